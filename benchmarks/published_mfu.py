"""The step-time model against a published measurement: MaxText's 16B model on TPU v5e.

One command, from any machine with libtpu (``pip install -e '.[tpu]'``):

    python benchmarks/published_mfu.py                    # v5e:16x16, as measured
    python benchmarks/published_mfu.py --topology v5e:4x4 --layers 2   # a quick look

MaxText publishes, for its 16B configuration on one v5e-256 slice, 120 TFLOP/s per chip,
61.10% MFU (``MaxText/configs/v5e/README.md``; the run is ``MaxText/configs/v5e/16b.sh``:
``global_parameter_scale=16 per_device_batch_size=6 remat_policy=full max_target_length=2048
attention=flash``). With ``base.yml``'s defaults, scale 16 is: 32 decoder layers, width 4096,
64 query and 64 key/value heads of 128, a gated SiLU MLP of 28,672, vocabulary 32,000, weights
in float32 and activations in bfloat16, parameters and optimizer state split over every chip
(FSDP), the batch too.

This file builds that model as a workload factory (:class:`MaxText16B`: the same shapes, the
same matmuls; RMSNorm; no rotary embedding, which is elementwise work), compiles one step of it
with every layer fully rematerialised (``full``, MaxText's ``remat_policy=full``) for the
topology ahead of time, and compares the library's estimated step time with the step time the
published figure implies: MaxText's own count of the step's model FLOPs per chip (its
``calculate_tflops_training_per_device``, the non-causal form its table was made with:
the recomputation is not counted) over 120 TFLOP/s. A ratio above 1 means the estimate is slower
than the measured run. The estimate prices collectives unoverlapped, which MaxText's run overlaps
(its ``LIBTPU_INIT_ARGS`` turn on collective fusion and overlap): the table gives the estimate
with and without them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from search_quality_tpu import fresh_storage, versions

import remat_search
from remat_search.plans.plan import RematPlan, scan_layers
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TpuTarget
from remat_search.spec.workloads import TransformerConfig
from remat_search.targets.base import target_of
from remat_search.workloads.transformer import TransformerWorkload, _attention, _split_batch
from remat_search.units import format_bytes

HERE = Path(__file__).resolve().parent

PUBLISHED_TFLOPS = 120.0
"""TFLOP/s per chip, 16B on 1x v5e-256 (MaxText/configs/v5e/README.md, which gives 61.10% MFU)."""
PEAK_TFLOPS = 197.0
"""v5e's bf16 peak, the one MaxText's MFU divides by (120 / 197 = 60.9%)."""
SHAPE = {"layers": 32, "emb": 4096, "heads": 64, "head_dim": 128, "mlp": 28672, "seq": 2048, "vocab": 32000,
         "per_chip_batch": 6}


class Block(nn.Module):
    """One MaxText llama2-style decoder layer: RMSNorm, q/k/v of ``heads × head_dim``, causal
    flash attention, output projection, RMSNorm, gated SiLU MLP; f32 weights, bf16 compute."""

    heads: int
    head_dim: int
    mlp: int
    mesh: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32, "use_bias": False}
        x = _split_batch(x, self.mesh)
        h = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32, name="attn_norm")(x)
        q, k, v = (
            checkpoint_name(nn.DenseGeneral((self.heads, self.head_dim), name=n, **kw)(h), f"{n}_proj")
            for n in ("query", "key", "value")
        )
        context = checkpoint_name(_attention(q, k, v, flash=True, mesh=self.mesh), "context")
        x = x + checkpoint_name(nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name="out", **kw)(context), "out_proj")
        h = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32, name="mlp_norm")(x)
        gate = checkpoint_name(nn.Dense(self.mlp, name="wi_0", **kw)(h), "mlpwi_0")
        up = checkpoint_name(nn.Dense(self.mlp, name="wi_1", **kw)(h), "mlpwi_1")
        return x + checkpoint_name(nn.Dense(x.shape[-1], name="wo", **kw)(nn.silu(gate) * up), "mlpwo")


class MaxText16B(TransformerWorkload):
    """MaxText's scale-16 decoder (see the module doc), scanned, as a remat-search workload."""

    name = "maxtext-16b"
    tensor_names = frozenset({"query_proj", "key_proj", "value_proj", "context", "out_proj",
                              "mlpwi_0", "mlpwi_1", "mlpwo"})

    def __init__(self, layers: int, batch: int) -> None:
        s = SHAPE
        super().__init__(TransformerConfig(
            kind="transformer", layers=layers, d_model=s["emb"], heads=s["heads"], d_ff=s["mlp"], seq_len=s["seq"],
            batch=batch, vocab=s["vocab"], dtype="bfloat16", scan=True, attention="flash",
        ))

    def _modules(self) -> dict[str, nn.Module]:
        s = SHAPE
        return {
            "embed": nn.Embed(s["vocab"], s["emb"], dtype=jnp.bfloat16, param_dtype=jnp.float32),
            "block": Block(s["heads"], s["head_dim"], s["mlp"], self.mesh),
            "final_norm": nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32),
            "logits": nn.Dense(s["vocab"], use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32),
        }

    def loss(self, plan: RematPlan):  # type: ignore[no-untyped-def]
        m = self._modules()

        def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
            x = m["embed"].apply({"params": params["embed"]}, tokens[:, :-1])
            x = scan_layers(plan, lambda p, x: m["block"].apply({"params": p}, x), params["layers"], x)
            x = m["final_norm"].apply({"params": params["final_norm"]}, x)
            logits = m["logits"].apply({"params": params["logits"]}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return loss_fn


def workload(layers: int = SHAPE["layers"], batch: int = 256 * SHAPE["per_chip_batch"]) -> MaxText16B:
    """The factory the spec names."""
    return MaxText16B(layers, batch)


def model_tflops_per_chip(layers: int) -> float:
    """MaxText's ``calculate_tflops_training_per_device`` for the 16B config at ``layers``
    layers, per chip: weights' matmuls ×3 (forward and backward) and the non-causal attention
    (4·B·S²·heads·head_dim a layer, ×3), recomputation not counted."""
    s = SHAPE
    b, t = s["per_chip_batch"], s["seq"]
    ffn = 2 * b * t * s["mlp"] * s["emb"] * 2 + 2 * b * t * s["mlp"] * s["emb"]
    qkv = 2 * b * t * s["emb"] * 3 * s["heads"] * s["head_dim"]
    projection = 2 * b * t * s["emb"] * s["heads"] * s["head_dim"]
    embedding = 2 * b * t * s["emb"] * s["vocab"]
    attention = 4 * b * t**2 * s["heads"] * s["head_dim"]
    return (((ffn + qkv + projection) * layers + embedding) * 3 + attention * layers * 3) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5e:16x16", help="the slice to compile for (default v5e:16x16, as measured)")
    parser.add_argument("--layers", type=int, default=SHAPE["layers"])
    args = parser.parse_args()
    chips = len(target_of(TpuTarget(platform="tpu", topology=args.topology)).devices())
    study = f"maxtext-16b-{args.topology.replace(':', '-')}-{args.layers}"
    began = time.perf_counter()
    report = remat_search.run(parse_spec({
        "study": study, "storage": fresh_storage(HERE / "results" / "studies" / "published_mfu.db", keep_cache=False),
        "workload": {"factory": "published_mfu:workload",
                     "args": {"layers": args.layers, "batch": chips * SHAPE["per_chip_batch"]}},
        "target": {"platform": "tpu", "topology": args.topology}, "mesh": {"fsdp": chips},
        "space": {"layout": "uniform", "choices": ["full"]}, "trials": 1, "budget": None,
        "sampler": {"kind": "random", "seed": 0}, "compilation_cache": None,
    }))
    trial = report.trials[0]
    m = trial.measurement
    if m is None or m.estimate is None or trial.seconds is None:
        raise SystemExit(f"the compile gave no estimate: {trial.status} {trial.error or ''}")
    e = m.estimate
    tflops = model_tflops_per_chip(args.layers)
    measured = tflops / PUBLISHED_TFLOPS
    rows = [
        ("published (MaxText, 1x v5e-256)", measured, PUBLISHED_TFLOPS),
        (f"estimate, `{m.time_model}` model", e.seconds, tflops / e.seconds),
        ("estimate without collectives (all overlapped)", e.compute_seconds, tflops / e.compute_seconds),
        ("whole-program roofline", e.roofline_seconds, tflops / e.roofline_seconds if e.roofline_seconds else None),
    ]
    lines = [
        "# The step-time model against MaxText's published 16B run on v5e\n",
        f"Command: `python benchmarks/published_mfu.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`; "
        f"{versions(report)}; compiled for {args.topology} ({chips} chips), {args.layers} layers, full remat, "
        f"{SHAPE['per_chip_batch']} × {SHAPE['seq']} tokens a chip.\n",
        f"Per chip: compiled peak {format_bytes(trial.peak_bytes)}; MaxText's count of the step's model FLOPs "
        f"{tflops:,.1f} TFLOP; the model's count of the compiled program's matmul FLOPs {e.flops / 1e12:,.1f} TFLOP "
        f"(recomputation included); HBM traffic {e.hbm_bytes / 2**30:,.0f} GiB; collectives "
        f"{e.collective_bytes / 2**30:,.1f} GiB received, {e.collective_seconds:.3f} s at the modelled ICI bandwidth. "
        f"Compile {m.compile_seconds:.0f} s; whole run {time.perf_counter() - began:.0f} s.\n",
        "| step time per chip | seconds | model TFLOP/s per chip | MFU | vs published step |",
        "|---|---|---|---|---|",
    ]
    for label, seconds, rate in rows:
        if seconds is not None and rate is not None:
            lines.append(f"| {label} | {seconds:.3f} | {rate:.1f} | {rate / PEAK_TFLOPS:.1%} | {seconds / measured:.2f} |")
    text = "\n".join(lines) + "\n"
    out = HERE / "results" / "published_mfu.md"
    out.write_text(text)
    print("\n" + text + f"\nwrote {out}")


if __name__ == "__main__":
    main()
