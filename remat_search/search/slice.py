"""One search across the hosts of a slice: the leader (process 0) holds the study and hands
every other process each request; all measure it in lockstep, and the leader merges what they saw.

Every host runs the same ``remat-search run SPEC`` (:class:`~remat_search.measure.slice.SliceMember`
says which process it is). The others connect to the leader over TCP, on the coordinator's port
+ 1 (a channel that is not a collective, so no disagreement can hang them), and show it their
spec: one that differs is refused before anything is compiled, in one line naming the host and
the field. Then the leader's :class:`SliceRunner` stands where one host's
:class:`~remat_search.measure.runner.Runner` stands, for the search, its confirmation and its
races: each request goes to every process's runner, whose workers form one ``jax.distributed``
job (:mod:`remat_search.measure.slice`), and the replies are merged (the largest peak; each step
the slowest process's). After a failed candidate every process starts a fresh worker, so a
crash costs the slice that trial and a restart of the workers, never the search.

A process that dies, hangs (no heartbeat for ``slice.heartbeat_timeout``) or leaves is a lost
slice: the others kill their workers and exit with
:data:`~remat_search.errors.SLICE_RESTART_EXIT`; the leader first fails the cut trial and queues
its plan again, and the launcher's restart of the job resumes the study.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from remat_search.errors import RematSearchError, RunError, SliceLost, SpecError, WorkloadError
from remat_search.measure import protocol
from remat_search.measure.device import DeviceInfo
from remat_search.measure.measurement import Measurement
from remat_search.measure.runner import Runner
from remat_search.measure.slice import SliceMember, merged
from remat_search.plans.plan import RematPlan
from remat_search.search.channel import Channel, Describe, End, Hello, Restart, Restarted, Welcome, connect
from remat_search.search.runners import runner_for
from remat_search.spec.models import SearchSpec, TimingConfig

NOT_COMPARED = {"storage", "workers"}
"""Spec fields the hosts may set apart: only the leader uses the storage, and a slice runs one worker a host."""


def comparable(spec: SearchSpec) -> dict[str, Any]:
    """What of ``spec`` every process of a slice must share."""
    return spec.model_dump(mode="json", exclude=NOT_COMPARED)


def first_difference(ours: Any, theirs: Any, path: str = "spec") -> str | None:
    """The first field (``spec.workload.layers``) where two specs as JSON differ, with both
    values; None where they are the same."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs)):
            found = first_difference(ours.get(key), theirs.get(key), f"{path}.{key}")
            if found:
                return found
        return None
    if ours != theirs:
        return f"{path} is {json.dumps(theirs)} there, {json.dumps(ours)} on the leader"
    return None


def check_slice(spec: SearchSpec, member: SliceMember) -> None:
    """What a slice needs of a spec (before any process starts work): its plans run here, over
    a mesh of every process's devices."""
    if spec.target != "local":
        raise SpecError(
            "spec.target: a slice runs its plans on its own devices (local); a TPU topology is compiled "
            "for from one process, without --processes"
        )
    if member.processes > 1 and not spec.mesh and spec.configuration is None:
        raise SpecError(
            f"spec.mesh: required on a slice of {member.processes} processes: a mesh over every "
            "process's devices, e.g. {data: 8} for 4 hosts of 2 devices"
        )


class SliceRunner:
    """The leader's runner of a slice: :class:`Runner`'s ``describe``, ``measure``, ``retime``,
    ``kill`` and ``close``, with every request made of every process at once (see the module)."""

    def __init__(self, local: Runner, channels: list[Channel], hosts: list[str]) -> None:
        self._local, self._channels, self.hosts = local, channels, hosts
        self._info: DeviceInfo | None = None

    def __enter__(self) -> SliceRunner:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(ended=kind is None)

    def describe(self) -> DeviceInfo:
        """Start every process's worker (they join one JAX job) and return what they run on."""
        if self._info is None:
            self._send_all(Describe())
            try:
                info = self._local.describe()
            except RematSearchError:
                self._check()  # its worker was killed because a process was lost: that is the error
                raise
            finally:
                replies = [channel.recv() for channel in self._channels]
            for i, reply in enumerate(replies, start=1):
                if isinstance(reply, protocol.StartFailed):
                    error = {"spec": SpecError, "run": RunError, "slice": SliceLost}.get(reply.kind, WorkloadError)
                    raise error(f"{reply.reason} (process {i}, {self.hosts[i]})")
            self._info = info
        return self._info

    def measure(self, plan: RematPlan, *, budget: int, timing: TimingConfig, gradient_tolerance: float | None,
                known: Any = None) -> Measurement:
        """Measure ``plan`` on every process; their measurements merged (:func:`merged`). A
        plan measured alike elsewhere (``known``) is not asked for: every process must run
        every plan it compiles, or the others would wait for it in a collective."""
        self._send_all(protocol.Measure(plan.to_json(), budget, timing, gradient_tolerance, ask=False))
        mine = self._local.measure(plan, budget=budget, timing=timing, gradient_tolerance=gradient_tolerance)
        self._check()
        theirs = []
        for channel in self._channels:
            reply = channel.recv()
            theirs.append(
                Measurement.model_validate_json(reply.payload) if isinstance(reply, protocol.Done)
                else Measurement(status="failed", plan_digest=plan.digest, error=reply.reason)
            )
        everyone = [mine, *theirs]
        m = merged(everyone, self.hosts)
        if m.status == "failed":
            self.restart()
        return m.model_copy(update={"slice_peaks": tuple(x.peak_bytes or 0 for x in everyone)})

    def retime(self, plans: list[RematPlan], *, warmup: int, rounds: int, budget: int | None = None) -> list[tuple[float, ...]]:
        """Re-time ``plans`` interleaved on every process; each step the slowest process's."""
        self._send_all(protocol.Retime([p.to_json() for p in plans], warmup, rounds, budget))
        mine: list[tuple[float, ...]] | None = None
        failure = None
        try:
            mine = self._local.retime(plans, warmup=warmup, rounds=rounds, budget=budget)
        except RematSearchError as e:
            failure = str(e)
        self._check()
        everyone = [mine]
        for i, channel in enumerate(self._channels, start=1):
            reply = channel.recv()
            if isinstance(reply, protocol.Failed):
                failure = failure or f"{reply.reason} (process {i}, {self.hosts[i]})"
            else:
                everyone.append([tuple(t) for t in json.loads(reply.payload)])
        if failure is not None or mine is None:
            self.restart()
            raise RematSearchError(failure or "confirm: re-timing failed")
        return [tuple(max(step) for step in zip(*times, strict=True)) for times in zip(*everyone, strict=True)]

    def restart(self) -> None:
        """Stop every process's worker; the next request starts a fresh JAX job."""
        self._send_all(Restart())
        self._local.close()
        for channel in self._channels:
            channel.recv()

    def kill(self) -> None:
        self._local.kill()

    def close(self, *, ended: bool = True) -> None:
        """Stop the slice. ``ended``: the search is over, and every process exits 0 (a lost one
        is past telling); else the leader stops on an error, and the others, finding it gone,
        exit 42: none may count as done while the study is not (an Indexed Job would not start
        a process that exited 0 again)."""
        for channel in self._channels:
            if ended:
                try:
                    channel.send(End())
                except SliceLost:
                    pass
            channel.close()
        self._local.close()

    def _check(self) -> None:
        """:class:`SliceLost` where a process was lost (its worker's failure is not the plan's)."""
        for channel in self._channels:
            if channel.lost is not None:
                raise SliceLost(f"slice: {channel.peer} is {channel.lost}")

    def _send_all(self, message: Any) -> None:
        for channel in self._channels:
            channel.send(message)


@contextmanager
def lead(spec: SearchSpec, member: SliceMember) -> Iterator[SliceRunner]:
    """The leader's side: wait for every other process (``slice.join_timeout``), refuse any whose
    spec differs (:class:`SpecError` here and exit 2 there), then yield the slice's runner."""
    local = runner_for(spec, member)
    host, port = member.channel
    deadline = time.monotonic() + spec.slice.join_timeout
    channels: dict[int, Channel] = {}
    hosts = {0: socket.gethostname()}
    refused: str | None = None
    with socket.create_server(("", port)) as server:
        while len(channels) < member.processes - 1:
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = server.accept()
            except TimeoutError:
                raise SliceLost(
                    f"slice: {len(channels) + 1} of {member.processes} processes joined within "
                    f"{spec.slice.join_timeout:g} s (slice.join_timeout), listening on port {port}"
                ) from None
            channel = Channel(sock, peer="a process", config=spec.slice, on_lost=local.kill)
            try:
                hello = channel.recv()
            except SliceLost:  # it left before it said who it is: wait for it again
                channel.close()
                continue
            if not isinstance(hello, Hello):  # not one of the slice's processes
                channel.close()
                continue
            channel.peer = f"process {hello.process_id} ({hello.host})"
            difference = first_difference(comparable(spec), hello.spec)
            if difference is not None or hello.process_id in channels or not 0 < hello.process_id < member.processes:
                said = difference or f"process id {hello.process_id} given twice or out of range"
                refused = refused or f"slice: process {hello.process_id} on host {hello.host} differs: {said}"
            channels[hello.process_id] = channel
            hosts[hello.process_id] = hello.host
    for channel in channels.values():
        channel.send(Welcome(refused))
    if refused is not None:
        for channel in channels.values():
            channel.close()
        raise SpecError(refused)
    order = sorted(channels)
    runner = SliceRunner(local, [channels[i] for i in order], [hosts[i] for i in [0, *order]])
    with runner:
        yield runner


def follow(spec: SearchSpec, member: SliceMember) -> None:
    """A process other than the leader: join it, then do what it asks until it says the search
    is over. A lost leader is :class:`SliceLost` (exit :data:`~remat_search.errors.SLICE_RESTART_EXIT`)."""
    runner = runner_for(spec, member)
    channel = Channel(connect(member, spec.slice), peer="the leader (process 0)", config=spec.slice, on_lost=runner.kill)
    channel.send(Hello(member.process_id, socket.gethostname(), comparable(spec)))
    welcome = channel.recv()
    if welcome.refused is not None:
        raise SpecError(welcome.refused)
    with runner:
        while True:
            request = channel.recv()
            if isinstance(request, End):
                channel.close()
                return
            answer = _answer(runner, request)
            if channel.ended:  # the leader stopped (Ctrl-C) while this process measured
                channel.close()
                return
            channel.send(answer)


def _answer(runner: Runner, request: Any) -> Any:
    """What this process answers the leader's ``request``."""
    if isinstance(request, Describe):
        try:
            return protocol.Ready(runner.describe().model_dump_json())
        except SpecError as e:
            return protocol.StartFailed("spec", str(e))
        except RunError as e:
            return protocol.StartFailed("run", str(e))
        except SliceLost as e:
            return protocol.StartFailed("slice", str(e))
        except RematSearchError as e:
            return protocol.StartFailed("other", str(e))
    if isinstance(request, Restart):
        runner.close()
        return Restarted()
    if isinstance(request, protocol.Measure):
        plan = RematPlan.model_validate_json(request.plan)
        try:
            m = runner.measure(plan, budget=request.budget, timing=request.timing,
                               gradient_tolerance=request.gradient_tolerance)
        except SliceLost:  # its worker could not join the others: the slice is lost, not the plan
            raise
        except RematSearchError as e:  # its worker could not start again
            return protocol.Failed(str(e))
        return protocol.Done(m.model_dump_json())
    if isinstance(request, protocol.Retime):
        try:
            times = runner.retime([RematPlan.model_validate_json(p) for p in request.plans], warmup=request.warmup,
                                  rounds=request.rounds, budget=request.budget)
        except SliceLost:
            raise
        except RematSearchError as e:
            return protocol.Failed(str(e))
        return protocol.Done(json.dumps(times))
    raise SliceLost(f"slice: the leader sent {type(request).__name__}, which this process does not know")
