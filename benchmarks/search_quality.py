"""Search quality side by side: best uniform preset, random, TPE, NSGA-II and the planner.

One command, all in one run, on this machine:

    python benchmarks/search_quality.py            # ~35 min on a 2-core CPU

For the built-in transformer (8 layers) at budgets of 50%, 65% and 80% of its no-remat
peak, every method searches its own fresh study (own SQLite file, no measurement or
compilation cache shared, so compile counts and wall times are each method's own) with
the same trial count; all studies begin with the same uniform presets. Then, per budget,
the best plan of each method and the no-remat plan are re-timed *interleaved* in one worker
(A B C … A B C …, see ``remat_search.confirm``) so that their step times are comparable.

Columns: best feasible step time (interleaved median), the FLOPs of that plan (from the
compiler: what its recomputation costs, free of timing noise), its time's ratio to no
remat's, trials until the method's best (by its search medians) is within 3% of the best any
method found, compiles, and wall time (the trials' durations summed: proposing, compiling, running). Below the table: the planner's prediction error on the plans it
proposed (each predicted before it was measured, so never trained on). Writes
``results/search_quality.md`` and ``results/search_quality.png`` beside this file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import optuna

import remat_search
from remat_search.measurement import measure
from remat_search.runner import Runner
from remat_search.spec import TimingConfig, parse_spec
from remat_search.units import format_bytes

HERE = Path(__file__).resolve().parent
WORKLOAD = {"kind": "transformer", "layers": 8, "d_model": 128, "heads": 4, "d_ff": 512,
            "seq_len": 64, "batch": 8, "vocab": 512}
CHOICES = ["none", "full", "dots", "dots_no_batch",
           {"label": "save_qkv", "names": ["query_proj", "key_proj", "value_proj"]},
           {"label": "save_attn", "names": ["context", "out_proj"]}]
SEARCHERS = ("random", "tpe", "nsga2", "planner")
WITHIN = 0.03


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per method and budget (default 20)")
    parser.add_argument("--budgets", default="0.5,0.65,0.8", help="fractions of the no-remat peak")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds of the final re-timing")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep", action="store_true",
                        help="keep the studies of an earlier run (resume them) instead of starting afresh")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "studies"
    runs.mkdir(exist_ok=True)

    none_peak = _no_remat_peak()
    print(f"no-remat compiled peak: {format_bytes(none_peak)}", flush=True)
    rows, curves, errors = [], {}, []
    for fraction in (float(f) for f in args.budgets.split(",")):
        budget = int(none_peak * fraction)
        reports, walls = {}, {}
        for method in SEARCHERS:
            db = runs / f"{method}-{fraction:.2f}.db"
            if not args.keep:
                for stale in runs.glob(f"{db.name}*"):
                    stale.unlink()
            spec = parse_spec({
                "study": f"{method}-{fraction:.2f}", "storage": f"sqlite:///{db}", "workload": WORKLOAD,
                "space": {"layout": "per_layer", "choices": CHOICES}, "budget": budget, "trials": args.trials,
                "sampler": {"kind": method, "seed": 0}, "timing": {"warmup": 2, "repeats": 5, "timeout": "300s"},
                "confirm": {"top": 0}, "compilation_cache": None,
            })
            reports[method] = remat_search.run(spec)
            walls[method] = _wall(spec.storage, spec.study, list(reports[method].trials))
            print(f"  {fraction:.0%} {method}: {walls[method]:.0f} s", flush=True)
        presets = _presets(reports["planner"])
        preset_wall = _wall(f"sqlite:///{runs / f'planner-{fraction:.2f}.db'}", f"planner-{fraction:.2f}", presets)
        best = {"preset": _best(presets, budget)} | {m: _best(reports[m].trials, budget) for m in SEARCHERS}
        confirmed = _retime(best, args.rounds)
        found = min(t.step_seconds for t in best.values() if t is not None)
        curves[fraction] = {m: _running_best(reports[m].trials, budget) for m in SEARCHERS}
        for method, t in best.items():
            trials = presets if method == "preset" else list(reports[method].trials)
            reached = _trials_to(trials, budget, found * (1 + WITHIN))
            rows.append({
                "budget": f"{fraction:.0%} ({format_bytes(budget)})", "method": method,
                "plan": t.summary() if t else "—", "peak": format_bytes(t.peak_bytes) if t else "—",
                "step": f"{confirmed[method] * 1e3:.1f} ms" if t else "—",
                "GFLOP": f"{t.measurement.flops / 1e9:.3f}" if t else "—",
                "vs none": f"{confirmed[method] / confirmed['none']:.3f}" if t else "—",
                "within 3%": str(reached) if reached else f"> {len(trials)}",
                "compiles": str(sum(1 for x in trials if x.reused_from is None and x.peak_bytes is not None)),
                "wall": f"{preset_wall if method == 'preset' else walls[method]:.0f} s",
            })
        errors += _prediction_errors(reports["planner"])
    table = _markdown(rows)
    summary = "\n" + _error_line("peak", [e for e, _ in errors]) + _error_line("step time", [e for _, e in errors if e is not None])
    header = (
        f"# Search quality ({args.trials} trials a method; transformer {WORKLOAD}; "
        f"no-remat peak {format_bytes(none_peak)})\n\nCommand: `python benchmarks/search_quality.py"
        f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`\n\n"
    )
    (args.out / "search_quality.md").write_text(header + table + summary)
    print(header + table + summary)
    _plot(curves, args.out / "search_quality.png")
    print(f"wrote {args.out / 'search_quality.md'} and {args.out / 'search_quality.png'}")


def _no_remat_peak() -> int:
    from remat_search.spec import TransformerConfig
    from remat_search.transformer import TransformerWorkload

    workload = TransformerWorkload(TransformerConfig.model_validate(WORKLOAD))
    m = measure(workload, remat_search.RematPlan.uniform("none", workload.layers), budget=1,
                timing=TimingConfig(), gradient_tolerance=1.0, reference_grads=lambda: None)
    return m.peak_bytes


def _presets(report: remat_search.StudyReport) -> list[remat_search.TrialResult]:
    return [t for t in report.trials if t.plan is not None and len(set(t.labels)) == 1][: len(CHOICES)]


def _fits(t: remat_search.TrialResult, budget: int) -> bool:
    return t.status == "measured" and t.peak_bytes is not None and t.peak_bytes <= budget


def _best(trials: list[remat_search.TrialResult], budget: int) -> remat_search.TrialResult | None:
    fitting = [t for t in trials if _fits(t, budget)]
    return min(fitting, key=lambda t: t.step_seconds) if fitting else None


def _running_best(trials: list[remat_search.TrialResult], budget: int) -> list[float | None]:
    best, out = None, []
    for t in sorted(trials, key=lambda t: t.number):
        if _fits(t, budget) and (best is None or t.step_seconds < best):
            best = t.step_seconds
        out.append(best)
    return out


def _trials_to(trials: list[remat_search.TrialResult], budget: int, target: float) -> int | None:
    for i, best in enumerate(_running_best(trials, budget), 1):
        if best is not None and best <= target:
            return i
    return None


def _wall(storage: str, study: str, trials: list[remat_search.TrialResult]) -> float:
    """Seconds the given trials took, start to finish, as optuna recorded them."""
    numbers = {t.number for t in trials}
    stored = optuna.load_study(study_name=study, storage=storage).trials
    return sum((t.datetime_complete - t.datetime_start).total_seconds() for t in stored if t.number in numbers)


def _retime(best: dict[str, remat_search.TrialResult | None], rounds: int) -> dict[str, float]:
    """Interleaved medians of each method's best plan and of no remat, in one worker."""
    plans = {"none": remat_search.RematPlan.uniform("none", WORKLOAD["layers"])}
    plans |= {m: t.plan for m, t in best.items() if t is not None}
    distinct = list(dict.fromkeys(plans.values()))
    with Runner(parse_spec({"study": "x", "workload": WORKLOAD, "space": {"choices": ["none"]},
                            "trials": 1}).workload, timeout=600) as runner:
        times = runner.retime(distinct, warmup=2, rounds=rounds)
    medians = {plan: statistics.median(t) for plan, t in zip(distinct, times, strict=True)}
    return {m: medians[p] for m, p in plans.items()}


def _prediction_errors(report: remat_search.StudyReport) -> list[tuple[float, float | None]]:
    out = []
    for t in report.trials:
        if t.prediction and t.peak_bytes and t.reused_from is None:
            peak = abs(t.prediction["peak"] / t.peak_bytes - 1)
            seconds = abs(t.prediction["seconds"] / t.step_seconds - 1) if t.status == "measured" else None
            out.append((peak, seconds))
    return out


def _error_line(what: str, errors: list[float]) -> str:
    if not errors:
        return f"Planner {what} predictions: none to compare.\n"
    return (
        f"Planner {what} prediction error on {len(errors)} plans it proposed (each predicted before it "
        f"was measured): mean {statistics.mean(errors):.1%}, max {max(errors):.1%}.\n"
    )


def _markdown(rows: list[dict[str, str]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _plot(curves: dict[float, dict[str, list[float | None]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), dpi=120, squeeze=False)
    for ax, (fraction, by_method) in zip(axes[0], curves.items(), strict=True):
        for method, best in by_method.items():
            xs = [i for i, b in enumerate(best, 1) if b is not None]
            ax.step(xs, [best[i - 1] * 1e3 for i in xs], where="post", label=method)
        ax.set_title(f"budget {fraction:.0%} of the no-remat peak")
        ax.set_xlabel("trial")
        ax.set_ylabel("best fitting step time so far (ms, search median)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
