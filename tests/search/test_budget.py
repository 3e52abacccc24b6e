"""A budget written relative to what the search learns: ``80%`` of no remat's compiled peak, or
``device``; in a spec (real tiny searches through ``remat-search run``) and in the queries."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

import remat_search
from remat_search import RematPlan
from remat_search.report.stored import open_study
from remat_search.units import format_bytes

from tests.conftest import spec_dict, write_spec

UNIFORM = {"layout": "uniform", "choices": ["none", "full"]}


def _no_remat(storage: str) -> Any:
    """The study's trial of the uniform no-remat plan."""
    with open_study("tiny", storage) as stored:
        (trial,) = stored.with_plan(RematPlan.uniform("none", stored.attrs["layers"]).to_json())
        return trial, stored.budget


@pytest.fixture
def shared(tmp_path: Path, storage_url: str, cli) -> tuple[str, Path, str]:  # type: ignore[no-untyped-def]
    """A study searched with ``budget: 80%`` (storage, spec file, run's output)."""
    path = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, budget="80%", space=UNIFORM, trials=2, confirm={"top": 0},
    ))
    result = cli("run", str(path))
    assert result.exit_code == 0, result.stdout + result.stderr
    return storage_url, path, result.stdout


def test_a_share_budget_is_that_share_of_no_remats_compiled_peak(shared) -> None:  # type: ignore[no-untyped-def]
    storage, _, out = shared
    none, budget = _no_remat(storage)
    assert budget == math.floor(0.8 * none.peak_bytes)  # rounded down to a whole byte
    assert none.status == "over_budget"  # 80% of its own peak: compiled, never run
    assert f"budget 80% of no remat's peak ({format_bytes(budget)})" in out.splitlines()
    assert f"--budget {remat_search.units.size_argument(budget)}" in " ".join(out.split())


def test_a_share_budget_resumes_with_the_same_share_and_not_with_another(shared, cli) -> None:  # type: ignore[no-untyped-def]
    storage, path, _ = shared
    _, budget = _no_remat(storage)
    write_spec(path, spec_dict(storage, budget="80%", space=UNIFORM, trials=3, confirm={"top": 0}))
    result = cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    with open_study("tiny", storage) as stored:
        assert stored.count()["COMPLETE"] == 3 and stored.budget == budget
    db = Path(storage.removeprefix("sqlite:///"))
    before = db.read_bytes()
    write_spec(path, spec_dict(storage, budget="90%", space=UNIFORM, trials=4, confirm={"top": 0}))
    result = cli("run", str(path))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "spec.budget: study 'tiny' already exists with another budget" in result.stderr
    assert db.read_bytes() == before


def test_show_says_the_budget_as_written(shared, cli) -> None:  # type: ignore[no-untyped-def]
    storage, _, _ = shared
    _, budget = _no_remat(storage)
    shown = cli("show", "--study", "tiny", "--storage", storage)
    assert f"budget 80% of no remat's peak ({format_bytes(budget)})" in shown.stdout.splitlines()


@pytest.mark.parametrize(
    ("budget", "expected"),
    [("0%", "spec.budget: expected a share of no remat's peak above 0% and at most 100%"),
     ("150%", "spec.budget: expected a share of no remat's peak above 0% and at most 100%"),
     ("-5%", "spec.budget: expected a share of no remat's peak above 0% and at most 100%"),
     ("70 %%", "spec.budget: expected a share of no remat's peak above 0% and at most 100%"),
     ("abc", "spec.budget: expected a positive size such as 200MiB, 16GiB, 80GB or 1.6e10, a share of no "
             "remat's peak such as 70%, or device, got 'abc'")],
)
def test_a_bad_budget_is_one_line_naming_the_field(cli, tmp_path: Path, storage_url: str, budget: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", spec_dict(storage_url, budget=budget))))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*"))
