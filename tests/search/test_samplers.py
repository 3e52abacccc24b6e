"""Every registered sampler (remat_search.search.samplers.SAMPLERS) under the search's contract, fast:
it derives from the base, runs the queued presets first, then proposes plans of the space, on
a multi-objective study with the budget as a constraint (synthetic objectives: no compiling
here); and a new sampler is one registered factory."""

from __future__ import annotations

import optuna
import pytest

import remat_search
from remat_search.errors import SpecError
from remat_search.search.samplers import SAMPLERS, Sampler, check_sampler, make_sampler, register
from remat_search.search.space import Space
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import SamplerConfig
from remat_search.spec.space import SpaceConfig

from tests.conftest import spec_dict

SPACE = Space.of(SpaceConfig(layout="per_layer", choices=["none", "full", "dots"]), 3)
SAVING = {"none": 0.0, "full": 30.0, "dots": 12.0}


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_a_sampler_runs_the_presets_then_proposes_plans_of_the_space(kind: str) -> None:
    budget = 150
    study = optuna.create_study(directions=["minimize", "minimize"])
    study.sampler = make_sampler(SamplerConfig(kind=kind, seed=0), space=SPACE, budget=budget)
    assert isinstance(study.sampler, Sampler)
    for params in SPACE.presets():
        study.enqueue_trial(params)
    for _ in range(8):
        trial = study.ask()
        plan = SPACE.suggest(trial)
        labels = SPACE.layer_labels(trial.params)
        peak = 200.0 - sum(SAVING[label] for label in labels[:-1])
        trial.set_constraint("budget", peak / budget - 1.0)
        study.tell(trial, [1.0 + 0.1 * sum(SAVING[label] > 0 for label in labels), peak])
        assert len(plan.layers) == 3 and set(trial.params) == set(SPACE.units)
    assert [SPACE.choices(t.params) for t in study.trials[:3]] == [(c,) * 3 for c in SPACE.labels]


def test_an_unknown_sampler_names_the_known_ones() -> None:
    with pytest.raises(SpecError, match="spec.sampler.kind: unknown sampler 'cmaes'; expected one of planner, tpe"):
        check_sampler(SamplerConfig(kind="cmaes"))


def test_a_new_sampler_is_one_registered_factory() -> None:
    assert list(SAMPLERS) == ["planner", "tpe", "nsga2", "random"]
    try:
        register("grid")(lambda space, budget, seed: optuna.samplers.GridSampler(
            {u: list(space.labels) for u in space.units}, seed=seed))
        check_sampler(SamplerConfig(kind="grid"))
        assert isinstance(make_sampler(SamplerConfig(kind="grid", seed=1), space=SPACE, budget=1), optuna.samplers.GridSampler)
        with pytest.raises(ValueError, match="sampler 'grid' is registered already"):
            register("grid")(SAMPLERS["grid"])
    finally:
        SAMPLERS.pop("grid", None)


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_a_sampler_drives_a_real_tiny_search(kind: str, storage_url: str) -> None:
    """The tiny transformer's presets, then two plans of the sampler's, compiled and measured."""
    report = remat_search.run(parse_spec(spec_dict(
        storage_url, study=kind, trials=5, sampler={"kind": kind, "seed": 0}, confirm={"top": 0},
        space={"layout": "per_layer", "choices": ["none", "full", "dots"]},
    )))
    assert len(report.trials) == 5 and all(t.plan is not None and len(t.plan.layers) == 2 for t in report.trials)
    assert {t.status for t in report.trials} <= {"measured", "over_budget"} and report.best(2**40).plan is not None
