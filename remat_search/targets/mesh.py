"""The device mesh plans are sharded over: its axes in order, and the devices placed over them
as ``jax.make_mesh`` places them (over a TPU topology's links)."""

from __future__ import annotations

import math
from typing import Any

from remat_search.errors import SpecError
from remat_search.spec.workloads import MESH_AXES


def make_mesh(devices: list[Any], axes: dict[str, int] | None) -> Any:
    """A ``Mesh`` over ``devices`` with the spec's axes (default: all on ``data``).

    The axes are laid out in :func:`mesh_axis_order`; the devices are placed over them as
    ``jax.make_mesh`` (``mesh_utils.create_device_mesh``) places them, which follows a TPU
    topology's physical links (``v5e:2x2`` as ``[0, 1, 3, 2]``), as MaxText and a training
    script using ``jax.make_mesh`` do: the same program over another order needs other
    collectives, and other memory. Local CPU devices stay in their own order. The axes are
    left ``Auto``, as ``Mesh(devices, names)`` makes them (``jax.make_mesh`` would make them
    ``Explicit``, another way of tracing). Where ``jax.make_mesh`` cannot place them (a
    ``v4`` topology's two cores a chip), they stay in id order, and :func:`device_order` says so."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    axes = dict(axes) if axes else {"data": len(devices)}
    if math.prod(axes.values()) != len(devices):
        raise SpecError(
            f"spec.mesh: {axes} spans {math.prod(axes.values())} devices, the target has {len(devices)}"
        )
    names = mesh_axis_order(axes)
    shape = tuple(axes[a] for a in names)
    try:
        placed = jax.make_mesh(shape, names, devices=devices).devices
    except (AssertionError, ValueError, NotImplementedError):  # mesh_utils' ways of saying it cannot
        placed = np.array(devices).reshape(shape)
    return Mesh(placed, names)


def mesh_axis_order(axes: dict[str, int]) -> tuple[str, ...]:
    """The order a mesh lays ``axes`` out in: the built-in ones (:data:`~remat_search.spec.models.MESH_AXES`)
    first, in that order, then the others as written."""
    return tuple(a for a in MESH_AXES if a in axes) + tuple(a for a in axes if a not in MESH_AXES)


def device_order(mesh: Any) -> list[int] | None:
    """The ids of ``mesh``'s devices in its row-major order, where that is not the devices' own
    order (ids ascending, as a flat reshape would keep them); None where it is, or no mesh."""
    if mesh is None:
        return None
    ids = [int(d.id) for d in mesh.devices.flat]
    return None if ids == sorted(ids) else ids
