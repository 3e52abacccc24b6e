"""Three hosts (a ``run`` process each, with a host name of its own) on one PostgreSQL study,
whole hosts killed with SIGKILL at random moments (the short version of
``benchmarks/chaos_hosts.py``): nothing finished is lost, and the totals are exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import chaos_hosts

pytestmark = pytest.mark.slow  # kills hosts at random moments


def test_hosts_killed_at_random_moments_lose_nothing_and_finish_exactly(tmp_path: Path, postgres_url: str) -> None:
    seen = chaos_hosts(tmp_path, postgres_url, kills=3, trials=8, hosts=3, seed=3)
    assert seen["exits"] == [0, 0, 0]
    assert seen["kills"] >= 1
    assert seen["finished"] == 8
    assert seen["running"] == 0
    assert seen["lost"] == []
    assert seen["orphans"] == []
    assert len(seen["hosts"]) >= 2  # trials were measured by several hosts
