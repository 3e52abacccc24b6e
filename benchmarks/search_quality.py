"""Search quality side by side: best uniform preset, random, TPE, NSGA-II and the planner.

One command, all in one run, on this machine:

    python benchmarks/search_quality.py            # ~50 min on a 2-core CPU

For the built-in transformer (8 layers) at budgets of 50%, 65% and 80% of its no-remat
peak, every method searches its own fresh study (own SQLite file, no measurement or
compilation cache shared, so compile counts and wall times are each method's own) with
the same trial count, ending with the search's own confirmation (its top 3 re-timed
interleaved); all studies begin with the same uniform presets. A method's answer is what
``remat-search best`` would say: :meth:`StudyReport.best`.

Each search times its trials against the anchor plan (``timing.anchor``, the default), so
its own medians are drift-corrected ratios; but step times on a shared machine drift by
tens of percent between minutes, so for the verdicts no two studies' medians compare. Instead, per budget, every plan the comparison needs — no remat,
each uniform preset that fits, each method's answer and each plan that was ever a method's
best so far — is re-timed *interleaved* in one worker (A B C … A B C …, ``--rounds`` times,
see ``remat_search.search.confirm``), and all columns below use those medians:

* step: the answer's interleaved median (± half its interquartile range); vs none: its
  ratio to no remat's; the preset row is the fastest preset that fits, by these medians;
* within 3%: after how many trials the method's best so far (by its own search medians,
  what it would answer if stopped there) is within 3% of the fastest plan any method found;
* compiles: plans the compiler saw (not cache reuses, not plans screened out by `prescreen`);
  wall: the trials' durations summed (proposing, compiling, running).

Below the table: verdicts on the two timing targets, the planner's prediction error on
the plans it proposed (each predicted before it was measured, so never trained on), and
every re-timed plan against the fastest, paired by round.
Writes ``results/search_quality.md`` and ``results/search_quality.png`` beside this file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import optuna

import remat_search
from remat_search.search.confirm import compare_times
from remat_search.measure.executables import Executables, measure
from remat_search.measure.runner import Runner
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig
from remat_search.units import format_bytes

HERE = Path(__file__).resolve().parent
WORKLOAD = {"kind": "transformer", "layers": 8, "d_model": 128, "heads": 4, "d_ff": 512,
            "seq_len": 64, "batch": 8, "vocab": 512}
CHOICES = ["none", "full", "dots", "dots_no_batch",
           {"label": "save_qkv", "names": ["query_proj", "key_proj", "value_proj"]},
           {"label": "save_attn", "names": ["context", "out_proj"]}]
SEARCHERS = ("random", "tpe", "nsga2", "planner")
WITHIN = 0.03
NONE = remat_search.RematPlan.uniform("none", WORKLOAD["layers"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per method and budget (default 20)")
    parser.add_argument("--budgets", default="0.5,0.65,0.8", help="fractions of the no-remat peak")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds of the final re-timing (default 30)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep", action="store_true",
                        help="keep the studies of an earlier run (resume them) instead of starting afresh")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "studies"
    runs.mkdir(exist_ok=True)
    began = time.perf_counter()

    none_peak = _no_remat_peak()
    print(f"no-remat compiled peak: {format_bytes(none_peak)}", flush=True)
    rows, curves, verdicts, errors, retimed = [], {}, [], [], []
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
                "sampler": {"kind": method, "seed": 0}, "timing": {"warmup": 2, "repeats": 10, "timeout": "300s"},
                "confirm": {"top": 3, "rounds": 10}, "compilation_cache": None,
            })
            reports[method] = remat_search.run(spec)
            walls[method] = _wall(spec.storage, spec.study, list(reports[method].trials))
            print(f"  {fraction:.0%} {method}: {walls[method]:.0f} s", flush=True)
        presets = presets_of(reports["planner"])
        preset_wall = _wall(f"sqlite:///{runs / f'planner-{fraction:.2f}.db'}", f"planner-{fraction:.2f}", presets)
        trials = {"preset": presets} | {m: list(reports[m].trials) for m in SEARCHERS}
        paths = {m: running_best(ts, budget) for m, ts in trials.items()}
        answers = {m: answer(reports[m], budget) for m in SEARCHERS}
        fitting = [t.plan for t in presets if fits(t, budget)]
        plans = [NONE, *fitting, *(p for p in answers.values() if p), *(p for path in paths.values() for p in path if p)]
        times = _retime(list(dict.fromkeys(plans)), args.rounds)
        median = {plan: statistics.median(ts) for plan, ts in times.items()}
        answers["preset"] = min(fitting, key=median.get) if fitting else None
        found = min(median[p] for p in times if p != NONE)
        curves[fraction] = (
            {m: [None if p is None else median[p] / median[NONE] for p in path] for m, path in paths.items()},
            found * (1 + WITHIN) / median[NONE],
        )
        peaks = {t.plan: t for ts in trials.values() for t in ts if t.plan is not None}
        for method in ("preset", *SEARCHERS):
            plan = answers[method]
            reached = next((i for i, p in enumerate(paths[method], 1) if p and median[p] <= found * (1 + WITHIN)), None)
            t = peaks[plan] if plan else None
            rows.append({
                "budget": f"{fraction:.0%} ({format_bytes(budget)})", "method": method,
                "plan": t.summary() if t else "—", "peak": format_bytes(t.peak_bytes) if t else "—",
                "step": f"{median[plan] * 1e3:.1f} ms ± {_half_iqr(times[plan]):.0%}" if plan else "—",
                "GFLOP": f"{t.measurement.flops / 1e9:.3f}" if t else "—",
                "vs none": f"{median[plan] / median[NONE]:.3f}" if plan else "—",
                "within 3%": str(reached) if reached else f"> {len(trials[method])}",
                "compiles": str(compiles(trials[method])),
                "wall": f"{preset_wall if method == 'preset' else walls[method]:.0f} s",
            })
        verdicts.append(_verdict(fraction, answers, times, {r["method"]: r["within 3%"] for r in rows[-5:]}))
        fastest = min((p for p in times if p != NONE), key=median.get)
        for plan in sorted(times, key=median.get):
            c = compare_times(times[plan], times[fastest])
            retimed.append({
                "budget": f"{fraction:.0%}", "plan": peaks[plan].summary(), "peak": format_bytes(peaks[plan].peak_bytes),
                "step": f"{median[plan] * 1e3:.1f} ms", "vs fastest, paired (95%)":
                    f"{c.ratio - 1:+.1%} ({c.low - 1:+.1%}…{c.high - 1:+.1%})" if plan != fastest else "fastest",
                "answer of": ", ".join(m for m, a in answers.items() if a == plan) or "—",
                "best so far of": ", ".join(m for m, path in paths.items() if plan in path) or "—",
            })
        errors += prediction_errors(reports["planner"])
    table = markdown(rows)
    summary = (
        "\n" + "".join(verdicts) + "\n" + error_line("peak", [e for e, _ in errors])
        + error_line("step time", [e for _, e in errors if e is not None])
        + f"\nWhole run: {(time.perf_counter() - began) / 60:.0f} min.\n"
        + "\n## Every plan re-timed, per budget (fastest first)\n\n" + markdown(retimed)
    )
    header = (
        f"# Search quality ({args.trials} trials a method; transformer {WORKLOAD}; "
        f"no-remat peak {format_bytes(none_peak)})\n\nCommand: `python benchmarks/search_quality.py"
        f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`\n\n"
        f"Step times: medians of {args.rounds} interleaved rounds per budget (see the module doc).\n\n"
    )
    (args.out / "search_quality.md").write_text(header + table + summary)
    print(header + table + summary)
    plot_best_so_far(curves, args.out / "search_quality.png", within=WITHIN, times="interleaved")
    print(f"wrote {args.out / 'search_quality.md'} and {args.out / 'search_quality.png'}")


def _no_remat_peak() -> int:
    from remat_search.spec.workloads import TransformerConfig
    from remat_search.workloads.transformer import TransformerWorkload

    workload = TransformerWorkload(TransformerConfig.model_validate(WORKLOAD))
    m = measure(Executables(workload), remat_search.RematPlan.uniform("none", workload.layers), budget=1,
                timing=TimingConfig(), gradient_tolerance=1.0)
    return m.peak_bytes


def presets_of(report: remat_search.StudyReport) -> list[remat_search.TrialResult]:
    """The study's uniform presets, one a choice (each search measures them first)."""
    first: dict[str, remat_search.TrialResult] = {}
    for t in report.trials:
        if t.plan is not None and len(set(t.labels)) == 1:
            first.setdefault(t.labels[0], t)
    return list(first.values())


def fits(t: remat_search.TrialResult, budget: int) -> bool:
    """Whether ``t`` was measured (or estimated) within ``budget``."""
    return t.status == "measured" and t.peak_bytes is not None and t.peak_bytes <= budget


def answer(report: remat_search.StudyReport, budget: int) -> remat_search.RematPlan | None:
    """What ``remat-search best`` says for ``budget``: confirmed medians where the search confirmed."""
    try:
        return report.best(budget).plan
    except remat_search.NoFeasiblePlan:
        return None


def running_best(trials: list[remat_search.TrialResult], budget: int) -> list[remat_search.RematPlan | None]:
    """After each trial, the fastest plan that fits so far, by the method's own search medians."""
    best, out = None, []
    for t in sorted(trials, key=lambda t: t.number):
        if fits(t, budget) and (best is None or t.step_seconds < best.step_seconds):
            best = t
        out.append(best.plan if best else None)
    return out


def _wall(storage: str, study: str, trials: list[remat_search.TrialResult]) -> float:
    """Seconds the given trials took, start to finish, as optuna recorded them."""
    numbers = {t.number for t in trials}
    stored = optuna.load_study(study_name=study, storage=storage).trials
    return sum((t.datetime_complete - t.datetime_start).total_seconds() for t in stored if t.number in numbers)


def _retime(plans: list[remat_search.RematPlan], rounds: int) -> dict[remat_search.RematPlan, tuple[float, ...]]:
    """Every plan's step times, interleaved in one worker."""
    print(f"  re-timing {len(plans)} plans interleaved, {rounds} rounds", flush=True)
    with Runner(parse_spec({"study": "x", "workload": WORKLOAD, "space": {"choices": ["none"]},
                            "trials": 1}).workload, timeout=600) as runner:
        times = runner.retime(plans, warmup=2, rounds=rounds)
    return dict(zip(plans, times, strict=True))


def _half_iqr(times: tuple[float, ...]) -> float:
    """Half the interquartile range of ``times``, relative to their median."""
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / 2 / statistics.median(times)


def _verdict(
    fraction: float, answers: dict[str, remat_search.RematPlan | None],
    times: dict[remat_search.RematPlan, tuple[float, ...]], reached: dict[str, str],
) -> str:
    """One line per budget on the two timing targets: the planner's answer against the best
    preset (paired by round, with a 95% interval), and trials to within 3%."""
    planner, preset = answers["planner"], answers["preset"]
    if planner is None or preset is None:
        versus = "no plan to compare"
    elif planner == preset:
        versus = "the same plan as the best preset"
    else:
        c = compare_times(times[planner], times[preset])
        verdict = "no slower" if c.ratio <= 1 else ("slower" if c.resolved else "slower within noise")
        versus = (
            f"{statistics.median(times[planner]) * 1e3:.1f} vs best preset "
            f"{statistics.median(times[preset]) * 1e3:.1f} ms: {c.ratio - 1:+.1%} paired "
            f"(95% interval {c.low - 1:+.1%}…{c.high - 1:+.1%}), {verdict}"
        )
    trials = ", ".join(f"{m} {reached[m]}" for m in SEARCHERS)
    return f"- {fraction:.0%}: planner {versus}; trials to within 3%: {trials}.\n"


def prediction_errors(report: remat_search.StudyReport) -> list[tuple[float, float | None]]:
    """Relative errors (peak, step time) of the planner's predictions on the plans it proposed."""
    out = []
    for t in report.trials:
        if t.prediction and t.peak_bytes and t.reused_from is None:
            peak = abs(t.prediction["peak"] / t.peak_bytes - 1)
            seconds = abs(t.prediction["seconds"] / t.step_seconds - 1) if t.status == "measured" else None
            out.append((peak, seconds))
    return out


def error_line(what: str, errors: list[float]) -> str:
    if not errors:
        return f"Planner {what} predictions: none to compare.\n"
    return (
        f"Planner {what} prediction error on {len(errors)} plans it proposed (each predicted before it "
        f"was measured): mean {statistics.mean(errors):.1%}, max {max(errors):.1%}.\n"
    )


def compiles(trials: list[remat_search.TrialResult]) -> int:
    """Plans the compiler saw for these trials: not the study's own reuses, nor plans screened
    out (``prescreen``); a measurement cache hit counts, as the method alone would have compiled it."""
    return sum(1 for t in trials if t.reused_from is None and t.measurement is not None and t.measurement.compiled)


def markdown(rows: list[dict[str, str]]) -> str:
    """A markdown table of ``rows`` (columns: the first row's keys)."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_best_so_far(
    curves: dict[float, tuple[dict[str, list[float | None]], float]], path: Path, *, within: float, times: str,
) -> None:
    """One panel a budget: each method's best so far against trials, as a ratio to no remat's
    step (``times`` says which times), and the line ``within`` of the best any method found."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), dpi=120, squeeze=False)
    for ax, (fraction, (by_method, line)) in zip(axes[0], curves.items(), strict=True):
        for method, best in by_method.items():
            xs = [i for i, b in enumerate(best, 1) if b is not None]
            ax.step(xs, [best[i - 1] for i in xs], where="post", label=method)
        ax.axhline(line, color="grey", linestyle="--", linewidth=0.8, label=f"within {within:.0%} of the best found")
        ax.set_title(f"budget {fraction:.0%} of the no-remat peak")
        ax.set_xlabel("trial")
        ax.set_ylabel(f"best so far: step time / no remat's ({times})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
