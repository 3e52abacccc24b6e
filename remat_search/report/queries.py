"""Reading a study back: the Pareto front, the best plan under any budget, summaries.

Everything here reads storage and never writes it, so queries are cheap and safe to run
beside a search: straight from optuna's tables (``stored.py``), without importing optuna or
JAX, and the best plan and the front without reading every trial. Every plan has one step time in all of them (``TrialResult.seconds``: its
confirmed time where it was re-timed, else the search's): the front is the plans no other
beats in both peak and that time, and the best plan for a budget is the fastest timed plan
whose compiled peak fits it, which is on that front.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from remat_search.errors import SpecError
from remat_search.report.results import StudyReport, TrialResult
from remat_search.store.attributes import SPEC_ATTR
from remat_search.report.stored import StoredStudy, open_studies, open_study
from remat_search.spec.budget import DEVICE, Share, read_budget
from remat_search.targets.calibration import Sample
from remat_search.targets.chips import CHIPS, GPUS, chip_key

if TYPE_CHECKING:
    from remat_search.workloads.base import Workload


def load_report(study: str, storage: str | None = None) -> StudyReport:
    """The report of study ``study`` in ``storage`` (default storage if None): every trial."""
    with open_study(study, storage) as stored:
        return stored.report()


def pareto_front(study: str, storage: str | None = None) -> list[TrialResult]:
    """The study's feasible Pareto front of step time vs peak memory, smallest peak first."""
    with open_study(study, storage) as stored:
        return stored.front()


def best_plan(
    study: str, budget: int | str | Share, storage: str | None = None, *, workload: Workload | None = None, check: bool = True,
) -> TrialResult:
    """The fastest measured plan of ``study`` whose compiled peak fits ``budget``
    (:meth:`StudyReport.best`, by indexed SQL: without reading every trial). ``budget``: bytes,
    a size, a share of no remat's peak (``70%``) or ``device`` (see :func:`budget_bytes`).

    For a training script that applies it: with ``check`` (the default), a study measured with
    another JAX version, or on another kind of device than this process's first, is refused
    (:class:`SpecError`, naming both), and so is one of another workload than ``workload``
    (its fingerprint: names, layers, tensor names, input shapes), where one is given: its
    peaks and times would not be this run's. ``check=False`` only reads the answer."""
    read_budget(budget)  # a malformed budget is told before the storage is opened
    with open_study(study, storage) as stored:
        found = stored.best(budget_bytes(budget, stored))
        measured_on = stored.device
    if check:
        _check_caller(study, measured_on, workload)
    return found


def _check_caller(study: str, measured_on: dict, workload: Workload | None) -> None:
    import jax

    mine = {
        "jax_version": jax.__version__, "device_kind": jax.devices()[0].device_kind,
        **({"workload_fingerprint": workload.fingerprint()} if workload is not None else {}),
    }
    for key, value in mine.items():
        if measured_on.get(key) is not None and measured_on[key] != value:
            raise SpecError(
                f"best_plan: study {study!r} was measured with {key} {measured_on[key]!r}, and this process has "
                f"{value!r}: its peaks and times are not this run's; search again here, or pass check=False to "
                "read the answer anyway"
            )


def budget_bytes(budget: object, study: StoredStudy, *, name: str = "budget") -> int:
    """The bytes a budget asked of ``study`` names (:func:`~remat_search.spec.budget.read_budget`
    reads it; ``name`` is what the asker called it, ``--budget``): a size (``14GiB``,
    ``1.6e10``); a share (``70%``) of the compiled peak of the study's trial of the uniform
    no-remat plan; ``device``: the memory limit of the device that measured the study. Else
    :class:`SpecError` naming ``name``."""
    asked = read_budget(budget, name=name)
    if isinstance(asked, Share):
        peak = study.no_remat_peak()
        if peak is None:
            missing = ("searches configurations and stores no compiled peak of the uniform no-remat plan at its own "
                       "batch and mesh (a search stores it when it resolves a share budget: run the spec again with one)"
                       if study.searches_configurations
                       else "has no compiled trial of the uniform no-remat plan")
            raise SpecError(f"{name}: {asked} is a share of no remat's compiled peak, and study {study.name!r} "
                            f"{missing}; give bytes such as 14GiB")
        return asked.of(peak)
    if asked == DEVICE:
        limit = study.device.get("memory_limit")
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise SpecError(
                f"{name}: device is the device's memory, and study {study.name!r} stores no memory limit "
                f"of its device ({study.device.get('platform') or 'none measured it yet'}); give bytes such as 14GiB"
            )
        return limit
    return asked


class StudySummary(BaseModel):
    """One study at a glance: one line of ``remat-search studies``, and ``GET /studies``."""

    model_config = ConfigDict(frozen=True)

    study: str
    budget: int
    device: str
    """``platform (device kind)`` of the devices that measure it; ``—`` before a worker has."""
    target: str
    """Where its plans run: ``local``, or the TPU topology they are compiled for (and its host link, where given)."""
    complete: int
    failed: int
    running: int
    done: int
    """Trials that count towards the spec's ``trials``: complete, screened out, or failed by the
    runner (a trial whose process died is measured again, so it does not count)."""
    total: int | None
    """The spec's ``trials`` (None for a study whose spec does not store it)."""
    eta_seconds: float | None
    """Estimated seconds to finish (:func:`estimate_seconds`); None when no trial has finished
    yet, the study is finished, or its total is unknown."""
    fastest_seconds: float | None
    fastest_trial: int | None
    """The trial of the fastest timed plan (the front's fastest, within the study's budget)."""
    estimated: bool
    """Step times are estimates (a compile-only target: see ``step_time``), not measurements."""


def list_studies(storage: str | None = None) -> list[StudySummary]:
    """Every study in ``storage`` with its trial counts (by state, in SQL), progress and
    fastest timed step (the front's fastest)."""
    with open_studies(storage) as studies:
        return [summarize(s) for s in studies]


def summarize(study: StoredStudy) -> StudySummary:
    """The summary of an open study."""
    states = study.count()
    fastest = study.fastest()
    finished = study.finished()
    spec = study.attrs.get(SPEC_ATTR)
    spec = spec if isinstance(spec, dict) else {}  # none where searched before `submit` existed
    total = spec.get("trials")
    running = states.get("RUNNING", 0)
    return StudySummary(
        study=study.name,
        budget=study.budget or _int(spec.get("budget")) or 0,  # a budget left to the device: once one measures it
        # A submitted study's device is the first worker's that measures it.
        device=f"{study.device.get('platform', '?')} ({study.device.get('device_kind', '?')})" if study.device else "—",
        target=_target(study.device.get("target") or spec.get("target") or study.attrs.get("target")),
        # Screened-out and infeasible plans are pruned: finished, though not measured.
        complete=states.get("COMPLETE", 0) + states.get("PRUNED", 0),
        failed=states.get("FAIL", 0),
        running=running,
        done=len(finished),
        total=_int(total),
        eta_seconds=estimate_seconds(finished, total=_int(total), running=running),
        fastest_seconds=fastest.seconds if fastest else None,
        fastest_trial=fastest.number if fastest else None,
        estimated=study.device.get("executes") is False,
    )


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _target(stored: object) -> str:
    """A target as its spec stored it: ``local``, or a TPU target by its topology."""
    if isinstance(stored, dict):
        return str(stored.get("topology", "?"))
    return stored if isinstance(stored, str) else "?"


def estimate_seconds(finished: Sequence[float | None], *, total: int | None, running: int) -> float | None:
    """Seconds until ``total`` trials are finished: the mean time of the ``finished`` ones (start
    to completion, compile and measure) times the trials left, divided by the trials running
    at once (at least one, at most the trials left). None when none has finished with its
    times, none is left, or ``total`` is unknown."""
    took = [s for s in finished if s is not None]
    left = (total or 0) - len(finished)
    if not took or left <= 0:
        return None
    return statistics.fmean(took) * left / max(1, min(running, left))


def study_samples(study: str, storage: str | None = None, *, chip: str | None = None) -> tuple[list[tuple[Sample, Path]], str]:
    """The calibration samples of ``study``: each trial that ran and was timed on its devices,
    its compiled program (kept in the study's artifacts, ``measure.artifacts.PROGRAMS``) and its
    measured median step; and the compiler the study compiled with. ``chip``: the chip's key
    (``h100``, ``v5e``) where the study's device kind does not say it."""
    from remat_search.measure.artifacts import ARTIFACTS, PROGRAMS
    from remat_search.store.location import storage_home

    known = sorted({*CHIPS, *GPUS})
    if chip is not None and chip not in known:
        raise SpecError(f"--chip: expected one of {', '.join(known)}, got {chip!r}")
    with open_study(study, storage) as stored:
        trials, device = stored.trials(), stored.device
    key = chip or chip_key(str(device.get("device_kind", "")))
    if key is None:
        raise SpecError(f"--chip: study {study!r} ran on {device.get('device_kind') or 'an unknown device'}, which is not a "
                        "chip the step-time model knows; name it (--chip h100, v5e, …)")
    folder = storage_home() / ARTIFACTS / study / PROGRAMS
    samples = []
    for t in trials:
        m = t.measurement
        if m is None or m.time_source != "measured" or not m.program_digest or t.plan is None or t.seconds is None:
            continue
        path = folder / f"{m.program_digest}.hlo.gz"
        if path.is_file():
            samples.append((Sample(label=f"{study}#{t.number}", chip=key, program=str(path), measured_seconds=t.seconds,
                                   kind=t.plan.kind, source=f"{device.get('device_kind', '')}, study {study!r}"), path))
    compiler = str(device.get("compiler_packages") or device.get("compiler_version") or "unstated")
    return samples, compiler
