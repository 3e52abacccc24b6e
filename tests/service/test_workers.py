"""Several workers on one study: in one search (``--workers N``), and several searches by hand
on one SQLite file. A study ends with exactly its trials whatever runs it, no plan is measured
twice at once, and plans of one host never hold its device together."""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from remat_search.store import cache
from remat_search.errors import StorageError
from remat_search.store.liveness import counts
from remat_search.report.results import trial_result
from remat_search.search.loop import run
from remat_search.spec.loading import parse_spec
from remat_search.store.attributes import HOST_ATTR, PID_ATTR, PLAN_ATTR
from remat_search.store.storage import open_storage

from tests.conftest import FAST_TIMING, run_process, spec_dict, write_spec

pytestmark = pytest.mark.slow  # several worker processes on one storage

SLOW = {"factory": "tests.factories:slow_compile", "args": {"seconds": 1.0}}
MLP_SPACE = {"layout": "per_layer", "choices": ["none", "full", "dots"]}


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _trials(storage_url: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=storage_url).get_trials(deepcopy=False)


def test_two_workers_compile_at_once_run_one_at_a_time_and_end_with_exactly_the_trials(storage_url: str) -> None:
    spec = parse_spec(spec_dict(
        storage_url, workload=SLOW, space=MLP_SPACE, trials=7, workers=2, budget="1GiB",
        sampler={"kind": "random", "seed": 1}, confirm={"top": 0},
    ))
    report = run(spec)
    trials = _trials(storage_url, spec.study)
    assert sum(counts(t) for t in trials) == 7
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    measured = [m for t in report.trials if (m := t.measurement) and t.reused_from is None and t.cached_from is None]
    compiles = [m.compiled_at for m in measured if m.compiled_at]
    runs = [m.ran_at for m in measured if m.ran_at]
    assert len(runs) >= 4, "the plans that fit ran"
    # Two compiles were in flight at once (each takes over 1 s: the trace sleeps)...
    assert any(_overlap(a, b) for a, b in itertools.combinations(compiles, 2)), compiles
    # ...but no two plans ever held the device together.
    assert not [(a, b) for a, b in itertools.combinations(runs, 2) if _overlap(a, b)]
    # Every worker's process measured: trials carry this host and pid, two workers' plans.
    assert {t.user_attrs[HOST_ATTR] for t in trials if HOST_ATTR in t.user_attrs}


def test_searches_started_by_hand_on_one_sqlite_file_share_the_work(tmp_path: Path, storage_url: str) -> None:
    """Two `run` processes of two workers each (four workers) on one study: the totals are
    exact, no plan is measured twice at once, and SQLite never says it is locked."""
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, workload=SLOW, space=MLP_SPACE, trials=9, workers=2,
        sampler={"kind": "tpe", "seed": 3}, timing=FAST_TIMING, confirm={"top": 0},
    ))
    searches = [run_process("run", str(spec)) for _ in range(2)]
    logs = [s.communicate(timeout=600)[0] for s in searches]
    for search, log in zip(searches, logs, strict=True):
        assert search.returncode == 0, log
        assert "locked" not in log, log
    trials = _trials(storage_url, "tiny")
    assert sum(counts(t) for t in trials) == 9
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert {t.user_attrs[PID_ATTR] for t in trials if PID_ATTR in t.user_attrs} == {s.pid for s in searches}
    # No plan was measured twice at once: two measurements of one plan (a repeat that another
    # process had claimed is reused, not measured) never overlap.
    busy: dict[str, list[tuple[float, float]]] = {}
    for t in trials:
        result = trial_result(t)
        m = result.measurement
        if m is None or result.reused_from is not None or result.cached_from is not None or not m.compiled_at:
            continue
        busy.setdefault(m.plan_digest, []).append((m.compiled_at[0], (m.ran_at or m.compiled_at)[1]))
    for digest, spans in busy.items():
        assert not [(a, b) for a, b in itertools.combinations(spans, 2) if _overlap(a, b)], digest
    with open_storage(storage_url).engine.connect() as connection:  # every claim was given back
        assert connection.execute(cache.claims.select()).first() is None
    with sqlite3.connect(storage_url.removeprefix("sqlite:///")) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_trial_of_a_dead_host_is_waited_for_then_failed_by_its_heartbeat_and_its_plan_measured_again(
    storage_url: str,
) -> None:
    """A trial running on another host (its process id means nothing here) holds its place in
    the study while its heartbeat beats; when the beats stop, a search fails it after the grace
    period and measures its plan again. The study ends with exactly its trials."""
    beat = {"interval": 1, "grace": 3}
    first = parse_spec(spec_dict(
        storage_url, workload={"kind": "mlp", "layers": 2, "width": 32, "hidden": 64, "batch": 16},
        space={"layout": "uniform", "choices": ["none", "full", "dots"]}, trials=2, heartbeat=beat,
        sampler={"kind": "random", "seed": 0}, confirm={"top": 0},
    ))
    run(first)
    storage = open_storage(storage_url)
    study = optuna.load_study(study_name=first.study, storage=storage)
    foreign = study.ask()  # the third preset, taken by a search on another host
    assert foreign.params == {} and study.get_trials(deepcopy=False)[foreign.number].state == TrialState.RUNNING
    foreign.suggest_categorical("policy", ["none", "full", "dots"])
    foreign.set_user_attr(HOST_ATTR, "another-host")
    foreign.set_user_attr(PID_ATTR, 1)
    storage.record_heartbeat(foreign._trial_id)
    died: list[float] = []

    def other_host() -> None:  # beats for a few seconds, then its host dies
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            storage.record_heartbeat(foreign._trial_id)
            last = time.monotonic()
            time.sleep(0.5)
        died.append(last)

    beater = threading.Thread(target=other_host)
    beater.start()
    report = run(first.model_copy(update={"trials": 4}))
    ended = time.monotonic()
    beater.join()
    assert ended > died[0] + beat["grace"], "the search ended before the other host's trial went stale"
    trials = _trials(storage_url, first.study)
    assert sum(counts(t) for t in trials) == 4
    assert trials[foreign.number].state == TrialState.FAIL
    assert report.trials[foreign.number].status == "interrupted"
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    # Its plan was queued again and measured.
    lost = foreign.params
    assert [t for t in trials if t.number > foreign.number and t.params == lost and PLAN_ATTR in t.user_attrs]


def test_workers_auto_is_one_per_two_cores_within_memory_and_bad_counts_are_one_line_errors(
    cli, tmp_path: Path, storage_url: str,  # type: ignore[no-untyped-def]
) -> None:
    import os

    import psutil

    from remat_search.search.runners import CORES_PER_WORKER, WORKER_HOST_MEMORY, resolve_workers

    assert resolve_workers(3) == 3
    auto = resolve_workers("auto")
    assert auto == max(1, min(len(os.sched_getaffinity(0)) // CORES_PER_WORKER,
                              psutil.virtual_memory().available // WORKER_HOST_MEMORY))
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(storage_url))
    for bad in ("0", "-1", "two", "1.5"):
        result = cli("run", str(spec), "--workers", bad)
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error: --workers: expected a positive number") and result.stderr.count("\n") == 1
    for field, value, said in (
        ("workers", 0, "spec.workers"), ("heartbeat", {"interval": 5, "grace": 5}, "spec.heartbeat"),
    ):
        result = cli("run", str(write_spec(tmp_path / "bad.yaml", spec_dict(storage_url, **{field: value}))))
        assert result.exit_code == 2 and result.stderr.startswith(f"error: {said}"), result.stderr
    assert not (tmp_path / "studies.db").exists()


def test_a_search_goes_on_when_another_search_finishes_its_trial_first(storage_url: str) -> None:
    """Another search may fail a trial this one is measuring (judged dead while its heartbeat
    was late, or popped from the queue at the same moment): this search drops that trial and
    goes on to finish the study with exactly its trials."""
    spec = parse_spec(spec_dict(
        storage_url, workload=SLOW, space={"layout": "uniform", "choices": ["none", "full", "dots"]},
        trials=3, sampler={"kind": "random", "seed": 0}, confirm={"top": 0},
    ))
    reports: list[object] = []
    search = threading.Thread(target=lambda: reports.append(run(spec)))
    search.start()
    deadline = time.monotonic() + 300
    db = Path(storage_url.removeprefix("sqlite:///"))
    while not db.exists():
        assert search.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    while True:  # the search is making optuna's tables: open once they are there
        try:
            storage = open_storage(storage_url)
            break
        except StorageError:
            assert search.is_alive() and time.monotonic() < deadline
            time.sleep(0.1)
    while True:  # the first trial is being measured (its compile sleeps 1 s)
        assert search.is_alive() and time.monotonic() < deadline
        studies = optuna.get_all_study_summaries(storage, include_best_trial=False)
        running = _trials(storage_url, "tiny") if studies else []
        running = [t for t in running if t.state == TrialState.RUNNING and PLAN_ATTR in t.user_attrs]
        if running:
            break
        time.sleep(0.05)
    study_id = storage.get_study_id_from_name("tiny")
    storage.set_trial_state_values(
        storage.get_trial_id_from_study_id_trial_number(study_id, running[0].number), state=TrialState.FAIL
    )
    search.join(timeout=600)
    assert reports, "the search raised"
    trials = _trials(storage_url, "tiny")
    assert sum(counts(t) for t in trials) == 3
    assert trials[running[0].number].state == TrialState.FAIL
