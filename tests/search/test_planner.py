"""The planner: cost-model fit and exact solve on synthetic costs, then a real planner study."""

from __future__ import annotations

import io
import itertools
import json
import random
import re
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState
from rich.console import Console

import remat_search
from remat_search.cli import output
from remat_search.search.cost_model import Observation, fit_cost_model
from remat_search.search.solver import solve_front
from remat_search.search.advice import plan_for_budget
from remat_search.spec.loading import parse_spec
from remat_search.store.attributes import COST_MODEL_ATTR, LAYERS_ATTR, PREDICTION_ATTR
from remat_search.store.storage import open_storage

from tests.conftest import spec_dict


def _brute_force(memory: np.ndarray, seconds: np.ndarray, cap: float) -> float | None:
    best = None
    for ks in itertools.product(range(memory.shape[1]), repeat=memory.shape[0]):
        m = sum(memory[u, k] for u, k in enumerate(ks))
        t = sum(seconds[u, k] for u, k in enumerate(ks))
        if m <= cap and (best is None or t < best):
            best = t
    return best


@pytest.mark.parametrize("seed", range(6))
def test_solver_finds_the_brute_force_optimum_at_every_cap(seed: int) -> None:
    rng = np.random.default_rng(seed)
    memory = rng.uniform(0, 10, size=(5, 4))
    seconds = rng.uniform(0, 10, size=(5, 4))
    solved = solve_front(memory, seconds)
    assert solved.exact and solved.thinned_to is None  # 4^5 plans: the front never nears MAX_STATES
    front = solved.points()
    assert [m for m, _, _ in front] == sorted(m for m, _, _ in front)
    assert all(a[1] > b[1] for a, b in itertools.pairwise(front))  # strictly faster as memory grows
    for m, t, ks in front:  # each point is the plan it claims to be
        assert m == pytest.approx(sum(memory[u, k] for u, k in enumerate(ks)))
        assert t == pytest.approx(sum(seconds[u, k] for u, k in enumerate(ks)))
    for cap in np.linspace(memory.min(axis=1).sum() - 1, memory.max(axis=1).sum() + 1, 25):
        capped = solve_front(memory, seconds, cap=cap)
        assert capped.exact
        fitting = [t for _, t, _ in capped.points()]
        expected = _brute_force(memory, seconds, cap)
        assert (min(fitting) if fitting else None) == (pytest.approx(expected) if expected is not None else None)


def _wide(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Costs whose front of partial plans grows past a few dozen states (12 units, 5 choices)."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0, 10, size=(12, 5)), rng.uniform(0, 10, size=(12, 5))


def test_thinned_front_still_reads_back_the_plans_it_prices() -> None:
    memory, seconds = _wide()
    exact, thinned = solve_front(memory, seconds), solve_front(memory, seconds, max_states=16)
    assert exact.exact and not thinned.exact and thinned.thinned_to == 16
    assert len(exact.memory) > 18 >= len(thinned.memory) >= 2
    for m, t, ks in thinned.points():
        assert m == pytest.approx(sum(memory[u, k] for u, k in enumerate(ks)))
        assert t == pytest.approx(sum(seconds[u, k] for u, k in enumerate(ks)))
    # The extremes survive thinning: the least-memory and the fastest plans.
    assert thinned.memory[0] == pytest.approx(exact.memory[0]) and thinned.seconds[-1] == pytest.approx(exact.seconds[-1])


def test_thinning_is_reported_exactly_when_it_happens() -> None:
    """The smallest ``max_states`` that leaves the solve exact returns the unthinned front;
    one state fewer thins it and says so."""
    memory, seconds = _wide()
    unthinned = solve_front(memory, seconds, max_states=10**9)
    assert unthinned.exact
    enough = next(n for n in range(1, 10**4) if solve_front(memory, seconds, max_states=n).exact)
    assert enough >= len(unthinned.memory)  # the last unit's front, at least, had to fit
    at_limit, below = solve_front(memory, seconds, max_states=enough), solve_front(memory, seconds, max_states=enough - 1)
    assert at_limit.points() == unthinned.points()
    assert below.thinned_to == enough - 1 and not below.exact


def test_a_thinned_optimum_is_never_better_than_the_exact_one_and_sometimes_worse() -> None:
    """At every cap the thinned solve finds a plan wherever the exact one does, and never a
    faster one: solved for that cap (as the planner's ``best`` does) or read off the front
    solved without one (as its sampler reads targets below the budget). Read off the front,
    it is slower at some caps here: the thinning has a cost, which is why it is reported."""
    memory, seconds = _wide()
    front = solve_front(memory, seconds, max_states=16)
    worse = 0
    for cap in np.linspace(memory.min(axis=1).sum(), memory.max(axis=1).sum(), 40):
        exact, thinned = solve_front(memory, seconds, cap=cap), solve_front(memory, seconds, cap=cap, max_states=16)
        assert exact.exact and len(exact.memory) > 0
        read = front.seconds[np.flatnonzero(front.memory <= cap)]
        assert len(thinned.memory) > 0 and len(read) > 0  # the least-memory plan survives thinning
        assert thinned.seconds[-1] >= exact.seconds[-1] - 1e-9 and read[-1] >= exact.seconds[-1] - 1e-9
        worse += bool(read[-1] > exact.seconds[-1] + 1e-9)
    assert worse > 0


def _synthetic(choices: tuple[str, ...]) -> tuple[float, float, float]:
    """A 4-layer chain with known costs: each layer but the last saves by its choice (the
    last layer's residuals are needed at once, so its choice saves nothing), and the first
    layer's residuals live longest, so checkpointing it saves more."""
    saving = {"none": 0.0, "full": 30.0, "dots": 12.0}
    work = {"none": 0.0, "full": 10.0, "dots": 3.0}
    peak = 200.0 - sum(saving[c] for c in choices[:-1]) - (20.0 if choices[0] != "none" else 0.0)
    flops = 100.0 + sum(work[c] for c in choices)
    return peak, flops, 0.5 + 0.01 * flops


def test_cost_model_learns_positions_from_presets_and_corrections() -> None:
    labels = ("none", "full", "dots")
    units = [f"layer_{i:02d}" for i in range(4)]
    every = list(itertools.product(labels, repeat=4))
    mixed = random.Random(0).sample([p for p in every if len(set(p)) > 1], 12)
    trained = [(c,) * 4 for c in labels] + mixed
    held_out = [p for p in every if p not in trained]
    observations = [Observation(choices=p, peak=(s := _synthetic(p))[0], flops=s[1], seconds=s[2]) for p in trained]
    kwargs = {"labels": labels, "unit_layers": [[i] for i in range(4)], "units": units, "layers": 4}

    presets_only = fit_cost_model(observations[:3], **kwargs)
    assert presets_only is not None
    assert presets_only.peak[3].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)  # the last layer saves nothing
    assert presets_only.peak[0, 1] == pytest.approx(presets_only.peak[1, 1]) and presets_only.peak[0, 1] < 0  # the prior spreads full's saving evenly
    for plan in held_out:
        assert presets_only.predict(plan).seconds == pytest.approx(_synthetic(plan)[2])  # time is FLOPs-exact

    model = fit_cost_model(observations, **kwargs)
    assert model.peak[0, 1] < model.peak[1, 1]  # learned: the first layer saves more
    error = {
        name: np.mean([abs(m.predict(p).peak - _synthetic(p)[0]) for p in held_out])
        for name, m in (("presets", presets_only), ("all", model))
    }
    assert error["all"] < 0.5 * error["presets"]
    assert model.predict(("mystery",) * 4) is None


def test_time_prior_is_the_presets_measured_step_where_they_ran() -> None:
    """Fewer FLOPs need not be faster (on a CPU, `dots` ran slower than `save_qkv`): a preset
    that ran is priced by its measured step; one over budget, by its FLOPs."""
    kwargs = {"labels": ("none", "full", "dots"), "unit_layers": [[i] for i in range(4)],
              "units": [f"layer_{i:02d}" for i in range(4)], "layers": 4}
    observations = [
        Observation(choices=("none",) * 4, peak=200.0, flops=100.0),  # over budget: never ran
        Observation(choices=("full",) * 4, peak=80.0, flops=140.0, seconds=1.0),
        Observation(choices=("dots",) * 4, peak=120.0, flops=112.0, seconds=1.4),  # fewer FLOPs, slower
    ]
    model = fit_cost_model(observations, **kwargs)
    assert model is not None
    assert model.predict(("full",) * 4).seconds == pytest.approx(1.0)
    assert model.predict(("dots",) * 4).seconds == pytest.approx(1.4)
    # none, never run: time against FLOPs falls here, so time proportional to work it is.
    assert model.predict(("none",) * 4).seconds == pytest.approx(100.0 * (1.0 + 1.4) / (140.0 + 112.0))
    assert model.predict(("full", "full", "dots", "dots")).seconds == pytest.approx(1.2)


def _device_refused(units: list[str], weights: list[float], *, remat: float,
                    offload: tuple[float, float]) -> tuple[dict[str, object], list[Observation]]:
    """A four-tensor space's fit arguments (each unit every layer, ``weights`` its bytes' share)
    and its three presets as a TPU study sees them: `device` refused by the compiler (its peak
    only), `remat` run at 140 FLOPs in ``remat`` seconds, `offload` at ``offload``'s (FLOPs, seconds)."""
    kwargs = {"labels": ("device", "remat", "offload"), "unit_layers": [[0, 1, 2, 3]] * 4,
              "units": units, "layers": 4, "weights": weights}
    return kwargs, [Observation(choices=("device",) * 4, peak=120.0),
                    Observation(choices=("remat",) * 4, peak=40.0, flops=140.0, seconds=remat),
                    Observation(choices=("offload",) * 4, peak=35.0, flops=offload[0], seconds=offload[1])]


def test_a_preset_the_compiler_refused_is_priced_from_the_plans_that_hold_its_choice() -> None:
    """On a TPU the device preset of a big model is refused at compile time (its peak from the
    refusal, no FLOPs, no step), while a published policy keeping names on the device runs fastest:
    the model prices `device` from that plan (its saving per byte kept, spread over the units by
    their bytes as a preset's is), where it once left `device` out and proposed only recomputing
    and offloading plans."""
    kwargs, presets = _device_refused(["a", "b", "c", "d"], [0.4, 0.4, 0.1, 0.1], remat=1.2, offload=(140.0, 1.8))
    published = Observation(choices=("device", "remat", "device", "remat"), peak=80.0, flops=120.0, seconds=1.0)
    assert fit_cost_model(presets, **kwargs).labels == ("remat", "device", "offload")  # the refused peak prices memory
    model = fit_cost_model([*presets, published], **kwargs)
    assert model.predict(published.choices).seconds == pytest.approx(1.0)
    # 0.2 s saved keeping half the bytes: 0.4 s for all of them, 0.16 s for unit a alone
    assert model.predict(("device",) * 4).seconds == pytest.approx(0.8)
    assert model.predict(("device", "remat", "remat", "remat")).seconds == pytest.approx(1.04)
    best = model.best(100.0)
    assert best.seconds < 1.0 and best.choices.count("device") >= 2
    refused = [presets[0], Observation(choices=("remat",) * 4, peak=40.0)]
    assert fit_cost_model([*refused, published], **kwargs) is None  # no preset with a FLOP count to price time by


def test_a_choice_priced_from_a_small_tensor_never_moves_a_step_by_more_than_a_third() -> None:
    """The v5e 32B study's planner, once a plan keeping only `context` (a small tensor, by its
    bytes) ran 1% faster than every tensor recomputed, spread that saving by bytes over the big
    tensors and read plans keeping them at steps below zero (-66 s and -79 s: it proposed them
    first). Priced from the plans holding it, a choice's prior may move the reference's step by at
    most a third, every unit holding it: what keeping every tensor can save of a step recomputing
    them all; the plans measured then correct the cells they hold, as any prior's."""
    kwargs, presets = _device_refused(["context", "b", "c", "mlpwi"], [0.001, 0.3, 0.3, 0.399], remat=12.0,
                                      offload=(120.0, 13.0))
    context = Observation(choices=("device", "remat", "remat", "remat"), peak=41.0, flops=139.0, seconds=11.88)
    model = fit_cost_model([*presets, context], **kwargs)
    assert model is not None
    assert model.predict(context.choices).seconds == pytest.approx(11.88, abs=0.05)  # what it measured (ridge-smoothed)
    # its prior saves at most a third (4 s of 12) every unit keeping it; the fit then moves the
    # one cell a plan measured (context's) by what that plan says, a tenth of a second
    for kept in itertools.product(("device", "remat"), repeat=4):
        assert model.predict(kept).seconds >= 12.0 * 2 / 3 - 0.1, kept
    assert model.predict(("device",) * 4).seconds == pytest.approx(8.0, abs=0.1)
    assert model.predict(("remat", "remat", "remat", "device")).seconds == pytest.approx(12.0 - 4.0 * 0.399)


def test_a_compile_the_tpu_compiler_refused_is_observed_at_the_bytes_it_needed() -> None:
    """A refused compile has no memory analysis, only the bytes the compiler needed (its
    out-of-memory message): the study's observations read them as the preset's peak, so the
    model prices that choice (v5p's `device` preset: the planner once proposed no plan keeping a
    name on the device)."""
    from remat_search.measure.measurement import Measurement, MemoryBreakdown
    from remat_search.report.results import TrialResult
    from remat_search.search.cost_model import cost_model, observations
    from remat_search.search.space import Space
    from remat_search.spec.space import SpaceConfig

    space = Space.of(SpaceConfig(layout="per_layer", choices=["none", "full"]), 2)

    def trial(number: int, choices: tuple[str, ...], m: dict[str, object]) -> tuple[TrialResult, dict[str, object]]:
        params = space.params(choices)
        plan = space.plan(params)
        measurement = Measurement(plan_digest=plan.digest, **m)  # type: ignore[arg-type]
        return TrialResult(number=number, status=measurement.status, plan=plan, measurement=measurement), params

    memory = MemoryBreakdown(argument=100, output=0, alias=0, temp=300, generated_code=0)
    trials = [
        trial(0, ("none", "none"), {"status": "over_budget", "oom_required_bytes": 900, "oom_available_bytes": 500}),
        trial(1, ("full", "full"), {"status": "measured", "memory": memory, "flops": 140.0, "estimated_seconds": 1.2}),
        trial(2, ("none", "full"), {"status": "measured", "memory": memory.model_copy(update={"temp": 500}),
                                    "flops": 120.0, "estimated_seconds": 1.0}),
    ]
    assert [o.peak for o in observations(trials, space)] == [900, 400, 600]
    model = cost_model(trials, space)
    assert model is not None and set(model.labels) == {"none", "full"}
    assert model.predict(("none", "full")).seconds == pytest.approx(1.0, abs=1e-3)


def test_calibration_margin_keeps_proposals_under_the_budget() -> None:
    """Mixed plans cost more than any additive model says (here +8 each): once the study has
    seen that, the model's best plan for a budget fits it in truth, not just in prediction."""
    labels = ("none", "full", "dots")
    units = [f"layer_{i:02d}" for i in range(4)]

    def true_peak(plan: tuple[str, ...]) -> float:
        return _synthetic(plan)[0] + (8.0 if len(set(plan)) > 1 else 0.0)

    every = list(itertools.product(labels, repeat=4))
    kwargs = {"labels": labels, "unit_layers": [[i] for i in range(4)], "units": units, "layers": 4}
    presets = [Observation(choices=(c,) * 4, peak=_synthetic((c,) * 4)[0], flops=_synthetic((c,) * 4)[1],
                           seconds=_synthetic((c,) * 4)[2]) for c in labels]
    naive = fit_cost_model(presets, **kwargs)
    assert naive.margin == 0.0
    budgets = np.linspace(120, 190, 15)
    assert any(true_peak(naive.best(b).choices) > b for b in budgets)  # the additive model overshoots

    mixed = [p for p in random.Random(1).sample(every, 10) if len(set(p)) > 1]
    seen = presets + [Observation(choices=p, peak=true_peak(p), flops=_synthetic(p)[1], seconds=_synthetic(p)[2])
                      for p in mixed]
    calibrated = fit_cost_model(seen, **kwargs)
    assert calibrated.margin > 0
    for b in budgets:
        best = calibrated.best(b)
        assert best is None or true_peak(best.choices) <= b


def test_a_plan_is_screened_out_only_when_certainly_over_the_budget() -> None:
    """Mixed plans cost 15 less than any additive model says. A plan the model screens out
    at ``1.05 × budget`` is over the budget in truth, though the model over-predicts it by
    more than 5%; and nothing is screened before three mixed plans have shown that error."""
    labels = ("none", "full", "dots")
    units = [f"layer_{i:02d}" for i in range(4)]

    def true_peak(plan: tuple[str, ...]) -> float:
        return _synthetic(plan)[0] - (15.0 if len(set(plan)) > 1 else 0.0)

    every = list(itertools.product(labels, repeat=4))
    kwargs = {"labels": labels, "unit_layers": [[i] for i in range(4)], "units": units, "layers": 4}

    def observed(plan: tuple[str, ...]) -> Observation:
        return Observation(choices=plan, peak=true_peak(plan), flops=_synthetic(plan)[1], seconds=_synthetic(plan)[2])

    presets = [observed((c,) * 4) for c in labels]
    mixed = [p for p in random.Random(2).sample(every, 12) if len(set(p)) > 1]
    budgets = np.linspace(80, 170, 10)
    early = fit_cost_model(presets + [observed(p) for p in mixed[:2]], **kwargs)
    assert not any(early.certainly_over(p, b, 1.05) for p in every for b in budgets)

    model = fit_cost_model(presets + [observed(p) for p in mixed], **kwargs)
    assert model.calibrated_on == len(mixed) and model.overshoot > 0
    screened = [(p, b) for p in every for b in budgets if model.certainly_over(p, b, 1.05)]
    assert screened  # the model does screen
    assert all(true_peak(p) > b for p, b in screened)


def test_cost_model_needs_two_priced_choices_and_a_timed_plan() -> None:
    only_peaks = [Observation(choices=(c,) * 2, peak=1.0, flops=1.0) for c in ("none", "full")]
    kwargs = {"labels": ("none", "full"), "unit_layers": [[0], [1]], "units": ["a", "b"], "layers": 2}
    assert fit_cost_model(only_peaks, **kwargs) is None
    assert fit_cost_model(only_peaks[:1] + [Observation(choices=("none",) * 2, peak=1.0, flops=1.0, seconds=1.0)], **kwargs) is None


def test_planner_study_proposes_predicted_plans_that_fit(tmp_path: Path, storage_url: str) -> None:
    """Presets first, then the planner's own proposals, each stored with its prediction; the
    first proposal is planned for the budget and its compiled peak is near the prediction.

    The uniform remat plans are made slow, as remat is on a real accelerator, and in the order
    of their FLOPs (here dots recomputes more than full: +300 ms a step, full +150 ms), with gaps
    far beyond a loaded host's noise (+40 and +20 ms were not: a suite with several processes
    standing for a slice's hosts beside it put dots at or below full once; +120 and +60 ms
    proposed nothing once more in a fresh clone's CI). No remat, over the budget, never runs: the model prices it
    by its FLOPs at the seconds per FLOP the presets show. Were the presets' times out of their
    FLOPs' order (noise does that on a tiny CPU model: the suite once failed so with both at
    +20 ms on a loaded host), that slope is no signal, no remat is priced at the presets' mean,
    and the predicted front is one measured preset, with nothing new to propose.
    """
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"full×3": 150, "dots×3": 300}))
    workload = {"factory": "tests.factories:delayed", "args": {"delays": str(delays)}}
    probe = remat_search.run(parse_spec(spec_dict(
        storage_url, study="probe", workload=workload, space={"layout": "uniform", "choices": ["none", "full"]},
        trials=2,
    )))
    none, full = (next(t.peak_bytes for t in probe.trials if t.labels[0] == c) for c in ("none", "full"))
    budget = (none + full) // 2
    spec = parse_spec(spec_dict(
        storage_url, workload=workload, budget=budget, trials=5, sampler={"kind": "planner", "seed": 0},
        space={"layout": "per_layer", "choices": ["none", "full", "dots"]},
    ))
    report = remat_search.run(spec)

    study = optuna.load_study(study_name="tiny", storage=storage_url)
    trials = sorted(study.trials, key=lambda t: t.number)
    assert all(PREDICTION_ATTR not in t.user_attrs for t in trials[:3])  # the presets
    proposals = [t for t in trials[3:] if PREDICTION_ATTR in t.user_attrs]
    assert proposals, "the planner proposed nothing"
    first = proposals[0].user_attrs[PREDICTION_ATTR]
    assert first["target"] == budget and first["peak"] <= budget
    measured = next(t for t in report.trials if t.number == proposals[0].number).peak_bytes
    assert abs(first["peak"] - measured) / measured < 0.05  # README: predicted peak within 5%
    plans = [t.plan.digest for t in report.trials]
    assert len(plans) == len(set(plans))  # the planner never proposes a plan twice

    advice = remat_search.plan_for_budget("tiny", budget, storage=storage_url)
    assert advice.thinned_to is None  # 3^3 plans: the front is exact, and `plan` says so
    assert "solve exact" in _rendered(advice)
    assert "solve approximate (front thinned to 16 states)" in _rendered(advice.model_copy(update={"thinned_to": 16}))


def test_two_workers_never_get_one_plan_from_the_planner(tmp_path: Path, storage_url: str) -> None:
    """With two workers each proposal is made while the other's trial runs: the planner counts
    the running plan as tried, so none of its proposals repeats a plan the study held when it was
    made (a repeat would be reused, and show here as an earlier trial of one digest). TPE, once
    the planner has nothing new, may repeat one, later: only the planner's own proposals are judged."""
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"full×3": 20, "dots×3": 20}))
    workload = {"factory": "tests.factories:delayed", "args": {"delays": str(delays)}}
    spec = parse_spec(spec_dict(
        storage_url, workload=workload, budget="1GiB", trials=8, workers=2, sampler={"kind": "planner", "seed": 0},
        space={"layout": "per_layer", "choices": ["none", "full", "dots"]}, confirm={"top": 0},
    ))
    report = remat_search.run(spec)
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    proposed = {t.number for t in study.trials if PREDICTION_ATTR in t.user_attrs}
    assert len(proposed) >= 2, "the planner proposed too little to judge"
    for t in report.trials:
        if t.number in proposed:  # new when proposed: no trial asked for before it has its plan
            before = [u.plan.digest for u in report.trials if u.number < t.number and u.plan is not None]
            assert t.plan.digest not in before, t.summary()


def _rendered(advice: remat_search.Advice) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(output.advice_table(advice))
    return console.file.getvalue()


# A search that screens plans out without compiling them (``prescreen``): its studies are
# tests/report/test_stored.py's ``presets`` and ``screening``, and its test
# (test_a_search_screens_out_far_over_plans_without_compiling) is there, on the fixture's search.


def test_plan_advises_the_best_measured_plan_when_the_model_s_plan_is_slower(  # type: ignore[no-untyped-def]
    tmp_path: Path, storage_url: str, cli,
) -> None:
    """The planner's advice is never worse than the best measured plan that fits: at full
    remat's peak the model advises a mix that saves as much for less recompute; once measured,
    that mix is slower (+90 ms a step) than full remat, so `plan` advises full remat, as `best`
    does, and says why."""
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"full×3": 30}))
    remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:delayed", "args": {"delays": str(delays)}},
        space={"layout": "per_layer", "choices": ["none", "full"]}, trials=2, confirm={"top": 0},
    )))
    full = next(t for t in remat_search.load_report("tiny", storage_url).trials if t.summary() == "full×3")
    budget = str(full.peak_bytes)

    def advised() -> remat_search.RematPlan:
        out = cli("plan", "--study", "tiny", "--budget", budget, "--storage", storage_url, "--json")
        assert out.exit_code == 0, out.stderr
        return remat_search.RematPlan.from_json(out.stdout)

    mix = advised()
    assert mix != full.plan
    assert plan_for_budget("tiny", full.peak_bytes, storage=storage_url).source == "predicted"
    delays.write_text(json.dumps({"full×3": 30, mix.summary(): 90}))
    measured = cli("plan", "--study", "tiny", "--budget", budget, "--storage", storage_url, "--measure")
    assert measured.exit_code == 0, measured.stderr
    measured_mix = next(t for t in remat_search.load_report("tiny", storage_url).trials if t.plan == mix)
    assert measured_mix.step_seconds > full.step_seconds

    assert advised() == full.plan == remat_search.best_plan("tiny", full.peak_bytes, storage_url).plan
    advice = plan_for_budget("tiny", full.peak_bytes, storage=storage_url)
    assert advice.source == "measured" and advice.measured.number == full.number
    assert f"trial {measured_mix.number}" in advice.reason
    shown = cli("plan", "--study", "tiny", "--budget", budget, "--storage", storage_url)
    assert shown.exit_code == 0 and "the best measured plan, not the model's" in shown.stdout


def test_plan_answers_from_the_model_the_search_kept_while_no_trial_completes_after_it(
    tmp_path: Path, storage_url: str,
) -> None:
    """The search keeps its cost model fitted to the study's complete trials; ``plan`` answers
    from it (so a kept model that says otherwise changes the answer) until the study holds
    another complete trial, and then fits again; either way the answer is the one a fit to
    every trial gives."""
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"full×3": 20, "dots×3": 20}))
    remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:delayed", "args": {"delays": str(delays)}},
        space={"layout": "per_layer", "choices": ["none", "full", "dots"]}, trials=4, confirm={"top": 0},
    )))
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    complete = len(study.get_trials(states=(TrialState.COMPLETE,)))
    kept = study.user_attrs[COST_MODEL_ATTR]
    assert kept["complete"] == complete
    budget = int(kept["model"]["base_peak"])
    from_kept = plan_for_budget("tiny", budget, storage=storage_url)
    study.set_user_attr(COST_MODEL_ATTR, None)
    fitted = plan_for_budget("tiny", budget, storage=storage_url)
    assert from_kept == fitted and from_kept.predicted is not None

    slower = {**kept["model"], "base_seconds": kept["model"]["base_seconds"] + 1.0}
    study.set_user_attr(COST_MODEL_ATTR, {"complete": complete, "model": slower})
    used = plan_for_budget("tiny", budget, storage=storage_url)
    assert used.predicted is not None and used.predicted.seconds > fitted.predicted.seconds + 0.99
    study.set_user_attr(COST_MODEL_ATTR, {"complete": complete - 1, "model": slower})  # a trial completed since
    assert plan_for_budget("tiny", budget, storage=storage_url) == fitted


def test_plan_reports_an_invalid_stored_space_apart_from_too_little_measured(  # type: ignore[no-untyped-def]
    storage_url: str, cli,
) -> None:
    storage = open_storage(storage_url, create=True)
    for name, space in (
        ("old", {"layout": "per_layer", "choices": ["none", "full"], "stride": 2}),  # a key unknown here
        ("new", {"layout": "per_layer", "choices": ["none", "full"]}),
    ):
        study = optuna.create_study(study_name=name, storage=storage, directions=["minimize", "minimize"])
        study.set_user_attr("space", space)
        study.set_user_attr(LAYERS_ATTR, 3)
    old = cli("plan", "--study", "old", "--budget", "1MiB", "--storage", storage_url)
    assert old.exit_code == 2
    assert "'old'" in old.stderr and "space.stride" in old.stderr and "run its search first" not in old.stderr
    new = cli("plan", "--study", "new", "--budget", "1MiB", "--storage", storage_url)
    assert new.exit_code == 1 and "too little measured" in new.stderr and "run its search first" in new.stderr


def test_the_package_uses_optuna_s_public_api_only() -> None:
    """No private storage or trial ids, nor optuna's own system key for queued trials: queued
    plans carry our attribute (store.QUEUED_ATTR)."""
    private = re.compile(r"\._storage\b|\._trial_id\b|[\"']fixed_params[\"']")
    package = Path(remat_search.__file__).parent
    used = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(package.rglob("*.py")) for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not used
