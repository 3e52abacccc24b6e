"""MaxText's own search (``maxtext.utils.estimator``) on the eight searched published runs, beside ours.

    python benchmarks/maxtext_estimator.py --runs v5p-32b   # MaxText's estimator on it, its answer priced (kept: a run done is not run again)
    python benchmarks/maxtext_estimator.py --report         # the page again from what is kept, compiling nothing

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

import remat_search
from remat_search.report.results import StudyReport, TrialResult

from published_configs import SYNTHETIC, Run, batch, search  # benchmarks/ is the script's folder
from published_tensors import DB, HERE, PROGRAMS, best_and_counts, group, searched, tensors

KEPT = HERE / "results" / "maxtext_estimator.json"
PAGE = HERE / "results" / "maxtext_estimator.md"
LOGS = HERE / "results" / "maxtext_estimator"


def topology_name(run: Run) -> str:
    """MaxText's name of the run's slice (``compile_topology``): ``v5p:4x4x4`` is ``v5p-128``."""
    from maxtext.utils.accelerator_to_spec_map import UserFacingNameToSystemCharacteristics

    chip, shape = run.topology.split(":")
    wanted = f"{'v5' if chip == 'v5p' else chip}:{shape}"
    return next(name for name, s in UserFacingNameToSystemCharacteristics.items()
                if name.startswith(chip + "-") and s.topology_name == wanted)


def argv(run: Run) -> list[str]:
    """The run as MaxText's command line takes it: its config, its batch and mesh, the slice."""
    from maxtext.configs import pyconfig

    keys = {**run.model, **SYNTHETIC, "max_target_length": run.seq, "per_device_batch_size": run.per_device_batch,
            **{f"ici_{axis}_parallelism": n for axis, n in run.mesh.items()},
            **{key: values[0] for key, values in run.settings.items()},
            "compile_topology": topology_name(run), "compile_topology_num_slices": 1, "hardware": "tpu",
            "base_output_directory": "/tmp/maxtext-estimator", "skip_jax_distributed_system": True}
    return [os.path.join(os.path.dirname(pyconfig.__file__), "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


CHECK = re.compile(r"Checking whether batch_size=(\S+) and policy=(\{.*\}) is OOM")
VERDICT = re.compile(r"Is OOM: (True|False)")
ANSWER = re.compile(r"Found valid combo: pdb=(\S+), policy=(\{.*\})")


def estimate(run: Run) -> dict[str, Any]:
    """MaxText's estimator on ``run``: each policy it compiled and whether it fit, its answer, its minutes."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{run.name}.log"
    env = {**os.environ, "LIBTPU_INIT_ARGS": run.flags, "TF_CPP_MIN_LOG_LEVEL": "2"}
    start = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "maxtext.utils.estimator", *argv(run)], env=env,
                              stdout=out, stderr=subprocess.STDOUT, check=False)
    minutes = (time.monotonic() - start) / 60
    text = log.read_text()
    asked = [ast.literal_eval(m.group(2)) for m in CHECK.finditer(text)]
    fits = [m.group(1) == "False" for m in VERDICT.finditer(text)]
    answer = ANSWER.search(text)
    return {"exit": done.returncode, "compiles": len(asked), "minutes": round(minutes, 1),
            "asked": [{"policy": p, "fits": f} for p, f in zip(asked, fits, strict=False)],
            "answer": ast.literal_eval(answer.group(2)) if answer else None}


def answer_point(run: Run, policy: dict[str, str]) -> Any:
    """The estimator's answer as a point of the run's per-tensor space (a name it leaves unset is
    MaxText's default, ``remat``; ``decoder_layer_input`` it sets to ``device``)."""
    names = tensors(run)
    kept = [n for n in names if policy.get(n, "device" if n == "decoder_layer_input" else "remat") == "device"]
    offloaded = [n for n in names if policy.get(n) == "offload"]
    return {"label": "maxtext_estimator", "per_name": {"device": kept, "offload": offloaded}}


def priced(run: Run, policy: dict[str, str], storage: str) -> StudyReport:
    """The estimator's answer compiled by remat-search alone, at the published batch and mesh, priced at the run's calibration."""
    calibration = PROGRAMS / f"{group(run.chip)}.json"
    space = {"layout": "tensors", "tensors": list(tensors(run)), "points": [answer_point(run, policy)]}
    target = {"platform": "tpu", "topology": run.topology, "calibration": str(calibration)}
    configuration = {"batch": [batch(run)], "global_batch": run.chips * run.per_device_batch, "mesh": [run.mesh]}
    return search(run, storage, 1, study=f"maxtext-{run.name}-estimator", space=space, target=target,
                  configuration=configuration)


def shown(policy: dict[str, str] | None) -> str:
    if policy is None:
        return "—"
    where = {place: sorted(n for n, p in policy.items() if p == place) for place in ("device", "offload")}
    return " · ".join(f"{place} {','.join(names)}" for place, names in where.items() if names) or "every tensor recomputed"


def row(run: Run, kept: dict[str, Any], theirs: StudyReport | None, ours: StudyReport | None) -> str:
    answer = theirs.trials[0] if theirs and theirs.trials else None
    best, _, compiled = best_and_counts(ours) if ours else (None, 0, 0)
    their_tps = answer.throughput if answer is not None else None
    our_tps = best.throughput if best is not None else None
    if their_tps is None or our_tps is None:
        versus = "—"
    else:
        band = best.measurement.estimate.band if best.measurement and best.measurement.estimate else None  # type: ignore[union-attr]
        gain = our_tps / their_tps - 1
        inside = band is not None and (1 + abs(gain)) < band[1] / band[0]
        versus = f"{gain:+.1%}" + (" (inside the band)" if inside else "")
    fits = f"{sum(a['fits'] for a in kept['asked'])} of {kept['compiles']} fit"
    return (f"| {run.name} | {shown(kept['answer'])} | {kept['compiles']} ({fits}) | {kept['minutes']:.0f} min | "
            f"{f'{their_tps:,.0f}' if their_tps else '—'} | {best.summary() if best else '—'} | "
            f"{f'{our_tps:,.0f}' if our_tps else '—'} | {compiled} | {versus} |")


def page(rows: list[str], missing: list[str]) -> str:
    return "\n".join([
        "# MaxText's own estimator beside remat-search, on the published runs", "",
        "Command: `python benchmarks/maxtext_estimator.py`. "
        + " ".join(__doc__.split(chr(10) + chr(10), 2)[2].replace("``", "`").split()), "",
        "Est. tokens/s per chip at the run's calibration (the same for both). Ours: the best of the run's "
        "per-tensor study (`published_tensors.md`), which may change batch, accumulation and mesh; its compiles "
        "count those handed to the TPU compiler, its out-of-memory refusals included, and so do the estimator's. "
        "A difference inside the calibration's band (its width, high / low) is not a win either way.", "",
        "| run | estimator's answer | its compiles | its wall | its est. tokens/s | ours | our est. tokens/s | "
        "our compiles | ours vs its |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows, "",
        *([f"Not run yet: {', '.join(missing)}."] if missing else []), "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", default=[r.name for r in searched()], help="which searched runs (default: all eight)")
    parser.add_argument("--report", action="store_true", help="write the page from what is kept, compiling nothing")
    args = parser.parse_args()
    storage = f"sqlite:///{DB}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    kept: dict[str, Any] = json.loads(KEPT.read_text()) if KEPT.exists() else {}
    for run in (r for r in searched() if r.name in args.runs and not args.report):
        if run.name not in kept or kept[run.name]["answer"] is None:
            kept[run.name] = estimate(run)
            KEPT.write_text(json.dumps(kept, indent=1) + "\n")
            print(run.name, kept[run.name]["compiles"], "compiles", kept[run.name]["answer"], flush=True)
        if kept[run.name]["answer"] is not None:
            priced(run, kept[run.name]["answer"], storage)
    rows, missing = [], []
    for run in searched():
        if run.name not in kept:
            missing.append(run.name)
            continue
        rows.append(row(run, kept[run.name], load(f"maxtext-{run.name}-estimator", storage),
                        load(f"maxtext-{run.name}-tensors", storage)))
        print(rows[-1], flush=True)
    PAGE.write_text(page(rows, missing))
    print(f"wrote {PAGE}")


def load(name: str, storage: str) -> StudyReport | None:
    try:
        return remat_search.load_report(name, storage)
    except Exception:  # noqa: BLE001 - a study not run yet
        return None


if __name__ == "__main__":
    main()
