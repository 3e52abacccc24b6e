"""The paired comparison behind the confirmed table's "vs fastest" column."""

from __future__ import annotations

import numpy as np
import pytest

from remat_search.confirm import compare_times


def test_pairing_by_round_cancels_drift_that_hides_the_difference_unpaired() -> None:
    # The machine slows to half speed and back; plan b is 5% slower than a in every round.
    mood = 1 + 0.5 * np.sin(np.linspace(0, 6, 30))
    a = 0.100 * mood
    b = 0.105 * mood * (1 + np.random.default_rng(0).normal(0, 0.01, 30))
    assert np.quantile(b, 0.25) < np.median(a) < np.quantile(b, 0.75)  # unpaired, lost in the drift
    c = compare_times(b, a)
    assert c.resolved and c.low > 1.03 and c.high < 1.07 and c.ratio == pytest.approx(1.05, abs=0.005)


def test_same_plan_twice_is_not_resolved_and_the_interval_covers_no_difference() -> None:
    rng = np.random.default_rng(1)
    covered = 0
    for _ in range(400):
        a, b = rng.lognormal(0, 0.15, 30), rng.lognormal(0, 0.15, 30)
        c = compare_times(b, a)
        covered += c.low <= 1 <= c.high
        assert c.low <= c.ratio <= c.high
    assert covered >= 0.93 * 400  # a 95% interval, up to sampling error


def test_few_rounds_give_the_whole_range() -> None:
    c = compare_times([1.2, 1.5, 1.1], [1.0, 1.0, 1.0])
    assert (c.low, c.ratio, c.high) == pytest.approx((1.1, 1.2, 1.5))
    assert c.resolved  # every round says slower
    with pytest.raises(ValueError, match="at least one round"):
        compare_times([], [])
