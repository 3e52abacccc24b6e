"""The space of plans a study may propose, and how optuna walks it.

A :class:`Space` is built once for a spec's :class:`~remat_search.spec.models.SpaceConfig` and a
workload's layer count. ``uniform`` gives every layer the same choice (one categorical
parameter, ``policy``); ``per_layer`` gives each layer its own (``layer_00``, ``layer_01``, …);
``segments`` gives each contiguous group of layers its own (``segment_00``, …); ``tensors``
gives each tensor name its place, on the device, recomputed or offloaded (``tensor_context``,
…), every layer alike (one ``per_name`` policy, MaxText's ``remat_policy: custom``). With
``nested: true`` one more parameter, ``layout``, picks ``flat`` or ``nested`` (recursive
checkpointing). The uniform plan of every choice — the presets people pick by hand — is
what :meth:`Space.presets` gives the search to queue first, so every study shows them beside
what the search finds. A study that searches configurations (``spec.configuration``) has one
more parameter, ``configuration``, choosing among them (:meth:`Space.with_configurations`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from remat_search.errors import SpecError
from remat_search.plans.configuration import Configuration
from remat_search.plans.plan import RematPlan
from remat_search.plans.policy import LayerPolicy, import_function
from remat_search.spec.space import SpaceConfig

if TYPE_CHECKING:  # optuna where a search walks the space: `plan` reads one without it
    import optuna
    from optuna.distributions import BaseDistribution

LAYOUT_PARAM = "layout"
"""The parameter of a ``nested: true`` space that picks the plan's layout."""
LAYOUTS = ("flat", "nested")
TENSOR_PARAM = "tensor_"
"""The prefix of a ``tensors`` space's parameters: ``tensor_context`` places ``context``."""
CONFIGURATION_PARAM = "configuration"
"""The parameter of a configuration study that picks the candidate's configuration, by its
:meth:`Configuration.summary`."""


@dataclass(frozen=True)
class Space:
    """The plans of one :class:`SpaceConfig` for a workload of ``layers`` layers, with the
    names of the optuna parameters that choose them (build it with :meth:`of`)."""

    config: SpaceConfig
    layers: int
    units: tuple[str, ...]
    """The per-unit choice parameters: ``policy`` (uniform), ``layer_NN`` (per_layer) or
    ``segment_NN`` (segments); not the ``layout`` parameter of a nested space."""
    unit_layers: tuple[tuple[int, ...], ...]
    """For each of :attr:`units`, in order, the layer indices its choice applies to."""
    configurations: tuple[Configuration, ...] = ()
    """The configurations searched (none: the spec's own batch and mesh)."""
    tensor_bytes: tuple[tuple[str, int], ...] = ()
    stacks: tuple[int, ...] | None = None
    """The model's scanned stacks (:attr:`Workload.stacks`), where it scans any."""
    """A ``tensors`` space's (name, bytes) of each tensor one layer saves, where the traced step told them."""

    def with_configurations(self, configurations: tuple[Configuration, ...]) -> Space:
        """This space with the ``configuration`` parameter choosing among ``configurations``."""
        return replace(self, configurations=configurations)

    @property
    def configuration_labels(self) -> tuple[str, ...]:
        return tuple(c.summary() for c in self.configurations)

    @classmethod
    def of(cls, config: SpaceConfig, layers: int, stacks: Sequence[int] | None = None) -> Space:
        """The space of ``config`` over ``layers`` layers; :class:`SpecError` if its segments
        do not fit them. ``stacks``: the layers of each unit the model runs as one body (a
        scanned stack; an unrolled layer is 1), where it scans any: a scan has one body, so a
        ``per_layer`` space gives each stack one choice (``stack_00``, …), a ``segments`` space's
        groups must be whole stacks, and none is nested."""
        if stacks is None or all(n == 1 for n in stacks):
            return cls._unrolled(config, layers)
        if config.layout in ("uniform", "tensors"):
            if config.nested:
                raise SpecError("spec.space.nested: a scanned stack runs one body; it cannot be nested")
            return replace(cls._unrolled(config, layers), stacks=tuple(stacks))
        return replace(cls._over_stacks(config, layers, tuple(stacks)), stacks=tuple(stacks))

    @classmethod
    def _unrolled(cls, config: SpaceConfig, layers: int) -> Space:
        if config.layout == "uniform":
            return cls(config, layers, ("policy",), (tuple(range(layers)),))
        if config.layout == "tensors":
            names = config.tensors or ()
            return cls(config, layers, tuple(TENSOR_PARAM + n for n in names), (tuple(range(layers)),) * len(names))
        if config.layout == "per_layer":
            return cls(config, layers, tuple(f"layer_{i:02d}" for i in range(layers)), tuple((i,) for i in range(layers)))
        sizes = _segment_sizes(config, layers)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return cls(
            config, layers, tuple(f"segment_{i:02d}" for i in range(len(sizes))),
            tuple(tuple(range(start, start + size)) for start, size in zip(starts, sizes, strict=True)),
        )

    @classmethod
    def _over_stacks(cls, config: SpaceConfig, layers: int, stacks: tuple[int, ...]) -> Space:
        """A ``per_layer`` or ``segments`` space over a model that scans: one choice a stack, or
        a group of whole stacks (see :meth:`of`)."""
        if config.nested:
            raise SpecError("spec.space.nested: a scanned stack runs one body; it cannot be nested")
        if sum(stacks) != layers:
            raise SpecError(f"workload: its stacks {list(stacks)} hold {sum(stacks)} layers, not {layers}")
        ends = {sum(stacks[: i + 1]) for i in range(len(stacks))}
        if config.layout == "per_layer":
            sizes = list(stacks)
        else:
            sizes = _segment_sizes(config, layers)
            cut = sorted({sum(sizes[: i + 1]) for i in range(len(sizes))} - ends)
            if cut:
                raise SpecError(
                    f"spec.space.segments: sizes {sizes} cut a scanned stack (the model's stacks are "
                    f"{list(stacks)} layers; a scan has one body): end each group where a stack ends"
                )
        prefix = "stack" if config.layout == "per_layer" else "segment"
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return cls(
            config, layers, tuple(f"{prefix}_{i:02d}" for i in range(len(sizes))),
            tuple(tuple(range(start, start + size)) for start, size in zip(starts, sizes, strict=True)),
        )

    @property
    def labels(self) -> tuple[str, ...]:
        """The choices' labels, in the spec's order."""
        return tuple(c.label for c in self.config.choices)

    @property
    def n_params(self) -> int:
        """How many parameters a trial sets: its units, its layout if nested, its configuration
        if searched."""
        return len(self.units) + (1 if self.config.nested else 0) + (1 if self.configurations else 0)

    def distributions(self) -> dict[str, BaseDistribution]:
        """Every parameter's optuna distribution."""
        from optuna.distributions import CategoricalDistribution

        space: dict[str, BaseDistribution] = {u: CategoricalDistribution(self.labels) for u in self.units}
        if self.config.nested:
            space[LAYOUT_PARAM] = CategoricalDistribution(LAYOUTS)
        if self.configurations:
            space[CONFIGURATION_PARAM] = CategoricalDistribution(self.configuration_labels)
        return space

    def suggest(self, trial: optuna.Trial) -> RematPlan:
        """Ask ``trial`` for one choice per unit (and the layout, if nested); the plan."""
        params = {name: trial.suggest_categorical(name, self.labels) for name in self.units}
        if self.config.nested:
            params[LAYOUT_PARAM] = trial.suggest_categorical(LAYOUT_PARAM, LAYOUTS)
        if self.configurations:
            params[CONFIGURATION_PARAM] = trial.suggest_categorical(CONFIGURATION_PARAM, self.configuration_labels)
        return self.plan(params)

    def params(self, choices: Sequence[str], configuration: str | None = None) -> dict[str, str]:
        """The trial parameters of the flat plan with ``choices``, one label per unit; where the
        space searches configurations, at ``configuration`` (a label of
        :attr:`configuration_labels`; default the first, the reference)."""
        params = dict(zip(self.units, choices, strict=True))
        if self.config.nested:
            params[LAYOUT_PARAM] = "flat"
        if self.configurations:
            params[CONFIGURATION_PARAM] = configuration or self.configuration_labels[0]
        return params

    @property
    def weights(self) -> tuple[float, ...] | None:
        """For the cost model's prior, each unit's share of what a preset saves and costs: a
        ``tensors`` space's by each tensor's bytes where the traced step told them
        (:meth:`with_tensor_bytes`), else alike; None: by the layers each unit holds."""
        if self.config.layout != "tensors":
            return None
        known = dict(self.tensor_bytes)
        sizes = [float(known.get(n, 0)) for n in self.tensor_names]
        if not sizes or not all(sizes):
            sizes = [1.0] * len(self.units)
        return tuple(size / sum(sizes) for size in sizes)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """A ``tensors`` space's tensor names, in its units' order (none for another layout)."""
        return self.config.tensors or ()

    def with_tensor_bytes(self, tensor_bytes: Mapping[str, int] | None) -> Space:
        """This space with the bytes of each tagged tensor one layer saves (the traced step's,
        :attr:`DeviceInfo.traced_bytes`): the cost model's prior spreads a preset by them."""
        return replace(self, tensor_bytes=tuple(sorted((tensor_bytes or {}).items())))

    def plan(self, params: Mapping[str, Any]) -> RematPlan:
        """The plan a trial's parameters stand for (``layout`` absent means flat)."""
        if self.config.layout == "tensors":
            return self._tensor_plan(params)
        policies: list[Any] = [None] * self.layers
        for name, unit in zip(self.units, self.unit_layers, strict=True):
            for i in unit:
                policies[i] = self.config.policy(params[name])
        return RematPlan(
            layers=tuple(policies), layout=params.get(LAYOUT_PARAM, "flat"), configuration=self._configuration(params),
        )

    def _tensor_plan(self, params: Mapping[str, Any]) -> RematPlan:
        """A ``tensors`` space's plan: every layer keeps its ``device`` tensors, offloads its
        ``offload`` ones and recomputes the rest (``per_name``; ``full`` where none is kept)."""
        where = {name: params[unit] for name, unit in zip(self.tensor_names, self.units, strict=True)}
        device = [n for n, at in where.items() if at == "device"]
        offload = [n for n, at in where.items() if at == "offload"]
        policy = (
            LayerPolicy(kind="per_name", names=tuple(device), offload=tuple(offload)) if device or offload
            else LayerPolicy(kind="full")
        )
        return RematPlan(layers=(policy,) * self.layers, configuration=self._configuration(params))

    def _configuration(self, params: Mapping[str, Any]) -> Configuration | None:
        """The configuration a trial's parameters pick, where the space searches them."""
        if not self.configurations:
            return None
        return self.configurations[self.configuration_labels.index(params[CONFIGURATION_PARAM])]

    def layer_labels(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        """The choice label of each layer under a trial's parameters (what tables print); a
        ``tensors`` space's layers, each its policy (``per_name(context; offload mlpwi)``)."""
        if self.config.layout == "tensors":
            return tuple(str(p) for p in self.plan(params).layers)
        labels = [""] * self.layers
        for name, unit in zip(self.units, self.unit_layers, strict=True):
            for i in unit:
                labels[i] = str(params[name])
        return tuple(labels)

    def choices(self, params: Mapping[str, Any], *, any_configuration: bool = False) -> tuple[str, ...] | None:
        """The label of each unit of a flat plan's parameters; None for a nested or partial one.
        In a space of configurations, None unless the plan is at the first (the reference, where
        the presets run and the per-layer cost model is fitted), or ``any_configuration``."""
        if params.get(LAYOUT_PARAM, "flat") != "flat" or not all(u in params for u in self.units):
            return None
        if self.configurations and not any_configuration and params.get(CONFIGURATION_PARAM) != self.configuration_labels[0]:
            return None
        return tuple(str(params[u]) for u in self.units)

    def presets(self) -> list[dict[str, str]]:
        """Trial parameters of a ``tensors`` space's points (``space.points``), then of the
        uniform plan of every choice not among them, in the spec's order (at the first
        configuration, where the space searches them).

        A ``nested: true`` space's flat presets carry ``layout: flat``, and one more preset
        follows them: the nested plan with no policy inside (every layer on the first choice
        that does not checkpoint), the JAX guide's recursive checkpointing. Without such a
        choice there is no nested preset.
        """
        points = [self.config.point_locations(p.policy) or {} for p in self.config.points]
        presets = [self.params(tuple(where[n] for n in self.tensor_names)) for where in points]
        presets += [params for label in self.labels if (params := self.params((label,) * len(self.units))) not in presets]
        none = next((c.label for c in self.config.choices if not c.policy.checkpoints), None)
        if self.config.nested and none is not None:
            presets.append({**self.params((none,) * len(self.units)), LAYOUT_PARAM: "nested"})
        return presets

    def check_names(self, tensor_names: Iterable[str]) -> None:
        """Raise :class:`SpecError` if a choice names a tensor the workload does not declare."""
        known = set(tensor_names)
        if self.config.layout == "tensors":
            unknown = sorted(set(self.tensor_names) - known)
            if unknown:
                raise SpecError(
                    f"spec.space.tensors: unknown tensor name(s) {unknown}; the workload names {sorted(known) or 'no tensors'}"
                )
            return
        for i, choice in enumerate(self.config.choices):
            unknown = sorted(set(choice.policy.tensor_names) - known)
            if unknown:
                raise SpecError(
                    f"spec.space.choices.{i}: unknown tensor name(s) {unknown} in {choice.label!r}; "
                    f"the workload names {sorted(known) or 'no tensors'}"
                )

    def check_functions(self) -> None:
        """Import every policy function the choices name (``function: "package.module:fn"``):
        a one-line :class:`~remat_search.errors.WorkloadError` naming the choice's field if one
        does not import or is not callable, before anything is written."""
        for i, choice in enumerate(self.config.choices):
            if choice.policy.function is not None:
                import_function(choice.policy.function, f"spec.space.choices.{i}.function")


def _segment_sizes(config: SpaceConfig, layers: int) -> list[int]:
    """The sizes of a ``segments`` space's groups: N near-equal (earlier groups take the
    remainder), or the spec's list, which must sum to ``layers``."""
    if config.segments is None:
        raise SpecError("spec.space.segments: required with layout: segments")
    if isinstance(config.segments, int):
        if config.segments > layers:
            raise SpecError(
                f"spec.space.segments: {config.segments} groups for a workload of {layers} layers; "
                f"give at most {layers}"
            )
        n = config.segments
        return [layers // n + (1 if i < layers % n else 0) for i in range(n)]
    if sum(config.segments) != layers:
        raise SpecError(
            f"spec.space.segments: sizes {list(config.segments)} sum to {sum(config.segments)}, "
            f"the workload has {layers} layers"
        )
    return list(config.segments)
