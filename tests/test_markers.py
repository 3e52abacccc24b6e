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


def collected(marks: str) -> list[str]:
    """The test ids ``pytest -m MARKS`` would run."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", marks],
        cwd=REPO, capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_quick_run_leaves_out_the_slow_tests_and_the_full_run_keeps_them() -> None:
    quick, slow = collected("not slow"), collected("slow")
    assert quick and slow and not set(quick) & set(slow)
    assert not [t for t in quick if t.startswith(SLOW_FILES) or t.endswith("[postgresql]")]
    assert {t.split("::")[0] for t in slow} >= set(SLOW_FILES)
