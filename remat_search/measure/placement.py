"""Arrays between the host and the devices of one worker, or of every process of a slice:
placing inputs over shardings, gathering values to the host, and stepping in lockstep.

On one host these are ``jax.device_put`` and ``jax.device_get``; on a slice (several processes
as one program) each process places its own devices' shards and gathers from all, and every
process calls them at once (they are collectives)."""

from __future__ import annotations

from typing import Any

import numpy as np


def placed(tree: Any, shardings: Any) -> Any:
    """``tree`` over ``shardings``. On a slice each process places its own devices' shards,
    cut from the same values (every process made them from the same seed): ``device_put``
    cannot reach another host's devices."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    host = jax.device_get(tree)
    return jax.tree.map(
        lambda x, sharding: jax.make_array_from_callback(np.shape(x), sharding, lambda index: np.asarray(x)[index]),
        host, shardings,
    )


def on_host(tree: Any) -> Any:
    """``tree``'s values on this host, in full: on a slice gathered from every process (a
    collective: every process asks at once)."""
    import jax

    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def in_step(label: str) -> None:
    """On a slice, wait until every process is here (a barrier over the devices): each
    process's timed steps then start together. Nothing on one host."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(label)
