"""The study's page in a real headless browser: Debian's Chromium, driven by playwright, against
``remat-search serve`` on loopback. It shows the front, the budget box and the plan that `best`
returns for a budget typed into it, and a screenshot of it is kept.

Where no Chromium can be started the test is skipped with the reason, except under CI (``$CI``
set), where it fails: CI must run it (``.ci/run`` installs chromium)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import remat_search
from remat_search.spec.loading import parse_spec
from remat_search.report.stored import open_study
from remat_search.units import format_bytes, format_seconds

from tests.conftest import REPO, spec_dict
from .serving import env, serve_command, serving

pytestmark = pytest.mark.slow  # drives Chromium

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
BUDGET = "1100KiB"
TEAM_SCREENSHOT = Path("/tmp/team/page.png")  # where the people building this look at it


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium (Debian's, not playwright's download)."""
    reason = None
    if importlib.util.find_spec("playwright") is None:
        reason = "the playwright package is not installed (pip install -e '.[test]')"
    elif not CHROMIUM.exists():
        reason = f"no {CHROMIUM} (apt-get install chromium)"
    if reason is None:
        from playwright.sync_api import Error, sync_playwright

        driver = sync_playwright().start()
        try:
            launched = driver.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        except Error as e:
            driver.stop()
            reason = f"Chromium did not start ({str(e).strip().splitlines()[0]})"
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the browser test cannot run under CI: {reason}", pytrace=False)
        pytest.skip(reason)
    try:
        yield launched
    finally:
        launched.close()
        driver.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """``serve`` over a storage holding study ``tiny``, finished by a real (tiny) search: its
    base URL and the storage. Its budget is near its plans' peaks (no remat's is over it, as in
    a real study), so that the front fills the picture."""
    url = f"sqlite:///{tmp_path_factory.mktemp('page') / 'studies.db'}"
    remat_search.run(parse_spec(spec_dict(url, trials=8, budget=BUDGET)))
    with serving(url) as base:
        yield base, url


def _best_json(storage: str, budget: str) -> str:
    done = subprocess.run([*serve_command()[:3], "best", "--study", "tiny", "--budget", budget, "--storage", storage,
                           "--json"], cwd=REPO, env=env(), capture_output=True, text=True, check=True, timeout=120)
    return done.stdout.strip()


def test_the_page_shows_the_front_and_answers_a_budget_typed_into_it(browser: Any, server: tuple[str, str], tmp_path: Path) -> None:
    base, storage = server
    with open_study("tiny", storage) as stored:
        front = stored.front()
        smallest = front[0]  # least memory: the answer for its own peak (the fastest too where it is alone)
        assert smallest.peak_bytes is not None and smallest.seconds is not None
        typed = f"{-(-smallest.peak_bytes // 1024)}KiB"  # its peak rounded up, as a person types a size
        assert stored.best(remat_search.units.parse_bytes(typed)) == smallest
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    try:
        response = page.goto(base + "/studies/tiny")
        assert response is not None and response.ok
        assert page.title().startswith("tiny")
        assert page.locator("#front svg").count() == 1 and page.locator("#front svg").is_visible()
        assert page.locator("#layers svg").count() == 1
        assert page.locator("#progress .value").inner_text() == "8/8"
        assert page.locator("#eta .value").inner_text() == "finished"
        budget = page.locator("#budget")
        assert budget.is_visible() and budget.input_value() == BUDGET  # the study's budget, to start with

        budget.fill(typed)
        page.locator("#ask-button").click()
        page.locator("#plan-json").wait_for()
        shown = page.locator("#plan-json").inner_text()
        assert shown == _best_json(storage, typed)
        assert remat_search.RematPlan.from_json(shown) == smallest.plan
        assert page.locator("#answer-trial").inner_text() == str(smallest.number)
        assert page.locator("#answer-peak").inner_text() == format_bytes(smallest.peak_bytes)
        assert page.locator("#answer-step").inner_text().startswith(format_seconds(smallest.seconds))
        rows = page.locator("#answer-layers tbody tr")
        assert rows.count() == len(smallest.plan.layers)  # type: ignore[union-attr]

        screenshot = tmp_path / "page.png"
        page.screenshot(path=str(screenshot), full_page=True)
        assert screenshot.stat().st_size > 10_000
        if TEAM_SCREENSHOT.parent.is_dir():
            shutil.copyfile(screenshot, TEAM_SCREENSHOT)

        for asked, status, said in (("1", "404", "the smallest peak measured is"), ("16 GiBs", "422", "budget: expected")):
            budget.fill(asked)
            page.locator("#ask-button").click()
            error = page.locator("#answer-error")
            error.wait_for()
            assert error.inner_text().startswith(f"{status}: ") and said in error.inner_text()
        assert requested and all(u.startswith(base + "/") for u in requested), requested  # nothing from elsewhere
    finally:
        page.close()
