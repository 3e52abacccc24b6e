"""The planner's cost model: a per-layer model fitted to a study's measurements.

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

:meth:`CostModel.solve` hands its deltas to :func:`search.solver.solve_front` for the
Pareto front of predicted (peak, time); the samplers (:mod:`search.samplers`) propose from
it and the advice (:mod:`search.advice`) answers ``plan`` with it. Predictions only choose
what to measure: every proposal is compiled and measured like any other trial.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from remat_search.report.results import TrialResult, trial_result
from remat_search.search.solver import solve_front
from remat_search.search.space import Space
from remat_search.store.attributes import COST_MODEL_ATTR

if TYPE_CHECKING:
    import optuna

RIDGES = (0.25, 1.0, 4.0, 16.0, 64.0)
"""Candidate ridge strengths: how many observations of one (unit, choice) it takes to move
its delta halfway from the prior."""
MAX_POOLED_SHARE = 1 / 3
"""The most the prior of a choice priced from the plans holding it (:func:`_pooled`) may move
the reference's step, every unit holding it: a third. With every tensor recomputed a step runs
its forward twice and its backward (no shorter than the forward) once, so keeping them all
saves at most that."""
MIN_CALIBRATION = 3
"""Measured mixed plans the model's error must be known from before it may screen a plan out."""


Array = Annotated[
    np.ndarray, BeforeValidator(lambda a: np.asarray(a, dtype=float)), PlainSerializer(lambda a: a.tolist(), return_type=list)
]
"""A float array that a model keeps in JSON as nested lists (Python floats: read back exactly)."""


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
    """The choices the model can price (those whose uniform preset has a peak: compiled, or
    refused by the TPU compiler with the bytes it needed); the first is the base."""
    base_peak: float
    base_seconds: float
    peak: Array
    """``[unit, label]`` delta of peak bytes from the base (0 for ``labels[0]``)."""
    seconds: Array
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
    units: Sequence[str], layers: int, ridge: float | None = None, weights: Sequence[float] | None = None,
) -> CostModel | None:
    """Fit the model, or None while the study cannot price at least two choices yet.

    A choice is priced once its uniform preset has a peak (the TPU compiler's refusal gives one,
    with no FLOP count: then its time prior comes from the plans holding it, :func:`_pooled`);
    time needs at least one plan that ran and one preset with a FLOP count. ``weights``: each unit's share of
    a preset's saving and extra time in the prior (a ``tensors`` space's, by each tensor's
    bytes), in place of the shares its layers give.
    """
    n_units = len(unit_layers)
    presets: dict[str, list[Observation]] = {}
    for o in observations:
        if len(set(o.choices)) == 1 and len(o.choices) == n_units:
            presets.setdefault(o.choices[0], []).append(o)
    usable = [label for label in labels if any(o.peak is not None for o in presets.get(label, ()))]
    # A preset the TPU compiler refused (out of HBM) has its peak, from the compiler's refusal,
    # and no program: no FLOPs and no step. Its choice is priced all the same, its time from
    # the plans that hold it (a published policy keeping some names on the device).
    compiled = [label for label in usable if any(o.flops is not None for o in presets[label])]
    timed = [o for o in observations if o.seconds is not None and o.flops is not None]
    if len(usable) < 2 or not compiled or not timed:
        return None
    ref = compiled[0]
    usable = [ref, *(label for label in usable if label != ref)]
    preset_peak = {label: _mean(o.peak for o in presets[label]) for label in usable}
    preset_flops = {label: _mean(o.flops for o in presets[label]) for label in compiled}

    # Where a choice's saving lands: layers before the last; its extra work: every layer.
    before_last = [sum(1 for i in ls if i < layers - 1) / max(layers - 1, 1) for ls in unit_layers]
    share = [len(ls) / layers for ls in unit_layers]
    if weights is not None:
        before_last = share = list(weights)
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

    def preset_time(label: str) -> float:
        """A choice's time: its preset's measured step where it ran; else (a preset over budget
        never runs) its extra FLOPs at those seconds per FLOP; else (never compiled) the
        reference's, until :func:`_pooled` reads it from the plans holding it."""
        if ran := [o.seconds for o in presets[label] if o.seconds is not None]:
            return _mean(ran)
        if label in preset_flops:
            return float(intercept + slope * (preset_flops[label] - preset_flops[ref]))
        return preset_time(ref)

    preset_seconds = {label: preset_time(label) for label in usable}
    time_prior = np.array([[(preset_seconds[label] - preset_seconds[ref]) * w for label in usable] for w in share])

    index = {label: k for k, label in enumerate(usable)}
    priced = [o for o in observations if all(c in index for c in o.choices) and len(o.choices) == n_units]
    timed_plans = [(o.choices, o.seconds) for o in priced if o.seconds is not None]
    for label in usable:
        if label not in preset_flops:
            time_prior[:, index[label]] = _pooled(label, timed_plans, index, preset_seconds[ref], time_prior, share)
    with_peak = [o for o in priced if o.peak is not None]
    peak, peak_loo = _ridge([(o.choices, o.peak) for o in with_peak], index, preset_peak[ref], peak_prior, ridge)
    seconds, _ = _ridge(timed_plans, index, preset_seconds[ref], time_prior, ridge)
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
        # The hat matrix X·A⁻¹·Xᵀ only by its diagonal and its product with the residual: never
        # n × n, so that fitting stays linear in the observations (a study of 10,000 plans).
        w = np.linalg.solve(X.T @ X + lam * np.eye(len(free)), X.T)
        hat_diag = np.einsum("ij,ji->i", X, w)
        return (residual - X @ (w @ residual)) / np.maximum(1.0 - hat_diag, 1e-9)

    lam = ridge if ridge is not None else min(RIDGES, key=lambda r: float(np.mean(loo_residuals(r) ** 2)))
    deltas = prior.copy().reshape(-1)
    deltas[free] += np.linalg.solve(X.T @ X + lam * np.eye(len(free)), X.T @ residual)
    values = np.array([value for _, value in data])
    return deltas.reshape(n_units, n_labels), values - loo_residuals(lam)


def _pooled(
    label: str, data: list[tuple[tuple[str, ...], float]], index: Mapping[str, int], base: float, prior: np.ndarray,
    share: Sequence[float],
) -> np.ndarray:
    """The time prior of a choice whose preset never compiled (no step, no FLOPs): one figure
    per unit of ``share`` (a tensor's bytes), least squares over the plans holding it, of what
    their steps leave once every other unit is priced by ``prior``; spread by ``share`` like
    any preset's. Zero where no timed plan holds it."""
    rows = [
        (sum(w for w, c in zip(share, choices, strict=True) if c == label),
         seconds - base - sum(prior[u, index[c]] for u, c in enumerate(choices) if c != label))
        for choices, seconds in data if label in choices
    ]
    held = sum(x * x for x, _ in rows)
    per_share = sum(x * y for x, y in rows) / held if held > 0 else 0.0
    # bounded by MAX_POOLED_SHARE: spread by bytes, a plan holding only a small tensor (MaxText's
    # `context`) would read its saving as a few bytes' and price a large tensor's at many times
    # the step (v5e 32B: -132 s for `mlpwi`, steps predicted below zero)
    reach = MAX_POOLED_SHARE * base / max(float(sum(share)), 1e-12)
    return float(np.clip(per_share, -reach, reach)) * np.asarray(share, dtype=float)


def _mean(values: Any) -> float:
    values = [v for v in values if v is not None]
    return float(sum(values) / len(values))



def observations(trials: Iterable[tuple[TrialResult, Mapping[str, object]]], space: Space) -> list[Observation]:
    """One observation per distinct flat plan among ``trials`` (a study's complete trials,
    each with its parameters), cache reuses counted once."""
    seen: dict[str, Observation] = {}
    for result, params in trials:
        m = result.measurement
        choices = space.choices(params)  # the model prices flat plans
        # a compile the TPU compiler refused (out of HBM) has no memory analysis; the bytes it
        # needed (its refusal's) are the plan's peak all the same
        if m is None or m.peak_bytes is None or result.plan is None or choices is None:
            continue
        seen.setdefault(result.plan.digest, Observation(
            choices=choices, peak=m.peak_bytes, flops=m.flops,
            # a plan over the budget never runs; on a target where steps are estimated, its
            # estimate was made all the same, and prices its choices as any other's does
            seconds=m.step_seconds if m.status == "measured" else m.estimated_seconds,
        ))
    return list(seen.values())


def cost_model(trials: Iterable[tuple[TrialResult, Mapping[str, object]]], space: Space) -> CostModel | None:
    """The cost model fitted to everything ``trials`` (complete, with their parameters) measured."""
    return fit_cost_model(
        observations(trials, space), labels=space.labels, unit_layers=space.unit_layers,
        units=space.units, layers=space.layers, weights=space.weights,
    )


def study_cost_model(study: optuna.Study, space: Space) -> CostModel | None:
    """The cost model of an open study (as its sampler and its search see it, through optuna)."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return cost_model(((trial_result(t), t.params) for t in complete), space)


def keep_cost_model(study: optuna.Study, space: Space) -> CostModel | None:
    """Fit the model to the study's complete trials and keep it in the study
    (:data:`~remat_search.store.attributes.COST_MODEL_ATTR`) with their count, so that ``plan``
    answers from it until the study completes another trial (:func:`kept_cost_model`). The
    search does this once it has finished its trials."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    model = cost_model(((trial_result(t), t.params) for t in complete), space)
    if model is not None:
        study.set_user_attr(COST_MODEL_ATTR, {"complete": len(complete), "model": model.model_dump(mode="json")})
    return model


def kept_cost_model(attrs: Mapping[str, Any], complete: int) -> CostModel | None:
    """The model a study keeps (its user attributes ``attrs``), if it was fitted to the
    ``complete`` trials the study holds now; None where it has none or the study has more
    (complete trials never leave that state, so an equal count is the same trials)."""
    kept = attrs.get(COST_MODEL_ATTR)
    if not kept or kept.get("complete") != complete:
        return None
    return CostModel.model_validate(kept["model"])
