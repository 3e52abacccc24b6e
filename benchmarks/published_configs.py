"""MaxText's published TPU runs, rebuilt on MaxText's own program (``workload: {kind: maxtext}``):
the step-time model's fidelity and the search's answers.

One command, from any machine with MaxText and libtpu (``pip install -e '.[maxtext,plot]'``):

    python benchmarks/published_configs.py                        # every run in RUNS
    python benchmarks/published_configs.py --runs v5p-32b --trials 3   # one, quickly
    python benchmarks/published_configs.py --report               # the page again from the kept studies

Each published run (:data:`RUNS`: MaxText's settings at the commit named, and the figure MaxText
published for them) is one study on the run's TPU slice, compiled ahead of time by MaxText's own
functions (``workloads/maxtext.py``), with the XLA flags the run's script set
(``LIBTPU_INIT_ARGS``) and MaxText's own ``compile_xla_flags``:

* **fidelity**: the published configuration is the study's first candidate (its settings are
  the reference configuration and its policy the first choice); its step time is estimated
  (``targets.step_time``) and set against the published step (as logged, or as the published
  TFLOP/s imply under the FLOP count MaxText used then: :func:`published_tflops`);
* **quality**: the study searches the configuration space at the same chips, global batch and
  HBM (``budget: device``): per-device batch and accumulation, the mesh (the published one and
  one other, a tensor axis among them for the v5p runs), and one remat policy for every layer
  (MaxText's form) among the run's choices; the answer is the highest estimated throughput that
  fits, set against the published configuration's own estimate.

The 2023 runs (v5e, v5p) trained MaxText's model of 2023 (its ``base.yml`` then: the parallel
decoder block, ReLU MLP, 8 heads of 256, tied embedding), which MaxText 0.2.5 still builds
(``decoder_block: default`` with those dimensions: :data:`MODEL_2023`); the v6e runs name MaxText
models. What differs from the runs: this machine's libtpu and MaxText 0.2.5, not the commit's.
Writes ``benchmarks/results/published_configs.md`` (and its picture, ``published_configs.png``) and keeps the studies in
``benchmarks/results/studies/published_maxtext.db``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

import remat_search
from remat_search.measure.measurement import judge
from remat_search.plans.configuration import BATCH_AXES
from remat_search.report.results import StudyReport, TrialResult, rank
from remat_search.spec.loading import parse_spec
from remat_search.targets.chips import CHIPS, PUBLISHED_BANDS
from remat_search.units import format_bytes

HERE = Path(__file__).resolve().parent
DB = HERE / "results" / "studies" / "published_maxtext.db"
PAGE = HERE / "results" / "published_configs.md"
QKV = ["query_proj", "key_proj", "value_proj"]

MODEL_2023 = {
    "decoder_block": "default", "base_emb_dim": 2560, "base_num_query_heads": 8, "base_num_kv_heads": 8,
    "base_mlp_dim": 8192, "base_num_decoder_layers": 16, "head_dim": 256, "mlp_activations": ["relu"],
    "logits_via_embedding": True, "vocab_size": 32768,
}
"""MaxText's ``base.yml`` of 2023 (commits 9bc243c9 and 76bd53b0f), scaled by each run's
``global_parameter_scale``, as MaxText 0.2.5 states it."""
SYNTHETIC = {"dataset_type": "synthetic", "enable_checkpointing": False, "use_iota_embed": True, "attention": "flash"}

V5E_FLAGS = ("--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true "
             "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
             "--xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true "
             "--xla_enable_async_all_gather=true")
V5P_FLAGS = ("--xla_tpu_megacore_fusion_allow_ags=false --xla_enable_async_collective_permute=true "
             "--xla_tpu_enable_ag_backward_pipelining=true " + V5E_FLAGS.replace(
                 " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true", ""))
# The v6e recipes' LIBTPU_INIT_ARGS, from the groups of MaxText's benchmarks/xla_flags_library.py at
# each recipe's commit. One flag of those groups is left out: ``--2a886c8_chip_config_name``, which the
# public libtpu does not know (MaxText's own Pathways runs remove it too).
DATA_PARALLEL_OVERLAP = "--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true"
CF_FOR_ALL_GATHER = (
    "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true "
    "--xla_enable_async_all_gather=true")
DENSE_VMEM_LIMIT = "--xla_tpu_scoped_vmem_limit_kib=98304"
LAYOUT_FOR_ALL_REDUCE_SCATTER = (
    "--xla_tpu_use_minor_sharding_for_major_trivial_input=true --xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 "
    "--xla_tpu_assign_all_reduce_scatter_layout=true")
SPARSECORE_ALL_REDUCE = (
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false --xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
    "--xla_tpu_enable_all_reduce_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=true "
    "--xla_sc_enable_instruction_fusion=false --xla_sc_disjoint_spmem=false --xla_sc_disable_megacore_partitioning=true")
HOST_OFFLOAD = (
    "--xla_tpu_enable_all_experimental_scheduler_features=true --xla_tpu_enable_scheduler_memory_pressure_tracking=true "
    "--xla_tpu_host_transfer_overlap_limit=24 --xla_tpu_aggressive_opt_barrier_removal=ENABLED "
    "--xla_lhs_prioritize_async_depth_over_stall=ENABLED --xla_tpu_enable_ag_backward_pipelining=true "
    "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED --xla_should_add_loop_invariant_op_in_chain=ENABLED "
    "--xla_max_concurrent_host_send_recv=100 --xla_tpu_scheduler_percent_shared_memory_limit=100 "
    "--xla_latency_hiding_scheduler_rerun=2")
V6E_8B_FLAGS = " ".join([DENSE_VMEM_LIMIT, LAYOUT_FOR_ALL_REDUCE_SCATTER, DATA_PARALLEL_OVERLAP, SPARSECORE_ALL_REDUCE,
                         HOST_OFFLOAD])
V6E_70B_FLAGS = " ".join([DENSE_VMEM_LIMIT, SPARSECORE_ALL_REDUCE])
DISABLE_COLLECTIVE_MATMUL = "--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000"
V6E_8B_NO_CM_FLAGS = f"{V6E_8B_FLAGS} {DISABLE_COLLECTIVE_MATMUL}"
V6E_LLAMA31_70B_FLAGS = " ".join([DENSE_VMEM_LIMIT, LAYOUT_FOR_ALL_REDUCE_SCATTER, DATA_PARALLEL_OVERLAP, HOST_OFFLOAD])
V6E_GPT3_FLAGS = " ".join([DENSE_VMEM_LIMIT, DATA_PARALLEL_OVERLAP, "--xla_tpu_use_bundle_aware_cost_model_for_fusions=false"])
"""The v6e recipes' flags but :data:`CF_FOR_ALL_GATHER`: libtpu 0.0.50 refuses its continuation fusion
for all-gathers on a v6e ("not supported/recommended on platforms other than TPU v5e"), which 0.0.42
compiled."""

FULL, MINIMAL = "full", {"label": "minimal", "names": [*QKV, "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo"]}
SAVE_QKV = {"label": "save_qkv_proj", "names": QKV}
QKV_OFFLOADED = {"label": "qkv_proj_offloaded", "offload": QKV}
OFFLOAD_QKVO = {"label": "custom_offload", "offload": ["decoder_layer_input", *QKV, "out_proj"]}
OFFLOAD_INPUT = {"label": "offload_input", "offload": ["decoder_layer_input"]}
OFFLOAD_INPUT_QKV = {"label": "offload_input_qkv", "offload": ["decoder_layer_input", *QKV]}
SPLASH_2048 = {**{f"sa_block_{b}": 2048 for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq", "kv_dq")},
               "sa_use_fused_bwd_kernel": True}
"""The splash-attention blocks of the v6e recipes of Llama 3.1 and Mistral (2048 throughout, fused backward)."""
SPLASH_2048_UNFUSED = {k: v for k, v in SPLASH_2048.items() if k != "sa_use_fused_bwd_kernel"}
"""The splash-attention blocks of the v5p recipe of Llama 3.1 405B (2048 throughout, MaxText's unfused backward)."""
OFFLOAD_CONTEXT_MLPWO = {"label": "offload_context_mlpwo", "offload": ["context", "mlpwo"]}
V5P_405B_FLAGS = " ".join([DENSE_VMEM_LIMIT, CF_FOR_ALL_GATHER.replace("--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true ", ""),
                           HOST_OFFLOAD])
"""The v5p recipe's LIBTPU_INIT_ARGS (MaxText's DENSE_VMEM_LIMIT_FLAG, CF_FOR_ALL_GATHER and HOST_OFFLOAD_FLAGS) but
the all-gather continuation fusion, which libtpu 0.0.50 refuses on a v5p as on a v6e."""
RECIPES = "AI-Hypercomputer/tpu-recipes (c8cfe2f): training/trillium/"


@dataclass(frozen=True)
class Run:
    """One published MaxText run: its settings, slice and figure."""

    name: str
    topology: str
    model: dict[str, Any]
    """MaxText settings of the model (``model_name`` or dimensions, ``global_parameter_scale``)."""
    per_device_batch: int
    seq: int
    mesh: dict[str, int]
    """The published mesh, as ``ici_*`` settings (``-1`` resolved)."""
    choices: list[Any]
    """The published policy first, then the others the study tries."""
    published: str
    source: str
    flags: str
    step_seconds: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    """The MFU printed beside :attr:`tflops`, to 4 figures where the TFLOP/s have 3: the step is
    read from it (MaxText's count over the MFU times the chip's peak)."""
    convention: str = ""
    """MaxText's FLOP count the TFLOP/s were made with: ``6N`` (2023: 6 · parameters · tokens +
    attention whole), ``6N-causal`` (Dec 2023: attention halved)."""
    meshes: list[dict[str, int]] = field(default_factory=list)
    """Other meshes the study tries."""
    settings: dict[str, list[Any]] = field(default_factory=dict)
    """MaxText memory knobs the study tries (``configuration.settings``)."""
    trials: int = 5

    @property
    def chips(self) -> int:
        return eval("*".join(self.topology.split(":")[1].split("x")))  # noqa: S307 - digits and x only

    @property
    def chip(self) -> str:
        return self.topology.split(":")[0]

    @property
    def family(self) -> str:
        """The model it trains, whatever its chips (a calibration's leave-one-family-out leaves
        its runs out together): ``llama3.1-70b``; MaxText's 2023 model by its size, ``2023-32b``."""
        return family(self.name)


def family(name: str) -> str:
    """The model of the run named ``name`` (:attr:`Run.family`)."""
    model = name.split("-", 1)[1]
    return re.sub(r"-x\d+$", "", model) if not re.fullmatch(r"\d+b", model) else f"2023-{model}"


def gps(scale: int) -> dict[str, Any]:
    return {**MODEL_2023, "global_parameter_scale": scale}


RUNS = [
    Run("v5e-16b", "v5e:16x16", gps(16), 6, 2048, {"fsdp": 256}, [FULL, MINIMAL, SAVE_QKV, QKV_OFFLOADED],
        "120 TFLOP/s per chip, 61.10% MFU", "MaxText 9bc243c9: README.md (1x v5e-256), MaxText/configs/largest_job/16b.sh",
        V5E_FLAGS, tflops=120.0, mfu=0.6110, convention="6N", meshes=[{"data": 2, "fsdp": 128}]),
    Run("v5e-32b", "v5e:16x16", gps(32), 4, 2048, {"fsdp": 256}, [FULL, MINIMAL, SAVE_QKV, QKV_OFFLOADED],
        "132 TFLOP/s per chip, 66.86% MFU", "MaxText 9bc243c9: README.md, MaxText/configs/largest_job/32b.sh",
        V5E_FLAGS, tflops=132.0, mfu=0.6686, convention="6N", meshes=[{"data": 2, "fsdp": 128}]),
    Run("v5e-64b", "v5e:16x16", gps(64), 2, 2048, {"fsdp": 256}, [FULL, MINIMAL, SAVE_QKV, QKV_OFFLOADED],
        "118 TFLOP/s per chip, 59.90% MFU", "MaxText 9bc243c9: README.md, MaxText/configs/largest_job/64b.sh",
        V5E_FLAGS, tflops=118.0, mfu=0.5990, convention="6N", meshes=[{"data": 2, "fsdp": 128}]),
    Run("v5p-32b", "v5p:4x4x4", gps(32), 8, 2048, {"fsdp": 16, "tensor": 4}, [MINIMAL, FULL, SAVE_QKV, QKV_OFFLOADED],
        "328 TFLOP/s per chip, 71.47% MFU", "MaxText 76bd53b0f: MaxText/configs/v5p/README.md (1x v5p-128), v5p/32b.sh",
        V5P_FLAGS, tflops=328.0, mfu=0.7147, convention="6N-causal", meshes=[{"fsdp": 64}]),
    Run("v5p-64b", "v5p:4x4x4", gps(64), 4, 2048, {"fsdp": 16, "tensor": 4}, [MINIMAL, FULL, SAVE_QKV, QKV_OFFLOADED],
        "323 TFLOP/s per chip, 70.31% MFU", "MaxText 76bd53b0f: MaxText/configs/v5p/README.md (1x v5p-128), v5p/64b.sh",
        V5P_FLAGS, tflops=323.0, mfu=0.7031, convention="6N-causal", meshes=[{"fsdp": 64}]),
    Run("v5p-128b", "v5p:4x4x8", gps(128), 2, 2048, {"fsdp": 16, "tensor": 8}, [MINIMAL, FULL, SAVE_QKV, QKV_OFFLOADED],
        "315 TFLOP/s per chip, 68.68% MFU", "MaxText 76bd53b0f: MaxText/configs/v5p/README.md (1x v5p-256), v5p/128b.sh",
        V5P_FLAGS, tflops=315.0, mfu=0.6868, convention="6N-causal", meshes=[{"fsdp": 32, "tensor": 4}]),
    Run("v6e-llama3.1-8b", "v6e:16x16", {"model_name": "llama3.1-8b", **SPLASH_2048},
        4, 8192, {"fsdp": 256}, [OFFLOAD_QKVO, OFFLOAD_INPUT],
        "4.546 s a step, 7,207 tokens/s per chip", "MaxText tpu-recipes-v0.1.4 (9f1820b4): "
        "benchmarks/maxtext_trillium_model_configs.py llama3_1_8b_8192", V6E_8B_FLAGS, step_seconds=4.546, trials=3),
    Run("v6e-llama2-70b", "v6e:16x16", {"model_name": "llama2-70b", "sa_block_q": 1024, "sa_block_q_dkv": 2048,
        "sa_block_q_dq": 2048}, 2, 4096, {"fsdp_transpose": 256}, [QKV_OFFLOADED, FULL],
        "9.052 s a step, 905 tokens/s per chip", "MaxText 140addcb: benchmarks/maxtext_trillium_model_configs.py "
        "llama2_70b_4096_sc", V6E_70B_FLAGS, step_seconds=9.052, meshes=[{"fsdp": 256}],
        settings={"optimizer_memory_host_offload": [False, True]}, trials=3),
    # Every other single-slice dense-model run of the v6e recipes with a logged step (tpu-recipes'
    # READMEs, each run's settings from MaxText's maxtext_trillium_model_configs.py at the tag the
    # README names): the fidelity and the calibration's samples, one trial each (no search).
    *[Run(f"v6e-llama3.1-8b-x{chips}", topology, {"model_name": "llama3.1-8b", **SPLASH_2048}, batch_, 8192,
          {"fsdp": chips}, [OFFLOAD_QKVO], f"{seconds} s a step", f"{RECIPES}Llama3.1-8B-MaxText/v6e-{chips}/README.md; "
          f"MaxText tpu-recipes-v0.1.4: {config}", flags, step_seconds=seconds, trials=1)
      for chips, topology, batch_, seconds, config, flags in [
          (8, "v6e:2x4", 3, 3.443, "llama3_1_8b_8192_no_collective_matmul", V6E_8B_NO_CM_FLAGS),
          (16, "v6e:4x4", 3, 3.393, "llama3_1_8b_8192_no_collective_matmul", V6E_8B_NO_CM_FLAGS),
          (32, "v6e:4x8", 3, 3.495, "llama3_1_8b_8192_no_collective_matmul", V6E_8B_NO_CM_FLAGS),
          (64, "v6e:8x8", 5, 5.652, "llama3_1_8b_8192_bs5", V6E_8B_FLAGS),
          (128, "v6e:8x16", 4, 4.602, "llama3_1_8b_8192", V6E_8B_FLAGS)]],
    *[Run(f"v6e-llama3.1-70b-x{chips}", topology, {"model_name": "llama3.1-70b", **SPLASH_2048, **extra}, batch_, 8192,
          {"fsdp": chips}, [OFFLOAD_INPUT_QKV], f"{seconds} s a step", f"{RECIPES}Llama3.1-70B-MaxText/v6e-{chips}/README.md; "
          f"MaxText tpu-recipes-v0.1.4: {config}", flags, step_seconds=seconds, trials=1)
      for chips, topology, batch_, seconds, config, flags, extra in [
          (32, "v6e:4x8", 2, 17.790, "llama3_1_70b_8192_bs2_bfloat16_no_collective_matmul",
           f"{V6E_LLAMA31_70B_FLAGS} {DISABLE_COLLECTIVE_MATMUL}", {"weight_dtype": "bfloat16"}),
          (64, "v6e:8x8", 2, 18.688, "llama3_1_70b_8192_bs2", V6E_LLAMA31_70B_FLAGS, {}),
          (128, "v6e:8x16", 4, 34.786, "llama3_1_70b_8192_bs4", V6E_LLAMA31_70B_FLAGS, {}),
          (256, "v6e:16x16", 5, 42.656, "llama3_1_70b_8192", V6E_LLAMA31_70B_FLAGS, {})]],
    Run("v6e-mistral-7b-x8", "v6e:2x4", {"model_name": "mistral-7b", **SPLASH_2048}, 6, 8192, {"fsdp": 8}, [OFFLOAD_QKVO],
        "6.320 s a step", f"{RECIPES}Mistral-7B-MaxText/README.md; MaxText tpu-recipes-v0.1.2: mistral_7b",
        V6E_8B_NO_CM_FLAGS, step_seconds=6.320, trials=1),
    Run("v6e-gpt3-175b", "v6e:16x16", {"model_name": "gpt3-175b", "sa_block_q": 1024, "sa_block_q_dkv": 2048,
                                       "sa_block_q_dq": 2048}, 3, 2048, {"fsdp": 256}, [FULL],
        "17.182 s a step", f"{RECIPES}GPT3-175B-MaxText/bf16/README.md; MaxText tpu-recipes-v0.1.2: gpt_3_175b_bf16",
        V6E_GPT3_FLAGS, step_seconds=17.182, trials=1),
]
"""MaxText's published runs on three TPU generations: eight searched (three with a tensor axis,
the v5p table), and eleven more v6e runs of the recipes, each its published configuration alone
(fidelity and calibration). Sources are MaxText's repository (github.com/AI-Hypercomputer/maxtext)
at the commit named, and the tpu-recipes repository for the v6e steps."""


HELD_OUT = [
    Run("v5p-llama3.1-405b", "v5p:8x8x8", {"model_name": "llama3.1-405b", "num_vocab_tiling": 4, **SPLASH_2048_UNFUSED},
        2, 8192, {"fsdp": 512}, [OFFLOAD_CONTEXT_MLPWO], "131.474 s a step",
        "AI-Hypercomputer/tpu-recipes (1dee47d): training/v5p/Llama3.1-405B-MaxText/cluster_toolkit/README.md (v5p-1024, "
        "step 10); MaxText 3eb77db3: benchmarks/maxtext_v5p_model_configs.py llama3_1_405b_8192_v5p_1024",
        V5P_405B_FLAGS, step_seconds=131.474, trials=1),
]
"""Published runs kept out of every calibration and every search: each is priced by the calibrations, which never
saw it, as a study prices a new model (its band, its marks), and set against its published step (:func:`held_out_lines`).
Its program is kept under :data:`HELD_OUT_PROGRAMS`."""


def label(choice: Any) -> str:
    return choice if isinstance(choice, str) else choice["label"]


def published_tflops(run: Run) -> float:
    """MaxText's count of one step's training FLOPs per chip then (TFLOP): 6 · parameters ·
    tokens (parameters of the 2023 model, norms aside) + 12 · heads · layers · head_dim · seq² ·
    batch of attention, whole (``6N``, 2023-09) or halved (``6N-causal``, 2023-12)."""
    from remat_search.spec.maxtext import maxtext_config
    from remat_search.spec.workloads import MaxTextConfig

    c = maxtext_config(MaxTextConfig(kind="maxtext", overrides={**run.model, **SYNTHETIC, "max_target_length": run.seq}))
    e, h, kv, d, layers = c.emb_dim, c.num_query_heads, c.num_kv_heads, c.head_dim, c.num_decoder_layers
    params = layers * (e * d * (2 * h + 2 * kv) + 2 * e * c.mlp_dim) + e * c.vocab_size
    b, s = run.per_device_batch, run.seq
    attention = 12 * h * layers * d * s * s * b * (0.5 if run.convention == "6N-causal" else 1.0)
    return (6 * params * s * b + attention) / 1e12


def published_step(run: Run) -> float:
    if run.step_seconds is not None:
        return run.step_seconds
    return published_tflops(run) / (run.mfu * CHIPS[run.chip].bf16_flops / 1e12)


def batch(run: Run) -> int:
    """The published batch in a configuration's terms: examples a data-parallel device runs
    (MaxText's ``per_device_batch_size`` counts every chip, a tensor axis's too)."""
    ways = math.prod(n for axis, n in run.mesh.items() if axis in BATCH_AXES)
    return run.per_device_batch * run.chips // ways


def spec(run: Run, storage: str, trials: int) -> dict[str, Any]:
    micro = [b for b in range(batch(run), 0, -1) if batch(run) % b == 0][:2]
    return {
        "study": f"maxtext-{run.name}", "storage": storage,
        "workload": {"kind": "maxtext", "overrides": {**run.model, **SYNTHETIC, "max_target_length": run.seq}},
        "target": {"platform": "tpu", "topology": run.topology},
        "space": {"layout": "uniform", "choices": run.choices},
        "configuration": {"batch": micro, "global_batch": run.chips * run.per_device_batch,
                          "mesh": [run.mesh, *run.meshes], **({"settings": run.settings} if run.settings else {})},
        "budget": "device", "trials": trials, "sampler": {"kind": "planner", "seed": 0},
        "timing": {"timeout": "3600s"}, "compilation_cache": None,
    }


def search(run: Run, storage: str, trials: int, *, keep_programs: bool = False, **fields: Any) -> StudyReport:
    """``run``'s study (its spec's top-level ``fields`` replaced), its workers compiling with the
    run's ``LIBTPU_INIT_ARGS``."""
    before = os.environ.get("LIBTPU_INIT_ARGS")
    os.environ["LIBTPU_INIT_ARGS"] = run.flags
    study = {**spec(run, storage, trials), **fields}
    study["target"]["keep_programs"] = keep_programs
    try:
        return remat_search.run(parse_spec(study))
    finally:
        os.environ.pop("LIBTPU_INIT_ARGS")
        if before is not None:
            os.environ["LIBTPU_INIT_ARGS"] = before


RE_READ: set[tuple[str, int]] = set()
"""The trials (study, number) whose verdict :func:`reread` changed."""


def reread(report: StudyReport) -> StudyReport:
    """The study with each trial judged again under today's peak rule (``MemoryBreakdown.peak``).
    A TPU program's breakdown keeps the HBM the compiler compiled it for since schema 14; the
    studies kept before lack it, and their budget (``device``) is that HBM. A trial judged
    before may be over the budget by a figure that reads within it now (the compiler compiled it,
    so it fits), or the other way."""
    trials = []
    for t in report.trials:
        m = t.measurement
        if t.status not in ("measured", "over_budget") or m is None or m.memory is None or m.estimate is None:
            trials.append(t)
            continue
        memory = m.memory if m.memory.hbm is not None else m.memory.model_copy(update={"hbm": report.budget})
        now = judge(m.raw.model_copy(update={"memory": memory}), budget=report.budget)
        if now.status != t.status:
            RE_READ.add((report.study, t.number))
        trials.append(t.model_copy(update={"measurement": now, "status": now.status}))
    return report.model_copy(update={"trials": tuple(trials)})


def status(trial: TrialResult, report: StudyReport) -> str:
    """The trial's verdict, marked where :func:`reread` changed it."""
    return trial.status + (" (re-read)" if (report.study, trial.number) in RE_READ else "")


def at_published_configuration(run: Run, trial: TrialResult) -> bool:
    """Whether ``trial`` runs at the published batch and mesh, in one step, with no memory knob set."""
    c = trial.plan.configuration if trial.plan else None
    return c is not None and dict(c.mesh) == run.mesh and c.batch == batch(run) and c.accumulation == 1 \
        and not any(v for _, v in c.settings)


def published_trial(run: Run, report: StudyReport) -> TrialResult | None:
    """The trial of the published configuration: the published policy at the first configuration."""
    return next((t for t in report.trials if at_published_configuration(run, t)
                 and t.labels and set(t.labels) == {label(run.choices[0])}), None)


GROUPS = {"v5": ("v5e", "v5p"), "v6e": ("v6e",)}
"""The calibrations by chip (``PROGRAMS/<group>.json``): v5e and v5p together (three runs each),
v6e alone; ``all`` (``calibration.json``) is one set of figures for every generation."""


def group(chip: str) -> str:
    return next(name for name, chips in GROUPS.items() if chip in chips)


def published_calibration() -> dict[str, Any]:
    """The step-time model calibrated on the kept published programs (:func:`keep_programs`),
    each with its samples' leave-one-out estimates: one calibration a group of chips
    (:data:`GROUPS`, ``PROGRAMS/<group>.json``) and one of all (``PROGRAMS/calibration.json``),
    each of which a TPU spec may name (``target.calibration``). Empty before any program is kept."""
    from remat_search.targets.calibration import calibrate, load_samples

    index = PROGRAMS / "samples.json"
    if not index.exists():
        return {}
    samples = load_samples(index)
    compiler = f"libtpu {importlib.metadata.version('libtpu')}, MaxText {importlib.metadata.version('maxtext')}"
    calibrations = {"all": calibrate(samples, name="maxtext-published", compiler=compiler)}
    for name, chips in GROUPS.items():
        calibrations[name] = calibrate([s for s in samples if s[0].chip in chips], name=f"maxtext-published-{name}",
                                       compiler=compiler)
    for name, calibration in calibrations.items():
        path = PROGRAMS / ("calibration.json" if name == "all" else f"{name}.json")
        path.write_text(calibration.model_dump_json(indent=1) + "\n")
    return calibrations


def page(results: list[tuple[Run, StudyReport, float]], command: str, calibrations: dict[str, Any]) -> str:
    ratios, samples_only = {}, []
    left_out = {s.label: s for name, c in calibrations.items() if name != "all" for s in c.samples}
    one = {s.label: s for s in calibrations["all"].samples} if calibrations else {}
    fidelity, quality, every = [], [], []
    for run, report, minutes in results:
        pub = published_trial(run, report)
        step = published_step(run)
        # Over the HBM in the study (its compiler's peak), the published configuration is estimated all the same.
        estimate = pub.measurement.estimate if pub is not None and pub.measurement is not None else None
        est = estimate.seconds if estimate is not None else None
        fits = pub is not None and status(pub, report).startswith("measured")
        peak = format_bytes(pub.peak_bytes) if pub is not None and pub.peak_bytes else "—"
        mesh = ",".join(f"{a}={n}" for a, n in run.mesh.items())
        if est is not None:
            ratios[run.name] = est / step
        loo, loo_all = left_out.get(run.name), one.get(run.name)
        calibration = calibrations.get(group(run.chip))
        fidelity.append(
            f"| {run.name} | {run.chips} × {run.chip} | {run.per_device_batch} × {run.seq} | {mesh} | {label(run.choices[0])} | "
            f"{run.published} | {step:.2f} s | {peak} of {format_bytes(report.budget)}: {'fits' if fits else '**no**'} | "
            + (f"{est:.2f} s | **{est / step:.3f}**" if est is not None else "— | —")
            + (f" | {loo.loo_seconds:.2f} s | **{loo.loo_seconds / step:.3f}**" if loo is not None else " | — | —")
            + (f" | {loo.lofo_seconds / step:.3f}" if loo is not None and loo.lofo_seconds else " | —")
            + (f" | {loo_all.loo_seconds / step:.3f} |" if loo_all is not None else " | — |"))
        if run.trials == 1:  # a fidelity sample: its published configuration alone, nothing searched
            samples_only.append(run.name)
        timed = report.timed() if run.trials > 1 else []
        best = min(timed, key=rank) if timed else None
        base = pub.throughput if fits and pub is not None else None
        gain = f"{best.throughput / base - 1:+.1%}" if best is not None and base else "—"
        low, high = PUBLISHED_BANDS[run.chip]
        beyond = best is not None and base and best.throughput / base > high / low
        calibrated = "—"
        if calibration is not None and best is not None and base and pub is not None and best.throughput > base:
            calibrated = calibrated_verdict(run, calibration, best, pub)
        quality.append(
            f"| {run.name} | {base:,.0f} | {best.summary() if best else '—'} | "
            f"{format_bytes(best.peak_bytes) if best else '—'} | {best.throughput:,.0f} | {gain} | "
            f"×{low:.3f}–{high:.3f} (+{high / low - 1:.1%}) | {'**beaten**' if beyond else 'not beaten' if best.throughput > base else '—'} | "
            f"{calibrated} | {len(report.trials)} ({report.count('infeasible')} infeasible) | {minutes:.0f} min |"
            if base and best else f"| {run.name} | — | — | — | — | — | — | — | — | {len(report.trials)} | {minutes:.0f} min |"
            if run.trials > 1 else "")
        for t in report.trials:
            every.append(f"| {run.name} | {t.number} | {t.summary() if t.plan else '—'} | "
                         f"{format_bytes(t.peak_bytes) if t.peak_bytes else '—'} | {status(t, report)} | "
                         f"{f'{t.seconds:.2f} s' if t.seconds else '—'} | "
                         f"{f'{t.throughput:,.0f}' if t.throughput else '—'} | {(t.error or '')[:90]} |")
    values = sorted(ratios.values())
    within = sum(abs(r - 1) <= 0.15 for r in values)
    device = results[0][1].device if results else {}
    lines = [
        "# MaxText's published TPU runs, on MaxText's own program: the step-time model's fidelity and the search's answers\n",
        f"Command: `{command}`; MaxText {importlib.metadata.version('maxtext')}, "
        f"jax {device.get('jax_version', '?')}, libtpu {device.get('compiler_version', '?')}; on this 2-core machine. Each study "
        "compiles MaxText's own train step (`workload: {kind: maxtext}`) ahead of time for the run's slice, with the XLA "
        "flags of the run's script, and the step-time model estimates each candidate (host transfers at 15 GB/s a chip). "
        "Every figure below is an **estimate** of the model. The searches' are uncalibrated (the datasheet's figures); "
        "beside them, each published configuration's estimate **calibrated leave-one-out**: the model's free figures "
        "fitted (`remat-search calibrate`) on the other published runs of its chip's group (v5e and v5p together; v6e) "
        "and their steps (`published_programs/`: `v5.json`, `v6e.json`), then priced on this one; beside it, the same "
        "**leave-one-family-out**: fitted on the runs of the group's other models alone (a model's runs at every chip "
        "count left out together: `Run.family`), the error the bands a study prints are read from; then one "
        "calibration of every run (`calibration.json`), left out one run at a time.\n",
        "## Fidelity: the published configuration's estimate against its published step\n",
        "![estimate / published step, each run](published_configs.png)\n",
        "| run | chips | batch a chip × tokens | mesh | remat | published | published step | compiled peak a chip | "
        "estimated step | est. / published | calibrated, left out | its / published | its family left out / published | "
        "one calibration of all, left out / published |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *fidelity, "",
        (f"Estimate / published over {len(values)} runs: min {values[0]:.3f}, median {statistics.median(values):.3f}, "
         f"max {values[-1]:.3f} (spread {values[-1] - values[0]:.3f}); within ±15%: {within} of {len(values)}.\n"
         if values else "No run estimated yet.\n"),
        *[line for name, c in calibrations.items()
          for line in calibrated_lines(c, {run.name: published_step(run) for run, _, _ in results}, name)],
        *held_out_lines(calibrations),
        "## Quality: the configuration space searched at the same chips, global batch and HBM\n",
        "Per-device batch (the published one or half, with accumulation making up the global batch), the published mesh "
        "or one other, one remat policy for every layer (MaxText's form), and, where listed, MaxText's memory knobs. "
        "Throughput is estimated tokens/s per chip, both sides from the same uncalibrated model. Each estimate's band is "
        "its generation's: the 95% prediction interval of published step / estimate over the published runs of that "
        "generation, counted by model family (the fidelity table; `targets.chips.PUBLISHED_BANDS`). A configuration is **beaten** only where the best found is faster even at the "
        "slow end of its band against the published configuration at the fast end of its own: a gain above the band's "
        "width (high / low - 1). A gain inside it is not a win. The last verdict prices both programs at the calibration "
        "of its chip's group (the answer's compiled alone, `--answers`: `published_programs/answers/`), gives that gain, and "
        "calls it beaten only where the answer at the slow end of its kind of plan's left-out band (recompute, offload) "
        "is faster than the published configuration at the fast end of its own; a band read against the uncalibrated "
        "gain (as this page did before) says nothing of it. "
        f"Not searched, their published configuration compiled alone (samples of the fidelity and the calibration): "
        f"{', '.join(samples_only) or 'none'}.\n",
        "| run | published config, est. tokens/s | best found | its peak | its est. tokens/s | gain | band (width) | "
        "verdict | verdict at the calibration's bands | trials | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(row for row in quality if row), "",
        *host_peak_lines(results),
        "## Every trial\n",
        "| run | trial | candidate | peak a chip | status | est. step | est. tokens/s per chip | reason |",
        "|---|---|---|---|---|---|---|---|",
        *every, "",
        "## Sources\n",
        *[f"- **{run.name}**: {run.source}; `LIBTPU_INIT_ARGS={run.flags}`" for run, _, _ in results], "",
    ]
    return "\n".join(lines)


def host_peak_lines(results: list[tuple[Run, StudyReport, float]]) -> list[str]:
    """Every compile that offloads: the compiler's peak against the arguments plus the host
    temporaries, and the breakdown sum (``MemoryBreakdown.compiler_peak_is_host``)."""
    rows, host = [], 0
    for run, report, _ in results:
        for t in report.trials:
            m = t.measurement.memory if t.measurement is not None else None
            if m is None or m.host_temp == 0 or m.compiler_peak is None:
                continue
            host += m.compiler_peak_is_host
            rows.append(f"| {run.name} | {t.number} | {t.summary() if t.plan else '—'} | {format_bytes(m.compiler_peak)} | "
                        f"{m.compiler_peak - m.argument - m.host_temp:,} | {format_bytes(m.host_temp)} | "
                        f"{format_bytes(m.breakdown_sum)} | {'**host**' if m.compiler_peak_is_host else 'device'} | "
                        f"{format_bytes(m.peak)} of {format_bytes(report.budget)} |")
    return [
        "## Memory: the compiler's peak of a program that offloads\n",
        f"Of {len(rows)} compiles that put tensors in host memory, **{host}** state a compiler's peak "
        "(`peak_memory_in_bytes`) equal to their arguments plus their host temporaries, to within a few hundred KB: "
        "the host's figure, not the device's (the TPU compiler compiled each for the chip's HBM, some at a \"peak\" "
        "several times it). The study's peak there is the breakdown sum (argument + output − alias + temp + code), "
        "which is at least the device's, or, where that reads over the chip, the HBM the compiler compiled the program "
        "for: it compiled it, so by its own out-of-memory verdict the program fits (`MemoryBreakdown.peak`). Columns: the compiler's peak; it less arguments and host temporaries, bytes; "
        "the host temporaries; the breakdown sum; which the compiler's peak is; the study's peak.\n",
        "| run | trial | candidate | compiler's peak | − (arguments + host temp), B | host temp | breakdown sum | "
        "compiler's peak is | study's peak |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows, "",
    ]


def calibrated_verdict(run: Run, calibration: Any, best: TrialResult, pub: TrialResult) -> str:
    """The answer against the published configuration, both priced at the calibration's figures
    (their kept programs: :data:`PROGRAMS`, :data:`ANSWERS`), and beaten only where the answer's
    slowest step its band allows is faster than the published configuration's fastest: the same
    global batch on the same chips, so the steps compare as the throughputs do."""
    from remat_search.targets.calibration import chip_of, read_program
    from remat_search.targets.step_time import price
    from remat_search.targets.work import read_work

    answer = ANSWERS / f"{run.name}.hlo.gz"
    if not answer.exists():
        return "— (the answer's program is not kept: `--answers`)"
    chip = chip_of(run.chip)
    theirs_s, ours_s = (price(read_work(read_program(p), chip.mxu), chip, calibration.efficiencies).seconds
                        for p in (PROGRAMS / f"{run.name}.hlo.gz", answer))
    ours, theirs = calibration.band(best.plan.kind), calibration.band(pub.plan.kind)
    beaten = ours_s * ours[1] < theirs_s * theirs[0]  # a band is published (measured) step / estimate
    return f"{theirs_s / ours_s - 1:+.1%} calibrated: " + ("**beaten**" if beaten else "not beaten")


def calibrated_lines(calibration: Any, steps: dict[str, float], name: str) -> list[str]:
    """The calibration's figures and its error left out, one run and one family at a time, for the page."""
    def spread(figure: str) -> tuple[list[float], int]:
        ratios = sorted(getattr(s, figure) / steps[s.label] for s in calibration.samples
                        if s.label in steps and getattr(s, figure) is not None)
        return ratios, sum(abs(r - 1) <= 0.15 for r in ratios)

    (loo, loo_within), (lofo, lofo_within) = spread("loo_seconds"), spread("lofo_seconds")
    e = calibration.efficiencies
    bands = ", ".join(f"{kind} ×{b[0]:.3f}–{b[1]:.3f}" for kind in ("recompute", "offload")
                      if (b := calibration.band(kind)) is not None)
    chips = "every generation, one set of figures" if name == "all" else ", ".join(GROUPS[name])
    family_out = (f"left out a family at a time ({calibration.families} families), over {len(lofo)} runs: min {lofo[0]:.3f}, "
                  f"median {statistics.median(lofo):.3f}, max {lofo[-1]:.3f}; within ±15%: **{lofo_within} of {len(lofo)}**"
                  if lofo else "one family: none left out a family at a time")
    return [
        f"**{calibration.name}** ({chips}; `published_programs/{'calibration' if name == 'all' else name}.json`): "
        f"estimate / published step, left out one run at a time, over {len(loo)} runs: min {loo[0]:.3f}, "
        f"median {statistics.median(loo):.3f}, max {loo[-1]:.3f}; within ±15%: {loo_within} of {len(loo)}; "
        f"{family_out}. Fitted on all {len(loo)} "
        f"({', '.join(calibration.fitted)}): matmuls at {e.matmul:.3f} of peak, HBM at {e.hbm:.3f}, ICI at {e.ici:.3f}, "
        f"host link at {e.host_link:.3f} of the assumed 15 GB/s, {e.launch_seconds * 1e6:.1f} µs an instruction; "
        f"bands (published / estimate, a family left out, a 95% prediction interval counted by family: "
        f"`Calibration.band`): {bands}. What it says of another model is this interval, not a promise.\n",
    ]


def matmul_share(work: Any, chip: Any, measured: float) -> float:
    """The time a program's matmuls take at its chip's peak, over its measured step."""
    from remat_search.targets.step_time import price

    return price(work, chip).mxu_flops / chip.bf16_flops / measured


def peak_ratios() -> str:
    """:func:`matmul_share` over the calibration's samples, lowest and highest by group of chips."""
    from remat_search.targets.calibration import chip_of, load_samples, read_program
    from remat_search.targets.work import read_work

    shares: dict[str, list[float]] = {}
    for sample, path in load_samples(PROGRAMS / "samples.json"):
        chip = chip_of(sample.chip)
        shares.setdefault(group(sample.chip), []).append(
            matmul_share(read_work(read_program(path), chip.mxu), chip, sample.measured_seconds))
    return ", ".join(f"{' and '.join(GROUPS[g])} {min(v):.3f}–{max(v):.3f}" for g, v in shares.items())


def held_out_lines(calibrations: dict[str, Any]) -> list[str]:
    """The held-out runs (:data:`HELD_OUT`, kept by ``--programs``) priced by the calibration of their
    chip's group and by the one of all, neither of which saw them: the estimate, the band and marks
    a study would print beside it, and whether the published step lands inside that band."""
    from remat_search.targets.calibration import chip_of, load_samples, read_program, with_band
    from remat_search.targets.step_time import price
    from remat_search.targets.work import read_work

    index = HELD_OUT_PROGRAMS / "samples.json"
    if not index.exists() or not calibrations:
        return []
    rows = []
    for sample, path in load_samples(index):
        chip = chip_of(sample.chip)
        work = read_work(read_program(path), chip.mxu)
        matmuls, waited = matmul_share(work, chip, sample.measured_seconds), price(work, chip).collective_seconds
        for name in (group(sample.chip), "all"):
            calibration = calibrations[name]
            estimate = with_band(price(work, chip, calibration.efficiencies), calibration, sample.kind, mesh=sample.mesh)
            free = price(work, chip, calibration.efficiencies.model_copy(update={"ici": 1e6})).seconds  # collectives free
            low, high = estimate.band or (math.nan, math.nan)
            ratio = sample.measured_seconds / estimate.seconds
            rows.append(
                f"| {sample.label} | `{'calibration' if name == 'all' else name}.json` | {sample.measured_seconds:.2f} s | "
                f"{estimate.seconds:.2f} s | {estimate.seconds / sample.measured_seconds:.3f} | ×{low:.3f}–{high:.3f} | "
                f"{ratio:.3f}: {'inside' if low <= ratio <= high else '**outside**'} | {estimate.outside or '—'} | "
                f"{matmuls:.3f} | {waited:.2f} s | {free / sample.measured_seconds:.3f} |")
    return [
        "## Held out: published runs no calibration has seen\n",
        "Each run of `HELD_OUT` is compiled as the others are (`--programs`) but kept apart "
        "(`published_programs/held_out/`): no calibration is fitted on it and no study searches it. Priced by the "
        "calibration of its chip's group and by the one of all, as a study on a new model would be: the estimate, "
        "its ratio to the published step, the band the study would print beside it (published / estimate, its kind of "
        "plan's 95% prediction interval, a family left out), whether the published step lands inside it, and the study's marks; then, at the "
        "datasheet's figures, the time its matmuls take at the chip's peak over the published step (how close to the "
        "peak the run ran them) and the collectives the model waits for; last, the estimate with every collective free, "
        "over the published step. The matmul ratio over the calibration's samples: "
        f"{peak_ratios()}.\n",
        "| run | calibration | published step | estimate | est. / published | band printed | published / estimate | marks "
        "| matmuls at peak / published step | collectives waited for, datasheet | collectives free: est. / published |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "",
    ]


def plot(ratios: dict[str, float], path: Path) -> None:
    """Each run's estimate / published step, the ±15% band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ratios)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.5 * len(names)), 3.6))
    ax.axhspan(0.85, 1.15, color="0.92", label="within ±15%")
    ax.axhline(1.0, color="0.5", lw=0.8)
    x = range(len(names))
    ax.bar(list(x), [ratios[n] for n in names], width=0.6, label="MaxText's program (kind: maxtext)")
    ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("estimated / published step")
    ax.set_ylim(0, max([1.3, *ratios.values()]))
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PROGRAMS = HERE / "results" / "published_programs"
"""Each published configuration's compiled program and its published step (``samples.json``):
what ``remat-search calibrate`` fits the TPU step-time model on (:func:`keep_programs`)."""


ANSWERS = PROGRAMS / "answers"
"""Each searched run's answer's compiled program, where it is faster than the published
configuration by the uncalibrated model (:func:`keep_answers`): priced at the calibration's
figures beside the published configuration's for the page's calibrated verdict."""
HELD_OUT_PROGRAMS = PROGRAMS / "held_out"
"""The programs of :data:`HELD_OUT` and their published steps (``samples.json``), apart from the calibration's samples."""


def keep_answers(runs: list[Run]) -> None:
    """Compile each searched run's answer alone (its policy and configuration, a study of one
    trial in a scratch storage) and keep its program under :data:`ANSWERS`."""
    import shutil
    import tempfile

    from remat_search.measure.artifacts import ARTIFACTS
    from remat_search.measure.artifacts import PROGRAMS as KEPT

    ANSWERS.mkdir(parents=True, exist_ok=True)
    for run in runs:
        try:
            report = reread(remat_search.load_report(f"maxtext-{run.name}", f"sqlite:///{DB}"))
        except Exception:  # noqa: BLE001 - a run not searched yet
            continue
        timed = report.timed() if run.trials > 1 else []
        best, pub = (min(timed, key=rank) if timed else None), published_trial(run, report)
        if best is None or best.plan is None or best.plan.configuration is None or pub is None or not pub.throughput \
                or best.throughput <= pub.throughput:
            continue
        c = best.plan.configuration
        with tempfile.TemporaryDirectory() as home:
            os.environ["REMAT_SEARCH_HOME"] = home
            try:
                answer = search(
                    run, f"sqlite:///{home}/answer.db", 1, keep_programs=True,
                    space={"layout": "uniform", "choices": [next(ch for ch in run.choices if label(ch) == best.labels[0])]},
                    configuration={"batch": [c.batch], "global_batch": run.chips * run.per_device_batch, "mesh": [dict(c.mesh)],
                                   **({"settings": {k: [v] for k, v in c.settings}} if c.settings else {})},
                ).trials[0]
            finally:
                os.environ.pop("REMAT_SEARCH_HOME")
            if answer.measurement is None or answer.measurement.program_digest is None or answer.summary() != best.summary():
                print(f"{run.name}: the answer ({best.summary()}) was not compiled as searched", flush=True)
                continue
            shutil.copy(Path(home) / ARTIFACTS / f"maxtext-{run.name}" / KEPT / f"{answer.measurement.program_digest}.hlo.gz",
                        ANSWERS / f"{run.name}.hlo.gz")
            print(f"{run.name}: kept the answer's program ({best.summary()})", flush=True)


def keep_programs(runs: list[Run], folder: Path = PROGRAMS, *, samples: bool = True, db: Path = DB) -> None:
    """Compile each run's published configuration (a study of one trial in ``db``, its
    artifacts in a scratch storage home), keep its program as ``folder/<run>.hlo.gz`` and, where
    ``samples``, its published step in ``folder/samples.json``: calibration samples
    (``remat_search.targets.calibration``)."""
    import json
    import shutil
    import tempfile

    from remat_search.measure.artifacts import ARTIFACTS
    from remat_search.measure.artifacts import PROGRAMS as KEPT

    folder.mkdir(parents=True, exist_ok=True)
    index = folder / "samples.json"
    kept = {s["label"]: s for s in (json.loads(index.read_text()) if index.exists() else [])}
    for run in runs:
        with tempfile.TemporaryDirectory() as home:
            os.environ["REMAT_SEARCH_HOME"] = home
            try:
                report = search(run, f"sqlite:///{db}", 1, keep_programs=True)
            finally:
                os.environ.pop("REMAT_SEARCH_HOME")
            trial = published_trial(run, report)
            if trial is None or trial.measurement is None or trial.measurement.program_digest is None:
                print(f"{run.name}: the published configuration was not compiled", flush=True)
                continue
            shutil.copy(Path(home) / ARTIFACTS / f"maxtext-{run.name}" / KEPT / f"{trial.measurement.program_digest}.hlo.gz",
                        folder / f"{run.name}.hlo.gz")
        offloads = any(isinstance(c, dict) and c.get("offload") for c in run.choices[:1])
        kept[run.name] = {
            "label": run.name, "chip": run.chip, "program": f"{run.name}.hlo.gz", "measured_seconds": published_step(run),
            "kind": "offload" if offloads else "recompute", "source": run.source, "family": run.family,
            "mesh": run.mesh,
        }
        if samples:
            index.write_text(json.dumps(sorted(kept.values(), key=lambda s: s["label"]), indent=1) + "\n")
        estimate = trial.measurement.estimate  # an over-budget trial is estimated too: its program is a sample
        print(f"{run.name}: kept ({trial.status}), estimated {estimate.seconds if estimate else float('nan'):.3f} s, "
              f"published {published_step(run):.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", default=[r.name for r in RUNS],
                        help="which of RUNS (default: all); with --programs, HELD_OUT's too")
    parser.add_argument("--trials", type=int, default=None, help="trials of each study (default: each run's)")
    parser.add_argument("--report", action="store_true", help="write the page from the kept studies, compiling nothing")
    parser.add_argument("--programs", action="store_true",
                        help="compile each published configuration alone and keep its program under results/published_programs")
    parser.add_argument("--answers", action="store_true",
                        help="compile each searched run's answer alone and keep its program under results/published_programs/answers")
    args = parser.parse_args()
    if args.programs:
        keep_programs([r for r in RUNS if r.name in args.runs])
        keep_programs([r for r in HELD_OUT if r.name in args.runs], HELD_OUT_PROGRAMS)
        return
    if args.answers:
        keep_answers([r for r in RUNS if r.name in args.runs])
        return
    DB.parent.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{DB}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    results = []
    for run in (r for r in RUNS if r.name in args.runs):
        start = time.monotonic()
        if args.report:
            try:
                report = reread(remat_search.load_report(f"maxtext-{run.name}", storage))
            except Exception:  # noqa: BLE001 - a run not searched yet
                continue
        else:
            report = reread(search(run, storage, args.trials or run.trials))
            optuna.load_study(study_name=f"maxtext-{run.name}", storage=storage).set_user_attr(
                "benchmark_minutes", (time.monotonic() - start) / 60)
        minutes = optuna.load_study(study_name=f"maxtext-{run.name}", storage=storage).user_attrs.get("benchmark_minutes", 0.0)
        results.append((run, report, minutes))
        print(f"{run.name}: {len(report.trials)} trials, {(time.monotonic() - start) / 60:.1f} min", flush=True)
    command = "python benchmarks/published_configs.py" + (f" --trials {args.trials}" if args.trials else "")
    PAGE.write_text(page(results, command, published_calibration()))
    ratios = {run.name: t.measurement.estimate.seconds / published_step(run) for run, report, _ in results
              if (t := published_trial(run, report)) is not None and t.measurement and t.measurement.estimate}
    if ratios:
        plot(ratios, PAGE.with_suffix(".png"))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
