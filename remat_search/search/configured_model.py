"""The planner's cost model across configurations: the per-layer model of the reference
configuration (:mod:`search.cost_model`) carried to every other configuration by what its
candidates measured there.

At the reference configuration (the first listed, where the presets run) a plan's peak ``P``
and step time ``T`` are what it measured there, or, for a plan not measured there, the
per-layer model's prediction corrected by the mean residual (peak) and ratio (time) of the
plans measured there. (The per-layer model is a ridge towards a prior and smooths a measured
plan: on the published Llama 2 70B it read the published point 9.357 s against the 9.141 s
measured, and so the planner took `full`, measured 9.294 s, for the fastest plan everywhere.)
The same plan at configuration ``k`` is predicted as

* peak: ``S_k + s_k · (P − S_ref) + e_k``: the training state a device holds (``S``: the
  compiler's argument bytes, exact once any candidate at ``k`` compiled; before, the
  reference's times how many more ways ``fsdp`` splits it there), plus the reference's
  activations scaled by the micro-batch's ratio to the reference's (``s_k``), plus the mean
  residual of ``k``'s measured peaks (``e_k``; 0 before one);
* step time: ``r_k · T``, ``r_k`` the mean ratio of ``k``'s measured step times to the
  reference's of the same plans; before one, its guess: the ratio of a step's tokens a device
  (global batch × sequence over the devices: a tensor axis splits a data-parallel device's
  examples over its chips), times the effect of each trait that sets ``k`` apart from the
  reference (its micro-batch and accumulation, its mesh, each other setting's value) as the
  configurations measured so far show it (least squares on the logarithm of their ratio over
  their tokens'; a trait none of them has: no effect).

A map is affine and increasing in ``P`` and ``T``, so a configuration's predicted front is
the image of the reference's; the model's front is the Pareto front of all of them in peak
and time per token a device trains on (the study's ranking). Predictions only choose what
to measure: every proposal is compiled and measured like any other trial.

:meth:`ConfiguredModel.openings` says which configurations nothing was measured at are worth a
compile. One with a trait no configuration measured has, always: its effect is learnt there.
One whose every trait was measured elsewhere, only while its fastest plan predicted to fit
could beat the best time per token measured so far, were its guess off by as much as the
guesses of such combinations have been (:attr:`ConfiguredModel.guess_error`: each measured
one's guess from the others).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict

from remat_search.plans.configuration import Configuration, cost
from remat_search.report.results import TrialResult, trial_result
from remat_search.search.cost_model import CostModel, Prediction, cost_model
from remat_search.search.space import CONFIGURATION_PARAM, Space

if TYPE_CHECKING:
    import optuna


class ConfiguredPrediction(Prediction):
    """The model's peak and step seconds for a plan at a configuration, and its time per token."""

    configuration: str
    """The configuration's label (:meth:`Configuration.summary`)."""
    cost: float
    """Step seconds per token a device trains on (the study's ranking)."""


class ConfigurationMap(BaseModel):
    """How the reference's predictions carry to one configuration (see the module doc)."""

    model_config = ConfigDict(frozen=True)

    configuration: Configuration
    state: float
    scale: float
    offset: float
    ratio: float
    guess: float
    """The step-time ratio assumed before a step was measured here (see the module doc)."""
    measured: int
    """How many of the study's plans at this configuration the map was fitted to."""
    timed: int = 0
    """How many of them ran (or were estimated): :attr:`ratio` is theirs, else :attr:`guess`."""
    novel: bool = False
    """Whether it has a trait that no configuration whose step was measured has."""

    def carry(self, prediction: Prediction, reference_state: float) -> ConfiguredPrediction:
        seconds = self.ratio * prediction.seconds
        return ConfiguredPrediction(
            choices=prediction.choices, configuration=self.configuration.summary(),
            peak=self.state + self.scale * (prediction.peak - reference_state) + self.offset,
            seconds=seconds, cost=seconds / self.configuration.tokens_per_device,
        )


class ConfiguredModel(BaseModel):
    """The reference's per-layer model, its measured plans, and one map for each configuration of the space."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    base: CostModel
    reference: str
    """The reference configuration's label."""
    reference_state: float
    reference_offset: float = 0.0
    """The mean residual of the peaks measured at the reference, over the per-layer model's."""
    reference_ratio: float = 1.0
    """The mean ratio of the steps measured at the reference to the per-layer model's."""
    measured_plans: tuple[Prediction, ...] = ()
    """The plans compiled at the reference: their peak there, and their step where they ran (or
    were estimated), else the corrected per-layer model's."""
    maps: tuple[ConfigurationMap, ...]
    incumbent: float | None = None
    """The least step seconds per token a device trains on that a candidate measured, anywhere."""
    guess_error: float | None = None
    """The largest factor by which a measured configuration's step ratio missed its guess from
    the other measured configurations, either way, over those whose every trait another of them
    has; None before one."""

    @property
    def margin(self) -> float:
        """The reference model's calibration margin (:attr:`CostModel.margin`)."""
        return self.base.margin

    def at_reference(self, choices: Sequence[str]) -> Prediction | None:
        """The plan's peak and step at the reference: measured, or the corrected per-layer model's."""
        if measured := next((p for p in self.measured_plans if p.choices == tuple(choices)), None):
            return measured
        return None if (p := self.base.predict(choices)) is None else self._corrected(p)

    def _corrected(self, p: Prediction) -> Prediction:
        return p.model_copy(update={"peak": p.peak + self.reference_offset, "seconds": p.seconds * self.reference_ratio})

    def predict(self, choices: tuple[str, ...], configuration: str) -> ConfiguredPrediction | None:
        """The prediction for the plan of ``choices`` at the configuration labelled ``configuration``."""
        prediction = self.at_reference(choices)
        found = next((m for m in self.maps if m.configuration.summary() == configuration), None)
        return None if prediction is None or found is None else found.carry(prediction, self.reference_state)

    def front(self, configuration: str | None = None) -> list[ConfiguredPrediction]:
        """The predicted Pareto front of every configuration's plans (or of the configuration
        labelled ``configuration``'s), in peak and time per token, least memory first."""
        measured = {p.choices for p in self.measured_plans}
        reference = [*self.measured_plans, *(self._corrected(p) for p in self.base.front() if p.choices not in measured)]
        maps = [m for m in self.maps if configuration in (None, m.configuration.summary())]
        points = sorted((m.carry(p, self.reference_state) for m in maps for p in reference), key=lambda p: (p.peak, p.cost))
        front: list[ConfiguredPrediction] = []
        for p in points:
            if not front or p.cost < front[-1].cost:
                front.append(p)
        return front

    def without(self, configurations: set[str]) -> ConfiguredModel:
        """The model with no map for the configurations labelled ``configurations`` (those the
        workload refused: no plan there is proposed)."""
        return self.model_copy(update={"maps": tuple(m for m in self.maps if m.configuration.summary() not in configurations)})

    def openings(self, budget: float) -> list[ConfiguredPrediction]:
        """For each configuration nothing was measured at, its fastest plan predicted to fit
        ``budget`` (with the model's margin), least predicted time per token first: those worth
        a compile to measure the configuration's map. A configuration is left out whose every
        trait a measured configuration has, once :attr:`guess_error` is known, if its prediction
        could not beat the best measured (:attr:`incumbent`) even were its guess off by that
        much in its favour: its candidates stay in :meth:`front`, at their guess."""
        error = self.guess_error
        openings = []
        for m in self.maps:
            if m.measured:
                continue
            fitting = [p for p in self.front(m.configuration.summary()) if p.peak * (1 + self.margin) <= budget]
            if not fitting:
                continue
            best = min(fitting, key=lambda p: p.cost)
            if m.novel or error is None or self.incumbent is None or best.cost / error < self.incumbent:
                openings.append(best)
        return sorted(openings, key=lambda p: p.cost)


class _Seen(BaseModel):
    choices: tuple[str, ...]
    configuration: str
    peak: float
    state: float
    seconds: float | None


def fit_configured(base: CostModel, trials: Iterable[tuple[TrialResult, Mapping[str, object]]], space: Space) -> ConfiguredModel | None:
    """The model of ``space``'s configurations, from the reference's per-layer model ``base``
    and every complete trial (with its parameters); None before a reference plan compiled."""
    seen: dict[str, _Seen] = {}
    for result, params in trials:
        m, choices = result.measurement, space.choices(params, any_configuration=True)
        if m is None or m.memory is None or result.plan is None or choices is None:
            continue
        seen.setdefault(result.plan.digest, _Seen(
            choices=choices, configuration=str(params[CONFIGURATION_PARAM]), peak=m.memory.peak,
            state=m.memory.argument, seconds=m.step_seconds if m.status == "measured" else None,
        ))
    reference = space.configurations[0]
    at_reference = [s.state for s in seen.values() if s.configuration == reference.summary()]
    if not at_reference:
        return None
    reference_state = statistics.fmean(at_reference)
    here = [(s, base.predict(s.choices)) for s in seen.values() if s.configuration == reference.summary()]
    priced_here = [(s, p) for s, p in here if p is not None]
    offset = statistics.fmean(s.peak - p.peak for s, p in priced_here) if priced_here else 0.0
    ratio = statistics.fmean([t / p.seconds for s, p in priced_here if (t := s.seconds) is not None and p.seconds > 0] or [1.0])
    model = ConfiguredModel(
        base=base, reference=reference.summary(), reference_state=reference_state, reference_offset=offset,
        reference_ratio=ratio, maps=(),
        # every plan compiled at the reference at its peak there; its step where it ran, else the model's
        measured_plans=tuple(
            Prediction(choices=s.choices, peak=s.peak, seconds=s.seconds if s.seconds is not None else p.seconds * ratio)
            for s, p in here if s.seconds is not None or p is not None
        ),
    )
    timed = [(s, s.seconds) for s in seen.values() if s.seconds is not None]
    tokens = {c.summary(): c.tokens_per_device / reference.tokens_per_device for c in space.configurations}
    traits = {c.summary(): _traits(c, reference) for c in space.configurations}
    rows = []
    for c in space.configurations:
        at = [s for s in seen.values() if s.configuration == c.summary()]
        fsdp = dict(reference.mesh).get("fsdp", 1) / dict(c.mesh).get("fsdp", 1)
        state = statistics.fmean(s.state for s in at) if at else reference_state * fsdp
        scale = c.batch / reference.batch
        priced = [(s, p) for s in at if (p := model.at_reference(s.choices)) is not None]
        offsets = [s.peak - (state + scale * (p.peak - reference_state)) for s, p in priced]
        ratios = [t / p.seconds for s, p in priced if (t := s.seconds) is not None and p.seconds > 0]
        rows.append((c, at, state, scale, offsets, ratios))
    # what each other configuration's measured ratio says beyond its tokens
    learnt = {c.summary(): (traits[c.summary()], math.log(statistics.fmean(r) / tokens[c.summary()])) for c, *_, r in rows[1:] if r}
    effects = _effects(learnt)
    known = set().union(*(t for t, _ in learnt.values()))
    maps = []
    for c, at, state, scale, offsets, ratios in rows:
        guess = tokens[c.summary()] * math.exp(sum(effects.get(t, 0.0) for t in traits[c.summary()]))
        maps.append(ConfigurationMap(
            configuration=c, state=state, scale=scale, offset=statistics.fmean(offsets) if offsets else 0.0,
            ratio=statistics.fmean(ratios) if ratios else guess, guess=guess, measured=len(at), timed=len(ratios),
            novel=not traits[c.summary()] <= known,
        ))
    by_label = {c.summary(): c for c in space.configurations}
    return model.model_copy(update={
        "maps": tuple(maps),
        "incumbent": min((cost(t, by_label[s.configuration]) for s, t in timed if s.configuration in by_label), default=None),
        "guess_error": _guess_error(learnt),
    })


def _traits(c: Configuration, reference: Configuration) -> frozenset[str]:
    """What sets ``c`` apart from ``reference``: its micro-batch and accumulation, its mesh, and
    each setting's value, where they differ from the reference's."""
    def of(x: Configuration) -> dict[str, str]:
        return {"batch": f"{x.batch}×{x.accumulation}", "mesh": json.dumps(x.mesh), **{k: json.dumps(v) for k, v in x.settings}}

    theirs = of(reference)
    return frozenset(f"{k} {v}" for k, v in of(c).items() if theirs.get(k) != v)


def _effects(learnt: Mapping[str, tuple[frozenset[str], float]]) -> dict[str, float]:
    """Each trait's effect on the logarithm of a step's ratio: least squares (the least-norm
    solution where traits always come together) over the measured configurations' ``learnt``
    (their traits, and the logarithm of their ratio over their tokens' ratio)."""
    names = sorted(set().union(*(t for t, _ in learnt.values())))
    if not names:
        return {}
    x = np.array([[float(n in t) for n in names] for t, _ in learnt.values()])
    y = np.array([v for _, v in learnt.values()])
    solution = np.linalg.lstsq(x, y, rcond=None)[0]
    return dict(zip(names, (float(v) for v in solution), strict=True))


def _guess_error(learnt: Mapping[str, tuple[frozenset[str], float]]) -> float | None:
    """The largest factor by which a measured configuration's ratio misses its guess from the
    others (:func:`_effects` without it), either way, over those whose every trait another
    measured configuration has; None where none has."""
    misses = []
    for k, (traits, value) in learnt.items():
        others = {o: v for o, v in learnt.items() if o != k}
        if traits <= set().union(*(t for t, _ in others.values())):
            effects = _effects(others)
            misses.append(math.exp(abs(value - sum(effects[t] for t in traits))))
    return max(misses, default=None)


def configured_model(complete: Sequence[tuple[TrialResult, Mapping[str, object]]], space: Space) -> ConfiguredModel | None:
    """The model of ``space``'s configurations fitted to ``complete`` trials (with their
    parameters), as the planner fits it; None while the reference's per-layer model cannot be fitted."""
    base = cost_model(complete, space)
    return None if base is None else fit_configured(base, complete, space)


def study_configured_model(study: optuna.Study, space: Space) -> ConfiguredModel | None:
    """The model of an open study of configurations, as its planner sees it (through optuna);
    None while the reference's per-layer model cannot be fitted."""
    from optuna.trial import TrialState

    return configured_model(
        [(trial_result(t), t.params) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))], space)
