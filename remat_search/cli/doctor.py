"""``remat-search doctor``: what is wrong with the storage, the backend or the device, and what to do.

:func:`diagnose` runs a list of :class:`Check`\\ s and writes nothing:

- **storage**: reachable, and with which driver (a server that does not answer fails here);
- **schema**: optuna's tables and the schema version (alembic's) this optuna expects, and our
  measurement cache table (``remat_search_measurements``);
- **integrity** and **journal mode** (SQLite): ``PRAGMA integrity_check``; WAL, which
  searches set so that several processes share the file;
- **stale trials**: running trials whose search is gone: on this host, by pid and the pid's
  start time (:func:`liveness.orphaned`, as a resumed search judges them); on other hosts, by
  optuna's heartbeat (``trial_heartbeats``) where one is recorded, else they cannot be judged;
- **backend**: JAX's platform and devices as a search's worker sees them (one is started on
  the smallest workload), and the plugins installed (libtpu, CUDA);
- **device memory** (per device, the worker's ``DeviceInfo.memory_limit``: a spec's default
  budget) and **host memory** (free RAM).

Input that names nothing to examine (a malformed URL, a SQLite file that does not exist, an
unknown study) raises, as every command does; a file that is no database, or a damaged one,
is a failed check.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Literal

import optuna
import psutil
import sqlalchemy
import sqlalchemy.exc
from optuna.trial import TrialState
from pydantic import BaseModel, ConfigDict

from remat_search.errors import StorageError
from remat_search.measure.device import installed_versions
from remat_search.measure.runner import Runner
from remat_search.spec.models import HeartbeatConfig
from remat_search.spec.workloads import MlpConfig
from remat_search.store.cache import measurements
from remat_search.store.liveness import orphaned
from remat_search.store.attributes import HOST_ATTR, PID_ATTR, host_name
from remat_search.store.storage import check_storage, load_study, resolve_url, translate_errors
from remat_search.targets.platform import is_cpu
from remat_search.units import format_bytes

Status = Literal["ok", "warn", "fail"]
HEARTBEAT_GRACE_SECONDS = HeartbeatConfig().grace
"""A running trial of another host whose last heartbeat is older than this is stale."""
LOW_HOST_MEMORY = 2**30
"""Free host memory below which the worker (it holds the workload and compiles) may run short."""
OPTUNA_TABLES = ("studies", "trials", "version_info", "alembic_version")
PROBE_WORKLOAD = MlpConfig(kind="mlp", layers=1, width=8, hidden=8, batch=1)
"""What the backend check's worker builds: the smallest workload there is."""
PLUGINS = ("libtpu", "libtpu-nightly", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm7-plugin")


class Check(BaseModel):
    """One thing the doctor looked at: what it found and, unless it is ok, what to do."""

    model_config = ConfigDict(frozen=True)

    name: str
    status: Status
    found: str
    fix: str = ""


def diagnose(storage: str | None = None, study: str | None = None, *, backend: bool = True) -> list[Check]:
    """Check the storage at ``storage`` (its studies, or only ``study``), and with ``backend``
    JAX's backend and the memory of the device and host. Writes nothing."""
    url = resolve_url(storage)
    checks = _storage_checks(url, study)
    if backend:
        checks += _backend_checks()
    return checks


def _storage_checks(url: str, study: str | None) -> list[Check]:
    parsed = sqlalchemy.engine.make_url(url) if _parses(url) else None
    try:
        engine_kwargs = check_storage(url)
    except StorageError as e:
        if parsed is None or parsed.get_backend_name() == "sqlite":
            raise  # a malformed URL, or a file that is not there: bad input
        return [Check(name="storage", status="fail", found=str(e).removeprefix("storage: "),
                      fix="start the database server, or correct the URL's host, port, user or password")]
    assert parsed is not None
    sqlite = parsed.get_backend_name() == "sqlite"
    where = str(Path(parsed.database).resolve()) if sqlite and parsed.database else parsed.render_as_string()
    size = f", {format_bytes(Path(where).stat().st_size)}" if sqlite else ""
    checks = [Check(name="storage", status="ok",
                    found=f"{parsed.get_backend_name()} via {parsed.get_driver_name()}: {where}{size}")]
    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        with engine.connect() as connection:
            tables = set(sqlalchemy.inspect(connection).get_table_names())
            schema = _schema_checks(connection, tables)
            if sqlite:
                schema += _sqlite_checks(connection, searched=measurements.name in tables)
    except sqlalchemy.exc.DatabaseError as e:
        reason = str(e.orig or e).strip().splitlines()[0]
        return [*checks, Check(
            name="integrity" if sqlite else "schema", status="fail", found=f"cannot read it: {reason}",
            fix=("the file is no SQLite database or is damaged: move it aside and restore a backup "
                 "(`remat-search run` starts a new one)") if sqlite else "check the database's server log",
        )]
    finally:
        engine.dispose()
    checks += schema
    if any(c.status == "fail" for c in schema):
        return checks
    try:  # the version tables are filled: optuna writes nothing as it opens
        rdb = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, skip_table_creation=True)
    except RuntimeError as e:  # optuna's "no longer compatible with the table schema"
        upgrade = "optuna storage upgrade" in str(e)
        checks[1] = Check(
            name="schema", status="fail", found=str(e).split(". ")[0],
            fix="back it up, then `optuna storage upgrade --storage URL`" if upgrade else
            "pip install -U optuna (a newer optuna made this database)",
        )
        return checks
    try:
        checks[1] = Check(name="schema", status="ok", found=(
            f"optuna schema {rdb.get_current_version()}, as optuna {optuna.__version__} expects"))
        return [*checks, _stale_check(rdb, study)]
    finally:
        rdb.engine.dispose()


def _parses(url: str) -> bool:
    try:
        sqlalchemy.engine.make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return False
    return True


def _schema_checks(connection: sqlalchemy.Connection, tables: set[str]) -> list[Check]:
    """optuna's tables and schema version; our cache table."""
    missing = [t for t in OPTUNA_TABLES if t not in tables]
    if missing:
        found = "no tables: an empty database" if not tables else f"optuna's tables {missing} missing"
        return [Check(name="schema", status="fail", found=found,
                      fix="not a studies database: check the URL, or `remat-search run SPEC --storage URL` makes one")]
    current = connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    versions = connection.exec_driver_sql("SELECT COUNT(*) FROM version_info").scalar()
    if current is None or not versions:
        return [Check(name="schema", status="fail", found="optuna's version tables are empty",
                      fix="the database was not made by optuna, or its setup was cut off: restore a backup")]
    schema = Check(name="schema", status="ok", found=f"optuna schema {current}")
    if measurements.name in tables:
        count = connection.execute(sqlalchemy.select(sqlalchemy.func.count()).select_from(measurements)).scalar()
        cache = Check(name="cache table", status="ok", found=f"{measurements.name}: {count} measurements")
    else:
        cache = Check(name="cache table", status="ok",
                      found=f"{measurements.name} absent: no search ran here yet (the first makes it)")
    return [schema, cache]


def _sqlite_checks(connection: sqlalchemy.Connection, *, searched: bool) -> list[Check]:
    problems = [row[0] for row in connection.exec_driver_sql("PRAGMA integrity_check")]
    if problems == ["ok"]:
        integrity = Check(name="integrity", status="ok", found="PRAGMA integrity_check: ok")
    else:
        integrity = Check(
            name="integrity", status="fail", found=f"{len(problems)} problem(s), first: {problems[0]}",
            fix="back it up, then `sqlite3 FILE .recover | sqlite3 NEW.db` and search with --storage sqlite:///NEW.db",
        )
    mode = str(connection.exec_driver_sql("PRAGMA journal_mode").scalar()).lower()
    if mode == "wal" or not searched:
        journal = Check(name="journal mode", status="ok", found=mode)
    else:
        journal = Check(name="journal mode", status="warn",
                        found=f"{mode}, not wal: searches sharing the file wait on each other",
                        fix="`sqlite3 FILE 'PRAGMA journal_mode=WAL'` with no search running (a search sets it too)")
    return [integrity, journal]


def _stale_check(storage: optuna.storages.RDBStorage, study: str | None) -> Check:
    """Running trials whose search is gone (this host: by pid; others: by heartbeat)."""
    with translate_errors(storage.url):
        names = [load_study(study, storage).study_name] if study else [
            s.study_name for s in storage.get_all_studies()
        ]
        beats = _heartbeats(storage.engine)
        stale: list[str] = []
        unjudged: list[str] = []
        alive = 0
        for name in names:
            study_id = storage.get_study_id_from_name(name)
            for trial in storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                where = f"{name}#{trial.number}"
                host = trial.user_attrs.get(HOST_ATTR)
                if host == host_name():
                    if orphaned(trial):
                        stale.append(f"{where} (pid {trial.user_attrs.get(PID_ATTR, '?')} gone)")
                    else:
                        alive += 1
                    continue
                age = beats.get(storage.get_trial_id_from_study_id_trial_number(study_id, trial.number))
                if age is None:
                    unjudged.append(f"{where} on {host}")
                elif age > HEARTBEAT_GRACE_SECONDS:
                    stale.append(f"{where} on {host} (last heartbeat {age:.0f} s ago)")
                else:
                    alive += 1
    scope = f"study {study!r}" if study else f"{len(names)} stud{'y' if len(names) == 1 else 'ies'}"
    if stale:
        return Check(
            name="stale trials", status="fail", found=f"{len(stale)} running with their search gone: " + ", ".join(stale[:5])
            + (f" and {len(stale) - 5} more" if len(stale) > 5 else ""),
            fix="run `remat-search run SPEC` again for each such study: it fails them and queues their plans again",
        )
    if unjudged:
        return Check(
            name="stale trials", status="warn",
            found=f"{len(unjudged)} running on other hosts record no heartbeat, so cannot be judged from here: "
            + ", ".join(unjudged[:5]),
            fix="check on those hosts that their searches still run; if not, run the spec again there",
        )
    return Check(name="stale trials", status="ok",
                 found=f"{scope}: " + (f"{alive} running, their searches alive" if alive else "none running"))


def _heartbeats(engine: sqlalchemy.Engine) -> dict[int, float]:
    """Seconds since each trial's last heartbeat (optuna's ``trial_heartbeats``), by trial id,
    by the database's own clock (which wrote them)."""
    with engine.connect() as connection:
        rows = connection.exec_driver_sql(
            "SELECT trial_id, MAX(heartbeat), CURRENT_TIMESTAMP FROM trial_heartbeats GROUP BY trial_id"
        ).all()
    return {int(trial_id): (_time(now) - _time(beat)).total_seconds() for trial_id, beat, now in rows}


def _time(value: object) -> datetime.datetime:
    if isinstance(value, datetime.datetime):
        return value.replace(tzinfo=None)
    return datetime.datetime.fromisoformat(str(value))


def _backend_checks() -> list[Check]:
    """JAX's backend and devices, the plugins installed, the device's and the host's memory."""
    plugins = installed_versions(PLUGINS)
    installed = f"; installed: {', '.join(plugins)}" if plugins else "; no TPU or GPU plugin installed"
    try:  # a worker as a search starts one, on the smallest workload: the backend a search gets
        with Runner(PROBE_WORKLOAD, timeout=60) as runner:
            device = runner.describe()
    except Exception as e:  # noqa: BLE001 - a backend that does not start is what this check reports
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [Check(name="backend", status="fail", found=f"the worker's JAX does not start: {reason}",
                      fix="reinstall JAX for this machine: pip install 'remat-search[cuda]' or '[tpu]', or plain for CPU")]
    found = (f"jax {device.jax_version} on {device.platform}: {device.device_count} × {device.device_kind}"
             f"{installed}")
    gpu_plugin = any(p.startswith(("jax-cuda", "jax-rocm")) for p in plugins)
    if is_cpu(device.platform) and gpu_plugin:
        backend = Check(name="backend", status="warn", found=found,
                        fix="a GPU plugin is installed but JAX found no GPU: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    else:
        backend = Check(name="backend", status="ok", found=found)
    if device.memory_limit is None:
        memory_check = Check(name="device memory", status="ok",
                             found=f"{device.platform} reports no memory limit: a spec for it needs a budget")
    else:
        memory_check = Check(name="device memory", status="ok",
                             found=f"{format_bytes(device.memory_limit)} usable per device (the default budget)")
    memory = psutil.virtual_memory()
    host_found = f"{format_bytes(memory.available)} free of {format_bytes(memory.total)}"
    host = Check(name="host memory", status="ok", found=host_found) if memory.available >= LOW_HOST_MEMORY else Check(
        name="host memory", status="warn", found=host_found,
        fix="free memory: the worker holds the workload and compiles in host memory",
    )
    return [backend, memory_check, host]
