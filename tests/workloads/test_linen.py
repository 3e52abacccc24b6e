"""A user's Flax linen model searched from a spec of a few lines, with no ``Workload``
subclass and no edit to its source (``tests/models/linen_decoder.py``): the plans keep the
model's outputs and gradients, really change its compiled peak, and a model whose structure
does not allow it is a one-line error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import remat_search
from remat_search import LayerPolicy, RematPlan, build_workload
from remat_search.errors import SpecError, WorkloadError
from remat_search.measure.executables import Executables
from remat_search.workloads.linen import LinenWorkload
from remat_search.spec.loading import parse_spec
from remat_search.spec.workloads import LinenConfig
from remat_search.workloads.base import next_token_loss

from tests.conftest import spec_dict, write_spec
from tests.models.linen_decoder import z_loss_cross_entropy

LINEN: dict[str, Any] = {
    "kind": "linen",
    "model": "tests.models.linen_decoder:Decoder",
    "args": {"vocab": 64, "layers": 3, "d_model": 32, "heads": 2, "d_ff": 64},
    "blocks": "blocks",
    "batch": 2, "seq_len": 128, "vocab": 64,
}
CHOICES: list[Any] = ["none", "full", "dots", {"label": "save_qkv", "names": ["qkv"]}]
QKV = LayerPolicy(kind="names", names=("qkv",))
MIXED = RematPlan(layers=(LayerPolicy(kind="full"), LayerPolicy(kind="none"), QKV))


@pytest.fixture(scope="module")
def workload() -> LinenWorkload:
    built = build_workload(LinenConfig(**LINEN))
    assert isinstance(built, LinenWorkload)
    return built


def _close(a: Any, b: Any, rtol: float) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol)


def test_a_spec_of_a_few_lines_searches_the_model(tmp_path: Path, storage_url: str, workload: LinenWorkload) -> None:
    spec = parse_spec(spec_dict(
        storage_url, study="linen", workload=LINEN, space={"layout": "per_layer", "choices": CHOICES},
        trials=4, confirm={"top": 0},
    ))
    report = remat_search.run(spec)
    assert [t.status for t in report.trials].count("measured") == 4, [t.status for t in report.trials]
    best = report.best(2**30)
    assert best.plan is not None and len(best.plan.layers) == 3
    (params, _), tokens = workload.inputs()
    plain = jax.jit(workload.forward())(params, tokens)
    _close(jax.jit(workload.forward(best.plan))(params, tokens), plain, rtol=1e-6)
    assert plain.shape == (2, 128, 64)


@pytest.mark.parametrize("plan", [MIXED, RematPlan.uniform("full", 3), RematPlan.uniform("dots", 3)], ids=RematPlan.summary)
def test_the_plans_gradients_are_no_remats(workload: LinenWorkload, plan: RematPlan) -> None:
    (params, _), tokens = workload.inputs()
    reference = jax.jit(jax.value_and_grad(workload.loss(RematPlan.uniform("none", 3))))(params, tokens)
    _close(jax.jit(jax.value_and_grad(workload.loss(plan)))(params, tokens), reference, rtol=1e-5)


def test_each_layer_is_checkpointed_by_its_own_policy(workload: LinenWorkload) -> None:
    (params, _), tokens = workload.abstract_inputs()
    jaxpr = jax.make_jaxpr(workload.loss(MIXED))(params, tokens)
    policies = [e.params["policy"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "remat2"]
    assert len(policies) == 2  # layer 1 is ``none``: not wrapped
    assert policies[0] is jax.checkpoint_policies.nothing_saveable
    assert policies[1] is not jax.checkpoint_policies.nothing_saveable


def test_tensor_names_are_the_tags_the_traced_model_emits(workload: LinenWorkload) -> None:
    assert workload.layers == 3
    assert workload.tensor_names == {"qkv", "attn_out", "mlp_hidden"}


def test_the_block_class_finds_the_same_layers(workload: LinenWorkload) -> None:
    by_class = build_workload(LinenConfig(**{**LINEN, "blocks": None, "block": "tests.models.linen_decoder:Block"}))
    assert by_class.layers == 3 and by_class.tensor_names == workload.tensor_names
    assert by_class.fingerprint() == workload.fingerprint()


def test_the_model_may_come_from_a_function(workload: LinenWorkload) -> None:
    made = build_workload(LinenConfig(**{**LINEN, "model": "tests.models.linen_decoder:tiny_decoder", "args": {"layers": 2}}))
    assert made.layers == 2 and made.tensor_names == workload.tensor_names


def test_policies_change_the_compiled_peak(workload: LinenWorkload) -> None:
    executables = Executables(workload)
    peak = {k: executables.build(RematPlan.uniform(k, 3)).memory.peak for k in ("none", "full", "dots")}
    # Each policy compiles to its own peak, both remat policies below none's (which of the two is
    # lower is XLA's: full on jaxlib 0.10, dots on 0.12).
    assert max(peak["full"], peak["dots"]) < peak["none"] and peak["full"] != peak["dots"], peak


def test_a_plan_of_another_depth_is_refused(workload: LinenWorkload) -> None:
    with pytest.raises(SpecError, match="plan: has 2 layers, the model runs 3"):
        workload.loss(RematPlan.uniform("full", 2))


def test_a_named_loss_replaces_the_default(workload: LinenWorkload) -> None:
    custom = build_workload(LinenConfig(**{**LINEN, "loss": "tests.models.linen_decoder:z_loss_cross_entropy"}))
    (params, _), tokens = workload.inputs()
    logits = jax.jit(workload.forward())(params, tokens)
    expected = z_loss_cross_entropy(logits, tokens)
    _close(jax.jit(custom.loss(MIXED))(params, tokens), expected, rtol=1e-5)
    assert abs(float(expected) - float(next_token_loss(logits, tokens))) > 1e-6


BAD_STRUCTURE: list[tuple[str, dict[str, Any], str]] = [
    ("a block class the model does not use", {"blocks": None, "block": "flax.linen:Conv"},
     "workload.block: the model makes no call of a module 'flax.linen:Conv'"),
    ("no such attribute", {"blocks": "layers"}, "workload.blocks: the model makes no call of a module named 'layers'"),
    ("not a module class", {"blocks": None, "block": "tests.models.linen_decoder:z_loss_cross_entropy"},
     "workload.block: 'tests.models.linen_decoder:z_loss_cross_entropy' is not a flax.linen Module class"),
    ("model does not import", {"model": "no_such_module:Decoder"}, "workload.model: 'no_such_module:Decoder' does not import"),
    ("model lacks the name", {"model": "tests.models.linen_decoder:Nope"}, "workload.model: 'tests.models.linen_decoder:Nope'"),
    ("bad arguments", {"args": {"vocab": 64}}, "workload.model: raised TypeError"),
    ("wrong logits", {"vocab": 65}, "workload.model: returns (2, 128, 64), the default loss expects logits of shape [2, 128, 65]"),
    ("other collections", {"model": "flax.linen:BatchNorm", "args": {"use_running_average": False}},
     "workload.model: has variable collections ['batch_stats'] besides params"),
    ("no layers named", {"blocks": None}, "spec.workload: name the model's layers"),
    ("bad import path", {"model": "Decoder"}, "spec.workload.model: expected an import path"),
]


@pytest.mark.parametrize(("case", "change", "line"), BAD_STRUCTURE, ids=[c[0] for c in BAD_STRUCTURE])
def test_a_structure_that_does_not_allow_it_is_one_line(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, storage_url: str, case: str, change: dict[str, Any], line: str
) -> None:
    spec = spec_dict(storage_url, workload={**LINEN, **change}, space={"layout": "per_layer", "choices": CHOICES})
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert line in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*")), "a database was written for bad input"


def test_nested_plans_are_refused_for_linen(storage_url: str) -> None:
    with pytest.raises(SpecError, match="space.nested: a linen model's layers cannot be nested"):
        parse_spec(spec_dict(storage_url, workload=LINEN, space={"choices": ["full"], "nested": True}))


def test_the_api_raises_workload_error() -> None:
    with pytest.raises(WorkloadError, match=r"^workload\.blocks: the model makes no call of a module named 'norms'"):
        build_workload(LinenConfig(**{**LINEN, "blocks": "norms"}))
