"""optuna-dashboard against a study remat-search wrote: the dashboard (a real process, its JSON
API over HTTP on loopback) names the study's two objectives and shows the budget constraint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import spec_dict, write_spec
from tests.ports import free_port
from .services import Service, executable, get_json, started

pytestmark = pytest.mark.slow  # starts optuna-dashboard

OBJECTIVE_NAMES = ["step seconds", "peak bytes"]


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The storage URL of a real search: none and full remat on the tiny transformer, with a
    budget between their peaks, so that one plan fits and one is over (compiled, never run)."""
    from typer.testing import CliRunner

    from remat_search.cli.app import app

    folder = tmp_path_factory.mktemp("dashboard")
    storage = f"sqlite:///{folder / 'studies.db'}"
    spec = write_spec(folder / "spec.yaml", spec_dict(
        storage, trials=2, budget="1MiB", space={"layout": "uniform", "choices": ["none", "full"]},
        confirm={"top": 0, "rounds": 2, "presets": False},
    ))
    result = CliRunner().invoke(app, ["run", str(spec)])
    assert result.exit_code == 0, result.stdout + result.stderr
    return storage


@pytest.fixture(scope="module")
def dashboard(searched: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Service]]:
    """``optuna-dashboard STORAGE --host 127.0.0.1 --port P`` as README says to run it: its URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("dashboard-log") / "dashboard.log"
    argv = [executable("optuna-dashboard"), searched, "--host", "127.0.0.1", "--port", str(port)]
    with started("optuna-dashboard", argv, log) as service:
        url = f"http://127.0.0.1:{port}"
        service.wait_for_http(f"{url}/api/studies")
        yield url, service


def _study(url: str, name: str) -> dict[str, Any]:
    """The dashboard's detail of study ``name`` (/api/studies/{id}), found in /api/studies."""
    summaries = get_json(f"{url}/api/studies")["study_summaries"]
    ids = [s["study_id"] for s in summaries if s["study_name"] == name]
    assert len(ids) == 1, summaries
    return get_json(f"{url}/api/studies/{ids[0]}")


def test_the_dashboard_names_both_objectives(dashboard: tuple[str, Service]) -> None:
    study = _study(dashboard[0], "tiny")
    assert study["directions"] == ["minimize", "minimize"]
    assert study.get("objective_names") == OBJECTIVE_NAMES


def test_the_dashboard_shows_the_budget_constraint_of_every_trial(dashboard: tuple[str, Service]) -> None:
    """Each trial's constraint is its peak over the budget, less one: ≤ 0 fits, > 0 is over (the
    dashboard draws such a trial as infeasible). The budget itself is a study attribute."""
    study = _study(dashboard[0], "tiny")
    attrs = {a["key"]: a["value"] for a in study["user_attrs"]}
    budget = json.loads(attrs["budget"])
    assert budget == 2**20
    trials = study["trials"]
    assert [t["state"] for t in trials] == ["Complete", "Complete"]
    for trial in trials:
        peak = trial["values"][1]
        assert trial["constraints"] == [pytest.approx(peak / budget - 1.0)], trial["constraints"]
    assert sorted(t["constraints"][0] > 0 for t in trials) == [False, True]  # one fits, one is over


def test_the_dashboard_shows_each_trials_plan_and_measurement(dashboard: tuple[str, Service]) -> None:
    study = _study(dashboard[0], "tiny")
    for trial in study["trials"]:
        attrs = {a["key"] for a in trial["user_attrs"]}
        assert {"plan", "measurement"} <= attrs, attrs
