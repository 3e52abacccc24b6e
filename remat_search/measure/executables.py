"""Measuring plans in a worker: compile each once, read memory from the compiler, and only
if a plan fits, run it.

:func:`measure` runs inside a worker process (see ``runner.py``) with the worker's
:class:`Executables`, which compile each plan's step once per worker, whatever the budget.
The peak comes from ``Compiled.memory_analysis()``; a plan whose peak exceeds the budget is
never executed. A plan that fits runs its first step on fresh inputs, and the gradients that
step computed (and its loss) are checked against the reference's first step: full remat, the
same mathematics in the least memory, run only where it fits the budget too, with a threshold
measured on it (:mod:`remat_search.measure.check`). That step is the first warm-up; then come
the timed repeats (median, min and spread), each beside a step of the anchor (full remat
again). What was seen is a raw measurement, judged against the budget (and a spec's
``gradient_tolerance``, where it sets one) by :func:`measurement.judge`. :func:`retime` re-times kept executables
interleaved. What is read off a compiled program besides its memory (its digest, cost and I/O
bytes) is :mod:`remat_search.measure.program`.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from remat_search.measure.artifacts import ReferenceStore, keep_program
from remat_search.measure.check import (
    Carriers, Reference, check, first_step, gradient_carriers, matmul_precision, noise_of, nudged,
)
from remat_search.measure.measurement import Measurement, MemoryBreakdown, RawMeasurement, judge
from remat_search.measure.placement import in_step, on_host, placed
from remat_search.measure.program import io_bytes, program_cost, program_digest
from remat_search.measure.slice import Agreement
from remat_search.plans.configuration import Configuration
from remat_search.plans.plan import RematPlan
from remat_search.spec.models import TimingConfig
from remat_search.targets.step_time import StepEstimate
from remat_search.targets.base import Target, out_of_memory
from remat_search.targets.local import LocalTarget
from remat_search.targets.platform import is_tpu
from remat_search.units import format_bytes

KEPT_EXECUTABLES = 64
"""How many compiled steps a worker keeps (least recently used dropped first), besides the anchor."""

INPUT_SEED = 0
"""The seed of the fresh inputs every checked first step starts from (the reference's too)."""


@dataclass(frozen=True)
class Build:
    """One plan compiled for the worker's devices: what the compiler said, and the executable
    (None where nothing runs here, or where the compiler ran out of memory)."""

    executable: Any | None
    seconds: float
    """Lowering and compiling, in seconds."""
    started: float = 0.0
    """When lowering began (Unix seconds)."""
    memory: MemoryBreakdown | None = None
    cost: dict[str, float] = field(default_factory=dict)
    oom: tuple[int, int, int] | None = None
    """(bytes needed in full, temporaries, available) from the compiler's out-of-memory error."""
    program: str | None = None
    """The compiled program's digest (:func:`program_digest`): plans that compile alike share
    it (None for a program that calls back into Python)."""
    estimate: StepEstimate | None = None
    """The target's model of one step of it, where nothing runs (``Target.estimate``)."""
    precision: tuple[float, str] | None = None
    """The anchor's matmuls' unit roundoff and what it is of (:func:`check.matmul_precision`),
    which the check's rounding figure is scaled to; None for other plans."""


class Executables:
    """The compiled training steps of one workload in one worker process, by plan digest.

    Each plan is lowered and compiled once per worker, whatever the budget: the verdict
    against a budget reads the kept figures, and the gradient check, the timing and
    confirmation (:func:`retime`) run the executable that was measured. The worker keeps
    at most ``capacity`` executables, the least recently used dropped first (a plan dropped
    and asked for again is compiled again), and the anchor's besides. Where nothing runs (a
    TPU target compiled ahead of time) only the compiler's figures are kept. The reference's
    first step and its noise (see :meth:`reference`) are computed at most once and kept on the host; with a
    ``reference_store`` it is loaded from there when saved before (by this study's earlier
    workers, or another host's), else computed and saved there. A new worker (after a crash or
    a timeout) starts empty.
    """

    reference_from: str | None = None
    """Where the reference came from: ``computed`` (full remat's first step ran here) or
    ``loaded`` (from the ``reference_store``); None before it was needed."""

    def __init__(self, workload: Any, *, target: Target | None = None, mesh: Any = None,
                 capacity: int = KEPT_EXECUTABLES, reference_store: ReferenceStore | None = None,
                 configuration: Configuration | None = None, programs: Path | None = None,
                 agree: Agreement | None = None) -> None:
        """``configuration``: the one the workload and mesh were built for (its plans carry
        it), where the study searches configurations; the anchor and reference run at it.
        ``programs``: a folder where each compiled program's text is kept (:func:`keep_program`)
        where the target keeps them (``Target.keeps_programs``: where plans run and are timed,
        or the spec asks), for a calibration of the step-time model to read later; None: not kept.
        ``agree``: on a slice, how the processes agree on each compile before any runs
        (:class:`~remat_search.measure.slice.Agreement`); None on one host."""
        self.workload, self.mesh, self.capacity, self.programs = workload, mesh, capacity, programs
        self.agree = agree
        workload.use_mesh(mesh)  # first: nothing of the workload is traced before it has the target's mesh
        self.target = target or LocalTarget()
        self.anchor_plan = anchor_plan(workload.layers).model_copy(update={"configuration": configuration})
        self._kept: OrderedDict[str, Build] = OrderedDict()
        self._anchor: Build | None = None
        self._reference: Reference | None = None
        self.reference_store = reference_store
        self._carriers: Carriers | None = None
        self._hbm: int | None = None

    @property
    def compile_hbm(self) -> int | None:
        """The HBM per chip a TPU compiler compiles each plan for (``Target.memory_limit``): a
        program it compiled fits it, by the compiler's own out-of-memory verdict
        (:attr:`MemoryBreakdown.hbm`). None on other platforms."""
        if self._hbm is None and is_tpu(self.target.platform):
            self._hbm = self.target.memory_limit(self.mesh)
        return self._hbm

    @property
    def carriers(self) -> Carriers:
        """The leaves of the training state the check compares (:func:`check.gradient_carriers`)."""
        if self._carriers is None:
            with self.workload.tracing():
                self._carriers = gradient_carriers(self.workload.abstract_inputs()[0])
        return self._carriers

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

    def reference(self, budget: int) -> Reference | None:
        """Full remat's first step on fresh inputs, the reference every plan's is checked
        against, with the noise measured on it (:func:`check.noise_of`: full remat run again,
        and on nudged inputs); None where full remat does not fit ``budget`` (it is not run, nor
        loaded: the verdict is the same whether it was saved or not)."""
        anchor = self.anchor(budget)
        if anchor is None:
            return None
        if self._reference is None and self._everyone(self.reference_store is not None and self.reference_store.path.is_dir()):
            self._reference = self._saved_reference()  # on a slice, every process at once (a restore may wait for all)
            self.reference_from = "loaded"
            if not self._everyone(self._reference is not None):
                self._reference = None  # loaded by all processes of a slice or by none: they run it in step
        if self._reference is None:  # none saved: full remat's steps run here
            step, carriers = anchor.executable, self.carriers
            _, first = first_step(step, self.inputs(), carriers)
            _, again = first_step(step, self.inputs(), carriers)
            _, probe = first_step(step, nudged(self.inputs()), carriers)
            assert anchor.precision is not None  # read as the anchor compiled (see _compile)
            unit_roundoff, precision = anchor.precision
            self._reference = Reference(first, noise_of(first, again, probe, unit_roundoff=unit_roundoff, precision=precision))
            self.reference_from = "computed"
            # Saved from one host alone (a slice's processes would each need to take part in the save).
            if self.reference_store is not None and self.agree is None:
                self.reference_store.save(self._reference)
        return self._reference

    def _everyone(self, yes: bool) -> bool:
        """``yes`` here and, on a slice, on every process (see :attr:`agree`)."""
        return yes if self.agree is None else all(said["yes"] for said in self.agree({"yes": yes}))

    def _saved_reference(self) -> Reference | None:
        """The reference from the ``reference_store``; None where there is none (or none saved
        of this state's carrier shapes)."""
        import jax

        if self.reference_store is None:
            return None
        with self.workload.tracing():
            state, _ = self.workload.abstract_inputs()
        leaves = jax.tree.leaves(state)
        return self.reference_store.load([tuple(leaves[i].shape) for i in self.carriers.indices])

    def inputs(self) -> tuple[Any, Any]:
        """Fresh ``(state, batch)`` on the devices (over the mesh, sharded): each step donates its state."""
        with self.workload.tracing():
            inputs = self.workload.inputs(INPUT_SEED)
            return inputs if self.mesh is None else placed(inputs, self.workload.input_shardings(self.mesh))

    def _compile(self, plan: RematPlan) -> Build:
        workload, mesh = self.workload, self.mesh
        started, start = time.time(), time.perf_counter()
        with workload.tracing():
            abstract = workload.abstract_inputs(mesh)
            lowered = (workload.step(plan) if mesh is None else workload.step(plan, mesh)).lower(*abstract)
        try:
            compiled = lowered.compile(compiler_options=workload.compiler_options(self.target.platform) or None)
        except Exception as e:
            oom = out_of_memory(e)
            if oom is None:
                raise
            peak = oom.required or oom.temp + io_bytes(lowered, abstract)
            return Build(None, time.perf_counter() - start, started, oom=(peak, oom.temp, oom.available))
        precision = self._precision(lowered) if plan.digest == self.anchor_plan.digest else None
        text, cost = compiled.as_text(), program_cost(compiled)
        digest = program_digest(text)
        if self.programs is not None and digest is not None and self.target.keeps_programs:  # a calibration's sample
            keep_program(self.programs, digest, text)
        return Build(
            compiled if self.target.executes else None, time.perf_counter() - start, started,
            memory=MemoryBreakdown.of(compiled, platform=self.target.platform, hbm=self.compile_hbm), cost=cost,
            program=digest, estimate=None if self.target.executes else self.target.estimate(
                text, cost, plan.kind, None if self.mesh is None else dict(self.mesh.shape)),
            precision=precision,
        )

    def _precision(self, lowered: Any) -> tuple[float, str]:
        """The lowered anchor's matmul precision on the target (the state's least precise
        floating dtype where it has no matmul)."""
        import jax
        import jax.numpy as jnp

        with self.workload.tracing():
            state, _ = self.workload.abstract_inputs()
        dtypes = {np.dtype(a.dtype) for a in jax.tree.leaves(state) if jax.dtypes.issubdtype(a.dtype, np.floating)}
        fallback = min(dtypes, key=lambda d: jnp.finfo(d).nmant).name if dtypes else "float32"
        return matmul_precision(lowered.as_text(), self.target.platform, fallback)


Known = Callable[[str], RawMeasurement | None]
"""A raw measurement of a compiled program (by :func:`program_digest`) that may stand for a
plan's, or None: the search asks its study and the measurement cache (``cache.lookup_program``)."""

def measure(
    executables: Executables, plan: RematPlan, *, budget: int, timing: TimingConfig, gradient_tolerance: float | None = None,
    known: Known | None = None,
) -> Measurement:
    """Compile ``plan`` (once per worker: see :class:`Executables`); run, check and time it
    only if it fits ``budget``; judge what was seen (:func:`measurement.judge`).

    Over the executables' mesh inputs are sharded and memory is per device. Where the target
    does not execute (a TPU compiled for ahead of time) nothing runs: the step time is the
    target's estimate, whatever the budget. With ``timing.anchor`` each timed step follows one of the
    anchor's (full remat), where the anchor fits the budget; else the plan is timed alone. A
    plan whose first step fails the check is not timed. Exceptions other than the compiler's
    out-of-memory propagate: the worker turns them into a failed measurement.

    A plan that would run is first looked up by its compiled program (``known``, see
    :func:`program_digest`): a measurement of the same program, by another plan, stands for
    it, and it is neither checked nor timed again (:func:`same_program`).
    """
    raw = _observe(
        executables, plan, budget=budget, timing=timing, gradient_tolerance=gradient_tolerance, known=known,
    )
    return judge(raw, budget=budget, gradient_tolerance=gradient_tolerance)


def _observe(
    executables: Executables, plan: RematPlan, *, budget: int, timing: TimingConfig, gradient_tolerance: float | None = None,
    known: Known | None = None,
) -> RawMeasurement:
    """What compiling ``plan`` and, within ``budget``, running it shows: see :func:`measure`."""
    build, slice_peak = _agreed_build(executables, plan)
    compiled_at = (build.started, build.started + build.seconds)
    if build.oom is not None:
        required, temp, available = build.oom
        return RawMeasurement(
            plan_digest=plan.digest, compile_seconds=build.seconds, compiled_at=compiled_at,
            oom_required_bytes=required, oom_temp_bytes=temp, oom_available_bytes=available,
        )
    assert build.memory is not None
    seen: dict[str, Any] = {
        "plan_digest": plan.digest, "compile_seconds": build.seconds, "compiled_at": compiled_at, "memory": build.memory,
        "flops": build.cost.get("flops"), "bytes_accessed": build.cost.get("bytes accessed"),
        "program_digest": build.program,
    }
    if not executables.target.executes:
        return RawMeasurement(
            time_source="estimated", estimated_seconds=build.estimate.seconds if build.estimate else None,
            estimate=build.estimate, **seen,
        )
    if max(build.memory.peak, slice_peak or 0) > budget:
        return RawMeasurement(**seen)
    found = known(build.program) if known is not None and build.program else None
    if found is not None and found.memory == build.memory and found.program_digest == build.program:
        return same_program(found, RawMeasurement(**seen))
    executables.anchor(budget)  # compiled before the device is taken: compiles need not wait for it
    with executables.target.device_lock():
        started = time.time()
        raw = _run(executables, build, plan, budget=budget, timing=timing, tolerance=gradient_tolerance, seen=seen)
        return raw.model_copy(update={"ran_at": (started, time.time())})


def _agreed_build(executables: Executables, plan: RematPlan) -> tuple[Build, int | None]:
    """``executables.build(plan)``, and on a slice the largest peak of every process's, agreed
    by all of them (see :class:`~remat_search.measure.slice.Agreement`: one that raised, or
    compiled another plan, fails it on all before any runs), so that all decide alike whether it
    runs; None on one host."""
    if executables.agree is None:
        return executables.build(plan), None
    try:
        build = executables.build(plan)
    except Exception as e:
        executables.agree({"plan": plan.digest, "failed": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
        raise
    peak = build.memory.peak if build.memory is not None else (build.oom[0] if build.oom else 0)
    return build, max(said["peak"] for said in executables.agree.check({"plan": plan.digest, "peak": peak}))


def _run(
    executables: Executables, build: Build, plan: RematPlan, *, budget: int, timing: TimingConfig,
    tolerance: float | None, seen: dict[str, Any],
) -> RawMeasurement:
    """Check ``plan``'s first step against the reference and time it, the device held."""
    reference = executables.reference(budget)  # first, so that one training state is on the device at a time
    inputs, warmup = executables.inputs(), timing.warmup
    if reference is None:
        needs = executables.build(executables.anchor_plan).memory
        seen["grad_skipped"] = (
            f"the reference, full remat, needs {format_bytes(needs.peak) if needs else 'more'} "
            f"> budget {format_bytes(budget)}, and nothing over the budget is run"
        )
    else:
        inputs, first = first_step(build.executable, inputs, executables.carriers)
        verdict = check(first, reference.step, reference.noise, executables.carriers)
        seen.update(
            grad_check=verdict, grad_rel_error=verdict.max_error, grad_reference="full", first_loss=first.loss,
            reference_from=executables.reference_from,
        )
        if verdict.failure(tolerance) is not None or not math.isfinite(first.loss):
            return RawMeasurement(**seen)  # failed: not timed
        warmup = max(warmup - 1, 0)  # the checked step was the first warm-up step

    anchor = executables.anchor(budget) if timing.anchor else None
    steps = [build.executable] if anchor is None else [anchor.executable, build.executable]  # the plan's last
    in_step(f"time {plan.digest}")
    (*anchor_times, times), loss = _time_steps(steps, inputs, warmup=warmup, rounds=timing.repeats)
    return RawMeasurement(
        time_source="measured", step_times=times, anchor_times=anchor_times[0] if anchor_times else (),
        loss=loss, **seen,
    )


def same_program(found: RawMeasurement, compiled: RawMeasurement) -> RawMeasurement:
    """``found``, another plan's measurement of the program ``compiled`` compiled to, as the
    measurement of ``compiled``'s plan: its run (the check, the times, the losses) stands, with
    this compile's own figures; :attr:`~RawMeasurement.same_program_as` names the plan that ran.
    Nothing of this plan ran, so it has no ``ran_at``."""
    return found.model_copy(update={
        **{f: getattr(compiled, f) for f in ("plan_digest", "compile_seconds", "compiled_at", "memory")},
        "ran_at": None, "same_program_as": found.same_program_as or found.plan_digest,
    })


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
    with executables.target.device_lock():
        in_step("retime")
        times, _ = _time_steps(
            [b.executable for b in builds], executables.inputs(), warmup=warmup, rounds=rounds, order=random.Random(seed)
        )
    return times


def anchor_plan(layers: int) -> RematPlan:
    """The plan every candidate is timed against (``timing.anchor``) and checked against:
    full remat, which runs in the least memory of the policies that keep everything on the
    device."""
    return RematPlan.uniform("full", layers)


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
    return [tuple(t) for t in times], float(on_host(loss))
