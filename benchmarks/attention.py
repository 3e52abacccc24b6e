"""The v5e write-up configuration's uniform presets with dense and with flash attention, side by
side: per-chip peak, activations (the compiled temp bytes), estimated step (the per-instruction
model of ``remat_search.targets.step_time``, and the whole-program roofline beside it) and GFLOP, each
from one ahead-of-time compile by the real TPU compiler (nothing runs; the figures are
deterministic).

    python benchmarks/attention.py                       # both, 14 compiles (~1-2 min each here)
    python benchmarks/attention.py --attention flash     # one column of the table only

The configuration is ``search_spaces/v5e-writeup.yaml``'s: 8 layers, d_model 2048, 32 × 2048
tokens in bf16, data parallel over ``v5e:2x4``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from remat_search import RematPlan, build_workload, load_spec
from remat_search.measure.executables import Executables, measure
from remat_search.spec.models import TimingConfig
from remat_search.targets.base import target_of
from remat_search.units import format_bytes

SPEC = Path(__file__).resolve().parents[1] / "search_spaces" / "v5e-writeup.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=["dense", "flash"], action="append")
    args = parser.parse_args()
    spec = load_spec(SPEC)
    target = target_of(spec.target)
    rows = []
    for attention in args.attention or ["dense", "flash"]:
        workload = build_workload(spec.workload.model_copy(update={"attention": attention}))
        executables = Executables(workload, target=target, mesh=target.mesh(spec.mesh))
        for choice in spec.space.choices:
            plan = RematPlan.uniform(choice.policy, workload.layers)
            start = time.perf_counter()
            m = measure(executables, plan, budget=2**40, timing=TimingConfig(), gradient_tolerance=1e-3)
            seconds = time.perf_counter() - start
            if m.memory is None:
                rows.append((attention, choice.label, m.status, "", "", "", "", f"{seconds:.0f} s"))
                continue
            rows.append((
                attention, choice.label, format_bytes(m.peak_bytes or 0), format_bytes(m.memory.temp),
                f"{(m.estimated_seconds or 0) * 1e3:.1f} ms",
                f"{(m.estimate.roofline_seconds or 0) * 1e3:.1f} ms" if m.estimate else "",
                f"{(m.flops or 0) / 1e9:,.0f}", f"{seconds:.0f} s",
            ))
            print(" | ".join(rows[-1]), flush=True)
    print()
    print("| attention | plan | peak / chip | activations (temp) | est. step | whole-program roofline | GFLOP / chip "
          "| compile |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
