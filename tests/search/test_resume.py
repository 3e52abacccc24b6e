"""Kill -9 a running search and run it again: it resumes and finishes, losing nothing."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import optuna
import sqlalchemy.exc
from optuna.trial import TrialState

from remat_search import StorageError
from remat_search.store.attributes import FAILURE_ATTR, INTERRUPTED, PID_ATTR, PLAN_ATTR
from remat_search.store.storage import open_storage

from tests.conftest import run_process, spec_dict, write_spec


def _trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    """The study's trials, read without writing (the search may be creating the tables)."""
    try:
        return optuna.load_study(study_name="tiny", storage=open_storage(storage)).trials
    except (KeyError, StorageError, optuna.exceptions.StorageInternalError, sqlalchemy.exc.OperationalError):
        return []


def test_kill_9_mid_trial_then_rerun_resumes_and_finishes(tmp_path: Path, storage_url: str) -> None:
    # Each compile sleeps 2 s (tests.factories.slow_compile), so the kill lands while a trial that
    # chose its plan is being measured (with the shared compilation cache, a tiny model's trial
    # is otherwise over in a blink, and CI saw the kill land between two trials).
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, trials=4, confirm={"top": 0}, space={"layout": "per_layer", "choices": ["none", "full", "dots"]},
        workload={"factory": "tests.factories:slow_compile", "args": {"seconds": 2.0}},
    ))
    search = run_process("run", str(spec))
    deadline = time.monotonic() + 300
    while True:  # wait until some trials are complete and one has chosen its plan and is being measured
        assert search.poll() is None, search.communicate()[0]
        assert time.monotonic() < deadline, "the search made no progress"
        trials = _trials(storage_url)
        states = [t.state for t in trials]
        measuring = [t for t in trials if t.state == TrialState.RUNNING and PLAN_ATTR in t.user_attrs]
        if states.count(TrialState.COMPLETE) >= 2 and measuring:
            break
        time.sleep(0.2)
    search.send_signal(signal.SIGKILL)
    search.communicate()  # reap it and close its pipe
    killed = _trials(storage_url)
    running = [t for t in killed if t.state == TrialState.RUNNING]
    complete_before = {t.number: t.values for t in killed if t.state == TrialState.COMPLETE}
    assert len(running) == 1 and len(complete_before) >= 2

    resumed = run_process("run", str(spec))
    log = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, log
    taken = running[0]  # the take-over is said, naming the trial and the process that died
    assert (
        f"note: trial {taken.number} of study 'tiny' was measured by process {taken.user_attrs[PID_ATTR]} of this "
        "host, which is gone: failed as interrupted, and its plan queued again"
    ) in log.splitlines(), log

    after = _trials(storage_url)
    states = [t.state for t in after]
    assert states.count(TrialState.COMPLETE) == 4
    assert TrialState.RUNNING not in states and TrialState.WAITING not in states
    for number, values in complete_before.items():  # no complete trial lost or changed
        assert after[number].state == TrialState.COMPLETE and after[number].values == values
    interrupted = after[running[0].number]
    assert interrupted.state == TrialState.FAIL and interrupted.user_attrs[FAILURE_ATTR] == INTERRUPTED
    assert interrupted.params  # it had chosen its plan, which was queued again and measured after the restart
    assert any(t.params == interrupted.params and t.state == TrialState.COMPLETE
               for t in after[interrupted.number + 1:])


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_rerun_with_another_budget_is_refused_before_any_work(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, home: Path
) -> None:
    """The study stored with 1 GiB; `run` with 2 GiB: one line, exit 2, no worker started, nothing
    traced or compiled, nothing written (no compilation cache, no artifacts, the database as it was)."""
    log = tmp_path / "compiles.log"
    spec = spec_dict(
        f"sqlite:///{home / 'studies.db'}", trials=2, space={"layout": "uniform", "choices": ["none", "full"]},
        workload={"factory": "tests.factories:counting", "args": {"log": str(log)}}, compilation_cache="jax-cache",
    )
    assert cli("submit", str(write_spec(tmp_path / "spec.yaml", spec))).exit_code == 0
    log.unlink(missing_ok=True)  # submit builds the workload (it traces nothing, but may say so)
    before = _files(home)
    result = cli("run", str(write_spec(tmp_path / "other.yaml", {**spec, "budget": "2GiB"})))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr == (
        "error: spec.budget: study 'tiny' already exists with another budget (1GiB); give this search a new "
        "study name\n"
    )
    assert not log.exists(), log.read_text()  # nothing traced, lowered or compiled, here or in a worker
    assert _files(home) == before  # no jax-cache/, no artifacts/, the database unchanged
