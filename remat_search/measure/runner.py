"""The runner: measures candidates in a worker process that may die without harm.

A compiler crash, an out-of-memory kill or a hang must not take the study down, so every
compile and run happens in a child process (``spawn``, never ``fork``, because JAX is
threaded). The worker is reused from one candidate to the next; when it dies or runs past
the timeout it is killed and the candidate becomes a failed :class:`Measurement` with the
reason, and the next candidate gets a fresh worker. Every reason is one line: a compiler
error, an exception in the user's step (at trace time or, from a callback, as it runs), a
timeout, a signal (a segfault; SIGKILL, which is how the kernel's OOM killer ends a process), or
host memory past ``worker_memory``, which the parent watches (the worker's resident bytes; an
address-space rlimit would not do: XLA reserves gigabytes of address space it never touches).
The worker exits by itself within :data:`PARENT_POLL_SECONDS` of its parent's death, so no
worker outlives the search that started it, however that search ends. With
``REMAT_SEARCH_DEBUG`` set, a candidate that raises in the worker carries the worker's own
traceback in its error (after its first line), and the search prints it on stderr.

The runner and its worker speak the typed messages of :mod:`remat_search.measure.protocol`;
what the worker runs on is told as a :class:`~remat_search.measure.device.DeviceInfo`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Self

import psutil

from remat_search.errors import RematSearchError, RunError, SpecError, WorkloadError
from remat_search.measure import protocol
from remat_search.measure.artifacts import ReferenceStore, reference_key
from remat_search.measure.device import DeviceInfo, describe, reference_parts
from remat_search.measure.executables import Executables, Known, measure, retime
from remat_search.measure.measurement import Measurement, RawMeasurement
from remat_search.plans.plan import RematPlan
from remat_search.spec.models import TargetConfig, TimingConfig, WorkloadConfig
from remat_search.targets.base import target_of
from remat_search.units import format_bytes

STARTUP_TIMEOUT = 300.0
WATCH_SECONDS = 0.05
"""How often the parent reads the worker's resident memory while it waits (``worker_memory``)."""
PARENT_POLL_SECONDS = 0.25
"""How often the worker checks that its parent, the search, is still alive."""
MAX_REASON_CHARS = 400
DEBUG_ENV = "REMAT_SEARCH_DEBUG"
"""Set (to anything), the worker sends its own traceback with every failure."""


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
    ) -> None:
        """``artifacts``: the study's artifacts folder, where the worker keeps the reference
        first step it checks plans against (see ``artifacts.py``); None: kept in memory only."""
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
        self, plan: RematPlan, *, budget: int, timing: TimingConfig, gradient_tolerance: float,
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
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        process = context.Process(
            target=_serve,
            args=(child_conn, self._workload, self._where, self._compilation_cache, os.getpid(), self._artifacts),
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
            raise WorkloadError(f"workload: the worker could not start ({reason})") from None
        if isinstance(said, protocol.StartFailed):
            self.close()
            if said.kind == "spec":
                raise SpecError(said.reason)
            if said.kind == "run":
                raise RunError(said.reason)
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


def _serve(
    conn: Connection,
    workload_config: WorkloadConfig,
    where: tuple[TargetConfig, dict[str, int] | None],
    compilation_cache: str | None,
    parent_pid: int,
    artifacts: str | None = None,
) -> None:
    """The worker's loop: build the workload once, then measure plan after plan."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the search, which stops the worker
    # libtpu locks a host against a second loader; compiling for a topology uses no TPU.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Several workers may share a GPU (one plan on it at a time): none may take its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    target_config, mesh_axes = where
    try:
        import jax

        from remat_search.workloads.base import build_workload, check_params_from
        from remat_search.workloads.tracing import trace_step

        if target_config == "local" and not jax.config.jax_platforms and _cpu_only_host():
            jax.config.update("jax_platforms", "cpu")  # not libtpu's probe: it prints TPU warnings, finds none
        if compilation_cache:  # JAX's persistent cache: a plan compiled before loads in a moment
            jax.config.update("jax_compilation_cache_dir", compilation_cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

        workload = build_workload(workload_config)
        target = target_of(target_config)
        mesh = target.mesh(mesh_axes)
        workload.use_mesh(mesh)  # before anything of it is traced (Workload.use_mesh)
        check_params_from(workload)  # a checkpoint the model does not fit is a spec error, now
        if mesh is not None:
            workload.shardings(mesh)  # a batch the mesh cannot split is a spec error, now
        traced = trace_step(workload)
        info = describe(target, mesh, workload, traced)
    except (SpecError, WorkloadError) as e:  # the spec's mesh or the model's partitioning, found with the mesh
        conn.send(protocol.StartFailed("spec", str(e)))
        return
    except RunError as e:  # e.g. the target's compiler did not state its memory
        conn.send(protocol.StartFailed("run", str(e)))
        return
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(protocol.StartFailed("other", _failure(e, line=False)))
        return
    conn.send(protocol.Ready(info.model_dump_json()))
    store = None if artifacts is None else ReferenceStore(Path(artifacts), reference_key(reference_parts(info, workload.layers)))
    # Each plan compiled once in this worker; the reference loaded from the study's artifacts if saved.
    executables = Executables(workload, target=target, mesh=mesh, reference_store=store)
    while True:
        try:
            request: protocol.Measure | protocol.Retime = conn.recv()
        except EOFError:
            return
        try:
            if isinstance(request, protocol.Retime):
                plans = [RematPlan.model_validate_json(p) for p in request.plans]
                times = retime(executables, plans, warmup=request.warmup, rounds=request.rounds, budget=request.budget)
                conn.send(protocol.Done(json.dumps(times)))
                continue
            m = measure(
                executables, RematPlan.model_validate_json(request.plan), budget=request.budget,
                timing=request.timing, gradient_tolerance=request.gradient_tolerance,
                known=_asker(conn) if request.ask else None,
            )
            conn.send(protocol.Done(m.model_dump_json()))
        except Exception as e:  # noqa: BLE001 - one bad candidate must not stop the worker
            conn.send(protocol.Failed(_failure(e)))


def _asker(conn: Connection) -> Known:
    """Ask the parent (see :meth:`Runner.measure`) for a measurement of a compiled program."""

    def known(program: str) -> RawMeasurement | None:
        conn.send(protocol.Program(program))
        answer: protocol.Known = conn.recv()
        return RawMeasurement.model_validate_json(answer.measurement) if answer.measurement is not None else None

    return known


def _cpu_only_host() -> bool:
    """Whether JAX could find nothing here but the CPU: no GPU plugin is installed and no TPU
    chip is attached (JAX's own PCI check). JAX would still load libtpu, where installed, to
    look for TPUs, and libtpu prints TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES warnings."""
    import importlib.util

    try:
        from jax._src.hardware_utils import num_available_tpu_chips_and_device_id
    except ImportError:  # moved in another JAX: let JAX look for itself
        return False
    plugins = importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("jax_plugins")
    return not plugins and num_available_tpu_chips_and_device_id()[0] == 0


def _failure(e: BaseException, *, line: bool = True) -> str:
    """What the worker says of an exception, in one line: its type, message (see
    :func:`one_line`) and (``line``) the line that raised it; with ``REMAT_SEARCH_DEBUG`` set,
    the worker's whole traceback after that line."""
    frames = traceback.extract_tb(e.__traceback__)
    said = one_line(f"{type(e).__name__}: {e}")
    if line and frames:
        said += f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
    if os.environ.get(DEBUG_ENV):
        said += "\nworker traceback:\n" + "".join(traceback.format_exception(e)).rstrip()
    return said


def one_line(message: str) -> str:
    """A failure's message as one line for tables and trial attributes. An error that carries
    a Python traceback (XLA's, when a callback in the step raised) is told by its first line and
    the exception the traceback ends with; other lines are dropped (``…`` says so); at most
    :data:`MAX_REASON_CHARS` characters."""
    lines = [text.strip() for text in message.strip().splitlines() if text.strip()]
    if not lines:
        return message.strip()
    said = lines[0]
    if len(lines) > 1:
        marker = "Traceback (most recent call last):"
        if marker in message:
            said = f"{said.replace(marker, '').rstrip()} {lines[-1]}"
        else:
            said += " …"
    return said if len(said) <= MAX_REASON_CHARS else said[: MAX_REASON_CHARS - 1] + "…"


def _exit_with_parent(parent_pid: int) -> None:
    """End the worker when the search process is gone (e.g. killed with SIGKILL): the worker
    is reparented then, so ``getppid`` changes; checked every :data:`PARENT_POLL_SECONDS`."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)
