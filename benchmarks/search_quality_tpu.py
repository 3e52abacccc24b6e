"""Search quality on a TPU target: random, TPE, NSGA-II and the planner, by estimated step time.

One command, all in one run, from any machine with libtpu (``pip install -e '.[tpu,plot]'``):

    python benchmarks/search_quality_tpu.py            # see the results file for its time here
    python benchmarks/search_quality_tpu.py --resume   # an interrupted run: finish its studies

The comparison of ``search_quality.py`` (the built-in transformer at 8 layers, its six choices
per layer, budgets of 50%, 65% and 80% of no remat's compiled peak, the same trial count for
every method, every study beginning with the same six uniform presets), but for a TPU topology
compiled ahead of time: nothing runs, and a plan's step time is the library's estimate of its
compiled program (``Target.estimate``, whatever model that is; each measurement says which).
Estimates are deterministic, so one pass is the answer: no re-timing, and each method's answer
is what ``remat-search best`` says (:meth:`StudyReport.best`).

All studies live in one SQLite file, so its measurement cache compiles a plan once for the
whole run (the presets first, in a study of their own). A method's compiles are still the
plans *it* needed the compiler for: a cache hit counts, as the method alone would have
compiled it; a plan its study measured before, or screened out (``prescreen``), does not; its
compile seconds are those compiles' own, wherever they ran. Columns:

* answer, peak, est. step: the method's answer for the budget; vs none: its estimate over no
  remat's; vs best preset: over the fastest uniform preset that fits;
* within 1%: after how many trials the method's best so far is within 1% of the fastest plan
  any method found for the budget.

Writes ``results/search_quality_tpu.md`` and ``.png`` beside this file; the studies stay in
``results/studies/tpu.db`` (``remat-search studies --storage sqlite:///…``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from search_quality import (
    CHOICES,
    SEARCHERS,
    answer,
    compiles,
    error_line,
    fits,
    markdown,
    plot_best_so_far,
    prediction_errors,
    presets_of,
    running_best,
)

import remat_search
from remat_search.spec.loading import parse_spec
from remat_search.units import format_bytes

HERE = Path(__file__).resolve().parent
TARGET = {"platform": "tpu", "topology": "v5e:2x2"}
WORKLOAD = {"kind": "transformer", "layers": 8, "d_model": 1024, "heads": 8, "d_ff": 4096, "seq_len": 512,
            "batch": 32, "vocab": 8192, "dtype": "bfloat16", "attention": "dense"}
"""8 sequences a chip over ``v5e:2x2``'s 4 chips. d_model 1024 makes the matmuls most of the step, so
recomputing them costs time (full remat +11% est.; at d_model 512 it cost nothing: the step was
bandwidth-bound, and recomputing fused elementwise work saves the bytes of keeping it)."""
MESH = {"fsdp": 4}
"""Parameters and optimizer state split over the 4 chips (with the batch): activations are most
of the peak, so the budgets (fractions of no remat's peak) leave room for mixes (full remat's
peak is 38% of no remat's)."""
WITHIN = 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per method and budget, presets included (default 20)")
    parser.add_argument("--budgets", default="0.5,0.65,0.8", help="fractions of the no-remat peak")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep-cache", action="store_true",
                        help="keep the earlier run's measurement cache (its studies are searched afresh)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the earlier run's studies and cache, and finish the studies it left unfinished")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    (args.out / "studies").mkdir(parents=True, exist_ok=True)
    db = args.out / "studies" / "tpu.db"
    storage = f"sqlite:///{db}" if args.resume else fresh_storage(db, keep_cache=args.keep_cache)
    began = time.perf_counter()

    presets = search(storage, "presets", WORKLOAD, CHOICES, layout="uniform", trials=len(CHOICES), sampler="random")
    none = next(t for t in presets.trials if t.labels[0] == "none")
    print(f"no-remat compiled peak {format_bytes(none.peak_bytes)}, est. step {none.seconds * 1e3:.3f} ms "
          f"({none.measurement.time_model})", flush=True)
    rows, curves, verdicts, errors = [], {}, [], []
    for fraction in (float(f) for f in args.budgets.split(",")):
        budget = int(none.peak_bytes * fraction)
        reports = {}
        for method in SEARCHERS:
            reports[method] = search(storage, f"{method}-{fraction:.2f}", WORKLOAD, CHOICES, budget=budget,
                                     trials=args.trials, sampler=method)
            print(f"  {fraction:.0%} {method}: {compiles(list(reports[method].trials))} compiles", flush=True)
        fitting = [t for t in presets_of(reports["planner"]) if fits(t, budget)]
        best_preset = min(fitting, key=lambda t: t.seconds) if fitting else None
        trials = {m: list(reports[m].trials) for m in SEARCHERS}
        found = min(t.seconds for ts in trials.values() for t in ts if fits(t, budget))
        curves[fraction] = (
            {m: [None if p is None else seconds_of(reports[m], p) / none.seconds for p in running_best(ts, budget)]
             for m, ts in trials.items()},
            found * (1 + WITHIN) / none.seconds,
        )
        reached = {m: within(reports[m], trials[m], budget, found) for m in SEARCHERS}
        for method in ("preset", *SEARCHERS):
            t = best_preset if method == "preset" else result(reports[method], answer(reports[method], budget))
            rows.append({
                "budget": f"{fraction:.0%} ({format_bytes(budget)})", "method": method,
                "answer": t.summary() if t else "—", "peak": format_bytes(t.peak_bytes) if t else "—",
                "est. step": f"{t.seconds * 1e3:.3f} ms" if t else "—",
                "vs none": f"{t.seconds / none.seconds:.3f}" if t else "—",
                "vs best preset": f"{t.seconds / best_preset.seconds:.4f}" if t and best_preset else "—",
                "within 1%": "—" if method == "preset" else (str(reached[method]) if reached[method] else f"> {args.trials}"),
                "compiles": str(compiles(list(presets.trials) if method == "preset" else trials[method])),
                "compile s": f"{compile_seconds(presets.trials if method == 'preset' else trials[method]):.0f}",
            })
        verdicts.append(verdict(fraction, reports, best_preset, found, reached, budget, args.trials))
        errors += prediction_errors(reports["planner"])
    model = none.measurement.time_model
    summary = (
        "\n" + "".join(verdicts) + "\n" + error_line("peak", [e for e, _ in errors])
        + error_line("step time", [e for _, e in errors if e is not None])
        + f"\nWhole run: {(time.perf_counter() - began) / 60:.0f} min"
        + (" (measurement cache of an earlier run kept)" if args.keep_cache else "")
        + (" (this pass only: it finished an earlier, interrupted run's studies)" if args.resume else "") + ".\n"
    )
    header = (
        f"# Search quality on {TARGET['topology']}, mesh {MESH} ({args.trials} trials a method; transformer {WORKLOAD}; "
        f"no-remat peak {format_bytes(none.peak_bytes)}, est. step {none.seconds * 1e3:.3f} ms)\n\n"
        f"Command: `python benchmarks/search_quality_tpu.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`\n\n"
        f"Step times: estimated by the `{model}` model (nothing ran); {versions(presets)}.\n\n"
    )
    (args.out / "search_quality_tpu.md").write_text(header + markdown(rows) + summary)
    print(header + markdown(rows) + summary)
    plot_best_so_far(curves, args.out / "search_quality_tpu.png", within=WITHIN, times=f"estimated, {model}")
    print(f"wrote {args.out / 'search_quality_tpu.md'} and {args.out / 'search_quality_tpu.png'}")


def fresh_storage(path: Path, *, keep_cache: bool) -> str:
    """The SQLite URL of ``path`` with no studies in it; its measurement cache kept only if asked."""
    url = f"sqlite:///{path}"
    if not keep_cache:
        for stale in path.parent.glob(f"{path.name}*"):
            stale.unlink()
    elif path.exists():
        for summary in optuna.get_all_study_summaries(url):
            optuna.delete_study(study_name=summary.study_name, storage=url)
    return url


def search(
    storage: str, study: str, workload: dict[str, Any], choices: list[Any], *, trials: int, sampler: str,
    budget: int | None = None, layout: str = "per_layer", target: dict[str, str] = TARGET,
    mesh: dict[str, int] | None = MESH,
) -> remat_search.StudyReport:
    """One study on the TPU target, searched to the end; its report."""
    spec = parse_spec({
        "study": study, "storage": storage, "workload": workload, "target": target, "mesh": mesh,
        "space": {"layout": layout, "choices": choices}, "budget": budget, "trials": trials,
        "sampler": {"kind": sampler, "seed": 0}, "compilation_cache": None,
    })
    return remat_search.run(spec)


def result(report: remat_search.StudyReport, plan: remat_search.RematPlan | None) -> remat_search.TrialResult | None:
    """The study's first trial of ``plan``."""
    return next((t for t in report.trials if plan is not None and t.plan == plan and t.seconds is not None), None)


def seconds_of(report: remat_search.StudyReport, plan: remat_search.RematPlan) -> float:
    found = result(report, plan)
    assert found is not None and found.seconds is not None
    return found.seconds


def within(
    report: remat_search.StudyReport, trials: list[remat_search.TrialResult], budget: int, found: float
) -> int | None:
    """The first trial (1-based) after which the best so far is within :data:`WITHIN` of ``found``."""
    return next(
        (i for i, p in enumerate(running_best(trials, budget), 1) if p and seconds_of(report, p) <= found * (1 + WITHIN)),
        None,
    )


def compile_seconds(trials: list[remat_search.TrialResult] | tuple[remat_search.TrialResult, ...]) -> float:
    """Seconds the compiles counted by :func:`compiles` took, wherever they ran."""
    return sum(
        t.measurement.compile_seconds or 0.0 for t in trials
        if t.reused_from is None and t.measurement is not None and t.measurement.compiled
    )


def verdict(
    fraction: float, reports: dict[str, remat_search.StudyReport], preset: remat_search.TrialResult | None,
    found: float, reached: dict[str, int | None], budget: int, trials: int,
) -> str:
    """One line a budget on the issue's targets: the planner within 1% of the best found in
    ≤ 15 trials, in fewer than TPE and random; its answer strictly faster than the best preset."""
    planner = result(reports["planner"], answer(reports["planner"], budget))
    count = {m: reached[m] or trials + 1 for m in SEARCHERS}
    fast = reached["planner"] is not None and reached["planner"] <= 15
    fewer = all(count["planner"] < count[m] for m in ("tpe", "random"))
    if planner is None or preset is None:
        versus = "no plan to compare with the best preset"
    elif planner.plan == preset.plan:
        versus = f"answers the best preset itself ({preset.summary()})"
    else:
        versus = f"{planner.seconds / preset.seconds - 1:+.2%} against the best preset ({preset.summary()})"
    best_is_preset = preset is not None and preset.seconds <= found
    trials_text = ", ".join(f"{m} {reached[m] or f'> {trials}'}" for m in SEARCHERS)
    return (
        f"- {fraction:.0%}: within 1% of the best found (trials: {trials_text}): "
        f"{'in ≤ 15' if fast else 'not in ≤ 15'}, {'fewer' if fewer else 'not fewer'} than TPE and random; "
        f"planner {versus}"
        + ("; no method found a plan faster than the best preset.\n" if best_is_preset else ".\n")
    )


def versions(report: remat_search.StudyReport) -> str:
    """The JAX and libtpu versions the study's plans were compiled with."""
    return f"jax {report.device.get('jax_version', '?')}, libtpu {report.device.get('compiler_version', '?')}"


if __name__ == "__main__":
    main()
