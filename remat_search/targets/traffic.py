"""The bytes an instruction moves: through HBM (its operands read and results written, less
what a slice or an in-place update leaves untouched) and over the host link (an offloaded
tensor's). The step-time model (:mod:`remat_search.targets.step_time`) prices them at the chip's
HBM and host-link bandwidths."""

from __future__ import annotations

from dataclasses import replace

from remat_search.targets.collectives import is_collective
from remat_search.targets.gpu_kernels import without_workspace
from remat_search.targets.hlo import CALLED, Computation, Instruction, Module, array_bytes, shape_arrays, tuple_elements

FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency", "domain", "copy-done", "async-done", "slice-done", "send-done", "recv-done",
    "all-gather-done", "all-reduce-done", "collective-permute-done", "reduce-scatter-done", "all-to-all-done",
    "fusion-done",
}
_SLICES = {"slice", "dynamic-slice", "gather"}
ALLOCATION = 'custom_call_target="AllocateBuffer"'

HOST_MEMORY_SPACE = 5
"""XLA's memory space of pinned host memory (``S(5)`` in a layout): where an ``offload``
policy's tensors go, by ``copy-start``/``copy-done`` on TPU or by an asynchronous
dynamic-update-slice and dynamic-slice on GPU."""



def as_run(ins: Instruction) -> Instruction:
    """``ins`` as it is priced: XLA:GPU's asynchronous fusion (a ``fusion-start`` shaped
    (operands, result, context), with a free ``fusion-done``) as the fusion it runs; a GPU
    library kernel without the scratch workspace its result carries (not traffic of the step's
    arrays); any other instruction as it is."""
    if ins.opcode == "custom-call":
        return replace(ins, shape=without_workspace(ins.shape, ins.attributes))
    if ins.opcode != "fusion-start":
        return ins
    elements = tuple_elements(ins.shape)
    return replace(ins, opcode="fusion", shape=elements[1] if len(elements) > 1 else ins.shape)


CONTROL = {"while", "call", "call-start", "conditional"}


def host_bytes(module: Module, computation: Computation, ins: Instruction) -> float:
    """Bytes ``ins`` itself moves between the device and pinned host memory: a copy from one
    to the other moves its array; an instruction or fusion that reads or writes a buffer in
    host memory moves what it touches of it (a slice, an in-place update: as :func:`_moved`
    counts HBM bytes)."""
    if ins.opcode in FREE or ins.opcode in CONTROL or ins.opcode.endswith("-done") or ALLOCATION in ins.attributes:
        return 0.0
    operands = [computation.shapes.get(o, "") for o in ins.operands]
    if f"S({HOST_MEMORY_SPACE})" not in ins.shape + "".join(operands):
        return 0.0
    if ins.opcode in ("copy", "copy-start"):
        result, source = _results(computation, ins), shape_arrays(operands[0]) if operands else []
        crosses = result and source and (result[0][2] == HOST_MEMORY_SPACE) != (source[0][2] == HOST_MEMORY_SPACE)
        return result[0][1] if crosses else 0.0
    return moved(module, computation, ins, HOST_MEMORY_SPACE)


def _results(computation: Computation, ins: Instruction) -> list[tuple[int, float, int]]:
    """The arrays ``ins`` writes (elements, bytes, memory space): an asynchronous start's
    shape also holds its operands and a context, which it does not write."""
    arrays = shape_arrays(ins.shape)
    if not ins.opcode.endswith("-start") or len(arrays) < 2:
        return arrays
    if ins.shape.startswith("(("):  # ((operands), results, context)
        given = sum(len(shape_arrays(computation.shapes.get(o, ""))) for o in ins.operands)
        return arrays[given:-1]
    return arrays[:1]  # (destination, source, context)


def moved(module: Module, computation: Computation, ins: Instruction, space: int = 0) -> float:
    """Bytes ``ins`` reads and writes in memory ``space`` (HBM, the default; or host
    memory): each operand in full and its result, except where it touches part of a buffer,
    as XLA's own cost analysis counts: a slice (``slice``, ``dynamic-slice``, ``gather``,
    also inside a fusion, or a fusion nested in that) reads only what it keeps, and an update in place
    (``dynamic-update-slice``) reads and writes only the update, not the buffer it updates.
    A scanned model's loop slices its layer out of stacked arrays, and writes its saved
    activations into them, this way every iteration."""
    shapes = computation.shapes

    def in_space(shape: str) -> float:
        return sum(nbytes for _, nbytes, where in shape_arrays(shape) if where == space)

    results = _results(computation, ins)
    if ins.opcode.removesuffix("-start") in _SLICES:
        kept = results[0] if results else (0, 0.0, -1)
        source = shape_arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
        return (kept[1] if source and source[0][2] == space else 0.0) + (kept[1] if kept[2] == space else 0.0)
    if ins.opcode.removesuffix("-start") == "dynamic-update-slice":
        update = shapes.get(ins.operands[1], "") if len(ins.operands) > 1 else ""
        updated = bool(results) and results[0][2] == space
        return (array_bytes(update) if updated else 0.0) + in_space(update)
    fused = module.computations.get(dict(CALLED.findall(ins.attributes)).get("calls", "")) if (
        ins.opcode.removesuffix("-start") == "fusion") else None
    reads = [in_space(shapes.get(o, "")) for o in ins.operands]
    written = 0.0 if ins.opcode.endswith("-start") and ins.opcode != "fusion-start" else sum(
        nbytes for _, nbytes, where in results if where == space)
    if fused is None:
        return sum(reads) + written
    users: dict[str, dict[str, list[Instruction]]] = {}

    def touched(inside: Computation, name: str) -> list[Instruction]:
        """What reads ``name`` in ``inside``: its users, through bitcasts and into the
        parameters of fusions nested in it (where the TPU compiler puts the slice of one
        layer out of a scanned stack)."""
        if inside.name not in users:
            users[inside.name] = {}
            for i in inside.instructions:
                for o in i.operands:
                    users[inside.name].setdefault(o, []).append(i)
        found = []
        for u in users[inside.name].get(name, []):
            nested = module.computations.get(dict(CALLED.findall(u.attributes)).get("calls", "")) if (
                u.opcode == "fusion") else None
            if u.opcode == "bitcast":
                found += touched(inside, u.name)
            elif nested is not None:
                for k in (k for k, o in enumerate(u.operands) if o == name):
                    inner = next((i for i in nested.instructions if i.opcode == "parameter" and i.arguments == str(k)),
                                 None)
                    found += touched(nested, inner.name) if inner is not None else [u]
            else:
                found.append(u)
        return found

    def origin(name: str) -> Instruction | None:  # the instruction behind bitcasts
        i = fused.by_name.get(name)
        return origin(i.operands[0]) if i is not None and i.opcode == "bitcast" and i.operands else i

    root = fused.root
    collective = any(is_collective(i) for i in fused.instructions)
    for p in (i for i in fused.instructions if i.opcode == "parameter"):
        index = int(p.arguments) if p.arguments.isdigit() else -1
        if not 0 <= index < len(reads):
            continue
        uses = touched(fused, p.name)
        if collective and uses and all(is_collective(u) or u is root for u in uses):
            reads[index] = 0.0  # sent by a collective, or handed on to the next fusion of its chain
        elif uses and all(u.opcode in _SLICES for u in uses):
            reads[index] = min(reads[index], sum(array_bytes(u.shape) for u in uses))
        elif uses and all(u.opcode == "dynamic-update-slice" and origin(u.operands[0]) is p for u in uses):
            reads[index] = 0.0
    outputs = [origin(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [origin(
        root.name) if root is not None else None]
    if collective and root is not None and is_collective(root):
        written = 0.0  # the chain's start or done: the collective's own buffers
    elif len(outputs) == len(results) and written:
        written = sum(
            _written(out, nbytes, fused, collective) for out, (_, nbytes, where) in zip(outputs, results, strict=True)
            if where == space
        )
    return sum(reads) + written


def _written(out: Instruction | None, nbytes: float, fused: Computation, collective: bool) -> float:
    """What a fusion's output ``out`` writes: an update in place, its update; in an
    asynchronous collective's fusion, a buffer the collective fills (received over the ICI, as
    an unfused collective's is) or one handed on unchanged (a parameter), nothing."""
    if out is not None and out.opcode == "dynamic-update-slice":
        return array_bytes(fused.shapes.get(out.operands[1], ""))
    if collective and out is not None and (out.opcode == "parameter" or is_collective(out)):
        return 0.0
    return nbytes

