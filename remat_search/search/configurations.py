"""The configurations a study searches (``spec.configuration``): every per-device batch with
every mesh the study's devices allow, and, at a fixed global batch, the accumulation that
makes it up; each checked before anything is written.

The plan carries its configuration (:class:`~remat_search.plans.configuration.Configuration`);
the worker builds the workload at its batch over its mesh (``workloads.base.build_workload``).
"""

from __future__ import annotations

import itertools
import math

from remat_search.errors import SpecError
from remat_search.plans.configuration import BATCH_AXES, Configuration
from remat_search.spec.models import ConfigurationSpace, SearchSpec
from remat_search.spec.workloads import (
    MESH_AXES,
    FactoryConfig,
    MaxTextConfig,
    MlpConfig,
    WorkloadConfig,
    rule_targets,
)


def check_workload(spec: SearchSpec) -> None:
    """A :class:`SpecError` where the spec searches configurations of a workload whose batch
    the search cannot set (a factory that takes no ``batch`` argument), or settings of a
    workload other than MaxText's, or a setting MaxText refuses (each value read by MaxText's
    loader)."""
    if spec.configuration is None:
        return
    for key, values in spec.configuration.settings.items():
        if not isinstance(spec.workload, MaxTextConfig):
            raise SpecError(
                f"spec.configuration.settings.{key}: only a kind: maxtext workload has settings to search "
                f"(this one is kind {spec.workload.kind})"
            )
        from remat_search.spec.maxtext import maxtext_config

        for value in values:
            try:
                maxtext_config(spec.workload, {key: value})
            except SpecError as e:
                raise SpecError(f"spec.configuration.settings.{key}: {str(e).removeprefix('spec.workload: ')}") from None
    if isinstance(spec.workload, FactoryConfig) and "batch" not in spec.workload.args:
        raise SpecError(
            "spec.configuration: a factory workload's batch is its own; give the factory a batch "
            "argument (workload.args.batch) for the search to set"
        )


def configurations(
    config: ConfigurationSpace, *, devices: int, mesh: dict[str, int] | None, sequence: int,
    axes: tuple[str, ...] = ("data", "fsdp"), strict: bool = False,
) -> tuple[Configuration, ...]:
    """Every configuration of ``config`` over ``devices`` devices (``mesh``: the study's own,
    for ``config.mesh`` null), in the spec's order, meshes first; examples of ``sequence``
    tokens. ``axes``: what ``mesh: all`` splits the devices over (:func:`search_axes`); with
    ``strict``, the only axes a listed mesh may name (MaxText's: it refuses others).

    A :class:`SpecError` names the field where a mesh does not span the devices, or no batch
    and mesh divide the global batch."""
    meshes = _meshes(config, devices=devices, mesh=mesh, axes=axes, strict=strict)
    settings = [tuple(zip(config.settings, values, strict=True)) for values in itertools.product(*config.settings.values())]
    found = []
    for axes in meshes:
        ways = math.prod(axes.get(a, 1) for a in BATCH_AXES)
        for batch in config.batch:
            accumulation = 1
            if config.global_batch is not None:
                if config.global_batch % (batch * ways):
                    continue
                accumulation = config.global_batch // (batch * ways)
            found += [Configuration(batch=batch, accumulation=accumulation, mesh=tuple(axes.items()), sequence=sequence,
                                    settings=these) for these in settings]
    if not found:
        raise SpecError(
            f"spec.configuration.global_batch: {config.global_batch} is a multiple of batch × data-parallel "
            f"devices for no batch of {list(config.batch)} and mesh of "
            f"{', '.join(str(m) if m else 'one device' for m in meshes)}; give a global batch that one of them divides"
        )
    return tuple(found)


def _meshes(
    config: ConfigurationSpace, *, devices: int, mesh: dict[str, int] | None, axes: tuple[str, ...], strict: bool
) -> list[dict[str, int]]:
    if config.mesh is None:
        return [dict(mesh or {})]
    if config.mesh == "all":
        return splits(devices, axes)
    for i, given in enumerate(config.mesh):
        if math.prod(given.values()) != devices:
            raise SpecError(
                f"spec.configuration.mesh.{i}: {given} spans {math.prod(given.values())} devices; the study's "
                f"devices are {devices} (spec.mesh: {mesh or 'one device'}): give meshes that span them"
            )
        foreign = [a for a in given if a not in axes]
        if strict and foreign:
            raise SpecError(
                f"spec.configuration.mesh.{i}: the workload shards over no axis {foreign[0]!r}; its axes are "
                f"{', '.join(axes)}"
            )
    return [dict(given) for given in config.mesh]


def splits(devices: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every mesh of ``devices`` devices over ``axes`` (which hold ``fsdp``), each axis of more
    than one device, in the order of ``axes``: FSDP over all of them first, then each other
    axis's share growing (the first axis's slowest), FSDP taking what is left."""
    others = [a for a in axes if a != "fsdp"]

    def grow(left: int, rest: list[str]) -> list[dict[str, int]]:
        if not rest:
            return [{"fsdp": left}]
        return [{rest[0]: d, **more} for d in range(1, left + 1) if left % d == 0 for more in grow(left // d, rest[1:])]

    return [{a: m[a] for a in axes if m[a] > 1} for m in grow(devices, others)]


def sequence_of(workload: WorkloadConfig) -> int:
    """Tokens an example of ``workload`` holds (1 where it has no sequence: examples are counted)."""
    if isinstance(workload, FactoryConfig):
        return int(workload.args.get("seq_len", 1))
    if isinstance(workload, MlpConfig):
        return 1
    if isinstance(workload, MaxTextConfig):  # MaxText's own, as its loader reads the spec's settings
        from remat_search.spec.maxtext import maxtext_config

        return int(maxtext_config(workload).max_target_length)
    return workload.seq_len


MAXTEXT_AXES = ("data", "fsdp", "fsdp_transpose", "context", "tensor", "tensor_sequence")
"""The mesh axes MaxText's logical axis rules split a dense model's training step over (its
``ici_*_parallelism`` settings): the batch over ``data``, ``fsdp`` and ``fsdp_transpose``, the
sequence over ``context`` (MaxText's sequence parallelism: its ``sequence`` axis is in no rule
and no mesh of 0.2.5's), heads and MLP over ``tensor`` and ``tensor_sequence``; and ``expert``
for a model with experts. Pipeline stages, DiLoCo and the inference axes are not searched."""


def search_axes(workload: WorkloadConfig) -> tuple[tuple[str, ...], bool]:
    """The mesh axes ``configuration.mesh: all`` splits ``workload``'s devices over: ``data``
    and ``fsdp`` (the batch's, and the built-in workloads' state's), then every other axis the
    spec's ``logical_axis_rules`` map onto (a linen or NNX model); MaxText's own
    (:data:`MAXTEXT_AXES`). And whether those are the only axes a mesh may name (MaxText's)."""
    if isinstance(workload, MaxTextConfig):
        from remat_search.spec.maxtext import maxtext_config

        experts = int(maxtext_config(workload).num_experts) > 1
        return MAXTEXT_AXES + (("expert",) if experts else ()), True
    rules = getattr(workload, "logical_axis_rules", None)
    named = rule_targets(rules) - {"data", "fsdp"} if rules else set()
    return ("data", "fsdp", *sorted(named, key=lambda a: (MESH_AXES.index(a) if a in MESH_AXES else len(MESH_AXES), a))), False
