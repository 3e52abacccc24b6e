"""Chaos: SIGKILL a search, or one of its workers, at random moments, again and again, then let
it finish; and check what is left. The suite runs a short version (tests/test_chaos.py),
``benchmarks/scale.py`` the long one (at least 30 kills).

What must hold afterwards: exactly the spec's trials finished (complete, screened out, or
failed by the runner with a reason), none left running, every trial that was complete at any
kill still there unchanged, every complete trial's plan measurable again, SQLite's integrity
check ok, and no worker process left behind by a killed search.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.trial import TrialState

from remat_search.store.liveness import counts
from remat_search.plans.plan import RematPlan
from remat_search.store.attributes import MEASUREMENT_ATTR, PLAN_ATTR

from .conftest import REPO, run_process, spec_dict, write_spec
from .ports import free_port

WORKLOAD = {"kind": "mlp", "layers": 3, "width": 32, "hidden": 64, "batch": 16}
SPACE = {"layout": "per_layer", "choices": ["none", "full", "dots"]}


def chaos(folder: Path, *, kills: int, trials: int, workers: int = 2, seed: int = 0) -> dict[str, Any]:
    """Run one study of ``trials`` trials with ``workers`` workers, killing the search (or one
    of its workers) ``kills`` times at random moments, then to the end; return what was seen:
    ``kills`` (driver, worker), ``finished``, ``running``, ``lost`` (complete trials missing or
    changed), ``integrity``, ``orphans`` (worker processes alive after their search died),
    ``plans`` (complete trials' plans), ``runs``."""
    rng = random.Random(seed)
    storage = f"sqlite:///{folder / 'chaos.db'}"
    spec = write_spec(folder / "chaos.yaml", spec_dict(
        storage, study="chaos", workload=WORKLOAD, space=SPACE, trials=trials, workers=workers,
        sampler={"kind": "random", "seed": seed}, confirm={"top": 0},
        timing={"warmup": 1, "repeats": 2, "timeout": "120s"}, heartbeat={"interval": 1, "grace": 5},
    ))
    seen: dict[int, tuple[Any, ...]] = {}  # complete trials at each kill: number → (state, values, measurement)
    killed = {"driver": 0, "worker": 0}
    workers_seen: set[int] = set()
    runs = 0
    while sum(killed.values()) < kills:
        search = run_process("run", str(spec))
        runs += 1
        deadline = time.monotonic() + rng.uniform(1.0, 8.0)
        # At a random moment, or at the latest with two trials to go: however fast the host, a
        # search is killed before it finishes as long as kills are left.
        while time.monotonic() < deadline and search.poll() is None and _finished(folder / "chaos.db") < trials - 2:
            workers_seen.update(c.pid for c in _children(search.pid))
            time.sleep(0.05)
        if search.poll() is not None:  # finished before the kill: the study is done
            search.communicate()
            break
        children = _children(search.pid)
        workers_seen.update(c.pid for c in children)
        if children and rng.random() < 0.4:
            rng.choice(children).kill()
            killed["worker"] += 1
            time.sleep(rng.uniform(0.5, 3.0))  # the search goes on without it, for a while
            search.kill()
            killed["driver"] += 1
        else:
            search.kill()
            killed["driver"] += 1
        search.communicate()
        seen.update(_complete(storage))
    final = run_process("run", str(spec))
    log = final.communicate(timeout=900)[0]
    runs += 1
    trials_now = optuna.load_study(study_name="chaos", storage=storage).get_trials(deepcopy=False)
    now = {t.number: _frozen(t) for t in trials_now if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    with sqlite3.connect(folder / "chaos.db") as db:
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
    return {
        "kills": killed, "runs": runs, "final_exit": final.returncode, "final_log": log,
        "finished": sum(counts(t) for t in trials_now),
        "running": sum(1 for t in trials_now if t.state == TrialState.RUNNING),
        "lost": sorted(n for n, frozen in seen.items() if now.get(n) != frozen),
        "integrity": integrity,
        "orphans": _orphans(workers_seen),
        "plans": [RematPlan.model_validate_json(t.user_attrs[PLAN_ATTR]) for t in trials_now
                  if t.state == TrialState.COMPLETE],
        "storage": storage,
    }


def _finished(db: Path) -> int:
    """How many trials of the chaos study are complete now (0 before its tables exist)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=60)) as connection:
            return connection.execute("SELECT count(*) FROM trials WHERE state IN ('COMPLETE', 'PRUNED')").fetchone()[0]
    except sqlite3.OperationalError:  # no database or no tables yet
        return 0


def _asked(db: Path) -> int:
    """How many trials the study has asked for so far, in any state (0 before its tables exist)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=60)) as connection:
            return connection.execute("SELECT count(*) FROM trials").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def _complete(storage: str) -> dict[int, tuple[Any, ...]]:
    try:
        trials = optuna.load_study(study_name="chaos", storage=storage).get_trials(deepcopy=False)
    except KeyError:  # killed before the study was made
        return {}
    return {t.number: _frozen(t) for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}


def _frozen(trial: optuna.trial.FrozenTrial) -> tuple[Any, ...]:
    return trial.state, trial.values, trial.user_attrs.get(MEASUREMENT_ATTR), trial.user_attrs.get(PLAN_ATTR)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


ORPHAN_SECONDS = 120.0
"""How long a worker of a killed search may take to see its parent gone and exit: it looks
every second, but a loaded host may run it late; one still alive past this will not exit."""


def _orphans(pids: set[int]) -> list[int]:
    """The processes of ``pids`` still alive once every worker had :data:`ORPHAN_SECONDS` to
    exit (the wait ends as soon as none is left): whatever the host's speed, only a worker
    that never exits is one."""
    deadline = time.monotonic() + ORPHAN_SECONDS
    while (alive := sorted(pid for pid in pids if _alive(pid))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def chaos_hosts(folder: Path, storage: str, *, kills: int, trials: int, hosts: int = 3, seed: int = 0) -> dict[str, Any]:
    """Run one study of ``trials`` trials on ``storage`` (PostgreSQL) with ``hosts`` "hosts": a
    ``run`` process each, with a host name of its own (``$REMAT_SEARCH_HOST``: none can judge
    another's trials by process id, only by heartbeat). Kill a whole host (its search and its
    worker, ``kill -9`` of the process group) ``kills`` times at random moments, starting it
    again a moment later; then let every host finish. Returns ``kills``, ``runs``, ``exits``
    (the last runs' exit codes), ``finished``, ``running``, ``lost``, ``orphans``, ``seconds``."""
    rng = random.Random(seed)
    spec = write_spec(folder / "chaos-hosts.yaml", spec_dict(
        storage, study="chaos", workload=WORKLOAD, space=SPACE, trials=trials, workers=1,
        sampler={"kind": "random", "seed": seed}, confirm={"top": 0},
        timing={"warmup": 1, "repeats": 2, "timeout": "120s"}, heartbeat={"interval": 1, "grace": 5},
    ))

    def start(host: int) -> Any:
        env = {**os.environ, "PYTHONPATH": str(REPO), "REMAT_SEARCH_HOST": f"host-{host}"}
        return subprocess.Popen(
            [sys.executable, "-m", "remat_search.cli.app", "run", str(spec)], cwd=REPO, env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    started = time.monotonic()
    procs = {h: start(h) for h in range(hosts)}
    runs, killed = hosts, 0
    seen: dict[int, tuple[Any, ...]] = {}
    processes_seen: set[int] = set()
    while killed < kills:
        time.sleep(rng.uniform(0.5, 4.0))
        for p in procs.values():
            processes_seen.update(c.pid for c in _children(p.pid))
        alive = [h for h, p in procs.items() if p.poll() is None]
        if not alive:
            break
        victim = rng.choice(alive)
        os.killpg(procs[victim].pid, signal.SIGKILL)  # the whole host: its search and its worker
        procs[victim].wait()
        killed += 1
        seen.update(_complete(storage))
        procs[victim] = start(victim)
        runs += 1
    exits = [p.wait(timeout=900) for p in procs.values()]
    seconds = time.monotonic() - started
    trials_now = optuna.load_study(study_name="chaos", storage=storage).get_trials(deepcopy=False)
    now = {t.number: _frozen(t) for t in trials_now if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    return {
        "kills": killed, "runs": runs, "exits": exits, "seconds": seconds,
        "finished": sum(counts(t) for t in trials_now),
        "running": sum(1 for t in trials_now if t.state == TrialState.RUNNING),
        "lost": sorted(n for n, frozen in seen.items() if now.get(n) != frozen),
        "orphans": _orphans(processes_seen),
        "hosts": sorted({t.user_attrs.get("host") for t in trials_now if t.user_attrs.get("host")}),
    }


def slice_processes(
    specs: list[Path], *, port: int, devices: int, env: dict[str, str] | None = None, quiet: bool = False,
    logs: list[Any] | None = None,
) -> list[subprocess.Popen[str]]:
    """One ``remat-search run`` a process of a slice on this host, as a launcher starts them
    (``specs[i]`` for process i), each with ``devices`` CPU devices of its own, joined at
    127.0.0.1:``port``; their output piped, or (``quiet``) dropped, or written to ``logs[i]``."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return [
        run_process(
            "run", str(spec), "--coordinator", f"127.0.0.1:{port}", "--processes", str(len(specs)),
            "--process-id", str(i), env={"XLA_FLAGS": flags, **(env or {})},
            **({"stdout": logs[i], "stderr": subprocess.STDOUT} if logs else
               {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL} if quiet else {}),
        )
        for i, spec in enumerate(specs)
    ]


def slice_port() -> int:
    """A free port whose next is free too: a slice's JAX job takes one, its searches the next."""
    return free_port(consecutive=2)


SLICE_EXIT_SECONDS = 120.0
"""How long the other processes of a slice may take to stop once one of them was killed: in
the chaos spec 5 s without a heartbeat, 20 s in a collective, 30 s to join (a process killed
before it joined is told from one not yet started only by then); this bounds a loaded host too."""


def chaos_slice(folder: Path, *, kills: int, trials: int, processes: int = 2, seed: int = 0) -> dict[str, Any]:
    """One study of ``trials`` trials searched by a slice of ``processes`` processes (2 CPU
    devices each, one mesh over all), started as a launcher would: whenever a process ends
    other than with exit 0, the others are waited for (they must stop by themselves within
    :data:`SLICE_EXIT_SECONDS`) and the whole slice is started again. A random process is
    killed (SIGKILL) at a random moment ``kills`` times; then the slice runs to the end.

    Returns ``kills``, ``victims`` (the process id killed each time), ``runs`` (slice starts),
    ``exits`` (the codes of the processes that were not killed, at each kill),
    ``restart_seconds`` (from each start after the first to the first trial it asks for),
    ``stragglers`` (processes that had to be killed because they did not stop by themselves), ``finished``, ``running``, ``lost`` (complete trials
    missing or changed since any kill), ``orphans`` (workers alive after their search died),
    ``final`` (the exit codes of the last start) and ``seconds``."""
    rng = random.Random(seed)
    storage = f"sqlite:///{folder / 'slice.db'}"
    spec = write_spec(folder / "slice.yaml", spec_dict(
        storage, study="chaos", workload=WORKLOAD, space=SPACE, trials=trials, mesh={"data": 2 * processes},
        sampler={"kind": "random", "seed": seed}, confirm={"top": 0},
        timing={"warmup": 1, "repeats": 2, "timeout": "60s"}, heartbeat={"interval": 1, "grace": 5},
        slice={"heartbeat_timeout": "5s", "collective_timeout": "20s", "join_timeout": "30s"},
    ))
    port = slice_port()
    started = time.monotonic()
    seen: dict[int, tuple[Any, ...]] = {}
    exits: list[int | None] = []
    workers_seen: set[int] = set()
    killed = runs = stragglers = 0
    victims: list[int] = []
    final: list[int | None] = []
    restart_seconds: list[float] = []
    odd: list[str] = []  # what a process that exited other than 0 or 42 (and was not killed) said
    while True:
        # A launcher starts the job again in fresh containers: the killed processes' workers are gone.
        _orphans(workers_seen)
        launched, asked_before = time.monotonic(), _asked(folder / "slice.db")
        logs = [(folder / f"run{runs}-{i}.log").open("w") for i in range(processes)]
        procs = slice_processes([spec] * processes, port=port, devices=2, quiet=True, logs=logs)
        runs += 1
        deadline = time.monotonic() + rng.uniform(2.0, 12.0)
        last_run = killed >= kills
        timed = runs == 1  # the first start makes the study: only restarts are timed
        while (last_run or time.monotonic() < deadline) and all(p.poll() is None for p in procs) \
                and (last_run or _finished(folder / "slice.db") < trials - 1):
            for p in procs:
                workers_seen.update(c.pid for c in _children(p.pid))
            if not timed and _asked(folder / "slice.db") > asked_before:
                restart_seconds.append(time.monotonic() - launched)
                timed = True
            time.sleep(0.05)
        if not last_run and all(p.poll() is None for p in procs):
            victim = rng.choice(procs)
            victim.kill()
            victims.append(procs.index(victim))
            killed += 1
        end = time.monotonic() + SLICE_EXIT_SECONDS
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                stragglers += 1
                p.kill()
            p.wait()
        codes = [p.returncode for p in procs]
        exits.extend(c for c in codes if c != -signal.SIGKILL)
        for log, code in zip(logs, codes, strict=True):
            log.close()
            if code not in (0, 42, -signal.SIGKILL):
                said = [line for line in Path(log.name).read_text().splitlines() if line.startswith("error:")]
                odd.append(f"exit {code}: {said[-1] if said else Path(log.name).read_text()[-500:]}")
        seen.update(_complete(storage))
        if all(c == 0 for c in codes):
            final = codes
            break
        if runs > 3 * kills + 10:
            final = codes
            break
    trials_now = optuna.load_study(study_name="chaos", storage=storage).get_trials(deepcopy=False)
    now = {t.number: _frozen(t) for t in trials_now if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    return {
        "kills": killed, "victims": victims, "runs": runs, "exits": exits, "stragglers": stragglers, "final": final,
        "restart_seconds": restart_seconds, "odd": odd,
        "seconds": time.monotonic() - started,
        "finished": sum(counts(t) for t in trials_now),
        "running": sum(1 for t in trials_now if t.state == TrialState.RUNNING),
        "lost": sorted(n for n, frozen in seen.items() if now.get(n) != frozen),
        "orphans": _orphans(workers_seen),
        "trials": trials_now,
    }
