"""The built-in ``transformer`` workload: a Flax linen decoder LM trained with AdamW.

Token embeddings, ``layers`` pre-norm blocks (RMSNorm → causal multi-head attention →
residual → RMSNorm → gelu MLP → residual), a final norm and logits, cross-entropy on the
next token. Each block is wrapped with ``nn.remat`` by the plan. The block names its
tensors as MaxText does, so ``names`` policies can keep them: ``query_proj``,
``key_proj``, ``value_proj``, ``context``, ``out_proj``, ``mlpwi``, ``mlpwo``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from remat_search.plan import RematPlan
from remat_search.spec import TransformerConfig
from remat_search.workload import PyTree, Workload

TENSOR_NAMES = frozenset(
    {"query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi", "mlpwo"}
)


def _layers(config: TransformerConfig) -> tuple[Callable[..., nn.Module], ...]:
    """RMSNorm, Dense and DenseGeneral (no biases) in the config's dtype, params included."""
    kw = {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.dtype)}
    return (
        functools.partial(nn.RMSNorm, **kw),
        functools.partial(nn.Dense, use_bias=False, **kw),
        functools.partial(nn.DenseGeneral, use_bias=False, **kw),
    )


class Block(nn.Module):
    """One decoder layer."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        norm, dense, dense_general = _layers(c)
        head_dim = c.d_model // c.heads
        h = norm(name="attn_norm")(x)
        q, k, v = (
            checkpoint_name(dense_general((c.heads, head_dim), name=n)(h), f"{n}_proj")
            for n in ("query", "key", "value")
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
        context = checkpoint_name(jnp.einsum("bhqk,bkhd->bqhd", weights, v), "context")
        x = x + checkpoint_name(dense_general(c.d_model, axis=(-2, -1), name="out")(context), "out_proj")
        h = norm(name="mlp_norm")(x)
        h = checkpoint_name(dense(c.d_ff, name="wi")(h), "mlpwi")
        return x + checkpoint_name(dense(c.d_model, name="wo")(nn.gelu(h)), "mlpwo")


class Decoder(nn.Module):
    """Embeddings, one :class:`Block` per layer (each remat-wrapped by ``plan``), logits."""

    config: TransformerConfig
    plan: RematPlan

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        norm, dense, _ = _layers(c)
        x = nn.Embed(c.vocab, c.d_model, dtype=c.dtype, param_dtype=c.dtype, name="embed")(tokens)
        for i in range(c.layers):
            x = self.plan.remat_module(Block, i)(c, name=f"layer_{i}")(x)
        x = norm(name="final_norm")(x)
        return dense(c.vocab, name="logits")(x)


class TransformerWorkload(Workload):
    """The :class:`Decoder` at the sizes of a :class:`TransformerConfig`."""

    name = "transformer"
    tensor_names = TENSOR_NAMES

    def __init__(self, config: TransformerConfig) -> None:
        self.config = config
        self.layers = config.layers

    def _model(self, plan: RematPlan) -> Decoder:
        return Decoder(self.config, plan)

    def init_params(self, key: jax.Array) -> PyTree:
        tokens = jnp.zeros((1, self.config.seq_len), jnp.int32)
        return self._model(RematPlan.uniform("none", self.layers)).init(key, tokens)["params"]

    def make_batch(self, key: jax.Array) -> PyTree:
        c = self.config
        return jax.random.randint(key, (c.batch, c.seq_len + 1), 0, c.vocab, dtype=jnp.int32)

    def loss(self, plan: RematPlan) -> Callable[[PyTree, PyTree], jax.Array]:
        model = self._model(plan)

        def loss_fn(params: PyTree, tokens: jax.Array) -> jax.Array:
            logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return loss_fn
