"""Scanned layers (one ``lax.scan`` per segment), the nested layout, and the spaces that
propose them; real compiles on tiny models."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optuna
import pytest

from remat_search import LayerPolicy, RematPlan, SpecError
from remat_search.measure.check import FirstStep, errors
from remat_search.targets.platform import CPU_COMPILER_OPTIONS
from remat_search.measure.measurement import MemoryBreakdown
from remat_search.workloads.mlp import MlpWorkload
from remat_search.plans.plan import apply_layers, scan_layers, segments
from remat_search.search.space import Space
from remat_search.spec.loading import parse_spec
from remat_search.spec.space import SpaceConfig
from remat_search.spec.workloads import MlpConfig, TransformerConfig
from remat_search.workloads.transformer import TransformerWorkload
from remat_search.workloads.base import Workload
from tests.conftest import spec_dict

TINY: dict[str, Any] = {
    "kind": "transformer", "layers": 4, "d_model": 32, "heads": 2, "d_ff": 128,
    "seq_len": 16, "batch": 2, "vocab": 64,
}
FULL, NONE, DOTS = LayerPolicy(kind="full"), LayerPolicy(kind="none"), LayerPolicy(kind="dots")


def _peak(workload: Workload, plan: RematPlan) -> int:
    compiled = workload.step(plan).lower(*workload.abstract_inputs()).compile(
        compiler_options=CPU_COMPILER_OPTIONS
    )
    return MemoryBreakdown.of(compiled, platform="cpu").peak


def _stack_layers(tree: dict[str, Any], layers: int) -> dict[str, Any]:
    """An unrolled transformer's tree in the scanned form (``layer_i`` → stacked ``layers``)."""
    rest = {k: v for k, v in tree.items() if not k.startswith("layer_")}
    return {**rest, "layers": jax.tree.map(lambda *a: jnp.stack(a), *(tree[f"layer_{i}"] for i in range(layers)))}


@pytest.fixture(scope="module")
def scanned() -> TransformerWorkload:
    return TransformerWorkload(TransformerConfig(**TINY, scan=True))


def test_segments_of_a_scanned_model_order_compiled_memory(scanned: TransformerWorkload) -> None:
    space = SpaceConfig(layout="segments", segments=2, choices=["none", "full"])
    mixed = Space.of(space, 4).plan({"segment_00": "full", "segment_01": "none"})
    assert mixed.layers == (FULL, FULL, NONE, NONE)
    assert segments(mixed) == [(0, 2, FULL), (2, 4, NONE)]
    full, none = RematPlan.uniform("full", 4), RematPlan.uniform("none", 4)
    assert _peak(scanned, full) < _peak(scanned, mixed) < _peak(scanned, none)


def gradient_error(tree: Any, reference: Any) -> float:
    """The largest norm-relative difference of any array of ``tree`` from ``reference``'s (the
    figure the first-step check holds, ``measure.check.errors``)."""
    def step(t: Any) -> FirstStep:
        return FirstStep(tuple(np.asarray(x, np.float64) for x in jax.tree.leaves(t)), 0.0)

    return max(errors(step(tree), step(reference)).leaves)


def _grad(workload: Workload, plan: RematPlan) -> Any:
    """The jitted gradient of ``workload``'s loss under ``plan``."""
    return jax.jit(jax.grad(workload.loss(plan)))


def test_scanned_and_unrolled_transformers_compute_the_same_gradients(scanned: TransformerWorkload) -> None:
    unrolled = TransformerWorkload(TransformerConfig(**TINY))
    (params, _), batch = unrolled.inputs()
    (stacked, _), scanned_batch = scanned.inputs()
    assert set(stacked) == {"embed", "layers", "final_norm", "logits"}
    assert jax.tree.leaves(stacked["layers"])[0].shape[0] == 4
    assert gradient_error(_stack_layers(params, 4), stacked) == 0.0  # same seed, same numbers
    assert gradient_error(scanned_batch, batch) == 0.0

    none = RematPlan.uniform("none", 4)
    reference = jax.device_get(_grad(scanned, none)(stacked, batch))
    assert gradient_error(_stack_layers(_grad(unrolled, none)(params, batch), 4), reference) < 1e-5

    mixed = RematPlan(layers=(FULL, FULL, NONE, DOTS))
    jaxpr = jax.make_jaxpr(scanned.loss(mixed))(stacked, batch).jaxpr
    assert sum(e.primitive.name == "scan" for e in jaxpr.eqns) == 3  # one scan per segment
    assert gradient_error(_grad(scanned, mixed)(stacked, batch), reference) < 1e-5


def test_scanned_layers_refuse_nested_plans_and_mismatched_stacks() -> None:
    def body(p: jax.Array, x: jax.Array) -> jax.Array:
        return x * p

    nested = RematPlan(layers=(NONE, NONE), layout="nested")
    with pytest.raises(SpecError, match="layout 'nested' is not supported for scanned layers"):
        scan_layers(nested, body, jnp.ones(2), jnp.ones(()))
    with pytest.raises(SpecError, match="has 3 layers"):
        scan_layers(RematPlan.uniform("full", 3), body, jnp.ones(2), jnp.ones(()))
    assert float(scan_layers(RematPlan(layers=(FULL, NONE)), body, jnp.array([2.0, 3.0]), jnp.ones(()))) == 6.0
    spec = spec_dict("sqlite:///unused.db", workload={**TINY, "scan": True})
    spec["space"] = {**spec["space"], "nested": True}
    with pytest.raises(SpecError, match=r"space\.nested: the nested layout cannot be scanned"):
        parse_spec(spec)


def test_nested_layout_applies_layers_in_order() -> None:
    fns = [lambda x, k=k: x * 2.0 + k for k in range(5)]  # no two commute
    x = jnp.array(1.0)
    flat = float(apply_layers(RematPlan.uniform("none", 5), fns, x))
    nested = RematPlan(layers=(NONE, FULL, NONE, DOTS, NONE), layout="nested")
    assert float(apply_layers(nested, fns, x)) == flat == 58.0  # 1 → 2 → 5 → 12 → 27 → 58
    grads = jax.grad(lambda v: apply_layers(nested, fns, v))(x)
    assert float(grads) == 32.0


def test_nested_layout_matches_flat_gradients_in_less_memory() -> None:
    workload = MlpWorkload(MlpConfig(kind="mlp", layers=16, width=32, hidden=128, batch=256))
    flat = RematPlan.uniform("none", 16)
    nested = RematPlan(layers=flat.layers, layout="nested")
    (params, _), batch = workload.inputs()
    reference = jax.device_get(_grad(workload, flat)(params, batch))
    assert gradient_error(_grad(workload, nested)(params, batch), reference) < 1e-5
    assert _peak(workload, nested) < _peak(workload, flat)


def test_segments_space_expands_groups_to_layers() -> None:
    space = Space.of(SpaceConfig(layout="segments", segments=3, choices=["none", "full"]), 7)
    assert space.units == ("segment_00", "segment_01", "segment_02")
    assert space.unit_layers == ((0, 1, 2), (3, 4), (5, 6))  # earlier groups take the remainder
    plan = space.plan({"segment_00": "none", "segment_01": "full", "segment_02": "none"})
    assert plan.layers == (NONE,) * 3 + (FULL,) * 2 + (NONE,) * 2 and plan.layout == "flat"

    sized = Space.of(SpaceConfig(layout="segments", segments=[1, 4, 2], choices=["none", "full"]), 7)
    sized.check_names(())
    assert sized.unit_layers == ((0,), (1, 2, 3, 4), (5, 6))
    assert sized.presets()[1] == {"segment_00": "full", "segment_01": "full", "segment_02": "full"}

    assert Space.of(SpaceConfig(layout="uniform", choices=["none"]), 3).unit_layers == ((0, 1, 2),)
    assert Space.of(SpaceConfig(layout="per_layer", choices=["none"]), 3).unit_layers == ((0,), (1,), (2,))


@pytest.mark.parametrize(
    ("segments", "message"),
    [([2, 2], r"sizes \[2, 2\] sum to 4, the workload has 7 layers"), (8, "8 groups for a workload of 7 layers")],
)
def test_segments_that_do_not_fit_the_workload_are_spec_errors(segments: Any, message: str) -> None:
    space = SpaceConfig(layout="segments", segments=segments, choices=["none"])
    with pytest.raises(SpecError, match=rf"^spec\.space\.segments: {message}"):
        Space.of(space, 7)


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"layout": "segments"}, "required with layout: segments"),
        ({"layout": "per_layer", "segments": 2}, "only allowed with layout: segments"),
        ({"layout": "segments", "segments": [2, 0]}, "expected a positive number of groups"),
    ],
)
def test_segments_field_is_checked_with_the_layout(space: dict[str, Any], message: str) -> None:
    spec = spec_dict("sqlite:///unused.db")
    spec["space"] = {**space, "choices": ["none", "full"]}
    with pytest.raises(SpecError, match=rf"^spec\.space\.segments: {message}"):
        parse_spec(spec)


def test_nested_space_adds_a_layout_parameter_and_the_recursive_preset() -> None:
    space = Space.of(SpaceConfig(layout="per_layer", nested=True, choices=["full", "none"]), 3)
    presets = space.presets()
    assert presets == [
        {"layer_00": "full", "layer_01": "full", "layer_02": "full", "layout": "flat"},
        {"layer_00": "none", "layer_01": "none", "layer_02": "none", "layout": "flat"},
        {"layer_00": "none", "layer_01": "none", "layer_02": "none", "layout": "nested"},
    ]
    recursive = space.plan(presets[-1])
    assert recursive == RematPlan(layers=(NONE,) * 3, layout="nested")
    assert recursive.summary() == "nested: none×3"
    assert space.plan({"layer_00": "full", "layer_01": "none", "layer_02": "none"}).layout == "flat"
    assert space.units == ("layer_00", "layer_01", "layer_02") and space.n_params == 4
    assert "layout" not in Space.of(SpaceConfig(layout="uniform", choices=["none"]), 3).presets()[0]

    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    plan = space.suggest(trial)
    assert set(trial.params) == {"layer_00", "layer_01", "layer_02", "layout"}
    assert plan.layout == trial.params["layout"]


def test_flat_plans_keep_their_json_and_digest() -> None:
    plan = RematPlan(layers=(FULL, LayerPolicy(kind="names", names=("context",))))
    text = '{"layers":[{"kind":"full","names":[]},{"kind":"names","names":["context"]}]}'
    assert plan.to_json() == text
    assert plan.digest == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert RematPlan.from_json(text) == plan and plan.layout == "flat"

    nested = RematPlan(layers=plan.layers, layout="nested")
    assert json.loads(nested.to_json())["layout"] == "nested"
    assert nested.digest != plan.digest
    assert RematPlan.from_json(nested.to_json()) == nested
