"""`remat-search run` as a separate process, as a user (or CI, or nohup) runs it: what it prints."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import run_process, spec_dict, write_spec


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The output (stdout and stderr, a pipe: not a terminal) of one search of a tiny spec."""
    folder = tmp_path_factory.mktemp("run")
    spec = write_spec(folder / "spec.yaml", spec_dict(f"sqlite:///{folder / 'studies.db'}", trials=2))
    search = run_process("run", str(spec))
    log = search.communicate(timeout=300)[0]
    assert search.returncode == 0, log
    return log


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
