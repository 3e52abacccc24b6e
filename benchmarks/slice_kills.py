"""A slice's search under kills, and what a slice costs: processes on this host stand for the
hosts of a slice (2 CPU devices each, one mesh over all, gloo over loopback).

1. Kills (``tests/chaos.py``'s ``chaos_slice``): a random process of the slice is SIGKILLed at a
   random moment, ``--kills`` times over one study; the others must stop by themselves with exit
   42 (the code launchers restart on), and the slice is started again, as a launcher would,
   until the study is done. Nothing completed may be lost or changed.
2. Restarts: what a failed candidate costs (every process starts a fresh worker, a new JAX job)
   against what a lost process costs (the whole slice started again), from the same runs.
3. Step times: each plan's step on one process with 4 devices, and on slices of 2 and 4
   processes with the same 4 devices, side by side. On CPU the slice's collectives cross
   loopback between processes: the ratios say what that costs here, not what a chip does.

    python benchmarks/slice_kills.py [--kills 10] [--trials 16] [--seed 0] [--processes 2]

Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from remat_search.errors import SLICE_RESTART_EXIT  # noqa: E402
from remat_search.report.results import study_report  # noqa: E402
from remat_search.store.attributes import CACHED_ATTR, REUSED_ATTR  # noqa: E402
from tests.chaos import chaos_slice, slice_port, slice_processes  # noqa: E402
from tests.conftest import spec_dict, write_spec  # noqa: E402

WORKLOAD = {"kind": "mlp", "layers": 4, "width": 64, "hidden": 512, "batch": 64}
PLANS = {"layout": "uniform", "choices": ["none", "full", "dots", "dots_no_batch"]}


def kills(folder: Path, *, kills: int, trials: int, seed: int, processes: int) -> dict:
    seen = chaos_slice(folder, kills=kills, trials=trials, processes=processes, seed=seed)
    print("| processes | kills (SIGKILL of a random process) | slice starts | survivors' exits | stopped by the launcher "
          "| finished / spec | left running | complete lost or changed | orphan workers | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    codes = {code: seen["exits"].count(code) for code in sorted(set(seen["exits"]))}
    print(f"| {processes} | {seen['kills']} | {seen['runs']} | {codes} | {seen['stragglers']} | {seen['finished']} / {trials} "
          f"| {seen['running']} | {len(seen['lost'])} | {len(seen['orphans'])} | {seen['seconds']:.0f} s |")
    for said in seen["odd"]:
        print(f"\nA process that was not killed exited other than 0 or 42: {said}")
    return seen


def restarts(folder: Path, seen: dict) -> None:
    """A failed candidate's cost (a fresh JAX job on every process) and a lost process's (the
    slice started again), in seconds, from trial timestamps."""
    spec = write_spec(folder / "failing.yaml", spec_dict(
        f"sqlite:///{folder / 'failing.db'}", study="failing", workload={"factory": "tests.factories:raising_on_process", "args": {"layers": 4}},
        space={"layout": "per_layer", "choices": ["none", "full", "dots"]}, trials=24, mesh={"data": 4},
        sampler={"kind": "random", "seed": 0}, confirm={"top": 0}, timing={"warmup": 1, "repeats": 2, "timeout": "120s"},
    ))
    procs = slice_processes([spec, spec], port=slice_port(), devices=2)
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    trials = sorted(optuna.load_study(study_name="failing", storage=f"sqlite:///{folder / 'failing.db'}").trials,
                    key=lambda t: t.datetime_start)

    def measured(t: optuna.trial.FrozenTrial) -> bool:  # here, not a stored measurement reused
        return t.state == TrialState.COMPLETE and not {REUSED_ATTR, CACHED_ATTR} & set(t.user_attrs)

    def seconds(t: optuna.trial.FrozenTrial) -> float:
        return (t.datetime_complete - t.datetime_start).total_seconds()

    after_failure = [seconds(b) for a, b in zip(trials, trials[1:]) if a.state == TrialState.FAIL and measured(b)]
    after_success = [seconds(b) for a, b in zip(trials, trials[1:]) if measured(a) and measured(b)]
    failed = [seconds(t) for t in trials if t.state == TrialState.FAIL]
    print()
    print("| what | seconds (median) | from |")
    print("|---|---|---|")
    print(f"| a trial measured after a measured one (the workers kept) | {statistics.median(after_success):.1f} "
          f"| {len(after_success)} trials |")
    print(f"| a trial measured after a failed one (every process starts a fresh worker, a new JAX job, first) "
          f"| {statistics.median(after_failure):.1f} | {len(after_failure)} trials |")
    print(f"| a trial that failed to compile on one process (and the workers stopped) | {statistics.median(failed):.1f} "
          f"| {len(failed)} trials |")
    starts = seen.get("restart_seconds") or []
    if starts:
        print(f"| the slice started again after a kill, to its first trial admitted | {statistics.median(starts):.1f} "
              f"| {len(starts)} starts |")


def step_times(folder: Path) -> None:
    """Each plan's anchored step on one process of 4 devices and on slices of 2×2 and 4×1."""
    rows: dict[str, list[float | None]] = {}
    flags = os.environ.get("XLA_FLAGS", "")
    common = {"workload": WORKLOAD, "space": PLANS, "trials": 4, "mesh": {"data": 4}, "confirm": {"top": 0},
              "timing": {"warmup": 2, "repeats": 9, "timeout": "300s", "anchor": False}}
    for column, processes in enumerate((1, 2, 4)):
        storage = f"sqlite:///{folder / f'steps{processes}.db'}"
        spec = write_spec(folder / f"steps{processes}.yaml", spec_dict(storage, study="steps", **common))
        if processes == 1:
            import subprocess

            env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=4",
                   "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            subprocess.run([sys.executable, "-m", "remat_search.cli.app", "run", str(spec)], env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            procs = slice_processes([spec] * processes, port=slice_port(), devices=4 // processes, quiet=True)
            assert [p.wait(timeout=900) for p in procs] == [0] * processes
        for t in study_report(optuna.load_study(study_name="steps", storage=storage)).trials:
            rows.setdefault(t.plan.summary(), [None, None, None])[column] = t.step_seconds
    print()
    print("| plan | 1 process × 4 devices | 2 processes × 2 | ratio | 4 processes × 1 | ratio |")
    print("|---|---|---|---|---|---|")
    for plan, (one, two, four) in rows.items():
        def ms(x: float | None) -> str:
            return f"{x * 1e3:.2f} ms" if x else "—"

        def ratio(x: float | None) -> str:
            return f"{x / one:.2f}" if x and one else "—"

        print(f"| {plan} | {ms(one)} | {ms(two)} | {ratio(two)} | {ms(four)} | {ratio(four)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2, help="processes of the slice killed (2 CPU devices each)")
    args = parser.parse_args()
    os.environ.setdefault("REMAT_SEARCH_HOME", tempfile.mkdtemp(prefix="remat-search-home-"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        seen = kills(Path(folder), kills=args.kills, trials=args.trials, seed=args.seed, processes=args.processes)
        restarts(Path(folder), seen)
        step_times(Path(folder))
    assert seen["kills"] >= args.kills and not seen["lost"] and seen["running"] == 0, seen
    assert set(seen["exits"]) <= {0, SLICE_RESTART_EXIT}, seen["odd"]
    print(f"\n{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
