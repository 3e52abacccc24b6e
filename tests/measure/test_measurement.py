"""The runner's measurements on a tiny real transformer: compiled memory, the check of the
measured program's first step, timing."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

import remat_search
from remat_search import LayerPolicy, RematPlan, build_workload
from remat_search.measure.executables import Executables, measure, retime
from remat_search.measure.measurement import Measurement, MemoryBreakdown, RawMeasurement, judge
from remat_search.report.text import describe_trial
from remat_search.report.results import TrialResult
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig
from remat_search.spec.workloads import TransformerConfig

from tests.conftest import TINY_TRANSFORMER, spec_dict
from tests.factories import miscomputing, recording

QKV = LayerPolicy(kind="names", names=("query_proj", "key_proj", "value_proj"))
ATTN = LayerPolicy(kind="names", names=("context", "out_proj"))
OUT = LayerPolicy(kind="names", names=("out_proj",))
"""Below full remat's peak on the tiny transformer, on jaxlib 0.10 and 0.12 alike (saving both
attention names is below it on 0.10, level with it on 0.12)."""
POLICIES = {
    "none": "none", "full": "full", "dots": "dots", "dots_no_batch": "dots_no_batch", "save_qkv": QKV, "save_attn": ATTN,
}


@pytest.fixture(scope="module")
def executables() -> Executables:
    return Executables(build_workload(TransformerConfig(**TINY_TRANSFORMER)))


@pytest.fixture(scope="module")
def measured(executables: Executables) -> dict[str, Measurement]:
    layers = executables.workload.layers
    return {
        label: measure(
            executables, RematPlan.uniform(policy, layers), budget=2**40,
            timing=TimingConfig(warmup=1, repeats=3),
        )
        for label, policy in POLICIES.items()
    }


def test_compiled_peak_orders_the_policies(measured: dict[str, Measurement]) -> None:
    peak = {label: m.peak_bytes for label, m in measured.items()}
    assert peak["full"] < peak["dots"] < peak["none"]
    assert peak["full"] < peak["save_qkv"] < peak["none"]


def test_peak_is_the_breakdown_sum(measured: dict[str, Measurement]) -> None:
    for m in measured.values():
        mem = m.memory
        assert mem is not None and mem.peak == mem.argument + mem.output - mem.alias + mem.temp
        assert mem.generated_code == 0 and mem.compiler_peak is None  # CPU: not trusted
        assert mem.alias > 0  # the step donates its state


def test_the_first_step_of_every_preset_matches_full_remats(measured: dict[str, Measurement]) -> None:
    """One f32 device: every preset's gradients are full remat's to the bit, within a threshold
    made of the rounding measured on full remat (float32 matmuls) and a rerun that differs by 0."""
    for label, m in measured.items():
        assert m.status == "measured", (label, m.error)
        assert m.grad_reference == "full" and m.grad_skipped is None, label
        c = m.grad_check
        assert c is not None and c.failure() is None and c.reproducible, label
        assert m.grad_rel_error == c.max_error == 0.0 and c.rerun == 0.0, label
        assert c.precision == "float32 matmuls" and 0 < c.rounding < 1e-5 and c.tree_threshold == 4 * c.rounding, label
        assert "the optimizer's first moment ('mu')" in c.compared, label


def test_show_says_what_the_check_compared_its_figures_and_what_the_threshold_was_made_of(
    measured: dict[str, Measurement],
) -> None:
    shown = describe_trial(TrialResult(number=0, status="measured", measurement=measured["dots"]))
    c = measured["dots"].grad_check
    assert "first step vs full remat's: the gradients, read from the optimizer's first moment ('mu')" in shown
    assert f"all arrays 0.00e+00 of {c.tree_threshold:.2e}" in shown and f"threshold: 4 × (rounding {c.rounding:.2e}" in shown
    assert "a rounding of float32 matmuls, unit roundoff 6e-08; + rerun 0.00e+00: full remat run twice)" in shown


def test_a_plan_whose_program_computes_something_else_fails_its_check() -> None:
    executables = Executables(miscomputing())
    timing = TimingConfig(warmup=1, repeats=2)
    dots = measure(executables, RematPlan.uniform("dots", 3), budget=2**40, timing=timing)
    assert dots.status == "failed" and "from full remat's by 1 (norm-relative) > threshold" in dots.error, dots.error
    assert dots.grad_rel_error == pytest.approx(1.0, rel=1e-5)  # its loss doubled: its gradients, Adam's first moment, ×2
    assert dots.step_times == ()  # failed before it was timed
    none = measure(executables, RematPlan.uniform("none", 3), budget=2**40, timing=timing)
    assert none.status == "measured" and none.grad_rel_error == 0.0


def test_recompute_shows_in_flops_and_steps_are_timed(measured: dict[str, Measurement]) -> None:
    assert measured["full"].flops > measured["none"].flops  # full remat recomputes the forward
    for m in measured.values():
        assert len(m.step_times) == 3 and all(s > 0 for s in m.step_times)
        assert m.time_source == "measured" and m.step_seconds == m.median_seconds
        assert m.min_seconds <= m.median_seconds and m.spread >= 0


def test_over_budget_plan_is_compiled_but_not_run(tmp_path: Path) -> None:
    log = tmp_path / "executions.log"
    workload = recording(str(log))
    m = measure(
        Executables(workload), RematPlan.uniform("none", workload.layers), budget=1, timing=TimingConfig(),
        gradient_tolerance=1e-4,
    )
    assert m.status == "over_budget" and m.peak_bytes > 1
    assert m.step_times == () and m.step_seconds is None and m.grad_rel_error is None
    assert not log.exists()  # nothing ran: neither the plan nor a reference


def test_where_full_remat_does_not_fit_a_plan_that_fits_runs_unchecked(
    executables: Executables, measured: dict[str, Measurement]
) -> None:
    out, full = executables.build(RematPlan.uniform(OUT, executables.workload.layers)).memory.peak, measured["full"].peak_bytes
    assert out < full  # on this model, saving the attention's output takes less than recomputing everything
    m = measure(
        executables, RematPlan.uniform(OUT, executables.workload.layers), budget=out,
        timing=TimingConfig(warmup=1, repeats=2), gradient_tolerance=1e-4,
    )
    assert m.status == "measured" and len(m.step_times) == 2
    assert m.grad_rel_error is None and m.grad_reference is None
    assert "full remat" in m.grad_skipped and "nothing over the budget is run" in m.grad_skipped
    assert m.anchor_times == ()  # nor is the anchor, which is full remat


def test_an_anchored_step_is_timed_alternately_with_the_anchor(
    executables: Executables, measured: dict[str, Measurement]
) -> None:
    m = measure(
        executables, RematPlan.uniform("dots", executables.workload.layers), budget=2**40,
        timing=TimingConfig(warmup=1, repeats=4), gradient_tolerance=1e-4,
    )
    assert m.status == "measured" and len(m.anchor_times) == len(m.step_times) == 4
    ratios = [t / a for t, a in zip(m.step_times, m.anchor_times, strict=True)]
    assert m.step_seconds == m.median_seconds  # no reference time yet: the plan's own median
    at = m.model_copy(update={"anchor_seconds": 0.5})
    assert at.step_seconds == pytest.approx(statistics.median(ratios) * 0.5)
    assert at.spread == pytest.approx((max(ratios) - min(ratios)) / statistics.median(ratios))
    # The anchor is full remat: over a budget below its peak it would not run, so there is none.
    assert executables.anchor(measured["full"].peak_bytes - 1) is None
    assert executables.anchor(measured["full"].peak_bytes) is not None


def test_retime_runs_the_kept_executables_in_a_shuffled_order_each_round(tmp_path: Path) -> None:
    log = tmp_path / "executions.log"
    executables = Executables(recording(str(log)))
    plans = [RematPlan.uniform(p, 3) for p in ("none", "full", "dots")]
    peaks = [executables.build(p).memory.peak for p in plans]
    with pytest.raises(ValueError, match="does not fit"):
        retime(executables, plans, warmup=0, rounds=2, budget=max(peaks) - 1)
    assert not log.exists()  # refused before anything ran

    times = retime(executables, plans, warmup=1, rounds=8, budget=max(peaks))
    assert [len(t) for t in times] == [8, 8, 8]
    executed = log.read_text().split()
    rounds = [executed[i:i + 3] for i in range(0, len(executed), 3)]
    assert len(rounds) == 9 and all(sorted(r) == sorted(p.digest for p in plans) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # not always the same order


def test_show_says_when_a_plan_ran_unchecked(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    workload = build_workload(TransformerConfig(**TINY_TRANSFORMER))
    executables = Executables(workload)
    out = executables.build(RematPlan.uniform(OUT, workload.layers)).memory.peak
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    remat_search.run(parse_spec(spec_dict(
        storage, space={"layout": "uniform", "choices": ["full", {"label": "save_out", "names": ["out_proj"]}]},
        budget=out, trials=2, confirm={"top": 0},
    )))
    shown = cli("show", "--study", "tiny", "--trial", "1", "--storage", storage)
    assert shown.exit_code == 0, shown.stderr
    assert "save_out" in shown.stdout and "measured" in shown.stdout
    assert "gradients not checked: the reference, full remat, needs" in " ".join(shown.stdout.split())
    full = cli("show", "--study", "tiny", "--trial", "0", "--storage", storage).stdout
    table = " ".join(cli("show", "--study", "tiny", "--storage", storage).stdout.split())
    assert "spread ±x%: half the (max − min) / median range of the repeats behind the step (the trial's timed repeats" in table
    assert "over_budget" in full and "gradients" not in full


def test_show_states_an_out_of_memory_peak_in_full() -> None:
    m = Measurement(
        status="over_budget", plan_digest="p", oom_required_bytes=21 * 2**30, oom_temp_bytes=20 * 2**30,
        oom_available_bytes=15 * 2**30,
    )
    assert m.peak_bytes == 21 * 2**30
    shown = describe_trial(TrialResult(number=3, status="over_budget", measurement=m))
    assert "needs 21.0 GiB per chip (temporaries 20.0 GiB" in shown and "+ arguments and outputs" in shown
    assert "15.0 GiB available" in shown


# A measured trial's `measurement` attribute as a study of measurement schema 2 stored it (verdict and raw mixed).
SCHEMA_2 = (
    '{"status":"measured","plan_digest":"f8e97cea0872b4b4","memory":{"argument":1245188,"output":1179816,'
    '"alias":1179652,"temp":917504,"generated_code":0,"host_argument":0,"host_output":0,"host_alias":0,'
    '"host_temp":0,"compiler_peak":null,"breakdown_sum":2162856,"peak":2162856,"peak_source":"breakdown_sum"},'
    '"oom_required_bytes":null,"oom_temp_bytes":null,"oom_available_bytes":null,"screened_bytes":null,'
    '"flops":76398600.0,"bytes_accessed":13435128.0,"compile_seconds":0.807,"time_source":"measured",'
    '"step_times":[0.003,0.002],"anchor_times":[0.004,0.004],"anchor_seconds":0.008,"estimated_seconds":null,'
    '"grad_max_abs_error":4.16,"grad_rel_error":3.0,"grad_reference":"full","grad_skipped":null,"error":null}'
)


def test_a_measurement_stored_before_the_raw_part_was_kept_apart_reads_as_it_did() -> None:
    m = Measurement.model_validate_json(SCHEMA_2)
    assert m.status == "measured" and m.peak_bytes == 2162856 and m.loss is None
    assert m.step_seconds == pytest.approx(statistics.median([0.75, 0.5]) * 0.008)
    assert judge(m.raw, budget=2162856) == m.model_copy(update={"anchor_seconds": None})
    assert "(max |Δ − Δref| / max |Δref|)" in describe_trial(TrialResult(number=0, status="measured", measurement=m))


def test_a_loss_that_is_not_finite_fails_the_plan_and_is_kept() -> None:
    memory = MemoryBreakdown(argument=1, output=0, alias=0, temp=0, generated_code=0)
    raw = RawMeasurement(plan_digest="p", memory=memory, time_source="measured", step_times=(0.1,), loss=float("nan"))
    m = judge(raw, budget=1)
    assert m.status == "failed" and m.error == "loss is nan after the timed steps" and m.step_seconds is None
    assert Measurement.model_validate_json(m.model_dump_json()).raw.model_dump_json() == raw.model_dump_json()
