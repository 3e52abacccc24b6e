"""The house: every import points down the data flow (DESIGN.md, "Data flow").

A module may import only modules of a lower layer, at the top of the file or inside a
function alike; the built-in workloads are found through ``workload.BUILTIN_WORKLOADS``, so
``workload.py`` never imports its own subclasses.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "remat_search"
LAYERS: list[set[str]] = [
    {"errors", "units"},
    {"imports"},
    {"policy"},
    {"plan"},
    {"export"},
    {"spec"},
    {"step_time"},
    {"space", "target", "checkpoint_params", "artifacts"},
    {"workload"},
    {"transformer", "mlp", "nnx_workload", "linen_workload"},
    {"measurement"},
    {"executables"},
    {"runner"},
    {"store"},
    {"cache", "results", "liveness"},
    {"stored"},
    {"study"},
    {"planner"},
    {"submission"},
    {"confirm"},
    {"search"},
    {"report", "doctor", "worker"},
    {"output", "pictures"},
    {"page"},
    {"server"},
    {"cli"},
    {"__init__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def imported(path: Path) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its body."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "remat_search":
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat_search."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("remat_search."))
    return names & RANK.keys()


def test_every_module_has_a_layer() -> None:
    assert {p.stem for p in PACKAGE.glob("*.py")} == set(RANK)


@pytest.mark.parametrize("module", sorted(RANK), ids=str)
def test_imports_point_down(module: str) -> None:
    upward = sorted(name for name in imported(PACKAGE / f"{module}.py") if RANK[name] >= RANK[module])
    assert not upward, f"{module} imports {upward}, which are not below it"
