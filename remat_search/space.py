"""The space of plans a study may propose, and how optuna walks it.

``uniform`` gives every layer the same choice (one categorical parameter, ``policy``);
``per_layer`` gives each layer its own (``layer_00``, ``layer_01``, …). The uniform plan of
every choice — the presets people pick by hand — is what :func:`preset_params` enqueues
first, so every study shows them beside what the search finds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import optuna

from remat_search.errors import SpecError
from remat_search.plan import RematPlan
from remat_search.spec import SamplerConfig, SpaceConfig


def param_names(space: SpaceConfig, layers: int) -> list[str]:
    """The optuna parameter names of a space for a workload of ``layers`` layers."""
    if space.layout == "uniform":
        return ["policy"]
    return [f"layer_{i:02d}" for i in range(layers)]


def suggest_plan(space: SpaceConfig, layers: int, trial: optuna.Trial) -> RematPlan:
    """Ask ``trial`` for one choice per parameter and build the plan."""
    labels = [c.label for c in space.choices]
    params = {name: trial.suggest_categorical(name, labels) for name in param_names(space, layers)}
    return plan_from_params(space, layers, params)


def plan_from_params(space: SpaceConfig, layers: int, params: dict[str, Any]) -> RematPlan:
    """The plan a trial's parameters stand for."""
    if space.layout == "uniform":
        return RematPlan.uniform(space.policy(params["policy"]), layers)
    return RematPlan(layers=tuple(space.policy(params[n]) for n in param_names(space, layers)))


def preset_params(space: SpaceConfig, layers: int) -> list[dict[str, str]]:
    """Trial parameters of the uniform plan of every choice, in the spec's order."""
    return [{name: c.label for name in param_names(space, layers)} for c in space.choices]


def check_space(space: SpaceConfig, *, layers: int, tensor_names: Iterable[str]) -> None:
    """Raise :class:`SpecError` if a choice names a tensor the workload does not declare."""
    known = set(tensor_names)
    for i, choice in enumerate(space.choices):
        unknown = sorted(set(choice.policy.names) - known)
        if unknown:
            raise SpecError(
                f"spec.space.choices.{i}: unknown tensor name(s) {unknown} in {choice.label!r}; "
                f"the workload names {sorted(known) or 'no tensors'}"
            )


def make_sampler(config: SamplerConfig, *, offset: int = 0) -> optuna.samplers.BaseSampler:
    """The optuna sampler of a spec; all but ``random`` learn from the budget constraint.

    ``offset`` (the study's trial count) moves the seed, so a resumed search does not replay
    the proposals of the session before it.
    """
    seed = None if config.seed is None else config.seed + offset
    if config.kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if config.kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)
