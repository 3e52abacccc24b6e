"""Long-running service processes for the tests (the HTTP API, workers, optuna-dashboard) and a
small HTTP client for them: real processes, real HTTP on loopback, no mocks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import REPO

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP request: (status, body), for an error status too."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _DIRECT.open(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def get_json(url: str) -> Any:
    """GET ``url``, expecting 200 and JSON."""
    status, body = http("GET", url)
    assert status == 200, (url, status, body[:500])
    return json.loads(body)


def executable(name: str) -> str:
    """A console script of this Python's environment (beside ``sys.executable``), else on PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed (pip install -e '.[test]')"
    return found


class Service:
    """A process started by :func:`started`, its output (stdout and stderr together) in a file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log = name, argv, log
        with log.open("w") as out:
            self.process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        return self.log.read_text()

    def alive(self) -> None:
        """Fail the test, with the output, if the process has exited."""
        code = self.process.poll()
        assert code is None, f"{self.name} exited with {code}:\n{self.output()[-4000:]}"

    def wait_for_http(self, url: str, timeout: float = 180) -> None:
        """Until ``url`` answers 200 (the service is up), failing if the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            self.alive()
            with contextlib.suppress(OSError):
                if http("GET", url)[0] == 200:
                    return
            assert time.monotonic() < deadline, f"{self.name} did not answer {url} in {timeout} s:\n{self.output()[-4000:]}"
            time.sleep(0.5)

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, then its exit code (killed past ``timeout``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a service: the repository on PYTHONPATH, output
    unbuffered, none of remat-search's own settings (storage, token) but those in ``extra``."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("REMAT_SEARCH_STORAGE", "REMAT_SEARCH_TOKEN")}
    return {**inherited, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(extra or {})}


@contextlib.contextmanager
def started(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Service]:
    """Start ``argv`` as a process (in :func:`environment` with ``env``) and kill it at the
    end if it is still running."""
    service = Service(name, argv, log, environment(env))
    try:
        yield service
    finally:
        if service.process.poll() is None:
            service.process.kill()
            service.process.wait()
