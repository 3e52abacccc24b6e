"""The matmul FLOPs of an instruction: its own (``dot``, ``convolution``), those of the fusion it
is, or a kernel's (a Pallas TPU kernel's, counted in its body; a GPU library kernel's, read off its
call). The step-time model (:mod:`remat_search.targets.step_time`) prices them at the chip's
peak."""

from __future__ import annotations

import json
import math
import re

from remat_search.targets import pallas_kernels
from remat_search.targets.gpu_kernels import kernel_flops
from remat_search.targets.hlo import CALLED, Computation, Instruction, Module, shape_dims, shape_elements

_COST_ESTIMATE = re.compile(r'"cost_estimate"\s*:\s*(\{[^{}]*\})')
_DIMS = re.compile(r"\b(lhs_contracting_dims|dim_labels)=(\{[\d,]*\}|[\w]+->\w+)")


def flops(module: Module, computation: Computation, ins: Instruction, mxu: int | None = None) -> float:
    """The matmul FLOPs of ``ins``: its own, those inside the fusion it is, or a kernel's: a
    Pallas TPU kernel's counted in its body (:mod:`pallas_kernels`; padded to an MXU of side
    ``mxu`` where given), else its own estimate, else a GPU library kernel's (:mod:`gpu_kernels`)."""
    if ins.opcode == "custom-call":
        counted = pallas_kernels.kernel_flops(ins.attributes, mxu)
        if counted:
            return counted
        estimate = _COST_ESTIMATE.search(ins.attributes)
        return float(json.loads(estimate[1]).get("flops", 0)) if estimate else kernel_flops(computation, ins) or 0.0
    if ins.opcode in ("dot", "convolution"):
        return _matmul_flops(computation, ins)
    called = dict(CALLED.findall(ins.attributes)).get("calls")
    if ins.opcode != "fusion" or called not in module.computations:
        return 0.0
    inner = module.computations[called]
    return sum(flops(module, inner, sub, mxu) for sub in inner.instructions)


def _matmul_flops(computation: Computation, ins: Instruction) -> float:
    """2 × output elements × the reduction each output element sums over."""
    out = shape_elements(ins.shape.split(")")[0] if ins.shape.startswith("(") else ins.shape)
    dims = dict(_DIMS.findall(ins.attributes))
    if ins.opcode == "dot":
        lhs = shape_dims(computation.shapes.get(ins.operands[0], "")) if ins.operands else []
        contracting = [int(d) for d in dims.get("lhs_contracting_dims", "{}").strip("{}").split(",") if d]
        return 2.0 * out * math.prod(lhs[d] for d in contracting if d < len(lhs))
    lhs, rhs = (shape_dims(computation.shapes.get(o, "")) for o in (ins.operands + ["", ""])[:2])
    labels = re.match(r"(\w+)_(\w+)->(\w+)", dims.get("dim_labels", ""))
    out_dims = shape_dims(ins.shape)
    if labels is None or not (len(labels[1]) == len(lhs) and len(labels[2]) == len(rhs) == len(out_dims)):
        return 0.0
    lhs_of, rhs_of, out_of = ({c: dims_[i] for i, c in enumerate(labels[k])} for k, dims_ in ((1, lhs), (2, rhs), (3, out_dims)))
    window = _window(ins.attributes)
    taps = 1
    for d, spatial in enumerate(sorted(c for c in labels[1] if c.isdigit())):
        taps *= _valid_taps(lhs_of[spatial], rhs_of[spatial], out_of[spatial], *[w[d] if d < len(w) else x for w, x in
                            zip(window, (1, 0, 1, 1))])
    return 2.0 * out_of["b"] * out_of["f"] * rhs_of["i"] * taps


_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _window(attributes: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """A convolution's per-spatial-dimension stride, low padding, lhs and rhs dilation."""
    match = _WINDOW.search(attributes)
    fields = dict(re.findall(r"(\w+)=([\w\-]+)", match[1])) if match else {}

    def each(key: str) -> list[int]:
        return [int(v) for v in fields[key].split("x")] if key in fields else []

    low = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else []
    return each("stride"), low, each("lhs_dilate"), each("rhs_dilate")


def _valid_taps(size: int, kernel: int, out: int, stride: int, low: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read the input, not its
    padding: as XLA's own cost analysis counts a convolution's FLOPs."""
    if out * kernel > 1_000_000:
        return out * kernel
    extent = (size - 1) * lhs_dilate
    count = 0
    for o in range(out):
        for k in range(kernel):
            x = o * stride - low + k * rhs_dilate
            count += 0 <= x <= extent and x % lhs_dilate == 0
    return count

