"""A matmul as a TPU's matrix unit spends it: its contraction and its held operand's width
padded to whole tiles of the unit's side."""

from __future__ import annotations

from remat_search.targets.mxu import mxu_flops
from remat_search.targets.chips import CHIPS


def test_a_matmul_of_whole_tiles_costs_its_flops() -> None:
    assert mxu_flops(512, 256, 768, 256) == 2 * 512 * 256 * 768
    assert mxu_flops(512, 128, 512, 128) == 2 * 512 * 128 * 512
    assert mxu_flops(3, 5, 7, None, batch=2) == 2 * 2 * 3 * 5 * 7  # a chip without one: unpadded


def test_a_128_wide_contraction_runs_at_half_rate_on_a_256_wide_unit() -> None:
    assert mxu_flops(512, 128, 512, 256) == 2 * (2 * 512 * 128 * 512)
    assert mxu_flops(512, 130, 512, 128) == 2 * 512 * 256 * 512  # 130 takes two tiles


def test_the_operand_held_is_the_one_that_pads_least() -> None:
    # [8, 128] @ [128, 64]: holding the right operand pads its width 64 → 128 (2×); holding the
    # left one pads its 8 rows → 128 (16×). The compiler may hold either: the cheaper is priced.
    assert mxu_flops(8, 128, 64, 128) == 2 * 8 * 128 * 128
    assert mxu_flops(64, 128, 8, 128) == 2 * 8 * 128 * 128
    assert mxu_flops(128, 128, 128, 256, batch=3) == 3 * 4 * (2 * 128**3)  # both the contraction and the width


def test_each_chips_mxu_is_the_side_jaxs_own_table_gives() -> None:
    from jax._src.pallas.mosaic.tpu_info import ChipVersion  # Pallas's table of TPU hardware
    from jax.experimental.pallas import tpu as pltpu

    for name in ("v4", "v5e", "v5p", "v6e"):
        cores = 2 if name in ("v4", "v5p") else 1  # megacore chips: two TensorCores a device
        assert pltpu.get_tpu_info_for_chip(ChipVersion(name), cores).mxu_column_size == CHIPS[name].mxu, name
