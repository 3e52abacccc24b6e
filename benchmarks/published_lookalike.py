"""MaxText's published TPU runs as the benchmark of the step-time model and of the search.

One command, from any machine with libtpu (``pip install -e '.[tpu,plot]'``):

    python benchmarks/published_lookalike.py                       # every run in RUNS
    python benchmarks/published_lookalike.py --runs v6e-llama3.1-8b --trials 4   # one, quickly

For each published run (:data:`RUNS`: a MaxText configuration and the throughput MaxText
published for it, each with the file and commit it is read from), it rebuilds the model as a
workload factory (:class:`Decoder`: the same shapes, the same matmuls, the same attention
kernel's work; RMSNorm; no rotary embedding, which is elementwise) and runs one study on the
same TPU slice, compiled ahead of time:

* **fidelity**: the published configuration (its per-device batch, mesh and remat policy) is
  compiled with the XLA flags MaxText ran it with and its step time estimated
  (``targets.step_time``, host transfers of offloaded tensors priced at the chip's host link);
  the table sets that estimate against the step time MaxText published, or the one its
  published TFLOP/s imply under the FLOP count MaxText used then (:func:`maxtext_tflops`);
* **quality**: the study searches the configuration space at the same chips, global batch
  (tokens per step) and HBM (``budget: device``): micro-batch, gradient accumulation, mesh
  (FSDP alone or with data parallelism) and one remat policy for every layer (MaxText's form),
  offload among them. The published configuration is the reference configuration, so its
  presets are compiled first; the answer is the highest estimated throughput that fits, set
  against the published configuration's own estimate: the same model on both sides, so the
  ratio is like for like. The search compiles with libtpu's default flags (MaxText's slow the
  v6e compiles several times over), but for the scoped VMEM limit the v6e runs' attention blocks
  need (:attr:`Run.search_flags`); a second study of each run (:func:`flagged`) compiles the run's
  choices at the published configuration and the search's answer with MaxText's flags;
* **the host link**, the one figure the estimates assume rather than read from Google's pages:
  each candidate under MaxText's flags that fits, compiled again and estimated at each of
  :data:`HOST_LINKS` (:func:`host_links`), what a faster link would change of the answers.

MaxText's flags (:attr:`Run.xla_flags`, set as ``LIBTPU_INIT_ARGS`` for the study's workers)
decide, among other things, how early the compiler starts an offloaded tensor's transfer,
which is what an offloading run's step waits for. A run's published figure is a measurement
of a real machine; each estimate is the model's, of a program compiled by this machine's
libtpu, which is not the one MaxText ran. Writes
``benchmarks/results/published_lookalike.md`` (a row per run), the picture of each study's
candidates (``published_lookalike.png``) and the host-link estimates
(``published_lookalike_links.json``), and keeps the studies in
``benchmarks/results/studies/published_lookalike.db``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import optuna
from jax.ad_checkpoint import checkpoint_name
from published_configs import (
    CF_FOR_ALL_GATHER,
    DATA_PARALLEL_OVERLAP,
    DENSE_VMEM_LIMIT,
    HOST_OFFLOAD,
    LAYOUT_FOR_ALL_REDUCE_SCATTER,
    SPARSECORE_ALL_REDUCE,
)
from search_quality_tpu import fresh_storage, versions

import remat_search
from remat_search.measure.executables import Executables
from remat_search.plans.plan import RematPlan, scan_layers
from remat_search.plans.policy import LayerPolicy
from remat_search.report.results import StudyReport, TrialResult, rank
from remat_search.search.loop import measure_params
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TpuTarget
from remat_search.spec.workloads import TransformerConfig
from remat_search.targets.chips import CHIPS, TPU_HOST_BYTES_PER_SECOND
from remat_search.targets.step_time import StepEstimate, estimate_step
from remat_search.targets.tpu import TpuAotTarget
from remat_search.units import format_bytes
from remat_search.workloads.transformer import FLASH_BLOCK_FIELDS, TransformerWorkload, _attention, _split_batch

HERE = Path(__file__).resolve().parent
QKV = ["query_proj", "key_proj", "value_proj"]
HOST_LINKS = (TPU_HOST_BYTES_PER_SECOND, 32e9, 64e9)
"""Host links (bytes/s a chip, one way) each candidate is estimated at again (:func:`host_links`):
the model's assumption, and PCIe Gen5 ×8's and ×16's. Google Cloud's v6e page says its chips
reach their host by PCIe Gen5, and not how wide; the v5e's says neither."""
LINKS = HERE / "results" / "published_lookalike_links.json"
""":func:`host_links`'s figures of each run, kept for ``--report``."""


@dataclass(frozen=True)
class Model:
    """A MaxText decoder's shape (its ``base.yml`` and model file)."""

    layers: int
    emb: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    activation: str  # "relu": one wi and wo (MaxText's 2023 default); "swiglu": wi_0, wi_1 and wo
    parallel: bool  # one norm, attention and MLP both read it, their outputs summed (2023 default)
    tied: bool  # logits through the embedding

    def params(self) -> int:
        """Parameters, as MaxText's 2023 count took them from the tree (norms aside)."""
        attention = self.emb * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = self.emb * self.mlp * (3 if self.activation == "swiglu" else 2)
        return self.layers * (attention + mlp) + self.emb * self.vocab * (1 if self.tied else 2)


# MaxText's base.yml of 2023 (commit 9bc243c9: base_emb_dim 2560, 8 heads of 256, MLP 8192
# relu, 16 layers, vocabulary 32768 tied, the parallel block), scaled by
# global_parameter_scale as pyconfig.get_individual_scales did; and the Llama files of
# MaxText/configs/models at the commits RUNS name.
MODELS = {
    "gps16": Model(32, 5120, 32, 32, 256, 32768, 32768, "relu", parallel=True, tied=True),
    "gps32": Model(32, 10240, 32, 32, 256, 32768, 32768, "relu", parallel=True, tied=True),
    "gps64": Model(64, 10240, 32, 32, 256, 32768, 32768, "relu", parallel=True, tied=True),
    "llama3.1-8b": Model(32, 4096, 32, 8, 128, 14336, 128256, "swiglu", parallel=False, tied=False),
    "llama2-70b": Model(80, 8192, 64, 8, 128, 28672, 32000, "swiglu", parallel=False, tied=False),
}


@dataclass(frozen=True)
class Run:
    """One published MaxText run: its configuration, and the figure published for it."""

    name: str
    model: str
    topology: str
    per_device_batch: int
    seq: int
    policy: str | dict[str, Any]
    """MaxText's remat_policy as a spec writes a choice (one policy for every layer)."""
    causal: bool
    """Whether its attention kernel skipped the masked half (MaxText's v5e runs of 2023 did not)."""
    convention: str
    """MaxText's FLOP count the figure was made with: ``6N`` (train.py, 2023) or ``matmuls``
    (maxtext_utils.calculate_tflops_training_per_device, 2024 on); attention non-causal both."""
    published: str
    """The published figure as printed."""
    step_seconds: float | None = None
    """A published step time, where MaxText's log gives one."""
    tflops: float | None = None
    """Published TFLOP/s per chip, where that is the figure."""
    mfu: float | None = None
    """Published MFU beside :attr:`tflops`: those TFLOP/s over the chip's peak. MaxText's v5e
    table prints the TFLOP/s to 3 figures and the MFU to 4, and every row of it agrees with the
    v5e's 197 TFLOP/s to the rounding, so the step is read from the MFU, the finer figure."""
    tokens_per_second: float | None = None
    """Published tokens/s per chip, where that is the figure."""
    xla_flags: str = ""
    """The ``LIBTPU_INIT_ARGS`` MaxText ran it with: its studies compile with them."""
    search_flags: str = ""
    """What of :attr:`xla_flags` the search compiles with too: what its attention blocks need
    to compile at all (libtpu's defaults otherwise)."""
    source: str = ""
    note: str = ""
    choices: list[Any] = field(default_factory=list)
    attention_blocks: dict[str, int] = field(default_factory=dict)
    """The flash kernel's block sizes MaxText ran with (Pallas's ``BlockSizes`` by field; the
    v6e runs' splash sizes ``sa_block_*`` carried over field for field)."""

    @property
    def chips(self) -> int:
        x, y = self.topology.split(":")[1].split("x")
        return int(x) * int(y)

    @property
    def chip(self) -> str:
        return self.topology.split(":")[0]

    def published_step(self) -> float:
        """The published step time: as logged, or as the published MFU, TFLOP/s or tokens/s imply."""
        if self.step_seconds is not None:
            return self.step_seconds
        if self.mfu is not None:
            return maxtext_tflops(self) / (self.mfu * CHIPS[self.chip].bf16_flops / 1e12)
        if self.tflops is not None:
            return maxtext_tflops(self) / self.tflops
        assert self.tokens_per_second is not None
        return self.per_device_batch * self.seq / self.tokens_per_second


FULL = "full"
MINIMAL = "dots_no_batch"  # MaxText's minimal: checkpoint_dots_with_no_batch_dims
SAVE_QKV = {"label": "save_qkv_proj", "names": QKV}
QKV_OFFLOADED = {"label": "qkv_proj_offloaded", "offload": QKV}
OFFLOAD_QKVO = {"label": "custom_offload", "offload": ["decoder_layer_input", *QKV, "out_proj"]}
"""Llama 3.1 8B's remat_policy custom: the layer's input and q, k, v and out_proj offloaded."""
OFFLOAD_INPUT = {"label": "offload_input", "offload": ["decoder_layer_input"]}
INPUT_OFFLOADED_QKV_KEPT = {"label": "input_offloaded_qkv_kept", "per_name": {"device": QKV, "offload": ["decoder_layer_input"]}}

# The LIBTPU_INIT_ARGS of each run, as MaxText's sources compose them: the v5e scripts' own line
# (configs/largest_job/*.sh at 9bc243c9); the v6e recipes' xla_flags, from the groups of its
# benchmarks/xla_flags_library.py at each recipe's commit. One flag of those groups is left out:
# ``--2a886c8_chip_config_name``, which the public libtpu does not know (MaxText's own Pathways
# runs remove it too).
V5E_2023_FLAGS = f"{DATA_PARALLEL_OVERLAP} {CF_FOR_ALL_GATHER}"

# The flash kernel's blocks of each run, as MaxText tiled it: the v5e runs of 2023 called this
# same Pallas kernel with 512 everywhere (MaxText/layers.py at 9bc243c9); the v6e recipes ran
# splash attention, whose sa_block_* (the recipe's, else base.yml's 512) map field for field:
# sa_block_q → block_q, sa_block_kv → block_k(_major), sa_block_q_dkv → block_q(_major)_dkv,
# sa_block_kv_dkv → block_k(_major)_dkv, sa_block_q_dq → block_q_dq, sa_block_kv_dq → block_k(_major)_dq.
FLASH_512 = dict.fromkeys(FLASH_BLOCK_FIELDS, 512)
FLASH_2048 = dict.fromkeys(FLASH_BLOCK_FIELDS, 2048)
"""Llama 3.1 8B's recipe: every sa_block_* 2048."""
SPLASH_70B = FLASH_512 | {"block_q": 1024, "block_q_major_dkv": 2048, "block_q_dkv": 2048, "block_q_dq": 2048}
"""Llama 2 70B's recipe: sa_block_q 1024, sa_block_q_dkv and sa_block_q_dq 2048, the rest 512."""

RUNS = [
    Run("v5e-16b", "gps16", "v5e:16x16", 6, 2048, FULL, causal=False, convention="6N",
        published="120 TFLOP/s per chip, 61.10% MFU", tflops=120.0, mfu=0.6110,
        xla_flags=V5E_2023_FLAGS,
        source="MaxText 9bc243c9: README.md (1x v5e-256), MaxText/configs/largest_job/16b.sh",
        attention_blocks=FLASH_512, choices=[FULL, MINIMAL, SAVE_QKV, QKV_OFFLOADED]),
    Run("v5e-32b", "gps32", "v5e:16x16", 4, 2048, FULL, causal=False, convention="6N",
        published="132 TFLOP/s per chip, 66.86% MFU", tflops=132.0, mfu=0.6686,
        xla_flags=V5E_2023_FLAGS,
        source="MaxText 9bc243c9: README.md, MaxText/configs/largest_job/32b.sh",
        attention_blocks=FLASH_512, choices=[FULL, MINIMAL, SAVE_QKV, QKV_OFFLOADED]),
    Run("v5e-64b", "gps64", "v5e:16x16", 2, 2048, FULL, causal=False, convention="6N",
        published="118 TFLOP/s per chip, 59.90% MFU", tflops=118.0, mfu=0.5990,
        xla_flags=V5E_2023_FLAGS,
        source="MaxText 9bc243c9: README.md, MaxText/configs/largest_job/64b.sh",
        attention_blocks=FLASH_512, choices=[FULL, MINIMAL, SAVE_QKV, QKV_OFFLOADED]),
    Run("v6e-llama3.1-8b", "llama3.1-8b", "v6e:16x16", 4, 8192, OFFLOAD_QKVO, causal=True, convention="matmuls",
        published="4.546 s a step, 417.397 TFLOP/s, 7,207 tokens/s per chip, 45.46% MFU", step_seconds=4.546,
        xla_flags=" ".join([DENSE_VMEM_LIMIT, LAYOUT_FOR_ALL_REDUCE_SCATTER, DATA_PARALLEL_OVERLAP, CF_FOR_ALL_GATHER,
                             SPARSECORE_ALL_REDUCE, HOST_OFFLOAD]),
        search_flags=DENSE_VMEM_LIMIT,
        source="MaxText tpu-recipes-v0.1.4 (9f1820b4): benchmarks/maxtext_trillium_model_configs.py llama3_1_8b_8192; "
               "log in AI-Hypercomputer/tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-256",
        note="remat_policy custom: decoder_layer_input, query/key/value/out_proj offloaded",
        attention_blocks=FLASH_2048, choices=[OFFLOAD_QKVO, FULL, OFFLOAD_INPUT, INPUT_OFFLOADED_QKV_KEPT]),
    Run("v6e-llama2-70b", "llama2-70b", "v6e:16x16", 2, 4096, QKV_OFFLOADED, causal=True, convention="matmuls",
        published="9.052 s a step, 402.274 TFLOP/s, 905 tokens/s per chip, 43.8% MFU", step_seconds=9.052,
        xla_flags=" ".join([DENSE_VMEM_LIMIT, CF_FOR_ALL_GATHER, SPARSECORE_ALL_REDUCE]),
        search_flags=DENSE_VMEM_LIMIT,
        source="MaxText 140addcb: benchmarks/maxtext_trillium_model_configs.py llama2_70b_4096_sc; log in "
               "AI-Hypercomputer/tpu-recipes training/trillium/Llama2-70B-MaxText",
        note="ici_fsdp_transpose_parallelism 256: FSDP over every chip, as here",
        attention_blocks=SPLASH_70B, choices=[QKV_OFFLOADED, FULL, MINIMAL, SAVE_QKV]),
]
"""MaxText's published runs that FSDP alone expresses (its v5p runs all split tensors over a
``tensor`` axis, which the built-in sharding here does not: left out), on two TPU
generations, two of them offloading. Llama 3.1 70B on v6e-256 (960 tokens/s a chip, offloading)
is left out for this machine's time: its figure is MaxText's approximate tokens/s. Sources are MaxText's repository
(github.com/AI-Hypercomputer/maxtext) at the commit named."""


def label(choice: str | dict[str, Any]) -> str:
    """A space's choice by name."""
    return choice if isinstance(choice, str) else choice["label"]


def layer_policy(choice: str | dict[str, Any]) -> LayerPolicy:
    """The policy a space's choice gives each layer."""
    if isinstance(choice, str):
        return LayerPolicy(kind=choice)
    if "per_name" in choice:
        split = choice["per_name"]
        return LayerPolicy(kind="per_name", names=tuple(sorted(split["device"])), offload=tuple(sorted(split["offload"])))
    kind = "offload" if "offload" in choice else "names"
    return LayerPolicy(kind=kind, names=tuple(sorted(choice[kind])))


def maxtext_tflops(run: Run) -> float:
    """MaxText's count of one step's training FLOPs per chip, in TFLOP, as its figure was made:
    ``6N``: 6 · parameters · tokens + 12 · heads · layers · head_dim · seq² · batch (train.py,
    2023, attention counted whole); ``matmuls``: 3 × (each layer's weight matmuls and the
    logits' + 4 · batch · seq² · heads · head_dim of attention a layer) (maxtext_utils, before
    it halved attention for causality in 2025-07)."""
    m, b, s = MODELS[run.model], run.per_device_batch, run.seq
    attention = 12 * m.heads * m.layers * m.head_dim * s * s * b
    if run.convention == "6N":
        return (6 * m.params() * s * b + attention) / 1e12
    ffn = 2 * b * s * m.mlp * m.emb * (3 if m.activation == "swiglu" else 2)
    qkv = 2 * b * s * m.emb * (m.heads + 2 * m.kv_heads) * m.head_dim
    projection = 2 * b * s * m.emb * m.heads * m.head_dim
    logits = 2 * b * s * m.emb * m.vocab
    return (3 * (m.layers * (ffn + qkv + projection) + logits) + attention) / 1e12


class Block(nn.Module):
    """One MaxText decoder layer of :class:`Model`'s shape: bf16 compute, f32 weights, flash
    attention (the Pallas TPU kernel), grouped key/value heads repeated for it."""

    shape: Model
    causal: bool
    mesh: Any = None
    blocks: tuple[tuple[str, int], ...] = ()
    """The flash kernel's block sizes, by field (:attr:`Run.attention_blocks`)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.shape
        kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32, "use_bias": False}
        # MaxText names the layer's input, so that a custom policy can offload it: the backward
        # then needs the named copy, not the scan's own stack of inputs.
        x = checkpoint_name(_split_batch(x, self.mesh), "decoder_layer_input")
        h = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32, name="pre_norm")(x)
        q = checkpoint_name(nn.DenseGeneral((s.heads, s.head_dim), name="query", **kw)(h), "query_proj")
        k, v = (checkpoint_name(nn.DenseGeneral((s.kv_heads, s.head_dim), name=n, **kw)(h), f"{n}_proj")
                for n in ("key", "value"))
        if s.kv_heads != s.heads:
            k, v = (jnp.repeat(t, s.heads // s.kv_heads, axis=2) for t in (k, v))
        context = checkpoint_name(_attention(q, k, v, flash=True, mesh=self.mesh, causal=self.causal,
                                                 blocks=dict(self.blocks)), "context")
        attention = checkpoint_name(nn.DenseGeneral(s.emb, axis=(-2, -1), name="out", **kw)(context), "out_proj")
        if not s.parallel:
            x = x + attention
            h = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32, name="mlp_norm")(x)
        if s.activation == "relu":
            hidden = nn.relu(checkpoint_name(nn.Dense(s.mlp, name="wi", **kw)(h), "mlpwi"))
        else:
            gate = checkpoint_name(nn.Dense(s.mlp, name="wi_0", **kw)(h), "mlpwi_0")
            hidden = nn.silu(gate) * checkpoint_name(nn.Dense(s.mlp, name="wi_1", **kw)(h), "mlpwi_1")
        out = checkpoint_name(nn.Dense(s.emb, name="wo", **kw)(hidden), "mlpwo")
        return x + attention + out if s.parallel else x + out


class Decoder(TransformerWorkload):
    """A :class:`Model`, scanned, as a remat-search workload (the factory :func:`workload`)."""

    tensor_names = frozenset({"decoder_layer_input", *QKV, "context", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1",
                              "mlpwo"})

    def __init__(self, model: str | Model, batch: int, seq_len: int, causal: bool,
                 blocks: dict[str, int] | None = None) -> None:
        self.shape = MODELS[model] if isinstance(model, str) else model
        self.causal, self.name = causal, f"maxtext-{model if isinstance(model, str) else 'small'}"
        self.blocks = tuple(sorted((blocks or {}).items()))
        s = self.shape
        super().__init__(TransformerConfig(
            kind="transformer", layers=s.layers, d_model=s.emb, heads=s.heads, d_ff=s.mlp, seq_len=seq_len,
            batch=batch, vocab=s.vocab, dtype="bfloat16", scan=True, attention="flash",
        ))

    def _modules(self) -> dict[str, nn.Module]:
        s = self.shape
        return {
            "embed": nn.Embed(s.vocab, s.emb, dtype=jnp.bfloat16, param_dtype=jnp.float32),
            "block": Block(s, self.causal, self.mesh, self.blocks),
            "final_norm": nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32),
            "logits": nn.Dense(s.vocab, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32),
        }

    def init_params(self, key: jax.Array) -> Any:
        params = super().init_params(key)
        if self.shape.tied:
            del params["logits"]
        return params

    def loss(self, plan: RematPlan):  # type: ignore[no-untyped-def]
        m, tied = self._modules(), self.shape.tied

        def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
            embed = {"params": params["embed"]}
            x = m["embed"].apply(embed, tokens[:, :-1])
            x = scan_layers(plan, lambda p, x: m["block"].apply({"params": p}, x), params["layers"], x)
            x = m["final_norm"].apply({"params": params["final_norm"]}, x)
            logits = (m["embed"].apply(embed, x, method="attend") if tied
                      else m["logits"].apply({"params": params["logits"]}, x)).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return loss_fn


def workload(model: str, batch: int, seq_len: int, causal: bool = True, blocks: dict[str, int] | None = None) -> Decoder:
    """The factory the studies name: ``model`` of :data:`MODELS` at a global ``batch`` of
    ``seq_len`` tokens (the argument's name tells the search the tokens an example holds), its
    flash kernel tiled in ``blocks`` (:attr:`Run.attention_blocks`)."""
    return Decoder(model, batch, seq_len, causal, blocks)


GPU_SCALE = 4
"""The small models measured on a GPU: each run's model with its width, heads and MLP a quarter
(key/value heads at least 1), 4 layers, 2048 tokens, so that every plan runs on one GPU."""


def small(run: Run) -> dict[str, Any]:
    """``run``'s small model, as :func:`gpu_step_time.measure` takes a shape."""
    m = MODELS[run.model]
    shape = Model(4, m.emb // GPU_SCALE, m.heads // GPU_SCALE, max(m.kv_heads // GPU_SCALE, 1), m.head_dim,
                  m.mlp // GPU_SCALE, m.vocab, m.activation, m.parallel, m.tied)
    return {"name": f"{run.name}-small", "layers": shape.layers, "model": shape, "seq_len": 2048,
            "batch": 8 if run.chip == "v5e" else 4, "causal": run.causal}


def small_decoder(shape: dict[str, Any]) -> Decoder:
    """:func:`gpu_step_time.measure`'s ``build``: a :func:`small` shape's workload."""
    return Decoder(shape["model"], shape["batch"], shape["seq_len"], shape["causal"])


def on_gpu(runs: list[Run]) -> None:
    """Each run's small model on this machine's GPU with its published policy, ``full``,
    ``save_qkv_proj`` (and ``dots_no_batch`` beside a published ``full``): measured and estimated step times (``benchmarks/gpu_step_time.py``),
    written to ``results/published_configs_gpu/``."""
    from gpu_step_time import _fresh, _platform, measure

    if _fresh(_platform) != "gpu":
        raise SystemExit("--gpu: this machine's JAX sees no GPU")
    shapes = []
    for run in runs:
        policy = layer_policy(run.policy).model_dump(exclude_defaults=True)
        plans = {label(run.policy): policy, "full": {"kind": "full"}, "save_qkv_proj": {"kind": "names", "names": QKV}}
        if run.policy == FULL:
            plans["dots_no_batch"] = {"kind": "dots_no_batch"}
        shapes.append(small(run) | {"plans": plans})
    measure(shapes, {}, HERE / "results" / "published_configs_gpu", build=small_decoder, keep_hlo=False)


def study_spec(run: Run, storage: str, trials: int, study: str) -> dict[str, Any]:
    """The spec of a study of ``run``: the configuration space at its chips, global batch and HBM."""
    chips, batch = run.chips, run.per_device_batch
    micro = [b for b in range(batch, 0, -1) if batch % b == 0][:3]
    return {
        "study": study, "storage": storage,
        "workload": {"factory": "published_lookalike:workload",
                     "args": {"model": run.model, "batch": chips * batch, "seq_len": run.seq, "causal": run.causal,
                              "blocks": run.attention_blocks}},
        "target": {"platform": "tpu", "topology": run.topology}, "mesh": {"fsdp": chips},
        "space": {"layout": "uniform", "choices": run.choices},
        "configuration": {"batch": micro, "global_batch": chips * batch,
                          "mesh": [{"fsdp": chips}, {"data": 2, "fsdp": chips // 2}]},
        "budget": "device", "trials": trials, "sampler": {"kind": "planner", "seed": 0},
        "timing": {"timeout": "1800s"}, "compilation_cache": None,
    }


def study_names(run: Run) -> tuple[str, str]:
    """The names of ``run``'s two studies: its search, and its compiles under MaxText's flags."""
    return f"published-{run.name}", f"published-{run.name}-maxtext-flags"


def search(run: Run, storage: str, trials: int) -> StudyReport:
    """``run``'s study (``published-<name>``): the configuration space searched, compiled with
    libtpu's default flags (and the run's :attr:`Run.search_flags`)."""
    with libtpu_flags(run.search_flags):
        return remat_search.run(parse_spec(study_spec(run, storage, trials, study_names(run)[0])))


@contextmanager
def libtpu_flags(flags: str) -> Iterator[None]:
    """Within: the workers a study starts compile with the XLA ``flags`` (``LIBTPU_INIT_ARGS``,
    which the study records with its device); none given, with libtpu's defaults."""
    before = os.environ.get("LIBTPU_INIT_ARGS")
    os.environ["LIBTPU_INIT_ARGS"] = flags
    try:
        yield
    finally:
        if before is None:
            del os.environ["LIBTPU_INIT_ARGS"]
        else:
            os.environ["LIBTPU_INIT_ARGS"] = before


def flagged(run: Run, storage: str, searched: StudyReport) -> StudyReport:
    """Study ``published-<name>-maxtext-flags``, compiled with the flags MaxText ran the run
    with: the run's choices at the published configuration (the presets, the published policy
    first) and the search's answer, where that is another: the fidelity figure, and the gain
    where the compiler schedules as MaxText's did."""
    searched_name, name = study_names(run)
    with libtpu_flags(run.xla_flags):
        report = remat_search.run(parse_spec(study_spec(run, storage, len(run.choices), name)))
        found = answer(searched)
        if found is None:
            return report
        params = optuna.load_study(study_name=searched_name, storage=storage).trials[found.number].params
        study = optuna.load_study(study_name=name, storage=storage)
        if all(t.params != params for t in study.trials):
            report = measure_params(study, storage, params)
    return report


class _KeptProgram(TpuAotTarget):
    """A TPU topology that keeps the last program it estimated, and its cost analysis."""

    program, cost = "", {}

    def estimate(self, hlo: str, cost: dict[str, float]) -> StepEstimate:
        self.program, self.cost = hlo, cost
        return super().estimate(hlo, cost)


def _estimates_at_links(name: str, plans: dict[str, str]) -> dict[str, dict[str, float]]:
    """Run ``name``'s ``plans`` (JSON, each with its configuration, by summary) compiled here as
    its study's worker compiles them, each program's step estimated at every :data:`HOST_LINKS`:
    seconds by link (bytes/s, as a string), by summary. In a process of its own: libtpu reads
    ``LIBTPU_INIT_ARGS`` once a process."""
    run = next(r for r in RUNS if r.name == name)
    target = _KeptProgram(TpuTarget(platform="tpu", topology=run.topology))
    found = {}
    for summary, text in plans.items():
        plan = RematPlan.from_json(text)
        c = plan.configuration
        decoder = workload(run.model, c.global_batch, run.seq, run.causal, run.attention_blocks)
        Executables(decoder, target=target, mesh=target.mesh(c.mesh_axes), configuration=c).build(plan)
        found[summary] = {
            f"{link:.0f}": estimate_step(target.program, target.chip.model_copy(update={"host_bytes_per_second": link}),
                                         target.cost).seconds
            for link in HOST_LINKS
        }
    return found


def fitting(report: StudyReport) -> dict[str, str]:
    """The study's candidates within the HBM, each estimated (plan JSON by summary)."""
    return {t.summary(): t.plan.to_json() for t in report.trials if t.step_seconds is not None}


def host_links(run: Run, flags: StudyReport) -> dict[str, dict[str, float]]:
    """What the one figure the step-time model assumes, the host link, decides of ``run``: each
    candidate of its study under MaxText's flags that fits the HBM (``flags``: the published
    configuration's choices and the search's answer), compiled again with those flags and
    estimated with the host link at each of :data:`HOST_LINKS` (see :func:`_estimates_at_links`)."""
    plans = fitting(flags)
    with libtpu_flags(run.xla_flags), ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_estimates_at_links, run.name, plans).result()


def published_trial(run: Run, report: StudyReport) -> TrialResult | None:
    """The study's trial of the published configuration: its policy at the reference configuration."""
    policy = layer_policy(run.policy)
    for t in report.trials:
        c = t.plan.configuration if t.plan is not None else None
        if (c is not None and c.batch == run.per_device_batch and c.accumulation == 1 and dict(c.mesh) == {"fsdp": run.chips}
                and set(t.plan.layers) == {policy}):
            return t
    return None


def compiled(report: StudyReport) -> list[TrialResult]:
    return [t for t in report.trials if t.measurement is not None and t.measurement.compiled]


def plot(results: list[tuple[Run, StudyReport]], path: Path) -> None:
    """Each study's compiled candidates: estimated tokens/s per chip against peak per chip,
    the HBM line, the published configuration and the answer marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), squeeze=False)
    for ax, (run, report) in zip(axes[0], results, strict=True):
        timed = [t for t in report.trials if t.throughput is not None and t.peak_bytes is not None]
        ax.scatter([t.peak_bytes / 2**30 for t in timed], [t.throughput for t in timed], alpha=0.6, s=18)
        hbm = report.budget
        if hbm:
            ax.axvline(hbm / 2**30, color="grey", linestyle="--", label=f"HBM {format_bytes(hbm)}")
        for t, marker, label in ((published_trial(run, report), "s", "published"), (answer(report), "*", "found")):
            if t is not None and t.throughput is not None:
                ax.scatter([t.peak_bytes / 2**30], [t.throughput], marker=marker, s=90, label=label)
        ax.set_title(run.name, fontsize=9)
        ax.set_xlabel("peak per chip (GiB)")
        ax.set_ylabel("tokens/s per chip (est.)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def answer(report: StudyReport) -> TrialResult | None:
    """The highest estimated throughput within the HBM, as the study judged it: its trials'
    stored verdicts, whose peaks were read by the rule of then (jax 0.10: a TPU compiler's peak
    was the device's even where it is the host's, ``MemoryBreakdown.compiler_peak_is_host``)."""
    timed = report.timed()
    return min(timed, key=rank) if report.budget and timed else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", default=[r.name for r in RUNS], help="which of RUNS (default: all)")
    parser.add_argument("--trials", type=int, default=8, help="trials of each study (default 8)")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the kept studies (to --trials in all) instead of searching afresh")
    parser.add_argument("--report", action="store_true",
                        help="write the page again from the studies kept in results/studies (no compiles)")
    parser.add_argument("--gpu", action="store_true",
                        help="on a machine with an NVIDIA GPU: each run's small model measured and estimated instead")
    args = parser.parse_args()
    unknown = set(args.runs) - {r.name for r in RUNS}
    if unknown:
        raise SystemExit(f"--runs: no run named {sorted(unknown)[0]!r}; expected some of {[r.name for r in RUNS]}")
    if args.gpu:
        on_gpu([r for r in RUNS if r.name in args.runs])
        return
    db = HERE / "results" / "studies" / "published_lookalike.db"
    results: list[tuple[Run, StudyReport]] = []
    with_flags: dict[str, StudyReport] = {}
    links: dict[str, dict[str, dict[str, float]]] = json.loads(LINKS.read_text()) if LINKS.exists() else {}
    if args.report:
        stored = {s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{db}")}
        for run in (r for r in RUNS if r.name in args.runs):
            searched_name, flags_name = study_names(run)
            results.append((run, remat_search.load_report(searched_name, f"sqlite:///{db}")))
            if flags_name in stored:
                with_flags[run.name] = remat_search.load_report(flags_name, f"sqlite:///{db}")
    else:
        storage = f"sqlite:///{db}" if args.resume else fresh_storage(db, keep_cache=True)
        stored = {s.study_name for s in optuna.get_all_study_summaries(storage)} if args.resume else set()
        for run in (r for r in RUNS if r.name in args.runs):
            searched_name = study_names(run)[0]
            kept = remat_search.load_report(searched_name, storage) if searched_name in stored else None
            if kept is not None and len(kept.trials) >= args.trials:
                results.append((run, kept))  # searched to --trials already
            else:
                print(f"{run.name}: searching {run.topology}, {args.trials} trials", flush=True)
                results.append((run, search(run, storage, args.trials)))
            print(f"{run.name}: the published configuration and the answer under MaxText's flags", flush=True)
            with_flags[run.name] = flagged(run, storage, results[-1][1])
            if not (args.resume and set(links.get(run.name, {})) == set(fitting(with_flags[run.name]))):
                print(f"{run.name}: those that fit, estimated at host links of "
                      f"{', '.join(f'{b / 1e9:.0f}' for b in HOST_LINKS)} GB/s", flush=True)
                links[run.name] = host_links(run, with_flags[run.name])
                LINKS.write_text(json.dumps(links, indent=1, sort_keys=True) + "\n")
    text = report_text(results, with_flags, links)
    out = HERE / "results" / "published_lookalike.md"
    out.write_text(text)
    plot(results, HERE / "results" / "published_lookalike.png")
    print("\n" + text + f"\nwrote {out} and published_lookalike.png")


def report_text(
    results: list[tuple[Run, StudyReport]], with_flags: dict[str, StudyReport],
    links: dict[str, dict[str, dict[str, float]]] | None = None,
) -> str:
    """The results page: fidelity (under MaxText's flags where ``with_flags`` holds the run's
    study of them), quality, what the host link decides (``links``: :func:`host_links` by run),
    sources."""
    timed = {run.name: t for run, report in results
             if (t := published_trial(run, with_flags.get(run.name, report))) is not None and t.seconds is not None}
    ratios = {run.name: timed[run.name].seconds / run.published_step() for run, _ in results if run.name in timed}
    corrected, loo = leave_one_out(results, ratios)
    fidelity, quality, gains = [], [], []
    for run, report in results:
        mine, found, flags = published_trial(run, report), answer(report), with_flags.get(run.name)
        step, m, est = run.published_step(), MODELS[run.model], timed.get(run.name)
        head = (f"| {run.name} | {run.chips} × {run.chip} | {run.model} ({m.params() / 1e9:.1f} B) | "
                f"{run.per_device_batch} × {run.seq} | {label(run.policy)} | {run.published} | {step:.2f} s | ")
        default = (f"{mine.seconds:.2f} s: {mine.seconds / step:.3f}" if mine is not None and mine.seconds is not None
                   else "—")
        if est is not None:
            e = est.measurement.estimate
            fix = corrected.get(run.name)
            fidelity.append(head + (
                f"{est.seconds:.2f} s{'' if flags else ' (default flags)'} | {e.compute_seconds:.2f} / "
                f"{e.collective_seconds:.2f} / {e.host_wait_seconds:.2f} s | {format_bytes(est.peak_bytes)} | "
                f"**{ratios[run.name]:.3f}** | {f'{fix:.3f}' if fix is not None else '—'} | {default} |"))
        else:
            fidelity.append(head + "not compiled | — | — | — | — | " + default + " |")
        own = compiled(report)
        gain = (found.throughput / mine.throughput - 1) if found and mine and mine.throughput else None
        gains.append(gain)
        quality.append(
            f"| {run.name} | {f'{mine.throughput:,.0f}' if mine and mine.throughput else '—'} | "
            f"{found.summary() if found else '—'} | {format_bytes(found.peak_bytes) if found else '—'} | "
            f"{f'{found.throughput:,.0f}' if found and found.throughput else '—'} | "
            f"{f'{gain:+.1%}' if gain is not None else '—'} | {len(own)} | "
            f"{sum(t.measurement.compile_seconds or 0 for t in own) / 60:.0f} min | {flagged_gain(run, flags, found)} |")
    spread = ""
    if ratios:
        values = list(ratios.values())
        spread = (f"Estimate / published step over {len(values)} runs: min {min(values):.3f}, median "
                  f"{statistics.median(values):.3f}, max {max(values):.3f}; within ±15%: "
                  f"{sum(map(within, values))} of {len(values)} as estimated"
                  + (f"; {sum(within(corrected.get(n, v)) for n, v in ratios.items())} of {len(values)} "
                     f"with the correction where leave-one-out applies it ({len(corrected)} runs corrected, each by "
                     "the other runs of its generation)" if corrected else "") + ".\n\n" + loo)
    beaten = sum(1 for g in gains if g is not None and g >= 0.05)
    first = results[0][1] if results else None
    trials = {len(report.trials) for _, report in results}
    command = "python benchmarks/published_lookalike.py" + (f" --trials {trials.pop()}" if len(trials) == 1 else "")
    studies = [r for _, r in results] + list(with_flags.values())
    compile_minutes = sum(t.measurement.compile_seconds or 0 for r in studies for t in compiled(r)) / 60
    gpu = HERE / "results" / "published_configs_gpu" / "gpu_step_time.md"
    return "\n".join([
        "# MaxText's published TPU runs: the step-time model's fidelity and the search's answers\n",
        f"Command: `{command}` (the page again from the kept studies: `--report`); "
        f"{versions(first) if first else ''}; {compile_minutes:.0f} min of compiles on this 2-core machine. Each study "
        f"compiles its candidates ahead of time for the run's slice (a chip's share of the step), and the step-time "
        f"model estimates each (host transfers at {TPU_HOST_BYTES_PER_SECOND / 1e9:.0f} GB/s a chip, overlapped with "
        f"the compute between a transfer's start and its done; collectives not overlapped). The search compiles "
        "with libtpu's default flags (the v6e runs' with one of MaxText's, "
        f"`{DENSE_VMEM_LIMIT}`: their attention blocks do not compile in less VMEM); the fidelity figures, and the last column of the quality table, come from a "
        "second study of each run (`published-<run>-maxtext-flags`: the published configuration and the search's "
        "answer) compiled with the XLA flags MaxText ran the run with (`LIBTPU_INIT_ARGS`, under Sources).\n",
        "## Fidelity: the published configuration's estimate against its published step\n",
        "| run | chips | model | batch a chip × tokens | remat | published | published step | estimated step, "
        "MaxText's flags | compute / collectives / host wait | compiled peak a chip | est. / published | "
        "corrected (leave-one-out) | default flags: est. step, / published |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *fidelity, "", spread,
        "## Quality: the configuration space searched at the same chips, global batch and HBM\n",
        "Micro-batch (the published per-chip batch or a divisor, with gradient accumulation making up the rest), "
        "mesh (FSDP over every chip, or data 2 × FSDP), one remat policy for every layer (the run's own, "
        "and the choices each source line names). Throughput is estimated tokens/s per chip, both sides "
        "from the same model, so a per-generation correction would not change the gain.\n",
        "| run | published config, est. tokens/s | best found | its peak | its est. tokens/s | gain | compiles | "
        "compile time | MaxText's flags: published → found, est. tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
        *quality, "",
        f"Published configurations beaten by ≥ 5% estimated throughput: {beaten} of {len(quality)}.\n",
        *link_section(results, with_flags, links or {}),
        "## Every candidate compiled\n",
        "Why a published configuration was or was not beaten, candidate by candidate: each study's compiles, "
        "with the compiler's peak a chip against the chip's HBM and the estimated throughput.\n",
        "| run | candidate | peak a chip | within HBM | est. step | est. tokens/s per chip | vs published |",
        "|---|---|---|---|---|---|---|",
        *candidate_rows(results), "",
        "## Sources\n",
        *(f"- **{run.name}**: {run.source}.{' ' + run.note + '.' if run.note else ''} Choices: "
          f"{', '.join(label(c) for c in run.choices)}. Flash attention's blocks (Pallas's `BlockSizes`): "
          f"{', '.join(f'{k} {v}' for k, v in run.attention_blocks.items())}. `LIBTPU_INIT_ARGS`: `{run.xla_flags}`."
          for run, _ in results),
        "",
        "![each study's candidates](published_lookalike.png)\n",
        *(["## On a GPU: each run's small model, measured\n",
           f"`python benchmarks/published_lookalike.py --gpu` on one GPU ({GPU_SCALE}× narrower, 4 layers, 2048 tokens; "
           "`results/published_configs_gpu/`):\n", gpu.read_text()] if gpu.exists() else []),
    ])


def link_section(
    results: list[tuple[Run, StudyReport]], with_flags: dict[str, StudyReport], links: dict[str, dict[str, dict[str, float]]]
) -> list[str]:
    """The page's section on the host link: each run's published configuration and its best
    candidate under MaxText's flags, estimated at each of :data:`HOST_LINKS`."""
    rows, beaten = [], dict.fromkeys(HOST_LINKS, 0)
    for run, _ in results:
        mine = published_trial(run, with_flags[run.name]) if run.name in with_flags else None
        found = links.get(run.name)
        if mine is None or not found or mine.summary() not in found:
            continue
        published, cells = found[mine.summary()], []
        for link in HOST_LINKS:
            key = f"{link:.0f}"
            best = min(found, key=lambda s: found[s][key])  # one global batch: the least step, the most tokens/s
            gain = published[key] / found[best][key] - 1
            beaten[link] += gain >= 0.05
            cells.append(f"{published[key]:.2f} s: {published[key] / run.published_step():.3f} | "
                         f"{best if best != mine.summary() else 'the published'}: {gain:+.1%}")
        rows.append(f"| {run.name} | {len(found)} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    gbs = [f"{link / 1e9:.0f} GB/s" for link in HOST_LINKS]
    return [
        "## The host link: the one figure the estimates assume\n",
        f"Google Cloud publishes no per-chip host link; the estimates above take {gbs[0]} one way (the figure of "
        "\"How to Scale Your Model\"). Every candidate of each study under MaxText's flags that fits the HBM "
        "(the published configuration's choices and the search's answer) compiled again with those flags and "
        f"estimated with the host link at {', '.join(gbs)} (PCIe Gen5 ×8 and ×16: Google Cloud's v6e page says "
        "PCIe Gen5, not how wide), by `host_links()`. A run whose candidates offload nothing does not move.\n",
        "| run | candidates | " + " | ".join(f"published config at {g}: est. step, / published | best at {g}: gain"
                                            for g in gbs) + " |",
        "|---|---|" + "---|---|" * len(HOST_LINKS),
        *rows, "",
        "Published configurations beaten by ≥ 5% estimated throughput among these candidates: "
        + ", ".join(f"{beaten[link]} of {len(rows)} at {g}" for link, g in zip(HOST_LINKS, gbs, strict=True)) + ".\n",
    ]


def flagged_gain(run: Run, flags: StudyReport | None, found: TrialResult | None) -> str:
    """Under MaxText's flags: the published configuration's and the answer's estimated tokens/s
    a chip, and the gain (the answer's trial found in ``flags`` by its plan)."""
    mine = published_trial(run, flags) if flags else None
    if mine is None or not mine.throughput or found is None:
        return "—"
    again = next((t for t in flags.trials if t.plan == found.plan and t.status != "waiting"), None)
    if again is None:
        return f"{mine.throughput:,.0f} → not compiled"
    if again.throughput is None:
        peak = f" ({format_bytes(again.peak_bytes)})" if again.peak_bytes else ""
        return f"{mine.throughput:,.0f} → **{again.status.replace('_', ' ')}**{peak}"
    return f"{mine.throughput:,.0f} → {again.throughput:,.0f}: {again.throughput / mine.throughput - 1:+.1%}"


def candidate_rows(results: list[tuple[Run, StudyReport]]) -> list[str]:
    """A row a compiled candidate of each study, in the order compiled."""
    rows = []
    for run, report in results:
        mine = published_trial(run, report)
        for t in compiled(report):
            fits = t.peak_bytes is not None and report.budget is not None and t.peak_bytes <= report.budget
            seconds = t.measurement.estimated_seconds  # estimated whether it fits or not
            rate = t.plan.configuration.global_batch * run.seq / run.chips / seconds if seconds else None
            vs = f"{rate / mine.throughput - 1:+.1%}" if rate and mine and mine.throughput else "—"
            rows.append(
                f"| {run.name} | {t.summary()}{' (published)' if t is mine else ''} | "
                f"{format_bytes(t.peak_bytes) if t.peak_bytes else '—'} | {'yes' if fits else '**no**'} | "
                f"{f'{seconds:.2f} s' if seconds else '—'} | {f'{rate:,.0f}' if rate else '—'} | {vs} |")
    return rows


def within(ratio: float) -> bool:
    """Whether an estimate / published ratio meets the issue's fidelity target, ±15%."""
    return abs(ratio - 1) <= 0.15


def leave_one_out(results: list[tuple[Run, StudyReport]], ratios: dict[str, float]) -> tuple[dict[str, float], str]:
    """A per-generation correction, where it improves the estimate of each run left out: each
    run divided by the mean ratio of the other runs of its chip. Returns the corrected ratios
    (of the generations where leave-one-out error falls with it) and a line a generation."""
    corrected, lines = {}, []
    for chip in sorted({run.chip for run, _ in results}):
        names = [run.name for run, _ in results if run.chip == chip and run.name in ratios]
        if len(names) < 2:
            lines.append(f"- {chip}: {len(names)} run, no correction can be checked.")
            continue
        fixed = {n: ratios[n] / statistics.mean(ratios[o] for o in names if o != n) for n in names}
        before = statistics.mean(abs(ratios[n] - 1) for n in names)
        after = statistics.mean(abs(fixed[n] - 1) for n in names)
        if after < before:
            corrected.update(fixed)
        lines.append(f"- {chip}: mean |est./published − 1| {before:.1%} uncorrected, {after:.1%} with each run "
                     f"divided by the mean of the other {len(names) - 1}: "
                     f"{'applied' if after < before else 'not applied'}.")
    return corrected, "Leave-one-out, by generation:\n\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
