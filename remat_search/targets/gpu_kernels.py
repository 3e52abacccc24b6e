"""The matmul FLOPs of XLA:GPU's library kernels, read off their ``custom-call`` in the optimized
HLO module, for the step-time model (:mod:`remat_search.targets.step_time`).

XLA:GPU hands most large matmuls to cuBLAS: a ``custom-call`` whose target is
``__cublas$gemm`` or ``__cublas$lt$matmul``, whose result is a tuple (the product, a scratch
workspace) and whose ``backend_config`` JSON holds the ``dot_dimension_numbers`` of the ``dot``
it replaced. Unlike a ``dot`` it shows no FLOPs by its opcode, so without this module a GPU
program's matmuls would be priced by their bytes alone. Matmuls XLA:GPU emits through Triton
(``fusion``, ``kind=kCustom``, ``"kind":"__triton_gemm"`` or ``"__triton_nested_gemm_fusion"``)
keep a ``dot`` inside their fused computation and are counted there, as any fusion's are.

cuDNN's fused attention (``__cudnn$fmhaSoftmax``, ``__cudnn$fmhaSoftmaxBackward`` and their
variants: what ``jax.nn.dot_product_attention`` emits with ``implementation="cudnn"``) is two
batched matmuls forward (scores ``Q·Kᵀ``, then ``P·V``: 4·B·H·Sq·Sk·D FLOPs) and five backward
(the scores recomputed, then ``dV``, ``dP``, ``dQ``, ``dK``: 10·B·H·Sq·Sk·D). B·H·Sq·Sk is the
scores' shape, which the kernel's ``backend_config`` states (``intermediate_tensor_shape``) in
both directions; D is the queries' (the first operand's) elements over B·H·Sq. A causal mask's
skipped blocks are counted as computed: an upper bound, about twice the work cuDNN does.
XLA's own cost analysis counts none of it (it reports -1 FLOPs for such a program).
"""

from __future__ import annotations

import math
import re

from remat_search.targets.hlo import Computation, Instruction, shape_dims, tuple_elements

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul")
_FMHA = "__cudnn$fmha"
_WORKSPACE = re.compile(r"[su]8\[\d+\]")


def kernel_flops(computation: Computation, ins: Instruction) -> float | None:
    """The matmul FLOPs of the library kernel ``ins`` (a ``custom-call``), or None where its
    target is none this module knows (priced by its bytes alone)."""
    target = _TARGET.search(ins.attributes)
    name = target[1] if target else ""
    operands = [shape_dims(computation.shapes.get(o, "")) for o in ins.operands[:2]]
    if name in _CUBLAS and operands:
        out = shape_dims(tuple_elements(ins.shape)[0])
        contracting = _dimensions(ins.attributes, "dot_dimension_numbers", "lhs_contracting_dimensions")
        return 2.0 * math.prod(out) * math.prod(operands[0][d] for d in contracting if d < len(operands[0]))
    if name.startswith(_FMHA) and operands:
        return _attention_matmul_flops(operands[0], ins.attributes) * (5 if "Backward" in name else 2)
    return None


def _attention_matmul_flops(queries: list[int], attributes: str) -> float:
    """FLOPs of one of cuDNN attention's batched matmuls: 2 × B·H·Sq·Sk (the scores) × D (the
    queries' elements over B·H·Sq); 0 where the scores' shape is not stated."""
    scores = re.search(r'"intermediate_tensor_shape"\s*:\s*\{\s*"dimensions"\s*:\s*\[([^\]]*)\]', attributes)
    dims = [int(d.strip().strip('"')) for d in scores[1].split(",") if d.strip()] if scores else []
    if len(dims) != 4 or not math.prod(dims[:3]):
        return 0.0
    return 2.0 * math.prod(dims) * math.prod(queries) / math.prod(dims[:3])


def without_workspace(shape: str, attributes: str) -> str:
    """A cuBLAS or cuDNN kernel's result ``shape`` without its last element where that is the
    kernel's scratch workspace (a flat ``s8``/``u8`` array); any other shape as it is."""
    target = _TARGET.search(attributes)
    name = target[1] if target else ""
    elements = tuple_elements(shape)
    if not (name in _CUBLAS or name.startswith(_FMHA)) or len(elements) < 2 or not _WORKSPACE.match(elements[-1]):
        return shape
    return elements[0] if len(elements) == 2 else "(" + ", ".join(elements[:-1]) + ")"


def _dimensions(attributes: str, numbers: str, field: str) -> list[int]:
    """One list of dimensions (``"lhs_contracting_dimensions":["1"]``) of the dimension
    numbers ``numbers`` in a ``backend_config`` JSON."""
    block = re.search(rf'"{numbers}"\s*:\s*\{{([^{{}}]*)\}}', attributes)
    found = re.search(rf'"{field}"\s*:\s*\[([^\]]*)\]', block[1]) if block else None
    return [int(d.strip().strip('"')) for d in found[1].split(",") if d.strip()] if found else []
