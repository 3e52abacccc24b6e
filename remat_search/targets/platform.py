"""Platforms by name: what each compiler platform (``cpu``, ``gpu``, ``tpu``, as
``jax.Device.platform`` names it) offers and how plans are compiled for it.

The one place that tells platforms apart by their names: the spec (attention ``auto``), the
workloads (the Pallas TPU kernel), the measurements (which memory figure is the peak), the
search (host offload) and the doctor ask these functions, not the strings. It imports nothing,
so every layer may ask it.
"""

from __future__ import annotations

from typing import Literal, get_args

Platform = Literal["cpu", "gpu", "tpu"]
"""The platforms a plan is compiled for."""
PLATFORMS: tuple[str, ...] = get_args(Platform)

CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
"""On CPU the default (concurrency-optimised) scheduler hides what remat saves."""

CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
"""The packages that compile and run plans on NVIDIA GPUs (XLA:GPU and its PJRT plugin)."""


def is_cpu(platform: str) -> bool:
    """Whether ``platform`` is the host's CPU (no accelerator)."""
    return platform == "cpu"


def is_gpu(platform: str) -> bool:
    """Whether ``platform`` is a GPU's (XLA:GPU)."""
    return platform == "gpu"


def is_tpu(platform: str) -> bool:
    """Whether ``platform`` is a TPU's (libtpu's compiler: its Pallas kernels, its peak rule)."""
    return platform == "tpu"


def offloads_to_host(platform: str) -> bool:
    """Whether tensors can be offloaded from ``platform``'s device memory to host memory (a GPU
    or TPU; on a CPU the device memory is the host's)."""
    return not is_cpu(platform)


def reports_compiler_peak(platform: str) -> bool:
    """Whether the compiler's ``peak_memory_in_bytes`` means something on ``platform`` (on CPU
    it is a constant)."""
    return not is_cpu(platform)


def compiler_options(platform: str) -> dict[str, str]:
    """The compiler options remat-search compiles plans for ``platform`` (``cpu``, ``gpu``,
    ``tpu``: ``jax.default_backend()``) with: on CPU the memory-optimised scheduler, which is
    what shows remat's savings there (XLA's default CPU scheduler orders work for concurrency
    and keeps what remat would free alive); none elsewhere. A training script that compiles its
    step with them (``lowered.compile(compiler_options=...)``) gets the memory the study
    measured for its plan, to the byte."""
    return dict(CPU_COMPILER_OPTIONS) if is_cpu(platform) else {}


def compiler_package_names(platform: str) -> tuple[str, ...]:
    """The packages whose versions say what compiles plans for ``platform``: jaxlib (XLA, whose
    CPU compiler it carries), libtpu for TPU, the CUDA plugins for GPU."""
    return ("jaxlib", *(("libtpu",) if is_tpu(platform) else CUDA_PLUGINS if is_gpu(platform) else ()))
