"""The ``remat-search`` command: a thin face over the library.

This module only makes the typer app and registers the commands, which live by what they do:
:mod:`cli.search_commands` (run, submit, worker, confirm: they measure),
:mod:`cli.query_commands` (pareto, best, plan, studies, show: they read studies) and
:mod:`cli.storage_commands` (doctor, serve: a whole storage). Each command checks its flags
(:mod:`cli.flags`), calls one library function and prints through :mod:`cli.output`.

Errors are mapped to exit codes in one place (:data:`EXIT_CODES`): bad input exits 2 with
one line naming the field, "nothing fits" exits 1, a failure at run time 3 with its reason
(an unexpected exception too, by its type and message). Set ``REMAT_SEARCH_DEBUG=1`` to see
tracebacks (the worker's own, for a failed candidate).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.markup import escape

from remat_search.cli import output, query_commands, search_commands, storage_commands
from remat_search.errors import (
    NoFeasiblePlan,
    RematSearchError,
    SLICE_RESTART_EXIT,
    RunError,
    SliceLost,
    SpecError,
    StorageError,
    WorkloadError,
)

EXIT_CODES: dict[type[Exception], int] = {
    SpecError: 2,
    StorageError: 2,
    WorkloadError: 2,
    NoFeasiblePlan: 1,
    RunError: 3,
    SliceLost: SLICE_RESTART_EXIT,
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


class Command(typer.core.TyperCommand):
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


def handle_errors(command: Callable[..., Any]) -> Callable[..., Any]:
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

    return wrapper


for _command in (  # in the order --help lists them
    search_commands.run, search_commands.maxtext, search_commands.submit, search_commands.worker,
    query_commands.pareto, query_commands.best, query_commands.plan,
    search_commands.confirm, query_commands.studies, query_commands.show, query_commands.calibrate,
    storage_commands.doctor, storage_commands.serve,
):
    app.command(cls=Command)(handle_errors(_command))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    sys.exit(main())
