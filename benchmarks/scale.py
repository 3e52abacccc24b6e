"""Scale-out and reliability, measured in one run:

    python benchmarks/scale.py [--quick]

1. **Workers.** One compile-bound study (a TPU target compiled ahead of time: every trial is
   a compile) at ``--workers`` 1, 2 and 4, each from an empty database and no compilation
   cache: wall time and trials per hour as ratios to one worker, and the cores one compile
   keeps busy (the search's and its workers' CPU seconds over wall seconds at one worker),
   with the largest worker's resident memory. From those two, the speed-up projected on
   hosts of 16 and 64 cores, and which of cores and memory limits it.
2. **Chaos.** A search SIGKILLed at random moments, driver and workers, at least 30 times,
   then let finish (``tests/chaos.py``): kills survived, complete trials lost, trials left
   running, orphan workers.
3. **Contention.** Several ``run`` processes on one study at once: 2 × 2 workers on SQLite,
   3 × 1 on a throwaway PostgreSQL server (as the tests start one): trials finished against the
   spec's, and "database is locked" errors.
4. **Fuzzed bad input** (``benchmarks/fuzz.py``, 200 inputs of each of 5 kinds): inputs tried
   and tracebacks seen.
5. **Queries at 10,000 trials** (``benchmarks/queries.py``, the SQLite contention study grown).

``--sections`` runs some of them (all take about half an hour here).

Figures go to stdout as Markdown tables (README's *Scale-out* section quotes them).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remat_search.store.liveness import counts
from tests.chaos import chaos
from tests.conftest import (
    PostgresUnavailable,
    create_database,
    run_process,
    spec_dict,
    throwaway_postgres,
    write_spec,
)

COMPILE_BOUND = {  # a v5e compile of it takes tens of seconds on this 2-core host
    "kind": "transformer", "layers": 2, "d_model": 256, "heads": 4, "d_ff": 1024,
    "seq_len": 512, "batch": 8, "vocab": 8192, "dtype": "bfloat16",
}
CHOICES = ["none", "full", "dots"]
GIB = 2**30


def workers_table(folder: Path, trials: int, counts_of_workers: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Run the compile-bound study once per worker count; return wall, CPU and RSS of each."""
    seen: dict[int, dict[str, float]] = {}
    for n in counts_of_workers:
        db = folder / f"workers-{n}.db"
        spec = write_spec(folder / f"workers-{n}.yaml", spec_dict(
            f"sqlite:///{db}", study=f"workers-{n}", workload=COMPILE_BOUND,
            space={"layout": "per_layer", "choices": CHOICES}, trials=trials, budget=None,
            target={"platform": "tpu", "topology": "v5e:2x2"}, sampler={"kind": "random", "seed": 0},
            timing={"timeout": "1800s"}, confirm={"top": 0}, compilation_cache=None,
        ))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        search = run_process("run", str(spec), "--workers", str(n))
        log = search.communicate()[0]
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if search.returncode != 0:
            raise SystemExit(f"--workers {n} failed:\n{log}")
        finished = sum(counts(t) for t in optuna.load_study(study_name=f"workers-{n}", storage=f"sqlite:///{db}").trials)
        seen[n] = {
            "wall": wall, "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "rss": after.ru_maxrss * 1024, "finished": finished,
        }
        print(f"  --workers {n}: {wall:.0f} s, {finished} trials", file=sys.stderr, flush=True)
    return seen


def contention(folder: Path, *, processes: int, workers: int, storage: str, trials: int) -> dict[str, int]:
    """``processes`` searches of ``workers`` workers each on one study at once."""
    spec = write_spec(folder / f"contention-{processes}x{workers}.yaml", spec_dict(
        storage, study=f"contention-{processes}x{workers}",
        # 10 layers of 3 choices: plans enough (59,049) for the queries to grow the study to 10,000
        workload={"kind": "mlp", "layers": 10, "width": 32, "hidden": 64, "batch": 16},
        space={"layout": "per_layer", "choices": CHOICES}, trials=trials, workers=workers,
        sampler={"kind": "tpe", "seed": 0}, confirm={"top": 0},
    ))
    searches = [run_process("run", str(spec)) for _ in range(processes)]
    logs = [s.communicate()[0] for s in searches]
    study = optuna.load_study(study_name=f"contention-{processes}x{workers}", storage=storage)
    return {
        "workers": processes * workers, "finished": sum(counts(t) for t in study.trials),
        "running": sum(t.state == optuna.trial.TrialState.RUNNING for t in study.trials),
        "lock_errors": sum(log.count("database is locked") for log in logs),
        "failed_runs": sum(s.returncode != 0 for s in searches),
    }


SECTIONS = ("workers", "chaos", "contention", "fuzz", "queries")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer trials, kills and fuzzed inputs: a smoke run")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"which to run, comma-separated (default: all of {', '.join(SECTIONS)})")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if unknown := sections - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(unknown)}; expected some of {', '.join(SECTIONS)}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials, kills = (4, 5) if args.quick else (12, 30)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if "workers" in sections:
            workers_section(folder, trials, (1, 2) if args.quick else (1, 2, 4))
        if "chaos" in sections:
            chaos_section(folder, kills)
        if sections & {"contention", "queries"}:  # the queries grow the SQLite contention study
            sqlite = contention_section(folder)
        if "fuzz" in sections:
            print("\n## Fuzzed bad input (benchmarks/fuzz.py)\n", flush=True)
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "fuzz.py"), "20" if args.quick else "200"],
                           check=True, cwd=REPO)
        if "queries" in sections:
            print("\n## Queries at 10,000 trials (benchmarks/queries.py, the SQLite contention study grown)\n", flush=True)
            subprocess.run([
                sys.executable, str(REPO / "benchmarks" / "queries.py"), "--storage", sqlite,
                "--study", "contention-2x2", "--budget", "1GiB", *(["--trials", "1000"] if args.quick else []),
            ], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def workers_section(folder: Path, trials: int, counts_of_workers: tuple[int, ...]) -> None:
    seen = workers_table(folder, trials, counts_of_workers)
    one = seen[1]
    cores_per_compile = one["cpu"] / one["wall"]
    print(f"\n## Workers: {trials} trials of a compile-bound study (TPU v5e:2x2 target), this host: "
          f"{len(os.sched_getaffinity(0))} cores\n")
    print("| workers | wall | trials/hour | vs 1 worker | cores busy | largest worker RSS |")
    print("|---|---|---|---|---|---|")
    for n, s in seen.items():
        print(f"| {n} | {s['wall']:.0f} s | {3600 * s['finished'] / s['wall']:.0f} | "
              f"{(s['finished'] / s['wall']) / (one['finished'] / one['wall']):.2f}× | "
              f"{s['cpu'] / s['wall']:.2f} | {s['rss'] / GIB:.2f} GiB |")
    print(f"\nOne compile keeps {cores_per_compile:.2f} cores busy; a worker holds up to {one['rss'] / GIB:.2f} GiB.\n")
    print("| host | workers by cores | workers by memory (4 GiB a core) | projected speed-up | limited by |")
    print("|---|---|---|---|---|")
    for cores in (16, 64):
        by_cores = cores / cores_per_compile
        by_memory = cores * 4 * GIB / one["rss"]
        limit = "cores" if by_cores <= by_memory else "memory"
        print(f"| {cores} cores, {cores * 4} GiB | {by_cores:.1f} | {by_memory:.1f} | "
              f"{min(by_cores, by_memory):.1f}× | {limit} |", flush=True)


def chaos_section(folder: Path, kills: int) -> None:
    chaos_folder = folder / "chaos"
    chaos_folder.mkdir()
    c = chaos(chaos_folder, kills=kills, trials=3 * kills // 2, workers=2, seed=1)
    print("\n## Chaos: SIGKILL at random moments\n")
    print("| kills (driver + worker) | runs | trials finished / spec | complete trials lost | left running "
          "| orphan workers | integrity_check |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {sum(c['kills'].values())} ({c['kills']['driver']} + {c['kills']['worker']}) | {c['runs']} | "
          f"{c['finished']} / {3 * kills // 2} | {len(c['lost'])} | {c['running']} | {len(c['orphans'])} | "
          f"{c['integrity']} |", flush=True)


def contention_section(folder: Path) -> str:
    """Run the contention table; return the SQLite study's URL."""
    print("\n## Contention: several `run` processes on one study\n")
    print("| storage | processes × workers | trials finished / spec | left running | lock errors | runs failed |")
    print("|---|---|---|---|---|---|")
    sqlite = f"sqlite:///{folder / 'contention.db'}"
    r = contention(folder, processes=2, workers=2, storage=sqlite, trials=12)
    print(f"| SQLite | 2 × 2 | {r['finished']} / 12 | {r['running']} | {r['lock_errors']} | {r['failed_runs']} |")
    try:
        with throwaway_postgres() as server:
            url = create_database(server, "contention")
            r = contention(folder, processes=3, workers=1, storage=url, trials=12)
            print(f"| PostgreSQL | 3 × 1 | {r['finished']} / 12 | {r['running']} | {r['lock_errors']} | "
                  f"{r['failed_runs']} |", flush=True)
    except PostgresUnavailable as e:
        print(f"| PostgreSQL | not run: {e} | | | | |")
    return sqlite


if __name__ == "__main__":
    main()
