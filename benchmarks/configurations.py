"""The training configuration searched with the plan, against the plan alone at today's fixed batch and mesh.

One command, from any machine with libtpu (``pip install -e '.[tpu,plot]'``):

    python benchmarks/configurations.py                 # see the results file for its time here
    python benchmarks/configurations.py --trials 12     # a quicker look

A scanned decoder (the built-in transformer, ``scan: true``: a compile takes about a minute
here whatever its depth) compiled ahead of time for ``v5e:2x2`` at a global batch of 32
sequences of 512 tokens. Two studies, in one SQLite file (its measurement cache compiles a
candidate once for both), at the same HBM budget (``--fraction`` of the fixed configuration's
no-remat peak) and global batch:

* **fixed**: today's question. The batch and mesh are fixed (8 sequences a chip, FSDP over
  the 4 chips: ``configuration: {batch: [8], mesh: [{fsdp: 4}]}``), and the study compiles
  every plan of its space (one policy for every scanned layer, as MaxText can express), so
  its answer is the best the plan alone can do there.
* **joint**: batch, accumulation, mesh and plan together: micro-batches of 8, 4, 2 and 1
  sequences a chip (accumulated to the same global batch), meshes ``fsdp=4``,
  ``data=2,fsdp=2`` and ``data=4``, and the same plans; ``--trials`` trials, the fixed
  configuration's presets first.

Nothing runs: a candidate's step time is the library's estimate of its compiled program
(``Target.estimate``), and its throughput is the global batch's tokens over that time, per
chip. The table gives each study's answer for the budget (what ``remat-search best`` says),
its estimated tokens/s per chip, and the joint's over the fixed's; the plot, every compiled
candidate's throughput against its compiled peak. Writes ``results/configurations.md`` and
``.png`` beside this file; the studies stay in ``results/studies/configurations.db``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from search_quality_tpu import fresh_storage, versions

import remat_search
from remat_search.report.results import StudyReport, TrialResult
from remat_search.spec.loading import parse_spec
from remat_search.units import format_bytes

HERE = Path(__file__).resolve().parent
TARGET = {"platform": "tpu", "topology": "v5e:2x2"}
WORKLOAD = {"kind": "transformer", "layers": 8, "d_model": 1024, "heads": 8, "d_ff": 4096, "seq_len": 512,
            "batch": 32, "vocab": 8192, "dtype": "bfloat16", "attention": "dense", "scan": True}
GLOBAL_BATCH = 32
CHOICES = ["none", "full", "dots", "dots_no_batch",
           {"label": "save_qkv", "names": ["query_proj", "key_proj", "value_proj"]},
           {"label": "save_attn", "names": ["context", "out_proj"]}]
FIXED = {"batch": [8], "global_batch": GLOBAL_BATCH, "mesh": [{"fsdp": 4}]}
JOINT = {"batch": [8, 4, 2, 1], "global_batch": GLOBAL_BATCH, "mesh": [{"fsdp": 4}, {"data": 2, "fsdp": 2}, {"data": 4}]}


def search(storage: str, study: str, configuration: dict[str, Any], *, trials: int, budget: int | None,
           workers: int) -> StudyReport:
    """One study of ``configuration`` over :data:`CHOICES`, one policy for every layer."""
    spec = {
        "study": study, "storage": storage, "workload": WORKLOAD, "target": TARGET, "budget": budget,
        "space": {"layout": "uniform", "choices": CHOICES}, "configuration": configuration, "trials": trials,
        "sampler": {"kind": "tpe", "seed": 0}, "workers": workers, "compilation_cache": None,
    }
    return remat_search.run(parse_spec(spec))


def row(name: str, t: TrialResult | None, fixed: TrialResult | None, report: StudyReport) -> dict[str, str]:
    compiled = [u for u in report.trials if u.measurement is not None and u.measurement.compiled]
    return {
        "study": name,
        "answer": t.summary() if t else "—",
        "peak": format_bytes(t.peak_bytes) if t else "—",
        "est. step": f"{t.seconds * 1e3:.2f} ms" if t else "—",
        "tokens/s per chip (est.)": f"{t.throughput:,.0f}" if t else "—",
        "vs fixed": f"{t.throughput / fixed.throughput:.3f}" if t and fixed else "—",
        "trials": str(len(report.trials)),
        "compile s": f"{sum(u.measurement.compile_seconds or 0 for u in compiled):.0f}",
    }


def markdown(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(r[k] for k in head) + " |" for r in rows)]) + "\n"


def plot(reports: dict[str, StudyReport], budget: int, path: Path) -> None:
    """Every compiled candidate's estimated throughput against its peak, each study its marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, report), marker in zip(reports.items(), ("o", "x"), strict=True):
        timed = [t for t in report.trials if t.throughput is not None and t.peak_bytes is not None]
        ax.scatter([t.peak_bytes / 2**20 for t in timed], [t.throughput for t in timed], marker=marker, label=name,
                   alpha=0.7)
        best = report.best(budget) if any(t.peak_bytes <= budget for t in timed) else None
        if best is not None:
            ax.annotate(best.summary(), (best.peak_bytes / 2**20, best.throughput), fontsize=7)
    ax.axvline(budget / 2**20, color="grey", linestyle="--", label=f"budget {format_bytes(budget)}")
    ax.set_xlabel("compiled peak per chip (MiB)")
    ax.set_ylabel("tokens/s per chip (estimated)")
    ax.set_title(f"{TARGET['topology']}: configuration + plan vs plan alone, global batch {GLOBAL_BATCH}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=24, help="trials of the joint study, its presets included")
    parser.add_argument("--fraction", type=float, default=0.5, help="the budget, of the fixed no-remat peak")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    (args.out / "studies").mkdir(parents=True, exist_ok=True)
    storage = fresh_storage(args.out / "studies" / "configurations.db", keep_cache=False)
    began = time.perf_counter()

    fixed = search(storage, "fixed", FIXED, trials=len(CHOICES), budget=None, workers=args.workers)
    none = next(t for t in fixed.trials if t.labels[0] == "none")
    budget = int(none.peak_bytes * args.fraction)
    print(f"fixed configuration: no-remat peak {format_bytes(none.peak_bytes)}; budget {format_bytes(budget)}", flush=True)
    joint = search(storage, "joint", JOINT, trials=args.trials, budget=budget, workers=args.workers)

    answers = {}
    for name, report in (("fixed", fixed), ("joint", joint)):
        try:
            answers[name] = report.best(budget)
        except remat_search.NoFeasiblePlan:
            answers[name] = None
    rows = [row(n, answers[n], answers["fixed"], r) for n, r in (("fixed", fixed), ("joint", joint))]
    gain = (answers["joint"].throughput / answers["fixed"].throughput - 1) if all(answers.values()) else None
    header = (
        f"# Configuration and plan together, against the plan alone at the fixed batch and mesh\n\n"
        f"Command: `python benchmarks/configurations.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`\n\n"
        f"{TARGET['topology']}, transformer {WORKLOAD}; global batch {GLOBAL_BATCH} sequences; budget "
        f"{args.fraction:.0%} of the fixed configuration's no-remat peak ({format_bytes(none.peak_bytes)}): "
        f"{format_bytes(budget)} per chip. Step times estimated (`{none.measurement.time_model}` model, nothing "
        f"ran); {versions(fixed)}.\n\n"
    )
    summary = (
        ("\nThe joint study's answer has " + f"{gain:+.1%} estimated tokens/s per chip against the fixed study's, "
         "at the same budget and global batch.\n" if gain is not None else "\nOne study has no answer within the budget.\n")
        + f"\nWhole run: {(time.perf_counter() - began) / 60:.0f} min.\n"
    )
    text = header + markdown(rows) + summary
    (args.out / "configurations.md").write_text(text)
    plot({"fixed": fixed, "joint": joint}, budget, args.out / "configurations.png")
    print(text)
    print(f"wrote {args.out / 'configurations.md'} and {args.out / 'configurations.png'}")


if __name__ == "__main__":
    main()
