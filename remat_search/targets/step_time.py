"""The step-time model of a compile-only target: one step's time, read off the compiled program.

Where plans are compiled ahead of time and never run (a TPU topology), a step's time is an
estimate. :func:`estimate_step` reads the optimized HLO module (``Compiled.as_text()``) the way
the chip would execute it, one scheduled instruction after another, and prices each one:

* a fusion, an unfused op or a kernel (``custom-call``) costs the slower of its FLOPs at the
  chip's peak and its HBM traffic (operands read, results written: the buffers in the default
  memory space, not those the compiler placed on the chip) at the chip's HBM bandwidth — a
  roofline per instruction, summed, so that recomputing elementwise work costs bandwidth and
  recomputing a matmul costs FLOPs. FLOPs are those of the matmuls (``dot``, ``convolution``)
  inside, or a Pallas kernel's own cost estimate;
* a collective (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute; also
  those the TPU compiler fused with a matmul) costs the bytes each chip receives in a ring over
  its group, at the chip's inter-chip (ICI) bandwidth, with **no overlap** with computation
  assumed: an upper bound on communication's share, which is how a fully rematerialised FSDP
  layer's second gather of its weights shows;
* a loop's body is counted as many times as the compiler knows it runs (``known_trip_count``);
  of a conditional's branches, the dearest.

What it leaves out: the vector unit's own throughput (elementwise FLOPs are priced by their
bytes alone), padding to the chip's tiles, overlap of copies and collectives with computation,
per-instruction launch overheads, and the host. It is a lower bound on compute and memory time
and an upper bound on communication, deterministic, and the same for every plan of a study:
good for ranking plans, not a promise of wall time.

The whole-program roofline this replaced (:func:`roofline_seconds`: one max over the
program's total FLOPs and bytes) is kept beside it for one release.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

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


# Google Cloud's published per-chip figures (bf16 dense FLOP/s, HBM bandwidth, bidirectional
# ICI bandwidth per chip halved): cloud.google.com/tpu/docs/v5e, /v5p, /v6e. The v4 page
# gives no per-chip ICI bandwidth.
CHIPS = {
    "v4": Chip(name="TPU v4", bf16_flops=275e12, hbm_bytes_per_second=1228e9),
    "v5e": Chip(name="TPU v5e", bf16_flops=197e12, hbm_bytes_per_second=819e9, ici_bytes_per_second=200e9),
    "v5p": Chip(name="TPU v5p", bf16_flops=459e12, hbm_bytes_per_second=2765e9, ici_bytes_per_second=600e9),
    "v6e": Chip(name="TPU v6e", bf16_flops=918e12, hbm_bytes_per_second=1640e9, ici_bytes_per_second=400e9),
}


class StepEstimate(BaseModel):
    """One step's estimated time on a chip (:func:`estimate_step`), and what it is made of."""

    model_config = ConfigDict(frozen=True)

    seconds: float
    """The estimate: :attr:`compute_seconds` + :attr:`collective_seconds`."""
    compute_seconds: float
    """Sum over the executed instructions of max(FLOPs / peak, HBM bytes / bandwidth)."""
    collective_seconds: float
    """Collectives' bytes received per chip at the ICI bandwidth (0 where the chip has no figure)."""
    flops: float
    hbm_bytes: float
    collective_bytes: float
    instructions: int
    """Instructions priced (each loop iteration counted)."""
    unknown_trip_counts: int = 0
    """Loops whose trip count the compiler did not state: counted once each."""
    roofline_seconds: float | None = None
    """The whole-program roofline of the same program (:func:`roofline_seconds`, the model
    before this one), kept beside it for one release."""


def estimate_step(hlo: str, chip: Chip, cost: dict[str, float] | None = None) -> StepEstimate:
    """The per-instruction model of one step of the optimized HLO module ``hlo`` on ``chip``
    (see the module's docstring), with the whole-program roofline of the compiler's cost
    analysis ``cost`` beside it where given."""
    module = _parse(hlo)
    total = _cost_of(module, module.entry, {})
    compute = total.compute_seconds(chip)
    collective = total.collective_bytes / chip.ici_bytes_per_second if chip.ici_bytes_per_second else 0.0
    return StepEstimate(
        seconds=compute + collective, compute_seconds=compute, collective_seconds=collective,
        flops=total.flops, hbm_bytes=total.hbm_bytes, collective_bytes=total.collective_bytes,
        instructions=total.instructions, unknown_trip_counts=total.unknown_trips,
        roofline_seconds=roofline_seconds(cost, chip) if cost is not None else None,
    )


def roofline_seconds(cost: dict[str, float], chip: Chip) -> float:
    """The whole-program roofline (the model before :func:`estimate_step`): the slower of the
    program's FLOPs at peak and its bytes accessed at HBM bandwidth, from the compiler's cost
    analysis."""
    return max(cost.get("flops", 0.0) / chip.bf16_flops, cost.get("bytes accessed", 0.0) / chip.hbm_bytes_per_second)


# --- reading the HLO text ---------------------------------------------------------------

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^{}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
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
}
_SLICES = {"slice", "dynamic-slice", "gather"}
_COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all"}


@dataclass
class _Instruction:
    name: str
    opcode: str
    shape: str
    operands: list[str]
    attributes: str
    arguments: str = ""
    """The text between the opcode's parentheses: a constant's value."""


@dataclass
class _Computation:
    name: str
    instructions: list[_Instruction] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)
    """Each value's shape text."""
    by_name: dict[str, _Instruction] = field(default_factory=dict)


@dataclass
class _Module:
    computations: dict[str, _Computation]
    entry: str


def _parse(hlo: str) -> _Module:
    """The module's computations and their instructions, in the printed (scheduled) order."""
    computations: dict[str, _Computation] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header[2], _Computation(header[2]))
                entry = header[2] if header[1] else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        instruction = _instruction(line)
        if instruction is not None:
            current.instructions.append(instruction)
            current.shapes[instruction.name] = instruction.shape
            current.by_name[instruction.name] = instruction
    return _Module(computations, entry)


def _instruction(line: str) -> _Instruction | None:
    """One instruction line: ``%name = SHAPE opcode(operands), attributes``."""
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    rest = line[head.end():]
    end = _balanced(rest, 0) if rest.startswith("(") else _shape_end(rest)
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode = re.match(r"[\w\-]+", rest)
    if opcode is None:
        return None
    start = opcode.end()
    close = _balanced(rest, start) if rest[start:start + 1] == "(" else start
    operands = re.findall(r"%([\w.\-]+)", rest[start:close])
    return _Instruction(head[1], opcode[0], shape, operands, rest[close:], rest[start + 1:close - 1])


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _shape_end(text: str) -> int:
    """The index just past an array shape such as ``f32[4,8]{1,0:T(8,128)}``."""
    match = _ARRAY.match(text)
    return match.end() if match else text.find(" ")


def _arrays(shape: str) -> list[tuple[int, float, int]]:
    """Each array of a (tuple) shape: (elements, bytes, memory space)."""
    found = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        elements = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        space = _MEMORY_SPACE.search(layout or "")
        found.append((elements, elements * _DTYPE_BYTES.get(dtype, 0), int(space[1]) if space else 0))
    return found


def _hbm_bytes(shape: str) -> float:
    """Bytes of the arrays of ``shape`` that live in HBM (the default memory space)."""
    return sum(nbytes for _, nbytes, space in _arrays(shape) if space == 0)


def _bytes(shape: str) -> float:
    """Bytes of all the arrays of ``shape``, wherever they live."""
    return sum(nbytes for _, nbytes, _ in _arrays(shape))


def _elements(shape: str) -> int:
    return sum(elements for elements, _, _ in _arrays(shape))


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(d) for d in match[2].split(",") if d] if match else []


# --- pricing ----------------------------------------------------------------------------


@dataclass
class _Cost:
    """What a run of instructions adds up to. Compute time is priced per instruction, so it is
    kept as the per-instruction roofline terms summed for the chip at hand."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: float = 0.0
    instructions: int = 0
    unknown_trips: int = 0
    priced: list[tuple[float, float]] = field(default_factory=list)
    """(FLOPs, HBM bytes) of each priced instruction, with its multiplicity folded in."""
    channels: dict[str, float] = field(default_factory=dict)
    """Bytes of collectives by channel: the TPU compiler splits one collective over a chain of
    fusions, each printing it whole, so a channel counts once a computation."""

    def add(self, other: _Cost, times: int = 1) -> None:
        self.flops += other.flops * times
        self.hbm_bytes += other.hbm_bytes * times
        self.collective_bytes += other.collective_bytes * times
        for channel, nbytes in other.channels.items():
            self.channels[channel] = max(self.channels.get(channel, 0.0), nbytes)
        self.instructions += other.instructions * times
        self.unknown_trips += other.unknown_trips * times
        self.priced.extend((f * times, b * times) for f, b in other.priced)

    def compute_seconds(self, chip: Chip) -> float:
        return sum(max(f / chip.bf16_flops, b / chip.hbm_bytes_per_second) for f, b in self.priced)


def _cost_of(module: _Module, name: str, memo: dict[str, _Cost]) -> _Cost:
    """The cost of running computation ``name`` once, as a schedule of instructions."""
    if name in memo:
        return memo[name]
    computation = module.computations.get(name)
    total = _Cost()
    for ins in computation.instructions if computation else ():
        total.add(_instruction_cost(module, computation, ins, memo))
    total.collective_bytes += sum(total.channels.values())
    total.channels = {}
    memo[name] = total
    return total


def _instruction_cost(module: _Module, computation: _Computation, ins: _Instruction, memo: dict[str, _Cost]) -> _Cost:
    """The cost of one scheduled instruction (see the module's docstring)."""
    opcode, called = ins.opcode, dict(_CALLED.findall(ins.attributes))
    if opcode in _FREE:
        return _Cost()
    if opcode == "while":
        trip = _trip_count(module, computation, ins, called.get("condition", ""), called.get("body", ""))
        cost = _Cost(unknown_trips=0 if trip else 1)
        cost.add(_cost_of(module, called.get("body", ""), memo), trip or 1)
        return cost
    if opcode == "conditional":
        names = [b.strip().lstrip("%") for b in _BRANCHES.search(ins.attributes)[1].split(",")] if _BRANCHES.search(
            ins.attributes) else [called.get("true_computation", ""), called.get("false_computation", "")]
        branches = [_cost_of(module, n, memo) for n in names if n]
        return max(branches, key=lambda c: (c.flops, c.hbm_bytes, c.collective_bytes), default=_Cost())
    if opcode == "call":
        return _cost_of(module, called.get("to_apply", ""), memo)
    if opcode.removesuffix("-start") in _COLLECTIVES:
        return _Cost(instructions=1, channels=_collectives(computation, [ins]))
    moved = _moved(module, computation, ins)
    flops = _flops(module, computation, ins)
    fused = called.get("calls", "") if opcode == "fusion" else ""
    channels = _collectives(module.computations[fused], module.computations[fused].instructions) if (
        fused in module.computations) else {}
    return _Cost(flops=flops, hbm_bytes=moved, instructions=1, priced=[(flops, moved)], channels=channels)


def _moved(module: _Module, computation: _Computation, ins: _Instruction) -> float:
    """HBM bytes ``ins`` reads and writes: each operand in full and its result, except where it
    touches part of a buffer, as XLA's own cost analysis counts: a slice (``slice``,
    ``dynamic-slice``, ``gather``, also inside a fusion) reads only what it keeps, and an update
    in place (``dynamic-update-slice``) reads and writes only the update, not the buffer it
    updates. A scanned model's loop slices its layer out of stacked arrays, and writes its
    saved activations into them, this way every iteration."""
    shapes = computation.shapes
    if ins.opcode.removesuffix("-start") in _SLICES:
        arrays = _arrays(ins.shape)
        kept = arrays[1] if ins.opcode.endswith("-start") and len(arrays) > 1 else arrays[0]
        source = _arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
        return (kept[1] if source and source[0][2] == 0 else 0.0) + (kept[1] if kept[2] == 0 else 0.0)
    if ins.opcode == "dynamic-update-slice":
        update = _hbm_bytes(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else 0.0
        return 2 * update if _arrays(ins.shape)[0][2] == 0 else update
    fused = module.computations.get(dict(_CALLED.findall(ins.attributes)).get("calls", "")) if (
        ins.opcode == "fusion") else None
    reads = [_hbm_bytes(shapes.get(o, "")) for o in ins.operands]
    written = 0.0 if ins.opcode.endswith("-start") else _hbm_bytes(ins.shape)
    if fused is None:
        return sum(reads) + written
    users: dict[str, list[_Instruction]] = {}
    for i in fused.instructions:
        for o in i.operands:
            users.setdefault(o, []).append(i)

    def touched(name: str) -> list[_Instruction]:  # its users, through bitcasts
        found = []
        for u in users.get(name, []):
            found += touched(u.name) if u.opcode == "bitcast" else [u]
        return found

    def origin(name: str) -> _Instruction | None:  # the instruction behind bitcasts
        i = fused.by_name.get(name)
        return origin(i.operands[0]) if i is not None and i.opcode == "bitcast" and i.operands else i

    for p in (i for i in fused.instructions if i.opcode == "parameter"):
        index = int(p.arguments) if p.arguments.isdigit() else -1
        if not 0 <= index < len(reads):
            continue
        uses = touched(p.name)
        if uses and all(u.opcode in _SLICES for u in uses):
            reads[index] = min(reads[index], sum(_bytes(u.shape) for u in uses))
        elif uses and all(u.opcode == "dynamic-update-slice" and origin(u.operands[0]) is p for u in uses):
            reads[index] = 0.0
    root = fused.instructions[-1] if fused.instructions else None
    outputs = [origin(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [origin(
        root.name) if root is not None else None]
    arrays = _arrays(ins.shape)
    if len(outputs) == len(arrays) and not ins.opcode.endswith("-start"):
        written = sum(
            (_bytes(fused.shapes.get(out.operands[1], "")) if out is not None and out.opcode == "dynamic-update-slice"
             else nbytes) for out, (_, nbytes, space) in zip(outputs, arrays, strict=True) if space == 0
        )
    return sum(reads) + written


def _collectives(computation: _Computation, instructions: list[_Instruction]) -> dict[str, float]:
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


def _trip_count(
    module: _Module, computation: _Computation, loop: _Instruction, condition: str, body: str
) -> int | None:
    """How many times ``loop`` runs its body: as the compiler states it, else read off a
    condition ``counter < N`` (or ``<=``), the counter's first value in the loop's operand and
    what the ``body`` adds to it each iteration."""
    if stated := _TRIP.search(loop.attributes):
        return int(stated[1])
    cond = module.computations.get(condition)
    root = cond.instructions[-1] if cond and cond.instructions else None
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.attributes)
    a, b = (cond.by_name.get(o) for o in root.operands)
    if direction is None or a is None or b is None:
        return None
    flipped = {"GT": "LT", "GE": "LE"}
    if a.opcode == "constant" and b.opcode == "get-tuple-element":
        (a, b), op = (b, a), flipped.get(direction[1], "")
    else:
        op = direction[1]
    if op not in ("LT", "LE") or a.opcode != "get-tuple-element" or b.opcode != "constant":
        return None
    index = int(found[1]) if (found := re.search(r"index=(\d+)", a.attributes)) else 0
    init = _counter_start(computation, loop, index)
    step = _counter_step(module.computations.get(body), index)
    try:
        limit = int(b.arguments)
    except ValueError:
        return None
    if init is None or step is None:
        return None
    return max(-(-(limit - init + (op == "LE")) // step), 0)


def _counter_step(body: _Computation | None, index: int) -> int | None:
    """What the loop's body adds to its counter (element ``index`` of the loop's tuple) each
    iteration: 1 in a scan, more where the compiler unrolled the body (the TPU compiler's
    windowed matmuls over an FSDP gather advance theirs by 2, one chunk from each side of the
    ring each iteration); None where the body's counter is not ``counter + constant``."""
    root = body.instructions[-1] if body is not None and body.instructions else None
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    update = _through_copies(body, root.operands[index])
    if update is None or update.opcode != "add" or len(update.operands) != 2:
        return None
    for counter, amount in (update.operands, update.operands[::-1]):
        read, constant = _through_copies(body, counter), _through_copies(body, amount)
        if (read is not None and read.opcode == "get-tuple-element" and re.search(rf"\bindex={index}\b", read.attributes)
                and constant is not None and constant.opcode == "constant"):
            try:
                step = int(constant.arguments)
            except ValueError:
                return None
            return step if step > 0 else None
    return None


def _through_copies(computation: _Computation, name: str) -> _Instruction | None:
    """The instruction behind ``name``, past the copies and bitcasts the scheduler adds."""
    found = computation.by_name.get(name)
    for _ in range(8):
        if found is None or found.opcode not in ("copy", "bitcast", "copy-start", "copy-done") or not found.operands:
            break
        found = computation.by_name.get(found.operands[0])
    return found


def _counter_start(computation: _Computation, loop: _Instruction, index: int) -> int | None:
    """The value the loop's counter (element ``index`` of its operand tuple) starts from."""
    init = computation.by_name.get(loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = _through_copies(computation, init.operands[index])
    try:
        return int(start.arguments) if start is not None and start.opcode == "constant" else None
    except ValueError:
        return None


def _flops(module: _Module, computation: _Computation, ins: _Instruction) -> float:
    """The matmul FLOPs of ``ins``: its own, those inside the fusion it is, or a kernel's estimate."""
    if ins.opcode == "custom-call":
        estimate = _COST_ESTIMATE.search(ins.attributes)
        return float(json.loads(estimate[1]).get("flops", 0)) if estimate else 0.0
    if ins.opcode in ("dot", "convolution"):
        return _matmul_flops(computation, ins)
    called = dict(_CALLED.findall(ins.attributes)).get("calls")
    if ins.opcode != "fusion" or called not in module.computations:
        return 0.0
    inner = module.computations[called]
    return sum(_flops(module, inner, sub) for sub in inner.instructions)


def _matmul_flops(computation: _Computation, ins: _Instruction) -> float:
    """2 × output elements × the reduction each output element sums over."""
    out = _elements(ins.shape.split(")")[0] if ins.shape.startswith("(") else ins.shape)
    dims = dict(_DIMS.findall(ins.attributes))
    if ins.opcode == "dot":
        lhs = _dims(computation.shapes.get(ins.operands[0], "")) if ins.operands else []
        contracting = [int(d) for d in dims.get("lhs_contracting_dims", "{}").strip("{}").split(",") if d]
        return 2.0 * out * math.prod(lhs[d] for d in contracting if d < len(lhs))
    lhs, rhs = (_dims(computation.shapes.get(o, "")) for o in (ins.operands + ["", ""])[:2])
    labels = re.match(r"(\w+)_(\w+)->(\w+)", dims.get("dim_labels", ""))
    out_dims = _dims(ins.shape)
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


def _collective_bytes(computation: _Computation, ins: _Instruction, kind: str) -> float:
    """Bytes one chip receives for the collective ``ins`` in a ring over its group."""
    result = _bytes(ins.shape)
    operand = sum(_bytes(computation.shapes.get(o, "")) for o in ins.operands)
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
