"""Everything the CLI prints, and where: rich tables for people on stdout, notes and errors on
stderr, progress lines as they come. The words of a study and its trials (a step time, a
trial's line, its account in full, the front as JSON) are :mod:`report.text`'s, which the
service prints too; this module sets them in tables for a terminal."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from remat_search.report.text import (
    budget_line,
    eta_text,
    fastest_text,
    gflop_text,
    progress_text,
    sharding_line,
    step_text,
)
from remat_search.units import format_bytes, format_seconds

if TYPE_CHECKING:  # the CLI imports this module for --help too: what reads studies comes with its data
    from remat_search.cli.doctor import Check
    from remat_search.report.queries import StudySummary
    from remat_search.report.results import StudyReport, TrialResult
    from remat_search.report.stored import StoredStudy
    from remat_search.search.advice import Advice
    from remat_search.search.progress import Progress
    from remat_search.targets.calibration import Calibration

console = Console()
errors = Console(stderr=True)


def print_lines(*lines: str, to: Console | None = None) -> None:
    """Print progress lines as they are, on stdout (or ``to``: a progress bar's console): no
    markup, no wrapping (logs keep one line each)."""
    for line in lines:
        (to or console).print(line, markup=False, highlight=False, soft_wrap=True)


def note(line: str) -> None:
    """A note or a message on stderr, as it is: no markup, one line however long."""
    errors.print(line, markup=False, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def library_notes() -> Iterator[None]:
    """Print the library's notes and warnings (the ``remat_search`` logger) on stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("remat_search")
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # not again by a root handler a library set (MaxText's absl)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def quiet_optuna() -> None:
    """optuna's own log lines off (its trial-by-trial INFO): for the commands that run optuna;
    the queries read the tables without it."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


_STATUS_STYLE = {
    "measured": "green", "over_budget": "yellow", "failed": "red", "infeasible": "yellow", "interrupted": "dim", "moved": "dim", "running": "cyan",
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
_STEP = {"justify": "right", "min_width": len("1,000.0 ms ✓")}
"""A step's time stays on its first line; an estimate's band and a throughput after it wrap."""


def trials_table(title: str, trials: Iterable[TrialResult], *, budget: int | None = None) -> Table:
    """One row a trial: plan, peak, median step time with its spread, FLOPs, status (on a narrow
    terminal without the spread, FLOPs and peak as % of the budget)."""
    narrow = _narrow()
    columns = {
        "trial": _NUMBER, "plan": _PLAN, "peak": _NUMBER, "step": _STEP, "spread": _NUMBER,
        "XLA GFLOP": _NUMBER, "status": _STATUS,
    }
    if narrow:
        del columns["spread"], columns["XLA GFLOP"]
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
        if t.error and t.status in ("failed", "infeasible", "moved"):
            status += f": {t.error.splitlines()[0][:80]}"
        cells = {
            "trial": str(t.number),
            "plan": t.summary(),
            "peak": peak,
            "step": step_text(t),
            "spread": _spread(t),
            "XLA GFLOP": gflop_text(m.flops) if m and m.flops is not None else "—",
            "status": Text(status, style=_STATUS_STYLE.get(t.status, "")),  # Text: an error's brackets are not markup
        }
        table.add_row(*(cells[c] for c in columns))
    table.caption = TIME_NOTE + ("" if narrow else "; " + SPREAD_NOTE + "; " + FLOP_NOTE)
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


FLOP_NOTE = (
    "XLA GFLOP: XLA's cost analysis of one chip's program, which counts a loop's body once (a scanned "
    "model's layers, an accumulated step's micro-steps: once); a TPU estimate's own count is in show --trial"
)


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


def progress_lines(
    p: Progress, study: str, *, budget_given: bool = True, budget_text: str | None = None, configurations: bool = False,
) -> list[str]:
    """What a search's or a confirmation's event says, as lines (a trial's: :func:`report.text.trial_line`).
    ``budget_given``: the spec gave the budget in bytes (already echoed), else the budget the
    search resolved is said here, beside ``budget_text`` as the spec wrote it (``70%``, ``device``).
    ``configurations``: the study searches meshes, so no one mesh is each candidate's."""
    if p.event == "start" and p.device is not None and p.budget is not None:
        d = p.device
        lines = [
            f"study {study}: {p.done}/{p.total} trials done; compiling for {d.target} = {d.device_count}× "
            f"{d.device_kind}" + (", each candidate's own mesh" if configurations else f", mesh {d.mesh}" if d.mesh else "")
            + ("" if d.executes else " (compile only: step times are estimated from the compiled program)")
        ]
        if d.workload_note:
            lines.append(d.workload_note)
        if d.shardings:
            lines.append(sharding_line(d.mesh, d.shardings, d.device_order, per_candidate=configurations))
        if not budget_given:
            lines.append(budget_line(budget_text, p.budget))
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


def front_table(study: str, budget: int, front: Iterable[TrialResult]) -> Table:
    """The Pareto front of ``study``, whose budget is ``budget``."""
    return trials_table(
        f"Pareto front of {study!r} (budget {format_bytes(budget)}"
        + ("" if _narrow() else ", peak as % of it") + ")",
        front, budget=budget,
    )


def calibration_table(calibration: Calibration) -> Group:
    """Each sample of a calibration (measured, estimated uncalibrated, fitted, left out alone and
    with its model family), then its figures and its held-out error by kind of plan."""
    table = _table(
        f"Calibration {calibration.name!r} ({', '.join(calibration.chips)}; {calibration.compiler})",
        {"sample": _PLAN, "family": {}, "kind": {}, "measured": _NUMBER, "uncalibrated": _NUMBER, "fitted": _NUMBER,
         "left out": _NUMBER, "error": _NUMBER, "family out": _NUMBER, "its error": _NUMBER},
    )
    for s in calibration.samples:
        table.add_row(s.label, s.family or "—", s.kind, format_seconds(s.measured_seconds),
                      format_seconds(s.uncalibrated_seconds), format_seconds(s.calibrated_seconds),
                      format_seconds(s.loo_seconds), f"{s.loo_error:+.1%}",
                      format_seconds(s.held_out_seconds), f"{s.held_out_error:+.1%}")
    lines = [Text(calibration_figures(calibration))]
    for kind, error in calibration.errors().items():
        band = calibration.band(kind)  # type: ignore[arg-type]
        assert band is not None
        lines.append(Text(f"{kind}: error up to {error:.1%} with its model family left out, over "
                          f"{calibration.families} families; its band, a 95% prediction interval of measured / "
                          f"estimate: {band[0]:.3f}-{band[1]:.3f}"))
    return Group(table, *lines)


def calibration_figures(calibration: Calibration) -> str:
    """The fitted figures, in words."""
    e = calibration.efficiencies
    words = {"matmul": f"matmuls at {e.matmul:.3g} of peak FLOP/s", "hbm": f"HBM traffic at {e.hbm:.3g} of its bandwidth",
             "ici": f"collectives at {e.ici:.3g} of ICI bandwidth", "host_link": f"host transfers at {e.host_link:.3g} of the link",
             "host_overlap": f"{e.host_overlap or 0:.3g} of the compute beside a transfer hides it",
             "launch_seconds": f"{format_seconds(e.launch_seconds)} an instruction besides its work"}
    return "fitted: " + "; ".join(words[f] for f in calibration.fitted)


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
            "fastest (step)": fastest_text(s),
        }
        table.add_row(*(cells[c] for c in columns))
    table.caption = (
        "done: trials finished of the spec's; ETA: their mean time so far × the trials left ÷ the trials running"
    )
    table.caption_justify = "left"
    return table


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


def answer_notes(stored: StoredStudy, found: TrialResult, limit: int) -> list[str]:
    """What an answer for ``limit`` bytes needs said beside it, as ``best`` and ``maxtext`` print
    it: how it was timed (or that it was not re-timed), the plans within its estimate's error,
    and the plans that fit ``limit`` but were never timed (over the study's own budget)."""
    from remat_search.report.results import settlement
    from remat_search.report.text import answer_note, band_of, rivals, rivals_note, untimed_text

    notes = [answer_note(found, limit, settlement(stored.attrs), stored.name)]
    notes.append(rivals_note(found, rivals(found, stored.trials_within(limit)) if band_of(found) else []))
    if untimed := stored.untimed_within(limit):
        notes.append(f"note: {untimed_text(len(untimed), limit, stored.budget)}; a study with a larger spec budget would time them")
    return [line for line in notes if line]
