"""The training configuration searched with the plan, against the plan alone at today's fixed batch and mesh.

One command, from any machine with libtpu (``pip install -e '.[tpu,plot]'``):

    python benchmarks/configurations.py                      # the wide decoder; see its results file for the time here
    python benchmarks/configurations.py --model small --samplers tpe

A scanned decoder (the built-in transformer, ``scan: true``: a compile takes about a minute
here whatever its depth) compiled ahead of time for ``v5e:2x2`` at a global batch of 32
sequences. Studies in one SQLite file (its measurement cache compiles a candidate once for all
of them), at the same HBM budget (``--fraction`` of the fixed configuration's no-remat peak, at
most a chip's HBM) and global batch:

* **fixed**: today's question. The batch and mesh are fixed (8 sequences a chip, FSDP over
  the 4 chips: ``configuration: {batch: [8], mesh: [{fsdp: 4}]}``), and the study compiles
  every plan of its space (one policy for every scanned layer, as MaxText can express), so
  its answer is the best the plan alone can do there.
* **joint** (one study a sampler of ``--samplers``): batch, accumulation, mesh and plan
  together: micro-batches of 8, 4, 2 and 1 sequences a chip (accumulated to the same global
  batch), meshes ``fsdp=4``, ``data=2,fsdp=2`` and ``data=4``, and the same plans;
  ``--trials`` trials, the fixed configuration's presets first.

Nothing runs: a candidate's step time is the library's estimate of its compiled program
(``Target.estimate``), and its throughput is the global batch's tokens over that time, per
chip. The table gives each study's answer for the budget (what ``remat-search best`` says),
its estimated tokens/s per chip, and its over the fixed study's; under it, the planner's
prediction errors on the candidates it proposed, by micro-batch and by mesh. The plot: every
compiled candidate's throughput against its compiled peak. Writes
``results/configurations-<model>.md`` and ``.png`` beside this file; the studies stay in
``results/studies/configurations-<model>.db``.
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
MODELS = {
    "small": {"kind": "transformer", "layers": 8, "d_model": 1024, "heads": 8, "d_ff": 4096, "seq_len": 512,
              "batch": 32, "vocab": 8192, "dtype": "bfloat16", "attention": "dense", "scan": True},
    "wide": {"kind": "transformer", "layers": 8, "d_model": 2048, "heads": 16, "d_ff": 8192, "seq_len": 2048,
             "batch": 32, "vocab": 32000, "dtype": "bfloat16", "attention": "dense", "scan": True},
}
"""``small``: search_quality_tpu.py's decoder, scanned; ``wide``: the v5e write-up's (its spec in
search_spaces/v5e-writeup.yaml), scanned, at the same global batch of 32 sequences."""
GLOBAL_BATCH = 32
CHOICES = ["none", "full", "dots", "dots_no_batch",
           {"label": "save_qkv", "names": ["query_proj", "key_proj", "value_proj"]},
           {"label": "save_attn", "names": ["context", "out_proj"]}]
FIXED = {"batch": [8], "global_batch": GLOBAL_BATCH, "mesh": [{"fsdp": 4}]}
JOINT = {"batch": [8, 4, 2, 1], "global_batch": GLOBAL_BATCH, "mesh": [{"fsdp": 4}, {"data": 2, "fsdp": 2}, {"data": 4}]}


def search(storage: str, study: str, workload: dict[str, Any], configuration: dict[str, Any], *, trials: int,
           budget: int | None, workers: int, sampler: str = "tpe") -> StudyReport:
    """One study of ``configuration`` over :data:`CHOICES`, one policy for every layer."""
    spec = {
        "study": study, "storage": storage, "workload": workload, "target": TARGET, "budget": budget,
        "space": {"layout": "uniform", "choices": CHOICES}, "configuration": configuration, "trials": trials,
        "sampler": {"kind": sampler, "seed": 0}, "workers": workers, "compilation_cache": None,
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


def prediction_errors(report: StudyReport) -> str:
    """The planner's relative errors on the candidates it proposed (each predicted before it
    was measured), by micro-batch and by mesh: how well its model carries plans across them."""
    groups: dict[str, list[tuple[float, float | None]]] = {}
    for t in report.trials:
        p, m = t.prediction, t.measurement
        if not p or m is None or t.peak_bytes is None or t.plan is None or t.plan.configuration is None:
            continue
        c = t.plan.configuration
        error = (abs(p["peak"] / t.peak_bytes - 1), abs(p["seconds"] / m.step_seconds - 1) if m.step_seconds else None)
        for key in (f"micro-batch {c.batch}", f"mesh {','.join(f'{a}={n}' for a, n in c.mesh)}"):
            groups.setdefault(key, []).append(error)
    if not groups:
        return "The planner proposed nothing of its own.\n"
    lines = ["| planner's proposals at | n | peak error, mean / max | step time error, mean / max |", "|---|---|---|---|"]
    for key, errors in sorted(groups.items()):
        peaks, times = [e for e, _ in errors], [e for _, e in errors if e is not None]
        time = f"{sum(times) / len(times):.1%} / {max(times):.1%}" if times else "—"
        lines.append(f"| {key} | {len(errors)} | {sum(peaks) / len(peaks):.1%} / {max(peaks):.1%} | {time} |")
    return "\n".join(lines) + "\n"


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
    for (name, report), marker in zip(reports.items(), ("o", "x", "+", "^"), strict=False):
        timed = [t for t in report.trials if t.throughput is not None and t.peak_bytes is not None]
        ax.scatter([t.peak_bytes / 2**20 for t in timed], [t.throughput for t in timed], marker=marker, label=name,
                   alpha=0.7)
        best = report.best(budget) if any(t.peak_bytes <= budget for t in timed) else None
        if best is not None:
            ax.annotate(best.summary(), (best.peak_bytes / 2**20, best.throughput), fontsize=7)
    ax.axvline(budget / 2**20, color="grey", linestyle="--", label=f"budget {format_bytes(budget)}")
    ax.set_xlabel("compiled peak per chip (MiB)")
    ax.set_ylabel("tokens/s per chip (estimated)")
    ax.set_title(f"{TARGET['topology']}: configuration + plan vs plan alone, global batch {GLOBAL_BATCH} sequences")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=24, help="trials of the joint study, its presets included")
    parser.add_argument("--fraction", type=float, default=0.5, help="the budget, of the fixed no-remat peak")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="wide")
    parser.add_argument("--samplers", default="tpe,planner", help="samplers of the joint study, one study each")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    (args.out / "studies").mkdir(parents=True, exist_ok=True)
    storage = fresh_storage(args.out / "studies" / f"configurations-{args.model}.db", keep_cache=False)
    workload = MODELS[args.model]
    began = time.perf_counter()

    fixed = search(storage, "fixed", workload, FIXED, trials=len(CHOICES), budget=None, workers=args.workers)
    none = next(t for t in fixed.trials if t.labels[0] == "none")
    budget = min(int(none.peak_bytes * args.fraction), int(fixed.device["memory_limit"]))  # at most a chip's HBM
    print(f"fixed configuration: no-remat peak {format_bytes(none.peak_bytes)}; budget {format_bytes(budget)}", flush=True)
    reports = {"fixed": fixed}
    for sampler in args.samplers.split(","):
        reports[f"joint, {sampler}"] = search(storage, f"joint-{sampler}", workload, JOINT, trials=args.trials,
                                              budget=budget, workers=args.workers, sampler=sampler)
        print(f"joint study ({sampler}) done", flush=True)

    answers = {}
    for name, report in reports.items():
        try:
            answers[name] = report.best(budget)
        except remat_search.NoFeasiblePlan:
            answers[name] = None
    rows = [row(n, answers[n], answers["fixed"], r) for n, r in reports.items()]
    gains = {n: answers[n].throughput / answers["fixed"].throughput - 1
             for n in reports if n != "fixed" and answers[n] and answers["fixed"]}
    header = (
        f"# Configuration and plan together, against the plan alone at the fixed batch and mesh\n\n"
        f"Command: `python benchmarks/configurations.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`\n\n"
        f"{TARGET['topology']}, transformer {workload}; global batch {GLOBAL_BATCH} sequences; budget "
        f"{args.fraction:.0%} of the fixed configuration's no-remat peak ({format_bytes(none.peak_bytes)}): "
        f"{format_bytes(budget)} per chip. Step times estimated (`{none.measurement.time_model}` model, nothing "
        f"ran); {versions(fixed)}.\n\n"
    )
    summary = (
        "\n" + "".join(f"- {n}: the answer has {g:+.1%} estimated tokens/s per chip against the fixed study's, at the "
                       "same budget and global batch.\n" for n, g in gains.items())
        + "".join(f"\n{prediction_errors(r)}" for n, r in reports.items() if n.endswith("planner"))
        + f"\nWhole run: {(time.perf_counter() - began) / 60:.0f} min.\n"
    )
    text = header + markdown(rows) + summary
    out = args.out / f"configurations-{args.model}"
    out.with_suffix(".md").write_text(text)
    plot(reports, budget, out.with_suffix(".png"))
    print(text)
    print(f"wrote {out}.md and {out}.png")


if __name__ == "__main__":
    main()
