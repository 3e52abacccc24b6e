"""Small language models that shard their own parameters, as MaxText-style models do: by
logical axis names (``embed``, ``mlp``, ``vocab``) mapped onto the mesh by rules the spec gives.
The linen one also constrains its hidden activations by logical names. Widths are multiples
of 128 split at most 2 ways, so a TPU's tiles pad nothing and per-chip bytes are exact.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

RULES = [["batch", ["data", "fsdp"]], ["embed", "fsdp"], ["mlp", "tensor"], ["vocab", None]]
"""The rules a spec gives for these models: how each logical name maps onto the mesh."""
PARTITIONS = {"embedding": ("vocab", "embed"), "wi": ("embed", "mlp"), "wo": ("mlp", "embed"), "head": ("embed", "vocab")}
"""Each kernel's logical names, by the kernel's name."""

_init = nn.initializers.lecun_normal()


class LinenBlock(nn.Module):
    """A residual gelu MLP whose kernels are partitioned by logical names."""

    d_model: int
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        wi = self.param("wi", nn.with_logical_partitioning(_init, PARTITIONS["wi"]), (self.d_model, self.d_ff))
        wo = self.param("wo", nn.with_logical_partitioning(_init, PARTITIONS["wo"]), (self.d_ff, self.d_model))
        h = nn.with_logical_constraint(checkpoint_name(x @ wi, "mlpwi"), ("batch", None, "mlp"))
        return x + checkpoint_name(jax.nn.gelu(h) @ wo, "mlpwo")


class LinenLM(nn.Module):
    """``tokens [batch, seq] -> logits [batch, seq, vocab]``: embeddings, blocks, a head."""

    vocab: int
    layers: int
    d_model: int
    d_ff: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.param("embedding", nn.with_logical_partitioning(_init, PARTITIONS["embedding"]),
                           (self.vocab, self.d_model))
        x = table[tokens]
        for _ in range(self.layers):
            x = LinenBlock(self.d_model, self.d_ff)(x)
        head = self.param("head", nn.with_logical_partitioning(_init, PARTITIONS["head"]), (self.d_model, self.vocab))
        return x @ head


class NnxBlock(nnx.Module):
    """A residual gelu MLP whose kernels carry logical ``out_sharding`` metadata."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs) -> None:
        self.wi = nnx.Linear(d_model, d_ff, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(_init, PARTITIONS["wi"]))
        self.wo = nnx.Linear(d_ff, d_model, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(_init, PARTITIONS["wo"]))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + checkpoint_name(self.wo(jax.nn.gelu(checkpoint_name(self.wi(x), "mlpwi"))), "mlpwo")


class NnxLM(nnx.Module):
    """``tokens -> logits``: embeddings, ``layers`` blocks in ``self.blocks``, a head."""

    def __init__(self, vocab: int, layers: int, d_model: int, d_ff: int, *, rngs: nnx.Rngs) -> None:
        self.embedding = nnx.Embed(vocab, d_model, rngs=rngs,
                                   embedding_init=nnx.with_partitioning(_init, PARTITIONS["embedding"]))
        self.blocks = nnx.List([NnxBlock(d_model, d_ff, rngs=rngs) for _ in range(layers)])
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(_init, PARTITIONS["head"]))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
