"""MaxText's own search (``maxtext.utils.estimator``) on the eight searched published runs, beside ours.

    python benchmarks/maxtext_estimator.py --runs v5p-32b   # MaxText's estimator on it, its answer priced (kept: a run done is not run again)
    python benchmarks/maxtext_estimator.py --report         # the page again from what is kept, compiling nothing
    python benchmarks/maxtext_estimator.py --frontier --runs v5e-16b   # its mode 2 too: the batch/policy frontier, each point priced

MaxText 0.2.5 ships a search of its own: for a config it orders the tensors its layer tags by a
shape score and walks each from ``device`` to ``offload`` to ``remat``, asking MaxText's
``train_compile.is_oom`` (an ahead-of-time compile for the chips) whether each policy fits. Given
the run's ``per_device_batch_size`` (its mode 1, the published global batch kept, as ours keeps
it) it starts from every tensor on the device and steps down until a policy fits: that policy is
its answer. It times nothing and keeps the mesh. Here it runs as a MaxText user runs it
(``python -m maxtext.utils.estimator`` with the run's config as ``key=value`` arguments, the
run's XLA flags in ``LIBTPU_INIT_ARGS``), and every compile it asks for is counted from its own
output. Its answer is then compiled once more by remat-search as the only candidate of a study
(``maxtext-<run>-estimator``, the published batch and mesh) and priced at the same calibration as
ours (``published_tensors``): its estimated throughput beside our answer's, and the compiles each
spent. Keeps the estimator's outputs in ``benchmarks/results/maxtext_estimator.json`` and writes
``benchmarks/results/maxtext_estimator.md``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from published_configs import SYNTHETIC, Run, batch, search  # benchmarks/ is the script's folder
from published_tensors import DB, HERE, PROGRAMS, best_and_counts, group, published_trial, rebanded, searched, tensors

import remat_search
from remat_search.report.results import StudyReport, TrialResult

KEPT = HERE / "results" / "maxtext_estimator.json"
PAGE = HERE / "results" / "maxtext_estimator.md"
LOGS = HERE / "results" / "maxtext_estimator"
PICTURE = HERE / "results" / "maxtext_estimator.png"


def topology_name(run: Run) -> str:
    """MaxText's name of the run's slice (``compile_topology``): ``v5p:4x4x4`` is ``v5p-128``."""
    from maxtext.utils.accelerator_to_spec_map import UserFacingNameToSystemCharacteristics

    chip, shape = run.topology.split(":")
    wanted = f"{'v5' if chip == 'v5p' else chip}:{shape}"
    return next(name for name, s in UserFacingNameToSystemCharacteristics.items()
                if name.startswith(chip + "-") and s.topology_name == wanted)


def argv(run: Run, frontier: bool = False) -> list[str]:
    """The run as MaxText's command line takes it: its config, its batch and mesh, the slice; for
    the ``frontier``, without ``per_device_batch_size`` (the estimator's mode 2 searches it)."""
    from maxtext.configs import pyconfig

    keys = {**run.model, **SYNTHETIC, "max_target_length": run.seq,
            **({} if frontier else {"per_device_batch_size": run.per_device_batch}),
            **{f"ici_{axis}_parallelism": n for axis, n in run.mesh.items()},
            **{key: values[0] for key, values in run.settings.items()},
            "compile_topology": topology_name(run), "compile_topology_num_slices": 1, "hardware": "tpu",
            "base_output_directory": "/tmp/maxtext-estimator", "skip_jax_distributed_system": True}
    return [os.path.join(os.path.dirname(pyconfig.__file__), "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


CHECK = re.compile(r"Checking whether batch_size=(\S+) and policy=(\{.*\}) is OOM")
VERDICT = re.compile(r"Is OOM: (True|False)")
ANSWER = re.compile(r"Found valid combo: pdb=(\S+), policy=(\{.*\})")


def estimate(run: Run, frontier: bool = False) -> dict[str, Any]:
    """MaxText's estimator on ``run``: each policy it compiled and whether it fit, its answer, its
    minutes; for the ``frontier`` (its mode 2), each batch too, and every point it prints."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{run.name}{'-frontier' if frontier else ''}.log"
    env = {**os.environ, "LIBTPU_INIT_ARGS": run.flags, "TF_CPP_MIN_LOG_LEVEL": "2",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # this process's own studies have loaded libtpu
    start = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "maxtext.utils.estimator", *argv(run, frontier)], env=env,
                              stdout=out, stderr=subprocess.STDOUT, check=False)
    minutes = (time.monotonic() - start) / 60
    text = "".join(line for line in log.read_text().splitlines(keepends=True) if "Config param" not in line)
    log.write_text(text)  # kept without MaxText's banner of every config key
    asked = [(float(m.group(1)), ast.literal_eval(m.group(2))) for m in CHECK.finditer(text)]
    fits = [m.group(1) == "False" for m in VERDICT.finditer(text)]
    answers = [(float(m.group(1)), ast.literal_eval(m.group(2))) for m in ANSWER.finditer(text)]
    error = text.strip().splitlines()[-1] if done.returncode and text.strip() else None
    kept: dict[str, Any] = {"exit": done.returncode, "error": error, "compiles": len(asked), "minutes": round(minutes, 1)}
    if not frontier:
        return {**kept, "asked": [{"policy": p, "fits": f} for (_, p), f in zip(asked, fits, strict=False)],
                "answer": answers[0][1] if answers else None}
    return {**kept, "asked": [{"batch": b, "policy": p, "fits": f} for (b, p), f in zip(asked, fits, strict=False)],
            "points": [{"batch": b, "policy": p} for b, p in answers] if not done.returncode else None}


def answer_point(run: Run, policy: dict[str, str]) -> Any:
    """The estimator's answer as a point of the run's per-tensor space (a name it leaves unset is
    MaxText's default, ``remat``; ``decoder_layer_input`` it sets to ``device``)."""
    names = tensors(run)
    kept = [n for n in names if policy.get(n, "device" if n == "decoder_layer_input" else "remat") == "device"]
    offloaded = [n for n in names if policy.get(n) == "offload"]
    return {"label": "maxtext_estimator", "per_name": {"device": kept, "offload": offloaded}}


def calibrated(run: Run) -> dict[str, str]:
    """The run's slice as a target priced at its chip group's calibration (``published_tensors``'s)."""
    return {"platform": "tpu", "topology": run.topology, "calibration": str(PROGRAMS / f"{group(run.chip)}.json")}


def priced(run: Run, policy: dict[str, str], storage: str) -> StudyReport:
    """The estimator's answer compiled by remat-search alone, at the published batch and mesh, priced at the run's calibration."""
    space = {"layout": "tensors", "tensors": list(tensors(run)), "points": [answer_point(run, policy)]}
    configuration = {"batch": [batch(run)], "global_batch": run.chips * run.per_device_batch, "mesh": [run.mesh]}
    return search(run, storage, 1, study=f"maxtext-{run.name}-estimator", space=space, target=calibrated(run),
                  configuration=configuration)


def frontier_points(run: Run, points: list[dict[str, Any]]) -> dict[float, list[dict[str, Any]]]:
    """The estimator's frontier as points of the run's per-tensor space, by batch, one a plan (it
    also sets ``kv_proj``, which no model here tags, so two of its points may be one plan)."""
    by_batch: dict[float, dict[str, Any]] = {}
    for p in points:
        at = by_batch.setdefault(p["batch"], {})
        point = answer_point(run, p["policy"])
        if str(point["per_name"]) not in at:
            at[str(point["per_name"])] = {**point, "label": f"frontier_{len(at)}"}
    return {pdb: list(at.values()) for pdb, at in sorted(by_batch.items())}


def frontier_name(run: Run, pdb: float) -> str:
    return f"maxtext-{run.name}-frontier-{pdb:g}"


def frontier_studies(run: Run, points: list[dict[str, Any]], storage: str) -> None:
    """The estimator's frontier compiled by remat-search, each point at its own batch (no
    accumulation: the global batch is the point's), the published mesh, priced at the run's
    calibration: one study a batch (:func:`frontier_name`), its points its only candidates."""
    for pdb, at in frontier_points(run, points).items():
        space = {"layout": "tensors", "tensors": list(tensors(run)), "points": at}
        configuration = {"batch": [round(pdb * batch(run) / run.per_device_batch)], "mesh": [run.mesh]}  # batch()'s terms
        search(run, storage, len(at), study=frontier_name(run, pdb), space=space, target=calibrated(run),
               configuration=configuration)


def shown(run: Run, policy: dict[str, str]) -> str:
    """The estimator's answer by the names the run's model tags (it sets ``kv_proj`` too, which none does)."""
    where = {place: sorted(n for n, p in policy.items() if p == place and n in tensors(run)) for place in ("device", "offload")}
    return " · ".join(f"{place} {','.join(names)}" for place, names in where.items() if names) or "every tensor recomputed"


def throughput(trial: TrialResult | None) -> str:
    """A trial's estimated tokens/s, marked where the estimate lies outside the calibration's samples."""
    if trial is None or trial.throughput is None:
        return "—"
    estimate = trial.measurement.estimate if trial.measurement else None
    return f"{trial.throughput:,.0f}" + (f" (outside the samples: {estimate.outside})" if estimate and estimate.outside else "")


def row(run: Run, kept: dict[str, Any], theirs: StudyReport | None, ours: StudyReport | None) -> str:
    if kept["answer"] is None:
        return f"| {run.name} | — | failed: {kept.get('error') or 'no answer'} | {kept['compiles']} | {kept['minutes']:.0f} min | — | — | — | — | — |"
    answer = theirs.trials[0] if theirs and theirs.trials else None
    best, _, compiled = best_and_counts(ours) if ours else (None, 0, 0)
    reached = str(compiles_until(ours, best.number)) if best is not None and ours is not None else "—"
    published = published_trial(run, ours) if ours else None
    return (f"| {run.name} | {throughput(published)} | {shown(run, kept['answer'])} | {fitted(kept)} | {kept['minutes']:.0f} min | "
            f"{throughput(answer)} | {best.summary() if best else '—'} | {throughput(best)} | "
            f"{compiled} (found at {reached}) | {versus(best, answer)} |")


def frontier_row(run: Run, kept: dict[str, Any], priced: list[TrialResult], ours: StudyReport | None) -> str:
    """The estimator's frontier on ``run``: its points, its compiles, its fastest point by our
    calibrated estimate, beside our answer at the published global batch."""
    if not kept.get("points"):
        return (f"| {run.name} | failed: {kept.get('error') or 'no point'} | {kept['compiles']} | {kept['minutes']:.0f} min | "
                "— | — | — | — | — | — | — | — |")
    timed = [t for t in priced if t.status == "measured" and t.throughput]
    within = [t for t in timed if t.plan is not None and t.plan.configuration is not None
              and t.plan.configuration.batch <= batch(run)]  # no larger a global batch than the published one
    fastest = max(timed, key=lambda t: t.throughput or 0) if timed else None
    fastest_within = max(within, key=lambda t: t.throughput or 0) if within else None
    best = best_and_counts(ours)[0] if ours else None
    points = ", ".join(f"{p['batch']:g}" for p in kept["points"])
    return (f"| {run.name} | {len(kept['points'])} (batch {points}) | {fitted(kept)} | {kept['minutes']:.0f} min | "
            f"{fastest.summary() if fastest else '—'} | {throughput(fastest)} | "
            f"{fastest_within.summary() if fastest_within else 'none'} | {throughput(fastest_within)} | "
            f"{best.summary() if best else '—'} | {throughput(best)} | {versus(best, fastest)} | {versus(best, fastest_within)} |")


def versus(ours: TrialResult | None, theirs: TrialResult | None) -> str:
    """Our answer's estimated throughput over theirs, marked where the gain is inside our estimate's band."""
    if ours is None or theirs is None or not ours.throughput or not theirs.throughput:
        return "—"
    estimate = ours.measurement.estimate if ours.measurement else None
    gain = ours.throughput / theirs.throughput - 1
    inside = estimate is not None and estimate.band is not None and 1 + abs(gain) < estimate.band[1] / estimate.band[0]
    return f"{gain:+.1%}" + (" (inside the band)" if inside else "")


def fitted(kept: dict[str, Any]) -> str:
    """The estimator's compiles, and how many of them fit."""
    return f"{kept['compiles']} ({sum(a['fits'] for a in kept['asked'])} of {kept['compiles']} fit)"


def compiles_until(report: StudyReport, number: int) -> int:
    """The compiles the study had spent when it compiled trial ``number`` (that one included)."""
    return sum(1 for t in report.trials if t.number <= number and t.measurement is not None and t.measurement.compiled)


def shortfall(run: Run, kept: dict[str, Any], theirs: StudyReport | None, ours: StudyReport | None) -> str | None:
    """Where ours is not at least as fast with as few compiles as the estimator, in a line; None where it is."""
    answer = theirs.trials[0] if theirs and theirs.trials else None
    best, _, compiled = best_and_counts(ours) if ours else (None, 0, 0)
    if kept["answer"] is None or answer is None or best is None or not answer.throughput or not best.throughput:
        return None
    said = []
    if best.throughput < answer.throughput:
        said.append(f"ours is {1 - best.throughput / answer.throughput:.1%} slower")
    if compiled > kept["compiles"]:
        reached = compiles_until(ours, best.number)  # type: ignore[arg-type]
        said.append(f"ours compiled {compiled} candidates to the estimator's {kept['compiles']}, and had its answer at the "
                    f"{reached}{'st' if reached == 1 else 'th'} ({'within' if reached <= kept['compiles'] else 'past'} the estimator's count)")
    return f"- {run.name}: {'; '.join(said)}." if said else None


def page(rows: list[str], missing: list[str], shortfalls: list[str], frontiers: list[str]) -> str:
    return "\n".join([
        "# MaxText's own estimator beside remat-search, on the published runs", "",
        "Command: `python benchmarks/maxtext_estimator.py`. "
        + " ".join(__doc__.split(chr(10) + chr(10), 2)[2].replace("``", "`").split()), "",
        ("Est. tokens/s per chip at the run's calibration (the same for both). Ours: the best of the run's "
        "per-tensor study (`published_tensors.md`), which may change batch, accumulation and mesh; its compiles "
        "count those handed to the TPU compiler, its out-of-memory refusals included, and so do the estimator's. "
        "A difference inside the calibration's band (its width, high / low) is not a win either way."), "",
        ("| run | published config, est. tokens/s | estimator's answer | its compiles | its wall | its est. tokens/s | ours | "
         "our est. tokens/s | our compiles (found at the k-th) | ours vs its |"),
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows, "",
        *([f"Not run yet: {', '.join(missing)}."] if missing else []), "",
        "Where ours is not at least as fast with as few compiles:", "", *(shortfalls or ["- nowhere."]), "",
        ("Why it compiles more: a study compiles the published policy first, then the three presets (every tensor "
        "on the device, recomputed, offloaded), then the planner's proposals over batch, accumulation and mesh, to "
        "its count of candidates (12 or more); the estimator stops at its first policy that fits, at the batch and mesh it "
        "was given, and never learns how fast that policy is. A fitting policy is not a fast one: where the "
        "estimator keeps every tensor it can on the device next to the HBM's edge, the compiled program recomputes "
        "and waits on its collectives more (v5p-32b: 3.07 s of collectives waited for, against 0.41 s for the "
        "published `minimal`, by `show --trial`), and where it offloads, the host link is priced in. Every "
        "v5 estimate that offloads is outside the calibration's samples (no v5 sample offloads): the comparison "
        "there rests on the model's pricing of the host link alone; the v6e samples offload, so the v6e rows do not."), "",
        *(frontier_section(frontiers) if frontiers else []),
    ])


def frontier_section(frontiers: list[str]) -> list[str]:
    return [
        "## Its frontier (mode 2: the batch searched too)", "",
        ("`python benchmarks/maxtext_estimator.py --frontier --runs RUN`. Without `per_device_batch_size` the "
         "estimator searches the batch too: the largest batch that fits with every tensor recomputed (a binary "
         "search of out-of-memory compiles), then, policy by policy from there towards every tensor on the device, "
         "the largest batch that still fits. It prints each (batch, policy) point and picks none. Each point is "
         "compiled here by remat-search at its own batch (no accumulation: its global batch is the point's, not "
         "the published one), the published mesh, and priced at the run's calibration (`maxtext-<run>-frontier-<batch>`). "
         "Its fastest point by that estimate is set beside our answer, which keeps the published global batch: "
         "a larger global batch is another training run, so where its fastest point's batch is larger than the "
         "published one the two do not train alike. Its compiles are those it asked for (its out-of-memory "
         "refusals included), not our pricing's."), "",
        ("| run | its points (batch a chip) | its compiles | its wall | its fastest point | its est. tokens/s | "
         "its fastest at no larger a batch than the published | its est. tokens/s | ours | our est. tokens/s | "
         "ours vs its fastest | ours vs its fastest at no larger a batch |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *frontiers, "",
        ("Every plan compiled for each of these runs, its estimated throughput a chip against its compiled peak "
         "(the estimator's points at their own batch, ours at the published global batch; the picture is drawn by "
         "`--report` from the kept studies):"), "",
        f"![the estimator's frontier beside our study]({PICTURE.name})", "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", default=[r.name for r in searched()], help="which searched runs (default: all eight)")
    parser.add_argument("--report", action="store_true", help="write the page from what is kept, compiling nothing")
    parser.add_argument("--frontier", action="store_true",
                        help="run the estimator's mode 2 too (no per_device_batch_size: its batch/policy frontier) and price its points")
    args = parser.parse_args()
    storage = f"sqlite:///{DB}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    kept: dict[str, Any] = json.loads(KEPT.read_text()) if KEPT.exists() else {}
    for run in (r for r in searched() if r.name in args.runs and not args.report):
        if run.name not in kept or kept[run.name]["answer"] is None:
            kept[run.name] = keep(run.name, estimate(run))
            print(run.name, kept[run.name]["compiles"], "compiles", kept[run.name]["answer"], flush=True)
        if kept[run.name]["answer"] is not None:
            priced(run, kept[run.name]["answer"], storage)
        if args.frontier:
            if kept[run.name].get("frontier", {}).get("points") is None:
                kept[run.name] = keep(run.name, {**kept[run.name], "frontier": estimate(run, frontier=True)})
                print(run.name, "frontier:", kept[run.name]["frontier"]["compiles"], "compiles", flush=True)
            if kept[run.name]["frontier"]["points"]:
                frontier_studies(run, kept[run.name]["frontier"]["points"], storage)
    rows, missing, shortfalls, frontiers = [], [], [], []
    pictured: list[tuple[Run, list[tuple[float, TrialResult]], StudyReport | None, StudyReport | None]] = []
    for run in searched():
        if run.name not in kept:
            missing.append(run.name)
            continue
        studies = load(run, f"maxtext-{run.name}-estimator", storage), load(run, f"maxtext-{run.name}-tensors", storage)
        rows.append(row(run, kept[run.name], *studies))
        shortfalls += [line] if (line := shortfall(run, kept[run.name], *studies)) else []
        print(rows[-1], flush=True)
        if "frontier" in kept[run.name]:
            at_batch = []  # each batch's points: its study's first trials, one a point (the presets queued after them are not run)
            for pdb, at in frontier_points(run, kept[run.name]["frontier"]["points"] or []).items():
                report = load(run, frontier_name(run, pdb), storage)
                at_batch += [(pdb, t) for t in report.trials if t.number < len(at)] if report else []
            frontiers.append(frontier_row(run, kept[run.name]["frontier"], [t for _, t in at_batch], studies[1]))
            pictured.append((run, at_batch, *studies))
            print(frontiers[-1], flush=True)
    if pictured:
        plot(pictured, PICTURE)
    PAGE.write_text(page(rows, missing, shortfalls, frontiers))
    print(f"wrote {PAGE}" + (f" and {PICTURE}" if pictured else ""))


def plot(runs: list[tuple[Run, list[tuple[float, TrialResult]], StudyReport | None, StudyReport | None]], path: Path) -> None:
    """One panel a run whose frontier is priced: every plan compiled for it, its estimated throughput
    against its compiled peak: the estimator's frontier points (each labelled with its batch), its
    mode-1 answer, our study's candidates, the published configuration and our answer; the budget
    a dashed line. Throughputs per chip, so that points at other batches compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.6), squeeze=False)
    for ax, (run, points, theirs, ours) in zip(axes[0], runs, strict=True):
        candidates = [t for t in ours.trials if t.status == "measured"] if ours else []
        best = best_and_counts(ours)[0] if ours else None
        published = published_trial(run, ours) if ours else None
        draw(ax, candidates, "our study's candidates", marker="o", color="lightgrey", edgecolors="grey")
        draw(ax, [t for _, t in points], "the estimator's frontier (labelled: its batch a chip)", marker="^", color="tab:orange")
        for pdb, t in points:
            if t.throughput and t.peak_bytes is not None:
                ax.annotate(f"{pdb:g}", (t.peak_bytes / 2**30, t.throughput), fontsize=7, xytext=(3, 3), textcoords="offset points")
        draw(ax, list(theirs.trials[:1]) if theirs else [], "the estimator's answer (published batch)", marker="x", color="tab:red", s=60)
        draw(ax, [published] if published else [], "published configuration", marker="*", color="tab:blue", s=140)
        draw(ax, [best] if best else [], "our answer (the published global batch)", marker="o", facecolors="none", edgecolors="black", s=160, linewidths=1.5)
        if ours:
            ax.axvline(ours.budget / 2**30, color="grey", linestyle="--", label=f"budget {ours.budget / 2**30:.1f} GiB")
        ax.set_title(f"{run.name} ({run.topology})", fontsize=10)
        ax.set_xlabel("compiled peak per chip (GiB)")
        ax.set_ylabel("est. tokens/s per chip (calibrated estimate)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def draw(ax: Any, trials: list[TrialResult], label: str, **style: Any) -> None:
    """``trials`` on ``ax``, estimated throughput against compiled peak (those with both)."""
    shown = [t for t in trials if t.throughput and t.peak_bytes is not None]
    ax.scatter([t.peak_bytes / 2**30 for t in shown], [t.throughput for t in shown], label=label, **style)  # type: ignore[operator]


def keep(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Keep ``entry`` as run ``name``'s in :data:`KEPT`, read again first: another run's process
    (``--runs`` of one run each, side by side) may have kept its own since this one started."""
    kept = json.loads(KEPT.read_text()) if KEPT.exists() else {}
    KEPT.write_text(json.dumps({**kept, name: entry}, indent=1) + "\n")
    return entry


def load(run: Run, name: str, storage: str) -> StudyReport | None:
    """Study ``name`` of ``run``, its bands read by today's rule (:func:`published_tensors.rebanded`); None if not run yet."""
    try:
        return rebanded(run, remat_search.load_report(name, storage))
    except Exception:  # noqa: BLE001 - a study not run yet
        return None


if __name__ == "__main__":
    main()
