"""A plan written for where it is used: remat-search's JSON, YAML, or MaxText's settings (a
config's lines, or its train command's ``key=value`` arguments).

MaxText applies one remat policy to every decoder layer; its ``remat_policy: custom`` says,
for each of its named tensors, whether it stays on the device, is offloaded to host memory,
or is recomputed. A plan is expressible that way when every layer has the same policy and
that policy is a choice about MaxText's names (``names``, ``offload``, ``per_name``), or
``full`` (MaxText's own ``remat_policy: full``); :func:`maxtext` says why not otherwise.
"""

from __future__ import annotations

import json
from typing import Literal

import yaml

from remat_search.errors import SpecError
from remat_search.plans.configuration import Configuration
from remat_search.plans.plan import RematPlan
from remat_search.plans.policy import POLICIES

Format = Literal["json", "yaml", "maxtext", "maxtext-args"]
FORMATS: tuple[Format, ...] = ("json", "yaml", "maxtext", "maxtext-args")
MAXTEXT_NAMES = (
    "decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj", "kv_proj", "query_wa_proj",
    "kv_wa_proj", "mla_q", "mla_kv", "context", "attention_out", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1",
    "mlpwo", "moe_x_sorted", "moe_routing_maps", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo",
    "indexer_cutoff_threshold", "engram",
)
"""The tensors MaxText's ``remat_policy: custom`` sets one by one (MaxText 0.2.5's
``RematAndOffload``: every field valued ``remat`` / ``device`` / ``offload``). The export writes
each of them, so that pasting an answer replaces whatever a config had set for any
(``tests/workloads/test_maxtext.py`` checks the list against the installed MaxText)."""
PINNED = "decoder_layer_input"
"""The layer's input, which MaxText keeps on the device whatever the policy: the points remat starts from."""
QKV = ("query_proj", "key_proj", "value_proj")
MAXTEXT_PRESETS: dict[str, tuple[str, ...] | None] = {
    "full": None,
    "save_qkv_proj": QKV,
    "save_dot_except_mlp": (*QKV, "out_proj"),
    "save_dot_except_mlpwi": (*QKV, "out_proj", "mlpwo"),
    "save_dot_with_context_except_mlp": (*QKV, "context", "out_proj"),
    "save_out_proj": ("out_proj",),
}
"""MaxText's ``remat_policy`` presets that a policy here states exactly, by MaxText's name: the
tensors each saves on the device (``names``), or None for ``full``. MaxText's lists also name
``qkv_proj``, the fused projection it tags only with ``fused_qkv: true``; it is left out, so each
is MaxText's preset on a model with separate projections (``fused_qkv: false``, its default).
Left out: ``minimal`` and ``minimal_with_context``, which in MaxText 0.2.5 save names too (its
decoder's ``minimal_policy``: every projection's and MLP matmul's output, of both MLP forms,
``mlpwi`` and ``mlpwi_0``/``mlpwi_1``, which no one model tags: write ``{label: minimal, names:
[...]}`` with your model's); and ``minimal_offloaded`` and ``qkv_proj_offloaded``, which offload
(only a GPU or a TPU can; write the latter as ``{label: qkv_proj_offloaded, offload: [query_proj,
key_proj, value_proj]}``)."""
MAXTEXT_ICI = {
    **{axis: f"ici_{axis}_parallelism" for axis in (
        "diloco", "data", "fsdp", "fsdp_transpose", "sequence", "context", "context_usp_ulysses",
        "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive",
    )},
    "stage": "ici_pipeline_parallelism",
}
"""MaxText's mesh axes and the setting that sizes each within a slice (MaxText 0.2.5's
``ici_*_parallelism`` fields, every one: ``tests/workloads/test_maxtext.py`` checks them against
the installed MaxText)."""
MaxTextValue = str | int | float | bool


def export(plan: RematPlan, form: Format) -> str:
    """``plan`` as ``form`` writes it (a :class:`SpecError` naming ``--format`` where a plan
    has no such form)."""
    if form == "json":
        return plan.to_json()
    if form == "yaml":
        return yaml.safe_dump(json.loads(plan.to_json()), sort_keys=False).rstrip("\n")
    if form == "maxtext-args":  # as MaxText's train command takes them, after its config file
        written = {key: str(value).lower() if isinstance(value, bool) else value for key, value in maxtext(plan).items()}
        return " ".join(f"{key}={value}" for key, value in written.items())
    return yaml.safe_dump(maxtext(plan), sort_keys=False).rstrip("\n")


def maxtext(plan: RematPlan) -> dict[str, MaxTextValue]:
    """MaxText's settings of ``plan``: its remat settings (:func:`maxtext_remat`), then, where
    the plan carries a configuration, its batch, accumulation and mesh
    (:func:`maxtext_configuration`)."""
    settings: dict[str, MaxTextValue] = dict(maxtext_remat(plan))
    if plan.configuration is not None:
        settings.update(maxtext_configuration(plan.configuration))
    return settings


def maxtext_configuration(configuration: Configuration) -> dict[str, MaxTextValue]:
    """MaxText's settings of a configuration: ``per_device_batch_size``,
    ``gradient_accumulation_steps`` and ``ici_<axis>_parallelism`` for each mesh axis, in the
    mesh's order, then 1 for every other axis of :data:`MAXTEXT_ICI` (an axis MaxText has no
    setting for is a :class:`SpecError`): each written even at 1, so that pasting it replaces
    whatever the config had (its ``ici_data_parallelism: 2``, its ``ici_fsdp_parallelism: -1``);
    then the configuration's own settings (MaxText's memory knobs, as searched).

    MaxText's micro-batch is ``per_device_batch_size`` × every device, while a configuration's
    ``batch`` is per data-parallel device (``data`` × ``fsdp``): over a mesh of those axes only
    the two are equal, and over a ``tensor`` axis, say, the per-device batch is the share of
    each device (a fraction where it does not divide, which MaxText takes)."""
    foreign = [axis for axis, _ in configuration.mesh if axis not in MAXTEXT_ICI]
    if foreign:
        raise SpecError(
            f"--format maxtext: mesh axis {foreign[0]!r} has no MaxText ici_*_parallelism setting "
            f"(its axes: {', '.join(MAXTEXT_ICI)}); use json or yaml"
        )
    share = configuration.batch * configuration.data_parallel / configuration.devices
    return {
        "per_device_batch_size": int(share) if share.is_integer() else share,
        "gradient_accumulation_steps": configuration.accumulation,
        **{MAXTEXT_ICI[axis]: size for axis, size in configuration.mesh},
        **{setting: 1 for axis, setting in MAXTEXT_ICI.items() if axis not in dict(configuration.mesh)},
        **dict(configuration.settings),
    }


def maxtext_remat(plan: RematPlan) -> dict[str, str]:
    """MaxText's remat settings of ``plan``: ``{remat_policy: full}``, or ``remat_policy:
    custom`` with ``device``, ``offload`` or ``remat`` for each of :data:`MAXTEXT_NAMES`, as its
    policy kind's ``maxtext`` hook says (``plans.policy.PolicyKind``). A nested plan, or one of
    several policies, is a :class:`SpecError` saying why MaxText cannot have it."""
    if plan.layout != "flat":
        raise SpecError(
            f"--format maxtext: the plan is {plan.layout} ({plan.summary()}), and MaxText checkpoints each "
            "decoder layer alone; use json or yaml with apply_layers"
        )
    kinds = {str(layer) for layer in plan.layers}
    if len(kinds) > 1:
        raise SpecError(
            f"--format maxtext: the plan gives its layers {len(kinds)} different policies ({plan.summary()}), "
            "and MaxText applies one to every decoder layer; use json or yaml with RematPlan.wrap"
        )
    layer = plan.layers[0]
    kind = POLICIES[layer.kind]
    if kind.maxtext is None:
        shown = str(layer) if kind.labelled else repr(layer.kind)
        raise SpecError(f"--format maxtext: policy {shown} {kind.no_maxtext}; use json or yaml")
    form = kind.maxtext(layer)
    if form == "full":
        return {"remat_policy": "full"}
    device, offload = form
    foreign = sorted((device | offload) - set(MAXTEXT_NAMES))
    if foreign:
        raise SpecError(f"--format maxtext: {foreign} are not MaxText's tensor names ({', '.join(MAXTEXT_NAMES)})")
    settings = {name: "device" if name in device else "offload" if name in offload else "remat" for name in MAXTEXT_NAMES}
    if settings[PINNED] == "remat":
        settings[PINNED] = "device"
    return {"remat_policy": "custom", **settings}
