"""A small Flax linen decoder LM, written as a user would write one: remat-search's linen
workload searches it from a spec (``tests/test_linen.py``) with no edit and no subclass.

Token embeddings, ``layers`` pre-norm :class:`Block` s made in ``setup`` as the list
``self.blocks`` (so Flax names them ``blocks_0``, ``blocks_1``, …), a final norm and a head.
Each block is called with an array mask and a Python flag, as real decoders are, and tags its
tensors with ``checkpoint_name``: ``qkv``, ``attn_out``, ``mlp_hidden``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


class Block(nn.Module):
    """Causal self-attention and a gelu MLP, each with a residual."""

    d_model: int
    heads: int
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, *, decode: bool = False) -> jax.Array:
        assert not decode, "this test model only trains"
        head_dim = self.d_model // self.heads
        h = nn.LayerNorm(use_bias=False)(x)
        qkv = checkpoint_name(nn.DenseGeneral((3, self.heads, head_dim), use_bias=False)(h), "qkv")
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim)
        weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        context = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + checkpoint_name(nn.DenseGeneral(self.d_model, axis=(-2, -1))(context), "attn_out")
        h = checkpoint_name(nn.Dense(self.d_ff)(nn.LayerNorm(use_bias=False)(x)), "mlp_hidden")
        return x + nn.Dense(self.d_model)(nn.gelu(h))


class Decoder(nn.Module):
    """``tokens [batch, seq] -> logits [batch, seq, vocab]``."""

    vocab: int
    layers: int
    d_model: int
    heads: int
    d_ff: int

    def setup(self) -> None:
        self.embed = nn.Embed(self.vocab, self.d_model)
        self.blocks = [Block(self.d_model, self.heads, self.d_ff) for _ in range(self.layers)]
        self.norm = nn.LayerNorm(use_bias=False)
        self.head = nn.Dense(self.vocab, use_bias=False)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        mask = jnp.tril(jnp.ones((tokens.shape[1], tokens.shape[1]), dtype=bool))
        for block in self.blocks:
            x = block(x, mask, decode=False)
        return self.head(self.norm(x))


def z_loss_cross_entropy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy plus PaLM's z-loss (1e-4 × log Z²), a loss users write."""
    logits, targets = logits[:, :-1].astype(jnp.float32), tokens[:, 1:]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (log_z - picked + 1e-4 * log_z**2).mean()


def tiny_decoder(layers: int) -> Decoder:
    """A decoder of ``layers`` blocks at a tiny width, as a project's model-size presets are."""
    return Decoder(vocab=64, layers=layers, d_model=32, heads=2, d_ff=64)
