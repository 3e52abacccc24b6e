"""The planner in a ``layout: tensors`` space against an exhaustive enumeration of it, on a TPU
topology compiled ahead of time (step times estimated, so one pass is the answer).

    python benchmarks/tensors_exhaustive.py                    # 3 tensors, 3³ = 27 combinations
    python benchmarks/tensors_exhaustive.py --tensors context,out_proj --planner-trials 6

The suite's form (``tests/search/test_tensors.py``) places 2 tensors (9 combinations). Here the
built-in transformer with long sequences (its saved tensors, not its weights, set its peak) on
``v5e:2x2`` over ``fsdp: 4``: a planner study of ``--planner-trials`` trials (the 3 presets,
then its proposals), then every combination (optuna's grid sampler) in a second study of the
same SQLite file, which compiles only what the planner did not. For each budget (fractions of
the span between the least and the most peak of the enumeration) it prints the exhaustive
optimum, the planner's answer and its estimate over the optimum's (the estimates' own error band,
×1.11–1.20 here, is far wider than any gap: this compares searches, not plans), and after how many
of its trials the planner first held the optimum.
Writes ``results/tensors_exhaustive.md`` beside this file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import optuna

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import remat_search
from remat_search.search import samplers
from remat_search.spec.loading import parse_spec
from remat_search.units import format_bytes
from tests.conftest import TINY_TRANSFORMER, spec_dict

WIDE = {**TINY_TRANSFORMER, "d_model": 64, "d_ff": 256, "seq_len": 512, "batch": 16}


class _Grid(optuna.samplers.GridSampler):
    """Optuna's grid sampler, without its request to stop the study once every point is taken."""

    def after_trial(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", default="context,out_proj,mlpwi", help="the tensor names to place")
    parser.add_argument("--planner-trials", type=int, default=10, help="the planner study's trials, presets included")
    parser.add_argument("--budgets", default="0.25,0.5,0.75", help="fractions of the span of the enumeration's peaks")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    tensors = args.tensors.split(",")
    combinations = 3 ** len(tensors)
    folder = Path(tempfile.mkdtemp(prefix="tensors-exhaustive-"))
    storage = f"sqlite:///{folder / 'studies.db'}"
    common = {
        "space": {"layout": "tensors", "tensors": tensors}, "target": {"platform": "tpu", "topology": "v5e:2x2"},
        "mesh": {"fsdp": 4}, "budget": "1GiB", "confirm": {"top": 0}, "workload": WIDE, "compilation_cache": None,
    }
    samplers.register("grid")(lambda space, budget, seed: _Grid({u: list(space.labels) for u in space.units}, seed=seed))
    started = time.monotonic()
    everything = remat_search.run(parse_spec(spec_dict(
        storage, study="exhaustive", trials=combinations + 3, sampler={"kind": "grid", "seed": 0}, **common,
    )))
    enumerated = time.monotonic() - started
    peaks = sorted({t.peak_bytes for t in everything.trials if t.peak_bytes is not None})
    rows = []
    for fraction in (float(f) for f in args.budgets.split(",")):
        budget = int(peaks[0] + fraction * (peaks[-1] - peaks[0]))
        optimum = everything.best(budget)
        started = time.monotonic()
        planned = remat_search.run(parse_spec(spec_dict(
            storage, study=f"planner-{fraction}", trials=args.planner_trials, sampler={"kind": "planner", "seed": 0},
            **{**common, "budget": budget},
        )))
        seconds = time.monotonic() - started
        found = planned.best(budget)
        first = next((i + 1 for i, t in enumerate(planned.trials) if t.plan is not None and t.plan.digest == optimum.plan.digest), None)
        rows.append((fraction, budget, optimum, found, first, len(planned.trials), seconds))
    lines = [
        f"# The planner against every combination of {len(tensors)} tensors' places ({combinations}), v5e:2x2, estimated",
        "",
        (f"`python benchmarks/tensors_exhaustive.py --tensors {args.tensors} --planner-trials {args.planner_trials}`; "
         f"the enumeration: {combinations} compiles in {enumerated:.0f} s on this host. Budgets: fractions of the span "
         f"{format_bytes(peaks[0])} – {format_bytes(peaks[-1])} of its peaks."),
        "",
        "| budget | exhaustive optimum | est. step | planner's answer | est. step | vs optimum | same plan | planner trial that first held it | planner trials |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fraction, budget, optimum, found, first, trials, _ in rows:
        lines.append(
            f"| {fraction:.2f} ({format_bytes(budget)}) | {optimum.summary()} | {optimum.seconds * 1e6:.3f} µs | "
            f"{found.summary()} | {found.seconds * 1e6:.3f} µs | ×{found.seconds / optimum.seconds:.4f} | {'yes' if found.plan.digest == optimum.plan.digest else 'no'} "
            f"| {first or 'never'} | {trials} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tensors_exhaustive.md").write_text(text)


if __name__ == "__main__":
    main()
