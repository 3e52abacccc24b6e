"""Targets: where a plan will run, and what can be known there without running it.

``local`` is whatever devices this process sees: plans are compiled, run and timed there. A
TPU topology (``v5e:2x4``, …) is compiled ahead of time by the real TPU compiler in libtpu,
on any host: memory is exact, nothing is allocated or executed, and step time is *estimated*
from the compiled program, instruction by instruction, against the chip's published peak
FLOP/s, HBM and inter-chip bandwidths (:mod:`remat_search.targets.step_time`).

A kind of target is one :class:`Target` subclass in a module of its own (``targets/local.py``,
``targets/tpu.py``), named in :data:`TARGETS` under the tag of its spec form
(``spec.target_kind``): the devices plans are compiled for, whether plans execute there, the
memory per device, the compiler's version and the step-time estimate where nothing executes.
:func:`target_of` picks the class for a spec's ``target``, the one place that tells kinds
apart; ``tests/targets/test_targets.py`` runs every class under the same contract. What tells
platforms (``cpu``, ``gpu``, ``tpu``) apart is :mod:`remat_search.targets.platform`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from remat_search.errors import SpecError
from remat_search.spec.models import TargetConfig, target_kind
from remat_search.store.location import storage_home
from remat_search.targets.platform import is_tpu
from remat_search.targets.step_time import StepEstimate

_OOM = re.compile(
    r"Ran out of memory.*?required for HLO temporaries \(([\d.]+)([KMGT]?)\).*?available HBM \(([\d.]+)([KMGT]?)\)",
    re.DOTALL,
)
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OOM_IN_SPACE = re.compile(
    r"Ran out of memory in memory space hbm\. Used [\d.]+[KMGT]? of ([\d.]+)([KMGT]?) hbm\. "
    r"Exceeded hbm capacity by ([\d.]+)([KMGT]?).*?HLO temp\s+([\d.]+)([KMGT]?)",
    re.DOTALL,
)
"""The same verdict as libtpu words it under other flags (``CompileTimeHbmOom``: the HBM and by
how much the program exceeds it, then a breakdown whose ``HLO temp`` line is the temporaries)."""


class OutOfMemory(NamedTuple):
    """The TPU compiler's out-of-memory verdict, in bytes a chip."""

    temp: int
    """The temporaries the program needs."""
    available: int
    """The HBM the compiler had."""
    required: int | None = None
    """All the program needs (arguments and outputs too), where the verdict states it."""


class Target(ABC):
    """Where plans are compiled for, and what can be known there: one subclass a kind.

    Built in the worker process (it loads the compiler), from the spec's ``target``.
    """

    executes: ClassVar[bool]
    """Whether plans run (and are timed) there, or are only compiled."""

    @property
    def keeps_programs(self) -> bool:
        """Whether a study keeps each compiled program (``measure.artifacts.PROGRAMS``): where
        plans are timed, each is a calibration sample; elsewhere only where the spec asks."""
        return self.executes

    @property
    @abstractmethod
    def name(self) -> str:
        """How the study names it: ``local``, or the TPU topology (with the host link where the spec gives one)."""

    @abstractmethod
    def devices(self) -> list[Any]:
        """The devices plans are compiled for (JAX devices, or a topology's: none allocated)."""

    @abstractmethod
    def mesh(self, axes: dict[str, int] | None) -> Any:
        """The ``Mesh`` plans are sharded over, with the spec's ``axes``; None for one device, unsharded."""

    @abstractmethod
    def memory_limit(self, mesh: Any) -> int | None:
        """Usable memory per device as its compiler or runtime reports it (None where none is)."""

    def estimate(self, hlo: str, cost: dict[str, float], kind: str = "recompute",
                 mesh: dict[str, int] | None = None) -> StepEstimate | None:
        """One step's time, modelled from the optimized program ``hlo`` (``Compiled.as_text()``)
        and the compiler's cost analysis ``cost``, where nothing executes
        (:func:`step_time.estimate_step`), with the error band of its plan's ``kind`` (keep,
        recompute, offload: ``targets.calibration``), marked where its ``mesh`` (axis sizes by
        name) or kind lies outside the samples of that band; None where plans run."""
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
        volume; each container has a ``/tmp`` of its own). On a slice, this process's devices
        (each process of a slice holds its own, in step with the others)."""
        import jax

        mine = [d for d in self.devices() if jax.process_count() == 1 or d.process_index == jax.process_index()]
        ids = ",".join(str(d.id) for d in mine)
        digest = hashlib.sha256(f"{self.platform}:{ids}".encode()).hexdigest()[:12]
        home = storage_home()
        home.mkdir(parents=True, exist_ok=True)
        return _file_lock(home / f"remat-search-device-{self.platform}-{digest}.lock")

    def compiler_version(self) -> str | None:
        """The TPU compiler's (libtpu's) version where plans are compiled for TPU, else None:
        XLA then comes with jaxlib, whose version the cache key holds already."""
        if not is_tpu(self.platform):
            return None
        try:
            return importlib.metadata.version("libtpu")
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


TARGETS: dict[str, str] = {
    "local": "remat_search.targets.local:LocalTarget",
    "tpu": "remat_search.targets.tpu:TpuAotTarget",
}
"""Every kind of target by the tag of its spec form (``spec.target_kind``), as ``module:Class``
(the base imports no kind: each builds on it). A new kind is one module with its class, named
here, and its form in ``spec.TargetConfig``."""


def target_class(kind: str) -> type[Target]:
    """The class of the kind of target tagged ``kind`` in :data:`TARGETS`."""
    module_name, class_name = TARGETS[kind].split(":")
    return getattr(importlib.import_module(module_name), class_name)  # type: ignore[no-any-return]


def target_of(config: TargetConfig) -> Target:
    """The target a spec's ``target`` names. Raises :class:`SpecError` for one that cannot be
    compiled for here (an unknown TPU generation or topology, no libtpu)."""
    kind = target_kind(config)
    if kind not in TARGETS:
        raise SpecError(f"spec.target: {config!r} is no kind of target; expected one of {', '.join(TARGETS)}")
    return target_class(kind)(config)  # type: ignore[call-arg]


def out_of_memory(error: BaseException) -> OutOfMemory | None:
    """The TPU compiler's out-of-memory verdict in ``error``, else None: the verdict of a
    compiler that refuses a program over the memory it has (compiling for a TPU here or ahead
    of time; other compilers state none)."""
    said = str(error)

    def size(number: str, unit: str) -> int:
        return int(float(number) * _UNIT[unit])

    if match := _OOM.search(said):
        return OutOfMemory(size(match[1], match[2]), size(match[3], match[4]))
    if match := _OOM_IN_SPACE.search(said):
        available = size(match[1], match[2])
        return OutOfMemory(size(match[5], match[6]), available, available + size(match[3], match[4]))
    return None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (made if missing), waiting for it as long as it takes."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
