"""A search killed with SIGKILL again and again, driver and workers, at random moments (the
short version of ``benchmarks/scale.py``'s chaos run): nothing finished is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat_search.measure.runner import Runner
from remat_search.spec.models import TimingConfig
from remat_search.spec.workloads import MlpConfig

from tests.chaos import WORKLOAD, chaos

pytestmark = pytest.mark.slow  # kills searches at random moments


def test_a_search_killed_at_random_moments_loses_nothing_and_finishes_exactly(tmp_path: Path) -> None:
    seen = chaos(tmp_path, kills=4, trials=8, workers=2, seed=7)
    assert seen["final_exit"] == 0, seen["final_log"]
    assert sum(seen["kills"].values()) >= 1
    assert seen["finished"] == 8
    assert seen["running"] == 0
    assert seen["lost"] == []
    assert seen["integrity"] == "ok"
    assert seen["orphans"] == []
    # Every complete trial's plan can be measured again (two of them here).
    with Runner(MlpConfig.model_validate(WORKLOAD), timeout=120) as runner:
        for plan in seen["plans"][:2]:
            m = runner.measure(plan, budget=2**30, timing=TimingConfig(warmup=1, repeats=2), gradient_tolerance=1e-3)
            assert m.status == "measured", m.error
