"""The search spec: what a study searches, written as YAML and checked by pydantic.

A :class:`SearchSpec` names the study and its storage, the workload, the space of plans,
the HBM budget, the sampler, the trial count and how candidates are timed. Unknown keys
are errors. :func:`load_spec` turns every problem into a one-line :class:`SpecError` that
names the field.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    ModelWrapValidatorHandler,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from remat_search.errors import SpecError
from remat_search.plans.policy import POLICIES, LayerPolicy
from remat_search.targets.platform import is_gpu, is_tpu
from remat_search.units import Bytes, Seconds

STORAGE_ENV = "REMAT_SEARCH_STORAGE"
HOME_ENV = "REMAT_SEARCH_HOME"
STUDY_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


def storage_home() -> Path:
    """Where studies and caches live by default, whatever the working directory:
    ``$REMAT_SEARCH_HOME``; else the ``storage/`` folder of the source checkout remat-search
    runs from (``pip install -e .``); else ``~/.local/share/remat-search``."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[2]  # remat_search/spec/models.py
    if (checkout / "pyproject.toml").is_file() and (checkout / "storage").is_dir():
        return checkout / "storage"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "remat-search"


def default_storage() -> str:
    """The default storage URL: ``studies.db`` in :func:`storage_home`."""
    return f"sqlite:///{storage_home() / 'studies.db'}"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _WorkloadConfig(_Frozen):
    """What every kind of workload may take besides its own fields."""

    params_from: str | None = None
    """The folder of an Orbax checkpoint of the model's parameters: their shapes, dtypes and,
    where stored, shardings are read from its metadata (never its arrays) and replace the
    model's own (see ``checkpoint_params.py``). Relative to the spec's folder in a spec file."""

    @field_validator("params_from")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        """Kept absolute: a study's workers may start from another working directory."""
        return None if value is None else os.path.abspath(os.path.expanduser(value))

    @model_serializer(mode="wrap")
    def _without_unset_params_from(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No ``params_from: null``: a study stored before the field existed keeps its identity."""
        data = handler(self)
        if isinstance(data, dict) and data.get("params_from") is None:
            data.pop("params_from", None)
        return data


class TransformerConfig(_WorkloadConfig):
    """The built-in Flax decoder LM trained with AdamW (see ``transformer.py``)."""

    kind: Literal["transformer"]
    layers: PositiveInt
    d_model: PositiveInt
    heads: PositiveInt
    d_ff: PositiveInt
    seq_len: PositiveInt
    batch: PositiveInt
    vocab: PositiveInt
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameters and activations (bf16 as real TPU runs use; the loss is taken in f32)."""
    scan: bool = False
    """Stack the layers' parameters (leading axis = layers) and run them with ``lax.scan``:
    one scan per run of equal policies ("segments"), so compile time stays about constant in
    depth. Nested plans cannot be scanned."""
    attention: Literal["auto", "dense", "flash"] = "auto"
    """``dense``: the scores ``[batch, heads, seq, seq]`` computed and kept as tensors, as a
    plain implementation does. ``flash``: fused attention that keeps no ``seq × seq`` matrix,
    as real runs use: the Pallas TPU flash-attention kernel on a TPU target (per shard of the
    batch, in ``shard_map``), ``jax.nn.dot_product_attention`` elsewhere (cuDNN's fused
    kernel on a GPU where it applies, XLA's composition on a CPU). ``auto`` (the default):
    ``flash`` where it compiles and keeps no score matrix, else ``dense``, decided where the
    workload is built for its target (:func:`resolved_attention`)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TransformerConfig:
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        return self


FLASH_BLOCK = 128
"""The Pallas TPU kernel's block along the sequence (its minimum): ``seq_len`` must be a multiple."""


def flash_tiles(config: TransformerConfig) -> bool:
    """Whether the Pallas TPU kernel can tile ``config``'s sequence (whole 128-token blocks)."""
    return config.seq_len % FLASH_BLOCK == 0


def resolved_attention(config: TransformerConfig, platform: str) -> Literal["dense", "flash"]:
    """The attention ``config`` runs with on a ``platform`` (a JAX device's: ``tpu``, ``gpu``,
    ``cpu``): as written unless ``auto``, which is ``flash`` on a TPU where the Pallas kernel
    tiles the sequence and on a GPU, else ``dense``. Not on a CPU: there XLA's
    ``dot_product_attention`` keeps the scores too, and its peak was not reliably lower."""
    if config.attention != "auto":
        return config.attention
    if is_tpu(platform):
        return "flash" if flash_tiles(config) else "dense"
    return "flash" if is_gpu(platform) else "dense"


class MlpConfig(_WorkloadConfig):
    """The built-in chain of dense → gelu → dense blocks trained with AdamW."""

    kind: Literal["mlp"]
    layers: PositiveInt
    width: PositiveInt
    hidden: PositiveInt
    batch: PositiveInt


class FactoryConfig(_WorkloadConfig):
    """A user workload: ``factory: "package.module:function"``, called with ``args``."""

    factory: str
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("factory")
    @classmethod
    def _import_path(cls, value: str) -> str:
        return _matching(value, r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "an import path 'package.module:function'")


def _import_path(value: str | None) -> str | None:
    """``value`` if it is an import path ``package.module:Name`` (``Name`` may be dotted), or None."""
    if value is None:
        return None
    return _matching(value, r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", "an import path 'package.module:Name'")


def _axis_name(value: str) -> str:
    return _matching(value, r"[A-Za-z_]\w*", "a mesh axis name of letters, digits and '_' such as fsdp")


MeshAxis = Annotated[str, AfterValidator(_axis_name)]
"""A mesh axis: any name (MaxText's rules name 12: ``stage``, ``context``, ``tensor_transpose``, …);
one the mesh does not list is there at size 1."""
MESH_AXES = ("data", "fsdp", "sequence", "tensor", "expert")
"""The axes the built-in workloads know (the batch over ``data`` and ``fsdp``, the state over
``fsdp``), in the order a mesh lays them out, first (MaxText's order of them); other axes follow
in the order the spec writes them."""
AxisRules = tuple[tuple[str, MeshAxis | tuple[MeshAxis, ...] | None], ...]
"""Logical axis rules, Flax's form: ``[[logical name, mesh axis (or a list of them, or null)], ...]``,
e.g. ``[[batch, [data, fsdp]], [embed, fsdp], [mlp, tensor]]``: how a model's logical names
(``nn.with_logical_partitioning``, ``nnx.with_partitioning``) map onto mesh axes; an axis that
``spec.mesh`` does not list is at size 1 (not split over)."""


class NnxConfig(_WorkloadConfig):
    """A Flax NNX model searched as it is (see ``nnx_workload.py``): its class (or a function
    returning it) by import path, called with ``args`` (and ``rngs`` when it takes them)."""

    kind: Literal["nnx"]
    model: str
    """``"package.module:Name"``: the model class, or a function returning the model."""
    args: dict[str, Any] = Field(default_factory=dict)
    """The constructor's keyword arguments."""
    blocks: str = "blocks"
    """The attribute (a dotted path: ``decoder.layers``) holding the list of blocks the
    model's ``__call__`` runs; each is checkpointed by its layer's policy."""
    batch: PositiveInt
    seq_len: PositiveInt
    vocab: PositiveInt
    """The default loss: next-token cross-entropy of ``model(tokens)``'s logits on random
    int32 tokens ``[batch, seq_len]`` in ``[0, vocab)``."""
    loss: str | None = None
    """Or ``"package.module:function"``: ``fn(logits, tokens) -> scalar``."""
    logical_axis_rules: AxisRules | None = None
    """How the model's logical axis names map onto the mesh (see :data:`AxisRules`): over a
    mesh, its parameters are sharded as their ``out_sharding`` metadata says, by these rules."""

    _import_paths = field_validator("model", "loss")(lambda value: _import_path(value))

    @field_validator("blocks")
    @classmethod
    def _attribute_path(cls, value: str) -> str:
        return _matching(value, r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", "an attribute name or a dotted path such as 'decoder.layers'")


class LinenConfig(_WorkloadConfig):
    """A user's Flax linen model, searched with no ``Workload`` subclass (``linen_workload.py``).

    ``model`` (a ``nn.Module`` class, or a function returning a module) is called with
    ``args``; the module maps int32 tokens ``[batch, seq_len]`` to logits
    ``[batch, seq_len, vocab]``. Its layers are the calls of ``block`` (the class of the
    model's blocks) or of the submodules that ``blocks`` names (the attribute ``blocks`` of a
    list made in ``setup`` gives ``blocks_0``, ``blocks_1``, …): layer ``i`` is the ``i``-th
    such call in one forward pass, checkpointed with the plan's policy for ``i``."""

    kind: Literal["linen"]
    model: str
    args: dict[str, Any] = Field(default_factory=dict)
    block: str | None = None
    blocks: str | None = None
    batch: PositiveInt
    seq_len: PositiveInt
    vocab: PositiveInt
    loss: str | None = None
    """``"package.module:function"``, ``fn(logits, tokens) -> scalar``; default (null): the
    next-token cross-entropy of the logits on the tokens."""
    logical_axis_rules: AxisRules | None = None
    """How the model's logical axis names map onto the mesh (see :data:`AxisRules`): over a
    mesh, its parameters are sharded as its ``nn.with_logical_partitioning`` metadata says,
    by these rules, and they are in force while its step is traced (``nn.logical_axis_rules``)."""

    _import_paths = field_validator("model", "block", "loss")(lambda value: _import_path(value))

    @field_validator("blocks")
    @classmethod
    def _attribute(cls, value: str | None) -> str | None:
        if value is None:
            return value
        return _matching(value, r"[A-Za-z_]\w*", "a submodule or attribute name such as 'blocks'")

    @model_validator(mode="after")
    def _layers_named(self) -> LinenConfig:
        if self.block is None and self.blocks is None:
            raise ValueError("name the model's layers: block: 'package.module:Block' or blocks: ATTRIBUTE")
        return self


def _workload_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return "factory" if "factory" in value else value.get("kind")
    if isinstance(value, BaseModel):
        return "factory" if isinstance(value, FactoryConfig) else getattr(value, "kind", None)
    return None


WorkloadConfig = Annotated[
    Annotated[TransformerConfig, Tag("transformer")]
    | Annotated[MlpConfig, Tag("mlp")]
    | Annotated[NnxConfig, Tag("nnx")]
    | Annotated[LinenConfig, Tag("linen")]
    | Annotated[FactoryConfig, Tag("factory")],
    Discriminator(
        _workload_tag,
        custom_error_type="workload_kind",
        custom_error_message="expected kind: transformer, mlp, nnx or linen, or factory: 'package.module:function'",
    ),
]


class PolicyChoice(_Frozen):
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


class SpaceConfig(_Frozen):
    """The plans a study may propose: a layout and a finite list of policy choices."""

    layout: Literal["uniform", "per_layer", "segments"] = "per_layer"
    """``uniform``: one choice for all layers; ``per_layer``: one a layer; ``segments``: one
    for each contiguous group of layers given by ``segments``."""
    segments: PositiveInt | tuple[PositiveInt, ...] | None = Field(default=None, validate_default=True)
    """With ``layout: segments`` (and only then): N near-equal contiguous groups (earlier
    groups take the remainder), or the list of group sizes, which must sum to the layers."""
    nested: bool = False
    """Also search the nested layout (the JAX guide's recursive checkpointing): one more
    parameter, ``layout``, of ``flat`` or ``nested``."""
    choices: tuple[PolicyChoice, ...] = Field(min_length=1)

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

    def policy(self, label: str) -> LayerPolicy:
        """The policy of the choice labelled ``label``."""
        return next(c.policy for c in self.choices if c.label == label)


class SamplerConfig(_Frozen):
    """Which optuna sampler proposes plans (constraint-aware ones learn from the budget)."""

    kind: str = "planner"
    """``planner``: the cost model's best plans for the budget and along the front, then TPE
    (see ``search/samplers.py``); or one of optuna's: ``tpe``, ``nsga2``, ``random`` (the names of
    ``samplers.SAMPLERS``, checked before a search writes anything)."""
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = 0
    """0 to 2**32 − 1, as numpy's generators take (null: a different search each run)."""


class TpuTarget(_Frozen):
    """A TPU slice compiled ahead of time with the real TPU compiler (libtpu), from any host."""

    platform: Literal["tpu"]
    topology: str

    @field_validator("topology")
    @classmethod
    def _topology_name(cls, value: str) -> str:
        return _matching(value, r"v[0-9][a-z]*:[0-9]+(x[0-9]+)*", "a TPU topology such as v5e:2x4 or v5p:2x2x1")


def target_kind(value: Any) -> str | None:
    """The kind of target a spec's ``target`` is written as (``local`` or ``tpu``; None for
    neither): the tag of its form in :data:`TargetConfig` and of its class in ``target.TARGETS``."""
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



class TimingConfig(_Frozen):
    """How a candidate that fits is timed, and how long it may take in all."""

    warmup: NonNegativeInt = 2
    repeats: PositiveInt = 5
    timeout: Seconds = 300.0
    anchor: bool = True
    """Time each candidate's steps alternately with a fixed plan's (full remat on every layer)
    and rank by the median of the per-step ratios, in the anchor's seconds: a busy spell of a
    shared machine slows both alike and cancels. It doubles the timed steps; a dedicated
    accelerator can turn it off."""


class ConfirmConfig(_Frozen):
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


class HeartbeatConfig(_Frozen):
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


Workers = PositiveInt | Literal["auto"]


class SearchSpec(_Frozen):
    """Everything one study needs. See ``search_spaces/demo.yaml`` for an example."""

    study: str
    storage: str = Field(default_factory=default_storage)
    """Database URL (``--storage`` and ``$REMAT_SEARCH_STORAGE`` win): default
    :func:`default_storage`."""
    workload: WorkloadConfig
    space: SpaceConfig
    budget: Bytes | None = None
    """Peak bytes per chip. Default: the chip's memory as the TPU compiler reports it, or as a
    local GPU's runtime does (``bytes_limit``); required on CPU."""
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
    sampler: SamplerConfig = SamplerConfig()
    timing: TimingConfig = TimingConfig()
    worker_memory: Bytes | None = None
    """Host memory (resident bytes) the worker process may use, e.g. ``8GiB`` (null: no limit).
    The search watches it and kills a worker past it: that candidate fails ("worker exceeded
    its host memory limit") and the next gets a fresh worker, before the host itself runs out."""
    gradient_tolerance: PositiveFloat = 1e-3
    """How far a plan's first step may differ from the reference's (full remat, on the same
    fresh inputs): max over the training state's arrays and the loss of
    max |Δ − Δref| / max |Δref|, where Δ is the change the step made to the array (the loss
    itself for the loss). Beyond it, the trial fails."""
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
    compilation_cache: str | None = "jax-cache"
    """Directory of JAX's persistent compilation cache for the worker, relative to
    :func:`storage_home` unless absolute (null: none): a plan compiled before, in any study,
    loads in a moment instead of compiling again."""
    _budget_text: str | None = PrivateAttr(default=None)

    @property
    def budget_text(self) -> str | None:
        """The budget as the spec wrote it (``38mb``), to echo beside what it was read as."""
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
    def _axis_names(cls, value: Any) -> Any:
        """A bad axis name told as ``spec.mesh: …``, not at a key's inner location."""
        for axis in value if isinstance(value, dict) else ():
            if not isinstance(axis, str):
                raise ValueError(f"expected a mesh axis name such as fsdp, got {axis!r}")
            _axis_name(axis)
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


def check_study_name(value: str) -> str:
    """Return ``value`` if it is a usable study name, else raise :class:`ValueError`."""
    return _matching(
        value, STUDY_NAME_PATTERN,
        "a study name of letters, digits, '.', '_' or '-' (starting with a letter or digit, at most 128)",
    )


def _matching(value: str, pattern: str, expected: str) -> str:
    if not re.fullmatch(pattern, value):
        raise ValueError(f"expected {expected}, got {value!r}")
    return value


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
    if isinstance(workload, dict) and isinstance(workload.get("params_from"), str):
        data["workload"] = {**workload, "params_from": str(path.parent / os.path.expanduser(workload["params_from"]))}
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
