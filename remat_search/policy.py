"""Policies: what one layer saves for the backward pass, each kind defined once.

A policy kind is one :class:`PolicyKind` in :data:`POLICIES`: its name, whether it takes
tensor names, whether it moves tensors to host memory (GPU/TPU only), and how it becomes a
``jax.checkpoint`` policy. Adding a kind is one :func:`register_policy` call here: specs,
plans and the search read this table, and ``tests/test_policies.py`` runs every kind in it.
:class:`LayerPolicy` is one layer's choice: a kind and, for kinds that take them, names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

JaxPolicy = Callable[..., Any]


@dataclass(frozen=True)
class PolicyKind:
    """One kind of policy and how it becomes a ``jax.checkpoint`` policy."""

    name: str
    description: str
    jax_policy: Callable[[tuple[str, ...]], JaxPolicy | None]
    """The ``jax.checkpoint`` policy for the given tensor names (None: no checkpoint at all)."""
    takes_names: bool = False
    """Written in a spec as ``{label: ..., <name>: [tensor names]}`` instead of a bare word."""
    host_memory: bool = False
    """Moves tensors to pinned host memory: only GPUs and TPUs have it."""
    checkpoints: bool = True
    """Whether the layer is wrapped in ``jax.checkpoint`` at all (``none`` is not)."""


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


register_policy(PolicyKind("none", "no checkpoint: every activation is saved", lambda names: None, checkpoints=False))
register_policy(PolicyKind("full", "save nothing, recompute the layer", lambda names: _policies().nothing_saveable))
register_policy(PolicyKind("dots", "save matrix-multiply outputs", lambda names: _policies().dots_saveable))
register_policy(PolicyKind(
    "dots_no_batch", "save matrix-multiply outputs without batch dimensions",
    lambda names: _policies().dots_with_no_batch_dims_saveable,
))
register_policy(PolicyKind(
    "names", "save only the tensors named with checkpoint_name",
    lambda names: _policies().save_only_these_names(*names), takes_names=True,
))
register_policy(PolicyKind(
    "names_except", "save every tensor named with checkpoint_name but these",
    lambda names: _policies().save_any_names_but_these(*names), takes_names=True,
))
register_policy(PolicyKind(
    "dots_no_batch_names", "save matrix-multiply outputs without batch dimensions, and the named tensors",
    lambda names: _policies().save_from_both_policies(
        _policies().dots_with_no_batch_dims_saveable, _policies().save_only_these_names(*names)
    ),
    takes_names=True,
))
register_policy(PolicyKind(
    "offload", "move the named tensors to pinned host memory (GPU/TPU only)",
    lambda names: _policies().save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host",
    ),
    takes_names=True, host_memory=True,
))


class LayerPolicy(BaseModel):
    """What one layer saves: a registered kind (:data:`POLICIES`) and, for ``names`` and
    ``offload``, the tensors it keeps (sorted, deduplicated)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    names: tuple[str, ...] = ()

    @field_validator("kind")
    @classmethod
    def _registered(cls, kind: str) -> str:
        if kind not in POLICIES:
            raise ValueError(f"unknown policy kind {kind!r}; expected one of {', '.join(POLICIES)}")
        return kind

    @field_validator("names")
    @classmethod
    def _canonical_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(names)))

    @model_validator(mode="after")
    def _names_match_kind(self) -> LayerPolicy:
        takes_names = POLICIES[self.kind].takes_names
        if takes_names and not self.names:
            raise ValueError(f"policy {self.kind!r} needs at least one tensor name")
        if not takes_names and self.names:
            raise ValueError(f"policy {self.kind!r} takes no tensor names, got {list(self.names)}")
        return self

    @property
    def checkpoints(self) -> bool:
        """Whether the layer is wrapped in ``jax.checkpoint`` at all (every kind but ``none``)."""
        return POLICIES[self.kind].checkpoints

    def __str__(self) -> str:
        return f"{self.kind}({','.join(self.names)})" if self.names else self.kind


def checkpoint_policy(policy: LayerPolicy) -> JaxPolicy | None:
    """The ``jax.checkpoint_policies`` function of ``policy`` (None for ``none``)."""
    return POLICIES[policy.kind].jax_policy(policy.names)
