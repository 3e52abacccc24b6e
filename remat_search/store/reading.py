"""The queries' read-only connection to a storage: plain SQL rows with named parameters,
over the standard library's ``sqlite3`` for a SQLite file (no SQLAlchemy import, a quarter of
a second of a query's wall time) and over SQLAlchemy otherwise; never through optuna. Optuna's
columns as read back: a parameter's external value (:func:`external_value`), the seconds between
two of its datetimes (:func:`seconds_between`)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import re
import sqlite3
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from remat_search.store.storage import (
    SQLITE_BUSY_TIMEOUT_SECONDS,
    check_storage,
    plain_sqlite,
    resolve_url,
    translate_errors,
)

if TYPE_CHECKING:
    import sqlalchemy


class Reader:
    """A read-only connection for the queries: rows of plain SQL with named parameters
    (``:name``; a list expands where the SQL says ``IN :name``)."""

    def __init__(self, execute: Callable[[str, dict[str, Any]], Iterator[tuple]], tables: Callable[[], set[str]]) -> None:
        self._execute, self._tables = execute, tables

    def stream(self, sql: str, **params: Any) -> Iterator[tuple]:
        """The rows of ``sql``, read as they are taken (stop early: the rest is never read)."""
        return self._execute(sql, params)

    def rows(self, sql: str, **params: Any) -> list[tuple]:
        return list(self._execute(sql, params))

    def has_table(self, name: str) -> bool:
        return name in self._tables()


@contextlib.contextmanager
def read_only(url: str | None = None) -> Iterator[Reader]:
    """A :class:`Reader` of the storage at ``url`` (see :func:`check_storage`: a missing
    SQLite file is an error), without optuna: no table is made, no pragma but ``query_only``
    set on SQLite, so that a query cannot write even by mistake. A SQLite file is read with the
    standard library's ``sqlite3``, without importing SQLAlchemy (a quarter of a second of a
    query's wall time); other databases through SQLAlchemy. Its errors are translated
    (:func:`translate_errors`), the block's own too."""
    url = resolve_url(url)
    engine_kwargs = check_storage(url)
    plain = plain_sqlite(url)
    with translate_errors(url):
        if plain is not None:
            connection = sqlite3.connect(plain, timeout=SQLITE_BUSY_TIMEOUT_SECONDS)
            try:
                connection.execute("PRAGMA query_only = ON")
                yield Reader(
                    lambda sql, params: _sqlite_rows(connection, sql, params),
                    lambda: {r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")},
                )
            finally:
                connection.close()
            return
        import sqlalchemy

        engine = sqlalchemy.create_engine(url, **engine_kwargs)
        try:
            with engine.connect() as connection:
                if engine.dialect.name == "sqlite":
                    connection.exec_driver_sql("PRAGMA query_only = ON")
                yield Reader(
                    lambda sql, params: _sqlalchemy_rows(connection, sql, params),
                    lambda: set(sqlalchemy.inspect(connection).get_table_names()),
                )
        finally:
            engine.dispose()


def _sqlite_rows(connection: sqlite3.Connection, sql: str, params: dict[str, Any]) -> Iterator[tuple]:
    """``sql``'s rows through sqlite3, each list parameter ``:name`` expanded to ``(:name_0, …)``."""
    lists = {k: v for k, v in params.items() if isinstance(v, list)}
    sql = re.sub(
        r":(\w+)", lambda m: f"({', '.join(f':{m[1]}_{i}' for i in range(len(lists[m[1]])))})" if m[1] in lists else m[0],
        sql,
    )
    flat = {k: v for k, v in params.items() if k not in lists}
    flat.update({f"{k}_{i}": x for k, v in lists.items() for i, x in enumerate(v)})
    cursor = connection.execute(sql, flat)
    try:
        for batch in iter(lambda: cursor.fetchmany(64), []):
            yield from batch
    finally:
        cursor.close()


def _sqlalchemy_rows(connection: sqlalchemy.Connection, sql: str, params: dict[str, Any]) -> Iterator[tuple]:
    """``sql``'s rows through SQLAlchemy, list parameters expanding."""
    from sqlalchemy import bindparam, text

    statement = text(sql)
    for name, value in params.items():
        if isinstance(value, list):
            statement = statement.bindparams(bindparam(name, expanding=True))
    result = connection.execute(statement, params)
    try:
        for batch in iter(lambda: result.fetchmany(64), []):
            yield from (tuple(row) for row in batch)
    finally:
        result.close()


def external_value(value: float, distribution_json: str) -> object:
    """A parameter as optuna gives it back (``distributions.json_to_distribution(...)
    .to_external_repr(value)``): a categorical's choice by index, an integer as int, a float
    as it is; both of optuna's JSON forms of a distribution are read."""
    kind, choices = _distribution(distribution_json)
    if kind in ("CategoricalDistribution", "categorical"):
        return choices[int(value)]
    if kind in ("IntDistribution", "IntUniformDistribution", "IntLogUniformDistribution", "int"):
        return int(value)
    return value


@functools.lru_cache(maxsize=256)
def _distribution(distribution_json: str) -> tuple[str | None, tuple[Any, ...]]:
    """A distribution's kind and (a categorical's) choices, parsed once a text: a study's
    trials share a few distributions, stored again with every parameter."""
    d = json.loads(distribution_json)
    kind = d.get("name") or d.get("type")
    categorical = kind in ("CategoricalDistribution", "categorical")
    return kind, tuple(d.get("attributes", d)["choices"]) if categorical else ()


def seconds_between(start: Any, end: Any) -> float | None:
    """Seconds from ``start`` to ``end``, optuna's datetime columns as read back (a datetime
    from PostgreSQL, its ISO text from SQLite); None if either is missing."""
    if start is None or end is None:
        return None
    times = [t if isinstance(t, datetime.datetime) else datetime.datetime.fromisoformat(str(t)) for t in (start, end)]
    return max(0.0, (times[1] - times[0]).total_seconds())
