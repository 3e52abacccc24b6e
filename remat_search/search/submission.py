"""Submitting a study: the spec checked and stored, its presets queued, nothing measured.

A submitted study waits in the storage until a worker (``remat-search worker``, on any host
that reaches the storage) or a ``run`` measures it. Everything a worker needs to measure it
as its submitter meant is stored with it (:data:`store.SPEC_ATTR`: the spec without its
storage URL, which is the worker's own). What depends on the device that measures it (a
budget left to the device's memory, offloading on a CPU) is checked by the first worker that
opens it, which records its device: later workers on other devices leave the study alone.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from remat_search.search.opening import checked, submitted
from remat_search.spec.models import SearchSpec
from remat_search.store.liveness import finished_trials
from remat_search.store.storage import translate_errors


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
    spec, space = checked(spec)  # bad input fails before anything is written
    study, storage, created = submitted(spec, space)
    with translate_errors(spec.storage):
        done = finished_trials(study)
    return Submitted(study=spec.study, storage=storage.url, created=created, done=done, total=spec.trials)
