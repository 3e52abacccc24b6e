"""Where studies live: optuna's RDB storage (SQLite by default, PostgreSQL for several hosts).

This module is the one place that opens storage and translates SQLAlchemy and optuna
storage errors into :class:`StorageError`. SQLite databases run in WAL mode with a busy
timeout so that several processes can share one file. A trial's plan and measurement are
kept as JSON user attributes next to optuna's own values and constraints;
:func:`trial_result` reads them back as a :class:`TrialResult`.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict

from remat_search.errors import StorageError
from remat_search.measurement import Measurement, relative_spread
from remat_search.plan import RematPlan
from remat_search.spec import DEFAULT_STORAGE, STORAGE_ENV

SQLITE_BUSY_TIMEOUT_SECONDS = 60
CONNECT_TIMEOUT_SECONDS = 10
# Trial user attributes written by the search.
PLAN_ATTR, MEASUREMENT_ATTR, FAILURE_ATTR = "plan", "measurement", "failure"
HOST_ATTR, PID_ATTR, REUSED_ATTR = "host", "pid", "reused_from"
PREDICTION_ATTR, CACHED_ATTR = "prediction", "cached_from"
# Study user attributes.
LAYERS_ATTR = "layers"
LABELS_ATTR = "labels"
INTERRUPTED = "interrupted"

TrialStatus = Literal["measured", "over_budget", "failed", "interrupted", "running", "waiting"]


CONFIRMATION_ATTR = "confirmation"


class Confirmed(BaseModel):
    """One plan's re-timed steps, from one interleaved session."""

    model_config = ConfigDict(frozen=True)

    times: tuple[float, ...]
    rounds: int
    session: str
    """When the session ran (UTC, ISO 8601): plans confirmed together share it."""

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """(max − min) / median of the re-timed steps."""
        return relative_spread(self.times)


def load_confirmations(study: optuna.Study) -> dict[int, Confirmed]:
    """The confirmed times stored in ``study``, by trial number."""
    stored = study.user_attrs.get(CONFIRMATION_ATTR, {})
    return {int(number): Confirmed.model_validate(c) for number, c in stored.items()}


class TrialResult(BaseModel):
    """One trial of a study as reports show it."""

    model_config = ConfigDict(frozen=True)

    number: int
    status: TrialStatus
    plan: RematPlan | None = None
    labels: tuple[str, ...] = ()
    """The spec's choice label of each layer (what the sampler picked)."""
    measurement: Measurement | None = None
    reused_from: int | None = None
    cached_from: str | None = None
    """``study#trial`` whose measurement of the same plan (same workload and device) this reuses."""
    prediction: dict[str, float] | None = None
    """The planner's prediction (peak, seconds) when it proposed this plan."""
    confirmed: Confirmed | None = None
    error: str | None = None

    @property
    def peak_bytes(self) -> int | None:
        return self.measurement.peak_bytes if self.measurement else None

    @property
    def time_estimated(self) -> bool:
        """Its step time is a roofline estimate (a compile-only target), not a measurement."""
        return self.measurement is not None and self.measurement.time_source == "estimated"

    def summary(self) -> str:
        """The plan in a few words, by choice label: ``full×2 save_qkv×6``."""
        if self.plan is None:
            return "—"
        return self.plan.summary(self.labels if len(self.labels) == len(self.plan.layers) else None)

    @property
    def step_seconds(self) -> float | None:
        """Measured median step time, or the estimate where nothing ran."""
        return self.measurement.step_seconds if self.measurement else None



def resolve_url(url: str | None) -> str:
    """The storage URL to use: the one given, else ``$REMAT_SEARCH_STORAGE``, else the default."""
    return url or os.environ.get(STORAGE_ENV) or DEFAULT_STORAGE


def check_storage(url: str | None = None, *, create: bool = False) -> dict:
    """Check that ``url`` is reachable, writing nothing; return the engine options to open it.

    With ``create=False`` a missing SQLite file is an error (queries never create one).
    """
    url = resolve_url(url)
    shown = _shown(url)
    with translate_errors(url):
        parsed = sqlalchemy.engine.make_url(url)
        if parsed.get_backend_name() == "sqlite":
            _check_sqlite_path(parsed.database, shown, create=create)
            return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_SECONDS}}
        engine_kwargs: dict = {"pool_pre_ping": True}
        if parsed.get_backend_name() == "postgresql":
            engine_kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
        probe = sqlalchemy.create_engine(parsed, **engine_kwargs)
        try:
            with probe.connect():
                pass
        finally:
            probe.dispose()
        return engine_kwargs


def open_storage(url: str | None = None, *, create: bool = False) -> optuna.storages.RDBStorage:
    """Open the storage at ``url`` (see :func:`check_storage`).

    With ``create=True`` optuna's tables are made if missing and SQLite is put in WAL mode;
    without it nothing is written, so queries are safe on any database.
    """
    url = resolve_url(url)
    engine_kwargs = check_storage(url, create=create)
    with translate_errors(url):
        for attempt in range(3):
            try:
                storage = optuna.storages.RDBStorage(
                    url, engine_kwargs=engine_kwargs, skip_table_creation=not create
                )
                break
            except sqlalchemy.exc.IntegrityError:  # another process made the tables just now
                if attempt == 2:
                    raise
                time.sleep(0.5)
        if create and storage.engine.dialect.name == "sqlite":
            with storage.engine.connect() as connection:
                connection.exec_driver_sql("PRAGMA journal_mode=WAL")
        return storage


@contextlib.contextmanager
def translate_errors(url: str) -> Iterator[None]:
    """Turn SQLAlchemy and optuna storage failures into one-line :class:`StorageError`s."""
    shown = _shown(url)
    try:
        yield
    except StorageError:
        raise
    except sqlalchemy.exc.NoSuchModuleError as e:
        raise StorageError(
            f"storage: {shown!r} needs a database driver that is not installed ({e}); "
            "URLs name the database and driver as in postgresql+psycopg://user@host/db"
        ) from None
    except ModuleNotFoundError as e:
        missing = _missing_driver(url, e)
        if missing is None:  # not the driver: a bug, with its own traceback
            raise
        raise StorageError(f"storage: {shown!r} {missing}") from None
    except sqlalchemy.exc.ArgumentError:
        raise StorageError(
            f"storage: {shown!r} is not a database URL; expected e.g. "
            f"{DEFAULT_STORAGE} or postgresql://user@host/db"
        ) from None
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        raise StorageError(f"storage: cannot use {shown!r} ({reason})") from None


# SQLAlchemy's driver name → the module it imports and what `pip install` needs to install it.
_DRIVERS = {
    "psycopg": ("psycopg", '"psycopg[binary]"'),
    "psycopg_async": ("psycopg", '"psycopg[binary]"'),
    "psycopg2": ("psycopg2", "psycopg2-binary"),
    "pg8000": ("pg8000", "pg8000"),
    "asyncpg": ("asyncpg", "asyncpg"),
    "mysqldb": ("MySQLdb", "mysqlclient"),
    "pymysql": ("pymysql", "pymysql"),
    "mysqlconnector": ("mysql", "mysql-connector-python"),
    "mariadbconnector": ("mariadb", "mariadb"),
    "asyncmy": ("asyncmy", "asyncmy"),
    "aiomysql": ("aiomysql", "aiomysql"),
    "oracledb": ("oracledb", "oracledb"),
    "pyodbc": ("pyodbc", "pyodbc"),
    "pymssql": ("pymssql", "pymssql"),
}


def _missing_driver(url: str, error: ModuleNotFoundError) -> str | None:
    """What to install (or write) when ``error`` is the driver of ``url`` not being installed;
    None when it is another module. A bare ``postgresql://`` means SQLAlchemy's default driver
    (psycopg 3 since SQLAlchemy 2.1), so the command follows the URL as written."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
        driver, dialect = parsed.get_driver_name(), parsed.get_dialect()
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError):
        return None
    module, package = _DRIVERS.get(driver, (driver, driver))
    if (error.name or "").partition(".")[0] != module.partition(".")[0]:
        return None
    if getattr(dialect, "is_async", False):  # optuna's storage is synchronous
        backend = parsed.get_backend_name()
        sync = sqlalchemy.engine.make_url(f"{backend}://").get_driver_name()
        return (
            f"names {driver}, an asyncio driver, which optuna's storage cannot use; write "
            f"{backend}+{sync}:// and pip install {_DRIVERS.get(sync, (sync, sync))[1]}"
        )
    return f"needs the {driver} driver, which is not installed: pip install {package}"


def load_study(name: str, storage: optuna.storages.RDBStorage) -> optuna.Study:
    """The study ``name``; a missing one is a :class:`StorageError` listing those that exist."""
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        known = sorted(s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False))
        raise StorageError(
            f"study: no study {name!r} in {_shown(storage.url)!r}; studies there: {known or 'none'}"
        ) from None


def trial_result(trial: FrozenTrial, confirmed: Confirmed | None = None) -> TrialResult:
    """Read a trial's plan, measurement and outcome from what the search stored (and its
    confirmed times, which live on the study)."""
    attrs = trial.user_attrs
    plan = RematPlan.model_validate_json(attrs[PLAN_ATTR]) if PLAN_ATTR in attrs else None
    measurement = (
        Measurement.model_validate_json(attrs[MEASUREMENT_ATTR]) if MEASUREMENT_ATTR in attrs else None
    )
    if trial.state == TrialState.COMPLETE:
        status: TrialStatus = measurement.status if measurement else "measured"  # type: ignore[assignment]
    elif trial.state == TrialState.FAIL:
        status = "interrupted" if attrs.get(FAILURE_ATTR) == INTERRUPTED else "failed"
    elif trial.state == TrialState.WAITING:
        status = "waiting"
    else:
        status = "running"
    error = measurement.error if measurement and measurement.error else attrs.get(FAILURE_ATTR)
    return TrialResult(
        number=trial.number, status=status, plan=plan, measurement=measurement,
        labels=tuple(attrs.get(LABELS_ATTR, ())) or _param_labels(trial.params, plan),
        reused_from=attrs.get(REUSED_ATTR),
        cached_from=attrs.get(CACHED_ATTR), prediction=attrs.get(PREDICTION_ATTR), confirmed=confirmed,
        error=error,
    )


def _param_labels(params: dict[str, object], plan: RematPlan | None) -> tuple[str, ...]:
    """Per-layer labels of a trial stored before labels were (``policy`` or ``layer_NN`` params)."""
    if plan is None:
        return ()
    if "policy" in params:
        return (str(params["policy"]),) * len(plan.layers)
    layers = sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k.rpartition("_")[2]))
    return tuple(str(params[k]) for k in layers) if len(layers) == len(plan.layers) else ()


def _check_sqlite_path(database: str | None, shown: str, *, create: bool) -> None:
    if not database or database == ":memory:":
        raise StorageError(f"storage: {shown!r} is in memory; studies must persist: name a file")
    path = Path(database)
    if path.exists():
        if not path.is_file():
            raise StorageError(f"storage: {shown!r} points at {str(path)!r}, which is not a file")
        return
    if not create:
        raise StorageError(
            f"storage: no database at {str(path)!r} ({shown}); run a search first, or pass --storage"
        )
    if not path.parent.is_dir():
        raise StorageError(
            f"storage: directory {str(path.parent)!r} of {shown!r} does not exist; "
            "create it or pass --storage"
        )
    if not os.access(path.parent, os.W_OK):
        raise StorageError(f"storage: directory {str(path.parent)!r} of {shown!r} is not writable")


def _shown(url: str) -> str:
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:
        return url
