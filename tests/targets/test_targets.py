"""Every kind of target (remat_search.targets.base.TARGETS) under one contract: the devices plans
are compiled for and a mesh over them, the memory per device, the compiler's version, the
verdict on a program over that memory, and one tiny plan measured: run and timed where the
target executes, compiled and estimated where it does not (a TPU topology, by libtpu on this
host: small compiles)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from remat_search import RunError, SpecError
from remat_search.store import cache
from remat_search.measure.executables import Executables, anchor_plan, measure
from remat_search.measure.measurement import judge
from remat_search.workloads.mlp import MlpWorkload
from remat_search.spec.models import TimingConfig, TpuTarget, target_kind
from remat_search.spec.workloads import MlpConfig
from remat_search.targets.base import TARGETS, Target, out_of_memory, target_class, target_of
from remat_search.targets.local import LocalTarget
from remat_search.targets.platform import is_cpu, is_tpu
from remat_search.targets.tpu import TpuAotTarget, hbm_of, probe_hbm

EXAMPLES: dict[type[Target], Any] = {
    LocalTarget: "local",
    TpuAotTarget: TpuTarget(platform="tpu", topology="v5e:2x2"),
}
"""A spec's ``target`` of each kind, as the contract runs it (a new kind adds one here)."""
TINY = MlpConfig(kind="mlp", layers=2, width=128, hidden=256, batch=16)


def test_every_kind_of_target_has_an_example() -> None:
    assert set(EXAMPLES) == {target_class(kind) for kind in TARGETS}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request: pytest.FixtureRequest) -> Target:
    config = EXAMPLES[target_class(request.param)]
    assert target_kind(config) == request.param
    made = target_of(config)  # the one place that picks the class
    assert type(made) is target_class(request.param)
    return made


def test_a_target_names_its_devices_and_meshes_them(target: Target) -> None:
    devices = target.devices()
    assert devices and {d.platform for d in devices} == {target.platform}
    assert target.name == ("local" if target.executes else EXAMPLES[type(target)].topology)
    mesh = target.mesh({"data": len(devices)})
    assert dict(mesh.shape) == {"data": len(devices)} and sorted(mesh.devices.flat, key=lambda d: d.id) == devices
    # placed as jax.make_mesh places them (over a TPU topology's links: not in id order)
    assert mesh.devices.tolist() == jax.make_mesh(mesh.devices.shape, ("data",), devices=devices).devices.tolist()
    default = target.mesh(None)
    assert default is None or default.size == len(devices)
    with pytest.raises(SpecError, match=r"spec\.mesh: .* spans"):
        target.mesh({"data": len(devices) + 1})


def test_a_target_states_its_memory_and_its_compiler(target: Target) -> None:
    limit = target.memory_limit(target.mesh({"data": len(target.devices())}))
    assert limit is None if is_cpu(target.platform) else limit > 2**30
    version = target.compiler_version()  # libtpu's where it compiles for TPU: part of the cache key
    assert (version is not None) == is_tpu(target.platform)


def test_a_target_refuses_a_program_over_its_memory_with_the_compilers_verdict(target: Target) -> None:
    mesh = target.mesh({"data": len(target.devices())})
    limit = target.memory_limit(mesh)
    too_big = jax.jit(lambda: jnp.zeros((2**38,), jnp.float32), out_shardings=NamedSharding(mesh, PartitionSpec()))
    if not is_tpu(target.platform):  # XLA:CPU (and XLA:GPU) states no verdict: memory is the runtime's to refuse
        try:
            too_big.lower().compile()
        except Exception as e:  # noqa: BLE001 - whatever it raises, it is no verdict
            assert out_of_memory(e) is None
        return
    with pytest.raises(Exception) as refused:  # noqa: PT011 - the compiler's own error type
        too_big.lower().compile()
    verdict = out_of_memory(refused.value)
    assert verdict is not None, f"no out-of-memory verdict in: {refused.value}"
    assert verdict.available == limit and verdict.temp > limit  # the memory the target states is the compiler's


def test_a_target_measures_a_plan_as_it_says(target: Target) -> None:
    executables = Executables(MlpWorkload(TINY), target=target, mesh=target.mesh(None))
    plan = anchor_plan(TINY.layers)  # the anchor and reference itself: one compile
    timing = TimingConfig(warmup=1, repeats=2)
    m = measure(executables, plan, budget=2**40, timing=timing, gradient_tolerance=1e-4)
    assert m.status == "measured" and m.peak_bytes > 0 and m.flops > 0
    assert (executables.build(plan).executable is not None) == target.executes
    if target.executes:
        assert m.time_source == "measured" and len(m.step_times) == 2 and m.grad_rel_error == 0.0
        assert m.estimate is None and m.estimated_seconds is None and m.time_model is None
    else:
        assert m.time_source == "estimated" and m.step_times == () and m.grad_rel_error is None
        assert m.estimate is not None and m.step_seconds == m.estimated_seconds == m.estimate.seconds > 0
    over = measure(executables, plan, budget=m.peak_bytes - 1, timing=timing, gradient_tolerance=1e-4)
    assert over.status == "over_budget" and over.step_seconds is None
    # Where nothing executes the raw measurement is whole whatever the budget: a larger one judges it.
    again = cache.measure_again(over.raw, budget=m.peak_bytes, repeats=2, anchored=True)
    assert again == target.executes
    if not target.executes:
        assert judge(over.raw, budget=m.peak_bytes, gradient_tolerance=1e-4) == m


def test_the_compilers_verdict_is_read_in_either_wording() -> None:
    # libtpu 0.0.42.1 compiling Llama 2 70B for v6e-256 under MaxText's flags (the head and the
    # program's lines of the report): another wording, the same verdict, the temporaries and the HBM.
    said = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in "
            "memory space hbm. Used 31.26G of 31.25G hbm. Exceeded hbm capacity by 10.93M.\n\nTotal hbm usage >= "
            "31.48G:\n    reserved        260.12M \n    program          28.21G \n    arguments         3.01G \n\n"
            "Program hbm requirement 28.21G:\n    reserved          3.59M\n    global           244.0K\n"
            "    HLO temp         28.21G (100.0% utilization: Unpadded (23.83G) Padded (23.84G), 15.5% "
            "fragmentation (4.37G))\n")
    # Where it says by how much the program exceeds the HBM, that is its peak, arguments and all.
    assert out_of_memory(RuntimeError(said)) == (int(28.21 * 2**30), int(31.25 * 2**30), int(31.25 * 2**30 + 10.93 * 2**20))
    assert out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem.")) is None


def test_the_memory_of_a_chip_is_read_from_the_compilers_out_of_memory_report_alone() -> None:
    said = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (1.00T) "
            "exceeds available HBM (15.75G).")  # as libtpu 0.0.42.1 words it for the probe on a v5e
    assert hbm_of(RuntimeError(said)) == int(15.75 * 2**30)
    with pytest.raises(RunError, match=r"did not state the memory of a chip \(RuntimeError: INTERNAL: it crashed\)"):
        hbm_of(RuntimeError("INTERNAL: it crashed\nat line 3"))
    with pytest.raises(RunError, match="a program of 1 TiB a chip compiled without running out of memory"):
        probe_hbm(LocalTarget().mesh({"data": 1}))  # on CPU the probe's program compiles: no limit to read
