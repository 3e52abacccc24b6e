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
from remat_search.units import format_bytes, size_argument

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
    assert f"--budget {size_argument(budget)}" in " ".join(out.split())


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


def test_queries_take_a_share_of_the_studys_no_remat_peak(shared, cli) -> None:  # type: ignore[no-untyped-def]
    storage, _, _ = shared
    none, budget = _no_remat(storage)
    size = size_argument(math.floor(0.9 * none.peak_bytes))
    for command in ("best", "plan"):
        relative = cli(command, "--study", "tiny", "--budget", "90%", "--storage", storage, "--json")
        absolute = cli(command, "--study", "tiny", "--budget", size, "--storage", storage, "--json")
        assert relative.exit_code == absolute.exit_code == 0, relative.stderr + absolute.stderr
        assert relative.stdout == absolute.stdout
    table = cli("best", "--study", "tiny", "--budget", "80%", "--storage", storage)
    assert f"Best plan of 'tiny' for {format_bytes(budget)}" in table.stdout
    assert remat_search.best_plan("tiny", "80%", storage).plan == RematPlan.uniform("full", len(none.plan.layers))


def test_a_query_share_of_a_study_of_configurations_is_of_the_peak_its_spec_share_was_of(
    tmp_path: Path, storage_url: str, cli  # type: ignore[no-untyped-def]
) -> None:
    """Every trial of a study of configurations carries one, so none is the no-remat plan at the
    study's own batch, whose peak the spec's share was taken of: the search stores that peak,
    and a query's share is taken of it, the same bytes."""
    path = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, budget="80%", space=UNIFORM, configuration={"batch": [2, 4], "global_batch": 8},
        trials=3, confirm={"top": 0},
    ))
    result = cli("run", str(path))
    assert result.exit_code == 0, result.stdout + result.stderr
    with open_study("tiny", storage_url) as stored:
        assert not stored.with_plan(RematPlan.uniform("none", stored.attrs["layers"]).to_json())
        peak, budget = stored.attrs["no_remat_peak"], stored.budget
        preset = next(t for t in stored.trials() if t.plan.is_uniform and t.labels[0] == "none")
    assert budget == math.floor(0.8 * peak)
    assert preset.plan.configuration.batch == 2 and preset.peak_bytes < peak  # not the share's: a micro-batch of 2, not the workload's 4
    relative = cli("best", "--study", "tiny", "--budget", "80%", "--storage", storage_url, "--json")
    absolute = cli("best", "--study", "tiny", "--budget", size_argument(budget), "--storage", storage_url, "--json")
    assert relative.exit_code == absolute.exit_code == 0, relative.stderr + absolute.stderr
    assert relative.stdout == absolute.stdout and RematPlan.from_json(relative.stdout).configuration is not None


def test_a_query_share_needs_the_no_remat_trial_and_device_a_stored_limit(tmp_path: Path, storage_url: str, cli) -> None:  # type: ignore[no-untyped-def]
    path = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, space={"layout": "uniform", "choices": ["full", "dots"]}, trials=2, confirm={"top": 0},
    ))
    assert cli("run", str(path)).exit_code == 0
    for command in ("best", "plan", "confirm"):
        result = cli(command, "--study", "tiny", "--budget", "70%", "--storage", storage_url)
        assert result.exit_code == 2, result.stdout + result.stderr
        assert result.stderr == (
            "error: --budget: 70% is a share of no remat's compiled peak, and study 'tiny' has no compiled trial "
            "of the uniform no-remat plan; give bytes such as 14GiB\n"
        )
        result = cli(command, "--study", "tiny", "--budget", "device", "--storage", storage_url)
        assert result.exit_code == 2, result.stdout + result.stderr
        assert result.stderr.count("\n") == 1
        assert "--budget: device is the device's memory, and study 'tiny' stores no memory limit of its device (cpu)" in result.stderr
        result = cli(command, "--study", "tiny", "--budget", "150%", "--storage", storage_url)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1
        assert "--budget: expected a share of no remat's peak above 0% and at most 100%" in result.stderr
