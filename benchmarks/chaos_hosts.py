"""Chaos on several hosts: three "hosts" (a ``run`` process each, with a host name of its own,
``$REMAT_SEARCH_HOST``) search one study on a throwaway PostgreSQL server; whole hosts (search
and worker) are SIGKILLed at random moments and started again (``tests/chaos.py``'s
``chaos_hosts``). No host can judge another's trials by process id: only heartbeats tell.

    python benchmarks/chaos_hosts.py [--kills 30] [--trials 45] [--seed 0]

Prints a Markdown table: kills, runs, trials finished against the spec's, trials left running,
complete trials lost or changed, orphan workers, hosts that measured trials, wall time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos import chaos_hosts  # noqa: E402
from tests.conftest import create_database, throwaway_postgres  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--trials", type=int, default=45)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, throwaway_postgres() as server:
        url = create_database(server, "chaos_hosts")
        seen = chaos_hosts(Path(folder), url, kills=args.kills, trials=args.trials, hosts=3, seed=args.seed)
    print("| hosts | kills of a whole host | runs | finished / spec | left running | complete lost or changed "
          "| orphan workers | hosts that measured | exit codes at the end | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| 3 | {seen['kills']} | {seen['runs']} | {seen['finished']} / {args.trials} | {seen['running']} "
          f"| {len(seen['lost'])} | {len(seen['orphans'])} | {len(seen['hosts'])} | {seen['exits']} "
          f"| {seen['seconds']:.0f} s |")


if __name__ == "__main__":
    main()
