"""The ``remat-search`` command: a thin face over the library.

Each command checks its flags, calls one library function and prints through
``output.py``. Errors are mapped to exit codes in one place (:data:`EXIT_CODES`): bad input
exits 2 with one line naming the field, "nothing fits" exits 1, a failure at run time 3 with
its reason (an unexpected exception too, by its type and message). Set
``REMAT_SEARCH_DEBUG=1`` to see tracebacks (the worker's own, for a failed candidate).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.markup import escape

from remat_search.cli import output
from remat_search.errors import (
    NoFeasiblePlan,
    RematSearchError,
    RunError,
    SpecError,
    StorageError,
    WorkloadError,
)
from remat_search.spec.models import STORAGE_ENV, check_study_name, default_storage
from remat_search.units import format_bytes, format_seconds, parse_bytes, size_argument

EXIT_CODES: dict[type[Exception], int] = {
    SpecError: 2,
    StorageError: 2,
    WorkloadError: 2,
    NoFeasiblePlan: 1,
    RunError: 3,
}
RUNTIME_FAILURE = 3
"""The exit code of a failure at run time: a :class:`RunError`, or any unexpected exception."""

app = typer.Typer(
    name="remat-search",
    help=(
        "Find the fastest gradient-checkpointing (remat) plan for a JAX training step that fits "
        "a memory budget: compile candidates, read their peak memory from the compiler, time "
        "those that fit, and keep everything in a resumable optuna study.\n\n"
        "Start with: remat-search run search_spaces/demo.yaml"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help as written: rich markup swallowed [bracketed] text
    context_settings={"max_content_width": 120},
)

StorageOption = Annotated[
    str | None,
    typer.Option("--storage", metavar="URL", envvar=STORAGE_ENV, show_default=False,
                 help=f"Database URL of the studies. Default: {default_storage()}"),
]
RunStorageOption = Annotated[
    str | None,
    typer.Option("--storage", metavar="URL", envvar=STORAGE_ENV, show_default=False,
                 help=f"Database URL of the studies. Default: the spec's storage, else {default_storage()}"),
]
StudyOption = Annotated[str, typer.Option("--study", "-s", metavar="NAME", help="Study name (the spec's study).")]
BudgetOption = Annotated[
    str, typer.Option(metavar="SIZE", help="Memory a plan may use at peak, e.g. 14GiB, 200MiB, 1.6e10.")
]
F = TypeVar("F", bound=Callable[..., Any])


class _Command(typer.core.TyperCommand):
    """Arguments as users write them, by their metavar: ``run [OPTIONS] SPEC``, where typer
    would print ``{SPEC}`` in the usage line and ``SPEC <path>`` in the list."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [piece.removeprefix("{").removesuffix("}") for piece in super().collect_usage_pieces(ctx)]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        params = self.get_params(ctx)
        arguments = [(p.metavar or p.name or "", getattr(p, "help", "") or "") for p in params
                     if p.param_type_name == "argument"]
        options = [record for p in params if p.param_type_name == "option" and (record := p.get_help_record(ctx))]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _print_version(value: bool) -> None:
    if value:
        import importlib.metadata  # here, not for every command: it costs a query 40 ms

        print(f"remat-search {importlib.metadata.version('remat-search')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    )] = False,
) -> None:
    pass


def _handle_errors(command: F) -> F:
    """Print an error as one line and exit with its code (:data:`EXIT_CODES`; any other
    failure, a :class:`RunError` or an unexpected exception, exits :data:`RUNTIME_FAILURE`)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as e:
            if os.environ.get("REMAT_SEARCH_DEBUG"):
                raise
            message = str(e) if isinstance(e, RematSearchError) else (
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no message'} "
                "(unexpected; REMAT_SEARCH_DEBUG=1 shows the traceback)"
            )
            output.errors.print(f"[red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_CODES.get(type(e), RUNTIME_FAILURE)) from None

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def _notes() -> Iterator[None]:
    """Print the library's notes and warnings (the ``remat_search`` logger) on stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("remat_search")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _budget(value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise SpecError(f"--budget: {e}") from None


def _study(value: str) -> str:
    try:
        return check_study_name(value)
    except ValueError as e:
        raise SpecError(f"--study: {e}") from None


@app.command(cls=_Command)
@_handle_errors
def run(
    spec: Annotated[Path, typer.Argument(metavar="SPEC", help="Search spec (YAML), e.g. search_spaces/demo.yaml.")],
    storage: RunStorageOption = None,
    workers: Annotated[str | None, typer.Option(
        metavar="N|auto", show_default=False,
        help="Worker processes measuring plans at once (default: the spec's workers, else 1). auto: one "
             "per two cores, as host memory allows. Compiles run in parallel; plans run on a local device "
             "one at a time.",
    )] = None,
) -> None:
    """Search the spec's space; running it again resumes an interrupted study.

    Every candidate is compiled; one over the budget is recorded and never run; one that
    fits is run, its first step checked against full remat's, and its step timed. The uniform
    presets go first, then the planner's predicted-best plans (sampler: planner), and the
    fastest plans that fit are re-timed interleaved at the end, racing until the plan that
    ranks first at the budget was re-timed (confirm: {top, rounds, races}).
    A plan measured before for this workload and device, in any study, is not compiled
    again (unless it was only compiled, over an earlier budget, and now fits).

    Several hosts share a study by running the same command against one PostgreSQL URL
    (--storage): each measures plans the others are not measuring, and a trial whose host
    died is taken back after the heartbeat's grace period.
    """
    from remat_search.report.results import rank
    from remat_search.spec.models import load_spec

    loaded = load_spec(spec, storage=storage, workers=_workers(workers))
    _importable_from(spec)
    if loaded.budget is not None:
        output.console.print(output.budget_line(loaded.budget_text, loaded.budget), highlight=False)
    try:
        report = _search(loaded)
    except KeyboardInterrupt:
        again = ["remat-search", "run", str(spec)]
        if storage and storage != os.environ.get(STORAGE_ENV):
            again += ["--storage", storage]
        if workers:
            again += ["--workers", workers]
        output.errors.print(
            f"interrupted: finished trials are kept, and the same command resumes the study: {shlex.join(again)}",
            markup=False, highlight=False, soft_wrap=True,
        )
        raise typer.Exit(130) from None
    output.console.print(output.front_table(report.study, report.budget, report.front))
    confirmed = sorted((t for t in report.timed() if t.confirmed), key=rank)
    if confirmed:
        output.console.print(output.confirmed_table(report, confirmed))
    screened = sum(1 for t in report.trials if t.measurement and t.measurement.screened_bytes is not None)
    output.console.print(
        f"{report.count('measured')} fit, {report.count('over_budget')} over budget (never run"
        + (f"; {screened} of them screened out by the cost model, never compiled" if screened else "") + "), "
        f"{report.count('failed')} failed. Next: remat-search best --study {report.study} "
        f"--budget {size_argument(report.budget)} --json > plan.json", soft_wrap=True,  # a command: one line
    )


def _importable_from(spec: Path) -> None:
    """Let a spec's ``workload.factory`` import from the spec's folder and the current one, as
    ``python -m`` would (a console script's import path has neither); the worker processes,
    spawned, share this process's path."""
    for folder in (str(Path.cwd()), str(spec.resolve().parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def _workers(value: str | None) -> str | None:
    if value is not None and value != "auto" and not (value.isdigit() and int(value) > 0):
        raise SpecError(f"--workers: expected a positive number of worker processes or auto, got {value!r}")
    return value


@app.command(cls=_Command)
@_handle_errors
def submit(
    spec: Annotated[Path, typer.Argument(metavar="SPEC", help="Search spec (YAML), e.g. search_spaces/demo.yaml.")],
    storage: RunStorageOption = None,
) -> None:
    """Store the spec's study for workers to measure, and return at once.

    The spec is checked as `run` checks it (its workload is built, its space's names are the
    workload's) and stored with the study, its uniform presets queued first. Any
    `remat-search worker` on the same storage then measures it, on its own host; `run SPEC`
    is submit, then work on it until it is finished. Submitting the same spec again changes
    nothing but its settings (more trials, say); another study of that name is refused.
    """
    from remat_search.spec.models import load_spec
    from remat_search.search.submission import submit as submit_study

    _quiet_optuna()
    loaded = load_spec(spec, storage=storage)
    _importable_from(spec)
    done = submit_study(loaded)
    said = "submitted study" if done.created else "study"
    again = "" if done.created else " was already submitted"
    output.console.print(
        f"{said} {done.study!r}{again} ({done.done}/{done.total} trials) to {done.storage}", highlight=False,
        soft_wrap=True, markup=False,
    )


@app.command(cls=_Command)
@_handle_errors
def worker(
    storage: StorageOption = None,
    workers: Annotated[str, typer.Option(
        metavar="N|auto", help="Worker processes measuring plans at once, as in `run --workers`."
    )] = "1",
    until_idle: Annotated[bool, typer.Option(
        "--until-idle", help="Exit once no submitted study has work left (default: wait for more)."
    )] = False,
    poll: Annotated[float, typer.Option(
        min=0.1, metavar="SECONDS", help="How often an idle worker looks for new studies."
    )] = 5.0,
) -> None:
    """Measure submitted studies until stopped: the service's worker, one or more per host.

    Takes the oldest study with trials left to take, measures it exactly as `run` would
    (the same guarantees: no plan measured twice at once, exactly `trials` finished however
    many workers and hosts share it, dead hosts' trials queued again by heartbeat), then the
    next. A study this host cannot measure (another device kind measures it) is left to others.

    Logs one JSON line per trial on stdout: study, trial, plan, status, peak_bytes, seconds.
    Ctrl-C or SIGTERM fail the trial in hand as interrupted and queue its plan again (another
    worker takes it), and say so; SIGTERM exits 0, Ctrl-C 130.
    """
    import signal

    from remat_search.store.storage import resolve_url
    from remat_search.service.worker import work

    _quiet_optuna()
    url = resolve_url(storage)
    in_hand: dict[tuple[str, int], str] = {}
    stopped_by: list[str] = []

    def on_event(event: dict[str, Any]) -> None:
        key = (event.get("study", ""), event.get("trial", -1))
        if event["event"] == "measuring":
            in_hand[key] = event["plan"]
            return
        in_hand.pop(key, None)
        _print(json.dumps(event, default=str, ensure_ascii=False))

    def terminate(signum: int, _: Any) -> None:
        stopped_by.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    try:
        with _notes():
            work(url, workers=_workers(workers) or 1, until_idle=until_idle, poll=poll, on_event=on_event)
    except KeyboardInterrupt:
        why = stopped_by[0] if stopped_by else "SIGINT"
        requeued = ", ".join(f"trial {n} of {s!r} ({plan})" for (s, n), plan in sorted(in_hand.items()))
        output.errors.print(
            f"worker: stopped by {why}; "
            + (f"{requeued}: failed as interrupted, its plan queued again for any worker" if requeued
               else "no trial was in hand"),
            markup=False, highlight=False, soft_wrap=True,
        )
        raise typer.Exit(0 if stopped_by else 130) from None


def _search(loaded: Any) -> Any:
    """Run the search of ``loaded``, telling its progress: in a terminal a bar that shows the
    trial being measured; elsewhere (CI, nohup, a pipe) a line a trial. Return its report."""
    from remat_search.search.loop import run as run_search

    _quiet_optuna()

    def lines(p: Any) -> list[str]:
        if p.event == "result":
            return [output.trial_line(p.trial, p.done, p.total)]
        return output.progress_lines(p, loaded.study, budget_given=loaded.budget is not None)

    if not output.console.is_terminal:
        with _notes():
            return run_search(loaded, on_progress=lambda p: _print(*lines(p)))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with _notes(), Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[best]}"), console=output.console, transient=False,
    ) as bar:
        task = bar.add_task("starting the worker…", total=loaded.trials, best="")
        best: list[float] = []

        def on_progress(p: Any) -> None:
            if p.event != "trial" and (p.event != "result" or p.trial.status == "failed"):
                _print(*lines(p), console=bar.console)
            if p.event == "start":
                bar.update(task, completed=p.done, description="searching")
            elif p.event == "trial":
                bar.update(task, description=output.running_text(p.trial))
            elif p.event == "result":
                if p.trial.status == "measured" and p.trial.step_seconds is not None:
                    best.append(p.trial.step_seconds)
                so_far = f"best fitting step {format_seconds(min(best))}" if best else "no fitting plan yet"
                bar.update(task, completed=p.done, best=so_far)
            elif p.event == "confirm":
                bar.update(task, description=f"confirming {p.plans} plans × {p.rounds} rounds")
            elif p.event == "confirmed":
                bar.update(task, description=f"confirmed {p.plans} plans")

        return run_search(loaded, on_progress=on_progress)


def _print(*lines: str, console: Any = None) -> None:
    """Print progress lines as they are: no markup, no wrapping (logs keep one line each)."""
    for line in lines:
        (console or output.console).print(line, markup=False, highlight=False, soft_wrap=True)


PlotOption = Annotated[Path | None, typer.Option(metavar="FILE", show_default=False, help=(
    "Also draw the study to this file, in the format its suffix names: .png, .svg or .html (a standalone "
    "page). Needs the plot extra: pip install 'remat-search[plot]'."
))]


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
    output.errors.print(f"wrote {pictures.save(figures, plot)}", markup=False, highlight=False, soft_wrap=True)


@app.command()
@_handle_errors
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
    with open_study(_study(study), storage) as stored:
        report = stored.report() if path is not None else None
        front = list(report.front) if report is not None else stored.front()
    if as_json:
        print(output.front_json(front))
    else:
        output.console.print(output.front_table(stored.name, stored.budget, front))
    if report is not None and path is not None:
        _draw(report, path, layers=False)


@app.command()
@_handle_errors
def best(
    study: StudyOption,
    budget: BudgetOption,
    storage: StorageOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the plan as JSON (RematPlan.from_json loads it).")] = False,
    form: Annotated[str, typer.Option(
        "--format", metavar="table|json|yaml|maxtext",
        help="table (default); json (= --json), yaml: the plan alone; maxtext: MaxText's remat settings "
             "(remat_policy: full, or custom with device/offload/remat per tensor name) where the plan has that form.",
    )] = "table",
) -> None:
    """The fastest measured plan whose compiled peak fits the budget (exit 1 if none does)."""
    from remat_search.plans.export import FORMATS, export
    from remat_search.report.results import settlement
    from remat_search.report.stored import open_study

    if form != "table" and form not in FORMATS:
        raise SpecError(f"--format: expected table, {', '.join(FORMATS)}; got {form!r}")
    form = "json" if as_json else form
    limit = _budget(budget)
    with open_study(_study(study), storage) as stored:
        found = stored.best(limit)
        untimed = stored.untimed_within(limit)
    note = output.answer_note(found, limit, settlement(stored.attrs), stored.name)
    if form != "table":
        assert found.plan is not None
        print(export(found.plan, form))  # type: ignore[arg-type]
    else:
        output.console.print(output.trials_table(f"Best plan of {stored.name!r} for {format_bytes(limit)}", [found], budget=limit))
        output.console.print(output.describe_trial(found))
    if note:
        output.errors.print(note, markup=False, highlight=False, soft_wrap=True)
    if untimed:
        output.errors.print(
            f"note: {len(untimed)} plan(s) fit {format_bytes(limit)} but were never timed, being over the "
            f"study's budget of {format_bytes(stored.budget)}; a study with a larger spec budget would time them"
        )


@app.command()
@_handle_errors
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
    from remat_search.search.loop import plan_for_budget

    _quiet_optuna()
    advice = plan_for_budget(_study(study), _budget(budget), storage=storage, measure=measure)
    if as_json:
        print(advice.plan.to_json())
        return
    output.console.print(output.advice_table(advice))
    if advice.measured is None:
        output.errors.print(f"not measured yet; add --measure to compile and time it as a trial of {advice.study!r}")


@app.command()
@_handle_errors
def confirm(
    study: StudyOption,
    budget: Annotated[
        str | None, typer.Option(metavar="SIZE", help="Confirm plans that fit this. Default: the study's budget.")
    ] = None,
    top: Annotated[int, typer.Option(min=2, metavar="N", help="How many of the fastest fitting plans to re-time.")] = 3,
    rounds: Annotated[
        int, typer.Option(min=1, metavar="N", help="Interleaved rounds (A B C A B C …) after the warm-up.")
    ] = 10,
    presets: Annotated[
        bool, typer.Option(help="Also re-time every uniform plan (preset) that fits, as baselines.")
    ] = True,
    races: Annotated[int, typer.Option(
        metavar="N",
        help="Race at most N times: while a plan not re-timed ranks first by its search time, re-time it with "
             "the others in a new session.",
    )] = 10,  # confirm.races' default
    storage: StorageOption = None,
) -> None:
    """Re-time the fastest plans that fit, interleaved, and rank them by those medians.

    Timings on a shared machine drift; interleaving puts every plan through the same slow
    spells. The times are stored in the study and `best` ranks by them from then on. Re-timed
    plans tend to come back slower than the search's single times saw them, so it races: while
    a plan it did not re-time ranks first at the budget, that plan is re-timed with the others
    (at most --races times), so `best` at this budget answers with a re-timed plan. Each plan
    is set against the fastest, paired round by round with a 95% interval; ≈ marks those the
    timing cannot tell from it.
    """
    from remat_search.search.confirm import confirm_study

    _quiet_optuna()
    limit = _budget(budget) if budget is not None else None
    if races < 0:
        raise SpecError(f"--races: expected 0 or more races, got {races}")
    with _notes():
        report, confirmed = confirm_study(
            _study(study), budget=limit, top=top, rounds=rounds, presets=presets, races=races, storage=storage,
            on_progress=lambda p: _print(*output.progress_lines(p, study)),
        )
    if not confirmed:
        output.errors.print("only one plan that ran fits: there is nothing to order")
        return
    output.console.print(output.confirmed_table(report, confirmed))


@app.command()
@_handle_errors
def studies(storage: StorageOption = None) -> None:
    """List the studies in the storage."""
    from remat_search.report.queries import list_studies

    output.console.print(output.studies_table(list_studies(storage)))


@app.command()
@_handle_errors
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
    with open_study(_study(study), storage) as stored:
        report = stored.report() if path is not None else None
        if trial is None:
            trials = list(report.trials) if report is not None else stored.trials()
        else:
            found, count = stored.trial(trial), stored.count()
    if trial is not None and found is None:
        total = sum(count.values())
        have = f"trials 0..{total - 1}" if total else "no trials yet"
        raise SpecError(f"--trial: study {stored.name!r} has no trial {trial} (it has {have})")
    if trial is None:
        output.console.print(output.trials_table(f"Trials of {stored.name!r}", trials, budget=stored.budget))
        if note := output.time_models_note(trials):
            output.errors.print(note, markup=False, highlight=False, soft_wrap=True)
    else:
        output.console.print(output.describe_trial(found), highlight=False)
    if stored.device.get("workload_note"):
        output.console.print(stored.device["workload_note"], highlight=False, markup=False)
    if stored.device.get("shardings"):
        line = output.sharding_line(stored.device.get("mesh"), stored.device["shardings"], stored.device.get("device_order"))
        output.console.print(line, highlight=False, markup=False)
    if report is not None and path is not None:
        _draw(report, path, layers=True)


def _quiet_optuna() -> None:
    """optuna's own log lines off (its trial-by-trial INFO): for the commands that run optuna;
    the queries read the tables without it."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


@app.command(cls=_Command)
@_handle_errors
def doctor(
    storage: StorageOption = None,
    study: Annotated[str | None, typer.Option("--study", "-s", metavar="NAME", show_default=False,
                                              help="Judge only this study's trials. Default: every study.")] = None,
) -> None:
    """Check the storage, the backend and the device, and say what to fix.

    Storage: reachable, its driver, optuna's schema version, the measurement cache table,
    SQLite's integrity and journal mode (WAL), and stale trials (running, their search gone:
    by pid on this host, by heartbeat on others). Backend: JAX's platform, devices and plugins
    (libtpu, CUDA). Memory: per device, and free on the host. Writes nothing.

    Exit codes: 0 when no check failed (warnings allowed); 1 when one failed, a file that is
    no database or is damaged included; 2 for bad input, one line: a malformed URL, a SQLite
    file that does not exist, an unknown study.
    """
    from remat_search.cli.doctor import diagnose

    checks = diagnose(storage, _study(study) if study is not None else None)
    output.console.print(output.doctor_table(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


TOKEN_ENV = "REMAT_SEARCH_TOKEN"


@app.command(cls=_Command)
@_handle_errors
def serve(
    storage: StorageOption = None,
    host: Annotated[str, typer.Option(metavar="ADDRESS", help="Address to listen on. Beyond loopback (127.0.0.1, ::1, localhost) only with a token.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, metavar="PORT", help="Port to listen on.")] = 8000,
    token: Annotated[str | None, typer.Option(
        metavar="TOKEN", envvar=TOKEN_ENV, show_default=False,
        help=f"Bearer token that writes (POST /studies) need; also from ${TOKEN_ENV}. Without one, writes are off.",
    )] = None,
) -> None:
    """Serve the storage's studies over HTTP (FastAPI; the API's schema at /docs).

    Reads answer as the commands do: GET /studies, /studies/NAME (progress, estimated time to
    finish, best plan so far; in a browser, the study's page with its front and a box to ask
    for a budget), /studies/NAME/pareto, /studies/NAME/trials/N, and
    /studies/NAME/best?budget=14GiB, which returns what `best --json` prints (404 naming the
    smallest peak measured when nothing fits). POST /studies submits a spec (YAML or JSON) as
    `submit` does, to this storage.

    Token rule: writes need the header Authorization: Bearer TOKEN (401 without it), and are
    off (403) when the server has no token; beyond loopback it listens only with a token.

    Example (the demo's plan for 38 MiB, then a search submitted):

    \b
      export REMAT_SEARCH_TOKEN=$(openssl rand -hex 16)
      remat-search serve &
      curl 'http://127.0.0.1:8000/studies/demo-transformer-cpu/best?budget=38MiB'
      curl -H "Authorization: Bearer $REMAT_SEARCH_TOKEN" \\
           -H 'Content-Type: application/yaml' --data-binary @spec.yaml \\
           http://127.0.0.1:8000/studies
    """
    import importlib.util
    import ipaddress

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecError(f"serve: needs {' and '.join(missing)}, not installed: pip install 'remat-search[service]'")
    token = token or None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False  # a host name: it may stand for any address
    if not loopback and token is None:
        raise SpecError(
            f"--host: {host!r} is beyond loopback: a service others can reach needs a token (--token, or "
            f"${TOKEN_ENV}); or listen on 127.0.0.1"
        )
    import uvicorn

    from remat_search.service.server import make_app
    from remat_search.store.storage import check_storage, open_storage, shown_url

    check_storage(storage, create=True)  # a malformed URL is bad input, said before listening
    if token:  # writes on: make optuna's tables now, so that a dashboard started after us finds them
        open_storage(storage, create=True)
    output.errors.print(
        f"serving {shown_url(storage)} on http://{host}:{port} (writes {'need the token' if token else 'off: no token'})",
        markup=False, highlight=False, soft_wrap=True,
    )
    uvicorn.run(make_app(storage, token=token), host=host.strip("[]"), port=port, log_level="info")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    sys.exit(main())
