"""Free loopback ports for the servers and slices the tests start.

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, the same range it draws
every outgoing connection's local port from: between the test picking it and its server binding
it, a client socket of another test (gloo, gRPC, PostgreSQL, HTTP) can take it ("Address already
in use", seen on CI). So ports are drawn below that range, each pytest-xdist worker from a
range of its own, and checked free (with every port after it that the caller needs).
"""

from __future__ import annotations

import os
import random
import socket

LOWEST, SPAN = 20000, 1500
"""Worker ``gwN`` draws from ``LOWEST + N·SPAN`` up, below Linux's default ephemeral range
(32768–60999) for up to 8 workers."""


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(consecutive: int = 1) -> int:
    """A free port ``p`` with ``p + 1 … p + consecutive − 1`` free too (a slice's JAX job takes
    ``p``, its searches the next)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = LOWEST + (int(worker) if worker.isdigit() else 0) * SPAN
    high = min(low + SPAN, _ephemeral_start()) - consecutive
    if high <= low:  # an unusual ephemeral range: the kernel's own choice, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    while True:
        port = random.randrange(low, high)
        if all(_bindable(port + k) for k in range(consecutive)):
            return port
