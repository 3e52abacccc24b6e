"""Workloads: the training steps remat-search optimises, behind one small interface.

A workload is a loss over repeated layers, its parameters, an example batch and an
optimizer. From those, :class:`Workload` builds what the runner compiles, runs, checks and
times: a donated training step (``step``).
Built-in kinds are ``transformer``, ``mlp``, ``nnx``, ``linen`` and ``maxtext``, found through :data:`BUILTIN_WORKLOADS`
(their modules build on this one); a user workload is any subclass returned by the factory
the spec names (``factory: "package.module:function"``). JAX is imported when a workload
is built, not with this module: reading studies needs none. How the state and batch are split
over a mesh (and a Flax model's logical axis rules) is :mod:`remat_search.workloads.sharding`;
tracing the step, :mod:`remat_search.workloads.tracing`. ``tests/workloads/test_workloads.py`` runs
every kind under one contract.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import hashlib
import importlib
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from remat_search.errors import CandidateRefused, SpecError, WorkloadError, first_line
from remat_search.imports import import_object
from remat_search.plans.configuration import Configuration
from remat_search.plans.export import maxtext_configuration
from remat_search.plans.plan import RematPlan
from remat_search.spec.workloads import FactoryConfig, MaxTextConfig, OptimizerConfig, WorkloadConfig
from remat_search.workloads.checkpoint_params import CheckpointParams, read_params_from
from remat_search.workloads.sharding import own_shardings, split_batch_over

if TYPE_CHECKING:
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding

PyTree = Any
BUILTIN_WORKLOADS: dict[str, str] = {
    "transformer": "remat_search.workloads.transformer:TransformerWorkload",
    "mlp": "remat_search.workloads.mlp:MlpWorkload",
    "nnx": "remat_search.workloads.nnx:NnxWorkload",
    "linen": "remat_search.workloads.linen:LinenWorkload",
    "maxtext": "remat_search.workloads.maxtext:MaxTextWorkload",
}
"""The built-in workload classes by spec ``kind``, as ``module:Class`` (each takes its config)."""


class Workload(abc.ABC):
    """A training step whose layers can be checkpointed by a :class:`RematPlan`.

    Subclasses set ``name``, ``layers`` and ``tensor_names`` (the names the loss gives
    tensors with ``jax.ad_checkpoint.checkpoint_name``, which ``names`` policies may keep)
    and implement :meth:`init_params`, :meth:`make_batch` and :meth:`loss`.
    """

    name: str
    layers: int
    tensor_names: frozenset[str] = frozenset()
    stacks: tuple[int, ...] | None = None
    """The layers of each unit the model runs as one body, in order (a scanned stack of 4 is 4,
    an unrolled layer 1), where it scans any; None: every layer its own. A plan gives each stack
    one policy."""
    mesh: Mesh | None = None
    """The target's device mesh (None: one device), given by :meth:`use_mesh` before anything
    is traced."""
    params_from: CheckpointParams | None = None
    """The parameters of the Orbax checkpoint the spec's ``workload.params_from`` names (set by
    :func:`build_workload`): their shapes, dtypes and stored shardings replace the model's own
    in :meth:`inputs` and :meth:`input_shardings`."""

    def use_mesh(self, mesh: Mesh | None) -> None:
        """Receive the target's device mesh before any shape, sharding or step is traced.

        The hook for a model whose parameters, shardings or sharding constraints need the mesh:
        a TPU target's devices are not this host's, so a model must not build its mesh from
        ``jax.devices()``. The worker calls it once, first; the default keeps the mesh as
        :attr:`mesh`. Override it to build what depends on the mesh (call ``super()``)."""
        self.mesh = mesh

    def note(self) -> str | None:
        """A line on what the workload chose for its target that its spec left open (the
        built-in transformer's ``attention: auto → flash (Pallas TPU kernel)``); None where it
        chose nothing. Called after :meth:`use_mesh`; ``run`` and ``show`` print it."""
        return None

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        """A context the worker enters around tracing the inputs and each step (a linen
        model's ``nn.logical_axis_rules(...)``, say); none by default."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def init_params(self, key: jax.Array) -> PyTree:
        """Initial parameters."""

    @abc.abstractmethod
    def make_batch(self, key: jax.Array) -> PyTree:
        """One example batch of inputs (and targets)."""

    @abc.abstractmethod
    def loss(self, plan: RematPlan) -> Callable[[PyTree, PyTree], jax.Array]:
        """The scalar loss ``(params, batch) -> loss`` with each layer wrapped by ``plan``."""

    def baseline_plan(self) -> RematPlan:
        """The plan the step is traced with to fingerprint it and read its tensor names: no
        remat (a workload that cannot run without it, MaxText's, says another)."""
        return RematPlan.uniform("none", self.layers)

    def compiler_options(self, platform: str) -> dict[str, str]:
        """The options every plan of it is compiled with (:func:`targets.platform.compiler_options`;
        MaxText's workload compiles with MaxText's own)."""
        from remat_search.targets.platform import compiler_options

        return compiler_options(platform)

    optimizer_config: OptimizerConfig | None = None
    """The spec's ``workload.optimizer`` (set by :func:`build_workload`); None: AdamW."""

    def optimizer(self) -> optax.GradientTransformation:
        """The optimizer whose state the step carries: the spec's ``workload.optimizer``, else
        AdamW (learning rate 1e-3), as real runs use."""
        import optax

        if self.optimizer_config is None:
            return optax.adamw(1e-3)
        return make_optimizer(self.optimizer_config)

    def inputs(self, seed: int = 0) -> tuple[PyTree, PyTree]:
        """Concrete ``(state, batch)`` for the step, ``state = (params, opt_state)``.

        Fresh arrays on every call (the step donates its state), from one compiled program.
        """
        import jax

        if "_jitted_inputs" not in self.__dict__:
            self._jitted_inputs = jax.jit(self._inputs)
        return self._jitted_inputs(jax.random.key(seed))

    def abstract_inputs(self, mesh: Mesh | None = None) -> tuple[PyTree, PyTree]:
        """Shapes and dtypes of :meth:`inputs` (with their shardings over ``mesh`` if given),
        for compiling without allocating."""
        import jax

        shapes = self._input_shapes()
        if mesh is None:
            return shapes
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.input_shardings(mesh)
        )

    def param_partitioning(self) -> PyTree | None:
        """The model's own partitioning of its parameters: a ``PartitionSpec`` of mesh axis
        names for each leaf of :meth:`init_params`' tree, or None where the model declares
        none (then :meth:`shardings` uses the FSDP heuristic). The linen and nnx workloads read
        it from the model's sharding metadata; a factory's workload may return its own."""
        return None

    def rule_axes(self) -> frozenset[str] | None:
        """The mesh axes the spec's ``workload.logical_axis_rules`` map onto, for a model whose
        partitioning is read with them (linen, nnx): a name in it that is neither one of these
        nor an axis of the mesh is a logical name the rules leave unmapped, an error. None (the
        default, a factory's workload, which maps its own names): every name is a mesh axis,
        at size 1 where the mesh leaves it out."""
        return None

    def input_shardings(self, mesh: Mesh) -> tuple[PyTree, PyTree]:
        """The shardings the step takes ``(state, batch)`` in: :meth:`shardings`, but with the
        parameters' stored shardings (and their optimizer state's) where a ``params_from``
        checkpoint has them and ``mesh`` can express them
        (:meth:`CheckpointParams.state_shardings`)."""
        own_state, own_batch = self.shardings(mesh)
        if self.params_from is None:
            return own_state, own_batch
        return self.params_from.state_shardings(mesh, self._input_shapes()[0], own_state), own_batch

    def sharding_source(self) -> str:
        """Where the step's shardings over a mesh come from (:meth:`input_shardings`), in
        words: ``run`` and ``show`` print it."""
        if type(self).shardings is not Workload.shardings:
            own = f"the workload's own ({type(self).__name__}.shardings)"
        elif self.param_partitioning() is not None:
            own = "the model's own partitioning of its parameters"
        else:
            own = "FSDP heuristic (each state array split over fsdp along its largest divisible dimension)"
        if self.params_from is not None and any(any(p.spec or ()) for p in self.params_from.params.values()):
            return f"the params_from checkpoint's stored shardings where the mesh can express them, else {own}"
        return own

    def shardings(self, mesh: Mesh) -> tuple[PyTree, PyTree]:
        """``NamedSharding``s of ``(state, batch)``; the batch's leading dimension is split over
        ``data`` and ``fsdp`` together.

        The parameters are sharded as the model's own partitioning says
        (:meth:`param_partitioning`; axes the mesh lacks are not split over), and the optimizer
        state as the parameters it mirrors (its scalars replicated), as a real run shards
        them. Where the model declares none, the FSDP heuristic: each parameter and
        optimizer-state array is split over ``fsdp`` along its largest dimension that the axis
        divides (replicated if none does). Override this for other schemes.
        """
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        (params, opt_state), batch = self._input_shapes()
        fsdp = mesh.shape.get("fsdp", 1)
        batch_axes = split_batch_over(mesh)
        ways = math.prod(mesh.shape[a] for a in batch_axes)

        def state_spec(a: jax.ShapeDtypeStruct) -> NamedSharding:
            dims = [d for d in sorted(range(a.ndim), key=lambda d: -a.shape[d]) if a.shape[d] % fsdp == 0]
            if fsdp == 1 or not dims:
                return NamedSharding(mesh, P())
            return NamedSharding(mesh, P(*("fsdp" if d == dims[0] else None for d in range(a.ndim))))

        def batch_spec(a: jax.ShapeDtypeStruct) -> NamedSharding:
            if not batch_axes:
                return NamedSharding(mesh, P())
            if a.ndim == 0 or a.shape[0] % ways:
                raise SpecError(
                    f"spec.mesh: the batch dimension ({a.shape[0] if a.ndim else 'none'}) must be "
                    f"divisible by {' × '.join(batch_axes)} = {ways}"
                )
            return NamedSharding(mesh, P(batch_axes))

        own = self.param_partitioning()
        if own is None:
            return jax.tree.map(state_spec, (params, opt_state)), jax.tree.map(batch_spec, batch)
        param_shardings = own_shardings(mesh, own, params, self.rule_axes())
        structure = jax.tree.structure(params)

        def mirrored(sub: PyTree) -> PyTree:  # an optimizer's moments mirror the parameters
            if jax.tree.structure(sub) == structure:
                return param_shardings
            return jax.tree.map(lambda a: NamedSharding(mesh, P()), sub)

        opt_shardings = jax.tree.map(mirrored, opt_state, is_leaf=lambda x: jax.tree.structure(x) == structure)
        return (param_shardings, opt_shardings), jax.tree.map(batch_spec, batch)

    def _input_shapes(self) -> tuple[PyTree, PyTree]:
        """``(state, batch)`` shapes, traced once per workload (every candidate needs them)."""
        import jax

        if "_shapes" not in self.__dict__:
            self._shapes = jax.eval_shape(self._inputs, jax.random.key(0))
        return self._shapes

    def _inputs(self, key: jax.Array) -> tuple[PyTree, PyTree]:
        import jax

        params_key, batch_key = jax.random.split(key)
        params = self.init_params(params_key)
        if self.params_from is not None:
            params = self.params_from.params_like(params, params_key)
        return (params, self.init_opt_state(params)), self.make_batch(batch_key)

    def init_opt_state(self, params: PyTree) -> PyTree:
        """What the step carries beside the parameters: :meth:`optimizer`'s ``init(params)``.
        A workload running the user's own train step carries what that step's state holds
        (an ``nnx.Optimizer``'s variables, a ``TrainState``'s step and optimizer state)."""
        return self.optimizer().init(params)

    def step(
        self, plan: RematPlan, mesh: Mesh | None = None
    ) -> Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]:
        """:meth:`train_fn` jitted, donating ``state``; over a ``mesh`` the new state keeps the
        old one's shardings, so donation aliases it."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        train_step = self.train_fn(plan, mesh)
        if mesh is None:
            return jax.jit(train_step, donate_argnums=0)
        state, batch = self.input_shardings(mesh)
        return jax.jit(
            train_step, donate_argnums=0, in_shardings=(state, batch),
            out_shardings=(state, NamedSharding(mesh, P())),
        )

    def train_fn(
        self, plan: RematPlan, mesh: Mesh | None = None
    ) -> Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]:
        """The training step ``(state, batch) -> (state, loss)``, not jitted: the gradients of
        :meth:`loss` and one update of :meth:`optimizer`. A workload running the user's own
        train step returns that step, over the same state.

        Where the plan's configuration accumulates ``k`` micro-batches, the batch is split into
        ``k`` (example ``i`` into micro-batch ``i mod k``, which keeps each device's examples on
        it) and the gradients of a ``lax.scan`` over them averaged before one update: the
        loss and gradients of the whole batch, in a micro-batch's activations. Over a ``mesh``,
        the summed gradients are sharded as the parameters are.
        """
        import jax
        import optax

        loss_fn, opt = self.loss(plan), self.optimizer()
        k = plan.configuration.accumulation if plan.configuration is not None else 1
        # The gradients summed over micro-batches are sharded as the parameters are (not left
        # to the compiler, which may keep a whole copy on every device), as a trainer shards them.
        sharded = (lambda tree: tree) if mesh is None else functools.partial(
            jax.lax.with_sharding_constraint, shardings=self.input_shardings(mesh)[0][0]
        )

        def gradients(params: PyTree, batch: PyTree) -> tuple[jax.Array, PyTree]:
            if k == 1:
                return jax.value_and_grad(loss_fn)(params, batch)
            micro = jax.tree.map(lambda a: a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1), batch)

            def add(total: tuple[jax.Array, PyTree], one: PyTree) -> tuple[tuple[jax.Array, PyTree], None]:
                loss, grads = jax.value_and_grad(loss_fn)(params, one)
                return (total[0] + loss, sharded(jax.tree.map(lambda t, g: t + g, total[1], grads))), None

            zero = (jax.numpy.zeros((), jax.numpy.float32), sharded(jax.tree.map(jax.numpy.zeros_like, params)))
            (loss, grads), _ = jax.lax.scan(add, zero, micro)
            return loss / k, jax.tree.map(lambda g: g / k, grads)

        def train_step(state: PyTree, batch: PyTree) -> tuple[PyTree, jax.Array]:
            params, opt_state = state
            loss, grads = gradients(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return train_step

    def fingerprint(self) -> str:
        """A hash of what the workload computes on: its name, layers, names and input shapes."""
        import jax

        shapes = jax.tree.map(lambda a: [list(a.shape), str(a.dtype)], self.abstract_inputs())
        text = json.dumps(
            [type(self).__qualname__, self.name, self.layers, sorted(self.tensor_names),
             jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, list))],
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """A language model's default loss: the mean cross-entropy of position ``t``'s logits
    against token ``t + 1``, in float32."""
    import jax.numpy as jnp
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()


def build_workload(config: WorkloadConfig, configuration: Configuration | None = None) -> Workload:
    """Build the workload a spec describes, at ``configuration``'s global batch if given (one
    step's examples over every device: a factory gets it as its ``batch`` argument); a bad
    factory raises :class:`WorkloadError`, a ``params_from`` that is no Orbax checkpoint
    :class:`SpecError` (whether the model fits the checkpoint is told by
    :func:`check_params_from`, once the workload has its mesh)."""
    if configuration is not None and isinstance(config, MaxTextConfig):  # MaxText's own settings of it
        config = config.model_copy(update={"overrides": {**config.overrides, **maxtext_configuration(configuration)}})
    elif configuration is not None and isinstance(config, FactoryConfig):
        config = config.model_copy(update={"args": {**config.args, "batch": configuration.global_batch}})
    elif configuration is not None:
        config = config.model_copy(update={"batch": configuration.global_batch})
    if isinstance(config, FactoryConfig):
        workload = _from_factory(config)
    else:
        module_name, class_name = BUILTIN_WORKLOADS[config.kind].split(":")
        workload = getattr(importlib.import_module(module_name), class_name)(config)
    if config.params_from is not None:
        workload.params_from = read_params_from(config.params_from)
    if config.optimizer is not None:
        if type(workload).optimizer is not Workload.optimizer:
            raise SpecError(f"spec.workload.optimizer: {type(workload).__name__} has an optimizer() of its own; "
                            "leave the spec's out or the method")
        make_optimizer(config.optimizer)  # a bad one is refused here, before any worker
        workload.optimizer_config = config.optimizer
    return workload


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """The optax transformation ``config`` names, made with its arguments; a one-line
    :class:`WorkloadError` naming ``workload.optimizer`` where it does not import, fails, or
    gives no ``GradientTransformation``."""
    import optax

    where = f"workload.optimizer.factory: {config.factory!r}"
    factory = import_object(config.import_path, "workload.optimizer.factory", what="function")
    if not callable(factory):
        raise WorkloadError(f"{where} is not a function returning an optax transformation")
    try:
        made = factory(**config.args)
    except Exception as e:  # noqa: BLE001 - the user's arguments, in one line
        raise WorkloadError(f"{where} raised {type(e).__name__}: {first_line(e)}") from None
    if not isinstance(made, optax.GradientTransformation):
        raise WorkloadError(f"{where} returned {type(made).__name__}, expected an optax.GradientTransformation")
    return made


def check_params_from(workload: Workload) -> None:
    """Trace ``workload``'s inputs and no-remat training step with the parameters of its ``params_from``
    checkpoint (none: nothing to do); a one-line :class:`SpecError` where its tree is not the
    model's, or the model does not take its shapes (a model that fails with its own
    parameters too is left to fail each candidate, as without a checkpoint)."""
    import jax

    if workload.params_from is None:
        return
    with workload.tracing():
        state, batch = workload.abstract_inputs()
        try:
            train_step = workload.train_fn(RematPlan.uniform("none", workload.layers))
            jax.eval_shape(train_step, state, batch)
        except Exception as e:  # noqa: BLE001 - the model's own error, told in one line
            try:
                own = jax.eval_shape(workload.init_params, jax.random.key(0))
                jax.eval_shape(train_step, (own, jax.eval_shape(workload.init_opt_state, own)), batch)
            except Exception:  # noqa: BLE001 - it fails with its own parameters too
                return
            first = first_line(e)
            raise SpecError(
                f"spec.workload.params_from: the model does not take the checkpoint's parameters "
                f"({type(e).__name__}: {first})"
            ) from None


def _from_factory(config: FactoryConfig) -> Workload:
    where = f"workload.factory: {config.factory!r}"
    factory = import_object(config.factory, "workload.factory", what="function")
    if not callable(factory):
        module_name, _, function_name = config.factory.partition(":")
        raise WorkloadError(f"{where}: module {module_name!r} has no function {function_name!r}")
    try:
        workload = factory(**config.args)
    except CandidateRefused:  # the factory cannot build this candidate: an infeasible trial, with its reason
        raise
    except Exception as e:  # noqa: BLE001
        raise WorkloadError(f"{where} raised {type(e).__name__}: {e}") from None
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"{where} returned {type(workload).__name__}, expected a remat_search.Workload"
        )
    if not isinstance(workload.layers, int) or workload.layers < 1:
        raise WorkloadError(f"{where} returned a workload with layers={workload.layers!r}, expected ≥ 1")
    return workload
