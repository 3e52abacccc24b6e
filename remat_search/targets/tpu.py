"""A TPU topology (``v5e:2x4``, …) compiled ahead of time by the real TPU compiler in libtpu,
on any host: memory is exact (the chip's HBM read from the compiler's out-of-memory report),
nothing is allocated or executed, and a step's time is estimated
(:mod:`remat_search.targets.step_time`)."""

from __future__ import annotations

from typing import Any

from remat_search.errors import RunError, SpecError, first_line
from remat_search.spec.models import TpuTarget
from remat_search.targets.base import Target, out_of_memory
from remat_search.targets.calibration import banded_kind, load_calibration, with_band
from remat_search.targets.chips import CHIPS, PUBLISHED_BANDS, PUBLISHED_TENSOR
from remat_search.targets.mesh import make_mesh
from remat_search.targets.platform import quiet_libtpu
from remat_search.targets.step_time import UNCALIBRATED, StepEstimate, estimate_step
from remat_search.units import size_argument


class TpuAotTarget(Target):
    """A TPU topology compiled ahead of time by libtpu, from any host: nothing executes, and
    a step's time is estimated for the chip (:data:`step_time.CHIPS`)."""

    executes = False

    def __init__(self, config: TpuTarget) -> None:
        self.topology = config.topology
        generation = config.topology.split(":")[0]
        if generation not in CHIPS:
            raise SpecError(
                f"spec.target.topology: unknown TPU generation in {config.topology!r}; "
                f"expected one of {sorted(CHIPS)}, e.g. v5e:2x4"
            )
        self.chip = CHIPS[generation]
        if config.host_link is not None:
            self.chip = self.chip.model_copy(update={"host_bytes_per_second": float(config.host_link)})
        self.host_link = config.host_link
        self.generation = generation
        self.calibration = None if config.calibration is None else load_calibration(config.calibration)
        if self.calibration is not None and generation not in self.calibration.chips:
            raise SpecError(f"spec.target.calibration: {config.calibration} was fitted on "
                            f"{', '.join(self.calibration.chips)}, not {generation}; expected a calibration of this chip")
        self._keep_programs = config.keep_programs
        self._devices: list[Any] | None = None

    @property
    def keeps_programs(self) -> bool:
        return self._keep_programs

    @property
    def name(self) -> str:
        """The topology, and the host link and calibration where the spec gives them: they price
        the step, so a measurement kept for one (the cache's key) is not another's."""
        name = self.topology if self.host_link is None else f"{self.topology}, host link {size_argument(self.host_link)}/s"
        return name if self.calibration is None else f"{name}, calibration {self.calibration.name}"

    def devices(self) -> list[Any]:
        if self._devices is None:
            self._devices = _topology_devices(self.topology)
        return self._devices

    def mesh(self, axes: dict[str, int] | None) -> Any:
        return make_mesh(self.devices(), axes)  # every chip of the topology, on data by default

    def memory_limit(self, mesh: Any) -> int:
        return probe_hbm(mesh)

    def estimate(self, hlo: str, cost: dict[str, float], kind: str = "recompute",
                 mesh: dict[str, int] | None = None) -> StepEstimate:
        efficiencies = self.calibration.efficiencies if self.calibration is not None else UNCALIBRATED
        estimate = estimate_step(hlo, self.chip, cost, efficiencies)
        kind = banded_kind(kind, estimate)  # type: ignore[arg-type]
        return with_band(estimate, self.calibration, kind, PUBLISHED_BANDS.get(self.generation),
                         mesh=mesh, uncalibrated_tensor=PUBLISHED_TENSOR.get(self.generation))


def _topology_devices(topology: str) -> list[Any]:
    """A TPU topology's devices, from libtpu (none allocated)."""
    try:
        import libtpu  # noqa: F401 - only its presence matters here
    except ImportError:
        raise SpecError(
            "spec.target: TPU targets need the TPU compiler (libtpu); "
            "install it with: pip install 'remat-search[tpu]'"
        ) from None
    from jax.experimental import topologies

    try:
        with quiet_libtpu():
            return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    except Exception as e:  # noqa: BLE001 - libtpu says what is wrong with the name
        first = str(e).strip().splitlines()[0]
        raise SpecError(f"spec.target.topology: libtpu does not know {topology!r} ({first})") from None


def probe_hbm(mesh: Any) -> int:
    """Usable HBM per chip as the TPU compiler reports it, from a program too big for any chip
    (see :func:`hbm_of`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    too_big = jax.jit(lambda: jnp.zeros((2**38,), jnp.float32), out_shardings=NamedSharding(mesh, PartitionSpec()))
    try:
        too_big.lower().compile()
    except Exception as e:  # noqa: BLE001 - judged by hbm_of: all but the out-of-memory report raise
        return hbm_of(e)
    return hbm_of(None)


def hbm_of(error: BaseException | None) -> int:
    """The HBM per chip that the compiler's out-of-memory ``error`` states it had. Any other
    error, or none (the program compiled), raises :class:`RunError` with the reason: a memory
    limit that cannot be read is no budget to search under."""
    oom = out_of_memory(error) if error is not None else None
    if oom is not None:
        return oom.available
    if error is None:
        reason = "a program of 1 TiB a chip compiled without running out of memory"
    else:
        reason = f"{type(error).__name__}: {first_line(error)}"
    raise RunError(f"target: the compiler did not state the memory of a chip ({reason})") from error
