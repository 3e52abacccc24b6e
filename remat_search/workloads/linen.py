"""The ``linen`` workload: a user's Flax linen model, searched from a spec with no subclass.

The spec names the model (``model: "package.module:Decoder"`` and its ``args``) and its
layers: ``block`` (the class of its blocks) or ``blocks`` (the submodule names: ``blocks``
matches ``blocks`` and ``blocks_0``, ``blocks_1``, …, as a list attribute made in ``setup``
names its items). The model's source is not touched. While the loss runs the model,
``nn.intercept_methods`` catches each call of a matching module's ``__call__``; the ``i``-th
such call in the forward pass is layer ``i``, and it runs inside ``nn.checkpoint`` (the
lifted ``jax.checkpoint``, which is what ``nn.remat(Block, policy=...)`` applies) with the
plan's policy for ``i`` (:meth:`~remat_search.plans.plan.RematPlan.policy_for`), or as it is for
``none``. Calls inside a layer are the layer's own. A model whose structure does not allow
this (no matching call, or a different number of calls than the plan has layers) is a
one-line :class:`~remat_search.errors.WorkloadError`.

Parameters come from the model's ``init`` (its ``params`` collection); the batch is random
int32 tokens ``[batch, seq_len]`` in ``[0, vocab)``; the loss is ``loss(logits, tokens)``
if the spec names one, else the next-token cross-entropy. ``tensor_names`` are the
``checkpoint_name`` tags the traced forward pass emits.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from remat_search.errors import SpecError, WorkloadError
from remat_search.imports import import_object
from remat_search.plans.plan import RematPlan
from remat_search.spec.workloads import LinenConfig, rule_targets
from remat_search.workloads.base import PyTree, Workload, next_token_loss
from remat_search.workloads.sharding import flax_tracing
from remat_search.workloads.tracing import traced_names

_inside_layer: contextvars.ContextVar[bool] = contextvars.ContextVar("inside_layer", default=False)
"""True while a layer runs: the calls it makes are its own, not layers."""


class LinenWorkload(Workload):
    """A linen model of a :class:`LinenConfig`, its layers checkpointed by the plan."""

    def __init__(self, config: LinenConfig) -> None:
        self.config = config
        self.name = f"linen:{config.model}"
        found = import_object(config.model, "workload.model")
        self.module = found if isinstance(found, nn.Module) and not config.args else _call(found, config.args, "workload.model")
        if not isinstance(self.module, nn.Module):
            raise WorkloadError(
                f"workload.model: {config.model!r} gave {type(self.module).__name__}, expected a flax.linen Module"
            )
        self.block_cls = import_object(config.block, "workload.block") if config.block else None
        if self.block_cls is not None and not (isinstance(self.block_cls, type) and issubclass(self.block_cls, nn.Module)):
            raise WorkloadError(f"workload.block: {config.block!r} is not a flax.linen Module class")
        self.loss_fn = import_object(config.loss, "workload.loss") if config.loss else next_token_loss
        if not callable(self.loss_fn):
            raise WorkloadError(f"workload.loss: {config.loss!r} is not a function (logits, tokens) -> loss")
        self.layers, self.tensor_names = self._inspect()

    def _is_layer(self, module: nn.Module, method_name: str) -> bool:
        """Whether a call of ``module.method_name`` is one of the layers the spec names."""
        if method_name != "__call__" or _inside_layer.get():
            return False
        if self.block_cls is not None and not isinstance(module, self.block_cls):
            return False
        pattern = self.config.blocks
        return pattern is None or re.fullmatch(rf"{re.escape(pattern)}(_\d+)?", module.name or "") is not None

    def _inspect(self) -> tuple[int, frozenset[str]]:
        """Trace the forward pass once: how many layer calls it makes, which names it emits,
        and that its logits have the shape the loss needs."""
        c = self.config
        where = "workload.block" if c.block else "workload.blocks"
        wanted = repr(c.block) if c.block else f"named {c.blocks!r} or {c.blocks + '_<i>'!r}"
        calls: list[str] = []

        def count(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
            if not self._is_layer(context.module, context.method_name):
                return next_fun(*args, **kwargs)
            calls.append(context.module.name or "")
            with _layer():
                return next_fun(*args, **kwargs)

        def forward(params: PyTree, tokens: jax.Array) -> jax.Array:
            with nn.intercept_methods(count):
                return self.module.apply({"params": params}, tokens)

        params = self._init_shapes()
        tokens = jax.ShapeDtypeStruct((c.batch, c.seq_len), jnp.int32)
        try:
            jaxpr = jax.make_jaxpr(forward)(params, tokens)
        except Exception as e:  # noqa: BLE001 - a model that does not trace is the user's
            raise WorkloadError(f"workload.model: {c.model!r} does not run on tokens [{c.batch}, {c.seq_len}] "
                                f"({type(e).__name__}: {_first_line(e)})") from None
        if not calls:
            raise WorkloadError(
                f"{where}: the model makes no call of a module {wanted}, so there are no layers to checkpoint; "
                "name the class of its blocks (workload.block) or the attribute that holds them (workload.blocks)"
            )
        (logits,) = jaxpr.out_avals if len(jaxpr.out_avals) == 1 else (None,)
        expected = (c.batch, c.seq_len, c.vocab)
        if logits is None or tuple(logits.shape) != expected:
            got = [tuple(a.shape) for a in jaxpr.out_avals]
            raise WorkloadError(f"workload.model: returns {got}, expected logits of shape {list(expected)}")
        return len(calls), traced_names(jaxpr)

    def _init_shapes(self) -> PyTree:
        c = self.config
        tokens = jax.ShapeDtypeStruct((1, c.seq_len), jnp.int32)
        try:
            variables = jax.eval_shape(self.module.init, jax.random.key(0), tokens)
        except Exception as e:  # noqa: BLE001
            raise WorkloadError(f"workload.model: {c.model!r} does not initialise "
                                f"({type(e).__name__}: {_first_line(e)})") from None
        others = sorted(set(variables) - {"params"})
        if others:
            raise WorkloadError(f"workload.model: has variable collections {others} besides params; "
                                "only params are supported (use workload.factory)")
        self._boxed = variables.get("params", {})
        return nn.meta.unbox(self._boxed)

    def init_params(self, key: jax.Array) -> PyTree:
        tokens = jnp.zeros((1, self.config.seq_len), jnp.int32)
        return nn.meta.unbox(self.module.init(key, tokens)["params"])

    def param_partitioning(self) -> PyTree | None:
        """The model's own: each parameter's ``nn.with_partitioning`` mesh axes, or its
        ``nn.with_logical_partitioning`` names mapped by ``workload.logical_axis_rules``
        (unannotated parameters replicated); None where no parameter is annotated."""
        boxes = jax.tree.leaves(self._boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
        if not any(isinstance(b, nn.Partitioned) for b in boxes):
            return None
        rules = self.config.logical_axis_rules
        logical = sorted({n for b in boxes if isinstance(b, nn.LogicallyPartitioned) for n in b.names if n})
        if logical and rules is None:
            raise WorkloadError(
                f"workload.logical_axis_rules: the model partitions its parameters by logical names {logical}; "
                "map them onto the mesh: [[name, mesh axis or null], ...]"
            )

        def spec(box: Any) -> PartitionSpec:
            if isinstance(box, nn.LogicallyPartitioned):
                return PartitionSpec(*nn.logical_to_mesh_axes(box.names, rules))
            if isinstance(box, nn.Partitioned):
                return PartitionSpec(*box.names)
            return PartitionSpec()

        return jax.tree.map(spec, self._boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))

    def rule_axes(self) -> frozenset[str]:
        """The mesh axes ``workload.logical_axis_rules`` map onto (none without rules)."""
        return rule_targets(self.config.logical_axis_rules)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        """``workload.logical_axis_rules`` in force, and the target's mesh where there is one, so
        the model's own sharding constraints (``nn.with_logical_constraint``) apply."""
        return flax_tracing(self.config.logical_axis_rules, self.mesh)

    def make_batch(self, key: jax.Array) -> PyTree:
        c = self.config
        return jax.random.randint(key, (c.batch, c.seq_len), 0, c.vocab, dtype=jnp.int32)

    def forward(self, plan: RematPlan | None = None) -> Callable[[PyTree, jax.Array], jax.Array]:
        """``(params, tokens) -> logits``, each layer checkpointed by ``plan`` (None: as the
        model is, no interception)."""
        if plan is None:
            return lambda params, tokens: self.module.apply({"params": params}, tokens)
        if plan.layout != "flat":
            raise SpecError(f"plan: layout {plan.layout!r} is not supported for linen models; use layout 'flat'")
        if len(plan.layers) != self.layers:
            raise SpecError(f"plan: has {len(plan.layers)} layers, the workload has {self.layers}")

        def apply(params: PyTree, tokens: jax.Array) -> jax.Array:
            with _checkpointed_layers(self, plan) as calls:
                logits = self.module.apply({"params": params}, tokens)
            if len(calls) != self.layers:
                raise WorkloadError(f"workload: the model made {len(calls)} layer calls, {self.layers} when inspected")
            return logits

        return apply

    def loss(self, plan: RematPlan) -> Callable[[PyTree, PyTree], jax.Array]:
        forward = self.forward(plan)
        return lambda params, tokens: self.loss_fn(forward(params, tokens), tokens)


@contextlib.contextmanager
def _checkpointed_layers(workload: LinenWorkload, plan: RematPlan) -> Iterator[list[str]]:
    """While active, the ``i``-th layer call runs under ``nn.checkpoint`` with the policy of
    ``plan``'s layer ``i`` (unwrapped for ``none``). Yields the list of layer calls made."""
    calls: list[str] = []

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        if not workload._is_layer(context.module, context.method_name):
            return next_fun(*args, **kwargs)
        layer = len(calls)
        calls.append(context.module.name or "")
        if layer >= len(plan.layers):
            raise WorkloadError(
                f"workload: the model made more layer calls than the {len(plan.layers)} it made when inspected"
            )
        if not plan.layers[layer].checkpoints:
            with _layer():
                return next_fun(*args, **kwargs)
        # Arrays pass through the checkpoint as arguments; the rest (flags, None) is closed over.
        leaves, tree = jax.tree.flatten((args, kwargs))
        is_array = [isinstance(leaf, jax.Array) for leaf in leaves]

        def run(module: nn.Module, *arrays: jax.Array) -> Any:
            it = iter(arrays)
            a, k = jax.tree.unflatten(tree, [next(it) if arr else leaf for leaf, arr in zip(leaves, is_array, strict=True)])
            with _layer():
                return getattr(module, context.method_name)(*a, **k)

        checkpointed = nn.checkpoint(run, policy=plan.policy_for(layer), prevent_cse=True)
        return checkpointed(context.module, *(leaf for leaf, arr in zip(leaves, is_array, strict=True) if arr))

    with nn.intercept_methods(interceptor):
        yield calls


@contextlib.contextmanager
def _layer() -> Iterator[None]:
    """Marks the calls made inside a layer as the layer's own, not layers."""
    token = _inside_layer.set(True)
    try:
        yield
    finally:
        _inside_layer.reset(token)


def _call(fn: Any, args: dict[str, Any], where: str) -> Any:
    if not callable(fn):
        raise WorkloadError(f"{where}: {type(fn).__name__} is not callable")
    try:
        return fn(**args)
    except Exception as e:  # noqa: BLE001
        raise WorkloadError(f"{where}: raised {type(e).__name__}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]
