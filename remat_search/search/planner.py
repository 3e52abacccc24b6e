"""The planner: a per-layer cost model fitted to a study's measurements, solved for its Pareto front.

Every measured plan teaches the model what each choice costs at each position. Peak
memory and step time are modelled as a base (the plan of the first choice everywhere,
usually no remat) plus one delta per (unit, choice), where a unit is a layer, a segment
or the whole stack, whichever the space's parameters are:

* the **prior** comes from the uniform presets. A choice's memory saving is spread over the
  units by the layers they hold *before the last one* — the last layer's residuals are
  needed as soon as the backward pass starts, so checkpointing it saves nothing — and its
  extra time by the layers they hold: its preset's measured step time where the preset ran,
  else its extra FLOPs priced at the study's measured seconds per FLOP (a preset over budget
  never runs). Measured, because fewer FLOPs need not be faster: on a 2-core CPU `dots`
  (fewest FLOPs) ran slower than `save_qkv`;
* every other measurement corrects the prior (ridge regression towards it), which learns
  what the prior gets wrong, e.g. that early layers' residuals live longest.

:func:`solve_front` then finds the Pareto front of predicted (peak, time) over all plans by
dynamic programming over units (a multiple-choice knapsack): exact unless the front of partial
plans outgrows :data:`MAX_STATES`, when it is thinned and says so (:attr:`Front.thinned_to`); and
:class:`PlannerSampler` proposes its best plan for the budget and for a spread of smaller
budgets, handing over to TPE when the model has nothing new to propose. Predictions only
choose what to measure: every proposal is compiled and measured like any other trial.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict, ValidationError

from remat_search.errors import NoFeasiblePlan, SpecError, StorageError
from remat_search.plans.plan import RematPlan, collapse_runs
from remat_search.report.results import StudyReport, TrialResult, study_report, trial_result
from remat_search.search.space import Space
from remat_search.spec.models import SamplerConfig, SpaceConfig, describe_validation_error
from remat_search.store.storage import LAYERS_ATTR, PREDICTION_ATTR, QUEUED_ATTR
from remat_search.units import format_bytes, format_seconds

RIDGES = (0.25, 1.0, 4.0, 16.0, 64.0)
"""Candidate ridge strengths: how many observations of one (unit, choice) it takes to move
its delta halfway from the prior."""
TARGETS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)
"""Budgets the sampler plans for, as fractions of the study's: the budget first, then the front."""
PER_TARGET = 3
"""How far down the front, from the fastest plan for a target, the sampler looks for one untried."""
MIN_CALIBRATION = 3
"""Measured mixed plans the model's error must be known from before it may screen a plan out."""
MAX_STATES = 20_000
"""Front size above which :func:`solve_front` merges states of nearly equal memory."""


class Observation(BaseModel):
    """What one measured plan says: its choices and what the compiler and the clock saw."""

    model_config = ConfigDict(frozen=True)

    choices: tuple[str, ...]
    """The choice label of each unit."""
    peak: float | None = None
    flops: float | None = None
    seconds: float | None = None


class Prediction(BaseModel):
    """The model's peak bytes and step seconds for one plan."""

    model_config = ConfigDict(frozen=True)

    choices: tuple[str, ...]
    peak: float
    seconds: float


class PredictedFront(BaseModel):
    """The predicted Pareto front, least memory first, and whether the solve was exact (see
    :attr:`Front.thinned_to`)."""

    model_config = ConfigDict(frozen=True)

    plans: tuple[Prediction, ...]
    thinned_to: int | None = None


class CostModel(BaseModel):
    """Base + per-(unit, choice) deltas for peak bytes and step seconds (see the module doc)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    units: tuple[str, ...]
    labels: tuple[str, ...]
    """The choices the model can price (those whose uniform preset was compiled)."""
    base_peak: float
    base_seconds: float
    peak: np.ndarray
    """``[unit, label]`` delta of peak bytes from the base (0 for ``labels[0]``)."""
    seconds: np.ndarray
    observations: int
    margin: float
    """Calibration: the largest relative under-prediction of a measured mixed plan's peak by
    the model fitted without it (leave-one-out). Plans for a budget are chosen to fit
    ``budget / (1 + margin)``, so that an error the study has seen is not made again."""
    overshoot: float = 0.0
    """The other side of the calibration: the largest relative over-prediction of such a peak."""
    calibrated_on: int = 0
    """How many measured mixed plans :attr:`margin` and :attr:`overshoot` come from."""

    def predict(self, choices: Sequence[str]) -> Prediction | None:
        """Predicted peak and time of a plan by choice label per unit; None for unknown labels."""
        if any(c not in self.labels for c in choices):
            return None
        idx = [self.labels.index(c) for c in choices]
        units = range(len(self.units))
        return Prediction(
            choices=tuple(choices),
            peak=self.base_peak + float(sum(self.peak[u, k] for u, k in zip(units, idx, strict=True))),
            seconds=self.base_seconds + float(sum(self.seconds[u, k] for u, k in zip(units, idx, strict=True))),
        )

    def certainly_over(self, choices: Sequence[str], budget: float, factor: float) -> Prediction | None:
        """The prediction for ``choices`` if the plan needs more than ``factor × budget`` even
        were the model over-predicting it by the most it ever has (:attr:`overshoot`); None
        if it may not, or while fewer than :data:`MIN_CALIBRATION` mixed plans calibrate that."""
        if self.calibrated_on < MIN_CALIBRATION or (prediction := self.predict(choices)) is None:
            return None
        return prediction if prediction.peak / (1 + self.overshoot) > factor * budget else None

    def solve(self, cap: float | None = None) -> PredictedFront:
        """The predicted Pareto front (only peaks ≤ ``cap`` if given), and whether it is exact."""
        solved = solve_front(self.peak, self.seconds, cap=None if cap is None else cap - self.base_peak)
        return PredictedFront(
            plans=tuple(
                Prediction(
                    choices=tuple(self.labels[k] for k in ks),
                    peak=self.base_peak + m, seconds=self.base_seconds + t,
                )
                for m, t, ks in solved.points()
            ),
            thinned_to=solved.thinned_to,
        )

    def front(self, cap: float | None = None) -> list[Prediction]:
        """The predicted Pareto front, least memory first (only peaks ≤ ``cap`` if given)."""
        return list(self.solve(cap).plans)

    def fitting(self, budget: float) -> PredictedFront:
        """The predicted front of the plans that fit ``budget`` with the model's calibration margin."""
        return self.solve(cap=budget / (1 + self.margin))

    def best(self, budget: float) -> Prediction | None:
        """The fastest plan predicted to fit ``budget`` with the model's calibration margin;
        None if none is predicted to."""
        plans = self.fitting(budget).plans
        return plans[-1] if plans else None


def fit_cost_model(
    observations: Sequence[Observation], *, labels: Sequence[str], unit_layers: Sequence[Sequence[int]],
    units: Sequence[str], layers: int, ridge: float | None = None,
) -> CostModel | None:
    """Fit the model, or None while the study cannot price at least two choices yet.

    A choice is priced once its uniform preset has a compiled peak and FLOP count; time
    needs at least one plan that ran.
    """
    n_units = len(unit_layers)
    presets: dict[str, list[Observation]] = {}
    for o in observations:
        if len(set(o.choices)) == 1 and len(o.choices) == n_units:
            presets.setdefault(o.choices[0], []).append(o)
    usable = [
        label for label in labels
        if any(o.peak is not None for o in presets.get(label, ())) and any(o.flops is not None for o in presets.get(label, ()))
    ]
    timed = [o for o in observations if o.seconds is not None and o.flops is not None]
    if len(usable) < 2 or not timed:
        return None
    preset_peak = {label: _mean(o.peak for o in presets[label]) for label in usable}
    preset_flops = {label: _mean(o.flops for o in presets[label]) for label in usable}
    ref = usable[0]

    # Where a choice's saving lands: layers before the last; its extra work: every layer.
    before_last = [sum(1 for i in ls if i < layers - 1) / max(layers - 1, 1) for ls in unit_layers]
    share = [len(ls) / layers for ls in unit_layers]
    peak_prior = np.array([[(preset_peak[label] - preset_peak[ref]) * w for label in usable] for w in before_last])

    # Seconds per extra FLOP, from every plan that ran.
    x = np.array([o.flops - preset_flops[ref] for o in timed])
    y = np.array([o.seconds for o in timed])
    if len(set(x.round(6))) >= 2:
        slope, intercept = np.polyfit(x, y, 1)
    else:
        slope, intercept = 0.0, float(y.mean())
    if slope <= 0:  # noise swamped the signal: time proportional to work
        slope = float(y.mean() / np.mean([o.flops for o in timed]))
        intercept = slope * preset_flops[ref]

    # A choice's extra time: its preset's measured step where it ran; else (a preset over
    # budget never runs) its extra FLOPs at those seconds per FLOP.
    preset_seconds = {
        label: _mean(ran) if (ran := [o.seconds for o in presets[label] if o.seconds is not None])
        else float(intercept + slope * (preset_flops[label] - preset_flops[ref]))
        for label in usable
    }
    time_prior = np.array([[(preset_seconds[label] - preset_seconds[ref]) * w for label in usable] for w in share])

    index = {label: k for k, label in enumerate(usable)}
    priced = [o for o in observations if all(c in index for c in o.choices) and len(o.choices) == n_units]
    with_peak = [o for o in priced if o.peak is not None]
    peak, peak_loo = _ridge([(o.choices, o.peak) for o in with_peak], index, preset_peak[ref], peak_prior, ridge)
    seconds, _ = _ridge(
        [(o.choices, o.seconds) for o in priced if o.seconds is not None], index, preset_seconds[ref], time_prior, ridge,
    )
    # Calibration: how far the model misses a mixed plan's peak it was not fitted to.
    held_out = [(o.peak, loo) for o, loo in zip(with_peak, peak_loo, strict=True) if len(set(o.choices)) > 1]
    return CostModel(
        units=tuple(units), labels=tuple(usable), base_peak=preset_peak[ref], base_seconds=preset_seconds[ref],
        peak=peak, seconds=seconds, observations=len(priced),
        margin=max([0.0, *(real / loo - 1 for real, loo in held_out)]),
        overshoot=max([0.0, *(loo / real - 1 for real, loo in held_out)]), calibrated_on=len(held_out),
    )


def _ridge(
    data: list[tuple[tuple[str, ...], float]], index: Mapping[str, int], base: float, prior: np.ndarray,
    ridge: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Deltas ``prior + w``, ``w`` minimising ‖residual − Xw‖² + ridge·‖w‖² (w = 0 on the base
    choice), and each row's leave-one-out prediction.

    ``ridge=None`` picks it from :data:`RIDGES` by leave-one-out error: large where the
    prior already explains the data, small where the data show what it misses.
    """
    n_units, n_labels = prior.shape
    if not data:
        return prior, np.zeros(0)
    free = [u * n_labels + k for u in range(n_units) for k in range(1, n_labels)]
    X = np.zeros((len(data), n_units * n_labels))
    residual = np.zeros(len(data))
    for row, (choices, value) in enumerate(data):
        ks = [index[c] for c in choices]
        for u, k in enumerate(ks):
            X[row, u * n_labels + k] = 1.0
        residual[row] = value - base - sum(prior[u, k] for u, k in enumerate(ks))
    X = X[:, free]

    def loo_residuals(lam: float) -> np.ndarray:
        hat = X @ np.linalg.solve(X.T @ X + lam * np.eye(len(free)), X.T)
        return (residual - hat @ residual) / np.maximum(1.0 - np.diag(hat), 1e-9)

    lam = ridge if ridge is not None else min(RIDGES, key=lambda r: float(np.mean(loo_residuals(r) ** 2)))
    deltas = prior.copy().reshape(-1)
    deltas[free] += np.linalg.solve(X.T @ X + lam * np.eye(len(free)), X.T @ residual)
    values = np.array([value for _, value in data])
    return deltas.reshape(n_units, n_labels), values - loo_residuals(lam)


class Front(BaseModel):
    """A Pareto front of summed (memory, seconds) from :func:`solve_front`: one state per
    plan, memory ascending and seconds descending, and whether it is exact."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    memory: np.ndarray
    seconds: np.ndarray
    choices: np.ndarray
    """``[state, unit]``: the choice index of each unit in each state's plan."""
    thinned_to: int | None = None
    """None where the front is exact: no unit's front of partial plans outgrew ``max_states``,
    so only dominated plans were dropped and the optimum for any cap is on it. Else the
    ``max_states`` it was thinned to: an optimum may have been merged away."""

    @property
    def exact(self) -> bool:
        return self.thinned_to is None

    def points(self) -> list[tuple[float, float, tuple[int, ...]]]:
        """``(memory, seconds, choices)`` of each state, memory ascending."""
        return [
            (float(a), float(b), tuple(int(k) for k in ks))
            for a, b, ks in zip(self.memory, self.seconds, self.choices, strict=True)
        ]


def solve_front(
    memory: np.ndarray, seconds: np.ndarray, *, cap: float | None = None, max_states: int = MAX_STATES
) -> Front:
    """The Pareto front of ``Σ memory[u, k_u]`` vs ``Σ seconds[u, k_u]`` over all choices ``k``.

    Dynamic programming over units: after each unit only the non-dominated partial plans
    are kept, so the result is exact (the optimum for any cap is on it) unless the front
    grows past ``max_states``, when states within 1/max_states of the memory range merge
    and the result says so (:attr:`Front.thinned_to`).
    Partial plans are kept as back-pointers (parent state, choice) and read back at the end,
    so a 96-layer stack costs arrays, not tuples, per unit.
    """
    n_units, n_choices = memory.shape
    lowest_rest = np.concatenate([np.cumsum(memory.min(axis=1)[::-1])[::-1], [0.0]])
    m, t = np.zeros(1), np.zeros(1)
    parents: list[np.ndarray] = []
    choices: list[np.ndarray] = []
    thinned = False
    for u in range(n_units):
        grown_m = (m[:, None] + memory[u][None, :]).reshape(-1)
        grown_t = (t[:, None] + seconds[u][None, :]).reshape(-1)
        index = np.arange(grown_m.size)
        if cap is not None:
            index = index[grown_m + lowest_rest[u + 1] <= cap]
        index = index[_pareto(grown_m[index], grown_t[index])]
        if index.size > max_states:
            index = index[_thin(grown_m[index], max_states)]
            thinned = True
        m, t = grown_m[index], grown_t[index]
        parents.append(index // n_choices)
        choices.append(index % n_choices)
    plans = np.zeros((m.size, n_units), dtype=int)
    state = np.arange(m.size)
    for u in reversed(range(n_units)):
        plans[:, u] = choices[u][state]
        state = parents[u][state]
    return Front(memory=m, seconds=t, choices=plans, thinned_to=max_states if thinned else None)


def _pareto(m: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Positions of the non-dominated (m, t) pairs, memory ascending (so seconds descending)."""
    order = np.lexsort((t, m))
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], t[order]]))[:-1]
    return order[t[order] < best_before]


def _thin(m: np.ndarray, n: int) -> np.ndarray:
    """Positions along a front (memory ascending) that keep the fastest state of each of ``n``
    equal memory buckets (seconds descend along the front: the last of each bucket), and the
    least-memory state, so the tightest budget the exact front meets stays met."""
    width = (m[-1] - m[0]) / n or 1.0
    bucket = ((m - m[0]) / width).astype(int)
    last = np.append(bucket[1:] != bucket[:-1], True)
    last[0] = True
    return np.flatnonzero(last)


def _mean(values: Any) -> float:
    values = [v for v in values if v is not None]
    return float(sum(values) / len(values))


def study_observations(study: optuna.Study, space: Space) -> list[Observation]:
    """One observation per distinct flat plan the study compiled (cache reuses counted once)."""
    seen: dict[str, Observation] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        result = trial_result(t)
        m = result.measurement
        choices = space.choices(t.params)  # the model prices flat plans
        if m is None or m.memory is None or result.plan is None or choices is None:
            continue
        seen.setdefault(result.plan.digest, Observation(
            choices=choices, peak=m.memory.peak, flops=m.flops,
            seconds=m.step_seconds if m.status == "measured" else None,
        ))
    return list(seen.values())


def study_cost_model(study: optuna.Study, space: Space) -> CostModel | None:
    """The cost model fitted to everything ``study`` has measured."""
    return fit_cost_model(
        study_observations(study, space), labels=space.labels, unit_layers=space.unit_layers,
        units=space.units, layers=space.layers,
    )


class PlannerSampler(optuna.samplers.BaseSampler):
    """Proposes the cost model's best plans for the budget and along the front, then TPE's.

    Each of its own proposals is one the study has not tried yet (TPE, once handed over, may
    repeat one: the measurement cache makes that free); its prediction is kept here by trial
    number until :func:`record_prediction` stores it on the trial (user attribute
    ``prediction``), so reports can set it beside the measurement. Queued trials (the
    presets, marked by :data:`store.QUEUED_ATTR`) pass through untouched.
    """

    def __init__(self, space: Space, budget: int, *, seed: int | None = None) -> None:
        self._space, self._budget = space, budget
        self._tpe = optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
        self.predictions: dict[int, dict[str, float]] = {}
        """The prediction of each trial this sampler proposed, by trial number, until recorded."""

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {} if QUEUED_ATTR in trial.user_attrs else self._space.distributions()

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        proposal = self._propose(study)
        if proposal is None:
            tpe_space = self._tpe.infer_relative_search_space(study, trial)
            return self._tpe.sample_relative(study, trial, tpe_space)
        prediction, target, trained_on, margin = proposal
        self.predictions[trial.number] = {
            "peak": prediction.peak, "seconds": prediction.seconds, "target": target, "trained_on": trained_on,
            "margin": margin,
        }
        return self._space.params(prediction.choices)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._tpe.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._tpe.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        self._tpe.after_trial(study, trial, state, values)

    def _propose(self, study: optuna.Study) -> tuple[Prediction, int, int, float] | None:
        """For the first target budget with one, the fastest predicted plan among its best
        :data:`PER_TARGET` that the study has not tried."""
        model = study_cost_model(study, self._space)
        if model is None:
            return None
        # A queued plan, or one suggested.
        tried = {self._space.choices(t.user_attrs.get(QUEUED_ATTR) or t.params) for t in study.get_trials(deepcopy=False)}
        front = model.front(cap=self._budget)
        for fraction in TARGETS:
            target = int(self._budget * fraction)
            fitting = [p for p in front if p.peak * (1 + model.margin) <= target]
            # The fastest untried of the target's best few (the best may be measured already).
            for prediction in fitting[::-1][:PER_TARGET]:
                if prediction.choices not in tried:
                    return prediction, target, model.observations, model.margin
        return None


def record_prediction(study: optuna.Study, trial: optuna.Trial) -> None:
    """Store on ``trial`` (user attribute ``prediction``) what the planner predicted for the
    plan it proposed there, once its parameters are suggested; nothing for other samplers'
    trials or queued ones."""
    sampler = study.sampler
    if isinstance(sampler, PlannerSampler) and (prediction := sampler.predictions.pop(trial.number, None)):
        trial.set_user_attr(PREDICTION_ATTR, prediction)


SamplerFactory = Callable[[Space, int, "int | None"], optuna.samplers.BaseSampler]
"""Builds a sampler for ``(space, budget, seed)``."""
SAMPLERS: dict[str, SamplerFactory] = {
    "planner": lambda space, budget, seed: PlannerSampler(space, budget, seed=seed),
    # constant_liar: running trials count as bad results, so workers in parallel spread out
    "tpe": lambda space, budget, seed: optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True),
    "nsga2": lambda space, budget, seed: optuna.samplers.NSGAIISampler(seed=seed),
    "random": lambda space, budget, seed: optuna.samplers.RandomSampler(seed=seed),
}
"""The samplers a spec may name (``sampler.kind``): the planner, then optuna's own. All but
``random`` learn from the budget constraint. A new sampler is one entry here."""


def check_sampler(config: SamplerConfig) -> None:
    """Raise :class:`SpecError` unless ``config`` names a sampler of :data:`SAMPLERS`."""
    if config.kind not in SAMPLERS:
        raise SpecError(f"spec.sampler.kind: unknown sampler {config.kind!r}; expected one of {', '.join(SAMPLERS)}")


def make_sampler(config: SamplerConfig, *, space: Space, budget: int, offset: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler a spec names (:data:`SAMPLERS`; see :func:`check_sampler`).

    ``offset`` (the study's trial count) moves the seed, so a resumed search does not replay
    the proposals of the session before it.
    """
    check_sampler(config)
    return SAMPLERS[config.kind](space, budget, None if config.seed is None else (config.seed + offset) % 2**32)


class Advice(BaseModel):
    """The plan to use for a budget: the planner's, or the study's fastest measured plan that
    fits where that one is faster (:attr:`source`); with what the study measured of it."""

    model_config = ConfigDict(frozen=True)

    study: str
    budget: int
    plan: RematPlan
    params: dict[str, str]
    """The trial parameters that stand for :attr:`plan` (to queue it in the study)."""
    labels: tuple[str, ...]
    predicted: Prediction | None
    """The model's prediction for :attr:`plan` (None for a measured plan it cannot price)."""
    measured: TrialResult | None
    observations: int
    """How many distinct measured plans the model was fitted to."""
    margin: float
    """The model's calibration margin (see :attr:`CostModel.margin`)."""
    thinned_to: int | None = None
    """None where the plan is the exact optimum of the model; else the front was thinned to
    this many states (see :attr:`Front.thinned_to`) and a faster predicted plan may exist."""
    source: Literal["predicted", "measured"] = "predicted"
    """``predicted``: the model's best plan for the budget; ``measured``: the study's fastest
    measured plan that fits it (what ``best`` answers), which the model's plan does not beat."""
    reason: str | None = None
    """Why a measured plan was advised instead of the model's."""


def advise(study: optuna.Study, budget: int) -> Advice:
    """The fastest plan the study's cost model predicts to fit ``budget``, unless the study's
    fastest measured plan that fits (:meth:`StudyReport.best`) is faster than it (than its
    measurement where it was measured, else its prediction) or no plan is predicted to fit:
    then that measured plan. The advice is never worse than the best measured plan.

    Raises :class:`StorageError` for a study whose stored search space does not validate;
    :class:`NoFeasiblePlan` while the study cannot fit a model (it needs the uniform presets
    of two choices compiled and one plan timed), or when no plan is predicted to fit and no
    measured one fits.
    """
    report = study_report(study)
    layers = study.user_attrs.get(LAYERS_ATTR) or next((len(t.plan.layers) for t in report.trials if t.plan), 0)
    space = _stored_space(study, layers)
    model = study_cost_model(study, space) if layers else None
    if model is None:
        raise NoFeasiblePlan(
            f"study: {study.study_name!r} has too little measured to plan from (it needs the uniform "
            "plans of two choices compiled and one plan timed); run its search first"
        )
    try:
        fastest: TrialResult | None = report.best(budget)
    except NoFeasiblePlan:
        fastest = None
    fitting = model.fitting(budget)
    best = fitting.plans[-1] if fitting.plans else None
    if best is None:
        smallest = model.front()[0]
        unpredicted = (
            f"no plan is predicted to fit {format_bytes(budget)} with the model's calibration "
            f"margin of {model.margin:.1%}; the smallest predicted peak is {format_bytes(int(smallest.peak))} "
            f"({collapse_runs(smallest.choices)})"
        )
        if fastest is None:
            raise NoFeasiblePlan(f"budget: {unpredicted}; `best` answers from measured plans only")
        reason = f"{unpredicted}, but {_described(fastest)} fits"
        return _measured_advice(study, budget, model, space, fastest, reason)
    params = space.params(best.choices)
    plan = space.plan(params)
    advice = Advice(
        study=study.study_name, budget=budget, plan=plan, params=params,
        labels=space.layer_labels(params), predicted=best, measured=measured_trial(report, plan),
        observations=model.observations, margin=model.margin, thinned_to=fitting.thinned_to,
    )
    if fastest is None or fastest.plan == plan or fastest.seconds is None:
        return advice
    seconds, how = _expected_seconds(advice)
    if fastest.seconds >= seconds:
        return advice
    return _measured_advice(study, budget, model, space, fastest, (
        f"{_described(fastest)} is faster than the model's plan ({plan.summary(advice.labels)}, {how})"
    ))


def _stored_space(study: optuna.Study, layers: int) -> Space:
    """The search space the study was made with, over ``layers`` layers; a
    :class:`StorageError` if it has none, or one that no longer validates (made by another
    version of remat-search)."""
    stored = study.user_attrs.get("space")
    if stored is None:
        raise StorageError(
            f"study: {study.study_name!r} was not made by remat-search (it has no search space stored)"
        )
    try:
        return Space.of(SpaceConfig.model_validate(stored), max(layers, 1))
    except ValidationError as e:
        raise StorageError(
            f"study: {study.study_name!r} stores a search space that no longer validates "
            f"({describe_validation_error(e, prefix='space')}); search again under a new study name"
        ) from None


def _expected_seconds(advice: Advice) -> tuple[float, str]:
    """The advised plan's step time as the study knows it (its measurement where it has one,
    else the prediction), and how it knows it; infinite where it was measured over the budget."""
    m, predicted = advice.measured, advice.predicted
    assert predicted is not None
    if m is not None and m.peak_bytes is not None and m.peak_bytes > advice.budget:
        return math.inf, f"trial {m.number}, measured over the budget at {format_bytes(m.peak_bytes)}"
    if m is not None and m.status == "measured" and m.seconds is not None:
        return m.seconds, f"trial {m.number}, measured at {format_seconds(m.seconds)}"
    return predicted.seconds, f"predicted at {format_seconds(predicted.seconds)}"


def _described(t: TrialResult) -> str:
    assert t.peak_bytes is not None and t.seconds is not None
    seconds, peak = format_seconds(t.seconds), format_bytes(t.peak_bytes)
    return f"trial {t.number} ({t.summary()}) measured {seconds} at {peak}"


def _measured_advice(
    study: optuna.Study, budget: int, model: CostModel, space: Space, trial: TrialResult, reason: str
) -> Advice:
    """Advice of the measured ``trial``, priced by the model where it can be."""
    assert trial.plan is not None
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    params = {name: str(value) for name, value in frozen.params.items()}
    choices = space.choices(params)
    return Advice(
        study=study.study_name, budget=budget, plan=trial.plan, params=params, labels=trial.labels,
        predicted=model.predict(choices) if choices is not None else None, measured=trial,
        observations=model.observations, margin=model.margin, source="measured", reason=reason,
    )


def measured_trial(report: StudyReport, plan: RematPlan) -> TrialResult | None:
    """The study's first trial that compiled ``plan``."""
    return next(
        (t for t in report.trials if t.plan == plan and t.status in ("measured", "over_budget") and t.reused_from is None),
        None,
    )
