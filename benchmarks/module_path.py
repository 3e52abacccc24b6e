"""The path a spec takes through the package's modules in one ``search.run``.

    PYTHONPATH=$PWD python benchmarks/module_path.py [--show]

Runs a tiny spec (a two-layer MLP, two trials, no confirmation) on a temporary SQLite file
twice: a new study, then the same spec again with one trial more (a resume). From the call
of ``run`` until its study is open (it tells ``start``), a profile hook on the calling thread
records the module of every function of ``remat_search`` that a function of another of its
modules calls (a function that pydantic or optuna calls back is not the spec's path),
consecutive calls into one module counted once. Of that path it counts:

- ``modules``: the distinct modules entered;
- ``climbs``: steps into a module of a higher layer than the one before (docs/design.md's
  ``layers`` block, lowest first): the path climbing back up;
- ``returns``: steps into a module the path had already left;
- ``edges``: the distinct (caller, callee) pairs of modules, and ``run's fan-out``: the
  modules ``search.loop`` itself calls into.

Module bodies run by an import are not counted (only functions), so a warm and a cold run
compare. Before opening had one place (commit fb7940a) the resumed path entered 15 modules,
climbed 21 times and returned 29 times over 23 edges, ``run`` calling into 9 modules.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

import optuna

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "remat_search"


def ranks() -> dict[str, int]:
    """Each module's layer in docs/design.md, lowest first."""
    block = re.search(r"^```layers\n(.*?)^```", (REPO / "docs" / "design.md").read_text(), re.M | re.S)
    assert block is not None
    lines = [line.split() for line in block[1].splitlines() if line.strip()]
    return {name: rank for rank, names in enumerate(lines) for name in names}


class Path_(NamedTuple):
    """Where one ``search.run`` went, from its call until it told ``start`` (the study open)."""

    calls: list[str]
    """The module of each call of one of the package's modules by another, repeats in a row once."""
    edges: set[tuple[str, str]]
    """(caller, callee) of those calls."""


def traced(spec: Any) -> Path_:
    """Run ``spec`` and follow it on this thread until its study is open: each call of a
    function of one module of the package by a function of another (a validator that pydantic
    calls is not the path: only the package's own calls count)."""
    from remat_search.search.loop import run

    calls: list[str] = []
    edges: set[tuple[str, str]] = set()
    package = str(PACKAGE) + "/"
    opened = False

    def module_of(frame: FrameType | None) -> str | None:
        filename = frame.f_code.co_filename if frame is not None else ""
        if not filename.startswith(package):
            return None
        return ".".join(Path(filename[len(package):]).with_suffix("").parts)

    def hook(frame: FrameType, event: str, _: Any) -> None:
        if opened or event != "call" or frame.f_code.co_name == "<module>":
            return
        back = frame.f_back
        while back is not None and back.f_code.co_filename == contextlib.__file__:
            back = back.f_back  # a context manager's generator is called by its `with`
        callee, caller = module_of(frame), module_of(back)
        if callee is None or caller is None or callee == caller:
            return
        edges.add((caller, callee))
        if not calls:
            calls.append(caller)
        if calls[-1] != callee:
            calls.append(callee)

    def tell(progress: Any) -> None:
        nonlocal opened
        opened = opened or progress.event == "start"

    sys.setprofile(hook)
    try:
        run(spec, on_progress=tell)
    finally:
        sys.setprofile(None)
    return Path_(calls, edges)


def counts(path: Path_, rank: dict[str, int]) -> dict[str, int]:
    calls = path.calls
    return {
        "modules": len(set(calls)),
        "climbs": sum(1 for a, b in zip(calls, calls[1:]) if rank.get(b, -1) > rank.get(a, -1)),
        "returns": sum(1 for i, m in enumerate(calls) if m in calls[:i]),
        "edges": len(path.edges),
        "run's fan-out": sum(1 for caller, _ in path.edges if caller == "search.loop"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--show", action="store_true", help="print each path")
    args = parser.parse_args()
    logging.getLogger("remat_search").setLevel(logging.ERROR)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    from remat_search.spec.loading import parse_spec

    rank = ranks()
    with tempfile.TemporaryDirectory() as tmp:
        spec: dict[str, Any] = {
            "study": "path", "storage": f"sqlite:///{tmp}/studies.db",
            "workload": {"kind": "mlp", "layers": 2, "width": 32, "hidden": 64, "batch": 16},
            "space": {"layout": "uniform", "choices": ["none", "full"]}, "budget": "1GiB", "trials": 2,
            "sampler": {"kind": "tpe", "seed": 0}, "timing": {"warmup": 1, "repeats": 2, "timeout": "120s"},
            "confirm": {"top": 0}, "compilation_cache": None,
        }
        for name, trials in (("new study", 2), ("resumed", 3)):
            path = traced(parse_spec({**spec, "trials": trials}))  # the spec's own validation is not the path
            print(f"{name:10} {counts(path, rank)}")
            if args.show:
                print("  " + " → ".join(path.calls))
                print("  " + ", ".join(f"{a}→{b}" for a, b in sorted(path.edges)))


if __name__ == "__main__":
    main()
