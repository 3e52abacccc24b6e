"""Workloads for the tests, loaded through the spec's ``factory:`` like a user's own.

They are real JAX programs; what they add is observable behaviour: a record of every
execution (to prove over-budget plans never run), a loss that raises, one that hangs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from remat_search.mlp import MlpWorkload
from remat_search.plan import RematPlan
from remat_search.spec import MlpConfig

TINY_MLP = MlpConfig(kind="mlp", layers=3, width=64, hidden=256, batch=128)


class RecordingMlp(MlpWorkload):
    """An MLP whose training step appends the plan's digest to ``log`` each time it *runs*."""

    def __init__(self, log: str) -> None:
        super().__init__(TINY_MLP)
        self.log = Path(log)

    def step(self, plan: RematPlan) -> Callable:
        inner = super().step(plan)

        def record() -> None:
            with self.log.open("a") as f:
                f.write(plan.digest + "\n")

        def recorded_step(state, batch):  # type: ignore[no-untyped-def]
            jax.debug.callback(record)
            return inner(state, batch)

        return jax.jit(recorded_step, donate_argnums=0)


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
    """An MLP that appends the plan's digest to ``log`` each time its step is lowered for
    compiling (``step(plan).lower(...)``, which every measurement does first). ``scale``
    changes its loss, not its shapes."""

    def __init__(self, log: str, scale: float = 1.0) -> None:
        super().__init__(TINY_MLP)
        self.log = Path(log)
        self.scale = scale

    def loss(self, plan: RematPlan) -> Callable:
        inner = super().loss(plan)
        return lambda params, batch: self.scale * inner(params, batch)

    def step(self, plan: RematPlan, mesh: object = None) -> Callable:
        inner = super().step(plan)
        log = self.log

        class Counted:
            def __call__(self, *args):  # type: ignore[no-untyped-def]
                return inner(*args)

            def lower(self, *args):  # type: ignore[no-untyped-def]
                with log.open("a") as f:
                    f.write(plan.digest + "\n")
                return inner.lower(*args)

        return Counted()


class DelayedMlp(MlpWorkload):
    """An MLP whose step, when it runs, sleeps the milliseconds that the JSON file ``delays``
    gives for its plan's summary (``{"none×3": 40}``) at that moment, plus those ``"*"``
    gives for every plan: a machine that is busy while some plans are timed and not others."""

    def __init__(self, delays: str) -> None:
        super().__init__(TINY_MLP)
        self.delays = Path(delays)

    def step(self, plan: RematPlan) -> Callable:
        inner = super().step(plan)
        summary = plan.summary()

        def delay() -> None:
            delays = json.loads(self.delays.read_text())
            time.sleep((delays.get(summary, 0) + delays.get("*", 0)) / 1000)

        def delayed_step(state, batch):  # type: ignore[no-untyped-def]
            jax.debug.callback(delay)
            return inner(state, batch)

        return jax.jit(delayed_step, donate_argnums=0)


def counting(log: str, scale: float = 1.0) -> CountingMlp:
    return CountingMlp(log, scale)


def delayed(delays: str) -> DelayedMlp:
    return DelayedMlp(delays)


def recording(log: str) -> RecordingMlp:
    return RecordingMlp(log)


def raising() -> RaisingMlp:
    return RaisingMlp(TINY_MLP)


def hanging(started: str | None = None) -> HangingMlp:
    return HangingMlp(started)


def not_a_workload() -> dict:
    return {"layers": 3}


def failing_factory() -> None:
    raise ValueError("factory needs a config file")


def plain_function(x: jax.Array) -> jax.Array:
    """Used to check that a plan read back from JSON wraps functions."""
    return jnp.sin(x @ x.T)
