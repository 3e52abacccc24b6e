"""Studies on a real PostgreSQL server (tests/conftest.py starts one): a search through the CLI,
and two searches at once on one study, as several hosts would run them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from remat_search import RematPlan
from remat_search.store.liveness import counts
from remat_search.store.attributes import CACHED_ATTR, PID_ATTR, PLAN_ATTR, REUSED_ATTR

from tests.conftest import TINY_TRANSFORMER, run_process, spec_dict, write_spec


def _query(url: str, sql: str, *params: Any) -> list[tuple]:
    """Rows of ``sql`` on the database of ``url``, read with psycopg itself, not through remat-search."""
    import psycopg

    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as db:
        return db.execute(sql, params).fetchall()


def _digest(trial: optuna.trial.FrozenTrial) -> str:
    return RematPlan.model_validate_json(trial.user_attrs[PLAN_ATTR]).digest


def test_a_search_on_postgresql_keeps_its_trials_and_measurements_there(
    tmp_path: Path, postgres_url: str, cli: Any
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(postgres_url, study="pg-tiny", trials=6))
    result = cli("run", str(spec))
    assert result.exit_code == 0, result.output

    studies = cli("studies", "--storage", postgres_url)
    assert studies.exit_code == 0 and "pg-tiny" in studies.stdout, studies.output
    best = cli("best", "--study", "pg-tiny", "--budget", "1GiB", "--storage", postgres_url, "--json")
    assert best.exit_code == 0, best.output
    best_plan = RematPlan.from_json(best.stdout)
    pareto = cli("pareto", "--study", "pg-tiny", "--storage", postgres_url, "--json")
    assert pareto.exit_code == 0, pareto.output
    assert json.loads(pareto.stdout)

    rows = _query(
        postgres_url,
        "SELECT t.number, t.state FROM trials t JOIN studies s ON s.study_id = t.study_id WHERE s.study_name = %s",
        "pg-tiny",
    )
    assert sorted(rows) == [(n, "COMPLETE") for n in range(6)]
    study = optuna.load_study(study_name="pg-tiny", storage=postgres_url)
    digests = {_digest(t) for t in study.trials}
    assert best_plan.digest in digests
    cached = _query(postgres_url, "SELECT plan, study, trial FROM remat_search_measurements")
    # Every plan the search measured is in the cache, as measured by this study's trial.
    assert {plan for plan, _, _ in cached} == digests
    assert all(s == "pg-tiny" and _digest(study.trials[n]) == plan for plan, s, n in cached)


def test_two_searches_at_once_share_one_study_on_postgresql(tmp_path: Path, postgres_url: str) -> None:
    """Two `remat-search run` processes on one study, as two hosts would run the same command,
    three workers in all (one search has two): together they finish it with exactly the spec's
    trial count, and no plan is measured twice (both samplers are seeded alike, so they propose
    the same plans at the same moments: one measures, the other waits and reuses it)."""
    trials = 10
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        postgres_url, study="pg-shared", trials=trials, workload={**TINY_TRANSFORMER, "layers": 3},
        sampler={"kind": "random", "seed": 0}, confirm={"top": 0},
    ))
    searches = [run_process("run", str(spec), "--workers", "2"), run_process("run", str(spec))]
    for search in searches:
        log = search.communicate(timeout=600)[0]
        assert search.returncode == 0, log

    study = optuna.load_study(study_name="pg-shared", storage=postgres_url)
    states = [t.state for t in study.trials]
    assert states.count(TrialState.RUNNING) == 0, states
    assert sum(counts(t) for t in study.trials) == trials, states
    assert all(s in (TrialState.COMPLETE, TrialState.PRUNED) for t, s in zip(study.trials, states) if counts(t))
    # Both searches measured some (a trial refused at admission, when both asked for the last
    # one at once, was never marked by either: it does not count).
    assert len({t.user_attrs[PID_ATTR] for t in study.trials if counts(t)}) == 2
    measured = [
        _digest(t) for t in study.trials
        if REUSED_ATTR not in t.user_attrs and CACHED_ATTR not in t.user_attrs and t.state == TrialState.COMPLETE
    ]
    assert len(measured) == len(set(measured)), measured
    # Each measurement in the cache was made by a complete trial of this study, of that plan,
    # and each plan once. (A trial both searches popped from the queue at once carries no mark
    # of reuse: tests/store/test_cache.py.)
    cached = _query(postgres_url, "SELECT plan, study, trial FROM remat_search_measurements")
    trials_by_number = {t.number: t for t in study.trials}
    assert all(s == "pg-shared" and trials_by_number[n].state == TrialState.COMPLETE
               and _digest(trials_by_number[n]) == plan for plan, s, n in cached), cached
    assert len({plan for plan, _, _ in cached}) == len(cached)
    assert set(measured) <= {plan for plan, _, _ in cached}


def test_a_database_that_does_not_exist_is_one_line_and_exit_2(tmp_path: Path, postgres_server: str, cli: Any) -> None:
    url = postgres_server + "/no_such_database"
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(url))
    result = cli("run", str(spec))
    assert result.exit_code == 2
    assert result.stderr.startswith("error: storage: cannot use 'postgresql+psycopg://postgres@127.0.0.1:")
    assert 'database "no_such_database" does not exist' in result.stderr and result.stderr.count("\n") == 1
