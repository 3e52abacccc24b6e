"""Write docker/constraints.txt: the exact version of every package the images install.

    python docker/constraints.py          # from the repository root, where the tests pass

For each image (``TARGET`` cpu, tpu, cuda) pip resolves the Dockerfile's own install line
(``pip install --dry-run --ignore-installed --report``) for Linux x86-64 and this Python,
constrained to the versions installed here (``pip freeze``): what the tests ran with is pinned
as it is, and what is not installed here (CUDA's wheels) as PyPI resolves it that day. The
union of the three resolutions is the file; the Dockerfile installs with ``-c`` on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

DOCKER = Path(__file__).resolve().parent
TARGETS = ("cpu", "tpu", "cuda")
EXTRAS = ("postgres", "service", "dashboard")  # beside the target, in every image (Dockerfile)
HEADER = """\
# The exact version of every package docker/Dockerfile installs, for each TARGET (cpu, tpu, cuda):
# `pip install -c docker/constraints.txt ".[TARGET,postgres,service,dashboard]"`. Written by
# `python docker/constraints.py` from the environment the tests passed in (CUDA's wheels, not
# installed there, as PyPI resolved them); tests/test_docker.py checks that it pins every package
# each image needs. Do not edit by hand: change pyproject.toml, install, run the script again.
"""


def pip(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=True).stdout


def resolve(target: str, constraints: Path) -> dict[str, str]:
    """The packages (name: version) pip installs for the ``target`` image, under ``constraints``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            "-c", str(constraints), f".[{','.join((target, *EXTRAS))}]")
        installs = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in installs if i["metadata"]["name"] != "remat-search"}


def main() -> None:
    frozen = [line for line in pip("freeze", "--exclude-editable").splitlines() if "==" in line]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as here:
        here.write("\n".join(frozen) + "\n")
        here.flush()
        pinned = {name: version for target in TARGETS for name, version in resolve(target, Path(here.name)).items()}
    lines = [f"{name}=={pinned[name]}" for name in sorted(pinned, key=str.lower)]
    (DOCKER / "constraints.txt").write_text(HEADER + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
