"""What is read off a compiled program besides its memory: a digest that two compiles of one
program share (so that a plan compiled alike to one measured before need not run), the
compiler's cost analysis, and the bytes of its arguments and outputs."""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from typing import Any

import numpy as np

_DEBUG_SECTIONS = re.compile(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n?)*", re.MULTILINE)
_METADATA = re.compile(r',?\s*metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_NAME = re.compile(r"%?\b([A-Za-z_][\w\-]*?)\.(\d+)\b")
_CALLBACK = re.compile(r'custom_call_target="[^"]*callback[^"]*"')


def program_digest(hlo: str) -> str | None:
    """A hash (16 hex digits) of an optimized HLO module's text (``Compiled.as_text()``) that
    two compiles of one program share: the source locations (``metadata``, the stack-frame
    tables) are left out, and each numbered name (``%fusion.12``) is renumbered in order of
    first appearance, per base name, since plans whose traces differ number the same
    instructions differently. Only names defined with ``%`` are renumbered.

    None for a program that calls back into Python (``jax.debug.callback``,
    ``jax.pure_callback``): the text names the callback by its index alone, so what it does,
    which may differ from plan to plan, is not in the text."""
    if _CALLBACK.search(hlo):
        return None
    text = _METADATA.sub("", _DEBUG_SECTIONS.sub("", hlo))
    defined = {m.group(0)[1:] for m in _NAME.finditer(text) if m.group(0).startswith("%")}
    seen: dict[str, str] = {}
    counts: Counter[str] = Counter()

    def rename(m: re.Match[str]) -> str:
        token = m.group(0).lstrip("%")
        if token not in defined:
            return m.group(0)
        if token not in seen:
            seen[token] = f"{m.group(1)}.{counts[m.group(1)]}"
            counts[m.group(1)] += 1
        return m.group(0)[: len(m.group(0)) - len(token)] + seen[token]

    return hashlib.sha256(_NAME.sub(rename, text).encode()).hexdigest()[:16]


def io_bytes(lowered: Any, abstract: Any) -> int:
    """Per-chip bytes of a lowered program's arguments and outputs, less the donated arguments
    that outputs of the same shape alias: what the TPU compiler's out-of-memory error leaves
    out of the bytes it needs. Logical sizes (before the TPU pads arrays to tiles)."""
    import jax

    def shard(a: Any) -> tuple[tuple[int, ...], str]:
        sharding = getattr(a, "sharding", None)
        shape = sharding.shard_shape(a.shape) if hasattr(sharding, "shard_shape") else a.shape
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # a key array (MaxText's state holds some): its bits
            return (*shape, *a.dtype._impl.key_shape), "uint32"
        return tuple(shape), str(np.dtype(a.dtype))

    def nbytes(key: tuple[tuple[int, ...], str]) -> int:
        return math.prod(key[0]) * np.dtype(key[1]).itemsize

    args = [shard(a) for a in jax.tree.leaves(abstract)]
    donated = [info.donated for info in jax.tree.leaves(lowered.args_info)]
    free = Counter(key for key, d in zip(args, donated, strict=True) if d)
    total = sum(map(nbytes, args))
    for key in (shard(o) for o in jax.tree.leaves(lowered.out_info)):
        total += nbytes(key)
        if free[key]:  # a donated argument's buffer holds this output
            free[key] -= 1
            total -= nbytes(key)
    return total


def program_cost(compiled: Any) -> dict[str, float]:
    """FLOPs and bytes accessed of one device's program (recomputation included)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX returns one dict per device program
        cost = cost[0] if cost else {}
    return {k: float(cost[k]) for k in ("flops", "bytes accessed") if cost and k in cost}
