"""The runner: measures candidates in a worker process that may die without harm.

A compiler crash, an out-of-memory kill or a hang must not take the study down, so every
compile and run happens in a child process, never ``fork``ed from the search (JAX is threaded):
workers are forked by multiprocessing's ``forkserver``, a clean process started once that has
imported JAX and the workload modules already (:data:`PRELOAD`), so a new worker (each search's
first, and every one after a crash) does not import them again, as a ``spawn``ed one does (about
1.4 s on a 2-core host such as CI's). Each worker takes the
search's environment as it is when the worker starts; where a variable JAX reads when it is
imported (``JAX_*``) has changed since the server started, the worker is ``spawn``ed instead, so
it reads the new value. The worker is reused from one candidate to the next; when it dies or runs past
the timeout it is killed and the candidate becomes a failed :class:`Measurement` with the
reason, and the next candidate gets a fresh worker. Every reason is one line: a compiler
error, an exception in the user's step (at trace time or, from a callback, as it runs), a
timeout, a signal (a segfault; SIGKILL, which is how the kernel's OOM killer ends a process), or
host memory past ``worker_memory``, which the parent watches (the worker's resident bytes; an
address-space rlimit would not do: XLA reserves gigabytes of address space it never touches).
The worker exits by itself within :data:`~remat_search.measure.worker.PARENT_POLL_SECONDS` of the search's death, so no
worker outlives the search that started it, however that search ends. With
``REMAT_SEARCH_DEBUG`` set, a candidate that raises in the worker carries the worker's own
traceback in its error (after its first line), and the search prints it on stderr.

This module is the parent's side; the worker's loop is :mod:`remat_search.measure.worker`.
They speak the typed messages of :mod:`remat_search.measure.protocol`; what the worker runs
on is told as a :class:`~remat_search.measure.device.DeviceInfo`.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Self

import psutil

from remat_search.errors import RematSearchError, RunError, SliceLost, SpecError, WorkloadError
from remat_search.measure import protocol
from remat_search.measure.device import DeviceInfo
from remat_search.measure.executables import Known
from remat_search.measure.measurement import Measurement
from remat_search.measure.worker import DEBUG_ENV, serve
from remat_search.plans.plan import RematPlan
from remat_search.measure.slice import SliceMember
from remat_search.spec.models import SliceConfig, TargetConfig, TimingConfig
from remat_search.spec.workloads import WorkloadConfig
from remat_search.units import format_bytes

STARTUP_TIMEOUT = 300.0
PRELOAD = [
    "jax", "optax", "flax.linen", "flax.nnx", "orbax.checkpoint", "remat_search.measure.worker", "remat_search.workloads.base",
]
"""What the forkserver imports once, before it forks workers (each would import them; orbax, which
saves and loads the first-step reference, about 1 s). None leaves a thread past numpy's (a fork
copies only the thread that forks)."""
WATCH_SECONDS = 0.05
"""How often the parent reads the worker's resident memory while it waits (``worker_memory``)."""


class Runner:
    """Measures plans of one workload in a reusable worker process.

    Use as a context manager. :meth:`measure` never raises for a bad candidate; starting
    a worker can (a workload or target the worker cannot build).
    """

    def __init__(
        self,
        workload: WorkloadConfig,
        *,
        timeout: float,
        memory_limit: int | None = None,
        target: TargetConfig = "local",
        mesh: dict[str, int] | None = None,
        compilation_cache: str | None = None,
        artifacts: str | None = None,
        member: tuple[SliceMember, SliceConfig] | None = None,
    ) -> None:
        """``artifacts``: the study's artifacts folder, where the worker keeps the reference
        first step it checks plans against (see ``artifacts.py``); None: kept in memory only.
        ``member``: on a slice, this process's place in it and the slice's timeouts: each worker
        joins the slice's JAX job (see :func:`worker.serve`)."""
        self._member = member
        self._workload = workload
        self._artifacts = artifacts
        self._where = (target, mesh)
        self._compilation_cache = compilation_cache
        self._timeout = timeout
        self._memory_limit = memory_limit
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._info: DeviceInfo | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> DeviceInfo:
        """Start the worker if needed and return what it runs on."""
        self._ensure_worker()
        assert self._info is not None
        return self._info

    def measure(
        self, plan: RematPlan, *, budget: int, timing: TimingConfig, gradient_tolerance: float | None,
        known: Known | None = None,
    ) -> Measurement:
        """Measure ``plan`` in the worker; crashes and timeouts come back as failures.

        ``known`` is asked, in this process, for a measurement of the program ``plan``
        compiled to, before the worker would run it (see :func:`executables.measure`)."""
        self._ensure_worker()
        assert self._conn is not None and self._process is not None
        self._conn.send(protocol.Measure(plan.to_json(), budget, timing, gradient_tolerance, ask=known is not None))
        deadline = time.monotonic() + self._timeout
        while True:
            stopped = self._wait(max(0.0, deadline - time.monotonic()), seconds=self._timeout)
            if stopped is not None:
                return Measurement(status="failed", plan_digest=plan.digest, error=stopped)
            try:
                reply: protocol.Reply = self._conn.recv()
            except (EOFError, OSError):
                reason = self._death_reason()
                self.close()
                return Measurement(status="failed", plan_digest=plan.digest, error=reason)
            if not isinstance(reply, protocol.Program):
                break
            assert known is not None
            try:
                found = known(reply.digest)  # the worker waits for the answer
            except BaseException:
                self.close()  # it waits for an answer it will not get: a new worker for the next plan
                raise
            self._conn.send(protocol.Known(found.model_dump_json() if found is not None else None))
        if isinstance(reply, protocol.Failed):
            if os.environ.get(DEBUG_ENV):
                print(f"remat-search: plan {plan.summary()} failed in the worker: {reply.reason}", file=sys.stderr)
            return Measurement(status="failed", plan_digest=plan.digest, error=reply.reason)
        return Measurement.model_validate_json(reply.payload)

    def retime(
        self, plans: list[RematPlan], *, warmup: int, rounds: int, budget: int | None = None
    ) -> list[tuple[float, ...]]:
        """Time ``plans`` interleaved in the worker, with the executables it kept (see
        :func:`executables.retime`); a plan over ``budget`` is refused, never run.

        Raises :class:`RematSearchError` if the worker fails or runs past the timeout per plan.
        """
        self._ensure_worker()
        assert self._conn is not None
        self._conn.send(protocol.Retime([p.to_json() for p in plans], warmup, rounds, budget))
        stopped = self._wait(self._timeout * len(plans))
        if stopped is not None:
            raise RematSearchError(f"confirm: re-timing {stopped}")
        try:
            reply: protocol.Done | protocol.Failed = self._conn.recv()
        except (EOFError, OSError):
            reason = self._death_reason()
            self.close()
            raise RematSearchError(f"confirm: re-timing failed ({reason})") from None
        if isinstance(reply, protocol.Failed):
            raise RematSearchError(f"confirm: re-timing failed ({reply.reason})")
        return [tuple(t) for t in json.loads(reply.payload)]

    def kill(self) -> None:
        """Kill the worker now, from any thread: a measurement in progress comes back failed
        (the search stops its workers so on Ctrl-C)."""
        process = self._process
        if process is not None and process.is_alive():
            process.kill()

    def close(self) -> None:
        """Stop the worker (killing it if it does not stop at once)."""
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def _ensure_worker(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        self.close()
        context = _worker_context()
        parent_conn, child_conn = context.Pipe()
        process = context.Process(
            target=serve,
            args=(child_conn, self._workload, self._where, self._compilation_cache, os.getpid(), dict(os.environ),
                  self._artifacts, self._member),
            name="remat-search-worker", daemon=True,
        )
        process.start()  # may raise (e.g. a script without `if __name__ == "__main__":`); close() then has nothing to join
        self._process = process
        child_conn.close()
        self._conn = parent_conn
        stopped = self._wait(STARTUP_TIMEOUT, limit=None)
        if stopped is not None:
            raise WorkloadError(f"workload: the worker did not start ({stopped})")
        try:
            said: protocol.Ready | protocol.StartFailed = parent_conn.recv()
        except EOFError:
            reason = self._death_reason()
            self.close()
            if self._member is not None:  # JAX aborts a worker whose slice lost a process as it joined
                raise SliceLost(f"slice: the worker died as it started with the others ({reason})") from None
            raise WorkloadError(f"workload: the worker could not start ({reason})") from None
        if isinstance(said, protocol.StartFailed):
            self.close()
            if said.kind == "spec":
                raise SpecError(said.reason)
            if said.kind == "run":
                raise RunError(said.reason)
            if said.kind == "slice":
                raise SliceLost(said.reason)
            raise WorkloadError(f"workload: the worker could not build it ({said.reason})")
        self._info = DeviceInfo.model_validate_json(said.info)

    def _wait(self, left: float, limit: str | None = "timing.timeout", *, seconds: float | None = None) -> str | None:
        """Wait up to ``left`` seconds for the worker to answer (or die); None when it did.
        Past the time (``seconds`` of the setting ``limit`` in all, ``left`` unless given), or
        past ``worker_memory`` (read every :data:`WATCH_SECONDS`), the worker is killed and
        the one-line reason returned."""
        seconds = left if seconds is None else seconds
        assert self._conn is not None and self._process is not None
        deadline = time.monotonic() + left
        watched = _Watched(self._process.pid) if self._memory_limit else None
        while True:
            left = deadline - time.monotonic()
            if self._conn.poll(max(0.0, min(left, WATCH_SECONDS) if watched else left)):
                return None
            if watched is not None and self._memory_limit is not None:
                used = watched.resident()
                if used > self._memory_limit:
                    self.close()
                    return (
                        f"worker exceeded its host memory limit of {format_bytes(self._memory_limit)} "
                        f"(worker_memory): {used / 2**20:.0f} MiB resident; worker killed"
                    )
            if left <= 0:
                self.close()
                setting = f" ({limit})" if limit else ""
                return f"timed out after {seconds:g} s{setting}; worker killed"

    def _death_reason(self) -> str:
        assert self._process is not None
        self._process.join(timeout=5)
        code = self._process.exitcode
        if code == -signal.SIGKILL:
            return "worker killed by signal SIGKILL (likely out of host memory: the kernel's OOM killer sends it)"
        if code is not None and code < 0:
            return f"worker died from signal {signal.Signals(-code).name}"
        return f"worker died (exit code {code})"


_SERVER_JAX_ENV: dict[str, str] | None = None
"""The ``JAX_*`` variables as they were when this process's forkserver started."""


def _jax_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("JAX_")}


def _worker_context() -> multiprocessing.context.BaseContext:
    """The forkserver (started with :data:`PRELOAD` imported), or ``spawn`` where a ``JAX_*``
    variable has changed since it started: JAX reads those when it is imported."""
    global _SERVER_JAX_ENV
    if _SERVER_JAX_ENV is None:
        _SERVER_JAX_ENV = _jax_env()
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver" if _jax_env() == _SERVER_JAX_ENV else "spawn")


class _Watched:
    """The resident memory of a worker and of any processes it started."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)

    def resident(self) -> int:
        """Resident bytes now (0 for a process gone meanwhile: its death is told otherwise)."""
        total = 0
        try:
            for p in (self._process, *self._process.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
        except psutil.Error:
            pass
        return total
