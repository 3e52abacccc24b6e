"""Orbax: a workload's parameters from a checkpoint's metadata (``workload.params_from``, no
array read), and the reference first step a study checks against, saved in its artifacts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import remat_search
from remat_search import RematPlan, SpecError, build_workload
from remat_search.measure.artifacts import ReferenceStore
from remat_search.measure.check import FirstStep, Noise, Reference
from remat_search.workloads.checkpoint_params import INIT_SCALE
from remat_search.measure.executables import Executables, anchor_plan, measure
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig, TpuTarget
from remat_search.spec.workloads import MlpConfig
from remat_search.targets.base import target_of
from remat_search.workloads.base import check_params_from

from tests.conftest import spec_dict, write_spec
from tests.factories import miscomputing

MODEL = MlpConfig(kind="mlp", layers=2, width=16, hidden=32, batch=8)
TIMING = TimingConfig(warmup=1, repeats=1)


def mlp_params(
    layers: int, width: int, hidden: int | list[int], dtype: Any = jnp.bfloat16, wi_sharding: Any = None,
) -> list:
    """An MLP's parameters as its training script would save them (the values do not matter);
    ``hidden`` may differ by layer."""
    hiddens = hidden if isinstance(hidden, list) else [hidden] * layers
    params = [{"wi": jnp.ones((width, h), dtype), "wo": jnp.ones((h, width), dtype)} for h in hiddens]
    if wi_sharding is not None:
        params = [{**p, "wi": jax.device_put(p["wi"], wi_sharding)} for p in params]
    return params


def save_without_arrays(path: Path, params: Any) -> Path:
    """Save ``params`` with Orbax (one zarr folder an array, no OCDBT), then delete every array's
    data, keeping its metadata: whatever reads this checkpoint reads no array, or fails."""
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=False))
    checkpointer.save(path, args=ocp.args.StandardSave(params))
    chunks = [f for a in path.glob("*/.zarray") for f in a.parent.iterdir() if f.name != ".zarray"]
    assert len(chunks) == len(jax.tree.leaves(params))
    for chunk in chunks:
        chunk.unlink()
    return path


def arg_bytes(tree: Any) -> int:
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def test_params_from_takes_the_checkpoints_shapes_and_dtypes_and_reads_no_array(tmp_path: Path) -> None:
    """A bf16 checkpoint whose second layer is twice as wide inside as the spec's f32 model:
    the step compiles and runs on parameters of the checkpoint's shapes and dtypes, though no
    array data is there; the first layer's values are the model's own, cast."""
    path = save_without_arrays(tmp_path / "ckpt", mlp_params(layers=2, width=16, hidden=[32, 64]))
    workload = build_workload(MODEL.model_copy(update={"params_from": str(path)}))
    check_params_from(workload)
    (params, _), _ = abstract = workload.abstract_inputs()
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(params)] == [
        ((16, 32), jnp.bfloat16), ((32, 16), jnp.bfloat16), ((16, 64), jnp.bfloat16), ((64, 16), jnp.bfloat16)]
    assert workload.fingerprint() != build_workload(MODEL).fingerprint()
    (values, _), _ = workload.inputs()
    (own, _), _ = build_workload(MODEL).inputs()
    assert np.array_equal(values[0]["wi"], own[0]["wi"].astype(jnp.bfloat16))  # the model's initialiser, cast
    assert float(jnp.std(values[1]["wi"].astype(jnp.float32))) == pytest.approx(INIT_SCALE, rel=0.1)  # random

    m = measure(Executables(workload), RematPlan.uniform("none", 2), budget=2**40, timing=TIMING, gradient_tolerance=1e-2)
    assert m.status == "measured", m.error
    assert m.memory is not None and m.memory.argument == arg_bytes(abstract)  # the checkpoint's sizes, compiled


def test_a_model_that_does_not_fit_the_checkpoint_is_a_one_line_spec_error(tmp_path: Path) -> None:
    three_layers = save_without_arrays(tmp_path / "three", mlp_params(layers=3, width=16, hidden=32))
    with pytest.raises(SpecError, match=r"^spec\.workload\.params_from: the checkpoint .* has parameter '2/wi', which the model does not"):
        check_params_from(build_workload(MODEL.model_copy(update={"params_from": str(three_layers)})))
    narrow = save_without_arrays(tmp_path / "narrow", mlp_params(layers=2, width=8, hidden=32))
    with pytest.raises(SpecError, match=r"^spec\.workload\.params_from: the model does not take the checkpoint's parameters \(TypeError"):
        check_params_from(build_workload(MODEL.model_copy(update={"params_from": str(narrow)})))


@pytest.mark.parametrize(
    ("params_from", "said"),
    [("no-such-checkpoint", "spec.workload.params_from: '{folder}/no-such-checkpoint' does not exist"),
     ("one-layer", "spec.workload.params_from: the checkpoint '{folder}/one-layer' has no parameter '1/wi', which the model has"),
     ("narrow", "spec.workload.params_from: the model does not take the checkpoint's parameters (TypeError")],
)
def test_a_bad_params_from_is_exit_2_in_one_line_and_nothing_written(
    cli: Any, tmp_path: Path, storage_url: str, home: Path, params_from: str, said: str,
) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    save_without_arrays(folder / "one-layer", mlp_params(layers=1, width=16, hidden=32))
    save_without_arrays(folder / "narrow", mlp_params(layers=2, width=8, hidden=32))
    spec = spec_dict(storage_url, workload={**MODEL.model_dump(), "params_from": params_from},
                     space={"layout": "uniform", "choices": ["none", "full"]})
    result = cli("run", str(write_spec(folder / "spec.yaml", spec)))  # relative to the spec's folder
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and said.format(folder=folder) in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*")) and not home.exists()


def test_a_tpu_search_compiles_with_the_checkpoints_shapes_and_stored_shardings(tmp_path: Path, storage_url: str) -> None:
    """The checkpoint's ``wi`` was saved split over ``fsdp`` on its first axis, where the
    built-in heuristic splits its largest (the second); on a v5e:2x2 as ``{fsdp: 4}`` the
    parameter and its Adam moments take the stored sharding, and the search compiles on them
    with no array of the checkpoint there to read."""
    saved_on = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    path = save_without_arrays(
        tmp_path / "ckpt", mlp_params(2, 16, 64, wi_sharding=NamedSharding(saved_on, P("fsdp", None))))
    config = MODEL.model_copy(update={"params_from": str(path)})
    target = target_of(TpuTarget(platform="tpu", topology="v5e:2x2"))
    mesh = target.mesh({"fsdp": 4})
    (params, (adam, *_)), _ = build_workload(config).abstract_inputs(mesh)
    assert params[0]["wi"].sharding.spec == adam.mu[0]["wi"].sharding.spec == adam.nu[1]["wi"].sharding.spec == P("fsdp", None)
    assert params[0]["wo"].sharding.spec == P("fsdp", None)  # stored on one device: the heuristic's
    (own, _), _ = build_workload(config.model_copy(update={"params_from": None})).abstract_inputs(mesh)
    assert own[0]["wi"].sharding.spec == P(None, "fsdp")

    report = remat_search.run(parse_spec(spec_dict(
        storage_url, workload=config.model_dump(), target={"platform": "tpu", "topology": "v5e:2x2"},
        mesh={"fsdp": 4}, budget=None, trials=1, confirm={"top": 0}, space={"layout": "uniform", "choices": ["full"]},
    )))
    assert [t.status for t in report.trials] == ["measured"], report.trials[0].measurement.error
    assert report.device["workload_fingerprint"] == build_workload(config).fingerprint()


def test_a_saved_reference_is_loaded_by_a_new_worker_and_still_catches_a_miscomputing_plan(tmp_path: Path) -> None:
    store = ReferenceStore(tmp_path / "artifacts" / "study", "key")
    first = Executables(miscomputing(), reference_store=store)
    none = RematPlan.uniform("none", first.workload.layers)
    measured = measure(first, none, budget=2**40, timing=TIMING)
    assert measured.status == "measured" and first.reference_from == "computed" and store.path.is_dir()

    second = Executables(miscomputing(), reference_store=store)  # as a new worker, or another host's
    dots = measure(second, RematPlan.uniform("dots", second.workload.layers), budget=2**40, timing=TIMING)
    assert second.reference_from == "loaded"
    assert dots.status == "failed" and "from full remat's by 1 (norm-relative)" in (dots.error or ""), dots.error
    again = measure(second, none, budget=2**40, timing=TIMING)
    assert again.status == "measured" and again.grad_check == measured.grad_check  # the same reference, and its noise


def test_a_resumed_study_checks_against_the_reference_its_first_search_saved(
    tmp_path: Path, storage_url: str, home: Path,
) -> None:
    """Full remat is not a choice and the anchor does not time: its step runs only to make the
    reference, which the resumed search (new workers) loads from the study's artifacts."""
    log = tmp_path / "executions.log"
    spec = spec_dict(
        storage_url, workload={"factory": "tests.factories:recording", "args": {"log": str(log)}}, trials=2,
        space={"layout": "per_layer", "choices": ["none", "dots"]}, timing={"warmup": 1, "repeats": 1, "anchor": False},
        confirm={"top": 0},
    )
    remat_search.run(parse_spec(spec))
    full = anchor_plan(3).digest
    first = log.read_text().split()
    assert full in first
    (saved,) = (home / "artifacts" / "tiny").glob("reference-*")

    report = remat_search.run(parse_spec({**spec, "trials": 4}))
    resumed = log.read_text().split()[len(first):]
    assert resumed and full not in resumed  # plans ran and were checked, the reference's step did not
    assert [p.name for p in (home / "artifacts" / "tiny").iterdir()] == [saved.name]
    checked = [t.measurement.grad_check for t in report.trials[2:] if t.measurement.grad_check is not None]
    assert checked and all(c.failure() is None for c in checked) and [t.status for t in report.trials] == ["measured"] * 4


def test_a_saved_reference_is_kept_whole_and_never_replaced(tmp_path: Path) -> None:
    store = ReferenceStore(tmp_path / "study", "key")
    noise = Noise(rounding=(1e-7, 2e-7, 1.5e-7, 0.0), rerun=(0.0,) * 4, unit_roundoff=2.0**-24, precision="float32 matmuls")
    store.save(Reference(FirstStep((np.ones((2, 3)), np.zeros(())), 1.5), noise))
    store.save(Reference(FirstStep((np.full((2, 3), 7.0), np.zeros(())), 9.0), noise))  # a later worker's: dropped
    loaded = store.load([(2, 3), ()])
    assert loaded is not None and loaded.step.loss == 1.5 and np.array_equal(loaded.step.gradients[0], np.ones((2, 3)))
    assert loaded.noise == noise  # the threshold's figures, and what they are of, with it
    assert [p.name for p in store.folder.iterdir()] == ["reference-key"]  # no temporary folder left
    assert store.load([(2, 4), ()]) is None  # not of this state's shapes: not used
    assert ReferenceStore(store.folder, "another-setting").load([(2, 3), ()]) is None  # another key's: never used
