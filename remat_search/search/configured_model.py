"""The planner's cost model across configurations: the per-layer model of the reference
configuration (:mod:`search.cost_model`) carried to every other configuration by what its
candidates measured there.

At the reference configuration (the first listed, where the presets run) the per-layer model
predicts a plan's peak ``P`` and step time ``T``. The same plan at configuration ``k`` is
predicted as

* peak: ``S_k + s_k · (P − S_ref) + e_k``: the training state a device holds (``S``: the
  compiler's argument bytes, exact once any candidate at ``k`` compiled; before, the
  reference's times how many more ways ``fsdp`` splits it there), plus the reference's
  activations scaled by the micro-batch's ratio to the reference's (``s_k``), plus the mean
  residual of ``k``'s measured peaks (``e_k``; 0 before one);
* step time: ``r_k · T``, ``r_k`` the mean ratio of ``k``'s measured step times to the
  model's; before one, the ratio of a step's tokens a device (global batch × sequence over
  the devices: a tensor axis splits a data-parallel device's examples over its chips).

A map is affine and increasing in ``P`` and ``T``, so a configuration's predicted front is
the image of the reference's; the model's front is the Pareto front of all of them in peak
and time per token a device trains on (the study's ranking). Predictions only choose what
to measure: every proposal is compiled and measured like any other trial.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from remat_search.plans.configuration import Configuration
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
    measured: int
    """How many of the study's plans at this configuration the map was fitted to."""

    def carry(self, prediction: Prediction, reference_state: float) -> ConfiguredPrediction:
        seconds = self.ratio * prediction.seconds
        return ConfiguredPrediction(
            choices=prediction.choices, configuration=self.configuration.summary(),
            peak=self.state + self.scale * (prediction.peak - reference_state) + self.offset,
            seconds=seconds, cost=seconds / self.configuration.tokens_per_device,
        )


class ConfiguredModel(BaseModel):
    """The reference's per-layer model and one map for each configuration of the space."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    base: CostModel
    reference_state: float
    maps: tuple[ConfigurationMap, ...]

    @property
    def margin(self) -> float:
        """The reference model's calibration margin (:attr:`CostModel.margin`)."""
        return self.base.margin

    def predict(self, choices: tuple[str, ...], configuration: str) -> ConfiguredPrediction | None:
        """The prediction for the plan of ``choices`` at the configuration labelled ``configuration``."""
        prediction = self.base.predict(choices)
        found = next((m for m in self.maps if m.configuration.summary() == configuration), None)
        return None if prediction is None or found is None else found.carry(prediction, self.reference_state)

    def front(self, configuration: str | None = None) -> list[ConfiguredPrediction]:
        """The predicted Pareto front of every configuration's plans (or of the configuration
        labelled ``configuration``'s), in peak and time per token, least memory first."""
        reference = self.base.front()
        maps = [m for m in self.maps if configuration in (None, m.configuration.summary())]
        points = sorted((m.carry(p, self.reference_state) for m in maps for p in reference), key=lambda p: (p.peak, p.cost))
        front: list[ConfiguredPrediction] = []
        for p in points:
            if not front or p.cost < front[-1].cost:
                front.append(p)
        return front


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
    maps = []
    for c in space.configurations:
        at = [s for s in seen.values() if s.configuration == c.summary()]
        fsdp = dict(reference.mesh).get("fsdp", 1) / dict(c.mesh).get("fsdp", 1)
        state = statistics.fmean(s.state for s in at) if at else reference_state * fsdp
        scale = c.batch / reference.batch
        priced = [(s, p) for s in at if (p := base.predict(s.choices)) is not None]
        offsets = [s.peak - (state + scale * (p.peak - reference_state)) for s, p in priced]
        ratios = [s.seconds / p.seconds for s, p in priced if s.seconds is not None and p.seconds > 0]
        maps.append(ConfigurationMap(
            configuration=c, state=state, scale=scale, offset=statistics.fmean(offsets) if offsets else 0.0,
            ratio=statistics.fmean(ratios) if ratios else c.tokens_per_device / reference.tokens_per_device,
            measured=len(at),
        ))
    return ConfiguredModel(base=base, reference_state=reference_state, maps=tuple(maps))


def study_configured_model(study: optuna.Study, space: Space) -> ConfiguredModel | None:
    """The model of an open study of configurations, as its planner sees it (through optuna);
    None while the reference's per-layer model cannot be fitted."""
    from optuna.trial import TrialState

    complete = [(trial_result(t), t.params) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    base = cost_model(complete, space)
    return None if base is None else fit_configured(base, complete, space)
