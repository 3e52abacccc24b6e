"""The space of plans a study may propose, and how optuna walks it.

``uniform`` gives every layer the same choice (one categorical parameter, ``policy``);
``per_layer`` gives each layer its own (``layer_00``, ``layer_01``, …); ``segments`` gives
each contiguous group of layers its own (``segment_00``, …). With ``nested: true`` one more
parameter, ``layout``, picks ``flat`` or ``nested`` (recursive checkpointing). The uniform
plan of every choice — the presets people pick by hand — is what :func:`preset_params`
enqueues first, so every study shows them beside what the search finds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import optuna

from remat_search.errors import SpecError
from remat_search.plan import RematPlan
from remat_search.spec import SpaceConfig

LAYOUT_PARAM = "layout"
"""The parameter of a ``nested: true`` space that picks the plan's layout."""
LAYOUTS = ("flat", "nested")


def param_names(space: SpaceConfig, layers: int) -> list[str]:
    """The names of the per-unit choice parameters of a space, for ``layers`` layers.

    ``policy`` (uniform), ``layer_NN`` (per_layer) or ``segment_NN`` (segments); the
    ``layout`` parameter of a nested space is not one of them.
    """
    if space.layout == "uniform":
        return ["policy"]
    if space.layout == "segments":
        return [f"segment_{i:02d}" for i in range(len(segment_sizes(space, layers)))]
    return [f"layer_{i:02d}" for i in range(layers)]


def unit_layers(space: SpaceConfig, layers: int) -> list[list[int]]:
    """For each of :func:`param_names`, in order, the layer indices its choice applies to."""
    if space.layout == "uniform":
        return [list(range(layers))]
    if space.layout == "per_layer":
        return [[i] for i in range(layers)]
    units, start = [], 0
    for size in segment_sizes(space, layers):
        units.append(list(range(start, start + size)))
        start += size
    return units


def segment_sizes(space: SpaceConfig, layers: int) -> list[int]:
    """The sizes of a ``segments`` space's groups: N near-equal (earlier groups take the
    remainder), or the spec's list as given (:func:`check_space` checks it sums to ``layers``)."""
    if isinstance(space.segments, int):
        n = min(space.segments, layers)
        return [layers // n + (1 if i < layers % n else 0) for i in range(n)]
    if space.segments is None:
        raise SpecError("spec.space.segments: required with layout: segments")
    return list(space.segments)


def suggest_plan(space: SpaceConfig, layers: int, trial: optuna.Trial) -> RematPlan:
    """Ask ``trial`` for one choice per parameter (and the layout, if nested) and build the plan."""
    labels = [c.label for c in space.choices]
    params = {name: trial.suggest_categorical(name, labels) for name in param_names(space, layers)}
    if space.nested:
        params[LAYOUT_PARAM] = trial.suggest_categorical(LAYOUT_PARAM, list(LAYOUTS))
    return plan_from_params(space, layers, params)


def plan_from_params(space: SpaceConfig, layers: int, params: dict[str, Any]) -> RematPlan:
    """The plan a trial's parameters stand for (``layout`` absent means flat)."""
    policies: list[Any] = [None] * layers
    for name, unit in zip(param_names(space, layers), unit_layers(space, layers), strict=True):
        for i in unit:
            policies[i] = space.policy(params[name])
    return RematPlan(layers=tuple(policies), layout=params.get(LAYOUT_PARAM, "flat"))


def layer_labels(space: SpaceConfig, layers: int, params: dict[str, Any]) -> tuple[str, ...]:
    """The choice label of each layer under a trial's parameters (what tables print)."""
    labels = [""] * layers
    for name, unit in zip(param_names(space, layers), unit_layers(space, layers), strict=True):
        for i in unit:
            labels[i] = str(params[name])
    return tuple(labels)


def preset_params(space: SpaceConfig, layers: int) -> list[dict[str, str]]:
    """Trial parameters of the uniform plan of every choice, in the spec's order.

    A ``nested: true`` space's flat presets carry ``layout: flat``, and one more preset
    follows them: the nested plan with no policy inside (every layer on the first choice
    whose policy is ``none``), the JAX guide's recursive checkpointing. Without such a
    choice there is no nested preset.
    """
    names = param_names(space, layers)
    layout = {LAYOUT_PARAM: "flat"} if space.nested else {}
    presets = [{**{name: c.label for name in names}, **layout} for c in space.choices]
    none = next((c.label for c in space.choices if not c.policy.checkpoints), None)
    if space.nested and none is not None:
        presets.append({**{name: none for name in names}, LAYOUT_PARAM: "nested"})
    return presets


def check_space(space: SpaceConfig, *, layers: int, tensor_names: Iterable[str]) -> None:
    """Raise :class:`SpecError` if a choice names a tensor the workload does not declare, or
    the segments do not fit the workload's layers."""
    if isinstance(space.segments, int) and space.segments > layers:
        raise SpecError(
            f"spec.space.segments: {space.segments} groups for a workload of {layers} layers; "
            f"give at most {layers}"
        )
    if isinstance(space.segments, tuple) and sum(space.segments) != layers:
        raise SpecError(
            f"spec.space.segments: sizes {list(space.segments)} sum to {sum(space.segments)}, "
            f"the workload has {layers} layers"
        )
    known = set(tensor_names)
    for i, choice in enumerate(space.choices):
        unknown = sorted(set(choice.policy.names) - known)
        if unknown:
            raise SpecError(
                f"spec.space.choices.{i}: unknown tensor name(s) {unknown} in {choice.label!r}; "
                f"the workload names {sorted(known) or 'no tensors'}"
            )
