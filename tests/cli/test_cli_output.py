"""What the query commands print, read as a user reads it: studies mid-search, narrow terminals, help."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from remat_search.plans.plan import RematPlan
from remat_search.store.attributes import FAILURE_ATTR, LABELS_ATTR, PLAN_ATTR


def test_show_a_study_with_running_waiting_and_failed_trials(cli, storage_url: str) -> None:  # type: ignore[no-untyped-def]
    """As during every search and after every interruption: a trial running, one queued."""
    study = optuna.create_study(study_name="tiny", storage=storage_url, directions=["minimize", "minimize"])
    failed = study.ask()
    failed.set_user_attr(FAILURE_ATTR, "E [/] [b]")  # brackets are text, not markup
    study.tell(failed, state=TrialState.FAIL)
    running = study.ask()
    running.set_user_attr(PLAN_ATTR, RematPlan.uniform("full", 2).to_json())
    running.set_user_attr(LABELS_ATTR, ["full", "full"])
    study.enqueue_trial({"layer_00": "none", "layer_01": "none"})

    result = cli("show", "--study", "tiny", "--storage", storage_url)
    assert result.exit_code == 0, result.stdout + result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 2}
    assert "running" in rows["1"] and "full×2" in rows["1"]
    assert "waiting" in rows["2"]
    assert "failed: E [/]" in rows["0"]


COMMANDS = ("run", "pareto", "best", "plan", "confirm", "studies", "show")


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_prints_its_text_whole_and_no_type_tags(cli, monkeypatch: pytest.MonkeyPatch, command: str, columns: int) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("COLUMNS", str(columns))
    result = cli(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Usage: ") and lines[0].endswith(
        {"": "[OPTIONS] COMMAND [ARGS]...", "run": "run [OPTIONS] SPEC"}.get(command, f"{command} [OPTIONS]")
    ), lines[0]
    assert not re.search(r"<\w+>|\{\w+\}", result.stdout), result.stdout  # typer's <str>, <bool>, {spec}
    assert max(map(len, lines)) <= columns
    text = re.sub(r"-\s+", "-", " ".join(result.stdout.split()))  # unwrapped (a path may wrap at a hyphen)
    if command:  # the default that rich markup swallowed as [default: ...]
        # The default is resolved when the CLI is imported: under this suite, in the storage home
        # of the test that imported it first ($REMAT_SEARCH_HOME is each test's own). A long path
        # wraps anywhere, so spaces are left out of the comparison.
        prefix = re.escape("thespec'sstorage,else") if command == "run" else ""
        pattern = rf"--storageURLDatabaseURLofthestudies\.Default:{prefix}sqlite:///\S+?/studies\.db\[envvar:REMAT_SEARCH_STORAGE\]"
        assert re.search(pattern, "".join(text.split())), text
    else:
        assert "--version Print the version and exit." in text


def test_version(cli) -> None:  # type: ignore[no-untyped-def]
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout == f"remat-search {importlib.metadata.version('remat-search')}\n"


def test_plot_without_matplotlib_names_the_extra(cli, tmp_path: Path, storage_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it fails
    png = tmp_path / "front.png"
    result = cli("pareto", "--study", "tiny", "--plot", str(png), "--storage", storage_url)
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr == (
        "error: --plot: drawing needs matplotlib, which is not installed: pip install 'remat-search[plot]'\n"
    )
    assert not list(tmp_path.iterdir()), "nothing is written"


def test_help_shows_the_storage_home_the_process_resolves(tmp_path: Path) -> None:
    """``--help``'s default storage is the process's own storage home ($REMAT_SEARCH_HOME here)."""
    import os
    import subprocess

    env = {**os.environ, "REMAT_SEARCH_HOME": str(tmp_path / "h"), "COLUMNS": "200"}
    result = subprocess.run(["remat-search", "best", "--help"], capture_output=True, text=True, env=env, check=True)
    text = re.sub(r"-\s+", "-", " ".join(result.stdout.split()))  # a path may wrap at a hyphen
    assert f"Default: sqlite:///{tmp_path / 'h' / 'studies.db'} [env var: REMAT_SEARCH_STORAGE]" in text, text
    assert not (tmp_path / "h").exists()  # help writes nothing


def test_help_imports_the_command_line_and_nothing_a_search_or_query_needs() -> None:
    """``--help`` loads typer, rich and pydantic, not JAX, NumPy, optuna, SQLAlchemy, YAML or
    matplotlib (each command imports what it runs when it runs): a user's first look is quick."""
    import subprocess

    heavy = ("jax", "numpy", "optuna", "sqlalchemy", "yaml", "matplotlib", "flax", "orbax")
    script = ("import sys; from remat_search.cli.app import app; from typer.testing import CliRunner; "
              "CliRunner().invoke(app, ['--help']); CliRunner().invoke(app, ['run', '--help']); "
              f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
