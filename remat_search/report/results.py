"""A study's trials read back as results: each trial's plan, measurement, outcome and
confirmed times (:class:`TrialResult`), and the study as a whole (:class:`StudyReport`).

The models and the rules that turn what the search stored into them (:func:`result_of`,
:func:`make_report`, :func:`rank`, :func:`pareto`). The one reader of a stored study is
:mod:`report.stored`, which builds them from optuna's tables; :func:`study_report` builds them
from an open ``optuna.Study``, for the search that holds one while it writes (its own report
at the end, confirmation, the planner's sampler) and for the tests, as the oracle the reader
is held to.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from remat_search.errors import NoFeasiblePlan
from remat_search.measure.measurement import Measurement, relative_spread
from remat_search.plans.configuration import cost as cost_of
from remat_search.plans.plan import RematPlan
from remat_search.store.attributes import (
    CACHED_ATTR,
    CONFIRMATION_ATTR,
    FAILURE_ATTR,
    INTERRUPTED,
    LABELS_ATTR,
    MEASUREMENT_ATTR,
    MOVED,
    MOVED_TO_ATTR,
    PLAN_ATTR,
    PREDICTION_ATTR,
    REUSED_ATTR,
    SAME_PROGRAM_ATTR,
    SETTLED_ATTR,
    TrialStatus,
)
from remat_search.units import format_bytes

if TYPE_CHECKING:  # optuna only where a caller has it open: readers read the tables (stored.py)
    import optuna
    from optuna.trial import FrozenTrial


class Confirmed(BaseModel):
    """One plan's re-timed steps, from one interleaved session."""

    model_config = ConfigDict(frozen=True)

    times: tuple[float, ...]
    rounds: int
    session: str
    """When the session ran (UTC, ISO 8601): plans confirmed together share it."""
    anchor_times: tuple[float, ...] = ()
    """The anchor plan's step in each round of the session, where the study times against
    the anchor (``timing.anchor``): the plan's per-round ratio to it states the confirmed time
    in the study's anchor seconds, like every search time of the study."""

    @property
    def median(self) -> float:
        """The median of the re-timed steps, in this session's seconds."""
        return statistics.median(self.times)

    @property
    def ratios(self) -> tuple[float, ...]:
        """Each round's time over the anchor's in that round (empty if the session had none)."""
        return tuple(t / a for t, a in zip(self.times, self.anchor_times, strict=True)) if self.anchor_times else ()

    @property
    def anchor_ratio(self) -> float | None:
        """The median of :attr:`ratios` (None if the session had no anchor)."""
        return statistics.median(self.ratios) if self.anchor_times else None

    @property
    def spread(self) -> float:
        """(max − min) / median of the re-timed steps."""
        return relative_spread(self.times)


def load_confirmations(study: optuna.Study) -> dict[int, Confirmed]:
    """The confirmed times stored in ``study``, by trial number."""
    return confirmations(study.user_attrs)


def confirmations(study_attrs: Mapping[str, Any]) -> dict[int, Confirmed]:
    """The confirmed times among a study's user attributes, by trial number."""
    stored = study_attrs.get(CONFIRMATION_ATTR, {})
    return {int(number): Confirmed.model_validate(c) for number, c in stored.items()}


class Settlement(BaseModel):
    """What the latest confirmation settled (see ``confirm.confirm``).

    ``budgets``: the budgets whose fastest plan it raced until that plan was re-timed in the
    session (the study's budget, and any ``confirm --budget``); ``exhausted``: those of them
    where its race budget (``confirm.races``) ran out first, so their answer is a plan timed
    only by the search."""

    model_config = ConfigDict(frozen=True)

    budgets: tuple[int, ...] = ()
    exhausted: tuple[int, ...] = ()
    session: str = ""


def settlement(study_attrs: Mapping[str, Any]) -> Settlement:
    """The latest confirmation's settlement among a study's user attributes (empty if none)."""
    return Settlement.model_validate(study_attrs.get(SETTLED_ATTR, {}))


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
    same_program_as: str | None = None
    """``study#trial`` whose plan compiled to the same program as this one's (same workload and
    device): its measurement stands for this one, compiled here but not run."""
    prediction: dict[str, float] | None = None
    """The planner's prediction (peak, seconds) when it proposed this plan."""
    confirmed: Confirmed | None = None
    error: str | None = None

    @property
    def peak_bytes(self) -> int | None:
        return self.measurement.peak_bytes if self.measurement else None

    @property
    def time_estimated(self) -> bool:
        """It fits, and its step time is an estimate (a compile-only target), not a
        measurement. (A compile-only target estimates plans over the budget too.)"""
        m = self.measurement
        return m is not None and m.status == "measured" and m.time_source == "estimated"

    def summary(self) -> str:
        """The plan in a few words, by choice label: ``full×2 save_qkv×6``."""
        if self.plan is None:
            return "—"
        return self.plan.summary(self.labels if len(self.labels) == len(self.plan.layers) else None)

    @property
    def step_seconds(self) -> float | None:
        """The search's step time of the plan (its anchored median, or the estimate where
        nothing ran): what the trial's optuna objective holds."""
        return self.measurement.step_seconds if self.measurement else None

    @property
    def confirmed_seconds(self) -> float | None:
        """The confirmed step time in the study's units, where it compares with the search's
        times: the median ratio to the anchor in the study's anchor seconds, or, in a study
        that does not time against the anchor, the confirmed median; else None."""
        c, m = self.confirmed, self.measurement
        if c is None or m is None:
            return None
        if c.anchor_ratio is not None and m.anchor_seconds:
            return c.anchor_ratio * m.anchor_seconds
        return c.median if not m.anchor_seconds and not c.anchor_times else None

    @property
    def seconds(self) -> float | None:
        """The plan's one step time, in every command and picture: confirmed where it was
        re-timed (:attr:`confirmed_seconds`), else the search's (:attr:`step_seconds`)."""
        confirmed = self.confirmed_seconds
        return confirmed if confirmed is not None else self.step_seconds

    @property
    def cost(self) -> float | None:
        """What plans are ranked by (:func:`rank`, the front): :attr:`seconds`, per token each
        device trains on where the plan carries a configuration (:func:`configuration.cost`)."""
        seconds = self.seconds
        if seconds is None or self.plan is None:
            return seconds
        return cost_of(seconds, self.plan.configuration)

    @property
    def throughput(self) -> float | None:
        """Tokens (examples, for a workload without sequences) per second per device, where the
        plan carries a configuration; else None."""
        if self.seconds is None or self.plan is None or self.plan.configuration is None:
            return None
        return self.plan.configuration.tokens_per_device / self.seconds

    @property
    def time_source(self) -> Literal["confirmed", "search", "estimated"] | None:
        """Where :attr:`seconds` comes from."""
        if self.confirmed_seconds is not None:
            return "confirmed"
        if self.step_seconds is None:
            return None
        return "estimated" if self.time_estimated else "search"



def trial_result(trial: FrozenTrial, confirmed: Confirmed | None = None) -> TrialResult:
    """Read a trial's plan, measurement and outcome from what the search stored (and its
    confirmed times, which live on the study)."""
    return result_of(trial.number, trial.state.name, trial.user_attrs, trial.params, confirmed)


def result_of(
    number: int, state: str, attrs: Mapping[str, Any], params: Mapping[str, object], confirmed: Confirmed | None = None
) -> TrialResult:
    """A trial's result from what optuna keeps of it: its number, its state's name
    (``COMPLETE``, ``PRUNED``, ``FAIL``, ``WAITING``, ``RUNNING``), its user attributes and its
    parameters (read only by trials stored before labels were: see :func:`_param_labels`)."""
    plan = RematPlan.model_validate_json(attrs[PLAN_ATTR]) if PLAN_ATTR in attrs else None
    measurement = (
        Measurement.model_validate_json(attrs[MEASUREMENT_ATTR]) if MEASUREMENT_ATTR in attrs else None
    )
    if state in ("COMPLETE", "PRUNED"):  # pruned: screened out, over budget
        status: TrialStatus = measurement.status if measurement else "measured"  # type: ignore[assignment]
    elif state == "FAIL":
        # Failed by the runner, with its reason; else its process stopped or died (see liveness.py).
        reason = attrs.get(FAILURE_ATTR)
        status = "moved" if reason == MOVED else "failed" if reason not in (None, INTERRUPTED) else "interrupted"
    elif state == "WAITING":
        status = "waiting"
    else:
        status = "running"
    error = measurement.error if measurement and measurement.error else attrs.get(FAILURE_ATTR)
    if status == "moved":
        error = f"the workload refused its configuration: queued again at {attrs.get(MOVED_TO_ATTR)}"
    return TrialResult(
        number=number, status=status, plan=plan, measurement=measurement,
        labels=tuple(attrs.get(LABELS_ATTR, ())) or _param_labels(params, plan),
        reused_from=attrs.get(REUSED_ATTR),
        cached_from=attrs.get(CACHED_ATTR), same_program_as=attrs.get(SAME_PROGRAM_ATTR), prediction=attrs.get(PREDICTION_ATTR), confirmed=confirmed,
        error=error,
    )


def needs_params(attrs: Mapping[str, Any]) -> bool:
    """Whether :func:`result_of` reads the trial's parameters (its labels are not stored)."""
    return not attrs.get(LABELS_ATTR) and PLAN_ATTR in attrs


def _param_labels(params: Mapping[str, object], plan: RematPlan | None) -> tuple[str, ...]:
    """Per-layer labels of a trial stored before labels were (``policy`` or ``layer_NN`` params)."""
    if plan is None:
        return ()
    if "policy" in params:
        return (str(params["policy"]),) * len(plan.layers)
    layers = sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k.rpartition("_")[2]))
    return tuple(str(params[k]) for k in layers) if len(layers) == len(plan.layers) else ()


class StudyReport(BaseModel):
    """A study's trials and front, with what they were measured on."""

    model_config = ConfigDict(frozen=True)

    study: str
    budget: int
    device: dict[str, Any]
    trials: tuple[TrialResult, ...]
    front: tuple[TrialResult, ...]

    def count(self, status: str) -> int:
        return sum(1 for t in self.trials if t.status == status)

    def timed(self) -> list[TrialResult]:
        """Trials that fit and have a step time (measured, or estimated on compile-only
        targets), each plan once (its first trial)."""
        seen: set[str] = set()
        out = []
        for t in self.trials:
            new = t.measurement is not None and t.measurement.plan_digest not in seen
            if t.status == "measured" and t.reused_from is None and new:
                seen.add(t.measurement.plan_digest)
                out.append(t)
        return out

    def best(self, budget: int) -> TrialResult:
        """The fastest timed plan whose peak fits ``budget``, by :func:`rank`; else
        :class:`NoFeasiblePlan`. It is the fastest plan of :attr:`front` that fits."""
        fitting = [t for t in self.timed() if t.peak_bytes is not None and t.peak_bytes <= budget]
        if fitting:
            return min(fitting, key=rank)
        peaks = [t for t in self.trials if t.peak_bytes is not None and t.measurement and t.measurement.compiled]
        if not peaks:
            raise NoFeasiblePlan(f"budget: study {self.study!r} has no measured plan yet")
        smallest = min(peaks, key=lambda t: t.peak_bytes)  # type: ignore[arg-type, return-value]
        assert smallest.plan is not None and smallest.peak_bytes is not None
        raise NoFeasiblePlan(
            f"budget: no measured plan of study {self.study!r} fits {format_bytes(budget)}; the "
            f"smallest peak measured is {format_bytes(smallest.peak_bytes)} "
            f"(trial {smallest.number}: {smallest.summary()})"
        )

    def untimed_within(self, budget: int) -> list[TrialResult]:
        """Plans whose compiled peak fits ``budget`` but were not timed: they exceeded the
        study's own budget. (A screened-out plan's peak is a prediction: not counted.)"""
        return [
            t for t in self.trials
            if t.status == "over_budget" and t.reused_from is None and t.measurement is not None
            and t.measurement.compiled and t.peak_bytes is not None and t.peak_bytes <= budget
        ]


def study_report(study: optuna.Study) -> StudyReport:
    """The report of a study the caller holds open in optuna (a search while it writes; the
    tests' oracle): what :meth:`report.stored.StoredStudy.report` reads from the tables."""
    confirmed = load_confirmations(study)
    trials = [trial_result(t, confirmed.get(t.number)) for t in study.get_trials(deepcopy=False)]
    return make_report(study.study_name, study.user_attrs, trials)


def make_report(study: str, study_attrs: Mapping[str, Any], trials: Iterable[TrialResult]) -> StudyReport:
    """The report of study ``study`` from its user attributes and its trials' results, in
    trial order."""
    report = StudyReport(
        study=study,
        budget=int(study_attrs.get("budget", 0)),
        device=study_attrs.get("device_info", {}),
        trials=tuple(trials),
        front=(),
    )
    return report.model_copy(update={"front": tuple(pareto(report.timed()))})


def rank(t: TrialResult) -> tuple[float, int, int]:
    """The one order of timed plans, which every reader of a study ranks by (``best``, the
    front's fastest, ``studies``, the page, the plot's star): each plan's one time
    (:attr:`TrialResult.seconds`; per token, :attr:`TrialResult.cost`, in a study of
    configurations), then its peak, then its trial number.

    A plan's one time is its confirmed time where the latest confirmation re-timed it, else the
    search's: the two are mixed in this order, in the study's anchor seconds, and every answer
    says which it is (:attr:`TrialResult.time_source`). Where a confirmation settled a budget
    (:class:`Settlement`), it re-timed plans until the first in this order was a re-timed one,
    so the answer there is confirmed unless its race budget ran out, which is said too."""
    return (t.cost, t.peak_bytes, t.number)  # type: ignore[return-value]


class Point(Protocol):
    """What the front is judged by: a plan's peak, its one time (per token, in a study of
    configurations: :attr:`TrialResult.cost`) and its trial number."""

    @property
    def number(self) -> int: ...
    @property
    def peak_bytes(self) -> int | float | None: ...
    @property
    def cost(self) -> float | None: ...


P = TypeVar("P", bound=Point)


def pareto(trials: Sequence[P]) -> list[P]:
    """The plans no other plan beats in both peak and step time (each by its one time,
    :attr:`TrialResult.seconds`, per token in a study of configurations), least memory first. Only plans that ran or were estimated
    within the study's budget take part: never a screened-out or over-budget one."""
    front: list[P] = []
    for t in sorted(trials, key=lambda t: (t.peak_bytes, t.cost, t.number)):
        if not front or t.cost < front[-1].cost:  # type: ignore[operator]
            front.append(t)
    return front


