"""The training scripts that apply an answer (README's "Apply the plan", docs/api.md's "Apply the
answer in a training script"): each runs exactly as written there.

Each script is taken from README.md or docs/ (the ```python block after its ``<!-- snippet: NAME -->``
marker), written to a folder with a ``plan.json`` and run with :func:`runpy.run_path`; its
globals (``loss_fn``, ``params`` or ``model``, ``x``, ``y``) are what the checks use. A mixed
plan, ``full×2 none dots`` (three runs, so three scans), is checked against no remat at the
same parameters; a real study's ``best --json`` is checked to be ``best_plan``'s and to run.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints

import remat_search as rs
from remat_search.plans.plan import segments
from remat_search.spec.loading import parse_spec
from tests.conftest import REPO, spec_dict

SNIPPETS = ["linen-unrolled", "linen-scanned", "nnx-unrolled", "nnx-scanned", "nnx-apply", "jax-unrolled", "jax-scanned"]
MIXED = rs.RematPlan(layers=[{"kind": "full"}, {"kind": "full"}, {"kind": "none"}, {"kind": "dots"}])
NONE = rs.RematPlan.uniform("none", 4)


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""Where the scripts are shown: README and the pages under docs/."""


def snippet(name: str) -> str:
    """The code README.md or a page of docs/ shows after ``<!-- snippet: name -->`` (one of them, once)."""
    found = [
        code for page in PAGES
        for code in re.findall(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", page.read_text(), re.DOTALL)
    ]
    assert len(found) == 1, f"README.md and docs/ show {len(found)} snippet(s) named {name!r}"
    return found[0]


def run_snippet(name: str, plan_json: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run README's script ``name`` in ``folder`` beside a ``plan.json`` of ``plan_json``; its globals."""
    folder.mkdir(parents=True)
    (folder / "plan.json").write_text(plan_json)
    (folder / "train.py").write_text(snippet(name))
    with monkeypatch.context() as m:
        m.chdir(folder)
        return runpy.run_path(str(folder / "train.py"), run_name="__main__")


def pure_loss(run: dict[str, Any]) -> tuple[Any, Any]:
    """``(f, params)``: the script's loss as a function of its parameters alone, and them."""
    x, y = run["x"], run["y"]
    if "model" in run and isinstance(run["model"], nnx.Module):
        graphdef, state = nnx.split(run["model"])
        return (lambda s: run["loss_fn"](nnx.merge(graphdef, s), x, y)), state
    return (lambda p: run["loss_fn"](p, x, y)), run["params"]


def residual_bytes(run: dict[str, Any]) -> int:
    f, params = pure_loss(run)
    return sum(int(np.prod(aval.shape)) * aval.dtype.itemsize for aval, _ in saved_residuals(f, params))


def as_runs(params: Any, plan: rs.RematPlan) -> Any:
    """A ``scan_linen`` model's variables for ``none×N`` (one run, ``seg0``) split into ``plan``'s runs."""
    blocks = params["params"]["blocks"]["seg0"]
    split = {
        f"seg{j}": jax.tree.map(lambda a, s=start, e=end: a[s:e], blocks)
        for j, (start, end, _) in enumerate(segments(plan))
    }
    return {"params": {**params["params"], "blocks": split}}


def scans(f: Any, params: Any) -> int:
    return sum(1 for eqn in jax.make_jaxpr(f)(params).eqns if eqn.primitive.name == "scan")


@pytest.mark.parametrize("name", SNIPPETS)
def test_each_snippet_applies_a_mixed_plan_in_two_lines_with_no_remat_s_gradients(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    code = snippet(name)
    assert next(line.split("#")[0].strip() for line in code.splitlines() if "plan" in line) == (
        'plan = rs.RematPlan.from_json(Path("plan.json").read_text())'
    )
    assert sum("plan" in line for line in code.splitlines()) == 2  # reading it and applying it

    mixed = run_snippet(name, MIXED.to_json(), tmp_path / "mixed", monkeypatch)
    plain = run_snippet(name, NONE.to_json(), tmp_path / "none", monkeypatch)
    assert re.fullmatch(r"loss \d+\.\d{4}\nloss \d+\.\d{4}\n", capsys.readouterr().out)

    f_mixed, _ = pure_loss(mixed)
    f_plain, params = pure_loss(plain)  # both losses at the same parameters
    if name == "linen-scanned":  # its variables follow the plan's runs: seg0, seg1, seg2
        assert sorted(mixed["params"]["params"]["blocks"]) == ["seg0", "seg1", "seg2"]
        params_mixed = as_runs(params, MIXED)
    else:  # the same tree whatever the plan, and the same training
        assert jax.tree.structure(pure_loss(mixed)[1]) == jax.tree.structure(params)
        params_mixed = params
        assert float(mixed["loss"]) == pytest.approx(float(plain["loss"]), rel=1e-5)
    loss_mixed, grads_mixed = jax.jit(jax.value_and_grad(f_mixed))(params_mixed)
    loss_plain, grads_plain = jax.jit(jax.value_and_grad(f_plain))(params)
    assert float(loss_mixed) == pytest.approx(float(loss_plain), rel=1e-6)
    if name == "linen-scanned":
        grads_plain = as_runs(grads_plain, MIXED)
    for a, b in zip(jax.tree.leaves(grads_mixed), jax.tree.leaves(grads_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    assert residual_bytes(mixed) < residual_bytes(plain)  # the policies apply
    if name.endswith("scanned"):
        assert scans(f_mixed, params_mixed) == 3 and scans(f_plain, params) == 1


def test_scan_nnx_writes_back_what_each_layer_s_call_changes() -> None:
    class Counted(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.calls = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x: jax.Array) -> jax.Array:
            self.calls[...] += 1
            return x + self.linear(x)

    @nnx.split_rngs(splits=4)
    @nnx.vmap
    def make(rngs: nnx.Rngs) -> Counted:
        return Counted(rngs)

    blocks = make(nnx.Rngs(0))
    x = jnp.ones((2, 4))
    out = rs.scan_nnx(MIXED, blocks, x)
    assert blocks.calls[...].tolist() == [1.0] * 4
    graphdef, state = nnx.split(blocks)
    expected = x
    for i in range(4):
        expected = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(expected)
    np.testing.assert_allclose(out, expected, rtol=1e-6)

    @nnx.split_rngs(splits=4)
    @nnx.vmap
    def make_dropped(rngs: nnx.Rngs) -> nnx.Sequential:
        return nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.Dropout(0.5, rngs=rngs))

    dropped = make_dropped(nnx.Rngs(0, dropout=1))
    first, second = rs.scan_nnx(MIXED, dropped, x), rs.scan_nnx(MIXED, dropped, x)
    assert bool((first != second).any())  # each call draws new masks: the RNG counts were written back
    assert jax.tree.leaves(nnx.state(dropped, nnx.RngCount))[0].tolist() == [2] * 4


def test_a_real_study_s_best_json_is_best_plan_s_and_runs_in_a_snippet(
    tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    rs.run(parse_spec(spec_dict(
        url, study="mine", trials=1, confirm={"top": 0},
        workload={"kind": "mlp", "layers": 4, "width": 16, "hidden": 32, "batch": 4},
        space={"layout": "uniform", "choices": ["dots"]},
    )))
    result = cli("best", "--study", "mine", "--budget", "1GiB", "--storage", url, "--json")
    assert result.exit_code == 0, result.output
    assert rs.RematPlan.from_json(result.stdout) == rs.best_plan("mine", "1GiB", url).plan
    capsys.readouterr()
    run_snippet("jax-scanned", result.stdout, tmp_path / "train", monkeypatch)
    assert re.fullmatch(r"loss \d+\.\d{4}\n", capsys.readouterr().out)


def test_on_cpu_the_memory_optimised_scheduler_shows_remat_s_savings() -> None:
    """docs/api.md: with ``rs.compiler_options("cpu")`` (the memory-optimised scheduler) every
    policy's peak is lower than with XLA's default CPU scheduler, and full remat's is at least a
    quarter below no remat's (the tiny transformer: 30% on jaxlib 0.10, whose default scheduler
    left it 1% below; 27% on 0.12, whose default shows 31% but from higher peaks)."""
    from remat_search.spec.workloads import TransformerConfig
    from tests.conftest import TINY_TRANSFORMER

    workload = rs.build_workload(TransformerConfig.model_validate(TINY_TRANSFORMER))
    assert rs.compiler_options("cpu") == {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    assert rs.compiler_options("tpu") == rs.compiler_options("gpu") == {}

    def peak(policy: str, options: dict[str, str] | None) -> int:
        lowered = workload.step(rs.RematPlan.uniform(policy, workload.layers)).lower(*workload.abstract_inputs())
        return rs.MemoryBreakdown.of(lowered.compile(compiler_options=options), platform="cpu").peak

    default = {policy: peak(policy, None) for policy in ("none", "full")}
    optimised = {policy: peak(policy, rs.compiler_options("cpu")) for policy in ("none", "full")}
    assert all(optimised[p] < default[p] for p in default), (optimised, default)
    assert optimised["full"] <= 0.75 * optimised["none"], optimised


def test_a_step_compiled_with_compiler_options_has_the_study_s_memory_to_the_byte(tmp_path: Path) -> None:
    from remat_search.spec.workloads import MlpConfig

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    config = {"kind": "mlp", "layers": 4, "width": 16, "hidden": 32, "batch": 4}
    report = rs.run(parse_spec(spec_dict(
        url, study="mine", trials=1, confirm={"top": 0}, workload=config, space={"layout": "uniform", "choices": ["dots"]},
    )))
    answer = rs.best_plan("mine", "1GiB", url)
    assert rs.compiler_options(report.device["platform"]) == rs.compiler_options(jax.default_backend())
    workload = rs.build_workload(MlpConfig.model_validate(config))
    lowered = workload.step(answer.plan).lower(*workload.abstract_inputs())
    compiled = lowered.compile(compiler_options=rs.compiler_options(jax.default_backend()))
    (trial,) = report.trials
    assert trial.measurement is not None
    assert rs.MemoryBreakdown.of(compiled, platform="cpu") == trial.measurement.memory
