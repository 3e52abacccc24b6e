"""Where studies live by default: the same place from any working directory, named in full."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from remat_search.store.location import default_storage, storage_home

from tests.conftest import REPO, spec_dict, write_spec


def _cli(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "REMAT_SEARCH_HOME": str(home)}
    env.pop("REMAT_SEARCH_STORAGE", None)
    return subprocess.run(
        [sys.executable, "-m", "remat_search.cli.app", *args], cwd=cwd, env=env, text=True, capture_output=True, check=False,
        timeout=300,
    )


def test_the_default_home_is_the_checkouts_storage_folder(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("REMAT_SEARCH_HOME", raising=False)
    assert storage_home() == REPO / "storage"
    assert default_storage() == f"sqlite:///{REPO / 'storage' / 'studies.db'}"


def test_a_study_made_in_one_folder_is_found_from_another(tmp_path: Path) -> None:
    home, here, there = tmp_path / "home", tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    spec = spec_dict("unused", study="anywhere", trials=1, confirm={"top": 0},
                     workload={"kind": "mlp", "layers": 2, "width": 16, "hidden": 32, "batch": 8},
                     space={"layout": "uniform", "choices": ["full"]})
    del spec["storage"]  # the default
    made = _cli("run", str(write_spec(here / "spec.yaml", spec)), cwd=here, home=home)
    assert made.returncode == 0, made.stdout + made.stderr
    assert (home / "studies.db").is_file() and not list(here.glob("**/*.db"))

    listed = _cli("studies", cwd=there, home=home)
    assert listed.returncode == 0 and "anywhere" in listed.stdout, listed.stdout + listed.stderr
    missing = _cli("show", "--study", "elsewhere", cwd=there, home=home)
    assert missing.returncode == 2
    assert f"sqlite:///{home / 'studies.db'}" in missing.stderr  # the resolved path, in full


def test_a_relative_storage_url_is_shown_resolved(tmp_path: Path) -> None:
    result = _cli("studies", "--storage", "sqlite:///nowhere/studies.db", cwd=tmp_path, home=tmp_path / "home")
    assert result.returncode == 2
    assert str(tmp_path / "nowhere" / "studies.db") in result.stderr, result.stderr


def test_a_write_waits_for_another_processs_lock_instead_of_failing(tmp_path: Path) -> None:
    """README: SQLite runs with a 60 s busy timeout. A writer holding the lock for 6 s (longer
    than sqlite3's own 5 s default) delays a study's write; it does not fail it."""
    import sqlite3
    import threading

    import optuna

    from remat_search.store.storage import open_storage

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    study = optuna.create_study(storage=open_storage(url, create=True), study_name="locked")
    locker = sqlite3.connect(tmp_path / "studies.db", isolation_level=None, check_same_thread=False)
    locker.execute("BEGIN IMMEDIATE")  # the write lock, as another process's transaction holds it
    release = threading.Timer(6.0, lambda: locker.execute("COMMIT"))
    release.start()
    try:
        study.set_user_attr("written", True)
    finally:
        release.join()
        locker.close()
    assert optuna.load_study(study_name="locked", storage=url).user_attrs == {"written": True}


def test_a_storage_home_that_cannot_be_made_is_bad_input(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    spec = spec_dict("unused", trials=1, workload={"kind": "mlp", "layers": 2, "width": 16, "hidden": 32, "batch": 8},
                     space={"layout": "uniform", "choices": ["full"]})
    del spec["storage"]
    result = _cli("run", str(write_spec(tmp_path / "spec.yaml", spec)), cwd=tmp_path, home=a_file / "home")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "REMAT_SEARCH_HOME" in result.stderr and "is not a writable directory" in result.stderr
    assert result.stderr.count("\n") == 1 and not list(tmp_path.glob("**/*.db"))


def _open_at_once(url: str, barrier: Any) -> None:
    barrier.wait()
    from remat_search.store.storage import open_storage

    open_storage(url, create=True)


def test_searches_that_start_at_once_on_a_new_database_all_open_it(tmp_path: Path) -> None:
    """Each makes optuna's tables if missing: all but the first find them made a moment ago
    (SQLite: "table studies already exists"), and open the database all the same."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    for attempt in range(3):
        url = f"sqlite:///{tmp_path / f'race-{attempt}.db'}"
        barrier = context.Barrier(4)
        processes = [context.Process(target=_open_at_once, args=(url, barrier)) for _ in range(4)]
        for p in processes:
            p.start()
        for p in processes:
            p.join(120)
        assert [p.exitcode for p in processes] == [0] * 4
