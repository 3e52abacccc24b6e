"""The first-step check off the bench it was built on: correct plans' errors beside the threshold
measured for them, by dtype and mesh, and the wrong-training models' figures.

1. Issue 46's search (``tests.conftest.CHECK_SEARCH``: the built-in transformer, 4 layers of width
   64, ``none``/``full``/``dots`` per layer, 10 TPE trials) on one CPU device and on four
   (``mesh: {data: 4}``), in float32 and bfloat16, and on a slice of 2 processes × 2 devices in
   float32. Every plan is correct: a trial that fails is a false verdict.
2. MaxText's own program (the tiny decoder of ``tests/workloads/test_maxtext.py``, bfloat16
   matmuls, float32 weights, MaxText's AdamW), its three choices (needs the ``maxtext`` extra).
3. The redrawing models (``tests.factories.RedrawingMlp``), every plan, on one and four devices.
4. The rounding probe's linearity: full remat's gradients on inputs nudged by ``1 ± δ`` against
   its own, at several δ, and scaled to the unit roundoff ``u`` as the check scales them.

    python benchmarks/check_noise.py [--skip-maxtext]

Prints Markdown tables (``benchmarks/results/check_noise.md`` keeps a run).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from remat_search.measure.check import GradientCheck  # noqa: E402
from remat_search.report.results import study_report  # noqa: E402
from tests.check_runs import redrawn, search  # noqa: E402
from tests.chaos import slice_port, slice_processes  # noqa: E402
from tests.conftest import CHECK_SEARCH, CHECK_WORKLOAD, spec_dict, write_spec  # noqa: E402

SETTINGS = [("one CPU device", 1, "float32"), ("mesh data:4, one process", 4, "float32"),
            ("one CPU device", 1, "bfloat16"), ("mesh data:4, one process", 4, "bfloat16")]


def _row(setting: str, dtype: str, report: object) -> str:
    trials = report.trials  # type: ignore[attr-defined]
    checks: list[GradientCheck] = [t.measurement.grad_check for t in trials if t.measurement and t.measurement.grad_check]
    failed = sum(t.status == "failed" for t in trials)
    worst = max(checks, key=lambda c: c.leaf_error / c.leaf_threshold)
    largest = max(c.max_error for c in checks)
    tree = max(c.tree_error for c in checks)
    return (f"| {setting} | {dtype} | {len(trials)} | {len({t.plan.digest for t in trials})} | {failed} | {largest:.2e} "
            f"| {tree:.2e} of {worst.tree_threshold:.2e} | {worst.leaf_error / worst.leaf_threshold:.2f} | {worst.rounding:.2e} "
            f"| {worst.rerun:.2e} |")


def _slice(folder: Path) -> object:
    storage = f"sqlite:///{folder / 'slice.db'}"
    spec = write_spec(folder / "slice.yaml", spec_dict(
        storage, study="check", mesh={"data": 4}, slice={"heartbeat_timeout": "10s", "collective_timeout": "60s",
                                                          "join_timeout": "120s"}, **CHECK_SEARCH,
    ))
    procs = slice_processes([spec, spec], port=slice_port(), devices=2)
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return study_report(optuna.load_study(study_name="check", storage=storage))


def _maxtext(folder: Path) -> object:
    from tests.workloads.test_maxtext import TINY

    return search(folder, 1, workload={"kind": "maxtext", "overrides": TINY}, trials=3, space={
        "layout": "uniform", "choices": ["full", {"label": "save_qkv_proj", "names": ["query_proj", "key_proj", "value_proj"]},
                                         {"label": "save_out_proj", "names": ["out_proj"]}]},
        timing={"warmup": 1, "repeats": 1, "timeout": "900s"},
    )


def linearity() -> None:
    from remat_search.measure.check import errors, first_step, nudged
    from remat_search.measure.executables import Executables
    from remat_search.spec.workloads import TransformerConfig
    from remat_search.workloads.base import build_workload

    print("| dtype | δ = 2⁻⁸ | 2⁻⁶ | 2⁻⁴ (the check's) | 2⁻³ | each scaled to u: 2⁻⁸ | 2⁻⁶ | 2⁻⁴ | 2⁻³ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, u in (("float32", 2.0**-24), ("bfloat16", 2.0**-8)):
        executables = Executables(build_workload(TransformerConfig(**{**CHECK_WORKLOAD, "dtype": dtype})))
        full = executables.build(executables.anchor_plan).executable
        _, reference = first_step(full, executables.inputs(), executables.carriers)
        seen: list[float] = []
        for e in (8, 6, 4, 3):
            _, probe = first_step(full, nudged(executables.inputs(), size=2.0**-e), executables.carriers)
            seen.append(errors(probe, reference).tree)
        scaled = [f * u / 2.0**-e for f, e in zip(seen, (8, 6, 4, 3), strict=True)]
        print(f"| {dtype} | " + " | ".join(f"{f:.3g}" for f in seen) + " | " + " | ".join(f"{f:.2e}" for f in scaled) + " |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-maxtext", action="store_true")
    args = parser.parse_args()
    # A storage home of this run's own: a study keeps its reference (and its noise) under the
    # home's artifacts/ and loads it in its next run; every figure here is measured afresh.
    home = tempfile.TemporaryDirectory()
    os.environ["REMAT_SEARCH_HOME"] = home.name
    print("| setting | dtype | trials | plans | failed | largest error (any array) | all arrays: worst error of threshold "
          "| worst array's error / its threshold | rounding | rerun |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for setting, devices, dtype in SETTINGS:
        with tempfile.TemporaryDirectory() as folder:
            mesh = {"mesh": {"data": devices}} if devices > 1 else {}
            report = search(Path(folder), devices, workload={**CHECK_WORKLOAD, "dtype": dtype}, **mesh)
            print(_row(setting, dtype, report), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        print(_row("slice, 2 processes × 2 devices", "float32", _slice(Path(folder))), flush=True)
    if not args.skip_maxtext:
        with tempfile.TemporaryDirectory() as folder:
            print(_row("MaxText's tiny decoder, one CPU device", "bfloat16 (float32 weights)", _maxtext(Path(folder))), flush=True)

    print("\nThe rounding probe, over all arrays (the transformer above, one CPU device):\n")
    linearity()
    print("\nThe redrawing models, every plan (full remat run twice differs: the reference is not reproducible):\n")
    print("| model | dtype | devices | plans failed | rerun (range) | rounding (range) | rerun / rounding (least) |")
    print("|---|---|---|---|---|---|---|")
    for devices in (1, 4):
        seen = redrawn(devices)
        for model in sorted({s["redraw"] for s in seen}):
            for dtype in ("float32", "bfloat16"):
                mine = [s for s in seen if s["redraw"] == model and s["dtype"] == dtype]
                checks = [GradientCheck.model_validate(s["check"]) for s in mine]
                failed = sum(s["status"] == "failed" for s in mine)
                reruns, roundings = [c.rerun for c in checks], [c.rounding for c in checks]
                print(f"| {model} | {dtype} | {devices} | {failed} of {len(mine)} | {min(reruns):.3f}–{max(reruns):.3f} "
                      f"| {min(roundings):.2e}–{max(roundings):.2e} | {min(c.rerun / c.rounding for c in checks):.0f} |", flush=True)


if __name__ == "__main__":
    main()
