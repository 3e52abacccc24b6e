"""The eight searched published MaxText runs, searched over MaxText's whole per-tensor space.

    python benchmarks/published_tensors.py --runs v5e-32b              # 12 candidates (resumes a kept study)
    python benchmarks/published_tensors.py --runs v5e-32b --trials 20  # 8 more
    python benchmarks/published_tensors.py --report                    # the page again, compiling nothing

Each run of ``published_configs.RUNS`` that is searched there (eight) is one study here,
``maxtext-<run>-tensors``, on the run's TPU slice, compiled ahead of time by MaxText's own
functions with the XLA flags of the run's script (``published_configs.search``). Its space is
MaxText's ``remat_policy: custom`` (``space: {layout: tensors}``): every tensor the run's model
tags on the device, recomputed or offloaded; beside it, the batch a data-parallel device runs
(with accumulation making up the published global batch) and the meshes the run lists. The
published configuration is the first candidate (a ``points`` entry at the published batch and
mesh), then the presets (every tensor at one place), then the planner's proposals.

Every estimate is priced by the run's chip group's calibration (``published_programs/v5.json``,
``v6e.json``): its band is measured a model family at a time (published step / estimate). The
answer **beats** the published configuration only where its slowest step within its band is
faster than the published configuration's fastest within its own (the same global batch on the
same chips: steps compare as throughputs do). An answer whose estimate lies outside the
calibration's samples (a kind of plan, or a tensor axis, that no sample has) is **unconfirmed**,
not counted. Writes ``benchmarks/results/published_tensors.md``; keeps the studies in
``benchmarks/results/studies/published_tensors.db``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import optuna

import remat_search
from remat_search.report.results import StudyReport, TrialResult, rank
from remat_search.targets.calibration import banded_kind, load_calibration
from remat_search.units import format_bytes

from published_configs import QKV, RUNS, Run, at_published_configuration, group, label, search  # benchmarks/ is the script's folder

HERE = Path(__file__).resolve().parent
DB = HERE / "results" / "studies" / "published_tensors.db"
PAGE = HERE / "results" / "published_tensors.md"
PROGRAMS = HERE / "results" / "published_programs"
TRIALS = 12
"""Candidates a run's study compiles at the least (issue 48): the published one, the presets, the planner's."""

CANDIDATE_STATUSES = ("measured", "over_budget", "failed", "infeasible")
"""The trials counted as candidates: compiled (or refused by MaxText); not those a stopped sitting cut off."""

TENSORS_2023 = ("decoder_layer_input", *QKV, "context", "attention_out", "out_proj", "mlpwi", "mlpwo")
"""What MaxText 0.2.5's ``decoder_block: default`` (the 2023 runs' model: ReLU MLP) tags, as
traced on v5e-32b's slice (the study's ``device_info.traced_bytes``)."""
TENSORS_LLAMA = ("decoder_layer_input", *QKV, "context", "attention_out", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
"""What its ``llama2`` decoder layer (Llama 2 and 3.1: gated MLP) tags."""


def searched() -> list[Run]:
    """The published runs ``published_configs`` searches (the others are fidelity samples alone)."""
    return [r for r in RUNS if r.trials > 1]


def tensors(run: Run) -> tuple[str, ...]:
    return TENSORS_LLAMA if "model_name" in run.model else TENSORS_2023


def rebanded(run: Run, report: StudyReport) -> StudyReport:
    """The study with each calibrated estimate's band read again from the run's calibration by
    today's rule (``Calibration.band``, a 95% prediction interval): the kept studies were priced
    when a band was its samples' lowest and highest ratio. The estimates themselves are unchanged."""
    calibration = load_calibration(PROGRAMS / f"{group(run.chip)}.json")
    trials = []
    for t in report.trials:
        e = t.measurement.estimate if t.measurement is not None else None
        if e is None or e.calibration != calibration.name or t.plan is None:
            trials.append(t)
            continue
        band = e.model_copy(update={"band": calibration.band(banded_kind(t.plan.kind, e))})  # as the target bands it
        trials.append(t.model_copy(update={"measurement": t.measurement.model_copy(update={"estimate": band})}))
    return report.model_copy(update={"trials": tuple(trials)})


def published_point(run: Run) -> dict[str, Any]:
    """The published policy as a point of the run's space: its kept and offloaded names that the
    model tags (MaxText's ``minimal`` names both MLP forms; a model tags one)."""
    choice = run.choices[0]
    if choice == "full":
        return choice  # type: ignore[return-value]  # every tensor recomputed
    names = tensors(run)
    kept = [n for n in choice.get("names", []) if n in names]
    offloaded = [n for n in choice.get("offload", []) if n in names]
    return {"label": choice["label"], "per_name": {"device": kept, "offload": offloaded}}


def tensor_study(run: Run, storage: str, trials: int, study: str | None = None) -> StudyReport:
    """The run's per-tensor study (``maxtext-<run>-tensors``, or ``study``), run (or resumed) to ``trials`` candidates."""
    calibration = PROGRAMS / f"{group(run.chip)}.json"
    space = {"layout": "tensors", "tensors": list(tensors(run)), "points": [published_point(run)]}
    target = {"platform": "tpu", "topology": run.topology, "calibration": str(calibration)}
    return search(run, storage, trials, study=study or f"maxtext-{run.name}-tensors", space=space, target=target)


def published_trial(run: Run, report: StudyReport) -> TrialResult | None:
    """The published configuration's trial: the first candidate (the published point), at the published batch and mesh."""
    first = next((t for t in report.trials if t.number == 0), None)
    return first if first is not None and at_published_configuration(run, first) else None


def verdict(best: TrialResult, pub: TrialResult) -> str:
    """Beaten beyond both bands, within them, or unconfirmed (an estimate outside the samples)."""
    ours, theirs = best.measurement.estimate, pub.measurement.estimate  # type: ignore[union-attr]
    if ours is None or theirs is None or ours.band is None or theirs.band is None:
        return "— (no band)"
    if best.number == pub.number or best.seconds >= pub.seconds:  # type: ignore[operator]
        return "the published configuration is the fastest found"
    if ours.outside:
        return f"unconfirmed ({ours.outside})"
    beyond = ours.seconds * ours.band[1] < theirs.seconds * theirs.band[0]
    return "**beaten**" if beyond else "not beaten (within the bands)"


def needed(best: TrialResult, pub: TrialResult) -> float | None:
    """The throughput gain over the published configuration that :func:`verdict` would count as
    beaten: the answer's slow end of its band against the published configuration's fast end."""
    ours, theirs = best.measurement.estimate, pub.measurement.estimate  # type: ignore[union-attr]
    if ours is None or theirs is None or ours.band is None or theirs.band is None:
        return None
    return ours.band[1] / theirs.band[0] - 1


def summary(results: list[tuple[Run, StudyReport]]) -> list[str]:
    """How many runs are beaten, and what stands in the way of the others: the gain each found
    against the gain its bands would count, or why it is not counted."""
    lines, beaten = [], 0
    for run, report in results:
        pub, (best, _, _) = published_trial(run, report), best_and_counts(report)
        if pub is None or best is None or not pub.throughput or not best.throughput:
            continue
        said, gain, wanted = verdict(best, pub), best.throughput / pub.throughput - 1, needed(best, pub)
        beaten += said == "**beaten**"
        lines.append(f"- {run.name}: {said}; found {gain:+.1%}" + (f", where {wanted:+.1%} would count" if wanted is not None else ""))
    return [
        f"**Beaten: {beaten} of {len(lines)} searched runs** (issue 48's goal: 3 of 8). A gain counts only beyond the "
        "model's error on models it never saw (the bands), so it must be larger than their width; the best each study "
        "found, against that:", "", *lines, "",
    ]


def best_and_counts(report: StudyReport) -> tuple[TrialResult | None, int, int]:
    """The study's fastest fitting trial, its candidates, and the compiles the TPU compiler was handed
    (its out-of-memory refusals among them; not those the cost model screened out over the budget)."""
    timed = report.timed()
    best = min(timed, key=rank) if timed else None
    candidates = sum(1 for t in report.trials if t.status in CANDIDATE_STATUSES)
    compiled = sum(1 for t in report.trials if t.measurement is not None and t.measurement.compiled)
    return best, candidates, compiled


def row(run: Run, report: StudyReport, minutes: float) -> str:
    pub = published_trial(run, report)
    best, candidates, compiled = best_and_counts(report)
    if pub is None or best is None or pub.throughput is None or best.throughput is None:
        return f"| {run.name} | — | — | — | — | — | — | — | {candidates} | {compiled} | {minutes:.0f} min |"
    band = pub.measurement.estimate.band if pub.measurement and pub.measurement.estimate else None  # type: ignore[union-attr]
    shown = f"×{band[0]:.3f}–{band[1]:.3f}" if band else "—"
    return (f"| {run.name} | {label(run.choices[0])}: {pub.throughput:,.0f} ({pub.status}) | {best.summary()} | "
            f"{format_bytes(best.peak_bytes or 0)} | {best.throughput:,.0f} | {best.throughput / pub.throughput - 1:+.1%} | "
            f"{shown} | {verdict(best, pub)} | {candidates} | {compiled} | {minutes:.0f} min |")


def page(rows: list[str], command: str, verdicts: list[str]) -> str:
    return "\n".join([
        "# Published MaxText runs, searched over MaxText's per-tensor space", "",
        f"Command: `{command}`. " + " ".join(__doc__.split(chr(10) + chr(10), 2)[2].replace("``", "`").split()), "",
        "Throughput is estimated tokens/s per chip at the run's calibration; the band is the published "
        "configuration's (published step / estimate, its model family left out). Candidates: trials "
        "(those screened out over the budget by the cost model and those MaxText refused among them); compiles: "
        "those handed to the TPU compiler, its out-of-memory refusals included. Wall: minutes of this 2-core machine, summed over the sittings.", "",
        "| run | published config, est. tokens/s | best found | its peak | its est. tokens/s | gain | band | verdict | "
        "candidates | compiles | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", *verdicts,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", default=[r.name for r in searched()], help="which searched runs (default: all eight)")
    parser.add_argument("--trials", type=int, default=TRIALS, help=f"candidates of each study (default {TRIALS})")
    parser.add_argument("--report", action="store_true", help="write the page from the kept studies, compiling nothing")
    args = parser.parse_args()
    DB.parent.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{DB}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows, results = [], []
    for run in searched():  # the page has every run: those not searched now, as kept
        name = f"maxtext-{run.name}-tensors"
        if args.report or run.name not in args.runs:
            try:
                report = remat_search.load_report(name, storage)
            except Exception:  # noqa: BLE001 - a run not searched yet
                continue
        else:
            start = time.monotonic()
            report = tensor_study(run, storage, args.trials)
            study = optuna.load_study(study_name=name, storage=storage)
            study.set_user_attr("benchmark_minutes", study.user_attrs.get("benchmark_minutes", 0.0) + (time.monotonic() - start) / 60)
        minutes = optuna.load_study(study_name=name, storage=storage).user_attrs.get("benchmark_minutes", 0.0)
        report = rebanded(run, report)
        rows.append(row(run, report, minutes))
        results.append((run, report))
        print(rows[-1], flush=True)
    PAGE.write_text(page(rows, "python benchmarks/published_tensors.py", summary(results)))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
