"""The local target: whatever devices this process sees; plans are compiled, run and timed there."""

from __future__ import annotations

from typing import Any

from remat_search.spec.models import TargetConfig
from remat_search.targets.base import Target
from remat_search.targets.mesh import make_mesh


class LocalTarget(Target):
    """The devices this process sees: plans are compiled, run and timed on them."""

    executes = True

    def __init__(self, config: TargetConfig = "local") -> None:
        pass

    @property
    def name(self) -> str:
        return "local"

    def devices(self) -> list[Any]:
        import jax

        return list(jax.devices())

    def mesh(self, axes: dict[str, int] | None) -> Any:
        return make_mesh(self.devices(), axes) if axes else None

    def memory_limit(self, mesh: Any) -> int | None:
        """A GPU's or TPU's usable memory from its runtime (``bytes_limit``); None on CPU."""
        device = self.devices()[0]
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - not every backend implements it
            return None
        return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
