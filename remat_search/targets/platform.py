"""Platforms by name: what each compiler platform (``cpu``, ``gpu``, ``tpu``, as
``jax.Device.platform`` names it) offers and how plans are compiled for it.

The one place that tells platforms apart by their names: the spec (attention ``auto``), the
workloads (the Pallas TPU kernel), the measurements (which memory figure is the peak), the
search (host offload) and the doctor ask these functions, not the strings. It imports nothing,
so every layer may ask it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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
    and keeps more of what remat would free alive); none elsewhere. A training script that compiles its
    step with them (``lowered.compile(compiler_options=...)``) gets the memory the study
    measured for its plan, to the byte."""
    return dict(CPU_COMPILER_OPTIONS) if is_cpu(platform) else {}


MANTISSA_BITS = {"f64": 52, "float64": 52, "f32": 23, "float32": 23, "tf32": 10, "f16": 10, "float16": 10,
                 "bf16": 7, "bfloat16": 7, "f8E4M3FN": 3, "f8E4M3": 3, "float8_e4m3fn": 3, "f8E5M2": 2, "float8_e5m2": 2}
"""Stored mantissa bits of the floating types a matmul's operands may have, by StableHLO's and NumPy's names."""


def unit_roundoff(dtype: str, precision: str, platform: str) -> float:
    """The unit roundoff (half the gap between 1 and the next number) of a matmul of ``dtype``
    operands at ``precision`` (StableHLO's ``DEFAULT``, ``HIGH``, ``HIGHEST``) as ``platform``
    computes it: float32 at ``DEFAULT`` runs one bfloat16 pass on a TPU and TF32 on a GPU's tensor
    cores (XLA's defaults), ``HIGH`` three bfloat16 passes on a TPU (about 16 bits); otherwise the
    dtype's own. An unknown dtype reads as float32."""
    bits = MANTISSA_BITS.get(dtype, 23)
    if bits == 23 and precision == "DEFAULT" and (is_tpu(platform) or is_gpu(platform)):
        bits = 7 if is_tpu(platform) else 10
    elif bits == 23 and precision == "HIGH" and is_tpu(platform):
        bits = 16
    return 2.0 ** -(bits + 1)


def compiler_package_names(platform: str) -> tuple[str, ...]:
    """The packages whose versions say what compiles plans for ``platform``: jaxlib (XLA, whose
    CPU compiler it carries), libtpu for TPU, the CUDA plugins for GPU."""
    return ("jaxlib", *(("libtpu",) if is_tpu(platform) else CUDA_PLUGINS if is_gpu(platform) else ()))


QUIET_LIBTPU = {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost"}
"""What libtpu is told while it loads on a host without TPUs (where these are unset)."""


@contextlib.contextmanager
def quiet_libtpu() -> Iterator[None]:
    """Within it, libtpu loads without its warnings on a host with no TPU.

    libtpu, loaded where no TPU is, asks the cloud's metadata for one and warns in five lines
    (TPU_ACCELERATOR_TYPE, TPU_WORKER_HOSTNAMES). Told it is a host of some TPU kind while it
    loads (:data:`QUIET_LIBTPU`, where those are unset), it says nothing; the kind decides nothing
    of what it compiles (the same optimized HLO for v4, v5e, v5p and v6e topologies, told
    v5litepod-4 or not)."""
    quiet = QUIET_LIBTPU if tpu_chips_attached() == 0 else {}
    before = {name: os.environ.get(name) for name in quiet}
    os.environ.update({name: value for name, value in quiet.items() if before[name] is None})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)


def tpu_chips_attached() -> int | None:
    """How many TPU chips this host has, by JAX's own PCI check (None where that check moved
    in another JAX): none, and libtpu only compiles here."""
    try:
        from jax._src.hardware_utils import num_available_tpu_chips_and_device_id
    except ImportError:
        return None
    return num_available_tpu_chips_and_device_id()[0]
