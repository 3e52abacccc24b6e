"""The matmul FLOPs of a Pallas TPU kernel, counted in its Mosaic body, for the step-time model
(:mod:`remat_search.targets.step_time`).

A Pallas kernel compiled for a TPU is a ``custom-call`` to ``tpu_custom_call`` whose
``backend_config`` carries the kernel itself: ``"body"``, a Mosaic MLIR module in bytecode,
base64. Its FLOPs are not in the HLO. A kernel may state an estimate (``"cost_estimate"``,
from ``pl.CostEstimate``), but the estimate is its author's: Pallas's own flash attention
states one for its forward kernel only, the non-causal count even where the kernel skips the
masked half, and none for its two backward kernels (``flash_mha_bwd_dkv``: the scores
recomputed, ``dV``, ``dP``, ``dK``; ``flash_mha_bwd_dq``: the scores, ``dP``, ``dQ``), which do
3.5 times the forward's matmul work. Priced by their bytes alone, they vanished from a step.

So the body is read instead. The kernel function (the one with ``iteration_bounds``: the
grid) runs once per grid point, its first arguments the point's indices. Each ``tpu.matmul``
in it costs 2 × its result's elements × its contracting size (as the chip's MXU spends
them, padding included: :mod:`~remat_search.targets.mxu`), once per grid point whose
``scf.if`` conditions hold (a causal kernel's ``pl.when(below_or_on_diag(...))``) and once per
iteration of each ``scf.for`` around it. Conditions and loop bounds are evaluated over the whole
grid where they are integer arithmetic of the grid indices and constants; where they read
anything else (a loaded value, a loop's own counter), the branch is counted as taken and a
loop of unknown length once: an upper bound. Elementwise work is not counted (the model prices
it by bytes).
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from remat_search.targets.mxu import mxu_flops

_BODY = re.compile(r'"custom_call_config"\s*:\s*\{\s*"body"\s*:\s*"([A-Za-z0-9+/=]+)"')
_GROUPS = re.compile(r"\[([\d, ]*)\]")
"""The dimension lists of a ``tpu.matmul``'s ``#tpu.dot_dimension_numbers<[...], [...], ...>``."""
_PREFIX = "stable_mosaic."
"""What a serialized Mosaic module puts before each op's dialect (``stable_mosaic.tpu.matmul``)."""

Weight = Any  # an integer, or a numpy integer array broadcastable to the grid: runs per grid point

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "arith.addi": np.add, "arith.subi": np.subtract, "arith.muli": np.multiply,
    "arith.divsi": lambda a, b: np.trunc(np.divide(a, b)).astype(np.int64), "arith.floordivsi": np.floor_divide,
    "arith.remsi": np.fmod, "arith.andi": np.bitwise_and, "arith.ori": np.bitwise_or, "arith.xori": np.bitwise_xor,
    "arith.minsi": np.minimum, "arith.maxsi": np.maximum,
}
_SAME = {"arith.extui", "arith.extsi", "arith.trunci", "arith.index_cast", "arith.index_castui"}
_COMPARE: dict[int, Callable[[Any, Any], Any]] = {
    0: np.equal, 1: np.not_equal, 2: np.less, 3: np.less_equal, 4: np.greater, 5: np.greater_equal,
    6: np.less, 7: np.less_equal, 8: np.greater, 9: np.greater_equal,
}
"""``arith.cmpi``'s predicates by number (eq, ne, slt, sle, sgt, sge, ult, ule, ugt, uge):
grid indices are never negative, so the unsigned ones compare as the signed."""


def kernel_flops(attributes: str, mxu: int | None = None) -> float | None:
    """The matmul FLOPs of the Pallas TPU kernel whose ``custom-call`` attributes are
    ``attributes`` (as an MXU of side ``mxu`` spends them, padding included, where given:
    :func:`~remat_search.targets.mxu.mxu_flops`), or None where they carry no Mosaic body this
    module can read (another kernel; a jaxlib without Mosaic's bindings)."""
    body = _BODY.search(attributes)
    return _body_flops(body[1], mxu) if body else None


@functools.lru_cache(maxsize=64)
def _body_flops(encoded: str, mxu: int | None) -> float | None:
    """FLOPs of one serialized Mosaic module (one kernel is called many times a program)."""
    try:  # Mosaic's dialect and MLIR's bindings, as jaxlib ships them (imported here: reading
        # a study's report needs no jax)
        from jax._src.lib import tpu as mosaic
        from jax._src.lib.mlir import ir
    except ImportError:  # pragma: no cover - a jaxlib without them: kernels keep their own estimates
        return None
    try:
        body = base64.b64decode(encoded)
    except binascii.Error:
        return None
    with ir.Context() as context:
        mosaic.register_dialect(context)
        context.allow_unregistered_dialects = True
        try:
            module = ir.Module.parse(body)
        except ir.MLIRError:
            return None
        kernel = next((op for op in module.body.operations if "iteration_bounds" in op.attributes), None)
        if kernel is None:
            return None
        grid = [int(n) for n in kernel.attributes["iteration_bounds"]]
        block = kernel.regions[0].blocks[0]
        values: dict[Any, Any] = {
            block.arguments[i]: np.arange(n, dtype=np.int64).reshape([n if j == i else 1 for j in range(len(grid))])
            for i, n in enumerate(grid)
        }
        try:
            return _block_flops(block, values, 1, grid, mxu)
        except (KeyError, IndexError, TypeError, ValueError):  # a body shaped otherwise: its own estimate
            return None


def _block_flops(block: Any, values: dict[Any, Any], weight: Weight, grid: list[int], mxu: int | None) -> float:
    """The matmul FLOPs of one block's operations over the grid, each run ``weight`` times a
    grid point; ``values`` holds what is known of the integers in scope."""
    flops = 0.0
    for op in block.operations:
        name = op.name.removeprefix(_PREFIX)
        if name == "tpu.matmul":
            flops += _matmul_flops(op, mxu) * _runs(weight, grid)
        elif name == "scf.if":
            taken = values.get(op.operands[0])
            then_weight = weight if taken is None else weight * np.asarray(taken, dtype=np.int64)
            else_weight = weight if taken is None else weight * (1 - np.asarray(taken, dtype=np.int64))
            flops += _block_flops(op.regions[0].blocks[0], values, then_weight, grid, mxu)
            if len(op.regions) > 1 and len(op.regions[1].blocks):
                flops += _block_flops(op.regions[1].blocks[0], values, else_weight, grid, mxu)
        elif name == "scf.for":
            lower, upper, step = (values.get(v) for v in list(op.operands)[:3])
            trips = 1 if any(v is None for v in (lower, upper, step)) else np.maximum(0, -(-(np.asarray(upper) - lower) // step))
            flops += _block_flops(op.regions[0].blocks[0], values, weight * trips, grid, mxu)
        elif op.regions:
            for region in op.regions:
                for inner in region.blocks:
                    flops += _block_flops(inner, values, weight, grid, mxu)
        else:
            _evaluate(op, name, values)
    return flops


def _evaluate(op: Any, name: str, values: dict[Any, Any]) -> None:
    """Record ``op``'s result in ``values`` where it is integer arithmetic of known values (a
    truth value as 0 or 1, whatever its bits: ``true`` is -1 as a signed ``i1``)."""
    from jax._src.lib.mlir import ir

    if len(op.results) != 1:
        return
    args = [values.get(v) for v in op.operands]
    result = None
    if name == "arith.constant":
        value = op.attributes["value"]
        result = np.int64(value.value) if isinstance(value, (ir.IntegerAttr, ir.BoolAttr)) else None
    elif any(a is None for a in args):
        return
    elif name in _BINARY and len(args) == 2:
        result = _BINARY[name](*args)
    elif name in _SAME and len(args) == 1:
        result = args[0]
    elif name == "arith.select" and len(args) == 3:
        result = np.where(args[0], args[1], args[2])
    elif name == "arith.cmpi" and len(args) == 2 and op.attributes["predicate"].value in _COMPARE:
        result = _COMPARE[op.attributes["predicate"].value](*args)
    if result is not None:
        truth = str(op.results[0].type) == "i1"
        values[op.results[0]] = (np.asarray(result) != 0).astype(np.int64) if truth else np.asarray(result, np.int64)


def _matmul_flops(op: Any, mxu: int | None) -> float:
    """2 × the result's elements × the contracting size of the left operand (padded to an MXU
    of side ``mxu`` where given). ``dimension_numbers`` lists the left operand's contracting
    dimensions first and its batch dimensions sixth; without them, the last dimension contracts."""
    from jax._src.lib.mlir import ir

    lhs = ir.ShapedType(op.operands[0].type).shape
    out = math.prod(ir.ShapedType(op.results[0].type).shape)
    groups = _GROUPS.findall(str(op.attributes["dimension_numbers"])) if "dimension_numbers" in op.attributes else []
    contracting, batched = ([[int(d) for d in g.split(",") if d.strip()] for g in (groups[0], groups[5])]
                            if len(groups) >= 6 else ([len(lhs) - 1], []))
    k = math.prod(lhs[d] for d in contracting if d < len(lhs))
    batch = math.prod(lhs[d] for d in batched if d < len(lhs))
    m = math.prod(lhs) // max(1, k * batch)
    return mxu_flops(m, k, out / max(1, batch * m), mxu, batch)


def _runs(weight: Weight, grid: list[int]) -> float:
    """How many times, over the whole grid, something run ``weight`` times a point runs."""
    weight = np.asarray(weight, dtype=np.int64)
    if weight.ndim == 0:
        return float(weight) * math.prod(grid)
    return float(weight.sum()) * math.prod(n for n, w in zip(grid, weight.shape, strict=True) if w == 1)
