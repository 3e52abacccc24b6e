"""Which configurations the planner opens, replayed on the kept per-tensor studies of the published runs.

    python benchmarks/planner_openings.py                          # the eight studies of published_tensors.db
    python benchmarks/planner_openings.py maxtext-v6e-llama2-70b-tensors
    python benchmarks/planner_openings.py --replan v6e-llama2-70b --trials 16   # compiles: about an hour here

In a space of configurations the planner first measures configurations nothing was measured at
(it opens them: ``ConfiguredModel.openings``). The kept studies were searched by planners that
opened every configuration. For each candidate the study's planner proposed at a configuration
nothing was measured at, the model is fitted to the candidates before it, as the planner fits it
now, and asked whether it would open that configuration, and with which plan. A configuration it
would not open is set against what the study measured there, and against the best the study
measured before it (the incumbent) and in the end. This replays the studies' own history: it
does not say what a study would have proposed after the first configuration left closed, which
only a new search can: ``--replan RUN`` searches it, a study ``maxtext-<run>-tensors-replan`` in
the same file (its measurement cache reused) that starts from the kept study's candidates before
its planner's first proposal (the published point and the presets) and goes on with the planner
as it stands, to ``--trials`` candidates; the page sets it beside the kept study. Writes
``benchmarks/results/planner_openings.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

import remat_search
from planner_predictions import DB, space_of
from published_configs import RUNS
from published_tensors import CANDIDATE_STATUSES, best_and_counts, tensor_study
from remat_search.report.results import trial_result
from remat_search.plans.configuration import cost as per_token
from remat_search.search.configured_model import configured_model
from remat_search.search.samplers import refused_configurations
from remat_search.search.space import CONFIGURATION_PARAM
from remat_search.store.attributes import PREDICTION_ATTR

HERE = Path(__file__).resolve().parent
PAGE = HERE / "results" / "planner_openings.md"
STUDIES = [f"maxtext-{run}-tensors" for run in (
    "v5e-16b", "v5e-32b", "v5e-64b", "v5p-32b", "v5p-64b", "v5p-128b", "v6e-llama3.1-8b", "v6e-llama2-70b")]


def initials(choices: tuple[str, ...] | None) -> str:
    """A plan as its choices' initials (`r` remat, `o` offload, `d` device), one a tensor."""
    return "".join(c[0] for c in choices) if choices else "?"


def cost(t: FrozenTrial) -> float | None:
    """The trial's step seconds per token a device trains on, where it ran (or was estimated)."""
    result = trial_result(t)
    m = result.measurement
    if m is None or m.step_seconds is None or result.plan is None or result.plan.configuration is None:
        return None
    return per_token(m.step_seconds, result.plan.configuration)


def replay(name: str, storage: str) -> list[str]:
    """One table row a configuration the study's planner opened."""
    study = optuna.load_study(study_name=name, storage=storage)
    space, budget = space_of(study), study.user_attrs["budget"]
    trials = study.get_trials(deepcopy=False)
    best = min((c for t in trials if t.state == TrialState.COMPLETE and (c := cost(t)) is not None), default=None)
    rows = []
    for i, t in enumerate(trials):
        configuration = t.params.get(CONFIGURATION_PARAM)
        before = trials[:i]
        if PREDICTION_ATTR not in t.user_attrs or configuration in {u.params.get(CONFIGURATION_PARAM) for u in before}:
            continue
        complete = [(trial_result(u), u.params) for u in before if u.state == TrialState.COMPLETE]
        model = configured_model(complete, space)
        if model is None:
            continue
        model = model.without(refused_configurations(before))
        opened = next((p for p in model.openings(budget) if p.configuration == configuration), None)
        measured, incumbent = cost(t), model.incumbent
        versus = "—" if measured is None or incumbent is None else f"{measured / incumbent:.3f}"
        rows.append(
            f"| {name.removeprefix('maxtext-').removesuffix('-tensors')} | {t.number} | {configuration} | "
            f"{initials(space.choices(t.params, any_configuration=True))} | {versus} | "
            f"{'yes, with ' + initials(opened.choices) if opened else '**no**'} | "
            f"{'—' if model.guess_error is None else f'{model.guess_error:.3f}'} | "
            f"{'yes' if measured is not None and measured == best else ''} |"
        )
    return rows


def replan(run_name: str, trials: int, storage: str) -> None:
    """Search the kept study of ``run_name`` again from its planner's first proposal (see the module doc)."""
    run = next(r for r in RUNS if r.name == run_name)
    kept, name = f"maxtext-{run_name}-tensors", f"maxtext-{run_name}-tensors-replan"
    if name not in {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}:
        old = optuna.load_study(study_name=kept, storage=storage)
        first = next(i for i, t in enumerate(old.trials) if PREDICTION_ATTR in t.user_attrs)
        study = optuna.create_study(study_name=name, storage=storage, directions=old.directions)
        for key, value in old.user_attrs.items():
            if key not in ("cost_model", "benchmark_minutes"):
                study.set_user_attr(key, value)
        study.add_trials(old.trials[:first])
    start = time.monotonic()
    tensor_study(run, storage, trials, study=name)
    study = optuna.load_study(study_name=name, storage=storage)
    study.set_user_attr("benchmark_minutes", study.user_attrs.get("benchmark_minutes", 0.0) + (time.monotonic() - start) / 60)


def found_at(name: str, storage: str) -> str:
    """The study's best (its candidate, its estimated tokens/s per chip) and the candidate one as
    fast (within 0.01%) was first found at, its candidates, compiles and wall minutes."""
    report = remat_search.load_report(name, storage)
    best, candidates, compiled = best_and_counts(report)
    minutes = optuna.load_study(study_name=name, storage=storage).user_attrs.get("benchmark_minutes", 0.0)
    if best is None or not best.throughput:
        return f"| {name} | — | — | — | {candidates} | {compiled} | {minutes:.0f} min |"
    first = min(t.number for t in report.timed() if t.throughput and t.throughput >= best.throughput * (1 - 1e-4))
    at = sum(1 for t in report.trials if t.number <= first and t.status in CANDIDATE_STATUSES)
    return f"| {name} | {best.summary()} | {best.throughput:,.0f} | {at} | {candidates} | {compiled} | {minutes:.0f} min |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="*", default=STUDIES, help="studies of published_tensors.db (default: the eight)")
    parser.add_argument("--replan", metavar="RUN", help="search RUN's kept study again from its planner's first proposal")
    parser.add_argument("--trials", type=int, default=16, help="candidates of the --replan study (default 16)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{DB}"
    if args.replan:
        replan(args.replan, args.trials, storage)
    lines = [
        "| run | candidate | configuration opened | its plan | its step per token / incumbent's | opened now? | guess error then | the study's best? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.studies:
        rows = replay(name, storage)
        lines += rows
        print("\n".join(rows), flush=True)
    closed = [line for line in lines if "**no**" in line]
    replans = sorted(s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)
                     if s.study_name.endswith("-replan"))
    searched = [
        "## Searched again", "",
        "Each study searched again from its planner's first proposal (`--replan`), beside the kept one. Best: the fastest "
        "fitting candidate, its estimated tokens/s per chip; found at: the first candidate as fast, within 0.01% (candidates counted as in the columns beside it: trials cut off by a stopped sitting are not candidates).", "",
        "| study | best | est. tokens/s per chip | found at | candidates | compiles | wall |", "|---|---|---|---|---|---|---|",
        *(found_at(n, storage) for r in replans for n in (r.removesuffix("-replan"), r)), "",
    ] if replans else []
    text = " ".join(__doc__.split("\n\n", 2)[2].replace("``", "`").split())
    PAGE.write_text("\n".join([
        "# Which configurations the planner opens, on the studies' own history", "",
        f"Command: `python benchmarks/planner_openings.py`. {text}", "",
        "Plans by their tensors' initials: `r` remat, `o` offload, `d` device. Incumbent: the least step per token "
        "measured before the candidate. Guess error: the model's, then (`ConfiguredModel.guess_error`).", "",
        *lines, "",
        f"Opened by the studies' planners: {len(lines) - 2}; opened now: {len(lines) - 2 - len(closed)}; "
        f"left closed now: {len(closed)}, of them the study's best: {sum(1 for line in closed if line.endswith('| yes |'))}.", "",
        *searched,
    ]))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
