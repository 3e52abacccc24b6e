"""docker/: what can be checked without a container engine.

The Dockerfile is read by Docker's own parser (the ``dockerfile`` package wraps BuildKit's Go
parser) and compose.yaml is checked against the Compose Specification's JSON schema
(``tests/compose-spec.json``, schema/compose-spec.json of github.com/compose-spec/compose-spec at
170098ba07d9f53c383a41bfd4c5166b0a4529a6, Apache-2.0). Every extra, path, subcommand and option
they name exists. What the images are built from is pinned: base images by digest, and every
package each image installs by docker/constraints.txt. Then the services' own command lines,
as compose.yaml writes them, run as local processes against a PostgreSQL server on loopback: a
spec goes in over HTTP, two workers finish the study, and the API answers ``best`` with a plan
whose peak is what ``show`` says; each service's health check runs here against it.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import dockerfile
import jsonschema
import optuna
import pytest
import typer
import yaml
from setuptools import find_packages as setuptools_find
from sqlalchemy.engine import make_url

from remat_search.plans.plan import RematPlan
from remat_search.report.results import TrialResult
from remat_search.store.liveness import counts
from remat_search.units import format_bytes

from tests.conftest import REPO, create_database, spec_dict
from tests.ports import free_port
from .services import Service, environment, executable, get_json, http, started

pytestmark = pytest.mark.slow  # runs docker/'s commands as processes and resolves PyPI

DOCKER = REPO / "docker"
SERVICES = {"postgres", "worker", "worker-cuda", "worker-tpu", "api", "dashboard"}
TARGETS = {"worker-cuda": "cuda", "worker-tpu": "tpu"}  # the image of every other service: cpu
TARGET_KEYS = {"image", "build", "profiles", "deploy", "privileged", "network_mode", "command", "healthcheck"}
TOKEN = "a-test-token-for-the-api"


def instructions() -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(DOCKER / "Dockerfile"))


def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def only(cmd: str) -> dockerfile.Command:
    """The Dockerfile's one instruction ``cmd`` (there must be exactly one)."""
    found = [i for i in instructions() if i.cmd == cmd.upper()]
    assert len(found) == 1, found
    return found[0]


def build_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults, before and after FROM alike."""
    return dict(v.split("=", 1) for i in instructions() if i.cmd == "ARG" for v in i.value)


_VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """compose's interpolation of every string in ``value``: ``${X}``, ``${X:-default}`` (set
    and not empty, else the default) and ``${X:?message}`` (an error where unset or empty)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, kind, word = match.groups()
        if env.get(name):
            return env[name]
        if kind == "?":
            raise KeyError(f"{name}: {word}")
        return word if kind == "-" else ""

    return _VARIABLE.sub(substitute, value)


# --- the files parse, and say what they should ---


def test_compose_is_valid_by_the_compose_specification() -> None:
    schema = json.loads((REPO / "tests" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []
    misspelt = compose()
    misspelt["services"]["worker"]["comand"] = misspelt["services"]["worker"].pop("command")
    assert not validator.is_valid(misspelt)  # the schema does catch a wrong key


def test_compose_runs_postgres_workers_the_api_and_the_dashboard() -> None:
    services = compose()["services"]
    assert set(services) == SERVICES
    assert services["postgres"]["image"].startswith("postgres:")
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["worker"]["deploy"]["replicas"] == 2
    for name in SERVICES - {"postgres"}:
        first = "api" if name == "dashboard" else "postgres"  # the api makes optuna's tables for it
        assert services[name]["depends_on"] == {first: {"condition": "service_healthy"}}
        target = TARGETS.get(name, "cpu")
        assert services[name]["build"]["args"] == {"TARGET": target}
        assert services[name]["image"] == f"remat-search:{target}"
        assert services[name].get("profiles", []) == ([target] if target != "cpu" else [])  # cpu: always
        assert services[name]["healthcheck"]["test"][0] == "CMD"  # run in the image, no shell
    assert services["dashboard"]["ports"] == ["127.0.0.1:8080:8080"]  # no login: this host only
    assert services["postgres"]["ports"] == ["127.0.0.1:${POSTGRES_PORT:-5432}:5432"]  # this host only


def test_the_api_is_published_on_loopback_unless_an_address_is_set() -> None:
    api = compose()["services"]["api"]
    assert interpolate(api["ports"], {}) == ["127.0.0.1:8000:8000"]
    assert interpolate(api["ports"], {"REMAT_SEARCH_API_ADDRESS": "0.0.0.0"}) == ["0.0.0.0:8000:8000"]


def test_the_tpu_worker_runs_as_the_dockerfile_says_and_the_cuda_worker_with_the_gpus() -> None:
    """The Dockerfile says a TPU image runs ``--privileged --net=host``; the CUDA one sees the
    GPUs through the NVIDIA container toolkit (``--gpus all``)."""
    said = (DOCKER / "Dockerfile").read_text()
    assert "`--privileged --net=host`" in said and "`docker run --gpus all`" in said
    services = compose()["services"]
    tpu, cuda = services["worker-tpu"], services["worker-cuda"]
    assert tpu["privileged"] is True and tpu["network_mode"] == "host"
    assert "privileged" not in cuda and "network_mode" not in cuda
    assert cuda["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    ]
    assert tpu["deploy"]["replicas"] == cuda["deploy"]["replicas"] == 1  # one process holds the chips
    def but_the_url(check: dict[str, Any]) -> dict[str, Any]:
        return {**check, "test": [a for a in check["test"] if not a.startswith("postgresql")]}

    for worker in ("worker-cuda", "worker-tpu"):  # the cpu worker's lines, but for the storage URL
        assert [a for a in services[worker]["command"] if "://" not in a] == ["worker", "--storage"]
        assert but_the_url(services[worker]["healthcheck"]) == but_the_url(services["worker"]["healthcheck"])
        assert {k: v for k, v in services[worker].items() if k not in TARGET_KEYS} == {
            k: v for k, v in services["worker"].items() if k not in TARGET_KEYS
        }


def _storage_urls(services: dict[str, Any]) -> dict[str, set[str]]:
    """Each service's PostgreSQL URLs: in its command and in its health check."""
    return {
        name: {a for a in [*service.get("command", []), *service.get("healthcheck", {}).get("test", [])] if a.startswith("postgresql")}
        for name, service in services.items() if name != "postgres"
    }


def test_every_service_names_the_same_postgresql_database_as_the_postgres_service() -> None:
    services = interpolate(compose()["services"], {"REMAT_SEARCH_TOKEN": TOKEN})
    postgres = services["postgres"]["environment"]
    (published,) = services["postgres"]["ports"]
    for name, urls in _storage_urls(services).items():
        assert len(urls) == 1, (name, urls)  # its health check asks the storage its command uses
        url = make_url(urls.pop())
        assert url.drivername == "postgresql+psycopg"
        if services[name].get("network_mode") == "host":  # the host's loopback, where postgres is published
            assert f"{url.host}:{url.port}:5432" == published == "127.0.0.1:5432:5432"
        else:
            assert (url.host, url.port) == ("postgres", 5432)  # the service's name on compose's network
        assert url.username == postgres.get("POSTGRES_USER", "postgres")
        assert url.password == postgres["POSTGRES_PASSWORD"]
        assert url.database == postgres["POSTGRES_DB"]
    moved = interpolate(compose()["services"], {"REMAT_SEARCH_TOKEN": TOKEN, "POSTGRES_PORT": "6543"})
    assert make_url(moved["worker-tpu"]["command"][-1]).port == 6543
    assert moved["postgres"]["ports"] == ["127.0.0.1:6543:5432"]


def test_compose_refuses_to_start_without_a_token_for_the_api() -> None:
    with pytest.raises(KeyError, match="REMAT_SEARCH_TOKEN"):
        interpolate(compose()["services"]["api"], {})
    assert interpolate(compose()["services"]["api"], {"REMAT_SEARCH_TOKEN": TOKEN})["environment"] == {
        "REMAT_SEARCH_TOKEN": TOKEN
    }


def test_dockerfile_builds_from_slim_python_with_the_cli_as_entrypoint() -> None:
    args = build_args()
    assert only("FROM").value == ("${BASE}",)
    assert args["BASE"].split("@")[0] == f"python:{sys.version_info.major}.{sys.version_info.minor}-slim-bookworm"
    assert args["TARGET"] == "cpu"
    entrypoint = only("ENTRYPOINT")
    assert entrypoint.json and entrypoint.value == ("remat-search",)
    assert only("USER").value == ("1000:1000",)  # not root
    assert "useradd --create-home --uid 1000 --gid 1000 remat" in " ".join(i.value[0] for i in instructions() if i.cmd == "RUN")


def test_the_storage_home_is_the_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    """The image installs the package (not editable), so its storage home comes from
    ``$REMAT_SEARCH_HOME``, which must be the volume."""
    from remat_search.store.location import HOME_ENV, storage_home

    env = dict(zip(only("ENV").value[::2], only("ENV").value[1::2], strict=True))
    assert only("VOLUME").value == (env[HOME_ENV],) == ("/app/storage",)
    monkeypatch.setenv(HOME_ENV, env[HOME_ENV])
    assert storage_home() == Path("/app/storage")
    mounts = {v for s in compose()["services"].values() for v in s.get("volumes", []) if v.startswith("storage:")}
    assert mounts == {f"storage:{env[HOME_ENV]}"}


def test_every_extra_the_dockerfile_installs_exists_in_pyproject() -> None:
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    run = " ".join(i.value[0] for i in instructions() if i.cmd == "RUN")
    targets = set(re.search(r'case "\$\{TARGET\}" in ([\w|]+)\)', run).group(1).split("|"))  # type: ignore[union-attr]
    assert targets == {"cpu", "cuda", "tpu"}
    assert build_args()["TARGET"] in targets
    named = re.findall(r'pip install -c docker/constraints\.txt "\.\[([^\]]+)\]"', run)
    assert len(named) == 1, run
    for target in targets:
        wanted = set(named[0].replace("${TARGET}", target).split(","))
        assert wanted == {target, "postgres", "service", "dashboard"}
        assert wanted <= extras, wanted - extras


# --- what the images are built from is pinned ---

_DIGEST = re.compile(r"^[\w.-]+:[\w.-]+@sha256:[0-9a-f]{64}$")
CONSTRAINTS = DOCKER / "constraints.txt"


def test_the_base_image_and_the_postgres_image_are_pinned_by_digest() -> None:
    assert _DIGEST.match(build_args()["BASE"]), build_args()["BASE"]
    images = {name: s["image"] for name, s in compose()["services"].items() if "build" not in s}
    assert images and all(_DIGEST.match(image) for image in images.values()), images
    assert not _DIGEST.match("python:3.11-slim") and not _DIGEST.match("python:3.11-slim@sha256:abc")


def test_the_postgres_image_is_the_postgresql_major_version_the_tests_run(postgres_server: str) -> None:
    """compose's PostgreSQL (by digest, its tag saying its version) is the major version of the
    server the tests run against: a major version has a data format and behaviour of its own."""
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 port={make_url(postgres_server).port} user=postgres dbname=postgres") as db:
        (running,) = db.execute("SHOW server_version").fetchone()  # type: ignore[misc]
    tag = compose()["services"]["postgres"]["image"].split("@")[0].removeprefix("postgres:")
    assert re.fullmatch(r"\d+\.\d+-\w+", tag), tag  # a release, not a moving major tag
    assert tag.split(".")[0] == running.split(".")[0], (tag, running)


def test_the_image_installs_its_packages_with_the_constraints_file() -> None:
    """One ``pip install`` in the Dockerfile, with ``-c docker/constraints.txt``, which is copied
    to that path below the working directory before it runs."""
    run = [i.value[0] for i in instructions() if i.cmd == "RUN"]
    installs = [i.strip() for i in re.findall(r"pip install ([^&]+)", " ".join(run))]
    assert installs == ['-c docker/constraints.txt ".[${TARGET},postgres,service,dashboard]"'], installs
    copied = [i for i in instructions() if i.cmd == "COPY" and "docker/constraints.txt" in i.value]
    assert [c.value for c in copied] == [("docker/constraints.txt", "./docker/constraints.txt")]
    assert only("WORKDIR").value == ("/app",)
    order = [i.cmd for i in instructions()]
    assert order.index("COPY") < order.index("RUN")


def _constraints_script() -> Any:
    """docker/constraints.py, the script that writes and checks the file, as a module."""
    spec = importlib.util.spec_from_file_location("docker_constraints", DOCKER / "constraints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def resolved() -> dict[str, str]:
    """What pip installs for the three images under docker/constraints.txt, resolved here against
    the registry (``constraints.py``'s :func:`resolve`). Without a registry the tests are skipped
    saying so, except under CI, where they fail."""
    import urllib.request

    try:
        urllib.request.urlopen("https://pypi.org/simple/jax/", timeout=30).close()
    except OSError as e:
        if os.environ.get("CI"):
            pytest.fail(f"the registry cannot be reached under CI: {e}", pytrace=False)
        pytest.skip(f"PyPI is not reachable: {e}")
    return _constraints_script().resolve(CONSTRAINTS)


def test_the_constraints_file_is_one_exact_pin_a_package(tmp_path: Path) -> None:
    script = _constraints_script()
    pins = script.pins(CONSTRAINTS)
    assert "jax" in pins and "libtpu" in pins and "jax-cuda12-plugin" in pins
    assert pins["jax-cuda12-plugin"] == pins["jaxlib"]  # CUDA's plugin of the jaxlib the other images run
    extras = ",".join(script.EXTRAS)
    assert f'".[${{TARGET}},{extras}]"' in (DOCKER / "Dockerfile").read_text()  # the script resolves the Dockerfile's line
    assert script.TARGETS == ("cpu", "tpu", "cuda")
    bad = tmp_path / "constraints.txt"
    bad.write_text(CONSTRAINTS.read_text() + "PyYAML==6.0\n")
    with pytest.raises(ValueError, match="pinned twice"):
        script.pins(bad)
    bad.write_text("jax>=0.10\n")
    with pytest.raises(ValueError, match="expected name==version lines"):
        script.pins(bad)


def test_the_constraints_pin_every_package_the_images_install(resolved: dict[str, str]) -> None:
    """pip resolves the images' own install line under the constraints, on its own (nothing
    installed here enters it): every package it would install is pinned, so the images are the
    same whatever newer releases the registry has (those are ``constraints.py --behind``'s)."""
    assert "jax" in resolved and "libtpu" in resolved and any(name.startswith("nvidia-") for name in resolved)
    assert _constraints_script().unpinned(resolved, CONSTRAINTS) == {}


def test_a_package_of_an_image_the_constraints_do_not_pin_is_named(resolved: dict[str, str], tmp_path: Path) -> None:
    """The check fails where the file misses a package of the images' closure: alembic (optuna's
    dependency, in every image) left out of the file, the check names it at the version pip chose."""
    script = _constraints_script()
    lines = CONSTRAINTS.read_text().splitlines()
    missing = tmp_path / "constraints.txt"
    missing.write_text("\n".join(line for line in lines if not line.lower().startswith("alembic==")) + "\n")
    assert script.unpinned(resolved, missing) == {"alembic": resolved["alembic"]}


def test_every_path_the_dockerfile_copies_exists() -> None:
    build = compose()["services"]["worker"]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == REPO
    assert (context / build["dockerfile"]).is_file()
    copies = [i for i in instructions() if i.cmd == "COPY"]
    assert copies
    for copy in copies:
        assert not copy.flags, copy  # nothing from another stage or image
        for source in copy.value[:-1]:
            assert (context / source).exists(), source


def test_the_package_the_image_installs_is_its_modules() -> None:
    """The image installs the package (``pip install .``, not editable), and setuptools packs
    ``remat_search`` and its subpackages (``packages.find``) as their modules only: a data file
    beside them (a template, a stylesheet) would be missing in the image unless pyproject
    declares it as package data, and a folder without ``__init__.py`` would be left out."""
    tracked = subprocess.run(["git", "ls-files", "remat_search"], cwd=REPO, capture_output=True, text=True, check=True)
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = setuptools.get("package-data", {}).get("remat_search", [])
    found = setuptools_find(where=str(REPO), **setuptools["packages"]["find"])
    folders = {str(p.parent.relative_to(REPO)).replace("/", ".") for p in (REPO / "remat_search").rglob("*.py")}
    assert sorted(found) == sorted(folders)
    others = [f for f in tracked.stdout.split() if not f.endswith(".py")]
    assert [f for f in others if not any(fnmatch.fnmatch(f.removeprefix("remat_search/"), d) for d in declared)] == []


def _ignored(path: str) -> bool:
    """Whether docker/Dockerfile.dockerignore leaves ``path`` out of the build context (its
    patterns in order, the last that matches decides; ``!`` lets a path back in)."""
    lines = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    ignored = False
    for line in (raw.strip() for raw in lines):
        if line and not line.startswith("#"):
            pattern = line.removeprefix("!")
            if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removeprefix("**/")):
                ignored = not line.startswith("!")
    return ignored


def test_the_build_context_holds_what_the_dockerfile_copies_and_not_the_storage() -> None:
    sources = [source for i in instructions() if i.cmd == "COPY" for source in i.value[:-1]]
    assert [s for s in sources if _ignored(s.rstrip("/"))] == []
    assert _ignored("storage") and _ignored("benchmarks") and _ignored("remat_search/__pycache__")


def _remat_search_commands() -> dict[str, set[str]]:
    """Each subcommand of ``remat-search`` and its options, from typer's click command tree."""
    from remat_search.cli.app import app

    group = typer.main.get_command(app)
    return {
        name: {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
        for name, command in group.commands.items()  # type: ignore[attr-defined]
    }


def test_every_remat_search_command_and_option_in_compose_exists() -> None:
    commands = _remat_search_commands()
    ran, checked = set(), set()
    for name, service in compose()["services"].items():
        if name == "postgres":
            continue
        lines = [] if "entrypoint" in service else [service["command"]]
        health = service["healthcheck"]["test"][1:]
        if health[0] == "remat-search":
            lines.append(health[1:])
            checked.add(health[1])
        for command, *args in lines:
            assert command in commands, (name, command)
            for option in (a for a in args if a.startswith("-")):
                assert option in commands[command], (name, command, option)
            ran.add(command)
    assert ran == {"worker", "serve", "studies"}
    assert checked == {"studies"}  # the workers' health check


def test_every_dashboard_option_in_compose_exists() -> None:
    service = compose()["services"]["dashboard"]
    assert service["entrypoint"] == ["optuna-dashboard"]
    shown = subprocess.run([executable("optuna-dashboard"), "--help"], capture_output=True, text=True, check=True).stdout
    for option in (a for a in service["command"] if a.startswith("-")):
        assert re.search(rf"\s{re.escape(option)}\b", shown), option


# --- the services' own command lines, as local processes ---


def local(argv: list[str], storage: str, port: int | None = None) -> list[str]:
    """A compose command line as a process here runs it: the ``postgres`` host of its storage
    URL becomes the loopback server ``storage``, ``0.0.0.0`` becomes 127.0.0.1 (tests listen on
    loopback only) and its ``--port`` a free ``port``."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("postgresql"):
            url, server = make_url(arg), make_url(storage)
            assert url.host == "postgres", arg
            arg = url.set(host=server.host, port=server.port).render_as_string(hide_password=False)
        elif arg == "0.0.0.0":
            arg = "127.0.0.1"
        elif i and argv[i - 1] == "--port":
            assert port is not None, argv
            arg = str(port)
        out.append(arg)
    return out


def health_check(service: dict[str, Any], storage: str, ports: dict[int, int], home: dict[str, str]) -> int:
    """Run a service's compose health check (``["CMD", ...]``: no shell) as a process here, with
    the exit code compose judges: ``remat-search`` is this Python's CLI, ``python`` this Python,
    its storage URL the loopback server ``storage`` and each ``127.0.0.1:PORT`` of the container
    the port its process listens on here (``ports``)."""
    kind, program, *args = service["healthcheck"]["test"]
    assert kind == "CMD", service["healthcheck"]
    head = {"remat-search": [sys.executable, "-m", "remat_search.cli.app"], "python": [sys.executable]}[program]
    argv = local(args, storage)
    for inside, here in ports.items():
        argv = [a.replace(f"127.0.0.1:{inside}/", f"127.0.0.1:{here}/") for a in argv]
    done = subprocess.run([*head, *argv], capture_output=True, cwd=REPO, env=environment(home), timeout=300, check=False)
    return done.returncode


def _wait_until_finished(api: str, study: str, workers: list[Service], timeout: float = 480) -> dict[str, Any]:
    """GET /studies/{study} until every trial is finished, failing if a worker exits first."""
    deadline = time.monotonic() + timeout
    while True:
        for worker in workers:
            worker.alive()
        summary = get_json(f"{api}/studies/{study}")
        if summary["done"] >= summary["total"] and not summary.get("running"):
            return summary
        assert time.monotonic() < deadline, f"the workers did not finish {study!r} in {timeout} s: {summary}"
        time.sleep(1)


def _events(worker: Service, event: str) -> list[dict[str, Any]]:
    """The worker's log lines (one JSON object a line) of this ``event``."""
    lines = (json.loads(line) for line in worker.output().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


def _wait_until_idle(workers: list[Service], timeout: float = 180) -> None:
    """Until every worker has said it is idle: up, its storage reached, nothing to do."""
    deadline = time.monotonic() + timeout
    while not all(_events(w, "idle") for w in workers):
        for worker in workers:
            worker.alive()
        assert time.monotonic() < deadline, [w.output()[-2000:] for w in workers]
        time.sleep(0.5)


@pytest.fixture
def compose_storage(postgres_server: str) -> Iterator[str]:
    """The loopback PostgreSQL server, holding compose's database (its name from compose.yaml)."""
    services = interpolate(compose()["services"], {"REMAT_SEARCH_TOKEN": TOKEN})
    create_database(postgres_server, services["postgres"]["environment"]["POSTGRES_DB"])
    yield postgres_server


def test_compose_services_run_as_local_processes(compose_storage: str, tmp_path: Path) -> None:
    """submit over HTTP → two workers finish the study → best over HTTP → the plan loads, and
    its peak is what ``show`` says; SIGTERM stops each worker with exit code 0."""
    env = {"REMAT_SEARCH_TOKEN": TOKEN}
    services = interpolate(compose()["services"], env)
    (storage,) = local([arg for arg in services["worker"]["command"] if "://" in arg], compose_storage)
    home = {"REMAT_SEARCH_HOME": str(tmp_path / "home")}
    cli = [sys.executable, "-m", "remat_search.cli.app"]
    api_port, dashboard_port = free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}"
    with ExitStack() as stack:
        serve = stack.enter_context(started(
            "api", [*cli, *local(services["api"]["command"], compose_storage, api_port)], tmp_path / "api.log",
            {**home, **services["api"]["environment"]},
        ))
        workers = [
            stack.enter_context(started(
                f"worker {i}", [*cli, *local(services["worker"]["command"], compose_storage)],
                tmp_path / f"worker-{i}.log", home,
            ))
            for i in range(services["worker"]["deploy"]["replicas"])
        ]
        serve.wait_for_http(f"{api}/health")
        assert services["dashboard"]["depends_on"] == {"api": {"condition": "service_healthy"}}
        dashboard = stack.enter_context(started(  # after the api is healthy, as compose starts it
            "dashboard",
            [executable(services["dashboard"]["entrypoint"][0]),
             *local(services["dashboard"]["command"], compose_storage, dashboard_port)],
            tmp_path / "dashboard.log",
        ))
        _wait_until_idle(workers)
        # compose's health checks, here: each passes against its running service, and fails
        # where it should (a storage nothing answers at; below, a dashboard that has stopped)
        assert health_check(services["api"], compose_storage, {8000: api_port}, home) == 0
        assert health_check(services["worker"], compose_storage, {}, home) == 0
        nowhere = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}"
        assert health_check(services["worker"], nowhere, {}, home) != 0

        spec = spec_dict(storage, trials=4, confirm={"top": 0, "rounds": 2, "presets": False})
        del spec["storage"]  # the server's own
        body = yaml.safe_dump(spec, sort_keys=False).encode()
        yaml_type = {"Content-Type": "application/yaml"}
        assert http("POST", f"{api}/studies", body, yaml_type)[0] == 401  # no token, no write
        assert get_json(f"{api}/studies") == []
        status, answer = http("POST", f"{api}/studies", body, {**yaml_type, "Authorization": f"Bearer {TOKEN}"})
        assert status == 201, answer
        assert json.loads(answer) == {"study": "tiny", "done": 0, "total": 4, "created": True}

        summary = _wait_until_finished(api, "tiny", workers)
        assert summary["done"] == summary["total"] == 4
        status, best = http("GET", f"{api}/studies/tiny/best?budget=1GiB")
        assert status == 200, best
        plan = RematPlan.from_json(best.decode())
        trials = []
        while (got := http("GET", f"{api}/studies/tiny/trials/{len(trials)}"))[0] == 200:
            trials.append(TrialResult.model_validate_json(got[1]))
        assert len(trials) >= 4, got
        (answer_trial,) = [t for t in trials if t.plan == plan and t.status == "measured" and t.reused_from is None]

        shown = subprocess.run(
            [*cli, "show", "--study", "tiny", "--storage", storage, "--trial", str(answer_trial.number)],
            capture_output=True, text=True, cwd=REPO, env=environment(home), check=False,
        )
        assert shown.returncode == 0, shown.stderr
        assert f"plan digest: {plan.digest}" in shown.stdout
        assert f"peak {format_bytes(answer_trial.peak_bytes or 0)} per device" in shown.stdout, shown.stdout
        best_cli = subprocess.run(
            [*cli, "best", "--study", "tiny", "--budget", "1GiB", "--json", "--storage", storage],
            capture_output=True, text=True, cwd=REPO, env=environment(home), check=False,
        )
        assert best_cli.stdout.strip() == best.decode().strip(), best_cli.stderr  # exactly what `best --json` prints

        logged = [_events(w, "trial") for w in workers]
        # Each counted trial logged once; numbers may skip where two workers raced for the last one.
        stored = optuna.load_study(study_name="tiny", storage=storage).get_trials(deepcopy=False)
        counted = sorted(t.number for t in stored if counts(t))
        assert sorted(line["trial"] for lines in logged for line in lines) == counted and len(counted) == 4, logged
        assert {line["study"] for lines in logged for line in lines} == {"tiny"}

        dashboard.wait_for_http(f"http://127.0.0.1:{dashboard_port}/api/studies")
        studies = get_json(f"http://127.0.0.1:{dashboard_port}/api/studies")["study_summaries"]
        assert [s["study_name"] for s in studies] == ["tiny"]
        assert health_check(services["dashboard"], compose_storage, {8080: dashboard_port}, home) == 0

        for worker in workers:
            assert worker.stop() == 0, worker.output()[-4000:]
        serve.stop()
        dashboard.stop()
        assert health_check(services["dashboard"], compose_storage, {8080: dashboard_port}, home) != 0
        assert health_check(services["api"], compose_storage, {8000: api_port}, home) != 0

