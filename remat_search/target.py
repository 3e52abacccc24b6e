"""Targets: where a plan will run, and what can be known there without running it.

``local`` is whatever devices this process sees: plans are compiled, run and timed there. A
TPU topology (``v5e:2x4``, …) is compiled ahead of time by the real TPU compiler in libtpu,
on any host: memory is exact, nothing is allocated or executed, and step time is *estimated*
from the compiled program's cost analysis against the chip's published peak FLOP/s and HBM
bandwidth (a roofline; inter-chip communication is not counted).
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from remat_search.errors import SpecError
from remat_search.spec import MESH_AXES, Target, TpuTarget


class Chip(BaseModel):
    """Published per-chip peaks, for the roofline estimate."""

    model_config = ConfigDict(frozen=True)

    name: str
    bf16_flops: float
    hbm_bytes_per_second: float


# Google Cloud's published per-chip figures (bf16 dense FLOP/s, HBM bandwidth).
CHIPS = {
    "v4": Chip(name="TPU v4", bf16_flops=275e12, hbm_bytes_per_second=1228e9),
    "v5e": Chip(name="TPU v5e", bf16_flops=197e12, hbm_bytes_per_second=819e9),
    "v5p": Chip(name="TPU v5p", bf16_flops=459e12, hbm_bytes_per_second=2765e9),
    "v6e": Chip(name="TPU v6e", bf16_flops=918e12, hbm_bytes_per_second=1640e9),
}
_OOM = re.compile(
    r"Ran out of memory.*?required for HLO temporaries \(([\d.]+)([KMGT]?)\).*?available HBM \(([\d.]+)([KMGT]?)\)",
    re.DOTALL,
)
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def chip_of(target: Target) -> Chip | None:
    """The chip of a TPU target (None for ``local``)."""
    if not isinstance(target, TpuTarget):
        return None
    generation = target.topology.split(":")[0]
    if generation not in CHIPS:
        raise SpecError(
            f"spec.target.topology: unknown TPU generation in {target.topology!r}; "
            f"expected one of {sorted(CHIPS)}, e.g. v5e:2x4"
        )
    return CHIPS[generation]


def target_devices(target: Target) -> list[Any]:
    """The devices plans are compiled for: local ones, or a TPU topology's (none allocated)."""
    import jax

    if not isinstance(target, TpuTarget):
        return list(jax.devices())
    chip_of(target)
    try:
        import libtpu  # noqa: F401 - only its presence matters here
    except ImportError:
        raise SpecError(
            "spec.target: TPU targets need the TPU compiler (libtpu); "
            "install it with: pip install 'remat-search[tpu]'"
        ) from None
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(topology_name=target.topology, platform="tpu").devices)
    except Exception as e:  # noqa: BLE001 - libtpu says what is wrong with the name
        first = str(e).strip().splitlines()[0]
        raise SpecError(f"spec.target.topology: libtpu does not know {target.topology!r} ({first})") from None


def make_mesh(devices: list[Any], axes: dict[str, int] | None) -> Any:
    """A ``Mesh`` over ``devices`` with the spec's axes (default: all on ``data``)."""
    import numpy as np
    from jax.sharding import Mesh

    axes = dict(axes) if axes else {"data": len(devices)}
    if math.prod(axes.values()) != len(devices):
        raise SpecError(
            f"spec.mesh: {axes} spans {math.prod(axes.values())} devices, the target has {len(devices)}"
        )
    names = tuple(a for a in MESH_AXES if a in axes)
    return Mesh(np.array(devices).reshape([axes[a] for a in names]), names)


def out_of_memory(error: BaseException) -> tuple[int, int] | None:
    """(required, available) bytes from the TPU compiler's out-of-memory error, else None."""
    match = _OOM.search(str(error))
    if match is None:
        return None
    return (int(float(match[1]) * _UNIT[match[2]]), int(float(match[3]) * _UNIT[match[4]]))


def probe_hbm(mesh: Any) -> int | None:
    """Usable HBM per chip as the TPU compiler reports it, from a program too big for any chip."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    too_big = jax.jit(lambda: jnp.zeros((2**38,), jnp.float32), out_shardings=NamedSharding(mesh, PartitionSpec()))
    try:
        too_big.lower().compile()
    except Exception as e:  # noqa: BLE001 - only the out-of-memory report is wanted
        oom = out_of_memory(e)
        return oom[1] if oom else None
    return None


def roofline_seconds(cost: dict[str, float], chip: Chip) -> float:
    """Lower bound of one step on ``chip``: the slower of its FLOPs and its HBM traffic."""
    return max(cost.get("flops", 0.0) / chip.bf16_flops, cost.get("bytes accessed", 0.0) / chip.hbm_bytes_per_second)
