"""Reading an optimized HLO module's text (``Compiled.as_text()``): its computations and their
instructions in the printed (scheduled) order, and the arrays of a shape (elements, bytes,
memory space), and how many times a loop runs. What the step-time model
(:mod:`remat_search.targets.step_time`) prices."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^{}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
"""The computations an instruction calls, by role: ``dict(CALLED.findall(ins.attributes))``."""


@dataclass
class Instruction:
    """One instruction: ``%name = SHAPE opcode(operands), attributes``."""

    name: str
    opcode: str
    shape: str
    operands: list[str]
    attributes: str
    arguments: str = ""
    """The text between the opcode's parentheses: a constant's value."""


@dataclass
class Computation:
    """One computation (the entry, a fusion's, a loop's body…) and its instructions in order."""

    name: str
    instructions: list[Instruction] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)
    """Each value's shape text."""
    by_name: dict[str, Instruction] = field(default_factory=dict)
    root: Instruction | None = None
    """The instruction marked ``ROOT``: what the computation returns. Not always printed last: a
    scheduled loop body may end with the transfers and kernels it overlaps with its result."""


@dataclass
class Module:
    """A whole HLO module: its computations by name, and the entry's name."""

    computations: dict[str, Computation]
    entry: str


def parse(hlo: str) -> Module:
    """The module's computations and their instructions, in the printed (scheduled) order."""
    computations: dict[str, Computation] = {}
    entry, current = "", None
    for line in _instruction_lines(hlo):
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header[2], Computation(header[2]))
                entry = header[2] if header[1] else entry
            continue
        if line.rstrip() == "}" or line.startswith("}, execution_thread"):  # or another execution thread's end
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            current.instructions.append(instruction)
            current.shapes[instruction.name] = instruction.shape
            current.by_name[instruction.name] = instruction
            if line.lstrip().startswith("ROOT "):
                current.root = instruction
    return Module(computations, entry)


def _instruction_lines(hlo: str) -> list[str]:
    """The module's lines, an instruction printed over several (a Pallas kernel's attributes
    may hold a line break: splash attention's ``xprof_metadata``) joined into one."""
    lines: list[str] = []
    for line in hlo.splitlines():
        closing = line.rstrip() == "}" or line.startswith("}, execution_thread")
        continued = lines and lines[-1].startswith(" ") and not line.startswith(("  %", "  ROOT ")) and not closing
        continued = continued and line.strip()
        if continued:
            lines[-1] += line
        else:
            lines.append(line)
    return lines


def _parse_instruction(line: str) -> Instruction | None:
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
    return Instruction(head[1], opcode[0], shape, operands, rest[close:], rest[start + 1:close - 1])


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


def shape_arrays(shape: str) -> list[tuple[int, float, int]]:
    """Each array of a (tuple) shape: (elements, bytes, memory space)."""
    found = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        elements = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        space = _MEMORY_SPACE.search(layout or "")
        found.append((elements, elements * _DTYPE_BYTES.get(dtype, 0), int(space[1]) if space else 0))
    return found


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape, each as text (``(a, (b, c), d)`` → ``a``,
    ``(b, c)``, ``d``); an array shape is its own one element."""
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for i, c in enumerate(shape):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        if (c == "," and depth == 1) or (c == ")" and depth == 0):
            text = re.sub(r"/\*[^*]*\*/", "", shape[start:i]).strip()
            elements += [text] if text else []
            start = i + 1
    return elements


def hbm_bytes(shape: str) -> float:
    """Bytes of the arrays of ``shape`` that live in HBM (the default memory space)."""
    return sum(nbytes for _, nbytes, space in shape_arrays(shape) if space == 0)


def array_bytes(shape: str) -> float:
    """Bytes of all the arrays of ``shape``, wherever they live."""
    return sum(nbytes for _, nbytes, _ in shape_arrays(shape))


def shape_elements(shape: str) -> int:
    """Elements of all the arrays of ``shape``."""
    return sum(elements for elements, _, _ in shape_arrays(shape))


def shape_dims(shape: str) -> list[int]:
    """The dimensions of the first array of ``shape``."""
    match = _ARRAY.search(shape)
    return [int(d) for d in match[2].split(",") if d] if match else []


def trip_count(
    module: Module, computation: Computation, loop: Instruction, condition: str, body: str
) -> int | None:
    """How many times ``loop`` runs its body: as the compiler states it, else read off a
    condition ``counter < N`` (or ``<=``), the counter's first value in the loop's operand and
    what the ``body`` adds to it each iteration."""
    if stated := _TRIP.search(loop.attributes):
        return int(stated[1])
    cond = module.computations.get(condition)
    root = cond.root if cond else None
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


def _counter_step(body: Computation | None, index: int) -> int | None:
    """What the loop's body adds to its counter (element ``index`` of the loop's tuple) each
    iteration: 1 in a scan, more where the compiler unrolled the body (the TPU compiler's
    windowed matmuls over an FSDP gather advance theirs by 2, one chunk from each side of the
    ring each iteration); None where the body's counter is not ``counter + constant``."""
    root = body.root if body is not None else None
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    update = through_copies(body, root.operands[index])
    if update is None or update.opcode != "add" or len(update.operands) != 2:
        return None
    for counter, amount in (update.operands, update.operands[::-1]):
        read, constant = through_copies(body, counter), through_copies(body, amount)
        if (read is not None and read.opcode == "get-tuple-element" and re.search(rf"\bindex={index}\b", read.attributes)
                and constant is not None and constant.opcode == "constant"):
            try:
                step = int(constant.arguments)
            except ValueError:
                return None
            return step if step > 0 else None
    return None


def through_copies(computation: Computation, name: str) -> Instruction | None:
    """The instruction behind ``name``, past the copies and bitcasts the scheduler adds."""
    found = computation.by_name.get(name)
    for _ in range(8):
        if found is None or found.opcode not in ("copy", "bitcast", "copy-start", "copy-done") or not found.operands:
            break
        found = computation.by_name.get(found.operands[0])
    return found


def _counter_start(computation: Computation, loop: Instruction, index: int) -> int | None:
    """The value the loop's counter (element ``index`` of its operand tuple) starts from."""
    init = computation.by_name.get(loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = through_copies(computation, init.operands[index])
    try:
        return int(start.arguments) if start is not None and start.opcode == "constant" else None
    except ValueError:
        return None
