"""A process's place in a multi-host slice, and what its worker does to take part.

On a slice every host runs the same ``remat-search run``; each is one process of the slice
(:class:`SliceMember`: the coordinator's address, how many processes, which one this is), from
flags, the environment a launcher sets, or a Cloud TPU VM's own metadata (:func:`member_of`).
The search processes never run JAX together: each host's worker does. Every worker of a
generation joins one ``jax.distributed`` job at the coordinator (:func:`join`), so that the
devices of all hosts form one mesh, and the workers agree on each candidate's compile through
the job's key-value store, which is not a collective (:class:`Agreement`): a process that
raised, or compiled another plan, fails the trial on all of them instead of hanging them in a
collective. What each process measured is merged into the trial's measurement by
:func:`merged` (the largest peak; each step the slowest process's).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from remat_search.errors import SpecError
from remat_search.measure.measurement import Measurement
from remat_search.spec.models import SliceConfig

COORDINATOR_ENV, PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "REMAT_SEARCH_PROCESSES", "REMAT_SEARCH_PROCESS_ID"
"""Where a launcher tells a process its slice: JAX's own variable for the coordinator, ours for
the count and index (a Kubernetes indexed Job sets the index from its completion index)."""
CHANNEL_PORT_OFFSET = 1
"""The search processes talk on the coordinator's port + this (the workers' JAX job has the port itself)."""


RUNTIME_FLAGS = ("--xla_cpu_collective_timeout_seconds", "--xla_force_host_platform_device_count")
"""XLA flags that change how a program waits (:func:`join` sets the first), or how many CPU
devices a process has (the key holds the devices and the mesh already), not the program: left
out of the compiler options a measurement and a saved reference are keyed by (``device.describe``)."""


def compile_flags(xla_flags: str) -> str:
    """``xla_flags`` less :data:`RUNTIME_FLAGS`."""
    if not any(flag in xla_flags for flag in RUNTIME_FLAGS):
        return xla_flags  # as keyed before slices existed
    return " ".join(flag for flag in xla_flags.split() if not flag.startswith(RUNTIME_FLAGS))


class SliceMember(BaseModel):
    """This process's place in a slice."""

    model_config = ConfigDict(frozen=True)

    coordinator: str
    """``host:port`` of process 0's JAX coordinator."""
    processes: int = Field(ge=1)
    process_id: int = Field(ge=0)

    @property
    def leader(self) -> bool:
        """Whether this process holds the study (process 0)."""
        return self.process_id == 0

    @property
    def channel(self) -> tuple[str, int]:
        """Where the leader's search listens for the others' (see ``search/slice.py``)."""
        host, port = self.coordinator.rsplit(":", 1)
        return host.strip("[]"), int(port) + CHANNEL_PORT_OFFSET


def member_of(coordinator: str | None, processes: int | None, process_id: int | None) -> SliceMember | None:
    """This process's place in a slice, from the flags given, else the environment a launcher
    sets (:data:`COORDINATOR_ENV`, :data:`PROCESSES_ENV`, :data:`PROCESS_ID_ENV`), else a Cloud
    TPU VM's metadata (as ``jax.distributed.initialize()`` finds it); None where nothing says this
    process is one of several (one host). A partial or bad setting raises :class:`SpecError`
    naming the flag."""
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or None
    processes = processes if processes is not None else _int_env(PROCESSES_ENV, "--processes")
    process_id = process_id if process_id is not None else _int_env(PROCESS_ID_ENV, "--process-id")
    if coordinator is None and processes is None and process_id is None:
        return _cloud_tpu_member()
    settings = (("--coordinator", coordinator, COORDINATOR_ENV, "HOST:PORT"), ("--processes", processes, PROCESSES_ENV, "N"),
                ("--process-id", process_id, PROCESS_ID_ENV, "I"))
    missing = [(flag, env, form) for flag, value, env, form in settings if value is None]
    if missing:
        flag, env, form = missing[0]
        given = " and ".join(f for f, value, _, _ in settings if value is not None)
        raise SpecError(f"{flag}: required with {given} on a slice: give {flag} {form} or ${env}")
    assert coordinator is not None and processes is not None and process_id is not None
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise SpecError(f"--coordinator: expected HOST:PORT (a port below 65535), got {coordinator!r}")
    if processes < 1:
        raise SpecError(f"--processes: expected a count of 1 or more, got {processes}")
    if not 0 <= process_id < processes:
        raise SpecError(f"--process-id: expected 0 to {processes - 1} (--processes {processes}), got {process_id}")
    return SliceMember(coordinator=coordinator, processes=processes, process_id=process_id)


def _int_env(name: str, flag: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"{flag}: ${name} must be a whole number, got {value!r}") from None


def _cloud_tpu_member() -> SliceMember | None:
    """A multi-host Cloud TPU VM's place in its slice (GCE or GKE), as JAX's own cluster
    detection reads it for ``jax.distributed.initialize()``; None elsewhere, and on a host that
    is the whole slice."""
    from remat_search.targets.platform import tpu_chips_attached

    if tpu_chips_attached() == 0:
        return None
    from jax._src.clusters import ClusterEnv  # private: the detection initialize() runs

    if not any("Tpu" in env.__name__ and env.is_env_present() for env in ClusterEnv._cluster_types):
        return None
    coordinator, count, index, _ = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 300)
    if coordinator is None or count is None or index is None or count == 1:
        return None
    return SliceMember(coordinator=coordinator, processes=count, process_id=index)


def join(member: SliceMember, config: SliceConfig) -> None:
    """Join this worker to its generation's ``jax.distributed`` job (before JAX starts a
    backend). On CPU the processes' collectives go over gloo, and one that waits past
    ``collective_timeout`` fails instead of hanging."""
    import jax

    if (jax.config.jax_platforms or "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _drop_gloo_lines()
        flag = f"--xla_cpu_collective_timeout_seconds={int(config.collective_timeout)}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    jax.distributed.initialize(
        member.coordinator, member.processes, member.process_id,
        initialization_timeout=int(config.join_timeout), heartbeat_timeout_seconds=max(int(config.heartbeat_timeout), 1),
    )


GLOO_LINE = b"[Gloo] "
"""How gloo starts the line it prints on stdout each time a collective's processes connect
(``[Gloo] Rank 0 is connected to 1 peer ranks. …``), whatever ``GLOO_LOG_LEVEL`` says."""


def _drop_gloo_lines() -> None:
    """This worker's stdout through a thread that drops gloo's lines (:data:`GLOO_LINE`) and
    passes every other on: a slice's log says what the search does, not each connection."""
    read, write = os.pipe()
    out = os.dup(1)
    os.dup2(write, 1)
    os.close(write)

    def forward() -> None:
        with os.fdopen(read, "rb") as lines, os.fdopen(out, "wb", buffering=0) as sink:
            for line in lines:
                if not line.startswith(GLOO_LINE):
                    sink.write(line)

    threading.Thread(target=forward, daemon=True, name="remat-search-gloo-lines").start()


class SliceDisagreement(RuntimeError):
    """Another process of the slice failed to compile the candidate, or compiled another plan:
    the trial fails on every process, with that process's reason."""


class Agreement:
    """The workers' agreement on each candidate, through the ``jax.distributed`` job's
    key-value store: every process says what it compiled (or why it could not), and reads what
    the others said, before any of them runs a collective. Calls are numbered: every process
    makes the same calls in the same order (the leader hands them the same requests)."""

    def __init__(self, timeout: float) -> None:
        from jax._src.distributed import global_state

        self._client, self._timeout_ms = global_state.client, int(timeout * 1000)
        self._me, self._count = global_state.process_id, global_state.num_processes
        self._calls = 0

    def __call__(self, said: dict[str, Any]) -> list[dict[str, Any]]:
        """What every process said at this call (``said`` for this one), in process order."""
        self._calls += 1
        key = f"remat_search/agree/{self._calls}"
        self._client.key_value_set(f"{key}/{self._me}", json.dumps({**said, "host": _host()}))
        return [
            json.loads(self._client.blocking_key_value_get(f"{key}/{i}", self._timeout_ms))
            for i in range(self._count)
        ]

    def check(self, said: dict[str, Any]) -> list[dict[str, Any]]:
        """:meth:`__call__`, raising :class:`SliceDisagreement` where a process failed or said
        another plan than this one."""
        everyone = self(said)
        for i, theirs in enumerate(everyone):
            if "failed" in theirs:
                raise SliceDisagreement(f"process {i} ({theirs['host']}) failed: {theirs['failed']}")
            if theirs.get("plan") != said.get("plan"):
                raise SliceDisagreement(
                    f"process {i} ({theirs['host']}) compiled plan {theirs.get('plan')}, this one {said.get('plan')}"
                )
        return everyone


def _host() -> str:
    import socket

    return socket.gethostname()


def merged(measurements: Sequence[Measurement], hosts: Sequence[str]) -> Measurement:
    """The trial's measurement from each process's (in process order, on ``hosts``): failed
    where any process failed, with the first such process's reason; else the measurement of the
    process with the largest peak, each timed step the slowest process's (all stepped together:
    a step ends on every host when the slowest does), the check's error the largest."""
    for i, m in enumerate(measurements):
        if m.status == "failed":  # a disagreement names the process that caused it already
            said = m.error or "failed"
            return m if said.startswith("process ") else m.model_copy(update={"error": f"process {i} ({hosts[i]}): {said}"})
    base = max(measurements, key=lambda m: m.peak_bytes or 0)
    update: dict[str, Any] = {}
    for name in ("step_times", "anchor_times"):
        series = [getattr(m, name) for m in measurements]
        if all(len(s) == len(series[0]) for s in series) and series[0]:
            update[name] = tuple(max(step) for step in zip(*series, strict=True))
    checked = [m for m in measurements if m.grad_check is not None]
    if checked:  # each process checked the same gathered gradients: the worst of them stands
        worst = max(checked, key=lambda m: m.grad_check.leaf_error / (m.grad_check.leaf_threshold or 1))  # type: ignore[union-attr]
        update.update(grad_check=worst.grad_check, grad_rel_error=worst.grad_rel_error)
    return base.model_copy(update=update)
