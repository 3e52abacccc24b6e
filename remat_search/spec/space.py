"""The space of plans a spec names (``spec.space``): the policy choices, each with its label,
and how they are laid over the layers (``uniform``, ``per_layer``, ``segments``) or over the
tensors (``tensors``, MaxText's ``remat_policy: custom``). Checked by pydantic as the rest of
the spec (:mod:`spec.models`); walked by a search as :class:`search.space.Space`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, ValidationInfo, field_validator, model_validator

from remat_search.plans.export import MAXTEXT_PRESETS
from remat_search.plans.policy import POLICIES, LayerPolicy
from remat_search.spec.fields import Frozen


class PolicyChoice(Frozen):
    """One policy the space may give a layer, with the label studies and reports use.

    Written in YAML as a bare policy (``full``), as ``{label: save_qkv, names: [...]}`` or
    ``{label: off_mlp, offload: [...]}``, as ``{label: mine, per_name: {device: [...],
    offload: [...]}}`` or as ``{label: save_softmax, function: "package.module:function"}``.
    """

    label: str = Field(pattern=r"^[A-Za-z0-9_.+-]+$")
    policy: LayerPolicy

    @model_validator(mode="before")
    @classmethod
    def _from_yaml(cls, value: Any) -> Any:
        bare = [k for k, p in POLICIES.items() if not p.labelled]
        labelled = {k: p for k, p in POLICIES.items() if p.labelled}
        if isinstance(value, str):
            if value not in bare:
                raise ValueError(
                    f"unknown policy {value!r}; expected one of {', '.join(bare)}, or "
                    + " or ".join(f"{{label: ..., {k}: {p.form}}}" for k, p in labelled.items())
                )
            return {"label": value, "policy": {"kind": value}}
        if isinstance(value, dict) and "policy" not in value:
            value = dict(value)
            kinds = [k for k in labelled if k in value]
            if len(kinds) != 1:
                raise ValueError(
                    "a labelled choice needs exactly one of " + " or ".join(f"{k}: {p.form}" for k, p in labelled.items())
                )
            kind = POLICIES[kinds[0]]
            written = value.pop(kind.name)
            if kind.from_spec is not None:
                return {**value, "policy": {"kind": kind.name, **kind.from_spec(written)}}
            if isinstance(written, str) or not isinstance(written, list):
                raise ValueError(f"{kind.name} must be a list of tensor names, got {written!r}")
            return {**value, "policy": {"kind": kind.name, "names": written}}
        return value


LOCATIONS = ("device", "remat", "offload")
"""Where a ``layout: tensors`` space may put each tensor: kept on the device, recomputed, or
offloaded to pinned host memory (GPU/TPU only): MaxText's words for ``remat_policy: custom``."""


def _location_choice(location: Any, tensors: list[str]) -> dict[str, Any]:
    """The choice of a ``layout: tensors`` space that puts every one of ``tensors`` at
    ``location`` (a word of :data:`LOCATIONS`, or that choice as a spec dumps it): its uniform
    plan, the preset the search queues first."""
    label = location.get("label") if isinstance(location, dict) else location
    if label not in LOCATIONS:
        raise ValueError(f"layout: tensors takes choices among {', '.join(LOCATIONS)}, got {location!r}")
    policy = {"device": {"kind": "per_name", "names": tensors}, "remat": {"kind": "full"},
              "offload": {"kind": "per_name", "offload": tensors}}[label]
    return {"label": label, "policy": policy}


class SpaceConfig(Frozen):
    """The plans a study may propose: a layout and a finite list of policy choices."""

    layout: Literal["uniform", "per_layer", "segments", "tensors"] = "per_layer"
    """``uniform``: one choice for all layers; ``per_layer``: one a layer; ``segments``: one
    for each contiguous group of layers given by ``segments``; ``tensors``: one for each tensor
    name of ``tensors``, its location (``choices`` among ``device``, ``remat``, ``offload``),
    every layer alike: MaxText's ``remat_policy: custom``."""
    tensors: tuple[str, ...] | None = None
    """With ``layout: tensors`` (and only then): the ``checkpoint_name`` tags to place. Each
    unlisted tag is recomputed, as MaxText's ``custom`` policy recomputes an unlisted name."""
    segments: PositiveInt | tuple[PositiveInt, ...] | None = Field(default=None, validate_default=True)
    """With ``layout: segments`` (and only then): N near-equal contiguous groups (earlier
    groups take the remainder), or the list of group sizes, which must sum to the layers."""
    nested: bool = False
    """Also search the nested layout (the JAX guide's recursive checkpointing): one more
    parameter, ``layout``, of ``flat`` or ``nested``."""
    choices: tuple[PolicyChoice, ...] = Field(min_length=1)
    points: tuple[PolicyChoice, ...] = ()
    """With ``layout: tensors`` (and only then): plans of the space to measure first, before the
    presets: today's policy, say (``{label: custom_offload, offload: [decoder_layer_input, ...]}``),
    so the study shows it beside what the search finds. Each is a policy MaxText's ``custom``
    form states (``full``, ``names``, ``offload``, ``per_name``) over :attr:`tensors`; every tensor
    it neither keeps nor offloads is recomputed."""

    @model_validator(mode="before")
    @classmethod
    def _maxtext(cls, value: Any) -> Any:
        """``space: maxtext``: one policy for every layer, of MaxText's presets that a policy
        states exactly (``plans.export.MAXTEXT_PRESETS``), so every answer pastes into MaxText.
        Another word is told in a line."""
        if isinstance(value, str):
            if value != "maxtext":
                raise ValueError(f"expected a mapping (layout, choices, ...) or maxtext, got {value!r}")
            return {"layout": "uniform", "choices": [
                label if names is None else {"label": label, "names": list(names)}
                for label, names in MAXTEXT_PRESETS.items()
            ]}
        return value

    @model_validator(mode="before")
    @classmethod
    def _tensors(cls, value: Any) -> Any:
        """``layout: tensors``: its locations (default all three) become the choices that put
        every tensor there, so the presets, the checks of names and of host memory read them as
        any space's; ``tensors`` is a list of distinct names, and only allowed with it."""
        if not isinstance(value, dict):
            return value
        if value.get("layout") != "tensors":
            if value.get("tensors") is not None:
                raise ValueError(f"tensors: only allowed with layout: tensors, not with layout: {value.get('layout', 'per_layer')}")
            return value
        if value.get("nested"):
            raise ValueError("nested: a layout: tensors plan is one policy for every layer, never nested")
        tensors = value.get("tensors")
        if not isinstance(tensors, (list, tuple)) or not tensors or not all(isinstance(t, str) and t for t in tensors):
            raise ValueError(f"tensors: expected a list of the checkpoint_name tags to place, got {tensors!r}")
        if len(set(tensors)) != len(tensors):
            raise ValueError(f"tensors: each name once, repeated: {sorted({t for t in tensors if tensors.count(t) > 1})}")
        choices = value.get("choices", list(LOCATIONS))
        if not isinstance(choices, (list, tuple)):
            raise ValueError(f"choices: expected a list among {', '.join(LOCATIONS)}, got {choices!r}")  # noqa: TRY004 - pydantic reports ValueErrors
        return {**value, "tensors": list(tensors), "choices": [_location_choice(c, list(tensors)) for c in choices]}

    @field_validator("segments", mode="before")
    @classmethod
    def _segments_iff_layout(cls, segments: Any, info: ValidationInfo) -> Any:
        layout = info.data.get("layout")
        if layout == "segments" and segments is None:
            raise ValueError("required with layout: segments (a number of groups or a list of sizes)")
        if layout is not None and layout != "segments" and segments is not None:
            raise ValueError(f"only allowed with layout: segments, not with layout: {layout}")
        sizes = segments if isinstance(segments, (list, tuple)) else [segments]
        if segments is not None and (
            not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
        ):
            raise ValueError(f"expected a positive number of groups or a list of positive sizes, got {segments!r}")
        return segments

    @field_validator("choices")
    @classmethod
    def _unique_labels(cls, choices: tuple[PolicyChoice, ...]) -> tuple[PolicyChoice, ...]:
        labels = [c.label for c in choices]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"labels must be unique, repeated: {duplicates}")
        return choices

    @model_validator(mode="after")
    def _points_in_the_space(self) -> SpaceConfig:
        """Each point is a plan of this ``tensors`` space: MaxText's custom form, over its
        tensors, at locations among its choices."""
        if self.points and self.layout != "tensors":
            raise ValueError(f"points: only allowed with layout: tensors, not with layout: {self.layout}")
        for point in self.points:
            if point.label in {p.label for p in self.points if p is not point}:
                raise ValueError(f"points: labels must be unique, repeated: {point.label!r}")
            located = self.point_locations(point.policy)
            if located is None:
                raise ValueError(f"points: {point.label!r} is no plan of a tensors space (a policy of device, "
                                 f"offloaded and recomputed tensors: full, names, offload or per_name)")
            outside = sorted({n for n in (*point.policy.names, *point.policy.offload) if n not in (self.tensors or ())})
            if outside:
                raise ValueError(f"points: {point.label!r} names {outside}, not among tensors {list(self.tensors or ())}")
            missing = sorted(set(located.values()) - {c.label for c in self.choices})
            if missing:
                raise ValueError(f"points: {point.label!r} puts tensors at {missing}, which choices leave out")
        return self

    def point_locations(self, policy: LayerPolicy) -> dict[str, str] | None:
        """Where ``policy`` puts each of :attr:`tensors` (``device``, ``offload``, ``remat``), as
        MaxText's custom form states it; None for a policy it cannot state."""
        form = POLICIES[policy.kind].maxtext
        stated = form(policy) if form is not None else None
        if not isinstance(stated, tuple):  # full: a word, every tensor recomputed
            return None if stated is None else {n: "remat" for n in self.tensors or ()}
        device, offload = stated
        return {n: "device" if n in device else "offload" if n in offload else "remat" for n in self.tensors or ()}

    def policy(self, label: str) -> LayerPolicy:
        """The policy of the choice labelled ``label``."""
        return next(c.policy for c in self.choices if c.label == label)
