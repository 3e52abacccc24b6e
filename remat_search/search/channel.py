"""The channel of a slice: the messages its processes send each other over TCP, as JSON, and a
connection that carries them in order with a heartbeat each way (``search.slice`` runs the
search over it)."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pydantic import TypeAdapter, ValidationError

from remat_search.errors import SliceLost
from remat_search.measure import protocol
from remat_search.measure.slice import SliceMember
from remat_search.spec.models import SliceConfig

BEATS_PER_TIMEOUT = 4
"""Heartbeats each way per ``slice.heartbeat_timeout``."""
CONNECT_RETRY_SECONDS = 0.2


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


def connect(member: SliceMember, config: SliceConfig) -> socket.socket:
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
