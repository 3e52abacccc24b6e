"""What an unscanned MaxText compile costs: MaxText's own train step (``workload: {kind:
maxtext}``) at several depths, its decoder scanned (``scan_layers: true``, MaxText's default) and
unscanned, each compiled for this machine's CPU, side by side in one run.

    python benchmarks/maxtext_unscanned.py            # depths 4, 8, 16 and 32

MaxText 0.2.5 applies one remat policy to every layer either way (its config has one
``remat_policy``), so an unscanned compile buys no plan a scanned one lacks: this is the price
of compiling it. Prints a table and writes ``benchmarks/results/maxtext_unscanned.md``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from pathlib import Path

from remat_search.plans.plan import RematPlan
from remat_search.spec.workloads import MaxTextConfig
from remat_search.units import format_bytes
from remat_search.workloads.base import build_workload

OUT = Path(__file__).resolve().parent / "results" / "maxtext_unscanned.md"
MODEL = {  # a small MaxText decoder (its base.yml's llama2 block), so each compile takes seconds
    "base_emb_dim": 256, "base_num_query_heads": 4, "base_num_kv_heads": 4, "head_dim": 64, "base_mlp_dim": 1024,
    "vocab_size": 1024, "max_target_length": 256, "per_device_batch_size": 2, "dataset_type": "synthetic",
    "enable_checkpointing": False, "attention": "dot_product",
}


def compile_once(layers: int, scan: bool) -> tuple[float, int]:
    """Seconds to lower and compile the step at ``layers`` layers, and the compiled temp bytes."""
    workload = build_workload(MaxTextConfig(kind="maxtext", overrides={
        **MODEL, "base_num_decoder_layers": layers, "scan_layers": scan}))
    workload.use_mesh(None)
    start = time.perf_counter()
    step = workload.step(RematPlan.uniform("full", layers))
    with workload.tracing():
        compiled = step.lower(*workload.abstract_inputs()).compile()
    return time.perf_counter() - start, compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[4, 8, 16, 32])
    args = parser.parse_args()
    compile_once(2, True)  # MaxText's first build imports and traces what later ones reuse
    rows = []
    for layers in args.layers:
        scanned, scanned_temp = compile_once(layers, True)
        unscanned, unscanned_temp = compile_once(layers, False)
        rows.append(f"| {layers} | {scanned:.1f} s | {unscanned:.1f} s | **{unscanned / scanned:.1f}×** | "
                    f"{format_bytes(scanned_temp)} | {format_bytes(unscanned_temp)} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "# What an unscanned MaxText compile costs\n",
        f"Command: `python benchmarks/maxtext_unscanned.py`; MaxText {importlib.metadata.version('maxtext')}, "
        "this machine's CPU (2 cores, other work beside it), `remat_policy: full`. Seconds from building the step "
        "to the compiled executable (MaxText's config and model built, traced, lowered and compiled), scanned "
        "(`scan_layers: true`) and unscanned, side by side in one run; the ratio is what to read.\n",
        "| layers | scanned | unscanned | unscanned / scanned | temp, scanned | temp, unscanned |",
        "|---|---|---|---|---|---|",
        *rows, "",
    ])
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
