"""What a program's collectives move: the bytes one chip receives for each, in a ring over its
group, by channel. The step-time model (:mod:`remat_search.targets.step_time`) prices them at
the chip's inter-chip bandwidth."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from remat_search.targets.hlo import Computation, Instruction, array_bytes

_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")

COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all"}


def is_collective(ins: Instruction) -> bool:
    """A collective, or the TPU compiler's marker of where an asynchronous one starts or is
    waited for (``AsyncCollectiveStart``, ``AsyncCollectiveDone``: the roots of the fusions that
    chain one across the instructions between)."""
    return ins.opcode.removesuffix("-start") in COLLECTIVES or (
        ins.opcode == "custom-call" and 'custom_call_target="AsyncCollective' in ins.attributes)


def collectives(computation: Computation, instructions: list[Instruction]) -> dict[str, tuple[float, bool]]:
    """Bytes received per chip by each collective among ``instructions``, by channel (or by
    name, for one without), and whether they come over one link: a ``collective-permute``
    sends each chip's bytes to one neighbour, where a ring collective over a group receives
    over every link its group spans."""
    found: dict[str, tuple[float, bool]] = {}
    for ins in instructions:
        kind = ins.opcode.removesuffix("-start")
        if kind in COLLECTIVES:
            channel = _CHANNEL.search(ins.attributes)
            key = f"channel {channel[1]}" if channel else f"{computation.name}/{ins.name}"
            keep_largest(found, [(key, (collective_bytes(computation, ins, kind), kind == "collective-permute"))])
    return found


def keep_largest(channels: dict[str, tuple[float, bool]], found: Iterable[tuple[str, tuple[float, bool]]]) -> None:
    """Add collectives ``found`` (bytes and whether over one link, by channel) to ``channels``,
    a channel's largest once: the TPU compiler prints one collective whole in each fusion of its chain."""
    for channel, (nbytes, one_link) in found:
        if nbytes >= channels.get(channel, (0.0, False))[0]:
            channels[channel] = (nbytes, one_link)



def collective_bytes(computation: Computation, ins: Instruction, kind: str) -> float:
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
