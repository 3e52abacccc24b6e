"""The samplers a spec may name (``sampler.kind``): the extension point of how a search proposes plans.

A sampler is an ``optuna.samplers.BaseSampler`` (the base: optuna drives it through its
study) built for a search by a :data:`SamplerFactory` from ``(space, budget, seed)``; the
registry :data:`SAMPLERS` holds one factory a kind, and a new sampler is one
:func:`register`-ed factory here. Registered: the planner's own (:class:`PlannerSampler`,
which proposes the cost model's best plans for the budget and along its front, then the
fastest untried plan one unit away from the front, then hands over to TPE when the model has
nothing new to propose), then optuna's. All but ``random``
learn from the budget constraint.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from remat_search.errors import SpecError
from remat_search.search.configured_model import study_configured_model
from remat_search.search.cost_model import Prediction, study_cost_model
from remat_search.search.space import CONFIGURATION_PARAM, Space
from remat_search.spec.models import SamplerConfig
from remat_search.store.attributes import MEASUREMENT_ATTR, PREDICTION_ATTR, QUEUED_ATTR

TARGETS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)
"""Budgets the sampler plans for, as fractions of the study's: the budget first, then the front."""
PER_TARGET = 3
"""How far down the front, from the fastest plan for a target, the sampler looks for one untried."""

Sampler = optuna.samplers.BaseSampler
"""The base every registered sampler derives from."""
SamplerFactory = Callable[[Space, int, "int | None"], Sampler]
"""Builds a sampler for ``(space, budget, seed)``."""
SAMPLERS: dict[str, SamplerFactory] = {}
"""The registry: each sampler kind a spec may name, by name, in the order they were registered."""


def register(kind: str) -> Callable[[SamplerFactory], SamplerFactory]:
    """Register the decorated factory as sampler ``kind``."""

    def add(factory: SamplerFactory) -> SamplerFactory:
        if kind in SAMPLERS:
            raise ValueError(f"sampler {kind!r} is registered already")
        SAMPLERS[kind] = factory
        return factory

    return add


def check_sampler(config: SamplerConfig) -> None:
    """Raise :class:`SpecError` unless ``config`` names a sampler of :data:`SAMPLERS`."""
    if config.kind not in SAMPLERS:
        raise SpecError(f"spec.sampler.kind: unknown sampler {config.kind!r}; expected one of {', '.join(SAMPLERS)}")


def make_sampler(config: SamplerConfig, *, space: Space, budget: int, offset: int = 0) -> Sampler:
    """The sampler a spec names (:data:`SAMPLERS`; see :func:`check_sampler`).

    ``offset`` (the study's trial count) moves the seed, so a resumed search does not replay
    the proposals of the session before it.
    """
    check_sampler(config)
    return SAMPLERS[config.kind](space, budget, None if config.seed is None else (config.seed + offset) % 2**32)


class PlannerSampler(Sampler):
    """Proposes the cost model's best plans for the budget and along the front, then the
    fastest untried neighbour of the front (one unit changed) predicted to fit, then TPE's.

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
        return self._space.params(prediction.choices, getattr(prediction, "configuration", None))

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
        :data:`PER_TARGET` that the study has not tried; else the fastest untried plan one unit
        away from the front that is predicted to fit the budget."""
        if self._space.configurations:
            return self._propose_configured(study)
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
        # Every plan of the front is tried (one plan may dominate all others): the fastest
        # untried plan one unit away from the front predicted to fit, so that the study measures
        # what is near the best rather than what TPE, with a few trials, would repeat.
        near = [
            prediction for plan in front for u, label in itertools.product(range(len(plan.choices)), model.labels)
            if (choices := (*plan.choices[:u], label, *plan.choices[u + 1:])) not in tried
            and (prediction := model.predict(choices)) is not None and prediction.peak * (1 + model.margin) <= self._budget
        ]
        if near:
            return min(near, key=lambda p: p.seconds), self._budget, model.observations, model.margin
        return None


    def _propose_configured(self, study: optuna.Study) -> tuple[Prediction, int, int, float] | None:
        """:meth:`_propose` in a space of configurations (:mod:`search.configured_model`).

        First each configuration nothing was measured at that is worth a compile
        (:meth:`ConfiguredModel.openings`: one with a trait no measured configuration has, or
        one whose guess could beat the best measured), in the order of its predicted time per
        token: its fastest plan predicted to fit the budget, so that its map is measured rather
        than assumed. Then, for each target, the candidate (plan and configuration) of the least
        predicted time per token among the best untried few. A configuration the workload refused
        (an infeasible trial: MaxText refuses its mesh) is proposed no more."""
        model = study_configured_model(study, self._space)
        if model is None:
            return None
        trials = study.get_trials(deepcopy=False)
        tried = set()
        for t in trials:
            params = t.user_attrs.get(QUEUED_ATTR) or t.params
            tried.add((self._space.choices(params, any_configuration=True), params.get(CONFIGURATION_PARAM)))
        refused = refused_configurations(trials)
        # the workload refuses those configurations (an infeasible trial: MaxText refuses its mesh): no more of them
        model = model.without(refused)
        for prediction in model.openings(self._budget):
            if (prediction.choices, prediction.configuration) not in tried:
                return prediction, self._budget, model.base.observations, model.margin
        front = model.front()
        for fraction in TARGETS:
            target = int(self._budget * fraction)
            fitting = sorted((p for p in front if p.peak * (1 + model.margin) <= target), key=lambda p: p.cost)
            for prediction in fitting[:PER_TARGET]:
                if (prediction.choices, prediction.configuration) not in tried:
                    return prediction, target, model.base.observations, model.margin
        return None


def refused_configurations(trials: Sequence[FrozenTrial]) -> set[str]:
    """The configurations (their parameter's labels) the workload refused in ``trials``: an
    infeasible trial's (MaxText refuses its mesh, say), which no plan at it changes."""
    return {
        (t.user_attrs.get(QUEUED_ATTR) or t.params).get(CONFIGURATION_PARAM) for t in trials
        if json.loads(t.user_attrs.get(MEASUREMENT_ATTR, "{}")).get("status") == "infeasible"
    }


def record_prediction(study: optuna.Study, trial: optuna.Trial) -> None:
    """Store on ``trial`` (user attribute ``prediction``) what the planner predicted for the
    plan it proposed there, once its parameters are suggested; nothing for other samplers'
    trials or queued ones."""
    sampler = study.sampler
    if isinstance(sampler, PlannerSampler) and (prediction := sampler.predictions.pop(trial.number, None)):
        trial.set_user_attr(PREDICTION_ATTR, prediction)



@register("planner")
def _planner(space: Space, budget: int, seed: int | None) -> Sampler:
    return PlannerSampler(space, budget, seed=seed)


@register("tpe")
def _tpe(space: Space, budget: int, seed: int | None) -> Sampler:
    # constant_liar: running trials count as bad results, so workers in parallel spread out
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)


@register("nsga2")
def _nsga2(space: Space, budget: int, seed: int | None) -> Sampler:
    return optuna.samplers.NSGAIISampler(seed=seed)


@register("random")
def _random(space: Space, budget: int, seed: int | None) -> Sampler:
    return optuna.samplers.RandomSampler(seed=seed)
