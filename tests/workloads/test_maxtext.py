"""``kind: maxtext``: MaxText's own model and train step, searched from a spec and from MaxText's
own command line (``remat-search maxtext``); each trial's peak is MaxText's own compile of the
same settings (``maxtext_reference``), on the CPU and on a ``v5e:2x2`` TPU topology ahead of
time, a tensor-parallel mesh included; the command's answer pastes into MaxText's loader; and
what a spec or a command line MaxText refuses gets.

MaxText needs Python ≥ 3.12 (the ``maxtext`` extra): where it is not installed, only the test of
that refusal runs here (the others are skipped with the reason)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

import remat_search
from remat_search.measure.check import GradientCheck
from remat_search.plans.export import maxtext
from remat_search.plans.plan import RematPlan
from remat_search.store.attributes import PLAN_ATTR
from remat_search.spec.maxtext import installed

from tests.conftest import REPO, run_process, spec_dict, write_spec

pytestmark = pytest.mark.slow  # MaxText's import alone takes 10-40 s
needs_maxtext = pytest.mark.skipif(not installed(), reason="MaxText is not installed (pip install 'remat-search[maxtext]', Python ≥ 3.12)")

TINY = {  # a 2-layer MaxText decoder small enough to compile in seconds
    "base_emb_dim": 64, "base_num_query_heads": 4, "base_num_kv_heads": 4, "base_mlp_dim": 128, "head_dim": 16,
    "base_num_decoder_layers": 2, "vocab_size": 256, "max_target_length": 32, "per_device_batch_size": 1,
    "dataset_type": "synthetic", "enable_checkpointing": False, "attention": "dot_product",
}
CHOICES = ["full", {"label": "save_qkv_proj", "names": ["query_proj", "key_proj", "value_proj"]},
           {"label": "save_out_proj", "names": ["out_proj"]}]


def maxtext_spec(tmp_path: Path, **overrides: object) -> dict:
    return spec_dict(f"sqlite:///{tmp_path / 'studies.db'}", **{
        "study": "mt", "workload": {"kind": "maxtext", "overrides": TINY},
        "space": {"layout": "uniform", "choices": CHOICES}, "trials": 3, "sampler": {"kind": "tpe", "seed": 0},
        "confirm": {"top": 0}, "timing": {"warmup": 1, "repeats": 2, "timeout": "600s"}, **overrides,
    })


def commanded(tmp_path: Path, *arguments: str) -> tuple[str, list[optuna.trial.FrozenTrial]]:
    """``remat-search maxtext ARGUMENTS`` on a study ``mt`` of its own storage: what it printed, and its
    complete trials."""
    storage = f"sqlite:///{tmp_path / 'command.db'}"
    return _ran(tmp_path, ("maxtext", *arguments, "--study", "mt", "--storage", storage), storage, "mt")


def _ran(tmp_path: Path, command: tuple[str, ...], storage: str, study: str) -> tuple[str, list[optuna.trial.FrozenTrial]]:
    home = tmp_path / "home"  # MaxText's base.yml keeps a JAX compilation cache in ~/jax_cache: not in a study
    # as a user who set no XLA log level (MaxText's package sets 0 in a process that imported it: this one may have)
    search = run_process(*command, env={"HOME": str(home), "TF_CPP_MIN_LOG_LEVEL": None})
    out = search.communicate(timeout=1200)[0]
    assert search.returncode == 0, out[-4000:]
    assert not (home / "jax_cache").exists()
    # MaxText brings libtpu: on a host without TPUs it stays quiet (and transformers, which MaxText imports)
    assert not [noise for noise in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "[transformers]") if noise in out], out
    assert not re.search(r"^I\d{4} ", out, re.MULTILINE), out  # no XLA INFO lines (MaxText's package turns them on)
    trials = optuna.load_study(study_name=study, storage=storage).get_trials()
    return out, [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]


def pasted(answer: str, form: str, tmp_path: Path) -> Any:
    """MaxText's own loader's reading of ``answer`` (``--format form``) laid over its base.yml, as a
    user pastes it onto their config (``maxtext``) or gives it after it (``maxtext-args``)."""
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    # base.yml's ~/jax_cache would turn on JAX's persistent cache in this test process, for
    # every test after it on this worker (CI, stop 53: a TPU compile-only client read an entry)
    theirs = {**TINY, "base_config": base, "skip_jax_distributed_system": True, "jax_cache_dir": ""}
    config_file = tmp_path / "theirs.yml"
    if form == "maxtext":
        config_file.write_text(yaml.safe_dump({**theirs, **yaml.safe_load(answer)}, sort_keys=False))
        return pyconfig.initialize(["train", str(config_file)])
    config_file.write_text(yaml.safe_dump(theirs, sort_keys=False))
    return pyconfig.initialize(["train", str(config_file), *answer.split()])


def answer_of(out: str) -> str:
    """The answer ``remat-search maxtext`` printed, after its line saying what to paste it onto."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("The answer for "))
    return "\n".join(line for line in lines[start + 1:] if not line.startswith(("note:", "WARNING")))


TINY_ARGS = tuple(f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in TINY.items())
"""``TINY`` as MaxText's key=value arguments."""


def maxtexts_own(settings: list[dict]) -> list[dict]:
    """MaxText's own compile of each mapping of ``settings`` (``maxtext_reference``, one process), its memory."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.workloads.maxtext_reference", json.dumps(settings)], cwd=REPO,
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line.removeprefix("MEMORY ")) for line in done.stdout.splitlines() if line.startswith("MEMORY ")]


@needs_maxtext
@pytest.mark.filterwarnings("ignore::DeprecationWarning:mpmath.*")  # mpmath (MaxText imports it) warns of itself on import
def test_on_cpu_the_maxtext_command_s_peaks_are_maxtext_s_own_and_its_answer_pastes(tmp_path: Path) -> None:
    """``remat-search maxtext --space tensors`` with MaxText's own key=value arguments, no spec:
    every custom policy it tried (the two presets, every tensor on the device or every one
    recomputed, then the planner's) has MaxText's own compile's peak, and its first step
    (bfloat16 matmuls, MaxText's AdamW, float32 weights) passes the check against full remat's,
    read from MaxText's own optimizer state, within the threshold measured on it; the answer it
    prints, pasted onto a config, reads back through MaxText's loader as the plan the study
    ranked first. (MaxText's presets are the v5e test's.)"""
    out, trials = commanded(tmp_path, *TINY_ARGS, "--budget", "1GiB", "--trials", "3", "--space", "tensors",
                            "--tensors", "query_proj,out_proj,mlpwo")
    assert len(trials) == 3
    plans = [RematPlan.from_json(trial.user_attrs[PLAN_ATTR]) for trial in trials]
    assert len({plan.digest for plan in plans}) == 3
    assert [str(plan.layers[0]) for plan in plans[:2]] == ["per_name(mlpwo,out_proj,query_proj)", "full"]
    owns = maxtexts_own([{**TINY, **maxtext(plan), "hardware": "cpu", "skip_jax_distributed_system": True} for plan in plans])
    for trial, plan, own in zip(trials, plans, owns, strict=True):
        peak = own["argument"] + own["output"] - own["alias"] + own["temp"]  # the CPU compiler states no peak
        assert trial.values[1] == peak, (plan.summary(), trial.values, own)
        measured = json.loads(trial.user_attrs["measurement"])  # run, and its first step checked against full remat's
        check = GradientCheck.model_validate(measured["grad_check"])
        assert measured["grad_reference"] == "full" and check.failure() is None, measured
        assert "first moment ('mu')" in check.compared and check.precision == "bfloat16 matmuls" and check.rounding > 1e-4
        assert check.leaf_error <= check.leaf_threshold and check.tree_error <= check.tree_threshold
    first = remat_search.load_report("mt", f"sqlite:///{tmp_path / 'command.db'}").best(2**30)  # `best`'s answer
    assert first.plan is not None and first.plan.digest in {plan.digest for plan in plans}
    loaded = pasted(answer_of(out), "maxtext", tmp_path)
    for key, value in maxtext(first.plan).items():
        assert str(getattr(loaded, key)).split(".")[-1].lower() == str(value).lower(), key
    assert out.count("never tags with checkpoint_name") <= 1, out  # a note once, not again by MaxText's root logger


@needs_maxtext
def test_on_a_v5e_topology_each_trial_s_peak_is_train_compile_s_own_and_the_command_s_answer_pastes(tmp_path: Path) -> None:
    """``remat-search maxtext ... compile_topology=v5e-4 --mesh tensor=4 --mesh fsdp=2,tensor=2``:
    the first mesh is one MaxText refuses (``tensor=4`` over 2 key/value heads): the first
    preset there is an infeasible trial with MaxText's reason, never compiled, and the presets
    then run over the second mesh; each compiled trial's peak is ``train_compile``'s own, and
    the answer, given as arguments after a config, reads back through MaxText's loader as the
    plan the study ranked first."""
    two_kv = {**TINY, "base_num_kv_heads": 2}
    args = [f"{key}={value}" for key, value in two_kv.items()]
    out, trials = commanded(tmp_path, *args, "compile_topology=v5e-4", "--mesh", "tensor=4", "--mesh", "fsdp=2,tensor=2",
                            "--batch", "2", "--trials", "3", "--format", "maxtext-args")
    every = optuna.load_study(study_name="mt", storage=f"sqlite:///{tmp_path / 'command.db'}").trials
    assert len(trials) == 2, [t.user_attrs for t in every]
    plans = [RematPlan.from_json(trial.user_attrs[PLAN_ATTR]) for trial in trials]
    assert all(plan.configuration is not None and dict(plan.configuration.mesh) == {"fsdp": 2, "tensor": 2} for plan in plans)
    assert len({plan.digest for plan in plans}) == 2
    owns = maxtexts_own([
        {**two_kv, **maxtext(plan), "compile_topology": "v5e-4", "compile_topology_num_slices": 1, "skip_jax_distributed_system": True}
        for plan in plans
    ])
    for trial, plan, own in zip(trials, plans, owns, strict=True):
        assert trial.values[1] == own["peak"], (plan.summary(), trial.values, own)
    report = remat_search.load_report("mt", f"sqlite:///{tmp_path / 'command.db'}")
    first = report.best(report.budget)  # `best`'s answer at the study's budget, the chip's HBM
    assert first.plan is not None and first.time_source == "estimated"
    # as `best` says it: the two plans' estimates differ by less than their band, which cannot rank them
    assert "note: within the estimate's error of: trial " in out, out
    assert "│ … │" not in out and "fsdp=2,tensor=2:" in out, out  # at 80 columns the band wraps, crushing no column
    loaded = pasted(answer_of(out), "maxtext-args", tmp_path)
    for key, value in maxtext(first.plan).items():
        assert str(getattr(loaded, key)).split(".")[-1].lower() == str(value).lower(), key
    [refused] = [t for t in every if t.state == optuna.trial.TrialState.PRUNED]
    measured = json.loads(refused.user_attrs["measurement"])
    assert measured["status"] == "infeasible" and measured.get("peak_bytes") is None, measured
    assert measured["error"].startswith("MaxText refuses the candidate: num_kv_heads (2)"), measured
    assert "divisible by 4" in measured["error"] and "\n" not in measured["error"]
    assert dict(RematPlan.from_json(refused.user_attrs[PLAN_ATTR]).configuration.mesh) == {"tensor": 4}
    assert refused.system_attrs["constraints"] == [1.0]  # the samplers see it as infeasible
    # every other preset, taken from the queue at tensor=4, was moved (failed, counted for nothing) to fsdp=2,tensor=2
    moved = [t for t in every if t.state == optuna.trial.TrialState.FAIL]
    assert moved and all(t.user_attrs["failure"] == "moved" and t.user_attrs["moved_to"].endswith("fsdp=2,tensor=2")
                         and dict(RematPlan.from_json(t.user_attrs[PLAN_ATTR]).configuration.mesh) == {"tensor": 4} for t in moved)
    # each preset queued again there once (the refused one too): the 2 that ran, the rest waiting for a longer study
    waiting = [t for t in every if t.state == optuna.trial.TrialState.WAITING]
    assert len(waiting) == len(moved) + 1 - len(trials) and len(every) == 1 + len(moved) + len(trials) + len(waiting)


@needs_maxtext
@pytest.mark.filterwarnings("ignore::DeprecationWarning:mpmath.*")  # mpmath (MaxText imports it) warns of itself on import
def test_maxtext_s_axes_are_what_mesh_all_spans_and_a_setting_maxtext_refuses_is_a_spec_error() -> None:
    """``mesh: all`` of a MaxText workload spans MaxText's axes (a MaxText mesh may name only
    them); a memory knob to search is read by MaxText's loader, value by value, before anything
    is written."""
    from remat_search.errors import SpecError
    from remat_search.search.configurations import MAXTEXT_AXES, check_workload, search_axes
    from remat_search.spec.loading import parse_spec
    from remat_search.spec.workloads import MaxTextConfig

    assert search_axes(MaxTextConfig(kind="maxtext", overrides=TINY)) == (MAXTEXT_AXES, True)
    assert search_axes(MaxTextConfig(kind="maxtext", overrides={**TINY, "num_experts": 4, "base_moe_mlp_dim": 128, "num_experts_per_tok": 2}))[0][-1] == "expert"
    base = {"study": "mt", "storage": "sqlite:///unused.db", "workload": {"kind": "maxtext", "overrides": TINY}, "space": "maxtext",
            "trials": 2}
    good = parse_spec({**base, "configuration": {"batch": [1], "settings": {"optimizer_memory_host_offload": [False, True]}}})
    check_workload(good)
    bad = parse_spec({**base, "configuration": {"batch": [1], "settings": {"optimizer_memory_host_offload": [False, "sometimes"]}}})
    with pytest.raises(SpecError, match=r"^spec.configuration.settings.optimizer_memory_host_offload: MaxText refuses the settings: "):
        check_workload(bad)


@needs_maxtext
@pytest.mark.filterwarnings("ignore::DeprecationWarning:mpmath.*")  # mpmath (MaxText imports it) warns of itself on import
@pytest.mark.parametrize(("meshes", "expected"), [
    # (mesh, per-data-parallel batch, accumulation) of each candidate, the first the config's own step
    (["tensor=4", "fsdp=2,tensor=2"], [({"tensor": 4}, 4, 1), ({"tensor": 4}, 2, 2), ({"fsdp": 2, "tensor": 2}, 2, 1)]),
    (["fsdp=4", "fsdp=2,tensor=2"], [({"fsdp": 4}, 1, 1), ({"fsdp": 2, "tensor": 2}, 2, 1), ({"fsdp": 2, "tensor": 2}, 1, 2)]),
])
def test_meshes_without_batch_keep_the_config_s_global_batch_on_a_topology(meshes: list[str], expected: list) -> None:
    """``remat-search maxtext ... compile_topology=v5e-4 --mesh ...`` without ``--batch``: the
    config's ``per_device_batch_size: 1`` counts all 4 chips, so every candidate trains 4 examples
    a step, over a ``tensor`` axis too (a batch per data-parallel device read from it would train
    fewer there), and each answer's ``per_device_batch_size`` and accumulation give MaxText the same."""
    from remat_search.plans.export import maxtext_configuration
    from remat_search.search.configurations import MAXTEXT_AXES, configurations
    from remat_search.spec.maxtext_study import maxtext_study

    spec = maxtext_study([*TINY_ARGS, "compile_topology=v5e-4"], budget="1GiB", meshes=meshes)
    assert spec.configuration is not None and spec.configuration.global_batch == 4
    found = configurations(spec.configuration, devices=4, mesh=None, sequence=32, axes=MAXTEXT_AXES, strict=True)
    assert [(dict(c.mesh), c.batch, c.accumulation) for c in found] == expected
    for c in found:
        settings = maxtext_configuration(c)
        assert settings["per_device_batch_size"] * 4 * settings["gradient_accumulation_steps"] == 4, settings


@needs_maxtext
@pytest.mark.filterwarnings("ignore::DeprecationWarning:mpmath.*")  # mpmath (MaxText imports it) warns of itself on import
def test_with_space_tensors_and_no_names_the_study_places_the_tensors_the_model_tags(tmp_path: Path) -> None:
    """``--space tensors`` without ``--tensors`` on a ``decoder_block: default`` decoder (a GELU
    MLP, the 2023 runs' model): the study places the tensors its traced step tags, ``mlpwi`` among
    them and not a gated decoder's ``mlpwi_0``/``mlpwi_1`` (a fixed list would search two tensors
    that save nothing and leave the largest recomputed), each of them and no other
    (``decoder_layer_input`` aside: MaxText keeps it on the device on local devices); and the same
    command resumes the study with its stored names."""
    from remat_search.plans.export import PINNED

    command = (*TINY_ARGS, "decoder_block=default", "mlp_activations=[gelu]", "--budget", "1GiB", "--space", "tensors")
    out, trials = commanded(tmp_path, *command, "--trials", "1")
    study = optuna.load_study(study_name="mt", storage=f"sqlite:///{tmp_path / 'command.db'}")
    placed = study.user_attrs["spec"]["space"]["tensors"]
    traced = study.user_attrs["device_info"]["traced_names"]
    assert "mlpwi" in placed and not {"mlpwi_0", "mlpwi_1"} & set(placed), placed
    assert sorted(placed) == sorted(set(traced) - {PINNED}), (placed, traced)
    assert f"note: --space tensors: the traced step's tensors: {', '.join(placed)}" in out and len(trials) == 1
    assert "the space does not place" not in out, out  # decoder_layer_input: nothing to place without offload
    out, trials = commanded(tmp_path, *command, "--trials", "1")  # refused, had it placed other names
    assert f"note: --space tensors: the study's tensors: {', '.join(placed)}" in out and len(trials) == 1


@needs_maxtext
@pytest.mark.filterwarnings("ignore::DeprecationWarning:mpmath.*")  # mpmath (MaxText imports it) warns of itself on import
@pytest.mark.parametrize(("settings", "point"), [
    (["remat_policy=custom", "query_proj=offload", "out_proj=device"], "per_name(decoder_layer_input,out_proj; offload query_proj)"),
    (["remat_policy=save_qkv_proj"], "per_name(key_proj,query_proj,value_proj)"),
    (["remat_policy=full"], None),  # every tensor recomputed: a preset of the space already
    (["remat_policy=custom", "context=device"], None),  # a tensor kept outside the space's names
    (["remat_policy=custom", "query_proj=offload", "local"], None),  # offloaded where there is no host memory
])
def test_with_space_tensors_the_config_s_own_policy_is_measured_first(settings: list[str], point: str | None) -> None:
    """``remat-search maxtext ... --space tensors``: the config's own remat policy, as MaxText's
    loader reads it, is the space's first point, so the study sets its answer against it; none
    where the space cannot state it."""
    from remat_search.search.space import Space
    from remat_search.spec.maxtext_study import maxtext_study

    topology = [] if "local" in settings else ["compile_topology=v5e-4"]
    spec = maxtext_study([*TINY_ARGS, *[s for s in settings if s != "local"], *topology], budget="1GiB", tensors=[])
    assert [str(p.policy) for p in spec.space.points] == ([point] if point else [])
    if point:
        first = Space.of(spec.space, 2).presets()[0]
        assert str(Space.of(spec.space, 2).plan(first).layers[0]) == point


REFUSED = [
    ({"overrides": {**TINY, "bogus_key": 1}}, "'bogus_key' not in 'emb_dim'"),
    ({"overrides": {**TINY, "base_emb_dim": "wide"}}, "base_emb_dim: Input should be a valid integer"),
    ({"config": "missing.yml", "overrides": TINY}, "No such file or directory"),  # relative to the spec's folder
]


@needs_maxtext
@pytest.mark.filterwarnings("ignore::DeprecationWarning:mpmath.*")  # mpmath (MaxText imports it) warns of itself on import
@pytest.mark.parametrize(("workload", "reason"), REFUSED, ids=["unknown key", "bad value", "no config file"])
def test_a_setting_maxtext_refuses_is_one_line_quoting_maxtext(tmp_path: Path, workload: dict, reason: str) -> None:
    """The spec read from its file (a config path is relative to the spec's folder), then
    MaxText's own loader, as ``run`` reads them, in this process: one line quoting MaxText."""
    from remat_search.errors import SpecError
    from remat_search.spec.loading import load_spec
    from remat_search.spec.maxtext import maxtext_config

    spec = load_spec(write_spec(tmp_path / "spec.yaml", maxtext_spec(tmp_path, workload={"kind": "maxtext", **workload})))
    with pytest.raises(SpecError) as refused:
        maxtext_config(spec.workload)  # type: ignore[arg-type]
    line = str(refused.value)
    assert line.startswith("spec.workload: MaxText refuses the settings: ") and "\n" not in line, line
    assert reason in line and len(line) < 400, line
    if "config" in workload:
        assert str(tmp_path / "missing.yml") in line


@needs_maxtext
@pytest.mark.parametrize("command", ["run", "maxtext"])
def test_a_setting_maxtext_refuses_exits_2_with_one_line_and_nothing_written(tmp_path: Path, command: str) -> None:
    """``run`` of a spec MaxText refuses (one of the refusals above: each is the same line from
    the same loader), or ``maxtext`` given the same key=value, prints that line alone and exits 2
    before writing anything."""
    workload, reason = REFUSED[0]
    if command == "run":
        spec = maxtext_spec(tmp_path, workload={"kind": "maxtext", **workload})
        search = run_process("run", str(write_spec(tmp_path / "spec.yaml", spec)))
        said = "error: spec.workload: MaxText refuses the settings: "
    else:
        search = run_process("maxtext", *TINY_ARGS, "bogus_key=1", "--budget", "1GiB", "--storage",
                             f"sqlite:///{tmp_path / 'studies.db'}")
        said = "error: KEY=VALUE: MaxText refuses them: "
    out = search.communicate(timeout=600)[0]
    assert search.returncode == 2, out
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith("budget ")]  # `run` says its budget first
    assert len(lines) == 1 and lines[0].startswith(said), out
    assert reason in lines[0] and len(lines[0]) < 400, out
    assert not (tmp_path / "studies.db").exists()


@pytest.mark.parametrize(("arguments", "said"), [
    (["nothing.yml"], "error: CONFIG: no such file 'nothing.yml'"),
    (["base_emb_dim"], "error: KEY=VALUE: expected MaxText settings as key=value"),
    (["compile_topology=v9z-4"], "error: compile_topology: MaxText knows no topology 'v9z-4'"),
    (["compile_topology=v5e-4", "compile_topology_num_slices=2"], "error: compile_topology_num_slices: expected 1"),
    (["compile_topology=v5e-4", "--mesh", "fsdp=two"], "error: --mesh: expected AXIS=N,AXIS=N"),
    (["--format", "yaml"], "error: --format: expected maxtext or maxtext-args"),
    (["--space", "all"], "error: --space: expected presets or tensors, got 'all'"),
    (["--tensors", "out_proj"], "error: --tensors: only with --space tensors"),
    ([*TINY_ARGS, "--budget", "1GiB", "--space", "tensors", "--tensors", "out_proj,out_proj"],
     "error: --tensors: each name once, repeated: ['out_proj']"),
    ([*TINY_ARGS, "--budget", "1GiB", "--space", "tensors", "--tensors", "out_proj,bogus"],
     "error: --tensors: unknown tensor name(s) ['bogus']; the workload names"),  # found as the search opens
    ([*TINY_ARGS, "per_device_batch_size=0.375", "compile_topology=v5e-4", "--mesh", "fsdp=4"],
     "error: --batch: the config's per_device_batch_size 0.375 × 4 chips is no whole global batch"),
    ([*TINY_ARGS, "--budget", "wide"], "error: --budget: expected"),
    (TINY_ARGS, "error: --budget: required here: cpu reports no memory limit"),  # found as the search opens
    ([*TINY_ARGS, "--space", "tensors"], "error: --budget: required here"),  # after the step's tags are traced
])
@pytest.mark.filterwarnings("ignore::DeprecationWarning:mpmath.*")  # mpmath (MaxText imports it) warns of itself on import
def test_the_maxtext_command_tells_bad_arguments_in_a_line_exit_2(tmp_path: Path, cli: Any, arguments: list[str], said: str) -> None:
    """Each bad argument of ``remat-search maxtext`` is one line naming it, exit 2, no study written."""
    if not installed() and ("compile_topology" in " ".join(arguments) or arguments[0] == TINY_ARGS[0]):
        pytest.skip("MaxText names the topologies and reads the settings")
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    budget = [] if arguments[0] == TINY_ARGS[0] else ["--budget", "1GiB"]  # the budget cases give theirs, or none
    result = cli("maxtext", *arguments, *budget, "--storage", storage)
    errors = [line for line in result.stderr.splitlines() if not line.startswith("note: ")]  # the search's notes, where it opened
    assert result.exit_code == 2 and len(errors) == 1, result.stdout + result.stderr
    assert errors[0].startswith(said), result.stderr
    assert not (tmp_path / "studies.db").exists()


BLOCK_MAXTEXT = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "maxtext" or name.startswith("maxtext."):
            raise ModuleNotFoundError("No module named 'maxtext'")
sys.meta_path.insert(0, Blocker())
from remat_search.cli.app import main
sys.argv = ["remat-search", *sys.argv[1:]]
main()
"""


def test_without_maxtext_a_maxtext_spec_is_one_line_naming_the_install_exit_2_nothing_written(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", maxtext_spec(tmp_path))
    done = subprocess.run([sys.executable, "-c", BLOCK_MAXTEXT, "run", str(spec)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'remat-search[maxtext]'" in lines[0], done.stderr
    assert not (tmp_path / "studies.db").exists()


@needs_maxtext
def test_the_export_names_every_tensor_and_mesh_setting_maxtext_reads() -> None:
    from remat_search.plans.export import MAXTEXT_ICI, MAXTEXT_NAMES
    from remat_search.workloads.maxtext import remat_names

    assert sorted(MAXTEXT_NAMES) == sorted(remat_names())
    from maxtext.configs import types

    ici = {n for model in types.__dict__.values() if isinstance(model, type) and hasattr(model, "model_fields")
           for n in getattr(model, "model_fields", {}) if n.startswith("ici_") and n.endswith("_parallelism") and n != "ici_parallelism"}  # that one: derived
    assert ici == set(MAXTEXT_ICI.values())


@needs_maxtext
@pytest.mark.parametrize("form", ["maxtext", "maxtext-args"])
def test_an_answer_pasted_onto_a_config_that_sets_other_values_gives_the_study_s_program(tmp_path: Path, form: str) -> None:
    """Pasted at the end of a config that sets other axes, names, batch and policy (or given as
    arguments after it), MaxText's own loader reads the answer's settings, every one: its global
    batch, mesh and policy."""
    import jax
    from maxtext.configs import pyconfig

    from remat_search.plans.configuration import Configuration
    from remat_search.plans.export import export
    from remat_search.plans.policy import LayerPolicy

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    theirs = {
        "base_config": base, "remat_policy": "minimal", "query_proj": "offload", "context": "device",
        "attention_out": "device", "ici_data_parallelism": 2, "ici_fsdp_parallelism": -1, "per_device_batch_size": 8,
        "gradient_accumulation_steps": 4, "internal_compile": True, "internal_compile_num_devices": 4,
        "skip_jax_distributed_system": True,
        # base.yml's ~/jax_cache would turn on JAX's persistent cache in this test process, for
        # every test after it on this worker (CI, stop 53: a TPU compile-only client read an entry)
        "jax_cache_dir": "",
    }
    configuration = Configuration(batch=2, accumulation=2, mesh={"fsdp": 2, "tensor": 2}, sequence=32)
    plan = RematPlan.uniform(LayerPolicy(kind="names", names=("key_proj", "value_proj")), 2).model_copy(
        update={"configuration": configuration}
    )
    answer = export(plan, form)  # type: ignore[arg-type]
    config_file = tmp_path / "theirs.yml"
    if form == "maxtext":  # the user's config with the answer pasted over it
        config_file.write_text(yaml.safe_dump({**theirs, **yaml.safe_load(answer)}, sort_keys=False))
        loaded = pyconfig.initialize(["train", str(config_file)])
    else:  # the answer as arguments after the user's config
        config_file.write_text(yaml.safe_dump(theirs, sort_keys=False))
        loaded = pyconfig.initialize(["train", str(config_file), *answer.split()])
    for key, value in maxtext(plan).items():
        assert str(getattr(loaded, key)).split(".")[-1].lower() == str(value).lower(), key
    assert loaded.remat_policy == "custom" and loaded.query_proj == "remat" and loaded.key_proj == "device"
    assert loaded.global_batch_size_to_train_on == configuration.global_batch == 8
    assert dict(zip(loaded.mesh_axes, loaded.ici_parallelism, strict=True))["tensor"] == 2
    assert not jax.config.jax_compilation_cache_dir  # MaxText's loader left JAX's cache off


@needs_maxtext
@pytest.mark.filterwarnings("ignore::DeprecationWarning:mpmath.*")  # mpmath (MaxText imports it) warns of itself on import
def test_a_plan_maxtext_cannot_state_raises_when_its_step_is_built() -> None:
    """docs/spec.md: such a plan is a failed trial with the export's reason (the worker makes any
    candidate that raises one)."""
    from remat_search.errors import SpecError
    from remat_search.spec.workloads import MaxTextConfig
    from remat_search.workloads.maxtext import MaxTextWorkload

    workload = MaxTextWorkload(MaxTextConfig(kind="maxtext", overrides=TINY))
    with pytest.raises(SpecError, match="policy 'dots' has no MaxText custom form"):
        workload.step(RematPlan.uniform("dots", workload.layers))
