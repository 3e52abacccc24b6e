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
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Self

import psutil
from pydantic import BaseModel, ConfigDict

from remat_search.measure.artifacts import ReferenceStore, reference_key
from remat_search.errors import RematSearchError, RunError, SpecError, WorkloadError
from remat_search.measure.executables import (
    INPUT_SEED,
    Executables,
    Known,
    anchor_plan,
    compiler_options,
    measure,
    retime,
)
from remat_search.measure.measurement import MEASUREMENT_SCHEMA, Measurement, RawMeasurement
from remat_search.plans.plan import RematPlan
from remat_search.spec.models import TargetConfig, TimingConfig, WorkloadConfig
from remat_search.targets.base import device_order, target_of
from remat_search.units import format_bytes

STARTUP_TIMEOUT = 300.0
WATCH_SECONDS = 0.05
"""How often the parent reads the worker's resident memory while it waits (``worker_memory``)."""
PARENT_POLL_SECONDS = 0.25
"""How often the worker checks that its parent, the search, is still alive."""
MAX_REASON_CHARS = 400
DEBUG_ENV = "REMAT_SEARCH_DEBUG"
"""Set (to anything), the worker sends its own traceback with every failure."""


class DeviceInfo(BaseModel):
    """What plans are compiled for, as the worker's JAX sees it."""

    model_config = ConfigDict(frozen=True)

    target: str
    """``local`` or the TPU topology."""
    platform: str
    device_kind: str
    device_count: int
    mesh: dict[str, int] | None
    device_order: list[int] | None = None
    """The devices' ids in the mesh's row-major order where it is not their own (ascending):
    ``jax.make_mesh``'s placement over a TPU topology's links (``target.device_order``). None:
    their own order, as every study measured before this field existed was (part of the cache
    key and of the study's identity)."""
    memory_limit: int | None
    """Usable memory per device as its compiler or runtime reports it (None on CPU)."""
    executes: bool
    """Whether plans run here (local) or are only compiled (a TPU target from elsewhere)."""
    jax_version: str
    workload_fingerprint: str
    compiler_options: str = ""
    """The options and XLA flags plans are compiled with: part of the measurement cache key."""
    compiler_version: str | None = None
    """libtpu's version where plans are compiled for TPU (it is the compiler): part of the key."""
    compiler_packages: str = ""
    """The versions of the packages that compile plans here (:func:`compiler_packages`): part of
    the measurement cache's key and of the saved reference's; "" where a study stored its device
    before the field existed."""
    measurement_schema: int = 0
    """:data:`measurement.MEASUREMENT_SCHEMA` of the worker: what its measurements mean (part
    of the key; 0 where a study stored its device before the field existed)."""
    program_fingerprint: str = ""
    """Hash of the no-remat step's jaxpr: the workload's code, not only its shapes (cache key)."""
    traced_names: tuple[str, ...] | None = None
    """The ``checkpoint_name`` tags the traced step emits (None: it did not trace)."""
    shardings: str | None = None
    """Over a mesh, where the state's shardings come from (:meth:`Workload.sharding_source`):
    the model's own partitioning or the FSDP heuristic; None without a mesh."""
    sharding_digest: str = ""
    """Hash of the state's and batch's ``PartitionSpec`` s over the mesh ("" without one):
    part of the measurement cache key, as the model's partitioning changes per-chip memory."""
    workload_note: str | None = None
    """What the workload chose for this target that its spec left open, in a line
    (:meth:`Workload.note`: ``attention: auto → flash (Pallas TPU kernel)``); None if nothing."""


CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
"""The packages that compile and run plans on NVIDIA GPUs (XLA:GPU and its PJRT plugin)."""


def compiler_packages(platform: str) -> str:
    """The versions of what compiles plans for ``platform`` here, as ``name version`` pairs:
    jaxlib (XLA, whose CPU compiler it carries), libtpu for TPU, the CUDA plugin for GPU, each
    where installed. A measurement or reference made with other versions is not reused."""
    return ", ".join(installed_versions(["jaxlib", *{"tpu": ("libtpu",), "gpu": CUDA_PLUGINS}.get(platform, ())]))


def installed_versions(names: Iterable[str]) -> list[str]:
    """``name version`` of each of the packages ``names`` that is installed here."""
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def reference_parts(info: DeviceInfo, layers: int) -> dict[str, Any]:
    """What a study's saved reference first step depends on (:func:`artifacts.reference_key`):
    the device and mesh, the state's shardings over it, the workload's shapes and program, the
    compiler, the anchor plan and the input seed."""
    return {
        **info.model_dump(include={
            "target", "platform", "device_kind", "device_count", "mesh", "shardings", "sharding_digest",
            "jax_version", "workload_fingerprint", "program_fingerprint", "compiler_options", "compiler_version",
            "compiler_packages",
        }),
        "anchor": anchor_plan(layers).digest, "input_seed": INPUT_SEED,
    }


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
        self._conn.send(("measure", plan.to_json(), budget, timing, gradient_tolerance, known is not None))
        deadline = time.monotonic() + self._timeout
        while True:
            stopped = self._wait(max(0.0, deadline - time.monotonic()), seconds=self._timeout)
            if stopped is not None:
                return Measurement(status="failed", plan_digest=plan.digest, error=stopped)
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                reason = self._death_reason()
                self.close()
                return Measurement(status="failed", plan_digest=plan.digest, error=reason)
            if kind != "program":
                break
            assert known is not None
            try:
                found = known(payload)  # the worker waits for the answer
            except BaseException:
                self.close()  # it waits for an answer it will not get: a new worker for the next plan
                raise
            self._conn.send(("known", found.model_dump_json() if found is not None else None))
        if kind == "error":
            if os.environ.get(DEBUG_ENV):
                print(f"remat-search: plan {plan.summary()} failed in the worker: {payload}", file=sys.stderr)
            return Measurement(status="failed", plan_digest=plan.digest, error=payload)
        return Measurement.model_validate_json(payload)

    def retime(
        self, plans: list[RematPlan], *, warmup: int, rounds: int, budget: int | None = None
    ) -> list[tuple[float, ...]]:
        """Time ``plans`` interleaved in the worker, with the executables it kept (see
        :func:`executables.retime`); a plan over ``budget`` is refused, never run.

        Raises :class:`RematSearchError` if the worker fails or runs past the timeout per plan.
        """
        self._ensure_worker()
        assert self._conn is not None
        self._conn.send(("retime", [p.to_json() for p in plans], warmup, rounds, budget))
        stopped = self._wait(self._timeout * len(plans))
        if stopped is not None:
            raise RematSearchError(f"confirm: re-timing {stopped}")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            reason = self._death_reason()
            self.close()
            raise RematSearchError(f"confirm: re-timing failed ({reason})") from None
        if kind == "error":
            raise RematSearchError(f"confirm: re-timing failed ({payload})")
        return [tuple(t) for t in json.loads(payload)]

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
            kind, payload = parent_conn.recv()
        except EOFError:
            reason = self._death_reason()
            self.close()
            raise WorkloadError(f"workload: the worker could not start ({reason})") from None
        if kind == "spec_error":
            self.close()
            raise SpecError(payload)
        if kind == "run_error":
            self.close()
            raise RunError(payload)
        if kind == "error":
            self.close()
            raise WorkloadError(f"workload: the worker could not build it ({payload})")
        self._info = DeviceInfo.model_validate_json(payload)

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

        from remat_search.workloads.base import build_workload, check_params_from, trace_step

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
        info = DeviceInfo(
            target=target.name, platform=target.platform, device_kind=target.devices()[0].device_kind,
            device_count=mesh.size if mesh is not None else 1,
            mesh=dict(mesh.shape) if mesh is not None else None,
            device_order=device_order(mesh),
            memory_limit=target.memory_limit(mesh), executes=target.executes, jax_version=jax.__version__,
            workload_fingerprint=workload.fingerprint(),
            program_fingerprint=traced.fingerprint,
            traced_names=None if traced.names is None else tuple(sorted(traced.names)),
            shardings=workload.sharding_source() if mesh is not None else None,
            sharding_digest=_sharding_digest(workload, mesh),
            workload_note=workload.note(),
            compiler_options=json.dumps({
                "options": compiler_options(target.platform),
                **{flag: os.environ.get(flag, "") for flag in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
            }, sort_keys=True),
            compiler_version=target.compiler_version(),
            compiler_packages=compiler_packages(target.platform),
            measurement_schema=MEASUREMENT_SCHEMA,
        )
    except (SpecError, WorkloadError) as e:  # the spec's mesh or the model's partitioning, found with the mesh
        conn.send(("spec_error", str(e)))
        return
    except RunError as e:  # e.g. the target's compiler did not state its memory
        conn.send(("run_error", str(e)))
        return
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", _failure(e, line=False)))
        return
    conn.send(("ready", info.model_dump_json()))
    store = None if artifacts is None else ReferenceStore(Path(artifacts), reference_key(reference_parts(info, workload.layers)))
    # Each plan compiled once in this worker; the reference loaded from the study's artifacts if saved.
    executables = Executables(workload, target=target, mesh=mesh, reference_store=store)
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:
            return
        try:
            if command == "retime":
                plans_json, warmup, rounds, budget = args
                plans = [RematPlan.model_validate_json(p) for p in plans_json]
                times = retime(executables, plans, warmup=warmup, rounds=rounds, budget=budget)
                conn.send(("ok", json.dumps(times)))
                continue
            plan_json, budget, timing, tolerance, ask = args
            m = measure(
                executables, RematPlan.model_validate_json(plan_json), budget=budget,
                timing=timing, gradient_tolerance=tolerance, known=_asker(conn) if ask else None,
            )
            conn.send(("ok", m.model_dump_json()))
        except Exception as e:  # noqa: BLE001 - one bad candidate must not stop the worker
            conn.send(("error", _failure(e)))


def _sharding_digest(workload: Any, mesh: Any) -> str:
    """See :attr:`DeviceInfo.sharding_digest`."""
    if mesh is None:
        return ""
    import jax

    specs = [str(s.spec) for s in jax.tree.leaves(workload.input_shardings(mesh))]
    return hashlib.sha256(json.dumps(specs).encode()).hexdigest()[:16]


def _asker(conn: Connection) -> Known:
    """Ask the parent (see :meth:`Runner.measure`) for a measurement of a compiled program."""

    def known(program: str) -> RawMeasurement | None:
        conn.send(("program", program))
        _, payload = conn.recv()
        return RawMeasurement.model_validate_json(payload) if payload is not None else None

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
