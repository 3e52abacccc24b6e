"""Bad input: one line naming the field, exit code 2, and nothing written."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from remat_search.store.storage import translate_errors

from tests.conftest import spec_dict, write_spec


def _assert_rejected(result: Any, field: str, folder: Path) -> None:
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert field in result.stderr, result.stderr
    assert not list(folder.glob("*.db*")), "a database was written for bad input"


BAD_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown key", {"budgett": "1GiB"}, "spec.budgett: unknown key"),
    ("unknown policy", {"space": {"choices": ["fulll"]}}, "spec.space.choices.0: unknown policy 'fulll'"),
    ("unknown tensor", {"space": {"choices": ["full", {"label": "x", "names": ["qkv_typo"]}]}},
     "spec.space.choices.1: unknown tensor name(s) ['qkv_typo']"),
    ("budget with a bad unit", {"budget": "16 GiBs"}, "spec.budget: expected a positive size"),
    ("negative budget", {"budget": -1}, "spec.budget: expected a positive size"),
    ("no trials", {"trials": 0}, "spec.trials"),
    ("bad study name", {"study": "my study"}, "spec.study: expected a study name"),
    ("unknown workload kind", {"workload": {"kind": "cnn"}}, "spec.workload: expected kind"),
    ("heads do not divide", {"workload": {**spec_dict("x")["workload"], "heads": 3}}, "spec.workload"),
    ("factory does not import", {"workload": {"factory": "no_such_module:make"}},
     "workload.factory: 'no_such_module:make' does not import"),
    ("factory returns no workload", {"workload": {"factory": "tests.factories:not_a_workload"}},
     "returned dict, expected a remat_search.Workload"),
    ("factory raises", {"workload": {"factory": "tests.factories:failing_factory"}},
     "raised ValueError: factory needs a config file"),
    ("missing function", {"workload": {"factory": "tests.factories:nope"}}, "has no function 'nope'"),
    ("offload on cpu", {"space": {"choices": ["full", {"label": "off", "offload": ["context"]}]}},
     "needs a GPU or TPU"),
    ("per_name offload on cpu", {"space": {"choices": ["full", {"label": "off", "per_name": {
        "device": ["context"], "offload": ["mlpwi"]}}]}}, "['off'] offload to host memory, which needs a GPU or TPU"),
    ("per_name unknown tensor", {"space": {"choices": [{"label": "x", "per_name": {"offload": ["qkv_typo"]}}]}},
     "spec.space.choices.0: unknown tensor name(s) ['qkv_typo']"),
    ("policy function does not import", {"space": {"choices": [
        "full", {"label": "sm", "function": "no_such_module:save_softmax"}]}},
     "spec.space.choices.1.function: 'no_such_module:save_softmax' does not import"),
    ("policy function missing", {"space": {"choices": [{"label": "sm", "function": "tests.policies:nope"}]}},
     "spec.space.choices.0.function: 'tests.policies:nope': module 'tests.policies' has no function 'nope'"),
    ("policy function not callable", {"space": {"choices": [{"label": "sm", "function": "tests.policies:not_a_function"}]}},
     "spec.space.choices.0.function: 'tests.policies:not_a_function' is a int, not a jax.checkpoint policy function"),
    ("policy function not a path", {"space": {"choices": [{"label": "sm", "function": "save_softmax"}]}},
     "spec.space.choices.0.policy.function: expected an import path 'package.module:function'"),
    ("timeout", {"timing": {"timeout": "soon"}}, "spec.timing.timeout"),
    ("no repeats", {"timing": {"repeats": 0}}, "spec.timing.repeats"),
    ("unknown sampler", {"sampler": {"kind": "cmaes"}}, "spec.sampler.kind"),
    ("negative tolerance", {"gradient_tolerance": -1}, "spec.gradient_tolerance"),
    ("unknown dtype", {"workload": {**spec_dict("x")["workload"], "dtype": "float8"}}, "spec.workload.dtype"),
    ("segments without the layout", {"space": {"segments": 2, "choices": ["full"]}}, "spec.space.segments"),
    ("segments that miss layers", {"space": {"layout": "segments", "segments": [1, 3], "choices": ["full"]}},
     "spec.space.segments: sizes [1, 3] sum to 4"),
    ("confirm rounds", {"confirm": {"rounds": 0}}, "spec.confirm.rounds"),
    ("confirm one plan", {"confirm": {"top": 1}}, "spec.confirm.top: 0 (skip) or at least 2"),
    ("confirm presets", {"confirm": {"presets": "maybe"}}, "spec.confirm.presets: Input should be a valid boolean"),
    ("confirm races", {"confirm": {"races": -1}}, "spec.confirm.races: Input should be greater than or equal to 0"),
    ("timing anchor", {"timing": {"anchor": "sometimes"}}, "spec.timing.anchor: Input should be a valid boolean"),
    ("prescreen at or under the budget", {"prescreen": 1.0}, "spec.prescreen: Input should be greater than 1"),
]


@pytest.mark.parametrize(("case", "change", "field"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_is_rejected(cli, tmp_path: Path, storage_url: str, case: str, change: dict, field: str) -> None:  # type: ignore[no-untyped-def]
    spec = spec_dict(storage_url)
    spec.update(change)
    _assert_rejected(cli("run", str(write_spec(tmp_path / "spec.yaml", spec))), field, tmp_path)


def _renamed(section: str, key: str, to: str) -> Callable[[dict[str, Any]], None]:
    """An edit of a spec that renames ``section.key`` (top level: section "") to ``to``."""
    def edit(spec: dict[str, Any]) -> None:
        fields = spec[section] if section else spec
        fields[to] = fields.pop(key, 3)
    return edit


MISSPELLED_KEYS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("trails", _renamed("", "trials", "trails"), "spec.trails: unknown key; did you mean 'trials'?"),
    ("timing.repeat", _renamed("timing", "repeats", "repeat"), "spec.timing.repeat: unknown key; did you mean 'repeats'?"),
    ("workload.leyers", _renamed("workload", "layers", "leyers"),
     "spec.workload.leyers: unknown key; did you mean 'layers'?"),
    ("space.choice", _renamed("space", "choices", "choice"), "spec.space.choice: unknown key; did you mean 'choices'?"),
    ("confirm.rouns", _renamed("confirm", "rounds", "rouns"), "spec.confirm.rouns: unknown key; did you mean 'rounds'?"),
    ("two typos", lambda spec: (_renamed("timing", "repeats", "repeat")(spec), _renamed("", "trials", "trails")(spec)),
     "spec.timing.repeat: unknown key; did you mean 'repeats'? (and 1 more)"),
    ("colour", lambda spec: spec.update(colour="red"), (
        "spec.colour: unknown key; expected one of: study, storage, workload, space, budget, trials, target, mesh, configuration, "
        "sampler, timing, worker_memory, gradient_tolerance, confirm, prescreen, workers, heartbeat, slice, compilation_cache")),
]


@pytest.mark.parametrize(("case", "edit", "line"), MISSPELLED_KEYS, ids=[c[0] for c in MISSPELLED_KEYS])
def test_a_misspelled_key_is_named_with_the_nearest_field(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, storage_url: str, case: str, edit: Callable[[dict[str, Any]], None], line: str
) -> None:
    spec = copy.deepcopy(spec_dict(storage_url))
    edit(spec)
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    _assert_rejected(result, line, tmp_path)
    assert result.stderr == f"error: {line}\n"


def test_malformed_yaml_and_missing_file(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text("study: demo\nspace: [unclosed\n")
    _assert_rejected(cli("run", str(bad)), "is not valid YAML at line", tmp_path)
    _assert_rejected(cli("run", str(tmp_path / "missing.yaml")), "spec: cannot read", tmp_path)
    bad.write_text("- just\n- a list\n")
    _assert_rejected(cli("run", str(bad)), "must be a YAML mapping", tmp_path)


@pytest.mark.parametrize(
    ("url", "field"),
    [("sqlite:////no/such/dir/studies.db", "directory '/no/such/dir'"),
     ("not a url", "is not a database URL"),
     ("nosuchdb://host/db", "needs a database driver"),
     ("sqlite://", "is in memory")],
)
def test_bad_storage_url_is_rejected(cli, tmp_path: Path, storage_url: str, url: str, field: str) -> None:  # type: ignore[no-untyped-def]
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(storage_url))
    _assert_rejected(cli("run", str(spec), "--storage", url), f"storage: {field}" if "directory" in field else field, tmp_path)


MISSING_DRIVERS = [  # URL as written, the driver module SQLAlchemy imports for it, what the user is told
    ("postgresql://u@db.example/studies", "psycopg",
     'needs the psycopg driver, which is not installed: pip install "psycopg[binary]"'),
    ("postgresql+psycopg://u@db.example/studies", "psycopg", 'pip install "psycopg[binary]"'),
    ("postgresql+psycopg2://u@db.example/studies", "psycopg2", "pip install psycopg2-binary"),
    ("postgresql+pg8000://u@db.example/studies", "pg8000", "pip install pg8000"),
    ("postgresql+asyncpg://u@db.example/studies", "asyncpg", (
        "names asyncpg, an asyncio driver, which optuna's storage cannot use; write postgresql+psycopg:// "
        'and pip install "psycopg[binary]"')),
    ("mysql://u@db.example/studies", "MySQLdb", "pip install mysqlclient"),
    ("mysql+pymysql://u@db.example/studies", "pymysql", "pip install pymysql"),
    ("mysql+mysqlconnector://u@db.example/studies", "mysql", "pip install mysql-connector-python"),
]


@pytest.mark.parametrize(("url", "module", "hint"), MISSING_DRIVERS, ids=[u for u, _, _ in MISSING_DRIVERS])
def test_a_missing_driver_is_named_with_the_command_that_installs_it(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, storage_url: str, url: str, module: str, hint: str
) -> None:
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(storage_url))
    for args in (["run", str(spec)], ["studies"]):
        result = cli(*args, "--storage", url)
        _assert_rejected(result, f"storage: {url!r} {hint}" if "asyncio" in hint else hint, tmp_path)
        assert result.stderr.rstrip().endswith(hint), result.stderr


def test_only_a_missing_driver_is_reported_as_one() -> None:
    """Another module missing inside a storage operation is a bug: it keeps its own error."""
    with pytest.raises(ModuleNotFoundError, match="no_such_helper"), translate_errors("postgresql://u@h/db"):
        import no_such_helper  # type: ignore[import-not-found]  # noqa: F401


def test_storage_comes_from_flag_then_environment_then_spec(cli, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(f"sqlite:///{tmp_path / 'spec.db'}"))
    monkeypatch.setenv("REMAT_SEARCH_STORAGE", "sqlite:////no/such/env/dir/x.db")
    _assert_rejected(cli("run", str(spec)), "'/no/such/env/dir'", tmp_path)
    _assert_rejected(cli("run", str(spec), "--storage", "sqlite:////no/flag/x.db"), "'/no/flag'", tmp_path)


@pytest.mark.parametrize(
    ("args", "field"),
    [(["best", "--study", "tiny", "--budget", "16 GiBs"], "--budget: expected a positive size"),
     (["best", "--study", "tiny", "--budget", "-1"], "--budget"),
     (["best", "--study", "bad name", "--budget", "1GiB"], "--study: expected a study name"),
     (["pareto", "--study", "tiny"], "storage: no database at"),
     (["pareto", "--study", "tiny", "--plot", "/no/such/dir/front.png"], "--plot: directory '/no/such/dir'"),
     (["show", "--study", "tiny"], "storage: no database at"),
     (["studies"], "storage: no database at"),
     (["plan", "--study", "tiny", "--budget", "lots"], "--budget: expected a positive size"),
     (["plan", "--study", "tiny", "--budget", "1GiB"], "storage: no database at"),
     (["confirm", "--study", "bad name"], "--study: expected a study name"),
     (["confirm", "--study", "tiny", "--budget", "0"], "--budget"),
     (["confirm", "--study", "tiny", "--races", "-1"], "--races")],
)
def test_queries_reject_bad_flags_and_write_nothing(cli, tmp_path: Path, storage_url: str, args: list[str], field: str) -> None:  # type: ignore[no-untyped-def]
    _assert_rejected(cli(*args, "--storage", storage_url), field, tmp_path)


def test_help_teaches(cli) -> None:  # type: ignore[no-untyped-def]
    result = cli("--help")
    assert result.exit_code == 0
    for command in ("run", "pareto", "best", "plan", "confirm", "studies", "show"):
        assert command in result.stdout
    assert "14GiB" in cli("best", "--help").stdout


def test_show_rejects_a_trial_the_study_does_not_have(cli, tmp_path: Path, storage_url: str) -> None:  # type: ignore[no-untyped-def]
    import optuna

    optuna.create_study(study_name="tiny", storage=storage_url)
    db = tmp_path / "studies.db"
    before = db.read_bytes()
    result = cli("show", "--study", "tiny", "--trial", "7", "--storage", storage_url)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "--trial: study 'tiny' has no trial 7" in result.stderr
    assert db.read_bytes() == before


def test_a_failure_at_run_time_exits_3_with_its_reason_not_2(cli, tmp_path: Path, storage_url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Exit 2 is for bad input only. A study whose stored measurement no longer reads (here:
    written by hand) is no bad flag: one line with the exception's type and message, exit 3;
    REMAT_SEARCH_DEBUG=1 lets the traceback through instead."""
    import optuna

    study = optuna.create_study(study_name="tiny", storage=storage_url, directions=["minimize", "minimize"])
    trial = study.ask()
    trial.set_user_attr("measurement", "{not json")
    study.tell(trial, [1.0, 1.0])
    result = cli("show", "--study", "tiny", "--storage", storage_url)
    assert result.exit_code == 3, result.stdout + result.stderr
    assert result.stderr.startswith("error: ValidationError: ") and result.stderr.count("\n") == 1
    assert "REMAT_SEARCH_DEBUG=1 shows the traceback" in result.stderr
    monkeypatch.setenv("REMAT_SEARCH_DEBUG", "1")
    with pytest.raises(ValueError, match="Invalid JSON"):
        cli("show", "--study", "tiny", "--storage", storage_url)
