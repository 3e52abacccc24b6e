"""The HTTP service as a user runs it: ``remat-search serve`` in a process of its own, on a free
loopback port, asked over real HTTP (tests/test_server.py, tests/test_page.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.conftest import REPO
from tests.ports import free_port


@dataclass(frozen=True)
class Answer:
    """An HTTP response: status, headers (lower-case names) and body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def serve_command(*args: str) -> list[str]:
    """``remat-search serve ARGS`` as a command line of this checkout."""
    return [sys.executable, "-m", "remat_search.cli.app", "serve", *args]


def env(**extra: str) -> dict[str, str]:
    """This environment, with this checkout importable and ``extra``; no token unless given."""
    base = {k: v for k, v in os.environ.items() if k != "REMAT_SEARCH_TOKEN"}
    return {**base, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **extra}


@contextlib.contextmanager
def serving(storage: str, *, token: str | None = None, host: str = "127.0.0.1") -> Iterator[str]:
    """``remat-search serve --storage STORAGE`` running (its token from $REMAT_SEARCH_TOKEN, as a
    deployment sets it): yields its base URL once /health answers; stopped at the end."""
    port = free_port()
    extra = {"REMAT_SEARCH_TOKEN": token} if token is not None else {}
    process = subprocess.Popen(
        serve_command("--storage", storage, "--host", host, "--port", str(port)), cwd=REPO, env=env(**extra),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise AssertionError(f"serve exited with {process.returncode}: {process.stdout.read()}")  # type: ignore[union-attr]
            with contextlib.suppress(OSError):
                if request(base + "/health").status == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError("serve did not answer /health within 120 s")
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()  # type: ignore[union-attr]


def request(url: str, *, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None) -> Answer:
    """One HTTP request; an error status is an answer too, not an exception."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return Answer(response.status, {k.lower(): v for k, v in response.headers.items()}, response.read())
    except urllib.error.HTTPError as e:
        with e:
            return Answer(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())
