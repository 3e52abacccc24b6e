"""MaxText's own config loader for a ``kind: maxtext`` workload (:mod:`workloads.maxtext`): the
spec's model and overrides, with a candidate's settings laid over them, read by MaxText's
``pyconfig.initialize``, which checks every key and value. The search calls it to check a spec
before anything is written; the worker, to build each candidate."""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from typing import Any

from remat_search.errors import SpecError
from remat_search.spec.workloads import MaxTextConfig
from remat_search.targets.platform import quiet_libtpu

_READ: dict[str, Any] = {}
"""The spec's own config, by the workload's JSON (:func:`maxtext_config`)."""
INSTALL = "pip install 'remat-search[maxtext]' (MaxText needs Python ≥ 3.12)"


def installed() -> bool:
    """Whether MaxText can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("maxtext") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module left half-imported
        return False


def before_import() -> None:
    """Where the user set neither, keep what MaxText's import would print out of our output: call
    before importing any of MaxText. It imports transformers, which warns of its own model configs
    at import; its package turns on XLA's INFO lines (``TF_CPP_MIN_LOG_LEVEL=0``: a TPU compile's
    PjRt lines in every search), where JAX's own default shows warnings and errors only."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


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
    before_import()
    with quiet_libtpu():  # MaxText's loader starts JAX's backends: libtpu, where installed, loads
        from maxtext.configs import pyconfig  # alone: its train module (13 s to import) is the worker's

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

