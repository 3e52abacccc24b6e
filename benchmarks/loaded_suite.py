"""The test suite on a quiet host and on a loaded one: does any outcome depend on the host's speed?

    python benchmarks/loaded_suite.py                     # the whole suite, alone then loaded
    python benchmarks/loaded_suite.py --only loaded -- tests/search   # one folder, loaded only

Loaded means one busy process per core beside the suite (a CPU burner: ``while True: pass``),
so that every compile, step and heartbeat of the suite runs at about half speed or worse. The
tests assert behaviour, never wall time: both runs must pass the same tests. Prints a table of
each run's counts and wall time, and the loaded run's time as a ratio of the quiet one's; the
failures, if any, below it. Run it in the virtual environment the tests run in.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _burn() -> None:
    while True:
        pass


def run_suite(pytest_args: list[str], *, burners: int) -> dict[str, object]:
    """Run pytest with ``burners`` busy processes beside it; its counts, failures and seconds."""
    procs = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(burners)]
    for p in procs:
        p.start()
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args], cwd=REPO,
                              capture_output=True, text=True, check=False, env={**os.environ, "CI": "true"})
    finally:
        for p in procs:
            p.kill()
    seconds = time.monotonic() - started
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"exit": done.returncode, "counts": counts, "failures": failures, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["quiet", "loaded"], help="run one of the two")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="busy processes when loaded")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: the whole suite)")
    args = parser.parse_args()
    runs = {name: burners for name, burners in (("quiet", 0), ("loaded", args.burners)) if args.only in (None, name)}
    results = {}
    for name, burners in runs.items():
        print(f"{name}: pytest {' '.join(args.pytest_args)} with {burners} busy processes beside it ...", flush=True)
        results[name] = run_suite(args.pytest_args, burners=burners)
    print("\n| run | busy processes | exit | passed | failed | skipped | wall time | ratio to quiet |")
    print("|---|---|---|---|---|---|---|---|")
    quiet = results.get("quiet")
    for name, r in results.items():
        c = r["counts"]
        ratio = f"{r['seconds'] / quiet['seconds']:.2f}" if quiet else "—"
        print(f"| {name} | {runs[name]} | {r['exit']} | {c.get('passed', 0)} | {c.get('failed', 0) + c.get('error', 0) + c.get('errors', 0)}"
              f" | {c.get('skipped', 0)} | {r['seconds'] / 60:.1f} min | {ratio} |")
    for name, r in results.items():
        for line in r["failures"]:
            print(f"{name}: {line}")
    sys.exit(max(int(r["exit"]) for r in results.values()))


if __name__ == "__main__":
    main()
