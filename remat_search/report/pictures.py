"""Pictures of a study a person reads at a glance: the front of step time against peak memory
(:func:`front_figure`) and the plans on it layer by layer (:func:`layers_figure`), saved as
PNG, SVG or a standalone HTML page (:func:`save`), or as SVG text for the study's web page
(:func:`front_svg`, :func:`layers_svg`).

Only what was measured is drawn as a measurement: every plan that ran (or, on a compile-only
target, was estimated) at its compiled peak and its one step time (:attr:`TrialResult.seconds`),
and the plans over the study's budget at their compiled peaks on a strip of their own, since
they never ran and have no time. A screened-out plan's peak is a prediction: it is left out.
matplotlib (the ``plot`` extra) is imported only when a picture is drawn, and through its
object API (no pyplot), so pictures drawn in threads of a server do not share state.
"""

from __future__ import annotations

import html
import importlib.util
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from remat_search.errors import NoFeasiblePlan, SpecError
from remat_search.report.results import StudyReport, TrialResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SUFFIXES = (".png", ".svg", ".html")
"""What :func:`save` writes, by the file's suffix."""
MISSING = "--plot: drawing needs matplotlib, which is not installed: pip install 'remat-search[plot]'"
OVER_BUDGET = "over budget: not run"
DPI = 130

# Kinds of measured plans, each with its look: (legend label, marker, colour, size).
PRESET = ("presets (uniform plans)", "s", "tab:orange", 46)
PROPOSAL = ("planner proposals", "^", "tab:purple", 46)
SAMPLED = ("other sampled plans", "o", "0.55", 22)


def require() -> None:
    """Raise :class:`SpecError` naming the extra to install where matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SpecError(MISSING)


def check_path(path: Path) -> Path:
    """``path`` if :func:`save` can write it (a known suffix, an existing folder), else
    :class:`SpecError` naming ``--plot``: checked before anything is read or drawn."""
    if path.suffix.lower() not in SUFFIXES:
        raise SpecError(
            f"--plot: expected a file ending in {', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]}, got {str(path)!r}"
        )
    if not path.parent.is_dir():
        raise SpecError(f"--plot: directory {str(path.parent)!r} does not exist")
    return path


def kind(t: TrialResult) -> tuple[str, str, str, int]:
    """How the front picture draws a timed plan: a preset (a uniform plan), a planner
    proposal (the trial holds the planner's prediction), or another sampled plan."""
    if t.plan is not None and t.plan.is_uniform:
        return PRESET
    return PROPOSAL if t.prediction is not None else SAMPLED


def over_budget(report: StudyReport) -> list[TrialResult]:
    """The plans compiled over the study's budget, each once, never run: they have a peak, the
    compiler's, and no time. Screened-out plans (a predicted peak, never compiled) are not."""
    seen: set[str] = set()
    out = []
    for t in report.trials:
        m = t.measurement
        if t.status == "over_budget" and t.reused_from is None and m is not None and m.compiled \
                and t.peak_bytes is not None and m.plan_digest not in seen:
            seen.add(m.plan_digest)
            out.append(t)
    return out


def _unit(peaks: Sequence[float]) -> tuple[str, float]:
    """The binary unit that writes the largest of ``peaks`` with one to four digits."""
    top = max(peaks, default=0)
    return next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= s), ("B", 1))


def _size(n: float) -> str:
    """Bytes to three significant digits, in the unit :func:`_unit` picks: ``1.24 MiB``."""
    unit, scale = _unit([n])
    return f"{n / scale:.3g} {unit}"


def _title(report: StudyReport) -> str:
    d = report.device
    return f"{report.study} on {d.get('platform', '?')} ({d.get('device_kind', '?')})"


def page_title(report: StudyReport) -> str:
    """What an HTML page of the study is called: the study and its budget."""
    budget = _size(report.budget) if report.budget else "none"
    return f"remat-search: study {report.study!r}, budget {budget}"


def _figure(width: float, height: float, label: str) -> Figure:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    figure.set_label(label)  # what save() titles an HTML page with
    return figure


def front_figure(report: StudyReport, *, budget: int | None = None) -> Figure:
    """Step time (ms; tokens/s per device in a study of configurations) against compiled peak
    of every timed plan, the Pareto front as a step
    line, the study's budget line (and ``budget``'s where given and different), the plan
    `best` returns for that budget starred; presets, planner proposals, other sampled plans
    and confirmed plans told apart by marker; and the plans over the study's budget on a strip
    above, at their compiled peaks (they never ran: they have no time)."""
    timed, over = report.timed(), over_budget(report)
    peaks = [t.peak_bytes for t in [*timed, *over] if t.peak_bytes is not None] + [report.budget, budget or 0]
    unit, scale = _unit(peaks)
    figure = _figure(10.0, 5.8, page_title(report))
    strip, ax = figure.subplots(2, 1, sharex=True, height_ratios=[1, 7])
    figure.get_layout_engine().set(h_pad=0.02, hspace=0.0)  # type: ignore[union-attr]

    def xy(trials: Sequence[TrialResult]) -> tuple[list[float], list[float]]:
        return [t.peak_bytes / scale for t in trials], [_y(t) for t in trials]  # type: ignore[operator]

    front = list(report.front)
    if front:  # to the budget: a larger budget buys nothing the study timed
        right = max(report.budget, front[-1].peak_bytes or 0)
        xs, ys = xy(front)
        ax.step([*xs, right / scale], [*ys, ys[-1]], where="post", color="tab:blue", linewidth=1.5,
                label="Pareto front", zorder=2)
    for i, (label, marker, colour, size) in enumerate((PRESET, PROPOSAL, SAMPLED)):
        points = [t for t in timed if kind(t)[0] == label]
        if points:
            ax.scatter(*xy(points), s=size, marker=marker, color=colour, label=label, zorder=5 - i)
    confirmed = [t for t in timed if t.time_source == "confirmed"]
    if confirmed:
        ax.scatter(*xy(confirmed), s=150, facecolors="none", edgecolors="tab:green", linewidths=1.5,
                   label="confirmed (re-timed)", zorder=6)
    on_front = {t.number for t in front}
    for t in timed:  # presets by name, the front's plans by trial number (the layer picture's rows)
        name = t.labels[0] if t.plan is not None and t.plan.is_uniform and t.labels else ""
        text = " ".join(filter(None, [name, f"#{t.number}" if t.number in on_front else ""]))
        if text:
            ax.annotate(text, (t.peak_bytes / scale, _y(t)), fontsize=8,  # type: ignore[operator]
                        xytext=(6, 4), textcoords="offset points")
    limit = budget if budget is not None else report.budget
    answer = _best(report, limit)
    if answer is not None:
        ax.scatter(*xy([answer]), s=300, marker="*", color="gold", edgecolors="black", linewidths=0.8,
                   label=f"best for {_size(limit)}: trial {answer.number}", zorder=7)
    _over_strip(strip, over, scale)
    lines = [(report.budget, f"study budget {_size(report.budget)}", "tab:red", "-")]
    if budget is not None and budget != report.budget:
        lines.append((budget, f"budget {_size(budget)}", "tab:brown", "--"))
    for where, label, colour, style in lines:
        if where:
            for axes in (ax, strip):
                axes.axvline(where / scale, color=colour, linestyle=style, linewidth=1.4, alpha=0.8,
                             label=label if axes is ax else None, zorder=1)
    if not timed:
        ax.text(0.5, 0.5, "no plan timed yet", transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax.set_xlabel(f"compiled peak memory per device ({unit})")
    ax.set_ylabel(_time_label(timed))
    ax.margins(x=0.07, y=0.08)  # room for the names and the star at the edges
    ax.grid(True, color="0.93")
    ax.set_axisbelow(True)
    strip.set_title(f"{_title(report)}: step time vs peak memory", loc="left", fontsize=11)
    handles, labels = ax.get_legend_handles_labels()
    more, names = strip.get_legend_handles_labels()
    figure.legend([*handles, *more], [*labels, *names], loc="outside right center", fontsize=8, frameon=False)
    return figure


def _best(report: StudyReport, budget: int) -> TrialResult | None:
    """What `best` answers for ``budget`` (None where nothing timed fits it)."""
    try:
        return report.best(budget)
    except NoFeasiblePlan:
        return None


def _over_strip(strip: Axes, over: list[TrialResult], scale: float) -> None:
    """The plans over budget along a strip at their compiled peaks, presets named."""
    strip.set_yticks([])
    strip.set_ylim(0, 1)
    strip.tick_params(axis="x", labelbottom=False)
    strip.text(0.005, 0.88, f"{OVER_BUDGET} (at compiled peak)", transform=strip.transAxes, fontsize=8,
               va="top", color="tab:red", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    if not over:
        strip.text(0.5, 0.35, "none", transform=strip.transAxes, fontsize=8, ha="center", color="0.5")
        return
    strip.scatter([t.peak_bytes / scale for t in over], [0.35] * len(over), marker="x", s=40,  # type: ignore[operator]
                  color="tab:red", label=f"{OVER_BUDGET} ({len(over)} plan{'s' if len(over) > 1 else ''}, at compiled peak)", zorder=3)
    for t in over:
        if t.plan is not None and t.plan.is_uniform and t.labels:
            strip.annotate(t.labels[0], (t.peak_bytes / scale, 0.35), fontsize=8,  # type: ignore[operator]
                           xytext=(5, 0), textcoords="offset points", va="center")


def _y(t: TrialResult) -> float:
    """A plan's height in the front's picture: its step in ms, or, where it carries a
    configuration (a study of configurations, ranked by throughput), its tokens/s per device."""
    return t.throughput if t.throughput is not None else t.seconds * 1e3  # type: ignore[operator]


def _time_label(timed: list[TrialResult]) -> str:
    """The time axis's name: estimated where the target only compiles (the step-time model)."""
    if any(t.throughput is not None for t in timed):
        estimated = any(t.time_source == "estimated" for t in timed)
        return f"{'estimated ' if estimated else ''}tokens/s per device (higher is faster)"
    if any(t.time_source == "estimated" for t in timed):
        return "estimated step time (ms, modelled from the compiled program: not run)"
    return "step time (ms)"


def policy_order(report: StudyReport) -> list[str]:
    """Every layer label of the study's plans, the presets' first (the space's order): the
    layer picture's colours, the same whatever the front holds."""
    planned = [t for t in report.trials if t.plan is not None]
    presets = [_labels(t)[0] for t in planned if t.plan.is_uniform]  # type: ignore[union-attr]
    return list(dict.fromkeys([*presets, *(label for t in planned for label in _labels(t))]))


def _labels(t: TrialResult) -> list[str]:
    """Each layer's choice label (the policy's own text where the trial stored none)."""
    assert t.plan is not None
    return list(t.labels) if len(t.labels) == len(t.plan.layers) else [str(p) for p in t.plan.layers]


def layers_figure(report: StudyReport) -> Figure:
    """The plans on the front layer by layer: a row a plan (least memory at the top), labelled
    with its step time and peak; a column a layer; each cell coloured by the layer's policy."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    front = [t for t in report.front if t.plan is not None]
    layers = max((len(t.plan.layers) for t in front), default=1)  # type: ignore[union-attr]
    figure = _figure(min(16.0, max(7.5, 3.5 + 0.45 * layers)), 1.6 + 0.42 * max(len(front), 2), page_title(report))
    ax = figure.subplots()
    figure.suptitle(f"{_title(report)}: the plans on the Pareto front, layer by layer", x=0.01, ha="left",
                    fontsize=11)
    if not front:
        ax.text(0.5, 0.5, "no plan on the front yet", transform=ax.transAxes, ha="center", va="center", color="0.4")
        ax.set_axis_off()
        return figure
    order = policy_order(report)
    palette = [_colour(i) for i in range(len(order))]
    rows = [[order.index(label) for label in _labels(t)] for t in front]
    ax.imshow(rows, cmap=ListedColormap(palette), vmin=-0.5, vmax=len(order) - 0.5, aspect="auto",
              interpolation="nearest")
    step = max(1, layers // 24)
    ax.set_xticks(range(0, layers, step))
    ax.set_xlabel("layer")
    ax.set_yticks(range(len(front)), [_row_label(t) for t in front], fontsize=8)
    ax.set_xticks([i - 0.5 for i in range(1, layers)], minor=True)
    ax.set_yticks([i - 0.5 for i in range(1, len(front))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5 if layers <= 48 else 0.5)
    ax.tick_params(which="minor", length=0)
    ax.set_ylabel("plans on the front: trial, step, peak", fontsize=9)
    if layers <= 12:  # room to name each cell's policy too
        for r, row in enumerate(rows):
            for c, i in enumerate(row):
                ax.text(c, r, order[i], ha="center", va="center", fontsize=8, color=_ink(palette[i]))
    used = sorted({i for row in rows for i in row})
    figure.legend([Patch(color=palette[i]) for i in used], [order[i] for i in used], title="policy",
                  loc="outside right upper", fontsize=8, frameon=False)
    return figure


def _colour(i: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["tab10" if i < 10 else "tab20"](i % 20)


def _ink(colour: tuple[float, float, float, float]) -> str:
    """Black or white, whichever reads better on ``colour``."""
    red, green, blue, _ = colour
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.55 else "white"


def _row_label(t: TrialResult) -> str:
    """``#6 · 7.28 ms ✓ · 1.26 MiB``: trial, step time (✓ confirmed, est. estimated), peak."""
    step = f"{t.seconds * 1e3:.3g} ms" if t.seconds is not None else "—"
    mark = {"confirmed": " ✓", "estimated": " (est.)"}.get(t.time_source or "", "")
    return f"#{t.number} · {step}{mark} · {_size(t.peak_bytes or 0)}"


def svg(figure: Figure) -> str:
    """``figure`` as SVG text to put inside an HTML page: no XML prolog, and a viewBox, so CSS
    may scale it."""
    from matplotlib import rc_context

    buffer = io.StringIO()
    with rc_context({"svg.fonttype": "none"}):  # text as text: a page's reader can find and copy it
        figure.savefig(buffer, format="svg", metadata={"Date": None})  # the same study, the same text
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def png(figure: Figure) -> bytes:
    """``figure`` as PNG bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def front_svg(report: StudyReport, *, budget: int | None = None) -> str:
    """:func:`front_figure` as SVG text (for the study's web page)."""
    return svg(front_figure(report, budget=budget))


def layers_svg(report: StudyReport) -> str:
    """:func:`layers_figure` as SVG text (for the study's web page)."""
    return svg(layers_figure(report))


def save(figures: Sequence[Figure], path: Path, *, title: str | None = None) -> Path:
    """Write ``figures`` (the front first) to ``path``, by its suffix: ``.png`` one image, the
    figures stacked top to bottom; ``.svg`` one SVG document, stacked alike; ``.html`` a
    standalone page with each figure inlined as SVG under ``title`` (default: the first
    figure's label, which names the study and its budget). Any other suffix, or a folder that
    does not exist, is a :class:`SpecError` naming ``--plot``. Everything is drawn before the
    file is opened, so a failure writes nothing."""
    path = check_path(Path(path))
    suffix = path.suffix.lower()
    if suffix == ".png":
        data = png(figures[0]) if len(figures) == 1 else _stacked_png(figures)
    elif suffix == ".svg":
        data = (svg(figures[0]) if len(figures) == 1 else _stacked_svg(figures)).encode()
    else:
        data = page(figures, title or figures[0].get_label() or "remat-search").encode()
    path.write_bytes(data)
    return path


def page(figures: Sequence[Figure], title: str) -> str:
    """A standalone HTML page: ``title`` and each figure inlined as SVG."""
    body = "\n".join(f"<figure>{svg(f)}</figure>" for f in figures)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n"
        "<style>body{font-family:sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em}"
        "figure{margin:0 0 2em}svg{max-width:100%;height:auto}</style>\n"
        f"</head>\n<body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body>\n</html>\n"
    )


def _stacked_png(figures: Sequence[Figure]) -> bytes:
    """One PNG of ``figures`` top to bottom, each as wide as drawn, on white."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.image import imsave

    images = []
    for f in figures:
        canvas = FigureCanvasAgg(f)
        canvas.draw()
        images.append(np.asarray(canvas.buffer_rgba()))
    width = max(i.shape[1] for i in images)
    padded = [np.pad(i, ((0, 0), (0, width - i.shape[1]), (0, 0)), constant_values=255) for i in images]
    buffer = io.BytesIO()
    imsave(buffer, np.concatenate(padded), format="png", dpi=DPI)
    return buffer.getvalue()


def _stacked_svg(figures: Sequence[Figure]) -> str:
    """One SVG document of ``figures`` top to bottom: each figure's own SVG nested at its offset."""
    parts, top, width = [], 0.0, 0.0
    for f in figures:
        w, h = (float(v) * 72 for v in f.get_size_inches())  # matplotlib's SVG is in points
        inner = re.sub(r'(width|height)="([\d.]+)pt"', r'\1="\2"', svg(f), count=2)  # in the outer's points
        parts.append(inner.replace("<svg ", f'<svg x="0" y="{top:.2f}" ', 1))
        top, width = top + h, max(width, w)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        f'width="{width:.2f}pt" height="{top:.2f}pt" viewBox="0 0 {width:.2f} {top:.2f}">\n'
        + "\n".join(parts) + "\n</svg>\n"
    )
