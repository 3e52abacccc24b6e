"""The search spec: what a study searches, written as YAML and checked by pydantic.

A :class:`SearchSpec` names the study and its storage, the workload, the space of plans,
the HBM budget, the sampler, the trial count and how candidates are timed. Unknown keys
are errors. :func:`load_spec` turns every problem into a one-line :class:`SpecError` that
names the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    ModelWrapValidatorHandler,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    Tag,
    field_validator,
    model_validator,
)

from remat_search.plans.configuration import Setting
from remat_search.spec.budget import Budget
from remat_search.spec.fields import Frozen, check_study_name, matching
from remat_search.spec.space import SpaceConfig
from remat_search.spec.workloads import (
    LinenConfig,
    MeshAxis,
    NnxConfig,
    TransformerConfig,
    WorkloadConfig,
    axis_name,
)
from remat_search.store.location import default_storage
from remat_search.units import Bytes, BytesPerSecond, Seconds


class ConfigurationSpace(Frozen):
    """The training configurations a study searches beside the plan (see
    ``plans/configuration.py``): every per-device batch with every mesh, and, at a fixed global
    batch, the accumulation that makes it up. Its objective is throughput: a trial's step time
    per token each chip trains on (examples, for a workload without sequences)."""

    batch: tuple[PositiveInt, ...] = Field(min_length=1)
    """Batch sizes to try, per data-parallel device (examples each device of the batch axes,
    ``plans.configuration.BATCH_AXES``, runs); with ``global_batch``, the micro-batch of one
    accumulation step. Over a mesh of those axes alone it is MaxText's ``per_device_batch_size``;
    over a ``tensor`` axis, say, MaxText's figure is the share of every device, which
    ``--format maxtext`` gives."""
    global_batch: PositiveInt | None = None
    """Examples one optimizer step trains on, fixed (null: each batch is one step's, with no
    accumulation). Each micro-batch runs ``global_batch / (batch × data-parallel devices)``
    accumulation steps; a pair of batch and mesh that does not divide it is left out."""
    mesh: tuple[dict[MeshAxis, PositiveInt], ...] | Literal["all"] | None = None
    """Meshes to try, each spanning the study's devices (those of ``spec.mesh``: the target's
    chips); ``all``: every split of them over the axes the workload shards over (``data`` and
    ``fsdp``, and those its ``logical_axis_rules`` map onto; MaxText's ``data``, ``fsdp``,
    ``fsdp_transpose``, ``context``, ``tensor``, ``tensor_sequence`` and, with experts,
    ``expert``: ``search.configurations.search_axes``); null: ``spec.mesh`` only."""

    settings: dict[str, tuple[Setting, ...]] = Field(default_factory=dict)
    """A ``kind: maxtext`` workload's own settings to search beside remat, each a list of
    values: the memory knobs MaxText offers (``optimizer_memory_host_offload: [false, true]``,
    ``parameter_memory_host_offload``); every combination with every batch and mesh. Each value
    is checked with MaxText's loader before anything is written."""

    @field_validator("settings")
    @classmethod
    def _some_values(cls, value: dict[str, tuple[Setting, ...]]) -> dict[str, tuple[Setting, ...]]:
        empty = [key for key, values in value.items() if not values]
        if empty:
            raise ValueError(f"{empty[0]}: expected a list of one or more values to search")
        return value

    @field_validator("batch", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        """``batch: 8`` reads as ``[8]``."""
        return (value,) if isinstance(value, int) else value

    @field_validator("mesh", mode="before")
    @classmethod
    def _meshes(cls, value: Any) -> Any:
        """One mesh (``{fsdp: 4}``) reads as a list of it; a word other than ``all`` is told in a line."""
        if isinstance(value, dict):
            return (value,)
        if isinstance(value, str) and value != "all":
            raise ValueError(f"expected a list of meshes such as [{{data: 2, fsdp: 2}}] or all, got {value!r}")
        return value


class SamplerConfig(Frozen):
    """Which optuna sampler proposes plans (constraint-aware ones learn from the budget)."""

    kind: str = "planner"
    """``planner``: the cost model's best plans for the budget and along the front, then TPE
    (see ``search/samplers.py``); or one of optuna's: ``tpe``, ``nsga2``, ``random`` (the names of
    ``samplers.SAMPLERS``, checked before a search writes anything)."""
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = 0
    """0 to 2**32 − 1, as numpy's generators take (null: a different search each run)."""


class TpuTarget(Frozen):
    """A TPU slice compiled ahead of time with the real TPU compiler (libtpu), from any host."""

    platform: Literal["tpu"]
    topology: str
    host_link: BytesPerSecond | None = None
    """The bytes a second one chip's link to its host carries one way, where you know it
    (``32GB/s``): what an offloaded tensor's transfers are priced at. None: the step-time
    model's assumption (``targets.chips.TPU_HOST_BYTES_PER_SECOND``, 15 GB/s), which
    Google Cloud publishes no figure to check."""
    calibration: str | None = None
    """A calibration of the step-time model (a file ``remat-search calibrate`` wrote, fitted on
    this chip's measured steps): every candidate's step is estimated with its figures and
    carries its error band. None: the datasheet's figures, the band the published runs of this
    generation showed (``targets.chips.PUBLISHED_BANDS``)."""
    keep_programs: bool = False
    """Keep each compiled program in the study's artifacts (gzipped, once per distinct program),
    as a study that times its plans does: a program whose step you measured elsewhere (a run
    on the chips, a published step) is a calibration sample (``remat-search calibrate
    SAMPLES.json``). A plan whose measurement the study reuses (the same plan measured before
    for the same target, in this storage) is not compiled again, so not kept. False: an
    estimated program is not kept."""

    @field_validator("topology")
    @classmethod
    def _topology_name(cls, value: str) -> str:
        return matching(value, r"v[0-9][a-z]*:[0-9]+(x[0-9]+)*", "a TPU topology such as v5e:2x4 or v5p:2x2x1")


def target_kind(value: Any) -> str | None:
    """The kind of target a spec's ``target`` is written as (``local`` or ``tpu``; None for
    neither): the tag of its form in :data:`TargetConfig` and of its class in ``targets.base.TARGETS``."""
    if value == "local":
        return "local"
    return "tpu" if isinstance(value, (dict, TpuTarget)) else None


TargetConfig = Annotated[
    Annotated[Literal["local"], Tag("local")] | Annotated[TpuTarget, Tag("tpu")],
    Discriminator(
        target_kind,
        custom_error_type="target",
        custom_error_message="expected local or {platform: tpu, topology: v5e:2x4}",
    ),
]
"""``local``: compile, run and time on the devices this process sees; or a TPU topology."""



class TimingConfig(Frozen):
    """How a candidate that fits is timed, and how long it may take in all."""

    warmup: NonNegativeInt = 2
    repeats: PositiveInt = 5
    timeout: Seconds = 300.0
    anchor: bool = True
    """Time each candidate's steps alternately with a fixed plan's (full remat on every layer)
    and rank by the median of the per-step ratios, in the anchor's seconds: a busy spell of a
    shared machine slows both alike and cancels. It doubles the timed steps; a dedicated
    accelerator can turn it off."""


class ConfirmConfig(Frozen):
    """How a search ends: its ``top`` fastest plans that fit, re-timed interleaved ``rounds``
    times, racing until the plan that ranks first at the budget is one of them (``top: 0``
    skips it; compile-only targets never run it)."""

    top: NonNegativeInt = 3
    rounds: PositiveInt = 10
    presets: bool = True
    """Re-time every uniform plan that fits beside them: the plans people pick by hand, so
    the answer is one no preset beats side by side, even where the search's own timing of a
    preset was unlucky."""
    races: NonNegativeInt = 10
    """The confirmation's budget of races: where a plan the session did not re-time ranks first
    by its search time (the fastest of many noisy times is biased low), it is re-timed with the
    others in a new session, at most ``races`` times; then the answer may be a plan timed only
    by the search, and ``run``, ``best`` and ``confirm`` say so."""

    @field_validator("top")
    @classmethod
    def _two_to_order(cls, top: int) -> int:
        if top == 1:
            raise ValueError("0 (skip) or at least 2: one plan re-timed alone has nothing to be compared with")
        return top


class HeartbeatConfig(Frozen):
    """How a study shared by several processes or hosts finds a trial whose process died:
    each search records a heartbeat of its running trials every ``interval`` seconds, and a
    running trial with none for ``grace`` seconds is failed and its plan queued again (by
    any search of the study, on any host). A trial of a process that died on the same host
    is found at once, by its process id."""

    interval: PositiveInt = 10
    grace: PositiveInt = 60

    @model_validator(mode="after")
    def _grace_after_beats(self) -> HeartbeatConfig:
        if self.grace <= self.interval:
            raise ValueError(f"heartbeat.grace: must be more than heartbeat.interval ({self.interval} s)")
        return self


class SliceConfig(Frozen):
    """How the processes of a multi-host slice (one ``remat-search run`` a host, joined by
    ``jax.distributed``) find that one of them died or hangs, and stop: within these bounds the
    others exit with :data:`~remat_search.errors.SLICE_RESTART_EXIT`, the code launchers restart
    a job on (``docs/slice.md``). Unused on one host."""

    heartbeat_timeout: Seconds = 100.0
    """A process not heard from for this long is dead: JAX's distributed heartbeat between the
    hosts' workers and remat-search's own between the hosts' searches."""
    collective_timeout: Seconds = 300.0
    """How long a process waits for the others at a step they must take together (the
    processes' agreement on a candidate's compile; a collective, on CPU); past it the trial fails."""
    join_timeout: Seconds = 300.0
    """How long the processes wait for each other to start (the launcher starts them at once)."""


Workers = PositiveInt | Literal["auto"]


class SearchSpec(Frozen):
    """Everything one study needs. See ``search_spaces/demo.yaml`` for an example."""

    study: str
    storage: str = Field(default_factory=default_storage)
    """Database URL (``--storage`` and ``$REMAT_SEARCH_STORAGE`` win): default
    :func:`default_storage`."""
    workload: WorkloadConfig
    space: SpaceConfig
    budget: Budget = None
    """Peak bytes per chip. Default (or ``device``): the chip's memory as the TPU compiler
    reports it, or as a local GPU's runtime does (``bytes_limit``); required on CPU. A share
    such as ``70%`` (a :class:`~remat_search.spec.budget.Share`) is that share of the
    compiled peak of the uniform no-remat plan on the target, which the search compiles first."""
    trials: PositiveInt
    target: TargetConfig = "local"
    mesh: dict[MeshAxis, PositiveInt] | None = None
    """Device mesh, e.g. ``{data: 2, fsdp: 4}``: the built-in workloads put the batch over
    ``data`` and ``fsdp``, and parameters and optimizer state over ``fsdp``; other axes
    (``tensor``, or any a model's rules name) are for a workload's own shardings (it gets the
    mesh from :meth:`Workload.use_mesh`); an axis the model names and the mesh leaves out is
    there at size 1. Axes are laid out as :data:`MESH_AXES` says, and the target's devices over
    them as ``jax.make_mesh`` orders them (``target.make_mesh``). Default: all of a TPU
    target's chips on ``data``; for ``local``, no mesh (one device)."""
    configuration: ConfigurationSpace | None = None
    """Batch, accumulation and mesh searched with the plan, by throughput (null: the
    workload's batch and ``mesh``, searched by step time)."""
    sampler: SamplerConfig = SamplerConfig()
    timing: TimingConfig = TimingConfig()
    worker_memory: Bytes | None = None
    """Host memory (resident bytes) the worker process may use, e.g. ``8GiB`` (null: no limit).
    The search watches it and kills a worker past it: that candidate fails ("worker exceeded
    its host memory limit") and the next gets a fresh worker, before the host itself runs out."""
    gradient_tolerance: PositiveFloat | None = None
    """How far a plan's first-step gradients (and loss) may differ from the reference's (full
    remat, on the same fresh inputs), norm-relative, per array and over all of them, in place of
    the threshold measured on the reference (null, the default: ``CHECK_FACTOR`` × the rounding
    and rerun noise of full remat's own step; see ``measure.check``). Beyond it, the trial fails."""
    confirm: ConfirmConfig = ConfirmConfig()
    prescreen: float | None = Field(default=1.2, gt=1)
    """Record a plan over budget without compiling it when the study's cost model (see
    ``planner``) predicts a peak above ``prescreen × budget`` even allowing for the largest
    over-prediction it has made on the study's mixed plans (null: compile every plan)."""
    workers: Workers = 1
    """Worker processes measuring candidates at once (``--workers`` wins). ``auto``: one per
    two cores, as host memory allows (see ``search.resolve_workers``). Compiles run in
    parallel; on a local accelerator plans run and are timed one at a time."""
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    slice: SliceConfig = SliceConfig()
    compilation_cache: str | None = "jax-cache"
    """Directory of JAX's persistent compilation cache for the worker, relative to
    :func:`storage_home` unless absolute (null: none): a plan compiled before, in any study,
    loads in a moment instead of compiling again."""
    _budget_text: str | None = PrivateAttr(default=None)

    @property
    def budget_text(self) -> str | None:
        """The budget as the spec wrote it (``38mb``, ``70%``, ``device``), to echo beside what it was read as."""
        return self._budget_text

    @model_validator(mode="wrap")
    @classmethod
    def _keep_budget_text(cls, data: Any, handler: ModelWrapValidatorHandler[SearchSpec]) -> SearchSpec:
        spec = handler(data)
        if isinstance(data, dict) and data.get("budget") is not None:
            spec._budget_text = str(data["budget"])
        return spec

    @field_validator("study")
    @classmethod
    def _study_name(cls, value: str) -> str:
        return check_study_name(value)

    @field_validator("mesh", mode="before")
    @classmethod
    def axis_names(cls, value: Any) -> Any:
        """A bad axis name told as ``spec.mesh: …``, not at a key's inner location."""
        for axis in value if isinstance(value, dict) else ():
            if not isinstance(axis, str):
                raise ValueError(f"expected a mesh axis name such as fsdp, got {axis!r}")
            axis_name(axis)
        return value

    @model_validator(mode="after")
    def _nested_needs_unrolled(self) -> SearchSpec:
        if self.space.nested and isinstance(self.workload, TransformerConfig) and self.workload.scan:
            raise ValueError(
                "space.nested: the nested layout cannot be scanned; set workload.scan: false or nested: false"
            )
        if self.space.nested and isinstance(self.workload, NnxConfig):
            raise ValueError("space.nested: an nnx model runs its blocks itself, so they cannot be nested; set nested: false")
        if self.space.nested and isinstance(self.workload, LinenConfig):
            raise ValueError("space.nested: a linen model's layers cannot be nested; set nested: false")
        return self

    @model_validator(mode="after")
    def _own_step_takes_the_batch(self) -> SearchSpec:
        own = getattr(self.workload, "train_step", None)
        if own is not None and self.configuration is not None and self.configuration.global_batch is not None:
            raise ValueError(
                "configuration.global_batch: the workload's own train_step takes one whole batch, so it cannot "
                "accumulate micro-batches; leave global_batch out (each batch is one step's)"
            )
        return self
