"""The commands over a whole storage rather than one spec or study: ``doctor`` checks it (and
the backend and device a search would get), ``serve`` serves it over HTTP.

``doctor`` calls :func:`cli.doctor.diagnose` and prints its checks; ``serve`` checks its
token rule (beyond loopback only with a token) and runs ``service.server``'s app.
"""

from __future__ import annotations

from typing import Annotated

import typer

from remat_search.cli import flags, output
from remat_search.cli.flags import StorageOption
from remat_search.errors import SpecError

TOKEN_ENV = "REMAT_SEARCH_TOKEN"


def doctor(
    storage: StorageOption = None,
    study: Annotated[str | None, typer.Option("--study", "-s", metavar="NAME", show_default=False,
                                              help="Judge only this study's trials. Default: every study.")] = None,
) -> None:
    """Check the storage, the backend and the device, and say what to fix.

    Storage: reachable, its driver, optuna's schema version, the measurement cache table,
    SQLite's integrity and journal mode (WAL), and stale trials (running, their search gone:
    by pid on this host, by heartbeat on others). Backend: JAX's platform, devices and plugins
    (libtpu, CUDA). Memory: per device, and free on the host. Writes nothing.

    Exit codes: 0 when no check failed (warnings allowed); 1 when one failed, a file that is
    no database or is damaged included; 2 for bad input, one line: a malformed URL, a SQLite
    file that does not exist, an unknown study.
    """
    from remat_search.cli.doctor import diagnose

    checks = diagnose(storage, flags.study(study) if study is not None else None)
    output.console.print(output.doctor_table(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


def serve(
    storage: StorageOption = None,
    host: Annotated[str, typer.Option(metavar="ADDRESS", help="Address to listen on. Beyond loopback (127.0.0.1, ::1, localhost) only with a token.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, metavar="PORT", help="Port to listen on.")] = 8000,
    token: Annotated[str | None, typer.Option(
        metavar="TOKEN", envvar=TOKEN_ENV, show_default=False,
        help=f"Bearer token that writes (POST /studies) need; also from ${TOKEN_ENV}. Without one, writes are off.",
    )] = None,
) -> None:
    """Serve the storage's studies over HTTP (FastAPI; the API's schema at /docs).

    Reads answer as the commands do: GET /studies, /studies/NAME (progress, estimated time to
    finish, best plan so far; in a browser, the study's page with its front and a box to ask
    for a budget), /studies/NAME/pareto, /studies/NAME/trials/N, and
    /studies/NAME/best?budget=14GiB, which returns what `best --json` prints (404 naming the
    smallest peak measured when nothing fits). POST /studies submits a spec (YAML or JSON) as
    `submit` does, to this storage.

    Token rule: writes need the header Authorization: Bearer TOKEN (401 without it), and are
    off (403) when the server has no token; beyond loopback it listens only with a token.

    Example (the demo's plan for 38 MiB, then a search submitted):

    \b
      export REMAT_SEARCH_TOKEN=$(openssl rand -hex 16)
      remat-search serve &
      curl 'http://127.0.0.1:8000/studies/demo-transformer-cpu/best?budget=38MiB'
      curl -H "Authorization: Bearer $REMAT_SEARCH_TOKEN" \\
           -H 'Content-Type: application/yaml' --data-binary @spec.yaml \\
           http://127.0.0.1:8000/studies
    """
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecError(f"serve: needs {' and '.join(missing)}, not installed: pip install 'remat-search[service]'")
    token = token or None
    if not _loopback(host) and token is None:
        raise SpecError(
            f"--host: {host!r} is beyond loopback: a service others can reach needs a token (--token, or "
            f"${TOKEN_ENV}); or listen on 127.0.0.1"
        )
    import uvicorn

    from remat_search.service.server import make_app
    from remat_search.store.storage import check_storage, open_storage, shown_url

    check_storage(storage, create=True)  # a malformed URL is bad input, said before listening
    if token:  # writes on: make optuna's tables now, so that a dashboard started after us finds them
        open_storage(storage, create=True)
    output.note(
        f"serving {shown_url(storage)} on http://{host}:{port} (writes {'need the token' if token else 'off: no token'})"
    )
    uvicorn.run(make_app(storage, token=token), host=host.strip("[]"), port=port, log_level="info")


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address; a host name other than ``localhost`` may stand for any."""
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
