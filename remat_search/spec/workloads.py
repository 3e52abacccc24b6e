"""The workloads a spec may name: the built-in kinds' configs (transformer, mlp, nnx, linen, maxtext) and a
factory's, with the mesh axes and logical axis rules they are sharded by."""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Discriminator,
    Field,
    PositiveInt,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from remat_search.spec.fields import Frozen, matching
from remat_search.targets.platform import is_gpu, is_tpu


class OptimizerConfig(Frozen):
    """The optimizer a step trains with: an optax transformation by import path, or a function of
    the user's returning one (``optax.adafactor``, ``my_project.train:make_optimizer``), called
    with ``args``."""

    factory: str
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("factory")
    @classmethod
    def _import_path(cls, value: str) -> str:
        return matching(value, r"[A-Za-z_][\w.]*[:.][A-Za-z_]\w*",
                        "an import path such as 'optax.adafactor' or 'package.module:function'")

    @property
    def import_path(self) -> str:
        """``package.module:name`` (``optax.adafactor`` is ``optax:adafactor``)."""
        if ":" in self.factory:
            return self.factory
        module, _, name = self.factory.rpartition(".")
        return f"{module}:{name}"


class BatchConfig(Frozen):
    """A batch of the user's own: ``factory`` (``"my_project.data:example_batch"``) called with
    ``args`` (and ``key``, a JAX PRNG key, where it takes one) returns it: an array, a tuple or a
    dict of arrays. The model is called with ``model_input`` of it (a dict's key, a tuple's
    index; default: an array itself, a tuple's first item, a dict whole)."""

    factory: str
    args: dict[str, Any] = Field(default_factory=dict)
    model_input: str | int | None = None

    @field_validator("factory")
    @classmethod
    def _import_path(cls, value: str) -> str:
        return matching(value, r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", "an import path 'package.module:function'")


class _WorkloadConfig(Frozen):
    """What every kind of workload may take besides its own fields."""

    optimizer: OptimizerConfig | None = None
    """The optimizer whose state the step carries; None: AdamW (learning rate 1e-3)."""
    params_from: str | None = None
    """The folder of an Orbax checkpoint of the model's parameters: their shapes, dtypes and,
    where stored, shardings are read from its metadata (never its arrays) and replace the
    model's own (see ``checkpoint_params.py``). Relative to the spec's folder in a spec file."""

    @field_validator("params_from")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        """Kept absolute: a study's workers may start from another working directory."""
        return None if value is None else os.path.abspath(os.path.expanduser(value))

    _omitted_when_unset: ClassVar[tuple[str, ...]] = ("params_from", "optimizer")
    """Fields added after studies were stored: left out of the dump while null."""

    @model_serializer(mode="wrap")
    def _without_unset_new_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No ``params_from: null`` (nor another field of :attr:`_omitted_when_unset`): a study
        stored before the field existed keeps its identity."""
        data = handler(self)
        if isinstance(data, dict):
            for name in self._omitted_when_unset:
                if data.get(name, 0) is None:
                    data.pop(name)
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
        return matching(value, r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "an import path 'package.module:function'")


def _import_path(value: str | None) -> str | None:
    """``value`` if it is an import path ``package.module:Name`` (``Name`` may be dotted), or None."""
    if value is None:
        return None
    return matching(value, r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", "an import path 'package.module:Name'")


def axis_name(value: str) -> str:
    return matching(value, r"[A-Za-z_]\w*", "a mesh axis name of letters, digits and '_' such as fsdp")


MeshAxis = Annotated[str, AfterValidator(axis_name)]
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


def _check_batch(config: Any) -> Any:
    """Tokens need ``seq_len`` and ``vocab``; a batch of one's own needs a loss over it."""
    if isinstance(config.batch, int):
        missing = [f for f in ("seq_len", "vocab") if getattr(config, f) is None]
        if missing:
            raise ValueError(f"{missing[0]}: required with a token batch (batch: N); or give batch: {{factory: ...}}")
    elif config.loss is None and getattr(config, "model_loss", None) is None and config.train_step is None:
        raise ValueError("loss: a batch of your own (batch: {factory: ...}) needs a loss: 'package.module:fn' "
                         "taking (outputs, batch) and returning a scalar")
    if config.train_step is not None and (config.loss is not None or getattr(config, "model_loss", None) is not None):
        raise ValueError("train_step: a train step of your own computes its own loss; leave loss and model_loss out")
    return config


def rule_targets(rules: AxisRules | None) -> frozenset[str]:
    """The mesh axes logical axis ``rules`` (:data:`AxisRules`) map onto."""
    return frozenset(
        axis for _, target in rules or () for axis in ((target,) if isinstance(target, str) else target or ())
    )


class NnxConfig(_WorkloadConfig):
    """A Flax NNX model searched as it is (see ``nnx_workload.py``): its class (or a function
    returning it) by import path, called with ``args`` (and ``rngs`` when it takes them)."""

    kind: Literal["nnx"]
    model: str
    """``"package.module:Name"``: the model class, or a function returning the model."""
    args: dict[str, Any] = Field(default_factory=dict)
    """The constructor's keyword arguments."""
    blocks: str = "blocks"
    """The attribute (a dotted path: ``decoder.layers``) holding the model's blocks: a list the
    model's ``__call__`` runs (each block checkpointed by its layer's policy), or one stack of
    blocks made with ``nnx.vmap`` and run with ``nnx.scan`` (its body checkpointed by one policy)."""
    layers: PositiveInt | None = None
    """How many layers the model has, where you want it checked: a program that runs another
    number is refused (None: the program's own count)."""
    batch: PositiveInt | BatchConfig
    """Random int32 tokens ``[batch, seq_len]`` in ``[0, vocab)``, or a batch of your own
    (:class:`BatchConfig`)."""
    seq_len: PositiveInt | None = None
    vocab: PositiveInt | None = None
    """The default loss: next-token cross-entropy of ``model(tokens)``'s logits."""
    loss: str | None = None
    """Or ``"package.module:function"``: ``fn(outputs, batch) -> scalar``."""
    model_loss: str | None = None
    """Or the model's own loss, ``"package.module:function"``: ``fn(model, batch) -> scalar``,
    given the model with its blocks checkpointed (it calls the model itself). Not with ``loss``."""
    train_step: str | None = None
    """Or the team's own train step, ``"package.module:function"``: ``fn(model, optimizer, batch)
    -> loss``, given the model with its blocks checkpointed and an ``nnx.Optimizer(model, tx,
    wrt=nnx.Param)`` of the spec's optimizer, both updated in place (Flax's own idiom); the
    program measured is that step. Not with ``loss`` or ``model_loss``."""
    logical_axis_rules: AxisRules | None = None
    """How the model's logical axis names map onto the mesh (see :data:`AxisRules`): over a
    mesh, its parameters are sharded as their ``out_sharding`` metadata says, by these rules."""

    _omitted_when_unset: ClassVar[tuple[str, ...]] = (
        "params_from", "optimizer", "model_loss", "train_step", "layers", "seq_len", "vocab")
    _import_paths = field_validator("model", "loss", "model_loss", "train_step")(lambda value: _import_path(value))

    @model_validator(mode="after")
    def _batch_named(self) -> Any:
        return _check_batch(self)

    @field_validator("model_loss")
    @classmethod
    def _one_loss(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("loss") is not None:
            raise ValueError("give loss (fn(logits, tokens)) or model_loss (fn(model, tokens)), not both")
        return value

    @field_validator("blocks")
    @classmethod
    def _attribute_path(cls, value: str) -> str:
        return matching(value, r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", "an attribute name or a dotted path such as 'decoder.layers'")


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
    layers: PositiveInt | None = None
    """How many layers the model has, where you want it checked: a program that runs another
    number is refused (None: the program's own count)."""
    batch: PositiveInt | BatchConfig
    """Random int32 tokens ``[batch, seq_len]`` in ``[0, vocab)``, or a batch of your own
    (:class:`BatchConfig`)."""
    seq_len: PositiveInt | None = None
    vocab: PositiveInt | None = None
    loss: str | None = None
    """``"package.module:function"``, ``fn(outputs, batch) -> scalar``; default (null): the
    next-token cross-entropy of the logits on the tokens."""
    train_step: str | None = None
    """Or the team's own train step, ``"package.module:function"``: ``fn(state, batch) -> (state,
    loss)``, given a ``flax.training.train_state.TrainState`` whose ``apply_fn`` is the model's
    ``apply`` with the plan's checkpoints and whose ``tx`` is the spec's optimizer; the program
    measured is that step. Not with ``loss``."""
    logical_axis_rules: AxisRules | None = None
    """How the model's logical axis names map onto the mesh (see :data:`AxisRules`): over a
    mesh, its parameters are sharded as its ``nn.with_logical_partitioning`` metadata says,
    by these rules, and they are in force while its step is traced (``nn.logical_axis_rules``)."""

    _omitted_when_unset: ClassVar[tuple[str, ...]] = (
        "params_from", "optimizer", "train_step", "layers", "seq_len", "vocab")
    _import_paths = field_validator("model", "block", "loss", "train_step")(lambda value: _import_path(value))

    @model_validator(mode="after")
    def _batch_named(self) -> Any:
        return _check_batch(self)

    @field_validator("blocks")
    @classmethod
    def _attribute(cls, value: str | None) -> str | None:
        if value is None:
            return value
        return matching(value, r"[A-Za-z_]\w*", "a submodule or attribute name such as 'blocks'")

    @model_validator(mode="after")
    def _layers_named(self) -> LinenConfig:
        if self.block is None and self.blocks is None:
            raise ValueError("name the model's layers: block: 'package.module:Block' or blocks: ATTRIBUTE")
        return self


class MaxTextConfig(_WorkloadConfig):
    """MaxText's own model and train step (see ``workloads/maxtext.py``), named as MaxText names
    it: ``model_name`` (``llama3.1-8b``) or a ``config`` file, plus ``overrides`` (any key of
    MaxText's config, as its train command takes them). MaxText checks them: a key or value it
    refuses is a spec error quoting its reason."""

    kind: Literal["maxtext"]
    model_name: str | None = None
    """MaxText's ``model_name`` (its ``configs/models/``); None: the config's own."""
    config: str | None = None
    """A MaxText config file (YAML); None: MaxText's ``base.yml``. Relative to the spec's folder
    in a spec file."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """MaxText settings over the config's, e.g. ``{max_target_length: 2048, attention: flash}``.
    A candidate's remat, batch and mesh settings are laid over these."""

    @field_validator("config")
    @classmethod
    def _config_absolute(cls, value: str | None) -> str | None:
        return None if value is None else os.path.abspath(os.path.expanduser(value))

    @field_validator("optimizer")
    @classmethod
    def _maxtext_optimizer(cls, value: OptimizerConfig | None) -> None:
        if value is not None:
            raise ValueError("MaxText trains with its own optimizer: set opt_type and its keys in overrides")
        return value

    def model_keys(self) -> dict[str, Any]:
        """The keys given to MaxText's loader: ``model_name`` (where given), then the overrides."""
        return {**({"model_name": self.model_name} if self.model_name else {}), **self.overrides}


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
    | Annotated[MaxTextConfig, Tag("maxtext")]
    | Annotated[FactoryConfig, Tag("factory")],
    Discriminator(
        _workload_tag,
        custom_error_type="workload_kind",
        custom_error_message="expected kind: transformer, mlp, nnx, linen or maxtext, or factory: 'package.module:function'",
    ),
]
