"""Where studies live: optuna's RDB storage (SQLite by default, PostgreSQL for several hosts).

This module is the one place that checks storage URLs, opens storage and translates
SQLAlchemy and optuna storage errors into :class:`StorageError` (:func:`translate_errors`).
A search opens it through optuna (:func:`open_storage`); queries read the same tables over a
plain read-only connection (:mod:`remat_search.store.reading`), without importing optuna.
SQLite databases run in WAL mode with a busy timeout so that several processes can share one
file. A trial's plan and measurement are kept as JSON user attributes next to optuna's own
values and constraints (their names are in ``store.attributes``); ``report.results`` reads
them back.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from remat_search.errors import StorageError
from remat_search.store.location import HOME_ENV, STORAGE_ENV, default_storage, storage_home

if TYPE_CHECKING:
    import optuna
    import sqlalchemy

SQLITE_BUSY_TIMEOUT_SECONDS = 60
CONNECT_TIMEOUT_SECONDS = 10


def resolve_url(url: str | None) -> str:
    """The storage URL to use: the one given, else ``$REMAT_SEARCH_STORAGE``, else the default."""
    return url or os.environ.get(STORAGE_ENV) or default_storage()


def check_storage(url: str | None = None, *, create: bool = False) -> dict:
    """Check that ``url`` is reachable, writing nothing; return the engine options to open it.

    With ``create=False`` a missing SQLite file is an error (queries never create one).
    """
    url = resolve_url(url)
    shown = _shown(url)
    try:  # optuna's RDBStorage fills the URL in as a template: url.format(SCHEMA_VERSION=...)
        url.format(SCHEMA_VERSION=0)
    except (ValueError, KeyError, IndexError, AttributeError):
        raise StorageError(
            f"storage: {shown!r} has a brace that optuna reads as a template field ({{SCHEMA_VERSION}}); "
            "double it ({{ or }}) or rename the file"
        ) from None
    plain = plain_sqlite(url)
    if plain is not None:  # the common case, checked without importing SQLAlchemy
        _check_sqlite_path(plain, shown, create=create)
        return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_SECONDS}}
    with translate_errors(url):
        parsed = _parse_url(url)
        if parsed.get_backend_name() == "sqlite":
            _check_sqlite_path(parsed.database, shown, create=create)
            engine_kwargs: dict = {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_SECONDS}}
            _engine(parsed, shown, engine_kwargs).dispose()  # its options read; SQLite opens nothing yet
            return engine_kwargs
        engine_kwargs = {"pool_pre_ping": True}
        if parsed.get_backend_name() == "postgresql":
            engine_kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
        probe = _engine(parsed, shown, engine_kwargs)
        try:
            with probe.connect():
                pass
        except UnicodeError as e:  # the host name cannot be looked up ('idna' codec), before any network
            raise StorageError(f"storage: {shown!r} names a host that is no host name ({e})") from None
        finally:
            probe.dispose()
        return engine_kwargs


def open_storage(
    url: str | None = None, *, create: bool = False, heartbeat: dict[str, Any] | None = None
) -> optuna.storages.RDBStorage:
    """Open the storage at ``url`` (see :func:`check_storage`).

    With ``create=True`` optuna's tables are made if missing and SQLite is put in WAL mode;
    without it nothing is written, so queries are safe on any database. ``heartbeat`` holds
    optuna's heartbeat options (``heartbeat_interval``, ``grace_period``,
    ``heartbeat_stale_trial_callback``: see ``liveness.py``).
    """
    import optuna
    import sqlalchemy.exc

    url = resolve_url(url)
    engine_kwargs = check_storage(url, create=create)
    database = sqlalchemy.engine.make_url(url).database  # a valid URL: check_storage parsed it
    if create and database and Path(database).resolve().parent == storage_home():
        storage_home().mkdir(parents=True, exist_ok=True)  # as _check_sqlite_path allowed
    with translate_errors(url):
        for attempt in range(3):
            try:
                with warnings.catch_warnings():  # heartbeats are "experimental" since optuna 2.9
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    storage = optuna.storages.RDBStorage(
                        url, engine_kwargs=engine_kwargs, skip_table_creation=not create, **(heartbeat or {})
                    )
                if create and storage.engine.dialect.name == "sqlite":
                    with storage.engine.connect() as connection:
                        connection.exec_driver_sql("PRAGMA journal_mode=WAL")
                break
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError, sqlalchemy.exc.ProgrammingError) as e:
                # Another process made the tables just now: SQLite says "table … already exists",
                # PostgreSQL a duplicate table or type. They are there now (optuna checks first).
                # Or SQLite refused a lock at once, without waiting out the busy timeout, as it
                # does where two connections' transactions would deadlock: "database is locked".
                if attempt == 2 or (
                    not isinstance(e, sqlalchemy.exc.IntegrityError)
                    and "already exists" not in str(e) and "database is locked" not in str(e)
                ):
                    raise
                time.sleep(0.5)
        return storage


_PLAIN_SQLITE = re.compile(r"sqlite:///(?P<path>[^?%]+)")


def plain_sqlite(url: str) -> str | None:
    """The file of a SQLite URL with no driver, options or escapes (``sqlite:///studies.db``,
    ``sqlite:////abs/path.db``), as SQLAlchemy reads it; None for any other URL."""
    found = _PLAIN_SQLITE.fullmatch(url)
    return found["path"] if found and found["path"] != ":memory:" else None


@contextlib.contextmanager
def translate_errors(url: str) -> Iterator[None]:
    """Turn SQLAlchemy and optuna storage failures into one-line :class:`StorageError`s."""
    shown = _shown(url)
    try:
        yield
    except StorageError:
        raise
    except Exception as e:
        sa = sys.modules.get("sqlalchemy.exc")  # loaded where SQLAlchemy ran: nothing else raised its errors
        if sa is not None and isinstance(e, sa.NoSuchModuleError):
            raise StorageError(
                f"storage: {shown!r} needs a database driver that is not installed ({e}); "
                "URLs name the database and driver as in postgresql+psycopg://user@host/db"
            ) from None
        if isinstance(e, ModuleNotFoundError):
            missing = _missing_driver(url, e)
            if missing is None:  # not the driver: a bug, with its own traceback
                raise
            raise StorageError(f"storage: {shown!r} {missing}") from None
        if sa is not None and isinstance(e, sa.ArgumentError):
            raise _not_a_url(shown) from None
        if not isinstance(e, (sqlite3.Error, *((sa.SQLAlchemyError,) if sa else ()), *_optuna_storage_errors())):
            raise
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        raise StorageError(f"storage: cannot use {shown!r} ({reason})") from None


def _optuna_storage_errors() -> tuple[type[Exception], ...]:
    """optuna's storage error where optuna is loaded (where it is not, nothing raised one):
    queries read the tables without importing it."""
    exceptions = sys.modules.get("optuna.exceptions")
    return (exceptions.StorageInternalError,) if exceptions is not None else ()


def _parse_url(url: str) -> sqlalchemy.engine.URL:
    """``url`` parsed; SQLAlchemy raises ValueError, not its ArgumentError, for some bad URLs
    (a port that is no number: ``postgresql://u@host:x/db``)."""
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(url)
    except ValueError:
        raise _not_a_url(_shown(url)) from None


def _engine(parsed: sqlalchemy.engine.URL, shown: str, engine_kwargs: dict) -> sqlalchemy.Engine:
    """An engine for ``parsed`` (no connection yet); a URL option its driver cannot read, or
    ignores, is a :class:`StorageError` (``?timeout=abc``, ``?mode=ro`` without ``uri=true``)."""
    import sqlalchemy

    with warnings.catch_warnings():
        warnings.simplefilter("error", sqlalchemy.exc.SAWarning)
        try:
            return sqlalchemy.create_engine(parsed, **engine_kwargs)
        except sqlalchemy.exc.SAWarning as e:
            reason = str(e).split(" (Background on this")[0]
            raise StorageError(f"storage: {shown!r}: {reason}") from None
        except (ValueError, TypeError) as e:
            raise StorageError(f"storage: {shown!r} has an option its driver cannot read ({e})") from None


def _not_a_url(shown: str) -> StorageError:
    return StorageError(
        f"storage: {shown!r} is not a database URL; expected e.g. "
        f"sqlite:///path/to/studies.db or postgresql://user@host/db"
    )


# SQLAlchemy's driver name → the module it imports and what `pip install` needs to install it.
_DRIVERS = {
    "psycopg": ("psycopg", '"psycopg[binary]"'),
    "psycopg_async": ("psycopg", '"psycopg[binary]"'),
    "psycopg2": ("psycopg2", "psycopg2-binary"),
    "pg8000": ("pg8000", "pg8000"),
    "asyncpg": ("asyncpg", "asyncpg"),
    "mysqldb": ("MySQLdb", "mysqlclient"),
    "pymysql": ("pymysql", "pymysql"),
    "mysqlconnector": ("mysql", "mysql-connector-python"),
    "mariadbconnector": ("mariadb", "mariadb"),
    "asyncmy": ("asyncmy", "asyncmy"),
    "aiomysql": ("aiomysql", "aiomysql"),
    "oracledb": ("oracledb", "oracledb"),
    "pyodbc": ("pyodbc", "pyodbc"),
    "pymssql": ("pymssql", "pymssql"),
}


def _missing_driver(url: str, error: ModuleNotFoundError) -> str | None:
    """What to install (or write) when ``error`` is the driver of ``url`` not being installed;
    None when it is another module. A bare ``postgresql://`` means SQLAlchemy's default driver
    (psycopg 3 since SQLAlchemy 2.1), so the command follows the URL as written."""
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
        driver, dialect = parsed.get_driver_name(), parsed.get_dialect()
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ValueError):
        return None
    module, package = _DRIVERS.get(driver, (driver, driver))
    if (error.name or "").partition(".")[0] != module.partition(".")[0]:
        return None
    if getattr(dialect, "is_async", False):  # optuna's storage is synchronous
        backend = parsed.get_backend_name()
        sync = sqlalchemy.engine.make_url(f"{backend}://").get_driver_name()
        return (
            f"names {driver}, an asyncio driver, which optuna's storage cannot use; write "
            f"{backend}+{sync}:// and pip install {_DRIVERS.get(sync, (sync, sync))[1]}"
        )
    return f"needs the {driver} driver, which is not installed: pip install {package}"


def load_study(name: str, storage: optuna.storages.RDBStorage) -> optuna.Study:
    """The study ``name``; a missing one is a :class:`StorageError` listing those that exist."""
    import optuna

    with translate_errors(storage.url):
        try:
            return optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            known = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
            raise no_such_study(name, storage.url, known) from None


def no_such_study(name: str, url: str, known: list[str]) -> StorageError:
    """The error for a study ``name`` that the storage at ``url`` lacks: it lists ``known``."""
    return StorageError(f"study: no study {name!r} in {_shown(url)!r}; studies there: {sorted(known) or 'none'}")


def _check_sqlite_path(database: str | None, shown: str, *, create: bool) -> None:
    if not database or database == ":memory:":
        raise StorageError(f"storage: {shown!r} is in memory; studies must persist: name a file")
    path = Path(database).resolve()
    if path.exists():
        if not path.is_file():
            raise StorageError(f"storage: {shown!r} points at {str(path)!r}, which is not a file")
        return
    if not create:
        raise StorageError(
            f"storage: no database at {str(path)!r} ({shown}); run a search first, or pass --storage"
        )
    if path.parent == storage_home():  # the default home: made on first use (open_storage)
        existing = next(p for p in (path.parent, *path.parent.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise StorageError(
                f"storage: the storage home {str(path.parent)!r} (${HOME_ENV}, else the default) cannot be "
                f"made: {str(existing)!r} is not a writable directory; set {HOME_ENV} or pass --storage"
            )
        return
    if not path.parent.is_dir():
        raise StorageError(
            f"storage: directory {str(path.parent)!r} of {shown!r} does not exist; "
            "create it or pass --storage"
        )
    if not os.access(path.parent, os.W_OK):
        raise StorageError(f"storage: directory {str(path.parent)!r} of {shown!r} is not writable")


def shown_url(url: str | None) -> str:
    """The storage ``url`` (resolved: :func:`resolve_url`) as messages and the service show it:
    its password hidden, a SQLite file's path absolute."""
    return _shown(resolve_url(url))


def _shown(url: str) -> str:
    """``url`` as messages print it: password hidden, a SQLite file's path made absolute."""
    plain = plain_sqlite(url)
    if plain is not None:
        return f"sqlite:///{Path(plain).resolve()}"
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return url
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        parsed = parsed.set(database=str(Path(parsed.database).resolve()))
    return parsed.render_as_string(hide_password=True)

