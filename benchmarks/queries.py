"""How fast the queries answer: at a study's own size, and grown to 10,000 trials.

    python benchmarks/queries.py --storage sqlite:///storage/studies.db   # the demo's study

The study is copied to a temporary SQLite file and grown there, in SQL, to ``--trials``
trials: each new trial copies one of the study's complete trials (its state, attributes,
constraint, parameters) with a plan of its own (per-layer choices drawn from the study's
space), its step times scaled and its temporaries moved by a few hundred KiB, so that every
trial has its own plan, time and peak, and its objective values say what its measurement
does. The source is only read.

The table sets each query's own work (the library function in this process, the median of
``--runs`` runs after one to warm up) beside reading the same study through optuna
(``optuna.load_study(...).get_trials()``, and the report built from it, which is how the
queries read studies before) and beside the command's wall time as a process
(``python -m remat_search.cli.app ... --json``: imports included). ``plan`` (the planner's
advice) is timed beside ``best`` twice. As it answers after a search: the search keeps its cost
model fitted to the study's complete trials in the study (``keep_cost_model``, called here on
the grown study as the search calls it when it has finished its trials, and timed), and
``plan`` solves that model, reading only the trials that can be the answer, as ``best`` does.
And as it answers once a trial has completed since (the kept model removed): it reads every
complete trial and fits the model itself. The line under the table gives both over ``best``. A second table gives the commands' wall times at
the study's own size, and ``plan``'s over ``best``'s there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna

import remat_search
from remat_search.plans.plan import RematPlan
from remat_search.plans.policy import LayerPolicy
from remat_search.report.results import study_report
from remat_search.report.stored import open_study
from remat_search.search.cost_model import keep_cost_model
from remat_search.search.space import Space
from remat_search.spec.space import SpaceConfig
from remat_search.store.attributes import COST_MODEL_ATTR, LAYERS_ATTR
from remat_search.units import format_bytes, parse_bytes

REPO = Path(__file__).resolve().parents[1]
# Attributes a copy keeps as they are (the rest are the plan's, written anew, or say where the
# trial's measurement came from, which a copy does not share).
KEPT = ("host", "pid", "pid_started")


def grow(db: Path, study: str, trials: int, seed: int = 0) -> int:
    """Add copies of ``study``'s complete trials to the SQLite file ``db`` until it has
    ``trials`` trials; return how many it had."""
    with open_study(study, f"sqlite:///{db}") as stored:
        results = {t.number: t for t in stored.trials()}
        space = stored.attrs["space"]
    rng = random.Random(seed)
    choices = [(c["label"], LayerPolicy(**c["policy"])) for c in space["choices"]]
    connection = sqlite3.connect(db)
    rows = connection.execute(
        "SELECT trial_id, number, state, datetime_start, datetime_complete FROM trials "
        "WHERE study_id = (SELECT study_id FROM studies WHERE study_name = ?) ORDER BY trial_id", (study,)
    ).fetchall()
    study_id = connection.execute("SELECT study_id FROM studies WHERE study_name = ?", (study,)).fetchone()[0]
    budget = json.loads(connection.execute(
        "SELECT value_json FROM study_user_attributes WHERE study_id = ? AND key = 'budget'", (study_id,)
    ).fetchone()[0])
    templates = [r for r in rows if r[2] == "COMPLETE" and results[r[1]].measurement is not None
                 and results[r[1]].measurement.memory is not None]
    distribution = connection.execute(
        "SELECT distribution_json FROM trial_params WHERE trial_id = ? LIMIT 1", (templates[0][0],)
    ).fetchone()[0]
    labels_of = [c["label"] for c in space["choices"]]
    seen = {t.plan.digest for t in results.values() if t.plan is not None}
    layers = len(next(t.plan for t in results.values() if t.plan is not None).layers)
    start = len(rows)
    for number in range(start, trials):
        trial_id, template, state, started, completed = templates[number % len(templates)]
        m = results[template].measurement
        assert m is not None and m.memory is not None
        while True:
            picked = [rng.choice(choices) for _ in range(layers)]
            plan = RematPlan(layers=tuple(p for _, p in picked))
            if plan.digest not in seen:
                break
        seen.add(plan.digest)
        measured = m.status == "measured"
        memory = m.memory.model_copy(update={"temp": max(0, m.memory.temp + rng.randint(-2**20 if measured else 0, 0 if measured else 2**20))})
        copy = m.model_copy(update={
            "plan_digest": plan.digest, "memory": memory,
            "step_times": tuple(t * rng.uniform(0.95, 1.6) for t in m.step_times) if measured else m.step_times,
        })
        copy = type(m).model_validate_json(copy.model_dump_json())  # as a reader will see it
        seconds, peak = copy.step_seconds, copy.peak_bytes
        assert peak is not None
        new = connection.execute(
            "INSERT INTO trials (number, study_id, state, datetime_start, datetime_complete) VALUES (?, ?, ?, ?, ?)",
            (number, study_id, state, started, completed),
        ).lastrowid
        connection.executemany("INSERT INTO trial_values (trial_id, objective, value, value_type) VALUES (?, ?, ?, ?)", [
            (new, 0, seconds, "FINITE") if seconds is not None else (new, 0, None, "INF_POS"),
            (new, 1, float(peak), "FINITE"),
        ])
        kept = connection.execute(
            f"SELECT key, value_json FROM trial_user_attributes WHERE trial_id = ? AND key IN {KEPT}", (trial_id,)
        ).fetchall()
        attrs = [*kept, ("plan", json.dumps(plan.to_json())), ("labels", json.dumps([label for label, _ in picked])),
                 ("measurement", json.dumps(copy.model_dump_json()))]
        connection.executemany("INSERT INTO trial_user_attributes (trial_id, key, value_json) VALUES (?, ?, ?)",
                               [(new, k, v) for k, v in attrs])
        connection.execute("INSERT INTO trial_system_attributes (trial_id, key, value_json) VALUES (?, ?, ?)",
                           (new, "constraints:budget", json.dumps(peak / budget - 1.0)))
        connection.executemany(
            "INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json) VALUES (?, ?, ?, ?)",
            [(new, f"layer_{i:02d}", float(labels_of.index(label)), distribution) for i, (label, _) in enumerate(picked)],
        )
    connection.commit()
    connection.close()
    return start


def keep(study: str, url: str) -> float:
    """Keep the study's cost model in it as its search does when it has finished its trials;
    return how long that took."""
    begin = time.perf_counter()
    with open_study(study, url) as stored:
        space = Space.of(SpaceConfig.model_validate(stored.attrs["space"]), stored.attrs[LAYERS_ATTR])
    assert keep_cost_model(optuna.load_study(study_name=study, storage=url), space) is not None
    return time.perf_counter() - begin


def median_seconds(work: Callable[[], Any], runs: int, *, warm: bool = True) -> tuple[float, Any]:
    """The median wall time of ``runs`` calls of ``work`` (after one unmeasured call if
    ``warm``), and what the last call returned."""
    if warm:
        work()
    times = []
    for _ in range(runs):
        begin = time.perf_counter()
        out = work()
        times.append(time.perf_counter() - begin)
    return statistics.median(times), out


def cli_seconds(args: list[str], runs: int) -> tuple[float, float]:
    """The fastest and slowest wall time of ``runs`` runs of the command as a process."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    times = []
    for _ in range(runs):
        begin = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "remat_search.cli.app", *args], env=env, cwd=REPO,
                              capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - begin)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(args)} failed: {done.stderr}")
    return min(times), max(times)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", required=True, help="SQLite URL of the study to copy (only read).")
    parser.add_argument("--study", default="demo-transformer-cpu")
    parser.add_argument("--budget", default="38MiB")
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=7, help="Runs of each in-process query (median).")
    parser.add_argument("--cli-runs", type=int, default=5, help="Runs of each command as a process.")
    a = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    budget = parse_bytes(a.budget)
    source = Path(a.storage.removeprefix("sqlite:///"))
    with tempfile.TemporaryDirectory() as folder:
        small, db, stale = Path(folder) / "small.db", Path(folder) / "grown.db", Path(folder) / "stale.db"
        shutil.copyfile(source, small)
        shutil.copyfile(source, db)
        had = grow(db, a.study, a.trials)
        url, small_url = f"sqlite:///{db}", f"sqlite:///{small}"

        print(f"Study {a.study!r} grown from {had} to {a.trials:,} trials; `best --budget {a.budget}` "
              f"({format_bytes(budget)}); in-process: median of {a.runs} runs; commands: {a.cli_runs} runs, "
              "fastest–slowest\n")
        own_best, found = median_seconds(lambda: remat_search.best_plan(a.study, budget, url), a.runs)
        kept_s = keep(a.study, url)
        own_plan, kept_advice = median_seconds(lambda: remat_search.plan_for_budget(a.study, budget, storage=url), a.runs)
        stale_url = f"sqlite:///{stale}"
        shutil.copyfile(db, stale)
        optuna.load_study(study_name=a.study, storage=stale_url).set_user_attr(COST_MODEL_ATTR, None)
        own_fit, fitted_advice = median_seconds(
            lambda: remat_search.plan_for_budget(a.study, budget, storage=stale_url), a.runs)
        assert kept_advice == fitted_advice, "the kept model answers otherwise than a fit"
        own_front, front = median_seconds(lambda: remat_search.pareto_front(a.study, url), a.runs)
        own_studies, _ = median_seconds(lambda: remat_search.list_studies(url), a.runs)
        optuna_runs = max(1, a.runs // 3)
        trials_s, _ = median_seconds(lambda: optuna.load_study(study_name=a.study, storage=url).get_trials(),
                                     optuna_runs, warm=False)
        report_s, report = median_seconds(
            lambda: study_report(optuna.load_study(study_name=a.study, storage=url)), optuna_runs, warm=False)
        assert found == report.best(budget) and front == list(report.front), "the queries disagree with optuna's read"
        print(f"| query at {a.trials:,} trials | its own work (library, in process) | the study read through optuna: "
              "`get_trials()` / the report from it | the command, wall (process) |")
        print("|---|---|---|---|")
        walls: dict[str, float] = {}
        for name, own, args in (
            (f"`best --budget {a.budget}`", own_best, ["best", "--study", a.study, "--budget", a.budget, "--json"]),
            ("`pareto`", own_front, ["pareto", "--study", a.study, "--json"]),
            ("`studies`", own_studies, ["studies"]),
            (f"`plan --budget {a.budget}`, model kept by the search", own_plan,
             ["plan", "--study", a.study, "--budget", a.budget, "--json"]),
            (f"`plan --budget {a.budget}`, a trial completed since (fits)", own_fit,
             ["plan", "--study", a.study, "--budget", a.budget, "--json", "--storage", stale_url]),
        ):
            low, high = cli_seconds(args if "--storage" in args else [*args, "--storage", url], a.cli_runs)
            walls[name.split(",")[-1] if "plan" in name else name.split()[0].strip("`")] = high
            print(f"| {name} | {ms(own)} | {ms(trials_s)} / {ms(report_s)} | {low:.2f}–{high:.2f} s |")
        print(f"\n`plan` over `best` at {a.trials:,} trials, the model kept: {own_plan / own_best:.2f}× in process, "
              f"{walls[' model kept by the search'] / walls['best']:.2f}× as commands (slowest runs); fitting it: "
              f"{own_fit / own_best:.1f}× in process, {walls[' a trial completed since (fits)'] / walls['best']:.2f}× as commands")
        print(f"\nKeeping the model at the end of a search of {a.trials:,} trials (reading them through optuna "
              f"and fitting): {kept_s:.1f} s")
        print(f"\n(the same answers: best is trial {found.number}, the front has {len(front)} plans, as the "
              "report read through optuna says)\n")

        print(f"| command at {had} trials | wall (process) |")
        print("|---|---|")
        small_walls: dict[str, float] = {}
        for args in (
            ["--help"],
            ["best", "--study", a.study, "--budget", a.budget, "--json"],
            ["pareto", "--study", a.study],
            ["show", "--study", a.study],
            ["studies"],
            ["plan", "--study", a.study, "--budget", a.budget],
        ):
            low, high = cli_seconds(args if args == ["--help"] else [*args, "--storage", small_url], a.cli_runs)
            small_walls[args[0]] = high
            print(f"| `{' '.join(args[:1] + args[3:] if len(args) > 1 else args)}` | {low:.2f}–{high:.2f} s |")
        print(f"\n`plan` over `best` at {had} trials, as commands (slowest runs): "
              f"{small_walls['plan'] / small_walls['best']:.2f}×")


if __name__ == "__main__":
    main()
