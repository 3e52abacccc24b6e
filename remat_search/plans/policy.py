"""Policies: what one layer saves for the backward pass, each kind defined once.

A policy kind is one :class:`PolicyKind` in :data:`POLICIES`: its name, which of a
:class:`LayerPolicy`'s fields it takes and how a spec writes them, whether it moves tensors
to host memory (GPU/TPU only), and how it becomes a ``jax.checkpoint`` policy. Adding a kind
is one :func:`register_policy` call here: specs, plans and the search read this table, and
``tests/test_policies.py`` runs every kind in it. :class:`LayerPolicy` is one layer's choice:
a kind and, for kinds that take them, tensor names or a function's import path.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from remat_search.errors import WorkloadError
from remat_search.imports import import_object

JaxPolicy = Callable[..., Any]
MaxTextForm = Literal["full"] | tuple[frozenset[str], frozenset[str]]
"""MaxText's form of a layer: ``"full"``, or (names kept on the device, names offloaded)."""
IMPORT_PATH = r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"
OPTIONAL_FIELDS = ("names", "offload", "function")
"""The :class:`LayerPolicy` fields a kind may take (``kind`` aside)."""


@dataclass(frozen=True)
class PolicyKind:
    """One kind of policy and how it becomes a ``jax.checkpoint`` policy."""

    name: str
    description: str
    jax_policy: Callable[[LayerPolicy], JaxPolicy | None]
    """The ``jax.checkpoint`` policy of a layer's :class:`LayerPolicy` (None: no checkpoint at all)."""
    takes_names: bool = False
    """Written in a spec as ``{label: ..., <name>: [tensor names]}`` instead of a bare word."""
    host_memory: bool = False
    """Moves tensors to pinned host memory: only GPUs and TPUs have it."""
    checkpoints: bool = True
    """Whether the layer is wrapped in ``jax.checkpoint`` at all (``none`` is not)."""
    fields: tuple[str, ...] = ()
    """The optional :class:`LayerPolicy` fields it takes (``names`` for ``takes_names``), at
    least one of them set; the others must stay empty."""
    from_spec: Callable[[Any], dict[str, Any]] | None = None
    """For a kind written ``{label: ..., <name>: VALUE}`` with a VALUE other than a list of
    names: VALUE to the policy's fields (a :class:`ValueError` saying what was expected)."""
    form: str = "[...]"
    """What VALUE looks like, for messages."""
    maxtext: Callable[[LayerPolicy], MaxTextForm] | None = None
    """MaxText's form of a layer of this kind (``plans.export``): ``"full"`` (its ``remat_policy:
    full``), or the tensor names kept on the device and those offloaded (``remat_policy: custom``,
    every other name recomputed). None: MaxText's config cannot say it (:attr:`no_maxtext` says why)."""
    no_maxtext: str = "has no MaxText custom form (it chooses by operation, not by MaxText's tensor names)"
    """Why MaxText's config has no form for this kind: the refusal's words after ``policy X``."""

    @property
    def uses(self) -> tuple[str, ...]:
        """The optional fields a policy of this kind takes."""
        return self.fields or (("names",) if self.takes_names else ())

    @property
    def labelled(self) -> bool:
        """Written as ``{label: ..., <name>: VALUE}`` (else as a bare word)."""
        return bool(self.uses)


POLICIES: dict[str, PolicyKind] = {}
"""Every policy kind by name, in the order specs and help texts list them."""


def register_policy(kind: PolicyKind) -> PolicyKind:
    """Add ``kind`` to :data:`POLICIES` (its name must be new)."""
    if kind.name in POLICIES:
        raise ValueError(f"policy kind {kind.name!r} is registered already")
    POLICIES[kind.name] = kind
    return kind


def _policies() -> Any:
    import jax  # deferred: reading plans and reports needs no JAX

    return jax.checkpoint_policies


register_policy(PolicyKind("none", "no checkpoint: every activation is saved", lambda p: None, checkpoints=False))
register_policy(PolicyKind(
    "full", "save nothing, recompute the layer", lambda p: _policies().nothing_saveable, maxtext=lambda p: "full",
))
register_policy(PolicyKind("dots", "save matrix-multiply outputs", lambda p: _policies().dots_saveable))
register_policy(PolicyKind(
    "dots_no_batch", "save matrix-multiply outputs without batch dimensions",
    lambda p: _policies().dots_with_no_batch_dims_saveable,
))
register_policy(PolicyKind(
    "names", "save only the tensors named with checkpoint_name",
    lambda p: _policies().save_only_these_names(*p.names), takes_names=True,
    maxtext=lambda p: (frozenset(p.names), frozenset()),
))
register_policy(PolicyKind(
    "names_except", "save every tensor named with checkpoint_name but these",
    lambda p: _policies().save_any_names_but_these(*p.names), takes_names=True,
))
register_policy(PolicyKind(
    "dots_no_batch_names", "save matrix-multiply outputs without batch dimensions, and the named tensors",
    lambda p: _policies().save_from_both_policies(
        _policies().dots_with_no_batch_dims_saveable, _policies().save_only_these_names(*p.names)
    ),
    takes_names=True,
))
register_policy(PolicyKind(
    "offload", "move the named tensors to pinned host memory (GPU/TPU only)",
    lambda p: _policies().save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(p.names),
        offload_src="device", offload_dst="pinned_host",
    ),
    takes_names=True, host_memory=True, maxtext=lambda p: (frozenset(), frozenset(p.names)),
))


def _per_name(value: Any) -> dict[str, Any]:
    """``{device: [...], offload: [...]}`` (either may be left out) to ``names`` and ``offload``."""
    if not isinstance(value, dict) or not value or set(value) - {"device", "offload"} or not all(
        isinstance(v, list) for v in value.values()
    ):
        raise ValueError(
            "per_name must map device and/or offload to lists of tensor names "
            f"(every other tensor is recomputed), got {value!r}"
        )
    return {"names": value.get("device", []), "offload": value.get("offload", [])}


def _function(value: Any) -> dict[str, Any]:
    if not isinstance(value, str):
        raise ValueError(f"function must be an import path 'package.module:function', got {value!r}")  # noqa: TRY004 - pydantic reports ValueErrors
    return {"function": value}


register_policy(PolicyKind(
    "per_name", "for each named tensor: keep it on the device, offload it to pinned host memory, or "
    "(unlisted) recompute it, as MaxText's remat_policy: custom",
    lambda p: _policies().save_and_offload_only_these_names(
        names_which_can_be_saved=list(p.names), names_which_can_be_offloaded=list(p.offload),
        offload_src="device", offload_dst="pinned_host",
    ),
    fields=("names", "offload"), from_spec=_per_name, form="{device: [...], offload: [...]}",
    maxtext=lambda p: (frozenset(p.names), frozenset(p.offload)),
))
register_policy(PolicyKind(
    "function", "a jax.checkpoint policy function of your own, (prim, *avals, **params) -> bool, by import path",
    lambda p: import_function(p.function or "", "policy.function"),
    fields=("function",), from_spec=_function, form="'package.module:function'",
    no_maxtext="is a function of your own, which MaxText's config cannot name (it has device/offload/remat per tensor name)",
))


class LayerPolicy(BaseModel):
    """What one layer saves: a registered kind (:data:`POLICIES`) and what that kind takes:
    tensor ``names`` (sorted, deduplicated; ``per_name``'s are kept on the device), ``per_name``'s
    ``offload`` names, or a ``function``'s import path.

    ``offload`` and ``function`` are left out of the JSON when empty, so the plans written
    before they existed keep their text and digest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    names: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    function: str | None = None

    @field_validator("kind")
    @classmethod
    def _registered(cls, kind: str) -> str:
        if kind not in POLICIES:
            raise ValueError(f"unknown policy kind {kind!r}; expected one of {', '.join(POLICIES)}")
        return kind

    @field_validator("names", "offload")
    @classmethod
    def _canonical_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(names)))

    @field_validator("function")
    @classmethod
    def _import_path(cls, function: str | None) -> str | None:
        if function is not None and not re.fullmatch(IMPORT_PATH, function):
            raise ValueError(f"expected an import path 'package.module:function', got {function!r}")
        return function

    @model_validator(mode="after")
    def _fields_match_kind(self) -> LayerPolicy:
        kind = POLICIES[self.kind]
        extra = [f for f in OPTIONAL_FIELDS if getattr(self, f) and f not in kind.uses]
        if extra == ["names"]:
            raise ValueError(f"policy {self.kind!r} takes no tensor names, got {list(self.names)}")
        if extra:
            raise ValueError(f"policy {self.kind!r} takes no {' or '.join(extra)}")
        if kind.uses and not any(getattr(self, f) for f in kind.uses):
            needs = "at least one tensor name" if "names" in kind.uses else f"a {kind.uses[0]}"
            raise ValueError(f"policy {self.kind!r} needs {needs}")
        both = sorted(set(self.names) & set(self.offload))
        if both:
            raise ValueError(f"{both} are both kept on the device and offloaded; name each once")
        return self

    @model_serializer(mode="wrap")
    def _omit_new_defaults(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        data = handler(self)
        for field in ("offload", "function"):
            if not getattr(self, field):
                data.pop(field, None)
        return data

    @property
    def checkpoints(self) -> bool:
        """Whether the layer is wrapped in ``jax.checkpoint`` at all (every kind but ``none``)."""
        return POLICIES[self.kind].checkpoints

    @property
    def host_memory(self) -> bool:
        """Whether it moves tensors to pinned host memory (only GPUs and TPUs have it)."""
        return POLICIES[self.kind].host_memory or bool(self.offload)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Every tensor name it refers to: kept on the device or offloaded."""
        return tuple(sorted({*self.names, *self.offload}))

    def __str__(self) -> str:
        if self.function:
            return f"{self.kind}({self.function})"
        if self.offload:
            return f"{self.kind}({','.join(self.names)}{'; ' if self.names else ''}offload {','.join(self.offload)})"
        return f"{self.kind}({','.join(self.names)})" if self.names else self.kind


def checkpoint_policy(policy: LayerPolicy) -> JaxPolicy | None:
    """The ``jax.checkpoint_policies`` function of ``policy`` (None for ``none``)."""
    return POLICIES[policy.kind].jax_policy(policy)


def import_function(path: str, where: str) -> JaxPolicy:
    """The policy function at ``path``; a one-line :class:`~remat_search.errors.WorkloadError`
    naming ``where`` (the spec field) when it does not import or is not callable."""
    function = import_object(path, where, what="function")
    if not callable(function):
        raise WorkloadError(
            f"{where}: {path!r} is a {type(function).__name__}, not a jax.checkpoint policy function "
            "(prim, *avals, **params) -> bool"
        )
    return function
