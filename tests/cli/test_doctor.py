"""``remat-search doctor`` on real SQLite files: healthy, with a stale trial, damaged, missing."""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from remat_search.cli import output
from remat_search.cli.app import app
from remat_search.cli.doctor import HEARTBEAT_GRACE_SECONDS, diagnose
from remat_search.store.attributes import HOST_ATTR, PID_ATTR, STARTED_ATTR

from tests.conftest import write_spec
from tests.search.test_fuzz import STUDY, base_spec


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A studies database a real search wrote (closed, WAL checkpointed)."""
    folder = tmp_path_factory.mktemp("doctor")
    db = folder / "studies.db"
    spec = write_spec(folder / "spec.yaml", {**base_spec(f"sqlite:///{db}"), "study": STUDY})
    result = CliRunner().invoke(app, ["run", str(spec)])
    assert result.exit_code == 0, result.stdout + result.stderr
    gc.collect()
    return db


@pytest.fixture
def db(searched: Path, tmp_path: Path) -> Path:
    """A copy of the searched database for one test to change."""
    return Path(shutil.copyfile(searched, tmp_path / "studies.db"))


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output.console, "width", 200)  # a row a line


def _doctor(db: Path, *args: str) -> Any:
    return CliRunner().invoke(app, ["doctor", "--storage", f"sqlite:///{db}", *args], catch_exceptions=False)


def _rows(result: Any) -> dict[str, str]:
    """The table's first line of each check: name → the rest of the row."""
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) >= 3 and cells[0] and cells[0] not in rows:
            rows[cells[0]] = " ".join(cells[1:])
    return rows


def _digest(db: Path) -> str:
    return hashlib.sha256(db.read_bytes()).hexdigest()


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _running_trial(db: Path, **attrs: Any) -> int:
    """Add a trial left RUNNING with ``attrs`` to the study, as a killed search leaves one."""
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{db}")
    trial = study.ask()
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    del study
    gc.collect()
    return trial.number


def test_a_healthy_study_passes_and_nothing_is_written(db: Path) -> None:
    before = _digest(db)
    result = _doctor(db)
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = _rows(result)
    assert set(rows) >= {"storage", "schema", "cache table", "integrity", "journal mode", "stale trials",
                         "backend", "device memory", "host memory"}, rows
    assert all(not row.startswith("fail") for row in rows.values()), rows
    assert "sqlite via pysqlite" in rows["storage"]
    assert f"as optuna {optuna.__version__} expects" in rows["schema"]
    assert "remat_search_measurements: 1 measurements" in rows["cache table"]
    assert rows["journal mode"] == "ok wal"
    assert "1 study: none running" in rows["stale trials"]
    assert "on cpu" in rows["backend"] and "no memory limit" in rows["device memory"]
    assert _digest(db) == before


def test_a_trial_of_a_dead_search_on_this_host_is_stale(db: Path) -> None:
    """host = this host, a pid that is gone: stale, exit 1, the fix named; the trial left as it was."""
    pid = _dead_pid()
    number = _running_trial(db, **{HOST_ATTR: socket.gethostname(), PID_ATTR: pid, STARTED_ATTR: 0.0})
    result = _doctor(db)
    assert result.exit_code == 1, result.stdout + result.stderr
    checks = {c.name: c for c in diagnose(f"sqlite:///{db}", backend=False)}
    stale = checks["stale trials"]
    assert stale.status == "fail" and f"{STUDY}#{number} (pid {pid} gone)" in stale.found
    assert "remat-search run SPEC" in stale.fix
    assert "stale trials" in result.stdout and "fail" in _rows(result)["stale trials"]
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{db}")
    assert study.trials[number].state == TrialState.RUNNING


def test_a_trial_of_a_live_search_is_not_stale(db: Path) -> None:
    import psutil

    me = psutil.Process()
    _running_trial(db, **{HOST_ATTR: socket.gethostname(), PID_ATTR: os.getpid(), STARTED_ATTR: me.create_time()})
    stale = {c.name: c for c in diagnose(f"sqlite:///{db}", STUDY, backend=False)}["stale trials"]
    assert stale.status == "ok" and f"study {STUDY!r}: 1 running, their searches alive" == stale.found


def test_another_hosts_trial_is_judged_by_its_heartbeat(db: Path) -> None:
    """No heartbeat: cannot be judged (warn); a heartbeat older than the grace period: stale."""
    number = _running_trial(db, **{HOST_ATTR: "elsewhere", PID_ATTR: 1, STARTED_ATTR: 0.0})
    stale = {c.name: c for c in diagnose(f"sqlite:///{db}", backend=False)}["stale trials"]
    assert stale.status == "warn" and f"{STUDY}#{number} on elsewhere" in stale.found
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(STUDY), number)
    storage.record_heartbeat(trial_id)
    storage.engine.dispose()
    stale = {c.name: c for c in diagnose(f"sqlite:///{db}", backend=False)}["stale trials"]
    assert stale.status == "ok", stale
    with sqlite3.connect(db) as connection:
        connection.execute(
            "UPDATE trial_heartbeats SET heartbeat = datetime(heartbeat, ?)", (f"-{2 * HEARTBEAT_GRACE_SECONDS} seconds",)
        )
    connection.close()
    stale = {c.name: c for c in diagnose(f"sqlite:///{db}", backend=False)}["stale trials"]
    assert stale.status == "fail" and f"{STUDY}#{number} on elsewhere (last heartbeat" in stale.found


def test_a_journal_mode_other_than_wal_is_a_warning(db: Path) -> None:
    with sqlite3.connect(db) as connection:
        connection.execute("PRAGMA journal_mode=DELETE")
    connection.close()
    journal = {c.name: c for c in diagnose(f"sqlite:///{db}", backend=False)}["journal mode"]
    assert journal.status == "warn" and journal.found.startswith("delete") and "journal_mode=WAL" in journal.fix


def test_a_damaged_file_fails_its_integrity_check_with_exit_1(db: Path) -> None:
    """A file whose pages past the first are overwritten: the integrity check fails, exit 1
    (the input named a file, and what is wrong with it is the diagnosis), the fix is named."""
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:] = bytes((i * 7 + 3) % 256 for i in range(len(data) - page))
    db.write_bytes(bytes(data))
    result = _doctor(db)
    assert result.exit_code == 1, result.stdout + result.stderr
    integrity = {c.name: c for c in diagnose(f"sqlite:///{db}", backend=False)}["integrity"]
    assert integrity.status == "fail" and ("malformed" in integrity.found or "problem" in integrity.found)
    assert integrity.fix


def test_a_file_that_is_no_database_fails_with_exit_1(tmp_path: Path) -> None:
    notes = tmp_path / "notes.db"
    notes.write_text("not a database\n" * 100)
    result = _doctor(notes)
    assert result.exit_code == 1, result.stdout + result.stderr
    integrity = {c.name: c for c in diagnose(f"sqlite:///{notes}", backend=False)}["integrity"]
    assert integrity.status == "fail" and "file is not a database" in integrity.found
    assert notes.read_text() == "not a database\n" * 100


def test_an_empty_database_is_no_studies_database(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    empty.touch()
    schema = {c.name: c for c in diagnose(f"sqlite:///{empty}", backend=False)}["schema"]
    assert schema.status == "fail" and "empty database" in schema.found
    assert empty.stat().st_size == 0


@pytest.mark.parametrize(("args", "line"), [
    (["--storage", "sqlite:////no/such/dir/studies.db"], "storage: no database at '/no/such/dir/studies.db'"),
    (["--storage", "not a url"], "is not a database URL"),
    (["--study", "bad name"], "--study: expected a study name"),
    (["--study", "nope"], "study: no study 'nope'"),
])
def test_bad_input_is_one_line_and_exit_2(searched: Path, args: list[str], line: str) -> None:
    if "--storage" not in args:
        args = [*args, "--storage", f"sqlite:///{searched}"]
    result = CliRunner().invoke(app, ["doctor", *args], catch_exceptions=False)
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and line in result.stderr
    assert not result.stdout


def test_help_states_the_exit_codes() -> None:
    result = CliRunner().invoke(app, ["doctor", "--help"], catch_exceptions=False)
    text = " ".join(result.stdout.split())
    assert "Exit codes: 0 when no check failed" in text and "1 when one failed" in text and "2 for bad input" in text
