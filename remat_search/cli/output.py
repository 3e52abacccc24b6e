"""Everything the CLI prints: rich tables for people, JSON for programs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from remat_search.units import format_bytes, format_duration, format_seconds, size_argument

if TYPE_CHECKING:  # the CLI imports this module for --help too: what reads studies comes with its data
    from remat_search.cli.doctor import Check
    from remat_search.measure.measurement import MemoryBreakdown, RawMeasurement
    from remat_search.search.planner import Advice
    from remat_search.report.queries import StudySummary
    from remat_search.report.results import Settlement, StudyReport, TrialResult
    from remat_search.search.progress import Progress

console = Console()
errors = Console(stderr=True)

_STATUS_STYLE = {
    "measured": "green", "over_budget": "yellow", "failed": "red", "interrupted": "dim", "running": "cyan",
    "waiting": "dim",
}


FULL_WIDTH = 110
"""Terminal columns below which tables leave out their low-value columns (spread, FLOPs, the
peak as % of the budget, search ranks), so that nothing is cut: the plan wraps at spaces
between labels, numbers and status words stay whole."""


def _narrow() -> bool:
    return console.width < FULL_WIDTH


def _table(title: str, columns: dict[str, dict]) -> Table:
    """A table with ``columns`` (name → ``add_column`` settings). Numbers never wrap; the plan
    wraps at spaces, never narrower than its longest label run; other text wraps too."""
    table = Table(title=title, title_justify="left")
    for name, settings in columns.items():
        table.add_column(name, **settings)
    return table


_NUMBER = {"justify": "right", "no_wrap": True}
_PLAN = {"min_width": 15, "ratio": 1}
_STATUS = {"min_width": len("over_budget")}


def trials_table(title: str, trials: Iterable[TrialResult], *, budget: int | None = None) -> Table:
    """One row a trial: plan, peak, median step time with its spread, FLOPs, status (on a narrow
    terminal without the spread, FLOPs and peak as % of the budget)."""
    narrow = _narrow()
    columns = {
        "trial": _NUMBER, "plan": _PLAN, "peak": _NUMBER, "step": _NUMBER, "spread": _NUMBER,
        "GFLOP": _NUMBER, "status": _STATUS,
    }
    if narrow:
        del columns["spread"], columns["GFLOP"]
    table = _table(title, columns)
    for t in trials:
        m = t.measurement
        screened = m is not None and m.screened_bytes is not None
        peak = ("~" if screened else "") + (format_bytes(t.peak_bytes) if t.peak_bytes is not None else "—")
        if budget and t.peak_bytes is not None and not narrow:
            peak += f" ({t.peak_bytes / budget:.0%})"
        status = ("fits" if t.time_estimated else t.status) + (f" = #{t.reused_from}" if t.reused_from is not None else "")
        if screened:
            status += " (predicted, not compiled)"
        if t.cached_from:
            status += f" (cached: {t.cached_from})"
        if t.same_program_as:
            status += f" (same program: {t.same_program_as})"
        if t.error and t.status == "failed":
            status += f": {t.error.splitlines()[0][:80]}"
        cells = {
            "trial": str(t.number),
            "plan": t.summary(),
            "peak": peak,
            "step": step_text(t),
            "spread": _spread(t),
            "GFLOP": _gflop(m.flops) if m and m.flops is not None else "—",
            "status": Text(status, style=_STATUS_STYLE.get(t.status, "")),  # Text: an error's brackets are not markup
        }
        table.add_row(*(cells[c] for c in columns))
    table.caption = TIME_NOTE + ("" if narrow else "; " + SPREAD_NOTE)
    table.caption_justify = "left"
    return table


TIME_NOTE = (
    "step: each plan's one time, ✓ confirmed (re-timed interleaved with the others), else the search's; "
    "both in the study's anchor seconds where it times against the anchor"
)
SPREAD_NOTE = (
    "spread ±x%: half the (max − min) / median range of the repeats behind the step (the trial's "
    "timed repeats, or its re-timed rounds where confirmed; of the ratios to the anchor where anchored)"
)


def step_text(t: TrialResult) -> str:
    """A plan's one time as tables print it: ``80.3 ms ✓`` where confirmed, ``(est.)`` where estimated."""
    if t.seconds is None:
        return "—"
    return format_seconds(t.seconds) + {"confirmed": " ✓", "estimated": " (est.)"}.get(t.time_source or "", "")


def _spread(t: TrialResult) -> str:
    from remat_search.measure.measurement import relative_spread

    c, m = t.confirmed, t.measurement
    if t.time_source == "confirmed" and c is not None:
        return f"±{relative_spread(c.ratios or c.times) / 2:.0%}"
    return f"±{m.spread / 2:.0%}" if m and m.spread is not None else "—"


def confirmed_table(report: StudyReport, confirmed: list[TrialResult]) -> Table:
    """The confirmed plans, fastest first, beside their search medians and ranks, each with
    how much slower than the fastest it is (paired by round, with an interval whose real
    coverage at that many rounds the header states). On a narrow terminal: trial, plan, peak,
    confirmed median and the comparison only."""
    from remat_search.search.confirm import compare_times, interval_order

    narrow = _narrow()
    coverage = interval_order(len(confirmed[0].confirmed.times))[1] if confirmed[0].confirmed else 0.0
    versus_column = f"vs fastest ({coverage:.0%} interval)"
    columns = {
        "rank": _NUMBER, "trial": _NUMBER, "plan": _PLAN, "peak": _NUMBER, "step": _NUMBER,
        "spread": _NUMBER, versus_column: {"justify": "right"}, "search rank": _NUMBER,
    }
    if narrow:
        for name in ("rank", "spread", "search rank"):
            del columns[name]
    table = _table(f"Confirmed plans of {report.study!r}, re-timed interleaved (fastest first)", columns)
    by_search = sorted(confirmed, key=lambda t: (t.step_seconds, t.number))
    fastest, unresolved = confirmed[0].confirmed, False
    for rank, t in enumerate(confirmed, 1):
        assert t.confirmed is not None and fastest is not None
        versus = "—"
        if rank > 1:
            c = compare_times(t.confirmed.times, fastest.times)
            versus = f"{c.ratio - 1:+.1%} ({c.low - 1:+.1%}…{c.high - 1:+.1%})" + ("" if c.resolved else " ≈")
            unresolved |= not c.resolved
        cells = {
            "rank": str(rank), "trial": str(t.number), "plan": t.summary(),
            "peak": format_bytes(t.peak_bytes) if t.peak_bytes else "—",
            "step": step_text(t), "spread": _spread(t),
            versus_column: versus, "search rank": str(by_search.index(t) + 1),
        }
        table.add_row(*(cells[c] for c in columns))
    table.caption = (
        TIME_NOTE + "; " + ("" if narrow else SPREAD_NOTE + "; search rank: by the search's times; ")
        + "vs fastest: the median of the per-round ratios to the fastest, with an interval that holds the true "
        f"ratio with {coverage:.0%} probability at this many rounds."
    )
    if unresolved:
        table.caption += (
            f" ≈ within this machine's timing noise of the fastest: its {coverage:.0%} interval includes no "
            "difference (ranks follow the medians; the paired ratio may then fall on either side of 0). More "
            "rounds (remat-search confirm --rounds 40) or a quieter machine tell them apart."
        )
    table.caption_justify = "left"
    return table


def advice_table(advice: Advice) -> Group:
    """The planner's plan for a budget: predicted vs measured peak and step time."""
    solve = "exact" if advice.thinned_to is None else f"approximate (front thinned to {advice.thinned_to:,} states)"
    header = Text(
        f"Planned for {format_bytes(advice.budget)} from {advice.observations} measured plans of "
        f"{advice.study!r} (calibration margin {advice.margin:.1%}; solve {solve}):\n"
        f"  {advice.plan.summary(advice.labels)}"
        + (f"\n  the best measured plan, not the model's: {advice.reason}" if advice.reason else "")
    )
    table = Table()
    for column in ("", "predicted", "measured", "error"):
        table.add_column(column, justify="right")
    measured, p = advice.measured, advice.predicted
    for name, predicted, seen, fmt in (
        ("peak", p and p.peak, measured.peak_bytes if measured else None, lambda v: format_bytes(int(v))),
        ("step", p and p.seconds, measured.seconds if measured else None, format_seconds),
    ):
        error = f"{predicted / seen - 1:+.1%}" if seen and predicted else "—"
        table.add_row(name, fmt(predicted) if predicted else "—", fmt(seen) if seen else "—", error)
    if measured is not None:
        table.add_row("trial", "", f"{measured.number} ({measured.status})", "")
    return Group(header, table)


def front_json(front: Iterable[TrialResult]) -> str:
    """The front as ``pareto --json`` prints it (and ``GET /studies/{study}/pareto`` returns it)."""
    return json.dumps([t.model_dump(mode="json") for t in front], indent=2)


def budget_line(written: str | None, budget: int) -> str:
    """The budget as understood: ``budget 38MiB`` where the spec wrote it in binary units, else
    what it wrote and what that is (``budget 38mb = 36.2 MiB``: decimal megabytes)."""
    if written is None:
        return f"budget {format_bytes(budget)}: the device's memory (the spec gives no budget)"
    if re.search(r"\d\s*[KMGT]iB$", written.strip(), re.IGNORECASE):
        return f"budget {written}"
    return f"budget {written} = {format_bytes(budget)}"


def sharding_line(mesh: dict[str, int] | None, shardings: str, device_order: list[int] | None = None) -> str:
    """Where the state's shardings over the mesh came from, and the order of the devices over it
    (``DeviceInfo.device_order``; None: their id order), in a line (``run`` and ``show``)."""
    if device_order is None:
        devices = "devices in id order"
    else:
        shown = device_order if len(device_order) <= 16 else [*device_order[:16], "…"]
        devices = f"devices [{', '.join(map(str, shown))}] (jax.make_mesh's order)"
    return f"shardings over mesh {mesh} of {devices}: {shardings}"


def progress_lines(p: Progress, study: str, *, budget_given: bool = True) -> list[str]:
    """What a search's or a confirmation's event says, as lines (a trial's: :func:`trial_line`).
    ``budget_given``: the spec gave a budget (already echoed), else the device's is said here."""
    if p.event == "start" and p.device is not None and p.budget is not None:
        d = p.device
        lines = [
            f"study {study}: {p.done}/{p.total} trials done; compiling for {d.target} = {d.device_count}× "
            f"{d.device_kind}" + (f", mesh {d.mesh}" if d.mesh else "")
            + ("" if d.executes else " (compile only: step times are estimated from the compiled program)")
        ]
        if d.workload_note:
            lines.append(d.workload_note)
        if d.shardings:
            lines.append(sharding_line(d.mesh, d.shardings, d.device_order))
        if not budget_given:
            lines.append(budget_line(None, p.budget))
        if p.done >= p.total:
            lines.append(
                f"all {p.total} trials of the spec are stored: nothing to measure, the results below are the "
                "stored ones (raise trials to search further)"
            )
        return lines
    if p.event == "confirm" and p.race:
        return [
            f"race {p.race}: a plan the last session did not re-time ranks first by its search time; re-timing it "
            f"with the others: {p.plans} plans × {p.rounds} rounds…"
        ]
    if p.event == "confirm":
        return [f"confirming {p.plans} plans × {p.rounds} rounds, interleaved in one worker…"]
    if p.event == "confirmed" and p.reused:
        reused = f"confirmation: these {p.plans} plans were re-timed together before ({p.rounds} rounds): their "
        return [reused + "stored times stand, nothing was re-timed"]
    if p.event == "confirmed" and p.exhausted:
        return [
            f"confirmation: the race budget ran out ({p.race} races, confirm.races): the plan that ranks first "
            "was timed by the search only, and `best` says so; `remat-search confirm` races again"
        ]
    if p.event == "confirm_elsewhere":
        return [f"confirmation: {p.holder} is confirming this study; its re-timed plans are stored for every reader"]
    return []


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
    if t.status == "failed":
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


def _gflop(flops: float) -> str:
    return f"{flops / 1e9:,.0f}" if flops >= 1e11 else f"{flops / 1e9:.2f}"


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
    return (
        f"  step: estimated {format_seconds(e.seconds)} by the per-instruction model: compute and memory "
        f"{format_seconds(e.compute_seconds)} over {e.instructions} instructions ({e.flops / 1e9:.1f} GFLOP, "
        f"{e.hbm_bytes / 1e9:.2f} GB of HBM traffic per chip) + collectives {format_seconds(e.collective_seconds)} "
        f"({e.collective_bytes / 1e9:.3f} GB over ICI, not overlapped){old}; nothing was run"
    )


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


def _seconds(seconds: float | None, *, estimated: bool) -> str:
    if seconds is None:
        return "—"
    return format_seconds(seconds) + (" (est.)" if estimated else "")


def front_table(study: str, budget: int, front: Iterable[TrialResult]) -> Table:
    """The Pareto front of ``study``, whose budget is ``budget``."""
    return trials_table(
        f"Pareto front of {study!r} (budget {format_bytes(budget)}"
        + ("" if _narrow() else ", peak as % of it") + ")",
        front, budget=budget,
    )


def studies_table(summaries: Iterable[StudySummary]) -> Table:
    """One row a study: its trial counts (on a narrow terminal in one column), progress
    (trials done of the spec's, running), the estimated time to finish, the fastest step."""
    narrow = _narrow()
    columns = {
        "study": {"overflow": "fold", "ratio": 1}, "device": {}, "budget": _NUMBER,
        "complete": _NUMBER, "failed": _NUMBER, "running": _NUMBER, "trials": {},
        "done": _NUMBER, "ETA": _NUMBER, "fastest (step)": _NUMBER,
    }
    for name in ("complete", "failed", "running") if narrow else ("trials",):
        del columns[name]
    table = _table("Studies", columns)
    for s in summaries:
        cells = {
            "study": s.study, "device": s.device, "budget": format_bytes(s.budget) if s.budget else "—",
            "complete": str(s.complete), "failed": str(s.failed), "running": str(s.running),
            "trials": f"{s.complete} complete" + "".join(
                f", {n} {what}" for n, what in ((s.failed, "failed"), (s.running, "running")) if n
            ),
            "done": progress_text(s),
            "ETA": eta_text(s),
            "fastest (step)": _seconds(s.fastest_seconds, estimated=s.estimated),
        }
        table.add_row(*(cells[c] for c in columns))
    table.caption = (
        "done: trials finished of the spec's; ETA: their mean time so far × the trials left ÷ the trials running"
    )
    table.caption_justify = "left"
    return table


def progress_text(s: StudySummary) -> str:
    """``4/12``: trials done of the spec's (``4`` where the study does not store its total)."""
    return f"{s.done}/{s.total}" if s.total is not None else str(s.done)


def eta_text(s: StudySummary) -> str:
    """The estimated time to finish, ``finished`` once done, else ``—`` (nothing finished yet)."""
    if s.eta_seconds is not None:
        return "~" + format_duration(s.eta_seconds)
    return "finished" if s.total is not None and s.done >= s.total else "—"


def _unreported_line(mem: MemoryBreakdown) -> str:
    """What ``show`` says of a breakdown whose figures ``memory_analysis()`` gave as 0 or less."""
    names = ", ".join("peak_memory_in_bytes" if f == "peak" else f"{f}_size_in_bytes" for f in mem.unreported)
    fell_back = "the compiler's peak" if mem.peak_source == "compiler_peak" else "the breakdown sum"
    return (
        f"  memory_analysis() gave {names} as 0 or less (a known JAX issue on TPU, jax#12848): "
        f"not what the step holds, so the peak is {fell_back}"
    )


def describe_trial(t: TrialResult) -> str:
    """A multi-line account of one trial: per-layer plan and the whole measurement."""
    from remat_search.measure.measurement import relative_spread

    lines = [f"trial {t.number}: {t.status}" + (f" (reuses trial {t.reused_from})" if t.reused_from is not None else "")]
    if t.plan:
        labels = t.labels if len(t.labels) == len(t.plan.layers) else [""] * len(t.plan.layers)
        lines += [
            f"  layer {i:2d}: {label + ' = ' if label and label != str(p) else ''}{p}"
            for i, (label, p) in enumerate(zip(labels, t.plan.layers, strict=True))
        ]
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
        if mem.host_total or mem.host_temp:
            lines.append(
                f"  host memory, from the compiler: {format_bytes(mem.host_total)}: argument "
                f"{format_bytes(mem.host_argument)} + output {format_bytes(mem.host_output)} − alias "
                f"{format_bytes(mem.host_alias)} + temp {format_bytes(mem.host_temp)} + code "
                f"{format_bytes(mem.host_generated_code)} (not in the device peak)"
            )
        lines.append(f"  compile {m.compile_seconds:.2f} s, {_gflop(m.flops)} GFLOP" if m.flops else "")
    if m and m.estimated_seconds is not None:
        lines.append(_estimate_line(m))
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
    if m and m.grad_rel_error is not None:
        checked = "first step (state change and loss) vs full remat's" if m.grad_reference == "full" else "gradients vs no remat"
        lines.append(f"  {checked}: max abs error {m.grad_max_abs_error:.2e}, relative {m.grad_rel_error:.2e}")
    if m and m.grad_skipped:
        lines.append(f"  gradients not checked: {m.grad_skipped}")
    if t.error:
        lines.append(f"  error: {t.error}")
    return "\n".join(line for line in lines if line)


_CHECK_STYLE = {"ok": "green", "warn": "yellow", "fail": "red"}


def doctor_table(checks: Iterable[Check]) -> Table:
    """One row a check of ``remat-search doctor``: its verdict, what it found, what to do."""
    table = _table("remat-search doctor", {
        "check": {"no_wrap": True}, "": {"no_wrap": True}, "found": {"ratio": 2, "overflow": "fold"},
        "what to do": {"ratio": 1, "overflow": "fold"},
    })
    for c in checks:
        table.add_row(c.name, Text(c.status, style=_CHECK_STYLE[c.status]), Text(c.found), Text(c.fix))
    return table
