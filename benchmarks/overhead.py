"""The overhead curve: activation memory saved against estimated step overhead, on the v5e
write-up configuration with dense and with flash attention.

One command, from any machine with libtpu (``pip install -e '.[tpu,plot]'``):

    python benchmarks/overhead.py                        # both variants; see the results file for its time here
    python benchmarks/overhead.py --attention flash --trials 1

The configuration is ``search_spaces/v5e-writeup.yaml``'s (8 layers, d_model 2048, 32 × 2048
tokens in bf16, data parallel over ``v5e:2x4``, its seven choices), compiled ahead of time by
the real TPU compiler: nothing runs, and a step's time is the library's estimate of the compiled
program (``Target.estimate``; the results name the model). For each variant: its uniform
presets are compiled first (a study of their own, at the chip's HBM); then, for each cut of
20%, 40%, 60% and 70% of no remat's activations (its compiled temp bytes), a planner study with
the budget ``no-remat peak − cut × no-remat temp`` begins from the same presets and proposes
``--trials`` plans of its own. The studies of a variant share one SQLite file's measurement
cache, so each plan compiles once. The best plan found for a budget is the fastest of every plan
compiled for the variant that fits it, whichever study proposed it; beside it, the fastest
uniform preset that fits. Columns:

* saved: (no remat's peak − the plan's) / no remat's temp bytes, the cut the plan makes in the
  budget's own terms;
* overhead: the plan's estimated step over no remat's, − 1.

Below the table, each variant's front: the plans no other is both smaller and faster than.
Writes ``results/overhead.md`` and ``results/overhead.png`` beside this file; the studies stay in
``results/studies/overhead-<attention>.db``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

import optuna
from search_quality import fits, markdown, presets_of
from search_quality_tpu import compile_seconds, fresh_storage, search, versions

import remat_search
from remat_search.report.results import pareto
from remat_search.spec.models import SearchSpec
from remat_search.units import format_bytes

HERE = Path(__file__).resolve().parent
SPEC = HERE.parent / "search_spaces" / "v5e-writeup.yaml"
CUTS = (0.2, 0.4, 0.6, 0.7)


class Variant(NamedTuple):
    """One attention variant's studies: no remat, its activations, the presets, every plan that fit."""

    attention: str
    none: remat_search.TrialResult
    temp: int
    presets: list[remat_search.TrialResult]
    plans: list[remat_search.TrialResult]
    reports: list[remat_search.StudyReport]
    minutes: float

    def saved(self, t: remat_search.TrialResult) -> float:
        """The cut ``t`` makes: (no remat's peak − its) / no remat's temp bytes."""
        return (self.none.peak_bytes - t.peak_bytes) / self.temp

    def overhead(self, t: remat_search.TrialResult) -> float:
        """``t``'s estimated step over no remat's, − 1."""
        return t.seconds / self.none.seconds - 1

    def budget(self, cut: float) -> int:
        return int(self.none.peak_bytes - cut * self.temp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", choices=["dense", "flash"], action="append", help="default: both")
    parser.add_argument("--trials", type=int, default=2, help="the planner's own trials per budget (default 2)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep-cache", action="store_true",
                        help="keep the earlier run's measurement cache (its studies are searched afresh either way)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    (args.out / "studies").mkdir(parents=True, exist_ok=True)
    spec = remat_search.load_spec(SPEC)
    began = time.perf_counter()
    variants = [
        search_variant(spec, attention, args.out / "studies" / f"overhead-{attention}.db", trials=args.trials,
                       keep_cache=args.keep_cache)
        for attention in args.attention or ["dense", "flash"]
    ]
    header = (
        f"# Activation memory saved vs estimated overhead ({SPEC.name}, {spec.target.topology})\n\n"
        f"Command: `python benchmarks/overhead.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}` "
        f"(the planner's own trials per budget: {args.trials})\n\n" + "".join(map(described, variants)) + "\n"
    )
    text = (
        header + "## The uniform presets\n\n" + markdown([row for v in variants for row in preset_rows(v)])
        + "\n## The best plan found for each cut, beside the best preset\n\n"
        + markdown([row for v in variants for row in cut_rows(v)])
        + "\n## The front of every plan compiled (least memory first)\n\n"
        + markdown([row for v in variants for row in front_rows(v)])
        + f"\nWhole run: {(time.perf_counter() - began) / 60:.0f} min"
        + (" (measurement cache of an earlier run kept)" if args.keep_cache else "") + ".\n"
    )
    (args.out / "overhead.md").write_text(text)
    print(text)
    plot(variants, args.out / "overhead.png")
    print(f"wrote {args.out / 'overhead.md'} and {args.out / 'overhead.png'}")


def search_variant(spec: SearchSpec, attention: str, db: Path, *, trials: int, keep_cache: bool) -> Variant:
    """The presets' study, then a planner study a cut, of one attention variant (see the module doc)."""
    started = time.perf_counter()
    storage = fresh_storage(db, keep_cache=keep_cache)
    workload = spec.workload.model_copy(update={"attention": attention}).model_dump()
    choices = [c.model_dump() for c in spec.space.choices]
    common = {"target": spec.target.model_dump(), "mesh": spec.mesh}
    reports = [search(storage, f"presets-{attention}", workload, choices, layout="uniform", trials=len(choices),
                      sampler="random", **common)]
    presets = presets_of(reports[0])
    none = next(t for t in presets if t.labels[0] == "none")
    assert none.measurement is not None and none.measurement.memory is not None and none.seconds is not None
    temp = none.measurement.memory.temp
    print(f"{attention}: no remat {format_bytes(none.peak_bytes)} peak, {format_bytes(temp)} temp, "
          f"est. step {none.seconds * 1e3:.1f} ms", flush=True)
    for cut in CUTS:
        budget = int(none.peak_bytes - cut * temp)
        reports.append(search(storage, f"planner-{attention}-{cut:.2f}", workload, choices, budget=budget,
                              trials=len(choices) + trials, sampler="planner", **common))
        print(f"  −{cut:.0%}: budget {format_bytes(budget)}", flush=True)
    plans = unique([t for r in reports for t in r.trials if t.status == "measured" and t.seconds is not None])
    return Variant(attention, none, temp, presets, plans, reports, (time.perf_counter() - started) / 60)


def described(v: Variant) -> str:
    compiled = [t for r in v.reports for t in r.trials]
    return (
        f"- {v.attention}: no remat {format_bytes(v.none.peak_bytes)} peak, {format_bytes(v.temp)} activations, "
        f"est. step {v.none.seconds * 1e3:.1f} ms ({v.none.measurement.time_model} model; {versions(v.reports[0])}); "
        f"{len(v.plans)} plans compiled, {compile_seconds(compiled) / 60:.0f} min of compiles, "
        f"{v.minutes:.0f} min in all.\n"
    )


def cut_rows(v: Variant) -> list[dict[str, str]]:
    """A row a cut: the best plan found that fits its budget, and the best preset."""
    rows = []
    for cut in CUTS:
        budget = v.budget(cut)
        best = min((t for t in v.plans if fits(t, budget)), key=lambda t: t.seconds, default=None)
        preset = min((t for t in v.presets if fits(t, budget)), key=lambda t: t.seconds, default=None)
        rows.append({
            "attention": v.attention, "cut": f"−{cut:.0%}", "budget": format_bytes(budget),
            "best plan found": best.summary() if best else "—", "peak": format_bytes(best.peak_bytes) if best else "—",
            "saved": f"{v.saved(best):.0%}" if best else "—", "est. step": f"{best.seconds * 1e3:.1f} ms" if best else "—",
            "overhead": f"{v.overhead(best):+.1%}" if best else "—",
            "best preset": preset.summary() if preset else "none fits",
            "preset saved": f"{v.saved(preset):.0%}" if preset else "—",
            "preset overhead": f"{v.overhead(preset):+.1%}" if preset else "—",
        })
    return rows


def preset_rows(v: Variant) -> list[dict[str, str]]:
    """A row a uniform preset: its compiled peak and activations, both models' step times."""
    rows = []
    for t in sorted(v.presets, key=lambda t: -t.peak_bytes):
        estimate = t.measurement.estimate
        rows.append({
            "attention": v.attention, "plan": t.labels[0], "peak / chip": format_bytes(t.peak_bytes),
            "activations (temp)": format_bytes(t.measurement.memory.temp), "saved": f"{v.saved(t):.0%}",
            "est. step": f"{t.seconds * 1e3:.1f} ms", "overhead": f"{v.overhead(t):+.1%}",
            "whole-program roofline": f"{estimate.roofline_seconds * 1e3:.1f} ms" if estimate and estimate.roofline_seconds else "—",
            "GFLOP / chip": f"{t.measurement.flops / 1e9:,.0f}",
            "compile": f"{t.measurement.compile_seconds:.0f} s" if t.measurement.compile_seconds else "—",
        })
    return rows


def front_rows(v: Variant) -> list[dict[str, str]]:
    return [
        {"attention": v.attention, "plan": t.summary(), "peak": format_bytes(t.peak_bytes),
         "activations (temp)": format_bytes(t.measurement.memory.temp), "saved": f"{v.saved(t):.0%}",
         "est. step": f"{t.seconds * 1e3:.1f} ms", "overhead": f"{v.overhead(t):+.1%}"}
        for t in pareto(v.plans)
    ]


def unique(trials: list[remat_search.TrialResult]) -> list[remat_search.TrialResult]:
    """One trial a plan (the first), whichever study it is from."""
    first: dict[str, remat_search.TrialResult] = {}
    for t in trials:
        assert t.plan is not None
        first.setdefault(t.plan.digest, t)
    return list(first.values())


def plot(variants: list[Variant], path: Path) -> None:
    """One panel a variant: every plan compiled, the front, the presets named, the cuts marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(variants), figsize=(6 * len(variants), 4.5), dpi=120, squeeze=False)
    for ax, v in zip(axes[0], variants, strict=True):
        ax.scatter([100 * v.saved(t) for t in v.plans], [100 * v.overhead(t) for t in v.plans], s=12, color="grey",
                   label="plans compiled")
        front = pareto(v.plans)
        ax.step([100 * v.saved(t) for t in front], [100 * v.overhead(t) for t in front], where="pre", color="C0",
                label="front")
        for t in v.presets:
            if t.seconds is not None:
                ax.scatter([100 * v.saved(t)], [100 * v.overhead(t)], marker="s", color="C1", s=24)
                ax.annotate(t.labels[0], (100 * v.saved(t), 100 * v.overhead(t)), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
        for cut in CUTS:
            ax.axvline(100 * cut, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(f"{v.attention} attention")
        ax.set_xlabel("activation memory saved: peak cut / no remat's temp bytes (%)")
        ax.set_ylabel("estimated step overhead vs no remat (%)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
