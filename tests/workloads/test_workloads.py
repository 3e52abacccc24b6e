"""Every kind of workload (``workloads.base.BUILTIN_WORKLOADS``, and a factory's) under one
contract, on tiny configs: it builds from its spec form, names its layers and the tensors its
step tags, a plan of mixed policies applies to it (one training step runs), and checkpointing
changes no mathematics (the gradients of no remat and of full remat agree)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from remat_search.plans.plan import RematPlan
from remat_search.plans.policy import LayerPolicy
from remat_search.spec.workloads import (
    FactoryConfig,
    LinenConfig,
    MlpConfig,
    NnxConfig,
    TransformerConfig,
    WorkloadConfig,
)
from remat_search.workloads.base import BUILTIN_WORKLOADS, Workload, build_workload
from remat_search.workloads.tracing import trace_step

from tests.conftest import TINY_TRANSFORMER

DECODER = {"vocab": 64, "d_model": 32, "heads": 2, "d_ff": 64, "layers": 2}
EXAMPLES: dict[str, WorkloadConfig] = {
    "transformer": TransformerConfig(**TINY_TRANSFORMER),
    "mlp": MlpConfig(kind="mlp", layers=2, width=16, hidden=32, batch=4),
    "nnx": NnxConfig(kind="nnx", model="tests.models.nnx_decoder:Decoder", args=DECODER, blocks="blocks",
                     batch=2, seq_len=16, vocab=64),
    "linen": LinenConfig(kind="linen", model="tests.models.linen_decoder:Decoder", args=DECODER, blocks="blocks",
                         batch=2, seq_len=16, vocab=64),
    "factory": FactoryConfig(factory="tests.factories:over_declared"),
}
"""A tiny spec form of each kind (a new kind adds one here)."""


def test_every_kind_of_workload_has_an_example() -> None:
    """All but ``maxtext``: MaxText's program has no loss or per-layer plan of ours to put under
    this contract (one policy for every layer, its own train step); tests/workloads/test_maxtext.py
    holds it to MaxText's own compile instead."""
    assert set(EXAMPLES) == {*BUILTIN_WORKLOADS, "factory"} - {"maxtext"}


@pytest.fixture(scope="module", params=list(EXAMPLES))
def workload(request: pytest.FixtureRequest) -> Workload:
    built = build_workload(EXAMPLES[request.param])
    built.use_mesh(None)  # one device: as the worker gives a target without a mesh
    return built


def test_a_workload_names_its_layers_and_the_tensors_its_step_tags(workload: Workload) -> None:
    assert isinstance(workload, Workload) and workload.name
    assert workload.layers == 2
    traced = trace_step(workload)
    assert traced.names, "the step tags no tensor with checkpoint_name"
    assert traced.names <= workload.tensor_names  # a names policy may keep each tag the step emits
    assert len(traced.fingerprint) == 16 and traced.fingerprint == trace_step(workload).fingerprint
    assert workload.fingerprint() == workload.fingerprint()


def test_a_plan_applies_to_a_workload(workload: Workload) -> None:
    kept = sorted(trace_step(workload).names or ())[0]
    plan = RematPlan(layers=(LayerPolicy(kind="full"), LayerPolicy(kind="names", names=(kept,))))
    with workload.tracing():
        state, batch = workload.inputs()
        before = jax.tree.structure(state)
        state, loss = workload.step(plan)(state, batch)
    assert np.isfinite(float(loss)) and jax.tree.structure(state) == before


def _gradients(workload: Workload, policy: str) -> tuple[float, Any]:
    with workload.tracing():
        (params, _), batch = workload.inputs(seed=1)
        loss, grads = jax.jit(jax.value_and_grad(workload.loss(RematPlan.uniform(policy, workload.layers))))(params, batch)
    return float(loss), jax.device_get(grads)


def test_no_remat_and_full_remat_compute_the_same_gradients(workload: Workload) -> None:
    loss_none, none = _gradients(workload, "none")
    loss_full, full = _gradients(workload, "full")
    assert loss_full == pytest.approx(loss_none, rel=1e-6)
    assert jax.tree.structure(none) == jax.tree.structure(full)
    for a, b in zip(jax.tree.leaves(none), jax.tree.leaves(full), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert any(np.any(leaf != 0) for leaf in jax.tree.leaves(none))  # gradients that say something
