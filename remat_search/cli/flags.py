"""The flags several commands share, and the checks of their values.

A value a flag cannot take is bad input: :class:`SpecError` naming the flag, which every
command prints as one line and exits 2 with (``app.EXIT_CODES``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from remat_search.errors import SpecError
from remat_search.spec.fields import check_study_name
from remat_search.store.location import STORAGE_ENV, default_storage
from remat_search.spec.budget import Asked, read_budget

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
SpecArgument = Annotated[
    Path, typer.Argument(metavar="SPEC", help="Search spec (YAML), e.g. search_spaces/demo.yaml.")
]
StudyOption = Annotated[str, typer.Option("--study", "-s", metavar="NAME", help="Study name (the spec's study).")]
BudgetOption = Annotated[
    str, typer.Option(metavar="SIZE", help=(
        "Memory a plan may use at peak, e.g. 14GiB, 200MiB, 1.6e10; 70%: that share of the compiled peak of the "
        "study's uniform no-remat trial; device: the memory of the device that measured the study."
    ))
]
PlotOption = Annotated[Path | None, typer.Option(metavar="FILE", show_default=False, help=(
    "Also draw the study to this file, in the format its suffix names: .png, .svg or .html (a standalone "
    "page). Needs the plot extra: pip install 'remat-search[plot]'."
))]


def budget(value: str) -> Asked:
    """``--budget`` as asked: bytes, a share of no remat's peak (``70%``) or ``device``, which a
    query resolves against its study (``report.queries.budget_bytes``)."""
    return read_budget(value, name="--budget")


def study(value: str) -> str:
    """``--study``'s name, checked as a study name."""
    try:
        return check_study_name(value)
    except ValueError as e:
        raise SpecError(f"--study: {e}") from None


def workers(value: str | None) -> str | None:
    """``--workers``: a positive number of worker processes, ``auto``, or None (not given)."""
    if value is not None and value != "auto" and not (value.isdigit() and int(value) > 0):
        raise SpecError(f"--workers: expected a positive number of worker processes or auto, got {value!r}")
    return value
