"""The words both faces say of a study: the CLI prints them, the service answers with them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from remat_search.report import text
from remat_search.report.queries import StudySummary
from remat_search.spec.loading import parse_spec

from tests.conftest import spec_dict

PACKAGE = Path(text.__file__).resolve().parents[1]


def summary(**fields: object) -> StudySummary:
    base: dict[str, object] = {
        "study": "s", "budget": 2**20, "device": "cpu (cpu)", "target": "local", "complete": 4, "failed": 0,
        "running": 1, "done": 4, "total": 12, "eta_seconds": 125.0, "fastest_seconds": 0.0803,
        "fastest_trial": 3, "estimated": False,
    }
    return StudySummary(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(("written", "line"), [
    ("38mb", "budget 38mb = 36.2 MiB"), ("38MiB", "budget 38MiB"), ("1.6e10", "budget 1.6e10 = 14.9 GiB"),
    (39845888, "budget 39845888 = 38.0 MiB"), ("16 GiB", "budget 16 GiB"), ("2.5MiB", "budget 2.5MiB"),
])
def test_the_budget_line_says_what_a_written_budget_means(written: object, line: str) -> None:
    spec = parse_spec(spec_dict("sqlite:///unused.db", budget=written))
    assert text.budget_line(spec.budget_text, spec.budget) == line


def test_a_study_in_progress_in_words() -> None:
    running = summary()
    assert (text.progress_text(running), text.eta_text(running), text.fastest_text(running)) == (
        "4/12", "~2 min", "80.3 ms"
    )
    finished = summary(done=12, eta_seconds=None, estimated=True)
    assert (text.progress_text(finished), text.eta_text(finished), text.fastest_text(finished)) == (
        "12/12", "finished", "80.3 ms (est.)"
    )
    unknown = summary(total=None, done=0, eta_seconds=None, fastest_seconds=None, fastest_trial=None)
    assert (text.progress_text(unknown), text.eta_text(unknown), text.fastest_text(unknown)) == ("0", "—", "—")


def test_a_missing_trial_names_the_trials_there_are() -> None:
    assert text.no_trial_text("s", 7, 3) == "study 's' has no trial 7 (it has trials 0..2)"
    assert text.no_trial_text("s", 0, 0) == "study 's' has no trial 0 (it has no trials yet)"


def test_text_for_both_faces_needs_neither_face_nor_rich() -> None:
    """The service prints these words without the CLI's terminal library."""
    tree = ast.parse((PACKAGE / "report" / "text.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] == "rich" or m.startswith("remat_search.cli")}
