"""What a study keeps of the spec that searches it, and the spec read back from it.

A study is tied to its identity (:data:`IDENTITY_FIELDS`, and the device that measures it,
:data:`DEVICE_IDENTITY`): a search with another would mix incomparable trials, so it is
refused (:func:`check_identity`, :func:`check_device_identity`). How its last search measured
(:data:`SETTINGS_FIELDS`) may change from one search to the next, but for
:data:`FIXED_SETTINGS` (:func:`changed_settings`). ``confirm``, ``plan --measure`` and the
workers read the spec back (:func:`spec_of_study`, :func:`spec_of_submitted`) to measure a
stored study exactly as it was measured; a field stored by an older version is read as it was
searched then (:func:`as_stored`) and compared as this version writes it (:func:`as_written_now`).
"""

from __future__ import annotations

import json
from typing import Any

import optuna
from pydantic import TypeAdapter

from remat_search.errors import SpecError, StorageError
from remat_search.measure.device import DeviceInfo
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import SearchSpec
from remat_search.store.liveness import finished_trials
from remat_search.store.attributes import SETTINGS_ATTR, SPEC_ATTR
from remat_search.units import size_argument

# Fields a study is tied to: resuming with others would mix incomparable trials.
IDENTITY_FIELDS = ("workload", "space", "budget", "target", "mesh", "configuration")
DEVICE_IDENTITY = ("platform", "device_kind", "device_count", "mesh", "device_order", "workload_fingerprint")
# How the study's last search measured (kept so that `plan --measure` and `confirm` measure alike).
SETTINGS_FIELDS = ("timing", "worker_memory", "gradient_tolerance", "prescreen", "compilation_cache", "sampler")
FIXED_SETTINGS = ("timing.anchor", "gradient_tolerance")
"""Settings a resumed search may not change: ``timing.anchor`` decides what a trial's step time
is (a ratio to the anchor in the study's anchor seconds, or seconds alone) and
``gradient_tolerance`` which trials failed. The other settings change how well, or which,
plans are measured next, never what a finished trial means: a resumed search may change them."""
FORMER_DEFAULTS: dict[str, dict[str, Any]] = {"transformer": {"attention": "dense"}}
"""Workload fields, by kind, whose default has changed, at their former default: a study
stored without one was searched with it (``attention`` was ``dense`` before ``auto``)."""


def check_identity(spec: SearchSpec, attrs: dict[str, Any]) -> None:
    """Refuse ``spec`` for a study with user attributes ``attrs`` if the study was submitted
    (or searched) with another identity. A budget left to the device, or written as a share
    of no remat's peak (``70%``), is compared once a device resolves it to bytes
    (:func:`check_device_identity`)."""
    mine = spec.model_dump(mode="json", include=set(IDENTITY_FIELDS))
    theirs = attrs.get(SPEC_ATTR)
    for key in IDENTITY_FIELDS:
        if isinstance(theirs, dict):
            stored = theirs.get(key)
        elif key in attrs:  # searched by a version that stored no spec
            stored = attrs[key]
        else:
            continue
        if key == "budget" and not (_is_bytes(stored) and _is_bytes(mine[key])):
            continue
        if as_written_now(key, stored) != mine[key]:
            raise identity_error(spec.study, key, stored)


def _is_bytes(budget: Any) -> bool:
    """Whether ``budget``, as a spec stores it, is bytes (not left to the device, not a share)."""
    return isinstance(budget, int) and not isinstance(budget, bool)


def device_identity(spec: SearchSpec, budget: int, device: DeviceInfo) -> dict[str, Any]:
    """The identity a search of ``spec`` on ``device`` within ``budget`` writes on its study."""
    return {
        **spec.model_dump(mode="json", include=set(IDENTITY_FIELDS)),
        "budget": budget,
        "device": device.model_dump(include=set(DEVICE_IDENTITY)),
    }


def check_device_identity(name: str, attrs: dict[str, Any], identity: dict[str, Any]) -> None:
    """Refuse study ``name`` (user attributes ``attrs``) where its identity, the device that
    measures it included, is not ``identity`` (:func:`device_identity`)."""
    for key, value in identity.items():
        if as_written_now(key, attrs.get(key)) != value:
            raise identity_error(name, key, attrs.get(key))


def identity_error(study: str, key: str, stored: Any) -> SpecError:
    """The error for a spec whose ``key`` (an identity field) is not ``stored``, the study's."""
    shown = size_argument(stored) if key == "budget" and isinstance(stored, int) else json.dumps(stored)[:160]
    return SpecError(
        f"spec.{'target' if key == 'device' else key}: study {study!r} already exists "
        f"with another {key} ({shown}); give this search a new study name"
    )


def settings_of(spec: SearchSpec) -> dict[str, Any]:
    """How a search of ``spec`` measures (:data:`SETTINGS_FIELDS`), as its study keeps it."""
    return spec.model_dump(mode="json", include=set(SETTINGS_FIELDS))


def changed_settings(spec: SearchSpec, attrs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings (dotted names: ``timing.repeats``) that ``spec`` changes from those stored
    in ``attrs``, as (stored, new); refused for :data:`FIXED_SETTINGS`. A setting the stored
    study does not have (stored by an older remat-search) is not compared."""
    old, new = _flatten(attrs.get(SETTINGS_ATTR, {})), _flatten(settings_of(spec))
    changed = {k: (v, new.get(k)) for k, v in sorted(old.items()) if new.get(k) != v}
    for name in FIXED_SETTINGS:
        if name in changed:
            raise SpecError(
                f"spec.{name}: study {spec.study!r} was measured with {name} = "
                f"{json.dumps(changed[name][0])}, and its trials would not compare with ones measured with "
                f"{json.dumps(changed[name][1])}; set it back, or give this search a new study name"
            )
    return changed


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def stored_spec(spec: SearchSpec) -> dict[str, Any]:
    """``spec`` as a study keeps it: everything but the storage URL (a worker's own)."""
    return spec.model_dump(mode="json", exclude={"storage"})


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
