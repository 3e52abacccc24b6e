"""The measurement cache: each plan is compiled once per workload and device, across studies.

A measurement depends on the workload (its shapes' fingerprint and its step's jaxpr, so an
edit to the model's code is a new workload), the plan (its digest), where it
was compiled (target and mesh), the device kind, the JAX version, the compiler options
(XLA flags included), libtpu's version for TPU (the compiler) and what a measurement means
(:data:`~remat_search.measurement.MEASUREMENT_SCHEMA`) — that tuple is the key of our own
table, ``remat_search_measurements``,
in the same database as optuna's tables. A new study with another budget, a re-run of a
finished search, or another host searching the same workload reuses every measurement in
it; :func:`reuse` re-judges a cached measurement against the new budget and tolerance.
"""

from __future__ import annotations

import datetime
import hashlib
import json

import sqlalchemy as sa

from remat_search.measurement import Measurement, gradient_failure
from remat_search.runner import DeviceInfo

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


def cache_key(device: DeviceInfo, plan_digest: str) -> dict[str, str]:
    """The key columns of one plan's measurement on ``device``."""
    backend = json.dumps({"target": device.target, "platform": device.platform, "mesh": device.mesh}, sort_keys=True)
    compiler = json.dumps({
        "options": device.compiler_options, "libtpu": device.compiler_version, "schema": device.measurement_schema,
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


def create_table(engine: sa.Engine) -> None:
    """Make the cache table if it is missing (optuna's tables are left alone)."""
    metadata.create_all(engine, tables=[measurements])


def lookup(engine: sa.Engine, device: DeviceInfo, plan_digest: str) -> tuple[Measurement, str, int] | None:
    """The cached measurement of a plan with the study and trial that made it, or None."""
    key = cache_key(device, plan_digest)
    query = sa.select(measurements.c.measurement, measurements.c.study, measurements.c.trial).where(
        *(measurements.c[column] == value for column, value in key.items())
    )
    try:
        with engine.connect() as connection:
            row = connection.execute(query).first()
    except sa.exc.OperationalError:  # no table yet: a database no search has written to
        return None
    if row is None:
        return None
    return Measurement.model_validate_json(row.measurement), row.study, row.trial


def store(engine: sa.Engine, device: DeviceInfo, m: Measurement, *, study: str, trial: int) -> None:
    """Keep ``m`` unless it failed (failures may be passing: a busy machine, a timeout) or was
    screened out (its peak is a prediction, not the compiler's).

    A measurement that ran replaces one that was only compiled (over an earlier budget), or
    one timed alone where it was timed against the anchor.
    """
    if m.status == "failed" or not m.compiled:
        return
    key = cache_key(device, m.plan_digest)
    row = {**key, "measurement": m.model_dump_json(), "study": study, "trial": trial,
           "created": datetime.datetime.now(datetime.UTC).replace(tzinfo=None)}
    where = [measurements.c[column] == value for column, value in key.items()]
    with engine.begin() as connection:
        old = connection.execute(sa.select(measurements.c.measurement).where(*where)).first()
        if old is None:
            try:
                connection.execute(measurements.insert().values(**row))
            except sa.exc.IntegrityError:  # another process stored it a moment ago
                pass
        elif m.status == "measured" and _timed_less(Measurement.model_validate_json(old.measurement), m):
            connection.execute(measurements.update().where(*where).values(**row))


def _timed_less(old: Measurement, new: Measurement) -> bool:
    """Whether ``new`` (which ran) tells more than ``old``: old was only compiled, or timed
    without the anchor where new was timed against it."""
    return old.status != "measured" or (bool(new.anchor_times) and not old.anchor_times)


def reuse(
    m: Measurement, *, budget: int, gradient_tolerance: float, repeats: int, anchored: bool = False
) -> Measurement | None:
    """``m`` judged against this study's budget, tolerance and timing; None if it must be
    measured again.

    A plan that ran is over budget if its peak is; one only compiled (over an earlier, smaller
    budget) must be run if it now fits, and one timed with fewer than ``repeats`` steps, or
    alone where the study times against the anchor (``anchored``), is timed again. The
    compiler's own out-of-memory is final.
    """
    peak = m.peak_bytes
    if m.status == "over_budget" and m.memory is None:  # the device itself cannot hold it
        return m
    if peak is None:
        return None
    if peak > budget:
        return m.model_copy(update={
            "status": "over_budget", "step_times": (), "anchor_times": (), "time_source": None, "estimated_seconds": None,
            "grad_max_abs_error": None, "grad_rel_error": None, "grad_reference": None, "grad_skipped": None,
            "error": None,
        })
    if m.status != "measured" or (
        m.time_source == "measured" and (len(m.step_times) < repeats or (anchored and not m.anchor_times))
    ):
        return None
    if m.grad_rel_error is not None and not m.grad_rel_error <= gradient_tolerance:
        return m.model_copy(update={
            "status": "failed", "error": gradient_failure(m.grad_rel_error, m.grad_reference, gradient_tolerance),
        })
    return m
