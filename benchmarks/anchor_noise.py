"""How much anchored timing steadies a trial's time: the uniform presets across the studies
of ``search_quality.py``.

    python benchmarks/search_quality.py     # first: its 12 studies, under results/studies/
    python benchmarks/anchor_noise.py

Every study times the same presets of the same workload, minutes apart. For each preset,
the table sets the spread of its raw search medians across the studies beside the spread
of its median ratios to the anchor (``timing.anchor``), each as (max − min) / median.
Only trials that ran in their own study count (no cache: each study has its own file).
"""

from __future__ import annotations

from pathlib import Path

import optuna

import remat_search
from remat_search.measure.measurement import relative_spread

STUDIES = Path(__file__).resolve().parent / "results" / "studies"


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    raw: dict[str, list[float]] = {}
    ratio: dict[str, list[float]] = {}
    for db in sorted(STUDIES.glob("*-0.??.db")):  # search_quality.py's: <method>-<budget>.db, a study each
        report = remat_search.load_report(db.stem, f"sqlite:///{db}")
        for t in report.trials:
            m = t.measurement
            if t.plan is None or not t.plan.is_uniform or t.reused_from is not None or not m or not m.anchor_ratios:
                continue
            raw.setdefault(t.summary(), []).append(m.median_seconds)
            ratio.setdefault(t.summary(), []).append(m.anchor_ratio)
    if not raw:
        raise SystemExit(f"no anchored preset timings under {STUDIES}: run benchmarks/search_quality.py first")
    print("| preset | studies | raw search median | its spread | median ratio to the anchor | its spread |")
    print("|---|---|---|---|---|---|")
    for plan, seconds in raw.items():
        r = ratio[plan]
        print(f"| `{plan}` | {len(seconds)} | {min(seconds) * 1e3:.0f}–{max(seconds) * 1e3:.0f} ms | "
              f"{relative_spread(seconds):.0%} | {min(r):.3f}–{max(r):.3f} | {relative_spread(r):.0%} |")


if __name__ == "__main__":
    main()
