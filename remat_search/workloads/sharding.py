"""How a workload's state and batch are split over a mesh: the batch's axes, a model's own
partitioning as shardings, and the spec's logical axis rules (which mesh axes they map onto,
and the context a Flax model's step is traced in with them)."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

from remat_search.errors import SpecError, WorkloadError
from remat_search.plans.configuration import BATCH_AXES

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh, NamedSharding

PyTree = Any


def split_batch_over(mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes the batch's leading dimension is split over: those of
    :data:`~remat_search.plans.configuration.BATCH_AXES` (``data``, ``fsdp``, …) of more than
    one device (none without a mesh)."""
    if mesh is None:
        return ()
    return tuple(a for a in mesh.axis_names if a in BATCH_AXES and mesh.shape[a] > 1)


def own_shardings(mesh: Mesh, partitioning: PyTree, params: PyTree, rule_axes: frozenset[str] | None) -> PyTree:
    """``NamedSharding``s of ``params`` from a model's ``PartitionSpec`` s (one per leaf): axes
    the mesh lacks are left out (at size 1: the model's run on such a mesh is not split over
    them); where the spec's rules map the names (``rule_axes``, see :meth:`Workload.rule_axes`),
    a name neither they nor the mesh have is a :class:`WorkloadError` (an unmapped logical
    name); a dimension the mesh's axes do not divide is a :class:`SpecError` naming the parameter."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def sharding(path: Any, a: jax.ShapeDtypeStruct, spec: Any) -> NamedSharding:
        dims = []
        for d, entry in enumerate(tuple(spec) + (None,) * (a.ndim - len(spec))):
            named = (entry,) if isinstance(entry, str) else tuple(entry or ())
            unknown = [x for x in named if rule_axes is not None and x not in mesh.shape and x not in rule_axes]
            if unknown:
                mapped = ", ".join(sorted(rule_axes or ())) or "none"
                raise WorkloadError(
                    f"workload.logical_axis_rules: the model partitions parameter {jax.tree_util.keystr(path)} over "
                    f"{unknown[0]!r}, which is no mesh axis (spec.mesh has {', '.join(mesh.axis_names)}; the rules "
                    f"map onto {mapped}); map its logical names onto mesh axes: [[name, mesh axis or null], ...]"
                )
            axes = tuple(x for x in named if x in mesh.shape)
            ways = math.prod(mesh.shape[x] for x in axes)
            if a.shape[d] % ways:
                raise SpecError(
                    f"spec.mesh: the model splits parameter {jax.tree_util.keystr(path)} (shape {list(a.shape)}) "
                    f"over {' × '.join(axes)} = {ways} in dimension {d}, which that does not divide"
                )
            dims.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return NamedSharding(mesh, P(*dims))

    specs = jax.tree.structure(params).flatten_up_to(partitioning)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return jax.tree.unflatten(
        jax.tree.structure(params), [sharding(path, a, spec) for (path, a), spec in zip(leaves, specs, strict=True)]
    )


def rules_on(rules: Any, mesh: Mesh | None) -> tuple[tuple[str, Any], ...] | None:
    """Logical axis ``rules`` (:data:`~remat_search.spec.models.AxisRules`) with the axes ``mesh``
    lacks left out (a name mapped only onto those is unsplit), as a model run on that mesh
    would have them at size 1; the rules as written where there is no mesh."""
    if rules is None or mesh is None:
        return rules

    def kept(target: Any) -> Any:
        axes = tuple(a for a in ((target,) if isinstance(target, str) else target or ()) if a in mesh.shape)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return tuple((name, kept(target)) for name, target in rules)


def flax_tracing(rules: Any, mesh: Mesh | None) -> contextlib.AbstractContextManager[Any]:
    """The context a Flax model's step is traced in: its logical axis ``rules`` in force (as
    :func:`rules_on` ``mesh``) and ``mesh`` as the abstract mesh, so that its own sharding
    constraints (``nn.with_logical_constraint``) apply. For linen and NNX alike (one setting)."""
    import flax.linen as nn
    import jax

    stack = contextlib.ExitStack()
    if rules is not None:
        stack.enter_context(nn.logical_axis_rules(rules_on(rules, mesh)))
    if mesh is not None:
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
    return stack
