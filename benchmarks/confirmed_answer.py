"""Is the answer at a study's budget a plan confirmation re-timed? Demo-sized studies on this host.

    python benchmarks/confirmed_answer.py                 # 10 studies of search_spaces/demo.yaml
    python benchmarks/confirmed_answer.py --studies 12 --trials 16

Each study is the demo spec with its own sampler seed and its own SQLite file (no measurement
shared between studies: each times its plans afresh, with this machine's noise). The search
ends with confirmation, which races (``confirm.races``): while a plan its session did not
re-time ranks first at the budget by its single search time, that plan is re-timed with the
others. The table says, per study, whether the plan that ranked first after the first session
was one it had re-timed (the rule before racing answered with it either way), how many races
followed, and where the answer's time finally comes from. Written to
``benchmarks/results/confirmed_answer.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import optuna

import remat_search
from remat_search.spec.loading import load_spec
from remat_search.search.progress import Progress
from remat_search.units import format_bytes, format_seconds

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "confirmed_answer.md"


def one_study(seed: int, trials: int, folder: Path) -> dict[str, object]:
    """Search the demo with ``seed`` into its own database; what its answer at the budget is."""
    storage = f"sqlite:///{folder / f'demo-{seed}.db'}"
    spec = load_spec(ROOT / "search_spaces" / "demo.yaml", storage=storage)
    spec = spec.model_copy(update={
        "study": f"demo-{seed}", "trials": trials, "compilation_cache": None,
        "sampler": spec.sampler.model_copy(update={"seed": seed}),
    })
    sessions: list[Progress] = []

    def heard(p: Progress) -> None:
        if p.event == "confirm":
            sessions.append(p)

    started = time.monotonic()
    report = remat_search.run(spec, on_progress=heard)
    best = report.best(report.budget)
    races = max((p.race for p in sessions), default=0)
    settled = optuna.load_study(study_name=spec.study, storage=storage).user_attrs.get("confirmation_settled", {})
    return {
        "seed": seed, "trials": len(report.trials), "timed": len(report.timed()),
        "re-timed": sum(1 for t in report.timed() if t.confirmed), "races": races,
        "first": "re-timed" if races == 0 else "search time only",
        "answer": f"#{best.number} {best.summary()}", "peak": format_bytes(best.peak_bytes or 0),
        "step": format_seconds(best.seconds or 0), "source": best.time_source,
        "exhausted": bool(settled.get("exhausted")), "minutes": (time.monotonic() - started) / 60,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--studies", type=int, default=10)
    parser.add_argument("--trials", type=int, default=24, help="trials a study (the demo's: 24)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.studies):
            rows.append(one_study(seed, args.trials, Path(folder)))
            r = rows[-1]
            print(f"study {seed}: {r['answer']} ({r['source']}), {r['races']} races, {r['minutes']:.1f} min", flush=True)
    lines = [
        f"{len(rows)} demo studies (search_spaces/demo.yaml, {args.trials} trials, seeds 0–{len(rows) - 1}), "
        "each in its own SQLite file, confirm: top 3, 10 rounds, presets, races 10.",
        "",
        "| seed | trials | plans timed | re-timed | first after session 1 | races | answer at the budget | peak | step | time source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['trials']} | {r['timed']} | {r['re-timed']} | {r['first']} | {r['races']} | "
            f"{r['answer']} | {r['peak']} | {r['step']} | {r['source']}{' (races ran out)' if r['exhausted'] else ''} |"
        )
    unconfirmed = sum(1 for r in rows if r["source"] != "confirmed")
    before = sum(1 for r in rows if r["first"] != "re-timed")
    lines += [
        "",
        f"Answers at the study's budget timed by the search only: **{unconfirmed} of {len(rows)}**. "
        f"Without racing (the rule before it: the first session, then the mixed ranking), "
        f"{before} of {len(rows)} would have been.",
    ]
    text = "\n".join(lines)
    print(text)
    RESULTS.write_text(text + "\n")


if __name__ == "__main__":
    main()
