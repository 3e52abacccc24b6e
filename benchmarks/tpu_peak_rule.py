"""Which memory figure the TPU compiler's own out-of-memory verdict supports.

One command, from any machine with libtpu (``pip install -e '.[tpu]'``):

    python benchmarks/tpu_peak_rule.py            # see the results file for its time here

On a TPU target ``Compiled.memory_analysis()`` gives two figures of a step's per-chip peak:
the breakdown sum (argument + output − alias + temp + generated code) and the compiler's
``peak_memory_in_bytes``; they can differ by 2× and order plans oppositely. The compiler
itself says which it holds to: it refuses a program too big for a chip's HBM
(``RESOURCE_EXHAUSTED: Ran out of memory on HBM``). For each model, chip and uniform policy
this grows the batch, through the library's own compile path (``Executables.build``, as a
search compiles a plan), until the compiler refuses it, then narrows the flip to 2% of the
batch. A figure the verdict supports is at most the chip's HBM at every batch that fitted (the
compiler rematerialises on its own near the limit, so figures are not monotonic in the batch
there: every fitting compile counts, not only the last), and close to it at the last. ``required`` is what a search records for
a refused plan: the temporaries the error states plus the per-chip arguments and outputs less
donated buffers (``measure.program.io_bytes``).

Also: the small-model inversion (the NNX decoder of ``tests/models/nnx_decoder.py``, 6 blocks of
width 128, batch 8 × 64 tokens on ``v5e:2x2`` as ``data 2 × fsdp 2``), its figures for no remat
and full remat at growing batches.

Writes ``results/tpu_peak_rule.md`` beside this file.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat_search import RematPlan, build_workload
from remat_search.measure.executables import Build, Executables
from remat_search.spec.models import TpuTarget
from remat_search.spec.workloads import MlpConfig, NnxConfig, TransformerConfig
from remat_search.targets.base import target_of

HERE = Path(__file__).resolve().parent
RESOLUTION = 0.02
"""The flip is narrowed until the first refused batch is within 2% of the last that fits."""
FIGURES = ("breakdown_sum", "compiler_peak", "peak", "max")
"""``peak``: the study's (``MemoryBreakdown.peak``), the compiler's unless it is the host's, at
most the HBM the compiler compiled for."""


@dataclass(frozen=True)
class Model:
    name: str
    config: Callable[[int], Any]
    """The workload config at a batch."""
    unit: int
    """The batch moves in multiples of this (the mesh's batch axes)."""
    start: int
    """A batch that fits on every chip swept (the search grows from there)."""
    mesh: dict[str, int] | None = None
    policies: tuple[str, ...] = ("none", "full")
    """The plans swept, one policy for every layer (``offload``: every tagged tensor offloaded)."""


OFFLOADED = ("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi", "mlpwo")
"""What the offloading model's plan puts in host memory: every tensor the transformer tags."""

MODELS = (
    Model("transformer (linen, 2×256, seq 256, f32)", lambda b: TransformerConfig(
        kind="transformer", layers=2, d_model=256, heads=4, d_ff=1024, seq_len=256, batch=b, vocab=512,
        attention="dense"), unit=4, start=1024),
    Model("mlp (4×1024→4096, f32)", lambda b: MlpConfig(kind="mlp", layers=4, width=1024, hidden=4096, batch=b),
          unit=4, start=4096),
    Model("NNX decoder (2×128, seq 256, data 2 × fsdp 2)", lambda b: nnx_decoder(b, layers=2, seq_len=256),
          unit=4, start=1024, mesh={"data": 2, "fsdp": 2}),
    Model("transformer offloading (scanned, 4×512, seq 1024, bf16, flash)", lambda b: TransformerConfig(
        kind="transformer", layers=4, d_model=512, heads=8, d_ff=2048, seq_len=1024, batch=b, vocab=1024,
        dtype="bfloat16", attention="flash", scan=True), unit=4, start=256, policies=("offload",)),
    Model("transformer offloading, deep (scanned, 8×256, seq 512, bf16, flash)", lambda b: TransformerConfig(
        kind="transformer", layers=8, d_model=256, heads=4, d_ff=1024, seq_len=512, batch=b, vocab=512,
        dtype="bfloat16", attention="flash", scan=True), unit=4, start=512, policies=("offload",)),
)
CASES = (("NNX", "v5e:2x2"), ("mlp", "v6e:2x2"), ("transformer (linen", "v5e:2x2"), ("transformer (linen", "v6e:2x2"),
         ("transformer offloading (", "v5e:2x2"), ("transformer offloading, deep", "v5e:2x2"))
"""(model, chip) in the order swept: each flip is written to the results as it is found. Every
model on every chip is ``--cases 6``, with ``MORE``."""
MORE = (("mlp", "v5e:2x2"), ("NNX", "v6e:2x2"))
POLICIES = ("none", "full")
"""The inversion's policies."""


def nnx_decoder(batch: int, *, layers: int, seq_len: int, d_model: int = 128) -> NnxConfig:
    """The issue's NNX decoder (heads 4, MLP 4× the width, vocabulary 512) at a batch."""
    return NnxConfig(kind="nnx", model="tests.models.nnx_decoder:Decoder", args={
        "vocab": 512, "d_model": d_model, "heads": 4, "d_ff": 4 * d_model, "layers": layers,
    }, batch=batch, seq_len=seq_len, vocab=512)


def compile_at(model: Model, topology: str, policy: str, batch: int) -> Build:
    """One compile through the library's path, as a search's worker makes it."""
    workload = build_workload(model.config(batch))
    target = target_of(TpuTarget(platform="tpu", topology=topology))
    executables = Executables(workload, target=target, mesh=target.mesh(model.mesh))
    if policy == "offload":
        return executables.build(RematPlan.model_validate(
            {"layers": [{"kind": "offload", "names": OFFLOADED}] * workload.layers}))
    return executables.build(RematPlan.uniform(policy, workload.layers))


def figures(build: Build) -> dict[str, int]:
    """The figures a fitting compile gives, by name."""
    m = build.memory
    assert m is not None and m.compiler_peak is not None
    return {"breakdown_sum": m.breakdown_sum, "compiler_peak": m.compiler_peak, "peak": m.peak,
            "host": int(m.compiler_peak_is_host),
            "max": max(m.breakdown_sum, m.compiler_peak), "temp": m.temp,
            "io": m.argument + m.output - m.alias, "code": m.generated_code}


@dataclass(frozen=True)
class Flip:
    model: str
    topology: str
    policy: str
    hbm: int
    fit: int
    """The largest batch that fitted…"""
    refused: int
    """…and the smallest refused."""
    fits: dict[int, dict[str, int]]
    """Every fitting compile's figures, by batch."""
    required: int
    """What a search records for the refused batch (temporaries stated + arguments and outputs)."""

    @property
    def at_fit(self) -> dict[str, int]:
        return self.fits[self.fit]

    def highest(self, figure: str) -> float:
        """The largest ``figure`` of a fitting compile, over the HBM."""
        return max(f[figure] for f in self.fits.values()) / self.hbm

    def over(self, figure: str) -> int:
        """How many fitting compiles ``figure`` puts over the HBM (each contradicts it)."""
        return sum(f[figure] > self.hbm for f in self.fits.values())


def find_flip(model: Model, topology: str, policy: str, *, log: Callable[[str], None]) -> Flip:
    """Grow the batch from ``model.start`` until the compiler refuses it; narrow to :data:`RESOLUTION`."""
    fitted: dict[int, dict[str, int]] = {}
    refused: dict[int, tuple[int, int, int]] = {}

    def probe(batch: int) -> None:
        build = compile_at(model, topology, policy, batch)
        if build.oom is not None:
            refused[batch] = build.oom
        else:
            fitted[batch] = figures(build)
        log(f"  {policy} batch {batch}: " + (f"refused, needs {build.oom[0]:,}" if build.oom else
            f"fits, sum {fitted[batch]['breakdown_sum']:,} compiler {fitted[batch]['compiler_peak']:,}"))

    def snap(batch: float) -> int:
        return max(model.unit, round(batch / model.unit) * model.unit)

    probe(model.start)
    if not fitted:
        raise RuntimeError(f"{model.name} on {topology}, {policy}: the start batch {model.start} does not fit")
    while not refused:  # grow: aim past where the compiler's peak, grown in proportion, reaches the HBM
        lo = max(fitted)
        f = fitted[lo]
        grow = 1.05 * (_hbm(topology) - f["io"]) / max(f["compiler_peak"] - f["io"], 1)
        probe(snap(lo * min(max(grow, 1.1), 16)))
    while True:
        lo = max(b for b in fitted if b < min(refused))
        hi = min(refused)
        if hi - lo <= max(model.unit, RESOLUTION * lo):
            break
        # Where the compiler's peak at lo and the bytes required at hi, joined by a line, reach
        # the HBM; kept to the middle 40% of the gap, so that it narrows whatever the line says.
        need_lo, (need_hi, _, hbm) = fitted[lo]["compiler_peak"], refused[hi]
        x = lo + (hi - lo) * (hbm - need_lo) / (need_hi - need_lo) if need_hi > need_lo else (lo + hi) / 2
        batch = snap(min(max(x, lo + 0.3 * (hi - lo)), hi - 0.3 * (hi - lo)))
        if not lo < batch < hi:
            break
        probe(batch)
    lo, hi = max(b for b in fitted if b < min(refused)), min(refused)
    required, _, hbm = refused[hi]
    return Flip(model.name, topology, policy, hbm, lo, hi, fitted, required)


_HBM: dict[str, int] = {}


def _hbm(topology: str) -> int:
    """The chip's HBM as the compiler states it (``target.probe_hbm``)."""
    if topology not in _HBM:
        target = target_of(TpuTarget(platform="tpu", topology=topology))
        _HBM[topology] = target.memory_limit(target.mesh(None))
    return _HBM[topology]


def inversion(log: Callable[[str], None]) -> list[tuple[int, str, dict[str, int]]]:
    """The issue's NNX decoder (6 blocks, width 128, seq 64, data 2 × fsdp 2 on v5e:2x2) at
    growing batches, no remat and full remat."""
    model = Model("nnx6", lambda b: nnx_decoder(b, layers=6, seq_len=64), unit=4, start=8, mesh={"data": 2, "fsdp": 2})
    rows = []
    for batch in (8, 512):
        for policy in POLICIES:
            build = compile_at(model, "v5e:2x2", policy, batch)
            rows.append((batch, policy, figures(build)))
            log(f"  inversion: batch {batch} {policy}: {rows[-1][2]}")
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def markdown(flips: list[Flip], rows: list[tuple[int, str, dict[str, int]]], seconds: float) -> str:
    from importlib.metadata import version

    import jax

    lines = [
        "# Which figure the TPU compiler's out-of-memory verdict supports",
        "",
        f"`python benchmarks/tpu_peak_rule.py`: jax {jax.__version__}, libtpu {version('libtpu')}, "
        f"{seconds / 60:.0f} min on a 2-core CPU host. MiB per chip; HBM as the compiler states it. "
        "Figures at the last batch that fits; `required`: what a search records for the first "
        "refused batch (the temporaries the error states + arguments and outputs − donated). "
        "Highest / HBM: the largest figure of any fitting compile of the sweep over the HBM "
        "(over 100%: the compiler fitted a program the figure says cannot fit), and how many "
        "fitting compiles it put over. The study's peak (`MemoryBreakdown.peak`) is the compiler's peak "
        "unless that is the host's (a program that offloads), then the breakdown sum, either at most "
        "the HBM the compiler compiled the program for: its own verdict.",
        "",
        "| model | chip (HBM) | policy | batch fits / refused | breakdown sum | compiler peak | temp | "
        "required (refused) | sum: highest / HBM | compiler peak: highest / HBM | the study's peak: highest / HBM | "
        "fits whose compiler peak is the host's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in flips:
        lines.append(
            f"| {f.model} | {f.topology} ({_mib(f.hbm)}) | {f.policy} | {f.fit:,} / {f.refused:,} | "
            f"{_mib(f.at_fit['breakdown_sum'])} | {_mib(f.at_fit['compiler_peak'])} | {_mib(f.at_fit['temp'])} | "
            f"{_mib(f.required)} | "
            + " | ".join(f"{f.highest(k):.2%} ({f.over(k)} of {len(f.fits)} over)" for k in FIGURES[:3])
            + f" | {sum(v.get('host', 0) for v in f.fits.values())} of {len(f.fits)} |"
        )
    lines += ["", "Fitting compiles each figure puts over the HBM: " + ", ".join(
        f"{k.replace('_', ' ')} {sum(f.over(k) for f in flips)} of {sum(len(f.fits) for f in flips)}"
        for k in FIGURES) + "; refused batches whose required bytes exceed the HBM: "
        f"{sum(f.required > f.hbm for f in flips)} of {len(flips)}.", ""]
    lines += [
        "## The small-model inversion",
        "",
        "The issue's NNX decoder (6 blocks, width 128, 4 heads, MLP 512, vocabulary 512, 64 tokens) on "
        "v5e:2x2 as data 2 × fsdp 2, per chip, MiB:",
        "",
        "| batch | policy | breakdown sum | compiler peak | temp | generated code | arguments + outputs − alias |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, policy, fig in rows:
        lines.append(f"| {batch:,} | {policy} | {_mib(fig['breakdown_sum'])} | {_mib(fig['compiler_peak'])} | "
                     f"{_mib(fig['temp'])} | {_mib(fig['code'])} | {_mib(fig['io'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=len(CASES), help="sweep the first N of CASES + MORE")
    parser.add_argument("--no-inversion", action="store_true")
    parser.add_argument("--only", help="sweep only the cases whose model name starts with this")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "tpu_peak_rule.md")
    args = parser.parse_args()
    t0 = time.perf_counter()

    def log(s: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f}s] {s}", flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    flips: list[Flip] = []
    rows: list[tuple[int, str, dict[str, int]]] = []
    cases = [c for c in CASES + MORE if args.only is None or c[0].startswith(args.only)] if args.only else (CASES + MORE)[: args.cases]
    for name, topology in cases:
        model = next(m for m in MODELS if m.name.startswith(name))
        for policy in model.policies:
            log(f"{model.name} on {topology}, {policy}")
            flips.append(find_flip(model, topology, policy, log=log))
            args.out.write_text(markdown(flips, rows, time.perf_counter() - t0))
    rows = [] if args.no_inversion else inversion(log)
    args.out.write_text(markdown(flips, rows, time.perf_counter() - t0))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
