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
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pydantic import TypeAdapter, ValidationError

from remat_search.errors import RematSearchError, RunError, SliceLost, SpecError, WorkloadError
from remat_search.measure import protocol
from remat_search.measure.device import DeviceInfo
from remat_search.measure.measurement import Measurement
from remat_search.measure.runner import Runner
from remat_search.measure.slice import SliceMember, merged
from remat_search.plans.plan import RematPlan
from remat_search.search.runners import runner_for
from remat_search.spec.models import SearchSpec, SliceConfig, TimingConfig

BEATS_PER_TIMEOUT = 4
"""Heartbeats each way per ``slice.heartbeat_timeout``."""
CONNECT_RETRY_SECONDS = 0.2
NOT_COMPARED = {"storage", "workers"}
"""Spec fields the hosts may set apart: only the leader uses the storage, and a slice runs one worker a host."""


@dataclass(frozen=True)
class Hello:
    """Process → leader, first: who it is and the spec it runs (as JSON, less :data:`NOT_COMPARED`)."""

    process_id: int
    host: str
    spec: dict[str, Any]


@dataclass(frozen=True)
class Welcome:
    """Leader → process: its spec is the leader's; ``refused``: why not (one line), and it exits 2."""

    refused: str | None = None


@dataclass(frozen=True)
class Describe:
    """Leader → process: start the worker (joining the slice's JAX job); answered Ready or StartFailed."""


@dataclass(frozen=True)
class Restart:
    """Leader → process: stop the worker (a candidate failed); the next request starts a fresh one."""


@dataclass(frozen=True)
class Restarted:
    """Process → leader: its worker is stopped."""


@dataclass(frozen=True)
class End:
    """Leader → process: the search is over; exit 0."""


@dataclass(frozen=True)
class _Beat:
    """Either way, every ``heartbeat_timeout / BEATS_PER_TIMEOUT`` seconds: still here."""


_LOST = object()
MESSAGES: dict[str, type] = {kind.__name__: kind for kind in (
    Hello, Welcome, Describe, Restart, Restarted, End, _Beat, protocol.Ready, protocol.StartFailed,
    protocol.Measure, protocol.Retime, protocol.Done, protocol.Failed,
)}
"""What the channel carries, by name: as JSON, never pickles (anyone who reaches the port could
make a pickle run code here)."""
_ADAPTERS = {name: TypeAdapter(kind) for name, kind in MESSAGES.items()}
"""Each message kind's JSON form, built once (a heartbeat goes every few seconds each way)."""


def encode(message: Any) -> bytes:
    """``message`` (one of :data:`MESSAGES`) as JSON."""
    kind = type(message).__name__
    return json.dumps({"kind": kind, "fields": _ADAPTERS[kind].dump_python(message, mode="json")}).encode()


def decode(data: bytes) -> Any:
    """A message from its JSON; ``ValueError`` for anything that is not one."""
    try:
        said = json.loads(data)
        return _ADAPTERS[said["kind"]].validate_python(said["fields"])
    except (KeyError, TypeError, ValueError, ValidationError) as e:
        raise ValueError(f"not a message of remat-search ({type(e).__name__})") from None


class Channel:
    """One process's connection to another over TCP: messages in order, a heartbeat each way
    from a thread, and a reader thread that notices a peer gone (the connection closed) or
    silent past ``heartbeat_timeout``. Then ``on_lost`` is called (from that thread: it kills
    the worker, so that a measurement waiting on the lost peer ends) and :meth:`recv` raises
    :class:`SliceLost`. An :class:`End` read is the channel's last message, and ends a
    measurement in progress the same way (:attr:`ended`)."""

    def __init__(self, sock: socket.socket, *, peer: str, config: SliceConfig,
                 on_lost: Callable[[], None] = lambda: None) -> None:
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer, self._silence, self._on_lost = peer, config.heartbeat_timeout, on_lost
        self._conn = Connection(sock.detach())
        self._lock = threading.Lock()
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._closed = threading.Event()
        self.lost: str | None = None
        self.ended = False
        threading.Thread(target=self._beat, args=(config.heartbeat_timeout / BEATS_PER_TIMEOUT,), daemon=True,
                         name=f"remat-search-beat-{peer}").start()
        threading.Thread(target=self._read, daemon=True, name=f"remat-search-read-{peer}").start()

    def send(self, message: Any) -> None:
        """Send ``message``; :class:`SliceLost` where the peer is gone."""
        try:
            with self._lock:
                self._conn.send_bytes(encode(message))
        except OSError as e:
            self._lose(f"gone ({e.strerror or e})")
            raise SliceLost(f"slice: {self.peer} is {self.lost}") from None

    def recv(self) -> Any:
        """The next message; :class:`SliceLost` where the peer was lost first."""
        message = self._inbox.get()
        if message is _LOST:
            self._inbox.put(_LOST)  # every later recv says so too
            raise SliceLost(f"slice: {self.peer} is {self.lost}")
        return message

    def close(self) -> None:
        self._closed.set()
        try:
            self._conn.close()
        except OSError:
            pass

    def _beat(self, every: float) -> None:
        while not self._closed.wait(every):
            try:
                with self._lock:
                    self._conn.send_bytes(encode(_Beat()))
            except OSError:
                return  # the reader tells

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                if not self._conn.poll(self._silence):
                    self._lose(f"silent for {self._silence:g} s (slice.heartbeat_timeout)")
                    return
                message = decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                if not self._closed.is_set():
                    self._lose("gone (its connection closed: the process died or stopped)")
                return
            except ValueError as e:
                self._lose(f"speaking another language: {e}")
                return
            if isinstance(message, _Beat):
                continue
            self._inbox.put(message)
            if isinstance(message, End):  # the leader is done: a measurement in progress is moot
                self.ended = True
                self._on_lost()
                return

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            self._inbox.put(_LOST)
            self._on_lost()


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
    channel = Channel(_connect(member, spec.slice), peer="the leader (process 0)", config=spec.slice, on_lost=runner.kill)
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


def _connect(member: SliceMember, config: SliceConfig) -> socket.socket:
    """A connection to the leader, tried until ``slice.join_timeout`` (it may start later)."""
    deadline = time.monotonic() + config.join_timeout
    while True:
        try:
            return socket.create_connection(member.channel, timeout=5)
        except OSError as e:
            if time.monotonic() > deadline:
                raise SliceLost(
                    f"slice: cannot reach the leader at {member.channel[0]}:{member.channel[1]} within "
                    f"{config.join_timeout:g} s (slice.join_timeout): {e.strerror or e}"
                ) from None
            time.sleep(CONNECT_RETRY_SECONDS)
