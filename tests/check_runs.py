"""Runs of the first-step check for the tests and ``benchmarks/check_noise.py``: the issue-46
search in a process with a given number of CPU devices, and every plan of the redrawing models
(``tests.factories.RedrawingMlp``) measured in one.

    python -m tests.check_runs DEVICES   # the redrawing models' checks, a JSON line each
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import CHECK_SEARCH, REPO, run_process, spec_dict, write_spec


def device_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a process with ``devices`` CPU devices (this process's flags kept)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def search(folder: Path, devices: int, **overrides: Any) -> Any:
    """Issue 46's search (``CHECK_SEARCH`` with ``overrides``) run by ``remat-search run`` in a
    process with ``devices`` CPU devices; the study's report."""
    import optuna

    from remat_search.report.results import study_report

    storage = f"sqlite:///{folder / 'check.db'}"
    spec = write_spec(folder / "check.yaml", spec_dict(storage, study="check", **{**CHECK_SEARCH, **overrides}))
    run = run_process("run", str(spec), env={"XLA_FLAGS": device_flags(devices)})
    out = run.communicate(timeout=1200)[0]
    assert run.returncode == 0, out[-4000:]
    return study_report(optuna.load_study(study_name="check", storage=storage))


def redrawn(devices: int) -> list[dict[str, Any]]:
    """Every (redraw, dtype, plan) of the redrawing models measured on ``devices`` CPU devices
    (``mesh: {data: devices}``), in a process of its own: status, error and the check."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.check_runs", str(devices)], cwd=REPO, capture_output=True, text=True,
        timeout=900, env={**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": device_flags(devices)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line.removeprefix("CHECKED ")) for line in done.stdout.splitlines() if line.startswith("CHECKED ")]


def _measure_redrawn(devices: int) -> None:
    from remat_search.measure.executables import Executables, measure
    from remat_search.plans.plan import RematPlan
    from remat_search.spec.models import TimingConfig
    from remat_search.targets.local import LocalTarget
    from tests.factories import REDRAWS, redrawing

    for redraw in REDRAWS:
        for dtype in ("float32", "bfloat16"):
            workload = redrawing(redraw, dtype)
            executables = Executables(workload, mesh=LocalTarget().mesh({"data": devices}) if devices > 1 else None)
            for policy in ("none", "dots", "full"):
                m = measure(executables, RematPlan.uniform(policy, workload.layers), budget=2**40,
                            timing=TimingConfig(warmup=1, repeats=1))
                print("CHECKED " + json.dumps({
                    "redraw": redraw, "dtype": dtype, "policy": policy, "status": m.status, "error": m.error,
                    "check": m.grad_check.model_dump(mode="json") if m.grad_check else None,
                }), flush=True)


if __name__ == "__main__":
    _measure_redrawn(int(sys.argv[1]))
