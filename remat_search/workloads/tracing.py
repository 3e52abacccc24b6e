"""Tracing a workload's no-remat step: a fingerprint of its program and the
``checkpoint_name`` tags it emits (the names a ``names`` policy may keep)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from remat_search.workloads.base import Workload


class TracedStep(NamedTuple):
    """What tracing the no-remat training step tells of a workload."""

    fingerprint: str
    """A hash of its jaxpr: it changes when the model's code or the optimizer does, even at the
    same shapes, so cached measurements of old code are not reused."""
    names: frozenset[str] | None
    """The ``checkpoint_name`` tags the step emits (a model's tags may depend on its
    configuration); None where it does not trace."""
    sizes: dict[str, int] | None = None
    """The bytes each tag marks in the traced program, every occurrence counted once (a scanned
    layer's once, an unrolled stack's once a layer): what a ``tensors`` space's cost model
    weighs its tensors by. None where it does not trace."""


def trace_step(workload: Workload) -> TracedStep:
    """Trace ``workload``'s step of its baseline plan (no remat) (within its :meth:`Workload.tracing` context)."""
    import jax

    try:
        with workload.tracing():
            state, batch = workload.abstract_inputs()
            jaxpr = jax.make_jaxpr(workload.step(workload.baseline_plan()))(state, batch)
    except Exception as e:  # noqa: BLE001 - a step that does not trace fails each candidate, with its reason
        return TracedStep(hashlib.sha256(f"does not trace: {type(e).__name__}".encode()).hexdigest()[:16], None)
    sizes = traced_sizes(jaxpr)
    return TracedStep(hashlib.sha256(str(jaxpr).encode()).hexdigest()[:16], frozenset(sizes), sizes)


def traced_names(jaxpr: Any) -> frozenset[str]:
    """The ``checkpoint_name`` tags (the ``name`` primitive) in ``jaxpr`` (a ClosedJaxpr or a
    Jaxpr) and every jaxpr inside it (jit, scan, remat, cond)."""
    return frozenset(traced_sizes(jaxpr))


def traced_sizes(jaxpr: Any) -> dict[str, int]:
    """The bytes each ``checkpoint_name`` tag marks in ``jaxpr`` and every jaxpr inside it,
    summed over the tag's occurrences (0 for a value whose size is not static)."""
    found: dict[str, int] = {}
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name == "name":
            aval = eqn.invars[0].aval
            size = getattr(aval, "size", 0) * getattr(getattr(aval, "dtype", None), "itemsize", 0)
            found[eqn.params["name"]] = found.get(eqn.params["name"], 0) + int(size)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    for name, size in traced_sizes(sub).items():
                        found[name] = found.get(name, 0) + size
    return found


LAYER_MARK = "remat_search.layer."
"""The prefix of the ``checkpoint_name`` tag a structure trace puts on each layer call's output
(``remat_search.layer.3``: unit 3): never in a measured program, only in :func:`layer_runs`' trace."""


def mark_layer(output: Any, unit: int) -> Any:
    """``output`` with its first array tagged as unit ``unit``'s (:data:`LAYER_MARK`), for
    :func:`layer_runs` to find where in the program the unit's body runs."""
    import jax
    from jax.ad_checkpoint import checkpoint_name

    leaves, tree = jax.tree.flatten(output)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array):
            leaves[i] = checkpoint_name(leaf, f"{LAYER_MARK}{unit}")
            break
    return jax.tree.unflatten(tree, leaves)


def layer_runs(jaxpr: Any) -> dict[int, int]:
    """How many layers each marked unit (:func:`mark_layer`) runs in ``jaxpr``: each place its
    mark stands counts the product of the lengths of the scans around it (a body scanned 4 times
    is 4 layers, however often the framework traced it), in the program's order. A mark inside a
    loop of no static length (``while``) is a :class:`ValueError`: its layer count is not known."""
    runs: dict[int, int] = {}

    def walk(inner: Any, times: int, loop: bool) -> None:
        for eqn in getattr(inner, "jaxpr", inner).eqns:
            if eqn.primitive.name == "name" and str(eqn.params["name"]).startswith(LAYER_MARK):
                if loop:
                    raise ValueError("runs a layer inside a while loop, whose length is not static")
                unit = int(str(eqn.params["name"]).removeprefix(LAYER_MARK))
                runs[unit] = runs.get(unit, 0) + times
            scale = int(eqn.params["length"]) if eqn.primitive.name == "scan" else 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                        walk(sub, times * scale, loop or eqn.primitive.name == "while")

    walk(jaxpr, 1, False)
    return runs


def without_marks(names: frozenset[str]) -> frozenset[str]:
    """``names`` less the structure trace's own marks."""
    return frozenset(n for n in names if not n.startswith(LAYER_MARK))
