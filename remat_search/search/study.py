"""A study as its search left it: the spec that measures it again, its budget on a device,
and the worker that measures its plans.

The orchestration that the search, confirmation and the planner share, below all three:
``confirm`` and ``plan --measure`` measure a stored study exactly as its last search did.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, Literal

import optuna
import psutil
from optuna.trial import TrialState
from pydantic import BaseModel, ConfigDict, TypeAdapter

from remat_search.measure.artifacts import ARTIFACTS
from remat_search.errors import SpecError, StorageError
from remat_search.store.liveness import counts
from remat_search.report.results import TrialResult
from remat_search.measure.runner import DeviceInfo, Runner
from remat_search.spec.models import SearchSpec, parse_spec, storage_home
from remat_search.units import format_bytes, size_argument

# Fields a study is tied to: resuming with others would mix incomparable trials.
IDENTITY_FIELDS = ("workload", "space", "budget", "target", "mesh")
DEVICE_IDENTITY = ("platform", "device_kind", "device_count", "mesh", "device_order", "workload_fingerprint")
# How the study's last search measured (kept so that `plan --measure` and `confirm` measure alike).
SETTINGS_FIELDS = ("timing", "worker_memory", "gradient_tolerance", "prescreen", "compilation_cache", "sampler")
SETTINGS_ATTR = "settings"
FIXED_SETTINGS = ("timing.anchor", "gradient_tolerance")
"""Settings a resumed search may not change: ``timing.anchor`` decides what a trial's step time
is (a ratio to the anchor in the study's anchor seconds, or seconds alone) and
``gradient_tolerance`` which trials failed. The other settings change how well, or which,
plans are measured next, never what a finished trial means: a resumed search may change them."""


class Progress(BaseModel):
    """What a search or a confirmation is doing, told to its ``on_progress`` callback.

    - ``start``: the study is open: ``done`` of its ``total`` trials are finished (all of them
      on a finished study's rerun), measured on ``device`` within ``budget``;
    - ``trial``: ``trial`` (its number, plan and labels; status ``running``) is about to be
      measured, or, with ``cached_from``/``reused_from``, a stored measurement reused for it;
    - ``result``: it was recorded (``trial`` as stored), ``done`` of ``total``;
    - ``confirm``: ``plans`` plans are about to be re-timed interleaved, ``rounds`` rounds; in
      ``race`` 0 the top plans and presets, in each later race with the new leader added;
    - ``confirmed``: they were; with ``reused``, they had been re-timed together before with at
      least ``rounds`` rounds, and those stored times stand: nothing was re-timed; with
      ``exhausted``, the races ran out while a plan timed only by the search ranked first;
    - ``confirm_elsewhere``: ``holder`` (``host pid``), another process sharing the study, is
      confirming it: this one leaves it to it.
    """

    model_config = ConfigDict(frozen=True)

    event: Literal["start", "trial", "result", "confirm", "confirmed", "confirm_elsewhere"]
    done: int = 0
    total: int = 0
    device: DeviceInfo | None = None
    budget: int | None = None
    trial: TrialResult | None = None
    plans: int = 0
    rounds: int = 0
    reused: bool = False
    race: int = 0
    exhausted: bool = False
    holder: str | None = None


ProgressCallback = Callable[[Progress], None]


def runner_for(spec: SearchSpec) -> Runner:
    """The worker that measures ``spec``'s plans where and as the spec says."""
    return Runner(
        spec.workload, timeout=spec.timing.timeout, memory_limit=spec.worker_memory, target=spec.target,
        mesh=spec.mesh,
        # JAX makes the directory on its first write: nothing is written for a bad spec.
        compilation_cache=str(storage_home() / spec.compilation_cache) if spec.compilation_cache else None,
        artifacts=str(storage_home() / ARTIFACTS / spec.study),  # made when a reference is first saved
    )


def spec_of_study(study: optuna.Study, storage: str, **overrides: Any) -> SearchSpec:
    """The spec that searches ``study`` as its last search did (workload, space, budget,
    target, mesh, timing), with ``overrides``; ``trials`` defaults to the finished count."""
    attrs = study.user_attrs
    if "space" not in attrs or "workload" not in attrs:
        raise StorageError(f"study: {study.study_name!r} was not made by remat-search (it has no spec stored)")
    data: dict[str, Any] = {k: as_stored(k, attrs[k]) for k in IDENTITY_FIELDS if attrs.get(k) is not None}
    data.update(attrs.get(SETTINGS_ATTR, {}))
    data.update(study=study.study_name, storage=storage, trials=max(1, finished_trials(study)))
    data.update(overrides)
    return parse_spec(data)


FORMER_DEFAULTS: dict[str, dict[str, Any]] = {"transformer": {"attention": "dense"}}
"""Workload fields, by kind, whose default has changed, at their former default: a study
stored without one was searched with it (``attention`` was ``dense`` before ``auto``)."""


def as_stored(key: str, stored: Any) -> Any:
    """A stored identity field with the fields its version left out at their defaults then
    (:data:`FORMER_DEFAULTS`), so that it is measured again as it was searched."""
    if key != "workload" or not isinstance(stored, dict):
        return stored
    return {**FORMER_DEFAULTS.get(stored.get("kind", ""), {}), **stored}


def as_written_now(key: str, stored: Any) -> Any:
    """A stored identity field (``workload``, ``space``, …) read and written again as this
    version writes it, so a field added since, at its default, does not make it differ; as
    stored where it does not read (another version's form, which then differs)."""
    if key == "device" and isinstance(stored, dict):
        return {"device_order": None, **stored}  # stored before the field: the devices' own order
    if key not in ("workload", "space", "target", "mesh") or stored is None:
        return stored
    stored = as_stored(key, stored)
    try:
        adapter = TypeAdapter(SearchSpec.model_fields[key].annotation)
        return adapter.dump_python(adapter.validate_python(stored), mode="json")
    except ValueError:
        return stored


def identity_error(study: str, key: str, stored: Any) -> SpecError:
    """The error for a spec whose ``key`` (an identity field) is not ``stored``, the study's."""
    shown = size_argument(stored) if key == "budget" and isinstance(stored, int) else json.dumps(stored)[:160]
    return SpecError(
        f"spec.{'target' if key == 'device' else key}: study {study!r} already exists "
        f"with another {key} ({shown}); give this search a new study name"
    )


def resolve_budget(budget: int | None, device: DeviceInfo) -> int:
    """The spec's budget, checked against the device's memory; that memory if none is given."""
    limit = device.memory_limit
    if budget is None:
        if limit is None:
            raise SpecError(
                f"spec.budget: required here: {device.platform} reports no memory limit "
                "(give one such as 200MiB or 16GiB)"
            )
        return limit
    if limit is not None and budget > limit:
        raise SpecError(
            f"spec.budget: {format_bytes(budget)} is more than the {format_bytes(limit)} a "
            f"{device.device_kind} device has for a program; leave budget out to use all of it"
        )
    return budget


def finished_trials(study: optuna.Study) -> int:
    """Trials that count towards ``spec.trials`` (:func:`liveness.counts`): complete, screened
    out (pruned), or failed by the runner."""
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(1 for t in study.get_trials(deepcopy=False, states=states) if counts(t))


WORKER_HOST_MEMORY = 4 * 2**30
"""Host memory ``workers: auto`` allows each worker: a TPU compile of a ~1B model holds several GiB."""
CORES_PER_WORKER = 2
"""Cores ``workers: auto`` allows each worker: one v5e compile of the write-up model kept 1.7 busy."""


def resolve_workers(workers: int | str) -> int:
    """The number of worker processes for ``spec.workers``: itself, or for ``auto`` one per
    :data:`CORES_PER_WORKER` cores this process may use, as the host's available memory allows
    (:data:`WORKER_HOST_MEMORY` each); at least one."""
    if workers != "auto":
        return int(workers)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores // CORES_PER_WORKER, psutil.virtual_memory().available // WORKER_HOST_MEMORY))


def changed_settings(stored: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings (dotted names: ``timing.repeats``) whose stored value ``new`` changes.
    A setting the stored study does not have (stored by an older remat-search) is not compared."""
    old_flat, new_flat = _flatten(stored), _flatten(new)
    return {k: (v, new_flat.get(k)) for k, v in sorted(old_flat.items()) if new_flat.get(k) != v}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
