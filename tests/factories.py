"""Workloads for the tests, loaded through the spec's ``factory:`` like a user's own.

They are real JAX programs; what they add is observable behaviour: a record of every
execution (to prove over-budget plans never run), of every lowering and trace (to prove no
plan is compiled twice), a loss that raises, one that hangs, one that a plan changes, and
plans that fail in every way a candidate can (:class:`FaultyMlp`).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from remat_search.workloads.mlp import MlpWorkload
from remat_search.plans.plan import RematPlan, apply_layers
from remat_search.spec.workloads import MlpConfig
from remat_search.workloads.base import PyTree

TINY_MLP = MlpConfig(kind="mlp", layers=3, width=64, hidden=256, batch=128)


class RecordingMlp(MlpWorkload):
    """An MLP that appends the plan's digest to ``log`` each time its loss is evaluated on the
    device: whatever runs it (a training step, a gradient), every execution is recorded."""

    def __init__(self, log: str) -> None:
        super().__init__(TINY_MLP)
        self.log = Path(log)

    def loss(self, plan: RematPlan) -> Callable:
        inner = super().loss(plan)

        def record() -> None:
            with self.log.open("a") as f:
                f.write(plan.digest + "\n")

        def loss_fn(params, batch):  # type: ignore[no-untyped-def]
            jax.debug.callback(record)
            return inner(params, batch)

        return loss_fn


class RaisingMlp(MlpWorkload):
    """An MLP whose loss raises while being traced, as a broken model would."""

    def loss(self, plan: RematPlan) -> Callable:
        def loss_fn(params, batch):  # type: ignore[no-untyped-def]
            raise RuntimeError("this model is broken")

        return loss_fn


class HangingMlp(MlpWorkload):
    """An MLP whose step sleeps far past any test timeout when it runs (first creating the
    file ``started``, if given, so that a test knows it hangs now)."""

    def __init__(self, started: str | None = None) -> None:
        super().__init__(TINY_MLP)
        self.started = started

    def loss(self, plan: RematPlan) -> Callable:
        inner = super().loss(plan)

        def hang() -> None:
            if self.started:
                Path(self.started).touch()
            time.sleep(3600)

        def loss_fn(params, batch):  # type: ignore[no-untyped-def]
            jax.debug.callback(hang)
            return inner(params, batch)

        return loss_fn


class CountingMlp(MlpWorkload):
    """An MLP that appends ``lower DIGEST PID`` to ``log`` each time its step is lowered for
    compiling (``step(plan).lower(...)``, which every compile does first), and ``trace DIGEST
    PID`` each time its loss is traced, whatever traces it (a lowering, a ``jax.jit`` call, a
    jaxpr): a compile that bypasses ``lower`` still shows as a trace. ``scale`` changes its
    loss, not its shapes."""

    def __init__(self, log: str, scale: float = 1.0) -> None:
        super().__init__(TINY_MLP)
        self.log = Path(log)
        self.scale = scale

    def _write(self, what: str, plan: RematPlan) -> None:
        with self.log.open("a") as f:
            f.write(f"{what} {plan.digest} {os.getpid()}\n")

    def loss(self, plan: RematPlan) -> Callable:
        inner = super().loss(plan)

        def loss_fn(params, batch):  # type: ignore[no-untyped-def]
            self._write("trace", plan)  # Python runs here only while JAX traces
            return self.scale * inner(params, batch)

        return loss_fn

    def step(self, plan: RematPlan, mesh: object = None) -> Callable:
        inner = super().step(plan)
        workload = self

        class Counted:
            def __call__(self, *args):  # type: ignore[no-untyped-def]
                return inner(*args)

            def lower(self, *args):  # type: ignore[no-untyped-def]
                workload._write("lower", plan)
                return inner.lower(*args)

        return Counted()


class MiscomputingMlp(MlpWorkload):
    """An MLP whose loss is doubled under any plan with a ``dots`` layer: a plan whose program
    computes something else (its gradients, and so Adam's first moment, double), which the
    gradient check must catch."""

    def loss(self, plan: RematPlan) -> Callable:
        inner = super().loss(plan)
        scale = 2.0 if any(p.kind == "dots" for p in plan.layers) else 1.0
        return lambda params, batch: scale * inner(params, batch)


class SlowCompileMlp(MlpWorkload):
    """An MLP whose loss sleeps ``seconds`` each time it is traced: every compile of a plan takes
    at least that long, as a big model's does, so compiles in flight at once can be seen."""

    def __init__(self, seconds: float) -> None:
        super().__init__(TINY_MLP)
        self.seconds = seconds

    def loss(self, plan: RematPlan) -> Callable:
        inner = super().loss(plan)

        def slow(params, batch):  # type: ignore[no-untyped-def]
            time.sleep(self.seconds)  # at trace time only: the compiled step does not sleep
            return inner(params, batch)

        return slow


def slow_compile(seconds: float = 1.0) -> SlowCompileMlp:
    return SlowCompileMlp(seconds)


class DelayedMlp(MlpWorkload):
    """An MLP whose step, when it runs, sleeps the milliseconds that the JSON file ``delays``
    gives for its plan's summary (``{"none×3": 40}``) at that moment, plus those ``"*"``
    gives for every plan: a machine that is busy while some plans are timed and not others.
    With ``"die": true`` in the file the step's process sends itself SIGKILL instead, as the
    kernel's OOM killer would: a machine that is gone from that moment on."""

    def __init__(self, delays: str) -> None:
        super().__init__(TINY_MLP)
        self.delays = Path(delays)

    def step(self, plan: RematPlan) -> Callable:
        inner = super().step(plan)
        summary = plan.summary()

        def delay() -> None:
            delays = json.loads(self.delays.read_text())
            if delays.get("die"):
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # the signal is delivered meanwhile
            time.sleep((delays.get(summary, 0) + delays.get("*", 0)) / 1000)

        def delayed_step(state, batch):  # type: ignore[no-untyped-def]
            jax.debug.callback(delay)
            return inner(state, batch)

        return jax.jit(delayed_step, donate_argnums=0)


FAULTS = ("compile", "raise_trace", "raise_run", "hang", "segfault", "sigkill", "hoard", "nan")


class FaultyMlp(MlpWorkload):
    """An MLP whose plans with a ``dots`` layer go wrong in the way ``fault`` names, and
    whose other plans run as they should (full remat, the reference, among them):

    - ``compile``: the step calls a custom call no one registered: the compiler fails;
    - ``raise_trace``: the loss raises while it is traced (a broken model);
    - ``raise_run``: the step raises as it runs, from a host callback (a broken input pipeline);
    - ``hang``: the step sleeps far past any test timeout;
    - ``segfault``: the worker sends itself SIGSEGV as the step runs (a crash in native code);
    - ``sigkill``: the worker sends itself SIGKILL as the step runs, as the kernel's OOM killer would;
    - ``hoard``: the step takes host memory, 32 MiB at a time up to ``hoard_bytes``, and keeps it;
    - ``nan``: the loss is NaN; its gradients, and so the state change, are untouched.
    """

    def __init__(self, fault: str, hoard_bytes: int = 6 * 2**30) -> None:
        super().__init__(TINY_MLP)
        if fault not in FAULTS:
            raise ValueError(f"fault: expected one of {FAULTS}, got {fault!r}")
        self.fault, self.hoard_bytes = fault, hoard_bytes
        self._hoard: list[np.ndarray] = []

    def loss(self, plan: RematPlan) -> Callable:
        inner = super().loss(plan)
        if not any(p.kind == "dots" for p in plan.layers):
            return inner
        fault = self.fault

        def loss_fn(params, batch):  # type: ignore[no-untyped-def]
            if fault == "raise_trace":
                raise RuntimeError("this model is broken")
            value = inner(params, batch)
            if fault == "compile":  # on the batch, which is not differentiated: no JVP rule needed
                x = batch["x"]
                return value + jax.ffi.ffi_call("remat_search_no_such_kernel", jax.ShapeDtypeStruct((), x.dtype))(x)
            if fault == "nan":
                return value + jnp.nan  # a constant: the gradients are those of `value`
            jax.debug.callback(self._misbehave)
            return value

        return loss_fn

    def _misbehave(self) -> None:
        if self.fault == "raise_run":
            raise ValueError("the input pipeline broke")
        if self.fault == "hang":
            time.sleep(3600)
        if self.fault in ("segfault", "sigkill"):
            os.kill(os.getpid(), signal.SIGSEGV if self.fault == "segfault" else signal.SIGKILL)
            time.sleep(60)  # the signal is delivered meanwhile
        if self.fault == "hoard":
            chunk = 32 * 2**20
            while len(self._hoard) * chunk < self.hoard_bytes:
                self._hoard.append(np.ones(chunk, np.uint8))  # written, so resident
                time.sleep(0.005)


def faulty(fault: str, hoard_bytes: int = 6 * 2**30) -> FaultyMlp:
    return FaultyMlp(fault, hoard_bytes)


def counting(log: str, scale: float = 1.0) -> CountingMlp:
    return CountingMlp(log, scale)


def delayed(delays: str) -> DelayedMlp:
    return DelayedMlp(delays)


def recording(log: str) -> RecordingMlp:
    return RecordingMlp(log)


def miscomputing() -> MiscomputingMlp:
    return MiscomputingMlp(TINY_MLP)


def raising() -> RaisingMlp:
    return RaisingMlp(TINY_MLP)


def hanging(started: str | None = None) -> HangingMlp:
    return HangingMlp(started)


def telling(variable: str) -> None:
    """No workload: raises with what the worker it was built in started with (``variable`` in its
    environment, JAX's ``jax_enable_x64``, read from ``JAX_ENABLE_X64`` when JAX is imported, and
    whether a forkserver forked it), which the search reports as the workload's error."""
    import psutil

    forked = "forkserver" in " ".join(psutil.Process(os.getppid()).cmdline())
    raise RuntimeError(f"{variable}={os.environ.get(variable)} x64={jax.config.jax_enable_x64} forked={forked}")


def not_a_workload() -> dict:
    return {"layers": 3}


def failing_factory() -> None:
    raise ValueError("factory needs a config file")


def plain_function(x: jax.Array) -> jax.Array:
    """Used to check that a plan read back from JSON wraps functions."""
    return jnp.sin(x @ x.T)


class TensorParallelMlp(MlpWorkload):
    """An MLP whose weights and hidden activations are split over the mesh's ``tensor`` axis,
    as a tensor-parallel model's are: it needs the target's mesh (given by ``use_mesh``, never
    built from this host's devices), declares its parameters' partitioning and overrides no
    sharding method."""

    def use_mesh(self, mesh: Any) -> None:
        super().use_mesh(mesh)
        self.used_meshes = [*getattr(self, "used_meshes", []), mesh]

    def param_partitioning(self) -> PyTree:
        """Its own shardings, Megatron's for an MLP: ``wi`` split by its hidden columns over
        ``tensor``, ``wo`` by its hidden rows."""
        from jax.sharding import PartitionSpec as P

        return [{"wi": P(None, "tensor"), "wo": P("tensor", None)} for _ in range(self.layers)]

    def loss(self, plan: RematPlan) -> Callable[[PyTree, PyTree], jax.Array]:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        assert self.mesh is not None, "use_mesh gives the mesh before the loss is traced"
        hidden = NamedSharding(self.mesh, P("data", "tensor"))

        def block(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
            h = jax.lax.with_sharding_constraint(checkpoint_name(x @ params["wi"], "mlpwi"), hidden)
            return x + checkpoint_name(jax.nn.gelu(h) @ params["wo"], "mlpwo")

        def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
            x = apply_layers(plan, [functools.partial(block, p) for p in params], batch["x"])
            return jnp.mean((x - batch["y"]) ** 2)

        return loss_fn


def tensor_parallel(layers: int = 2, width: int = 64, hidden: int = 256, batch: int = 8) -> TensorParallelMlp:
    return TensorParallelMlp(MlpConfig(kind="mlp", layers=layers, width=width, hidden=hidden, batch=batch))


class OverDeclaredMlp(MlpWorkload):
    """Declares a tensor name its step never tags (as a model whose tags depend on its configuration)."""

    tensor_names = frozenset({"mlpwi", "mlpwo", "never_tagged"})


def over_declared() -> OverDeclaredMlp:
    return OverDeclaredMlp(MlpConfig(kind="mlp", layers=2, width=16, hidden=32, batch=4))


def refusing(batch: int, refused: int = 4) -> MlpWorkload:
    """The tiny MLP at ``batch``, refusing to be built at ``refused``: a model that cannot run
    some configuration (as MaxText refuses a mesh that does not divide its heads)."""
    from remat_search.errors import CandidateRefused

    if batch == refused:
        raise CandidateRefused(f"this model cannot run a batch of {refused}")
    return MlpWorkload(TINY_MLP.model_copy(update={"batch": batch}))


class RaisingOnOneProcessMlp(MlpWorkload):
    """An MLP whose plans with ``dots`` on the first layer raise while traced on one process of
    a slice (``process``), and compile on the others: a candidate only one host fails to compile."""

    def __init__(self, process: int, layers: int) -> None:
        super().__init__(MlpConfig(kind="mlp", layers=layers, width=32, hidden=128, batch=16))
        self.process = process

    def loss(self, plan: RematPlan) -> Callable:
        inner = super().loss(plan)
        broken = plan.summary().startswith("dots") and jax.process_index() == self.process

        def loss_fn(params, batch):  # type: ignore[no-untyped-def]
            if broken:
                raise RuntimeError(f"this model is broken on process {jax.process_index()}")
            return inner(params, batch)

        return loss_fn


def raising_on_process(process: int = 1, layers: int = 2) -> RaisingOnOneProcessMlp:
    return RaisingOnOneProcessMlp(process, layers)


REDRAWS = ("host_noise", "stateful_dropout")


class RedrawingMlp(MlpWorkload):
    """An MLP whose recomputed forward is not its first forward, as a model that trains
    differently under remat would be: each block's hidden activation is changed by a draw that
    a recomputation draws again, differently.

    - ``host_noise``: noise from a host callback declared pure (``jax.pure_callback`` over
      NumPy's generator), added to the activation: a plan that recomputes the block draws new
      noise in its backward pass;
    - ``stateful_dropout``: a dropout mask drawn by XLA's stateful generator
      (``lax.rng_uniform``), whose key advances at every draw, the recomputation's too.

    Parameters and activations in ``dtype`` (``float32`` or ``bfloat16``)."""

    def __init__(self, redraw: str, dtype: str = "float32", layers: int = 3, batch: int = 128) -> None:
        if redraw not in REDRAWS:
            raise ValueError(f"redraw: expected one of {REDRAWS}, got {redraw!r}")
        super().__init__(TINY_MLP.model_copy(update={"layers": layers, "batch": batch}))
        self.redraw, self.dtype = redraw, jnp.dtype(dtype)
        self._rng = np.random.default_rng()

    def init_params(self, key: jax.Array) -> PyTree:
        return jax.tree.map(lambda a: a.astype(self.dtype), super().init_params(key))

    def make_batch(self, key: jax.Array) -> PyTree:
        return jax.tree.map(lambda a: a.astype(self.dtype), super().make_batch(key))

    def _changed(self, h: jax.Array) -> jax.Array:
        if self.redraw == "stateful_dropout":
            keep = jax.lax.rng_uniform(jnp.float32(0), jnp.float32(1), h.shape) < 0.8
            return jnp.where(keep, h / 0.8, 0).astype(h.dtype)
        shape = jax.ShapeDtypeStruct(h.shape, jnp.float32)
        noise = jax.pure_callback(lambda: self._rng.standard_normal(h.shape, np.float32), shape)
        return h + noise.astype(h.dtype)

    def loss(self, plan: RematPlan) -> Callable:
        def block(params: PyTree, x: jax.Array) -> jax.Array:
            h = self._changed(jax.nn.gelu(checkpoint_name(x @ params["wi"], "mlpwi")))
            return x + checkpoint_name(h @ params["wo"], "mlpwo")

        def loss_fn(params, batch):  # type: ignore[no-untyped-def]
            x = apply_layers(plan, [functools.partial(block, p) for p in params], batch["x"])
            return jnp.mean((x.astype(jnp.float32) - batch["y"].astype(jnp.float32)) ** 2)

        return loss_fn


def redrawing(redraw: str, dtype: str = "float32", layers: int = 3, batch: int = 128) -> RedrawingMlp:
    return RedrawingMlp(redraw, dtype, layers, batch)
