"""The worker protocol: the messages a :class:`~remat_search.measure.runner.Runner` and its
worker process send each other over their ``multiprocessing`` connection, one class a kind.

The worker starts by saying :class:`Ready` (or why it could not: :class:`StartFailed`); then
the runner asks :class:`Measure` or :class:`Retime`, and the worker answers :class:`Done` or
:class:`Failed`. While measuring, the worker may ask the runner whether a compiled program was
measured before (:class:`Program`); the runner answers :class:`Known`. Plans and measurements
travel as their JSON, as they are stored. Frozen dataclasses: pickled by the connection, and
importable by the spawned worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from remat_search.spec.models import TimingConfig


@dataclass(frozen=True)
class Ready:
    """Worker → runner: the workload is built; ``info`` is its :class:`DeviceInfo` as JSON."""

    info: str


@dataclass(frozen=True)
class StartFailed:
    """Worker → runner: the worker could not build its workload or target, and why (one line):
    the spec's fault (``spec``), the target's compiler (``run``), joining its slice's JAX job
    (``slice``: a process of the slice is gone), or anything else (``other``)."""

    kind: Literal["spec", "run", "slice", "other"]
    reason: str


@dataclass(frozen=True)
class Measure:
    """Runner → worker: measure ``plan`` (a :class:`RematPlan` as JSON) against ``budget``;
    ``ask`` says whether the worker asks :class:`Program` before running it."""

    plan: str
    budget: int
    timing: TimingConfig
    gradient_tolerance: float | None
    ask: bool


@dataclass(frozen=True)
class Retime:
    """Runner → worker: time ``plans`` (as JSON) interleaved; a plan over ``budget`` is refused."""

    plans: list[str]
    warmup: int
    rounds: int
    budget: int | None


@dataclass(frozen=True)
class Program:
    """Worker → runner, while measuring: is there a measurement of the compiled program with
    this digest (:func:`executables.program_digest`)? The worker waits for :class:`Known`."""

    digest: str


@dataclass(frozen=True)
class Known:
    """Runner → worker: the answer to :class:`Program`, a raw measurement as JSON, or None."""

    measurement: str | None


@dataclass(frozen=True)
class Done:
    """Worker → runner: what was asked, as JSON (a measurement, or the re-timed step times)."""

    payload: str


@dataclass(frozen=True)
class Failed:
    """Worker → runner: what was asked failed; ``reason`` is one line (and, with
    ``REMAT_SEARCH_DEBUG``, the worker's traceback after it)."""

    reason: str


Reply = Done | Failed | Program
"""What the worker may send while it works on a request."""
