"""Confirmation: re-time a study's fastest plans side by side before anyone trusts the order.

Step times on shared machines drift: a plan timed during a busy minute looks slower than
it is. Confirmation re-times the top plans that fit a budget, and the uniform presets that
fit, *interleaved* — A B C A B C … — so a slow spell slows them all alike, and ranks them by
those medians. The times are kept in the study (user attribute ``confirmation``, one entry
per trial) and :meth:`StudyReport.best` ranks by them where present. :func:`compare_times`
says, paired round by round, whether a difference stands out of the machine's noise.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Sequence

import optuna
from pydantic import BaseModel, ConfigDict

from remat_search.store import cache
from remat_search.errors import NoFeasiblePlan, RunError, SpecError
from remat_search.measure.executables import anchor_plan
from remat_search.plans.plan import RematPlan
from remat_search.report.queries import budget_bytes
from remat_search.report.stored import open_study
from remat_search.report.results import (
    Confirmed,
    Settlement,
    StudyReport,
    TrialResult,
    load_confirmations,
    rank,
    settlement,
    study_report,
)
from remat_search.measure.runner import Runner
from remat_search.spec.budget import Share, read_budget
from remat_search.spec.models import ConfirmConfig, HeartbeatConfig
from remat_search.store.attributes import ANCHOR_ATTR, CONFIRMATION_ATTR, SETTLED_ATTR
from remat_search.store.storage import load_study, open_storage, translate_errors
from remat_search.search.progress import Progress, ProgressCallback
from remat_search.search.runners import resolve_budget, runner_for
from remat_search.search.study import spec_of_study


class Comparison(BaseModel):
    """How much slower one plan is than another, from one interleaved session.

    Round ``i`` of both plans ran back to back, under the same machine mood, so the ratio of
    round ``i``'s times cancels what drifts between rounds; :attr:`ratio` is the median of
    those per-round ratios and ``low``…``high`` a distribution-free confidence interval for
    it (order statistics of the ratios) whose real :attr:`coverage` depends on the rounds.
    """

    model_config = ConfigDict(frozen=True)

    ratio: float
    low: float
    high: float
    coverage: float
    """The probability that ``low``…``high`` holds the true median ratio (rounds independent):
    at least :data:`CONFIDENCE` from 6 rounds on; 1 − 2^(1−n) below (0 at 1 round, 94% at 5)."""

    @property
    def resolved(self) -> bool:
        """Whether the interval excludes 1: the timing separates the two plans."""
        return self.low > 1 or self.high < 1


CONFIDENCE = 0.95


def interval_order(rounds: int, confidence: float = CONFIDENCE) -> tuple[int, float]:
    """``(k, coverage)`` of the interval ``[r_(k), r_(n+1-k)]`` of ``rounds`` sorted ratios: the
    largest ``k`` whose coverage, 1 − 2·P(Binomial(n, 1/2) ≤ k−1), is at least ``confidence``
    (``k = 1``, the whole range, when none is), and that coverage."""
    if rounds < 1:
        raise ValueError("compare_times needs at least one round")
    tail, k = 0.0, 1
    for j in range(rounds // 2):  # tail = P(Binomial(n, 1/2) <= j): how often r_(j+1) lies above the median
        tail += math.comb(rounds, j) / 2**rounds
        if tail > (1 - confidence) / 2:
            break
        k = j + 1
    below = sum(math.comb(rounds, j) for j in range(k)) / 2**rounds  # P(Binomial(n, 1/2) <= k - 1)
    return k, 1 - 2 * below


def compare_times(times: Sequence[float], reference: Sequence[float], confidence: float = CONFIDENCE) -> Comparison:
    """``times`` against ``reference``, paired round by round (see :class:`Comparison`).

    The interval is ``[r_(k), r_(n+1-k)]`` of the sorted ratios with ``k`` from
    :func:`interval_order`; with fewer than six rounds it is the whole range of the ratios,
    and its coverage, which the result states, is less than 95%.
    """
    ratios = sorted(a / b for a, b in zip(times, reference, strict=True))
    n = len(ratios)
    k, coverage = interval_order(n, confidence)
    return Comparison(ratio=statistics.median(ratios), low=ratios[k - 1], high=ratios[n - k], coverage=coverage)


def candidates(report: StudyReport, budget: int, top: int, *, presets: bool = True) -> list[TrialResult]:
    """The ``top`` fastest distinct plans that ran and fit ``budget``, by their search medians,
    then (with ``presets``) every other uniform plan that fits."""
    fitting = [
        t for t in report.timed()
        if not t.time_estimated and t.peak_bytes is not None and t.peak_bytes <= budget
    ]
    if not fitting:
        raise NoFeasiblePlan(f"budget: study {report.study!r} has no plan that ran and fits it")
    ranked = sorted(fitting, key=lambda t: (t.measurement.step_seconds, t.number))
    return ranked[:top] + [t for t in ranked[top:] if presets and _is_preset(t.plan)]


def _session_anchor(study: optuna.Study, report: StudyReport, budget: int) -> RematPlan | None:
    """The anchor plan to time in a confirmation session, where the study times against it
    (it has anchor seconds) and one of its trials shows the anchor fits ``budget``; else None,
    and the session's times stand alone."""
    if ANCHOR_ATTR not in study.user_attrs or not report.trials or report.trials[0].plan is None:
        return None
    anchor = anchor_plan(len(report.trials[0].plan.layers))
    fits = any(t.plan == anchor and t.peak_bytes is not None and t.peak_bytes <= budget for t in report.timed())
    return anchor if fits else None


def _is_preset(plan: RematPlan | None) -> bool:
    """One policy on every layer, checkpointed layer by layer: what people pick by hand."""
    return plan is not None and plan.layout == "flat" and plan.is_uniform


RACES = ConfirmConfig().races
"""How many times one confirmation races at most (``confirm.races``)."""


def confirm(
    study: optuna.Study, runner: Runner, *, storage: optuna.storages.RDBStorage, budget: int, top: int, rounds: int,
    warmup: int, presets: bool = True, races: int = RACES, heartbeat: HeartbeatConfig = HeartbeatConfig(),
    on_progress: ProgressCallback | None = None,
) -> StudyReport:
    """Confirm ``study`` at ``budget``: re-time its ``top`` fastest plans fitting ``budget``
    interleaved (with ``presets``, and every uniform plan that fits: see :func:`candidates`),
    then race: while the plan that ranks first (:func:`results.rank`) at this budget, or at a
    budget an earlier confirmation settled, was not re-timed in the session, re-time it with
    all the others in a new session, at most ``races`` times. Store and return the report.

    Why race: the fastest of many single noisy search times is biased low (the winner's curse),
    so re-timed plans tend to come back slower than the search saw them, and the next plan, by
    its one search time, would then be the answer without ever being re-timed. Only the latest
    session is kept, holding every plan an earlier one re-timed, so that the budgets settled
    before stay settled; the :class:`~remat_search.report.results.Settlement` records the budgets and
    those where ``races`` ran out first. A stored session that already settled ``budget`` with
    at least ``rounds`` rounds is kept as it is (re-running a finished search costs nothing).
    Fewer than two plans that fit: nothing to order, nothing re-timed.

    The searches and workers sharing the study confirm it once: the first to get here claims
    the confirmation in ``storage`` (:func:`cache.confirmation_claim`, alive by ``heartbeat``),
    and the others leave it to it. ``on_progress`` hears ``confirm`` before each session, then
    ``confirmed`` (with ``reused`` where nothing was re-timed, ``exhausted`` where the race
    budget ran out), or ``confirm_elsewhere`` (``holder``) where another process holds it.
    """
    tell = on_progress or (lambda _: None)
    with cache.confirmation_claim(
        storage.engine, study.study_name, interval=heartbeat.interval, grace=heartbeat.grace
    ) as holder:
        if holder is not None:
            tell(Progress(event="confirm_elsewhere", holder=holder))
            return study_report(study)
        return _race(study, runner, budget=budget, top=top, rounds=rounds, warmup=warmup, presets=presets,
                     races=races, tell=tell)


def _race(
    study: optuna.Study, runner: Runner, *, budget: int, top: int, rounds: int, warmup: int, presets: bool,
    races: int, tell: ProgressCallback,
) -> StudyReport:
    """:func:`confirm`, with the study's confirmation claimed."""
    report = study_report(study)
    chosen = candidates(report, budget, top, presets=presets)
    if len(chosen) < 2:
        return report  # nothing to order
    done = load_confirmations(study)
    before = settlement(study.user_attrs)
    budgets = sorted({*before.budgets, budget})
    numbers = {t.number for t in chosen}
    kept = [t for t in report.timed() if t.number in done and t.number not in numbers]  # the last session's others
    plans = [*chosen, *kept]
    sessions = {done[t.number].session for t in chosen if t.number in done}
    enough = all(t.number in done and done[t.number].rounds >= rounds for t in chosen)
    if budget in before.budgets and budget not in before.exhausted and len(sessions) == 1 and enough:
        stored = min(done[t.number].rounds for t in chosen)
        tell(Progress(event="confirmed", plans=len(done), rounds=stored, reused=True))
        return report
    largest = max(budgets)  # every plan re-timed ran in the search, within the study's budget
    anchor = _session_anchor(study, report, largest)
    for race in range(races + 1):
        tell(Progress(event="confirm", plans=len(plans), rounds=rounds, race=race))
        session = _retime(study, runner, plans, anchor, budget=largest, rounds=rounds, warmup=warmup)
        report = study_report(study)
        leaders = {b: leader for b in budgets if (leader := _leader(report, b)) is not None}
        unsettled = [b for b, leader in leaders.items() if leader.confirmed is None]
        if not unsettled:
            break
        if race == races:  # out of races: these budgets' answers were timed by the search only
            study.set_user_attr(
                SETTLED_ATTR, Settlement(budgets=tuple(budgets), exhausted=tuple(unsettled), session=session).model_dump()
            )
            tell(Progress(event="confirmed", plans=len(plans), rounds=rounds, race=race, exhausted=True))
            return study_report(study)
        plans += {leaders[b].number: leaders[b] for b in unsettled}.values()
    study.set_user_attr(SETTLED_ATTR, Settlement(budgets=tuple(budgets), session=session).model_dump())
    tell(Progress(event="confirmed", plans=len(plans), rounds=rounds, race=race))
    return study_report(study)


def _leader(report: StudyReport, budget: int) -> TrialResult | None:
    """The plan that ranks first at ``budget``, or None where no timed plan fits it."""
    try:
        return report.best(budget)
    except NoFeasiblePlan:
        return None


def _retime(
    study: optuna.Study, runner: Runner, chosen: list[TrialResult], anchor: RematPlan | None, *,
    budget: int, rounds: int, warmup: int,
) -> str:
    """Re-time ``chosen`` (and ``anchor``, where given) interleaved in one session and store it
    as the study's confirmation, replacing the one before; return the session's time stamp."""
    plans = [t.plan for t in chosen]
    if anchor is not None and anchor not in plans:
        plans.append(anchor)  # timed in the session, so the confirmed times are in the study's units
    times = runner.retime(plans, warmup=warmup, rounds=rounds, budget=budget)
    if len(times) != len(plans):
        raise RunError("confirm: the worker returned times for another number of plans")
    anchor_times = times[plans.index(anchor)] if anchor is not None else ()
    # Medians of one session compare; those of another, on a machine in another mood, do not:
    # the new session replaces the old.
    session = datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")
    study.set_user_attr(CONFIRMATION_ATTR, {
        str(t.number): Confirmed(times=seconds, rounds=rounds, session=session, anchor_times=anchor_times).model_dump()
        for t, seconds in zip(chosen, times[: len(chosen)], strict=True)
    })
    return session


def confirm_study(
    study_name: str, *, budget: int | str | Share | None = None, top: int = 3, rounds: int = 10, presets: bool = True,
    races: int = RACES, storage: str | None = None, on_progress: ProgressCallback | None = None,
) -> tuple[StudyReport, list[TrialResult]]:
    """Confirm ``study_name`` under ``budget`` (default: the study's) on this machine, as its
    last search measured it, racing as :func:`confirm` does; return the report and the plans
    of the session that fit ``budget``, fastest first by :func:`results.rank` (none when fewer
    than two plans fit). ``budget``: bytes, a size, a share of no remat's peak (``70%``) or
    ``device``, resolved against the study (:func:`~remat_search.report.queries.budget_bytes`).
    ``on_progress``: see :func:`confirm`."""
    if budget is not None:
        read_budget(budget, name="--budget")  # a malformed budget is told before the storage is opened
    opened = open_storage(storage)
    study = load_study(study_name, opened)
    with translate_errors(opened.url):
        spec = spec_of_study(study, opened.url)
    asked = spec.budget
    with open_study(study_name, opened.url) as stored:
        if stored.device.get("executes") is False:  # told before a worker loads the compiler
            raise _compile_only(study_name, stored.device.get("target"))
        if budget is not None:
            asked = budget_bytes(budget, stored, name="--budget")
    with runner_for(spec) as runner:
        device = runner.describe()
        if not device.executes:
            raise _compile_only(study_name, device.target)
        assert not isinstance(asked, Share)  # a study stores its budget in bytes
        limit = resolve_budget(asked, device)
        report = confirm(
            study, runner, storage=opened, budget=limit, top=top, rounds=rounds, warmup=spec.timing.warmup,
            presets=presets, races=races, heartbeat=spec.heartbeat, on_progress=on_progress,
        )
    confirmed = [t for t in report.timed() if t.confirmed and t.peak_bytes is not None and t.peak_bytes <= limit]
    if len(confirmed) < 2:
        return report, []
    return report, sorted(confirmed, key=rank)


def _compile_only(study_name: str, target: object) -> SpecError:
    return SpecError(
        f"study: {study_name!r} compiles for {target}, where nothing runs here; there are no step times to confirm"
    )
