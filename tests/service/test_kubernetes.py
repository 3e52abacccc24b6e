"""docker/k8s/: the Kubernetes manifests, checked without a cluster.

Every object loads through the Kubernetes API's own models (the official ``kubernetes``
client): the models drop keys they do not know, so each object must come back from them
unchanged, which a misspelt key does not. Then the containers' own command lines, with the
environment the manifests give them (the Secret's values filled in), run as local processes
against a PostgreSQL server on loopback: the API takes a spec, two workers of the Job measure it
and exit 0 when nothing is left, as the Job's pods do.
"""

from __future__ import annotations

import copy
import json
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from kubernetes.client import ApiClient

from remat_search.errors import SLICE_RESTART_EXIT
from remat_search.measure.slice import CHANNEL_PORT_OFFSET, PROCESS_ID_ENV
from remat_search.plans.plan import RematPlan
from remat_search.store.liveness import counts

from tests.conftest import REPO, create_database, spec_dict
from tests.ports import free_port
from .services import get_json, http, started
from .test_docker import TOKEN, _remat_search_commands, interpolate, only

pytestmark = pytest.mark.slow  # runs the manifests' commands as processes

K8S = REPO / "docker" / "k8s"
MODELS = {  # kind: (apiVersion, the client's model)
    "Secret": ("v1", "V1Secret"),
    "Service": ("v1", "V1Service"),
    "Deployment": ("apps/v1", "V1Deployment"),
    "Job": ("batch/v1", "V1Job"),
}
SECRETS = {"REMAT_SEARCH_TOKEN": "token", "REMAT_SEARCH_STORAGE": "storage"}  # envsubst's variable: the Secret's key


def documents() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    """Each object by (kind, name)."""
    found = {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents()}
    assert len(found) == len(documents())
    return found


def model(doc: dict[str, Any]) -> Any:
    """``doc`` as the Kubernetes client deserialises an API server's answer: its model."""
    version, name = MODELS[doc["kind"]]
    assert doc["apiVersion"] == version, doc["apiVersion"]
    return ApiClient()._ApiClient__deserialize(copy.deepcopy(doc), name)  # type: ignore[attr-defined]


def round_trip(doc: dict[str, Any]) -> Any:
    return ApiClient().sanitize_for_serialization(model(doc))


def pod(kind: str, name: str) -> dict[str, Any]:
    return objects()[(kind, name)]["spec"]["template"]["spec"]


def container(kind: str, name: str) -> dict[str, Any]:
    (only_container,) = pod(kind, name)["containers"]
    return only_container


API, WORKERS, SECRET = ("Deployment", "remat-search-api"), ("Job", "remat-search-workers"), ("Secret", "remat-search")
SLICE = ("Job", "remat-search-slice")


# --- the objects are what the Kubernetes API takes ---


def test_every_object_loads_through_the_kubernetes_models_unchanged() -> None:
    docs = documents()
    assert sorted(doc["kind"] for doc in docs) == ["Deployment", "Job", "Job", "Secret", "Service", "Service"]
    for doc in docs:
        assert round_trip(doc) == doc, doc["metadata"]["name"]
    misspelt = copy.deepcopy(objects()[WORKERS])
    misspelt["spec"]["parallelizm"] = misspelt["spec"].pop("parallelism")
    assert round_trip(misspelt) != misspelt  # the check does catch a wrong key, deep ones too
    misspelt = copy.deepcopy(objects()[API])
    misspelt["spec"]["template"]["spec"]["containers"][0]["arg"] = ["serve"]
    assert round_trip(misspelt) != misspelt
    nameless = copy.deepcopy(objects()[API])
    del nameless["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):  # and the models' own checks run
        model(nameless)


def test_the_service_is_a_deployment_the_workers_a_job_of_32_and_the_secrets_a_secret() -> None:
    found = objects()
    assert set(found) == {API, WORKERS, SECRET, ("Service", "remat-search-api"), SLICE, ("Service", "remat-search-slice")}
    job = found[WORKERS]["spec"]
    assert job["parallelism"] == 32 and "completions" not in job  # a work queue: done when the pods exit 0
    assert pod(*WORKERS)["restartPolicy"] == "OnFailure"
    assert container(*WORKERS)["image"] == "remat-search:tpu"  # libtpu: TPU-target studies compile on CPU nodes
    assert container(*API)["image"] == "remat-search:cpu"
    assert container(*WORKERS)["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}  # a compile: ~2 cores

    deployment, service = found[API]["spec"], found[("Service", "remat-search-api")]["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"] == {"matchLabels": labels} and service["selector"] == labels
    assert service["type"] == "ClusterIP"  # inside the cluster only
    (port,) = container(*API)["ports"]
    (published,) = service["ports"]
    assert published["targetPort"] == port["name"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container(*API)[probe]["httpGet"] == {"path": "/health", "port": port["name"]}


def test_the_token_and_the_database_url_come_only_from_the_secret() -> None:
    secret = objects()[SECRET]
    assert secret["type"] == "Opaque"
    assert secret["stringData"] == {key: f"${{{variable}}}" for variable, key in SECRETS.items()}  # envsubst fills them
    for where in (API, WORKERS):
        env = container(*where)["env"]
        assert all(set(e) == {"name", "valueFrom"} for e in env), env  # no value written in the manifest
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env}
        assert all(ref["name"] == "remat-search" and ref["key"] in secret["stringData"] for ref in refs.values())
        assert {name: ref["key"] for name, ref in refs.items()} == {name: SECRETS.get(name) for name in refs}
        assert not [a for a in container(*where)["args"] if "://" in a]  # nothing secret on a command line
    assert {e["name"] for e in container(*API)["env"]} == set(SECRETS)
    assert {e["name"] for e in container(*WORKERS)["env"]} == {"REMAT_SEARCH_STORAGE"}  # workers write no API


def test_the_pods_run_as_the_image_says() -> None:
    """Not root, as the image's USER; the storage home (``$REMAT_SEARCH_HOME``, the image's volume)
    is a volume of the pod."""
    user, group = only("USER").value[0].split(":")
    env = dict(zip(only("ENV").value[::2], only("ENV").value[1::2], strict=True))
    assert only("ENTRYPOINT").value == ("remat-search",)
    for where in (API, WORKERS):
        context = pod(*where)["securityContext"]
        assert context == {"runAsNonRoot": True, "runAsUser": int(user), "runAsGroup": int(group), "fsGroup": int(group)}
        (mount,) = container(*where)["volumeMounts"]
        assert mount["mountPath"] == env["REMAT_SEARCH_HOME"]
        (volume,) = pod(*where)["volumes"]
        assert volume == {"name": mount["name"], "emptyDir": {}}
        assert "command" not in container(*where)  # the image's entrypoint, remat-search, runs the args


def test_every_remat_search_command_and_option_in_the_manifests_exists() -> None:
    commands = _remat_search_commands()
    for where in (API, WORKERS):
        command, *args = container(*where)["args"]
        assert command in commands, (where, command)
        assert [a for a in args if a.startswith("-") and a not in commands[command]] == []
    assert container(*WORKERS)["args"] == ["worker", "--until-idle"]  # each pod exits 0 when nothing is left


def test_the_slice_is_an_indexed_job_of_one_pod_a_process_restarted_on_the_slices_exit_code() -> None:
    """docker/k8s/slice.yaml: one pod a host, each told its index (``$REMAT_SEARCH_PROCESS_ID``)
    and pod 0's name through the headless Service; a pod that exits 42 (the slice lost a
    process) or is killed is created again, any other failure ends the Job; the study is in the
    Secret's database, which every restart finds."""
    found = objects()
    job, service = found[SLICE]["spec"], found[("Service", "remat-search-slice")]["spec"]
    args = container(*SLICE)["args"]
    assert args[0] == "run" and [a for a in args[1:] if a.startswith("-") and a not in _remat_search_commands()["run"]] == []
    processes = int(args[args.index("--processes") + 1])
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == processes
    leader = args[args.index("--coordinator") + 1]
    host, port = leader.rsplit(":", 1)
    assert host == f"{found[SLICE]['metadata']['name']}-0.{pod(*SLICE)['subdomain']}"  # pod 0, by the Service
    assert service["clusterIP"] == "None" and pod(*SLICE)["subdomain"] == "remat-search-slice"
    assert service["selector"] == found[SLICE]["spec"]["template"]["metadata"]["labels"]
    assert {p["port"] for p in service["ports"]} == {int(port), int(port) + CHANNEL_PORT_OFFSET}
    env = {e["name"]: e["valueFrom"] for e in container(*SLICE)["env"]}
    assert env[PROCESS_ID_ENV] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env["REMAT_SEARCH_STORAGE"] == {"secretKeyRef": {"name": "remat-search", "key": "storage"}}
    assert pod(*SLICE)["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    ignore, disrupted, fail = job["podFailurePolicy"]["rules"]
    assert ignore["action"] == "Ignore" and SLICE_RESTART_EXIT in ignore["onExitCodes"]["values"]
    assert 128 + signal.SIGKILL in ignore["onExitCodes"]["values"]  # 137: killed (the kernel's OOM killer too)
    assert disrupted == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["operator"] == "NotIn"
    assert set(fail["onExitCodes"]["values"]) == {0, *ignore["onExitCodes"]["values"]}
    assert not {1, 2, 3} & set(ignore["onExitCodes"]["values"])  # what a restart would not mend ends the Job


# --- the containers' own command lines, as local processes ---


def environment_of(where: tuple[str, str], secrets: dict[str, str]) -> dict[str, str]:
    """The environment the manifest gives the container: the Secret as ``envsubst`` fills it in
    from ``secrets`` (its variables' values), each ``secretKeyRef`` read from it."""
    data = interpolate(objects()[SECRET]["stringData"], secrets)
    return {e["name"]: data[e["valueFrom"]["secretKeyRef"]["key"]] for e in container(*where)["env"]}


def local(args: list[str], port: int | None = None) -> list[str]:
    """The container's args as a process here runs them: on 127.0.0.1 (tests listen on loopback
    only) and, for ``--port``, the free ``port``."""
    out = []
    for i, arg in enumerate(args):
        if arg == "0.0.0.0":
            arg = "127.0.0.1"
        elif i and args[i - 1] == "--port":
            assert port is not None, args
            arg = str(port)
        out.append(arg)
    return out


def test_the_manifests_commands_run_as_local_processes(postgres_server: str, tmp_path: Path) -> None:
    """The API takes a spec with the Secret's token; the Job's workers (two here, not 32) finish
    the study and each exits 0 by itself; the API answers ``best``."""
    secrets = {"REMAT_SEARCH_TOKEN": TOKEN, "REMAT_SEARCH_STORAGE": create_database(postgres_server, "k8s")}
    cli = [sys.executable, "-m", "remat_search.cli.app"]
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    home = {"REMAT_SEARCH_HOME": str(tmp_path / "home")}
    with ExitStack() as stack:
        serve = stack.enter_context(started(
            "api", [*cli, *local(container(*API)["args"], port)], tmp_path / "api.log",
            {**home, **environment_of(API, secrets)},
        ))
        serve.wait_for_http(api + container(*API)["readinessProbe"]["httpGet"]["path"])
        assert get_json(f"{api}/health")["status"] == "ok"

        spec = spec_dict(secrets["REMAT_SEARCH_STORAGE"], trials=4, confirm={"top": 0, "rounds": 2, "presets": False})
        del spec["storage"]  # the server's own, from the Secret
        body, yaml_type = yaml.safe_dump(spec, sort_keys=False).encode(), {"Content-Type": "application/yaml"}
        assert http("POST", f"{api}/studies", body, yaml_type)[0] == 401
        status, answer = http("POST", f"{api}/studies", body, {**yaml_type, "Authorization": f"Bearer {TOKEN}"})
        assert status == 201, answer

        workers = [
            stack.enter_context(started(
                f"worker {i}", [*cli, *local(container(*WORKERS)["args"])], tmp_path / f"worker-{i}.log",
                {**home, **environment_of(WORKERS, secrets)},
            ))
            for i in range(2)
        ]
        for worker in workers:
            assert worker.process.wait(timeout=480) == 0, worker.output()[-4000:]  # the pod succeeds
        summary = get_json(f"{api}/studies/tiny")
        assert summary["done"] == summary["total"] == 4 and not summary["running"], summary
        trials = [json.loads(line) for w in workers for line in w.output().splitlines()
                  if line.startswith("{") and json.loads(line)["event"] == "trial"]
        # Each counted trial reported once, by the worker that measured it. Numbers may skip:
        # two workers asking for the last trial at once, one is not admitted (put back).
        study = optuna.load_study(study_name="tiny", storage=secrets["REMAT_SEARCH_STORAGE"])
        counted = sorted(t.number for t in study.get_trials(deepcopy=False) if counts(t))
        assert sorted(t["trial"] for t in trials) == counted and len(counted) == 4
        status, best = http("GET", f"{api}/studies/tiny/best?budget=1GiB")
        assert status == 200, best
        assert RematPlan.from_json(best.decode()).digest  # the plan, as `best --json` prints it
        serve.stop()
