"""``attention: flash`` in the built-in transformer: the same mathematics as ``dense``, with no
``seq × seq`` matrix kept; on a TPU target the Pallas TPU kernel, compiled ahead of time by the
real TPU compiler from this CPU host."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from remat_search import RematPlan, build_workload
from remat_search.executables import Executables, measure
from remat_search.spec import TimingConfig, TpuTarget, TransformerConfig

from .conftest import TINY_TRANSFORMER, spec_dict, write_spec

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
    from remat_search.target import target_of

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
