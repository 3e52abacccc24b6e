"""Shared helpers: tiny real workloads, spec files, the CLI run in-process or as a process, and
a real PostgreSQL server (:func:`postgres_url`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# LLVM at -O0 for every compile of the suite, in this process and in the workers it spawns:
# XLA:CPU compiles the tiny models about twice as fast, the memory figures (buffer
# assignment, before LLVM) are byte-for-byte the same, and no test judges compute speed.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# The TPU-target tests load libtpu in this process too: not exclusively (as the workers do), so
# that a search or another test run on this host at the same time does not lock them out.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import optuna  # after XLA_FLAGS, which XLA reads when it starts
import pytest
import yaml
from typer.testing import CliRunner

from remat_search.cli import output
from remat_search.cli.app import app
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]
TINY_TRANSFORMER: dict[str, Any] = {
    "kind": "transformer", "layers": 2, "d_model": 32, "heads": 2, "d_ff": 128,
    "seq_len": 32, "batch": 4, "vocab": 64,
}
CHOICES: list[Any] = ["none", "full", "dots", {"label": "save_attn", "names": ["context", "out_proj"]}]
FAST_TIMING = {"warmup": 1, "repeats": 2, "timeout": "120s"}
CHECK_WORKLOAD = {"kind": "transformer", "layers": 4, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32,
                  "batch": 8, "vocab": 256}
CHECK_SEARCH: dict[str, Any] = {
    "workload": CHECK_WORKLOAD, "space": {"layout": "per_layer", "choices": ["none", "full", "dots"]}, "trials": 10,
    "sampler": {"kind": "tpe", "seed": 0}, "timing": {"warmup": 1, "repeats": 1, "timeout": "300s"}, "confirm": {"top": 0},
}
"""Issue 46's search of the first-step check (the study name and storage aside): on main c87a32a
it failed correct plans on four devices and in bfloat16 (tests/measure/test_check.py)."""
CHECK_SHORT: dict[str, Any] = {**CHECK_SEARCH, "trials": 5, "timing": {**CHECK_SEARCH["timing"], "anchor": False}}
"""The suite's form of it: the first 5 of its 10 trials (``benchmarks/check_noise.py`` runs all 10;
on main c87a32a 5 trials of the four-device float32 search pass with chance 0.4⁵ ≈ 1 %, of a
bfloat16 one 0.1⁵), no anchor steps (the check is what is tested, not the time)."""

optuna.logging.set_verbosity(optuna.logging.WARNING)

SHARED_JAX_CACHE = "REMAT_SEARCH_TESTS_JAX_CACHE"
"""The variable naming the JAX persistent compilation cache that :func:`spec_dict`'s searches
share across the run (every pytest worker, every process they start): what a user's searches
get by default (``compilation_cache: jax-cache`` under the storage home), one folder for the
suite instead of one per test's home, so that the tiny models' plans, compiled by dozens of
tests, are compiled once (a 5-trial tiny study: 19.7 → 11.5 CPU-s, peaks the same to the
byte). Made by :func:`pytest_configure`; a test of the cache itself sets its own folder."""


def pytest_configure(config: pytest.Config) -> None:
    """Make the run's :data:`SHARED_JAX_CACHE` folder once, in the controller, before the
    xdist workers start (they inherit the variable); unless the caller named one."""
    if not hasattr(config, "workerinput") and SHARED_JAX_CACHE not in os.environ:
        folder = tempfile.mkdtemp(prefix="remat-search-tests-jax-cache-")
        os.environ[SHARED_JAX_CACHE] = folder
        config.stash[_MADE_CACHE] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    if (folder := config.stash.get(_MADE_CACHE, None)) is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(SHARED_JAX_CACHE, None)


_MADE_CACHE = pytest.StashKey[str]()


def _signal_state() -> tuple[object, frozenset[signal.Signals]]:
    """How this thread takes Ctrl-C: SIGINT's handler, and the signals it blocks."""
    return signal.getsignal(signal.SIGINT), frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, []))


_SIGNALS_AT_START = _signal_state()


@pytest.fixture(autouse=True)
def _signals_as_found() -> Iterator[None]:
    """Every test, and every fixture, leaves SIGINT as the session found it, handled and not
    blocked: a process the test process starts inherits an ignored or blocked SIGINT, and
    Ctrl-C would not reach it (a later test of the same pytest worker, whichever that is,
    would hang on it). Checked before each test (a fixture set up for it) and after it."""
    assert _signal_state() == _SIGNALS_AT_START, f"SIGINT changed before this test: {_signal_state()}"
    yield
    assert _signal_state() == _SIGNALS_AT_START, f"this test changed SIGINT: {_signal_state()}"


def spec_dict(storage: str, **overrides: Any) -> dict[str, Any]:
    """A small valid spec on the tiny transformer; ``overrides`` replace top-level fields."""
    spec = {
        "study": "tiny",
        "storage": storage,
        "workload": dict(TINY_TRANSFORMER),
        "space": {"layout": "per_layer", "choices": CHOICES},
        "budget": "1GiB",
        "trials": 6,
        "sampler": {"kind": "tpe", "seed": 0},
        "timing": FAST_TIMING,
        "confirm": {"top": 2, "rounds": 2, "presets": False},  # tests/test_cache.py confirms presets
        "compilation_cache": os.environ.get(SHARED_JAX_CACHE),
    }
    spec.update(overrides)
    return spec


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own storage home (``$REMAT_SEARCH_HOME``, which the workers it spawns inherit):
    what a search keeps there (a study's artifacts, say) never lands in the checkout, nor passes
    from one test to another."""
    home = tmp_path / "home"
    monkeypatch.setenv("REMAT_SEARCH_HOME", str(home))
    return home


@pytest.fixture
def storage_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'studies.db'}"


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run ``remat-search ARGS`` in this process; returns click's Result (exit_code, stdout, stderr).
    Its tables come out as a wide terminal prints them, every column; a narrow terminal's are
    tested in a process with COLUMNS set (tests/test_cli_run.py)."""
    monkeypatch.setattr(output.console, "width", 200)
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(app, list(args), catch_exceptions=False)

    return invoke


AS_FROM_A_TERMINAL = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('remat_search.cli.app', run_name='__main__', alter_sys=True)"
)
"""``python -m remat_search.cli.app``, Ctrl-C handled as a terminal starts it: a test process
started in the background of a script (``.ci/run &``) has SIGINT ignored, as POSIX shells ignore
it for background jobs, and every process it starts would inherit that (the suite once failed so)."""


def run_process(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``remat-search ARGS`` as a separate process (for kill -9, Ctrl-C and resume tests);
    ``env``: variables to set in its environment beside this one's (None: to unset)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}
    env = {key: value for key, value in env.items() if value is not None}
    return subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, *args], cwd=REPO, env=env, text=True,
        **{"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, **kwargs},
    )


def _postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server programs (``initdb``, ``pg_ctl``): on PATH, else
    Debian's /usr/lib/postgresql/VERSION/bin (the newest), else None."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent  # a link to the real folder, with pg_ctl beside it
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


class PostgresUnavailable(Exception):
    """No PostgreSQL server can be started here (the reason)."""


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[str]:
    """A throwaway PostgreSQL server: ``initdb`` in a temporary folder, on 127.0.0.1 at a free
    port (its socket in that folder), trust authentication for the superuser ``postgres``;
    stopped and deleted at the end. Yields its URL without a database
    (``postgresql+psycopg://postgres@127.0.0.1:PORT``). As root, the server runs as the
    ``postgres`` user (it refuses root). Raises :class:`PostgresUnavailable` where none can be
    started (no binaries, no psycopg, a failed start)."""
    if importlib.util.find_spec("psycopg") is None:
        raise PostgresUnavailable("the psycopg driver is not installed (pip install -e '.[postgres]')")
    bindir = _postgres_bin()
    if bindir is None:
        raise PostgresUnavailable("initdb not found on PATH or in /usr/lib/postgresql/*/bin (apt-get install postgresql)")
    as_user: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            raise PostgresUnavailable("running as root, and runuser is missing to start the server as the postgres user")
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise PostgresUnavailable("running as root, and there is no postgres user to run the server") from None
        as_user = ["runuser", "-u", "postgres", "--"]
    folder = Path(tempfile.mkdtemp(prefix="remat-search-pg-"))
    data, sockets, log = folder / "data", folder / "sockets", folder / "server.log"
    sockets.mkdir()
    if as_user:
        for path in (folder, sockets):
            shutil.chown(path, "postgres", "postgres")
    port = free_port()

    def run(*command: str) -> None:
        done = subprocess.run([*as_user, *command], capture_output=True, text=True, timeout=120, check=False)
        if done.returncode:
            said = (done.stderr or done.stdout).strip().splitlines() or [f"exit code {done.returncode}"]
            log_tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
            raise RuntimeError(f"{Path(command[0]).name}: {' / '.join([said[-1], *log_tail])}")

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        options = f"-h 127.0.0.1 -p {port} -k {sockets} -c fsync=off -c max_connections=200"
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise PostgresUnavailable(f"the server did not start ({e})") from None
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
    finally:
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)


def create_database(server: str, name: str) -> str:
    """A new, empty database ``name`` on the server at ``server`` (dropped first if it exists): its URL."""
    import psycopg

    port = server.rpartition(":")[2]
    with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", autocommit=True) as db:
        db.execute(f'DROP DATABASE IF EXISTS "{name}"')
        db.execute(f'CREATE DATABASE "{name}"')
    return f"{server}/{name}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The session's throwaway PostgreSQL server (:func:`throwaway_postgres`): its URL without a
    database (see :func:`postgres_url`). Where none can be started the test is skipped with the
    reason, except under CI (``$CI`` set, as ``.ci/run`` does), where it fails: CI must run it."""
    try:
        server = throwaway_postgres()
        url = server.__enter__()
    except PostgresUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL tests cannot run under CI: {e}", pytrace=False)
        pytest.skip(f"no PostgreSQL server: {e}")
    try:
        yield url
    finally:
        server.__exit__(None, None, None)


@pytest.fixture
def postgres_url(postgres_server: str, request: pytest.FixtureRequest) -> str:
    """A new, empty database on the session's PostgreSQL server, for one test: its URL."""
    return create_database(postgres_server, "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:50])


SLOW_FIXTURES = frozenset({"postgres_server", "postgres_url"})
"""A test that needs one of these (a PostgreSQL server) is marked ``slow``, wherever it is, and
so is a test parametrised with ``"postgresql"`` (a fixture that asks for the server by name)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the PostgreSQL tests ``slow`` (the other slow files mark themselves)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or "postgresql" in params.values():
            item.add_marker(pytest.mark.slow)
