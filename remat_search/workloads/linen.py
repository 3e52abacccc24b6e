"""The ``linen`` workload: a user's Flax linen model, searched from a spec with no subclass.

The spec names the model (``model: "package.module:Decoder"`` and its ``args``) and its
layers: ``block`` (the class of its blocks) or ``blocks`` (the submodule names: ``blocks``
matches ``blocks`` and ``blocks_0``, ``blocks_1``, …, as a list attribute made in ``setup``
names its items, and the ``name`` given to an ``nn.scan`` of a block). The model's source is not
touched. While the model runs, ``nn.intercept_methods`` catches each ``__call__`` of a matching
module; each distinct module (its scope path) is one **unit**: an unrolled block is one layer, a
block run by ``nn.scan`` (or ``nn.scan(nn.remat(Block))``) is a **stack** of as many layers as
the scan's length. The layer count comes from the traced program (:func:`~remat_search.workloads.
tracing.layer_runs`), never from counting calls: a scan's body is traced more than once. Each
unit's call runs inside ``nn.checkpoint`` (the lifted ``jax.checkpoint``, which is what
``nn.remat(Block, policy=...)`` applies) with the plan's policy for its layers, one policy for a
stack's body, or as it is for ``none``. Calls inside a layer are the layer's own.

:func:`apply_linen` is that application for a trainer: ``model.apply`` with a plan applied, the
program the search measured. Parameters come from the model's ``init`` (its ``params``
collection); the inputs and loss are the spec's (:mod:`~remat_search.workloads.inputs`).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

from remat_search.errors import SpecError, WorkloadError, first_line
from remat_search.imports import import_object
from remat_search.plans.plan import RematPlan
from remat_search.spec.workloads import LinenConfig, rule_targets
from remat_search.workloads.base import PyTree, Workload
from remat_search.workloads.inputs import Inputs, check_scalar, described
from remat_search.workloads.sharding import flax_tracing
from remat_search.workloads.tracing import layer_runs, mark_layer, traced_names, without_marks

_inside_layer: contextvars.ContextVar[bool] = contextvars.ContextVar("inside_layer", default=False)
"""True while a layer runs: the calls it makes are its own, not layers."""


class LayerMatch(NamedTuple):
    """Which calls of a linen model are its layers: of an instance of ``block`` (a class), or of
    a submodule named ``blocks`` or ``blocks_<i>`` (None: any name)."""

    block: type | None
    blocks: str | None
    block_name: str | None = None
    """How the spec wrote ``block`` (``package.module:Block``), for an error."""

    def __call__(self, module: nn.Module, method_name: str) -> bool:
        if method_name != "__call__" or _inside_layer.get():
            return False
        if self.block is not None and not isinstance(module, self.block):
            return False
        return self.blocks is None or re.fullmatch(rf"{re.escape(self.blocks)}(_\d+)?", module.name or "") is not None

    def wanted(self) -> tuple[str, str]:
        """The spec field naming the layers, and what it names, for an error."""
        if self.block is not None:
            return "workload.block", repr(self.block_name or f"{self.block.__module__}:{self.block.__qualname__}")
        return "workload.blocks", f"named {self.blocks!r} or {str(self.blocks) + '_<i>'!r}"


class Unit(NamedTuple):
    """One layer module of a linen model: its scope path, its first layer and how many layers
    it runs (one unrolled, a scan's length stacked)."""

    path: tuple[str, ...]
    start: int
    layers: int


def linen_units(module: nn.Module, match: LayerMatch, variables: PyTree, *args: Any, **kwargs: Any) -> tuple[Unit, ...]:
    """The layer units of ``module.apply(variables, *args, **kwargs)`` (shapes suffice), in the
    program's order; a :class:`WorkloadError` naming the layers' field where it runs none, or a
    layer in a loop of no static length."""
    paths: list[tuple[str, ...]] = []

    field, wanted = match.wanted()

    def mark(next_fun: Callable[..., Any], call_args: Any, call_kwargs: Any, context: Any) -> Any:
        if match(context.module, "__call__") and _own_remat(type(context.module)):
            raise WorkloadError(
                f"{field}: {context.module.name!r} runs under the model's own nn.remat, so a "
                "plan's policy would run inside it and the model's remat would decide what is saved; build "
                "the model without its remat (its own remat flag or policy argument) to search it"
            )
        if not match(context.module, context.method_name):
            return next_fun(*call_args, **call_kwargs)
        path = tuple(context.module.scope.path)
        if path not in paths:
            paths.append(path)
        with _layer():
            return mark_layer(next_fun(*call_args, **call_kwargs), paths.index(path))

    def forward(v: PyTree, a: Any, k: Any) -> Any:
        with nn.intercept_methods(mark):
            return module.apply(v, *a, **k)

    jaxpr = jax.make_jaxpr(forward)(variables, args, kwargs)
    try:
        runs = layer_runs(jaxpr)
    except ValueError as e:
        raise WorkloadError(f"{field}: the model {e}; run its layers unrolled or with nn.scan") from None
    if not paths:
        raise WorkloadError(
            f"{field}: the model makes no call of a module {wanted}, so there are no layers to checkpoint; "
            "name the class of its blocks (workload.block) or the attribute that holds them (workload.blocks)"
        )
    units, start = [], 0
    for i, path in enumerate(paths):
        units.append(Unit(path, start, runs.get(i, 0)))
        start += runs.get(i, 0)
    return tuple(u for u in units if u.layers)


def _own_remat(cls: type) -> bool:
    """Whether ``cls`` is a class ``nn.remat`` (``nn.checkpoint``) made: its ``__call__`` runs
    under Flax's lifted checkpoint."""
    from flax.core import lift

    fn = cls.__dict__.get("__call__")
    while fn is not None:
        names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
        if "transform" in names:
            cell = fn.__closure__[names.index("transform")]
            if cell.cell_contents is lift.checkpoint:
                return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def apply_linen(model: nn.Module, plan: RematPlan, *, block: type | None = None,
                blocks: str | None = None) -> Callable[..., Any]:
    """``model.apply`` with ``plan`` applied: the returned ``apply(variables, *args, **kwargs)``
    runs ``model`` as written, each layer (the calls of an instance of ``block``, or of the
    submodules named ``blocks`` / ``blocks_<i>``, as the spec's ``workload.block`` and
    ``workload.blocks``) under ``nn.checkpoint`` with its policy of ``plan``; a scanned stack's
    body (``nn.scan(Block, ..., length=N)``) with the one policy of its ``N`` layers. The
    variables' tree is the model's own, whatever the plan, so a checkpoint loads as before.

    The layers are found by tracing the first call at its inputs' shapes (again at new shapes).
    A plan with another number of layers than the model runs, or two policies in one stack, is a
    :class:`SpecError`; no matching call a :class:`WorkloadError`. The search measures a plan
    through this function, so the program a trainer compiles with it is the measured one."""
    if block is None and blocks is None:
        raise SpecError("apply_linen: name the model's layers: block=BlockClass or blocks='attribute'")
    match = LayerMatch(block, blocks)
    found: dict[Any, tuple[Unit, ...]] = {}

    def apply(variables: PyTree, *args: Any, **kwargs: Any) -> Any:
        key = jax.tree.structure((variables, args, kwargs)), tuple(
            (getattr(a, "shape", None), str(getattr(a, "dtype", a))) for a in jax.tree.leaves((variables, args, kwargs))
        )
        if key not in found:
            found[key] = linen_units(model, match, *_shapes((variables, *args)), **_shapes(kwargs))
        with checkpointed_layers(match, plan, found[key]):
            return model.apply(variables, *args, **kwargs)

    return apply


def _shapes(tree: Any) -> Any:
    """Arrays as their shapes, anything else (flags, None) as it is."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, tree)


def check_plan(plan: RematPlan, units: Sequence[Unit]) -> None:
    """A :class:`SpecError` unless ``plan`` has a layer for each layer ``units`` run and one
    policy over each stack."""
    layers = sum(u.layers for u in units)
    if plan.layout != "flat":
        raise SpecError(f"plan: layout {plan.layout!r} is not supported for linen models; use layout 'flat'")
    if len(plan.layers) != layers:
        raise SpecError(f"plan: has {len(plan.layers)} layers, the model runs {layers}")
    for u in units:
        if len(set(plan.layers[u.start : u.start + u.layers])) > 1:
            raise SpecError(
                f"plan: layers {u.start}–{u.start + u.layers - 1} are one scanned stack "
                f"({'/'.join(u.path)}), whose one body takes one policy; it gives them several"
            )


@contextlib.contextmanager
def checkpointed_layers(match: LayerMatch, plan: RematPlan, units: Sequence[Unit]) -> Iterator[None]:
    """While active, each layer call of a unit of ``units`` runs under ``nn.checkpoint`` with
    its policy of ``plan`` (unwrapped for ``none``; ``prevent_cse=False`` in a stack, as scanned
    remat wants)."""
    check_plan(plan, units)
    by_path = {u.path: u for u in units}

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        if not match(context.module, context.method_name):
            return next_fun(*args, **kwargs)
        unit = by_path.get(tuple(context.module.scope.path))
        if unit is None:
            raise WorkloadError(f"workload: the model called a layer {'/'.join(context.module.scope.path)!r} "
                                "its structure trace did not run")
        if not plan.layers[unit.start].checkpoints:
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

        checkpointed = nn.checkpoint(run, policy=plan.policy_for(unit.start), prevent_cse=unit.layers == 1)
        return checkpointed(context.module, *(leaf for leaf, arr in zip(leaves, is_array, strict=True) if arr))

    with nn.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def _layer() -> Iterator[None]:
    """Marks the calls made inside a layer as the layer's own, not layers."""
    token = _inside_layer.set(True)
    try:
        yield
    finally:
        _inside_layer.reset(token)


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
        block_cls = import_object(config.block, "workload.block") if config.block else None
        if block_cls is not None and not (isinstance(block_cls, type) and issubclass(block_cls, nn.Module)):
            raise WorkloadError(f"workload.block: {config.block!r} is not a flax.linen Module class")
        self.match = LayerMatch(block_cls, config.blocks, config.block)
        self.inputs_of = Inputs(config)
        self._train_step = import_object(config.train_step, "workload.train_step") if config.train_step else None
        if config.train_step and not callable(self._train_step):
            raise WorkloadError(f"workload.train_step: {config.train_step!r} is not a function (state, batch) -> "
                                "(state, loss)")
        self.units, self.tensor_names = self._inspect()
        self.layers = sum(u.layers for u in self.units)
        self.stacks = tuple(u.layers for u in self.units)

    def _inspect(self) -> tuple[tuple[Unit, ...], frozenset[str]]:
        """Trace the forward pass once: its layer units, the names it emits, and that its
        outputs suit the loss."""
        c = self.config
        params = self._init_shapes()
        batch = self.inputs_of.abstract_batch()
        (arg,) = self.inputs_of.model_args(batch)
        try:
            units = linen_units(self.module, self.match, {"params": params}, arg)
            outputs = jax.eval_shape(lambda p, a: self.module.apply({"params": p}, a), params, arg)
        except WorkloadError:
            raise
        except Exception as e:  # noqa: BLE001 - a model that does not trace is the user's
            raise WorkloadError(f"workload.model: {c.model!r} does not run on {self.inputs_of.describe()} "
                                f"({type(e).__name__}: {first_line(e)})") from None
        if c.train_step is None:
            self.inputs_of.check_outputs(outputs)
        field = "workload.block" if c.block else "workload.blocks"
        for u in units:
            stacked = _leading_axes(params, u.path)
            if u.layers > 1 and stacked and stacked != {u.layers}:
                raise WorkloadError(
                    f"{field}: {'/'.join(u.path)!r} runs {u.layers} layers but holds parameters stacked "
                    f"over {sorted(stacked)}: its calls and its layers disagree"
                )
        layers = sum(u.layers for u in units)
        if c.layers is not None and layers != c.layers:
            raise WorkloadError(
                f"workload.layers: the model runs {layers} layers ({_describe(units)}), the spec says {c.layers}"
            )
        plan = RematPlan.uniform("none", layers)
        field = "workload.train_step" if c.train_step else "workload.loss"
        try:
            if c.train_step is None:
                jaxpr = jax.make_jaxpr(self.loss(plan, units))(params, batch)
            else:
                state = (params, jax.eval_shape(self.init_opt_state, params))
                jaxpr = jax.make_jaxpr(self.train_fn(plan, units=units))(state, batch)
        except WorkloadError:
            raise
        except Exception as e:  # noqa: BLE001
            raise WorkloadError(f"{field}: does not trace ({type(e).__name__}: {first_line(e)})") from None
        if c.train_step is None:
            check_scalar(jaxpr, field)
        return units, without_marks(traced_names(jaxpr))

    def note(self) -> str | None:
        """The layers as the model runs them, where it scans any."""
        return None if all(u.layers == 1 for u in self.units) else f"layers: {_describe(self.units)}"

    def _init_shapes(self) -> PyTree:
        c = self.config
        (arg,) = self.inputs_of.model_args(self.inputs_of.abstract_batch())
        try:
            variables = jax.eval_shape(self.module.init, jax.random.key(0), arg)
        except Exception as e:  # noqa: BLE001
            raise WorkloadError(f"workload.model: {c.model!r} does not initialise "
                                f"({type(e).__name__}: {first_line(e)})") from None
        others = sorted(set(variables) - {"params"})
        if others:
            raise WorkloadError(f"workload.model: has variable collections {others} besides params; "
                                "only params are supported (use workload.factory)")
        self._boxed = variables.get("params", {})
        return nn.meta.unbox(self._boxed)

    def init_params(self, key: jax.Array) -> PyTree:
        (arg,) = self.inputs_of.model_args(self.inputs_of.make_batch(jax.random.key(0)))
        return nn.meta.unbox(self.module.init(key, arg)["params"])

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
        return self.inputs_of.make_batch(key)

    def forward(self, plan: RematPlan | None = None,
                units: Sequence[Unit] | None = None) -> Callable[[PyTree, PyTree], Any]:
        """``(params, batch) -> outputs``, each layer checkpointed by ``plan`` (None: as the
        model is, no interception)."""
        model_args = self.inputs_of.model_args
        if plan is None:
            return lambda params, batch: self.module.apply({"params": params}, *model_args(batch))
        units = self.units if units is None else units
        check_plan(plan, units)

        def apply(params: PyTree, batch: PyTree) -> Any:
            with checkpointed_layers(self.match, plan, units):
                return self.module.apply({"params": params}, *model_args(batch))

        return apply

    def loss(self, plan: RematPlan, units: Sequence[Unit] | None = None) -> Callable[[PyTree, PyTree], jax.Array]:
        forward = self.forward(plan, units)
        return lambda params, batch: self.inputs_of.loss(forward(params, batch), batch)

    def init_opt_state(self, params: PyTree) -> PyTree:
        """With ``workload.train_step``: a ``TrainState``'s ``step`` and ``opt_state``, as
        ``TrainState.create`` makes them; else the optax state of the parameters."""
        if self._train_step is None:
            return super().init_opt_state(params)
        from flax.training.train_state import TrainState

        made = TrainState.create(apply_fn=self.module.apply, params=params, tx=self.optimizer())
        return {"step": made.step, "opt_state": made.opt_state}

    def train_fn(self, plan: RematPlan, mesh: Any = None, *,
                 units: Sequence[Unit] | None = None) -> Callable[[PyTree, PyTree], Any]:
        """With ``workload.train_step``: that step, ``fn(state, batch) -> (state, loss)``, given a
        ``TrainState`` whose ``apply_fn`` runs the model with ``plan``'s checkpoints and whose
        ``tx`` is the spec's optimizer. Else remat-search's own step."""
        if self._train_step is None:
            return super().train_fn(plan, mesh)
        from flax.training.train_state import TrainState

        units = self.units if units is None else units
        check_plan(plan, units)
        own, opt, where = self._train_step, self.optimizer(), f"workload.train_step: {self.config.train_step!r}"

        def apply_fn(variables: PyTree, *args: Any, **kwargs: Any) -> Any:
            with checkpointed_layers(self.match, plan, units):
                return self.module.apply(variables, *args, **kwargs)

        def train_step(state: PyTree, batch: PyTree) -> tuple[PyTree, jax.Array]:
            params, rest = state
            out = own(TrainState(step=rest["step"], apply_fn=apply_fn, params=params, tx=opt,
                                 opt_state=rest["opt_state"]), batch)
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], TrainState)):
                raise WorkloadError(f"{where} returned {described(out)}, expected (state, loss): the new "
                                    "TrainState and the loss")
            new, loss = out
            if not isinstance(loss, jax.Array) or loss.shape != ():
                raise WorkloadError(f"{where} returned a loss that is {described(loss)}, expected a scalar")
            return (new.params, {"step": new.step, "opt_state": new.opt_state}), loss

        return train_step


def _leading_axes(params: PyTree, path: tuple[str, ...]) -> set[int]:
    """The leading axes of the parameters under ``path`` (the scope's), empty where it holds none."""
    node: Any = params
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return set()
        node = node[part]
    return {a.shape[0] for a in jax.tree.leaves(node) if getattr(a, "ndim", 0)}


def _describe(units: Sequence[Unit]) -> str:
    """``layers/ ×4 (scanned)``, ``blocks_0, blocks_1``."""
    return ", ".join(f"{'/'.join(u.path)} ×{u.layers} (scanned)" if u.layers > 1 else "/".join(u.path) for u in units)


def _call(fn: Any, args: dict[str, Any], where: str) -> Any:
    if not callable(fn):
        raise WorkloadError(f"{where}: {type(fn).__name__} is not callable")
    try:
        return fn(**args)
    except Exception as e:  # noqa: BLE001
        raise WorkloadError(f"{where}: raised {type(e).__name__}: {first_line(e)}") from None


