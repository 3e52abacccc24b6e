"""`best --format maxtext` answers with what MaxText can take: the best plan that fits and that
MaxText expresses, saying so where the study's best is a per-layer mix it cannot; `space:
maxtext` searches only such plans, so every answer pastes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import remat_search
from remat_search.errors import NoFeasiblePlan
from remat_search.measure.measurement import Measurement, MemoryBreakdown
from remat_search.plans.configuration import Configuration
from remat_search.plans.export import MAXTEXT_ICI, MAXTEXT_NAMES, MAXTEXT_PRESETS, PINNED, maxtext
from remat_search.plans.plan import RematPlan
from remat_search.plans.policy import LayerPolicy
from remat_search.report.maxtext import MaxTextAnswer, maxtext_answer
from remat_search.report.results import TrialResult
from remat_search.report.stored import open_study
from remat_search.spec.loading import parse_spec
from remat_search.spec.space import SpaceConfig
from tests.conftest import spec_dict, write_spec


@pytest.fixture
def mixed(tmp_path: Path, storage_url: str) -> str:
    """A study of the 3-layer MLP, none, full or save_wi (mlpwi kept) a layer, whose uniform
    plans run 150 ms (none), 100 ms (full) and 50 ms (save_wi) slower than every mix: its best is
    a mix, and of the plans MaxText can express (full and save_wi on every layer) save_wi is the
    faster."""
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"none×3": 150, "full×3": 100, "names(mlpwi)×3": 50}))
    remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:delayed", "args": {"delays": str(delays)}},
        space={"layout": "per_layer", "choices": ["none", "full", {"label": "save_wi", "names": ["mlpwi"]}]},
        trials=6, confirm={"top": 0},
    )))
    return storage_url


def test_where_the_best_is_a_mix_maxtext_gets_the_fastest_plan_it_can_express(mixed: str, cli: Any) -> None:
    report = remat_search.load_report("tiny", mixed)
    best = report.best(2**30)
    assert best.plan is not None and not best.plan.is_uniform, "the study's best should be a mix"
    save_wi = next(t for t in report.timed() if t.summary() == "save_wi×3")
    with open_study("tiny", mixed) as stored:
        answer = maxtext_answer(stored, 2**30)
    assert (answer.best.number, answer.answer.number, answer.is_best) == (best.number, save_wi.number, False)
    assert answer.slower_percent == pytest.approx((save_wi.seconds / best.seconds - 1) * 100)
    assert answer.slower_percent > 0 and answer.lower_throughput_percent is None

    shown = cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", mixed, "--format", "maxtext")
    assert shown.exit_code == 0, shown.stderr
    assert yaml.safe_load(shown.stdout) == maxtext(save_wi.plan)
    assert yaml.safe_load(shown.stdout)["mlpwi"] == "device"
    notice = next(line for line in shown.stderr.splitlines() if "study's best" in line)
    assert notice == (
        f"note: the study's best is {best.summary()} (trial {best.number}), a per-layer mix, which MaxText cannot "
        "express (one remat_policy for every decoder layer); this is the fastest candidate MaxText can express, "
        f"save_wi×3 (trial {save_wi.number}): {answer.slower_percent:.1f}% slower "
        f"({save_wi.seconds:.4g} s vs {best.seconds:.4g} s a step)"
    )
    as_json = cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", mixed, "--json")
    assert RematPlan.from_json(as_json.stdout) == best.plan and "study's best" not in as_json.stderr


def _configured(number: int, plan: RematPlan, seconds: float, **configuration: Any) -> TrialResult:
    plan = plan.model_copy(update={"configuration": Configuration.model_validate(configuration)})
    measurement = Measurement(
        status="measured", plan_digest=plan.digest, time_source="measured", step_times=(seconds,),
        memory=MemoryBreakdown(argument=0, output=0, alias=0, temp=2**20, generated_code=0),
    )
    return TrialResult(number=number, status="measured", plan=plan, measurement=measurement)


def test_in_a_study_of_configurations_the_cost_is_said_in_throughput() -> None:
    """Best: a mix at batch 4, 0.1 s a step (1280 tokens/s per device); MaxText's: full remat at
    batch 2 × 2, 0.25 s (512): 60% lower throughput."""
    mix = RematPlan(layers=(LayerPolicy(kind="full"), LayerPolicy(kind="none")))
    best = _configured(3, mix, 0.1, batch=4, sequence=32)
    answer = _configured(1, RematPlan.uniform("full", 2), 0.25, batch=2, accumulation=2, sequence=32)
    found = MaxTextAnswer(answer=answer, best=best, settings=maxtext(answer.plan))
    assert found.lower_throughput_percent == pytest.approx(60)
    assert found.notice() == (
        "note: the study's best is batch 4 · 1 device: full none (trial 3), a per-layer mix, which MaxText cannot "
        "express (one remat_policy for every decoder layer); this is the fastest candidate MaxText can express, "
        "batch 2×2 · 1 device: full×2 (trial 1): 60.0% lower throughput (512 vs 1280 tokens/s per device)"
    )
    assert MaxTextAnswer(answer=best, best=best, settings={}).notice() is None


def test_where_no_plan_that_fits_has_a_maxtext_form_it_is_one_line_and_exit_1(storage_url: str, cli: Any) -> None:
    remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"kind": "mlp", "layers": 3, "width": 16, "hidden": 32, "batch": 4},
        space={"layout": "uniform", "choices": ["none", "dots"]}, trials=2, confirm={"top": 0},
    )))
    with open_study("tiny", storage_url) as stored, pytest.raises(NoFeasiblePlan):
        maxtext_answer(stored, 2**30)
    shown = cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", storage_url, "--format", "maxtext")
    assert shown.exit_code == 1 and shown.stdout == ""
    assert shown.stderr.count("\n") == 1
    assert re.match(
        r"error: --format maxtext: no timed plan of study 'tiny' that fits 1\.0 GiB has a MaxText form; its best "
        r"there, (none|dots)×3 \(trial \d\), whose policy (none|dots) has no MaxText form; use json or yaml$",
        shown.stderr.strip(),
    ), shown.stderr


def test_space_maxtext_is_a_uniform_space_of_maxtext_s_presets() -> None:
    space = SpaceConfig.model_validate("maxtext")
    assert space.layout == "uniform" and not space.nested
    assert [c.label for c in space.choices] == list(MAXTEXT_PRESETS) == [
        "full", "save_qkv_proj", "save_dot_except_mlp", "save_dot_except_mlpwi",
        "save_dot_with_context_except_mlp", "save_out_proj",
    ]
    assert space.policy("save_dot_except_mlpwi").names == ("key_proj", "mlpwo", "out_proj", "query_proj", "value_proj")
    for choice in space.choices:  # each is MaxText's: full, or custom with its names on the device
        settings = maxtext(RematPlan.uniform(choice.policy, 2))
        kept = {n for n, s in settings.items() if s == "device"} - {PINNED}
        if choice.label == "full":
            assert settings == {"remat_policy": "full"}
        else:
            assert kept == set(choice.policy.names)


def test_a_search_of_space_maxtext_answers_with_a_config_that_pastes(storage_url: str, cli: Any) -> None:
    """On the tiny transformer, which tags every name the presets keep, with a configuration:
    the answer is MaxText's remat settings, per-device batch and accumulation."""
    spec = parse_spec(spec_dict(
        storage_url, space="maxtext", configuration={"batch": [2, 4], "global_batch": 8}, trials=3, confirm={"top": 0},
    ))
    report = remat_search.run(spec)
    kept = set().union(*(names for names in MAXTEXT_PRESETS.values() if names))
    assert kept <= set(report.device["traced_names"])  # the step tags every name the presets keep
    best = report.best(report.budget)
    shown = cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", storage_url, "--format", "maxtext")
    assert shown.exit_code == 0, shown.stderr
    pasted = yaml.safe_load(shown.stdout)
    assert "study's best" not in shown.stderr
    remat = {"remat_policy"} | (set(MAXTEXT_NAMES) if pasted["remat_policy"] == "custom" else set())
    # every mesh setting too (the study's own mesh, no axis: each at 1), so that the paste replaces them
    assert set(pasted) == remat | {"per_device_batch_size", "gradient_accumulation_steps", *MAXTEXT_ICI.values()}
    configuration = best.plan.configuration
    assert (pasted["per_device_batch_size"], pasted["gradient_accumulation_steps"]) == (
        configuration.batch, configuration.accumulation,
    ) and pasted["per_device_batch_size"] * pasted["gradient_accumulation_steps"] == 8
    label = best.labels[0]
    if label != "full":
        assert {n for n, s in pasted.items() if s == "device"} == set(MAXTEXT_PRESETS[label]) | {PINNED}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"space": "maxtxt"}, "spec.space: expected a mapping (layout, choices, ...) or maxtext, got 'maxtxt'"),
    ({"space": "maxtext", "workload": {"kind": "mlp", "layers": 2, "width": 16, "hidden": 32, "batch": 4}},
     "spec.space.choices.1: unknown tensor name(s) ['key_proj', 'query_proj', 'value_proj'] in 'save_qkv_proj'"),
])
def test_bad_maxtext_spaces_are_one_line_errors_and_nothing_is_written(
    tmp_path: Path, storage_url: str, cli: Any, overrides: dict[str, Any], message: str,
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(storage_url, **overrides))
    result = cli("run", str(spec))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*"))
