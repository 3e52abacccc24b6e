"""The step-time model of a compile-only target: one step's time, read off the compiled program.

Where plans are compiled ahead of time and never run (a TPU topology), a step's time is an
estimate. :func:`estimate_step` reads the optimized HLO module (``Compiled.as_text()``) the way
the chip would execute it, one scheduled instruction after another, and prices each one:

* a fusion, an unfused op or a kernel (``custom-call``) costs the slower of its FLOPs at the
  chip's peak and its HBM traffic (operands read, results written: the buffers in the default
  memory space, not those the compiler placed on the chip) at the chip's HBM bandwidth — a
  roofline per instruction, summed, so that recomputing elementwise work costs bandwidth and
  recomputing a matmul costs FLOPs. FLOPs are those of the matmuls (``dot``, ``convolution``)
  inside, or of a kernel's: a Pallas TPU kernel's matmuls counted in its Mosaic body over its
  grid (:mod:`~remat_search.targets.pallas_kernels`) and priced as the chip's matrix unit
  spends them, each padded to its tiles (:mod:`~remat_search.targets.mxu`: a 128-wide head
  runs at half rate on a v6e), a GPU library kernel's read off its call
  (:mod:`~remat_search.targets.gpu_kernels`);
* a collective (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute; also
  those the TPU compiler fused with a matmul, and those a v6e's SparseCore runs, called
  asynchronously on its own thread: ``call-start``) costs the bytes each chip receives in a ring over
  its group, at the chip's inter-chip (ICI) bandwidth, with **no overlap** with computation
  assumed: an upper bound on communication's share, which is how a fully rematerialised FSDP
  layer's second gather of its weights shows. Its buffers cost no HBM time (the chip's DMA
  engines fill them as the slower ICI delivers), also where the TPU compiler chains it over
  fusions (``AsyncCollectiveStart`` … ``AsyncCollectiveDone``): those fusions cost what else
  they compute;
* a transfer to or from pinned host memory (``S(5)``: an ``offload`` policy's tensors) costs
  its bytes at the chip's host link (:attr:`Chip.host_bytes_per_second`), one transfer after
  another on the link, **overlapped** with the instructions scheduled between the transfer's
  start and its done: computation waits only for what they do not cover;
* a loop's body is counted as many times as the compiler knows it runs (``known_trip_count``);
  of a conditional's branches, the dearest.

What it leaves out: the vector unit's own throughput (elementwise FLOPs are priced by their
bytes alone), XLA's own matmuls' padding to the MXU's tiles (the compiler lays their
dimensions out, folding heads into one, say: the HLO does not say how), overlap of on-chip copies and collectives with
computation, per-instruction launch overheads, and the host's own work. It is a lower bound on compute and memory time
and an upper bound on communication, deterministic, and the same for every plan of a study:
good for ranking plans, not a promise of wall time.

The module's text is read by :mod:`remat_search.targets.hlo`; this module prices it.

The whole-program roofline this replaced (:func:`roofline_seconds`: one max over the
program's total FLOPs and bytes) is kept beside it for one release.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict

from remat_search.targets import pallas_kernels
from remat_search.targets.gpu_kernels import kernel_flops, without_workspace
from remat_search.targets.hlo import (
    Computation,
    Instruction,
    Module,
    array_bytes,
    parse,
    shape_arrays,
    shape_dims,
    shape_elements,
    trip_count,
    tuple_elements,
)

TIME_MODEL = "fusions"
"""The name of :func:`estimate_step`'s model, as measurements record it (``time_model``);
measurements without one were estimated by the whole-program roofline."""


class Chip(BaseModel):
    """Published per-chip peaks, for the step-time model."""

    model_config = ConfigDict(frozen=True)

    name: str
    bf16_flops: float
    hbm_bytes_per_second: float
    ici_bytes_per_second: float | None = None
    """What one chip's links carry in one direction (half the published bidirectional
    per-chip ICI bandwidth); None where Google Cloud publishes no per-chip figure."""
    host_bytes_per_second: float | None = None
    """What the chip's link to its host's memory carries in one direction: the price of
    moving an offloaded tensor to pinned host memory or back. None: not priced."""
    mxu: int | None = None
    """The side of the chip's matrix unit, a square systolic array: matmuls are priced padded to
    its tiles (:mod:`~remat_search.targets.mxu`). None: not padded."""


TPU_HOST_BYTES_PER_SECOND = 1.5e10
"""A TPU chip's host link (PCIe), one direction. Google Cloud publishes no per-chip figure;
this is the one "How to Scale Your Model" (jax-ml.github.io/scaling-book, part 2, "TPUs")
works with, used for every generation. An assumption, stated where estimates are shown."""

# Google Cloud's published per-chip figures (bf16 dense FLOP/s, HBM bandwidth, bidirectional
# ICI bandwidth per chip halved): cloud.google.com/tpu/docs/v5e, /v5p, /v6e. The v4 page
# gives no per-chip ICI bandwidth. The host link: TPU_HOST_BYTES_PER_SECOND. The MXU's side:
# 128 up to v5p, 256 on v6e (:mod:`remat_search.targets.mxu`).
CHIPS = {
    "v4": Chip(name="TPU v4", bf16_flops=275e12, hbm_bytes_per_second=1228e9,
               host_bytes_per_second=TPU_HOST_BYTES_PER_SECOND, mxu=128),
    "v5e": Chip(name="TPU v5e", bf16_flops=197e12, hbm_bytes_per_second=819e9, ici_bytes_per_second=200e9,
                host_bytes_per_second=TPU_HOST_BYTES_PER_SECOND, mxu=128),
    "v5p": Chip(name="TPU v5p", bf16_flops=459e12, hbm_bytes_per_second=2765e9, ici_bytes_per_second=600e9,
                host_bytes_per_second=TPU_HOST_BYTES_PER_SECOND, mxu=128),
    "v6e": Chip(name="TPU v6e", bf16_flops=918e12, hbm_bytes_per_second=1640e9, ici_bytes_per_second=400e9,
                host_bytes_per_second=TPU_HOST_BYTES_PER_SECOND, mxu=256),
}

# NVIDIA's published per-GPU figures for the SXM parts (dense bf16 Tensor Core FLOP/s: the
# datasheets' 1,979 TFLOP/s is with 2:4 sparsity, half of it dense; HBM bandwidth), from the
# H100 datasheet (nvidia.com/en-us/data-center/h100/) and the H200's
# (nvidia.com/en-us/data-center/h200/). NVLink is not inter-chip ICI: left None, so a GPU
# estimate prices no collectives. Not in CHIPS, whose keys are TPU topology generations.
# The host link: PCIe Gen5 x16, the datasheets' 128 GB/s counted both ways, 64 GB/s one way.
GPUS = {
    "h100": Chip(name="NVIDIA H100 SXM", bf16_flops=989e12, hbm_bytes_per_second=3.35e12, host_bytes_per_second=64e9),
    "h200": Chip(name="NVIDIA H200 SXM", bf16_flops=989e12, hbm_bytes_per_second=4.8e12, host_bytes_per_second=64e9),
}


def gpu_chip(device_kind: str) -> Chip | None:
    """The :data:`GPUS` entry of a JAX GPU's ``device_kind`` (``"NVIDIA H100 80GB HBM3"`` →
    H100), or None for a GPU not listed there."""
    words = re.findall(r"[a-z0-9]+", device_kind.lower())
    return next((GPUS[w] for w in words if w in GPUS), None)


class StepEstimate(BaseModel):
    """One step's estimated time on a chip (:func:`estimate_step`), and what it is made of."""

    model_config = ConfigDict(frozen=True)

    seconds: float
    """The estimate: :attr:`compute_seconds` + :attr:`host_wait_seconds` + :attr:`collective_seconds`."""
    compute_seconds: float
    """Sum over the executed instructions of max(MXU FLOPs / peak, HBM bytes / bandwidth)."""
    collective_seconds: float
    """Collectives' bytes received per chip at the ICI bandwidth (0 where the chip has no figure)."""
    flops: float
    hbm_bytes: float
    mxu_flops: float = 0.0
    """:attr:`flops` as the chip's matrix unit spends them, its tiles' padding included
    (:attr:`Chip.mxu`); the same where the chip pads nothing."""
    collective_bytes: float
    instructions: int
    """Instructions priced (each loop iteration counted)."""
    host_bytes: float = 0.0
    """Bytes moved between the device and pinned host memory (offloaded tensors, both ways)."""
    host_seconds: float = 0.0
    """:attr:`host_bytes` at the chip's host-link bandwidth: how long the link is busy."""
    host_wait_seconds: float = 0.0
    """The part of :attr:`host_seconds` that computation waits for: a transfer overlaps
    the instructions scheduled between its start and its done, and no more."""
    unknown_trip_counts: int = 0
    """Loops whose trip count the compiler did not state: counted once each."""
    roofline_seconds: float | None = None
    """The whole-program roofline of the same program (:func:`roofline_seconds`, the model
    before this one), kept beside it for one release."""


def estimate_step(hlo: str, chip: Chip, cost: dict[str, float] | None = None) -> StepEstimate:
    """The per-instruction model of one step of the optimized HLO module ``hlo`` on ``chip``
    (see the module's docstring), with the whole-program roofline of the compiler's cost
    analysis ``cost`` beside it where given."""
    module = parse(hlo)
    total = _cost_of(module, module.entry, {}, chip)
    collective = total.collective_bytes / chip.ici_bytes_per_second if chip.ici_bytes_per_second else 0.0
    return StepEstimate(
        seconds=total.compute_seconds + total.host_wait_seconds + collective, compute_seconds=total.compute_seconds,
        collective_seconds=collective, flops=total.flops, mxu_flops=total.mxu_flops, hbm_bytes=total.hbm_bytes,
        collective_bytes=total.collective_bytes, instructions=total.instructions,
        unknown_trip_counts=total.unknown_trips, host_bytes=total.host_bytes,
        host_seconds=_link_seconds(total.host_bytes, chip), host_wait_seconds=total.host_wait_seconds,
        roofline_seconds=roofline_seconds(cost, chip) if cost is not None else None,
    )


def roofline_seconds(cost: dict[str, float], chip: Chip) -> float:
    """The whole-program roofline (the model before :func:`estimate_step`): the slower of the
    program's FLOPs at peak and its bytes accessed at HBM bandwidth, from the compiler's cost
    analysis."""
    return max(cost.get("flops", 0.0) / chip.bf16_flops, cost.get("bytes accessed", 0.0) / chip.hbm_bytes_per_second)


_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COST_ESTIMATE = re.compile(r'"cost_estimate"\s*:\s*(\{[^{}]*\})')
_DIMS = re.compile(r"\b(lhs_contracting_dims|dim_labels)=(\{[\d,]*\}|[\w]+->\w+)")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")

_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency", "domain", "copy-done", "async-done", "slice-done", "send-done", "recv-done",
    "all-gather-done", "all-reduce-done", "collective-permute-done", "reduce-scatter-done", "all-to-all-done",
    "fusion-done",
}
_SLICES = {"slice", "dynamic-slice", "gather"}
_ALLOCATION = 'custom_call_target="AllocateBuffer"'
"""A buffer made, not written (XLA:GPU's for a host-offload destination): free."""
_COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all"}


# --- pricing ----------------------------------------------------------------------------

HOST_MEMORY_SPACE = 5
"""XLA's memory space of pinned host memory (``S(5)`` in a layout): where an ``offload``
policy's tensors go, by ``copy-start``/``copy-done`` on TPU or by an asynchronous
dynamic-update-slice and dynamic-slice on GPU."""


@dataclass
class _Cost:
    """What a run of instructions adds up to, at one chip."""

    flops: float = 0.0
    mxu_flops: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: float = 0.0
    instructions: int = 0
    unknown_trips: int = 0
    compute_seconds: float = 0.0
    """Each priced instruction's max(MXU FLOPs / peak, HBM bytes / bandwidth), summed."""
    host_bytes: float = 0.0
    host_wait_seconds: float = 0.0
    """Time computation waits for transfers to or from host memory."""
    channels: dict[str, float] = field(default_factory=dict)
    """Bytes of collectives by channel: the TPU compiler splits one collective over a chain of
    fusions, each printing it whole, so a channel counts once a computation."""

    def add(self, other: _Cost, times: int = 1) -> None:
        self.flops += other.flops * times
        self.mxu_flops += other.mxu_flops * times
        self.hbm_bytes += other.hbm_bytes * times
        self.collective_bytes += other.collective_bytes * times
        for channel, nbytes in other.channels.items():
            self.channels[channel] = max(self.channels.get(channel, 0.0), nbytes)
        self.instructions += other.instructions * times
        self.unknown_trips += other.unknown_trips * times
        self.compute_seconds += other.compute_seconds * times
        self.host_bytes += other.host_bytes * times
        self.host_wait_seconds += other.host_wait_seconds * times


def _link_seconds(nbytes: float, chip: Chip) -> float:
    """``nbytes`` over the chip's host link (0 where the chip has no figure)."""
    return nbytes / chip.host_bytes_per_second if chip.host_bytes_per_second else 0.0


def _cost_of(module: Module, name: str, memo: dict[str, _Cost], chip: Chip) -> _Cost:
    """The cost of running computation ``name`` once, as a schedule of instructions.

    Host transfers run on the chip's host link beside computation: one started
    asynchronously (a ``-start``) queues on the link, first come first served, and the
    instruction that waits for it (its ``-done``) waits only for what the instructions
    scheduled between them did not cover; a synchronous one waits for itself. A transfer
    still running at the end of the computation is waited for there."""
    if name in memo:
        return memo[name]
    computation = module.computations.get(name)
    total = _Cost()
    clock = link = 0.0  # this computation's time so far, and when the host link is next free
    running: dict[str, float] = {}  # asynchronous host transfers: when each ends
    for ins in computation.instructions if computation else ():
        cost = _instruction_cost(module, computation, ins, memo, chip)
        total.add(cost)
        busy = cost.compute_seconds + cost.host_wait_seconds
        moved = _host_bytes(module, computation, ins)
        if moved:
            total.host_bytes += moved
            link = max(clock, link) + _link_seconds(moved, chip)
            if ins.opcode.endswith("-start"):
                running[ins.name] = link
            else:
                busy = max(busy, link - clock)
                total.host_wait_seconds += busy - cost.compute_seconds - cost.host_wait_seconds
        elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in running:
            wait = max(0.0, running.pop(ins.operands[0]) - clock)
            total.host_wait_seconds += wait
            busy += wait
        clock += busy
    if running:
        total.host_wait_seconds += max(0.0, max(running.values()) - clock)
    total.collective_bytes += sum(total.channels.values())
    total.channels = {}
    memo[name] = total
    return total


def _instruction_cost(
    module: Module, computation: Computation, ins: Instruction, memo: dict[str, _Cost], chip: Chip
) -> _Cost:
    """The cost of one scheduled instruction (see the module's docstring), its host
    transfer aside (:func:`_cost_of` times those)."""
    ins = _as_run(ins)
    opcode, called = ins.opcode, dict(_CALLED.findall(ins.attributes))
    if opcode in _FREE or opcode.endswith("-done") or _ALLOCATION in ins.attributes:
        return _Cost()
    if opcode == "while":
        trip = trip_count(module, computation, ins, called.get("condition", ""), called.get("body", ""))
        cost = _Cost(unknown_trips=0 if trip else 1)
        cost.add(_cost_of(module, called.get("body", ""), memo, chip), trip or 1)
        return cost
    if opcode == "conditional":
        names = [b.strip().lstrip("%") for b in _BRANCHES.search(ins.attributes)[1].split(",")] if _BRANCHES.search(
            ins.attributes) else [called.get("true_computation", ""), called.get("false_computation", "")]
        branches = [_cost_of(module, n, memo, chip) for n in names if n]
        return max(branches, key=lambda c: (c.flops, c.hbm_bytes, c.collective_bytes), default=_Cost())
    if opcode in ("call", "call-start"):  # call-start: run on another thread (a SparseCore's collective)
        return _cost_of(module, called.get("to_apply", ""), memo, chip)
    if opcode.removesuffix("-start") in _COLLECTIVES:
        return _Cost(instructions=1, channels=_collectives(computation, [ins]))
    moved = _moved(module, computation, ins)
    flops = _flops(module, computation, ins)
    held = _flops(module, computation, ins, chip.mxu) if chip.mxu else flops
    fused = called.get("calls", "") if opcode == "fusion" else ""
    channels = _collectives(module.computations[fused], module.computations[fused].instructions) if (
        fused in module.computations) else {}
    seconds = max(held / chip.bf16_flops, moved / chip.hbm_bytes_per_second)
    return _Cost(flops=flops, mxu_flops=held, hbm_bytes=moved, instructions=1, compute_seconds=seconds,
                 channels=channels)


def _as_run(ins: Instruction) -> Instruction:
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


_CONTROL = {"while", "call", "call-start", "conditional"}


def _host_bytes(module: Module, computation: Computation, ins: Instruction) -> float:
    """Bytes ``ins`` itself moves between the device and pinned host memory: a copy from one
    to the other moves its array; an instruction or fusion that reads or writes a buffer in
    host memory moves what it touches of it (a slice, an in-place update: as :func:`_moved`
    counts HBM bytes)."""
    if ins.opcode in _FREE or ins.opcode in _CONTROL or ins.opcode.endswith("-done") or _ALLOCATION in ins.attributes:
        return 0.0
    operands = [computation.shapes.get(o, "") for o in ins.operands]
    if f"S({HOST_MEMORY_SPACE})" not in ins.shape + "".join(operands):
        return 0.0
    if ins.opcode in ("copy", "copy-start"):
        result, source = _results(computation, ins), shape_arrays(operands[0]) if operands else []
        crosses = result and source and (result[0][2] == HOST_MEMORY_SPACE) != (source[0][2] == HOST_MEMORY_SPACE)
        return result[0][1] if crosses else 0.0
    return _moved(module, computation, ins, HOST_MEMORY_SPACE)


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


def _moved(module: Module, computation: Computation, ins: Instruction, space: int = 0) -> float:
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
    fused = module.computations.get(dict(_CALLED.findall(ins.attributes)).get("calls", "")) if (
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
            nested = module.computations.get(dict(_CALLED.findall(u.attributes)).get("calls", "")) if (
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
    collective = any(_is_collective(i) for i in fused.instructions)
    for p in (i for i in fused.instructions if i.opcode == "parameter"):
        index = int(p.arguments) if p.arguments.isdigit() else -1
        if not 0 <= index < len(reads):
            continue
        uses = touched(fused, p.name)
        if collective and uses and all(_is_collective(u) or u is root for u in uses):
            reads[index] = 0.0  # sent by a collective, or handed on to the next fusion of its chain
        elif uses and all(u.opcode in _SLICES for u in uses):
            reads[index] = min(reads[index], sum(array_bytes(u.shape) for u in uses))
        elif uses and all(u.opcode == "dynamic-update-slice" and origin(u.operands[0]) is p for u in uses):
            reads[index] = 0.0
    outputs = [origin(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [origin(
        root.name) if root is not None else None]
    if collective and root is not None and _is_collective(root):
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
    if collective and out is not None and (out.opcode == "parameter" or _is_collective(out)):
        return 0.0
    return nbytes


def _is_collective(ins: Instruction) -> bool:
    """A collective, or the TPU compiler's marker of where an asynchronous one starts or is
    waited for (``AsyncCollectiveStart``, ``AsyncCollectiveDone``: the roots of the fusions that
    chain one across the instructions between)."""
    return ins.opcode.removesuffix("-start") in _COLLECTIVES or (
        ins.opcode == "custom-call" and 'custom_call_target="AsyncCollective' in ins.attributes)


def _collectives(computation: Computation, instructions: list[Instruction]) -> dict[str, float]:
    """Bytes received per chip by each collective among ``instructions``, by channel (or by
    name, for one without)."""
    found = {}
    for ins in instructions:
        kind = ins.opcode.removesuffix("-start")
        if kind in _COLLECTIVES:
            channel = _CHANNEL.search(ins.attributes)
            key = f"channel {channel[1]}" if channel else f"{computation.name}/{ins.name}"
            found[key] = max(found.get(key, 0.0), _collective_bytes(computation, ins, kind))
    return found


def _flops(module: Module, computation: Computation, ins: Instruction, mxu: int | None = None) -> float:
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
    called = dict(_CALLED.findall(ins.attributes)).get("calls")
    if ins.opcode != "fusion" or called not in module.computations:
        return 0.0
    inner = module.computations[called]
    return sum(_flops(module, inner, sub, mxu) for sub in inner.instructions)


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


def _collective_bytes(computation: Computation, ins: Instruction, kind: str) -> float:
    """Bytes one chip receives for the collective ``ins`` in a ring over its group."""
    result = array_bytes(ins.shape)
    operand = sum(array_bytes(computation.shapes.get(o, "")) for o in ins.operands)
    if ins.opcode.endswith("-start") and ins.shape.startswith("("):
        result -= operand  # an async start's shape is (operands, results)
    group = _group_size(ins.attributes)
    if kind == "all-gather":
        group = group or (round(result / operand) if operand else 1)
        return result * (group - 1) / group
    if kind == "reduce-scatter":
        group = group or (round(operand / result) if result else 1)
        return operand * (group - 1) / group
    if kind == "all-reduce":
        group = group or 2
        return 2 * operand * (group - 1) / group
    if kind in ("all-to-all", "ragged-all-to-all"):
        group = group or 2
        return operand * (group - 1) / group
    return operand  # collective-permute: each chip receives what it is sent


def _group_size(attributes: str) -> int | None:
    """The size of the replica groups, in any of the three ways HLO prints them."""
    if match := _GROUPS_LIST.search(attributes):
        return len([d for d in match[1].split(",") if d]) or None
    if match := _GROUPS_IOTA.search(attributes):
        return int(match[1].split(",")[-1])
    if match := _GROUPS_MESH.search(attributes):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", match[1]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", match[2]) if a in sizes) or None
    return None
