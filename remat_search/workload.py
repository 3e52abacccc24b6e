"""Workloads: the training steps remat-search optimises, behind one small interface.

A workload is a loss over repeated layers, its parameters, an example batch and an
optimizer. From those, :class:`Workload` builds what the runner compiles, runs, checks and
times: a donated training step (``step``).
Built-in kinds are ``transformer``, ``mlp`` and ``linen``, found through :data:`BUILTIN_WORKLOADS`
(their modules build on this one); a user workload is any subclass returned by the factory
the spec names (``factory: "package.module:function"``). JAX is imported when a workload
is built, not with this module: reading studies needs none.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from remat_search.errors import SpecError, WorkloadError
from remat_search.plan import RematPlan
from remat_search.spec import FactoryConfig, WorkloadConfig

if TYPE_CHECKING:
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding

PyTree = Any
BUILTIN_WORKLOADS: dict[str, str] = {
    "transformer": "remat_search.transformer:TransformerWorkload",
    "mlp": "remat_search.mlp:MlpWorkload",
    "linen": "remat_search.linen_workload:LinenWorkload",
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

    @abc.abstractmethod
    def init_params(self, key: jax.Array) -> PyTree:
        """Initial parameters."""

    @abc.abstractmethod
    def make_batch(self, key: jax.Array) -> PyTree:
        """One example batch of inputs (and targets)."""

    @abc.abstractmethod
    def loss(self, plan: RematPlan) -> Callable[[PyTree, PyTree], jax.Array]:
        """The scalar loss ``(params, batch) -> loss`` with each layer wrapped by ``plan``."""

    def optimizer(self) -> optax.GradientTransformation:
        """The optimizer whose state the step carries (AdamW by default, as real runs use)."""
        import optax

        return optax.adamw(1e-3)

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
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.shardings(mesh)
        )

    def shardings(self, mesh: Mesh) -> tuple[PyTree, PyTree]:
        """``NamedSharding``s of ``(state, batch)``: FSDP-style state, batch over every axis.

        Each parameter and optimizer-state array is split over ``fsdp`` along its largest
        dimension that the axis divides (replicated if none does); the batch's leading
        dimension is split over ``data`` and ``fsdp`` together.
        """
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        state, batch = self._input_shapes()
        fsdp = mesh.shape.get("fsdp", 1)
        batch_axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
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

        return jax.tree.map(state_spec, state), jax.tree.map(batch_spec, batch)

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
        return (params, self.optimizer().init(params)), self.make_batch(batch_key)

    def step(
        self, plan: RematPlan, mesh: Mesh | None = None
    ) -> Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]:
        """A jitted training step ``(state, batch) -> (state, loss)`` that donates ``state``.

        Over a ``mesh`` the new state keeps the old one's shardings, so donation aliases it.
        """
        import jax
        import optax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        loss_fn, opt = self.loss(plan), self.optimizer()

        def train_step(state: PyTree, batch: PyTree) -> tuple[PyTree, jax.Array]:
            params, opt_state = state
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        if mesh is None:
            return jax.jit(train_step, donate_argnums=0)
        state, batch = self.shardings(mesh)
        return jax.jit(
            train_step, donate_argnums=0, in_shardings=(state, batch),
            out_shardings=(state, NamedSharding(mesh, P())),
        )

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


def program_fingerprint(workload: Workload) -> str:
    """A hash of the no-remat training step's jaxpr: it changes when the model's code or the
    optimizer does, even at the same shapes, so cached measurements of old code are not reused."""
    import jax

    state, batch = workload.abstract_inputs()
    try:
        text = str(jax.make_jaxpr(workload.step(RematPlan.uniform("none", workload.layers)))(state, batch))
    except Exception as e:  # noqa: BLE001 - a step that does not trace fails each candidate, with its reason
        text = f"does not trace: {type(e).__name__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_workload(config: WorkloadConfig) -> Workload:
    """Build the workload a spec describes; a bad factory raises :class:`WorkloadError`."""
    if isinstance(config, FactoryConfig):
        return _from_factory(config)
    module_name, class_name = BUILTIN_WORKLOADS[config.kind].split(":")
    return getattr(importlib.import_module(module_name), class_name)(config)


def _from_factory(config: FactoryConfig) -> Workload:
    module_name, function_name = config.factory.split(":")
    where = f"workload.factory: {config.factory!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's factory's
        raise WorkloadError(f"{where} does not import ({type(e).__name__}: {e})") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise WorkloadError(f"{where}: module {module_name!r} has no function {function_name!r}")
    try:
        workload = factory(**config.args)
    except Exception as e:  # noqa: BLE001
        raise WorkloadError(f"{where} raised {type(e).__name__}: {e}") from None
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"{where} returned {type(workload).__name__}, expected a remat_search.Workload"
        )
    if not isinstance(workload.layers, int) or workload.layers < 1:
        raise WorkloadError(f"{where} returned a workload with layers={workload.layers!r}, expected ≥ 1")
    return workload
