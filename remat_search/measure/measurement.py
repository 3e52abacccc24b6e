"""Measurements: what the compiler and the clock said of one plan, and the verdict on it.

A :class:`RawMeasurement` is what the runner saw, whatever the budget: the compiler's memory
and cost figures (or its out-of-memory report), the seconds of the timed steps, the check of
the first step against the reference's (:mod:`~remat_search.measure.check`). :func:`judge`
gives it a verdict against a budget, and the check's measured threshold or a spec's gradient
tolerance (over budget, measured or failed), making a :class:`Measurement`. The
worker judges what it has just measured (``executables.measure``); the measurement cache keeps
raw measurements only and judges a hit again for each study (``cache.py``), never rewriting it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, computed_field

from remat_search.measure.check import GradientCheck
from remat_search.targets.platform import PLATFORMS, Platform, is_tpu, reports_compiler_peak
from remat_search.targets.step_time import TIME_MODEL, StepEstimate

MEASUREMENT_SCHEMA = 15
"""What a measurement means, as a number the measurement cache is keyed by: bump it when that
changes (how a plan is compiled, checked, timed or what its fields say), so that no measurement
made the old way is reused. 1: gradients of ``jax.grad`` checked against no remat's, out-of-memory
peaks of temporaries only. 2: the measured executable's first step checked against full
remat's, run only within the budget; out-of-memory peaks in full. 3: the cache keeps the raw
measurement alone (no verdict), with the last loss, and a compile-only target's estimate
whatever the budget. 4: that estimate is the per-instruction model (``step_time``), with the
whole-program roofline beside it. 5: that model prices a slice or an in-place update by the part
of the buffer it touches, and the built-in transformer splits each layer's activations over the
batch axes explicitly (a scanned model's program changed). 6: a loop whose body advances its
counter by more than 1 (the TPU compiler's windowed matmuls over an FSDP gather: 2) is counted
that many times fewer. 7: on TPU the peak is the compiler's ``peak_memory_in_bytes``, not the larger
of it and the breakdown sum (the compiler's out-of-memory verdict holds to it; see
``MemoryBreakdown.peak``), and the breakdown keeps the platform it was compiled for. 8: the model
prices transfers to and from pinned host memory (offload) on the chip's host link, overlapped with
the instructions between a transfer's start and its done; a ``-done`` costs nothing. 9: a Pallas
TPU kernel's FLOPs are its matmuls counted in its Mosaic body over its grid
(``targets.pallas_kernels``): flash attention's backward kernels, which state none, count, and a
causal kernel's skipped blocks do not. 10: a slice in a fusion nested in another (the TPU
compiler's collective matmuls take a scanned stack's layer that way) reads what it keeps, not the
whole stack. 11: a collective run by an asynchronous call on another thread (a v6e's SparseCore
all-reduce, ``call-start``) is priced, and that thread's computations are read apart; the fusions
that start, carry and wait for an asynchronous collective on TPU move on HBM only what they
compute (the collective's buffers are its ICI bytes, as an unfused collective's are). 12: a Pallas
TPU kernel's matmuls are priced as the chip's matrix unit spends them, padded to its tiles
(``targets.mxu``: a 128-wide head at half rate on a v6e). 13: the check compares the first step's
gradients (the optimizer's first moment), norm-relative, against a threshold measured on the
reference (``measure.check``), not the state's change by its largest element. 14: a TPU
program's breakdown keeps the HBM it was compiled for, and its peak is at most that (the
compiler compiled it: ``MemoryBreakdown.peak``). 15: the model overlaps an asynchronous collective
with the computation scheduled between its start and its done, and a channel the TPU compiler
chains over fusions with the fusions between its first and its last; a ``collective-permute``
crosses one link (``Chip.ici_links``). The kept published studies were searched under this model
while the number still read 14."""

Verdict = Literal["measured", "over_budget", "failed", "infeasible"]
"""``infeasible``: the workload refused to build the candidate (:class:`~remat_search.errors.CandidateRefused`),
so it was never compiled; :attr:`Measurement.error` says why."""


HOST_PEAK_SLACK = 2**20
"""How far above the arguments plus the host temporaries a TPU compiler's peak may be and still
be read as the host's (:attr:`MemoryBreakdown.compiler_peak_is_host`): 31–205 KB in every case seen."""


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
    host_generated_code: int = 0
    """Host memory, where the program puts tensors there (``offload`` on a GPU or TPU); 0 where
    the compiler says none (and in measurements made before these were kept)."""
    compiler_peak: int | None = None
    """``peak_memory_in_bytes``: reported on TPU (and GPU); on CPU a constant, so not kept."""
    platform: Platform | None = None
    """What the program was compiled for, which decides the :attr:`peak` rule; None in
    measurements made before it was kept (schema 6 and before: the larger figure, as then)."""
    hbm: int | None = None
    """The HBM per chip the TPU compiler compiled the program for (``Target.memory_limit``): it
    refuses at compile time a program whose device memory does not fit (E1000, "Ran out of memory
    in memory space hbm"), so a program it compiled fits this, whatever the figures above sum to.
    None off TPU, and in measurements made before it was kept (schema 13 and before)."""

    @classmethod
    def of(cls, compiled: Any, *, platform: str, hbm: int | None = None) -> MemoryBreakdown:
        """Read the breakdown of a ``jax.stages.Compiled`` compiled for ``platform`` (as
        ``jax.Device.platform`` names it) and, on TPU, for ``hbm`` bytes a chip."""
        m = compiled.memory_analysis()
        fields = ("argument", "output", "alias", "temp", "generated_code")
        return cls(
            **{f: int(getattr(m, f"{f}_size_in_bytes")) for f in fields},
            **{f"host_{f}": int(getattr(m, f"host_{f}_size_in_bytes", 0) or 0) for f in fields},
            compiler_peak=int(getattr(m, "peak_memory_in_bytes", 0) or 0) if reports_compiler_peak(platform) else None,
            platform=platform if platform in PLATFORMS else None,
            hbm=hbm if is_tpu(platform) else None,
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def breakdown_sum(self) -> int:
        """argument + output − alias + temp + generated code."""
        return self.argument + self.output - self.alias + self.temp + self.generated_code

    @property
    def host_total(self) -> int:
        """Host bytes of one step, summed as the device's: argument + output − alias + temp +
        generated code (0 where nothing is on the host)."""
        return self.host_argument + self.host_output - self.host_alias + self.host_temp + self.host_generated_code

    @computed_field  # type: ignore[prop-decorator]
    @property
    def unreported(self) -> tuple[str, ...]:
        """The figures ``memory_analysis()`` gave as zero or negative where a training step
        has some: ``temp`` (a step has temporaries), ``argument``, any negative field, and the
        compiler's peak where it is read (``peak``). A known JAX issue on TPU (jax#12848) and GPU
        (jax#18954): the TPU compiler reports ``temp = 0`` for some programs."""
        fields = {"argument": self.argument, "temp": self.temp}
        negative = {f: getattr(self, f) for f in ("output", "alias", "generated_code")}
        bad = [f for f, v in fields.items() if v <= 0] + [f for f, v in negative.items() if v < 0]
        return tuple(bad) + (("peak",) if self.compiler_peak is not None and self.compiler_peak <= 0 else ())

    @property
    def compiler_peak_is_host(self) -> bool:
        """Whether the compiler's peak reads as the arguments plus the host temporaries (to
        within :data:`HOST_PEAK_SLACK`), not the device's: libtpu states so for programs that
        offload much, e.g. 115.6 GiB for a Llama 3.1 70B step it compiled for a 31.25 GiB v6e
        (arguments 3.1 GiB + host temporaries 112.5 GiB + 37.6 KB), on v5e, v5p and v6e alike
        (``benchmarks/results/published_configs.md``, "Memory")."""
        return (self.host_temp > 0 and self.compiler_peak is not None
                and 0 <= self.compiler_peak - (self.argument + self.host_temp) < HOST_PEAK_SLACK)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def peak(self) -> int:
        """Peak device bytes of one step, the figure the budget is checked against.

        On TPU the compiler's peak: the TPU compiler's own out-of-memory verdict holds to it
        (``benchmarks/tpu_peak_rule.py``: at every batch it fitted, the compiler's peak was
        within the chip's HBM, where the breakdown sum was over it at some), and it stands
        where the breakdown's temp reads 0; the breakdown sum where the compiler's peak
        itself is unreported (0 or negative) or is the host's (:attr:`compiler_peak_is_host`:
        the device's own is not stated, and the sum is at least it). Either is capped at the
        :attr:`hbm` the compiler compiled the program for (``compiler_verdict``): it compiled it,
        so the program fits that, where the breakdown sum of a program that offloads reads
        over it (a Llama 3.1 70B step MaxText ran on v6e-32: 34.3 GiB of 31.25 GiB). Elsewhere
        the larger of the breakdown sum and the compiler's peak (CPU: the breakdown sum, matched
        to the byte; the compiler's peak is not kept)."""
        source = self.peak_source
        if source == "compiler_verdict":
            assert self.hbm is not None
            return self.hbm
        return self.compiler_peak if source == "compiler_peak" and self.compiler_peak else self.breakdown_sum

    @computed_field  # type: ignore[prop-decorator]
    @property
    def peak_source(self) -> Literal["breakdown_sum", "compiler_peak", "compiler_verdict"]:
        """Which figure :attr:`peak` is (see there): ``compiler_verdict``, the HBM the compiler
        compiled the program for, is an upper bound, not the program's own peak."""
        read = self.compiler_peak is not None and self.compiler_peak > 0
        if self.platform is not None and is_tpu(self.platform):
            figure = self.compiler_peak if read and not self.compiler_peak_is_host else None
            if self.hbm is not None and (figure if figure is not None else self.breakdown_sum) > self.hbm:
                return "compiler_verdict"
            return "compiler_peak" if figure is not None else "breakdown_sum"
        return "compiler_peak" if read and (self.compiler_peak or 0) > self.breakdown_sum else "breakdown_sum"


class RawMeasurement(BaseModel):
    """What the compiler and the clock said of one plan on one device, budget-free: judged by
    :func:`judge`, kept as it is by the measurement cache."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="strings")

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
    flops: float | None = None
    bytes_accessed: float | None = None
    compile_seconds: float | None = None
    compiled_at: tuple[float, float] | None = None
    """When the worker compiled the plan (start and end, Unix seconds): now, or earlier where it
    kept the executable."""
    ran_at: tuple[float, float] | None = None
    """When the plan held the device (start and end, Unix seconds): its state placed, checked
    and timed. Plans of one host never hold its device at once (see ``Target.device_lock``)."""
    time_source: Literal["measured", "estimated"] | None = None
    """``measured``: the plan ran and was timed; ``estimated``: a compile-only target's model of
    its step; None: it never ran (it was over the budget it was measured under, or failed its
    check first)."""
    step_times: tuple[float, ...] = ()
    """Seconds of each timed repeat (measured on the local device)."""
    anchor_times: tuple[float, ...] = ()
    """Seconds of the anchor plan's step run just before each of :attr:`step_times`
    (``timing.anchor``): both ran under the same load, so their ratio is free of what drifts
    between rounds."""
    loss: float | None = None
    """The loss after the last timed step (not finite: the plan fails)."""
    first_loss: float | None = None
    """The loss of the checked first step (not finite: the plan fails, whatever the check
    says, and is not timed); None where the first step was not checked."""
    estimated_seconds: float | None = None
    """The estimate of one step, for targets where nothing runs: :attr:`estimate`'s seconds,
    or in measurements of schema 3 and before, the whole-program roofline."""
    estimate: StepEstimate | None = None
    """What the step-time model (``step_time.estimate_step``) made of the compiled program."""
    grad_rel_error: float | None = None
    """The check's largest norm-relative error of any array (:attr:`GradientCheck.max_error`);
    in measurements of schema 12 and before, max |Δ − Δref| / max |Δref| of the state's change."""
    grad_check: GradientCheck | None = None
    """The check of the first step against the reference's, with its thresholds and what they
    were made of (None where not checked, and in measurements of schema 12 and before)."""
    grad_reference: Literal["none", "full"] | None = None
    """The plan whose first step this plan's was checked against: ``full`` (full remat). In
    measurements of schema 1 (see :data:`MEASUREMENT_SCHEMA`), ``none``: gradients of no remat."""
    reference_from: Literal["computed", "loaded"] | None = None
    """Where the reference's first step came from: run by this worker (``computed``), or
    ``loaded`` from the study's artifacts, saved by an earlier worker of the same devices and
    mesh on one host (a slice loads it only where every process finds it, and saves none)."""
    grad_skipped: str | None = None
    """Why a plan that ran was not checked: the reference does not fit the budget it ran
    under, and nothing over the budget is run."""
    program_digest: str | None = None
    """The compiled program's digest (``executables.program_digest``): plans that compile to
    the same program share it (None in measurements made before it was kept)."""
    slice_peaks: tuple[int, ...] = ()
    """On a slice, each process's peak, in process order (the plan's peak is the largest);
    empty on one host."""
    same_program_as: str | None = None
    """The digest of the plan that ran for this measurement, where this plan compiled to the
    same program (:attr:`program_digest`) and was not run itself: its check and times are that
    plan's. None: this plan ran (or never needed to)."""

    @property
    def peak_bytes(self) -> int | None:
        """Peak device bytes (per chip) as compiled; where the compiler ran out of memory, the
        bytes it needs in full (:attr:`oom_required_bytes`); None when the compile did not get
        that far."""
        return self.memory.peak if self.memory else self.oom_required_bytes

    @property
    def time_model(self) -> str | None:
        """Which model estimated :attr:`estimated_seconds`: ``fusions`` (``step_time``) or, in
        measurements of schema 3 and before, ``roofline`` (whole-program); None where not estimated."""
        if self.estimated_seconds is None:
            return None
        return TIME_MODEL if self.estimate is not None else "roofline"

    @property
    def compiled(self) -> bool:
        """Whether the compiler saw the plan (it was not screened out, nor failed before)."""
        return self.memory is not None or self.oom_required_bytes is not None

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


class Measurement(RawMeasurement):
    """What the runner saw for one (workload, plan, device), with the verdict against a study's
    budget and gradient tolerance (see :func:`judge`) and the study's anchor time.

    Stored flat, as one JSON object, so that measurements stored before the raw part was kept
    apart read as they did. :attr:`raw` is the part the verdict was given on."""

    status: Verdict
    error: str | None = None
    """Why it failed or is infeasible: the check of its first step, a loss that is not finite, or the worker's
    own failure (a crash, a timeout, an exception), where there is no raw measurement."""
    anchor_seconds: float | None = None
    """The study's reference time of the anchor, in which :attr:`step_seconds` of an
    anchored measurement is expressed (set by the search as it records the trial)."""
    screened_bytes: int | None = None
    """Where the plan was screened out without compiling (``prescreen``): the peak the
    study's cost model predicted for it, far over the budget (a verdict without a raw
    measurement)."""

    @property
    def raw(self) -> RawMeasurement:
        """The raw measurement the verdict was given on, as it was measured or cached."""
        return RawMeasurement(**{name: getattr(self, name) for name in RawMeasurement.model_fields})

    @property
    def peak_bytes(self) -> int | None:
        """As compiled (see :attr:`RawMeasurement.peak_bytes`); for a screened plan, as predicted."""
        peak = super().peak_bytes
        return peak if peak is not None else self.screened_bytes

    @property
    def step_seconds(self) -> float | None:
        """The step time the study ranks by, for a plan judged measured (None otherwise): the
        median ratio to the anchor times the study's anchor seconds where anchored, else the
        measured median, or the estimate."""
        if self.status != "measured":
            return None
        if self.anchor_ratio is not None and self.anchor_seconds:
            return self.anchor_ratio * self.anchor_seconds
        return self.median_seconds if self.step_times else self.estimated_seconds

    @property
    def spread(self) -> float | None:
        """(max − min) / median of what :attr:`step_seconds` is the median of (the ratios to
        the anchor, or the timed repeats): how far to trust it. None where it has no step time."""
        values = self.anchor_ratios or self.step_times
        return relative_spread(values) if values and self.status == "measured" else None


def judge(raw: RawMeasurement, *, budget: int, gradient_tolerance: float | None = None) -> Measurement:
    """The verdict on ``raw`` against ``budget`` and, where given, ``gradient_tolerance``: the
    worker's on what it has just measured and the cache's on what it kept, alike.

    Over budget where the compiler ran out of memory (final, whatever the budget) or the peak
    exceeds ``budget``; failed where the first step fails its check (its measured threshold, or
    ``gradient_tolerance`` in its place: :meth:`GradientCheck.failure`), or the loss of its
    first step or after the timed steps is not finite (a non-finite first loss is named first,
    even where the check passed); else measured. ``raw`` is kept as it is. A plan that fits but
    never ran has no verdict (``ValueError``): it must be measured (see ``cache.measure_again``).
    """
    peak = raw.peak_bytes
    if peak is None:
        raise ValueError(f"plan {raw.plan_digest}: never compiled, so nothing to judge")
    if raw.memory is None or peak > budget:
        return _verdict(raw, "over_budget")
    if raw.first_loss is not None and not math.isfinite(raw.first_loss):
        return _verdict(raw, "failed", f"loss is {raw.first_loss} at its first step (not finite); not timed")
    failure = raw.grad_check.failure(gradient_tolerance) if raw.grad_check is not None else None
    if failure is not None:
        return _verdict(raw, "failed", failure)
    if raw.time_source is None:
        raise ValueError(f"plan {raw.plan_digest}: fits the budget but never ran, so it must be measured")
    if raw.loss is not None and not math.isfinite(raw.loss):
        return _verdict(raw, "failed", f"loss is {raw.loss} after the timed steps")
    return _verdict(raw, "measured")


def _verdict(raw: RawMeasurement, status: Verdict, error: str | None = None) -> Measurement:
    return Measurement(**dict(raw), status=status, error=error)


def relative_spread(values: Sequence[float]) -> float:
    """(max − min) / median: how far apart repeated timings of one thing fell."""
    return (max(values) - min(values)) / statistics.median(values)
