"""``attention: flash`` in the built-in transformer: the same mathematics as ``dense``, with no
``seq × seq`` matrix kept; on a TPU target the Pallas TPU kernel, compiled ahead of time by the
real TPU compiler from this CPU host. ``attention: auto`` (the default): flash where it compiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from remat_search import RematPlan, build_workload, load_spec
from remat_search.store.cache import cache_key
from remat_search.measure.executables import Executables, measure
from remat_search.measure.runner import Runner
from remat_search.spec.models import TimingConfig, TpuTarget
from remat_search.spec.workloads import TransformerConfig, resolved_attention

from tests.conftest import TINY_TRANSFORMER, spec_dict, write_spec

V5E = TpuTarget(platform="tpu", topology="v5e:2x2")


def test_flash_attention_computes_what_dense_attention_does() -> None:
    dense, flash = (build_workload(TransformerConfig(**TINY_TRANSFORMER, attention=a)) for a in ("dense", "flash"))
    (params, _), batch = dense.inputs()
    for plan in (RematPlan.uniform("none", 2), RematPlan.uniform("dots", 2)):
        loss_d, grads_d = jax.jit(jax.value_and_grad(dense.loss(plan)))(params, batch)
        loss_f, grads_f = jax.jit(jax.value_and_grad(flash.loss(plan)))(params, batch)
        assert float(loss_f) == pytest.approx(float(loss_d), rel=1e-5)
        for d, f in zip(jax.tree.leaves(grads_d), jax.tree.leaves(grads_f), strict=True):
            np.testing.assert_allclose(f, d, rtol=1e-4, atol=1e-6)
    assert "context" in flash.tensor_names


def test_on_a_tpu_target_flash_is_the_pallas_kernel_and_keeps_no_score_matrix() -> None:
    """At 1,024 tokens dense attention keeps a score matrix per head: the kernel's peak is lower
    by at least one such matrix (bf16, a chip's share of the batch)."""
    from remat_search.targets.base import target_of

    config = {"kind": "transformer", "layers": 1, "d_model": 256, "heads": 2, "d_ff": 512, "seq_len": 1024,
              "batch": 4, "vocab": 256, "dtype": "bfloat16"}
    peaks = {}
    for attention in ("dense", "flash"):
        workload = build_workload(TransformerConfig(**config, attention=attention))
        target = target_of(V5E)
        mesh = target.mesh({"data": 4})
        executables = Executables(workload, target=target, mesh=mesh)
        m = measure(executables, RematPlan.uniform("none", 1), budget=2**34, timing=TimingConfig(), gradient_tolerance=1e-3)
        assert m.status == "measured", m.error
        peaks[attention] = m.peak_bytes
        hlo = workload.step(RematPlan.uniform("none", 1), mesh).lower(*workload.abstract_inputs(mesh)).as_text()
        assert ("tpu_custom_call" in hlo) == (attention == "flash")
    scores = config["batch"] // 4 * config["heads"] * config["seq_len"] ** 2 * 2
    assert peaks["dense"] - peaks["flash"] >= scores, peaks


def test_flash_on_a_tpu_target_needs_whole_kernel_blocks(tmp_path: Path, storage_url: str, cli: Any) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, workload={**TINY_TRANSFORMER, "attention": "flash"}, target={"platform": "tpu", "topology": "v5e:2x2"},
        budget=None, trials=1, space={"layout": "uniform", "choices": ["full"]},
    ))
    result = cli("run", str(spec))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert "workload.attention: flash on a TPU target runs the Pallas kernel" in result.stderr
    assert "seq_len must be a multiple of 128, got 32" in result.stderr
    assert not list(tmp_path.glob("*.db*"))


def test_auto_is_flash_where_it_compiles_and_dense_elsewhere() -> None:
    """The default ``auto``, resolved where the workload is built for its target: dense on this
    CPU, flash (the Pallas kernel, in the lowered step) on a v5e when ``seq_len`` is whole
    128-token blocks, dense when it is not, flash on a GPU; ``dense`` and ``flash`` as written."""
    from remat_search.targets.base import target_of

    short = TransformerConfig(**TINY_TRANSFORMER)  # seq_len 32
    long = TransformerConfig(**{**TINY_TRANSFORMER, "seq_len": 128})
    assert short.attention == "auto"
    assert [resolved_attention(short, p) for p in ("cpu", "gpu", "tpu")] == ["dense", "flash", "dense"]
    assert resolved_attention(long, "tpu") == "flash"
    for written in ("dense", "flash"):
        assert {resolved_attention(short.model_copy(update={"attention": written}), p) for p in ("cpu", "tpu")} == {written}

    local = build_workload(short)
    local.use_mesh(None)
    assert local.attention == "dense"
    # On a CPU flash is XLA's composition: it computes each head's 32 × 32 score matrix too.
    cpu_flash = build_workload(short.model_copy(update={"attention": "flash"}))
    hlo = cpu_flash.step(RematPlan.uniform("none", 2)).lower(*cpu_flash.abstract_inputs()).as_text()
    assert "tensor<4x2x32x32xf32>" in hlo
    assert local.note() == "attention: auto → dense (on cpu, flash would be XLA's composition, which keeps the scores too)"
    assert build_workload(short.model_copy(update={"attention": "dense"})).note() is None

    mesh = target_of(V5E).mesh({"data": 4})
    untiled, tiled = build_workload(short), build_workload(long)
    untiled.use_mesh(mesh)
    tiled.use_mesh(mesh)
    assert untiled.attention == "dense" and "seq_len 32 is not a multiple of the Pallas TPU kernel's 128" in untiled.note()
    assert tiled.attention == "flash" and tiled.note() == "attention: auto → flash (Pallas TPU kernel)"
    hlo = tiled.step(RematPlan.uniform("none", 2), mesh).lower(*tiled.abstract_inputs(mesh)).as_text()
    assert "tpu_custom_call" in hlo


def test_the_measurement_cache_keys_on_the_resolved_attention() -> None:
    """Workers for ``auto`` and for what it resolves to key a plan's measurement alike (one
    program), on this CPU (dense) and on a v5e (flash); dense and flash do not."""
    plan = RematPlan.uniform("full", 2).digest

    def key(config: dict[str, Any], attention: str, **where: Any) -> dict[str, str]:
        with Runner(TransformerConfig(**config, attention=attention), timeout=120, **where) as runner:
            return cache_key(runner.describe(), plan)

    cpu = {a: key(TINY_TRANSFORMER, a) for a in ("auto", "dense", "flash")}
    assert cpu["auto"] == cpu["dense"] != cpu["flash"]
    long = {**TINY_TRANSFORMER, "seq_len": 128}
    tpu = {a: key(long, a, target=V5E, mesh={"data": 4}) for a in ("auto", "flash")}
    assert tpu["auto"] == tpu["flash"]


@pytest.mark.parametrize("name", ["v5e-writeup", "v5e-1b"])
def test_the_v5e_specs_pin_the_dense_attention_their_readme_figures_used(name: str) -> None:
    """Their 2,048 tokens are whole kernel blocks: ``auto`` would be flash there."""
    workload = load_spec(Path(__file__).parents[2] / "search_spaces" / f"{name}.yaml").workload
    assert workload.attention == "dense"
    assert resolved_attention(workload.model_copy(update={"attention": "auto"}), "tpu") == "flash"
