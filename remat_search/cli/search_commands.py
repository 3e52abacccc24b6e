"""The commands that measure: ``run``, ``maxtext``, ``submit``, ``worker`` and ``confirm``.

Each checks its flags, calls one library function (``search.loop.run``,
``search.submission.submit``, ``service.worker.work``, ``search.confirm.confirm_study``) and
prints its progress as it comes and its result through :mod:`cli.output`. ``app`` registers
them; the library loads inside each, so that ``--help`` does not import JAX or optuna.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from remat_search.cli import flags, output
from remat_search.cli.flags import RunStorageOption, SpecArgument, StorageOption, StudyOption
from remat_search.errors import SpecError
from remat_search.report.text import budget_line, running_text, trial_line
from remat_search.store.location import STORAGE_ENV
from remat_search.units import format_seconds, size_argument


def run(
    spec: SpecArgument,
    storage: RunStorageOption = None,
    workers: Annotated[str | None, typer.Option(
        metavar="N|auto", show_default=False,
        help="Worker processes measuring plans at once (default: the spec's workers, else 1). auto: one "
             "per two cores, as host memory allows. Compiles run in parallel; plans run on a local device "
             "one at a time.",
    )] = None,
    coordinator: Annotated[str | None, typer.Option(
        metavar="HOST:PORT", show_default=False, rich_help_panel="Slice (several hosts as one search)",
        help="Process 0's address on a slice (default: $JAX_COORDINATOR_ADDRESS; a Cloud TPU VM finds it "
             "itself). Its JAX job uses PORT, the searches PORT+1.",
    )] = None,
    processes: Annotated[int | None, typer.Option(
        metavar="N", show_default=False, rich_help_panel="Slice (several hosts as one search)",
        help="Processes of the slice, one a host (default: $REMAT_SEARCH_PROCESSES).",
    )] = None,
    process_id: Annotated[int | None, typer.Option(
        metavar="I", show_default=False, rich_help_panel="Slice (several hosts as one search)",
        help="This process's index, 0 to N-1; 0 holds the study (default: $REMAT_SEARCH_PROCESS_ID).",
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

    On a slice (several hosts as one program: a TPU pod slice, GPU nodes) start the same
    command on every host, with --coordinator, --processes and --process-id or the variables a
    launcher sets: every candidate is compiled and timed by all of them together; process 0
    holds the study. If a host dies the others exit 42, the code launchers restart a job on,
    and the restarted job resumes the study (docs/slice.md).
    """
    from remat_search.measure.slice import member_of
    from remat_search.spec.loading import load_spec

    member = member_of(coordinator, processes, process_id)
    loaded = load_spec(spec, storage=storage, workers=flags.workers(workers))
    _importable_from(spec)
    if member is not None and not member.leader:
        from remat_search.search.slice import check_slice, follow

        check_slice(loaded, member)
        output.note(f"process {member.process_id} of {member.processes}: following the leader at "
                    f"{member.channel[0]}:{member.channel[1]}")
        try:
            follow(loaded, member)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None  # the leader loses this process: it stops the slice (exit 42)
        output.note(f"process {member.process_id}: the leader ended the search")
        return
    if isinstance(loaded.budget, int):  # a share (70%) is said once the search has compiled no remat
        output.console.print(budget_line(loaded.budget_text, loaded.budget), highlight=False)
    try:
        report = _search(loaded, member)
    except KeyboardInterrupt:
        again = ["remat-search", "run", str(spec)]
        if storage and storage != os.environ.get(STORAGE_ENV):
            again += ["--storage", storage]
        if workers:
            again += ["--workers", workers]
        output.note(f"interrupted: finished trials are kept, and the same command resumes the study: {shlex.join(again)}")
        raise typer.Exit(130) from None
    _tell(report, f"remat-search best --study {report.study} --budget {size_argument(report.budget)} --json > plan.json")


def _tell(report: Any, next_command: str) -> None:
    """A finished search's front, its confirmed plans, and what became of its trials."""
    from remat_search.report.results import rank

    output.console.print(output.front_table(report.study, report.budget, report.front))
    confirmed = sorted((t for t in report.timed() if t.confirmed), key=rank)
    if confirmed:
        output.console.print(output.confirmed_table(report, confirmed))
    screened = sum(1 for t in report.trials if t.measurement and t.measurement.screened_bytes is not None)
    output.console.print(
        f"{report.count('measured')} fit, {report.count('over_budget')} over budget (never run"
        + (f"; {screened} of them screened out by the cost model, never compiled" if screened else "") + "), "
        + (f"{report.count('infeasible')} infeasible (refused by the workload, never compiled), " if report.count("infeasible") else "")
        + (f"{report.count('moved')} moved (presets taken at a refused configuration, queued at the next; not counted), " if report.count("moved") else "")
        + f"{report.count('failed')} failed. Next: {next_command}", soft_wrap=True,  # a command: one line
    )


def maxtext(
    arguments: Annotated[list[str] | None, typer.Argument(
        metavar="[CONFIG.yml] KEY=VALUE...", show_default=False,
        help="What you give MaxText's train or train_compile: a config file (default: MaxText's base.yml) and "
             "settings over it, such as model_name=llama3.1-8b per_device_batch_size=4 ici_fsdp_parallelism=-1. "
             "compile_topology=v5e-4 compiles for that TPU slice ahead of time (libtpu) instead of the local devices.",
    )] = None,
    budget: Annotated[str | None, typer.Option(
        metavar="SIZE|device", show_default=False,
        help="Peak memory a plan may use per chip (14GiB, 70%, device). Default: device, the chip's HBM as its "
             "compiler reports it; required on CPU.",
    )] = None,
    trials: Annotated[int | None, typer.Option(min=1, metavar="N", show_default=False, help="Candidates to compile (default: "
                                               "MaxText's six remat presets, or 12 with --space tensors; six more with --batch or --mesh).")] = None,
    batch: Annotated[list[int] | None, typer.Option(
        "--batch", min=1, metavar="N", show_default=False,
        help="Batch sizes to search beside the policy (repeat it), per data-parallel device (MaxText's "
             "per_device_batch_size over batch axes alone: data, fsdp, fsdp_transpose, expert); with --mesh alone, the config's global batch on a "
             "compile_topology, made up by each mesh.",
    )] = None,
    mesh: Annotated[list[str] | None, typer.Option(
        "--mesh", metavar="AXIS=N,...|all", show_default=False,
        help="Meshes to search (repeat it), such as fsdp=2,tensor=2, in MaxText's ici_*_parallelism axes; all: "
             "every split of the chips over the axes the model shards over.",
    )] = None,
    study: Annotated[str | None, typer.Option("--study", "-s", metavar="NAME", show_default=False,
                                              help="Study name (default: maxtext-MODEL_NAME, else the config's name).")] = None,
    storage: StorageOption = None,
    workers: Annotated[str | None, typer.Option(metavar="N|auto", show_default=False,
                                                help="Worker processes compiling at once, as in `run --workers`.")] = None,
    space: Annotated[str, typer.Option(
        "--space", metavar="presets|tensors",
        help="What to search: MaxText's six remat presets, or its whole custom policy, each tensor (--tensors) on "
             "the device, recomputed or, on a TPU topology, offloaded, the planner choosing 12 candidates by default.",
    )] = "presets",
    tensors: Annotated[str | None, typer.Option(
        "--tensors", metavar="NAME,...", show_default=False,
        help="With --space tensors: the tensor names to place (default: those the model's step tags, traced on the "
             "target before the search, such as decoder_layer_input, query_proj, key_proj, value_proj, attention_out, "
             "out_proj, mlpwi_0, mlpwi_1, mlpwo; a resumed study's own).",
    )] = None,
    form: Annotated[str, typer.Option(
        "--format", metavar="maxtext|maxtext-args",
        help="The answer as MaxText settings to paste onto your config (maxtext), or as key=value arguments for "
             "MaxText's train command (maxtext-args).",
    )] = "maxtext",
) -> None:
    """Search MaxText's own train step from the command line you would give MaxText, and print the answer to paste.

    No spec to write: the config and KEY=VALUE settings are read by MaxText's own loader (a key
    or value it refuses is one line, exit 2), and the study searches MaxText's remat presets
    (remat_policy full and custom with device/remat per tensor) or, with --space tensors, every
    custom policy of the tensors named, and, with --batch or --mesh,
    the batch and mesh beside them. Running the same command again resumes the study. The
    answer is the fastest plan that fits the budget, as MaxText settings (docs/spec.md, MaxText).

    Example, a v5e-4 slice compiled ahead of time from this machine:

      remat-search maxtext model_name=llama2-7b per_device_batch_size=2 compile_topology=v5e-4 --mesh all
    """
    from remat_search.plans.export import export
    from remat_search.report.maxtext import maxtext_answer
    from remat_search.report.stored import open_study
    from remat_search.search.opening import tagged_tensors
    from remat_search.spec.maxtext_study import as_flags, maxtext_study

    if form not in ("maxtext", "maxtext-args"):
        raise SpecError(f"--format: expected maxtext or maxtext-args, got {form!r}")
    if space not in ("presets", "tensors"):
        raise SpecError(f"--space: expected presets or tensors, got {space!r}")
    if tensors is not None and space != "tensors":
        raise SpecError("--tensors: only with --space tensors")
    output.quiet_optuna()
    named = [n for n in (tensors or "").split(",") if n]
    settings = {"budget": budget, "trials": trials, "study": flags.study(study) if study else None, "storage": storage,
                "workers": flags.workers(workers), "batches": batch or (), "meshes": mesh or ()}
    loaded = maxtext_study(arguments or [], **settings, tensors=None if space == "presets" else named)
    if space == "tensors" and not named:  # the names the model tags, not a dense decoder's
        try:
            tagged = tagged_tensors(loaded)
        except SpecError as e:
            raise as_flags(e) from None
        if tagged is not None:
            names, stored = tagged
            loaded = maxtext_study(arguments or [], **settings, tensors=list(names) if stored else [],
                                   default_tensors=names)
            placed = loaded.space.tensors or ()  # type: ignore[union-attr]
            aside = [n for n in names if n not in placed]  # decoder_layer_input: on the device on local devices
            output.note(f"note: --space tensors: {'the study' if stored else 'the traced step'}'s tensors: {', '.join(placed)}"
                        + (f" ({', '.join(aside)} aside: MaxText keeps it on the device unless offloaded, which local "
                           "devices cannot)" if aside else "") + " (--tensors names others)")
    if isinstance(loaded.budget, int):
        output.console.print(budget_line(loaded.budget_text, loaded.budget), highlight=False)
    try:
        report = _search(loaded)
    except KeyboardInterrupt:
        output.note("interrupted: finished trials are kept, and the same command resumes the study")
        raise typer.Exit(130) from None
    except SpecError as e:  # found as the search opens (a budget a CPU cannot read): the argument that set it
        raise as_flags(e) from None
    _tell(report, f"remat-search show --study {report.study}" + (f" --storage {storage}" if storage else ""))
    with open_study(report.study, loaded.storage) as stored:
        found = maxtext_answer(stored, report.budget)
        notes = output.answer_notes(stored, found.answer, report.budget)
    output.console.print(f"The answer for {size_argument(report.budget)}, to paste onto your MaxText config "
                         f"({'settings' if form == 'maxtext' else 'arguments'}):", highlight=False)
    assert found.answer.plan is not None
    print(export(found.answer.plan, form))  # type: ignore[arg-type]
    for line in ([notice] if (notice := found.notice()) else []) + notes:
        output.note(line)


def _importable_from(spec: Path) -> None:
    """Let a spec's ``workload.factory`` import from the spec's folder and the current one, as
    ``python -m`` would (a console script's import path has neither); the worker processes,
    spawned, share this process's path."""
    for folder in (str(Path.cwd()), str(spec.resolve().parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def _search(loaded: Any, member: Any = None) -> Any:
    """Run the search of ``loaded``, telling its progress: in a terminal a bar that shows the
    trial being measured; elsewhere (CI, nohup, a pipe) a line a trial. Return its report."""
    from remat_search.search.loop import run as run_search

    output.quiet_optuna()

    def lines(p: Any) -> list[str]:
        if p.event == "result":
            return [trial_line(p.trial, p.done, p.total)]
        return output.progress_lines(
            p, loaded.study, budget_given=isinstance(loaded.budget, int), budget_text=loaded.budget_text,
            configurations=loaded.configuration is not None,
        )

    if not output.console.is_terminal:
        with output.library_notes():
            return run_search(loaded, on_progress=lambda p: output.print_lines(*lines(p)), member=member)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with output.library_notes(), Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[best]}"), console=output.console, transient=False,
    ) as bar:
        task = bar.add_task("starting the worker…", total=loaded.trials, best="")
        best: list[float] = []

        def on_progress(p: Any) -> None:
            if p.event != "trial" and (p.event != "result" or p.trial.status == "failed"):
                output.print_lines(*lines(p), to=bar.console)
            if p.event == "start":
                bar.update(task, completed=p.done, description="searching")
            elif p.event == "trial":
                bar.update(task, description=running_text(p.trial))
            elif p.event == "result":
                if p.trial.status == "measured" and p.trial.step_seconds is not None:
                    best.append(p.trial.step_seconds)
                so_far = f"best fitting step {format_seconds(min(best))}" if best else "no fitting plan yet"
                bar.update(task, completed=p.done, best=so_far)
            elif p.event == "confirm":
                bar.update(task, description=f"confirming {p.plans} plans × {p.rounds} rounds")
            elif p.event == "confirmed":
                bar.update(task, description=f"confirmed {p.plans} plans")

        return run_search(loaded, on_progress=on_progress, member=member)


def submit(spec: SpecArgument, storage: RunStorageOption = None) -> None:
    """Store the spec's study for workers to measure, and return at once.

    The spec is checked as `run` checks it (its workload is built, its space's names are the
    workload's) and stored with the study, its uniform presets queued first. Any
    `remat-search worker` on the same storage then measures it, on its own host; `run SPEC`
    is submit, then work on it until it is finished. Submitting the same spec again changes
    nothing but its settings (more trials, say); another study of that name is refused.
    """
    from remat_search.search.submission import submit as submit_study
    from remat_search.spec.loading import load_spec

    output.quiet_optuna()
    loaded = load_spec(spec, storage=storage)
    _importable_from(spec)
    done = submit_study(loaded)
    said = "submitted study" if done.created else "study"
    again = "" if done.created else " was already submitted"
    output.console.print(
        f"{said} {done.study!r}{again} ({done.done}/{done.total} trials) to {done.storage}", highlight=False,
        soft_wrap=True, markup=False,
    )


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

    from remat_search.service.worker import work
    from remat_search.store.storage import resolve_url

    output.quiet_optuna()
    url = resolve_url(storage)
    in_hand: dict[tuple[str, int], str] = {}
    stopped_by: list[str] = []

    def on_event(event: dict[str, Any]) -> None:
        key = (event.get("study", ""), event.get("trial", -1))
        if event["event"] == "measuring":
            in_hand[key] = event["plan"]
            return
        in_hand.pop(key, None)
        output.print_lines(json.dumps(event, default=str, ensure_ascii=False))

    def terminate(signum: int, _: Any) -> None:
        stopped_by.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    try:
        with output.library_notes():
            work(url, workers=flags.workers(workers) or 1, until_idle=until_idle, poll=poll, on_event=on_event)
    except KeyboardInterrupt:
        why = stopped_by[0] if stopped_by else "SIGINT"
        requeued = ", ".join(f"trial {n} of {s!r} ({plan})" for (s, n), plan in sorted(in_hand.items()))
        output.note(
            f"worker: stopped by {why}; "
            + (f"{requeued}: failed as interrupted, its plan queued again for any worker" if requeued
               else "no trial was in hand")
        )
        raise typer.Exit(0 if stopped_by else 130) from None


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

    output.quiet_optuna()
    limit = flags.budget(budget) if budget is not None else None
    if races < 0:
        raise SpecError(f"--races: expected 0 or more races, got {races}")
    with output.library_notes():
        report, confirmed = confirm_study(
            flags.study(study), budget=limit, top=top, rounds=rounds, presets=presets, races=races, storage=storage,
            on_progress=lambda p: output.print_lines(*output.progress_lines(p, study)),
        )
    if not confirmed:
        output.errors.print("only one plan that ran fits: there is nothing to order")
        return
    output.console.print(output.confirmed_table(report, confirmed))
