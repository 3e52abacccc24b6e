"""Rules that hold across hosts and containers whatever their clocks, time zones and ``/tmp``:
the device lock, the order of admission, the take-over of dead trials."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from remat_search.store.storage import open_storage

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # several host processes on one storage

HOLD = """
import sys, time
from pathlib import Path
from remat_search.targets.local import LocalTarget
log, start = Path(sys.argv[1]), Path(sys.argv[2])
target = LocalTarget()
target.devices()
(log.parent / f"ready-{sys.argv[3]}").touch()
while not start.exists():
    time.sleep(0.01)
for _ in range(15):
    with target.device_lock():
        with log.open("a") as f:
            f.write(f"in {sys.argv[3]}\\n")
        time.sleep(0.02)
        with log.open("a") as f:
            f.write(f"out {sys.argv[3]}\\n")
"""


def test_two_processes_sharing_only_the_storage_home_hold_the_device_one_at_a_time(tmp_path: Path) -> None:
    """Two workers with a ``/tmp`` each (compose's replicas, one per container) and one storage
    home (the volume they share) never hold the device at once."""
    log, start, home = tmp_path / "log", tmp_path / "start", tmp_path / "home"
    procs = []
    for name in ("a", "b"):
        tmp = tmp_path / f"tmp-{name}"
        tmp.mkdir()
        env = {**os.environ, "TMPDIR": str(tmp), "REMAT_SEARCH_HOME": str(home), "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, "-c", HOLD, str(log), str(start), name], env=env))
    while not all((tmp_path / f"ready-{name}").exists() for name in "ab"):
        assert all(p.poll() is None for p in procs), "a process ended before it was ready"
        time.sleep(0.05)
    start.touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = log.read_text().split()
    events = list(zip(lines[::2], lines[1::2], strict=True))
    assert len(events) == 60
    for entered, left in zip(events[::2], events[1::2], strict=True):  # each "in" followed by its own "out"
        assert entered[0] == "in" and left == ("out", entered[1]), events


HOST = """
import datetime, sys, time
import optuna
import optuna.storages._rdb.storage as rdb
from remat_search.store.liveness import admitted, ask, heartbeat_storage_options, recover
from remat_search.spec.models import HeartbeatConfig
from remat_search.store.storage import open_storage

class Clock(datetime.datetime):  # this host's clock: off by SKEW hours (optuna stamps trials with it)
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime.now(tz) + datetime.timedelta(hours=float(sys.argv[3]))

rdb.datetime = Clock
optuna.logging.set_verbosity(optuna.logging.WARNING)
url, what = sys.argv[1], sys.argv[2]
storage = open_storage(url, heartbeat=heartbeat_storage_options(HeartbeatConfig(interval=60, grace=120), 1))
study = optuna.load_study(study_name="s", storage=storage)
if what == "recover":
    recover(study, storage, n_params=1)
    sys.exit(0)
trial = ask(study)
trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name("s"), trial.number)
if what == "admit":
    storage.record_heartbeat(trial_id)
    print(admitted(study, storage, trial_id, trials=1), flush=True)
else:  # "hold": asked for, alive, not beaten yet (a search between optuna's ask and its first write)
    print("asked", flush=True)
    sys.stdin.read()
"""


def _host(url: str, what: str, *, tz: str, skew_hours: float = 0.0, **kwargs: object) -> subprocess.Popen[str]:
    """A process standing for a host in time zone ``tz`` whose clock is ``skew_hours`` off."""
    env = {**os.environ, "TZ": tz, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", HOST, url, what, str(skew_hours)], env=env, text=True, stdout=subprocess.PIPE, **kwargs
    )


def _study(url: str) -> optuna.Study:
    return optuna.create_study(study_name="s", storage=open_storage(url, create=True), directions=["minimize"] * 2)


def test_a_trial_just_asked_for_on_a_host_with_another_clock_and_time_zone_is_not_taken_for_dead(
    storage_url: str,
) -> None:
    """Host A (UTC+9, its clock an hour behind) has asked for a trial and not yet marked it; host
    B (UTC−5) looks for dead trials: A's trial is alive, whatever A's clock said when it asked."""
    study = _study(storage_url)
    a = _host(storage_url, "hold", tz="Asia/Tokyo", skew_hours=-1, stdin=subprocess.PIPE)
    try:
        assert a.stdout is not None and a.stdout.readline() == "asked\n"
        b = _host(storage_url, "recover", tz="America/New_York")
        b.communicate(timeout=120)
        assert b.returncode == 0
        assert [t.state for t in study.get_trials()] == [TrialState.RUNNING]
    finally:
        a.kill()
        a.communicate()


def test_admission_follows_the_database_not_the_hosts_clocks(storage_url: str) -> None:
    """One trial to go: host B (UTC−5) asks first and is admitted; host A (UTC+9, its clock an
    hour behind, so its trial looks older) asks next and is refused: no study ends with more."""
    _study(storage_url)
    first = _host(storage_url, "admit", tz="America/New_York")
    assert first.communicate(timeout=120)[0] == "True\n"
    second = _host(storage_url, "admit", tz="Asia/Tokyo", skew_hours=-1)
    assert second.communicate(timeout=120)[0] == "False\n"
