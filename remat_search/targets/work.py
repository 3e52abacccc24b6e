"""A compiled program as the work its chip does, before any price: each computation's scheduled
instructions with their matmul FLOPs (:mod:`~remat_search.targets.matmuls`), HBM and host-link
bytes (:mod:`~remat_search.targets.traffic`) and collectives' bytes
(:mod:`~remat_search.targets.collectives`), and the loops, calls and branches between them.

Reading the text is the slow part of an estimate; pricing the work is a walk over numbers. A
calibration (:mod:`~remat_search.targets.calibration`) reads each measured program once and
prices it many times, at every guess of the free figures (:class:`~remat_search.targets.step_time.Efficiencies`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from remat_search.targets.collectives import COLLECTIVES, collectives
from remat_search.targets.hlo import CALLED, Computation, Instruction, Module, parse, trip_count
from remat_search.targets.matmuls import flops
from remat_search.targets.traffic import ALLOCATION, FREE, as_run, host_bytes, moved

_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass(frozen=True)
class Op:
    """One scheduled instruction as its chip runs it."""

    name: str
    priced: bool = False
    """Computes or moves memory (a fusion, an unfused op, a kernel): priced at the roofline."""
    flops: float = 0.0
    mxu_flops: float = 0.0
    """:attr:`flops` padded to the matrix unit's tiles, where the chip has one."""
    hbm_bytes: float = 0.0
    channels: tuple[tuple[str, tuple[float, bool]], ...] = ()
    """Bytes each collective it runs (or a fusion of it runs) delivers per chip, by channel, and
    whether over one link (a ``collective-permute``: :func:`~remat_search.targets.collectives.collectives`)."""
    collective: bool = False
    """A collective itself (counted as an instruction, priced by its channel)."""
    host_bytes: float = 0.0
    """Bytes it moves between the device and pinned host memory."""
    starts: bool = False
    """An asynchronous start (``…-start``): a transfer it begins runs until its done."""
    waits_for: str | None = None
    """A ``…-done``: the start it waits for."""
    body: str | None = None
    trips: int | None = None
    """A loop's body, and how many times it runs (None: the compiler did not say; counted once)."""
    calls: str | None = None
    branches: tuple[str, ...] = ()

    @property
    def inert(self) -> bool:
        """Costs nothing and waits for nothing a price counts (a parameter, a tuple, a bitcast,
        a start of neither a transfer nor a collective): :func:`read_work` leaves it out."""
        return not (self.priced or self.collective or self.host_bytes or self.waits_for or self.body
                    or self.calls or self.branches)


@dataclass
class Work:
    """A program's computations as :class:`Op` lists, in schedule order (the inert ones left out), and its entry."""

    computations: dict[str, list[Op]] = field(default_factory=dict)
    entry: str = ""


def read_work(hlo: str, mxu: int | None = None) -> Work:
    """The work of the optimized HLO module ``hlo`` (``Compiled.as_text()``), matmuls padded to
    a matrix unit of side ``mxu`` where given."""
    module = parse(hlo)
    ops = {name: [_op(module, c, ins, mxu) for ins in c.instructions] for name, c in module.computations.items()}
    return Work({name: [op for op in c if not op.inert] for name, c in ops.items()}, module.entry)


def _op(module: Module, computation: Computation, ins: Instruction, mxu: int | None) -> Op:
    moved_to_host = host_bytes(module, computation, ins)
    starts = ins.opcode.endswith("-start")
    waits_for = ins.operands[0] if ins.opcode.endswith("-done") and ins.operands else None
    run = as_run(ins)
    opcode, called = run.opcode, dict(CALLED.findall(run.attributes))
    common = {"name": ins.name, "host_bytes": moved_to_host, "starts": starts, "waits_for": waits_for}
    if opcode in FREE or opcode.endswith("-done") or ALLOCATION in run.attributes:
        return Op(**common)
    if opcode == "while":
        trips = trip_count(module, computation, run, called.get("condition", ""), called.get("body", ""))
        return Op(**common, body=called.get("body", ""), trips=trips)
    if opcode == "conditional":
        listed = _BRANCHES.search(run.attributes)
        names = [b.strip().lstrip("%") for b in listed[1].split(",")] if listed else [
            called.get("true_computation", ""), called.get("false_computation", "")]
        return Op(**common, branches=tuple(n for n in names if n))
    if opcode in ("call", "call-start"):  # call-start: run on another thread (a SparseCore's collective)
        return Op(**common, calls=called.get("to_apply", ""))
    if opcode.removesuffix("-start") in COLLECTIVES:
        return Op(**common, collective=True, channels=tuple(collectives(computation, [run]).items()))
    fused = module.computations.get(called.get("calls", "")) if opcode == "fusion" else None
    counted = flops(module, computation, run)
    return Op(**common, priced=True, flops=counted, mxu_flops=flops(module, computation, run, mxu) if mxu else counted,
              hbm_bytes=moved(module, computation, run),
              channels=tuple(collectives(fused, fused.instructions).items()) if fused is not None else ())
