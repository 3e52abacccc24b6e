"""Plans that compile to the same program are measured once: the compiled program's digest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import sqlalchemy as sa

import remat_search
from remat_search import LayerPolicy, RematPlan, build_workload
from remat_search.store import cache
from remat_search.measure.executables import Executables, measure
from remat_search.measure.program import program_digest
from remat_search.measure.device import DeviceInfo
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig
from remat_search.spec.workloads import TransformerConfig

from tests.conftest import TINY_TRANSFORMER, spec_dict
from tests.factories import TINY_MLP, over_declared, recording

HLO = """HloModule jit_train_step, is_scheduled=true

FileNames
1 "/home/me/train.py"

%fused_computation.7 (param_0.3: f32[4]) -> f32[4] {
  %param_0.3 = f32[4]{0} parameter(0)
  ROOT %neg.12 = f32[4]{0} negate(%param_0.3), metadata={op_name="jit(step)/neg" stack_frame_id=3}
}

ENTRY %main.20 (Arg_0.1: f32[4]) -> f32[4] {
  %Arg_0.1 = f32[4]{0} parameter(0)
  ROOT %fusion.2 = f32[4]{0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation.7
}
"""


def test_the_program_digest_leaves_out_source_locations_and_numbering() -> None:
    renumbered = (
        HLO.replace("fused_computation.7", "fused_computation.9").replace("neg.12", "neg.40")
        .replace("param_0.3", "param_0.8").replace('"/home/me/train.py"', '"/tmp/other.py"')
        .replace("stack_frame_id=3", "stack_frame_id=5")
    )
    assert program_digest(renumbered) == program_digest(HLO)
    assert program_digest(HLO.replace("negate(", "abs(")) != program_digest(HLO)
    assert program_digest(HLO.replace("f32[4]{0} negate", "f16[4]{0} negate")) != program_digest(HLO)


def test_a_program_that_calls_back_into_python_has_no_digest(tmp_path: Path) -> None:
    executables = Executables(recording(str(tmp_path / "runs.log")))  # a callback names each plan it runs
    assert executables.build(RematPlan.uniform("dots", 3)).program is None


def test_plans_that_compile_alike_share_the_program_digest() -> None:
    workload = build_workload(TransformerConfig(**TINY_TRANSFORMER))
    emitted = ("context", "key_proj", "mlpwi", "mlpwo", "out_proj", "query_proj", "value_proj")

    def program(policy: Any, executables: Executables) -> str | None:
        return executables.build(RematPlan.uniform(policy, workload.layers)).program

    first, second = Executables(workload), Executables(workload)  # two compiles of one plan
    full = program("full", first)
    assert full is not None and program("full", second) == full
    assert program(LayerPolicy(kind="names_except", names=emitted), first) == full  # saves nothing named


def test_a_plan_compiled_to_a_measured_program_is_not_run_again() -> None:
    executables = Executables(build_workload(TINY_MLP))
    timing = TimingConfig(warmup=1, repeats=2, timeout="60s", anchor=False)
    dots = measure(executables, RematPlan.uniform("dots", 3), budget=2**30, timing=timing, gradient_tolerance=1e-3)
    assert dots.ran_at is not None and dots.same_program_as is None
    asked: list[str] = []

    def known(program: str) -> Any:
        asked.append(program)
        return dots.raw if program == dots.program_digest else None

    plan = RematPlan.uniform("dots_no_batch", 3)  # the MLP's dots have no batch dimensions
    shared = measure(executables, plan, budget=2**30, timing=timing, gradient_tolerance=1e-3, known=known)
    assert asked == [dots.program_digest]
    assert shared.status == "measured" and shared.plan_digest == plan.digest
    assert shared.same_program_as == dots.plan_digest and shared.ran_at is None
    assert shared.step_times == dots.step_times and shared.memory == dots.memory
    other = measure(executables, RematPlan.uniform("full", 3), budget=2**30, timing=timing, gradient_tolerance=1e-3,
                    known=known)
    assert other.same_program_as is None and other.ran_at is not None and other.program_digest != dots.program_digest


def test_a_search_measures_choices_that_compile_alike_once(storage_url: str, cli) -> None:  # type: ignore[no-untyped-def]
    ghost = {"label": "ghost", "names": ["never_tagged"]}  # declared, never tagged: saves nothing, as full
    spec = parse_spec(spec_dict(
        storage_url, study="alike", workload={"factory": "tests.factories:over_declared"}, trials=4, workers=1,
        space={"layout": "uniform", "choices": ["full", ghost, "dots", "dots_no_batch"]}, confirm={"top": 0},
    ))
    report = remat_search.run(spec)
    trials = sorted(report.trials, key=lambda t: t.number)  # the presets, in the spec's order
    assert [t.labels[0] for t in trials] == ["full", "ghost", "dots", "dots_no_batch"]
    full, ghost_trial, dots, no_batch = trials
    for ran in (full, dots):
        assert ran.same_program_as is None and ran.measurement.ran_at is not None
    assert full.measurement.program_digest != dots.measurement.program_digest
    for shared, ran in ((ghost_trial, full), (no_batch, dots)):
        m = shared.measurement
        assert shared.same_program_as == f"alike#{ran.number}" and shared.status == "measured"
        assert m.same_program_as == ran.plan.digest and m.ran_at is None  # compiled, never run
        assert m.program_digest == ran.measurement.program_digest and m.peak_bytes == ran.peak_bytes
        assert m.step_times == ran.measurement.step_times
    # The worker's digest is this process's: two compiles of a plan in two processes give one.
    assert Executables(over_declared()).build(dots.plan).program == dots.measurement.program_digest
    table = cli("show", "--study", "alike", "--storage", storage_url).stdout
    assert f"(same program: alike#{dots.number})" in table
    shown = cli("show", "--study", "alike", "--trial", str(no_batch.number), "--storage", storage_url).stdout
    assert f"compiled to the same program as alike#{dots.number}'s plan" in shown
    assert f"(run as plan {dots.plan.digest})" in shown
    # The cache keeps the program's measurement too: another study's plan compiled alike finds it.
    device = DeviceInfo.model_validate(optuna.load_study(study_name="alike", storage=storage_url).user_attrs["device_info"])
    hit = cache.lookup_program(sa.create_engine(storage_url), device, dots.measurement.program_digest)
    assert hit is not None and (hit.study, hit.trial) == ("alike", dots.number)
