"""A study and its trials in words: the plain text both faces print, the CLI and the service.

Lines and notes, not tables: a trial's step time as every table shows it, a trial in a log
line or in full, a study's progress and estimated time to finish, the front as JSON, the
budget as understood. The CLI sets them in its rich tables and prints them; the service
answers with them and puts them in the study's page; so the two say the same thing in the
same words. Nothing here imports rich.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from remat_search.units import format_bytes, format_duration, format_seconds, size_argument

if TYPE_CHECKING:  # the CLI imports this module for --help too: what reads studies comes with its data
    from remat_search.measure.check import GradientCheck
    from remat_search.measure.measurement import MemoryBreakdown, RawMeasurement
    from remat_search.report.queries import StudySummary
    from remat_search.report.results import Settlement, TrialResult
    from remat_search.targets.step_time import StepEstimate


def front_json(front: Iterable[TrialResult]) -> str:
    """The front as ``pareto --json`` prints it (and ``GET /studies/{study}/pareto`` returns it)."""
    return json.dumps([t.model_dump(mode="json") for t in front], indent=2)


def progress_text(s: StudySummary) -> str:
    """``4/12``: trials done of the spec's (``4`` where the study does not store its total)."""
    return f"{s.done}/{s.total}" if s.total is not None else str(s.done)


def eta_text(s: StudySummary) -> str:
    """The estimated time to finish, ``finished`` once done, else ``—`` (nothing finished yet)."""
    if s.eta_seconds is not None:
        return "~" + format_duration(s.eta_seconds)
    return "finished" if s.total is not None and s.done >= s.total else "—"


def fastest_text(s: StudySummary) -> str:
    """The study's fastest step so far, ``(est.)`` where estimated, else ``—``."""
    if s.fastest_seconds is None:
        return "—"
    return format_seconds(s.fastest_seconds) + (" (est.)" if s.estimated else "")


def step_text(t: TrialResult) -> str:
    """A plan's one time as tables print it: ``80.3 ms ✓`` where confirmed, ``(est.)`` where
    estimated; with its throughput where it carries a configuration."""
    if t.seconds is None:
        return "—"
    text = format_seconds(t.seconds) + {"confirmed": " ✓", "estimated": f" ({estimate_mark(t)})"}.get(t.time_source or "", "")
    return text if t.throughput is None else f"{text}, {throughput_text(t)}"


def estimate_mark(t: TrialResult) -> str:
    """How an estimated step is marked: ``est.``, with its band where one is known (``est.
    ×0.97-1.03``: the measured step lay between those multiples of such an estimate) and ``cal.``
    where a calibration priced it."""
    e = t.measurement.estimate if t.measurement is not None else None
    if e is None or e.band is None:
        return "est."
    outside = ", outside its samples" if e.outside else ""
    return f"{'cal. ' if e.calibration else ''}est. ×{e.band[0]:.2f}-{e.band[1]:.2f}{outside}"


def band_text(e: StepEstimate) -> str:
    """Where an estimate's error comes from, in words: its calibration's held-out error (a model
    family left out at a time), the published runs of its chip, or nothing known; and what puts
    the plan outside the samples that error was measured on, where something does."""
    if e.band is None:
        return "uncalibrated, its error unknown: no published run or calibration of this chip gives one"
    low, high = e.band
    if e.calibration:
        text = (f"calibrated ({e.calibration}): a model it never saw takes {low:.2f}–{high:.2f}× its estimate "
                "95 times in 100, by its samples' measured steps over their estimates fitted without their model family")
    else:
        text = (f"uncalibrated: by MaxText's published runs of this generation, a run takes {low:.2f}–{high:.2f}× the "
                "model's estimate 95 times in 100 (remat-search calibrate fits it to your own measurements)")
    return text if not e.outside else f"{text}; outside its samples ({e.outside}): an extrapolation"


def band_of(t: TrialResult) -> tuple[float, float] | None:
    """The band of its step where that is an estimate with a known one; else None (only then can
    others be within its error)."""
    e = t.measurement.estimate if t.measurement is not None else None
    return e.band if t.time_estimated and e is not None else None


def rivals(found: TrialResult, others: Iterable[TrialResult]) -> list[TrialResult]:
    """The estimated candidates among ``others`` whose step is within each other's band of
    ``found``'s: the steps their bands allow overlap, so the estimate cannot tell which is faster
    (for candidates of a configuration search, the time a token or example takes: their steps'
    batches differ). None where ``found`` is measured or its band unknown."""
    def span(t: TrialResult) -> tuple[float, float] | None:
        band = band_of(t)
        if band is None or t.seconds is None:
            return None
        per = 1 / t.throughput if t.throughput else t.seconds
        return per * band[0], per * band[1]

    mine = span(found)
    if mine is None:
        return []
    return [t for t in others if t.number != found.number and (theirs := span(t)) is not None
            and theirs[0] <= mine[1] and mine[0] <= theirs[1]]


def rivals_note(found: TrialResult, close: list[TrialResult], shown: int = 3) -> str | None:
    """``best``'s note where its estimated answer is within the estimate's error of others."""
    band = band_of(found)
    if not close or band is None:
        return None
    named = ", ".join(f"trial {t.number} ({t.summary()}, {format_seconds(t.seconds or 0)})" for t in close[:shown])
    more = f" and {len(close) - shown} more" if len(close) > shown else ""
    return (f"note: within the estimate's error of: {named}{more}; its band ×{band[0]:.2f}–{band[1]:.2f} "
            "cannot tell which is faster: measure them on the chip")


def throughput_text(t: TrialResult) -> str:
    """A candidate's throughput, ``12,345 tokens/s per device`` (examples where its workload has
    no sequences); ``—`` for a plan without a configuration."""
    if t.throughput is None or t.plan is None or t.plan.configuration is None:
        return "—"
    unit = "tokens" if t.plan.configuration.sequence > 1 else "examples"
    return f"{t.throughput:,.0f} {unit}/s per device"


def gflop_text(flops: float) -> str:
    """FLOPs in GFLOP: whole numbers from 100 GFLOP, else two decimals."""
    return f"{flops / 1e9:,.0f}" if flops >= 1e11 else f"{flops / 1e9:.2f}"


def budget_line(written: str | None, budget: int) -> str:
    """The budget as understood: ``budget 38MiB`` where the spec wrote it in binary units, else
    what it wrote and what that is (``budget 38mb = 36.2 MiB``: decimal megabytes; ``budget
    70% of no remat's peak (25.1 MiB)``; ``budget device = 15.7 GiB: the device's memory``)."""
    if written is None:
        return f"budget {format_bytes(budget)}: the device's memory (the spec gives no budget)"
    written = written.strip()
    if written == "device":
        return f"budget device = {format_bytes(budget)}: the device's memory"
    if written.endswith("%"):
        return f"budget {written} of no remat's peak ({format_bytes(budget)})"
    if re.search(r"\d\s*[KMGT]iB$", written.strip(), re.IGNORECASE):
        return f"budget {written}"
    return f"budget {written} = {format_bytes(budget)}"


def sharding_line(
    mesh: dict[str, int] | None, shardings: str, device_order: list[int] | None = None, *, per_candidate: bool = False,
) -> str:
    """Where the state's shardings over the mesh came from, and the order of the devices over it
    (``DeviceInfo.device_order``; None: their id order), in a line (``run`` and ``show``).
    ``per_candidate``: the study searches meshes (``spec.configuration``), so each candidate's
    state is sharded over its own mesh, not over ``mesh`` (the target's default)."""
    if per_candidate:
        return f"shardings over each candidate's own mesh (its configuration's): {shardings}"
    if device_order is None:
        devices = "devices in id order"
    else:
        shown = device_order if len(device_order) <= 16 else [*device_order[:16], "…"]
        devices = f"devices [{', '.join(map(str, shown))}] (jax.make_mesh's order)"
    return f"shardings over mesh {mesh} of {devices}: {shardings}"


def no_trial_text(study: str, number: int, total: int) -> str:
    """That ``study``, of ``total`` trials, has no trial ``number`` (``show --trial``, ``GET .../trials/N``)."""
    have = f"trials 0..{total - 1}" if total else "no trials yet"
    return f"study {study!r} has no trial {number} (it has {have})"


def untimed_text(count: int, budget: int, study_budget: int) -> str:
    """That ``count`` plans fit ``budget`` but were never timed, being over the study's own
    budget (what ``best`` notes and ``GET .../best`` says in a header)."""
    return (
        f"{count} plan(s) fit {format_bytes(budget)} but were never timed, being over the study's budget of "
        f"{format_bytes(study_budget)}"
    )


def answer_note(t: TrialResult, budget: int, settled: Settlement, study: str) -> str | None:
    """What ``best`` adds about where its answer's time comes from, unless it is a confirmed
    plan of a budget the latest confirmation settled: that it was never re-timed, or that the
    confirmation's races ran out at this budget."""
    if t.time_source != "search":
        return None
    again = f"remat-search confirm --study {study} --budget {size_argument(budget)}"
    if budget in settled.exhausted:
        return (
            f"note: not re-timed: the confirmation's race budget ran out at {format_bytes(budget)} with this plan "
            f"first by its one search time (biased low among many); `{again} --races N` races further"
        )
    return (
        f"note: not re-timed: its time is the search's single measurement, and the fastest of many noisy times "
        f"is biased low; `{again}` re-times it against the others until the plan that ranks first was re-timed"
    )


def trial_line(t: TrialResult, done: int, total: int) -> str:
    """One finished trial in a line, for logs: number, plan, status, peak and step."""
    m = t.measurement
    status = "fits" if t.time_estimated else t.status
    line = f"trial {t.number} ({done}/{total}) {t.summary()}: {status}"
    if t.status in ("failed", "infeasible"):
        return line + f": {(t.error or 'unknown failure').splitlines()[0]}"
    if m is not None and m.screened_bytes is not None:
        line += f", peak ~{format_bytes(m.screened_bytes)} predicted: not compiled, never run"
    elif t.peak_bytes is not None:
        line += f", peak {format_bytes(t.peak_bytes)}"
        line += f", step {step_text(t)}" if t.seconds else ": never run"
    if t.reused_from is not None:
        line += f" (= trial {t.reused_from}: the same plan, its measurement reused)"
    if t.cached_from:
        line += f" (cached from {t.cached_from}: not compiled again)"
    if t.same_program_as:
        line += f" (the same compiled program as {t.same_program_as}: its measurement reused, not run again)"
    return line


def running_text(t: TrialResult) -> str:
    """What the search is doing with a trial now, for a progress bar."""
    if t.reused_from is not None or t.cached_from:
        return f"trial {t.number}: reusing the measurement of {t.summary()}"
    return f"trial {t.number}: compiling and timing {t.summary()}"


def time_models_note(trials: Iterable[TrialResult]) -> str | None:
    """A note where a study's step times were estimated by more than one model (a study
    searched before the per-instruction model, resumed after it): their times do not compare."""
    older = sum(1 for t in trials if t.measurement is not None and t.measurement.time_model == "roofline")
    newer = sum(1 for t in trials if t.measurement is not None and t.measurement.time_model == "fusions")
    if not (older and newer):
        return None
    return (
        f"note: {older} trial(s) were estimated by the whole-program roofline and {newer} by the per-instruction "
        "model that replaced it: their step times do not compare; search again under a new study name"
    )


def _estimate_line(m: RawMeasurement) -> str:
    """How a compile-only target's step time was estimated, by which model (``time_model``)."""
    e = m.estimate
    if e is None:  # measured before the per-instruction model (schema 3 and older)
        return (
            f"  step: estimated {format_seconds(m.estimated_seconds)} by the whole-program roofline of "
            f"{(m.flops or 0) / 1e9:.1f} GFLOP and {(m.bytes_accessed or 0) / 1e9:.2f} GB of HBM traffic per chip "
            "(the older model; nothing was run)"
        )
    old = f"; the whole-program roofline says {format_seconds(e.roofline_seconds)}" if e.roofline_seconds else ""
    host = (
        f" + waiting for host transfers {format_seconds(e.host_wait_seconds)} ({e.host_bytes / 1e9:.3f} GB to and "
        f"from host memory, the link busy {format_seconds(e.host_seconds)}"
        f"{f' at {e.host_bytes / e.host_seconds / 1e9:.3g} GB/s' if e.host_seconds else ''}, overlapped with the compute between "
        f"each transfer's start and its done)" if e.host_bytes else ""
    )
    padded = (f", {e.mxu_flops / 1e9:.1f} as the matrix units spend them, padded to their tiles"
              if e.mxu_flops > e.flops else "")
    return (
        f"  step: estimated {format_seconds(e.seconds)} by the per-instruction model: compute and memory "
        f"{format_seconds(e.compute_seconds)} over {e.instructions} instructions ({e.flops / 1e9:.1f} GFLOP{padded}, "
        f"{e.hbm_bytes / 1e9:.2f} GB of HBM traffic per chip) + collectives {format_seconds(e.collective_seconds)} "
        f"waited for ({e.collective_bytes / 1e9:.3f} GB over ICI, the asynchronous ones overlapped with the compute "
        f"scheduled beside them){host}{old}; nothing was run\n"
        f"  error: {band_text(e)}"
    )


def _unreported_line(mem: MemoryBreakdown) -> str:
    """What ``show`` says of a breakdown whose figures ``memory_analysis()`` gave as 0 or less."""
    names = ", ".join("peak_memory_in_bytes" if f == "peak" else f"{f}_size_in_bytes" for f in mem.unreported)
    fell_back = {"compiler_peak": "the compiler's peak", "breakdown_sum": "the breakdown sum",
                 "compiler_verdict": "the HBM the compiler compiled it for"}[mem.peak_source]
    return (
        f"  memory_analysis() gave {names} as 0 or less (a known JAX issue on TPU, jax#12848): "
        f"not what the step holds, so the peak is {fell_back}"
    )


def ran_on(m: Any, device: dict[str, Any] | None) -> str:
    """Where a measured trial ran: its hosts (a slice's processes) and devices, and on a slice
    each host's peak."""
    hosts = len(m.slice_peaks) or 1
    devices = f", {device['device_count']} devices" if device and device.get("device_count") else ""
    if hosts == 1:
        return f"  ran on 1 host{devices}"
    peaks = ", ".join(format_bytes(p) for p in m.slice_peaks)
    return (f"  ran on a slice of {hosts} hosts{devices}, in lockstep (each step the slowest host's); "
            f"peak per host: {peaks}")


def check_lines(c: GradientCheck, tolerance: float | None) -> list[str]:
    """The check of a trial's first step, in lines: what was compared, the figures beside their
    thresholds, and what the thresholds were made of."""
    failure = c.failure(tolerance)
    return [
        f"  first step vs full remat's: {c.compared}, {c.arrays} arrays: " + ("passed" if failure is None else "FAILED"),
        f"    worst array {c.leaf}: {c.leaf_error:.2e} of threshold {c.leaf_threshold:.2e}; largest error {c.max_error:.2e}; "
        f"all arrays {c.tree_error:.2e} of {c.tree_threshold:.2e}; loss {c.loss_error:.2e} of {c.loss_threshold:.2e} (norm-relative)",
        f"    threshold: {c.threshold_text(tolerance)}"
        + ("" if c.reproducible else "; the reference is NOT reproducible"),
    ]


def describe_trial(t: TrialResult, device: dict[str, Any] | None = None, tolerance: float | None = None) -> str:
    """A multi-line account of one trial: per-layer plan and the whole measurement; with the
    study's ``device`` (as stored), where it ran: how many hosts and devices; its first step's
    check against the study's ``gradient_tolerance`` (None: the measured threshold)."""
    from remat_search.measure.measurement import relative_spread

    lines = [f"trial {t.number}: {t.status}" + (f" (reuses trial {t.reused_from})" if t.reused_from is not None else "")]
    if t.plan:
        labels = t.labels if len(t.labels) == len(t.plan.layers) else [""] * len(t.plan.layers)
        layers = [f"{label + ' = ' if label and label != str(p) else ''}{p}" for label, p in zip(labels, t.plan.layers, strict=True)]
        first = 0  # a run of layers with one policy (a scanned model's: all of them) in one line
        for i, shown in enumerate(layers):
            if i + 1 == len(layers) or layers[i + 1] != shown:
                lines.append(f"  layer {i:2d}: {shown}" if first == i else f"  layers {first:2d}–{i}: {shown}")
                first = i + 1
        lines.append(f"  plan digest: {t.plan.digest}")
    m = t.measurement
    if m and m.memory:
        mem = m.memory
        lines.append(
            f"  peak {format_bytes(mem.peak)} per device, from the {mem.peak_source.replace('_', ' ')}: "
            f"argument {format_bytes(mem.argument)} + output {format_bytes(mem.output)} − alias "
            f"{format_bytes(mem.alias)} + temp {format_bytes(mem.temp)} + code {format_bytes(mem.generated_code)}"
            + (f"; compiler peak {format_bytes(mem.compiler_peak)}" if mem.compiler_peak is not None else "")
        )
        if mem.unreported:
            lines.append(_unreported_line(mem))
        if mem.compiler_peak_is_host:
            lines.append("  the compiler's peak is its arguments plus its host temporaries (libtpu's figure of a program "
                         "that offloads): the device's own peak is not stated, so the peak is the breakdown sum, at least it"
                         + (", or the HBM below it" if mem.peak_source == "compiler_verdict" else ""))
        if mem.peak_source == "compiler_verdict":
            lines.append(f"  at most {format_bytes(mem.peak)}: the TPU compiler compiled it for {format_bytes(mem.peak)} "
                         "of HBM a chip, and it refuses a program that does not fit (its out-of-memory verdict); "
                         f"the {'breakdown sum' if mem.compiler_peak_is_host or not mem.compiler_peak else 'compiler peak'} "
                         "reads more, an upper bound the compiler's verdict is below")
        if mem.host_total or mem.host_temp:
            lines.append(
                f"  host memory, from the compiler: {format_bytes(mem.host_total)}: argument "
                f"{format_bytes(mem.host_argument)} + output {format_bytes(mem.host_output)} − alias "
                f"{format_bytes(mem.host_alias)} + temp {format_bytes(mem.host_temp)} + code "
                f"{format_bytes(mem.host_generated_code)} (not in the device peak)"
            )
        lines.append(f"  compile {m.compile_seconds:.2f} s, {gflop_text(m.flops)} GFLOP by XLA's cost analysis "
                     "(a loop's body counted once)" if m.flops else "")
    if m and m.estimated_seconds is not None:
        lines.append(_estimate_line(m))
    if t.plan is not None and t.plan.configuration is not None:
        c = t.plan.configuration
        lines.append(
            f"  configuration: {c.batch} examples a device a micro-step, {c.accumulation} micro-step(s) a step "
            f"(global batch {c.global_batch}), mesh {c.mesh_axes or 'one device'}"
            + (f"; {throughput_text(t)}" if t.throughput is not None else "")
        )
    if m and m.screened_bytes is not None:
        lines.append(
            f"  screened out, never compiled: the study's cost model predicts a peak of "
            f"{format_bytes(m.screened_bytes)}, more than prescreen × budget even allowing for its largest over-prediction"
        )
    if m and m.oom_required_bytes is not None:
        needs = f"needs {format_bytes(m.oom_required_bytes)} per chip"
        if m.oom_temp_bytes is not None:  # measurement schema 2 on: the peak in full
            needs += (
                f" (temporaries {format_bytes(m.oom_temp_bytes)}, as its error states, + arguments and outputs "
                f"less aliased {format_bytes(m.oom_required_bytes - m.oom_temp_bytes)}, their per-chip sizes)"
            )
        else:
            needs += " for its temporaries alone"
        lines.append(
            f"  the compiler ran out of memory: it {needs}, {format_bytes(m.oom_available_bytes or 0)} available"
        )
    if m and m.step_times:
        lines.append(
            f"  step: median {format_seconds(m.median_seconds)}, min {format_seconds(m.min_seconds)}, "
            f"spread {relative_spread(m.step_times):.0%} over {len(m.step_times)} repeats"
        )
    if m and m.time_source == "measured":
        lines.append(ran_on(m, device))
    if m and m.anchor_ratio is not None and m.anchor_seconds:
        lines.append(
            f"  vs the anchor (full remat), step by step: median ratio {m.anchor_ratio:.3f}, "
            f"spread {m.spread:.0%}; at the study's anchor time of {format_seconds(m.anchor_seconds)}: "
            f"{format_seconds(m.step_seconds)}"
        )
    if t.confirmed:
        c = t.confirmed
        lines.append(
            f"  confirmed: median {format_seconds(c.median)}, spread {c.spread:.0%} over {len(c.times)} "
            f"interleaved rounds ({c.session})"
            + (f"; median ratio {c.anchor_ratio:.3f} to the anchor timed in the same rounds" if c.anchor_ratio else "")
        )
    if t.seconds is not None:
        source = {"confirmed": "its confirmed time", "search": "the search's time", "estimated": "the estimate"}
        lines.append(f"  its one time, in every table and the plot: {step_text(t)} ({source[t.time_source or 'search']})")
    if t.prediction and m and m.peak_bytes:
        p = t.prediction
        lines.append(
            f"  planner predicted peak {format_bytes(int(p['peak']))} ({p['peak'] / m.peak_bytes - 1:+.1%})"
            + (f", step {format_seconds(p['seconds'])} ({p['seconds'] / m.step_seconds - 1:+.1%})"
               if m.status == "measured" and m.step_seconds else "")
            + f" for a target of {format_bytes(int(p['target']))}"
        )
    if t.cached_from:
        lines.append(f"  measurement reused from {t.cached_from} (same workload, plan and device)")
    if t.same_program_as:
        lines.append(
            f"  compiled to the same program as {t.same_program_as}'s plan (same workload and device): "
            "its measurement reused, this plan not run"
        )
    if m and m.program_digest:
        lines.append(f"  program digest: {m.program_digest}"
                     + (f" (run as plan {m.same_program_as})" if m.same_program_as else ""))
    if m and m.grad_check is not None:
        lines += check_lines(m.grad_check, tolerance)
    elif m and m.grad_rel_error is not None:  # measured before the check compared gradients (schema 12 and before)
        checked = "first step (state change and loss) vs full remat's" if m.grad_reference == "full" else "gradients vs no remat"
        lines.append(f"  {checked}: relative error {m.grad_rel_error:.2e} (max |Δ − Δref| / max |Δref|)")
    if m and m.grad_skipped:
        lines.append(f"  gradients not checked: {m.grad_skipped}")
    if t.error:
        lines.append(f"  error: {t.error}")
    return "\n".join(line for line in lines if line)
