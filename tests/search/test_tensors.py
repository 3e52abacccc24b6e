"""``layout: tensors``: each tagged tensor on the device, recomputed or offloaded (MaxText's
``remat_policy: custom``), searched by the planner; on a TPU target, where step times are
estimates and so the same on every run, it finds the fastest fitting combination that an
exhaustive enumeration of the space finds, in fewer compiles."""

from __future__ import annotations

import itertools
from pathlib import Path

import optuna
import pytest

import remat_search
from remat_search.errors import SpecError
from remat_search.plans.export import maxtext_remat
from remat_search.plans.plan import RematPlan
from remat_search.search import samplers
from remat_search.search.space import Space
from remat_search.spec.loading import parse_spec
from remat_search.spec.space import SpaceConfig
from remat_search.store.attributes import PLAN_ATTR
from tests.conftest import TINY_TRANSFORMER, spec_dict

TENSORS = ["context", "out_proj", "mlpwi"]
WIDE = {**TINY_TRANSFORMER, "d_model": 64, "d_ff": 256, "seq_len": 512, "batch": 16}
"""The tiny transformer with long sequences: its saved tensors, not its weights, set its peak."""


def test_each_tensor_s_location_is_a_parameter_and_the_plan_is_maxtext_s_custom_policy() -> None:
    space = Space.of(SpaceConfig.model_validate({"layout": "tensors", "tensors": TENSORS}), 3)
    assert space.units == ("tensor_context", "tensor_out_proj", "tensor_mlpwi")
    assert space.labels == ("device", "remat", "offload")
    plans = {tuple(p.values()): space.plan(p) for p in space.presets()}  # every tensor at one location
    assert str(plans[("device",) * 3].layers[0]) == "per_name(context,mlpwi,out_proj)"
    assert plans[("remat",) * 3].layers[0].kind == "full"
    assert plans[("offload",) * 3].layers[0].offload == tuple(sorted(TENSORS))
    plan = space.plan({"tensor_context": "device", "tensor_out_proj": "offload", "tensor_mlpwi": "remat"})
    assert plan.layers == (plan.layers[0],) * 3 and str(plan.layers[0]) == "per_name(context; offload out_proj)"
    custom = maxtext_remat(plan)
    assert (custom["remat_policy"], custom["context"], custom["out_proj"], custom["mlpwi"]) == ("custom", "device", "offload", "remat")
    every = [space.plan(dict(zip(space.units, c, strict=True))).digest for c in itertools.product(space.labels, repeat=3)]
    assert len(set(every)) == 27  # 3³ distinct programs' plans
    weighted = space.with_tensor_bytes({"context": 1024, "out_proj": 1024, "mlpwi": 4096})
    assert weighted.weights == (1 / 6, 1 / 6, 4 / 6) and space.weights == (1 / 3,) * 3


@pytest.mark.parametrize(("space", "said"), [
    ({"layout": "tensors"}, "spec.space: tensors: expected a list of the checkpoint_name tags to place, got None"),
    ({"layout": "tensors", "tensors": ["context", "context"]}, "spec.space: tensors: each name once, repeated: ['context']"),
    ({"layout": "tensors", "tensors": ["context"], "choices": ["device", "dots"]},
     "spec.space: layout: tensors takes choices among device, remat, offload, got 'dots'"),
    ({"layout": "per_layer", "tensors": ["context"], "choices": ["full"]},
     "spec.space: tensors: only allowed with layout: tensors, not with layout: per_layer"),
    ({"layout": "tensors", "tensors": ["context"], "nested": True},
     "spec.space: nested: a layout: tensors plan is one policy for every layer, never nested"),
    ({"layout": "per_layer", "choices": ["full"], "points": ["full"]},
     "spec.space: points: only allowed with layout: tensors, not with layout: per_layer"),
    ({"layout": "tensors", "tensors": ["context"], "points": ["dots"]}, "spec.space: points: 'dots' is no plan of a tensors "
     "space (a policy of device, offloaded and recomputed tensors: full, names, offload or per_name)"),
    ({"layout": "tensors", "tensors": ["context"], "points": [{"label": "mine", "names": ["mlpwo"]}]},
     "spec.space: points: 'mine' names ['mlpwo'], not among tensors ['context']"),
    ({"layout": "tensors", "tensors": ["context"], "choices": ["device", "remat"], "points": [{"label": "off", "offload": ["context"]}]},
     "spec.space: points: 'off' puts tensors at ['offload'], which choices leave out"),
])
def test_a_bad_tensors_space_is_one_line_naming_the_field(space: dict, said: str, storage_url: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec(spec_dict(storage_url, space=space))
    assert str(raised.value) == said


def test_a_name_the_model_never_tags_is_refused_before_anything_is_written(tmp_path: Path, storage_url: str) -> None:
    with pytest.raises(SpecError, match=r"^spec.space.tensors: unknown tensor name\(s\) \['qkv_proj'\]; the workload names"):
        remat_search.run(parse_spec(spec_dict(storage_url, space={"layout": "tensors", "tensors": ["qkv_proj", "context"]})))
    assert not (tmp_path / "studies.db").exists()


def test_names_the_step_never_tags_and_tags_the_space_leaves_out_are_said_once(
    storage_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A ``tensors`` space naming a tensor the traced step never tags (a model's tags depend on
    its configuration: a GELU MLP tags ``mlpwi``, a gated one ``mlpwi_0`` and ``mlpwi_1``), and
    leaving out one it tags: one note says both, by the field the user wrote."""
    spec = parse_spec(spec_dict(storage_url, workload={"factory": "tests.factories:over_declared"}, trials=2,
                                space={"layout": "tensors", "tensors": ["mlpwi", "never_tagged"], "choices": ["device", "remat"]},
                                confirm={"top": 0}))
    with caplog.at_level("WARNING", logger="remat_search"):
        remat_search.run(spec)
    said = ("note: spec.space.tensors: names ['never_tagged'], which the traced step never tags with checkpoint_name: "
            "placing them changes nothing; the step also tags ['mlpwo'], which the space does not place")
    assert [r.getMessage() for r in caplog.records if "spec.space" in r.getMessage()] == [said]


def test_a_cpu_study_places_each_tensor_and_weighs_the_prior_by_the_tensor_s_bytes(storage_url: str) -> None:
    """On the CPU (no host memory): device or remat for each of three tensors, the planner
    proposing after the point the spec names (today's policy, say: ``mlpwi`` kept) and the two
    presets; every trial's plan is the one its parameters say, and the study keeps the traced
    bytes its cost model weighs the tensors by (``mlpwi`` is d_ff wide, four times ``context``
    and ``out_proj``)."""
    report = remat_search.run(parse_spec(spec_dict(
        storage_url, space={"layout": "tensors", "tensors": TENSORS, "choices": ["device", "remat"],
                            "points": [{"label": "keep_mlpwi", "names": ["mlpwi"]}]},
        trials=5, sampler={"kind": "planner", "seed": 0}, confirm={"top": 0},
    )))
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    space = Space.of(SpaceConfig.model_validate(study.user_attrs["space"]), TINY_TRANSFORMER["layers"])
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(trials) == 5 and [t.params for t in trials[:3]] == space.presets()
    assert [str(report.trials[i].plan.layers[0]) for i in range(3)] == ["per_name(mlpwi)", "per_name(context,mlpwi,out_proj)", "full"]
    for trial in trials:
        assert RematPlan.from_json(trial.user_attrs[PLAN_ATTR]) == space.plan(trial.params)
    sizes = study.user_attrs["device_info"]["traced_bytes"]
    assert sizes["mlpwi"] == 4 * sizes["context"] == 4 * sizes["out_proj"] > 0
    peaks = {tuple(t.params.values()): t.values[1] for t in trials}
    assert peaks[("remat",) * 3] < peaks[("device",) * 3]  # keeping every tensor costs memory
    assert all(t.plan is not None for t in report.trials)


@pytest.mark.slow
def test_on_a_tpu_target_the_planner_finds_the_exhaustive_optimum_in_fewer_compiles(storage_url: str) -> None:
    """Two tensors, each kept on the device or recomputed (2² combinations), on a ``v5e:2x2``
    topology, step times estimated: the planner's study of 3 trials (the 2 presets, then its
    first proposal) answers the budget with the plan an exhaustive enumeration (optuna's grid
    sampler) finds fastest within it, which is no preset (keeping both is over the budget;
    recomputing both is slower). Both studies share one database, so the enumeration compiles
    only what the planner did not. ``benchmarks/tensors_exhaustive.py`` runs three tensors with
    offload too, 3³ combinations, at three budgets (as this test did, with 3², until the suite
    had to fit in 20 minutes)."""
    common = {
        "space": {"layout": "tensors", "tensors": ["out_proj", "mlpwi"], "choices": ["device", "remat"]},
        "target": {"platform": "tpu", "topology": "v5e:2x2"},
        "mesh": {"fsdp": 4}, "budget": "27MiB", "confirm": {"top": 0}, "workload": WIDE,
    }
    planned = remat_search.run(parse_spec(spec_dict(
        storage_url, study="planner", trials=3, sampler={"kind": "planner", "seed": 0}, **common,
    )))
    samplers.register("grid")(lambda space, budget, seed: _Grid({unit: list(space.labels) for unit in space.units}, seed=seed))
    try:
        everything = remat_search.run(parse_spec(spec_dict(
            storage_url, study="exhaustive", trials=6, sampler={"kind": "grid", "seed": 0}, **common,  # 2 presets, 4 points
        )))
    finally:
        samplers.SAMPLERS.pop("grid", None)
    assert len({t.plan.digest for t in everything.trials if t.plan is not None}) == 4  # every combination
    exhaustive, found = everything.best(everything.budget), planned.best(planned.budget)
    assert exhaustive.plan is not None and found.plan is not None
    assert exhaustive.time_source == found.time_source == "estimated"
    assert found.plan.digest == exhaustive.plan.digest, (found.summary(), exhaustive.summary())
    assert str(found.plan.layers[0]) == "per_name(mlpwi)"  # out_proj recomputed, mlpwi kept
    compiled = {t.plan.digest for t in planned.trials if t.plan is not None}
    assert len(compiled) == 3 and len(planned.trials) == 3  # of the 4 the enumeration compiled


class _Grid(optuna.samplers.GridSampler):
    """Optuna's grid sampler, which asks the study to stop once every point is taken: the
    search stops by its trial count, asking and telling outside ``Study.optimize``."""

    def after_trial(self, *args: object) -> None:
        pass
