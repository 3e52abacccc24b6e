"""Objects a spec names by import path (``"package.module:Name"``), imported in one place.

Workload models, factories and losses, and a user's own ``jax.checkpoint`` policy functions
are all found this way, in the process that checks a spec and again in each worker process
(spawned: it shares the import path, not the objects), so a path that does not import is
said the same way wherever it is written.
"""

from __future__ import annotations

import importlib
from typing import Any

from remat_search.errors import WorkloadError, first_line


def import_object(path: str, where: str, *, what: str = "class or function") -> Any:
    """The object at ``"package.module:Name"`` (``Name`` may be dotted); else a one-line
    :class:`WorkloadError` naming the spec field ``where`` (``workload.model``). A module that
    is not found is said with where it was looked for: the worker processes share this path."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):  # the module imports what is missing
            raise WorkloadError(f"{where}: {path!r} does not import ({type(e).__name__}: {e})") from None
        raise WorkloadError(
            f"{where}: {path!r} does not import: no module {e.name!r} on the import path, which the worker "
            f"process shares (the spec's folder and the current one first for the CLI, then $PYTHONPATH): put "
            f"it there, add its folder to PYTHONPATH, or pip install its package"
        ) from None
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's
        first = first_line(e)
        raise WorkloadError(f"{where}: {path!r} does not import ({type(e).__name__}: {first})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise WorkloadError(f"{where}: {path!r}: module {module_name!r} has no {what} {attr!r}")
        obj = getattr(obj, part)
    return obj
