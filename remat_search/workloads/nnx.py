"""The ``nnx`` workload: a user's Flax NNX model, searched as it is written.

A spec names the model (its class, or a function returning it), its constructor's arguments
and the attribute holding its blocks (``blocks: "blocks"``, or a dotted path). Nothing of
the model is edited or subclassed. The loss rebuilds the model inside the traced step, puts
the step's parameters into it (``nnx.update``), replaces each element of the blocks' list by
a thin :class:`Checkpointed` module that calls the block through ``jax.checkpoint`` with its
layer's policy (:meth:`RematPlan.wrap`), and calls the model's own ``__call__``. So the model's
``__call__`` must run its blocks from that list (``for block in self.blocks: x = block(x)``),
which tracing checks: a block it never calls is a :class:`WorkloadError`. A stack of blocks made
with ``nnx.vmap`` and run with ``nnx.scan`` (Flax's scan-over-layers idiom) is wrapped whole: its
body takes one policy, and its layers are the stack's length, checked against the layers the
traced program runs.

The parameters are the model's own (``nnx.state(model, nnx.Param)`` as a plain dict); the
batch and the loss are the spec's (:mod:`~remat_search.workloads.inputs`: tokens and next-token
cross-entropy by default), or the model's own ``fn(model, batch) -> scalar`` (``model_loss``),
given the wrapped model. ``tensor_names`` are the ``checkpoint_name`` tags the traced program
emits, found by tracing, not declared. ``flat`` plans only: the model runs its chain itself, so a
``nested`` plan cannot regroup it.

:func:`apply_nnx` applies a plan to a trainer's model through the same wrapping
(:func:`wrap_blocks`), so the program it trains is the one the search measured.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from remat_search.errors import SpecError, WorkloadError, first_line
from remat_search.imports import import_object
from remat_search.plans.plan import RematPlan
from remat_search.spec.workloads import NnxConfig, rule_targets
from remat_search.workloads.base import PyTree, Workload
from remat_search.workloads.inputs import Inputs, check_scalar, described
from remat_search.workloads.sharding import flax_tracing
from remat_search.workloads.tracing import layer_runs, mark_layer, traced_names, without_marks

M = TypeVar("M", bound=nnx.Module)


class Checkpointed(nnx.Module):
    """A block called through ``wrap`` (``fn -> jax.checkpoint(fn, policy=...)``): its
    variables and its array arguments go in as arguments, the rest is closed over; the
    block's updated variables (an RNG count, statistics) are written back after the call."""

    def __init__(self, block: nnx.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
                 on_call: Callable[[], None] | None = None, mark: int | None = None) -> None:
        self.block = block
        self._wrap = wrap
        self._on_call = on_call
        self._mark = mark
        """A structure trace's unit number: the output is tagged with it (:func:`mark_layer`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._on_call is not None:
            self._on_call()
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]
        graphdef, state = nnx.split(self.block)

        def pure(state: nnx.State, arrays: list[jax.Array]) -> tuple[Any, nnx.State]:
            full = list(leaves)
            for i, a in zip(dynamic, arrays, strict=True):
                full[i] = a
            call_args, call_kwargs = jax.tree.unflatten(tree, full)
            module = nnx.merge(graphdef, state)
            return module(*call_args, **call_kwargs), nnx.state(module)

        out, new_state = self._wrap(pure)(state, [leaves[i] for i in dynamic])
        nnx.update(self.block, new_state)
        return out if self._mark is None else mark_layer(out, self._mark)


def find_blocks(model: nnx.Module, path: str, *, field: str) -> tuple[Any, str, Any]:
    """``(owner, attribute, blocks)``: the blocks at the attribute ``path`` (dotted:
    ``decoder.layers``) of ``model`` and where they hang: a list of modules, or one module whose
    parameters are stacked over its layers (made with ``nnx.vmap``, run with ``nnx.scan``); else
    a one-line :class:`WorkloadError` naming ``field`` (the spec's ``workload.blocks``, or
    ``apply_nnx``'s ``blocks``)."""
    owner, parents = [model], path.split(".")
    for i, name in enumerate(parents):
        if not hasattr(owner[-1], name):
            held = sorted(k for k in vars(owner[-1]) if not k.startswith("_"))
            raise WorkloadError(
                f"{field}: {type(owner[-1]).__name__} has no attribute {'.'.join(parents[: i + 1])!r}"
                f" (it has {held})"
            )
        owner.append(getattr(owner[-1], name))
    blocks = owner[-1]
    if isinstance(blocks, Checkpointed):
        blocks = blocks.block
    if isinstance(blocks, nnx.Module) and not isinstance(blocks, nnx.List):
        stack_length(blocks, path, field=field)
        return owner[-2], parents[-1], blocks
    if not isinstance(blocks, (list, tuple, nnx.List)) or not len(blocks) or not all(
        isinstance(b, nnx.Module) for b in blocks
    ):
        raise WorkloadError(
            f"{field}: {path!r} is {type(blocks).__name__}, expected a non-empty list of the "
            "nnx.Modules the model's __call__ runs (an nnx.List or a list), or one stack of them made with nnx.vmap"
        )
    return owner[-2], parents[-1], blocks


def stack_length(stack: nnx.Module, path: str, *, field: str) -> int:
    """The layers of a stacked block (made with ``nnx.vmap``): the one leading axis of its
    parameters; else a one-line :class:`WorkloadError` naming ``field``."""
    leading = {v.shape[0] if v.ndim else None for v in jax.tree.leaves(nnx.state(stack, nnx.Param))}
    if len(leading) != 1 or None in leading:
        raise WorkloadError(
            f"{field}: {path!r} is one {type(stack).__name__} whose parameters are not stacked over layers "
            f"(leading axes {sorted(leading, key=str)}); expected a list of blocks, or one block made with nnx.vmap"
        )
    return int(next(iter(leading)))  # type: ignore[arg-type]


def block_units(blocks: Any, path: str, *, field: str) -> tuple[int, ...]:
    """The layers of each unit of ``blocks`` (:func:`find_blocks`): one for each block of a
    list, the stack's length for a stacked block."""
    if isinstance(blocks, nnx.Module) and not isinstance(blocks, nnx.List):
        return (stack_length(blocks, path, field=field),)
    return (1,) * len(blocks)


def wrap_blocks(model: nnx.Module, plan: RematPlan, path: str, *, field: str, mark: bool = False) -> list[int]:
    """Replace, in place, each block of the list at ``path`` in ``model`` by a
    :class:`Checkpointed` one that calls it with its layer's policy of ``plan`` (a block
    already wrapped is rewrapped, not wrapped twice); a stacked block (``nnx.vmap``-made) by one
    that calls each layer's slice with the stack's one policy (``prevent_cse=False``, as scanned
    remat wants). Returns each unit's count of calls, which grows as the model runs, so a caller
    can tell a block the model never ran. ``mark``: tag each unit's output for a structure trace.

    The one wrapping of an NNX model: the search measures a plan through it and
    :func:`apply_nnx` applies one through it, so the program a trainer runs is the measured one."""
    if plan.layout != "flat":
        raise SpecError(
            f"plan: layout {plan.layout!r} is not supported for nnx models, which run their blocks "
            "themselves; use layout 'flat' (space.nested: false)"
        )
    owner, attribute, blocks = find_blocks(model, path, field=field)
    units = block_units(blocks, path, field=field)
    if len(plan.layers) != sum(units):
        raise SpecError(f"plan: has {len(plan.layers)} layers, the model has {sum(units)} in {path!r}")
    calls = [0] * len(units)

    def counter(i: int) -> Callable[[], None]:
        return lambda: calls.__setitem__(i, calls[i] + 1)

    if units != (1,) * len(units):  # one stacked block: one body, one policy
        if len(set(plan.layers)) > 1:
            raise SpecError(f"plan: the {units[0]} layers of {path!r} are one stack (nnx.vmap), whose one body "
                            "takes one policy; it gives them several")
        wrap = functools.partial(plan.wrap, layer=0, prevent_cse=False)
        setattr(owner, attribute, Checkpointed(blocks, wrap, counter(0), 0 if mark else None))
        return calls

    wrapped = [
        Checkpointed(b.block if isinstance(b, Checkpointed) else b, functools.partial(plan.wrap, layer=i), counter(i),
                     i if mark else None)
        for i, b in enumerate(blocks)
    ]
    if isinstance(blocks, tuple):
        setattr(owner, attribute, tuple(wrapped))
    else:
        for i, w in enumerate(wrapped):
            blocks[i] = w
    return calls


def unwrap_blocks(model: nnx.Module, path: str, *, field: str) -> None:
    """Undo :func:`wrap_blocks`, in place: each :class:`Checkpointed` block at ``path`` replaced
    by the block it holds, so the model's parameters are at their own paths again."""
    owner, attribute, blocks = find_blocks(model, path, field=field)
    if isinstance(getattr(owner, attribute), Checkpointed):  # a stack
        setattr(owner, attribute, blocks)
    elif isinstance(blocks, tuple):
        setattr(owner, attribute, tuple(b.block if isinstance(b, Checkpointed) else b for b in blocks))
    else:
        for i, b in enumerate(blocks):
            if isinstance(b, Checkpointed):
                blocks[i] = b.block


def apply_nnx(model: M, plan: RematPlan, *, blocks: str = "blocks") -> M:
    """Checkpoint each block of ``model`` with its layer's policy of ``plan``, in place, with
    no edit to the model's code; returns ``model`` itself.

    ``blocks`` is the attribute (a dotted path: ``decoder.layers``) holding the list of blocks
    the model's ``__call__`` runs, as the spec's ``workload.blocks``; ``plan`` has one layer a
    block (:func:`remat_search.best_plan`'s ``.plan``, or :meth:`RematPlan.from_json`). Each
    block becomes a :class:`Checkpointed` one, as when the search measured the plan, so the
    model's parameters sit one level deeper (``blocks/0/block/...``): load a checkpoint before
    applying a plan. Applying another plan replaces the first. A plan of another length, or a
    ``nested`` one, is a :class:`SpecError`; a ``blocks`` that is no list of modules a
    :class:`WorkloadError`."""
    wrap_blocks(model, plan, blocks, field="blocks")
    return model


def _takes_rngs(constructor: Callable[..., Any]) -> bool:
    try:
        signature = inspect.signature(constructor.__init__ if isinstance(constructor, type) else constructor)
    except (TypeError, ValueError):
        return False
    return "rngs" in signature.parameters


class NnxWorkload(Workload):
    """A Flax NNX model whose blocks are checkpointed by a plan (see the module's text)."""

    def __init__(self, config: NnxConfig) -> None:
        self.config = config
        self.name = f"nnx {config.model}"
        self._constructor = import_object(config.model, "workload.model")
        self.inputs_of = Inputs(config)
        self._model_loss = import_object(config.model_loss, "workload.model_loss") if config.model_loss else None
        self._train_step = import_object(config.train_step, "workload.train_step") if config.train_step else None
        if config.train_step and not callable(self._train_step):
            raise WorkloadError(f"workload.train_step: {config.train_step!r} is not a function "
                                "(model, optimizer, batch) -> loss")
        abstract = nnx.eval_shape(lambda: self._build(jax.random.key(0)))
        self.stacks = block_units(find_blocks(abstract, config.blocks, field="workload.blocks")[2], config.blocks,
                                  field="workload.blocks")
        self.layers = sum(self.stacks)
        self._partitioning = self._read_partitioning(nnx.state(abstract, nnx.Param))
        self._graphdef, self._params_shape, rest = nnx.split(abstract, nnx.Param, ...)
        self._stateless = not jax.tree.leaves(rest)
        """No variables but parameters: the loss merges the model from them, else it rebuilds it."""
        self.tensor_names = self._traced_names()

    def _build(self, key: jax.Array) -> nnx.Module:
        """The model, its parameters drawn from ``key`` (``rngs=nnx.Rngs(key)`` when it takes one)."""
        kwargs = dict(self.config.args)
        if "rngs" not in kwargs and _takes_rngs(self._constructor):
            kwargs["rngs"] = nnx.Rngs(key)
        try:  # sharding metadata kept, not applied: the step's shardings place the parameters
            with nnx.use_eager_sharding(False):
                model = self._constructor(**kwargs)
        except Exception as e:  # noqa: BLE001 - the user's constructor's failure, in one line
            first = first_line(e)
            raise WorkloadError(f"workload.model: {self.config.model!r} raised {type(e).__name__}: {first}") from None
        if not isinstance(model, nnx.Module):
            raise WorkloadError(
                f"workload.model: {self.config.model!r} returned {type(model).__name__}, expected a flax.nnx.Module"
            )
        return model

    def _read_partitioning(self, params: nnx.State) -> PyTree | None:
        """Each parameter's ``out_sharding`` metadata (``nnx.with_partitioning``) as a
        ``PartitionSpec``, logical names mapped by ``workload.logical_axis_rules``; None where
        no parameter has any."""
        annotated = [v for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
                     if isinstance(v, nnx.Variable) and v.get_metadata().get("out_sharding")]
        if not annotated:
            return None
        with self.tracing():
            return nnx.to_pure_dict(nnx.get_partition_spec(params))

    def param_partitioning(self) -> PyTree | None:
        """The model's own (see :meth:`_read_partitioning`)."""
        return self._partitioning

    def rule_axes(self) -> frozenset[str]:
        """The mesh axes ``workload.logical_axis_rules`` map onto (none without rules)."""
        return rule_targets(self.config.logical_axis_rules)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        """``workload.logical_axis_rules`` in force, and the target's mesh where there is one, so
        the model's own sharding constraints apply."""
        return flax_tracing(self.config.logical_axis_rules, self.mesh)

    def init_params(self, key: jax.Array) -> PyTree:
        """The model's ``nnx.Param`` s, as a plain nested dict (list indices are int keys)."""
        return nnx.to_pure_dict(nnx.state(self._build(key), nnx.Param))

    def make_batch(self, key: jax.Array) -> PyTree:
        return self.inputs_of.make_batch(key)

    def note(self) -> str | None:
        """The layers as the model holds them, where it stacks them."""
        return None if self.stacks == (1,) * self.layers else (
            f"layers: {self.config.blocks} ×{self.layers} (one stack, nnx.vmap)")

    def forward(self, plan: RematPlan, params: PyTree, batch: PyTree, *, mark: bool = False) -> Any:
        """``model(batch)`` (its model input) with ``params`` and each block checkpointed by
        ``plan``: the model's own ``__call__``, its blocks replaced by :class:`Checkpointed` ones."""
        return self._run(plan, params, lambda model: model(*self.inputs_of.model_args(batch)), mark=mark)

    def _run(self, plan: RematPlan, params: PyTree, call: Callable[[nnx.Module], Any], *, mark: bool = False) -> Any:
        """``call(model)``, the model holding ``params`` and its blocks wrapped by ``plan``
        (:func:`wrap_blocks`); a block the call never ran is a :class:`WorkloadError`."""
        model, calls = self._model(plan, params, mark=mark)
        out = call(model)
        self._check_calls(calls)
        return out

    def _model(self, plan: RematPlan, params: PyTree, *, mark: bool = False) -> tuple[nnx.Module, list[int]]:
        """The model holding ``params``, its blocks wrapped by ``plan`` (:func:`wrap_blocks`),
        and the count of each unit's calls."""
        if len(plan.layers) != self.layers:
            raise SpecError(f"plan: has {len(plan.layers)} layers, the workload has {self.layers}")
        if self._stateless:
            state = jax.tree.map(lambda a: a, self._params_shape)  # a copy to fill in
            nnx.replace_by_pure_dict(state, params)
            model = nnx.merge(self._graphdef, state)
        else:  # rebuilt for its other variables (RNG streams, statistics); its parameters' init is dead code
            model = self._build(jax.random.key(0))
            state = nnx.state(model, nnx.Param)
            nnx.replace_by_pure_dict(state, params)
            nnx.update(model, state)
        return model, wrap_blocks(model, plan, self.config.blocks, field="workload.blocks", mark=mark)

    def _check_calls(self, calls: list[int]) -> None:
        """A block the model never ran is a :class:`WorkloadError`."""
        missed = [i for i, n in enumerate(calls) if n == 0]
        if missed:
            raise WorkloadError(
                f"workload.blocks: the model's __call__ did not call block(s) {missed} of {self.config.blocks!r}; "
                f"it must run its blocks from that attribute (for block in self.{self.config.blocks}: ...)"
            )

    def init_opt_state(self, params: PyTree) -> PyTree:
        """With ``workload.train_step``: the variables of an ``nnx.Optimizer`` of the spec's
        optimizer over the model with its blocks checkpointed (as a trainer makes it after
        :func:`apply_nnx`), as a plain dict; else the optax state of the parameters."""
        if self._train_step is None:
            return super().init_opt_state(params)
        model, _ = self._model(self.baseline_plan(), params)
        return nnx.to_pure_dict(nnx.state(nnx.Optimizer(model, self.optimizer(), wrt=nnx.Param)))

    def train_fn(self, plan: RematPlan, mesh: Any = None, *, mark: bool = False) -> Callable[[PyTree, PyTree], Any]:
        """With ``workload.train_step``: that step, ``fn(model, optimizer, batch) -> loss``, given
        the model with ``plan``'s checkpoints and its ``nnx.Optimizer``, which it updates in
        place; the new state is read back from both. Else remat-search's own step."""
        if self._train_step is None:
            return super().train_fn(plan, mesh) if not mark else self._marked(plan)
        own, where = self._train_step, f"workload.train_step: {self.config.train_step!r}"

        def train_step(state: PyTree, batch: PyTree) -> tuple[PyTree, jax.Array]:
            params, opt_state = state
            model, calls = self._model(plan, params, mark=mark)
            optimizer = nnx.Optimizer(model, self.optimizer(), wrt=nnx.Param)
            variables = nnx.state(optimizer)
            nnx.replace_by_pure_dict(variables, opt_state)
            nnx.update(optimizer, variables)
            loss = own(model, optimizer, batch)
            if not isinstance(loss, jax.Array) or loss.shape != ():
                raise WorkloadError(f"{where} returned {described(loss)}, expected the loss, a scalar")
            self._check_calls(calls)
            unwrap_blocks(model, self.config.blocks, field="workload.blocks")
            new_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            return (new_params, nnx.to_pure_dict(nnx.state(optimizer))), loss

        return train_step

    def _marked(self, plan: RematPlan) -> Callable[[PyTree, PyTree], Any]:
        """The loss with each unit's output tagged (:func:`mark_layer`), for the structure trace."""
        loss = self.loss(plan, mark=True)
        return lambda state, batch: loss(state[0], batch)

    def loss(self, plan: RematPlan, *, mark: bool = False) -> Callable[[PyTree, PyTree], jax.Array]:
        """The scalar loss: ``workload.model_loss(model, batch)`` on the wrapped model where
        the spec names one, else ``workload.loss`` (or next-token cross-entropy) of its outputs."""
        model_loss = self._model_loss

        def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
            if model_loss is not None:
                return self._run(plan, params, lambda model: model_loss(model, batch), mark=mark)
            return self.inputs_of.loss(self.forward(plan, params, batch, mark=mark), batch)

        return loss_fn

    def _traced_names(self) -> frozenset[str]:
        """Trace the loss once with no remat: checks the structure (the layers the program runs
        are the layers the model holds), the outputs' shape, and returns the names the program tags."""
        c = self.config
        params = jax.eval_shape(self.init_params, jax.random.key(0))
        batch = self.inputs_of.abstract_batch()
        plan = RematPlan.uniform("none", self.layers)
        try:
            if c.model_loss is None and c.train_step is None:
                self.inputs_of.check_outputs(jax.eval_shape(functools.partial(self.forward, plan), params, batch))
            state = (params, jax.eval_shape(self.init_opt_state, params)) if c.train_step else (params, None)
            jaxpr = jax.make_jaxpr(self.train_fn(plan, mark=True))(state, batch)
        except (WorkloadError, SpecError):
            raise
        except Exception as e:  # noqa: BLE001 - the user's model or loss fails to trace
            first = first_line(e)
            what = f"{c.train_step!r}" if c.train_step else f"{c.model!r}"
            raise WorkloadError(f"workload: {what} does not trace ({type(e).__name__}: {first})") from None
        if c.train_step is None:
            check_scalar(jaxpr, "workload.model_loss" if c.model_loss else "workload.loss")
        try:
            runs = layer_runs(jaxpr)
        except ValueError as e:
            raise WorkloadError(f"workload.blocks: the model {e}; run its blocks unrolled or with nnx.scan") from None
        ran = [runs.get(i, 0) for i in range(len(self.stacks))]
        if ran != list(self.stacks):
            raise WorkloadError(
                f"workload.blocks: the model's __call__ runs {sum(ran)} layer(s) of {c.blocks!r}, which holds "
                f"{self.layers}: its calls and its layers disagree"
            )
        if c.layers is not None and c.layers != self.layers:
            raise WorkloadError(f"workload.layers: the model runs {self.layers} layers of {c.blocks!r}, "
                                f"the spec says {c.layers}")
        return without_marks(traced_names(jaxpr))
