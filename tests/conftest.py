"""Shared helpers: tiny real workloads, spec files, the CLI run in-process or as a process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# LLVM at -O0 for every compile of the suite, in this process and in the workers it spawns:
# XLA:CPU compiles the tiny models about twice as fast, the memory figures (buffer
# assignment, before LLVM) are byte-for-byte the same, and no test judges compute speed.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import optuna  # noqa: E402 - after XLA_FLAGS, which XLA reads when it starts
import pytest  # noqa: E402
import yaml
from typer.testing import CliRunner

from remat_search import output
from remat_search.cli import app

REPO = Path(__file__).resolve().parents[1]
TINY_TRANSFORMER: dict[str, Any] = {
    "kind": "transformer", "layers": 2, "d_model": 32, "heads": 2, "d_ff": 128,
    "seq_len": 32, "batch": 4, "vocab": 64,
}
CHOICES: list[Any] = ["none", "full", "dots", {"label": "save_attn", "names": ["context", "out_proj"]}]
FAST_TIMING = {"warmup": 1, "repeats": 2, "timeout": "120s"}

optuna.logging.set_verbosity(optuna.logging.WARNING)


def spec_dict(storage: str, **overrides: Any) -> dict[str, Any]:
    """A small valid spec on the tiny transformer; ``overrides`` replace top-level fields."""
    spec = {
        "study": "tiny",
        "storage": storage,
        "workload": dict(TINY_TRANSFORMER),
        "space": {"layout": "per_layer", "choices": CHOICES},
        "budget": "1GiB",
        "trials": 6,
        "sampler": {"kind": "tpe", "seed": 0},
        "timing": FAST_TIMING,
        "confirm": {"top": 2, "rounds": 2, "presets": False},  # tests/test_cache.py confirms presets
        "compilation_cache": None,
    }
    spec.update(overrides)
    return spec


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def storage_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'studies.db'}"


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run ``remat-search ARGS`` in this process; returns click's Result (exit_code, stdout, stderr).
    Its tables come out as a wide terminal prints them, every column; a narrow terminal's are
    tested in a process with COLUMNS set (tests/test_cli_run.py)."""
    monkeypatch.setattr(output.console, "width", 200)
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(app, list(args), catch_exceptions=False)

    return invoke


def run_process(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``remat-search ARGS`` as a separate process (for kill -9 and resume tests)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "remat_search.cli", *args], cwd=REPO, env=env, text=True,
        **{"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, **kwargs},
    )
