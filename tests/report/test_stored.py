"""Queries read optuna's tables straight (``stored.py``) and answer as the study read
through optuna does, on studies made by real searches: a confirmed time that reorders plans,
reused and cached trials (a plan's later trials), plans over the budget, plans screened out
(pruned), budgets nothing fits."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import sqlalchemy

import remat_search
from remat_search import RematPlan
from remat_search.errors import NoFeasiblePlan
from remat_search.measure.executables import Executables, measure
from remat_search.report.queries import list_studies
from remat_search.report.results import StudyReport, study_report
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig
from remat_search.report.stored import open_study
from remat_search.store import cache
from remat_search.store.reading import external_value

from tests.conftest import CHOICES, REPO, TINY_TRANSFORMER, spec_dict
from tests.factories import delayed


def _through_optuna(study: str, storage: str) -> StudyReport:
    return study_report(optuna.load_study(study_name=study, storage=storage))


SCREENED = {**TINY_TRANSFORMER, "layers": 3, "batch": 8, "seq_len": 64}
SCREENED_SPACE = {"layout": "per_layer", "choices": CHOICES}


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Four studies in one storage.

    ``reorder`` (uniform none/full/dots on a delayed MLP): no remat over the budget; the search
    timed full remat, the anchor, in a busy spell (+40 ms), so dots ranked first; re-timed
    with dots slowed instead, full remat ranks first. Its last two trials reuse earlier ones.
    ``again`` (uniform full/dots, same workload): every trial from ``reorder``'s measurements
    (cached), so a plan has several timed trials; its confirmation slows dots, whose later
    trials keep the fast search time, which only the plan's first trial may give.
    ``presets`` and ``screening``: only full remat fits, and the cost model screens plans out
    without compiling them (pruned trials, no values); what ``screening`` must hold is
    :func:`test_a_search_screens_out_far_over_plans_without_compiling`'s."""
    folder = tmp_path_factory.mktemp("stored")
    storage = f"sqlite:///{folder / 'studies.db'}"
    delays = folder / "delays.json"
    delays.write_text("{}")
    workload = delayed(str(delays))
    peaks = {p: measure(Executables(workload), RematPlan.uniform(p, 3), budget=1, timing=TimingConfig(),
                        gradient_tolerance=1e-4).peak_bytes for p in ("none", "full", "dots")}
    assert max(peaks["full"], peaks["dots"]) < peaks["none"]
    factory = {"factory": "tests.factories:delayed", "args": {"delays": str(delays)}}

    delays.write_text(json.dumps({"full×3": 40}))
    remat_search.run(parse_spec(spec_dict(
        storage, study="reorder", workload=factory, budget=peaks["none"] - 1, trials=5, confirm={"top": 0},
        space={"layout": "uniform", "choices": ["none", "full", "dots"]},
    )))
    delays.write_text(json.dumps({"dots×3": 40}))
    remat_search.confirm_study("reorder", top=2, rounds=3, presets=False, storage=storage)
    remat_search.run(parse_spec(spec_dict(
        storage, study="again", workload=factory, budget=peaks["none"] - 1, trials=6,
        space={"layout": "uniform", "choices": ["full", "dots"]}, confirm={"top": 2, "rounds": 3, "presets": False},
    )))

    presets = remat_search.run(parse_spec(spec_dict(
        storage, study="presets", workload=SCREENED, space=SCREENED_SPACE, trials=4, confirm={"top": 0},
    )))
    remat_search.run(parse_spec(spec_dict(
        storage, study="screening", workload=SCREENED, space=SCREENED_SPACE, trials=12, prescreen=1.2, confirm={"top": 0},
        budget=next(t.peak_bytes for t in presets.trials if t.labels[0] == "full") + 1,
        sampler={"kind": "random", "seed": 3},
    )))
    optuna.create_study(study_name="empty", storage=storage)
    return storage


def _budgets(report: StudyReport) -> list[int]:
    """Every peak of the study, a byte either side, none at all, and plenty."""
    peaks = {t.peak_bytes for t in report.trials if t.peak_bytes is not None}
    return sorted({1, 2**40, report.budget} | {p + d for p in peaks for d in (-1, 0, 1)})


def _answer(find, budget: int) -> object:  # type: ignore[no-untyped-def]
    try:
        return find(budget)
    except NoFeasiblePlan as e:
        return f"NoFeasiblePlan: {e}"


STUDIES = ["reorder", "again", "presets", "screening", "empty"]


def test_the_studies_have_what_the_queries_must_get_right(studies: str) -> None:
    reorder = _through_optuna("reorder", studies)
    by_search = min(reorder.timed(), key=lambda t: t.step_seconds)
    best = reorder.best(reorder.budget)
    assert best.time_source == "confirmed" and best.number != by_search.number  # confirmation reorders
    assert any(t.reused_from is not None for t in reorder.trials)
    assert any(t.status == "over_budget" for t in reorder.trials)

    again = _through_optuna("again", studies)
    dots = [t for t in again.trials if t.labels[0] == "dots" and t.status == "measured"]
    first, later = dots[0], dots[1:]
    assert later and all(t.reused_from is None and t.cached_from for t in later)  # timed trials of one plan
    assert first.seconds > max(t.seconds for t in later)  # the first is confirmed slower than they say

    screening = optuna.load_study(study_name="screening", storage=studies)
    assert any(t.state == optuna.trial.TrialState.PRUNED and t.values is None for t in screening.trials)


def test_a_search_screens_out_far_over_plans_without_compiling(studies: str, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """``screening``: under a budget only full remat fits, a random search records the plans its
    calibrated cost model predicts far over (``prescreen``) without compiling or caching them, as
    pruned trials with no objective values: no reader of the study's objectives takes the
    prediction for a measurement. They count towards the trials asked for. Each of them,
    compiled, is over the budget. (Moved from tests/search/test_planner.py, whose studies
    these are: the fixture's search serves both.)"""
    report = _through_optuna("screening", studies)
    screened = {t.plan.digest: t for t in report.trials if t.measurement.screened_bytes is not None}
    assert len(screened) >= 3, "nothing was screened out"
    assert all(t.status == "over_budget" and not t.measurement.compiled for t in screened.values())
    numbers = {t.number for t in screened.values()}
    study = optuna.load_study(study_name="screening", storage=studies)
    for number in numbers:
        assert study.trials[number].state == optuna.trial.TrialState.PRUNED and study.trials[number].values is None
    assert not numbers & {t.number for t in study.best_trials}
    assert not numbers & {t.number for t in remat_search.pareto_front("screening", studies)}
    assert len(report.trials) == 12  # pruned trials finish: the search stops at the 12 asked for
    assert next(s for s in list_studies(studies) if s.study == "screening").complete == 12
    with sqlalchemy.create_engine(studies).connect() as connection:
        cached = set(connection.execute(sqlalchemy.select(cache.measurements.c.plan)).scalars())
    assert not cached & screened.keys()
    shown = cli("show", "--study", "screening", "--trial", str(next(iter(screened.values())).number), "--storage", studies).stdout
    assert "screened out, never compiled" in shown
    plot = tmp_path / "front.png"
    plotted = cli("pareto", "--study", "screening", "--storage", studies, "--plot", str(plot))
    assert plotted.exit_code == 0 and plot.stat().st_size > 0
    # The same search without ``prescreen``, on a copy of the storage (the fixture's stays as the
    # other tests read it; its measurements cached): it compiles every plan, each screened one over.
    copy = tmp_path / "copy.db"
    with contextlib.closing(sqlite3.connect(studies.removeprefix("sqlite:///"))) as source, \
            contextlib.closing(sqlite3.connect(copy)) as target:
        source.backup(target)  # with what is still in the write-ahead log
    compiling = remat_search.run(parse_spec(spec_dict(
        f"sqlite:///{copy}", study="compiling", workload=SCREENED, space=SCREENED_SPACE, trials=12, budget=report.budget, prescreen=None,
        confirm={"top": 0}, sampler={"kind": "random", "seed": 3},
    )))
    compiled = {t.plan.digest: t for t in compiling.trials}
    assert screened.keys() <= compiled.keys()  # the same seed proposes the same plans
    for digest in screened:
        assert compiled[digest].measurement.compiled and compiled[digest].peak_bytes > report.budget


@pytest.mark.parametrize("name", STUDIES)
def test_best_is_what_the_report_read_through_optuna_says(studies: str, name: str) -> None:
    """For every budget that matters: the same trial, or the same NoFeasiblePlan message."""
    expected = _through_optuna(name, studies)
    with open_study(name, studies) as stored:
        for budget in _budgets(expected):
            assert _answer(stored.best, budget) == _answer(expected.best, budget), budget
            assert stored.untimed_within(budget) == expected.untimed_within(budget), budget
        assert stored.front() == list(expected.front)
        assert stored.report() == expected
        assert stored.trials() == list(expected.trials)
        for t in expected.trials:
            assert stored.trial(t.number) == t
        assert stored.trial(len(expected.trials)) is None
    assert remat_search.pareto_front(name, studies) == list(expected.front)
    assert remat_search.load_report(name, studies) == expected


def test_the_later_trials_of_a_plan_are_not_its_time(studies: str) -> None:
    """`again`: dots' first trial was confirmed slow; its later trials' fast search time is
    no answer (StudyReport.timed keeps each plan's first trial)."""
    expected = _through_optuna("again", studies)
    best = remat_search.best_plan("again", "1TiB", studies)
    assert best == expected.best(2**40) and best.labels[0] == "full"


def test_studies_are_counted_as_optuna_counts_them(studies: str) -> None:
    summaries = {s.study: s for s in list_studies(studies)}
    assert sorted(summaries) == sorted(STUDIES)
    for name in STUDIES:
        trials = optuna.load_study(study_name=name, storage=studies).trials
        states = [t.state.name for t in trials]
        report = _through_optuna(name, studies)
        s = summaries[name]
        assert (s.complete, s.failed, s.running) == (
            states.count("COMPLETE") + states.count("PRUNED"), states.count("FAIL"), states.count("RUNNING"))
        assert s.fastest_seconds == min((t.seconds for t in report.front), default=None)
        assert s.budget == report.budget


def test_a_missing_study_lists_those_there(studies: str) -> None:
    with pytest.raises(remat_search.StorageError, match=r"no study 'nope' in .*; studies there: \['again', 'empty'"):
        remat_search.best_plan("nope", "1GiB", studies)


def test_queries_write_nothing(studies: str) -> None:
    """A query cannot write: its SQLite connection is query-only."""
    with pytest.raises(remat_search.StorageError, match="readonly"), open_study("reorder", studies) as stored:
        stored.connection.rows("CREATE TABLE written (x INTEGER)")


def test_parameters_read_back_as_optuna_gives_them() -> None:
    distributions = [
        optuna.distributions.CategoricalDistribution(["none", "full", 3, None, True]),
        optuna.distributions.IntDistribution(0, 9),
        optuna.distributions.FloatDistribution(0.5, 2.0, log=True),
    ]
    for d in distributions:
        text = optuna.distributions.distribution_to_json(d)
        for value in ([0.0, 1.0, 2.0, 3.0, 4.0] if isinstance(d, optuna.distributions.CategoricalDistribution) else [1.0, 1.5]):
            assert external_value(value, text) == d.to_external_repr(value)
    abbreviated = json.dumps({"type": "categorical", "choices": ["a", "b"]})
    assert external_value(1.0, abbreviated) == "b"


QUERIES = [["--help"], ["studies"], ["best", "--study", "reorder", "--budget", "1GiB"],
           ["best", "--study", "reorder", "--budget", "1GiB", "--json"], ["pareto", "--study", "reorder"],
           ["pareto", "--study", "reorder", "--json"], ["show", "--study", "reorder"],
           ["show", "--study", "reorder", "--trial", "0"]]


@pytest.mark.parametrize("args", QUERIES, ids=lambda a: " ".join(a[:1] + a[3:]))
def test_queries_import_neither_jax_nor_optuna(studies: str, args: list[str]) -> None:
    """The queries read a SQLite file with the standard library's sqlite3 alone: importing
    JAX costs most of a second, optuna's storage half of one (its alembic schema check),
    SQLAlchemy a quarter."""
    storage = [] if args == ["--help"] else ["--storage", studies]
    code = (
        "import sys\nfrom remat_search.cli.app import main\n"
        f"sys.argv = ['remat-search', *{args + storage!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('imported:', sorted(m for m in ('jax', 'optuna', 'alembic', 'sqlalchemy') if m in sys.modules), "
        "file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("imported: []"), done.stderr
