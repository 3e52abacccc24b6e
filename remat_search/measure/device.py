"""The device identity: what plans are compiled for, as the worker's JAX sees it, and what of
it keys a measurement and a study's saved reference (the devices, the mesh and its shardings,
the workload's program, the compiler and its packages)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

from remat_search.measure.executables import INPUT_SEED, anchor_plan
from remat_search.measure.measurement import MEASUREMENT_SCHEMA
from remat_search.measure.slice import compile_flags
from remat_search.targets.base import Target
from remat_search.targets.mesh import device_order
from remat_search.targets.platform import compiler_options, compiler_package_names


class DeviceInfo(BaseModel):
    """What plans are compiled for, as the worker's JAX sees it."""

    model_config = ConfigDict(frozen=True)

    target: str
    """``local`` or the TPU topology (with the host link where the spec gives one: ``v5e:2x2, host link 64GB/s``)."""
    platform: str
    device_kind: str
    device_count: int
    processes: int = 1
    """The processes (hosts) of the slice the devices are on (``jax.process_count()``): 1 on one host."""
    mesh: dict[str, int] | None
    device_order: list[int] | None = None
    """The devices' ids in the mesh's row-major order where it is not their own (ascending):
    ``jax.make_mesh``'s placement over a TPU topology's links (``target.device_order``). None:
    their own order, as every study measured before this field existed was (part of the cache
    key and of the study's identity)."""
    memory_limit: int | None
    """Usable memory per device as its compiler or runtime reports it (None on CPU)."""
    executes: bool
    """Whether plans run here (local) or are only compiled (a TPU target from elsewhere)."""
    jax_version: str
    workload_fingerprint: str
    compiler_options: str = ""
    """The options and XLA flags plans are compiled with: part of the measurement cache key."""
    compiler_version: str | None = None
    """libtpu's version where plans are compiled for TPU (it is the compiler): part of the key."""
    compiler_packages: str = ""
    """The versions of the packages that compile plans here (:func:`compiler_packages`): part of
    the measurement cache's key and of the saved reference's; "" where a study stored its device
    before the field existed."""
    measurement_schema: int = 0
    """:data:`measurement.MEASUREMENT_SCHEMA` of the worker: what its measurements mean (part
    of the key; 0 where a study stored its device before the field existed)."""
    program_fingerprint: str = ""
    """Hash of the no-remat step's jaxpr: the workload's code, not only its shapes (cache key)."""
    traced_names: tuple[str, ...] | None = None
    """The ``checkpoint_name`` tags the traced step emits (None: it did not trace)."""
    traced_bytes: dict[str, int] | None = None
    """The bytes each of those tags marks in the traced step (``TracedStep.sizes``): what a
    ``layout: tensors`` space's cost model weighs each tensor by. None: not traced."""
    shardings: str | None = None
    """Over a mesh, where the state's shardings come from (:meth:`Workload.sharding_source`):
    the model's own partitioning or the FSDP heuristic; None without a mesh."""
    sharding_digest: str = ""
    """Hash of the state's and batch's ``PartitionSpec`` s over the mesh ("" without one):
    part of the measurement cache key, as the model's partitioning changes per-chip memory."""
    workload_note: str | None = None
    """What the workload chose for this target that its spec left open, in a line
    (:meth:`Workload.note`: ``attention: auto → flash (Pallas TPU kernel)``); None if nothing."""


def compiler_packages(platform: str) -> str:
    """The versions of what compiles plans for ``platform`` here, as ``name version`` pairs:
    jaxlib (XLA, whose CPU compiler it carries), libtpu for TPU, the CUDA plugin for GPU, each
    where installed. A measurement or reference made with other versions is not reused."""
    return ", ".join(installed_versions(compiler_package_names(platform)))


def installed_versions(names: Iterable[str]) -> list[str]:
    """``name version`` of each of the packages ``names`` that is installed here."""
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def reference_parts(info: DeviceInfo, layers: int) -> dict[str, Any]:
    """What a study's saved reference first step depends on (:func:`artifacts.reference_key`):
    the device and mesh, the state's shardings over it, the workload's shapes and program, the
    compiler, the anchor plan and the input seed."""
    return {
        **info.model_dump(include={
            "target", "platform", "device_kind", "device_count", "mesh", "shardings", "sharding_digest",
            "jax_version", "workload_fingerprint", "program_fingerprint", "compiler_options", "compiler_version",
            "compiler_packages",
        }),
        "anchor": anchor_plan(layers).digest, "input_seed": INPUT_SEED, "schema": MEASUREMENT_SCHEMA,
    }


def describe(target: Target, mesh: Any, workload: Any, traced: Any) -> DeviceInfo:
    """The identity of the worker's devices: ``target`` and its ``mesh``, with ``workload``
    (given the mesh) and its no-remat step ``traced`` (:func:`workloads.tracing.trace_step`)."""
    import jax

    return DeviceInfo(
        target=target.name, platform=target.platform, device_kind=target.devices()[0].device_kind,
        device_count=mesh.size if mesh is not None else 1, processes=jax.process_count(),
        mesh=dict(mesh.shape) if mesh is not None else None,
        device_order=device_order(mesh),
        memory_limit=target.memory_limit(mesh), executes=target.executes, jax_version=jax.__version__,
        workload_fingerprint=workload.fingerprint(),
        program_fingerprint=traced.fingerprint,
        traced_names=None if traced.names is None else tuple(sorted(traced.names)),
        traced_bytes=traced.sizes,
        shardings=workload.sharding_source() if mesh is not None else None,
        sharding_digest=sharding_digest(workload, mesh),
        workload_note=workload.note(),
        compiler_options=json.dumps({
            "options": compiler_options(target.platform),
            "XLA_FLAGS": compile_flags(os.environ.get("XLA_FLAGS", "")), "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
        }, sort_keys=True),
        compiler_version=target.compiler_version(),
        compiler_packages=compiler_packages(target.platform),
        measurement_schema=MEASUREMENT_SCHEMA,
    )


def sharding_digest(workload: Any, mesh: Any) -> str:
    """See :attr:`DeviceInfo.sharding_digest`."""
    if mesh is None:
        return ""
    import jax

    specs = [str(s.spec) for s in jax.tree.leaves(workload.input_shardings(mesh))]
    return hashlib.sha256(json.dumps(specs).encode()).hexdigest()[:16]
