"""A Flax NNX decoder LM written with Flax's scan-over-layers idiom: its ``layers`` blocks are
one ``Block`` made under ``nnx.vmap`` (every parameter stacked over a leading axis of
``layers``) and run with ``nnx.scan``. ``nnx-scanned.yaml`` searches it as written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name


class Block(nnx.Module):
    """Pre-norm causal self-attention and a gelu MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int, d_ff: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.heads = heads
        self.attn_norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.wi = nnx.Linear(d_model, d_ff, use_bias=False, dtype=dtype, rngs=rngs)
        self.wo = nnx.Linear(d_ff, d_model, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        head_dim = d // self.heads
        qkv = checkpoint_name(self.qkv(self.attn_norm(x)), "qkv").reshape(b, s, 3, self.heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        context = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
        x = x + checkpoint_name(self.out(checkpoint_name(context, "context")), "out_proj")
        hidden = checkpoint_name(self.wi(self.mlp_norm(x)), "mlp_hidden")
        return x + self.wo(jax.nn.gelu(hidden))


class Decoder(nnx.Module):
    """``tokens [batch, seq] -> logits [batch, seq, vocab]``; ``self.blocks`` is one stack of blocks."""

    def __init__(self, vocab: int, layers: int, d_model: int, heads: int, d_ff: int, *,
                 dtype: str = "float32", rngs: nnx.Rngs) -> None:
        dt = jnp.dtype(dtype)
        self.embed = nnx.Embed(vocab, d_model, dtype=dt, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(d_model, heads, d_ff, dtype=dt, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = nnx.RMSNorm(d_model, dtype=dt, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, dtype=dt, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        x = run(self.embed(tokens), self.blocks)
        return self.head(self.final_norm(x)).astype(jnp.float32)
