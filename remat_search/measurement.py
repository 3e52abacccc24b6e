"""Measuring one plan: compile, read memory from the compiler, and only if it fits, run it.

:func:`measure` runs inside a worker process (see ``runner.py``). It lowers and compiles
the workload's step under the plan, takes the peak from ``Compiled.memory_analysis()``,
and returns at once when the peak exceeds the budget: a plan that does not fit is never
executed. A plan that fits has its gradients checked against the no-remat plan and its
step timed (warm-up, then repeats; median, min and spread).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, computed_field

from remat_search.plan import RematPlan
from remat_search.spec import TimingConfig
from remat_search.target import Chip, out_of_memory, roofline_seconds

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
    """From the compiler's own out-of-memory error (TPU): bytes its temporaries need…"""
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
    """The plan whose gradients this plan's were checked against (``full`` when no remat
    does not fit the device)."""
    error: str | None = None

    @property
    def peak_bytes(self) -> int | None:
        """Peak device bytes (per chip) as compiled, or as predicted for a screened plan; None
        when the compile did not get that far."""
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


def measure(
    workload: Any,
    plan: RematPlan,
    *,
    budget: int,
    timing: TimingConfig,
    gradient_tolerance: float,
    reference_grads: Callable[[], Any],
    anchor: Callable[[], Any] | None = None,
    mesh: Any = None,
    chip: Chip | None = None,
) -> Measurement:
    """Compile ``plan`` for ``workload``; run, check and time it only if it fits ``budget``.

    Over a ``mesh`` inputs are sharded and memory is per device. With a ``chip`` (a TPU
    target compiled ahead of time) nothing runs: the step time is a roofline estimate.
    ``reference_grads`` returns the no-remat gradients (computed once, when first needed);
    ``anchor`` the compiled anchor plan (see :func:`compile_anchor`) to time alternately with
    the plan, or None to time the plan alone.
    Exceptions other than the compiler's out-of-memory propagate: the worker turns them
    into a failed measurement with the reason.
    """
    import jax

    cpu = chip is None and jax.default_backend() == "cpu"
    start = time.perf_counter()
    try:
        compiled = _compile(workload, plan, mesh, cpu=cpu)
    except Exception as e:
        oom = out_of_memory(e)
        if oom is None:
            raise
        return Measurement(
            status="over_budget", plan_digest=plan.digest, compile_seconds=time.perf_counter() - start,
            oom_required_bytes=oom[0], oom_available_bytes=oom[1],
        )
    cost = _cost(compiled)
    seen: dict[str, Any] = {
        "plan_digest": plan.digest,
        "compile_seconds": time.perf_counter() - start,
        "memory": MemoryBreakdown.of(compiled, trust_compiler_peak=not cpu),
        "flops": cost.get("flops"),
        "bytes_accessed": cost.get("bytes accessed"),
    }
    if seen["memory"].peak > budget:
        return Measurement(status="over_budget", **seen)
    if chip is not None:
        return Measurement(
            status="measured", time_source="estimated", estimated_seconds=roofline_seconds(cost, chip), **seen
        )

    state, batch = workload.inputs()
    reference, reference_plan = reference_grads()
    abs_error, rel_error = gradient_error(workload.grad(plan)(state[0], batch), reference)
    seen.update(grad_max_abs_error=abs_error, grad_rel_error=rel_error, grad_reference=reference_plan)
    if not rel_error <= gradient_tolerance:
        return Measurement(
            status="failed",
            error=f"gradients differ from those of plan {reference_plan!r}: relative error "
            f"{rel_error:.3g} > gradient_tolerance {gradient_tolerance:g}",
            **seen,
        )

    anchored = anchor() if anchor is not None else None
    executables = [compiled] if anchored is None else [anchored, compiled]  # the plan steps last
    (*anchor_times, times), loss = _time_steps(
        executables, workload, mesh, warmup=timing.warmup, rounds=timing.repeats, inputs=(state, batch)
    )
    if not math.isfinite(loss):
        return Measurement(status="failed", error=f"loss is {loss} after the timed steps", **seen)
    return Measurement(
        status="measured", time_source="measured", step_times=times,
        anchor_times=anchor_times[0] if anchor_times else (), **seen,
    )


def retime(workload: Any, plans: list[RematPlan], *, warmup: int, rounds: int, mesh: Any = None) -> list[tuple[float, ...]]:
    """Time ``plans`` interleaved — A B C A B C … — so that a slow spell of a shared machine
    slows them all alike; return each plan's step times.

    One training state passes from step to step (every plan's step has the same
    signature), so only one lives on the device. Used to confirm a search's ranking.
    """
    import jax

    cpu = jax.default_backend() == "cpu"
    compiled = [_compile(workload, plan, mesh, cpu=cpu) for plan in plans]
    times, _ = _time_steps(compiled, workload, mesh, warmup=warmup, rounds=rounds, inputs=workload.inputs())
    return times


def anchor_plan(layers: int) -> RematPlan:
    """The plan every candidate is timed against (``timing.anchor``): full remat, which runs
    in the least memory of the policies that keep everything on the device."""
    return RematPlan.uniform("full", layers)


def compile_anchor(workload: Any, *, budget: int, mesh: Any = None) -> Any | None:
    """The anchor plan compiled, or None where its peak exceeds ``budget`` (it would not be
    run, so candidates are timed alone)."""
    import jax

    cpu = jax.default_backend() == "cpu"
    compiled = _compile(workload, anchor_plan(workload.layers), mesh, cpu=cpu)
    return compiled if MemoryBreakdown.of(compiled, trust_compiler_peak=not cpu).peak <= budget else None


def _compile(workload: Any, plan: RematPlan, mesh: Any, *, cpu: bool) -> Any:
    step = workload.step(plan) if mesh is None else workload.step(plan, mesh)
    return step.lower(*workload.abstract_inputs(mesh)).compile(compiler_options=compiler_options(cpu) or None)


def _time_steps(
    compiled: list[Any], workload: Any, mesh: Any, *, warmup: int, rounds: int, inputs: tuple[Any, Any]
) -> tuple[list[tuple[float, ...]], float]:
    """Run each executable in turn, ``warmup + rounds`` times, on ``inputs`` (the one state
    the device holds: each step donates it); the timed seconds of each, and the last loss."""
    import jax

    state, batch = inputs
    if mesh is not None:
        state, batch = jax.device_put((state, batch), workload.shardings(mesh))
    times: list[list[float]] = [[] for _ in compiled]
    loss = None
    for i in range(warmup + rounds):
        for step, seconds in zip(compiled, times, strict=True):
            t0 = time.perf_counter()
            state, loss = step(state, batch)
            jax.block_until_ready((state, loss))
            if i >= warmup:
                seconds.append(time.perf_counter() - t0)
    return [tuple(t) for t in times], float(loss)


def compiler_options(cpu: bool) -> dict[str, str]:
    """The compiler options plans are compiled with: the memory-optimised scheduler on CPU."""
    return dict(CPU_COMPILER_OPTIONS) if cpu else {}


def reference_gradients(workload: Any) -> tuple[Any, Literal["none", "full"]]:
    """Gradients of the no-remat plan on the workload's inputs, as host arrays, and "none".

    Where no remat does not fit the device, the full-remat plan's (the same mathematics in
    the least memory) and "full".
    """
    import jax

    (params, _), batch = workload.inputs()
    try:
        none = RematPlan.uniform("none", workload.layers)
        return jax.device_get(workload.grad(none)(params, batch)), "none"
    except Exception as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
    full = RematPlan.uniform("full", workload.layers)
    return jax.device_get(workload.grad(full)(params, batch)), "full"


def gradient_error(grads: Any, reference: Any) -> tuple[float, float]:
    """(max absolute error, max over leaves of max |error| / max |reference|)."""
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
