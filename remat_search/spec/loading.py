"""Loading a spec: YAML in, a checked :class:`~remat_search.spec.models.SearchSpec` out, and every
problem as one line naming the field (:class:`~remat_search.errors.SpecError`)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    Tag,
    ValidationError,
)

from remat_search.errors import SpecError
from remat_search.spec.models import SearchSpec
from remat_search.store.location import STORAGE_ENV


def load_spec(
    path: str | os.PathLike[str], *, storage: str | None = None, workers: int | str | None = None
) -> SearchSpec:
    """Read and check a YAML spec; ``storage`` (from ``--storage`` or the environment) and
    ``workers`` (``--workers``) win over the spec's."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SpecError(f"spec: cannot read {str(path)!r} ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise SpecError(f"spec: {str(path)!r} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(f"spec: {str(path)!r} must be a YAML mapping of fields, got {type(data).__name__}")
    workload = data.get("workload")
    if isinstance(workload, dict):  # the paths a workload names are relative to the spec's folder
        paths = ("params_from", "config") if workload.get("kind") == "maxtext" else ("params_from",)
        relative = {k: str(path.parent / os.path.expanduser(v)) for k, v in workload.items() if k in paths and isinstance(v, str)}
        data["workload"] = {**workload, **relative}
    storage = storage or os.environ.get(STORAGE_ENV)
    if storage:
        data["storage"] = storage
    if workers is not None:
        data["workers"] = workers
    return parse_spec(data)


def parse_spec(data: dict[str, Any]) -> SearchSpec:
    """Validate a spec given as a mapping, with the same one-line errors as :func:`load_spec`."""
    try:
        return SearchSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(describe_validation_error(e, prefix="spec", model=SearchSpec)) from None


def describe_validation_error(
    e: ValidationError, *, prefix: str, model: type[BaseModel] | None = None
) -> str:
    """One line for a pydantic error: the first field's path, message and bad value.

    An unknown key comes first, with the nearest field of ``model`` at its level if one is
    near (a misspelled key also makes the field it meant "missing": that error is its echo)."""
    errors = e.errors(include_url=False)
    hints: dict[tuple, str] = {}  # unknown key's location → the hint
    meant = set()  # locations of the fields the unknown keys stand for
    for err in errors:
        if err["type"] == "extra_forbidden" and model is not None:
            *parent, key = err["loc"]
            known = _keys_at(model, parent)
            near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hints[err["loc"]] = (
                f"; did you mean {near[0]!r}?" if near else f"; expected one of: {', '.join(known)}" if known else ""
            )
            meant.update((*parent, n) for n in near)
    # A misspelled key also makes the field it meant "missing": the same mistake, told once.
    errors = [err for err in errors if not (err["type"] == "missing" and err["loc"] in meant)]
    first = next((err for err in errors if err["type"] == "extra_forbidden"), errors[0])
    hint = hints.get(first["loc"], "")
    # Errors on an ancestor of the first field are consequences of it (e.g. an empty list).
    others = [err for err in errors if err is not first and err["loc"] != first["loc"][: len(err["loc"])]]
    loc = ".".join(
        str(p) if str(p).isprintable() else repr(str(p))  # a key "a\nb" must not break the line
        for i, p in enumerate(first["loc"])
        if not (i == 1 and first["loc"][0] in ("workload", "target") and p in _TAGS)
        and not str(p).startswith("function-")
    )
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key" + hint
    elif first["type"] == "missing":
        message = "required field missing"
    elif "input" in first and not isinstance(first["input"], (dict, list)) and "got" not in message and repr(first["input"]) not in message:
        message += f" (got {first['input']!r})"
    more = f" (and {len(others)} more)" if others else ""
    return f"{prefix}.{loc}: {message}{more}" if loc else f"{prefix}: {message}{more}"


def _keys_at(model: type[BaseModel], path: list[Any]) -> list[str]:
    """The field names of the model(s) found at ``path`` (an error's location) under ``model``:
    a field name goes into its type, a list index stays, a union's tag (``transformer``)
    picks that member."""
    models: list[tuple[str | None, type[BaseModel]]] = [(None, model)]
    for part in path:
        tagged = [(tag, m) for tag, m in models if tag == part]
        if tagged or isinstance(part, int):
            models = tagged or models
            continue
        models = [tm for _, m in models if part in m.model_fields for tm in _models_in(m.model_fields[part].annotation)]
    return list(dict.fromkeys(name for _, m in models for name in m.model_fields))


def _models_in(annotation: Any, tag: str | None = None) -> list[tuple[str | None, type[BaseModel]]]:
    """The pydantic models inside a type (``X | None``, ``tuple[X, ...]``, a tagged union), with their tags."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(tag, annotation)]
    args = get_args(annotation)
    if get_origin(annotation) is Annotated:
        tag = next((m.tag for m in args[1:] if isinstance(m, Tag)), tag)
        args = args[:1]
    return [found for arg in args for found in _models_in(arg, tag)]


_TAGS = ("transformer", "mlp", "nnx", "linen", "factory", "tpu", "local")
