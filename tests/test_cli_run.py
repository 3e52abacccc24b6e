"""`remat-search run` as a separate process, as a user (or CI, or nohup) runs it: what it prints."""

from __future__ import annotations

import importlib.util

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
