"""Reading a study back: the Pareto front, the best plan under any budget, summaries.

Everything here reads storage and never writes it, so queries are cheap and safe to run
beside a search: straight from optuna's tables (``stored.py``), without importing optuna or
JAX, and the best plan and the front without reading every trial. Every plan has one step time in all of them (``TrialResult.seconds``: its
confirmed time where it was re-timed, else the search's): the front is the plans no other
beats in both peak and that time, and the best plan for a budget is the fastest timed plan
whose compiled peak fits it, which is on that front.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from remat_search.errors import SpecError
from remat_search.results import StudyReport, TrialResult
from remat_search.stored import StoredStudy, open_studies, open_study
from remat_search.units import parse_bytes


def load_report(study: str, storage: str | None = None) -> StudyReport:
    """The report of study ``study`` in ``storage`` (default storage if None): every trial."""
    with open_study(study, storage) as stored:
        return stored.report()


def pareto_front(study: str, storage: str | None = None) -> list[TrialResult]:
    """The study's feasible Pareto front of step time vs peak memory, smallest peak first."""
    with open_study(study, storage) as stored:
        return stored.front()


def best_plan(study: str, budget: int | str, storage: str | None = None) -> TrialResult:
    """The fastest measured plan of ``study`` whose compiled peak fits ``budget``
    (:meth:`StudyReport.best`, by indexed SQL: without reading every trial)."""
    try:
        limit = parse_bytes(budget)
    except ValueError as e:
        raise SpecError(f"budget: {e}") from None
    with open_study(study, storage) as stored:
        return stored.best(limit)


class StudySummary(BaseModel):
    """One line of ``remat-search studies``."""

    model_config = ConfigDict(frozen=True)

    study: str
    budget: int
    device: str
    complete: int
    failed: int
    running: int
    fastest_seconds: float | None
    estimated: bool
    """Step times are roofline estimates (a compile-only target), not measurements."""


def list_studies(storage: str | None = None) -> list[StudySummary]:
    """Every study in ``storage`` with its trial counts (by state, in SQL) and fastest timed
    step (the front's fastest)."""
    with open_studies(storage) as studies:
        return [_summary(s) for s in studies]


def _summary(study: StoredStudy) -> StudySummary:
    states = study.count()
    fastest = study.fastest()
    return StudySummary(
        study=study.name,
        budget=study.budget,
        device=f"{study.device.get('platform', '?')} ({study.device.get('device_kind', '?')})",
        # Screened-out plans are pruned: finished, though not measured.
        complete=states.get("COMPLETE", 0) + states.get("PRUNED", 0),
        failed=states.get("FAIL", 0),
        running=states.get("RUNNING", 0),
        fastest_seconds=fastest.seconds if fastest else None,
        estimated=study.device.get("executes") is False,
    )
