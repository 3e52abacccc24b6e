"""The solver: the Pareto front of a cost model's summed (memory, seconds) over all plans.

:func:`solve_front` finds it by dynamic programming over units (a multiple-choice knapsack):
exact unless the front of partial plans outgrows :data:`MAX_STATES`, when it is thinned and
says so (:attr:`Front.thinned_to`). :mod:`search.cost_model` prices the units' choices;
this module only sums and prunes.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

MAX_STATES = 20_000
"""Front size above which :func:`solve_front` merges states of nearly equal memory."""


class Front(BaseModel):
    """A Pareto front of summed (memory, seconds) from :func:`solve_front`: one state per
    plan, memory ascending and seconds descending, and whether it is exact."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    memory: np.ndarray
    seconds: np.ndarray
    choices: np.ndarray
    """``[state, unit]``: the choice index of each unit in each state's plan."""
    thinned_to: int | None = None
    """None where the front is exact: no unit's front of partial plans outgrew ``max_states``,
    so only dominated plans were dropped and the optimum for any cap is on it. Else the
    ``max_states`` it was thinned to: an optimum may have been merged away."""

    @property
    def exact(self) -> bool:
        return self.thinned_to is None

    def points(self) -> list[tuple[float, float, tuple[int, ...]]]:
        """``(memory, seconds, choices)`` of each state, memory ascending."""
        return [
            (float(a), float(b), tuple(int(k) for k in ks))
            for a, b, ks in zip(self.memory, self.seconds, self.choices, strict=True)
        ]


def solve_front(
    memory: np.ndarray, seconds: np.ndarray, *, cap: float | None = None, max_states: int = MAX_STATES
) -> Front:
    """The Pareto front of ``Σ memory[u, k_u]`` vs ``Σ seconds[u, k_u]`` over all choices ``k``.

    Dynamic programming over units: after each unit only the non-dominated partial plans
    are kept, so the result is exact (the optimum for any cap is on it) unless the front
    grows past ``max_states``, when states within 1/max_states of the memory range merge
    and the result says so (:attr:`Front.thinned_to`).
    Partial plans are kept as back-pointers (parent state, choice) and read back at the end,
    so a 96-layer stack costs arrays, not tuples, per unit.
    """
    n_units, n_choices = memory.shape
    lowest_rest = np.concatenate([np.cumsum(memory.min(axis=1)[::-1])[::-1], [0.0]])
    m, t = np.zeros(1), np.zeros(1)
    parents: list[np.ndarray] = []
    choices: list[np.ndarray] = []
    thinned = False
    for u in range(n_units):
        grown_m = (m[:, None] + memory[u][None, :]).reshape(-1)
        grown_t = (t[:, None] + seconds[u][None, :]).reshape(-1)
        index = np.arange(grown_m.size)
        if cap is not None:
            index = index[grown_m + lowest_rest[u + 1] <= cap]
        index = index[_pareto(grown_m[index], grown_t[index])]
        if index.size > max_states:
            index = index[_thin(grown_m[index], max_states)]
            thinned = True
        m, t = grown_m[index], grown_t[index]
        parents.append(index // n_choices)
        choices.append(index % n_choices)
    plans = np.zeros((m.size, n_units), dtype=int)
    state = np.arange(m.size)
    for u in reversed(range(n_units)):
        plans[:, u] = choices[u][state]
        state = parents[u][state]
    return Front(memory=m, seconds=t, choices=plans, thinned_to=max_states if thinned else None)


def _pareto(m: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Positions of the non-dominated (m, t) pairs, memory ascending (so seconds descending)."""
    order = np.lexsort((t, m))
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], t[order]]))[:-1]
    return order[t[order] < best_before]


def _thin(m: np.ndarray, n: int) -> np.ndarray:
    """Positions along a front (memory ascending) that keep the fastest state of each of ``n``
    equal memory buckets (seconds descend along the front: the last of each bucket), and the
    least-memory state, so the tightest budget the exact front meets stays met."""
    width = (m[-1] - m[0]) / n or 1.0
    bucket = ((m - m[0]) / width).astype(int)
    last = np.append(bucket[1:] != bucket[:-1], True)
    last[0] = True
    return np.flatnonzero(last)

