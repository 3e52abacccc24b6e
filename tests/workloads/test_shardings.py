"""A model's own shardings over a mesh: linen logical partitioning and NNX ``out_sharding``
metadata, mapped by the spec's ``logical_axis_rules``, instead of the built-in FSDP heuristic;
``run`` and ``show`` say which was used. Compiled for a TPU v5e 2x2 by the real TPU compiler."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import pytest

import remat_search
from remat_search import RematPlan, build_workload
from remat_search.measure.executables import Executables, measure
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig, TpuTarget
from remat_search.spec.workloads import LinenConfig, NnxConfig
from remat_search.targets.base import target_of

from tests.conftest import spec_dict, write_spec
from tests.models.sharded import PARTITIONS, RULES

V5E = TpuTarget(platform="tpu", topology="v5e:2x2")
MESH = {"fsdp": 2, "tensor": 2}
ARGS = {"vocab": 256, "layers": 2, "d_model": 256, "d_ff": 512}
SHAPES = {"embedding": (256, 256), "wi": (256, 512), "wo": (512, 256), "head": (256, 256)}
LINEN = {"kind": "linen", "model": "tests.models.sharded:LinenLM", "block": "tests.models.sharded:LinenBlock",
         "args": ARGS, "batch": 8, "seq_len": 16, "vocab": 256, "logical_axis_rules": RULES}
NNX = {"kind": "nnx", "model": "tests.models.sharded:NnxLM", "args": ARGS, "batch": 8, "seq_len": 16, "vocab": 256,
       "logical_axis_rules": RULES}


def _state_bytes_per_chip(ways: Any) -> int:
    """Parameters, AdamW's two moments: 3 float32 copies of every kernel, each split
    ``ways(kernel)`` ways (the count scalars left out: a few bytes)."""
    kernels = [*(["embedding", "head"]), *(["wi", "wo"] * ARGS["layers"])]
    return sum(3 * 4 * math.prod(SHAPES[k]) // ways(k) for k in kernels)


def _own_ways(kernel: str) -> int:
    """How many ways the rules split ``kernel``, read from the test's own tables."""
    rules = {name: target for name, target in RULES}
    return math.prod(MESH.get(rules[name], 1) if isinstance(rules[name], str) else 1 for name in PARTITIONS[kernel])


@pytest.mark.parametrize("config", [LINEN, NNX], ids=["linen", "nnx"])
def test_a_models_own_partitioning_sets_its_per_chip_state(config: dict[str, Any]) -> None:
    model = (LinenConfig if config["kind"] == "linen" else NnxConfig).model_validate(config)
    workload = build_workload(model)
    target = target_of(V5E)
    executables = Executables(workload, target=target, mesh=target.mesh(MESH))
    m = measure(executables, RematPlan.uniform("full", 2), budget=2**34, timing=TimingConfig(), gradient_tolerance=1e-3)
    assert m.status == "measured", m.error
    assert workload.sharding_source() == "the model's own partitioning of its parameters"
    tokens = config["batch"] // MESH["fsdp"] * config["seq_len"] * 4  # int32, the batch over fsdp
    own, heuristic = _state_bytes_per_chip(_own_ways), _state_bytes_per_chip(lambda k: MESH["fsdp"])
    assert own < 0.7 * heuristic  # the rules split the blocks' kernels 4 ways, the heuristic 2
    assert m.memory is not None and m.memory.argument - tokens == pytest.approx(own, rel=0.01)


def test_run_and_show_say_the_shardings_came_from_the_model(tmp_path: Path, storage_url: str, cli: Any) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, workload=LINEN, target={"platform": "tpu", "topology": "v5e:2x2"}, mesh=MESH, budget=None,
        trials=2, confirm={"top": 0}, space={"layout": "uniform", "choices": ["none", "full"]},
    ))
    result = cli("run", str(spec))
    assert result.exit_code == 0, result.output
    line = ("shardings over mesh {'fsdp': 2, 'tensor': 2} of devices [0, 1, 3, 2] (jax.make_mesh's order): "
            "the model's own partitioning of its parameters")
    assert line in result.stdout
    shown = cli("show", "--study", "tiny", "--storage", storage_url)
    assert shown.exit_code == 0 and line in shown.stdout, shown.output


def test_the_heuristic_is_named_where_the_model_has_no_partitioning(storage_url: str) -> None:
    report = remat_search.run(parse_spec(spec_dict(
        storage_url, target={"platform": "tpu", "topology": "v5e:2x2"}, mesh={"fsdp": 4}, budget=None, trials=1,
        confirm={"top": 0}, space={"layout": "uniform", "choices": ["full"]},
    )))
    assert report.device["shardings"].startswith("FSDP heuristic")


@pytest.mark.parametrize(("config", "message"), [
    (LINEN, ("workload.logical_axis_rules: the model partitions its parameters by logical names "
             "['embed', 'mlp', 'vocab']; map them onto the mesh")),
    (NNX, ("workload.logical_axis_rules: the model partitions parameter ['blocks'][0]['wi']['kernel'] over 'embed', "
           "which is no mesh axis (spec.mesh has fsdp, tensor; the rules map onto none)")),
], ids=["linen", "nnx"])
def test_logical_names_without_rules_are_one_line_errors_and_nothing_is_written(
    tmp_path: Path, storage_url: str, cli: Any, config: dict[str, Any], message: str
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, workload={**config, "logical_axis_rules": None}, target={"platform": "tpu", "topology": "v5e:2x2"},
        mesh=MESH, budget=None, trials=1, space={"layout": "uniform", "choices": ["full"]},
    ))
    result = cli("run", str(spec))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*"))


@pytest.mark.parametrize("config", [LINEN, NNX], ids=["linen", "nnx"])
def test_an_annotated_model_searches_on_one_cpu_device(storage_url: str, config: dict[str, Any]) -> None:
    """No mesh: the metadata is kept and nothing is sharded (NNX would shard eagerly at construction)."""
    small = {**config, "args": {"vocab": 64, "layers": 2, "d_model": 16, "d_ff": 32}, "vocab": 64}
    report = remat_search.run(parse_spec(spec_dict(
        storage_url, workload=small, trials=2, confirm={"top": 0}, space={"layout": "uniform", "choices": ["none", "full"]},
    )))
    assert [t.status for t in report.trials] == ["measured", "measured"]
    assert report.device.get("shardings") is None


def test_the_models_own_activation_constraints_apply_while_its_step_is_traced() -> None:
    """``nn.with_logical_constraint`` is a no-op without a mesh in context: ``tracing()`` gives
    it the target's (abstract) mesh and the rules, so the compiled step keeps the constraints."""
    workload = build_workload(LinenConfig.model_validate(LINEN))
    mesh = target_of(V5E).mesh(MESH)
    workload.use_mesh(mesh)
    step = workload.step(RematPlan.uniform("full", 2), mesh)
    with workload.tracing():
        constrained = step.lower(*workload.abstract_inputs(mesh)).as_text()
    unconstrained = step.lower(*workload.abstract_inputs(mesh)).as_text()
    assert constrained.count("sharding_constraint") >= workload.layers and "sharding_constraint" not in unconstrained


@pytest.mark.parametrize(("workload", "field"), [
    ({**LINEN, "logical_axis_rules": [["embed", "ten sr"]]},
     "spec.workload.logical_axis_rules.0.1: expected a mesh axis name of letters, digits and '_' such as fsdp, got 'ten sr'"),
    ({**NNX, "logical_axis_rules": "embed: fsdp"}, "spec.workload.logical_axis_rules: Input should be a valid tuple"),
    ({"kind": "transformer", "layers": 2, "d_model": 32, "heads": 2, "d_ff": 64, "seq_len": 32, "batch": 4,
      "vocab": 64, "attention": "fast"}, "spec.workload.attention"),
], ids=["bad-mesh-axis", "not-a-list", "attention"])
def test_bad_rules_or_attention_are_one_line_errors_and_nothing_is_written(
    tmp_path: Path, storage_url: str, cli: Any, workload: dict[str, Any], field: str
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(storage_url, workload=workload))
    result = cli("run", str(spec))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and field in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*"))


def test_the_measurement_cache_keys_on_the_shardings() -> None:
    """The same workload on the same mesh sharded another way is another cache entry."""
    from remat_search.store.cache import cache_key
    from remat_search.measure.device import DeviceInfo, sharding_digest

    workload = build_workload(LinenConfig.model_validate(LINEN))
    mesh = target_of(V5E).mesh(MESH)
    digest = sharding_digest(workload, mesh)
    assert digest and sharding_digest(workload, None) == ""
    device = DeviceInfo(target="v5e:2x2", platform="tpu", device_kind="TPU v5 lite", device_count=4, mesh=MESH,
                        memory_limit=None, executes=False, jax_version="0", workload_fingerprint="w",
                        shardings="the model's own partitioning of its parameters", sharding_digest=digest)
    other = device.model_copy(update={"sharding_digest": "0" * 16})
    assert cache_key(device, "p") != cache_key(other, "p")


# MaxText's way: rules naming every axis it knows (12), each name mapped onto several; on a mesh
# of fsdp and tensor alone they split the kernels as RULES does, the other axes at size 1.
TWELVE_AXES_RULES = [
    ["batch", ["data", "stage", "fsdp", "fsdp_transpose", "expert"]],
    ["embed", ["fsdp", "fsdp_transpose", "sequence", "context", "expert"]],
    ["mlp", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]],
    ["vocab", ["context_autoregressive"]],
]


@pytest.mark.parametrize("config", [LINEN, NNX], ids=["linen", "nnx"])
def test_rules_may_name_the_axes_a_model_names_those_the_mesh_lacks_at_size_1(
    storage_url: str, config: dict[str, Any]
) -> None:
    axes = {a for _, target in TWELVE_AXES_RULES for a in target}
    assert len(axes) == 12
    spec = parse_spec(spec_dict(storage_url, workload={**config, "logical_axis_rules": TWELVE_AXES_RULES},
                                target={"platform": "tpu", "topology": "v5e:2x2"}, mesh=MESH))
    mesh = target_of(V5E).mesh(spec.mesh)

    def specs(workload_config: Any) -> list[str]:
        workload = build_workload(workload_config)
        workload.use_mesh(mesh)
        return [str(s.spec) for s in jax.tree.leaves(workload.input_shardings(mesh))]

    assert specs(spec.workload) == specs(spec.workload.model_copy(update={"logical_axis_rules": RULES}))


def test_a_factorys_axes_the_mesh_lacks_are_size_1_and_no_error_names_a_field_it_lacks() -> None:
    """A factory maps its own logical names (MaxText's rules name 12 axes): whatever mesh axes
    its partitioning names, those the spec's mesh leaves out are not split over."""
    from jax.sharding import PartitionSpec as P

    from remat_search.spec.workloads import MlpConfig
    from tests.factories import TensorParallelMlp

    class Staged(TensorParallelMlp):
        def param_partitioning(self) -> Any:
            return [{"wi": P("stage", ("tensor", "tensor_transpose")), "wo": P("tensor", "context")}
                    for _ in range(self.layers)]

    workload = Staged(MlpConfig(kind="mlp", layers=2, width=64, hidden=256, batch=8))
    mesh = target_of(V5E).mesh({"data": 2, "tensor": 2})
    workload.use_mesh(mesh)
    (params, _), _ = workload.input_shardings(mesh)
    assert [str(p.spec) for p in jax.tree.leaves(params)] == ["P(None, 'tensor')", "P('tensor', None)"] * 2
