"""Rules that hold across hosts and containers whatever their clocks, time zones and ``/tmp``:
the device lock, the order of admission, the take-over of dead trials."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .conftest import REPO

HOLD = """
import sys, time
from pathlib import Path
from remat_search.target import LocalTarget
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
