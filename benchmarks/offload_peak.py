"""Where offloaded tensors live: the device peak of offloading q, k and v against keeping them,
on an unrolled and on a scanned stack, and when the compiled program brings them back.

One command, from any machine with libtpu (``pip install -e '.[tpu]'``):

    python benchmarks/offload_peak.py

Issue 14's table found that offloading q, k and v (``offload``) gave a *higher* device peak
than keeping them on the device (``names``), on unrolled models. This compiles a 4-layer
decoder (d_model 1024, 16 heads, 2048 tokens, batch 16, bf16, flash attention, data parallel
over ``v5e:2x2``) unrolled and scanned with three plans (q, k, v offloaded; kept on the device;
``full``), and reads each program: its peak (the compiler's), host memory, the bytes the step
time model sees crossing the host link, and, for the offloading programs, each transfer's place
in the schedule. An offloaded tensor that comes back to the device (its host-to-device
``copy-start``) before the last one has left is on the device through the end of the forward
pass, where the peak is, as if it had been kept there. Writes ``results/offload_peak.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from search_quality import markdown

from remat_search.measure.executables import compiler_options
from remat_search.measure.measurement import MemoryBreakdown
from remat_search.plans.plan import RematPlan
from remat_search.spec.models import TpuTarget
from remat_search.spec.workloads import TransformerConfig
from remat_search.targets.base import target_of
from remat_search.targets.hlo import parse, shape_arrays
from remat_search.targets.chips import CHIPS
from remat_search.targets.step_time import estimate_step
from remat_search.targets.traffic import HOST_MEMORY_SPACE
from remat_search.units import format_bytes
from remat_search.workloads.base import build_workload

HERE = Path(__file__).resolve().parent
QKV = ["query_proj", "key_proj", "value_proj"]
PLANS = {"offload q, k, v": {"kind": "offload", "names": QKV}, "keep q, k, v": {"kind": "names", "names": QKV},
         "full": {"kind": "full"}}
MODEL = {"kind": "transformer", "layers": 4, "d_model": 1024, "heads": 16, "d_ff": 4096, "seq_len": 2048, "batch": 16,
         "vocab": 1024, "dtype": "bfloat16", "attention": "flash"}


def transfers(hlo: str) -> tuple[int, int, int]:
    """In the entry computation's schedule of an unrolled program: how many tensors go to host
    memory, how many of them come back before the last has left, and the schedule's length."""
    module = parse(hlo)
    entry = module.computations[module.entry].instructions
    out, back = [], []
    for i, ins in enumerate(entry):
        if ins.opcode != "copy-start":
            continue
        arrays = shape_arrays(ins.shape)
        if arrays[0][2] == HOST_MEMORY_SPACE:
            out.append(i)
        elif len(arrays) > 1 and arrays[1][2] == HOST_MEMORY_SPACE:
            back.append(i)
    return len(out), sum(1 for i in back if out and i < max(out)), len(entry)


def main() -> None:
    target = target_of(TpuTarget(platform="tpu", topology="v5e:2x2"))
    mesh = target.mesh(None)
    rows = []
    for scan in (False, True):
        workload = build_workload(TransformerConfig(**MODEL, scan=scan))
        workload.use_mesh(mesh)
        for label, policy in PLANS.items():
            plan = RematPlan.model_validate({"layers": [policy] * MODEL["layers"]})
            with workload.tracing():
                lowered = workload.step(plan, mesh).lower(*workload.abstract_inputs(mesh))
            compiled = lowered.compile(compiler_options=compiler_options("tpu") or None)
            hlo, memory = compiled.as_text(), MemoryBreakdown.of(compiled, platform="tpu")
            e = estimate_step(hlo, CHIPS["v5e"])
            sent, early, length = transfers(hlo) if not scan and e.host_bytes else (0, 0, 0)
            rows.append({
                "stack": "scanned" if scan else "unrolled", "plan": label, "device peak / chip": format_bytes(memory.peak),
                "host memory": format_bytes(memory.host_total), "host link bytes": format_bytes(int(e.host_bytes)),
                "est. step": f"{e.seconds * 1e3:.1f} ms", "of which waiting on the host link":
                    f"{e.host_wait_seconds * 1e3:.1f} ms",
                "back before the last left": f"{early} of {sent} (schedule of {length})" if sent else "—",
            })
            print(rows[-1], flush=True)
    text = "\n".join([
        "# Where offloaded tensors live: device peak, unrolled and scanned\n",
        f"Command: `python benchmarks/offload_peak.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`; "
        f"{versions(target)}. A 4-layer decoder, d_model 1024, 2048 tokens, batch 16 "
        "in bf16, flash attention, data parallel over v5e:2x2; compiled ahead of time.\n",
        markdown(rows),
    ])
    out = HERE / "results" / "offload_peak.md"
    out.write_text(text)
    print(text + f"\nwrote {out}")


def versions(target: object) -> str:
    import jax

    return f"jax {jax.__version__}, libtpu {target.compiler_version()}"  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
