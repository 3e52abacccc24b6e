"""A Flax NNX model searched from a spec of a few lines (``kind: nnx``), with no Workload
subclass and no edit to the model (tests/models/nnx_decoder.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import remat_search
from remat_search.errors import SpecError, WorkloadError
from remat_search.measure.executables import INPUT_SEED
from remat_search.workloads.base import next_token_loss
from remat_search.workloads.nnx import Checkpointed, NnxWorkload
from remat_search.plans.plan import RematPlan
from remat_search.plans.policy import LayerPolicy
from remat_search.spec.models import SearchSpec
from remat_search.spec.workloads import NnxConfig

from tests.conftest import spec_dict, write_spec
from tests.models.nnx_decoder import Decoder

ARGS: dict[str, Any] = {"vocab": 64, "d_model": 32, "heads": 2, "d_ff": 64, "layers": 3}
WORKLOAD: dict[str, Any] = {
    "kind": "nnx", "model": "tests.models.nnx_decoder:Decoder", "args": ARGS,
    "blocks": "blocks", "batch": 4, "seq_len": 16, "vocab": 64,
}
CHOICES: list[Any] = ["none", "full", "dots", {"label": "save_attn", "names": ["context", "out_proj"]}]


def _workload(**changes: Any) -> NnxWorkload:
    return NnxWorkload(NnxConfig(**{**WORKLOAD, **changes}))


def _grads(workload: NnxWorkload, plan: RematPlan) -> tuple[jax.Array, Any]:
    (params, _), tokens = workload.inputs(seed=1)
    return jax.jit(jax.value_and_grad(workload.loss(plan)))(params, tokens)


@pytest.fixture(scope="module")
def decoder() -> tuple[NnxWorkload, tuple[jax.Array, Any]]:
    """The tiny decoder's workload and its loss and gradients with no remat."""
    workload = _workload()
    return workload, _grads(workload, RematPlan.uniform("none", 3))


def _assert_close(grads: Any, expected: Any) -> None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, expected)


def test_search_finds_a_plan_whose_forward_is_the_models(storage_url: str, decoder: Any) -> None:
    spec = SearchSpec.model_validate(spec_dict(
        storage_url, study="nnx", workload=WORKLOAD, space={"layout": "per_layer", "choices": CHOICES},
        trials=4, confirm={"top": 0},
    ))
    report = remat_search.run(spec)
    assert len(report.trials) == 4 and report.count("measured") == 4, [t.error for t in report.trials]
    best = report.best(2**30)
    workload, (no_remat_loss, no_remat_grads) = decoder
    key, tokens = jax.random.key(3), workload.make_batch(jax.random.key(4))
    model = Decoder(**ARGS, rngs=nnx.Rngs(key))  # the model as its user runs it, unwrapped
    np.testing.assert_array_equal(workload.forward(best.plan, workload.init_params(key), tokens), model(tokens))
    loss, grads = _grads(workload, best.plan)
    assert loss == no_remat_loss
    _assert_close(grads, no_remat_grads)


@pytest.mark.parametrize("policy", ["full", "dots_no_batch"])
def test_every_block_is_checkpointed_by_its_policy(policy: str, decoder: Any) -> None:
    workload, (_, no_remat_grads) = decoder
    plan = RematPlan.uniform(policy, 3)
    (params, _), tokens = workload.inputs()
    jaxpr = jax.make_jaxpr(workload.loss(plan))(params, tokens)
    remats = [e for e in jaxpr.eqns if e.primitive.name in {"checkpoint", "remat2", "remat"}]
    assert len(remats) == 3
    no_remat = jax.make_jaxpr(workload.loss(RematPlan.uniform("none", 3)))(params, tokens)
    assert not [e for e in no_remat.eqns if e.primitive.name in {"checkpoint", "remat2", "remat"}]
    _, grads = _grads(workload, plan)
    _assert_close(grads, no_remat_grads)


def test_a_model_holding_an_rng_stream_keeps_its_dropout_under_remat() -> None:
    workload = _workload(args={**ARGS, "dropout": 0.5})
    mixed = RematPlan(layers=[LayerPolicy(kind=k) for k in ("full", "none", "dots")])
    loss, grads = _grads(workload, mixed)
    no_remat_loss, no_remat_grads = _grads(workload, RematPlan.uniform("none", 3))
    assert loss == no_remat_loss
    _assert_close(grads, no_remat_grads)


def test_tensor_names_are_the_tags_the_traced_model_emits() -> None:
    attention = {"query_proj", "key_proj", "value_proj", "context", "out_proj"}
    assert _workload().tensor_names == attention | {"mlpwi", "mlpwo"}
    assert _workload(args={**ARGS, "tag_mlp": False}).tensor_names == attention
    assert _workload().layers == 3
    assert jax.tree.structure(_workload().init_params(jax.random.key(0))) == jax.tree.structure(
        nnx.to_pure_dict(nnx.state(Decoder(**ARGS, rngs=nnx.Rngs(0)), nnx.Param))
    )


def test_a_named_loss_replaces_the_default() -> None:
    workload = _workload(loss="tests.workloads.test_nnx:mean_logit")
    (params, _), tokens = workload.inputs()
    model = Decoder(**ARGS, rngs=nnx.Rngs(jax.random.split(jax.random.key(0))[0]))
    loss = workload.loss(RematPlan.uniform("full", 3))(params, tokens)
    assert loss == pytest.approx(float(model(tokens).mean()), abs=1e-6)


def mean_logit(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """A loss named by import path in a spec (``loss: tests.workloads.test_nnx:mean_logit``)."""
    return jnp.mean(logits)


def squared_logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """A model's own loss named in a spec (``model_loss: tests.workloads.test_nnx:squared_logits``)."""
    return jnp.mean(model(tokens) ** 2)


def logits_of(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """A model loss that forgets to reduce: not a scalar."""
    return model(tokens)


def test_a_search_trains_the_model_s_own_loss(storage_url: str) -> None:
    workload = {**WORKLOAD, "model_loss": "tests.workloads.test_nnx:squared_logits"}
    spec = SearchSpec.model_validate(spec_dict(
        storage_url, study="own-loss", workload=workload, space={"layout": "uniform", "choices": ["full"]},
        trials=1, confirm={"top": 0},
    ))
    (trial,) = remat_search.run(spec).trials
    assert trial.measurement is not None and trial.measurement.status == "measured", trial.error
    params_key, batch_key = jax.random.split(jax.random.key(INPUT_SEED))  # the inputs the first step ran on
    model = Decoder(**ARGS, rngs=nnx.Rngs(params_key))
    tokens = _workload().make_batch(batch_key)
    assert trial.measurement.first_loss == pytest.approx(float(jnp.mean(model(tokens) ** 2)), rel=1e-5)
    assert trial.measurement.first_loss != pytest.approx(float(next_token_loss(model(tokens), tokens)), rel=1e-2)


def test_a_nested_plan_is_refused(decoder: Any) -> None:
    workload, _ = decoder
    (params, _), tokens = workload.inputs()
    with pytest.raises(SpecError, match="layout 'nested' is not supported for nnx models"):
        workload.loss(RematPlan(layers=RematPlan.uniform("full", 3).layers, layout="nested"))(params, tokens)


BAD_STRUCTURE: list[tuple[str, dict[str, Any], str]] = [
    ("no such attribute", {"blocks": "layers"}, "workload.blocks: Decoder has no attribute 'layers' (it has ["),
        ("calls and layers disagree", {"blocks": "embed"},
     "workload.blocks: the model's __call__ runs 1 layer(s) of 'embed', which holds 64: its calls and its layers disagree"),
    ("blocks the model does not run",
     {"model": "tests.models.nnx_decoder:Detached", "args": {"vocab": 64, "d_model": 32, "layers": 2}},
     "workload.blocks: the model's __call__ did not call block(s) [0, 1] of 'blocks'"),
    ("model does not import", {"model": "tests.models.no_such:Decoder"}, "workload.model: 'tests.models.no_such:Decoder' does not import"),
    ("model is missing", {"model": "tests.models.nnx_decoder:Nope"}, "has no class or function 'Nope'"),
    ("model fails", {"args": {**ARGS, "heads": "two"}}, "workload: 'tests.models.nnx_decoder:Decoder' does not trace (TypeError: "),
    ("constructor fails", {"args": {**ARGS, "depth": 2}}, "workload.model: 'tests.models.nnx_decoder:Decoder' raised TypeError: "),
    ("logits of another shape", {"vocab": 65}, "the default loss expects logits of shape [4, 16, 65]"),
    ("nested", {}, "space.nested: an nnx model runs its blocks itself"),
    ("model path", {"model": "tests.models.nnx_decoder.Decoder"}, "spec.workload.model: expected an import path 'package.module:Name'"),
    ("both losses", {"loss": "tests.workloads.test_nnx:mean_logit", "model_loss": "tests.workloads.test_nnx:squared_logits"},
     "spec.workload.model_loss: give loss (fn(logits, tokens)) or model_loss (fn(model, tokens)), not both"),
    ("model loss not a scalar", {"model_loss": "tests.workloads.test_nnx:logits_of"},
     "workload.model_loss: returned shape [4, 16, 64], expected a scalar"),
]


@pytest.mark.parametrize(("case", "change", "message"), BAD_STRUCTURE, ids=[c[0] for c in BAD_STRUCTURE])
def test_a_structure_that_does_not_allow_it_is_one_line(cli, tmp_path: Path, storage_url: str, case: str, change: dict,  # type: ignore[no-untyped-def]
                                                         message: str) -> None:
    spec = spec_dict(storage_url, workload={**WORKLOAD, **change}, space={"choices": CHOICES, "nested": case == "nested"})
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*")), "a database was written for bad input"


def test_a_choice_naming_a_tag_the_model_does_not_emit_is_refused(cli, tmp_path: Path, storage_url: str) -> None:  # type: ignore[no-untyped-def]
    spec = spec_dict(
        storage_url, workload={**WORKLOAD, "args": {**ARGS, "tag_mlp": False}},
        space={"choices": ["full", {"label": "save_mlp", "names": ["mlpwi"]}]},
    )
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert result.exit_code == 2
    assert "unknown tensor name(s) ['mlpwi']" in result.stderr
    assert not list(tmp_path.glob("*.db*"))


def test_errors_are_workload_errors() -> None:
    with pytest.raises(WorkloadError, match="has no attribute 'layers'"):
        _workload(blocks="layers")


def _train_step_memory(model: nnx.Module, tokens: jax.Array) -> remat_search.MemoryBreakdown:
    """The memory of a trainer's jitted AdamW step on ``model`` (its state donated), compiled
    as remat-search compiles a plan on this platform."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adamw(1e-3)

    def train_step(state: Any, tokens: jax.Array) -> Any:
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest)(tokens), tokens))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    lowered = jax.jit(train_step, donate_argnums=0).lower((params, opt.init(params)), tokens)
    compiled = lowered.compile(compiler_options=remat_search.compiler_options(jax.default_backend()))
    return remat_search.MemoryBreakdown.of(compiled, platform=jax.default_backend())


def test_apply_nnx_trains_each_measured_plan_with_its_measured_memory_and_the_model_s_gradients(
    storage_url: str,
) -> None:
    spec = SearchSpec.model_validate(spec_dict(
        storage_url, study="apply", workload=WORKLOAD, space={"layout": "per_layer", "choices": ["none", "full"]},
        trials=4, confirm={"top": 0},
    ))
    trials = [t for t in remat_search.run(spec).trials if t.measurement is not None and t.status == "measured"]
    summaries = {t.plan.summary() for t in trials if t.plan is not None}
    assert {"none×3", "full×3"} < summaries, summaries  # and at least one plan that mixes them
    tokens = _workload().make_batch(jax.random.key(1))

    def loss_fn(model: nnx.Module) -> jax.Array:
        return next_token_loss(model(tokens), tokens)

    plain = Decoder(**ARGS, rngs=nnx.Rngs(0))
    plain_loss, plain_grads = nnx.jit(nnx.value_and_grad(loss_fn))(plain)
    for trial in trials:
        assert trial.plan is not None and trial.measurement is not None
        model = Decoder(**ARGS, rngs=nnx.Rngs(0))
        assert remat_search.apply_nnx(model, trial.plan) is model
        assert all(isinstance(b, Checkpointed) for b in model.blocks)
        assert _train_step_memory(model, tokens) == trial.measurement.memory, trial.plan.summary()
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
        assert float(loss) == pytest.approx(float(plain_loss), rel=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    full, none = (next(t for t in trials if t.plan is not None and t.plan.summary() == s) for s in ("full×3", "none×3"))
    # Two programs, two peaks (on a model this small, which is lower is XLA's: full on jaxlib 0.10,
    # none by 0.6% on 0.12), each applied above with its own memory.
    assert full.peak_bytes is not None and none.peak_bytes is not None and full.peak_bytes != none.peak_bytes


def test_apply_nnx_replaces_a_plan_it_applied_and_refuses_one_that_does_not_fit() -> None:
    model = Decoder(**ARGS, rngs=nnx.Rngs(0))
    blocks = list(model.blocks)
    remat_search.apply_nnx(model, RematPlan.uniform("full", 3))
    remat_search.apply_nnx(model, RematPlan.uniform("none", 3))
    assert [b.block for b in model.blocks] == blocks  # rewrapped, not wrapped twice
    paths = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert "blocks/0/block/qkv/kernel" in paths  # the parameters one level deeper
    with pytest.raises(SpecError, match=r"^plan: has 2 layers, the model has 3 in 'blocks'$"):
        remat_search.apply_nnx(model, RematPlan.uniform("full", 2))
    with pytest.raises(SpecError, match="layout 'nested' is not supported for nnx models"):
        remat_search.apply_nnx(model, RematPlan(layers=RematPlan.uniform("full", 3).layers, layout="nested"))
    with pytest.raises(WorkloadError, match=r"^blocks: Decoder has no attribute 'layers' \(it has \["):
        remat_search.apply_nnx(model, RematPlan.uniform("full", 3), blocks="layers")


class Nested(nnx.Module):
    """A model holding its blocks one attribute down (``decoder.blocks``)."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.decoder = Decoder(**ARGS, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.decoder(tokens)


def test_apply_nnx_finds_blocks_by_a_dotted_path() -> None:
    model = remat_search.apply_nnx(Nested(rngs=nnx.Rngs(0)), RematPlan.uniform("full", 3), blocks="decoder.blocks")
    assert all(isinstance(b, Checkpointed) for b in model.decoder.blocks)
    tokens = _workload().make_batch(jax.random.key(1))
    jaxpr = jax.make_jaxpr(lambda m: m(tokens))(model)
    assert sum(e.primitive.name in {"checkpoint", "remat2", "remat"} for e in jaxpr.eqns) == 3


def test_a_spec_without_model_loss_dumps_as_before_it_existed() -> None:
    """A study stored before ``model_loss`` existed keeps its identity (the spec's dump)."""
    assert "model_loss" not in NnxConfig(**WORKLOAD).model_dump(mode="json")
    named = NnxConfig(**WORKLOAD, model_loss="tests.workloads.test_nnx:squared_logits")
    assert named.model_dump(mode="json")["model_loss"] == "tests.workloads.test_nnx:squared_logits"
