"""A study from MaxText's own command line (``remat-search maxtext``): the config file and
``KEY=VALUE`` settings a MaxText user gives ``train`` or ``train_compile``, read as MaxText reads
them, made into the :class:`~remat_search.spec.models.SearchSpec` a spec file would have been,
with every error naming the argument the user gave."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any

from remat_search.errors import SpecError
from remat_search.spec.loading import parse_spec
from remat_search.spec.maxtext import INSTALL, before_import, installed, maxtext_config
from remat_search.spec.models import SearchSpec
from remat_search.spec.space import LOCATIONS

DENSE_TENSORS = (
    "decoder_layer_input", "query_proj", "key_proj", "value_proj", "attention_out", "out_proj", "mlpwi_0", "mlpwi_1",
    "mlpwo",
)
"""The tensors MaxText 0.2.5's dense decoder layer tags (``decoder_block: llama2``, gated MLP, as
traced: ``attention_out``, not ``context``): :func:`maxtext_study`'s default names, which
``remat-search maxtext --space tensors`` replaces with those the model's traced step tags
(:func:`~remat_search.search.opening.tagged_tensors`) unless ``--tensors`` names others."""
TENSOR_TRIALS = 12
"""Candidates a ``--space tensors`` study compiles by default: its presets, then the planner's."""


def maxtext_study(
    arguments: Sequence[str], *, budget: str | None = None, trials: int | None = None, study: str | None = None,
    storage: str | None = None, workers: str | None = None, batches: Sequence[int] = (),
    meshes: Sequence[str] = (), tensors: Sequence[str] | None = None, default_tensors: Sequence[str] = DENSE_TENSORS,
) -> SearchSpec:
    """The study of a MaxText command line, ``[CONFIG.yml] KEY=VALUE ...`` as MaxText's ``train``
    and ``train_compile`` take them: MaxText's own train step of that config and those settings
    (read by MaxText's loader, which refuses a key or value in one line), searched over MaxText's
    remat presets (``space: maxtext``), with no spec file to write.

    ``compile_topology=v5e-4`` (``train_compile``'s own key) makes the target that TPU topology,
    compiled ahead of time; without it, the local devices. ``batches`` (per-device batch sizes)
    and ``meshes`` (``fsdp=2,tensor=2``, or ``all``) search configurations beside the policy;
    ``trials`` defaults to the presets (and six more where configurations are searched). An
    error names the argument that set the field (:func:`as_flags`).

    ``tensors``: search MaxText's whole ``remat_policy: custom`` space instead of its presets,
    each of these tensor names (empty: ``default_tensors``, such as
    :func:`~remat_search.search.opening.tagged_tensors` gives) on the device, recomputed or, on a
    TPU topology, offloaded (``space: {layout: tensors}``), the planner choosing
    :data:`TENSOR_TRIALS` candidates by default; the config's own policy first, where the space
    states it (:func:`config_point`)."""
    from remat_search.plans.export import MAXTEXT_PRESETS, PINNED

    keys = list(arguments)
    config = keys.pop(0) if keys and keys[0].endswith((".yml", ".yaml")) else None
    if config is not None and not os.path.isfile(os.path.expanduser(config)):
        raise SpecError(f"CONFIG: no such file {config!r}; expected a MaxText config (.yml) or none (MaxText's base.yml)")
    bad = next((k for k in keys if not re.fullmatch(r"[A-Za-z_][\w.]*=.*", k)), None)
    if bad is not None:
        raise SpecError(f"KEY=VALUE: expected MaxText settings as key=value after an optional config .yml, got {bad!r}")
    mesh: Any = ("all" if "all" in meshes else [_mesh(m) for m in meshes]) if meshes else None
    if not installed():
        raise SpecError(f"maxtext: needs MaxText; install it with: {INSTALL}")
    # MaxText's own reading of key=value arguments (its pyconfig: OmegaConf.from_cli)
    from omegaconf import OmegaConf

    overrides: dict[str, Any] = OmegaConf.to_container(OmegaConf.from_cli(keys))  # type: ignore[assignment]
    topology, slices = overrides.pop("compile_topology", None), overrides.pop("compile_topology_num_slices", 1)
    target: Any = "local"
    chips = None  # the topology's, where one is named (the local devices are the worker's to count)
    if topology:
        before_import()
        from maxtext.utils.accelerator_to_spec_map import get_system_characteristics

        try:
            system = get_system_characteristics(str(topology))
        except ValueError:
            raise SpecError(f"compile_topology: MaxText knows no topology {topology!r}; expected one such as v5e-4, "
                            "v5p-128 or v6e-256") from None
        if system.platform != "tpu":
            raise SpecError(f"compile_topology: {topology} is a {system.platform} topology; remat-search compiles "
                            "ahead of time for TPU topologies only (search a GPU on the GPU itself)")
        if str(slices) != "1":
            raise SpecError(f"compile_topology_num_slices: expected 1 (one slice), got {slices!r}")
        target = {"platform": "tpu", "topology": system.topology_name}
        chips = system.devices_per_slice
    named = overrides.get("model_name") or (os.path.splitext(os.path.basename(config))[0] if config else "base")
    workload = {"kind": "maxtext", **({"config": os.path.expanduser(config)} if config else {}), "overrides": overrides}
    space: Any = "maxtext"
    if tensors is not None:  # on the device or recomputed; offloaded where the target has host memory (a TPU)
        names = list(tensors or default_tensors)
        if target == "local" and PINNED in names and not tensors:
            names.remove(PINNED)  # MaxText keeps it on the device unless offloaded: two choices, one program
        space = {"layout": "tensors", "tensors": names, "choices": list(LOCATIONS if target != "local" else LOCATIONS[:2])}
    default_trials = TENSOR_TRIALS if tensors is not None else len(MAXTEXT_PRESETS)
    data: dict[str, Any] = {
        "study": study or "maxtext-" + re.sub(r"[^A-Za-z0-9_-]+", "-", str(named)).strip("-"),
        "workload": workload, "space": space, "target": target,
        # every preset; with configurations to search, six more candidates beside them
        "trials": trials or default_trials + (6 if batches or meshes else 0), **({"budget": budget} if budget else {}),
        **({"storage": storage} if storage else {}), **({"workers": workers} if workers else {}),
    }
    try:
        spec = parse_spec(data)
        read = maxtext_config(spec.workload)  # type: ignore[arg-type]  # MaxText's refusal, before anything is written
        if tensors is not None and (point := config_point(read, space)) is not None:
            data["space"] = {**space, "points": [point]}  # the user's own policy, measured first
            spec = parse_spec(data)
        if batches or meshes:
            if batches:
                configuration: dict[str, Any] = {"batch": list(batches), "mesh": mesh}
            elif chips is not None:
                configuration = _config_global_batch(float(read.per_device_batch_size), chips, mesh)
            elif float(read.per_device_batch_size).is_integer():
                configuration = {"batch": [int(read.per_device_batch_size)], "mesh": mesh}
            else:
                raise SpecError(f"--batch: the config's per_device_batch_size is {read.per_device_batch_size}; "
                                "give --batch N (whole examples)")
            spec = parse_spec({**data, "configuration": configuration})
    except SpecError as e:
        raise as_flags(e) from None
    return spec


def config_point(read: Any, space: dict[str, Any]) -> dict[str, Any] | None:
    """The remat policy of MaxText's config ``read`` as a point of the ``tensors`` ``space``
    (``space.points``: the study measures it first, so the answer is set against it): a
    ``custom`` policy, or a preset that saves names (``plans.export.MAXTEXT_PRESETS``). None where
    the space cannot state it (``full`` is a preset of the space already; a tensor kept or
    offloaded outside the space's names, or offloaded where it has no host memory; ``minimal``)."""
    from remat_search.plans.export import MAXTEXT_NAMES, MAXTEXT_PRESETS, PINNED

    policy = str(read.remat_policy)
    if policy == "custom":
        where = {name: str(getattr(read, name, "remat")).split(".")[-1].lower() for name in MAXTEXT_NAMES}
    elif MAXTEXT_PRESETS.get(policy) is not None:
        where = {name: "device" if name in MAXTEXT_PRESETS[policy] else "remat" for name in MAXTEXT_NAMES}
    else:
        return None
    outside = {name for name, at in where.items() if name not in space["tensors"] and at != "remat"}
    if outside - {PINNED} or where.get(PINNED) == "offload" and PINNED not in space["tensors"]:
        return None
    inside = {name: where[name] for name in space["tensors"]}
    if set(inside.values()) - set(space["choices"]):  # the locations maxtext_study gave the space
        return None
    return {"label": f"config_{policy}", "per_name": {
        "device": [n for n, at in inside.items() if at == "device"], "offload": [n for n, at in inside.items() if at == "offload"]}}


_FLAGS = {
    "spec.workload: MaxText refuses the settings": "KEY=VALUE: MaxText refuses them", "spec.budget": "--budget",
    "spec.trials": "--trials", "spec.storage": "--storage", "spec.workers": "--workers",
    "spec.configuration.batch": "--batch", "spec.configuration.mesh": "--mesh", "spec.space.tensors": "--tensors",
    "spec.space: tensors": "--tensors",
}
"""The fields of the spec :func:`maxtext_study` builds, by the argument that set each."""


def as_flags(error: SpecError) -> SpecError:
    """``error`` of the spec :func:`maxtext_study` built, naming the argument the user gave
    (``--budget: ...``) instead of a spec field they never wrote."""
    text = str(error)
    field = next((f for f in _FLAGS if text.startswith(f)), None)
    return SpecError(_FLAGS[field] + text[len(field):]) if field else error


def _config_global_batch(per_device: float, chips: int, mesh: Any) -> dict[str, Any]:
    """The configurations of ``--mesh`` without ``--batch`` on a topology of ``chips``: the
    config's own global batch (MaxText's ``per_device_batch_size`` counts every chip) kept in
    every candidate, each mesh's batch per data-parallel device that makes it up in one step
    first, then the smaller micro-batches that make it up by accumulation. Without it, a mesh
    with a ``tensor`` axis would train a smaller global batch than the config."""
    from remat_search.plans.configuration import BATCH_AXES

    examples = per_device * chips
    if not examples.is_integer():
        raise SpecError(f"--batch: the config's per_device_batch_size {per_device} × {chips} chips is no whole "
                        "global batch; give --batch N (examples per data-parallel device)")
    ways = ([math.prod(size for axis, size in m.items() if axis in BATCH_AXES) for m in mesh] if mesh != "all"
            else [d for d in range(1, chips + 1) if chips % d == 0])
    batches = sorted({int(examples) // w for w in ways if examples % w == 0}, reverse=True)
    return {"batch": batches or [1], "global_batch": int(examples), "mesh": mesh}


def _mesh(text: str) -> dict[str, int]:
    """``--mesh fsdp=2,tensor=2`` as a mesh."""
    parts = [p.split("=", 1) for p in text.split(",") if p]
    if not parts or any(len(p) != 2 or not p[1].isdigit() or int(p[1]) < 1 for p in parts):
        raise SpecError(f"--mesh: expected AXIS=N,AXIS=N (such as fsdp=2,tensor=2) or all, got {text!r}")
    return {axis: int(n) for axis, n in parts}
