"""The chips the step-time model prices programs for: their published peaks.

A chip's figures are the datasheet's (bf16 FLOP/s, HBM, inter-chip and host-link bandwidths,
the matrix unit's side) and one fact of how its compiler schedules an offload's transfers
(:attr:`Chip.host_overlap`). What a chip reaches of them is measured, not assumed: a
calibration (:mod:`remat_search.targets.calibration`) fits the fractions.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

PCIE_GEN5_X16 = 64e9
"""A PCIe Gen5 x16 link, one way: 128 GB/s counted both ways, as NVIDIA's datasheets count it."""


class Chip(BaseModel):
    """Published per-chip peaks, for the step-time model."""

    model_config = ConfigDict(frozen=True)

    name: str
    bf16_flops: float
    hbm_bytes_per_second: float
    ici_bytes_per_second: float | None = None
    """What one chip's links carry in one direction (half the published bidirectional
    per-chip ICI bandwidth); None where Google Cloud publishes no per-chip figure."""
    ici_links: int = 1
    """The chip's inter-chip links, over which :attr:`ici_bytes_per_second` is spread: 4 on a 2D
    torus (v5e, v6e), 6 on a 3D one (v4, v5p). A ring collective over a group receives over
    them all (the model's assumption); a ``collective-permute``, each chip sending to one
    neighbour, over one."""
    host_bytes_per_second: float | None = None
    """What the chip's link to its host's memory carries in one direction: the price of
    moving an offloaded tensor to pinned host memory or back. None: not priced."""
    mxu: int | None = None
    """The side of the chip's matrix unit, a square systolic array: matmuls are priced padded to
    its tiles (:mod:`~remat_search.targets.mxu`). None: not padded."""
    host_overlap: float = 1.0
    """How much of the computation scheduled between a host transfer's start and its done runs
    beside the transfer: 1 where transfers run on their own engine (a TPU's DMA: the model's
    assumption, until a calibration measures it), 0 where they queue behind the computation
    (XLA:GPU: one stream carries the kernels and the copies; docs/step_time.md shows the trace)."""
    hbm_ceiling: float = 1.0
    """The most of :attr:`hbm_bytes_per_second` a calibration may fit: the datasheet's (1) where
    every byte the model counts crosses HBM (a TPU: the buffers its compiler keeps on the chip, in
    VMEM, are marked and left out); 2 on a GPU, whose L2 cache serves bytes a program reads again
    that the HLO counts as HBM traffic."""
    host_link_ceiling: float = PCIE_GEN5_X16
    """The most a calibration may fit for the host link, in bytes per second one way: a PCIe Gen5
    x16 link's (:data:`PCIE_GEN5_X16`), the widest a chip's host link is."""


TPU_HOST_BYTES_PER_SECOND = 1.5e10
"""A TPU chip's host link (PCIe), one direction. Google Cloud publishes no per-chip figure;
this is the one "How to Scale Your Model" (jax-ml.github.io/scaling-book, part 2, "TPUs")
works with, used for every generation. An assumption, stated where estimates are shown."""

# Google Cloud's published per-chip figures (bf16 dense FLOP/s, HBM bandwidth, bidirectional
# ICI bandwidth per chip halved): cloud.google.com/tpu/docs/v5e, /v5p, /v6e. The v4 page
# gives no per-chip ICI bandwidth. The host link: TPU_HOST_BYTES_PER_SECOND. The MXU's side:
# 128 up to v5p, 256 on v6e (:mod:`remat_search.targets.mxu`).
CHIPS = {
    "v4": Chip(name="TPU v4", bf16_flops=275e12, hbm_bytes_per_second=1228e9, ici_links=6,
               host_bytes_per_second=TPU_HOST_BYTES_PER_SECOND, mxu=128),
    "v5e": Chip(name="TPU v5e", bf16_flops=197e12, hbm_bytes_per_second=819e9, ici_bytes_per_second=200e9, ici_links=4,
                host_bytes_per_second=TPU_HOST_BYTES_PER_SECOND, mxu=128),
    "v5p": Chip(name="TPU v5p", bf16_flops=459e12, hbm_bytes_per_second=2765e9, ici_bytes_per_second=600e9, ici_links=6,
                host_bytes_per_second=TPU_HOST_BYTES_PER_SECOND, mxu=128),
    "v6e": Chip(name="TPU v6e", bf16_flops=918e12, hbm_bytes_per_second=1640e9, ici_bytes_per_second=400e9, ici_links=4,
                host_bytes_per_second=TPU_HOST_BYTES_PER_SECOND, mxu=256),
}

# NVIDIA's published per-GPU figures for the SXM parts (dense bf16 Tensor Core FLOP/s: the
# datasheets' 1,979 TFLOP/s is with 2:4 sparsity, half of it dense; HBM bandwidth), from the
# H100 datasheet (nvidia.com/en-us/data-center/h100/) and the H200's
# (nvidia.com/en-us/data-center/h200/). NVLink is not inter-chip ICI: left None, so a GPU
# estimate prices no collectives. Not in CHIPS, whose keys are TPU topology generations.
# The host link: PCIe Gen5 x16, the datasheets' 128 GB/s counted both ways, 64 GB/s one way.
# XLA:GPU runs an offload's copies on the stream of the step's kernels: no overlap (host_overlap 0).
GPUS = {
    "h100": Chip(name="NVIDIA H100 SXM", bf16_flops=989e12, hbm_bytes_per_second=3.35e12,
                 host_bytes_per_second=PCIE_GEN5_X16, host_overlap=0.0, hbm_ceiling=2.0),
    "h200": Chip(name="NVIDIA H200 SXM", bf16_flops=989e12, hbm_bytes_per_second=4.8e12,
                 host_bytes_per_second=PCIE_GEN5_X16, host_overlap=0.0, hbm_ceiling=2.0),
}


_TPU_KINDS = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5p": "v5p", "tpu v5": "v5p",
              "tpu v6 lite": "v6e", "tpu v6e": "v6e"}


def chip_key(device_kind: str) -> str | None:
    """The key in :data:`CHIPS` or :data:`GPUS` of a JAX device's ``device_kind`` (``"TPU v5
    lite"`` → ``v5e``, ``"NVIDIA H100 80GB HBM3"`` → ``h100``), or None for a device not listed."""
    kind = device_kind.strip().lower()
    if kind in _TPU_KINDS:
        return _TPU_KINDS[kind]
    return next((w for w in re.findall(r"[a-z0-9]+", kind) if w in GPUS), None)


def gpu_chip(device_kind: str) -> Chip | None:
    """The :data:`GPUS` entry of a JAX GPU's ``device_kind`` (``"NVIDIA H100 80GB HBM3"`` →
    H100), or None for a GPU not listed there."""
    words = re.findall(r"[a-z0-9]+", device_kind.lower())
    return next((GPUS[w] for w in words if w in GPUS), None)



PUBLISHED_BANDS: dict[str, tuple[float, float]] = {
    "v5e": (0.955, 1.405),
    "v5p": (1.145, 1.216),
    "v6e": (0.624, 1.668),
}
"""The uncalibrated model's error on each TPU generation: the 95% prediction band
(``calibration.prediction_band``, counted by model family) of MaxText's published step / the
model's estimate of the published configuration, over the published runs of that generation
(benchmarks/results/published_configs.md: three on v5e, three on v5p, thirteen of five models on
v6e; tests/targets/test_calibration.py checks these against the page). A generation without
published runs has no band: its error is unknown."""

PUBLISHED_TENSOR: dict[str, int] = {"v5e": 1, "v5p": 8, "v6e": 1}
"""The widest tensor axis of those published runs, by generation (v5p-128b's ``tensor=8``; the
v5e and v6e runs shard by FSDP alone): an uncalibrated estimate over a wider one is outside them."""
