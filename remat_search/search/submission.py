"""Submitting a study: the spec checked and stored, its presets queued, nothing measured.

A submitted study waits in the storage until a worker (``remat-search worker``, on any host
that reaches the storage) or a ``run`` measures it. Everything a worker needs to measure it
as its submitter meant is stored with it (:data:`store.SPEC_ATTR`: the spec without its
storage URL, which is the worker's own). What depends on the device that measures it (a
budget left to the device's memory, offloading on a CPU) is checked by the first worker that
opens it, which records its device: later workers on other devices leave the study alone.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import optuna
from pydantic import BaseModel, ConfigDict

from remat_search.store import cache
from remat_search.errors import StorageError
from remat_search.store.liveness import enqueue
from remat_search.search.planner import check_sampler
from remat_search.search.space import Space
from remat_search.spec.models import SearchSpec, TransformerConfig, parse_spec
from remat_search.store.storage import (
    LAYERS_ATTR,
    QUEUED_ATTR,
    SPEC_ATTR,
    check_storage,
    open_storage,
    translate_errors,
)
from remat_search.report.stored import open_study
from remat_search.search.study import IDENTITY_FIELDS, as_stored, as_written_now, finished_trials, identity_error
from remat_search.workloads.base import build_workload

METRIC_NAMES = ("step seconds", "peak bytes")
"""The study's objectives as optuna (and optuna-dashboard) names them."""


class Submitted(BaseModel):
    """A study in the storage, as :func:`submit` left it."""

    model_config = ConfigDict(frozen=True)

    study: str
    storage: str
    created: bool
    """False where the same study had been submitted (or searched) before."""
    done: int
    total: int


def submit(spec: SearchSpec) -> Submitted:
    """Check ``spec`` as ``run`` does and store its study, with the presets queued; return at
    once, having measured nothing. Submitting the same spec again changes nothing but the
    settings ``run`` may change (``trials`` among them); another study of that name is refused."""
    check_storage(spec.storage, create=True)  # bad input fails before anything is written
    spec = resumed_as_stored(spec)
    space = check(spec)
    storage = open_storage(spec.storage, create=True)
    with translate_errors(spec.storage):
        cache.create_table(storage.engine)
        study, created = create_study(spec, storage, space)
        return Submitted(
            study=spec.study, storage=storage.url, created=created, done=finished_trials(study), total=spec.trials
        )


def resumed_as_stored(spec: SearchSpec) -> SearchSpec:
    """``spec``, or, where it leaves the transformer's ``attention`` unset and its study is
    stored with ``dense`` (or without the field: searched before ``auto`` was the default),
    ``spec`` with ``attention: dense``: rerunning an older spec resumes its study as it was
    searched, not refused for another workload. Reads only; a study not stored yet is left be."""
    workload = spec.workload
    if not isinstance(workload, TransformerConfig) or "attention" in workload.model_fields_set:
        return spec
    stored = None
    with contextlib.suppress(StorageError), open_study(spec.study, spec.storage) as study:  # none yet: nothing to resume
        spec_attr = study.attrs.get(SPEC_ATTR)
        stored = as_stored("workload", spec_attr.get("workload") if isinstance(spec_attr, dict) else study.attrs.get("workload"))
    if not isinstance(stored, dict) or stored.get("attention") != "dense":
        return spec
    return spec.model_copy(update={"workload": workload.model_copy(update={"attention": "dense"})})


def check(spec: SearchSpec) -> Space:
    """What can be checked of ``spec`` without its device: the workload builds, the space's
    names are the workload's, the sampler exists. Returns the space."""
    workload = build_workload(spec.workload)
    space = Space.of(spec.space, workload.layers)
    space.check_names(workload.tensor_names)
    space.check_functions()
    check_sampler(spec.sampler)
    return space


def create_study(spec: SearchSpec, storage: optuna.storages.RDBStorage, space: Space) -> tuple[optuna.Study, bool]:
    """Load or create ``spec``'s study, refuse it if it was submitted or searched with another
    identity (workload, space, budget, target, mesh), then :func:`prepare` it. Returns the
    study and whether it was created here."""
    study, created = load_or_create(spec.study, storage)
    check_identity(spec, study)
    prepare(spec, study, space)
    return study, created


def load_or_create(name: str, storage: optuna.storages.RDBStorage) -> tuple[optuna.Study, bool]:
    """The study ``name`` (two objectives, both minimised), created if missing; and whether
    this call created it."""
    created = False
    if name not in {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}:
        try:
            optuna.create_study(study_name=name, storage=storage, directions=["minimize", "minimize"])
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            pass  # another process created it a moment ago
    return optuna.load_study(study_name=name, storage=storage), created


def prepare(spec: SearchSpec, study: optuna.Study, space: Space) -> None:
    """Store ``spec`` with its study (the last one submitted wins: ``trials`` may grow), name
    the objectives (:data:`METRIC_NAMES`) and queue the presets not queued yet."""
    if not study.metric_names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(list(METRIC_NAMES))
    study.set_user_attr(SPEC_ATTR, stored_spec(spec))
    study.set_user_attr(LAYERS_ATTR, space.layers)
    queued = [t.user_attrs.get(QUEUED_ATTR) for t in study.get_trials(deepcopy=False)]
    for params in space.presets():
        if params not in queued:
            enqueue(study, params)


def refuse_another_identity(spec: SearchSpec) -> None:
    """Refuse ``spec`` where its study is stored with another identity (workload, space,
    budget, target, mesh), before any work: it reads the storage, and writes, builds and
    compiles nothing (a study not stored yet is left be)."""
    attrs = None
    with contextlib.suppress(StorageError), open_study(spec.study, spec.storage) as study:
        attrs = study.attrs
    if attrs is not None:
        _check_identity(spec, attrs)


def check_identity(spec: SearchSpec, study: optuna.Study) -> None:
    """Refuse ``spec`` for ``study`` if the study was submitted (or searched) with another
    identity. A budget left to the device is compared once a device resolves it (``run``)."""
    _check_identity(spec, study.user_attrs)


def _check_identity(spec: SearchSpec, attrs: dict[str, Any]) -> None:
    mine = spec.model_dump(mode="json", include=set(IDENTITY_FIELDS))
    theirs = attrs.get(SPEC_ATTR)
    for key in IDENTITY_FIELDS:
        if isinstance(theirs, dict):
            stored = theirs.get(key)
        elif key in attrs:  # searched by a version that stored no spec
            stored = attrs[key]
        else:
            continue
        if as_written_now(key, stored) != mine[key] and not (key == "budget" and (stored is None or mine[key] is None)):
            raise identity_error(spec.study, key, stored)


def stored_spec(spec: SearchSpec) -> dict[str, Any]:
    """``spec`` as a study keeps it: everything but the storage URL (a worker's own)."""
    return spec.model_dump(mode="json", exclude={"storage"})


def spec_of_submitted(study: optuna.Study, storage: str, **overrides: Any) -> SearchSpec:
    """The spec ``study`` was last submitted with, on ``storage``, with ``overrides`` (``workers``)."""
    stored = study.user_attrs.get(SPEC_ATTR)
    if not isinstance(stored, dict):
        raise StorageError(
            f"study: {study.study_name!r} has no stored spec (it was searched before `submit` existed); "
            "run its spec again with `remat-search run`"
        )
    stored = {**stored, "workload": as_stored("workload", stored.get("workload"))}
    return parse_spec({**stored, "storage": storage, **overrides})
