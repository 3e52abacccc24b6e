"""``pytest -m "not slow"``, the day-to-day run, leaves out what needs a PostgreSQL server, a
browser, several processes or hosts killed at random, TPU compiles or docker's commands; README's
``pytest`` runs everything."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

SLOW_FILES = (
    "tests/service/test_page.py", "tests/service/test_dashboard.py", "tests/service/test_docker.py",
    "tests/service/test_kubernetes.py", "tests/search/test_chaos.py", "tests/store/test_chaos_hosts.py",
    "tests/search/test_faults.py", "tests/search/test_fuzz.py", "tests/targets/test_tpu.py",
    "tests/targets/test_tpu_peak.py", "tests/targets/test_mesh.py", "tests/store/test_hosts.py",
    "tests/service/test_workers.py", "tests/store/test_postgres.py",
)


MARKS = """
import sys, pytest
class Marks:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("SLOW" if item.get_closest_marker("slow") else "QUICK", item.nodeid)
sys.exit(pytest.main(["--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"], plugins=[Marks()]))
"""
"""One collection of the whole suite, printing each test id after its mark as ``-m`` reads it:
``SLOW`` where the test is marked ``slow`` (``-m slow`` runs it), else ``QUICK`` (``-m "not slow"``)."""


def collected() -> tuple[list[str], list[str]]:
    """The test ids ``pytest -m "not slow"`` and ``pytest -m slow`` would run, from one collection."""
    done = subprocess.run([sys.executable, "-c", MARKS], cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    marked = [line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("SLOW ", "QUICK "))]
    return [t for mark, t in marked if mark == "QUICK"], [t for mark, t in marked if mark == "SLOW"]


def test_the_quick_run_leaves_out_the_slow_tests_and_the_full_run_keeps_them() -> None:
    quick, slow = collected()
    assert quick and slow and not set(quick) & set(slow)
    assert not [t for t in quick if t.startswith(SLOW_FILES) or t.endswith("[postgresql]")]
    assert {t.split("::")[0] for t in slow} >= set(SLOW_FILES)
