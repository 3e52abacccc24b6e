"""The worker process: the environment it starts with, and what it says of a candidate that raises."""

from __future__ import annotations

import pytest

from remat_search import RematPlan
from remat_search.errors import RematSearchError
from remat_search.measure.runner import PRELOAD, Runner
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig

from tests.conftest import spec_dict


def _measure_broken(storage_url: str) -> str:
    """The error of a plan of ``tests.factories:raising``, whose loss raises as it is traced, in a new worker."""
    workload = parse_spec(spec_dict(storage_url, workload={"factory": "tests.factories:raising"})).workload
    with Runner(workload, timeout=120) as runner:
        m = runner.measure(RematPlan.uniform("full", 3), budget=2**30, timing=TimingConfig(), gradient_tolerance=1e-4)
    assert m.status == "failed" and m.error is not None
    return m.error


def test_a_candidate_that_raises_fails_with_one_line(storage_url: str, capfd: pytest.CaptureFixture[str]) -> None:
    error = _measure_broken(storage_url)
    assert error.startswith("RuntimeError: this model is broken (at factories.py:") and "\n" not in error
    assert "this model is broken" not in capfd.readouterr().err


def test_with_remat_search_debug_a_candidate_that_raises_shows_the_workers_traceback(
    storage_url: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REMAT_SEARCH_DEBUG", "1")  # before the worker starts, which inherits it
    error = _measure_broken(storage_url)
    first, _, rest = error.partition("\n")
    assert first.startswith("RuntimeError: this model is broken (at factories.py:")  # the line tables show
    assert rest.startswith("worker traceback:\nTraceback (most recent call last):")
    assert 'factories.py", line' in rest and 'raise RuntimeError("this model is broken")' in rest
    assert "executables.py" in rest  # the worker's own frames, from where it compiles the plan
    shown = capfd.readouterr().err
    assert "plan full×3 failed in the worker: RuntimeError: this model is broken" in shown
    assert 'raise RuntimeError("this model is broken")' in shown


def test_a_re_timing_that_runs_past_the_timeout_kills_the_worker_and_says_so(storage_url: str) -> None:
    """Re-timing may take ``timing.timeout`` a plan; past it the worker is killed and the error
    says which limit ran out. Independent of the host's speed: every step of
    ``tests.factories:hanging`` hangs, so however long its compiles take, the time runs out."""
    workload = parse_spec(spec_dict(storage_url, workload={"factory": "tests.factories:hanging"})).workload
    plans = [RematPlan.uniform("full", 3), RematPlan.uniform("dots", 3)]
    with Runner(workload, timeout=2) as runner:
        with pytest.raises(RematSearchError, match=r"^confirm: re-timing timed out after 4 s \(timing\.timeout\); worker killed$"):
            runner.retime(plans, warmup=1, rounds=2)


def test_each_worker_starts_with_the_environment_of_then_and_jax_reads_its_variables(
    storage_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers are forked by a forkserver that imported JAX once, with the environment of when it
    started; each worker takes the search's environment as it is when the worker starts, and
    where a ``JAX_*`` variable (which JAX reads as it is imported) changed since, it is spawned
    afresh so that JAX reads the new value (docs/api.md)."""
    workload = parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:telling", "args": {"variable": "REMAT_SEARCH_MARK"}},
    )).workload

    def told() -> str:
        with Runner(workload, timeout=120) as runner, pytest.raises(RematSearchError) as raised:
            runner.describe()
        return str(raised.value).rpartition("RuntimeError: ")[2].removesuffix(")")

    monkeypatch.delenv("JAX_ENABLE_X64", raising=False)
    monkeypatch.delenv("REMAT_SEARCH_MARK", raising=False)
    assert told() == "REMAT_SEARCH_MARK=None x64=False forked=True"  # the server may have started before
    monkeypatch.setenv("REMAT_SEARCH_MARK", "set after the server started")
    assert told() == "REMAT_SEARCH_MARK=set after the server started x64=False forked=True"
    monkeypatch.setenv("JAX_ENABLE_X64", "1")
    assert told() == "REMAT_SEARCH_MARK=set after the server started x64=True forked=False"
    monkeypatch.delenv("JAX_ENABLE_X64")
    assert told().endswith("x64=False forked=True")  # as the server has it again


PRELOADED = """
import os, sys
from remat_search.measure.runner import PRELOAD
threads = []
for module in PRELOAD:
    __import__(module)
    threads.append(len(os.listdir("/proc/self/task")))
print(*threads)
"""


def test_the_forkserver_s_imports_start_no_thread_past_numpy_s() -> None:
    """A fork copies only the thread that forks: a module the forkserver imports must not leave
    a thread running (a lock it held would stay held in every worker). Each import of
    :data:`PRELOAD` in turn, in a fresh process: the count of threads after JAX (numpy's
    OpenBLAS starts its own there) does not grow."""
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "-c", PRELOADED], cwd=REPO, capture_output=True, text=True, check=True)
    threads = [int(n) for n in done.stdout.split()]
    assert len(threads) == len(PRELOAD) and len(set(threads)) == 1, dict(zip(PRELOAD, threads, strict=True))
