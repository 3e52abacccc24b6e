"""The house: every import points down the layers that docs/design.md writes once.

A module may import only modules of a lower layer, at the top of the file or inside a
function alike; the built-in workloads are found through ``workloads.base.BUILTIN_WORKLOADS``,
so the base never imports its own subclasses.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "remat_search"
DESIGN = REPO / "docs" / "design.md"


def layers() -> list[set[str]]:
    """The layers of docs/design.md's ``layers`` block, lowest first."""
    block = re.search(r"^```layers\n(.*?)^```", DESIGN.read_text(), re.M | re.S)
    assert block, f"{DESIGN} has no ```layers block"
    return [set(line.split()) for line in block[1].splitlines() if line.strip()]


RANK = {name: rank for rank, names in enumerate(layers()) for name in names}


def module_name(path: Path) -> str:
    """``remat_search/store/cache.py`` as ``store.cache``."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def modules() -> dict[str, Path]:
    """The package's modules (not the packages' ``__init__``) by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"}


def imported(path: Path) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its body."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat_search"):
            parent = node.module.removeprefix("remat_search").lstrip(".")
            for alias in node.names:
                names.add(f"{parent}.{alias.name}" if parent else alias.name)
                names.add(parent)
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("remat_search.") for a in node.names if a.name.startswith("remat_search."))
    return names & RANK.keys()


def test_every_module_has_a_layer() -> None:
    assert set(modules()) == set(RANK)


def test_subpackages_hold_only_their_docstring() -> None:
    """Importing ``remat_search.store.cache`` runs ``remat_search/store/__init__.py``: it
    imports nothing, so no package drags in another's modules (or JAX) on the way down."""
    for init in PACKAGE.glob("*/__init__.py"):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{init} holds more than its docstring"


@pytest.mark.parametrize("module", sorted(RANK), ids=str)
def test_imports_point_down(module: str) -> None:
    upward = sorted(name for name in imported(modules()[module]) if RANK[name] >= RANK[module])
    assert not upward, f"{module} imports {upward}, which are not below it (docs/design.md, Layers)"
