"""The batch a Flax model's workload (``nnx``, ``linen``) trains on, what its model is called
with, and the loss over it: int32 tokens and next-token cross-entropy by default, or the
user's own batch factory and loss (:class:`~remat_search.spec.workloads.BatchConfig`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from remat_search.errors import WorkloadError, first_line
from remat_search.imports import import_object
from remat_search.spec.workloads import BatchConfig, LinenConfig, NnxConfig
from remat_search.workloads.base import PyTree, next_token_loss


class Inputs:
    """A workload's batch and loss, as its spec names them.

    ``make_batch(key)`` draws the batch; ``model_args(batch)`` is what the model is called with
    (the tokens, or the factory batch's ``model_input``); ``loss(outputs, batch)`` the scalar the
    step differentiates. A factory that does not import, raises, or returns no arrays is a
    one-line :class:`WorkloadError` naming ``workload.batch``."""

    def __init__(self, config: NnxConfig | LinenConfig) -> None:
        self.config = config
        self.tokens = not isinstance(config.batch, BatchConfig)
        self._loss = import_object(config.loss, "workload.loss") if config.loss else next_token_loss
        if not callable(self._loss):
            raise WorkloadError(f"workload.loss: {config.loss!r} is not a function (outputs, batch) -> scalar")
        if isinstance(config.batch, BatchConfig):
            self._factory = import_object(config.batch.factory, "workload.batch.factory", what="function")
            if not callable(self._factory):
                raise WorkloadError(f"workload.batch.factory: {config.batch.factory!r} is not a function")
            self._keyed = _takes(self._factory, "key")
            self.shapes = self._factory_shapes()

    def _factory_shapes(self) -> PyTree:
        batch = self.config.batch
        assert isinstance(batch, BatchConfig)
        try:
            shapes = jax.eval_shape(self.make_batch, jax.random.key(0))
        except WorkloadError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's factory's failure, in one line
            raise WorkloadError(f"workload.batch.factory: {batch.factory!r} raised {type(e).__name__}: "
                                f"{first_line(e)}") from None
        leaves = jax.tree.leaves(shapes)
        if not leaves or not all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves):
            raise WorkloadError(f"workload.batch.factory: {batch.factory!r} returned no arrays; expected an array, "
                                "a tuple or a dict of arrays")
        self.model_args(shapes)  # the model's part of it exists
        return shapes

    def make_batch(self, key: jax.Array) -> PyTree:
        """One batch: random tokens ``[batch, seq_len]`` in ``[0, vocab)``, or the factory's."""
        c = self.config
        if isinstance(c.batch, int):
            assert c.seq_len is not None and c.vocab is not None
            return jax.random.randint(key, (c.batch, c.seq_len), 0, c.vocab, dtype=jnp.int32)
        kwargs = {**c.batch.args, **({"key": key} if self._keyed else {})}
        try:
            made = self._factory(**kwargs)
        except Exception as e:  # noqa: BLE001
            raise WorkloadError(f"workload.batch.factory: {c.batch.factory!r} raised {type(e).__name__}: "
                                f"{first_line(e)}") from None
        return jax.tree.map(jnp.asarray, made)

    def abstract_batch(self) -> PyTree:
        """The batch's shapes and dtypes."""
        c = self.config
        if isinstance(c.batch, int):
            return jax.ShapeDtypeStruct((c.batch, c.seq_len), jnp.int32)
        return self.shapes

    def model_args(self, batch: PyTree) -> tuple[Any, ...]:
        """What the model is called with: ``(tokens,)``, or ``(batch[model_input],)``."""
        c = self.config
        if not isinstance(c.batch, BatchConfig):
            return (batch,)
        pick = c.batch.model_input
        if pick is None:
            return (batch[0],) if isinstance(batch, (tuple, list)) else (batch,)
        try:
            return (batch[pick],)
        except (KeyError, IndexError, TypeError):
            held = sorted(batch) if isinstance(batch, dict) else f"{type(batch).__name__} of {len(batch)}" if isinstance(
                batch, (tuple, list)) else type(batch).__name__
            raise WorkloadError(f"workload.batch.model_input: {pick!r} is not in the batch ({held})") from None

    def loss(self, outputs: Any, batch: PyTree) -> jax.Array:
        """The scalar loss of the model's ``outputs`` on ``batch``."""
        return self._loss(outputs, batch)

    def check_outputs(self, outputs: Any) -> None:
        """With tokens and the default loss: ``outputs`` (shapes) are logits ``[batch, seq_len, vocab]``."""
        c = self.config
        if self.tokens and c.loss is None:
            expected = (c.batch, c.seq_len, c.vocab)
            if getattr(outputs, "shape", None) != expected:
                got = getattr(outputs, "shape", type(outputs).__name__)
                raise WorkloadError(
                    f"workload.model: returns {got}, the default loss expects logits of shape {list(expected)} "
                    "(batch, seq_len, vocab); or name a loss: 'package.module:function'"
                )

    def describe(self) -> str:
        """The batch in words (``tokens [8, 512]``, ``my.data:images: (float32[8,32,32,3], int32[8])``)."""
        c = self.config
        if isinstance(c.batch, int):
            return f"int32 tokens [{c.batch}, {c.seq_len}] in [0, {c.vocab})"
        text = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", self.shapes)
        return f"{c.batch.factory}: {text}"


def check_scalar(jaxpr: Any, field: str) -> None:
    """A one-line :class:`WorkloadError` naming ``field`` unless ``jaxpr`` returns one scalar."""
    avals = jaxpr.out_avals
    if len(avals) != 1 or getattr(avals[0], "shape", None) != ():
        got = f"shape {list(avals[0].shape)}" if len(avals) == 1 else f"{len(avals)} values"
        raise WorkloadError(f"{field}: returned {got}, expected a scalar")


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def described(value: Any) -> str:
    """What a user's function returned, in words: ``an array of shape [8]``, else its type."""
    if isinstance(value, jax.Array):
        return "a scalar" if value.shape == () else f"an array of shape {list(value.shape)}"
    return type(value).__name__
