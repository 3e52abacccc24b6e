"""README is the front door and docs/ holds the rest: every link and every path they name
exists, README stays short, and its two commands are the ones CI and the demo use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w/.-])((?:tests|benchmarks|remat_search|search_spaces|docker|docs)/[\w./-]*\w)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings: lower case, punctuation dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file, or heading, is not there."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_points_to_a_file_and_heading_that_exist(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_the_text_names_exists(page: Path) -> None:
    named = {m.rstrip(".") for m in PATH.findall(page.read_text())}
    missing = sorted(p for p in named if not any(REPO.glob(p)) and "<" not in p)
    assert missing == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [no heading](there.md#nope) [web](https://x.y)\n")
    assert broken_links(page) == ["missing.md", "there.md#nope"]


def test_readme_is_a_front_door_linking_every_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(text) if t.startswith("docs/")}
    assert linked == {p.resolve() for p in PAGES[1:]}


def test_readmes_two_commands_are_the_ones_ci_and_the_demo_run() -> None:
    """The first two bash blocks: install and run the demo, install and run the tests; .ci/run
    ends with the second, run in a virtual environment it has just made, and the demo's spec is
    there."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    demo, tests = (b.strip() for b in blocks[:2])
    assert demo == "pip install -e . && remat-search run search_spaces/demo.yaml"
    assert (REPO / "search_spaces" / "demo.yaml").is_file()
    assert tests == "pip install -e '.[test]' && pytest"
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == tests
    # in a new virtual environment, made and entered just before: what a new machine resolves
    assert ci[-5:-1] == ['VENV=$(mktemp -d)', "trap 'rm -rf \"$VENV\"' EXIT", 'python3 -m venv --upgrade-deps "$VENV"', '. "$VENV/bin/activate"']
    assert "python3 -m venv --upgrade-deps .venv" in README.read_text()  # as README tells a new user


def test_every_spec_in_search_spaces_loads() -> None:
    """The specs users start from are valid, whatever they search (a MaxText-shaped one too)."""
    from remat_search.spec.loading import load_spec

    specs = sorted((REPO / "search_spaces").glob("*.yaml"))
    assert len(specs) >= 4
    for path in specs:
        assert load_spec(path).study, path


def test_the_maxtext_answer_in_the_spec_page_is_what_best_prints_for_its_study(cli) -> None:  # type: ignore[no-untyped-def]
    """docs/spec.md shows `best --format maxtext` of the MaxText-shaped study kept in
    benchmarks/results/studies: read from that study now, it prints the same settings."""
    page = (REPO / "docs" / "spec.md").read_text()
    shown = page.split("--budget device --format maxtext` printed:\n\n```yaml\n", 1)[1].split("```", 1)[0]
    storage = f"sqlite:///{REPO / 'benchmarks' / 'results' / 'studies' / 'maxtext-16b-v5e.db'}"
    result = cli("best", "--study", "maxtext-16b-v5e", "--budget", "device", "--format", "maxtext", "--storage", storage)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == shown
    assert "per_device_batch_size: 6" in shown and "remat_policy:" in shown
