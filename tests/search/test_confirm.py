"""The paired comparison behind the confirmed table's "vs fastest" column."""

from __future__ import annotations

import numpy as np
import pytest

from remat_search.search.confirm import compare_times


def test_pairing_by_round_cancels_drift_that_hides_the_difference_unpaired() -> None:
    # The machine slows to half speed and back; plan b is 5% slower than a in every round.
    mood = 1 + 0.5 * np.sin(np.linspace(0, 6, 30))
    a = 0.100 * mood
    b = 0.105 * mood * (1 + np.random.default_rng(0).normal(0, 0.01, 30))
    assert np.quantile(b, 0.25) < np.median(a) < np.quantile(b, 0.75)  # unpaired, lost in the drift
    c = compare_times(b, a)
    assert c.resolved and c.low > 1.03 and c.high < 1.07 and c.ratio == pytest.approx(1.05, abs=0.005)


@pytest.mark.parametrize("rounds", [5, 10, 30])
def test_the_interval_covers_no_difference_as_often_as_it_says(rounds: int) -> None:
    rng = np.random.default_rng(rounds)
    trials, covered, whole = 4000, 0, 0
    for _ in range(trials):
        a, b = rng.lognormal(0, 0.15, rounds), rng.lognormal(0, 0.15, rounds)
        c = compare_times(b, a)
        covered += c.low <= 1 <= c.high
        whole += (c.low, c.high) == (min(b / a), max(b / a))
        assert c.low <= c.ratio <= c.high
    coverage = compare_times(b, a).coverage
    assert abs(covered / trials - coverage) < 4 * (coverage * (1 - coverage) / trials) ** 0.5  # both ways
    assert whole == (trials if rounds <= 8 else 0)  # from 9 rounds on, never the whole range


@pytest.mark.parametrize(
    ("rounds", "coverage"),
    # 1 − 2·P(Binomial(n, 1/2) ≤ k − 1) for the interval [r_(k), r_(n+1−k)]: k = 1, 1, 1, 2, 10
    [(1, 0.0), (5, 15 / 16), (6, 31 / 32), (10, 1 - 2 * 11 / 1024), (30, 513906825 / 536870912)],
)
def test_the_interval_states_its_exact_coverage(rounds: int, coverage: float) -> None:
    c = compare_times([1.0] * rounds, [1.0] * rounds)
    assert c.coverage == pytest.approx(coverage, abs=1e-12)


def test_few_rounds_give_the_whole_range() -> None:
    c = compare_times([1.2, 1.5, 1.1], [1.0, 1.0, 1.0])
    assert (c.low, c.ratio, c.high) == pytest.approx((1.1, 1.2, 1.5))
    assert c.resolved  # every round says slower
    assert c.coverage == 0.75  # 1 − 2/2³: less than the 95% asked for, and said
    with pytest.raises(ValueError, match="at least one round"):
        compare_times([], [])
