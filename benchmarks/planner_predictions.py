"""How well the planner's model predicts the next candidate, on the kept per-tensor studies of the published runs.

    python benchmarks/planner_predictions.py                          # the v5 studies of published_tensors.db
    python benchmarks/planner_predictions.py maxtext-v5p-64b-tensors  # one study

For each candidate of a study past its first four (the published policy and the presets), the
model (the per-tensor cost model and its map of configurations, ``search.cost_model`` and
``search.configured_model``) is fitted to the candidates before it, as the planner fitted it then,
and its step for that candidate is set against the step the study priced (compiled, estimated at
the calibration): one step ahead, never the candidate itself. Plans keeping a tensor on the device
are counted apart: on v5p the TPU compiler refuses the ``device`` preset, so their time has no
preset to start from. Writes ``benchmarks/results/planner_predictions.md``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import optuna
from optuna.trial import TrialState

from remat_search.report.results import trial_result
from remat_search.search.configurations import configurations
from remat_search.search.configured_model import configured_model
from remat_search.search.space import Space
from remat_search.spec.loading import parse_spec
from remat_search.spec.maxtext import maxtext_config

HERE = Path(__file__).resolve().parent
DB = HERE / "results" / "studies" / "published_tensors.db"
PAGE = HERE / "results" / "planner_predictions.md"
STUDIES = [f"maxtext-{run}-tensors" for run in ("v5e-16b", "v5e-32b", "v5e-64b", "v5p-32b", "v5p-64b", "v5p-128b")]


def space_of(study: optuna.Study) -> Space:
    """The study's search space as its planner had it: its spec's, over its layers, its tensors' bytes, its configurations."""
    attrs = study.user_attrs
    spec = parse_spec(attrs["spec"])
    device = attrs["device_info"]
    config = maxtext_config(spec.workload)
    space = Space.of(spec.space, attrs["layers"]).with_tensor_bytes(device["traced_bytes"])
    return space.with_configurations(configurations(
        spec.configuration, devices=device["device_count"], mesh=None, sequence=config.max_target_length,
        axes=tuple(config.mesh_axes), strict=True))


def errors(name: str, storage: str) -> list[tuple[int, str, float, float]]:
    """(trial, its choices' initials, predicted, priced) for each candidate past the first four."""
    study = optuna.load_study(study_name=name, storage=storage)
    space = space_of(study)
    trials = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    rows = []
    for i, t in enumerate(trials[4:], start=4):
        result = trial_result(t)
        if result.measurement is None or result.measurement.status != "measured" or result.measurement.step_seconds is None:
            continue
        before = [(trial_result(u), u.params) for u in trials[:i]]
        model = configured_model(before, space)
        choices = space.choices(t.params, any_configuration=True)
        predicted = model.predict(choices, t.params["configuration"]) if model and choices else None
        if predicted is not None:
            rows.append((t.number, "".join(c[0] for c in choices), predicted.seconds, result.measurement.step_seconds))
    return rows


def summary(rows: list[tuple[int, str, float, float]]) -> str:
    if not rows:
        return "— | —"
    errs = [p / a - 1 for _, _, p, a in rows]
    return f"{len(rows)} | {statistics.fmean(abs(e) for e in errs):.1%} (mean {statistics.fmean(errs):+.1%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="*", default=STUDIES, help="studies of published_tensors.db (default: the six v5 runs)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{DB}"
    lines = ["| study | candidates | mean abs. error | with a tensor on the device | its mean abs. error |", "|---|---|---|---|---|"]
    every: list[tuple[int, str, float, float]] = []
    for name in args.studies:
        rows = errors(name, storage)
        every += rows
        device = [r for r in rows if "d" in r[1]]
        lines.append(f"| {name} | {summary(rows)} | {summary(device)} |")
        print(lines[-1], flush=True)
    lines.append(f"| all | {summary(every)} | {summary([r for r in every if 'd' in r[1]])} |")
    text = " ".join(__doc__.split("\n\n", 2)[2].replace("``", "`").split())
    PAGE.write_text("\n".join(["# The planner's model, one step ahead", "", f"Command: `python benchmarks/planner_predictions.py`. {text}", "",
                               "Error: predicted step / priced step − 1.", "", *lines, ""]))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
