"""TPU targets compiled ahead of time by the real TPU compiler (libtpu), on this CPU-only host."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import pytest

import remat_search
from remat_search.report.text import estimate_mark
from remat_search import LayerPolicy, RematPlan, SpecError, build_workload
from remat_search.measure.executables import Executables, measure
from remat_search.measure.program import io_bytes
from remat_search.measure.measurement import Measurement
from remat_search.report.text import describe_trial
from remat_search.report.results import TrialResult
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig, TpuTarget
from remat_search.spec.workloads import TransformerConfig
from remat_search.targets.chips import CHIPS
from remat_search.targets.base import target_of
from remat_search.targets.tpu import TpuAotTarget
from remat_search.units import format_bytes

from tests.conftest import TINY_TRANSFORMER, spec_dict, write_spec

pytestmark = pytest.mark.slow  # compiles for TPU topologies

V5E = TpuTarget(platform="tpu", topology="v5e:2x2")
HBM_V5E = int(15.75 * 2**30)  # "available HBM (15.75G)", as libtpu reports a v5e chip
QKV = LayerPolicy(kind="names", names=("query_proj", "key_proj", "value_proj"))
# Attention-heavy enough that activations, not weights, set the per-chip peak.
SMALL = TransformerConfig(kind="transformer", layers=2, d_model=128, heads=4, d_ff=512, seq_len=256, batch=16, vocab=256,
                          attention="dense")
# 2 layers of 192 sequences × 1024 tokens per chip: too big for 16 GiB unless recomputed
# (jax 0.10.2, libtpu 0.0.42.1: no remat needs 20.4 GiB, full remat peaks at 14.4 GiB).
LARGE = TransformerConfig(kind="transformer", layers=2, d_model=512, heads=8, d_ff=2048, seq_len=1024, batch=768, vocab=256,
                          attention="dense")


def _measure(config: TransformerConfig, policy: object, mesh_axes: dict | None = None, target: TpuTarget = V5E) -> Measurement:
    workload = build_workload(config)
    target = target_of(target)
    executables = Executables(workload, target=target, mesh=target.mesh(mesh_axes))
    plan = RematPlan.uniform(policy, workload.layers)
    m = measure(executables, plan, budget=HBM_V5E, timing=TimingConfig(), gradient_tolerance=1e-3)
    assert executables.build(plan).executable is None  # nothing kept that could run for a TPU target
    return m


@pytest.fixture(scope="module")
def small() -> dict[str, Measurement]:
    """SMALL compiled for a v5e 2x2 under three policies (one TPU compile each, ~6 s)."""
    return {label: _measure(SMALL, policy) for label, policy in (("none", "none"), ("full", "full"), ("save_qkv", QKV))}


def test_per_chip_peak_orders_full_names_none(small: dict[str, Measurement]) -> None:
    peak = {label: m.peak_bytes for label, m in small.items()}
    assert peak["full"] < peak["save_qkv"] < peak["none"]


def test_tpu_measurements_are_compiled_and_estimated_never_run(small: dict[str, Measurement]) -> None:
    m = small["full"]
    assert m.status == "measured" and m.time_source == "estimated" and m.step_times == ()
    assert m.memory.compiler_peak is not None and m.memory.breakdown_sum > 0
    assert m.memory.peak == m.memory.compiler_peak and m.memory.peak_source == "compiler_peak"  # tests/test_tpu_peak.py
    # The per-instruction model's time, with the whole-program roofline beside it.
    chip, e = CHIPS["v5e"], m.estimate
    assert m.time_model == "fusions" and e is not None and m.estimated_seconds == e.seconds > 0
    assert e.roofline_seconds == pytest.approx(max(m.flops / chip.bf16_flops, m.bytes_accessed / chip.hbm_bytes_per_second))
    assert e.seconds == pytest.approx(e.compute_seconds + e.collective_seconds) and e.host_bytes == 0


def test_offload_reports_the_compilers_host_memory_beside_device_memory() -> None:
    tiny = TransformerConfig(**TINY_TRANSFORMER)
    qkv = ("query_proj", "key_proj", "value_proj")
    offload = _measure(tiny, LayerPolicy(kind="offload", names=qkv))
    saved = _measure(tiny, LayerPolicy(kind="names", names=qkv))
    host = offload.memory
    # jax 0.10.2, libtpu 0.0.42.1: 96 KiB of host temporaries, the offloaded activations.
    assert host.host_temp > 0 and host.host_total == host.host_temp
    assert saved.memory.host_total == 0
    offloading = RematPlan.uniform(LayerPolicy(kind="offload", names=qkv), tiny.layers)
    shown = describe_trial(TrialResult(number=0, status="measured", measurement=offload, plan=offloading))
    assert f"host memory, from the compiler: {format_bytes(host.host_total)}" in shown
    # The estimate prices the transfers on the host link: the activations out and back (their
    # logical bytes; the host buffers the compiler counts are padded to its tiles).
    assert 0 < offload.estimate.host_bytes <= 2 * host.host_temp and "waiting for host transfers" in shown
    kept = describe_trial(TrialResult(number=1, status="measured", measurement=saved,
                                      plan=RematPlan.uniform(LayerPolicy(kind="names", names=qkv), tiny.layers)))
    assert "host memory" not in kept and "host transfers" not in kept and saved.estimate.host_bytes == 0


def test_a_targets_host_link_prices_the_same_transfers_and_says_so(storage_url: str) -> None:
    """``target.host_link`` (a link figure the user knows) prices an offloading plan's transfers
    at it: the same program and bytes, the link busy for 15/64 of the time the model's assumed 15
    GB/s takes, `show` saying which; and a study at one link does not take another's kept
    measurements (the target's name carries the link, and the cache's key with it)."""
    tiny = TransformerConfig(**TINY_TRANSFORMER)
    offload = LayerPolicy(kind="offload", names=("query_proj", "key_proj", "value_proj"))
    assumed = _measure(tiny, offload)
    fast = _measure(tiny, offload, target=V5E.model_copy(update={"host_link": 64 * 10**9}))
    one, other = assumed.estimate, fast.estimate
    assert assumed.program_digest == fast.program_digest and other.host_bytes == one.host_bytes > 0
    assert other.host_seconds == pytest.approx(one.host_seconds * 15 / 64)
    assert other.compute_seconds == one.compute_seconds and other.host_wait_seconds <= one.host_wait_seconds
    plan = RematPlan.uniform(offload, tiny.layers)
    for m, said in ((assumed, "at 15 GB/s"), (fast, "at 64 GB/s")):
        assert said in describe_trial(TrialResult(number=0, status="measured", measurement=m, plan=plan))

    space = {"layout": "uniform", "choices": [{"label": "offload_qkv", "offload": ["query_proj", "key_proj", "value_proj"]}]}
    reports = [remat_search.run(parse_spec(spec_dict(
        storage_url, study=f"link-{(link or 'assumed').removesuffix('/s')}", space=space, trials=1, confirm={"top": 0},
        target={"platform": "tpu", "topology": "v5e:2x2", **({"host_link": link} if link else {})},
    ))) for link in (None, "64GB/s")]
    assert [r.device["target"] for r in reports] == ["v5e:2x2", "v5e:2x2, host link 64GB/s"]
    first, second = (r.trials[0] for r in reports)
    assert second.cached_from is None and second.measurement.estimate.host_seconds < first.measurement.estimate.host_seconds
    with pytest.raises(SpecError, match=r"^spec.target: study 'link-assumed' already exists with another target"):
        remat_search.run(parse_spec(spec_dict(
            storage_url, study="link-assumed", space=space, trials=2, confirm={"top": 0},
            target={"platform": "tpu", "topology": "v5e:2x2", "host_link": "64GB/s"},
        )))


def test_too_big_without_remat_is_infeasible_with_the_compilers_bytes_in_full_while_full_fits() -> None:
    none = _measure(LARGE, "none")
    assert none.status == "over_budget" and none.memory is None
    assert none.oom_available_bytes == HBM_V5E and none.oom_temp_bytes > HBM_V5E  # "HLO temporaries (20.36G)"
    mesh = target_of(V5E).mesh(None)
    abstract = build_workload(LARGE).abstract_inputs(mesh)
    arguments = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    assert none.peak_bytes == none.oom_required_bytes >= none.oom_temp_bytes + arguments  # comparable with peaks
    full = _measure(LARGE, "full")
    assert full.status == "measured" and full.peak_bytes <= HBM_V5E
    # What is added to the temporaries is what the compiler counts when a plan fits, but for tile padding.
    lowered = build_workload(LARGE).step(RematPlan.uniform("full", LARGE.layers), mesh).lower(*abstract)
    compiled = full.memory.argument + full.memory.output - full.memory.alias
    assert 0.99 * compiled <= io_bytes(lowered, abstract) <= compiled


def test_fsdp_divides_per_chip_argument_bytes_by_the_mesh() -> None:
    # Widths that stay multiples of the TPU's 128-lane tiles when split 4 ways: no padding.
    config = TransformerConfig(kind="transformer", layers=2, d_model=512, heads=4, d_ff=2048,
                               seq_len=32, batch=8, vocab=1024)
    replicated = _measure(config, "full", {"data": 4}).memory
    sharded = _measure(config, "full", {"fsdp": 4}).memory
    tokens = config.batch // 4 * (config.seq_len + 1) * 4  # int32 batch, split 4 ways in both
    state_replicated, state_sharded = replicated.argument - tokens, sharded.argument - tokens
    assert state_replicated / state_sharded == pytest.approx(4, rel=0.02)


@pytest.mark.parametrize("budget", [None, "device"])
def test_a_tpu_search_defaults_its_budget_to_the_chips_hbm(
    storage_url: str, budget: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_spec(spec_dict(
        storage_url, target={"platform": "tpu", "topology": "v5e:2x2"}, budget=budget, trials=3,
        workload={**TINY_TRANSFORMER, "batch": 8, "dtype": "bfloat16"},
        space={"layout": "uniform", "choices": ["none", "full", "dots"]},
    ))
    report = remat_search.run(spec)
    assert report.budget == HBM_V5E
    assert report.device["target"] == "v5e:2x2" and report.device["device_kind"] == "TPU v5 lite"
    assert report.device["executes"] is False and report.device["mesh"] == {"data": 4}
    assert [t.measurement.time_source for t in report.trials] == ["estimated"] * 3
    assert report.best(HBM_V5E).step_seconds == min(t.step_seconds for t in report.trials)
    # A query's `device` is the memory limit the study stored of its device.
    assert remat_search.best_plan(spec.study, "device", storage_url, check=False) == report.best(HBM_V5E)
    # Nothing runs on a TPU target: no step times to confirm, said before a worker starts.
    monkeypatch.setattr("remat_search.search.confirm.runner_for", None)  # a worker would fail differently
    with pytest.raises(SpecError, match=r"^study: 'tiny' compiles for v5e:2x2, where nothing runs here; there are no "):
        remat_search.confirm_study(spec.study, storage=storage_url)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"target": {"platform": "tpu", "topology": "v9:2x2"}}, "spec.target.topology: unknown TPU generation"),
     ({"target": {"platform": "tpu", "topology": "v5e:3x3"}}, "spec.target.topology: libtpu does not know 'v5e:3x3'"),
     ({"target": {"platform": "tpu", "topology": "v5e-2x2"}}, "spec.target.topology: expected a TPU topology such as v5e:2x4"),
     ({"target": "tpu"}, "spec.target: expected local or {platform: tpu"),
     ({"target": {"platform": "tpu", "topology": "v5e:2x2", "host_link": "fast"}},
      "spec.target.host_link: expected bytes a second such as 32GB/s, 64GB/s or 3.2e10, got 'fast'"),
     ({"target": {"platform": "tpu", "topology": "v5e:2x2", "keep_programs": "maybe"}},
      "spec.target.keep_programs: Input should be a valid boolean, unable to interpret input (got 'maybe')"),
     ({"target": {"platform": "tpu", "topology": "v5e:2x2"}, "mesh": {"data": 2, "fsdp": 4}},
      "spec.mesh: {'data': 2, 'fsdp': 4} spans 8 devices, the target has 4"),
     ({"target": {"platform": "tpu", "topology": "v5e:2x2"}, "mesh": {"model layer": 4}},
      "spec.mesh: expected a mesh axis name of letters, digits and '_' such as fsdp, got 'model layer'"),
     ({"target": {"platform": "tpu", "topology": "v5e:2x2"}, "mesh": {"data": 4},
       "workload": {**TINY_TRANSFORMER, "batch": 6}}, "spec.mesh: the batch dimension (6) must be divisible"),
     ({"target": {"platform": "tpu", "topology": "v5e:2x2"}, "budget": "20GiB"},
      "spec.budget: 20.0 GiB is more than the 15.8 GiB a TPU v5 lite device has"),
     ({"budget": None}, "spec.budget: required here: cpu reports no memory limit"),
     ({"budget": "device"}, "spec.budget: required here: cpu reports no memory limit"),
     # A share of no remat's peak (an MLP whose activations take 49.7 GiB a chip) past the chip's HBM.
     ({"target": {"platform": "tpu", "topology": "v5e:2x2"}, "budget": "100%",
       "workload": {"kind": "mlp", "layers": 2, "width": 128, "hidden": 16384, "batch": 2097152},
       "space": {"layout": "uniform", "choices": ["none", "full"]}},
      "spec.budget: 49.7 GiB is more than the 15.8 GiB a TPU v5 lite device has for a program; leave budget out")],
)
def test_bad_targets_are_clean_errors(cli, tmp_path: Path, storage_url: str, change: dict, field: str) -> None:  # type: ignore[no-untyped-def]
    spec = spec_dict(storage_url)
    spec.update(change)
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and field in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*"))


def test_without_libtpu_a_tpu_target_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "libtpu", None)  # as if it were not installed
    with pytest.raises(SpecError, match=r"pip install 'remat-search\[tpu\]'"):
        TpuAotTarget(V5E).devices()


def test_a_factory_gets_the_targets_mesh_through_use_mesh_and_compiles_with_its_own_constraints(
    storage_url: str,
) -> None:
    """A tensor-parallel factory (hidden activations over ``tensor``) on a v5e:2x2 as
    ``{data: 2, tensor: 2}``: the mesh comes from the TPU topology through ``use_mesh``,
    before anything is traced, and the model overrides no sharding method."""
    from tests.factories import TensorParallelMlp, tensor_parallel

    assert not {"shardings", "input_shardings", "abstract_inputs"} & set(vars(TensorParallelMlp))
    workload = tensor_parallel()
    target = target_of(V5E)
    executables = Executables(workload, target=target, mesh=target.mesh({"data": 2, "tensor": 2}))
    (mesh,) = workload.used_meshes
    assert dict(mesh.shape) == {"data": 2, "tensor": 2} and {d.platform for d in mesh.devices.flat} == {"tpu"}
    m = measure(executables, RematPlan.uniform("full", 2), budget=HBM_V5E, timing=TimingConfig(), gradient_tolerance=1e-3)
    assert m.status == "measured" and m.time_source == "estimated", m.error
    # Its own shardings: parameters and Adam moments split over tensor, 2 ways (the heuristic,
    # with no fsdp axis, would replicate them); the batch x and y split over data.
    assert workload.sharding_source() == "the model's own partitioning of its parameters"
    state = 3 * 4 * sum(math.prod(a.shape) for a in jax.tree.leaves(workload.abstract_inputs()[0][0])) // 2
    batch = 2 * 4 * 64 * 4
    assert m.memory is not None and m.memory.argument - batch == pytest.approx(state, rel=0.01)

    report = remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:tensor_parallel"}, target={"platform": "tpu", "topology": "v5e:2x2"},
        mesh={"data": 2, "tensor": 2}, budget=None, trials=2, confirm={"top": 0},
        space={"layout": "uniform", "choices": ["none", "full"]},
    )))
    assert [t.status for t in report.trials] == ["measured", "measured"]
    assert report.device["mesh"] == {"data": 2, "tensor": 2}
    # MaxText's published v5e runs shard by FSDP alone: an estimate over a tensor axis is outside them.
    assert m.estimate is not None and m.estimate.outside == "tensors split 2 ways, no sample's more than 1"
    assert all(t.measurement.estimate.outside == m.estimate.outside for t in report.trials)
    assert estimate_mark(report.trials[0]).endswith(", outside its samples")
