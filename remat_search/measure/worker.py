"""The worker process of a :class:`~remat_search.measure.runner.Runner`: it builds the
workload and the target once, says what it runs on, then measures (or re-times) plan after
plan as the runner asks, over the messages of :mod:`remat_search.measure.protocol`. A
candidate that raises is a one-line failure (:func:`one_line`), never the worker's end; the
worker ends with the search that started it (within :data:`PARENT_POLL_SECONDS`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from remat_search.errors import CandidateRefused, RunError, SpecError, WorkloadError
from remat_search.measure import protocol
from remat_search.measure.artifacts import PROGRAMS, ReferenceStore, reference_key
from remat_search.measure.device import describe, reference_parts
from remat_search.measure.executables import Executables, Known, measure, retime
from remat_search.measure.measurement import Measurement, RawMeasurement
from remat_search.measure.slice import Agreement, SliceDisagreement, SliceMember, join
from remat_search.plans.configuration import Configuration
from remat_search.plans.plan import RematPlan
from remat_search.spec.models import SliceConfig, TargetConfig
from remat_search.spec.workloads import WorkloadConfig
from remat_search.targets.base import Target, target_of

PARENT_POLL_SECONDS = 0.25
"""How often the worker checks that the search that started it is still alive."""
MAX_REASON_CHARS = 400
DEBUG_ENV = "REMAT_SEARCH_DEBUG"
"""Set (to anything), the worker sends its own traceback with every failure."""


def serve(
    conn: Connection,
    workload_config: WorkloadConfig,
    where: tuple[TargetConfig, dict[str, int] | None],
    compilation_cache: str | None,
    parent_pid: int,
    environment: dict[str, str],
    artifacts: str | None = None,
    member: tuple[SliceMember, SliceConfig] | None = None,
) -> None:
    """The worker's loop: build the workload once, then measure plan after plan.

    ``environment``: the search's, as it was when it started this worker (a forked worker has
    its forkserver's, from when that started). ``member``: on a slice, this process's place and
    the slice's timeouts: the worker joins the slice's ``jax.distributed`` job first, and agrees
    with the other processes' workers on every compile (:mod:`remat_search.measure.slice`)."""
    os.environ.clear()
    os.environ.update(environment)
    threading.Thread(target=_exit_with_parent, args=(psutil.Process(parent_pid),), daemon=True).start()
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
        # JAX's persistent cache: a plan compiled before loads in a moment. Not for a TPU topology:
        # libtpu writes its entries there but cannot read them back without a TPU client.
        if member is not None:
            try:
                join(*member)
            except Exception as e:  # noqa: BLE001 - another process is gone, or never came
                conn.send(protocol.StartFailed("slice", f"slice: this worker could not join the others: {_failure(e)}"))
                return
        if compilation_cache and target_config == "local":
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
    programs = None if artifacts is None else Path(artifacts) / PROGRAMS  # for a calibration (calibrate --study)
    agree = None if member is None else Agreement(member[1].collective_timeout)
    base = Executables(workload, target=target, mesh=mesh, reference_store=store, programs=programs, agree=agree)
    executables = _Configured(base, workload_config, target)
    while True:
        try:
            request: protocol.Measure | protocol.Retime = conn.recv()
        except EOFError:
            return
        try:
            if isinstance(request, protocol.Retime):
                plans = [RematPlan.model_validate_json(p) for p in request.plans]
                times = executables.retime(plans, warmup=request.warmup, rounds=request.rounds, budget=request.budget)
                conn.send(protocol.Done(json.dumps(times)))
                continue
            plan = RematPlan.model_validate_json(request.plan)
            try:
                m = measure(
                    executables.at(plan.configuration), plan, budget=request.budget,
                    timing=request.timing, gradient_tolerance=request.gradient_tolerance,
                    known=_asker(conn) if request.ask else None,
                )
            except CandidateRefused as e:  # an infeasible candidate, never compiled: the reason is its record
                m = Measurement(status="infeasible", plan_digest=plan.digest, error=str(e))
            conn.send(protocol.Done(m.model_dump_json()))
        except SliceDisagreement as e:  # another process's failure, told with its process and host
            conn.send(protocol.Failed(str(e)))
        except Exception as e:  # noqa: BLE001 - one bad candidate must not stop the worker
            conn.send(protocol.Failed(_failure(e)))


class _Configured:
    """The worker's executables of each configuration its plans carry: the spec's own workload
    and mesh for a plan without one; for a configuration, the workload at its batch over its
    mesh, built when a plan first asks for it (its reference is kept in memory only)."""

    def __init__(self, base: Executables, workload_config: WorkloadConfig, target: Target) -> None:
        self._base, self._workload_config, self._target = base, workload_config, target
        self._built: dict[Configuration, Executables] = {}

    def at(self, configuration: Configuration | None) -> Executables:
        if configuration is None:
            return self._base
        if configuration not in self._built:
            from remat_search.workloads.base import build_workload, check_params_from

            workload = build_workload(self._workload_config, configuration)
            mesh = self._target.mesh(configuration.mesh_axes)
            workload.use_mesh(mesh)
            check_params_from(workload)
            self._built[configuration] = Executables(workload, target=self._target, mesh=mesh, configuration=configuration,
                                                     programs=self._base.programs, agree=self._base.agree)
        return self._built[configuration]

    def retime(self, plans: list[RematPlan], **how: Any) -> list[tuple[float, ...]]:
        """:func:`executables.retime` of ``plans``, one interleaved session for each
        configuration among them (one training state on the device at a time); their times in
        the order of ``plans``."""
        times: dict[int, tuple[float, ...]] = {}
        for configuration in dict.fromkeys(p.configuration for p in plans):
            group = [i for i, p in enumerate(plans) if p.configuration == configuration]
            found = retime(self.at(configuration), [plans[i] for i in group], **how)
            times.update(zip(group, found, strict=True))
        return [times[i] for i in range(len(plans))]


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

    from remat_search.targets.platform import tpu_chips_attached

    plugins = importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("jax_plugins")
    return not plugins and tpu_chips_attached() == 0


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


def _exit_with_parent(search: psutil.Process) -> None:
    """End the worker when the search process is gone (e.g. killed with SIGKILL), checked every
    :data:`PARENT_POLL_SECONDS`. The search, not this process's parent: a forked worker's parent
    is the search's forkserver, which lives as long as any worker it forked does."""
    with contextlib.suppress(psutil.NoSuchProcess):
        while search.is_running() and search.status() != psutil.STATUS_ZOMBIE:
            time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)
