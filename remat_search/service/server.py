"""The HTTP face of remat-search: the studies of one storage, read as the CLI reads them, and
searches submitted as ``remat-search submit`` submits them (``remat-search serve``).

Every answer comes from the functions the CLI calls, in the words of ``report.text`` that it
prints too, so the two never disagree:
``GET /studies/{study}/best?budget=14GiB`` returns, byte for byte, what ``best --json`` prints
(the plan's canonical JSON, which :meth:`RematPlan.from_json` loads), ``/pareto`` what
``pareto --json`` prints, ``/studies`` the rows of ``studies``. A browser asking for
``/studies/{study}`` (``Accept: text/html``) gets the study's page (``page.py``).

Errors are one line, ``{"detail": "..."}``, with the CLI's messages: bad input (a malformed
budget, spec or study name) is 422, an unknown study, a storage that cannot be read and a
budget nothing fits are 404. Writes (``POST /studies``) need ``Authorization: Bearer TOKEN``;
with no token configured they are off (403), and a missing or wrong token is 401. A refused
or malformed write is turned away before anything is opened: it changes nothing.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

import yaml
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from remat_search.errors import NoFeasiblePlan, RematSearchError, SpecError, StorageError, WorkloadError
from remat_search.plans.plan import RematPlan
from remat_search.report.queries import StudySummary, budget_bytes, list_studies, summarize
from remat_search.report.results import TrialResult
from remat_search.report.stored import open_study
from remat_search.report.text import band_of, estimate_mark, front_json, no_trial_text, rivals, untimed_text
from remat_search.service.page import render_page
from remat_search.spec.budget import read_budget
from remat_search.spec.fields import check_study_name
from remat_search.spec.loading import parse_spec
from remat_search.store.storage import resolve_url, shown_url
from remat_search.units import format_bytes

STATUS: dict[type[Exception], int] = {SpecError: 422, WorkloadError: 422, StorageError: 404, NoFeasiblePlan: 404}
"""The HTTP status of each error (as ``cli.app.EXIT_CODES`` gives its exit code); any other is 500."""
MAX_SPEC_BYTES = 1 << 20
"""The largest spec ``POST /studies`` reads: a spec is a page of YAML."""
JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


class StudyStatus(StudySummary):
    """``GET /studies/{study}``: the study's summary and its best plan so far, in full (the
    fastest timed plan, within the study's budget), or null."""

    best: TrialResult | None


class SubmitAnswer(BaseModel):
    """What ``POST /studies`` answers: the study, its trials done of its total, and whether
    this request created it (false: the same spec was submitted before)."""

    model_config = ConfigDict(frozen=True)

    study: str
    done: int
    total: int
    created: bool


def make_app(storage: str | None, *, token: str | None) -> FastAPI:
    """The service over ``storage`` (None: ``$REMAT_SEARCH_STORAGE``, else the default); writes
    need ``token`` as a bearer token, and are off when it is None or empty."""
    url = resolve_url(storage)
    app = FastAPI(
        title="remat-search",
        summary="The studies of one storage: progress, the Pareto front, the best plan for a budget; submit searches.",
        description=(
            f"Storage: `{shown_url(url)}`. Reads are open; `POST /studies` needs `Authorization: Bearer TOKEN` "
            "(off when the server has no token). Errors are `{\"detail\": \"one line\"}`."
        ),
    )
    _errors(app)

    @app.get("/health", summary="The service is up, and the storage it serves")
    def health() -> dict[str, str]:
        return {"status": "ok", "storage": shown_url(url)}

    @app.get("/studies", summary="Every study: progress, estimated time to finish, fastest step")
    def studies() -> list[StudySummary]:
        return list_studies(url)

    @app.get(
        "/studies/{study}", summary="One study's progress and best plan so far; its page in a browser",
        responses={200: {"content": {"text/html": {}}, "description": "JSON, or the page for Accept: text/html"}},
    )
    def study(study: str, request: Request) -> StudyStatus:
        with open_study(_name(study), url) as stored:
            summary = summarize(stored)
            report = stored.report() if _wants_html(request) else None
            best = stored.fastest() if report is None else None
        if report is not None:
            return HTMLResponse(render_page(summary, report))  # type: ignore[return-value]
        return StudyStatus(**summary.model_dump(), best=best)

    @app.get(
        "/studies/{study}/pareto", summary="The Pareto front, as `remat-search pareto --json` prints it",
        response_model=list[TrialResult],
    )
    def pareto(study: str) -> Response:
        with open_study(_name(study), url) as stored:
            front = stored.front()
        return Response(front_json(front) + "\n", media_type="application/json")

    @app.get("/studies/{study}/trials/{number}", summary="One trial, as `remat-search show --trial N` reads it")
    def trial(study: str, number: int) -> TrialResult:
        with open_study(_name(study), url) as stored:
            found, total = stored.trial(number), sum(stored.count().values())
        if found is None:
            raise HTTPException(404, f"trial: {no_trial_text(stored.name, number, total)}")
        return found

    @app.get(
        "/studies/{study}/best",
        summary="The fastest measured plan that fits a budget: exactly what `remat-search best --json` prints",
        description=(
            "The plan's canonical JSON (`RematPlan.from_json` loads it). Headers: X-Remat-Search-Trial (its trial), "
            "-Peak-Bytes (its compiled peak), -Seconds (its one step time), -Time-Source (confirmed, search or "
            "estimated), -Estimate (an estimated step's mark: its band, calibrated or not), -Within-Error (where other "
            "estimated candidates are within the estimate's error of it: their trial numbers), and -Note where plans fit but were never timed (over the study's budget). 404 names the smallest peak measured when nothing fits; 422 for a malformed budget."
        ),
        responses={200: {"model": RematPlan}, 404: {"description": "no measured plan fits the budget"}},
        response_class=Response,
    )
    def best(study: str, budget: str = Query(description=(
        "Peak memory a plan may use, e.g. 14GiB, 200MiB, 1.6e10; 70%: that share of the compiled peak of the "
        "study's uniform no-remat trial; device: the memory of the device that measured the study."
    ))) -> Response:
        read_budget(budget)  # a malformed budget is a 422 before the storage is opened
        with open_study(_name(study), url) as stored:
            limit = budget_bytes(budget, stored)
            found = stored.best(limit)
            untimed = stored.untimed_within(limit)
            close = rivals(found, stored.trials_within(limit)) if band_of(found) else []
        assert found.plan is not None
        headers = {  # what `best` without --json shows beside the plan; the body stays best --json's
            "X-Remat-Search-Trial": str(found.number),
            "X-Remat-Search-Peak-Bytes": str(found.peak_bytes),
            "X-Remat-Search-Seconds": repr(found.seconds),
            "X-Remat-Search-Time-Source": str(found.time_source),
        }
        if found.time_estimated:
            headers["X-Remat-Search-Estimate"] = estimate_mark(found)
        if close:
            headers["X-Remat-Search-Within-Error"] = ", ".join(str(t.number) for t in close)
        if untimed:
            headers["X-Remat-Search-Note"] = untimed_text(len(untimed), limit, stored.budget)
        return Response(found.plan.to_json() + "\n", media_type="application/json", headers=headers)

    @app.post(
        "/studies", status_code=201,
        summary="Submit a search (its spec as YAML or JSON): `remat-search submit`, against this server's storage",
        description=(
            "Needs `Authorization: Bearer TOKEN`. The spec is checked as `run` checks it, the study created with its "
            "presets queued, and the answer returned at once: workers measure it. The same spec again answers "
            "created: false. A spec naming another storage is refused (422)."
        ),
        openapi_extra={"requestBody": {"required": True, "content": {
            t: {"schema": {"type": "object"}} for t in (*JSON_TYPES, *YAML_TYPES)
        }}},
        responses={401: {"description": "no or wrong token"}, 403: {"description": "writes are off"}},
    )
    async def submit_study(request: Request) -> SubmitAnswer:
        _authorize(request, token)
        data = _spec_data(request.headers.get("content-type", ""), await _body(request))
        if data.get("storage") not in (None, url):
            raise SpecError(
                f"spec.storage: this server submits to its own storage ({shown_url(url)}), not "
                f"{shown_url(str(data['storage']))}; leave storage out of the spec"
            )
        spec = parse_spec({**data, "storage": url})
        from remat_search.search.submission import (
            submit,  # JAX and optuna load with the first write, not at start
        )

        done = await run_in_threadpool(submit, spec)
        return SubmitAnswer(study=done.study, done=done.done, total=done.total, created=done.created)

    return app


def _name(study: str) -> str:
    try:
        return check_study_name(study)
    except ValueError as e:
        raise SpecError(f"study: {e}") from None


def _wants_html(request: Request) -> bool:
    """A browser's request: it asks for HTML (curl and programs ask for anything, ``*/*``)."""
    return "text/html" in request.headers.get("accept", "")


def _authorize(request: Request, token: str | None) -> None:
    """Let a write through only with the server's bearer token (compared in constant time)."""
    if not token:
        raise HTTPException(403, "writes are off: this server has no token (serve --token, or $REMAT_SEARCH_TOKEN)")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise HTTPException(401, "authorization: expected the header Authorization: Bearer <the server's token>",
                            headers={"WWW-Authenticate": "Bearer"})


async def _body(request: Request) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_SPEC_BYTES:
            raise HTTPException(413, f"spec: larger than {format_bytes(MAX_SPEC_BYTES)}; a spec is a page of YAML")
    return body


def _spec_data(content_type: str, body: bytes) -> dict[str, Any]:
    """The spec a request's body holds, as a mapping, by its Content-Type."""
    kind = content_type.split(";")[0].strip().lower()
    try:
        text = body.decode()
        if kind in JSON_TYPES:
            data = json.loads(text)
        elif kind in YAML_TYPES:
            data = yaml.safe_load(text)
        else:
            raise HTTPException(
                415, f"Content-Type: expected application/json or application/yaml, got {kind or 'none'!r}"
            )
    except UnicodeDecodeError:
        raise SpecError("spec: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"spec: not valid JSON at line {e.lineno}: {e.msg}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(f"spec: not valid YAML{where}: {getattr(e, 'problem', None) or type(e).__name__}") from None
    if not isinstance(data, dict):
        raise SpecError(f"spec: must be a mapping of fields, got {type(data).__name__}")
    return data


def _errors(app: FastAPI) -> None:
    """Every error as ``{"detail": "one line"}``: ours by :data:`STATUS`, FastAPI's own
    validation errors (a missing query parameter) by their first field."""

    @app.exception_handler(RematSearchError)
    async def ours(request: Request, e: RematSearchError) -> JSONResponse:
        return JSONResponse({"detail": _line(str(e))}, status_code=STATUS.get(type(e), 500))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body"))
        message = "required" if first.get("type") == "missing" else first.get("msg", "invalid")
        return JSONResponse({"detail": _line(f"{where}: {message}" if where else message)}, status_code=422)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": _line(f"{type(e).__name__}: {e} (unexpected)")}, status_code=500)


def _line(text: str) -> str:
    return " ".join(text.split()) or "no message"
