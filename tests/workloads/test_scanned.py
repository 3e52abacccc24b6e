"""Models as their teams write them, searched from the specs in ``search_spaces/``: a linen
decoder under ``nn.scan`` and an NNX decoder under ``nnx.scan`` over ``nnx.vmap``-made blocks
are stacks of 4 layers with one body; the answer applied to the model as written compiles to the
trial's peak to the byte, with the unwrapped model's gradients. A model whose calls and layers
disagree, or that runs its layers under its own remat, is one line. The optimizer is the spec's;
a batch of one's own (an image classifier's) is searched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

import remat_search as rs
from remat_search.errors import SpecError
from remat_search.report.stored import open_study
from remat_search.search.space import Space
from remat_search.spec.space import SpaceConfig
from remat_search.spec.workloads import LinenConfig, NnxConfig, TransformerConfig
from remat_search.store.attributes import STACKS_ATTR
from remat_search.workloads.base import build_workload, next_token_loss

from tests.conftest import FAST_TIMING, REPO, TINY_TRANSFORMER, spec_dict, write_spec

SPACES = REPO / "search_spaces"


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example models import as the CLI imports them: from the spec's folder."""
    monkeypatch.syspath_prepend(str(SPACES))


def _example(tmp_path: Path, name: str, **changes: Any) -> Path:
    """``search_spaces/NAME.yaml`` with the test's timing and no confirmation, in ``tmp_path``."""
    spec = {**yaml.safe_load((SPACES / f"{name}.yaml").read_text()), "timing": FAST_TIMING, "confirm": {"top": 0}}
    spec.update(changes)
    return write_spec(tmp_path / f"{name}.yaml", spec)


def _state_bytes(tree: Any) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _memory(train_step: Any, state: Any, batch: Any) -> rs.MemoryBreakdown:
    """The memory of a trainer's jitted step (its state donated), compiled as remat-search compiles."""
    compiled = jax.jit(train_step, donate_argnums=0).lower(state, batch).compile(
        compiler_options=rs.compiler_options(jax.default_backend()))
    return rs.MemoryBreakdown.of(compiled, platform=jax.default_backend())


def _searched(cli: Any, tmp_path: Path, name: str) -> rs.StudyReport:
    path = _example(tmp_path, name)
    result = cli("run", str(path))
    assert result.exit_code == 0, result.stdout + result.stderr
    return rs.load_report(yaml.safe_load(path.read_text())["study"])


def _measured(report: rs.StudyReport) -> list[rs.TrialResult]:
    return [t for t in report.trials if t.status == "measured" and t.plan is not None and t.measurement is not None]


def test_a_scanned_linen_model_is_one_stack_of_4_and_its_answer_applies_to_the_byte(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = _searched(cli, tmp_path, "linen-scanned")
    with open_study("linen-scanned") as study:
        assert study.attrs[STACKS_ATTR] == [4]
    trials = _measured(report)
    assert len({t.plan.summary() for t in trials}) >= 3 and any(t.plan.tensor_names for t in trials), [
        t.plan.summary() for t in trials]
    assert all(t.plan.is_uniform and len(t.plan.layers) == 4 for t in trials)

    from linen_scanned import Decoder

    config = build_workload(LinenConfig(**yaml.safe_load((SPACES / "linen-scanned.yaml").read_text())["workload"]))
    model = Decoder(**config.config.args)
    tokens = config.make_batch(jax.random.key(1))
    params = model.init(jax.random.key(0), tokens)["params"]
    opt = optax.adafactor(learning_rate=1e-3)

    def grads_of(apply: Any) -> Any:
        return jax.jit(jax.value_and_grad(lambda p: next_token_loss(apply({"params": p}, tokens), tokens)))(params)

    plain_loss, plain_grads = grads_of(model.apply)
    for trial in trials:
        apply = rs.apply_linen(model, trial.plan, blocks="layers")

        def train_step(state: Any, batch: Any, apply: Any = apply) -> Any:
            p, opt_state = state
            loss, g = jax.value_and_grad(lambda q: next_token_loss(apply({"params": q}, batch), batch))(p)
            updates, opt_state = opt.update(g, opt_state, p)
            return (optax.apply_updates(p, updates), opt_state), loss

        assert _memory(train_step, (params, opt.init(params)), tokens) == trial.measurement.memory, trial.plan.summary()
        loss, grads = grads_of(apply)
        assert float(loss) == pytest.approx(float(plain_loss), rel=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, plain_grads)


def test_a_scanned_nnx_model_is_one_stack_of_4_and_its_answer_applies_to_the_byte(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = _searched(cli, tmp_path, "nnx-scanned")
    with open_study("nnx-scanned") as study:
        assert study.attrs[STACKS_ATTR] == [4]
    trials = _measured(report)
    assert len({t.plan.summary() for t in trials}) >= 3 and any(t.plan.tensor_names for t in trials), [
        t.plan.summary() for t in trials]

    from nnx_scanned import Decoder

    args = yaml.safe_load((SPACES / "nnx-scanned.yaml").read_text())["workload"]["args"]
    tokens = build_workload(NnxConfig(**yaml.safe_load((SPACES / "nnx-scanned.yaml").read_text())["workload"])).make_batch(
        jax.random.key(1))
    opt = optax.sgd(learning_rate=1e-2, momentum=0.9)

    def loss_fn(model: nnx.Module) -> Any:
        return next_token_loss(model(tokens), tokens)

    plain_loss, plain_grads = nnx.jit(nnx.value_and_grad(loss_fn))(Decoder(**args, rngs=nnx.Rngs(0)))
    for trial in trials:
        model = rs.apply_nnx(Decoder(**args, rngs=nnx.Rngs(0)), trial.plan, blocks="blocks")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def train_step(state: Any, batch: Any, graphdef: Any = graphdef, rest: Any = rest) -> Any:
            p, opt_state = state
            loss, g = jax.value_and_grad(lambda q: next_token_loss(nnx.merge(graphdef, q, rest)(batch), batch))(p)
            updates, opt_state = opt.update(g, opt_state, p)
            return (optax.apply_updates(p, updates), opt_state), loss

        assert _memory(train_step, (params, opt.init(params)), tokens) == trial.measurement.memory, trial.plan.summary()
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
        assert float(loss) == pytest.approx(float(plain_loss), rel=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     jax.tree.leaves(grads), jax.tree.leaves(plain_grads))


LINEN = yaml.safe_load((SPACES / "linen-scanned.yaml").read_text())["workload"]
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("calls and layers disagree", {"layers": 3},
     "workload.layers: the model runs 4 layers (layers ×4 (scanned)), the spec says 3"),
    ("the model's own remat", {"args": {**LINEN["args"], "remat": True}},
     "workload.blocks: 'layers' runs under the model's own nn.remat"),
    ("an optimizer that is not one", {"optimizer": {"factory": "optax.nope"}},
     "workload.optimizer.factory: 'optax:nope': module 'optax' has no function 'nope'"),
]


@pytest.mark.parametrize(("case", "change", "line"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_model_the_search_cannot_describe_is_one_line(cli, tmp_path: Path, case: str, change: dict[str, Any],  # type: ignore[no-untyped-def]
                                                        line: str) -> None:
    result = cli("run", str(_example(tmp_path, "linen-scanned", workload={**LINEN, **change})))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert line in result.stderr, result.stderr
    assert not list(Path(tmp_path).glob("**/*.db")), "a database was written for bad input"


def test_a_scanned_model_s_space_gives_each_stack_one_choice() -> None:
    choices = ["none", "full"]
    per_layer = Space.of(SpaceConfig(layout="per_layer", choices=choices), 6, (4, 1, 1))
    assert per_layer.units == ("stack_00", "stack_01", "stack_02")
    assert per_layer.unit_layers == ((0, 1, 2, 3), (4,), (5,))
    assert Space.of(SpaceConfig(layout="segments", segments=[4, 2], choices=choices), 6, (4, 1, 1)).units == (
        "segment_00", "segment_01")
    with pytest.raises(SpecError, match=r"^spec\.space\.segments: sizes \[3, 3\] cut a scanned stack"):
        Space.of(SpaceConfig(layout="segments", segments=2, choices=choices), 6, (4, 1, 1))
    with pytest.raises(SpecError, match=r"^spec\.space\.nested: a scanned stack runs one body"):
        Space.of(SpaceConfig(layout="uniform", choices=choices, nested=True), 6, (4, 1, 1))
    from linen_scanned import Decoder

    model = Decoder(vocab=16, layers=2, d_model=8, heads=2, d_ff=16)
    tokens = jax.numpy.zeros((1, 4), jax.numpy.int32)
    mixed = rs.RematPlan(layers=(rs.LayerPolicy(kind="full"), rs.LayerPolicy(kind="none")))
    with pytest.raises(SpecError, match=r"^plan: layers 0–1 are one scanned stack \(layers\)"):
        rs.apply_linen(model, mixed, blocks="layers")(model.init(jax.random.key(0), tokens), tokens)


@pytest.mark.parametrize("factory", ["optax.adafactor", "optax.sgd"])
def test_the_spec_s_optimizer_is_the_state_each_trial_carries(tmp_path: Path, storage_url: str, factory: str) -> None:
    args = {"learning_rate": 1e-3, **({"momentum": 0.9} if factory == "optax.sgd" else {})}
    optimizer = {"factory": factory, "args": args}
    spec = rs.SearchSpec.model_validate(spec_dict(
        storage_url, study=f"opt-{factory}", workload={**TINY_TRANSFORMER, "optimizer": optimizer},
        space={"layout": "uniform", "choices": ["none", "full"]}, trials=2, confirm={"top": 0},
    ))
    workload = build_workload(TransformerConfig(**{**TINY_TRANSFORMER, "optimizer": optimizer}))
    (params, _), batch = workload.abstract_inputs()
    made = getattr(optax, factory.removeprefix("optax."))(**args)
    loss = workload.loss(rs.RematPlan.uniform("none", workload.layers))

    def train_step(state: Any, batch: Any, opt: Any) -> Any:
        p, opt_state = state
        value, g = jax.value_and_grad(loss)(p, batch)
        updates, opt_state = opt.update(g, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), value

    def argument_bytes(opt: Any) -> int:  # a trainer's step on optax's own init of the same parameters
        return _memory(lambda s, b: train_step(s, b, opt), (params, jax.eval_shape(opt.init, params)), batch).argument

    expected = argument_bytes(made)
    assert expected != argument_bytes(optax.adamw(1e-3))  # another optimizer, another state
    # the state's bytes, less the placeholders the step passes through unread (JAX drops them)
    assert _state_bytes(params) + _state_bytes(batch) < expected <= _state_bytes(
        (params, jax.eval_shape(made.init, params), batch))
    trials = _measured(rs.run(spec))
    assert len(trials) == 2
    assert {t.measurement.memory.argument for t in trials} == {expected}


def test_a_batch_of_one_s_own_is_searched(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = _searched(cli, tmp_path, "image-classifier")
    trials = _measured(report)
    assert len(trials) == 5 and len({t.peak_bytes for t in trials}) > 1
    workload = build_workload(NnxConfig(**yaml.safe_load((SPACES / "image-classifier.yaml").read_text())["workload"]))
    batch = workload.abstract_inputs()[1]
    assert (batch["image"].shape, str(batch["image"].dtype)) == ((8, 32, 32, 3), "float32")
    assert (batch["label"].shape, str(batch["label"].dtype)) == ((8,), "int32")


BAD_BATCH: list[tuple[dict[str, Any], str]] = [
    ({"factory": "image_classifier:nope"}, "workload.batch.factory: 'image_classifier:nope'"),
    ({"factory": "image_classifier:example_batch", "args": {"batch": 8}},
     "workload.batch.factory: 'image_classifier:example_batch' raised TypeError"),
    ({"factory": "image_classifier:example_batch", "args": {"batch": 8, "size": 32, "classes": 10}, "model_input": "pixels"},
     "workload.batch.model_input: 'pixels' is not in the batch (['image', 'label'])"),
]


@pytest.mark.parametrize(("batch", "line"), BAD_BATCH, ids=["not importable", "raises", "no such input"])
def test_a_bad_batch_factory_is_one_line(cli, tmp_path: Path, batch: dict[str, Any], line: str) -> None:  # type: ignore[no-untyped-def]
    workload = {**yaml.safe_load((SPACES / "image-classifier.yaml").read_text())["workload"], "batch": batch}
    result = cli("run", str(_example(tmp_path, "image-classifier", workload=workload)))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and line in result.stderr, result.stderr


def test_a_loss_that_is_no_scalar_is_one_line(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    workload = {**yaml.safe_load((SPACES / "image-classifier.yaml").read_text())["workload"],
                "loss": "tests.workloads.test_scanned:per_example"}
    result = cli("run", str(_example(tmp_path, "image-classifier", workload=workload)))
    assert result.exit_code == 2 and "workload.loss: returned shape [8], expected a scalar" in result.stderr, result.stderr


def per_example(logits: Any, batch: Any) -> Any:
    """A loss a user forgot to average."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def test_readmes_flax_start_trains_the_model_with_the_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_snippets import snippet

    (tmp_path / "plan.json").write_text(rs.RematPlan.uniform("full", 4).to_json())
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(snippet("flax-start"), "train.py", "exec"), namespace)  # noqa: S102 - README's script, as written
    from remat_search.workloads.nnx import Checkpointed

    assert isinstance(namespace["model"].blocks, Checkpointed)
    assert np.isfinite(float(namespace["train_step"](namespace["model"], namespace["optimizer"], namespace["tokens"])))


def test_a_team_s_own_nnx_train_step_is_the_program_measured(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``own-train-step.yaml``: the step measured is ``image_classifier.train_step`` (its
    label-smoothed loss, not a cross-entropy), its state an ``nnx.Optimizer`` of the spec's AdamW,
    and the check reads the gradients from its first moment."""
    from image_classifier import Classifier, cross_entropy, smoothed_cross_entropy

    from remat_search.measure.executables import INPUT_SEED

    path = _example(tmp_path, "own-train-step", trials=3)
    result = cli("run", str(path))
    assert result.exit_code == 0, result.stdout + result.stderr
    spec = yaml.safe_load(path.read_text())
    trials = _measured(rs.load_report(spec["study"]))
    assert len(trials) == 3
    workload = build_workload(NnxConfig(**spec["workload"]))
    (params, opt_state), batch = workload.inputs(INPUT_SEED)
    assert int(opt_state["step"]) == 0 and "mu" in opt_state["opt_state"][0]  # the nnx.Optimizer's own variables
    model = Classifier(**spec["workload"]["args"], rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    logits = model(batch["image"])
    own, plain = float(smoothed_cross_entropy(logits, batch["label"])), float(cross_entropy(logits, batch))
    assert abs(own - plain) > 1e-3 * abs(plain)  # the two losses tell apart
    for trial in trials:
        assert trial.measurement.first_loss == pytest.approx(own, rel=1e-5), trial.plan.summary()
        assert "first moment ('mu')" in trial.measurement.grad_check.compared
    shown = cli("show", "--study", spec["study"], "--trial", str(trials[0].number))
    assert "the gradients, read from the optimizer's first moment ('mu')" in " ".join(shown.stdout.split())


def test_a_team_s_own_linen_train_step_is_checked_on_its_state_s_change(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A ``TrainState`` step under plain SGD (no first moment): the step measured is
    ``linen_scanned.train_step`` (cross-entropy plus a z-loss), the state carries the
    ``TrainState``'s step, and ``show --trial`` says the check compared the state's change."""
    from linen_scanned import train_step

    from remat_search.measure.executables import INPUT_SEED

    workload = {**LINEN, "train_step": "linen_scanned:train_step", "optimizer": {"factory": "optax.sgd",
                                                                                 "args": {"learning_rate": 1e-2}}}
    path = _example(tmp_path, "linen-scanned", study="linen-own-step", workload=workload, trials=2,
                    space={"layout": "per_layer", "choices": ["none", "full"]})
    result = cli("run", str(path))
    assert result.exit_code == 0, result.stdout + result.stderr
    trials = _measured(rs.load_report("linen-own-step"))
    assert {t.plan.summary() for t in trials} == {"none×4", "full×4"}  # both pass the check
    built = build_workload(LinenConfig(**workload))
    (params, rest), tokens = built.inputs(INPUT_SEED)
    from flax.training.train_state import TrainState

    _, own = train_step(TrainState(step=rest["step"], apply_fn=built.module.apply, params=params,
                                   tx=optax.sgd(1e-2), opt_state=rest["opt_state"]), tokens)
    plain = float(next_token_loss(built.module.apply({"params": params}, tokens), tokens))
    assert abs(float(own) - plain) > 1e-6 * abs(plain)  # the z-loss is in it
    for trial in trials:
        assert trial.measurement.first_loss == pytest.approx(float(own), rel=1e-6)
    shown = cli("show", "--study", "linen-own-step", "--trial", str(trials[0].number))
    assert "the whole training state's change" in " ".join(shown.stdout.split())


OWN_STEP_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"train_step": "linen_scanned:nope"}, "workload.train_step: 'linen_scanned:nope'"),
    ({"train_step": "tests.workloads.test_scanned:no_state_back"},
     "workload.train_step: 'tests.workloads.test_scanned:no_state_back' returned a scalar, expected (state, loss)"),
    ({"train_step": "linen_scanned:train_step", "loss": "tests.workloads.test_scanned:per_example"},
     "train_step: a train step of your own computes its own loss"),
]


@pytest.mark.parametrize(("change", "line"), OWN_STEP_REFUSED, ids=["not importable", "returns no state", "with a loss"])
def test_a_bad_own_train_step_is_one_line(cli, tmp_path: Path, change: dict[str, Any], line: str) -> None:  # type: ignore[no-untyped-def]
    result = cli("run", str(_example(tmp_path, "linen-scanned", workload={**LINEN, **change})))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and line in result.stderr, result.stderr
    assert not list(Path(tmp_path).glob("**/*.db")), "a database was written for bad input"


def test_an_own_train_step_cannot_accumulate(tmp_path: Path, storage_url: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="configuration.global_batch: the workload's own train_step"):
        rs.SearchSpec.model_validate(spec_dict(
            storage_url, workload={**LINEN, "train_step": "linen_scanned:train_step"},
            configuration={"batch": [2], "global_batch": 4}))


def no_state_back(state: Any, tokens: Any) -> Any:
    """A step that forgot to return its state."""
    return state.apply_fn({"params": state.params}, tokens).mean()
