"""The built-in ``mlp`` workload: a residual chain of dense → gelu → dense blocks.

The block of the JAX gradient-checkpointing guide, repeated ``layers`` times, trained
with AdamW on a regression target. Tensors are named ``mlpwi`` (after the first dense)
and ``mlpwo`` (after the second), as in MaxText.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from remat_search.plans.plan import RematPlan, apply_layers
from remat_search.spec.workloads import MlpConfig
from remat_search.workloads.base import PyTree, Workload


def mlp_block(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One residual block: ``x + gelu(x @ wi) @ wo`` with named intermediates."""
    h = jax.nn.gelu(checkpoint_name(x @ params["wi"], "mlpwi"))
    return x + checkpoint_name(h @ params["wo"], "mlpwo")


class MlpWorkload(Workload):
    """A chain of :func:`mlp_block` layers (``layers``, ``width``, ``hidden``, ``batch``)."""

    name = "mlp"
    tensor_names = frozenset({"mlpwi", "mlpwo"})

    def __init__(self, config: MlpConfig) -> None:
        self.config = config
        self.layers = config.layers

    def init_params(self, key: jax.Array) -> PyTree:
        c = self.config
        keys = jax.random.split(key, 2 * c.layers)
        return [
            {
                "wi": jax.random.normal(keys[2 * i], (c.width, c.hidden)) / jnp.sqrt(c.width),
                "wo": jax.random.normal(keys[2 * i + 1], (c.hidden, c.width)) / jnp.sqrt(c.hidden),
            }
            for i in range(c.layers)
        ]

    def make_batch(self, key: jax.Array) -> PyTree:
        x_key, y_key = jax.random.split(key)
        shape = (self.config.batch, self.config.width)
        return {"x": jax.random.normal(x_key, shape), "y": jax.random.normal(y_key, shape)}

    def loss(self, plan: RematPlan) -> Callable[[PyTree, PyTree], jax.Array]:
        def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
            x = apply_layers(plan, [functools.partial(mlp_block, p) for p in params], batch["x"])
            return jnp.mean((x - batch["y"]) ** 2)

        return loss_fn
