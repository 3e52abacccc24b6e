"""Studies of configurations: batch, accumulation and mesh searched with the plan, ranked by
throughput; the accumulated step is the whole batch's; bad configurations are one-line errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

import remat_search
from remat_search.store.liveness import counts
from remat_search.errors import SpecError
from remat_search.measure.measurement import Measurement, MemoryBreakdown
from remat_search.measure.runner import Runner
from remat_search.plans.configuration import Configuration
from remat_search.plans.plan import RematPlan
from remat_search.search.configurations import configurations
from remat_search.report.pictures import front_figure
from remat_search.report.results import TrialResult
from remat_search.report.text import describe_trial
from remat_search.search.configured_model import fit_configured
from remat_search.search.cost_model import CostModel
from remat_search.search.space import Space
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import ConfigurationSpace, TimingConfig
from remat_search.spec.workloads import TransformerConfig
from remat_search.store.attributes import PREDICTION_ATTR
from remat_search.store.liveness import enqueue
from remat_search.targets.platform import compiler_options
from remat_search.workloads.base import build_workload

from tests.conftest import TINY_TRANSFORMER, spec_dict, write_spec

SPACE = {"layout": "per_layer", "choices": ["none", "full"]}
CONFIGURATION = {"batch": [2, 4], "global_batch": 8}


def _step(configuration: Configuration | None, policy: str = "none") -> tuple[Any, Any]:
    """The tiny transformer's first step at ``configuration`` (None: its own batch of 8, no
    accumulation) on the same 8 examples: the new parameters and loss, and the compiled step."""
    workload = build_workload(TransformerConfig(**{**TINY_TRANSFORMER, "batch": 8}), configuration)
    plan = RematPlan.uniform(policy, workload.layers).model_copy(update={"configuration": configuration})
    step = workload.step(plan)
    compiled = step.lower(*workload.abstract_inputs()).compile(compiler_options=compiler_options("cpu") or None)
    (params, _), loss = compiled(*workload.inputs(0))
    return (jax.device_get(params), float(loss)), compiled


def test_an_accumulated_step_trains_as_the_whole_batch_does_in_a_micro_batch_s_memory() -> None:
    (whole, loss), one = _step(None)
    peaks = {}
    for batch, accumulation in ((4, 2), (2, 4)):
        (params, accumulated_loss), compiled = _step(Configuration(batch=batch, accumulation=accumulation))
        assert accumulated_loss == pytest.approx(loss, rel=1e-5)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        peaks[batch] = compiled.memory_analysis().temp_size_in_bytes
    assert peaks[2] < peaks[4] < one.memory_analysis().temp_size_in_bytes


def test_configurations_are_every_batch_with_every_mesh_that_divides_the_global_batch() -> None:
    """The batch is split over data and fsdp, not tensor: over fsdp=2 × tensor=2 a micro-batch
    of 4 makes 8 in one step, over 4 ways it cannot."""
    every = configurations(ConfigurationSpace(batch=(1, 2, 4), global_batch=8, mesh="all"), devices=4, mesh=None, sequence=16)
    assert [(c.batch, c.accumulation, c.mesh_axes) for c in every] == [
        (1, 2, {"fsdp": 4}), (2, 1, {"fsdp": 4}),
        (1, 2, {"data": 2, "fsdp": 2}), (2, 1, {"data": 2, "fsdp": 2}),
        (1, 2, {"data": 4}), (2, 1, {"data": 4}),
    ]
    assert all(c.global_batch == 8 and c.tokens_per_device == 8 * 16 / 4 for c in every)
    listed = ConfigurationSpace(batch=(1, 2, 4), global_batch=8, mesh=({"fsdp": 2, "tensor": 2},))
    found = configurations(listed, devices=4, mesh=None, sequence=16)
    assert [(c.batch, c.accumulation) for c in found] == [(1, 4), (2, 2), (4, 1)]
    own = configurations(ConfigurationSpace(batch=(2, 4)), devices=1, mesh=None, sequence=1)
    assert [(c.batch, c.accumulation, c.mesh) for c in own] == [(2, 1, ()), (4, 1, ())]


def test_mesh_all_splits_the_devices_over_every_axis_the_workload_shards_over() -> None:
    """``mesh: all`` is every mesh of the devices over the workload's axes: data and fsdp for
    the built-in ones, the axes a linen or NNX model's rules map onto too, MaxText's own (a
    tensor and a sequence axis among them); FSDP over every device first. A MaxText mesh may
    name only those, a factory's any."""
    from remat_search.search.configurations import MAXTEXT_AXES, search_axes, splits
    from remat_search.spec.workloads import LinenConfig

    assert search_axes(TransformerConfig(**TINY_TRANSFORMER)) == (("data", "fsdp"), False)
    rules = (("batch", ("data", "fsdp")), ("mlp", "tensor"), ("heads", "tensor"), ("length", "sequence"))
    linen = LinenConfig(kind="linen", model="tests.factories:LinenBlocks", blocks="blocks", batch=2, seq_len=8, vocab=16, logical_axis_rules=rules)
    assert search_axes(linen) == (("data", "fsdp", "sequence", "tensor"), False)
    every = splits(4, ("data", "fsdp", "sequence", "tensor"))
    assert every[0] == {"fsdp": 4} and {"tensor": 4} in every and {"fsdp": 2, "sequence": 2} in every
    assert len(every) == len({tuple(m.items()) for m in every}) == 10  # 4 = 2 × 2 over 4 axes: C(5, 2) ways
    assert all(math.prod(m.values()) == 4 and all(n > 1 for n in m.values()) for m in every)
    space = ConfigurationSpace(batch=(2,), global_batch=8, mesh="all")
    found = configurations(space, devices=4, mesh=None, sequence=16, axes=("data", "fsdp", "sequence", "tensor"))
    # the batch is split over data and fsdp only: over a tensor or sequence axis a micro-batch of 2 accumulates more
    assert {c.mesh: c.accumulation for c in found}[(("tensor", 4),)] == 4
    assert {c.mesh: c.accumulation for c in found}[(("fsdp", 4),)] == 1
    assert "context" in MAXTEXT_AXES and "tensor" in MAXTEXT_AXES and "sequence" not in MAXTEXT_AXES
    with pytest.raises(SpecError, match=r"spec.configuration.mesh.0: the workload shards over no axis 'sequence'"):
        configurations(ConfigurationSpace(batch=(2,), mesh=({"sequence": 4},)), devices=4, mesh=None, sequence=16,
                       axes=MAXTEXT_AXES, strict=True)


def test_a_configuration_s_settings_are_in_its_plan_and_its_export_and_leave_other_digests_alone() -> None:
    """MaxText's memory knobs searched beside remat ride on the configuration: every
    combination with every batch and mesh, in the summary, the plan's text and the export;
    a configuration without settings keeps the text (and digest) it had before they existed."""
    from remat_search.plans.export import export

    space = ConfigurationSpace(batch=(2,), mesh=({"fsdp": 4},), settings={"optimizer_memory_host_offload": [False, True]})
    found = configurations(space, devices=4, mesh=None, sequence=16)
    assert [c.settings for c in found] == [(("optimizer_memory_host_offload", False),), (("optimizer_memory_host_offload", True),)]
    plan = RematPlan.uniform("full", 2).model_copy(update={"configuration": found[1]})
    assert found[1].summary() == "batch 2 · fsdp=4 · optimizer_memory_host_offload=true"
    assert '"settings":[["optimizer_memory_host_offload",true]]' in plan.to_json()
    assert "optimizer_memory_host_offload: true" in export(plan, "maxtext")
    assert "optimizer_memory_host_offload=true" in export(plan, "maxtext-args")
    bare = RematPlan.uniform("full", 2).model_copy(update={"configuration": Configuration(batch=2, mesh={"fsdp": 4}, sequence=16)})
    assert "settings" not in bare.to_json()
    assert bare.digest == RematPlan.from_json(
        '{"configuration":{"accumulation":1,"batch":2,"mesh":[["fsdp",4]],"sequence":16},'
        '"layers":[{"kind":"full","names":[]},{"kind":"full","names":[]}]}').digest


def _space_of(*configurations: Configuration) -> Space:
    from remat_search.spec.space import SpaceConfig

    return Space.of(SpaceConfig(layout="per_layer", choices=["none", "full"]), 2).with_configurations(configurations)


def _trial(number: int, space: Space, choices: tuple[str, ...], configuration: str, *, state: float, temp: float,
           seconds: float) -> tuple[TrialResult, dict[str, object]]:
    params = space.params(choices, configuration)
    memory = MemoryBreakdown(argument=int(state), output=0, alias=0, temp=int(temp), generated_code=0)
    plan = space.plan(params)
    m = Measurement(status="measured", plan_digest=plan.digest, memory=memory, time_source="measured", step_times=(seconds,))
    return TrialResult(number=number, status="measured", plan=plan, measurement=m), params


def test_the_configured_model_carries_the_reference_s_plans_to_other_configurations() -> None:
    """At the reference (batch 4, fsdp=4) a device holds 1,000 bytes of state, and each layer's
    `none` 800 bytes of activations over `full`'s 200; over data=4 at batch 2 the state is
    replicated (4,000), activations half plus 100 bytes of buffers, steps 1.2× as long. Before a
    candidate there compiles, the prior (state × 4, activations × ½, time × 1) predicts it; after
    one, every other plan there is predicted exactly."""
    reference = Configuration(batch=4, mesh={"fsdp": 4}, sequence=8)
    other = Configuration(batch=2, accumulation=2, mesh={"data": 4}, sequence=8)
    space = _space_of(reference, other)
    act = {"none": 800.0, "full": 200.0}
    seconds = {"none": 1.0, "full": 1.5}

    def truth(choices: tuple[str, ...], c: Configuration) -> tuple[float, float, float]:
        activations = sum(act[x] for x in choices)
        step = sum(seconds[x] for x in choices)
        if c == reference:
            return 1000.0, activations, step
        return 4000.0, activations / 2 + 100, step * 1.2

    base = CostModel(
        units=space.units, labels=("none", "full"), base_peak=1000 + 1600, base_seconds=2.0,
        peak=np.array([[0.0, -600.0], [0.0, -600.0]]), seconds=np.array([[0.0, 0.5], [0.0, 0.5]]),
        observations=4, margin=0.0,
    )
    first = [_trial(0, space, ("none", "none"), reference.summary(), **dict(zip(("state", "temp", "seconds"), truth(("none", "none"), reference))))]
    prior = fit_configured(base, first, space)
    assert prior is not None
    guess = prior.predict(("full", "none"), other.summary())
    assert (guess.peak, guess.seconds) == (4000 + 0.5 * 1000, 2.5)
    one = _trial(1, space, ("none", "none"), other.summary(), **dict(zip(("state", "temp", "seconds"), truth(("none", "none"), other))))
    model = fit_configured(base, [*first, one], space)
    for choices in (("full", "none"), ("full", "full")):
        state, temp, step = truth(choices, other)
        predicted = model.predict(choices, other.summary())
        assert predicted.peak == pytest.approx(state + temp) and predicted.seconds == pytest.approx(step)
        assert predicted.cost == pytest.approx(step / other.tokens_per_device)
    front = model.front()
    assert [p.peak for p in front] == sorted(p.peak for p in front)
    assert all(b.cost < a.cost for a, b in zip(front, front[1:]))


def test_before_a_configuration_is_measured_its_step_is_the_reference_s_per_token_a_chip() -> None:
    """v5p-128b's published mesh, fsdp=16 × tensor=8 at 16 examples a data-parallel device, and
    its other, fsdp=32 × tensor=4 at 8: the same global batch, the same tokens a chip, so the same
    step before either other configuration is measured; half the global batch, half the step.
    (Priced by examples a data-parallel device, the other mesh once read twice as fast, and the
    planner proposed it first.)"""
    reference = Configuration(batch=16, mesh={"fsdp": 16, "tensor": 8}, sequence=8)
    other = Configuration(batch=8, mesh={"fsdp": 32, "tensor": 4}, sequence=8)
    halved = Configuration(batch=8, mesh={"fsdp": 16, "tensor": 8}, sequence=8)
    space = _space_of(reference, other, halved)
    base = CostModel(
        units=space.units, labels=("none", "full"), base_peak=2600, base_seconds=2.0,
        peak=np.array([[0.0, -600.0], [0.0, -600.0]]), seconds=np.array([[0.0, 0.5], [0.0, 0.5]]), observations=4, margin=0.0,
    )
    model = fit_configured(base, [_trial(0, space, ("none", "none"), reference.summary(), state=1000, temp=1600, seconds=2.0)], space)
    assert model.predict(("none", "none"), other.summary()).seconds == pytest.approx(2.0)
    assert model.predict(("full", "none"), halved.summary()).seconds == pytest.approx(1.25)


def _two_layer_model(space: Space) -> CostModel:
    """`none` 800 bytes and 1 s a layer, `full` 200 bytes and 1.5 s, over 1,000 bytes of state."""
    return CostModel(
        units=space.units, labels=("none", "full"), base_peak=2600, base_seconds=2.0,
        peak=np.array([[0.0, -600.0], [0.0, -600.0]]), seconds=np.array([[0.0, 0.5], [0.0, 0.5]]), observations=4, margin=0.0,
    )


def test_a_plan_measured_at_the_reference_is_carried_at_its_measurement() -> None:
    """The per-layer model smooths a measured plan towards its prior (on the published Llama 2
    70B: the published point predicted 9.357 s, measured 9.141 s, so `full` read as the fastest
    plan everywhere). A plan measured at the reference is carried to the other configurations at
    what it measured, and stands on the front at it."""
    reference = Configuration(batch=4, mesh={"fsdp": 4}, sequence=8)
    other = Configuration(batch=2, accumulation=2, mesh={"fsdp": 4}, sequence=8)
    space = _space_of(reference, other)
    trials = [
        _trial(0, space, ("none", "none"), reference.summary(), state=1000, temp=1600, seconds=2.0),
        _trial(1, space, ("full", "none"), reference.summary(), state=1000, temp=1000, seconds=1.8),
    ]
    model = fit_configured(_two_layer_model(space), trials, space)
    assert model.base.predict(("full", "none")).seconds == pytest.approx(2.5)  # the ridge's, not the clock's
    assert model.predict(("full", "none"), reference.summary()).seconds == pytest.approx(1.8)
    assert model.predict(("full", "none"), other.summary()).seconds == pytest.approx(1.8)  # the same tokens a device
    assert model.incumbent == pytest.approx(1.8 / reference.tokens_per_device)
    assert ("full", "none") == min(model.front(other.summary()), key=lambda p: p.cost).choices


def test_a_configuration_is_opened_for_a_new_trait_or_while_its_guess_could_beat_the_best_measured() -> None:
    """Every configuration of a 2 × 3 grid (micro-batch 4, 2×2 or 1×4; mesh fsdp=4 or
    data=2,fsdp=2) trains as many tokens a device. Each configuration with a trait no measured
    one has is opened (measured once), whatever its guess. Micro-batch 2×2 measured 1.2× its
    guess, 1×4 1.5×, data=2 0.95×: each combination is guessed from its traits (2×2 over data=2:
    1.2 × 0.95 = 1.14×) and, before one is measured, opened, the likelier first. Once 2×2 over
    data=2 measured 1.2×, 5% off its guess, 1×4 over data=2 (guessed 1.425×) could not beat the
    best measured (0.95×) were its guess 5% too slow: it is not opened."""
    reference = Configuration(batch=4, mesh={"fsdp": 4}, sequence=8)
    two, four = (Configuration(batch=b, accumulation=a, mesh={"fsdp": 4}, sequence=8) for b, a in ((2, 2), (1, 4)))
    data = Configuration(batch=4, mesh={"data": 2, "fsdp": 2}, sequence=8)
    two_data, four_data = (Configuration(batch=b, accumulation=a, mesh={"data": 2, "fsdp": 2}, sequence=8) for b, a in ((2, 2), (1, 4)))
    space = _space_of(reference, two, four, data, two_data, four_data)
    base, budget = _two_layer_model(space), 10_000

    def measured(number: int, c: Configuration, factor: float) -> tuple[TrialResult, dict[str, object]]:
        return _trial(number, space, ("none", "none"), c.summary(), state=1000, temp=1600, seconds=2.0 * factor)

    trials = [measured(0, reference, 1.0)]
    model = fit_configured(base, trials, space)
    assert model.guess_error is None and all(m.novel for m in model.maps[1:])
    assert len(model.openings(budget)) == 5  # each has a new trait

    trials += [measured(1, two, 1.2), measured(2, four, 1.5)]
    model = fit_configured(base, trials, space)
    assert [m.novel for m in model.maps] == [False, False, False, True, True, True]
    assert len(model.openings(budget)) == 3  # data=2 is a new trait still
    trials.append(measured(3, data, 0.95))
    model = fit_configured(base, trials, space)
    assert model.guess_error is None  # no measured configuration combines traits the others have
    assert model.predict(("none", "none"), two_data.summary()).seconds == pytest.approx(2.0 * 1.2 * 0.95)
    assert [(p.configuration, round(p.seconds, 6)) for p in model.openings(budget)] == [
        (two_data.summary(), 2.28), (four_data.summary(), 2.85)]

    trials.append(measured(4, two_data, 1.2))
    model = fit_configured(base, trials, space)
    assert model.guess_error == pytest.approx(1.2 / 1.14)  # each of the three combined, from the other two
    assert model.incumbent == pytest.approx(1.9 / reference.tokens_per_device)
    assert model.openings(budget) == []  # 1×4 over data=2: guessed 2.90 s, over 1.9 s even 5% faster
    assert model.predict(("none", "none"), four_data.summary()).seconds == pytest.approx(2.90, abs=0.005)


def test_the_planner_proposes_plans_and_configurations_it_has_not_tried(storage_url: str) -> None:
    """In a study of configurations the planner's proposals (each with its prediction) are new
    candidates; a configuration nothing was measured at is proposed first, to measure it."""
    spec = spec_dict(storage_url, space=SPACE, configuration=CONFIGURATION, trials=6, confirm={"top": 0},
                     sampler={"kind": "planner", "seed": 0})
    report = remat_search.run(parse_spec(spec))
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    proposed = [t for t in study.trials if PREDICTION_ATTR in t.user_attrs]
    assert proposed, "the planner proposed nothing"
    for t in proposed:  # new when proposed (TPE, once the planner has nothing new, may repeat one)
        before = [u.plan.digest for u in report.trials if u.number < t.number]
        assert report.trials[t.number].plan.digest not in before
    assert {t.params["configuration"] for t in proposed} >= {"batch 4×2 · 1 device"}


def test_a_configuration_the_workload_refuses_is_infeasible_and_proposed_no_more(
    tmp_path: Path, storage_url: str, cli: Any
) -> None:
    """A factory that cannot build a configuration raises ``CandidateRefused``: its trial is
    infeasible (pruned, its constraint violated, the reason kept), never compiled, `run` counts
    it, and the planner proposes that configuration no more."""
    spec = spec_dict(storage_url, space=SPACE, configuration={"batch": [2, 4]}, trials=4, confirm={"top": 0},
                     sampler={"kind": "planner", "seed": 0},
                     workload={"factory": "tests.factories:refusing", "args": {"batch": 2}})
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert result.exit_code == 0, result.output
    assert "infeasible (refused by the workload, never compiled)" in result.stdout, result.stdout
    assert "infeasible: this model cannot run a batch of 4" in result.output, result.output
    report = remat_search.load_report("tiny", storage_url)
    # the presets at the first configuration, then the planner measures the other one: refused
    assert [t.status for t in report.trials[:3]] == ["measured", "measured", "infeasible"], [
        (t.status, t.summary(), t.prediction is not None) for t in report.trials]
    refused = report.trials[2]
    assert refused.plan.configuration.batch == 4 and refused.peak_bytes is None and refused.prediction is not None
    assert refused.error == "this model cannot run a batch of 4"
    # the planner proposes it no more (TPE, where the planner has nothing new, learns from the constraint)
    assert all(t.plan.configuration.batch == 2 for t in report.trials[3:] if t.prediction is not None)
    assert all(t.status == "infeasible" for t in report.trials if t.plan.configuration.batch == 4)
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    assert study.trials[2].state == TrialState.PRUNED and study.trials[2].system_attrs["constraints"] == [1.0]


def test_presets_queued_at_a_configuration_the_workload_refuses_run_at_the_next(tmp_path: Path, storage_url: str, cli: Any) -> None:
    """The first configuration refused (as MaxText refuses the first mesh a user lists): the
    first preset is refused there, and then every preset runs at the next configuration, the
    refused one queued again; none is spent on a refusal it has already seen, and `run` and
    `show` say what moved."""
    spec = spec_dict(storage_url, space=SPACE, configuration={"batch": [4, 2]}, trials=3, confirm={"top": 0},
                     sampler={"kind": "planner", "seed": 0}, workload={"factory": "tests.factories:refusing", "args": {"batch": 2}})
    ran = cli("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert ran.exit_code == 0 and "1 moved (presets taken at a refused configuration, queued at the next; not counted)" in ran.stdout, ran.output
    shown = cli("show", "--study", "tiny", "--storage", storage_url)
    assert "moved: the workload refused its configuration" in " ".join(shown.stdout.split()), shown.stdout
    report = remat_search.load_report("tiny", storage_url)
    seen = [(t.status, t.plan.configuration.batch, str(t.plan.layers[0])) for t in report.trials]
    # the refused preset queued again at batch 2 behind the waiting one; that one, taken at batch 4, moved there
    assert seen == [("infeasible", 4, "none"), ("moved", 4, "full"), ("measured", 2, "none"), ("measured", 2, "full")], seen
    assert report.trials[1].error == "the workload refused its configuration: queued again at batch 2 · 1 device"
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    assert report.count("moved") == 1 and [counts(t) for t in study.trials] == [True, False, True, True]


def test_a_study_of_configurations_ranks_its_candidates_by_throughput(storage_url: str, cli: Any) -> None:
    """Every candidate carries one of the configurations; the presets run at the first; each
    accumulated step passed the gradient check against full remat at its configuration; the
    first objective is the step per token each device trains on, and `best` answers with the
    candidate of the most tokens per second, configuration included, confirmed; `plan` says its
    model cannot price configurations. Run again, the study resumes."""
    spec = spec_dict(storage_url, space=SPACE, configuration=CONFIGURATION, trials=5, confirm={"top": 2, "rounds": 2})
    report = remat_search.run(parse_spec(spec))
    configured = {(t.plan.configuration.batch, t.plan.configuration.accumulation) for t in report.trials}
    assert configured <= {(2, 4), (4, 2)}
    presets = [t for t in report.trials if t.plan.is_uniform][:2]
    assert [(t.plan.configuration.batch, t.labels[0]) for t in presets] == [(2, "none"), (2, "full")]
    measured = [t for t in report.trials if t.status == "measured"]
    assert measured and all(t.measurement.grad_check.failure() is None for t in measured)

    study = optuna.load_study(study_name="tiny", storage=storage_url)
    for trial in study.get_trials(states=(TrialState.COMPLETE,)):
        t = next(r for r in report.trials if r.number == trial.number)
        if t.status == "measured":
            c = t.plan.configuration
            assert trial.values[0] == t.step_seconds / (8 * TINY_TRANSFORMER["seq_len"] / c.devices)
    best = report.best(report.budget)
    assert best.confirmed is not None
    assert f"configuration: {best.plan.configuration.batch} examples a device a micro-step" in describe_trial(best)
    assert best.throughput == max(t.throughput for t in report.timed())
    answered = cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", storage_url, "--json")
    assert answered.exit_code == 0, answered.stderr
    assert RematPlan.from_json(answered.stdout) == best.plan and best.plan.configuration is not None
    shown = cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", storage_url)
    assert "tokens/s per device" in shown.stdout and best.plan.configuration.summary() in shown.stdout

    ax = front_figure(report).axes[1]
    assert ax.get_ylabel() == "tokens/s per device (higher is faster)"
    drawn = {float(y) for c in ax.collections for y in c.get_offsets()[:, 1]}
    assert {t.throughput for t in report.timed()} <= drawn  # each plan at its tokens/s, not its step time
    planned = cli("plan", "--study", "tiny", "--budget", "1GiB", "--storage", storage_url)
    assert planned.exit_code == 2 and "searches configurations" in planned.stderr
    shared = cli("best", "--study", "tiny", "--budget", "70%", "--storage", storage_url)
    assert shared.exit_code == 2 and shared.stderr == (
        "error: --budget: 70% is a share of no remat's compiled peak, and study 'tiny' searches configurations and "
        "stores no compiled peak of the uniform no-remat plan at its own batch and mesh (a search stores it when it "
        "resolves a share budget: run the spec again with one); give bytes such as 14GiB\n")

    again = remat_search.run(parse_spec({**spec, "trials": 6, "confirm": {"top": 0}}))
    assert len(again.trials) == 6 and [t.plan for t in again.trials[:5]] == [t.plan for t in report.trials]


def test_candidates_of_two_configurations_are_re_timed_each_in_its_own_session() -> None:
    """Confirmation hands the worker candidates of several configurations at once: each is timed
    with the executables of its configuration, every round, in the order given back."""
    small, large = Configuration(batch=2, sequence=32), Configuration(batch=4, sequence=32)
    plans = [RematPlan.uniform(p, 2).model_copy(update={"configuration": c})
             for p, c in (("none", small), ("full", large), ("full", small))]
    with Runner(TransformerConfig(**TINY_TRANSFORMER), timeout=120) as runner:
        times = runner.retime(plans, warmup=1, rounds=3, budget=2**30)
        measured = [runner.measure(p, budget=2**30, timing=TimingConfig(warmup=1, repeats=2, anchor=False),
                                   gradient_tolerance=1e-3) for p in plans]
    assert [len(t) for t in times] == [3, 3, 3] and all(x > 0 for t in times for x in t)
    assert [m.status for m in measured] == ["measured"] * 3
    assert measured[1].peak_bytes > measured[2].peak_bytes  # full remat at 4 examples, then at 2


def test_a_study_stored_before_configurations_resumes(storage_url: str) -> None:
    """A study whose stored spec and identity have no ``configuration`` (made before it existed)
    resumes with a spec that leaves it out."""
    spec = spec_dict(storage_url, space=SPACE, trials=2, confirm={"top": 0})
    remat_search.run(parse_spec(spec))
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    stored = {k: v for k, v in study.user_attrs["spec"].items() if k != "configuration"}
    study.set_user_attr("spec", stored)
    assert "configuration" not in study.user_attrs["spec"]
    assert len(remat_search.run(parse_spec({**spec, "trials": 3})).trials) == 3


@pytest.mark.parametrize(("overrides", "message"), [
    ({"configuration": {"batch": [2], "mesh": [{"data": 2}]}}, "spec.configuration.mesh.0: {'data': 2} spans 2 devices"),
    ({"configuration": {"batch": [4], "global_batch": 6}}, "spec.configuration.global_batch: 6 is a multiple"),
    ({"configuration": {"batch": [0]}}, "spec.configuration.batch.0"),
    ({"configuration": {"batch": [2], "mesh": "some"}}, "spec.configuration.mesh"),
    ({"configuration": {"batch": [2]}, "timing": {"anchor": True}}, "spec.timing.anchor: a study of configurations"),
    ({"configuration": {"batch": [2]}, "workload": {"factory": "tests.factories:delayed", "args": {}}},
     "spec.configuration: a factory workload's batch is its own"),
    ({"configuration": {"batch": [2], "settings": {"optimizer_memory_host_offload": [True]}}},
     "spec.configuration.settings.optimizer_memory_host_offload: only a kind: maxtext workload has settings"),
    ({"configuration": {"batch": [2], "settings": {"optimizer_memory_host_offload": []}}},
     "spec.configuration.settings"),
])
def test_bad_configurations_are_one_line_errors_and_nothing_is_written(
    tmp_path: Path, storage_url: str, cli: Any, overrides: dict[str, Any], message: str,
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(storage_url, space=SPACE, **overrides))
    result = cli("run", str(spec))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*"))


@pytest.mark.slow  # compiles for a TPU topology
def test_a_tpu_study_of_configurations_compiles_each_mesh_and_estimates_throughput(storage_url: str, cli: Any) -> None:
    """Over v5e:2x2 every candidate is compiled over its own mesh of the 4 chips at its batch:
    each has its own peak and estimate, its throughput is the global batch's tokens per chip
    over that estimate, and the objective is the estimate per token per chip. ``show`` says the
    shardings are over each candidate's mesh, not the target's default (``data: 4``)."""
    model = {"kind": "transformer", "layers": 2, "d_model": 64, "heads": 2, "d_ff": 256, "seq_len": 128,
             "batch": 32, "vocab": 128, "attention": "dense"}
    spec = spec_dict(
        storage_url, workload=model, target={"platform": "tpu", "topology": "v5e:2x2"}, budget=None, trials=1,
        space={"layout": "uniform", "choices": ["none"]}, confirm={"top": 0},
        configuration={"batch": [8, 2], "global_batch": 32, "mesh": [{"fsdp": 4}, {"data": 4}]},
    )
    remat_search.run(parse_spec(spec))  # its preset: the first configuration
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    for label in ("batch 2×4 · fsdp=4", "batch 8 · data=4", "batch 2×4 · data=4"):  # every other one, queued
        enqueue(study, {"policy": "none", "configuration": label})
    report = remat_search.run(parse_spec({**spec, "trials": 4}))
    assert {(t.plan.configuration.batch, t.plan.configuration.accumulation, t.plan.configuration.mesh)
            for t in report.trials} == {(8, 1, (("fsdp", 4),)), (2, 4, (("fsdp", 4),)), (8, 1, (("data", 4),)), (2, 4, (("data", 4),))}
    assert all(t.time_estimated and t.throughput == 32 * 128 / 4 / t.seconds for t in report.trials)
    assert len({t.peak_bytes for t in report.trials}) == len({t.seconds for t in report.trials}) == 4
    assert all(s.values[0] == t.seconds / (32 * 128 / 4) for s, t in zip(study.trials, report.trials, strict=True))
    shown = cli("show", "--study", "tiny", "--storage", storage_url).stdout
    assert "shardings over each candidate's own mesh (its configuration's): " in shown and "shardings over mesh" not in shown
