"""The HTTP service over real HTTP on loopback: ``remat-search serve`` as a process, a study made
by a real search, every endpoint beside the command that answers the same question."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import remat_search
from remat_search.plans.plan import RematPlan
from remat_search.report.queries import list_studies
from remat_search.report.results import TrialResult
from remat_search.spec.loading import parse_spec
from remat_search.report.stored import open_study

from tests.conftest import REPO, spec_dict
from .serving import env, free_port, request, serve_command, serving

TOKEN = "test-token-0123456789"


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A storage holding study ``tiny``, finished by a real (tiny) search."""
    folder = tmp_path_factory.mktemp("server")
    url = f"sqlite:///{folder / 'studies.db'}"
    remat_search.run(parse_spec(spec_dict(url, trials=6)))
    return url


@pytest.fixture(scope="module")
def server(storage: str) -> Iterator[str]:
    """``serve`` over it with a token: its base URL."""
    with serving(storage, token=TOKEN) as base:
        yield base


@pytest.fixture(scope="module")
def read_only_server(storage: str) -> Iterator[str]:
    """``serve`` over it without a token: writes off."""
    with serving(storage) as base:
        yield base


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*serve_command()[:3], *args], cwd=REPO, env=env(), capture_output=True, text=True,
                          check=False, timeout=120)


def _one_line(detail: Any) -> str:
    assert isinstance(detail, str) and "\n" not in detail and detail, detail
    return detail


def test_health_names_the_storage(server: str, storage: str) -> None:
    answer = request(server + "/health")
    assert answer.status == 200
    assert answer.json() == {"status": "ok", "storage": storage}


def test_studies_are_the_summaries_the_studies_command_prints(server: str, storage: str, cli) -> None:  # type: ignore[no-untyped-def]
    answer = request(server + "/studies")
    assert answer.status == 200
    assert answer.json() == [s.model_dump(mode="json") for s in list_studies(storage)]
    (tiny,) = answer.json()
    assert (tiny["study"], tiny["done"], tiny["running"], tiny["target"]) == ("tiny", 6, 0, "local")
    assert tiny["eta_seconds"] is None  # finished
    table = cli("studies", "--storage", storage)
    assert table.exit_code == 0, table.stderr
    cells = next([c.strip() for c in line.split("│")] for line in table.stdout.splitlines() if "│ tiny" in line)
    done = f"{tiny['done']}/{tiny['total']}" if tiny["total"] is not None else str(tiny["done"])
    assert done in cells and ("finished" if tiny["total"] is not None else "—") in cells, cells


def test_a_study_is_its_summary_and_best_plan_so_far(server: str, storage: str) -> None:
    answer = request(server + "/studies/tiny")
    assert answer.status == 200 and answer.headers["content-type"] == "application/json"
    got = answer.json()
    with open_study("tiny", storage) as stored:
        fastest = stored.fastest()
    (summary,) = list_studies(storage)
    assert fastest is not None
    assert got == {**summary.model_dump(mode="json"), "best": fastest.model_dump(mode="json")}
    assert got["best"]["number"] == got["fastest_trial"]


def test_pareto_is_what_pareto_json_prints(server: str, storage: str, cli) -> None:  # type: ignore[no-untyped-def]
    answer = request(server + "/studies/tiny/pareto")
    printed = cli("pareto", "--study", "tiny", "--storage", storage, "--json")
    assert answer.status == 200 and printed.exit_code == 0
    assert answer.body.decode() == printed.stdout
    front = [TrialResult.model_validate(t) for t in answer.json()]
    assert front and all(t.status == "measured" for t in front)


def test_a_trial_is_what_show_reads(server: str, storage: str) -> None:
    with open_study("tiny", storage) as stored:
        trials = stored.trials()
    for t in trials:
        answer = request(f"{server}/studies/tiny/trials/{t.number}")
        assert answer.status == 200
        assert TrialResult.model_validate(answer.json()) == t
    missing = request(server + "/studies/tiny/trials/99")
    assert missing.status == 404
    assert _one_line(missing.json()["detail"]) == "trial: study 'tiny' has no trial 99 (it has trials 0..5)"


def _budgets(storage: str) -> list[str]:
    """The study's budget, and each plan's peak on the front: each its own answer."""
    with open_study("tiny", storage) as stored:
        return ["1GiB", *(str(t.peak_bytes) for t in stored.front())]


def test_best_is_byte_for_byte_what_best_json_prints(server: str, storage: str) -> None:
    for budget in _budgets(storage):
        answer = request(f"{server}/studies/tiny/best?budget={budget}")
        printed = _cli("best", "--study", "tiny", "--budget", budget, "--storage", storage, "--json")
        assert answer.status == 200 and printed.returncode == 0, printed.stderr
        assert answer.body == printed.stdout.encode()
        plan = RematPlan.from_json(answer.body.decode())
        with open_study("tiny", storage) as stored:
            best = stored.best(int(budget) if budget.isdigit() else 2**30)
        assert plan == best.plan
        assert answer.headers["x-remat-search-trial"] == str(best.number)
        assert int(answer.headers["x-remat-search-peak-bytes"]) == best.peak_bytes
        assert float(answer.headers["x-remat-search-seconds"]) == best.seconds
        assert answer.headers["x-remat-search-time-source"] == best.time_source


def test_nothing_fits_is_404_naming_the_smallest_peak(server: str, storage: str) -> None:
    answer = request(server + "/studies/tiny/best?budget=1")
    printed = _cli("best", "--study", "tiny", "--budget", "1", "--storage", storage, "--json")
    assert answer.status == 404 and printed.returncode == 1
    detail = _one_line(answer.json()["detail"])
    assert printed.stderr == f"error: {detail}\n"
    with open_study("tiny", storage) as stored:
        smallest = min(t.peak_bytes for t in stored.trials() if t.peak_bytes)
    assert "the smallest peak measured is" in detail
    assert remat_search.units.format_bytes(smallest) in detail


def test_best_takes_a_share_of_the_studys_no_remat_peak(server: str, storage: str) -> None:
    with open_study("tiny", storage) as stored:
        (none,) = stored.with_plan(RematPlan.uniform("none", stored.attrs["layers"]).to_json())
    share = request(f"{server}/studies/tiny/best?budget=90%25")
    size = request(f"{server}/studies/tiny/best?budget={none.peak_bytes * 9 // 10}")
    assert share.status == size.status == 200
    assert share.body == size.body and share.headers["x-remat-search-trial"] == size.headers["x-remat-search-trial"]


@pytest.mark.parametrize("query", ["budget=x", "budget=-1", "budget=16%20GiBs", "budget=", "", "budget=150%25"])
def test_a_bad_budget_is_422_in_one_line(server: str, query: str) -> None:
    answer = request(f"{server}/studies/tiny/best?{query}")
    assert answer.status == 422
    assert _one_line(answer.json()["detail"]).startswith("budget: ")


def test_an_unknown_study_is_404_and_a_malformed_name_422(server: str) -> None:
    for path in ("/studies/nope", "/studies/nope/pareto", "/studies/nope/best?budget=1GiB", "/studies/nope/trials/0"):
        answer = request(server + path)
        assert answer.status == 404, path
        assert _one_line(answer.json()["detail"]) == "study: no study 'nope' in " + repr(
            request(server + "/health").json()["storage"]) + "; studies there: ['tiny']"
    answer = request(server + "/studies/bad%20name")
    assert answer.status == 422 and _one_line(answer.json()["detail"]).startswith("study: expected a study name")


def test_a_storage_that_cannot_be_read_is_404(tmp_path: Path) -> None:
    with serving(f"sqlite:///{tmp_path / 'none.db'}") as base:
        answer = request(base + "/studies")
    assert answer.status == 404
    assert _one_line(answer.json()["detail"]).startswith("storage: no database at ")


def test_the_schema_is_served_at_docs_and_openapi_json(server: str) -> None:
    docs = request(server + "/docs")
    assert docs.status == 200 and b"swagger" in docs.body.lower() and b"/openapi.json" in docs.body
    schema = request(server + "/openapi.json").json()
    assert {path: sorted(methods) for path, methods in schema["paths"].items()} == {
        "/health": ["get"], "/studies": ["get", "post"], "/studies/{study}": ["get"],
        "/studies/{study}/pareto": ["get"], "/studies/{study}/trials/{number}": ["get"],
        "/studies/{study}/best": ["get"],
    }
    assert "RematPlan" in json.dumps(schema["paths"]["/studies/{study}/best"])


def test_a_browser_gets_the_page(server: str) -> None:
    answer = request(server + "/studies/tiny", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/html")
    assert b"<title>tiny" in answer.body


# --- writes ---------------------------------------------------------------------------------------
def _database(storage: str) -> tuple[dict[str, bytes], list[str]]:
    """The storage's files, byte for byte, and its content, statement by statement. (SQLite's
    shared-memory index and an empty log come and go with readers: they are no content.)"""
    path = Path(storage.removeprefix("sqlite:///"))
    files = {p.name: p.read_bytes() for p in sorted(path.parent.glob(path.name + "*"))
             if not p.name.endswith("-shm") and p.stat().st_size}
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        dump = list(db.iterdump())
    db.close()
    return files, dump


def _spec(storage: str, **changes: Any) -> dict[str, Any]:
    spec = spec_dict(storage, study="posted", **changes)
    del spec["storage"]
    return spec


YAML = {"Content-Type": "application/yaml"}
JSON = {"Content-Type": "application/json"}


def test_a_write_is_refused_without_the_token_and_changes_nothing(server: str, read_only_server: str, storage: str) -> None:
    body = yaml.safe_dump(_spec(storage)).encode()
    request(server + "/studies")  # reads may fold SQLite's log into the file: before the snapshot
    before = _database(storage)
    refused = [
        (read_only_server, {**YAML, "Authorization": f"Bearer {TOKEN}"}, 403),  # writes off: no token set
        (read_only_server, YAML, 403),
        (server, YAML, 401),  # no token given
        (server, {**YAML, "Authorization": "Bearer wrong"}, 401),
        (server, {**YAML, "Authorization": f"Bearer {TOKEN}x"}, 401),
        (server, {**YAML, "Authorization": TOKEN}, 401),  # no scheme
        (server, {**YAML, "Authorization": f"Basic {TOKEN}"}, 401),
    ]
    for base, headers, status in refused:
        answer = request(base + "/studies", method="POST", body=body, headers=headers)
        assert answer.status == status, (headers, answer.body)
        detail = _one_line(answer.json()["detail"])
        assert ("writes are off" in detail) if status == 403 else detail.startswith("authorization:")
        if status == 401:
            assert answer.headers["www-authenticate"] == "Bearer"
    assert _database(storage) == before
    assert [s.study for s in list_studies(storage)] == ["tiny"]


BAD_WRITES = [
    ("no content type", {}, b"study: x", 415, "Content-Type: expected application/json or application/yaml"),
    ("form", {"Content-Type": "application/x-www-form-urlencoded"}, b"study=x", 415, "Content-Type:"),
    ("bad yaml", YAML, b"study: [x", 422, "spec: not valid YAML at line 1"),
    ("bad json", JSON, b"{\"study\": ", 422, "spec: not valid JSON at line 1"),
    ("not a mapping", JSON, b"[1, 2]", 422, "spec: must be a mapping of fields, got list"),
    ("not text", YAML, b"\xff\xfe", 422, "spec: not UTF-8 text"),
    ("unknown key", YAML, b"study: posted\ntrails: 3\n", 422, "spec.trails: unknown key"),
]


@pytest.mark.parametrize(("case", "headers", "body", "status", "detail"), BAD_WRITES, ids=[c[0] for c in BAD_WRITES])
def test_a_bad_write_is_4xx_in_one_line_and_changes_nothing(
    server: str, storage: str, case: str, headers: dict[str, str], body: bytes, status: int, detail: str,
) -> None:
    request(server + "/studies")
    before = _database(storage)
    answer = request(server + "/studies", method="POST", body=body,
                     headers={**headers, "Authorization": f"Bearer {TOKEN}"})
    assert answer.status == status, answer.body
    assert detail in _one_line(answer.json()["detail"])
    assert _database(storage) == before


def test_a_spec_naming_another_storage_is_refused(server: str, storage: str, tmp_path: Path) -> None:
    before = _database(storage)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    answer = request(server + "/studies", method="POST", body=json.dumps({**_spec(storage), "storage": other}).encode(),
                     headers={**JSON, "Authorization": f"Bearer {TOKEN}"})
    assert answer.status == 422
    assert _one_line(answer.json()["detail"]).startswith("spec.storage: this server submits to its own storage")
    assert _database(storage) == before and not (tmp_path / "other.db").exists()


# --- serve's own rules ------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.org"])
def test_serve_refuses_beyond_loopback_without_a_token(host: str) -> None:
    port = free_port()
    done = subprocess.run(serve_command("--host", host, "--port", str(port)), cwd=REPO, env=env(),
                          capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --host: ") and done.stderr.count("\n") == 1, done.stderr
    assert "token" in done.stderr and done.stdout == ""


def test_serve_beyond_loopback_with_a_token(storage: str) -> None:
    with serving(storage, token=TOKEN, host="0.0.0.0") as base:
        assert request(base + "/health").status == 200


def test_serve_refuses_a_malformed_storage_url_before_listening() -> None:
    done = subprocess.run(serve_command("--storage", "nonsense", "--port", str(free_port())), cwd=REPO, env=env(),
                          capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: storage: 'nonsense' is not a database URL"), done.stderr


def test_serve_help_teaches_the_token_rule_and_an_example(cli) -> None:  # type: ignore[no-untyped-def]
    result = cli("serve", "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    for taught in ("Authorization: Bearer TOKEN", "are off (403) when the server has no token",
                   "beyond loopback it listens only with a token", "$REMAT_SEARCH_TOKEN", "/docs",
                   "curl 'http://127.0.0.1:8000/studies/demo-transformer-cpu/best?budget=38MiB'"):
        assert taught in text, taught


def test_a_spec_posted_with_the_token_is_submitted_once(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    storage = f"sqlite:///{tmp_path / 'new.db'}"  # no database yet: serve, writes on, makes optuna's tables
    spec = _spec(storage)
    with serving(storage, token=TOKEN) as base:
        before = {p.name: p.read_bytes() for p in tmp_path.glob("new.db*")}
        assert "new.db" in before
        bad = request(base + "/studies", method="POST", headers={**YAML, "Authorization": f"Bearer {TOKEN}"},
                      body=yaml.safe_dump({**spec, "workload": {"factory": "no_such_module:make"}}).encode())
        assert bad.status == 422
        assert _one_line(bad.json()["detail"]).startswith("workload.factory: 'no_such_module:make' does not import")
        assert {p.name: p.read_bytes() for p in tmp_path.glob("new.db*")} == before, "a refused spec wrote"

        answers = [
            request(base + "/studies", method="POST", body=body, headers={**kind, "Authorization": f"Bearer {TOKEN}"})
            for body, kind in ((yaml.safe_dump(spec).encode(), YAML), (json.dumps(spec).encode(), JSON))
        ]
        assert [(a.status, a.json()) for a in answers] == [
            (201, {"study": "posted", "done": 0, "total": 6, "created": True}),
            (201, {"study": "posted", "done": 0, "total": 6, "created": False}),
        ]
        status = request(base + "/studies/posted").json()
        assert (status["done"], status["total"], status["running"], status["eta_seconds"], status["best"]) == (
            0, 6, 0, None, None)
        assert (status["target"], status["budget"], status["device"]) == ("local", 2**30, "—")  # no worker yet
        page = request(base + "/studies/posted", headers={"Accept": "text/html"})  # nothing measured yet
        assert page.status == 200 and b"0/6" in page.body
    again = cli("submit", str(tmp_path / "spec.yaml"), "--storage", storage) if (tmp_path / "spec.yaml").write_text(
        yaml.safe_dump(spec)) else None
    assert again is not None and again.exit_code == 0, again.stderr
    assert again.stdout.startswith("study 'posted' was already submitted (0/6 trials)")


def test_health_hides_the_storage_password(postgres_url: str) -> None:
    with_password = postgres_url.replace("postgres@", "postgres:s3cret@")  # the test server trusts any
    with serving(with_password) as base:
        answer = request(base + "/health")
    assert answer.json() == {"status": "ok", "storage": postgres_url.replace("postgres@", "postgres:***@")}


def test_serve_without_the_service_extra_names_it(cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed
    result = cli("serve")
    assert result.exit_code == 2
    assert result.stderr == "error: serve: needs fastapi, not installed: pip install 'remat-search[service]'\n"
