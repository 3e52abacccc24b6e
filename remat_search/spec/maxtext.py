"""MaxText's own config loader for a ``kind: maxtext`` workload (:mod:`workloads.maxtext`): the
spec's model and overrides, with a candidate's settings laid over them, read by MaxText's
``pyconfig.initialize``, which checks every key and value. The search calls it to check a spec
before anything is written; the worker, to build each candidate."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from remat_search.errors import SpecError
from remat_search.spec.workloads import MaxTextConfig
from remat_search.targets.platform import quiet_libtpu

if TYPE_CHECKING:
    from remat_search.spec.models import SearchSpec

_READ: dict[str, Any] = {}
"""The spec's own config, by the workload's JSON (:func:`maxtext_config`)."""
INSTALL = "pip install 'remat-search[maxtext]' (MaxText needs Python ≥ 3.12)"


def installed() -> bool:
    """Whether MaxText can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("maxtext") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module left half-imported
        return False


def maxtext_config(config: MaxTextConfig, settings: dict[str, Any] | None = None, **more: Any) -> Any:
    """MaxText's config (``pyconfig.initialize``, MaxText's own loader) of the spec's workload with
    ``settings`` (a candidate's) laid over its overrides: a one-line :class:`SpecError` quoting
    MaxText's reason where it refuses a key or a value. The spec's own (no ``settings``, nothing
    ``more``) is read once a process: the search reads it to check the spec, to count an
    example's tokens and to list the mesh axes."""
    if not settings and not more and config.model_dump_json() in _READ:
        return _READ[config.model_dump_json()]
    if not installed():
        raise SpecError(f"spec.workload: kind maxtext needs MaxText; install it with: {INSTALL}")
    # MaxText imports transformers, which warns of its own model configs at import: not ours to say.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with quiet_libtpu():  # MaxText's loader starts JAX's backends: libtpu, where installed, loads
        from maxtext.trainers.pre_train import train  # noqa: F401 - before pyconfig: MaxText's import order
        from maxtext.configs import pyconfig

        base = config.config or os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
        # Where MaxText would write a run's outputs (it warns where none is given); compiling writes nothing there.
        # No JAX compilation cache of MaxText's (its base.yml's ~/jax_cache): the spec's compilation_cache
        # says where one is. No jax.distributed join: remat-search's worker compiles alone.
        keys = {"base_output_directory": os.path.join(tempfile.gettempdir(), "remat-search-maxtext"), "jax_cache_dir": "",
                **config.model_keys(), **(settings or {}), **more, "skip_jax_distributed_system": True}
        # MaxText logs a refusal (in banner lines, a warning per unknown key) before raising it
        loggers = [logging.getLogger(name) for name in ("absl", "maxtext")]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
        try:
            read = pyconfig.initialize(["remat-search", base], **keys)
        except Exception as e:  # noqa: BLE001 - MaxText's own refusal, told in one line
            raise SpecError(f"spec.workload: MaxText refuses the settings: {refusal(e)}") from None
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)
    if not settings and not more:
        _READ[config.model_dump_json()] = read
    return read


def refusal(error: BaseException) -> str:
    """MaxText's reason in one line: a pydantic error's fields and messages, else the first line."""
    errors = getattr(error, "errors", None)
    if type(error).__name__ == "ValidationError" and callable(errors):
        message = "; ".join(
            (f"{'.'.join(map(str, e['loc']))}: " if e.get("loc") else "") + str(e["msg"]) for e in errors()
        )
    else:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        message = lines[0] if lines else type(error).__name__
    return message if len(message) <= 300 else message[:297] + "..."


def maxtext_study(
    arguments: Sequence[str], *, budget: str | None = None, trials: int | None = None, study: str | None = None,
    storage: str | None = None, workers: str | None = None, batches: Sequence[int] = (),
    meshes: Sequence[str] = (),
) -> SearchSpec:
    """The study of a MaxText command line, ``[CONFIG.yml] KEY=VALUE ...`` as MaxText's ``train``
    and ``train_compile`` take them: MaxText's own train step of that config and those settings
    (read by MaxText's loader, which refuses a key or value in one line), searched over MaxText's
    remat presets (``space: maxtext``), with no spec file to write.

    ``compile_topology=v5e-4`` (``train_compile``'s own key) makes the target that TPU topology,
    compiled ahead of time; without it, the local devices. ``batches`` (per-device batch sizes)
    and ``meshes`` (``fsdp=2,tensor=2``, or ``all``) search configurations beside the policy;
    ``trials`` defaults to the presets (and six more where configurations are searched). An
    error names the argument that set the field (:func:`as_flags`)."""
    from remat_search.plans.export import MAXTEXT_PRESETS
    from remat_search.spec.loading import parse_spec

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
    from omegaconf import OmegaConf  # MaxText's own reading of key=value arguments (pyconfig: OmegaConf.from_cli)

    overrides: dict[str, Any] = OmegaConf.to_container(OmegaConf.from_cli(keys))  # type: ignore[assignment]
    topology, slices = overrides.pop("compile_topology", None), overrides.pop("compile_topology_num_slices", 1)
    target: Any = "local"
    if topology:
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
    named = overrides.get("model_name") or (os.path.splitext(os.path.basename(config))[0] if config else "base")
    workload = {"kind": "maxtext", **({"config": os.path.expanduser(config)} if config else {}), "overrides": overrides}
    data: dict[str, Any] = {
        "study": study or "maxtext-" + re.sub(r"[^A-Za-z0-9_-]+", "-", str(named)).strip("-"),
        "workload": workload, "space": "maxtext", "target": target,
        # every preset; with configurations to search, six more candidates beside them
        "trials": trials or len(MAXTEXT_PRESETS) + (6 if batches or meshes else 0), **({"budget": budget} if budget else {}),
        **({"storage": storage} if storage else {}), **({"workers": workers} if workers else {}),
    }
    try:
        spec = parse_spec(data)
        read = maxtext_config(spec.workload)  # type: ignore[arg-type]  # MaxText's refusal, before anything is written
        if batches or meshes:
            if not batches:
                if not float(read.per_device_batch_size).is_integer():
                    raise SpecError(f"--batch: the config's per_device_batch_size is {read.per_device_batch_size}; "
                                    "give --batch N (whole examples)")
                batches = (int(read.per_device_batch_size),)
            spec = parse_spec({**data, "configuration": {"batch": list(batches), "mesh": mesh}})
    except SpecError as e:
        raise as_flags(e) from None
    return spec


_FLAGS = {
    "spec.workload: MaxText refuses the settings": "KEY=VALUE: MaxText refuses them", "spec.budget": "--budget",
    "spec.trials": "--trials", "spec.storage": "--storage", "spec.workers": "--workers",
    "spec.configuration.batch": "--batch", "spec.configuration.mesh": "--mesh",
}
"""The fields of the spec :func:`maxtext_study` builds, by the argument that set each."""


def as_flags(error: SpecError) -> SpecError:
    """``error`` of the spec :func:`maxtext_study` built, naming the argument the user gave
    (``--budget: ...``) instead of a spec field they never wrote."""
    text = str(error)
    field = next((f for f in _FLAGS if text.startswith(f)), None)
    return SpecError(_FLAGS[field] + text[len(field):]) if field else error


def _mesh(text: str) -> dict[str, int]:
    """``--mesh fsdp=2,tensor=2`` as a mesh."""
    parts = [p.split("=", 1) for p in text.split(",") if p]
    if not parts or any(len(p) != 2 or not p[1].isdigit() or int(p[1]) < 1 for p in parts):
        raise SpecError(f"--mesh: expected AXIS=N,AXIS=N (such as fsdp=2,tensor=2) or all, got {text!r}")
    return {axis: int(n) for axis, n in parts}
