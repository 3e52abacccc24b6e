"""The pictures of a study (front and layers), as figures and as the files `pareto --plot` and
`show --plot` write, on one real tiny planner study with presets, planner proposals, confirmed
plans and a preset over its budget."""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

import remat_search
from remat_search.report import pictures
from remat_search.report.results import StudyReport, TrialResult
from remat_search.spec.loading import parse_spec

from tests.conftest import TINY_TRANSFORMER, spec_dict

BUDGET = 2 * 2**20
"""Between the tiny 4-layer transformer's presets: no remat (about 2.25 MiB) is over it, the others fit."""


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, StudyReport]:
    """One finished planner study: its storage URL and report. Ten trials: the four presets (no
    remat over the budget), then the planner's proposals, all a picture needs (asserted here).
    Six were too few: in CI (stop 52) both trials after the presets went to TPE. The planner
    proposes only while its front, fitted to measured times, holds a plan not yet tried."""
    storage = f"sqlite:///{tmp_path_factory.mktemp('pictures') / 'studies.db'}"
    report = remat_search.run(parse_spec(spec_dict(
        storage, study="pictures", workload={**TINY_TRANSFORMER, "layers": 4}, trials=10, budget=BUDGET,
        sampler={"kind": "planner", "seed": 0}, confirm={"top": 2, "rounds": 2, "presets": True},
    )))
    kinds = {pictures.kind(t)[0] for t in report.timed()}
    assert {pictures.PRESET[0], pictures.PROPOSAL[0]} <= kinds, kinds
    assert any(t.time_source == "confirmed" for t in report.timed()), "nothing was confirmed"
    assert pictures.over_budget(report), "no plan was compiled over the budget: the picture has no strip to test"
    return storage, report


def _legend(figure: Figure) -> list[str]:
    return [text.get_text() for legend in figure.legends for text in legend.get_texts()]


def _points(figure: Figure, axes: int) -> set[tuple[float, float]]:
    """Every marker's (x, y) on the figure's ``axes``-th axes (0: the over-budget strip)."""
    return {(round(float(x), 6), round(float(y), 6)) for c in figure.axes[axes].collections for x, y in c.get_offsets()}


def _at(t: TrialResult) -> tuple[float, float]:
    return round(t.peak_bytes / 2**20, 6), round(t.seconds * 1e3, 6)  # type: ignore[operator]


def test_the_front_draws_every_timed_plan_by_kind_and_the_over_budget_ones_apart(study: Any) -> None:
    _, report = study
    figure = pictures.front_figure(report)
    kinds = {pictures.kind(t)[0] for t in report.timed()}
    best = report.best(report.budget)
    legend = _legend(figure)
    assert set(legend) == kinds | {
        "Pareto front", "confirmed (re-timed)", "study budget 2 MiB", f"best for 2 MiB: trial {best.number}",
        f"over budget: not run ({len(pictures.over_budget(report))} plan"
        + ("s" if len(pictures.over_budget(report)) > 1 else "") + ", at compiled peak)",
    }, legend
    assert {_at(t) for t in report.timed()} == _points(figure, 1), "each timed plan at its peak (MiB) and time (ms)"
    over = pictures.over_budget(report)
    assert all(t.seconds is None and t.peak_bytes > report.budget for t in over)  # type: ignore[operator]
    assert {round(x, 6) for x, _ in _points(figure, 0)} == {round(t.peak_bytes / 2**20, 6) for t in over}  # type: ignore[operator]
    strip_texts = [t.get_text() for t in figure.axes[0].texts]
    assert "over budget: not run (at compiled peak)" in strip_texts
    front = next(line for line in figure.axes[1].lines if line.get_label() == "Pareto front")
    assert [round(x, 6) for x in front.get_xdata()][:-1] == [_at(t)[0] for t in report.front]
    assert figure.axes[1].get_xlabel() == "compiled peak memory per device (MiB)"
    assert figure.axes[1].get_ylabel() == "step time (ms)"


def test_a_screened_plan_is_no_measurement_and_is_not_drawn(study: Any) -> None:
    _, report = study
    over = pictures.over_budget(report)[0]
    assert over.measurement is not None
    screened = over.model_copy(update={"number": 99, "measurement": over.measurement.model_copy(update={
        "memory": None, "oom_required_bytes": None, "screened_bytes": 3 * 2**20, "plan_digest": "screened",
    })})
    with_screened = report.model_copy(update={"trials": (*report.trials, screened)})
    assert pictures.over_budget(with_screened) == pictures.over_budget(report)
    figure = pictures.front_figure(with_screened)
    assert 3.0 not in {x for x, _ in _points(figure, 0) | _points(figure, 1)}


def test_another_budget_gets_its_own_line_and_its_best_plan_starred(study: Any) -> None:
    _, report = study
    # the smallest timed plan's peak: below the study's budget, and some plan fits it (the front
    # may hold one plan only, when the smallest plan also timed fastest)
    budget = min(t.peak_bytes for t in report.timed())  # type: ignore[type-var]
    assert budget < report.budget
    figure = pictures.front_figure(report, budget=budget)
    best = report.best(budget)
    legend = _legend(figure)
    assert "study budget 2 MiB" in legend and any(label.startswith("budget ") for label in legend)
    assert f"best for {pictures._size(budget)}: trial {best.number}" in legend
    lines = {line.get_label(): line.get_xdata()[0] for line in figure.axes[1].lines if line.get_label() != "Pareto front"}
    assert lines == {"study budget 2 MiB": 2.0, f"budget {pictures._size(budget)}": budget / 2**20}


def test_estimated_times_say_so_on_the_axis(study: Any) -> None:
    _, report = study

    def estimated(t: TrialResult) -> TrialResult:
        if t.measurement is None or t.status != "measured":
            return t
        return t.model_copy(update={"confirmed": None, "measurement": t.measurement.model_copy(update={"time_source": "estimated"})})

    compiled_only = report.model_copy(update={"trials": tuple(map(estimated, report.trials)),
                                              "front": tuple(map(estimated, report.front))})
    assert all(t.time_source == "estimated" for t in compiled_only.timed())
    assert pictures.front_figure(compiled_only).axes[1].get_ylabel().startswith("estimated step time (ms")


def test_the_layers_picture_has_a_row_per_front_plan_and_a_colour_per_policy(study: Any) -> None:
    _, report = study
    figure = pictures.layers_figure(report)
    ax = figure.axes[0]
    order = pictures.policy_order(report)
    assert order[:4] == ["none", "full", "dots", "save_attn"]  # the presets first, the space's order
    cells = ax.images[0].get_array()
    assert cells.shape == (len(report.front), 4)
    for row, t in zip(cells.tolist(), report.front, strict=True):
        assert [order[i] for i in row] == list(t.labels)
    labels = [label.get_text() for label in ax.get_yticklabels()]
    assert labels == [f"#{t.number} · {t.seconds * 1e3:.3g} ms{' ✓' if t.time_source == 'confirmed' else ''} · "  # type: ignore[operator]
                      f"{pictures._size(t.peak_bytes)}" for t in report.front]  # type: ignore[arg-type]
    assert set(_legend(figure)) == {label for t in report.front for label in t.labels}
    assert ax.get_xlabel() == "layer"


def test_an_empty_study_draws_without_points() -> None:
    empty = StudyReport(study="empty", budget=2**30, device={}, trials=(), front=())
    assert "no plan timed yet" in [t.get_text() for t in pictures.front_figure(empty).axes[1].texts]
    assert "no plan on the front yet" in pictures.layers_svg(empty)


def _svg_texts(text: str) -> list[str]:
    """The text of every <text> of an SVG document (matplotlib's, fonts as text)."""
    root = ET.fromstring(text)
    return ["".join(e.itertext()) for e in root.iter("{http://www.w3.org/2000/svg}text")]


def test_svg_text_for_the_page(study: Any) -> None:
    _, report = study
    front = pictures.front_svg(report, budget=report.budget // 2)
    assert front.startswith("<svg") and "budget 1 MiB" in _svg_texts(front)
    assert "study budget 2 MiB" in _svg_texts(front) and "over budget: not run (at compiled peak)" in _svg_texts(front)
    assert "layer" in _svg_texts(pictures.layers_svg(report))


def test_save_by_suffix(study: Any, tmp_path: Path) -> None:
    _, report = study
    front, layers = pictures.front_figure(report), pictures.layers_figure(report)
    one = imread(pictures.save([front], tmp_path / "front.png"))
    both = imread(pictures.save([front, layers], tmp_path / "both.png"))
    assert both.shape[0] == one.shape[0] + imread(pictures.save([layers], tmp_path / "layers.png")).shape[0]
    svg = pictures.save([front, layers], tmp_path / "both.svg").read_text()
    texts = _svg_texts(svg)
    assert "study budget 2 MiB" in texts and "layer" in texts and "presets (uniform plans)" in texts
    page = pictures.save([front, layers], tmp_path / "study.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<title>remat-search: study &#x27;pictures&#x27;, budget 2 MiB</title>" in page
    embedded = re.findall(r"<svg.*?</svg>", page, re.DOTALL)
    assert len(embedded) == 2 and "planner proposals" in _svg_texts(embedded[0])
    with pytest.raises(remat_search.SpecError, match=r"^--plot: expected a file ending in \.png, \.svg or \.html"):
        pictures.save([front], tmp_path / "front.pdf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both.png", "both.svg", "front.png", "layers.png", "study.html"]


def test_pareto_and_show_plot(study: Any, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    storage, report = study
    result = cli("pareto", "--study", "pictures", "--storage", storage, "--plot", str(tmp_path / "front.png"))
    assert result.exit_code == 0, result.stderr
    assert result.stderr == f"wrote {tmp_path / 'front.png'}\n"
    front_height = imread(tmp_path / "front.png").shape[0]
    page = cli("pareto", "--study", "pictures", "--storage", storage, "--plot", str(tmp_path / "front.html"))
    assert page.exit_code == 0 and len(re.findall("<svg", (tmp_path / "front.html").read_text())) == 2
    assert cli("pareto", "--study", "pictures", "--storage", storage, "--plot", str(tmp_path / "front.svg")).exit_code == 0
    assert "layer" not in _svg_texts((tmp_path / "front.svg").read_text())
    shown = cli("show", "--study", "pictures", "--storage", storage, "--plot", str(tmp_path / "study.png"))
    assert shown.exit_code == 0 and "Trials of 'pictures'" in shown.stdout
    assert imread(tmp_path / "study.png").shape[0] > front_height  # the layers under the front
    assert cli("show", "--study", "pictures", "--storage", storage, "--plot", str(tmp_path / "study.svg")).exit_code == 0
    assert "layer" in _svg_texts((tmp_path / "study.svg").read_text())
    if report.front:
        assert f"#{report.front[0].number} · " in " ".join(_svg_texts((tmp_path / "study.svg").read_text()))


@pytest.mark.parametrize("command", ["pareto", "show"])
@pytest.mark.parametrize(("name", "message"), [
    ("front.pdf", "--plot: expected a file ending in .png, .svg or .html, got '{path}'"),
    ("front", "--plot: expected a file ending in .png, .svg or .html, got '{path}'"),
    ("no/such/dir/front.png", "--plot: directory '{folder}' does not exist"),
])
def test_a_bad_plot_file_is_one_line_and_writes_nothing(  # type: ignore[no-untyped-def]
    study: Any, cli, tmp_path: Path, command: str, name: str, message: str,
) -> None:
    storage, _ = study
    path = tmp_path / name
    result = cli(command, "--study", "pictures", "--storage", storage, "--plot", str(path))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr == "error: " + message.format(path=path, folder=path.parent) + "\n"
    assert result.stdout == "" and not list(tmp_path.iterdir())


def test_show_plot_without_matplotlib_names_the_extra(study: Any, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    storage, _ = study
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it fails
    result = cli("show", "--study", "pictures", "--storage", storage, "--plot", str(tmp_path / "study.html"))
    assert result.exit_code == 2 and result.stderr == f"error: {pictures.MISSING}\n"
    assert not list(tmp_path.iterdir())
