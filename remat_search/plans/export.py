"""A plan written for where it is used: remat-search's JSON, YAML, or a MaxText config.

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
from remat_search.plans.plan import RematPlan

Format = Literal["json", "yaml", "maxtext"]
FORMATS: tuple[Format, ...] = ("json", "yaml", "maxtext")
MAXTEXT_NAMES = (
    "decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj", "context", "out_proj",
    "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo",
)
"""The tensors MaxText's ``remat_policy: custom`` sets one by one (its ``base.yml``)."""
PINNED = "decoder_layer_input"
"""The layer's input, which MaxText keeps on the device whatever the policy: the points remat starts from."""


def export(plan: RematPlan, form: Format) -> str:
    """``plan`` as ``form`` writes it (a :class:`SpecError` naming ``--format`` where a plan
    has no such form)."""
    if form == "json":
        return plan.to_json()
    if form == "yaml":
        return yaml.safe_dump(json.loads(plan.to_json()), sort_keys=False).rstrip("\n")
    return yaml.safe_dump(maxtext(plan), sort_keys=False).rstrip("\n")


def maxtext(plan: RematPlan) -> dict[str, str]:
    """MaxText's remat settings of ``plan``: ``{remat_policy: full}``, or ``remat_policy:
    custom`` with ``device``, ``offload`` or ``remat`` for each of :data:`MAXTEXT_NAMES`."""
    kinds = {str(layer) for layer in plan.layers}
    if len(kinds) > 1:
        raise SpecError(
            f"--format maxtext: the plan gives its layers {len(kinds)} different policies ({plan.summary()}), "
            "and MaxText applies one to every decoder layer; use json or yaml with RematPlan.wrap"
        )
    layer = plan.layers[0]
    if layer.kind == "full":
        return {"remat_policy": "full"}
    if layer.kind == "function":
        raise SpecError(
            f"--format maxtext: policy {layer} is a function of your own, which MaxText's config cannot name "
            "(it has device/offload/remat per tensor name); use json or yaml"
        )
    if layer.kind not in ("names", "offload", "per_name"):
        raise SpecError(
            f"--format maxtext: policy {layer.kind!r} has no MaxText custom form (it chooses by operation, "
            "not by MaxText's tensor names); use json or yaml"
        )
    foreign = sorted(set(layer.tensor_names) - set(MAXTEXT_NAMES))
    if foreign:
        raise SpecError(f"--format maxtext: {foreign} are not MaxText's tensor names ({', '.join(MAXTEXT_NAMES)})")
    device = set(layer.names) if layer.kind in ("names", "per_name") else set()
    offload = set(layer.offload) if layer.kind == "per_name" else set(layer.names) - device
    settings = {name: "device" if name in device else "offload" if name in offload else "remat" for name in MAXTEXT_NAMES}
    if settings[PINNED] == "remat":
        settings[PINNED] = "device"
    return {"remat_policy": "custom", **settings}
