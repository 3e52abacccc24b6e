"""The runner's measurements on a tiny real transformer: compiled memory, gradients, timing."""

from __future__ import annotations

import functools
import statistics

import pytest

from remat_search import LayerPolicy, RematPlan, build_workload
from remat_search.measurement import Measurement, compile_anchor, measure, reference_gradients
from remat_search.spec import TimingConfig, TransformerConfig

from .conftest import TINY_TRANSFORMER

QKV = LayerPolicy(kind="names", names=("query_proj", "key_proj", "value_proj"))
POLICIES = {"none": "none", "full": "full", "dots": "dots", "dots_no_batch": "dots_no_batch", "save_qkv": QKV}


@pytest.fixture(scope="module")
def measured() -> dict[str, Measurement]:
    workload = build_workload(TransformerConfig(**TINY_TRANSFORMER))
    reference = functools.cache(lambda: reference_gradients(workload))
    return {
        label: measure(
            workload, RematPlan.uniform(policy, workload.layers), budget=2**40,
            timing=TimingConfig(warmup=1, repeats=3), gradient_tolerance=1e-4, reference_grads=reference,
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


def test_gradients_of_every_plan_match_no_remat(measured: dict[str, Measurement]) -> None:
    for label, m in measured.items():
        assert m.status == "measured", (label, m.error)
        assert m.grad_rel_error is not None and m.grad_rel_error <= 1e-4, label
        assert m.grad_reference == "none"


def test_recompute_shows_in_flops_and_steps_are_timed(measured: dict[str, Measurement]) -> None:
    assert measured["full"].flops > measured["none"].flops  # full remat recomputes the forward
    for m in measured.values():
        assert len(m.step_times) == 3 and all(s > 0 for s in m.step_times)
        assert m.time_source == "measured" and m.step_seconds == m.median_seconds
        assert m.min_seconds <= m.median_seconds and m.spread >= 0


def test_over_budget_plan_is_compiled_but_not_run() -> None:
    workload = build_workload(TransformerConfig(**TINY_TRANSFORMER))

    def no_reference() -> None:
        raise AssertionError("an over-budget plan must not be run or checked")

    m = measure(
        workload, RematPlan.uniform("none", workload.layers), budget=1, timing=TimingConfig(),
        gradient_tolerance=1e-4, reference_grads=no_reference,
    )
    assert m.status == "over_budget" and m.peak_bytes > 1
    assert m.step_times == () and m.step_seconds is None and m.grad_rel_error is None


def test_an_anchored_step_is_timed_alternately_with_the_anchor(measured: dict[str, Measurement]) -> None:
    workload = build_workload(TransformerConfig(**TINY_TRANSFORMER))
    anchor = functools.cache(lambda: compile_anchor(workload, budget=2**40))
    m = measure(
        workload, RematPlan.uniform("dots", workload.layers), budget=2**40, timing=TimingConfig(warmup=1, repeats=4),
        gradient_tolerance=1e-4, reference_grads=functools.cache(lambda: reference_gradients(workload)), anchor=anchor,
    )
    assert m.status == "measured" and len(m.anchor_times) == len(m.step_times) == 4
    ratios = [t / a for t, a in zip(m.step_times, m.anchor_times, strict=True)]
    assert m.step_seconds == m.median_seconds  # no reference time yet: the plan's own median
    at = m.model_copy(update={"anchor_seconds": 0.5})
    assert at.step_seconds == pytest.approx(statistics.median(ratios) * 0.5)
    assert at.spread == pytest.approx((max(ratios) - min(ratios)) / statistics.median(ratios))
    # The anchor is full remat: over a budget below its peak it would not run, so there is none.
    assert compile_anchor(workload, budget=measured["full"].peak_bytes - 1) is None
