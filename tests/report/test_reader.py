"""The one reader of studies (``report.stored``), on SQLite and on PostgreSQL, against optuna's
own reading of the same studies as the oracle.

Two studies in one storage, written through optuna's API as a search writes them: measured
trials, a plan over the budget, failed and interrupted trials, a plan screened out (pruned), a
later trial of a plan already timed, a running and a queued trial, confirmed times that
reorder plans and a settled budget. Every answer of the reader (trials, report, front, best at
every budget, plans untimed within a budget, confirmations, settlement, counts, parameters)
must be what ``optuna.load_study(...).get_trials()`` turned into results says.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from remat_search.errors import NoFeasiblePlan
from remat_search.measure.measurement import Measurement, MemoryBreakdown
from remat_search.plans.plan import RematPlan
from remat_search.report.queries import list_studies
from remat_search.report.results import StudyReport, load_confirmations, settlement, study_report
from remat_search.report.stored import StoredStudy, open_study
from remat_search.store.attributes import (
    CONFIRMATION_ATTR,
    FAILURE_ATTR,
    INTERRUPTED,
    LABELS_ATTR,
    MEASUREMENT_ATTR,
    PLAN_ATTR,
    QUEUED_ATTR,
    SETTLED_ATTR,
)

BUDGET = 100
CHOICES = ("none", "full", "dots", "dots_no_batch")
DISTRIBUTION = {"policy": CategoricalDistribution(CHOICES)}


def _attrs(policy: str, status: str, peak: int | None = None, seconds: float | None = None, **extra: object) -> dict:
    plan = RematPlan.uniform(policy, 3)
    m = Measurement(
        status=status, plan_digest=plan.digest,  # type: ignore[arg-type]
        memory=None if peak is None else MemoryBreakdown(argument=0, output=0, alias=0, temp=peak, generated_code=0),
        time_source="measured" if seconds is not None else None, step_times=() if seconds is None else (seconds,),
        **extra,  # type: ignore[arg-type]
    )
    return {PLAN_ATTR: plan.to_json(), LABELS_ATTR: [policy] * 3, MEASUREMENT_ATTR: m.model_dump_json()}


def _add(study: optuna.Study, policy: str, state: TrialState, attrs: dict, values: list[float] | None = None) -> None:
    study.add_trial(create_trial(
        state=state, values=values, params={"policy": policy}, distributions=DISTRIBUTION, user_attrs=attrs,
    ))


def _measured(study: optuna.Study, policy: str, peak: int, seconds: float) -> None:
    _add(study, policy, TrialState.COMPLETE, _attrs(policy, "measured", peak, seconds), [seconds, float(peak)])


def _write(storage: str) -> None:
    """Studies ``alpha`` (every kind of trial) and ``beta`` (a few measured ones) in ``storage``."""
    alpha = optuna.create_study(study_name="alpha", storage=storage, directions=["minimize", "minimize"])
    alpha.set_user_attr("budget", BUDGET)
    alpha.set_user_attr("device_info", {"platform": "cpu", "device_kind": "cpu"})
    _add(alpha, "none", TrialState.COMPLETE, _attrs("none", "over_budget", 150), [float("inf"), 150.0])  # 0
    _measured(alpha, "full", 60, 1.5)  # 1: confirmed at 0.9 below, which makes it the fastest
    _measured(alpha, "dots", 80, 1.2)  # 2
    _measured(alpha, "dots_no_batch", 95, 1.1)  # 3
    _add(alpha, "none", TrialState.FAIL, {**_attrs("none", "failed", error="boom"), FAILURE_ATTR: "boom"})  # 4
    _add(alpha, "full", TrialState.FAIL, {FAILURE_ATTR: INTERRUPTED})  # 5: its process died
    _add(alpha, "none", TrialState.PRUNED, _attrs("none", "over_budget", screened_bytes=140))  # 6: screened out
    _measured(alpha, "dots", 80, 0.8)  # 7: a later trial of trial 2's plan: not its time
    alpha.ask()  # 8: running
    alpha.enqueue_trial({"policy": "dots_no_batch"}, user_attrs={QUEUED_ATTR: {"policy": "dots_no_batch"}})  # 9
    alpha.set_user_attr(CONFIRMATION_ATTR, {"1": {"times": [0.9, 0.9, 1.0], "rounds": 3, "session": "s1"}})
    alpha.set_user_attr(SETTLED_ATTR, {"budgets": [BUDGET], "exhausted": [], "session": "s1"})

    beta = optuna.create_study(study_name="beta", storage=storage, directions=["minimize", "minimize"])
    beta.set_user_attr("budget", 70)
    _measured(beta, "full", 50, 2.0)
    _measured(beta, "dots", 65, 1.0)
    _add(beta, "none", TrialState.COMPLETE, _attrs("none", "over_budget", 120), [float("inf"), 120.0])


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def storage(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The two studies, in a SQLite file or a PostgreSQL database (which, under CI, must start)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('reader') / 'studies.db'}"
    else:
        from tests.conftest import create_database

        url = create_database(request.getfixturevalue("postgres_server"), "t_reader")
    _write(url)
    yield url


STUDIES = ("alpha", "beta")


def _oracle(name: str, storage: str) -> tuple[optuna.Study, StudyReport]:
    study = optuna.load_study(study_name=name, storage=storage)
    return study, study_report(study)


def _answer(find, budget: int) -> object:  # type: ignore[no-untyped-def]
    try:
        return find(budget)
    except NoFeasiblePlan as e:
        return str(e)


def _budgets(report: StudyReport) -> list[int]:
    peaks = sorted({t.peak_bytes for t in report.trials if t.peak_bytes is not None})
    return sorted({0, *peaks, *(p - 1 for p in peaks), *(p + 1 for p in peaks), 10**12})


def test_the_studies_hold_every_kind_of_trial(storage: str) -> None:
    _, report = _oracle("alpha", storage)
    statuses = {t.status for t in report.trials}
    assert statuses == {"measured", "over_budget", "failed", "interrupted", "running", "waiting"}
    assert report.trials[1].confirmed is not None and report.trials[6].measurement.screened_bytes == 140  # type: ignore[union-attr]
    assert [t.number for t in report.front] == [1] and report.best(BUDGET).number == 1


@pytest.mark.parametrize("name", STUDIES)
def test_the_reader_reads_every_trial_as_optuna_does(storage: str, name: str) -> None:
    study, expected = _oracle(name, storage)
    with open_study(name, storage) as stored:
        assert stored.trials() == list(expected.trials)
        assert stored.report() == expected
        assert [stored.trial(t.number) for t in expected.trials] == list(expected.trials)
        assert stored.trial(len(expected.trials)) is None
        assert stored.params() == {t.number: t.params for t in study.trials}
        assert stored.params(state="COMPLETE") == {t.number: t.params for t in study.trials if t.state == TrialState.COMPLETE}
        assert stored.params(numbers=[1]) == {1: study.trials[1].params}
        for plan in {t.plan for t in expected.trials if t.plan is not None}:  # alpha: plans of 1–3 trials
            assert stored.with_plan(plan.to_json()) == [t for t in expected.trials if t.plan == plan]
        assert stored.with_plan(RematPlan.uniform("none", 4).to_json()) == []


@pytest.mark.parametrize("name", STUDIES)
def test_the_front_and_best_at_every_budget_are_optunas(storage: str, name: str) -> None:
    _, expected = _oracle(name, storage)
    with open_study(name, storage) as stored:
        assert stored.front() == list(expected.front)
        assert stored.fastest() == (min(expected.front, key=lambda t: t.seconds) if expected.front else None)
        for budget in _budgets(expected):
            assert _answer(stored.best, budget) == _answer(expected.best, budget), budget
            assert stored.untimed_within(budget) == expected.untimed_within(budget), budget


@pytest.mark.parametrize("name", STUDIES)
def test_confirmations_settlement_and_counts_are_optunas(storage: str, name: str) -> None:
    study, _ = _oracle(name, storage)
    with open_study(name, storage) as stored:
        assert stored.attrs == study.user_attrs
        assert stored.confirmed == load_confirmations(study)
        assert stored.settlement() == settlement(study.user_attrs)
        assert stored.count() == dict(collections.Counter(t.state.name for t in study.trials))
    summary = next(s for s in list_studies(storage) if s.study == name)
    states = collections.Counter(t.state for t in study.trials)
    assert (summary.complete, summary.failed, summary.running) == (
        states[TrialState.COMPLETE] + states[TrialState.PRUNED], states[TrialState.FAIL], states[TrialState.RUNNING]
    )
    counted = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
        t.state == TrialState.FAIL and t.user_attrs.get(FAILURE_ATTR) not in (None, INTERRUPTED))]
    assert summary.done == len(counted)


def test_two_studies_in_one_storage_are_read_apart(storage: str) -> None:
    assert [s.study for s in list_studies(storage)] == ["alpha", "beta"]
    with open_study("beta", storage) as stored:
        assert isinstance(stored, StoredStudy) and stored.budget == 70 and stored.confirmed == {}
        assert [t.number for t in stored.trials()] == [0, 1, 2] and stored.best(70).number == 1
