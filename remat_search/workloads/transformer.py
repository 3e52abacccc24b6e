"""The built-in ``transformer`` workload: a Flax linen decoder LM trained with AdamW.

Token embeddings, ``layers`` pre-norm blocks (RMSNorm → causal multi-head attention →
residual → RMSNorm → gelu MLP → residual), a final norm and logits, cross-entropy on the
next token. The parameters are one tree per module (``embed``, ``layer_0`` … or, with
``scan: true``, ``layers`` stacked along a leading axis, ``final_norm``, ``logits``) and do
not depend on the plan; the loss applies the blocks functionally, checkpointed by the plan
(:func:`~remat_search.plans.plan.apply_layers`, or :func:`~remat_search.plans.plan.scan_layers` with one
``lax.scan`` per run of equal policies). The block names its tensors as MaxText does, so
``names`` policies can keep them: ``query_proj``, ``key_proj``, ``value_proj``,
``context``, ``out_proj``, ``mlpwi``, ``mlpwo``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from remat_search.errors import SpecError
from remat_search.plans.plan import RematPlan, apply_layers, scan_layers
from remat_search.spec.workloads import FLASH_BLOCK, TransformerConfig, flash_tiles, resolved_attention
from remat_search.targets.platform import is_tpu
from remat_search.workloads.base import PyTree, Workload
from remat_search.workloads.sharding import split_batch_over

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
    mesh: Any = None
    """The target's mesh (None: one device): where the flash kernel runs."""
    flash: bool = False
    """Fused attention (the config's attention as resolved for the target), else dense."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        norm, dense, dense_general = _layers(c)
        x = _split_batch(x, self.mesh)
        head_dim = c.d_model // c.heads
        h = norm(name="attn_norm")(x)
        q, k, v = (
            checkpoint_name(dense_general((c.heads, head_dim), name=n)(h), f"{n}_proj")
            for n in ("query", "key", "value")
        )
        context = checkpoint_name(_attention(q, k, v, flash=self.flash, mesh=self.mesh), "context")
        x = x + checkpoint_name(dense_general(c.d_model, axis=(-2, -1), name="out")(context), "out_proj")
        h = norm(name="mlp_norm")(x)
        h = checkpoint_name(dense(c.d_ff, name="wi")(h), "mlpwi")
        return x + checkpoint_name(dense(c.d_model, name="wo")(nn.gelu(h)), "mlpwo")


def _split_batch(x: jax.Array, mesh: Any) -> jax.Array:
    """``x`` constrained to be split along its batch over the mesh's batch axes, as the inputs
    are. Without it, inside a scanned model's loop XLA's sharding propagation may follow the
    FSDP-split weights instead and gather every layer's activations across the chips."""
    batch_axes = split_batch_over(mesh)
    if not batch_axes or x.shape[0] % math.prod(mesh.shape[a] for a in batch_axes):
        return x
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(batch_axes)))


FLASH_BLOCK_FIELDS = ("block_q", "block_k_major", "block_k", "block_q_major_dkv", "block_q_dkv", "block_k_major_dkv",
                      "block_k_dkv", "block_q_dq", "block_k_major_dq", "block_k_dq")
"""The sequence blocks of Pallas's flash attention kernel (its ``BlockSizes`` but the batch's):
what ``_attention``'s ``blocks`` may name."""


def _attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, flash: bool, mesh: Any, causal: bool = True,
    blocks: Mapping[str, int] | None = None,
) -> jax.Array:
    """Multi-head attention of ``[batch, seq, heads, head_dim]`` queries, keys and values
    (see :attr:`TransformerConfig.attention`), causal unless said (MaxText's v5e runs of 2023
    computed every score). The Pallas TPU kernel tiles the sequence in :data:`FLASH_BLOCK`
    tokens, or in ``blocks`` (its ``BlockSizes`` by field, those named) where given."""
    head_dim = q.shape[-1]
    if not flash:
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), dtype=bool)) if causal else jnp.ones((), dtype=bool)
        weights = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(scores.dtype).min), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    batch_axes = split_batch_over(mesh)
    ways = math.prod(mesh.shape[a] for a in batch_axes)
    # Not the TPU kernel off a TPU, nor for init's one-sequence batch (it only shapes the parameters).
    if mesh is None or not is_tpu(mesh.devices.flat[0].platform) or q.shape[0] % ways:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas
    from jax.sharding import PartitionSpec as P

    sizes = pallas.BlockSizes(block_b=1, **dict.fromkeys(FLASH_BLOCK_FIELDS, FLASH_BLOCK) | dict(blocks or {}))

    def kernel(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:  # [b, h, s, d] on one shard
        return pallas.flash_attention(q, k, v, causal=causal, sm_scale=head_dim**-0.5, block_sizes=sizes)

    # Mosaic kernels are not partitioned by XLA: each shard of the batch runs its own.
    batch = P(batch_axes or None)
    heads_first = [jnp.swapaxes(t, 1, 2) for t in (q, k, v)]
    out = jax.shard_map(kernel, mesh=mesh, in_specs=(batch,) * 3, out_specs=batch, check_vma=False)(*heads_first)
    return jnp.swapaxes(out, 1, 2)


class TransformerWorkload(Workload):
    """Embeddings, ``layers`` :class:`Block` s (unrolled or scanned), final norm and logits,
    at the sizes of a :class:`TransformerConfig`."""

    name = "transformer"
    tensor_names = TENSOR_NAMES

    def __init__(self, config: TransformerConfig) -> None:
        self.config = config
        self.layers = config.layers

    def use_mesh(self, mesh: Any) -> None:
        """Keep the mesh (the flash kernel runs per shard of it); refuse a sequence the TPU
        kernel cannot tile."""
        c = self.config
        if c.attention == "flash" and mesh is not None and is_tpu(mesh.devices.flat[0].platform) and not flash_tiles(c):
            raise SpecError(
                f"workload.attention: flash on a TPU target runs the Pallas kernel, whose blocks are "
                f"{FLASH_BLOCK} tokens: seq_len must be a multiple of {FLASH_BLOCK}, got {c.seq_len}"
            )
        super().use_mesh(mesh)

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices (this process's default one without a mesh)."""
        return str(self.mesh.devices.flat[0].platform if self.mesh is not None else jax.devices()[0].platform)

    @property
    def attention(self) -> str:
        """The attention this workload runs with: the config's, ``auto`` resolved for :attr:`platform`."""
        return resolved_attention(self.config, self.platform)

    def note(self) -> str | None:
        """``attention: auto → …``, what ``auto`` became for the target and why (None unless auto)."""
        if self.config.attention != "auto":
            return None
        platform = self.platform
        tpu_kernel = self.mesh is not None and is_tpu(platform)
        if self.attention == "flash":
            return f"attention: auto → flash ({'Pallas TPU kernel' if tpu_kernel else 'jax.nn.dot_product_attention'})"
        if is_tpu(platform):
            return (f"attention: auto → dense (seq_len {self.config.seq_len} is not a multiple of the "
                    f"Pallas TPU kernel's {FLASH_BLOCK}-token blocks)")
        return f"attention: auto → dense (on {platform}, flash would be XLA's composition, which keeps the scores too)"

    def _modules(self) -> dict[str, nn.Module]:
        c = self.config
        norm, dense, _ = _layers(c)
        return {
            "embed": nn.Embed(c.vocab, c.d_model, dtype=c.dtype, param_dtype=c.dtype),
            "block": Block(c, self.mesh, flash=self.attention == "flash"),
            "final_norm": norm(),
            "logits": dense(c.vocab),
        }

    def init_params(self, key: jax.Array) -> PyTree:
        """``{embed, layer_0 … layer_{n-1} | layers (stacked), final_norm, logits}``.

        Layer ``i`` is initialised from the same key whether scanned or not, so both forms
        of one config and seed hold the same numbers.
        """
        c, m = self.config, self._modules()
        embed_key, layers_key, norm_key, logits_key = jax.random.split(key, 4)
        tokens = jnp.zeros((1, c.seq_len), jnp.int32)
        x = jnp.zeros((1, c.seq_len, c.d_model), jnp.dtype(c.dtype))

        def init_block(k: jax.Array) -> PyTree:
            return m["block"].init(k, x)["params"]

        layer_keys = jax.random.split(layers_key, c.layers)
        if c.scan:
            layers = {"layers": jax.vmap(init_block)(layer_keys)}
        else:
            layers = {f"layer_{i}": init_block(k) for i, k in enumerate(layer_keys)}
        return {
            "embed": m["embed"].init(embed_key, tokens)["params"],
            **layers,
            "final_norm": m["final_norm"].init(norm_key, x)["params"],
            "logits": m["logits"].init(logits_key, x)["params"],
        }

    def make_batch(self, key: jax.Array) -> PyTree:
        c = self.config
        return jax.random.randint(key, (c.batch, c.seq_len + 1), 0, c.vocab, dtype=jnp.int32)

    def loss(self, plan: RematPlan) -> Callable[[PyTree, PyTree], jax.Array]:
        c, m = self.config, self._modules()

        def block(layer_params: PyTree, x: jax.Array) -> jax.Array:
            return m["block"].apply({"params": layer_params}, x)

        def loss_fn(params: PyTree, tokens: jax.Array) -> jax.Array:
            x = m["embed"].apply({"params": params["embed"]}, tokens[:, :-1])
            if c.scan:
                x = scan_layers(plan, block, params["layers"], x)
            else:
                x = apply_layers(
                    plan, [functools.partial(block, params[f"layer_{i}"]) for i in range(c.layers)], x
                )
            x = m["final_norm"].apply({"params": params["final_norm"]}, x)
            logits = m["logits"].apply({"params": params["logits"]}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return loss_fn
