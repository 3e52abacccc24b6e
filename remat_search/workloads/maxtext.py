"""MaxText's own program as the workload (``kind: maxtext``): its model, train step, optimizer,
dtypes, attention, scan, logical axis rules and mesh, built by the functions MaxText's
``train_compile`` calls, so that a trial's peak is MaxText's own compile of the same settings.

A candidate is a set of MaxText settings: the plan's ``remat_policy`` (and ``custom`` names,
:func:`plans.export.maxtext_remat`) laid over the spec's ``overrides``, which hold its
configuration's ``per_device_batch_size``, ``gradient_accumulation_steps`` and
``ici_*_parallelism`` (``build_workload``, :func:`plans.export.maxtext_configuration`). MaxText
builds the mesh from them over the target's devices, so tensor and sequence parallelism are
its own. MaxText scans its decoder layers (``scan_layers: true``, its default): one policy for
every layer, so a study of it searches uniform plans. MaxText needs Python ≥ 3.12 and is the
``maxtext`` extra (``pip install 'remat-search[maxtext]'``); it is imported in the worker that
compiles, and, to check the spec, in the search (:func:`spec.maxtext.maxtext_config`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from remat_search.errors import CandidateRefused, SpecError
from remat_search.plans.export import maxtext_remat
from remat_search.plans.plan import RematPlan
from remat_search.spec.maxtext import before_import, maxtext_config, refusal
from remat_search.spec.workloads import MaxTextConfig
from remat_search.workloads.base import Workload

if TYPE_CHECKING:
    from jax.sharding import Mesh

LOSS = ("scalar", "learning/loss")
"""Where MaxText's train step puts the loss among its metrics."""


class MaxTextWorkload(Workload):
    """MaxText's train step for the spec's model and settings, one program per candidate."""

    def __init__(self, config: MaxTextConfig) -> None:
        """``config``: with a configuration's settings among its overrides (``build_workload``)."""
        self.config = config
        base = maxtext_config(config)
        self.name = f"maxtext {config.model_name or os.path.basename(config.config or 'base.yml')}"
        self.layers = int(base.num_decoder_layers)
        self.tensor_names = frozenset(remat_names())
        self._devices: list[Any] | None = None
        self._built: dict[str, Any] = {}

    def use_mesh(self, mesh: Mesh | None) -> None:
        """Keep the target's devices: MaxText builds its own mesh over them (``ici_*``)."""
        import jax

        super().use_mesh(mesh)
        self._devices = sorted(mesh.devices.flat, key=lambda d: d.id) if mesh is not None else jax.devices()[:1]

    def note(self) -> str | None:
        return "MaxText's own model, train step and mesh (maxtext " + _version() + ")"

    def sharding_source(self) -> str:
        return "MaxText's own logical axis rules and mesh (ici_* settings)"

    def baseline_plan(self) -> RematPlan:
        """MaxText has no setting without remat: its step is traced with ``full``."""
        return RematPlan.uniform("full", self.layers)

    def _program(self, plan: RematPlan) -> _Program:
        """What MaxText builds for ``plan``'s remat settings (built once; the configuration's
        are the workload's overrides)."""
        settings = maxtext_remat(plan)
        key = repr(sorted(settings.items()))
        if key not in self._built:
            self._built[key] = _Program(self.config, settings, self._devices or [])
        return self._built[key]

    def _shapes_plan(self) -> RematPlan:
        """The plan whose program gives the inputs' shapes and shardings (every policy's are the same)."""
        return RematPlan.uniform("full", self.layers)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        return self._program(self._shapes_plan()).context()

    def init_params(self, key: Any) -> Any:  # pragma: no cover - MaxText initialises its own state
        raise NotImplementedError

    def make_batch(self, key: Any) -> Any:  # pragma: no cover
        raise NotImplementedError

    def loss(self, plan: RematPlan) -> Callable[[Any, Any], Any]:  # pragma: no cover
        raise NotImplementedError

    def inputs(self, seed: int = 0) -> tuple[Any, Any]:
        return self._program(self._shapes_plan()).inputs(seed)

    def abstract_inputs(self, mesh: Mesh | None = None) -> tuple[Any, Any]:
        return self._program(self._shapes_plan()).shaped

    def input_shardings(self, mesh: Mesh) -> tuple[Any, Any]:
        return self._program(self._shapes_plan()).in_shardings

    def shardings(self, mesh: Mesh) -> tuple[Any, Any]:
        return self.input_shardings(mesh)

    def compiler_options(self, platform: str) -> dict[str, str]:
        """MaxText's own: its ``compile_xla_flags``, as ``train_compile`` compiles with."""
        return self._program(self._shapes_plan()).compiler_options

    def step(self, plan: RematPlan, mesh: Mesh | None = None) -> Any:
        return self._program(plan).jitted

    def fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(repr((_version(), self.config.model_dump_json())).encode()).hexdigest()[:16]


def remat_names() -> tuple[str, ...]:
    """The tensor names MaxText's ``remat_policy: custom`` sets one by one (its config's fields
    whose values are ``remat`` / ``device`` / ``offload``), read from the installed MaxText."""
    before_import()
    from maxtext.configs import types

    return tuple(n for n, f in types.RematAndOffload.model_fields.items() if f.annotation is types.RematLocation)


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("maxtext")


class _Program:
    """One candidate's MaxText program: its config, mesh, shaped inputs and jitted step, as
    ``train_compile.main`` builds them (``get_shaped_inputs``, the Zero-1 shardings, the input
    data sharding, ``get_functional_train_with_signature``)."""

    def __init__(self, spec: MaxTextConfig, settings: dict[str, Any], devices: list[Any]) -> None:
        import jax
        from jax.sharding import AxisType, Mesh

        before_import()
        from maxtext.common.common_types import ShardMode
        from maxtext.trainers.pre_train import train, train_compile
        from maxtext.utils import max_utils, maxtext_utils, sharding

        jax.config.update("jax_default_prng_impl", "unsafe_rbg")  # as train_compile.main sets it
        platform = devices[0].platform
        # MaxText counts the devices it builds for: the local ones, or, compiling for a topology
        # (train_compile's compile_topology), the topology's: given as such (internal_compile).
        count = {} if platform == "cpu" else {"internal_compile": True, "internal_compile_num_devices": len(devices)}
        # MaxText refuses a candidate as it builds it (a mesh whose axes do not divide the devices,
        # or the heads): an infeasible candidate, with MaxText's reason.
        try:
            config = maxtext_config(spec, settings, **count, hardware="cpu" if platform == "cpu" else platform)
            jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
            axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
            placed = maxtext_utils.create_device_mesh(config, devices)
            self.mesh = Mesh(placed, config.mesh_axes, axis_types=(axis_type,) * len(config.mesh_axes))
            self.config = config
            args, _, state_shardings, _, model = train_compile.get_shaped_inputs(self.mesh, config)
            params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
            input_state = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
            data = sharding.get_input_data_sharding(config, self.mesh)
            func, ins, outs, static, donate = maxtext_utils.get_functional_train_with_signature(
                train.train_step, data, input_state, model, config, params_shardings
            )
        except SpecError as e:  # its config loader's refusal, already in a line
            raise CandidateRefused(str(e).removeprefix("spec.workload: ")) from None
        except Exception as e:  # noqa: BLE001 - raised by MaxText's own functions building this candidate
            raise CandidateRefused(f"MaxText refuses the candidate: {refusal(e)}") from None
        self.shaped, self.in_shardings, self.state_shardings = tuple(args), ins, state_shardings
        self.compiler_options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
        jitted = jax.jit(func, in_shardings=ins, out_shardings=outs, static_argnums=static, donate_argnums=donate)
        self.jitted = _LossOnly(jitted, self)

    def context(self) -> contextlib.AbstractContextManager[Any]:
        import jax
        from flax.core.spmd import logical_axis_rules

        stack = contextlib.ExitStack()  # train_compile's jit_and_compile: jax.set_mesh, MaxText's axis rules
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(logical_axis_rules(self.config.logical_axis_rules))
        return stack

    def inputs(self, seed: int) -> tuple[Any, Any]:
        """A fresh initial state (MaxText's initialisation, as its trainer makes it) and a
        synthetic batch of random tokens, placed as the step takes them."""
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from maxtext.common import train_state_nnx
        from maxtext.optimizers import optimizers
        from maxtext.utils import maxtext_utils, model_creation_utils

        config, mesh = self.config, self.mesh
        with self.context():
            create_model, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
            tx = optimizers.get_optimizer(config, maxtext_utils.create_learning_rate_schedule(config), model, mesh=mesh)

            def init() -> Any:  # get_shaped_inputs' create_train_state_fn, made concrete
                model = create_model()
                return nnx.split(train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param)))[1]

            state = jax.jit(init, out_shardings=self.state_shardings)()
        batch_shape = self.shaped[1]["inputs"].shape
        tokens = jax.random.randint(jax.random.key(seed), batch_shape, 0, config.vocab_size, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(batch_shape[-1], dtype=jnp.int32), batch_shape)
        ones = jnp.ones(batch_shape, jnp.int32)
        batch = {"inputs": tokens, "inputs_position": positions, "inputs_segmentation": ones,
                 "targets": jnp.roll(tokens, -1, axis=-1), "targets_position": positions, "targets_segmentation": ones}
        return state, jax.device_put(batch, self.in_shardings[1])


class _LossOnly:
    """MaxText's jitted step, lowered and compiled in its mesh and rules; the executable
    returns ``(state, loss)`` as remat-search's steps do (MaxText's own returns its metrics,
    the program compiled is MaxText's, unchanged)."""

    def __init__(self, jitted: Any, program: _Program) -> None:
        self._jitted, self._program = jitted, program

    def lower(self, *args: Any) -> Any:
        with self._program.context():
            return _Lowered(self._jitted.lower(*args))

    def __call__(self, *args: Any) -> Any:
        """Traced (``jax.make_jaxpr``) within the workload's :meth:`~MaxTextWorkload.tracing`."""
        return _loss_of(self._jitted(*args))


class _Lowered:
    def __init__(self, lowered: Any) -> None:
        self._lowered = lowered

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Any:
        return _Compiled(self._lowered.compile(compiler_options=compiler_options))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


class _Compiled:
    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        return _loss_of(self._compiled(state, batch))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


def _loss_of(out: tuple[Any, Any]) -> tuple[Any, Any]:
    state, metrics = out
    return state, functools.reduce(lambda m, k: m[k], LOSS, metrics)
