"""The configurations a study searches (``spec.configuration``): every per-device batch with
every mesh the study's devices allow, and, at a fixed global batch, the accumulation that
makes it up; each checked before anything is written.

The plan carries its configuration (:class:`~remat_search.plans.configuration.Configuration`);
the worker builds the workload at its batch over its mesh (``workloads.base.build_workload``).
"""

from __future__ import annotations

import math

from remat_search.errors import SpecError
from remat_search.plans.configuration import BATCH_AXES, Configuration
from remat_search.spec.models import ConfigurationSpace, SearchSpec
from remat_search.spec.workloads import FactoryConfig, MaxTextConfig, MlpConfig, WorkloadConfig


def check_workload(spec: SearchSpec) -> None:
    """A :class:`SpecError` where the spec searches configurations of a workload whose batch
    the search cannot set (a factory that takes no ``batch`` argument)."""
    if spec.configuration is None:
        return
    if isinstance(spec.workload, FactoryConfig) and "batch" not in spec.workload.args:
        raise SpecError(
            "spec.configuration: a factory workload's batch is its own; give the factory a batch "
            "argument (workload.args.batch) for the search to set"
        )


def configurations(config: ConfigurationSpace, *, devices: int, mesh: dict[str, int] | None, sequence: int) -> tuple[Configuration, ...]:
    """Every configuration of ``config`` over ``devices`` devices (``mesh``: the study's own,
    for ``config.mesh`` null), in the spec's order, meshes first; examples of ``sequence`` tokens.

    A :class:`SpecError` names the field where a mesh does not span the devices, or no batch
    and mesh divide the global batch."""
    meshes = _meshes(config, devices=devices, mesh=mesh)
    found = []
    for axes in meshes:
        ways = math.prod(axes.get(a, 1) for a in BATCH_AXES)
        for batch in config.batch:
            accumulation = 1
            if config.global_batch is not None:
                if config.global_batch % (batch * ways):
                    continue
                accumulation = config.global_batch // (batch * ways)
            found.append(Configuration(batch=batch, accumulation=accumulation, mesh=tuple(axes.items()), sequence=sequence))
    if not found:
        raise SpecError(
            f"spec.configuration.global_batch: {config.global_batch} is a multiple of batch × data-parallel "
            f"devices for no batch of {list(config.batch)} and mesh of "
            f"{', '.join(str(m) if m else 'one device' for m in meshes)}; give a global batch that one of them divides"
        )
    return tuple(found)


def _meshes(config: ConfigurationSpace, *, devices: int, mesh: dict[str, int] | None) -> list[dict[str, int]]:
    if config.mesh is None:
        return [dict(mesh or {})]
    if config.mesh == "all":
        splits = [d for d in range(1, devices + 1) if devices % d == 0]
        return [{a: n for a, n in (("data", d), ("fsdp", devices // d)) if n > 1} for d in splits]
    for i, axes in enumerate(config.mesh):
        if math.prod(axes.values()) != devices:
            raise SpecError(
                f"spec.configuration.mesh.{i}: {axes} spans {math.prod(axes.values())} devices; the study's "
                f"devices are {devices} (spec.mesh: {mesh or 'one device'}): give meshes that span them"
            )
    return [dict(axes) for axes in config.mesh]


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
