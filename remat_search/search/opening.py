"""Opening a study, for a search or a submission, in one place: a spec goes down once.

:func:`checked` reads what the storage holds of the spec's study and checks the spec against
it and against its workload, before anything is written, built on a device or compiled: the
storage answers, an older spec resumes its study as it was searched (:func:`_as_searched`),
a spec with another identity is refused, the space's names are the workload's. Then
:func:`opened` (a search, on its device) or :func:`submitted` (a submission, with no device)
loads or creates the study, checks it again (another process may have made it meanwhile),
stores the spec with it and queues the presets; a search also ties the study to its device
and budget, notes the settings it changes, gives it its sampler and takes back the trials a
killed search left running (:func:`liveness.recover`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from typing import Any, NamedTuple

import optuna

from remat_search.errors import SpecError, StorageError
from remat_search.measure.device import DeviceInfo
from remat_search.measure.runner import Runner
from remat_search.plans.export import MAXTEXT_NAMES, PINNED
from remat_search.report.stored import open_study
from remat_search.search.configurations import check_workload, configurations, search_axes, sequence_of
from remat_search.search.runners import no_remat_peak, resolve_budget, runner_for
from remat_search.search.samplers import check_sampler, make_sampler
from remat_search.search.space import Space
from remat_search.search.study import (
    SETTINGS_ATTR,
    as_stored,
    changed_settings,
    check_device_identity,
    check_identity,
    device_identity,
    settings_of,
    stored_spec,
)
from remat_search.spec.budget import Share
from remat_search.spec.models import SearchSpec
from remat_search.spec.workloads import MaxTextConfig, TransformerConfig
from remat_search.store import cache
from remat_search.store.attributes import LAYERS_ATTR, NO_REMAT_PEAK_ATTR, QUEUED_ATTR, SPEC_ATTR, STACKS_ATTR
from remat_search.store.liveness import enqueue, heartbeat_storage_options, recover
from remat_search.store.storage import check_storage, open_storage, translate_errors
from remat_search.targets.platform import offloads_to_host, quiet_libtpu
from remat_search.workloads.base import build_workload

logger = logging.getLogger("remat_search")
METRIC_NAMES = ("step seconds", "peak bytes")
"""The study's objectives as optuna (and optuna-dashboard) names them."""
CONFIGURATION_METRIC_NAMES = ("step seconds per token per device", "peak bytes")
"""The objectives of a study of configurations (``spec.configuration``): the first is the
inverse of throughput."""
INITIALIZED_ATTR = "initialized"
"""Set once a search has tied the study to its device and budget."""


class Opened(NamedTuple):
    """A study open for a search, in the storage that beats for its trials, and the budget
    its device resolved."""

    study: optuna.Study
    storage: optuna.storages.RDBStorage
    budget: int
    space: Space
    """The space searched: with its configurations where the spec searches them."""


def checked(spec: SearchSpec) -> tuple[SearchSpec, Space]:
    """``spec`` as its study resumes (see :func:`_as_searched`) and its space, checked against
    the storage, the stored study and the workload: the storage answers, the study (if stored)
    has the spec's identity, the workload builds, the space's names are the workload's, the
    sampler exists. Reads the storage; writes, and compiles, nothing."""
    check_storage(spec.storage, create=True)  # fail fast, before anything is written or started
    attrs = _stored_attrs(spec)
    if attrs is not None:
        spec = _as_searched(spec, attrs)
        check_identity(spec, attrs)
    check_workload(spec)
    spec = _timed_alone(spec)
    with quiet_libtpu():  # a model built here (an NNX model's shapes, MaxText's loader) starts JAX's backends
        workload = build_workload(spec.workload)
    space = Space.of(spec.space, workload.layers, workload.stacks)
    space.check_names(workload.tensor_names)
    space.check_functions()
    check_sampler(spec.sampler)
    return spec, space


def tagged_tensors(spec: SearchSpec) -> tuple[tuple[str, ...], bool] | None:
    """The tensors of MaxText's custom policy that a ``--space tensors`` study of ``spec`` places
    when the user names none, and whether they are its stored study's: the stored study's own (it
    resumes as it was searched); else those the model's step tags on ``spec``'s target, traced by
    a worker as a search's first step traces it, in a layer's order
    (:data:`~remat_search.plans.export.MAXTEXT_NAMES`). A ``decoder_block: default`` model tags
    ``mlpwi``, a ``llama2`` one ``mlpwi_0`` and ``mlpwi_1``; flash attention on a TPU tags
    ``context``, which ``dot_product`` attention does not. None where the step does not trace.
    ``spec`` is :func:`checked` before a worker starts: a bad storage is refused first, and
    nothing is written."""
    spec_attr = (_stored_attrs(spec) or {}).get(SPEC_ATTR)
    space = spec_attr.get("space") if isinstance(spec_attr, dict) else None
    if isinstance(space, dict) and space.get("tensors"):
        return tuple(space["tensors"]), True
    spec, _ = checked(spec)
    with runner_for(spec) as runner:
        traced = runner.describe().traced_names
    return None if traced is None else (tuple(n for n in MAXTEXT_NAMES if n in traced), False)


def _timed_alone(spec: SearchSpec) -> SearchSpec:
    """``spec`` with ``timing.anchor`` off where it searches configurations: the anchor (full
    remat) of each configuration is another program, so times paired with it would not compare
    across configurations; each candidate is timed alone. Asked for by name, that is an error."""
    if spec.configuration is None or not spec.timing.anchor:
        return spec
    if "anchor" in spec.timing.model_fields_set:
        raise SpecError(
            "spec.timing.anchor: a study of configurations times each candidate alone (each "
            "configuration's anchor is another program); set anchor: false or leave it out"
        )
    return spec.model_copy(update={"timing": spec.timing.model_copy(update={"anchor": False})})


def _stored_attrs(spec: SearchSpec) -> dict[str, Any] | None:
    """The user attributes of ``spec``'s study as stored, or None where it is not stored yet."""
    with contextlib.suppress(StorageError), open_study(spec.study, spec.storage) as study:
        return study.attrs
    return None


def _as_searched(spec: SearchSpec, attrs: dict[str, Any]) -> SearchSpec:
    """``spec``, or, where it leaves the transformer's ``attention`` unset and its study (user
    attributes ``attrs``) is stored with ``dense`` (or without the field: searched before
    ``auto`` was the default), ``spec`` with ``attention: dense``: rerunning an older spec
    resumes its study as it was searched, not refused for another workload."""
    workload = spec.workload
    if not isinstance(workload, TransformerConfig) or "attention" in workload.model_fields_set:
        return spec
    spec_attr = attrs.get(SPEC_ATTR)
    stored = as_stored("workload", spec_attr.get("workload") if isinstance(spec_attr, dict) else attrs.get("workload"))
    if not isinstance(stored, dict) or stored.get("attention") != "dense":
        return spec
    return spec.model_copy(update={"workload": workload.model_copy(update={"attention": "dense"})})


def submitted(spec: SearchSpec, space: Space) -> tuple[optuna.Study, optuna.storages.RDBStorage, bool]:
    """``spec``'s study, loaded or created, checked and prepared (:func:`_prepare`), with its
    storage; and whether it was created here. ``spec`` and ``space`` as :func:`checked`
    returned them."""
    storage = open_storage(spec.storage, create=True)
    with translate_errors(spec.storage):
        cache.create_table(storage.engine)
        study, created = _load(spec, storage)
        _prepare(spec, study, space)
    return study, storage, created


def opened(spec: SearchSpec, space: Space, device: DeviceInfo, runner: Runner) -> Opened:
    """``spec``'s study open for a search on ``device``, whose worker is ``runner`` (``spec``
    and ``space`` as :func:`checked` returned them): the spec checked against the device, its
    budget resolved to bytes (a share such as ``70%`` of the no-remat plan's peak, which
    ``runner`` compiles first), the study loaded or created, refused if it is tied to another
    device or budget or measured with other
    :data:`~remat_search.search.study.FIXED_SETTINGS`, then prepared, tied to this device and
    budget, given its sampler, and its dead trials taken back."""
    _warn_untagged(spec, device)
    offload = [c.label for c in spec.space.choices if c.policy.host_memory]
    if offload and not offloads_to_host(device.platform):
        raise SpecError(
            f"spec.space.choices: {offload} offload to host memory, which needs a GPU or TPU; "
            "this machine compiles for cpu"
        )
    asked, peak = spec.budget, None
    if isinstance(asked, Share):  # before the study is tied to its budget
        peak = no_remat_peak(asked, spec, runner, space.layers)
        asked = asked.of(peak)
    budget = resolve_budget(asked, device)
    space = space.with_tensor_bytes(device.traced_bytes)
    if spec.configuration is not None:
        axes, strict = search_axes(spec.workload)
        space = space.with_configurations(configurations(
            spec.configuration, devices=device.device_count, mesh=device.mesh, sequence=sequence_of(spec.workload),
            axes=axes, strict=strict,
        ))
    storage = open_storage(
        spec.storage, create=True, heartbeat=heartbeat_storage_options(spec.heartbeat, space.n_params)
    )
    with translate_errors(spec.storage):  # the storage calls that open the study; later ones fail at run time
        cache.create_table(storage.engine)
        study, _ = _load(spec, storage)
        _tie(spec, study, space, device, budget)
        if peak is not None:  # what a query's share is taken of (report.queries.budget_bytes)
            study.set_user_attr(NO_REMAT_PEAK_ATTR, peak)
        recover(study, storage, n_params=space.n_params)
    return Opened(study, storage, budget, space)


def _warn_untagged(spec: SearchSpec, device: DeviceInfo) -> None:
    """Say which choices name tensors the traced step never tags (a model's tags may depend on
    its configuration): for those names such a choice saves nothing. A ``tensors`` space's names
    are said so, and the tags it leaves out beside them."""
    if device.traced_names is None:
        return
    if spec.space.layout == "tensors":  # its choices are the locations of every name it places: said once, by name
        untagged = [n for n in spec.space.tensors or () if n not in device.traced_names]
        # MaxText keeps its layer's input on the device unless offloaded: with no offload, it has nothing to place
        maxtext = isinstance(spec.workload, MaxTextConfig)
        aside = {PINNED} if maxtext and "offload" not in {c.label for c in spec.space.choices} else set()
        unplaced = [n for n in device.traced_names if n not in (spec.space.tensors or ()) and n not in aside]
        if untagged or unplaced:
            logger.warning(
                "note: spec.space.tensors: %s", "; ".join(
                    ([f"names {untagged}, which the traced step never tags with checkpoint_name: placing them changes nothing"]
                     if untagged else [])
                    + ([f"the step also tags {unplaced}, which the space does not place"] if unplaced else [])),
            )
        return
    for choice in spec.space.choices:
        missing = sorted(set(choice.policy.tensor_names) - set(device.traced_names))
        if missing:
            logger.warning(
                "note: spec.space.choices: %r names %s, which the traced step never tags with checkpoint_name "
                "(it tags %s): for those, the choice saves nothing", choice.label, missing,
                ", ".join(device.traced_names) or "nothing",
            )


def _load(spec: SearchSpec, storage: optuna.storages.RDBStorage) -> tuple[optuna.Study, bool]:
    """``spec``'s study (two objectives, both minimised), created if missing, refused if it
    has another identity; and whether this call created it."""
    created = False
    if spec.study not in {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}:
        try:
            optuna.create_study(study_name=spec.study, storage=storage, directions=["minimize", "minimize"])
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            pass  # another process created it a moment ago
    study = optuna.load_study(study_name=spec.study, storage=storage)
    check_identity(spec, study.user_attrs)
    return study, created


def _tie(spec: SearchSpec, study: optuna.Study, space: Space, device: DeviceInfo, budget: int) -> None:
    """Tie ``study`` to the search of ``spec`` on ``device`` within ``budget``, refusing it
    where it is tied to another (before anything is written), prepare it, note the settings
    this search changes, and give it its sampler."""
    identity = device_identity(spec, budget, device)
    if study.user_attrs.get(INITIALIZED_ATTR):  # refused before anything is written
        check_device_identity(spec.study, study.user_attrs, identity)
    changed = changed_settings(spec, study.user_attrs)
    _prepare(spec, study, space)
    if not study.user_attrs.get(INITIALIZED_ATTR):  # new, submitted, or killed while being set up
        for key, value in identity.items():
            study.set_user_attr(key, value)
        study.set_user_attr("device_info", device.model_dump())
        study.set_user_attr(INITIALIZED_ATTR, True)
        check_device_identity(spec.study, study.user_attrs, identity)  # another worker's, set at the same moment, wins
    for name, (old, new) in changed.items():
        logger.warning(
            "note: spec.%s changed from %s to %s since study %r was last searched: allowed, its trials "
            "stay comparable", name, json.dumps(old), json.dumps(new), spec.study,
        )
    study.set_user_attr(SETTINGS_ATTR, settings_of(spec))
    # Not the same seed as last time: a resumed search must not replay its proposals.
    study.sampler = make_sampler(
        spec.sampler, space=space, budget=budget, offset=len(study.get_trials(deepcopy=False))
    )


def _prepare(spec: SearchSpec, study: optuna.Study, space: Space) -> None:
    """Store ``spec`` with its study (the last one submitted wins: ``trials`` may grow), name
    the objectives (:data:`METRIC_NAMES`) and queue the presets not queued yet."""
    if not study.metric_names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(list(CONFIGURATION_METRIC_NAMES if spec.configuration else METRIC_NAMES))
    study.set_user_attr(SPEC_ATTR, stored_spec(spec))
    study.set_user_attr(LAYERS_ATTR, space.layers)
    if space.stacks is not None:
        study.set_user_attr(STACKS_ATTR, list(space.stacks))
    if spec.configuration is not None and not space.configurations:
        return  # its configurations are known once a device tells its mesh: queued by the search
    queued = [t.user_attrs.get(QUEUED_ATTR) for t in study.get_trials(deepcopy=False)]
    for params in space.presets():
        if params not in queued:
            enqueue(study, params)
