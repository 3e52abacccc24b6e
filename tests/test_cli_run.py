"""`remat-search run` as a separate process, as a user (or CI, or nohup) runs it: what it prints."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import run_process, spec_dict, write_spec


@pytest.fixture(scope="module")
def tiny_search(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The output (stdout and stderr, a pipe: not a terminal) of one search of a tiny spec with
    a budget in decimal units, and the spec."""
    folder = tmp_path_factory.mktemp("run")
    spec = write_spec(folder / "spec.yaml", spec_dict(f"sqlite:///{folder / 'studies.db'}", trials=2, budget="1gb"))
    search = run_process("run", str(spec))
    log = search.communicate(timeout=300)[0]
    assert search.returncode == 0, log
    return log, spec


@pytest.fixture
def tiny_run(tiny_search: tuple[str, Path]) -> str:
    return tiny_search[0]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu prints these only where installed")
def test_a_cpu_search_prints_no_libtpu_warnings(tiny_run: str) -> None:
    """With libtpu installed (the test extra), JAX's probe for TPUs made libtpu print these."""
    for noise in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "INVALID_ARGUMENT", "libtpu"):
        assert noise not in tiny_run, tiny_run


def test_ctrl_c_says_the_run_was_interrupted_and_how_to_resume(tmp_path: Path, storage_url: str) -> None:
    """Ctrl-C in a terminal signals the whole process group: the search and its worker."""
    started = tmp_path / "hanging"
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, trials=2, space={"layout": "uniform", "choices": ["none", "full"]},
        workload={"factory": "tests.workloads:hanging", "args": {"started": str(started)}},
    ))
    search = run_process("run", str(spec), stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while not started.exists():  # until a trial's step is running (and hangs)
        assert search.poll() is None, search.communicate()
        assert time.monotonic() < deadline, "no step ran"
        time.sleep(0.2)
    os.killpg(search.pid, signal.SIGINT)
    stdout, stderr = search.communicate(timeout=120)
    assert search.returncode == 130, stdout + stderr
    assert stderr.splitlines() == [
        f"interrupted: finished trials are kept, and the same command resumes the study: remat-search run {spec}"
    ], stderr


def test_the_budget_is_echoed_as_understood(tiny_run: str) -> None:
    assert tiny_run.splitlines()[0] == "budget 1gb = 953.7 MiB"  # decimal gigabytes: said so, first


def test_another_budget_for_the_study_is_refused_in_the_units_it_was_written(  # type: ignore[no-untyped-def]
    cli, tiny_search: tuple[str, Path], tmp_path: Path
) -> None:
    spec = yaml.safe_load(tiny_search[1].read_text())
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", {**spec, "budget": "1GiB"})))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "budget 1GiB"  # an exact binary size: nothing to add
    assert result.stderr == (
        "error: spec.budget: study 'tiny' already exists with another budget (1GB); give this search a new "
        "study name\n"
    )
