"""How the planner's exact solver scales with depth: ``solve_front`` beside the textbook DP.

One command:

    python benchmarks/solver_scale.py

Costs are synthetic but shaped like a real study's (six choices whose savings and extra
times are alike across layers, ±3% and ±10% per layer), which is what makes fronts large.
The textbook DP keeps each partial plan as a tuple of choices, copied at every layer; the
library keeps back-pointers in numpy arrays and reads the plans back at the end. Both are
run here, on the same costs, and must return the same front.
"""

from __future__ import annotations

import time

import numpy as np

from remat_search.planner import MAX_STATES, solve_front

SAVING = np.array([0, -5e6, -2e6, -2.1e6, -3e6, -4e6])
EXTRA = np.array([0, 3e-3, 1e-3, 1.1e-3, 1.5e-3, 2e-3])


def tuple_dp(memory: np.ndarray, seconds: np.ndarray) -> list[tuple[float, float, tuple[int, ...]]]:
    """The same Pareto DP with a choice tuple per state (no cap; thinning as the library's)."""
    states: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for u in range(memory.shape[0]):
        grown = sorted(
            ((m + memory[u, k], t + seconds[u, k], ks + (k,)) for m, t, ks in states for k in range(memory.shape[1])),
            key=lambda s: (s[0], s[1]),
        )
        states = []
        for state in grown:
            if not states or state[1] < states[-1][1]:
                states.append(state)
        if len(states) > MAX_STATES:
            low, width = states[0][0], (states[-1][0] - states[0][0]) / MAX_STATES or 1.0
            kept = {int((s[0] - low) / width): s for s in states}
            kept[-1] = states[0]
            states = sorted(kept.values(), key=lambda s: s[0])
    return states


def main() -> None:
    rng = np.random.default_rng(0)
    print("| layers | front size | tuple DP | solve_front | speed-up |\n|---|---|---|---|---|")
    for layers in (8, 24, 48, 96):
        weight = np.linspace(1, 0.8, layers)[:, None]
        memory = SAVING * weight * rng.uniform(0.97, 1.03, (layers, 6))
        seconds = EXTRA * rng.uniform(0.9, 1.1, (layers, 6))
        t0 = time.perf_counter()
        slow = tuple_dp(memory, seconds)
        t1 = time.perf_counter()
        fast = solve_front(memory, seconds)
        t2 = time.perf_counter()
        assert len(slow) == len(fast) and all(
            abs(a[1] - b[1]) <= 1e-9 * max(1.0, abs(a[1])) for a, b in zip(slow, fast, strict=True)
        ), "the two solvers disagree"
        print(f"| {layers} | {len(fast)} | {t1 - t0:.2f} s | {t2 - t1:.2f} s | {(t1 - t0) / (t2 - t1):.0f}× |")


if __name__ == "__main__":
    main()
