"""Measuring one plan: compile, read memory from the compiler, and only if it fits, run it.

:func:`measure` runs inside a worker process (see ``runner.py``) with the worker's
:class:`Executables`, which compile each plan's step once per worker, whatever the budget.
The peak comes from ``Compiled.memory_analysis()``; a plan whose peak exceeds the budget is
never executed. A plan that fits runs its first step on fresh inputs, and the change that step
makes to the training state (and its loss) is checked against the reference's first step: full
remat, the same mathematics in the least memory, run only where it fits the budget too. That
step is the first warm-up; then come the timed repeats (median, min and spread), each beside a
step of the anchor (full remat again). :func:`retime` re-times kept executables interleaved.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, computed_field

from remat_search.plan import RematPlan
from remat_search.spec import TimingConfig
from remat_search.target import Chip, out_of_memory, roofline_seconds
from remat_search.units import format_bytes

MEASUREMENT_SCHEMA = 2
"""What a measurement means, as a number the measurement cache is keyed by: bump it when that
changes (how a plan is compiled, checked, timed or what its fields say), so that no measurement
made the old way is reused. 1: gradients of ``jax.grad`` checked against no remat's, out-of-memory
peaks of temporaries only. 2: the measured executable's first step checked against full
remat's, run only within the budget; out-of-memory peaks in full."""
KEPT_EXECUTABLES = 64
"""How many compiled steps a worker keeps (least recently used dropped first), besides the anchor."""

Status = Literal["measured", "over_budget", "failed"]

# On CPU the default (concurrency-optimised) scheduler hides what remat saves.
CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


class MemoryBreakdown(BaseModel):
    """The compiler's memory figures for one executable, in bytes (device, then host)."""

    model_config = ConfigDict(frozen=True)

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    host_argument: int = 0
    host_output: int = 0
    host_alias: int = 0
    host_temp: int = 0
    compiler_peak: int | None = None
    """``peak_memory_in_bytes``: reported on TPU (and GPU); on CPU a constant, so not kept."""

    @classmethod
    def of(cls, compiled: Any, *, trust_compiler_peak: bool) -> MemoryBreakdown:
        """Read the breakdown of a ``jax.stages.Compiled``."""
        m = compiled.memory_analysis()
        fields = ("argument", "output", "alias", "temp", "generated_code")
        return cls(
            **{f: int(getattr(m, f"{f}_size_in_bytes")) for f in fields},
            **{f"host_{f}": int(getattr(m, f"host_{f}_size_in_bytes")) for f in fields[:4]},
            compiler_peak=int(getattr(m, "peak_memory_in_bytes", 0) or 0) if trust_compiler_peak else None,
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def breakdown_sum(self) -> int:
        """argument + output − alias + temp + generated code."""
        return self.argument + self.output - self.alias + self.temp + self.generated_code

    @computed_field  # type: ignore[prop-decorator]
    @property
    def peak(self) -> int:
        """Peak device bytes of one step: the larger of the breakdown sum and the compiler's peak."""
        return max(self.breakdown_sum, self.compiler_peak or 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def peak_source(self) -> Literal["breakdown_sum", "compiler_peak"]:
        """Which figure :attr:`peak` is (the budget is checked against the larger)."""
        return "compiler_peak" if (self.compiler_peak or 0) > self.breakdown_sum else "breakdown_sum"


class Measurement(BaseModel):
    """What the runner saw for one (workload, plan, device)."""

    model_config = ConfigDict(frozen=True)

    status: Status
    plan_digest: str
    memory: MemoryBreakdown | None = None
    oom_required_bytes: int | None = None
    """Where the compiler ran out of memory (TPU): the bytes one chip needs in full, to compare
    with other plans' peaks: the temporaries its error states (:attr:`oom_temp_bytes`) plus
    the program's per-chip arguments and outputs less the donated arguments they alias
    (logical sizes, before the TPU pads them to tiles, so a lower bound)…"""
    oom_temp_bytes: int | None = None
    """…the temporaries alone, as the compiler's error states them…"""
    oom_available_bytes: int | None = None
    """…and the HBM it had for them."""
    screened_bytes: int | None = None
    """Where the plan was screened out without compiling (``prescreen``): the peak the
    study's cost model predicted for it, far over the budget."""
    flops: float | None = None
    bytes_accessed: float | None = None
    compile_seconds: float | None = None
    time_source: Literal["measured", "estimated"] | None = None
    step_times: tuple[float, ...] = ()
    """Seconds of each timed repeat (measured on the local device)."""
    anchor_times: tuple[float, ...] = ()
    """Seconds of the anchor plan's step run just before each of :attr:`step_times`
    (``timing.anchor``): both ran under the same load, so their ratio is free of what drifts
    between rounds."""
    anchor_seconds: float | None = None
    """The study's reference time of the anchor, in which :attr:`step_seconds` of an
    anchored measurement is expressed (set by the search as it records the trial)."""
    estimated_seconds: float | None = None
    """Roofline estimate of one step, for targets where nothing runs."""
    grad_max_abs_error: float | None = None
    grad_rel_error: float | None = None
    grad_reference: Literal["none", "full"] | None = None
    """The plan whose first step this plan's was checked against: ``full`` (full remat). In
    measurements of schema 1 (see :data:`MEASUREMENT_SCHEMA`), ``none``: gradients of no remat."""
    grad_skipped: str | None = None
    """Why a plan that ran was not checked: the reference does not fit the budget, and
    nothing over the budget is run."""
    error: str | None = None

    @property
    def peak_bytes(self) -> int | None:
        """Peak device bytes (per chip) as compiled; where the compiler ran out of memory, the
        bytes it needs in full (:attr:`oom_required_bytes`); for a screened plan, as predicted;
        None when the compile did not get that far."""
        if self.memory:
            return self.memory.peak
        return self.oom_required_bytes if self.oom_required_bytes is not None else self.screened_bytes

    @property
    def compiled(self) -> bool:
        """Whether the compiler saw the plan (it was not screened out, nor failed before)."""
        return self.memory is not None or self.oom_required_bytes is not None

    @property
    def step_seconds(self) -> float | None:
        """The step time the study ranks by: the median ratio to the anchor times the
        study's anchor seconds where anchored, else the measured median, or the estimate."""
        if self.anchor_ratio is not None and self.anchor_seconds:
            return self.anchor_ratio * self.anchor_seconds
        return self.median_seconds if self.step_times else self.estimated_seconds

    @property
    def anchor_ratio(self) -> float | None:
        """The median of :attr:`anchor_ratios`: the plan's step over the anchor's (None if unanchored)."""
        return statistics.median(self.anchor_ratios) if self.anchor_times else None

    @property
    def anchor_ratios(self) -> tuple[float, ...]:
        """Each repeat's time over the anchor's time in the same round (empty if unanchored)."""
        return tuple(t / a for t, a in zip(self.step_times, self.anchor_times, strict=True)) if self.anchor_times else ()

    @property
    def median_seconds(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def min_seconds(self) -> float | None:
        return min(self.step_times) if self.step_times else None

    @property
    def spread(self) -> float | None:
        """(max − min) / median of what :attr:`step_seconds` is the median of (the ratios to
        the anchor, or the timed repeats): how far to trust it."""
        values = self.anchor_ratios or self.step_times
        return relative_spread(values) if values else None


def relative_spread(values: Sequence[float]) -> float:
    """(max − min) / median: how far apart repeated timings of one thing fell."""
    return (max(values) - min(values)) / statistics.median(values)


@dataclass(frozen=True)
class Build:
    """One plan compiled for the worker's devices: what the compiler said, and the executable
    (None where nothing runs here, or where the compiler ran out of memory)."""

    executable: Any | None
    seconds: float
    """Lowering and compiling, in seconds."""
    memory: MemoryBreakdown | None = None
    cost: dict[str, float] = field(default_factory=dict)
    oom: tuple[int, int, int] | None = None
    """(bytes needed in full, temporaries, available) from the compiler's out-of-memory error."""


@dataclass(frozen=True)
class FirstStep:
    """What an executable's first step did to fresh inputs, on the host: the change to each
    leaf of the training state (new − initial; an optimizer's moments carry the gradients),
    and the loss."""

    change: Any
    loss: float


class Executables:
    """The compiled training steps of one workload in one worker process, by plan digest.

    Each plan is lowered and compiled once per worker, whatever the budget: the verdict
    against a budget reads the kept figures, and the gradient check, the timing and
    confirmation (:func:`retime`) run the executable that was measured. The worker keeps
    at most ``capacity`` executables, the least recently used dropped first (a plan dropped
    and asked for again is compiled again), and the anchor's besides. Where nothing runs (a
    TPU target compiled ahead of time) only the compiler's figures are kept. The reference's
    first step (see :meth:`reference`) is computed at most once and kept on the host. A new
    worker (after a crash or a timeout) starts empty.
    """

    def __init__(self, workload: Any, *, mesh: Any = None, chip: Chip | None = None,
                 capacity: int = KEPT_EXECUTABLES) -> None:
        import jax

        self.workload, self.mesh, self.chip, self.capacity = workload, mesh, chip, capacity
        self.cpu = chip is None and jax.default_backend() == "cpu"
        self.anchor_plan = anchor_plan(workload.layers)
        self._kept: OrderedDict[str, Build] = OrderedDict()
        self._anchor: Build | None = None
        self._reference: FirstStep | None = None

    def build(self, plan: RematPlan) -> Build:
        """``plan`` compiled: kept from before, or compiled now. Exceptions other than the
        compiler's out-of-memory propagate (and nothing is kept)."""
        if plan.digest == self.anchor_plan.digest:
            if self._anchor is None:
                self._anchor = self._compile(plan)
            return self._anchor
        kept = self._kept.pop(plan.digest, None) or self._compile(plan)
        self._kept[plan.digest] = kept
        if len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
        return kept

    def anchor(self, budget: int) -> Build | None:
        """The anchor plan compiled, or None where its peak exceeds ``budget`` (it is not run)."""
        build = self.build(self.anchor_plan)
        return build if build.memory is not None and build.memory.peak <= budget else None

    def reference(self, budget: int) -> FirstStep | None:
        """Full remat's first step on fresh inputs, the reference every plan's is checked
        against; None where full remat does not fit ``budget`` (it is not run)."""
        anchor = self.anchor(budget)
        if anchor is None:
            return None
        if self._reference is None:
            _, self._reference = first_step(anchor.executable, self.inputs())
        return self._reference

    def inputs(self) -> tuple[Any, Any]:
        """Fresh ``(state, batch)`` on the devices (over the mesh, sharded): each step donates its state."""
        import jax

        inputs = self.workload.inputs()
        return inputs if self.mesh is None else jax.device_put(inputs, self.workload.shardings(self.mesh))

    def _compile(self, plan: RematPlan) -> Build:
        workload, mesh = self.workload, self.mesh
        start = time.perf_counter()
        abstract = workload.abstract_inputs(mesh)
        lowered = (workload.step(plan) if mesh is None else workload.step(plan, mesh)).lower(*abstract)
        try:
            compiled = lowered.compile(compiler_options=compiler_options(self.cpu) or None)
        except Exception as e:
            oom = out_of_memory(e)
            if oom is None:
                raise
            temp, available = oom
            return Build(None, time.perf_counter() - start, oom=(temp + io_bytes(lowered, abstract), temp, available))
        return Build(
            None if self.chip is not None else compiled, time.perf_counter() - start,
            memory=MemoryBreakdown.of(compiled, trust_compiler_peak=not self.cpu), cost=_cost(compiled),
        )


def measure(
    executables: Executables, plan: RematPlan, *, budget: int, timing: TimingConfig, gradient_tolerance: float
) -> Measurement:
    """Compile ``plan`` (once per worker: see :class:`Executables`); run, check and time it
    only if it fits ``budget``.

    Over the executables' mesh inputs are sharded and memory is per device. For a TPU
    target compiled ahead of time (a ``chip``) nothing runs: the step time is a roofline
    estimate. With ``timing.anchor`` each timed step follows one of the anchor's (full remat),
    where the anchor fits the budget; else the plan is timed alone. Exceptions other than the
    compiler's out-of-memory propagate: the worker turns them into a failed measurement.
    """
    build = executables.build(plan)
    if build.oom is not None:
        required, temp, available = build.oom
        return Measurement(
            status="over_budget", plan_digest=plan.digest, compile_seconds=build.seconds,
            oom_required_bytes=required, oom_temp_bytes=temp, oom_available_bytes=available,
        )
    assert build.memory is not None
    seen: dict[str, Any] = {
        "plan_digest": plan.digest, "compile_seconds": build.seconds, "memory": build.memory,
        "flops": build.cost.get("flops"), "bytes_accessed": build.cost.get("bytes accessed"),
    }
    if build.memory.peak > budget:
        return Measurement(status="over_budget", **seen)
    if executables.chip is not None:
        return Measurement(
            status="measured", time_source="estimated",
            estimated_seconds=roofline_seconds(build.cost, executables.chip), **seen,
        )

    reference = executables.reference(budget)  # first, so that one training state is on the device at a time
    inputs, warmup = executables.inputs(), timing.warmup
    if reference is None:
        needs = executables.build(executables.anchor_plan).memory
        seen["grad_skipped"] = (
            f"the reference, full remat, needs {format_bytes(needs.peak) if needs else 'more'} "
            f"> budget {format_bytes(budget)}, and nothing over the budget is run"
        )
    else:
        inputs, first = first_step(build.executable, inputs)
        abs_error, rel_error = gradient_error((first.change, first.loss), (reference.change, reference.loss))
        seen.update(grad_max_abs_error=abs_error, grad_rel_error=rel_error, grad_reference="full")
        if not rel_error <= gradient_tolerance:
            return Measurement(status="failed", error=gradient_failure(rel_error, "full", gradient_tolerance), **seen)
        warmup = max(warmup - 1, 0)  # the checked step was the first warm-up step

    anchor = executables.anchor(budget) if timing.anchor else None
    steps = [build.executable] if anchor is None else [anchor.executable, build.executable]  # the plan's last
    (*anchor_times, times), loss = _time_steps(steps, inputs, warmup=warmup, rounds=timing.repeats)
    if not math.isfinite(loss):
        return Measurement(status="failed", error=f"loss is {loss} after the timed steps", **seen)
    return Measurement(
        status="measured", time_source="measured", step_times=times,
        anchor_times=anchor_times[0] if anchor_times else (), **seen,
    )


def gradient_failure(rel_error: float, reference: str | None, tolerance: float) -> str:
    """The reason a plan fails the gradient check."""
    return (
        f"the state change and loss of its first step differ from those of plan {reference!r}: "
        f"relative error {rel_error:.3g} > gradient_tolerance {tolerance:g}"
    )


def retime(
    executables: Executables, plans: list[RematPlan], *, warmup: int, rounds: int,
    budget: int | None = None, seed: int = 0,
) -> list[tuple[float, ...]]:
    """Time ``plans`` interleaved, each round in an order shuffled by a ``seed``-ed generator,
    so that a slow spell of a shared machine slows them all alike and no plan always follows
    the same one; return each plan's step times.

    The worker's kept executables run (see :class:`Executables`). One training state passes
    from step to step (every plan's step has the same signature), so only one lives on the
    device. A plan over ``budget``, or one that cannot run here, raises ``ValueError``: it is
    never run. Used to confirm a search's ranking.
    """
    builds = [executables.build(plan) for plan in plans]
    for plan, build in zip(plans, builds, strict=True):
        if build.executable is None:
            raise ValueError(f"plan {plan.summary()} cannot run here (compiled for another target, or out of memory)")
        if budget is not None and build.memory is not None and build.memory.peak > budget:
            raise ValueError(f"plan {plan.summary()} does not fit {format_bytes(budget)}: it is not run")
    times, _ = _time_steps(
        [b.executable for b in builds], executables.inputs(), warmup=warmup, rounds=rounds, order=random.Random(seed)
    )
    return times


def anchor_plan(layers: int) -> RematPlan:
    """The plan every candidate is timed against (``timing.anchor``) and checked against:
    full remat, which runs in the least memory of the policies that keep everything on the
    device."""
    return RematPlan.uniform("full", layers)


def first_step(executable: Any, inputs: tuple[Any, Any]) -> tuple[tuple[Any, Any], FirstStep]:
    """Run ``executable`` once on ``inputs`` (which it donates); the new ``(state, batch)``,
    still on the devices, and what the step did (on the host)."""
    import jax

    state, batch = inputs
    before = jax.device_get(state)
    state, loss = executable(state, batch)
    change = jax.tree.map(_change, jax.device_get(state), before)
    return (state, batch), FirstStep(change=change, loss=float(loss))


def _change(after: np.ndarray, before: np.ndarray) -> np.ndarray:
    """new − initial, computed in float64 and kept as float32 (float64 for 64-bit leaves)."""
    after = np.asarray(after)
    delta = after.astype(np.float64) - np.asarray(before).astype(np.float64)
    return delta if after.dtype.itemsize > 4 else delta.astype(np.float32)


def io_bytes(lowered: Any, abstract: Any) -> int:
    """Per-chip bytes of a lowered program's arguments and outputs, less the donated arguments
    that outputs of the same shape alias: what the TPU compiler's out-of-memory error leaves
    out of the bytes it needs. Logical sizes (before the TPU pads arrays to tiles)."""
    import jax

    def shard(a: Any) -> tuple[tuple[int, ...], str]:
        sharding = getattr(a, "sharding", None)
        shape = sharding.shard_shape(a.shape) if hasattr(sharding, "shard_shape") else a.shape
        return tuple(shape), str(np.dtype(a.dtype))

    def nbytes(key: tuple[tuple[int, ...], str]) -> int:
        return math.prod(key[0]) * np.dtype(key[1]).itemsize

    args = [shard(a) for a in jax.tree.leaves(abstract)]
    donated = [info.donated for info in jax.tree.leaves(lowered.args_info)]
    free = Counter(key for key, d in zip(args, donated, strict=True) if d)
    total = sum(map(nbytes, args))
    for key in (shard(o) for o in jax.tree.leaves(lowered.out_info)):
        total += nbytes(key)
        if free[key]:  # a donated argument's buffer holds this output
            free[key] -= 1
            total -= nbytes(key)
    return total


def _time_steps(
    steps: list[Any], inputs: tuple[Any, Any], *, warmup: int, rounds: int, order: random.Random | None = None
) -> tuple[list[tuple[float, ...]], float]:
    """Run each executable in turn, ``warmup + rounds`` times, from ``inputs`` (the one state
    the device holds: each step donates it), in the order given, or shuffled every round by
    ``order``; the timed seconds of each, and the last loss."""
    import jax

    state, batch = inputs
    times: list[list[float]] = [[] for _ in steps]
    loss = None
    for i in range(warmup + rounds):
        turn = list(range(len(steps)))
        if order is not None:
            order.shuffle(turn)
        for j in turn:
            t0 = time.perf_counter()
            state, loss = steps[j](state, batch)
            jax.block_until_ready((state, loss))
            if i >= warmup:
                times[j].append(time.perf_counter() - t0)
    return [tuple(t) for t in times], float(loss)


def compiler_options(cpu: bool) -> dict[str, str]:
    """The compiler options plans are compiled with: the memory-optimised scheduler on CPU."""
    return dict(CPU_COMPILER_OPTIONS) if cpu else {}


def gradient_error(grads: Any, reference: Any) -> tuple[float, float]:
    """(max absolute error, max over leaves of max |error| / max |reference|) of two trees of
    arrays: gradients, or what a plan's first step did (state change and loss) against the
    reference's."""
    import jax

    abs_error = rel_error = 0.0
    for g, r in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(reference), strict=True):
        diff = float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(r, np.float64))))
        scale = float(np.max(np.abs(np.asarray(r, np.float64))))
        abs_error = max(abs_error, diff)
        rel_error = max(rel_error, diff / scale if scale > 0 else diff)
    return abs_error, rel_error


def _cost(compiled: Any) -> dict[str, float]:
    """FLOPs and bytes accessed of one device's program (recomputation included)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX returns one dict per device program
        cost = cost[0] if cost else {}
    return {k: float(cost[k]) for k in ("flops", "bytes accessed") if cost and k in cost}
