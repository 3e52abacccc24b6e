"""A small Flax NNX decoder LM, written as a user writes one: remat-search searches it through
a spec (``kind: nnx``) without editing or subclassing it.

Token embeddings, ``layers`` pre-norm blocks (causal multi-head attention and a gelu MLP, each
residual), a final norm and the logits. The blocks tag tensors with ``checkpoint_name``
(``query_proj``, ``key_proj``, ``value_proj``, ``context``, ``out_proj``, ``mlpwi``,
``mlpwo``), and ``tag_mlp=False`` leaves the MLP's two untagged, as a model's configuration can.
``dropout > 0`` adds dropout after the MLP, drawing from an RNG stream the model holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name


class Block(nnx.Module):
    """One decoder layer."""

    def __init__(
        self, d_model: int, heads: int, d_ff: int, *, tag_mlp: bool, dropout: float, rngs: nnx.Rngs
    ) -> None:
        self.heads, self.tag_mlp = heads, tag_mlp
        self.attn_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.wi = nnx.Linear(d_model, d_ff, rngs=rngs)
        self.wo = nnx.Linear(d_ff, d_model, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        head_dim = d // self.heads
        q, k, v = (
            checkpoint_name(t.reshape(b, s, self.heads, head_dim), name)
            for t, name in zip(
                jnp.split(self.qkv(self.attn_norm(x)), 3, axis=-1), ("query_proj", "key_proj", "value_proj"),
                strict=True,
            )
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
        context = checkpoint_name(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d), "context")
        x = x + checkpoint_name(self.out(context), "out_proj")
        h = self.wi(self.mlp_norm(x))
        h = checkpoint_name(h, "mlpwi") if self.tag_mlp else h
        h = self.wo(jax.nn.gelu(h))
        h = self.dropout(h) if self.dropout is not None else h
        return x + (checkpoint_name(h, "mlpwo") if self.tag_mlp else h)


class Decoder(nnx.Module):
    """Embeddings, ``layers`` :class:`Block` s in ``self.blocks``, final norm and logits."""

    def __init__(
        self, vocab: int, d_model: int, heads: int, d_ff: int, layers: int, *, tag_mlp: bool = True,
        dropout: float = 0.0, rngs: nnx.Rngs,
    ) -> None:
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, d_ff, tag_mlp=tag_mlp, dropout=dropout, rngs=rngs) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


class Detached(nnx.Module):
    """A model whose structure does not allow substitution: it keeps its blocks in ``blocks``
    but runs them from a tuple it made at construction, so replacing ``blocks``' elements
    changes nothing it calls."""

    def __init__(self, vocab: int, d_model: int, layers: int, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(d_model, d_model, rngs=rngs) for _ in range(layers)])
        self.run_order = nnx.data(tuple(self.blocks))
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.run_order:
            x = jnp.tanh(block(x))
        return self.head(x)
