"""The commands that read studies: ``pareto``, ``best``, ``plan``, ``studies`` and ``show``.

Each checks its flags, reads the study through ``report.stored`` (``plan`` through the
planner, ``studies`` through ``report.queries``) and prints a table or JSON through
:mod:`cli.output`, and with ``--plot`` a picture through ``report.pictures``. Nothing here
writes, but ``plan --measure``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer

from remat_search.cli import flags, output
from remat_search.cli.flags import BudgetOption, PlotOption, StorageOption, StudyOption
from remat_search.errors import SpecError
from remat_search.report.text import (
    budget_line,
    describe_trial,
    front_json,
    no_trial_text,
    sharding_line,
    time_models_note,
)
from remat_search.store.attributes import SPEC_ATTR
from remat_search.units import format_bytes


def _plot_path(plot: Path | None) -> Path | None:
    """``--plot``'s file, checked before the study is read (matplotlib, suffix, folder)."""
    if plot is None:
        return None
    from remat_search.report import pictures

    pictures.require()
    return pictures.check_path(plot)


def _draw(report: Any, plot: Path, *, layers: bool) -> None:
    """Write ``report``'s front (and, with ``layers`` or to an .html page, its front's plans
    layer by layer) to ``plot``, and say so on stderr."""
    from remat_search.report import pictures

    figures = [pictures.front_figure(report)]
    if layers or plot.suffix.lower() == ".html":
        figures.append(pictures.layers_figure(report))
    output.note(f"wrote {pictures.save(figures, plot)}")


def pareto(
    study: StudyOption,
    storage: StorageOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the front as JSON.")] = False,
    plot: PlotOption = None,
) -> None:
    """Show the Pareto front: no other plan is both faster and smaller.

    --plot draws it: step time against compiled peak, every timed plan (presets, planner
    proposals, other sampled plans and confirmed plans by marker), the front as a step line,
    the budget line with the plan `best` returns for it starred, and the plans over budget,
    never run, on a strip above at their compiled peaks. An .html page adds the plans on the
    front layer by layer.
    """
    from remat_search.report.stored import open_study

    path = _plot_path(plot)
    with open_study(flags.study(study), storage) as stored:
        report = stored.report() if path is not None else None
        front = list(report.front) if report is not None else stored.front()
    if as_json:
        print(front_json(front))
    else:
        output.console.print(output.front_table(stored.name, stored.budget, front))
    if report is not None and path is not None:
        _draw(report, path, layers=False)


def best(
    study: StudyOption,
    budget: BudgetOption,
    storage: StorageOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the plan as JSON (RematPlan.from_json loads it).")] = False,
    form: Annotated[str, typer.Option(
        "--format", metavar="table|json|yaml|maxtext|maxtext-args",
        help="table (default); json (= --json), yaml: the plan alone; maxtext: MaxText's settings (remat_policy: "
             "full, or custom with device/offload/remat for every tensor name MaxText has; the plan's batch, "
             "accumulation and every ici_*_parallelism where it carries a configuration, so that pasted onto any "
             "config they replace its own) of the fastest plan that fits and MaxText can express, with a note on "
             "stderr where that is not the study's best; maxtext-args: the same as key=value arguments for "
             "MaxText's train command.",
    )] = "table",
) -> None:
    """The fastest measured plan whose compiled peak fits the budget (exit 1 if none does)."""
    from remat_search.plans.export import FORMATS, export
    from remat_search.report.maxtext import maxtext_answer
    from remat_search.report.queries import budget_bytes
    from remat_search.report.stored import open_study

    if form != "table" and form not in FORMATS:
        raise SpecError(f"--format: expected table, {', '.join(FORMATS)}; got {form!r}")
    form = "json" if as_json else form
    asked = flags.budget(budget)
    with open_study(flags.study(study), storage) as stored:
        limit = budget_bytes(asked, stored, name="--budget")
        for_maxtext = maxtext_answer(stored, limit) if form.startswith("maxtext") else None
        found = for_maxtext.answer if for_maxtext is not None else stored.best(limit)
        notes = output.answer_notes(stored, found, limit)
    if form != "table":
        assert found.plan is not None
        print(export(found.plan, form))  # type: ignore[arg-type]
        if for_maxtext is not None and (notice := for_maxtext.notice()):
            output.note(notice)
    else:
        output.console.print(output.trials_table(f"Best plan of {stored.name!r} for {format_bytes(limit)}", [found], budget=limit))
        output.console.print(describe_trial(found, stored.device, stored.gradient_tolerance))
    for line in notes:
        output.note(line)


def plan(
    study: StudyOption,
    budget: BudgetOption,
    storage: StorageOption = None,
    measure: Annotated[bool, typer.Option("--measure", help="Compile and time the plan as one more trial of the study (unless it was measured).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the plan as JSON.")] = False,
) -> None:
    """The planner's predicted-best plan for any budget, beside what was measured of it.

    The cost model is fitted to every plan the study compiled (the uniform presets give
    each choice's cost, mixed plans correct it per layer) and solved for the budget: exactly
    unless its front had to be thinned, which the output says.
    A prediction is not a measurement: `best` only returns measured plans.
    """
    from remat_search.search.advice import plan_for_budget

    if measure:  # only --measure runs optuna: the advice reads the tables without it
        output.quiet_optuna()
    advice = plan_for_budget(flags.study(study), flags.budget(budget), storage=storage, measure=measure)
    if as_json:
        print(advice.plan.to_json())
        return
    output.console.print(output.advice_table(advice))
    if advice.measured is None:
        output.errors.print(f"not measured yet; add --measure to compile and time it as a trial of {advice.study!r}")


def studies(storage: StorageOption = None) -> None:
    """List the studies in the storage."""
    from remat_search.report.queries import list_studies

    output.console.print(output.studies_table(list_studies(storage)))


def show(
    study: StudyOption,
    trial: Annotated[int | None, typer.Option(metavar="N", help="Show this trial in full.")] = None,
    storage: StorageOption = None,
    plot: PlotOption = None,
) -> None:
    """Every trial of a study, or one trial in full.

    --plot draws the study: the front (as `pareto --plot` does) and, under it, the plans on
    the front layer by layer (a row a plan with its step time and peak, a column a layer,
    coloured by policy); .png and .svg stack both in one picture.
    """
    from remat_search.report.stored import open_study

    path = _plot_path(plot)
    with open_study(flags.study(study), storage) as stored:
        report = stored.report() if path is not None else None
        if trial is None:
            trials = list(report.trials) if report is not None else stored.trials()
        else:
            found, count = stored.trial(trial), stored.count()
    if trial is not None and found is None:
        raise SpecError(f"--trial: {no_trial_text(stored.name, trial, sum(count.values()))}")
    if trial is None:
        output.console.print(output.trials_table(f"Trials of {stored.name!r}", trials, budget=stored.budget))
        written = (stored.attrs.get(SPEC_ATTR) or {}).get("budget")
        if isinstance(written, str) and stored.budget:  # a share (70%): what it came to
            output.console.print(budget_line(written, stored.budget), highlight=False, markup=False)
        if note := time_models_note(trials):
            output.note(note)
    else:
        output.console.print(describe_trial(found, stored.device, stored.gradient_tolerance), highlight=False)
    if stored.device.get("workload_note"):
        output.console.print(stored.device["workload_note"], highlight=False, markup=False)
    if stored.device.get("shardings"):
        line = sharding_line(stored.device.get("mesh"), stored.device["shardings"], stored.device.get("device_order"),
                             per_candidate=stored.searches_configurations)
        output.console.print(line, highlight=False, markup=False)
    if report is not None and path is not None:
        _draw(report, path, layers=True)


def calibrate(
    samples: Annotated[list[Path] | None, typer.Argument(
        metavar="SAMPLES.json", show_default=False,
        help="Files of measured programs: a JSON list of {label, chip, program, measured_seconds, kind} "
             "(benchmarks/gpu_step_time.py writes one beside its programs).")] = None,
    name: Annotated[str, typer.Option("--name", metavar="NAME", help="The calibration's name (it names the file too).")] = "",
    study: Annotated[str | None, typer.Option("--study", "-s", metavar="NAME",
                     help="Also every trial this study ran and timed on its devices (its programs are kept).")] = None,
    storage: StorageOption = None,
    chip: Annotated[str | None, typer.Option("--chip", metavar="KEY",
                    help="The chip --study's devices are (h100, h200, v5e, v5p, v6e, v4), where their device kind "
                         "does not say it.")] = None,
    compiler: Annotated[str | None, typer.Option("--compiler", metavar="TEXT",
                        help="The compiler the samples were compiled by (default: the study's; else unstated).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", metavar="PATH",
                   help="Where to write the calibration (default: calibrations/NAME.json in the storage home).")] = None,
) -> None:
    """Fit the step-time model to measured steps, and measure its error.

    The model's free figures (the fractions of its peak FLOP/s, HBM, ICI and host link a chip
    reaches, and a cost per instruction) are fitted so that the estimates of the samples' programs
    come closest to their measured steps; each sample is then estimated with the figures fitted on
    all the others (leave-one-out): that error, by kind of plan, is the calibration's band. Name
    the file in a TPU spec (target: {platform: tpu, topology: ..., calibration: PATH}) to estimate
    with it: show and best then state the band of each estimate.

    On a TPU VM or a GPU host, one command: remat-search run SPEC (a spec on target: local), then
    remat-search calibrate --study NAME --name my-chip.
    """
    from remat_search.report.queries import study_samples
    from remat_search.store.location import storage_home
    from remat_search.targets.calibration import calibrate as fit_calibration
    from remat_search.targets.calibration import load_samples

    if not re.fullmatch(r"[A-Za-z0-9][\w.\-]*", name):
        raise SpecError(f"--name: expected a name of letters, digits, '.', '-' and '_' such as h100-jax0.11, got {name!r}")
    found = [s for path in samples or [] for s in load_samples(path)]
    stated = compiler
    if study is not None:
        of_study, stated = study_samples(flags.study(study), storage, chip=chip)
        if not of_study:
            raise SpecError(f"--study: {study!r} has no trial that ran on its devices with its program kept; "
                            "a study on target: local keeps them")
        found += of_study
        stated = compiler or stated
    if not found:
        raise SpecError("calibrate: no samples; name a SAMPLES.json file or --study")
    target = out or storage_home() / "calibrations" / f"{name}.json"
    with output.errors.status(f"fitting on {len(found)} samples, then each left out"):
        calibration = fit_calibration(found, name=name, compiler=stated or "unstated")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(calibration.model_dump_json(indent=1) + "\n")
    output.console.print(output.calibration_table(calibration))
    output.console.print(f"wrote {target}", highlight=False, markup=False)
