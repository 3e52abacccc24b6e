"""`best --format json|yaml|maxtext`: the answer written for where it is used."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import remat_search
from remat_search import LayerPolicy, RematPlan
from remat_search.errors import SpecError
from remat_search.plans.configuration import Configuration
from remat_search.plans.export import MAXTEXT_ICI, MAXTEXT_NAMES, export, maxtext
from remat_search.spec.loading import parse_spec
from tests.conftest import spec_dict


def test_a_uniform_names_plan_is_maxtext_custom_with_its_names_on_the_device() -> None:
    plan = RematPlan.uniform(LayerPolicy(kind="names", names=("context", "out_proj")), 4)
    settings = maxtext(plan)
    assert settings == {
        "remat_policy": "custom",
        **{n: "device" if n in ("context", "out_proj", "decoder_layer_input") else "remat" for n in MAXTEXT_NAMES},
    }
    assert yaml.safe_load(export(plan, "maxtext")) == settings


def test_offload_and_full_have_their_maxtext_forms() -> None:
    offload = maxtext(RematPlan.uniform(LayerPolicy(kind="offload", names=("mlpwi", "decoder_layer_input")), 2))
    assert offload["mlpwi"] == offload["decoder_layer_input"] == "offload" and offload["context"] == "remat"
    assert maxtext(RematPlan.uniform("full", 3)) == {"remat_policy": "full"}


def test_per_name_is_maxtext_custom_name_by_name() -> None:
    policy = LayerPolicy(kind="per_name", names=("query_proj", "key_proj"), offload=("mlpwi", "context"))
    settings = maxtext(RematPlan.uniform(policy, 2))
    assert settings == {
        "remat_policy": "custom",
        **{n: "device" if n in ("query_proj", "key_proj", "decoder_layer_input") else
           "offload" if n in ("mlpwi", "context") else "remat" for n in MAXTEXT_NAMES},
    }


@pytest.mark.parametrize(("plan", "why"), [
    (RematPlan.uniform(LayerPolicy(kind="per_name", names=("context",), offload=("my_tensor",)), 2),
     "['my_tensor'] are not MaxText's tensor names"),
    (RematPlan.uniform(LayerPolicy(kind="function", function="tests.policies:save_softmax"), 2),
     "policy function(tests.policies:save_softmax) is a function of your own"),
    (RematPlan(layers=(LayerPolicy(kind="full"), LayerPolicy(kind="dots"))), "MaxText applies one to every decoder layer"),
    (RematPlan.uniform("dots", 2), "policy 'dots' has no MaxText custom form"),
    (RematPlan.uniform(LayerPolicy(kind="names", names=("my_tensor",)), 2), "['my_tensor'] are not MaxText's tensor names"),
])
def test_a_plan_maxtext_cannot_express_says_why(plan: RematPlan, why: str) -> None:
    with pytest.raises(SpecError, match=r"^--format maxtext: .*" + re.escape(why)):
        maxtext(plan)


def _configured(plan: RematPlan, **configuration: object) -> RematPlan:
    return plan.model_copy(update={"configuration": Configuration.model_validate(configuration)})


def test_a_configured_plan_writes_its_batch_accumulation_and_mesh_after_its_remat_settings() -> None:
    plan = _configured(
        RematPlan.uniform(LayerPolicy(kind="names", names=("context",)), 2),
        batch=4, accumulation=2, mesh={"data": 2, "fsdp": 2}, sequence=32,
    )
    written = export(plan, "maxtext")
    remat = maxtext(RematPlan.uniform(LayerPolicy(kind="names", names=("context",)), 2))
    every_other_axis = [(setting, 1) for axis, setting in MAXTEXT_ICI.items() if axis not in ("data", "fsdp")]
    assert list(yaml.safe_load(written).items()) == [
        *remat.items(),
        ("per_device_batch_size", 4), ("gradient_accumulation_steps", 2),
        ("ici_data_parallelism", 2), ("ici_fsdp_parallelism", 2), *every_other_axis,
    ]
    full = _configured(RematPlan.uniform("full", 3), batch=8, mesh={"fsdp": 4})
    assert export(full, "maxtext").startswith(
        "remat_policy: full\nper_device_batch_size: 8\ngradient_accumulation_steps: 1\nici_fsdp_parallelism: 4\n"
        "ici_diloco_parallelism: 1\nici_data_parallelism: 1\n"
    )
    assert export(full, "maxtext-args").startswith(
        "remat_policy=full per_device_batch_size=8 gradient_accumulation_steps=1 ici_fsdp_parallelism=4 "
    )
    alone = _configured(RematPlan.uniform("full", 3), batch=2)
    assert maxtext(alone) == {
        "remat_policy": "full", "per_device_batch_size": 2, "gradient_accumulation_steps": 1,
        **{setting: 1 for setting in MAXTEXT_ICI.values()},
    }


def test_maxtext_s_per_device_batch_is_each_device_s_share_of_the_micro_batch() -> None:
    """A configuration's batch is per data-parallel device; MaxText's per device, tensor and
    pipeline devices included: over fsdp=2 × tensor=2 a batch of 4 is 2 a device, of 1 is 0.5."""
    full = RematPlan.uniform("full", 2)
    split = maxtext(_configured(full, batch=4, mesh={"fsdp": 2, "tensor": 2}))
    assert split["per_device_batch_size"] == 2 and split["ici_tensor_parallelism"] == 2
    assert maxtext(_configured(full, batch=1, mesh={"fsdp": 2, "tensor": 2}))["per_device_batch_size"] == 0.5
    staged = maxtext(_configured(full, batch=2, mesh={"data": 2, "stage": 2, "expert": 2, "sequence": 1}))
    assert [k for k in staged if k.startswith("ici_")][:4] == [
        "ici_data_parallelism", "ici_pipeline_parallelism", "ici_expert_parallelism", "ici_sequence_parallelism",
    ]  # the mesh's axes first, then every other at 1
    assert {k for k in staged if k.startswith("ici_")} == set(MAXTEXT_ICI.values())


def test_a_mesh_axis_maxtext_has_no_setting_for_and_a_nested_plan_are_refused() -> None:
    with pytest.raises(SpecError, match=r"^--format maxtext: mesh axis 'model' has no MaxText ici_\*_parallelism setting"):
        maxtext(_configured(RematPlan.uniform("full", 2), batch=2, mesh={"data": 2, "model": 2}))
    nested = RematPlan(layers=(LayerPolicy(kind="full"),) * 4, layout="nested")
    with pytest.raises(SpecError, match=r"^--format maxtext: the plan is nested \(nested: full×4\)"):
        maxtext(nested)


def test_yaml_and_json_load_back_as_the_plan() -> None:
    plan = RematPlan(layers=(LayerPolicy(kind="full"), LayerPolicy(kind="names", names=("context",))))
    assert RematPlan.model_validate(yaml.safe_load(export(plan, "yaml"))) == plan
    assert RematPlan.from_json(export(plan, "json")) == plan


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('export') / 'studies.db'}"
    remat_search.run(parse_spec(spec_dict(
        url, trials=2, confirm={"top": 0},
        space={"layout": "uniform", "choices": ["full", {"label": "save_attn", "names": ["context", "out_proj"]}]},
    )))
    return url


def test_best_in_each_format_is_the_same_plan(cli, study: str) -> None:  # type: ignore[no-untyped-def]
    ask = ("best", "--study", "tiny", "--budget", "1GiB", "--storage", study)
    as_json = cli(*ask, "--json")
    assert as_json.exit_code == 0, as_json.stderr
    plan = RematPlan.from_json(as_json.stdout)
    assert cli(*ask, "--format", "json").stdout == as_json.stdout
    assert RematPlan.model_validate(yaml.safe_load(cli(*ask, "--format", "yaml").stdout)) == plan
    assert yaml.safe_load(cli(*ask, "--format", "maxtext").stdout) == maxtext(plan)


def test_an_unknown_format_is_one_line(cli, study: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    result = cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", study, "--format", "toml")
    assert result.exit_code == 2
    assert result.stderr == "error: --format: expected table, json, yaml, maxtext, maxtext-args; got 'toml'\n"


def test_best_plan_refuses_a_study_measured_with_another_jax_device_or_workload(study: str, tmp_path: Path) -> None:
    import sqlite3

    import optuna

    from remat_search.spec.workloads import MlpConfig, TransformerConfig
    from remat_search.workloads.base import build_workload
    from tests.conftest import TINY_TRANSFORMER

    mine = build_workload(TransformerConfig(**TINY_TRANSFORMER))
    assert remat_search.best_plan("tiny", "1GiB", study, workload=mine).plan is not None
    other = build_workload(MlpConfig(kind="mlp", layers=2, width=16, hidden=32, batch=4))
    with pytest.raises(SpecError, match=r"^best_plan: study 'tiny' was measured with workload_fingerprint '"):
        remat_search.best_plan("tiny", "1GiB", study, workload=other)

    copy = tmp_path / "copy.db"
    with sqlite3.connect(study.removeprefix("sqlite:///")) as source, sqlite3.connect(copy) as target:
        source.backup(target)  # the WAL's pages too
    stored = optuna.load_study(study_name="tiny", storage=f"sqlite:///{copy}")
    measured_on = stored.user_attrs["device_info"]
    for key, value in (("jax_version", "0.4.1"), ("device_kind", "TPU v5 lite")):
        stored.set_user_attr("device_info", {**measured_on, key: value})
        with pytest.raises(SpecError, match=f"was measured with {key} '{value}', and this process has"):
            remat_search.best_plan("tiny", "1GiB", f"sqlite:///{copy}")
        assert remat_search.best_plan("tiny", "1GiB", f"sqlite:///{copy}", check=False).plan is not None
