"""`submit` stores a study and measures nothing; `worker` measures whatever was submitted,
logs a JSON line a trial, leaves alone what its host cannot measure, and on SIGTERM puts the
trial in hand back."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from remat_search import submit
from remat_search.spec.loading import parse_spec
from remat_search.search.opening import METRIC_NAMES
from remat_search.search.study import spec_of_submitted
from tests.conftest import FAST_TIMING, run_process, spec_dict, write_spec

SMALL = {"trials": 3, "space": {"layout": "uniform", "choices": ["none", "full", "dots"]}, "confirm": {"top": 0}}


def _study(url: str, name: str = "tiny") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=url)


def test_submit_is_the_function_whatever_was_imported_before() -> None:
    import remat_search
    import remat_search.search.submission  # the module that defines submit: importing it must not shadow it

    assert remat_search.submit is submit and callable(remat_search.submit)


def test_submit_stores_the_study_and_measures_nothing(cli, tmp_path: Path, storage_url: str) -> None:  # type: ignore[no-untyped-def]
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(storage_url, **SMALL))
    result = cli("submit", str(spec))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.stdout == f"submitted study 'tiny' (0/3 trials) to {storage_url}\n"
    study = _study(storage_url)
    assert [t.state for t in study.get_trials()] == [TrialState.WAITING] * 3  # the presets, queued
    assert study.metric_names == list(METRIC_NAMES)
    assert spec_of_submitted(study, storage_url).model_dump() == parse_spec(spec_dict(storage_url, **SMALL)).model_dump()

    again = cli("submit", str(spec))
    assert again.exit_code == 0 and again.stdout == f"study 'tiny' was already submitted (0/3 trials) to {storage_url}\n"
    assert len(study.get_trials()) == 3  # the presets queued once


def test_submit_refuses_another_study_of_the_name_and_writes_nothing(cli, tmp_path: Path, storage_url: str) -> None:  # type: ignore[no-untyped-def]
    assert cli("submit", str(write_spec(tmp_path / "a.yaml", spec_dict(storage_url, **SMALL)))).exit_code == 0
    db = Path(storage_url.removeprefix("sqlite:///"))
    before = db.read_bytes()
    other = {**SMALL, "space": {"layout": "uniform", "choices": ["none", "full"]}}
    result = cli("submit", str(write_spec(tmp_path / "b.yaml", spec_dict(storage_url, **other))))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "spec.space: study 'tiny' already exists with another space" in result.stderr
    assert db.read_bytes() == before


def test_submit_with_a_bad_workload_writes_nothing(cli, tmp_path: Path, storage_url: str) -> None:  # type: ignore[no-untyped-def]
    spec = spec_dict(storage_url, **SMALL, workload={"factory": "tests.factories:failing_factory"})
    result = cli("submit", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "workload" in result.stderr
    assert not Path(storage_url.removeprefix("sqlite:///")).exists()


def test_a_worker_measures_what_was_submitted_and_logs_a_line_a_trial(tmp_path: Path, storage_url: str) -> None:
    done = submit(parse_spec(spec_dict(storage_url, **SMALL)))
    assert done.created and (done.done, done.total) == (0, 3)
    worker = run_process("worker", "--storage", storage_url, "--until-idle", stderr=subprocess.PIPE)
    stdout, stderr = worker.communicate(timeout=600)
    assert worker.returncode == 0, stdout + stderr
    events = [json.loads(line) for line in stdout.splitlines()]
    trials = [e for e in events if e["event"] == "trial"]
    assert [(e["study"], e["trial"], e["plan"], e["status"]) for e in trials] == [
        ("tiny", 0, "none×2", "measured"), ("tiny", 1, "full×2", "measured"), ("tiny", 2, "dots×2", "measured"),
    ]
    assert [e["done"] for e in trials] == [1, 2, 3] and all(e["peak_bytes"] > 0 and e["seconds"] > 0 for e in trials)
    assert events[0] == {"event": "study", "study": "tiny", "done": 0, "total": 3}
    study = _study(storage_url)
    peaks = {t.number: int(t.values[1]) for t in study.get_trials(states=(TrialState.COMPLETE,))}
    assert peaks == {e["trial"]: e["peak_bytes"] for e in trials}


def test_a_worker_leaves_alone_a_study_its_host_cannot_measure(tmp_path: Path, storage_url: str) -> None:
    submit(parse_spec(spec_dict(storage_url, **SMALL, budget=None)))  # a CPU reports no memory to default to
    worker = run_process("worker", "--storage", storage_url, "--until-idle", stderr=subprocess.PIPE)
    stdout, stderr = worker.communicate(timeout=300)
    assert worker.returncode == 0, stdout + stderr
    events = [json.loads(line) for line in stdout.splitlines()]
    assert [e["event"] for e in events] == ["study", "left"]
    assert events[1]["reason"].startswith("spec.budget: required here: cpu reports no memory limit")
    assert len(_study(storage_url).get_trials(states=(TrialState.WAITING,))) == 3  # left for another worker


def test_sigterm_puts_the_trial_in_hand_back_and_exits_0(tmp_path: Path, storage_url: str) -> None:
    started = tmp_path / "hanging"
    submit(parse_spec(spec_dict(
        storage_url, trials=2, space={"layout": "uniform", "choices": ["none", "full"]}, confirm={"top": 0},
        workload={"factory": "tests.factories:hanging", "args": {"started": str(started)}},
        timing={**FAST_TIMING, "timeout": "300s"},
    )))
    worker = run_process("worker", "--storage", storage_url, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not started.exists():  # a trial's step is running (and hangs)
        assert worker.poll() is None, worker.communicate()
        assert time.monotonic() < deadline, "no step ran"
        time.sleep(0.2)
    worker.send_signal(signal.SIGTERM)
    stdout, stderr = worker.communicate(timeout=120)
    assert worker.returncode == 0, stdout + stderr
    assert stderr.splitlines() == [
        "worker: stopped by SIGTERM; trial 0 of 'tiny' (none×3): failed as interrupted, its plan queued again "
        + "for any worker"
    ], stderr
    trials = _study(storage_url).get_trials()
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs["failure"] == "interrupted"
    waiting = [t.user_attrs["queued_params"] for t in trials if t.state == TrialState.WAITING]
    assert trials[0].params in waiting


def test_a_study_whose_last_trial_died_with_its_worker_is_finished_by_another(storage_url: str) -> None:
    """Finished plus running trials reach ``trials``, but the running one is dead: a worker
    looking for work takes it back (by pid here; by heartbeat from another host)."""
    submit(parse_spec(spec_dict(  # each compile takes 1 s: the kill lands while trial 1 compiles
        storage_url, **{**SMALL, "trials": 2, "space": {"layout": "uniform", "choices": ["none", "dots"]}},
        workload={"factory": "tests.factories:slow_compile", "args": {"seconds": 1.0}},  # (full: the anchor, compiled)
    )))
    first = run_process("worker", "--storage", storage_url, stderr=subprocess.DEVNULL)
    assert first.stdout is not None
    assert json.loads(first.stdout.readline())["event"] == "study"
    assert json.loads(first.stdout.readline())["trial"] == 0
    deadline = time.monotonic() + 300
    while not [t for t in _study(storage_url).get_trials(states=(TrialState.RUNNING,)) if "plan" in t.user_attrs]:
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    first.kill()
    first.communicate()
    study = _study(storage_url)
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE, TrialState.RUNNING]

    second = run_process("worker", "--storage", storage_url, "--until-idle", stderr=subprocess.PIPE)
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stdout + stderr
    assert [json.loads(line)["plan"] for line in stdout.splitlines() if '"trial"' in line] == ["dots×3"]
    states = [t.state for t in _study(storage_url).get_trials()]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]  # the dead one failed, its plan redone


def test_a_new_empty_database_lists_no_studies_and_a_worker_finds_no_work_in_it(tmp_path: Path) -> None:
    """A service's first start: the database exists, with no tables yet."""
    db = tmp_path / "empty.db"
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE scratch (a)")
        connection.execute("DROP TABLE scratch")
    url = f"sqlite:///{db}"
    studies = run_process("studies", "--storage", url, stderr=subprocess.PIPE)
    stdout, stderr = studies.communicate(timeout=120)
    assert studies.returncode == 0 and stderr == "", stderr
    assert stdout.split("┡")[1].split("\n")[1].startswith("└")  # the table's rows: none
    worker = run_process("worker", "--storage", url, "--until-idle", stderr=subprocess.PIPE)
    stdout, stderr = worker.communicate(timeout=120)
    assert worker.returncode == 0 and stdout == "", stdout + stderr


def test_a_factory_beside_the_spec_imports_in_the_search_and_its_worker(tmp_path: Path) -> None:
    """`run` from another folder: the spec's folder is on the import path of the search and of
    the worker process it spawns; a module found nowhere is one line naming where it looked."""
    (tmp_path / "beside_the_spec.py").write_text(
        "from remat_search.workloads.mlp import MlpWorkload\nfrom remat_search.spec.workloads import MlpConfig\n\n\n"
        "def make():\n    return MlpWorkload(MlpConfig(kind='mlp', layers=2, width=16, hidden=32, batch=4))\n"
    )
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        url, workload={"factory": "beside_the_spec:make"}, trials=1, confirm={"top": 0},
        space={"layout": "uniform", "choices": ["full"]},
    ))
    search = run_process("run", str(spec), stderr=subprocess.PIPE)  # in the repository's folder, not tmp_path
    stdout, stderr = search.communicate(timeout=300)
    assert search.returncode == 0, stdout + stderr
    assert [t.state for t in _study(url).get_trials()] == [TrialState.COMPLETE]

    missing = write_spec(tmp_path / "missing.yaml", spec_dict(  # a study of its own: "tiny" has another workload
        url, study="missing", workload={"factory": "found_nowhere:make"},
    ))
    search = run_process("run", str(missing), stderr=subprocess.PIPE)
    stdout, stderr = search.communicate(timeout=300)
    assert search.returncode == 2 and stderr.count("\n") == 1, stderr
    assert "workload.factory: 'found_nowhere:make' does not import: no module 'found_nowhere' on the import path" in stderr


def test_bad_worker_and_submit_input_is_one_line_and_writes_nothing(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for args, said in [
        (("worker", "--storage", "notaurl", "--until-idle"), "error: storage: 'notaurl' is not a database URL"),
        (("worker", "--storage", f"sqlite:///{tmp_path}/no/such/dir.db", "--until-idle"), "error: storage: directory"),
        (("worker", "--workers", "0", "--until-idle"), "error: --workers: expected a positive number"),
        (("submit", str(tmp_path / "missing.yaml")), "error: spec: cannot read"),
    ]:
        result = cli(*args)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith(said), result.stderr
    assert list(tmp_path.iterdir()) == []
