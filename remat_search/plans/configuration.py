"""A training configuration: what a team sets beside the remat plan, and a study may search.

A :class:`Configuration` is the per-device batch a step runs at once (the micro-batch), how
many micro-batches a step accumulates gradients over, and the device mesh. It rides on a
:class:`~remat_search.plans.plan.RematPlan` (:attr:`RematPlan.configuration`), so that a
candidate — plan and configuration — is one piece of data with one digest, and ``best``
answers with the whole of it. A plan without one runs at the spec's own batch and mesh, as
every study before configurations did.
"""

from __future__ import annotations

import json
import math

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

Setting = bool | int | float | str
"""A value of a workload's own setting (a MaxText config key's)."""
BATCH_AXES = ("data", "fsdp", "fsdp_transpose", "expert")
"""The mesh axes a step's batch is split over: MaxText's (its ``activation_batch`` rule), and
the built-in workloads' (``workloads.sharding.split_batch_over``), where a mesh has them."""


class Configuration(BaseModel):
    """Per-device micro-batch, gradient accumulation and mesh of one candidate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch: PositiveInt
    """Examples each data-parallel device runs in one micro-step (MaxText's ``per_device_batch_size``)."""
    accumulation: PositiveInt = 1
    """Micro-steps a step accumulates gradients over before the optimizer updates once."""
    mesh: tuple[tuple[str, PositiveInt], ...] = Field(default=())
    """``(axis, size)`` pairs (``()``: one device, no mesh), in the order written."""
    sequence: PositiveInt = 1
    """Tokens each example holds (the workload's ``seq_len``; 1 where it has none, so that
    throughput counts examples)."""
    settings: tuple[tuple[str, Setting], ...] = ()
    """The workload's own settings this candidate sets beside remat, ``(key, value)`` in the
    spec's order: MaxText's memory knobs (``optimizer_memory_host_offload: true``). Left out of
    the plan's text where there are none (``RematPlan.to_json``), so digests stay as they were."""

    @field_validator("mesh", mode="before")
    @classmethod
    def _pairs(cls, value: object) -> object:
        """A mesh may be given as a mapping (``{data: 2, fsdp: 2}``)."""
        return tuple(value.items()) if isinstance(value, dict) else value

    @field_validator("settings", mode="before")
    @classmethod
    def _setting_pairs(cls, value: object) -> object:
        """Settings may be given as a mapping (``{optimizer_memory_host_offload: true}``)."""
        return tuple(value.items()) if isinstance(value, dict) else value

    @property
    def mesh_axes(self) -> dict[str, int] | None:
        """The mesh as the spec's ``mesh`` field writes it (None: no mesh)."""
        return dict(self.mesh) or None

    @property
    def data_parallel(self) -> int:
        """How many ways the batch is split: the product of the mesh's batch axes."""
        return math.prod(size for axis, size in self.mesh if axis in BATCH_AXES)

    @property
    def global_batch(self) -> int:
        """Examples one optimizer step trains on, over every device."""
        return self.batch * self.accumulation * self.data_parallel

    @property
    def devices(self) -> int:
        """How many devices the mesh spans."""
        return math.prod(size for _, size in self.mesh)

    @property
    def tokens_per_device(self) -> float:
        """Tokens one step trains on, per device: what throughput is counted in."""
        return self.global_batch * self.sequence / self.devices

    def summary(self) -> str:
        """A short human form: ``batch 4×2 · data=2,fsdp=2`` (micro-batch × accumulation)."""
        batch = f"batch {self.batch}" + (f"×{self.accumulation}" if self.accumulation > 1 else "")
        mesh = ",".join(f"{axis}={size}" for axis, size in self.mesh) or "1 device"
        settings = "".join(f" · {key}={json.dumps(value)}" for key, value in self.settings)
        return f"{batch} · {mesh}{settings}"


def cost(seconds: float, configuration: Configuration | None) -> float:
    """What candidates are ranked by, and a trial's first objective: the step's ``seconds``,
    per token each device trains on where the candidate has a ``configuration`` (the inverse
    of its throughput, so that the fastest is still the least)."""
    return seconds if configuration is None else seconds / configuration.tokens_per_device
