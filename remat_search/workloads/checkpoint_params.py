"""Parameters from an Orbax checkpoint (``workload.params_from``), read from its metadata alone.

A search should compile against the real model's sizes, and those live in its checkpoint.
:func:`read_params_from` reads the checkpoint's metadata
(``ocp.StandardCheckpointer().metadata(path).item_metadata.tree``): each parameter's shape,
dtype and, where the checkpoint stored one, its sharding's partition spec. No array is read,
so a checkpoint of any size is used from any host. The workload's parameters then take those
shapes and dtypes (:meth:`CheckpointParams.params_like`) and, over a mesh that can express
them, those shardings (:meth:`CheckpointParams.state_shardings`). The checkpoint's tree must be
the model's own: the same parameters by path (``blocks/0/wi``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from remat_search.errors import SpecError, first_line

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

PyTree = Any
WHERE = "spec.workload.params_from"
INIT_SCALE = 0.02
"""The standard deviation of the normal values a parameter gets whose shape the model's own
initialiser does not make (see :meth:`CheckpointParams.params_like`)."""


class StoredParam(NamedTuple):
    """One parameter as the checkpoint's metadata describes it."""

    shape: tuple[int, ...]
    dtype: Any
    spec: tuple[Any, ...] | None
    """The partition spec of the sharding it was saved with (entries: None, an axis name, or a
    tuple of names); None where the checkpoint stored no named sharding."""


def key_path(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A pytree key path as plain strings (``('blocks', '0', 'wi')``), whatever the containers:
    Orbax stores tuples and named tuples as lists and dicts."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return tuple(parts)


def _shown(path: tuple[str, ...]) -> str:
    return "/".join(path) or "(the root)"


@dataclass(frozen=True)
class CheckpointParams:
    """The parameters an Orbax checkpoint holds, by key path, as its metadata says."""

    path: str
    params: dict[tuple[str, ...], StoredParam]

    def matched(self, model: PyTree) -> list[StoredParam]:
        """The checkpoint's parameters in the order of ``model``'s leaves (the model's own
        parameters, arrays or shapes); a :class:`SpecError` naming the first path one has and
        the other lacks."""
        import jax

        paths = [key_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
        missing = [p for p in paths if p not in self.params]
        extra = sorted(set(self.params) - set(paths))
        if missing:
            raise SpecError(
                f"{WHERE}: the checkpoint {self.path!r} has no parameter {_shown(missing[0])!r}, which the model has"
                f" ({len(missing)} missing; the checkpoint's tree must be the model's parameters)"
            )
        if extra:
            raise SpecError(
                f"{WHERE}: the checkpoint {self.path!r} has parameter {_shown(extra[0])!r}, which the model does not"
                f" ({len(extra)} more than the model's; the checkpoint's tree must be the model's parameters)"
            )
        return [self.params[p] for p in paths]

    def params_like(self, params: PyTree, key: jax.Array) -> PyTree:
        """``params`` (the model's own, fresh from its initialiser; traceable) with the
        checkpoint's shapes and dtypes: the model's values cast to the checkpoint's dtype where
        the shapes agree, else normal values of standard deviation :data:`INIT_SCALE`. The
        checkpoint's values are never read: a step's memory and time do not depend on them."""
        import jax

        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(key, max(len(leaves), 1))
        made = [
            leaf.astype(stored.dtype) if tuple(leaf.shape) == stored.shape
            else (INIT_SCALE * jax.random.normal(k, stored.shape)).astype(stored.dtype)
            for leaf, stored, k in zip(leaves, self.matched(params), keys, strict=False)
        ]
        return jax.tree.unflatten(treedef, made)

    def state_shardings(self, mesh: Mesh, state: PyTree, own: PyTree) -> PyTree:
        """The training state's shardings over ``mesh``: each parameter's stored sharding where
        ``mesh`` can express it (every axis it names is the mesh's, and divides its dimension),
        and the same for the optimizer-state arrays that mirror a parameter (an Adam moment: its
        path ends with the parameter's, its shape is the same); ``own`` (the workload's
        shardings) for the rest. ``state`` is ``(params, opt_state)``, abstract."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        def fits(stored: StoredParam) -> bool:
            if stored.spec is None or len(stored.spec) > len(stored.shape):
                return False
            for entry, size in zip(stored.spec, stored.shape, strict=False):
                axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
                if any(a not in mesh.shape for a in axes) or size % math.prod(mesh.shape[a] for a in axes):
                    return False
            return True

        usable = {path: stored for path, stored in self.params.items() if fits(stored)}

        def sharding(path: tuple[Any, ...], leaf: Any, mine: Any) -> Any:
            keys = key_path(path)
            for n in range(len(keys) - 1, 0, -1):  # the longest parameter path it ends with
                stored = usable.get(keys[-n:])
                if stored is not None and tuple(leaf.shape) == stored.shape:
                    return NamedSharding(mesh, P(*(tuple(e) if isinstance(e, list) else e for e in stored.spec)))
            return mine

        return jax.tree_util.tree_map_with_path(sharding, state, own)


def read_params_from(path: str) -> CheckpointParams:
    """The parameters of the Orbax checkpoint at ``path``, from its metadata (no array is
    read); a one-line :class:`SpecError` naming ``workload.params_from`` where there is none."""
    import jax
    import orbax.checkpoint as ocp

    folder = Path(path)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise SpecError(f"{WHERE}: {path!r} {what}; expected the folder of an Orbax checkpoint of the model's parameters")
    try:
        metadata = ocp.StandardCheckpointer().metadata(folder).item_metadata
    except Exception as e:  # noqa: BLE001 - whatever Orbax says of a folder it cannot read
        first = first_line(e)
        raise SpecError(f"{WHERE}: {path!r} is not a readable Orbax checkpoint ({type(e).__name__}: {first})") from None
    tree = getattr(metadata, "tree", None)
    if tree is None:
        raise SpecError(f"{WHERE}: {path!r} is not an Orbax checkpoint (no item metadata in it)")
    params: dict[tuple[str, ...], StoredParam] = {}
    for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = key_path(leaf_path)
        if getattr(leaf, "shape", None) is None or getattr(leaf, "dtype", None) is None:
            raise SpecError(f"{WHERE}: {path!r}: entry {_shown(keys)!r} is not an array ({type(leaf).__name__})")
        spec = getattr(getattr(leaf, "sharding", None), "partition_spec", None)
        params[keys] = StoredParam(tuple(leaf.shape), leaf.dtype, None if spec is None else tuple(spec))
    return CheckpointParams(str(folder), params)
