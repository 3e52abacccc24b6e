"""The mesh plans are compiled over is the one the run will use: a TPU topology's devices placed
as ``jax.make_mesh`` places them (``v5e:2x2``: ``[0, 1, 3, 2]``, a ring), not in id order; the
axes any a model names. Compiled for a TPU v5e 2x2 by the real TPU compiler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import optuna
import pytest
import yaml
from jax.sharding import AxisType

import remat_search
from remat_search import MemoryBreakdown, RematPlan, build_workload
from remat_search.store.cache import cache_key
from remat_search.measure.device import DeviceInfo
from remat_search.spec.models import TpuTarget
from remat_search.spec.workloads import TransformerConfig
from remat_search.targets.base import target_of
from remat_search.targets.mesh import device_order, make_mesh

from tests.conftest import spec_dict, write_spec

pytestmark = pytest.mark.slow  # compiles for TPU topologies

V5E = {"platform": "tpu", "topology": "v5e:2x2"}
# MaxText's way: every axis its rules name, all but fsdp at size 1; written in MaxText's order.
MESH = {"data": 1, "stage": 1, "fsdp": 4, "tensor": 1}
# Small enough to compile in seconds; its full-remat peak over the ring is the breakdown sum's,
# 1.9 MB below the flat order's (libtpu 0.0.42.1: 5.78 MB against 7.73 MB).
MODEL = {"kind": "transformer", "layers": 2, "d_model": 64, "heads": 2, "d_ff": 256, "seq_len": 128, "batch": 32,
         "vocab": 128, "attention": "dense"}


def _independent_compile(order: str, policy: str) -> MemoryBreakdown:
    """The same training step, jitted over a mesh built as a training script would build it
    (``jax.make_mesh`` with the spec's axes as written, left ``Auto``), or over the devices
    in id order (``order="flat"``), and compiled for the TPU."""
    devices = target_of(TpuTarget.model_validate(V5E)).devices()
    shape, names = tuple(MESH.values()), tuple(MESH)
    auto = (AxisType.Auto,) * len(names)
    if order == "flat":
        mesh = jax.sharding.Mesh(np.array(devices).reshape(shape), names, axis_types=auto)
    else:
        mesh = jax.make_mesh(shape, names, axis_types=auto, devices=devices)
    workload = build_workload(TransformerConfig.model_validate(MODEL))
    workload.use_mesh(mesh)
    step = workload.step(RematPlan.uniform(policy, workload.layers), mesh)
    compiled = step.lower(*workload.abstract_inputs(mesh)).compile()
    return MemoryBreakdown.of(compiled, platform="tpu", hbm=target_of(TpuTarget.model_validate(V5E)).memory_limit(mesh))


def test_a_tpu_studys_peaks_are_those_over_the_mesh_jax_make_mesh_builds(
    tmp_path: Path, storage_url: str, cli: Any
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, workload=MODEL, target=V5E, mesh=MESH, budget=None, trials=2, confirm={"top": 0},
        space={"layout": "uniform", "choices": ["full", "none"]},
    ))
    result = cli("run", str(spec))
    assert result.exit_code == 0, result.output

    report = remat_search.load_report("tiny", storage=storage_url)
    assert report.device["device_order"] == [0, 1, 3, 2]
    by_policy = {t.labels[0]: t for t in report.trials}
    for policy in ("full", "none"):
        stored = by_policy[policy].measurement
        assert stored is not None and stored.memory is not None
        assert stored.memory == _independent_compile("make_mesh", policy)
        assert stored.peak_bytes == stored.memory.peak
    # Over the devices in id order the step compiles to another program: the order is what makes
    # it equal. (Its breakdown is larger; the compiler's peak, the TPU figure, is the same here.)
    flat = _independent_compile("flat", "full")
    assert flat != by_policy["full"].measurement.memory
    assert flat.breakdown_sum > by_policy["full"].measurement.memory.breakdown_sum

    line = "shardings over mesh {'data': 1, 'fsdp': 4, 'tensor': 1, 'stage': 1} of devices [0, 1, 3, 2] (jax.make_mesh's order)"
    assert line in result.stdout
    shown = cli("show", "--study", "tiny", "--storage", storage_url)
    assert shown.exit_code == 0 and line in shown.stdout, shown.output

    # The same study as a version before the device order was kept stored it (measured over the
    # devices in id order): not resumed over another order, its trials would not compare.
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    study.set_user_attr("device", {k: v for k, v in study.user_attrs["device"].items() if k != "device_order"})
    again = cli("run", str(write_spec(spec, {**yaml.safe_load(spec.read_text()), "trials": 3})))
    assert again.exit_code == 2 and again.stderr.count("\n") == 1, again.output
    assert "spec.target: study 'tiny' already exists with another device" in again.stderr


def test_the_devices_are_placed_as_jax_make_mesh_places_them() -> None:
    devices = target_of(TpuTarget.model_validate(V5E)).devices()
    for axes in ({"fsdp": 4}, {"data": 2, "fsdp": 2}, MESH, None):
        mesh = make_mesh(devices, axes)
        assert mesh.devices.tolist() == jax.make_mesh(mesh.devices.shape, mesh.axis_names, devices=devices).devices.tolist()
        assert device_order(mesh) == [0, 1, 3, 2]
        assert set(mesh.axis_types) == {AxisType.Auto}  # as Mesh(devices, names) makes them
    assert make_mesh(devices, MESH).axis_names == ("data", "fsdp", "tensor", "stage")  # built-in axes first
    cpu = jax.devices("cpu")[:1]
    assert device_order(make_mesh(cpu, {"fsdp": 1})) is None  # the devices in their own order
    # v4's ahead-of-time topology lists two cores a chip, which jax.make_mesh refuses: id order
    v4 = target_of(TpuTarget(platform="tpu", topology="v4:2x2x1")).devices()
    with pytest.raises(AssertionError, match="megacore"):
        jax.make_mesh((len(v4),), ("data",), devices=v4)
    assert device_order(make_mesh(v4, {"data": 2, "fsdp": len(v4) // 2})) is None


def test_the_measurement_cache_keys_on_the_device_order_and_the_axes() -> None:
    """Another order of the devices, or of the axes, is another program: no cached measurement
    is shared; the devices in their own order over the built-in axes keep the key they had."""
    device = DeviceInfo(target="v5e:2x2", platform="tpu", device_kind="TPU v5 lite", device_count=4,
                        mesh={"data": 2, "fsdp": 2}, memory_limit=None, executes=False, jax_version="0",
                        workload_fingerprint="w")
    old_key = cache_key(device, "p")
    assert "layout" not in old_key["backend"]
    ring = device.model_copy(update={"device_order": [0, 1, 3, 2]})
    renamed = device.model_copy(update={"mesh": {"data": 2, "fsdp": 2, "stage": 1}})
    reordered = device.model_copy(update={"mesh": {"data": 2, "fsdp": 2, "context": 1, "stage": 1}})
    restaged = device.model_copy(update={"mesh": {"data": 2, "fsdp": 2, "stage": 1, "context": 1}})
    keys = [cache_key(d, "p")["backend"] for d in (device, ring, renamed, reordered, restaged)]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize(("mesh", "message"), [
    ({"model layer": 4}, "spec.mesh: expected a mesh axis name of letters, digits and '_' such as fsdp, got 'model layer'"),
    ({"fsdp": 0}, "spec.mesh.fsdp: Input should be greater than 0"),
    ({"stage": 2, "fsdp": 4}, "spec.mesh: {'stage': 2, 'fsdp': 4} spans 8 devices, the target has 4"),
], ids=["name", "size", "product"])
def test_bad_meshes_are_one_line_errors_and_nothing_is_written(
    tmp_path: Path, storage_url: str, cli: Any, mesh: dict[str, int], message: str
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(storage_url, target=V5E, mesh=mesh, budget=None))
    result = cli("run", str(spec))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*"))


def test_a_study_measured_over_the_devices_in_id_order_is_not_resumed_over_another(storage_url: str) -> None:
    """A study stored before the device order was kept was measured over the devices in id
    order: resumed where that is the order still, it goes on; where jax.make_mesh places them
    otherwise, its trials would not compare, and the search says so rather than mix them."""
    from remat_search.search.study import as_written_now

    stored = {"platform": "tpu", "device_kind": "TPU v5 lite", "device_count": 4, "mesh": {"fsdp": 4},
              "workload_fingerprint": "w"}
    assert as_written_now("device", stored) == {**stored, "device_order": None}
    assert as_written_now("device", stored) != {**stored, "device_order": [0, 1, 3, 2]}
