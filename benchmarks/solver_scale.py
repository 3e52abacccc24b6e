"""What the planner's solver loses by thinning, and what its speed buys, as depth grows.

One command:

    python benchmarks/solver_scale.py

``solve_front`` keeps only non-dominated partial plans, which is exact, but merges states of
nearly equal memory once a unit's front outgrows ``MAX_STATES`` (then it reports
``thinned_to``). Here each depth is solved three ways on the same costs: as the planner does
(thinning at ``MAX_STATES``), unthinned (``max_states`` unbounded: the exact front), and by the
textbook exact DP that copies a tuple of choices per state (which must agree with the
unthinned solve; up to ``TEXTBOOK_UP_TO`` layers). The thinned front is then read at caps
spread evenly over the exact front's memory range, as the sampler reads its targets, and
solved for a few of them, as ``best`` does; at each cap its fastest plan is set against the
exact optimum. Times are one run each, on whatever machine runs this: read them as ratios.

Costs are synthetic but shaped like a real study's (six choices whose savings and extra
times are alike across layers, ±3% and ±10% per layer), which is what makes fronts large.
Excess time is relative to the whole step, taken as ``STEP`` seconds a layer without remat
(full remat, one extra forward, then adds a third), and, harsher, relative to the exact
plan's remat overhead alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from remat_search.search.solver import MAX_STATES, Front, solve_front

SAVING = np.array([0, -5e6, -2e6, -2.1e6, -3e6, -4e6])
EXTRA = np.array([0, 3e-3, 1e-3, 1.1e-3, 1.5e-3, 2e-3])
STEP = 9e-3
"""Seconds a layer takes without remat: full remat's extra 3 ms is one more forward, a third."""
DEPTHS = (8, 24, 48, 64, 96, 128)
READ_CAPS = 500
"""Caps the fronts are read at, evenly over the exact front's memory range."""
SOLVED_CAPS = 10
"""Caps the thinned solve is run for (each a full solve)."""
UNBOUNDED = 10**9
TEXTBOOK_UP_TO = 96
"""Deepest stack the textbook DP runs on (at 128 layers it takes minutes)."""
T = TypeVar("T")


def tuple_dp(memory: np.ndarray, seconds: np.ndarray) -> list[tuple[float, float, tuple[int, ...]]]:
    """The textbook exact Pareto DP: a choice tuple per state, no thinning."""
    states: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for u in range(memory.shape[0]):
        grown = sorted(
            (
                (m + memory[u, k], t + seconds[u, k], ks + (k,))
                for m, t, ks in states for k in range(memory.shape[1])
            ),
            key=lambda s: (s[0], s[1]),
        )
        states = []
        for state in grown:
            if not states or state[1] < states[-1][1]:
                states.append(state)
    return states


def fastest(front: Front, caps: np.ndarray) -> np.ndarray:
    """The fastest time on ``front`` within each cap (NaN where nothing fits)."""
    at = np.searchsorted(front.memory, caps, side="right") - 1
    return np.where(at >= 0, front.seconds[np.maximum(at, 0)], np.nan)


def excess(thinned: np.ndarray, exact: np.ndarray, base: float) -> tuple[np.ndarray, np.ndarray]:
    """Relative excess of thinned over exact times: of the whole step, and of the remat overhead."""
    overhead = np.where(exact > 0, (thinned - exact) / np.where(exact > 0, exact, 1.0), 0.0)
    return (thinned - exact) / (base + exact), overhead


def timed(solve: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """``solve(*args, **kwargs)`` and the seconds it took."""
    start = time.perf_counter()
    result = solve(*args, **kwargs)
    return result, time.perf_counter() - start


def main() -> None:
    print(
        f"Thinning at MAX_STATES = {MAX_STATES:,} against the unthinned solve. Excess: the thinned "
        "fastest time over the exact optimum at the same cap, relative to the step (to the remat "
        f"overhead); {READ_CAPS} caps read off the fronts, {SOLVED_CAPS} solved for.\n"
    )
    print(
        "| layers | exact front | thinned front | thinned? | caps read: slower | largest excess "
        "| median where slower | caps solved: slower | largest excess | unthinned ÷ thinned time "
        "| tuple DP ÷ unthinned time |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for layers in DEPTHS:
        rng = np.random.default_rng(layers)
        weight = np.linspace(1, 0.8, layers)[:, None]
        memory = SAVING * weight * rng.uniform(0.97, 1.03, (layers, 6))
        seconds = EXTRA * rng.uniform(0.9, 1.1, (layers, 6))
        base = STEP * layers
        thinned, t_thinned = timed(solve_front, memory, seconds)
        exact, t_exact = timed(solve_front, memory, seconds, max_states=UNBOUNDED)
        assert exact.exact
        speed_up = "—"
        if layers <= TEXTBOOK_UP_TO:
            textbook, t_textbook = timed(tuple_dp, memory, seconds)
            assert len(textbook) == len(exact.memory) and np.allclose(
                [s[1] for s in textbook], exact.seconds, rtol=1e-9, atol=1e-12
            ), "the unthinned solve and the textbook DP disagree"
            speed_up = f"{t_textbook / t_exact:.0f}×"

        caps = np.linspace(exact.memory[0], exact.memory[-1], READ_CAPS)
        best, read = fastest(exact, caps), fastest(thinned, caps)
        assert not np.isnan(read).any() and (read >= best - 1e-12).all(), "thinned beat exact: a solver bug"
        step, overhead = excess(read, best, base)
        slower = read > best + 1e-12

        solved_caps = caps[np.linspace(0, READ_CAPS - 1, SOLVED_CAPS + 2).astype(int)[1:-1]]
        solved = np.array([solve_front(memory, seconds, cap=c).seconds[-1] for c in solved_caps])
        solved_step, _ = excess(solved, fastest(exact, solved_caps), base)
        solved_slower = solved_step > 1e-12

        print(
            f"| {layers} | {len(exact.memory):,} | {len(thinned.memory):,} "
            f"| {'no' if thinned.exact else 'yes'} "
            f"| {slower.sum()} of {READ_CAPS} | {step.max():.4%} ({overhead.max():.3%}) "
            f"| {np.median(step[slower]) if slower.any() else 0:.4%} "
            f"| {solved_slower.sum()} of {SOLVED_CAPS} | {solved_step.max():.4%} "
            f"| {t_exact / t_thinned:.1f}× ({t_thinned:.2f} s) | {speed_up} ({t_exact:.2f} s) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
