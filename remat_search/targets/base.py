"""Targets: where a plan will run, and what can be known there without running it.

``local`` is whatever devices this process sees: plans are compiled, run and timed there. A
TPU topology (``v5e:2x4``, …) is compiled ahead of time by the real TPU compiler in libtpu,
on any host: memory is exact, nothing is allocated or executed, and step time is *estimated*
from the compiled program, instruction by instruction, against the chip's published peak
FLOP/s, HBM and inter-chip bandwidths (:mod:`remat_search.targets.step_time`).

A kind of target is one :class:`Target` subclass in :data:`TARGETS`, under the tag of its
spec form (``spec.target_kind``): the devices plans are compiled for, whether plans execute
there, the memory per device, the compiler's version and the step-time estimate where nothing
executes. :func:`target_of` picks the class for a spec's ``target``, the one place that tells
kinds apart; ``tests/test_targets.py`` runs every class under the same contract.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from remat_search.errors import RunError, SpecError
from remat_search.spec.models import MESH_AXES, TargetConfig, TpuTarget, storage_home, target_kind
from remat_search.targets.step_time import CHIPS, StepEstimate, estimate_step

_OOM = re.compile(
    r"Ran out of memory.*?required for HLO temporaries \(([\d.]+)([KMGT]?)\).*?available HBM \(([\d.]+)([KMGT]?)\)",
    re.DOTALL,
)
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class Target(ABC):
    """Where plans are compiled for, and what can be known there: one subclass a kind.

    Built in the worker process (it loads the compiler), from the spec's ``target``.
    """

    executes: ClassVar[bool]
    """Whether plans run (and are timed) there, or are only compiled."""

    @property
    @abstractmethod
    def name(self) -> str:
        """How the study names it: ``local``, or the TPU topology."""

    @abstractmethod
    def devices(self) -> list[Any]:
        """The devices plans are compiled for (JAX devices, or a topology's: none allocated)."""

    @abstractmethod
    def mesh(self, axes: dict[str, int] | None) -> Any:
        """The ``Mesh`` plans are sharded over, with the spec's ``axes``; None for one device, unsharded."""

    @abstractmethod
    def memory_limit(self, mesh: Any) -> int | None:
        """Usable memory per device as its compiler or runtime reports it (None where none is)."""

    def estimate(self, hlo: str, cost: dict[str, float]) -> StepEstimate | None:
        """One step's time, modelled from the optimized program ``hlo`` (``Compiled.as_text()``)
        and the compiler's cost analysis ``cost``, where nothing executes
        (:func:`step_time.estimate_step`); None where plans run."""
        return None

    @property
    def platform(self) -> str:
        """``cpu``, ``gpu`` or ``tpu``: what the compiler compiles for."""
        return str(self.devices()[0].platform)

    def device_lock(self) -> contextlib.AbstractContextManager[None]:
        """Held while a plan holds the devices (its training state placed, stepped, timed): one
        plan at a time on this host's devices, whichever worker or search runs it, so that no
        two plans are timed at once or have their states on a device together. A lock file
        (``flock``) that the kernel releases when its holder dies, in the storage home: the
        folder that the workers of one host share (compose's worker replicas mount it as a
        volume; each container has a ``/tmp`` of its own)."""
        ids = ",".join(str(d.id) for d in self.devices())
        digest = hashlib.sha256(f"{self.platform}:{ids}".encode()).hexdigest()[:12]
        home = storage_home()
        home.mkdir(parents=True, exist_ok=True)
        return _file_lock(home / f"remat-search-device-{self.platform}-{digest}.lock")

    def compiler_version(self) -> str | None:
        """The TPU compiler's (libtpu's) version where plans are compiled for TPU, else None:
        XLA then comes with jaxlib, whose version the cache key holds already."""
        if self.platform != "tpu":
            return None
        try:
            return importlib.metadata.version("libtpu")
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


class LocalTarget(Target):
    """The devices this process sees: plans are compiled, run and timed on them."""

    executes = True

    def __init__(self, config: TargetConfig = "local") -> None:
        pass

    @property
    def name(self) -> str:
        return "local"

    def devices(self) -> list[Any]:
        import jax

        return list(jax.devices())

    def mesh(self, axes: dict[str, int] | None) -> Any:
        return make_mesh(self.devices(), axes) if axes else None

    def memory_limit(self, mesh: Any) -> int | None:
        """A GPU's or TPU's usable memory from its runtime (``bytes_limit``); None on CPU."""
        device = self.devices()[0]
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - not every backend implements it
            return None
        return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


class TpuAotTarget(Target):
    """A TPU topology compiled ahead of time by libtpu, from any host: nothing executes, and
    a step's time is estimated for the chip (:data:`step_time.CHIPS`)."""

    executes = False

    def __init__(self, config: TpuTarget) -> None:
        self.topology = config.topology
        generation = config.topology.split(":")[0]
        if generation not in CHIPS:
            raise SpecError(
                f"spec.target.topology: unknown TPU generation in {config.topology!r}; "
                f"expected one of {sorted(CHIPS)}, e.g. v5e:2x4"
            )
        self.chip = CHIPS[generation]
        self._devices: list[Any] | None = None

    @property
    def name(self) -> str:
        return self.topology

    def devices(self) -> list[Any]:
        if self._devices is None:
            self._devices = _topology_devices(self.topology)
        return self._devices

    def mesh(self, axes: dict[str, int] | None) -> Any:
        return make_mesh(self.devices(), axes)  # every chip of the topology, on data by default

    def memory_limit(self, mesh: Any) -> int:
        return probe_hbm(mesh)

    def estimate(self, hlo: str, cost: dict[str, float]) -> StepEstimate:
        return estimate_step(hlo, self.chip, cost)


TARGETS: dict[str, type[Target]] = {"local": LocalTarget, "tpu": TpuAotTarget}
"""Every kind of target by the tag of its spec form (``spec.target_kind``). A new kind is one
class here, and its form in ``spec.TargetConfig``."""


def target_of(config: TargetConfig) -> Target:
    """The target a spec's ``target`` names. Raises :class:`SpecError` for one that cannot be
    compiled for here (an unknown TPU generation or topology, no libtpu)."""
    kind = target_kind(config)
    if kind not in TARGETS:
        raise SpecError(f"spec.target: {config!r} is no kind of target; expected one of {', '.join(TARGETS)}")
    return TARGETS[kind](config)  # type: ignore[arg-type]


def _topology_devices(topology: str) -> list[Any]:
    """A TPU topology's devices, from libtpu (none allocated)."""
    try:
        import libtpu  # noqa: F401 - only its presence matters here
    except ImportError:
        raise SpecError(
            "spec.target: TPU targets need the TPU compiler (libtpu); "
            "install it with: pip install 'remat-search[tpu]'"
        ) from None
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    except Exception as e:  # noqa: BLE001 - libtpu says what is wrong with the name
        first = str(e).strip().splitlines()[0]
        raise SpecError(f"spec.target.topology: libtpu does not know {topology!r} ({first})") from None


def make_mesh(devices: list[Any], axes: dict[str, int] | None) -> Any:
    """A ``Mesh`` over ``devices`` with the spec's axes (default: all on ``data``).

    The axes are laid out in :func:`mesh_axis_order`; the devices are placed over them as
    ``jax.make_mesh`` (``mesh_utils.create_device_mesh``) places them, which follows a TPU
    topology's physical links (``v5e:2x2`` as ``[0, 1, 3, 2]``), as MaxText and a training
    script using ``jax.make_mesh`` do: the same program over another order needs other
    collectives, and other memory. Local CPU devices stay in their own order. The axes are
    left ``Auto``, as ``Mesh(devices, names)`` makes them (``jax.make_mesh`` would make them
    ``Explicit``, another way of tracing). Where ``jax.make_mesh`` cannot place them (a
    ``v4`` topology's two cores a chip), they stay in id order, and :func:`device_order` says so."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    axes = dict(axes) if axes else {"data": len(devices)}
    if math.prod(axes.values()) != len(devices):
        raise SpecError(
            f"spec.mesh: {axes} spans {math.prod(axes.values())} devices, the target has {len(devices)}"
        )
    names = mesh_axis_order(axes)
    shape = tuple(axes[a] for a in names)
    try:
        placed = jax.make_mesh(shape, names, devices=devices).devices
    except (AssertionError, ValueError, NotImplementedError):  # mesh_utils' ways of saying it cannot
        placed = np.array(devices).reshape(shape)
    return Mesh(placed, names)


def mesh_axis_order(axes: dict[str, int]) -> tuple[str, ...]:
    """The order a mesh lays ``axes`` out in: the built-in ones (:data:`~remat_search.spec.models.MESH_AXES`)
    first, in that order, then the others as written."""
    return tuple(a for a in MESH_AXES if a in axes) + tuple(a for a in axes if a not in MESH_AXES)


def device_order(mesh: Any) -> list[int] | None:
    """The ids of ``mesh``'s devices in its row-major order, where that is not the devices' own
    order (ids ascending, as a flat reshape would keep them); None where it is, or no mesh."""
    if mesh is None:
        return None
    ids = [int(d.id) for d in mesh.devices.flat]
    return None if ids == sorted(ids) else ids


def out_of_memory(error: BaseException) -> tuple[int, int] | None:
    """(required, available) bytes from the TPU compiler's out-of-memory error, else None."""
    match = _OOM.search(str(error))
    if match is None:
        return None
    return (int(float(match[1]) * _UNIT[match[2]]), int(float(match[3]) * _UNIT[match[4]]))


def probe_hbm(mesh: Any) -> int:
    """Usable HBM per chip as the TPU compiler reports it, from a program too big for any chip
    (see :func:`hbm_of`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    too_big = jax.jit(lambda: jnp.zeros((2**38,), jnp.float32), out_shardings=NamedSharding(mesh, PartitionSpec()))
    try:
        too_big.lower().compile()
    except Exception as e:  # noqa: BLE001 - judged by hbm_of: all but the out-of-memory report raise
        return hbm_of(e)
    return hbm_of(None)


def hbm_of(error: BaseException | None) -> int:
    """The HBM per chip that the compiler's out-of-memory ``error`` states it had. Any other
    error, or none (the program compiled), raises :class:`RunError` with the reason: a memory
    limit that cannot be read is no budget to search under."""
    oom = out_of_memory(error) if error is not None else None
    if oom is not None:
        return oom[1]
    if error is None:
        reason = "a program of 1 TiB a chip compiled without running out of memory"
    else:
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    raise RunError(f"target: the compiler did not state the memory of a chip ({reason})") from error


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (made if missing), waiting for it as long as it takes."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
