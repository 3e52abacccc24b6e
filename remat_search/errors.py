"""The errors remat-search raises, in one place.

Every error a user can cause is a :class:`RematSearchError`. Its message names the field
or flag, repeats the bad value and says what was expected, on one line, so the CLI can
print it as it is. The CLI maps each class to an exit code in one table (``cli/app.py``): 2 for
bad input only, 1 for "nothing fits", 3 for a failure at run time.
"""

from __future__ import annotations


class RematSearchError(Exception):
    """Base class of every error remat-search raises on purpose."""


class SpecError(RematSearchError):
    """A search spec, a plan or a command-line value is malformed (exit code 2)."""


class StorageError(RematSearchError):
    """The storage URL is malformed or unreachable, or a study is missing (exit code 2)."""


class WorkloadError(RematSearchError):
    """A workload factory does not import, fails, or returns something that is no workload."""


class CandidateRefused(WorkloadError):
    """The workload cannot build one candidate (MaxText refuses its settings: a mesh that does
    not divide its heads, an axis it does not shard over): that candidate is an infeasible
    trial with the reason, and the search goes on."""


class NoFeasiblePlan(RematSearchError):
    """No measured plan fits the budget asked for (exit code 1)."""


class RunError(RematSearchError):
    """Something failed at run time, not in the input: a worker that died while re-timing, a
    confirmation that could not finish (exit code 3). What was measured before it is kept."""


SLICE_RESTART_EXIT = 42
"""The exit code of a slice's processes when one of them died or hangs: JobSet and XPK
restart a job on it (and on 127-255), never on an ordinary failure (exit code 1)."""


class SliceLost(RematSearchError):
    """A process of the slice died, hung or left (exit code :data:`SLICE_RESTART_EXIT`): the
    others stop, the trial it cut is failed and queued again, and the launcher's restart of the
    whole job resumes the study."""


def first_line(error: BaseException) -> str:
    """An exception's message, its first line only: a user's own error told in one line."""
    return (str(error).strip().splitlines() or [""])[0]
