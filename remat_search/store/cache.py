"""The measurement cache: each plan is compiled once per workload and device, across studies.

A measurement depends on the workload (its shapes' fingerprint and its step's jaxpr, so an
edit to the model's code is a new workload), the plan (its digest), where it
was compiled (target and mesh), the device kind, the JAX version, the compiler options
(XLA flags included), the compiler's packages (jaxlib; libtpu for TPU, the CUDA plugin for
GPU: :func:`device.compiler_packages`) and what a measurement means
(:data:`~remat_search.measure.measurement.MEASUREMENT_SCHEMA`) — that tuple is the key of our own
table, ``remat_search_measurements``,
in the same database as optuna's tables. It keeps raw measurements only (what the compiler
and the clock said, whatever the budget): a new study with another budget, a re-run of a
finished search, or another host searching the same workload judges each one it finds against
its own budget and tolerance (:func:`measurement.judge`), unless :func:`measure_again` says it
cannot be judged as it is.

Plans whose text differs may compile to the same program (``names`` of a tensor the model
never tags, and ``full``): each measurement is also kept by the digest of its compiled
program, in ``remat_search_programs`` under the same key but the plan's, so that a plan
compiled to a program measured before is not run again (:func:`lookup_program`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import sqlalchemy as sa

from remat_search.measure.device import DeviceInfo
from remat_search.measure.measurement import Measurement, RawMeasurement
from remat_search.spec.workloads import MESH_AXES
from remat_search.store.attributes import host_name

metadata = sa.MetaData()
measurements = sa.Table(
    "remat_search_measurements",
    metadata,
    sa.Column("workload", sa.String(64), primary_key=True),
    sa.Column("program", sa.String(64), primary_key=True),
    sa.Column("plan", sa.String(64), primary_key=True),
    sa.Column("backend", sa.String(255), primary_key=True),
    sa.Column("device_kind", sa.String(128), primary_key=True),
    sa.Column("jax_version", sa.String(32), primary_key=True),
    sa.Column("compiler_options", sa.String(64), primary_key=True),
    sa.Column("measurement", sa.Text, nullable=False),
    sa.Column("study", sa.String(128)),
    sa.Column("trial", sa.Integer),
    sa.Column("created", sa.DateTime),
)


programs = sa.Table(
    "remat_search_programs",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("measurement", sa.Text, nullable=False),
    sa.Column("study", sa.String(128)),
    sa.Column("trial", sa.Integer),
    sa.Column("created", sa.DateTime),
)
"""Raw measurements by the hash of their cache key with the compiled program's digest in the
plan's place (see :func:`lookup_program`); the plan that was measured is in the measurement."""


claims = sa.Table(
    "remat_search_claims",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("study", sa.String(512), nullable=False),
    sa.Column("trial", sa.Integer, nullable=False),
    sa.Column("created", sa.DateTime),
)
"""Plans being measured now, by the hash of their cache key: a search claims a plan before it
measures it, so no plan is measured twice at once by the searches sharing a database (another
search that wants it waits for the measurement). The claim names the trial that holds it: a
claim whose trial is no longer running is stale (its process died) and may be taken over."""


def cache_key(device: DeviceInfo, plan_digest: str) -> dict[str, str]:
    """The key columns of one plan's measurement on ``device``."""
    layout = _layout_digest(device)
    backend = json.dumps({
        "target": device.target, "platform": device.platform, "mesh": device.mesh,
        **({"processes": device.processes} if device.processes > 1 else {}),
        **({"shardings": device.sharding_digest} if device.sharding_digest else {}),
        **({"layout": layout} if layout else {}),
    }, sort_keys=True)
    compiler = json.dumps({
        "options": device.compiler_options, "libtpu": device.compiler_version, "schema": device.measurement_schema,
        "packages": device.compiler_packages,
    }, sort_keys=True)
    return {
        "workload": device.workload_fingerprint,
        "program": device.program_fingerprint,
        "plan": plan_digest,
        "backend": backend,
        "device_kind": device.device_kind,
        "jax_version": device.jax_version,
        "compiler_options": hashlib.sha256(compiler.encode()).hexdigest()[:16],
    }


def _layout_digest(device: DeviceInfo) -> str:
    """A hash of how the mesh lays out the devices, where that is not what every cached
    measurement before it assumed (the devices in their own order, over the built-in axes in
    their order, which ``backend``'s mesh then says in full): "" where it is that. The order of
    the axes and of the devices over them decides a program's collectives and memory."""
    if device.mesh is None or (device.device_order is None and set(device.mesh) <= set(MESH_AXES)):
        return ""
    layout = json.dumps({"axes": list(device.mesh), "devices": device.device_order})
    return hashlib.sha256(layout.encode()).hexdigest()[:16]


class Cached(NamedTuple):
    """A cached raw measurement, with the study and trial that measured it, and when it was kept
    (UTC; None where the database did not say)."""

    raw: RawMeasurement
    study: str
    trial: int
    created: datetime.datetime | None = None


def create_table(engine: sa.Engine) -> None:
    """Make the cache's tables if they are missing (optuna's tables are left alone). Searches
    that start at once may race to make them: the database refuses all but the first, which is fine."""
    for attempt in range(5):
        try:
            metadata.create_all(engine, tables=[measurements, programs, claims])  # checks first
            return
        except (sa.exc.ProgrammingError, sa.exc.IntegrityError, sa.exc.OperationalError):
            # Another search made one of them just now, maybe while this one made the one before:
            # "table … already exists" can come once a table, so check again until all are there.
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def claim(engine: sa.Engine, device: DeviceInfo, plan_digest: str, *, study: str, trial: int) -> tuple[str, int] | None:
    """Claim the plan for ``study``'s ``trial`` to measure: None where it is ours now (or was
    already), else the ``(study, trial)`` that holds it."""
    key = _claim_key(device, plan_digest)
    try:
        with engine.begin() as connection:  # the insert's own transaction: a conflict rolls it back
            connection.execute(claims.insert().values(
                key=key, study=study, trial=trial, created=datetime.datetime.now(datetime.UTC).replace(tzinfo=None),
            ))
        return None
    except sa.exc.IntegrityError:
        pass
    with engine.connect() as connection:
        row = connection.execute(sa.select(claims.c.study, claims.c.trial).where(claims.c.key == key)).first()
    if row is None:  # released a moment ago
        return claim(engine, device, plan_digest, study=study, trial=trial)
    return None if (row.study, row.trial) == (study, trial) else (row.study, row.trial)


def release(engine: sa.Engine, device: DeviceInfo, plan_digest: str, *, study: str, trial: int) -> None:
    """Give up ``study``'s ``trial``'s claim of the plan (nothing where another holds it): after
    its measurement is stored, or when the claim is stale and is taken over."""
    with engine.begin() as connection:
        connection.execute(claims.delete().where(
            claims.c.key == _claim_key(device, plan_digest), claims.c.study == study, claims.c.trial == trial,
        ))


@contextlib.contextmanager
def confirmation_claim(engine: sa.Engine, study: str, *, interval: float, grace: float) -> Iterator[str | None]:
    """Claim ``study``'s confirmation while the block runs, so that the searches and workers
    sharing a study confirm it once, not once each: yields None where this process holds it,
    else who holds it (``host pid``), and the block should leave the confirmation to them.

    The holder's row in ``remat_search_claims`` counts beats, one every ``interval`` seconds; a
    holder whose count has not moved for ``grace`` seconds, as the waiting process's own
    monotonic clock measures it, is dead and its claim is taken over. No two hosts' clocks are
    compared."""
    key = hashlib.sha256(f"confirm\0{study}".encode()).hexdigest()
    me = f"{host_name()} {os.getpid()} {uuid.uuid4().hex[:8]}"
    holder = _take_confirmation(engine, key, me, interval=interval, grace=grace)
    if holder is not None:
        yield holder.rsplit(" ", 1)[0]
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            with contextlib.suppress(sa.exc.SQLAlchemyError), engine.begin() as connection:
                connection.execute(
                    claims.update().where(claims.c.key == key, claims.c.study == me).values(trial=claims.c.trial + 1)
                )

    beating = threading.Thread(target=beat, name="confirmation-heartbeat", daemon=True)
    beating.start()
    try:
        yield None
    finally:
        stop.set()
        beating.join()
        with engine.begin() as connection:
            connection.execute(claims.delete().where(claims.c.key == key, claims.c.study == me))


def _take_confirmation(engine: sa.Engine, key: str, me: str, *, interval: float, grace: float) -> str | None:
    """Take the confirmation claim ``key`` for ``me``: None once it is ours, else its live holder."""
    try:
        with engine.begin() as connection:
            connection.execute(claims.insert().values(key=key, study=me, trial=0))
        return None
    except sa.exc.IntegrityError:
        pass
    seen = _holder(engine, key)
    deadline = time.monotonic() + grace
    while seen is not None and time.monotonic() < deadline:
        time.sleep(min(interval / 4, max(0.0, deadline - time.monotonic())))
        now = _holder(engine, key)
        if now != seen:  # it beat (alive) or let go (done): either way, theirs to finish
            return (now or seen)[0]
    if seen is None:  # let go before we looked: take it afresh
        return _take_confirmation(engine, key, me, interval=interval, grace=grace)
    with engine.begin() as connection:  # silent for `grace`: dead; take it over, unless another just did
        taken = connection.execute(
            claims.update().where(claims.c.key == key, claims.c.study == seen[0], claims.c.trial == seen[1])
            .values(study=me, trial=seen[1] + 1)
        ).rowcount
    return None if taken == 1 else seen[0]


def _holder(engine: sa.Engine, key: str) -> tuple[str, int] | None:
    with engine.connect() as connection:
        row = connection.execute(sa.select(claims.c.study, claims.c.trial).where(claims.c.key == key)).first()
    return (row.study, row.trial) if row is not None else None


def _claim_key(device: DeviceInfo, plan_digest: str) -> str:
    return hashlib.sha256(json.dumps(cache_key(device, plan_digest), sort_keys=True).encode()).hexdigest()


def _program_key(device: DeviceInfo, program_digest: str) -> str:
    """The key of ``remat_search_programs``: the cache key with the program in the plan's place."""
    key = {**cache_key(device, ""), "plan": None, "program_digest": program_digest}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def lookup_program(engine: sa.Engine, device: DeviceInfo, program_digest: str) -> Cached | None:
    """A cached raw measurement of a plan compiled to the program ``program_digest``
    (``executables.program_digest``) on ``device``, with the study and trial that made it, or
    None. As :func:`lookup`, whose every measurement since programs were kept this also holds."""
    with engine.connect() as connection:
        if not sa.inspect(connection).has_table(programs.name):
            return None
        row = connection.execute(
            sa.select(programs.c.measurement, programs.c.study, programs.c.trial)
            .where(programs.c.key == _program_key(device, program_digest))
        ).first()
    if row is None:
        return None
    return Cached(RawMeasurement.model_validate_json(row.measurement), row.study, row.trial)


def lookup(engine: sa.Engine, device: DeviceInfo, plan_digest: str) -> Cached | None:
    """The cached raw measurement of a plan with the study and trial that made it, or None
    (also where no search has made the table yet). Errors of the database (one that is
    locked, one that cannot be read) propagate: a plan is not measured again for them."""
    key = cache_key(device, plan_digest)
    query = sa.select(measurements.c.measurement, measurements.c.study, measurements.c.trial, measurements.c.created).where(
        *(measurements.c[column] == value for column, value in key.items())
    )
    with engine.connect() as connection:
        if not sa.inspect(connection).has_table(measurements.name):  # a database no search has written to
            return None
        row = connection.execute(query).first()
    if row is None:
        return None
    return Cached(RawMeasurement.model_validate_json(row.measurement), row.study, row.trial, row.created)


def store(engine: sa.Engine, device: DeviceInfo, m: Measurement, *, study: str, trial: int) -> None:
    """Keep the raw part of ``m`` unless it failed (failures may be passing: a busy machine, a
    timeout) or was screened out (its peak is a prediction, not the compiler's).

    A raw measurement that tells more replaces the one kept (see :func:`_told`): one that ran
    replaces one only compiled (over an earlier budget), one timed against the anchor one
    timed alone. A compiled program's is kept by the same rule (:func:`lookup_program`).
    """
    if m.status == "failed" or not m.compiled:
        return
    raw = m.raw
    kept = {"measurement": raw.model_dump_json(), "study": study, "trial": trial,
            "created": datetime.datetime.now(datetime.UTC).replace(tzinfo=None)}
    _keep(engine, measurements, cache_key(device, m.plan_digest), kept, raw)
    if raw.program_digest is not None:
        _keep(engine, programs, {"key": _program_key(device, raw.program_digest)}, kept, raw)


def _keep(engine: sa.Engine, table: sa.Table, key: dict[str, str], kept: dict, raw: RawMeasurement) -> None:
    """Insert the row ``key`` + ``kept`` into ``table``, or replace the one there where ``raw``
    tells more (:func:`_told`)."""
    where = [table.c[column] == value for column, value in key.items()]
    with engine.begin() as connection:
        old = connection.execute(sa.select(table.c.measurement).where(*where)).first()
        if old is None:
            try:
                connection.execute(table.insert().values(**key, **kept))
            except sa.exc.IntegrityError:  # another process stored it a moment ago
                pass
        elif _told(raw) > _told(RawMeasurement.model_validate_json(old.measurement)):
            connection.execute(table.update().where(*where).values(**key, **kept))


def _told(raw: RawMeasurement) -> tuple[bool, bool, int]:
    """How much ``raw`` tells, to compare two of one plan: timed (or estimated) at all, then
    timed against the anchor, then by how many repeats."""
    return raw.time_source is not None, bool(raw.anchor_times), len(raw.step_times)


def measure_again(raw: RawMeasurement, *, budget: int, repeats: int, anchored: bool) -> bool:
    """Whether a cached raw measurement must be measured again for a study with this
    ``budget`` and timing, rather than judged as it is.

    It must where it fits ``budget`` but never ran (it was over an earlier, smaller budget),
    or was timed with fewer than ``repeats`` steps, or alone where the study times against the
    anchor (``anchored``). Over the budget it is judged as it is; so is a plan the compiler ran
    out of memory for (final, whatever the budget).
    """
    if raw.memory is None:
        return raw.oom_required_bytes is None  # never compiled: nothing to judge
    if raw.memory.peak > budget:
        return False
    if raw.time_source == "measured":
        return len(raw.step_times) < repeats or (anchored and not raw.anchor_times)
    return raw.time_source is None
