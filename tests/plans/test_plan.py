import jax
import jax.numpy as jnp
import pytest

from remat_search import LayerPolicy, RematPlan, SpecError
from remat_search.plans.policy import checkpoint_policy


def _plan() -> RematPlan:
    return RematPlan(layers=(
        LayerPolicy(kind="full"),
        LayerPolicy(kind="names", names=("value_proj", "key_proj", "key_proj")),
        LayerPolicy(kind="none"),
    ))


def test_canonical_json_and_digest_are_stable() -> None:
    plan = _plan()
    assert plan.layers[1].names == ("key_proj", "value_proj")  # sorted, deduplicated
    same = RematPlan(layers=(
        LayerPolicy(kind="full"),
        LayerPolicy(kind="names", names=("key_proj", "value_proj")),
        LayerPolicy(kind="none"),
    ))
    assert plan.to_json() == same.to_json()
    assert plan.digest == same.digest and len(plan.digest) == 16
    assert plan.digest != RematPlan.uniform("full", 3).digest
    assert RematPlan.from_json(plan.to_json()) == plan
    assert hash(plan) == hash(same)


def test_summary_collapses_runs() -> None:
    assert RematPlan.uniform("dots", 4).summary() == "dots×4"
    assert _plan().summary() == "full names(key_proj,value_proj) none"
    assert _plan().summary(["a", "b", "b"]) == "a b×2"


@pytest.mark.parametrize(
    "bad", [{"kind": "names"}, {"kind": "full", "names": ["x"]}, {"kind": "everything"}]
)
def test_layer_policy_rejects_bad_combinations(bad: dict) -> None:
    with pytest.raises(ValueError):
        LayerPolicy(**bad)


def test_from_json_rejects_non_plans() -> None:
    with pytest.raises(SpecError, match="plan: not a remat plan"):
        RematPlan.from_json('{"layers": [{"kind": "sometimes"}]}')


def test_check_against_workload_shape() -> None:
    _plan().check(layers=3, tensor_names={"key_proj", "value_proj", "query_proj"})
    with pytest.raises(SpecError, match="has 3 layers, the workload has 4"):
        _plan().check(layers=4, tensor_names={"key_proj", "value_proj"})
    with pytest.raises(SpecError, match=r"unknown tensor name\(s\) \['value_proj'\]"):
        _plan().check(layers=3, tensor_names={"key_proj"})


def test_policies_translate_to_jax_policies() -> None:
    cp = jax.checkpoint_policies
    assert checkpoint_policy(LayerPolicy(kind="none")) is None
    assert checkpoint_policy(LayerPolicy(kind="full")) is cp.nothing_saveable
    assert checkpoint_policy(LayerPolicy(kind="dots")) is cp.dots_saveable
    assert checkpoint_policy(LayerPolicy(kind="dots_no_batch")) is cp.dots_with_no_batch_dims_saveable
    assert callable(checkpoint_policy(LayerPolicy(kind="names", names=("context",))))
    assert callable(checkpoint_policy(LayerPolicy(kind="offload", names=("context",))))


def _has_checkpoint(fn, *args) -> bool:  # type: ignore[no-untyped-def]
    return any(e.primitive.name.startswith(("checkpoint", "remat")) for e in jax.make_jaxpr(fn)(*args).eqns)


def test_wrap_checkpoints_exactly_the_layers_with_a_policy() -> None:
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2

    x = jnp.ones(3)
    plan = _plan()
    assert _has_checkpoint(plan.wrap(f, 0), x)
    assert _has_checkpoint(plan.wrap(f, 1), x)
    assert plan.wrap(f, 2) is f
    assert jnp.allclose(jax.grad(lambda x: plan.wrap(f, 0)(x).sum())(x), jax.grad(lambda x: f(x).sum())(x))
