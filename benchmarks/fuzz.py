"""Bad input, fuzzed at length: the strategies of ``tests/search/test_fuzz.py`` over ≥ 1,000 inputs.

    python benchmarks/fuzz.py [INPUTS_PER_CATEGORY]     # default 250 (5 categories)

Each input goes through the real CLI in this process (plan JSON through
``RematPlan.from_json``, which is how a plan is read back), against one real searched study.
The table counts, per category, the inputs tried, those that ended in exit 2 with one line
naming the field, the valid runs (exit 0, or 1 for "nothing fits"), the tracebacks (an
exception that escaped, exit 3 "unexpected", or an error that is not one line) and the times
the real study's database file changed. The first failures are printed after it.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package: its strategies

from tests.search.test_fuzz import (
    QUERIES,
    Fuzzer,
    budgets,
    make_real_study,
    plan_texts,
    specs,
    storage_urls,
    study_names,
)


def _fuzz(strategy: st.SearchStrategy[Any], call: Any, n: int, failures: list[str]) -> None:
    """Try ``n`` inputs of ``strategy`` on ``call``, noting each failure and going on."""

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def once(args: tuple[Any, ...]) -> None:
        try:
            call(*args)
        except AssertionError as e:
            lines = str(e).splitlines()
            failures.append(" / ".join(lines[:6]))

    once()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 250
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        fuzzer = Fuzzer(make_real_study(Path(tmp)))
        categories: list[tuple[str, st.SearchStrategy[Any], Any]] = [
            ("spec", st.tuples(specs("sqlite:///{tmp}/studies.db")), fuzzer.spec),
            ("budget", st.tuples(st.sampled_from(["best", "plan", "confirm"]), budgets), fuzzer.budget),
            ("storage URL", st.tuples(st.sampled_from([*QUERIES, "run"]), storage_urls), fuzzer.storage),
            ("study name", st.tuples(st.sampled_from([q for q in QUERIES if q != "studies"]), study_names),
             fuzzer.study),
            ("plan JSON", st.tuples(plan_texts()), fuzzer.plan_json),
        ]
        seconds: dict[str, float] = {}
        for name, strategy, call in categories:
            start = time.perf_counter()
            _fuzz(strategy, call, n, failures)
            seconds[name] = time.perf_counter() - start
    print("| category | inputs tried | exit-2 errors | valid runs | tracebacks | database changed | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    total = dict.fromkeys(["inputs", "error", "valid", "traceback", "db changed"], 0)
    for name, row in fuzzer.counts.items():
        print(f"| {name} | {row['inputs']} | {row['error']} | {row['valid']} | {row['traceback']} | "
              f"{row['db changed']} | {seconds[name]:.0f} |")
        for key in total:
            total[key] += row[key]
    print(f"| all | {total['inputs']} | {total['error']} | {total['valid']} | {total['traceback']} | "
          f"{total['db changed']} | {sum(seconds.values()):.0f} |")
    for failure in failures[:20]:
        print("FAILED:", failure)


if __name__ == "__main__":
    main()
