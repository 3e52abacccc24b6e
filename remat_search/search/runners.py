"""The worker processes that measure a spec's plans: one as the spec says, how many, and the
budget their device holds.

Shared by the search, the confirmation and ``plan --measure``, so that a stored study is
measured again exactly as its last search measured it.
"""

from __future__ import annotations

import os

import psutil

from remat_search.errors import SpecError, WorkloadError
from remat_search.measure.artifacts import ARTIFACTS
from remat_search.measure.device import DeviceInfo
from remat_search.measure.runner import Runner
from remat_search.measure.slice import SliceMember
from remat_search.plans.plan import RematPlan
from remat_search.spec.budget import Share
from remat_search.spec.models import SearchSpec
from remat_search.store.location import storage_home
from remat_search.units import format_bytes

WORKER_HOST_MEMORY = 4 * 2**30
"""Host memory ``workers: auto`` allows each worker: a TPU compile of a ~1B model holds several GiB."""
CORES_PER_WORKER = 2
"""Cores ``workers: auto`` allows each worker: one v5e compile of the write-up model kept 1.7 busy."""


def runner_for(spec: SearchSpec, member: SliceMember | None = None) -> Runner:
    """The worker that measures ``spec``'s plans where and as the spec says; on a slice, this
    host's part of it (``member``: this process's place)."""
    return Runner(
        spec.workload, timeout=spec.timing.timeout, memory_limit=spec.worker_memory, target=spec.target,
        mesh=spec.mesh,
        # JAX makes the directory on its first write: nothing is written for a bad spec.
        compilation_cache=str(storage_home() / spec.compilation_cache) if spec.compilation_cache else None,
        artifacts=str(storage_home() / ARTIFACTS / spec.study),  # made when a reference is first saved
        member=None if member is None else (member, spec.slice),
    )


def resolve_workers(workers: int | str) -> int:
    """The number of worker processes for ``spec.workers``: itself, or for ``auto`` one per
    :data:`CORES_PER_WORKER` cores this process may use, as the host's available memory allows
    (:data:`WORKER_HOST_MEMORY` each); at least one."""
    if workers != "auto":
        return int(workers)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores // CORES_PER_WORKER, psutil.virtual_memory().available // WORKER_HOST_MEMORY))


def resolve_budget(budget: int | None, device: DeviceInfo) -> int:
    """The spec's budget, checked against the device's memory; that memory if none is given."""
    limit = device.memory_limit
    if budget is None:
        if limit is None:
            raise SpecError(
                f"spec.budget: required here: {device.platform} reports no memory limit "
                "(give one such as 200MiB or 16GiB)"
            )
        return limit
    if limit is not None and budget > limit:
        raise SpecError(
            f"spec.budget: {format_bytes(budget)} is more than the {format_bytes(limit)} a "
            f"{device.device_kind} device has for a program; leave budget out to use all of it"
        )
    return budget


def no_remat_peak(share: Share, spec: SearchSpec, runner: Runner, layers: int) -> int:
    """The compiled peak of the uniform no-remat plan over ``layers`` layers at the spec's own
    batch and mesh, which ``share`` (the spec's budget, ``70%``) is a share of: compiled by
    ``runner`` and never run (a budget of one byte: every plan is over it)."""
    plan = RematPlan.uniform("none", layers)
    m = runner.measure(plan, budget=1, timing=spec.timing, gradient_tolerance=spec.gradient_tolerance)
    if m.peak_bytes is None:
        raise WorkloadError(
            f"spec.budget: {share} is a share of no remat's compiled peak, and the no-remat plan "
            f"({plan.summary()}) did not compile: {m.error or m.status}; give the budget in bytes"
        )
    return m.peak_bytes
