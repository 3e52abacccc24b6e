"""Every registered policy kind (remat_search.plans.policy.POLICIES), through spec, plan and JAX.

A kind added to the registry is tested here without a line more: it parses from a spec as a
bare word or a labelled list of names, checkpoints a layer exactly when it says it does, and
leaves the gradients of the layer it wraps as they were.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_search
from remat_search import POLICIES, LayerPolicy, PolicyKind, RematPlan, register_policy
from remat_search.errors import SpecError
from remat_search.plans.export import PINNED, maxtext
from remat_search.spec.loading import parse_spec
from remat_search.spec.space import PolicyChoice

NAMES = ("mlpwi",)
WRITTEN: dict[str, tuple[Any, dict[str, Any]]] = {
    "per_name": ({"device": list(NAMES)}, {"names": NAMES}),
    "function": ("tests.policies:save_softmax", {"function": "tests.policies:save_softmax"}),
}
"""How a spec writes each kind that takes something other than a list of names, and the
policy's fields that gives."""


def _written(kind: str) -> Any:
    """``kind`` as a spec's choice writes it."""
    if not POLICIES[kind].labelled:
        return kind
    return {"label": "mine", kind: WRITTEN[kind][0] if kind in WRITTEN else list(NAMES)}


def _policy(kind: str) -> LayerPolicy:
    if not POLICIES[kind].labelled:
        return LayerPolicy(kind=kind)
    return LayerPolicy(kind=kind, **(WRITTEN[kind][1] if kind in WRITTEN else {"names": NAMES}))


def _layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(checkpoint_name(x @ w, "mlpwi")) @ w.T


@pytest.mark.parametrize("kind", list(POLICIES))
def test_a_kind_parses_from_a_spec(kind: str) -> None:
    choice = PolicyChoice.model_validate(_written(kind))
    assert choice.policy == _policy(kind)
    assert LayerPolicy.model_validate_json(choice.policy.model_dump_json()) == choice.policy


@pytest.mark.parametrize("kind", list(POLICIES))
def test_a_kind_checkpoints_as_it_says_and_keeps_the_gradients(kind: str) -> None:
    plan = RematPlan.uniform(_policy(kind), 1)
    w, x = jnp.eye(4) * 0.5 + 0.1, jnp.arange(8.0).reshape(2, 4) / 8
    wrapped = plan.wrap(lambda x: _layer(w, x), 0)
    eqns = jax.make_jaxpr(wrapped)(x).eqns
    assert any(e.primitive.name.startswith(("checkpoint", "remat")) for e in eqns) == POLICIES[kind].checkpoints
    grads = jax.jit(jax.grad(lambda x: wrapped(x).sum()))(x)
    assert jnp.allclose(grads, jax.grad(lambda x: _layer(w, x).sum())(x), rtol=1e-6)


@pytest.mark.parametrize("kind", list(POLICIES))
def test_a_kind_is_written_for_maxtext_as_its_hook_says(kind: str) -> None:
    """``--format maxtext`` asks the kind: its form, or its own reason why MaxText has none."""
    plan = RematPlan.uniform(_policy(kind), 2)
    hook = POLICIES[kind].maxtext
    if hook is None:
        with pytest.raises(SpecError, match=re.escape(POLICIES[kind].no_maxtext)):
            maxtext(plan)
        return
    form = hook(_policy(kind))
    settings = maxtext(plan)
    if form == "full":
        assert settings == {"remat_policy": "full"}
    else:
        device, offload = form
        assert {n for n, s in settings.items() if s == "device"} - {PINNED} == set(device) - {PINNED}
        assert {n for n, s in settings.items() if s == "offload"} == set(offload)


def test_a_new_kind_is_one_registration_export_included() -> None:
    """A kind registered here (MaxText's ``minimal``: its matmul outputs kept) parses and
    exports with nothing else changed."""
    kept = frozenset({"query_proj", "key_proj", "value_proj", "mlpwi", "mlpwo", "out_proj"})
    register_policy(PolicyKind(
        "minimal_like", "save MaxText's matmul outputs", lambda p: jax.checkpoint_policies.save_only_these_names(*kept),
        maxtext=lambda p: (kept, frozenset()),
    ))
    try:
        assert PolicyChoice.model_validate("minimal_like").policy == LayerPolicy(kind="minimal_like")
        settings = maxtext(RematPlan.uniform(LayerPolicy(kind="minimal_like"), 3))
        assert {n for n, s in settings.items() if s == "device"} == kept | {PINNED}
    finally:
        del POLICIES["minimal_like"]


def test_an_unknown_kind_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy kind 'everything'; expected one of none, full"):
        LayerPolicy(kind="everything")
    with pytest.raises(ValueError, match="unknown policy 'fulll'; expected one of none, full, dots, dots_no_batch"):
        PolicyChoice.model_validate("fulll")


def test_a_kind_is_registered_once() -> None:
    with pytest.raises(ValueError, match="'full' is registered already"):
        register_policy(PolicyKind("full", "again", lambda names: None))


def _saved(kind: str, names: tuple[str, ...], **fields: Any) -> set[str]:
    """What a layer with a named matmul (``a``), a named elementwise tensor (``b``) and an
    unnamed matmul saves for the backward pass under ``kind``, by JAX's own account
    (``saved_residuals``): ``named X``, ``dot`` (an unnamed matmul's output) or ``host``
    (a tensor offloaded to host memory)."""
    w = jnp.eye(4) * 0.5 + 0.1

    def layer(x: jax.Array) -> jax.Array:
        a = checkpoint_name(x @ w, "a")
        b = checkpoint_name(jnp.sin(a), "b")
        return (jnp.tanh(b @ w.T) * b).sum()  # the backward needs b and the unnamed matmul's output

    wrapped = RematPlan.uniform(LayerPolicy(kind=kind, names=names, **fields), 1).wrap(layer, 0)
    x = jnp.arange(8.0).reshape(2, 4) / 8
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(wrapped, x)
    return {
        "host" if "<host>" in why else
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
        workload={"factory": "tests.factories:over_declared"},
        space={"layout": "uniform", "choices": [
            {"label": "all_but_wi", "names_except": ["mlpwi", "never_tagged"]},
            {"label": "dnb_wo", "dots_no_batch_names": ["mlpwo"]},
        ]},
    ))
    with caplog.at_level("WARNING", logger="remat_search"):
        report = remat_search.run(spec)
    assert [(t.summary(), t.status) for t in report.trials] == [("all_but_wi×2", "measured"), ("dnb_wo×2", "measured")]
    for t in report.trials:
        assert t.peak_bytes and t.measurement is not None and t.measurement.grad_check is not None
        assert t.measurement.grad_check.failure() is None and t.measurement.grad_rel_error == 0.0  # one f32 device
    assert [r.getMessage() for r in caplog.records if "never tags" in r.getMessage()] == [
        "note: spec.space.choices: 'all_but_wi' names ['never_tagged'], which the traced step never tags with "
        + "checkpoint_name (it tags mlpwi, mlpwo): for those, the choice saves nothing"
    ]


def test_per_name_keeps_some_names_on_the_device_and_offloads_others() -> None:
    """Offloading compiles on CPU (it has no memory effect there): JAX's account still shows
    the offloaded tensor as host memory."""
    assert _saved("per_name", ("a",), offload=("b",)) == {"named a", "host"}
    assert _saved("per_name", (), offload=("b",)) == {"host"}
    assert _saved("per_name", ("a", "b")) == _saved("names", ("a", "b")) == {"named a", "named b"}
    assert LayerPolicy(kind="per_name", names=("a",), offload=("b",)).host_memory
    assert not LayerPolicy(kind="per_name", names=("a",)).host_memory


@pytest.mark.parametrize(("written", "error"), [
    ({"per_name": {}}, "per_name must map device and/or offload to lists of tensor names"),
    ({"per_name": {"device": ["a"], "remat": ["b"]}}, "per_name must map device and/or offload"),
    ({"per_name": {"device": ["a"], "offload": ["a"]}}, "['a'] are both kept on the device and offloaded"),
    ({"function": "not a path"}, "expected an import path 'package.module:function', got 'not a path'"),
    ({"function": ["a:b"]}, "function must be an import path"),
    ({"names": ["a"], "function": "a:b"}, "a labelled choice needs exactly one of names: [...]"),
])
def test_a_malformed_per_name_or_function_choice_says_what_was_expected(written: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        PolicyChoice.model_validate({"label": "mine", **written})


def test_the_plans_written_before_per_name_and_function_keep_their_text_and_digest() -> None:
    """Stored studies and the measurement cache key on a plan's canonical JSON: the new fields
    are left out when empty, so every plan of the older kinds is the text it was."""
    kinds = [("none", ()), ("full", ()), ("dots", ()), ("dots_no_batch", ()), ("names", ("out_proj", "context")),
             ("names_except", ("mlpwi",)), ("dots_no_batch_names", ("mlpwo",)), ("offload", ("mlpwi",))]
    plan = RematPlan(layers=tuple(LayerPolicy(kind=k, names=n) for k, n in kinds))
    assert plan.to_json() == (
        '{"layers":[{"kind":"none","names":[]},{"kind":"full","names":[]},{"kind":"dots","names":[]},'
        '{"kind":"dots_no_batch","names":[]},{"kind":"names","names":["context","out_proj"]},'
        '{"kind":"names_except","names":["mlpwi"]},{"kind":"dots_no_batch_names","names":["mlpwo"]},'
        '{"kind":"offload","names":["mlpwi"]}]}'
    )
    assert plan.digest == "fb3e68ce466354b8"
    assert RematPlan(layers=plan.layers, layout="nested").digest == "a98c0e23b798c651"
    from tests.conftest import spec_dict

    space = parse_spec(spec_dict("sqlite:///x.db")).model_dump(mode="json")["space"]
    assert {key for choice in space["choices"] for key in choice["policy"]} == {"kind", "names"}


def test_the_softmax_policy_saves_the_attention_probabilities_only() -> None:
    """``tests.policies:save_softmax`` in a block of the built-in transformer: by JAX's own
    account the one tensor it saves is softmax's output, batch × heads × queries × keys."""
    from remat_search.spec.workloads import TransformerConfig
    from remat_search.workloads.transformer import Block

    config = TransformerConfig(kind="transformer", layers=1, d_model=32, heads=2, d_ff=64, seq_len=8, batch=2, vocab=16)
    block, x = Block(config), jnp.ones((2, 8, 32))
    params = block.init(jax.random.key(0), x)
    policy = LayerPolicy(kind="function", function="tests.policies:save_softmax")
    wrapped = RematPlan.uniform(policy, 1).wrap(lambda x: block.apply(params, x).sum(), 0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(wrapped, x)
    saved = [line for line in printed.getvalue().splitlines() if "from a constant" not in line and "from the argument" not in line]
    assert len(saved) == 1 and saved[0].startswith("f32[2,2,8,8] output of div from "), saved
    import inspect

    from remat_search.workloads import transformer

    source, first = inspect.getsourcelines(transformer._attention)
    softmax = first + next(i for i, line in enumerate(source) if "jax.nn.softmax(" in line)
    assert f"transformer.py:{softmax}:" in saved[0], saved  # the softmax line of dense attention


def test_a_function_and_a_per_name_choice_search_with_their_peaks_and_gradients(tmp_path: Path) -> None:
    """The v5e write-up's custom policy (save the attention softmax) named by import path, and
    a per-name choice, each measured in a real study on the tiny transformer."""
    from tests.conftest import TINY_TRANSFORMER, spec_dict

    spec = parse_spec(spec_dict(
        f"sqlite:///{tmp_path / 'studies.db'}", trials=2, confirm={"top": 0},
        workload={**TINY_TRANSFORMER, "layers": 1}, timing={"warmup": 0, "repeats": 1, "anchor": False},
        space={"layout": "uniform", "choices": [
            {"label": "save_softmax", "function": "tests.policies:save_softmax"},
            {"label": "qkv_device", "per_name": {"device": ["query_proj", "key_proj", "value_proj"]}},
        ]},
    ))
    report = remat_search.run(spec)
    assert [(t.summary(), t.status) for t in report.trials] == [
        ("save_softmax", "measured"), ("qkv_device", "measured"),
    ]
    for t in report.trials:
        assert t.peak_bytes and t.measurement is not None and t.measurement.grad_check is not None
        assert t.measurement.grad_check.failure() is None and t.measurement.grad_rel_error == 0.0  # one f32 device
    assert report.trials[0].plan.layers[0] == LayerPolicy(kind="function", function="tests.policies:save_softmax")

    # Another study of the same workload: the per-name plan is known by its text (cached); the
    # function's code may have changed since, so its plan is compiled and known by its program.
    again = remat_search.run(spec.model_copy(update={"study": "again"}))
    function, per_name = again.trials
    assert per_name.cached_from == "tiny#1" and function.cached_from is None
    assert function.same_program_as == "tiny#0"
