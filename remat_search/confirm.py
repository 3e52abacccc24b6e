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

from remat_search.errors import NoFeasiblePlan, RunError, SpecError
from remat_search.executables import anchor_plan
from remat_search.plan import RematPlan
from remat_search.results import Confirmed, StudyReport, TrialResult, load_confirmations, study_report
from remat_search.runner import Runner
from remat_search.store import ANCHOR_ATTR, CONFIRMATION_ATTR, load_study, open_storage, translate_errors
from remat_search.study import Progress, ProgressCallback, resolve_budget, runner_for, spec_of_study


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


def confirm(
    study: optuna.Study, runner: Runner, *, budget: int, top: int, rounds: int, warmup: int, presets: bool = True,
    on_progress: ProgressCallback | None = None,
) -> StudyReport:
    """Re-time the ``top`` fastest plans fitting ``budget`` interleaved (with ``presets``, and
    every uniform plan that fits: see :func:`candidates`); store and return the report.

    Only the latest session is kept: its plans rank among themselves by these medians (see
    :meth:`StudyReport.best`). Plans already confirmed together with at least ``rounds``
    rounds are not re-timed (re-running a finished search costs nothing). Fewer than two
    plans that fit: nothing to order, nothing re-timed. ``on_progress`` hears ``confirm``
    before the re-timing and ``confirmed`` after it, or ``confirmed`` (reused) instead.
    """
    tell = on_progress or (lambda _: None)
    report = study_report(study)
    chosen = candidates(report, budget, top, presets=presets)
    if len(chosen) < 2:
        return report  # nothing to order
    done = load_confirmations(study)
    sessions = {done[t.number].session for t in chosen if t.number in done}
    if len(sessions) == 1 and all(t.number in done and done[t.number].rounds >= rounds for t in chosen):
        stored = min(done[t.number].rounds for t in chosen)
        tell(Progress(event="confirmed", plans=len(chosen), rounds=stored, reused=True))
        return report
    tell(Progress(event="confirm", plans=len(chosen), rounds=rounds))
    plans = [t.plan for t in chosen]
    anchor = _session_anchor(study, report, budget)
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
    tell(Progress(event="confirmed", plans=len(chosen), rounds=rounds))
    return study_report(study)


def confirm_study(
    study_name: str, *, budget: int | None = None, top: int = 3, rounds: int = 10, presets: bool = True,
    storage: str | None = None, on_progress: ProgressCallback | None = None,
) -> tuple[StudyReport, list[TrialResult]]:
    """Confirm ``study_name``'s ``top`` plans (and, with ``presets``, its uniform plans) under
    ``budget`` (default: the study's) on this machine, as its last search measured them;
    return the report and the plans of this session that fit, fastest first (none when
    fewer than two plans fit). ``on_progress``: see :func:`confirm`."""
    opened = open_storage(storage)
    study = load_study(study_name, opened)
    with translate_errors(opened.url):
        spec = spec_of_study(study, opened.url)
    with runner_for(spec) as runner:
        device = runner.describe()
        if not device.executes:
            raise SpecError(
                f"study: {study_name!r} compiles for {device.target}, where nothing runs here; "
                "there are no step times to confirm"
            )
        limit = resolve_budget(budget if budget is not None else spec.budget, device)
        report = confirm(
            study, runner, budget=limit, top=top, rounds=rounds, warmup=spec.timing.warmup, presets=presets,
            on_progress=on_progress,
        )
    chosen = {t.number for t in candidates(report, limit, top, presets=presets)}
    confirmed = [t for t in report.trials if t.number in chosen and t.confirmed]
    if len(confirmed) < 2:
        return report, []
    return report, sorted(confirmed, key=lambda t: (t.seconds, t.number))
