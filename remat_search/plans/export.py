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
from remat_search.plans.policy import POLICIES

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
    custom`` with ``device``, ``offload`` or ``remat`` for each of :data:`MAXTEXT_NAMES`, as its
    policy kind's ``maxtext`` hook says (``plans.policy.PolicyKind``)."""
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
