"""Every registered policy kind (remat_search.policy.POLICIES), through spec, plan and JAX.

A kind added to the registry is tested here without a line more: it parses from a spec as a
bare word or a labelled list of names, checkpoints a layer exactly when it says it does, and
leaves the gradients of the layer it wraps as they were.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_search
from remat_search import POLICIES, LayerPolicy, PolicyKind, RematPlan, register_policy
from remat_search.spec import PolicyChoice, parse_spec

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


def _saved(kind: str, names: tuple[str, ...]) -> set[str]:
    """What a layer with a named matmul (``a``), a named elementwise tensor (``b``) and an
    unnamed matmul saves for the backward pass under ``kind``, by JAX's own account
    (``saved_residuals``): ``named X`` or ``dot`` (an unnamed matmul's output)."""
    w = jnp.eye(4) * 0.5 + 0.1

    def layer(x: jax.Array) -> jax.Array:
        a = checkpoint_name(x @ w, "a")
        b = checkpoint_name(jnp.sin(a), "b")
        return (jnp.tanh(b @ w.T) * b).sum()  # the backward needs b and the unnamed matmul's output

    wrapped = RematPlan.uniform(LayerPolicy(kind=kind, names=names), 1).wrap(layer, 0)
    x = jnp.arange(8.0).reshape(2, 4) / 8
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(wrapped, x)
    return {
        ("named " + why.split("named ")[1].split()[0].strip("'")) if "named" in why else
        ("dot" if "dot_general" in why else "other")
        for why in printed.getvalue().splitlines() if "from the argument" not in why and "from a constant" not in why
    }


def test_names_except_saves_every_named_tensor_but_those() -> None:
    assert _saved("names_except", ("a",)) == {"named b"}
    assert _saved("names", ("a",)) == {"named a"}


def test_dots_no_batch_names_saves_the_matmuls_and_the_named_tensors() -> None:
    assert _saved("dots_no_batch_names", ("b",)) >= {"named b", "dot"}
    assert "named b" not in _saved("dots_no_batch", ())


def test_the_new_kinds_search_with_their_peaks_and_gradients_and_untagged_names_are_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Each kind in a real study: compiled (its peak in the table), run, and its first step
    within the gradient tolerance of full remat's. A choice naming a tensor the traced step
    never tags (the workload declares it, its step does not emit it) is said."""
    from tests.conftest import spec_dict

    spec = parse_spec(spec_dict(
        f"sqlite:///{tmp_path / 'studies.db'}", trials=2, confirm={"top": 0},
        workload={"factory": "tests.workloads:over_declared"},
        space={"layout": "uniform", "choices": [
            {"label": "all_but_wi", "names_except": ["mlpwi", "never_tagged"]},
            {"label": "dnb_wo", "dots_no_batch_names": ["mlpwo"]},
        ]},
    ))
    with caplog.at_level("WARNING", logger="remat_search"):
        report = remat_search.run(spec)
    assert [(t.summary(), t.status) for t in report.trials] == [("all_but_wi×2", "measured"), ("dnb_wo×2", "measured")]
    for t in report.trials:
        assert t.peak_bytes and t.measurement is not None and t.measurement.grad_rel_error is not None
        assert t.measurement.grad_rel_error <= spec.gradient_tolerance
    assert [r.getMessage() for r in caplog.records if "never tags" in r.getMessage()] == [
        "note: spec.space.choices: 'all_but_wi' names ['never_tagged'], which the traced step never tags with "
        + "checkpoint_name (it tags mlpwi, mlpwo): for those, the choice saves nothing"
    ]
