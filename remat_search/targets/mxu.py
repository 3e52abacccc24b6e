"""What a matmul costs a TPU's matrix unit (MXU), padding included, for the step-time model
(:mod:`remat_search.targets.step_time`).

An MXU is a square systolic array, ``side`` × ``side`` multiply-accumulate cells: 128 on TPU v4,
v5e and v5p, 256 on v6e (Pallas's own table of TPU hardware, ``mxu_column_size`` of
``jax.experimental.pallas.tpu.get_tpu_info_for_chip``; "How to Scale Your Model", part 2,
"TPUs"; Google Cloud's v6e page: "two 256x256 matrix-multiply units"). It holds a tile of one
operand (the contraction × that operand's width) and streams the other operand's rows through
it, so a matmul pays for its contraction and the held operand's width each rounded up to a
whole number of tiles: a ``[m, 128] @ [128, n]`` matmul runs at half the rate on a v6e. The
compiler may hold either operand; the cheaper is priced.
"""

from __future__ import annotations

import math


def mxu_flops(m: float, k: float, n: float, side: int | None, batch: float = 1.0) -> float:
    """The FLOPs an MXU of ``side`` spends on ``batch`` matmuls of ``[m, k] @ [k, n]``: their
    ``2·batch·m·k·n`` with ``k`` and the held operand's width padded up to multiples of
    ``side``; without padding where ``side`` is None (a chip without one: a GPU)."""
    if not side:
        return 2.0 * batch * m * k * n

    def up(size: float) -> float:
        return math.ceil(size / side) * side

    return 2.0 * batch * up(k) * min(m * up(n), up(m) * n)
