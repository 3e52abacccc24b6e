"""A Flax linen decoder LM whose layers run under ``nn.scan``, as Flax's guides and large-model
code write it: one ``Block`` body, its parameters stacked over ``layers`` (``layers/...`` with a
leading axis of 4). ``linen-scanned.yaml`` searches it as written; ``remat=True`` wraps the body
in the model's own ``nn.remat`` first (``nn.scan(nn.remat(Block))``, MaxText's form).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.training.train_state import TrainState
from jax.ad_checkpoint import checkpoint_name


class Block(nn.Module):
    """Pre-norm causal self-attention and a gelu MLP; a scan body: ``(x, _) -> (x, None)``."""

    d_model: int
    heads: int
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        b, s, d = x.shape
        head_dim = d // self.heads
        h = nn.RMSNorm()(x)
        qkv = checkpoint_name(nn.DenseGeneral((3, self.heads, head_dim), use_bias=False)(h), "qkv")
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        context = checkpoint_name(jnp.einsum("bhqk,bkhd->bqhd", weights, v), "context")
        x = x + nn.DenseGeneral(d, axis=(-2, -1), use_bias=False)(context)
        hidden = checkpoint_name(nn.Dense(self.d_ff, use_bias=False)(nn.RMSNorm()(x)), "mlp_hidden")
        return x + nn.Dense(d, use_bias=False)(nn.gelu(hidden)), None


class Decoder(nn.Module):
    """``tokens [batch, seq] -> logits [batch, seq, vocab]``, ``layers`` blocks in one ``nn.scan``."""

    vocab: int
    layers: int
    d_model: int
    heads: int
    d_ff: int
    remat: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model)(tokens)
        body = nn.remat(Block, prevent_cse=False) if self.remat else Block
        stack = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        x, _ = stack(self.d_model, self.heads, self.d_ff, name="layers")(x, None)
        return nn.Dense(self.vocab, use_bias=False)(nn.RMSNorm()(x))


def train_step(state: TrainState, tokens: jax.Array) -> tuple[TrainState, jax.Array]:
    """A team's own step over a ``TrainState``: next-token cross-entropy plus a z-loss on the
    logits' log-normaliser (``1e-4 · logsumexp²``), then ``apply_gradients``. A spec's
    ``workload.train_step: "linen_scanned:train_step"`` measures this step."""

    def loss_fn(params: dict) -> jax.Array:
        logits = state.apply_fn({"params": params}, tokens)[:, :-1].astype(jnp.float32)
        labels = tokens[:, 1:]
        normaliser = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return (normaliser - chosen).mean() + 1e-4 * (normaliser**2).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
