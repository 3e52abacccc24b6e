"""Everything the CLI prints: rich tables for people, JSON for programs."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from remat_search.confirm import compare_times, interval_order
from remat_search.measurement import relative_spread
from remat_search.planner import Advice
from remat_search.report import StudySummary
from remat_search.results import StudyReport, TrialResult
from remat_search.units import format_bytes, format_seconds

console = Console()
errors = Console(stderr=True)

_STATUS_STYLE = {"measured": "green", "over_budget": "yellow", "failed": "red", "interrupted": "dim"}


def trials_table(title: str, trials: Iterable[TrialResult], *, budget: int | None = None) -> Table:
    """One row a trial: plan, peak, median step time with its spread, FLOPs, status."""
    table = Table(title=title, title_justify="left")
    for column in ("trial", "plan", "peak", "step", "spread", "confirmed", "GFLOP", "status"):
        table.add_column(column, justify="right" if column not in ("plan", "status") else "left")
    for t in trials:
        m = t.measurement
        screened = m is not None and m.screened_bytes is not None
        peak = ("~" if screened else "") + (format_bytes(t.peak_bytes) if t.peak_bytes is not None else "—")
        if budget and t.peak_bytes is not None:
            peak += f" ({t.peak_bytes / budget:.0%})"
        status = ("fits" if t.time_estimated else t.status) + (f" = #{t.reused_from}" if t.reused_from is not None else "")
        if screened:
            status += " (predicted, not compiled)"
        if t.cached_from:
            status += f" (cached: {t.cached_from})"
        if t.error and t.status == "failed":
            status += f": {t.error.splitlines()[0][:80]}"
        table.add_row(
            str(t.number),
            t.summary(),
            peak,
            _seconds(t.step_seconds, estimated=t.time_estimated),
            f"±{m.spread / 2:.0%}" if m and m.spread is not None else "—",
            _confirmed(t),
            _gflop(m.flops) if m and m.flops is not None else "—",
            f"[{_STATUS_STYLE.get(t.status, '')}]{status}[/]",
        )
    table.caption = SPREAD_NOTE
    table.caption_justify = "left"
    return table


SPREAD_NOTE = (
    "spread ±x%: half the (max − min) / median range of the trial's timed repeats "
    "(of its per-step ratios to the anchor where anchored)"
)


def _confirmed(t: TrialResult) -> str:
    c = t.confirmed
    return f"{format_seconds(c.median)} ±{c.spread / 2:.0%}" if c else "—"


def confirmed_table(report: StudyReport, confirmed: list[TrialResult]) -> Table:
    """The confirmed plans, fastest first, beside their search medians and ranks, each with
    how much slower than the fastest it is (paired by round, with an interval whose real
    coverage at that many rounds the header states)."""
    table = Table(
        title=f"Confirmed plans of {report.study!r}, re-timed interleaved (fastest first)", title_justify="left"
    )
    coverage = interval_order(len(confirmed[0].confirmed.times))[1] if confirmed[0].confirmed else 0.0
    columns = ("rank", "trial", "plan", "peak", "confirmed median", "spread", f"vs fastest ({coverage:.0%} interval)",
               "search median", "search rank")
    for column in columns:
        table.add_column(column, justify="left" if column == "plan" else "right")
    by_search = sorted(confirmed, key=lambda t: (t.step_seconds, t.number))
    fastest, unresolved = confirmed[0].confirmed, False
    for rank, t in enumerate(confirmed, 1):
        assert t.confirmed is not None and fastest is not None
        versus = "—"
        if rank > 1:
            c = compare_times(t.confirmed.times, fastest.times)
            versus = f"{c.ratio - 1:+.1%} ({c.low - 1:+.1%}…{c.high - 1:+.1%})" + ("" if c.resolved else " ≈")
            unresolved |= not c.resolved
        table.add_row(
            str(rank), str(t.number), t.summary(), format_bytes(t.peak_bytes) if t.peak_bytes else "—",
            format_seconds(t.confirmed.median), f"±{t.confirmed.spread / 2:.0%}", versus,
            format_seconds(t.step_seconds) if t.step_seconds else "—", str(by_search.index(t) + 1),
        )
    table.caption = (
        "spread ±x%: half the (max − min) / median range of the plan's re-timed steps; vs fastest: the median of "
        f"the per-round ratios to the fastest, with an interval that holds the true ratio with {coverage:.0%} "
        "probability at this many rounds."
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
        ("step", p and p.seconds, measured.step_seconds if measured else None, format_seconds),
    ):
        error = f"{predicted / seen - 1:+.1%}" if seen and predicted else "—"
        table.add_row(name, fmt(predicted) if predicted else "—", fmt(seen) if seen else "—", error)
    if measured is not None:
        table.add_row("trial", "", f"{measured.number} ({measured.status})", "")
    return Group(header, table)


def _gflop(flops: float) -> str:
    return f"{flops / 1e9:,.0f}" if flops >= 1e11 else f"{flops / 1e9:.2f}"


def _seconds(seconds: float | None, *, estimated: bool) -> str:
    if seconds is None:
        return "—"
    return format_seconds(seconds) + (" (est.)" if estimated else "")


def front_table(report: StudyReport) -> Table:
    return trials_table(
        f"Pareto front of {report.study!r} (budget {format_bytes(report.budget)}, peak as % of it)",
        report.front, budget=report.budget,
    )


def studies_table(summaries: Iterable[StudySummary]) -> Table:
    table = Table(title="Studies", title_justify="left")
    for column in ("study", "device", "budget", "complete", "failed", "running", "fastest feasible"):
        table.add_column(column)
    for s in summaries:
        table.add_row(
            s.study, s.device, format_bytes(s.budget) if s.budget else "—",
            str(s.complete), str(s.failed), str(s.running),
            _seconds(s.fastest_seconds, estimated=s.estimated),
        )
    return table


def describe_trial(t: TrialResult) -> str:
    """A multi-line account of one trial: per-layer plan and the whole measurement."""
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
        host = mem.host_argument + mem.host_output - mem.host_alias + mem.host_temp
        if host:
            lines.append(f"  host (pinned) memory: {format_bytes(host)}")
        lines.append(f"  compile {m.compile_seconds:.2f} s, {_gflop(m.flops)} GFLOP" if m.flops else "")
    if m and m.estimated_seconds is not None:
        lines.append(
            f"  step: estimated {format_seconds(m.estimated_seconds)} (roofline of {m.flops / 1e9:.1f} GFLOP and "
            f"{(m.bytes_accessed or 0) / 1e9:.2f} GB of HBM traffic per chip; nothing was run)"
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
        )
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
    if m and m.grad_rel_error is not None:
        checked = "first step (state change and loss) vs full remat's" if m.grad_reference == "full" else "gradients vs no remat"
        lines.append(f"  {checked}: max abs error {m.grad_max_abs_error:.2e}, relative {m.grad_rel_error:.2e}")
    if m and m.grad_skipped:
        lines.append(f"  gradients not checked: {m.grad_skipped}")
    if t.error:
        lines.append(f"  error: {t.error}")
    return "\n".join(line for line in lines if line)
