"""docker/constraints.txt: the exact version of every package the images install.

    python docker/constraints.py           # write it from this environment (where the tests passed)
    python docker/constraints.py --check   # does it pin every package of each image? (exit 1: no)
    python docker/constraints.py --behind  # which pins are older than what pip resolves today

pip resolves the Dockerfile's own install line (``pip install --dry-run --ignore-installed
--report``) for this Python, with every image's ``TARGET`` (cpu, tpu, cuda) at once, on its
own: nothing installed here enters the resolution but the constraints it is given. Writing
constrains it to the versions installed here (``pip freeze``): what the tests ran with is pinned
as it is, and what is not installed here (CUDA's wheels) as the registry resolves it that day;
that is the file, and the Dockerfile installs with ``-c`` on it. ``--check`` resolves the images
under the file and names every package pip would pick freely (a closure the file does not pin,
so an image would not be the one tested), and ``--behind`` resolves them without it and names
each pin a newer release has overtaken: a stale pin is reported there, never by a test.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name  # the names pip and the registry compare

DOCKER = Path(__file__).resolve().parent
CONSTRAINTS = DOCKER / "constraints.txt"
TARGETS = ("cpu", "tpu", "cuda")
EXTRAS = ("postgres", "service", "dashboard")  # beside the target, in every image (Dockerfile)
HEADER = """\
# The exact version of every package docker/Dockerfile installs, for each TARGET (cpu, tpu, cuda):
# `pip install -c docker/constraints.txt ".[TARGET,postgres,service,dashboard]"`. Written by
# `python docker/constraints.py` from the environment the tests passed in (CUDA's wheels, not
# installed there, as the registry resolved them); `python docker/constraints.py --check` (and
# tests/service/test_docker.py) checks that it pins every package each image needs, and `--behind`
# lists the pins newer releases have overtaken. Do not edit by hand: change pyproject.toml,
# install, run the script again.
"""


def pip(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False,
                          cwd=DOCKER.parent)
    if done.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def resolve(constraints: Path | None = CONSTRAINTS) -> dict[str, str]:
    """The packages (canonical name: version) pip installs for the images (:data:`TARGETS`), under
    ``constraints`` (None: as the registry resolves them today), whatever is installed here.

    One resolution of every image's extras at once: an extra only adds requirements, so where
    every package of it is pinned, so is every package of each image alone (and one run of pip
    costs a third of three)."""
    extras = ",".join((*TARGETS, *EXTRAS))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            *(["-c", str(constraints)] if constraints is not None else []), f".[{extras}]")
        installs = json.loads(report.read_text())["install"]
    found = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    del found["remat-search"]
    return found


def pins(constraints: Path = CONSTRAINTS) -> dict[str, str]:
    """The file's pins, canonical name: version; every line but comments is ``name==version``,
    one a package."""
    lines = [line for line in constraints.read_text().splitlines() if line and not line.startswith("#")]
    bad = [line for line in lines if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", line)]
    if bad:
        raise ValueError(f"{constraints}: expected name==version lines, got {bad}")
    found = {canonicalize_name(name): version for name, version in (line.split("==") for line in lines)}
    if len(found) != len(lines):
        raise ValueError(f"{constraints}: a package pinned twice")
    return found


def unpinned(resolved: dict[str, str], constraints: Path = CONSTRAINTS) -> dict[str, str]:
    """The packages of an image's resolution (:func:`resolve`) the file does not pin at the
    version pip chose: pip picked them freely, so they are whatever the registry has that day."""
    pinned = pins(constraints)
    return {name: version for name, version in resolved.items() if pinned.get(name) != version}


def behind(constraints: Path = CONSTRAINTS) -> dict[str, tuple[str, str]]:
    """Each pin that pip, resolving the images without the file, would now install at another
    version: canonical name: (pinned, resolved today)."""
    pinned = pins(constraints)
    return {name: (pinned[name], version) for name, version in sorted(resolve(None).items())
            if name in pinned and pinned[name] != version}


def write() -> None:
    """Write the file from this environment's packages (see the module's docstring)."""
    frozen = [line for line in pip("freeze", "--exclude-editable").splitlines() if "==" in line]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as here:
        here.write("\n".join(frozen) + "\n")
        here.flush()
        pinned = resolve(Path(here.name))
    lines = [f"{name}=={pinned[name]}" for name in sorted(pinned)]
    CONSTRAINTS.write_text(HEADER + "\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="name each package an image would install unpinned (exit 1)")
    mode.add_argument("--behind", action="store_true", help="name each pin that a newer release has overtaken")
    args = parser.parse_args()
    if args.behind:
        for name, (pinned, today) in behind().items():
            print(f"{name}: pinned {pinned}, resolved today {today}")
        return 0
    if args.check:
        loose = unpinned(resolve())
        for name, version in sorted(loose.items()):
            print(f"{name}=={version} is not pinned by {CONSTRAINTS.name}")
        return 1 if loose else 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
