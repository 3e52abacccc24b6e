"""Every registered policy kind (remat_search.policy.POLICIES), through spec, plan and JAX.

A kind added to the registry is tested here without a line more: it parses from a spec as a
bare word or a labelled list of names, checkpoints a layer exactly when it says it does, and
leaves the gradients of the layer it wraps as they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from remat_search import POLICIES, LayerPolicy, PolicyKind, RematPlan, register_policy
from remat_search.spec import PolicyChoice

NAMES = ("mlpwi",)


def _policy(kind: str) -> LayerPolicy:
    return LayerPolicy(kind=kind, names=NAMES if POLICIES[kind].takes_names else ())


def _layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(checkpoint_name(x @ w, "mlpwi")) @ w.T


@pytest.mark.parametrize("kind", list(POLICIES))
def test_a_kind_parses_from_a_spec(kind: str) -> None:
    written = {"label": "mine", kind: list(NAMES)} if POLICIES[kind].takes_names else kind
    choice = PolicyChoice.model_validate(written)
    assert choice.policy == _policy(kind)


@pytest.mark.parametrize("kind", list(POLICIES))
def test_a_kind_checkpoints_as_it_says_and_keeps_the_gradients(kind: str) -> None:
    plan = RematPlan.uniform(_policy(kind), 1)
    w, x = jnp.eye(4) * 0.5 + 0.1, jnp.arange(8.0).reshape(2, 4) / 8
    wrapped = plan.wrap(lambda x: _layer(w, x), 0)
    eqns = jax.make_jaxpr(wrapped)(x).eqns
    assert any(e.primitive.name.startswith(("checkpoint", "remat")) for e in eqns) == POLICIES[kind].checkpoints
    grads = jax.jit(jax.grad(lambda x: wrapped(x).sum()))(x)
    assert jnp.allclose(grads, jax.grad(lambda x: _layer(w, x).sum())(x), rtol=1e-6)


def test_an_unknown_kind_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy kind 'everything'; expected one of none, full"):
        LayerPolicy(kind="everything")
    with pytest.raises(ValueError, match="unknown policy 'fulll'; expected one of none, full, dots, dots_no_batch"):
        PolicyChoice.model_validate("fulll")


def test_a_kind_is_registered_once() -> None:
    with pytest.raises(ValueError, match="'full' is registered already"):
        register_policy(PolicyKind("full", "again", lambda names: None))
