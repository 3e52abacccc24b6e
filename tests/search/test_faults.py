"""Every way a candidate can fail is a failed trial with a one-line reason, and the search goes
on; no worker outlives the search that started it. Real faults in real worker processes: the
workloads of ``tests/factories.py`` (:class:`~tests.factories.FaultyMlp`) misbehave only under
plans with a ``dots`` layer, so the other plans of each search are measured as usual."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from optuna.trial import TrialState

import remat_search
from remat_search.errors import SpecError
from remat_search.spec.loading import parse_spec
from remat_search.store.attributes import FAILURE_ATTR

from tests.chaos import ORPHAN_SECONDS
from tests.conftest import FAST_TIMING, run_process, spec_dict, write_spec

pytestmark = pytest.mark.slow  # crashes and hangs worker processes

FAULTS: list[tuple[str, dict[str, Any], str]] = [
    ("tests.factories:faulty compile", {},
     "JaxRuntimeError: NOT_FOUND: No FFI handler registered for remat_search_no_such_kernel"),
    ("tests.factories:faulty raise_trace", {}, "RuntimeError: this model is broken (at factories.py:"),
    ("tests.factories:faulty raise_run", {}, "CpuCallback error calling callback: ValueError: the input pipeline broke"),
    # The timeout bounds the other plans' trials too: 30 s, which no compile and steps of this
    # MLP come near on a loaded 2-core host (1-3 s), while the hanging one never ends.
    ("tests.factories:faulty hang", {"timing": {**FAST_TIMING, "timeout": "30s"}},
     "timed out after 30 s (timing.timeout); worker killed"),
    ("tests.factories:faulty segfault", {}, "worker died from signal SIGSEGV"),
    ("tests.factories:faulty sigkill", {},
     "worker killed by signal SIGKILL (likely out of host memory: the kernel's OOM killer sends it)"),
    ("tests.factories:faulty hoard", {"worker_memory": "1536MiB"},
     "worker exceeded its host memory limit of 1.5 GiB (worker_memory): "),
    ("tests.factories:faulty nan", {}, "loss is nan at its first step (not finite); not timed"),
    ("tests.factories:miscomputing", {}, "gradient differs from full remat's by 1 (norm-relative) > threshold"),
]


@pytest.mark.parametrize(
    ("workload", "settings", "reason"), FAULTS, ids=[w.split(":")[1] for w, _, _ in FAULTS]
)
def test_a_faulty_candidate_is_a_failed_trial_with_a_one_line_reason_and_the_search_goes_on(
    storage_url: str, workload: str, settings: dict[str, Any], reason: str
) -> None:
    factory, _, fault = workload.partition(" ")
    spec = parse_spec(spec_dict(
        storage_url, workload={"factory": factory, "args": {"fault": fault} if fault else {}},
        space={"layout": "uniform", "choices": ["full", "dots", "none"]}, trials=3,
        confirm={"top": 0}, **settings,
    ))
    report = remat_search.run(spec)  # the faulty plan second: the search must go on after it

    by_label = {t.labels[0]: t for t in report.trials}
    assert len(report.trials) == 3
    assert by_label["full"].status == by_label["none"].status == "measured", report.trials
    failed = by_label["dots"]
    assert failed.status == "failed" and failed.error is not None
    assert reason in failed.error and "\n" not in failed.error, failed.error
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    states = {t.number: t for t in study.trials}
    assert states[failed.number].state == TrialState.FAIL
    assert states[failed.number].user_attrs[FAILURE_ATTR] == failed.error


def test_worker_memory_is_a_size(storage_url: str) -> None:
    assert parse_spec(spec_dict(storage_url, worker_memory="2GiB")).worker_memory == 2 * 2**30
    assert parse_spec(spec_dict(storage_url)).worker_memory is None
    with pytest.raises(SpecError, match=r"^spec\.worker_memory: expected a positive size such as 200MiB.*'lots'"):
        parse_spec(spec_dict(storage_url, worker_memory="lots"))


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_no_worker_outlives_a_search_killed_with_sigkill(tmp_path: Path, storage_url: str) -> None:
    """SIGKILL gives the search no chance to stop its worker: the worker sees that its parent
    is gone and exits by itself (``measure.worker._exit_with_parent``)."""
    started = tmp_path / "hanging"
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, trials=2, space={"layout": "uniform", "choices": ["none", "full"]},
        workload={"factory": "tests.factories:hanging", "args": {"started": str(started)}},
    ))
    search = run_process("run", str(spec))
    deadline = time.monotonic() + 300
    while not started.exists():  # until the worker is measuring a plan (and hangs in its step)
        assert search.poll() is None, search.communicate()
        assert time.monotonic() < deadline, "no step ran"
        time.sleep(0.2)
    children = psutil.Process(search.pid).children(recursive=True)
    assert any("multiprocessing" in " ".join(c.cmdline()) for c in children), children  # the spawned worker
    search.kill()
    killed = time.monotonic()
    search.wait()  # not its output: the worker shares the pipe, so reading waits for the worker too
    while any(map(_alive, children)) and time.monotonic() < killed + ORPHAN_SECONDS:  # gone in ~1 s; late on a loaded host
        time.sleep(0.05)
    assert not [c for c in children if _alive(c)]
    print(f"workers gone {time.monotonic() - killed:.2f} s after the search was killed")
    search.communicate(timeout=60)
