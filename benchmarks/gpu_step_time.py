"""The step-time model on an NVIDIA GPU, against measured step times.

The step-time model (:func:`remat_search.targets.step_time.estimate_step`) was built for TPU
programs; this checks it on a GPU, where every plan can also be run. On a machine with one
NVIDIA GPU (H100 or H200, :data:`~remat_search.targets.step_time.GPUS`):

    python benchmarks/gpu_step_time.py --hlo                  # every model × plan: results/gpu_step_time.md,
                                                              # each compiled program under results/hlo
    python benchmarks/gpu_step_time.py --out /tmp/g           # elsewhere
    python benchmarks/gpu_step_time.py --estimate benchmarks/results   # on any machine: the table again,
                                                              # re-estimated from the kept programs

For each small decoder (the built-in transformer, scanned, dense attention as ``auto`` resolves
on a GPU without a mesh: ``jax.nn.dot_product_attention``'s XLA composition) and each plan, it
compiles one training step, runs 3 warm-up and 10 timed steps (the median is reported), and
estimates the step from the compiled program's text for the GPU at hand. Each (model, plan)
runs in its own process: ``memory_stats()["peak_bytes_in_use"]`` is the process's peak so far,
never reset. The table gives the compiler's peak (``memory_analysis``), the runtime's measured
peak, the bytes the plan keeps on the host, the measured and estimated milliseconds and their
ratio (estimated / measured: below 1, the model is faster than the GPU), and the ratio's spread.

:func:`measure` is the library part: other benchmarks call it with their own shapes and their
own ``build`` (a picklable module-level callable from a shape to a workload).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from remat_search.units import format_bytes

RESULTS = Path(__file__).resolve().parent / "results"

MODELS: list[dict[str, Any]] = [
    {"name": "d1024-L8", "d_model": 1024, "layers": 8, "seq_len": 2048, "batch": 8},
    {"name": "d2048-L4", "d_model": 2048, "layers": 4, "seq_len": 2048, "batch": 4},
    {"name": "d1536-L6", "d_model": 1536, "layers": 6, "seq_len": 2048, "batch": 6},
]
"""Small decoders: heads of 128, an MLP four times as wide, a 32,000-token vocabulary, bf16. The
third was measured only on the H200, after a calibration was fitted on the first two: a shape that
calibration never saw (``gpu_calibration.py``)."""

PLANS: dict[str, dict[str, Any]] = {
    "none": {"kind": "none"},
    "dots_no_batch": {"kind": "dots_no_batch"},
    "full": {"kind": "full"},
    "offload_qkv": {"kind": "offload", "names": ["query_proj", "key_proj", "value_proj"]},
    "offload_q": {"kind": "offload", "names": ["query_proj"]},
    "offload_mlpwi": {"kind": "offload", "names": ["mlpwi"]},
}
"""One layer policy each, applied to every layer. The offloading plans move different bytes
(the query: a third of ``offload_qkv``'s; the MLP's input projection: four thirds), so that a
calibration sees how an offload's cost grows with its bytes."""

WARMUP, STEPS = 3, 10

Build = Callable[[dict[str, Any]], Any]
"""From a model's shape (a dict with at least ``name`` and ``layers``) to its workload."""


def transformer(shape: dict[str, Any]) -> Any:
    """The built-in transformer at ``shape`` (``d_model``, ``layers``, ``seq_len``, ``batch``;
    optional ``heads``, ``d_ff``, ``vocab``), scanned over its layers, in bf16."""
    from remat_search.spec.workloads import TransformerConfig
    from remat_search.workloads.base import build_workload

    d = shape["d_model"]
    return build_workload(TransformerConfig(
        kind="transformer", layers=shape["layers"], d_model=d, heads=shape.get("heads", max(d // 128, 1)),
        d_ff=shape.get("d_ff", 4 * d), seq_len=shape["seq_len"], batch=shape["batch"],
        vocab=shape.get("vocab", 32000), dtype="bfloat16", scan=True,
    ))


def measure(models: list[dict[str, Any]], plans: dict[str, dict[str, Any]], out: Path, *,
            build: Build = transformer, keep_hlo: bool = True, trace: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Measure and estimate every (model, plan) on this process's GPU, each in a fresh process
    (a shape's own ``plans``, where it has them, instead of ``plans``);
    write ``out/gpu_step_time.json`` and ``.md`` (and each program's text under ``out/hlo``
    where ``keep_hlo``; a profiler's trace of two more steps of each ``model-plan`` named in
    ``trace``, as ``out/trace-MODEL-PLAN.json.gz``, Perfetto's JSON) and return the rows. A plan that does not compile or run gets a row
    with its ``error``. The calling process must not have started JAX on the GPU (it would
    hold the memory the runs need)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in models:
        for label, layer in shape.get("plans", plans).items():
            hlo = out / "hlo" / f"{shape['name']}-{label}.hlo.gz" if keep_hlo else None
            traced = out / f"trace-{shape['name']}-{label}.json.gz" if f"{shape['name']}-{label}" in trace else None
            try:
                row = _fresh(_one, build, shape, label, layer, hlo, traced)
            except Exception as e:  # noqa: BLE001 - a plan that fails is a row, not the end
                row = {"model": shape["name"], "plan": label, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps(row), flush=True)
            rows.append(row)
            _write(rows, out)
    return rows


def _fresh(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a fresh process (spawned: this one never starts JAX's GPU client,
    which would hold most of the GPU's memory and its peak)."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def _platform() -> str:
    import jax

    return jax.devices()[0].platform


def _one(build: Build, shape: dict[str, Any], label: str, layer: dict[str, Any], hlo: Path | None,
         traced: Path | None = None) -> dict[str, Any]:
    """One (model, plan) in this (fresh) process: compile, run, time, estimate (and trace two
    more steps into ``traced``)."""
    import jax

    from remat_search.measure.executables import Executables
    from remat_search.plans.plan import RematPlan
    from remat_search.targets.local import LocalTarget
    from remat_search.targets.chips import GPUS, gpu_chip
    from remat_search.targets.step_time import estimate_step

    device = jax.devices()[0]
    chip = gpu_chip(device.device_kind) or (GPUS["h100"] if device.platform == "cpu" else None)  # a CPU dry run
    if chip is None:
        raise ValueError(f"no published figures for the GPU {device.device_kind!r}: add it to step_time.GPUS")
    executables = Executables(build(shape), target=LocalTarget(), mesh=None)
    compiled = executables.build(RematPlan.model_validate({"layers": [layer] * shape["layers"]}))
    if compiled.executable is None:
        raise MemoryError(f"the compiler ran out of memory: {compiled.oom}")
    text = compiled.executable.as_text()
    if hlo is not None:
        hlo.parent.mkdir(parents=True, exist_ok=True)
        hlo.write_bytes(gzip.compress(text.encode()))
    state, batch = executables.inputs()
    times = []
    for i in range(WARMUP + STEPS):
        start = time.perf_counter()
        state, loss = compiled.executable(state, batch)
        jax.block_until_ready(loss)
        times += [time.perf_counter() - start] if i >= WARMUP else []
    if traced is not None:
        carried = [state]  # the executable donates its state: each traced step takes the last one's

        def step() -> Any:
            carried[0], traced_loss = compiled.executable(carried[0], batch)
            return traced_loss

        _trace(step, traced)
    estimate = estimate_step(text, chip)
    memory = compiled.memory
    assert memory is not None
    return {
        "model": shape["name"], "plan": label, "device": device.device_kind, "chip": chip.name,
        "compiled_peak": memory.peak, "measured_peak": int((device.memory_stats() or {}).get("peak_bytes_in_use", 0)),
        "host_bytes": memory.host_total, "measured_ms": statistics.median(times) * 1e3,
        "estimated_ms": estimate.seconds * 1e3, "estimated_tflop": estimate.flops / 1e12,
        "estimated_hbm_gb": estimate.hbm_bytes / 1e9, "compile_s": compiled.seconds, "loss": float(loss),
    }


def _trace(step: Callable[[], Any], traced: Path) -> None:
    """Two runs of ``step`` under JAX's profiler, its Perfetto trace written to ``traced``."""
    import shutil
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(2):
                jax.block_until_ready(step())
        shutil.copy(next(Path(folder).rglob("perfetto_trace.json.gz")), traced)


def reestimate(out: Path) -> list[dict[str, Any]]:
    """The rows of ``out/gpu_step_time.json`` estimated again from the programs kept under
    ``out/hlo`` with this checkout's step-time model (on any machine); rewrite the table."""
    from remat_search.targets.chips import gpu_chip
    from remat_search.targets.step_time import estimate_step

    rows = json.loads((out / "gpu_step_time.json").read_text())
    for row in rows:
        hlo = out / "hlo" / f"{row['model']}-{row['plan']}.hlo.gz"
        chip = gpu_chip(row.get("device", ""))
        if "error" not in row and hlo.exists() and chip is not None:
            estimate = estimate_step(gzip.decompress(hlo.read_bytes()).decode(), chip)
            row.update(estimated_ms=estimate.seconds * 1e3, estimated_tflop=estimate.flops / 1e12,
                       estimated_hbm_gb=estimate.hbm_bytes / 1e9)
    _write(rows, out)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of ``rows`` and the spread of estimated / measured."""
    lines = [
        "| model | plan | compiled peak | measured peak | host memory | measured ms | estimated ms | est./meas. |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['plan']} | {r['error'][:120]} | | | | | |")
            continue
        ratio = r["estimated_ms"] / r["measured_ms"]
        ratios.append(ratio)
        lines.append(
            f"| {r['model']} | {r['plan']} | {format_bytes(r['compiled_peak'])} | {format_bytes(r['measured_peak'])} "
            f"| {format_bytes(r['host_bytes'])} | {r['measured_ms']:.1f} | {r['estimated_ms']:.1f} | {ratio:.2f} |"
        )
    if ratios:
        lines += ["", f"est./meas. over {len(ratios)} runs: min {min(ratios):.2f}, median "
                      f"{statistics.median(ratios):.2f}, max {max(ratios):.2f} (max/min {max(ratios) / min(ratios):.2f})"]
    devices = sorted({r["device"] for r in rows if "device" in r})
    return (f"Device: {', '.join(devices) or 'none'}; {WARMUP} warm-up + {STEPS} timed steps, median.\n\n"
            + "\n".join(lines) + "\n")


def samples(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured rows as calibration samples (``remat_search.targets.calibration.Sample``):
    ``remat-search calibrate OUT/samples.json`` fits the step-time model on them."""
    from remat_search.targets.chips import GPUS, gpu_chip

    def kind(plan: dict[str, Any]) -> str:
        return "keep" if plan["kind"] == "none" else "offload" if plan["kind"] == "offload" else "recompute"

    return [{
        "label": f"{r['model']}-{r['plan']}", "chip": next(k for k, c in GPUS.items() if c == gpu_chip(r["device"])),
        "program": f"hlo/{r['model']}-{r['plan']}.hlo.gz", "measured_seconds": r["measured_ms"] / 1e3,
        "kind": kind(PLANS[r["plan"]]), "source": f"{r['device']}, median of {STEPS} steps (gpu_step_time.py)",
    } for r in rows if "error" not in r and r["plan"] in PLANS and gpu_chip(r.get("device", ""))]


def _write(rows: list[dict[str, Any]], out: Path) -> None:
    (out / "gpu_step_time.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "gpu_step_time.md").write_text(table(rows))
    if (out / "hlo").is_dir():
        (out / "samples.json").write_text(json.dumps(samples(rows), indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the table (and programs) go")
    parser.add_argument("--hlo", action="store_true", help="keep each compiled program's text under OUT/hlo")
    parser.add_argument("--models", nargs="*", help="only these of MODELS, by name")
    parser.add_argument("--plans", nargs="*", help="only these of PLANS")
    parser.add_argument("--trace", nargs="*", default=[], metavar="MODEL-PLAN",
                        help="also write a profiler trace of two steps of each (OUT/trace-MODEL-PLAN.json.gz)")
    parser.add_argument("--any-platform", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--estimate", type=Path, metavar="DIR",
                        help="re-estimate DIR's kept programs with this checkout's model (no GPU needed)")
    args = parser.parse_args()
    if args.estimate is not None:
        print(table(reestimate(args.estimate)))
        return
    platform = _fresh(_platform)
    if platform != "gpu" and not args.any_platform:
        print(f"gpu_step_time: needs a GPU; this machine's JAX sees {platform} devices", file=sys.stderr)
        sys.exit(2)
    models = [m for m in MODELS if not args.models or m["name"] in args.models]
    plans = {k: v for k, v in PLANS.items() if not args.plans or k in args.plans}
    print(table(measure(models, plans, args.out, keep_hlo=args.hlo, trace=tuple(args.trace))))


if __name__ == "__main__":
    main()
