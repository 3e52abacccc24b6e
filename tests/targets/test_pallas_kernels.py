"""A Pallas TPU kernel's FLOPs, counted in its Mosaic body: Pallas's own flash attention,
compiled for a v5e by the real TPU compiler (ahead of time, as a study compiles)."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from remat_search.spec.models import TpuTarget
from remat_search.targets.base import target_of
from remat_search.targets.pallas_kernels import kernel_flops
from remat_search.targets.chips import CHIPS
from remat_search.targets.step_time import estimate_step

B, H, S, D, BLOCK = 1, 2, 512, 128, 128  # B a chip
SCORES = B * H * S * S * D  # one matmul of the scores' shape, halved: 2·B·H·S·S·D is its FLOPs


def _kernels(causal: bool) -> tuple[str, dict[str, float | None]]:
    """The optimized HLO of flash attention's forward and backward on a v5e 2x2, the batch
    split over the 4 chips, and the counted FLOPs of each kernel in it (a chip's share) by its
    name (``flash_attention``, ``flash_mha_bwd_dkv``…)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas

    sizes = pallas.BlockSizes(
        block_q=BLOCK, block_k_major=BLOCK, block_k=BLOCK, block_b=1, block_q_major_dkv=BLOCK,
        block_k_major_dkv=BLOCK, block_k_dkv=BLOCK, block_q_dkv=BLOCK, block_k_major_dq=BLOCK,
        block_k_dq=BLOCK, block_q_dq=BLOCK,
    )

    mesh = target_of(TpuTarget(platform="tpu", topology="v5e:2x2")).mesh({"data": 4})
    batch = PartitionSpec("data")

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        kernel = partial(pallas.flash_attention, causal=causal, sm_scale=D**-0.5, block_sizes=sizes)
        out = jax.shard_map(kernel, mesh=mesh, in_specs=(batch,) * 3, out_specs=batch, check_vma=False)(q, k, v)
        return jnp.sum(out.astype(jnp.float32))

    shape = jax.ShapeDtypeStruct((4 * B, H, S, D), jnp.bfloat16, sharding=NamedSharding(mesh, batch))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile().as_text()
    kernels = {}
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            name = re.match(r"\s*%?([a-z_]+)", line)[1]
            kernels[name.removesuffix("_block_q_major_")] = kernel_flops(line)
    return hlo, kernels


@pytest.fixture(scope="module")
def compiled() -> dict[bool, tuple[str, dict[str, float | None]]]:
    return {causal: _kernels(causal) for causal in (False, True)}


def _flops(kernels: dict[str, float | None], prefix: str) -> float | None:
    found = [flops for name, flops in kernels.items() if name.startswith(prefix)]
    assert len(found) == 1, kernels
    return found[0]


def test_flash_attentions_kernels_count_two_matmuls_forward_and_seven_backward(compiled) -> None:
    _, kernels = compiled[False]
    # Forward: the scores Q·Kᵀ and P·V. The backward's dK/dV kernel recomputes the scores, then
    # dV, dP and dK; its dQ kernel recomputes the scores, then dP and dQ. The forward states
    # its own estimate; the backward's state none, and were priced by their bytes alone.
    assert _flops(kernels, "flash_attention") == 2 * 2 * SCORES
    assert _flops(kernels, "flash_mha_bwd_dkv") == 4 * 2 * SCORES
    assert _flops(kernels, "flash_mha_bwd_dq") == 3 * 2 * SCORES


def test_a_causal_kernel_counts_the_blocks_it_runs(compiled) -> None:
    _, kernels = compiled[True]
    # 4 blocks along the sequence: the kernels run the 10 of 16 (query, key) block pairs on or
    # below the diagonal, and skip the rest (pl.when). The forward's own estimate counts all 16.
    runs = (4 * 5 // 2) / 16
    assert _flops(kernels, "flash_attention") == 2 * 2 * SCORES * runs
    assert _flops(kernels, "flash_mha_bwd_dkv") == 4 * 2 * SCORES * runs
    assert _flops(kernels, "flash_mha_bwd_dq") == 3 * 2 * SCORES * runs


def test_the_step_time_model_counts_the_kernels(compiled) -> None:
    for causal, (hlo, kernels) in compiled.items():
        counted = sum(flops or 0.0 for flops in kernels.values())
        assert estimate_step(hlo, CHIPS["v5e"]).flops >= counted > 0, causal


def test_a_loop_counts_each_iteration_and_a_condition_on_the_grid_its_points() -> None:
    from jax.experimental import pallas as pl

    def kernel(x_ref: jax.Array, o_ref: jax.Array) -> None:
        o_ref[...] = jnp.zeros_like(o_ref)

        @pl.when(pl.program_id(0) < 3)  # 3 of the grid's 4 points
        def _() -> None:
            def body(_: int, acc: jax.Array) -> jax.Array:
                return acc + jnp.dot(x_ref[...], x_ref[...], preferred_element_type=jnp.float32)

            o_ref[...] = jax.lax.fori_loop(0, 5, body, jnp.zeros((128, 128), jnp.float32))  # scf.for, 5 times

        @pl.when(jnp.logical_not(pl.program_id(0) < 3))  # the other point: one matmul
        def _() -> None:
            o_ref[...] = jnp.dot(x_ref[...], x_ref[...], preferred_element_type=jnp.float32)

    call = pl.pallas_call(
        kernel, grid=(4,), in_specs=[pl.BlockSpec((128, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((128, 128), lambda i: (i, 0)), out_shape=jax.ShapeDtypeStruct((512, 128), jnp.float32),
    )
    mesh = target_of(TpuTarget(platform="tpu", topology="v5e:2x2")).mesh({"data": 4})
    x = jax.ShapeDtypeStruct((4 * 512, 128), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("data")))
    sharded = jax.shard_map(call, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data"),
                            check_vma=False)
    hlo = jax.jit(sharded).lower(x).compile().as_text()
    [line] = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert kernel_flops(line) == (3 * 5 + 1) * 2 * 128**3


def test_a_kernel_whose_body_cannot_be_read_keeps_its_own_estimate() -> None:
    assert kernel_flops('backend_config={"custom_call_config":{"body":"bm90IG1saXI="}}') is None  # "not mlir"
    assert kernel_flops('custom_call_target="__cublas$gemm"') is None


def test_a_kernels_matmuls_are_priced_as_the_chips_matrix_unit_spends_them(compiled) -> None:
    hlo, kernels = compiled[False]
    lines = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(lines) == 3
    for line in lines:
        # 128-token blocks of 128-wide heads: whole tiles of a v5e's 128-wide MXU; on a v6e's
        # 256-wide one, both the contraction and the held operand's width fill half a tile.
        assert kernel_flops(line, 128) == kernel_flops(line)
        assert kernel_flops(line, 256) == 4 * kernel_flops(line)
    counted = sum(flops or 0.0 for flops in kernels.values())
    v5e, v6e = (estimate_step(hlo, CHIPS[chip]) for chip in ("v5e", "v6e"))
    assert v5e.mxu_flops == v5e.flops
    assert v6e.flops == v5e.flops
    assert v6e.mxu_flops == v6e.flops + 3 * counted
    assert v6e.compute_seconds >= v6e.mxu_flops / CHIPS["v6e"].bf16_flops
