"""A remat plan: which activations each layer saves for the backward pass.

A :class:`RematPlan` is pure data — frozen, hashable, JSON-serialisable — so it can be
stored in a study, printed, compared and used as a cache key. This module is also the one
place where a policy becomes a ``jax.checkpoint`` policy (:func:`checkpoint_policy`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from remat_search.errors import SpecError

PolicyKind = Literal["none", "full", "dots", "dots_no_batch", "names", "offload"]
NAMED_KINDS = ("names", "offload")
F = TypeVar("F", bound=Callable[..., Any])


class LayerPolicy(BaseModel):
    """What one layer saves.

    ``none`` applies no checkpoint (everything saved), ``full`` saves nothing and recomputes
    the layer, ``dots`` saves matrix-multiply outputs, ``dots_no_batch`` those without batch
    dimensions, ``names`` saves only the tensors named with ``checkpoint_name``, and
    ``offload`` moves the named tensors to pinned host memory (GPU/TPU only).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: PolicyKind
    names: tuple[str, ...] = ()

    @field_validator("names")
    @classmethod
    def _canonical_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(names)))

    @model_validator(mode="after")
    def _names_match_kind(self) -> LayerPolicy:
        if self.kind in NAMED_KINDS and not self.names:
            raise ValueError(f"policy {self.kind!r} needs at least one tensor name")
        if self.kind not in NAMED_KINDS and self.names:
            raise ValueError(f"policy {self.kind!r} takes no tensor names, got {list(self.names)}")
        return self

    def __str__(self) -> str:
        return f"{self.kind}({','.join(self.names)})" if self.names else self.kind


class RematPlan(BaseModel):
    """One :class:`LayerPolicy` per layer of a workload, layer 0 first."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[LayerPolicy, ...] = Field(min_length=1)

    @classmethod
    def uniform(cls, policy: LayerPolicy | PolicyKind, layers: int) -> RematPlan:
        """The plan that gives every one of ``layers`` layers the same policy."""
        if isinstance(policy, str):
            policy = LayerPolicy(kind=policy)
        return cls(layers=(policy,) * layers)

    @classmethod
    def from_json(cls, text: str) -> RematPlan:
        """Load a plan written by :meth:`to_json` (or ``remat-search best --json``)."""
        try:
            return cls.model_validate_json(text)
        except ValueError as e:
            raise SpecError(f"plan: not a remat plan ({_first_error(e)})") from None

    def to_json(self) -> str:
        """Canonical JSON: the same plan always gives the same text."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """A stable hash of the canonical JSON (16 hex digits), usable as a cache key."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @property
    def tensor_names(self) -> frozenset[str]:
        """Every tensor name any layer's policy refers to."""
        return frozenset(n for p in self.layers for n in p.names)

    def summary(self, labels: Iterable[str] | None = None) -> str:
        """A short human form, runs of equal layers collapsed: ``full×2 dots×6``.

        ``labels``, one per layer (the spec's choice labels), replace the policies' own text.
        """
        return collapse_runs(labels if labels is not None else (str(p) for p in self.layers))

    def check(self, *, layers: int, tensor_names: Iterable[str]) -> None:
        """Raise :class:`SpecError` unless the plan fits a workload of this shape."""
        if len(self.layers) != layers:
            raise SpecError(f"plan: has {len(self.layers)} layers, the workload has {layers}")
        unknown = sorted(self.tensor_names - set(tensor_names))
        if unknown:
            raise SpecError(
                f"plan: unknown tensor name(s) {unknown}; the workload names "
                f"{sorted(tensor_names)}"
            )

    def policy_for(self, layer: int) -> Callable[..., Any] | None:
        """The ``jax.checkpoint`` policy of ``layer``, or None when it is not checkpointed."""
        return checkpoint_policy(self.layers[layer])

    def wrap(self, fn: F, layer: int, *, prevent_cse: bool = True) -> F:
        """Return ``fn`` checkpointed with the policy of ``layer`` (``fn`` itself for ``none``)."""
        if self.layers[layer].kind == "none":
            return fn
        import jax

        return jax.checkpoint(fn, policy=self.policy_for(layer), prevent_cse=prevent_cse)

    def remat_module(self, module_cls: type, layer: int, **remat_kwargs: Any) -> type:
        """Return a Flax linen module class wrapped with ``nn.remat`` for ``layer``."""
        if self.layers[layer].kind == "none":
            return module_cls
        import flax.linen as nn

        return nn.remat(module_cls, policy=self.policy_for(layer), **remat_kwargs)


def collapse_runs(items: Iterable[str]) -> str:
    """``a a b a`` → ``a×2 b a``."""
    runs: list[list[Any]] = []
    for item in items:
        if runs and runs[-1][0] == item:
            runs[-1][1] += 1
        else:
            runs.append([item, 1])
    return " ".join(f"{item}×{n}" if n > 1 else item for item, n in runs)


def checkpoint_policy(policy: LayerPolicy) -> Callable[..., Any] | None:
    """Translate a :class:`LayerPolicy` to a ``jax.checkpoint_policies`` function."""
    import jax  # deferred: reading plans and reports needs no JAX

    cp = jax.checkpoint_policies
    if policy.kind == "none":
        return None
    if policy.kind == "full":
        return cp.nothing_saveable
    if policy.kind == "dots":
        return cp.dots_saveable
    if policy.kind == "dots_no_batch":
        return cp.dots_with_no_batch_dims_saveable
    if policy.kind == "names":
        return cp.save_only_these_names(*policy.names)
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(policy.names),
        offload_src="device",
        offload_dst="pinned_host",
    )


def _first_error(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(e).splitlines()[0]
