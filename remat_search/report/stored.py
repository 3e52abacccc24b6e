"""The one reader of studies: a stored study read straight from optuna's tables, no optuna, no JAX.

:func:`open_study` (and :func:`open_studies`) give a :class:`StoredStudy`, the interface every
reader of a stored study uses (the queries, the service and its page, the CLI's queries, the
planner's ``plan``): its trials as :class:`TrialResult` (:meth:`~StoredStudy.trials`,
:meth:`~StoredStudy.trial`, :meth:`~StoredStudy.report`, :meth:`~StoredStudy.params`), its
confirmed times (:attr:`~StoredStudy.confirmed`) and settlement
(:meth:`~StoredStudy.settlement`), its front and best plan at a budget
(:meth:`~StoredStudy.front`, :meth:`~StoredStudy.best`, :meth:`~StoredStudy.fastest`,
:meth:`~StoredStudy.untimed_within`), its progress (:meth:`~StoredStudy.count`,
:meth:`~StoredStudy.finished`; summarized by ``queries.summarize``). tests/report/test_reader.py
holds it to optuna's own reading of the same studies, on SQLite and PostgreSQL.

optuna's ``RDBStorage`` checks its schema with alembic on every open and reads a study by
loading every trial: half a second before the first row, and seconds at thousands of trials.
A query needs neither. :class:`StoredStudy` reads the same tables with plain SQL (``studies``,
``study_user_attributes``, ``trials``, ``trial_user_attributes``, ``trial_values``,
``trial_params``, as optuna's ``storages/_rdb/models.py`` defines them) and builds the same
:class:`TrialResult` and :class:`StudyReport` as :func:`results.study_report` does through
optuna. It only reads.

The best plan for a budget and the front come from the trials' objective values (0: the
search's step seconds, 1: peak bytes), fastest first, loading only the trials that can be the
answer: every plan's one time is its search time unless it was confirmed, and the confirmed
few are read in full. Each trial that would be the answer is read and checked as
:meth:`StudyReport.timed` would (measured, not reused, its plan's first such trial); should its
stored values disagree with its measurement (never, as the search writes them), the whole
study is read instead, so the answer is always :meth:`StudyReport.best`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from remat_search.errors import NoFeasiblePlan
from remat_search.report.results import (
    Settlement,
    StudyReport,
    TrialResult,
    confirmations,
    make_report,
    needs_params,
    pareto,
    rank,
    result_of,
    settlement,
)
from remat_search.plans.plan import RematPlan
from remat_search.store.attributes import (
    FAILURE_ATTR, INTERRUPTED, LAYERS_ATTR, MOVED, NO_REMAT_PEAK_ATTR, PLAN_ATTR, SETTINGS_ATTR, SPEC_ATTR,
)
from remat_search.store.reading import Reader, external_value, read_only, seconds_between
from remat_search.store.storage import no_such_study, resolve_url
from remat_search.units import format_bytes

# optuna's TrialState and TrialValueType, by the names its Enum columns store (literals in the
# SQL, so that PostgreSQL's enum types compare with them).
_TIMED = """
    SELECT t.trial_id, t.number, s.value, p.value FROM trials t
    JOIN trial_values s ON s.trial_id = t.trial_id AND s.objective = 0
    JOIN trial_values p ON p.trial_id = t.trial_id AND p.objective = 1
    WHERE t.study_id = :study AND t.state = 'COMPLETE' AND s.value_type = 'FINITE'"""


class _Point(NamedTuple):
    """A timed trial as its objective values place it (a confirmed one by its one time)."""

    trial_id: int
    number: int
    cost: float
    """The first objective: the step's seconds (per token, in a study of configurations)."""
    peak_bytes: float


class _Inconsistent(Exception):
    """A trial's stored values disagree with its measurement: read the whole study instead."""


class StoredStudy:
    """One study of a storage, read over an open connection (see :func:`open_study`)."""

    def __init__(self, connection: Reader, study_id: int, name: str, attrs: dict[str, Any]) -> None:
        self.connection = connection
        self.study_id = study_id
        self.name = name
        self.attrs = attrs
        """The study's user attributes."""
        self.budget = int(attrs.get("budget", 0))
        self.device: dict[str, Any] = attrs.get("device_info", {})
        self.confirmed = confirmations(attrs)
        """Confirmed times by trial number."""

    @property
    def searches_configurations(self) -> bool:
        """Whether the study searches batch, accumulation and mesh with the plan
        (``spec.configuration``): its trials' plans each carry a configuration."""
        searched = self.attrs.get(SPEC_ATTR)
        return isinstance(searched, dict) and bool(searched.get("configuration"))

    @property
    def gradient_tolerance(self) -> float | None:
        """The ``gradient_tolerance`` the study's last search held first steps to, in place of the
        check's measured threshold (None: the measured threshold)."""
        settings = self.attrs.get(SETTINGS_ATTR)
        tolerance = settings.get("gradient_tolerance") if isinstance(settings, dict) else None
        return float(tolerance) if isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool) else None

    def settlement(self) -> Settlement:
        """What the study's latest confirmation settled (empty if none)."""
        return settlement(self.attrs)

    # --- whole study -------------------------------------------------------------------
    def trials(self) -> list[TrialResult]:
        """Every trial's result, in trial order."""
        rows = self._rows("SELECT trial_id, number, state FROM trials WHERE study_id = :study ORDER BY trial_id")
        attrs = self._attrs(
            "SELECT a.trial_id, a.key, a.value_json FROM trial_user_attributes a "
            "JOIN trials t ON t.trial_id = a.trial_id WHERE t.study_id = :study"
        )
        return self._results(rows, attrs)

    def report(self) -> StudyReport:
        """The study's report, as :func:`results.study_report` builds it through optuna."""
        return make_report(self.name, self.attrs, self.trials())

    def trial(self, number: int) -> TrialResult | None:
        """Trial ``number``'s result (None if the study has no such trial)."""
        found = self._load(self._ids("number", [number]))
        return next(iter(found.values()), None)

    def with_plan(self, plan_json: str) -> list[TrialResult]:
        """The results of the trials of the plan whose canonical JSON is ``plan_json``
        (:meth:`RematPlan.to_json`), in trial order: found in SQL, without reading the others."""
        rows = self._rows(
            "SELECT a.trial_id FROM trial_user_attributes a JOIN trials t ON t.trial_id = a.trial_id "
            "WHERE t.study_id = :study AND a.key = :key AND a.value_json = :value",
            key=PLAN_ATTR, value=json.dumps(plan_json),
        )
        return list(self._load(sorted(r[0] for r in rows)).values())

    def no_remat_peak(self) -> int | None:
        """The compiled peak of the uniform no-remat plan (every layer ``none``) at the study's
        own batch and mesh, which a budget such as ``70%`` is a share of: as the search stored
        it where it resolved a share budget, else that of the study's first compiled trial of
        the plan; None where the study has neither (its space has no ``none``, it was not
        compiled yet, or it searches configurations and no search of it resolved a share budget)."""
        stored = self.attrs.get(NO_REMAT_PEAK_ATTR)
        if isinstance(stored, int) and not isinstance(stored, bool):
            return stored
        layers = self.attrs.get(LAYERS_ATTR)
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            return None
        for t in self.with_plan(RematPlan.uniform("none", layers).to_json()):
            if t.measurement is not None and t.measurement.compiled and t.peak_bytes is not None:
                return t.peak_bytes
        return None

    def params(self, *, numbers: Sequence[int] | None = None, state: str | None = None) -> dict[int, dict[str, object]]:
        """The parameters of the trials ``numbers`` (every trial if None) in optuna's ``state``
        (any if None), by trial number, as optuna gives them back (``FrozenTrial.params``):
        what the cost model is fitted to, with the trials' results."""
        where = "" if state is None else " AND state = :state"
        rows = self._rows(
            f"SELECT trial_id, number FROM trials WHERE study_id = :study{where}", **({} if state is None else {"state": state})
        )
        if numbers is not None:
            wanted = set(numbers)
            rows = [r for r in rows if r[1] in wanted]
        found = self._params([r[0] for r in rows])
        return {number: found.get(i, {}) for i, number in rows}

    def count(self) -> dict[str, int]:
        """How many trials are in each of optuna's states (``COMPLETE``: count; the Enum column
        reads back as the state's name, SQLite's text and PostgreSQL's enum alike)."""
        rows = self._rows("SELECT state, COUNT(*) FROM trials WHERE study_id = :study GROUP BY state")
        return {str(state): n for state, n in rows}

    def finished(self) -> list[float | None]:
        """The trials that count towards the spec's ``trials`` (as ``liveness.counts`` judges
        them: complete, screened out, or failed by the runner with its reason), one entry
        each: the seconds it took, start to completion (None where optuna kept no times)."""
        rows = self._rows(
            "SELECT t.datetime_start, t.datetime_complete FROM trials t WHERE t.study_id = :study AND ("
            "t.state IN ('COMPLETE', 'PRUNED') OR (t.state = 'FAIL' AND EXISTS ("
            "SELECT 1 FROM trial_user_attributes a WHERE a.trial_id = t.trial_id AND a.key = :failure "
            "AND a.value_json NOT IN (:interrupted, :moved, 'null'))))",
            failure=FAILURE_ATTR, interrupted=json.dumps(INTERRUPTED), moved=json.dumps(MOVED),
        )
        return [seconds_between(start, end) for start, end in rows]

    # --- the best plan and the front, from the objective values ---------------------------
    def best(self, budget: int) -> TrialResult:
        """:meth:`StudyReport.best`: the fastest timed plan that fits ``budget`` (else
        :class:`NoFeasiblePlan`, naming the smallest peak), reading only the trials that can
        be the answer."""
        found = self._fastest(budget)
        if found is None:
            raise self._nothing_fits(budget)
        return found

    def fastest(self) -> TrialResult | None:
        """The fastest timed plan whatever its peak (None if none was timed): the front's
        fastest."""
        return self._fastest(None)

    def _fastest(self, budget: int | None) -> TrialResult | None:
        try:
            return self._best(budget)
        except _Inconsistent:
            return min((t for t in self.report().timed() if _fits(t, budget)), key=rank, default=None)

    def front(self) -> list[TrialResult]:
        """:attr:`StudyReport.front`, reading only the trials on it (and those they replace)."""
        try:
            return self._front()
        except _Inconsistent:
            return list(self.report().front)

    def trials_within(self, budget: int) -> list[TrialResult]:
        """The timed trials whose compiled peak fits ``budget`` (by indexed SQL on the peak)."""
        return [t for t in self._within(budget, "FINITE") if t.seconds is not None]

    def untimed_within(self, budget: int) -> list[TrialResult]:
        """:meth:`StudyReport.untimed_within`: compiled over the study's budget, within ``budget``."""
        return [
            t for t in self._within(budget, "INF_POS")
            if t.status == "over_budget" and t.reused_from is None and t.measurement is not None
            and t.measurement.compiled and t.peak_bytes is not None and t.peak_bytes <= budget
        ]

    def _within(self, budget: int, step: Literal["FINITE", "INF_POS"]) -> list[TrialResult]:
        """The complete trials whose peak objective is within ``budget`` and whose step objective
        is of optuna's ``value_type`` ``step`` (``FINITE``: timed; ``INF_POS``: never run)."""
        rows = self._rows(
            "SELECT t.trial_id FROM trials t "
            "JOIN trial_values s ON s.trial_id = t.trial_id AND s.objective = 0 "
            "JOIN trial_values p ON p.trial_id = t.trial_id AND p.objective = 1 "
            f"WHERE t.study_id = :study AND t.state = 'COMPLETE' AND s.value_type = '{step}' "  # an enum in PostgreSQL
            "AND p.value <= :budget ORDER BY t.trial_id",
            budget=float(budget),  # the values are floats; an int past 2**63 is no SQLite INTEGER
        )
        return list(self._load([r[0] for r in rows]).values())

    def _best(self, budget: int | None) -> TrialResult | None:
        limit = "" if budget is None else " AND p.value <= :budget"
        confirmed = self._confirmed()
        rivals: list[TrialResult] | None = None  # the confirmed plans that are timed and fit
        stream = self.connection.stream(
            _TIMED + limit + " ORDER BY s.value, p.value, t.number",
            study=self.study_id, budget=None if budget is None else float(budget),  # as at untimed_within
        )
        for batch in iter(lambda: list(itertools.islice(stream, 16)), []):
            points = [_Point(*row) for row in batch if row[0] not in confirmed]
            loaded = self._load([p.trial_id for p in points])
            timed = self._timed({**loaded, **confirmed} if rivals is None else loaded)  # one look-up for both
            if rivals is None:
                rivals = [t for i, t in timed.items() if i in confirmed and _fits(t, budget)]
            for p in points:  # fastest first: the first timed one is the fastest unconfirmed plan
                if p.trial_id in timed:
                    stream.close()
                    return min([_consistent(timed[p.trial_id], p), *rivals], key=rank)
        if rivals is None:
            rivals = [t for t in self._timed(confirmed).values() if _fits(t, budget)]
        return min(rivals, key=rank, default=None)

    def _front(self) -> list[TrialResult]:
        confirmed = self._confirmed()
        ones = {i: t.cost for i, t in confirmed.items() if t.cost is not None}
        points = [
            p._replace(cost=ones[p.trial_id]) if p.trial_id in ones else p
            for p in (_Point(*row) for row in self._rows(_TIMED))
        ]
        loaded = dict(confirmed)
        while True:  # drop each plan on the front that is not timed until none is
            front = pareto(points)
            loaded.update(self._load([p.trial_id for p in front if p.trial_id not in loaded]))
            timed = self._timed({p.trial_id: loaded[p.trial_id] for p in front})
            if len(timed) == len(front):
                return [_consistent(loaded[p.trial_id], p) for p in front]
            dropped = {p.trial_id for p in front} - timed.keys()
            points = [p for p in points if p.trial_id not in dropped]

    def _nothing_fits(self, budget: int) -> NoFeasiblePlan:
        """:meth:`StudyReport.best`'s error: the smallest compiled peak, by its trial. A
        complete trial's peak is its objective 1; the others (failed, running) are read."""
        smallest = self._rows(
            "SELECT t.trial_id FROM trials t JOIN trial_values p ON p.trial_id = t.trial_id AND p.objective = 1 "
            "WHERE t.study_id = :study AND t.state = 'COMPLETE' AND p.value_type = 'FINITE' "
            "ORDER BY p.value, t.trial_id LIMIT 1"
        )
        others = self._rows(
            "SELECT DISTINCT t.trial_id FROM trials t JOIN trial_user_attributes a ON a.trial_id = t.trial_id "
            "WHERE t.study_id = :study AND t.state <> 'COMPLETE' AND a.key = 'measurement'"
        )
        loaded = self._load(sorted(r[0] for r in [*smallest, *others]))
        peaks = [t for t in loaded.values() if t.peak_bytes is not None and t.measurement and t.measurement.compiled]
        if not peaks:
            return NoFeasiblePlan(f"budget: study {self.name!r} has no measured plan yet")
        smallest_t = min(peaks, key=lambda t: t.peak_bytes)  # type: ignore[arg-type, return-value]
        return NoFeasiblePlan(
            f"budget: no measured plan of study {self.name!r} fits {format_bytes(budget)}; the "
            f"smallest peak measured is {format_bytes(smallest_t.peak_bytes)} "  # type: ignore[arg-type]
            f"(trial {smallest_t.number}: {smallest_t.summary()})"
        )

    # --- reading trials ---------------------------------------------------------------------
    def _confirmed(self) -> dict[int, TrialResult]:
        """The confirmed trials' results, by trial id."""
        return self._load(self._ids("number", list(self.confirmed)))

    def _timed(self, results: Mapping[int, TrialResult]) -> dict[int, TrialResult]:
        """Those of ``results`` (by trial id) that :meth:`StudyReport.timed` keeps: measured,
        not reused, and the first such trial of their plan. Earlier trials of the same plan
        are found by its stored text: the plan's canonical JSON, whose hash is its digest."""
        measured = {i: t for i, t in results.items() if _measured(t)}
        if not measured:
            return {}
        plans = self._rows(
            "SELECT a.trial_id, a.value_json FROM trial_user_attributes a WHERE a.key = 'plan' AND a.trial_id IN :ids",
            ids=list(measured),
        )
        texts = {i: value for i, value in plans}
        same = self._rows(
            "SELECT a.trial_id, a.value_json FROM trial_user_attributes a JOIN trials t ON t.trial_id = a.trial_id "
            "WHERE t.study_id = :study AND a.key = 'plan' AND a.value_json IN :texts AND t.trial_id < :last",
            texts=sorted(set(texts.values())), last=max(measured),
        )
        earlier = self._load(sorted({i for i, _ in same} - measured.keys()))
        earlier.update(measured)
        firsts: dict[str, int] = {}  # plan digest → its first measured, unreused trial
        for i in sorted(earlier):
            t = earlier[i]
            if _measured(t):
                firsts.setdefault(t.measurement.plan_digest, i)  # type: ignore[union-attr]
        return {i: t for i, t in measured.items() if firsts[t.measurement.plan_digest] == i}  # type: ignore[union-attr]

    def _ids(self, column: str, values: list[int]) -> list[int]:
        """The trial ids of this study's trials whose ``column`` is in ``values``."""
        if not values:
            return []
        rows = self._rows(f"SELECT trial_id FROM trials WHERE study_id = :study AND {column} IN :values", values=values)
        return sorted(r[0] for r in rows)

    def _load(self, trial_ids: Sequence[int]) -> dict[int, TrialResult]:
        """The results of the trials ``trial_ids``, by trial id, in trial order."""
        if not trial_ids:
            return {}
        rows = self._rows(
            "SELECT trial_id, number, state FROM trials WHERE trial_id IN :ids ORDER BY trial_id", ids=list(trial_ids)
        )
        attrs = self._attrs(
            "SELECT trial_id, key, value_json FROM trial_user_attributes WHERE trial_id IN :ids", ids=list(trial_ids)
        )
        return dict(zip((r[0] for r in rows), self._results(rows, attrs), strict=True))

    def _results(self, rows: Iterable[Sequence[Any]], attrs: dict[int, dict[str, Any]]) -> list[TrialResult]:
        rows = list(rows)
        wanted = [r[0] for r in rows if needs_params(attrs.get(r[0], {}))]
        params = self._params(wanted)
        return [
            result_of(number, str(state), attrs.get(i, {}), params.get(i, {}), self.confirmed.get(number))
            for i, number, state in rows
        ]

    def _params(self, trial_ids: list[int]) -> dict[int, dict[str, object]]:
        """The parameters of ``trial_ids`` in their external form (a categorical's choice)."""
        if not trial_ids:
            return {}
        out: dict[int, dict[str, object]] = {}
        rows = self._rows(
            "SELECT trial_id, param_name, param_value, distribution_json FROM trial_params WHERE trial_id IN :ids",
            ids=trial_ids,
        )
        for i, name, value, distribution in rows:
            out.setdefault(i, {})[name] = external_value(value, distribution)
        return out

    def _attrs(self, sql: str, **params: Any) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for i, key, value in self._rows(sql, **params):
            out.setdefault(i, {})[key] = json.loads(value)
        return out

    def _rows(self, sql: str, **params: Any) -> list[Sequence[Any]]:
        return self.connection.rows(sql, **{"study": self.study_id, **params})


@contextlib.contextmanager
def open_study(name: str, storage: str | None = None) -> Iterator[StoredStudy]:
    """Study ``name`` of ``storage`` (the default storage if None), read-only, while the block
    runs; a missing study is a :class:`StorageError` listing those there."""
    url = resolve_url(storage)
    with read_only(url) as connection:
        yield _stored(connection, name, url)


@contextlib.contextmanager
def open_studies(storage: str | None = None) -> Iterator[list[StoredStudy]]:
    """Every study of ``storage``, by name, read-only, while the block runs."""
    url = resolve_url(storage)
    with read_only(url) as connection:
        if not connection.has_table("studies"):  # a new database: no worker has opened it
            yield []
            return
        names = [r[0] for r in connection.rows("SELECT study_name FROM studies ORDER BY study_name")]
        yield [_stored(connection, n, url) for n in names]


def _stored(connection: Reader, name: str, url: str) -> StoredStudy:
    found = connection.rows("SELECT study_id FROM studies WHERE study_name = :name", name=name)
    if not found:
        known = [r[0] for r in connection.rows("SELECT study_name FROM studies")]
        raise no_such_study(name, url, known)
    found = found[0]
    rows = connection.rows("SELECT key, value_json FROM study_user_attributes WHERE study_id = :study", study=found[0])
    return StoredStudy(connection, found[0], name, {key: json.loads(value) for key, value in rows})


def _measured(t: TrialResult) -> bool:
    return t.status == "measured" and t.reused_from is None and t.measurement is not None


def _fits(t: TrialResult, budget: int | None) -> bool:
    return t.peak_bytes is not None and (budget is None or t.peak_bytes <= budget)


def _consistent(t: TrialResult, p: _Point) -> TrialResult:
    """``t``, checked against the values it was placed by."""
    if (t.cost, t.peak_bytes) != (p.cost, p.peak_bytes):
        raise _Inconsistent(f"trial {t.number}: values {p.cost, p.peak_bytes} != {t.cost, t.peak_bytes}")
    return t

