"""Progress and the estimated time to finish (``studies``, ``GET /studies``): trials done of the
spec's, running, and the finished trials' mean time × the trials left ÷ the trials running, read
from optuna's own start and completion times, on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime
from typing import Any

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState

from remat_search.report.queries import estimate_seconds, list_studies
from remat_search.store.attributes import FAILURE_ATTR, INTERRUPTED, SPEC_ATTR

START = datetime.datetime(2030, 1, 1, 12, 0, 0)


def _study_mid_search(url: str) -> None:
    """Study ``mid`` of 6 trials: one complete in 10 s, one screened out (pruned) in 20 s, one
    failed by the runner in 30 s (all three count), one interrupted (it does not: its plan is
    measured again), two running."""
    study = optuna.create_study(study_name="mid", storage=url, directions=["minimize", "minimize"])
    study.set_user_attr(SPEC_ATTR, {"trials": 6, "budget": 2**20, "target": "local"})
    study.set_user_attr("device_info", {"target": "local", "platform": "cpu", "device_kind": "cpu", "executes": True})
    study.tell(study.ask(), [0.01, 1000.0])
    study.tell(study.ask(), state=TrialState.PRUNED)
    for reason in ("compile failed: boom", INTERRUPTED):
        trial = study.ask()
        trial.set_user_attr(FAILURE_ATTR, reason)
        study.tell(trial, state=TrialState.FAIL)
    study.ask(), study.ask()
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as db:
        for number, seconds in ((0, 10), (1, 20), (2, 30), (3, 500)):
            db.execute(
                sqlalchemy.text("UPDATE trials SET datetime_start = :start, datetime_complete = :end WHERE number = :n")
                .bindparams(sqlalchemy.bindparam("start", type_=sqlalchemy.DateTime),  # SQLAlchemy's own conversion:
                            sqlalchemy.bindparam("end", type_=sqlalchemy.DateTime)),   # sqlite3's adapter is deprecated (3.12)
                {"start": START, "end": START + datetime.timedelta(seconds=seconds), "n": number},
            )
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, storage_url: str) -> str:
    return storage_url if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def test_progress_and_the_time_to_finish_come_from_the_trials(url: str, cli: Any) -> None:
    _study_mid_search(url)
    (mid,) = list_studies(url)
    assert (mid.done, mid.total, mid.running, mid.complete, mid.failed) == (3, 6, 2, 2, 2)
    assert mid.eta_seconds == pytest.approx(20 * 3 / 2)  # mean 20 s, 3 left, 2 at once

    table = cli("studies", "--storage", url)
    assert table.exit_code == 0, table.stderr
    cells = next([c.strip() for c in line.split("│")] for line in table.stdout.splitlines() if "│ mid" in line)
    assert "3/6" in cells and "~30 s" in cells and "2" in cells, cells


@pytest.mark.parametrize(("finished", "total", "running", "eta"), [
    ([10.0, 20.0], 6, 0, 60.0),  # nothing running: one at a time
    ([10.0, 20.0], 6, 2, 30.0),
    ([10.0, 20.0], 3, 4, 15.0),  # more running than left: the last one still takes its time
    ([10.0, None], 4, 1, 20.0),  # a trial without times counts as done, not in the mean
    ([None], 4, 1, None),  # no finished trial with its times
    ([], 4, 1, None),  # nothing finished yet
    ([10.0, 20.0], 2, 0, None),  # finished
    ([10.0, 20.0, 30.0], 2, 0, None),  # more than the spec asked (a resumed study)
    ([10.0], None, 1, None),  # a study whose total is not stored
])
def test_the_estimate(finished: list[float | None], total: int | None, running: int, eta: float | None) -> None:
    assert estimate_seconds(finished, total=total, running=running) == eta
