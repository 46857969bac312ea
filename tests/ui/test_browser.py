"""The dashboard in a real browser: `tracehound ui` serving a store, Debian's Chromium driven by
Playwright (by its path: no browser is downloaded). Each view is loaded by its address, must
name the culprit, and is saved as a screenshot (into $TRACEHOUND_SCREENSHOTS when set, else the
test's temporary directory)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from ui_harness import HOSTILE, FilledStore

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(url: str, tmp_path: Path) -> Iterator[str]:
    """`tracehound ui` on a free loopback port until the block ends; its base address."""
    port = _free_port()
    log = (tmp_path / f"ui-{port}.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "tracehound.controller.cli", "ui", "--store", url, "--port",
         str(port), "--address", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(tmp_path)},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert server.poll() is None, (tmp_path / f"ui-{port}.log").read_text()
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("tracehound ui did not answer its health check")
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


@contextmanager
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian's chromium is missing (scripts/test.sh installs it)"
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                      args=["--no-sandbox", "--disable-gpu"])
        try:
            page = chromium.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(90_000)
            yield page
        finally:
            chromium.close()


def _shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("TRACEHOUND_SCREENSHOTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


def _load(page: Any, base: str, view: str, job: str, expect: list[str], shot: Path, *,
          cells: tuple[str, ...] = ()) -> None:
    """Open a view by its address, wait until every text of `expect` is shown and every text
    of `cells` is in a table (tables draw on a canvas; their cells are in the page for screen
    readers, hidden), then save a screenshot."""
    page.goto(f"{base}/?view={view}&job={quote(job)}")
    for text in expect:
        page.get_by_text(text, exact=False).first.wait_for(state="visible")
    for text in cells:
        page.locator('[role="gridcell"]').filter(
            has_text=re.compile(f"^{re.escape(text)}$")).first.wait_for(state="attached")
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000  # a drawn page, not a blank one


def test_each_view_names_the_culprit_of_a_real_demo_run(demo_store: FilledStore,
                                                        tmp_path: Path) -> None:
    shots = _shots(tmp_path)
    with serving(demo_store.url, tmp_path) as base, browser() as page:
        _load(page, base, "jobs", "demo-hang",
              ["Latest incident of each job", "rank 3 on node-1"], shots / "demo-jobs.png")
        _load(page, base, "incident", "demo-hang",
              ["Culprit ranks", "culprit nodes: node-1", "Timeline"],
              shots / "demo-incident.png", cells=("isolate", "resumed"))
        page.get_by_text("rank 3 on node node-1", exact=False).first.wait_for()
        _load(page, base, "progress", "demo-hang",
              ["culprit (incident demo-hang/0/1, hang): ranks 3 on node-1", "Furthest behind",
               "rank 3 at #"], shots / "demo-progress.png")
        assert page.locator("canvas, svg").count() > 0  # the heatmap is drawn
        # "Furthest behind" leads with the culprit and its state by the evidence
        page.locator('[role="gridcell"]').filter(
            has_text=re.compile(r"^culprit rank 3: ")).first.wait_for(state="attached")
        _load(page, base, "stragglers", "demo-hang", ["culprit ranks: 3", "Link latency"],
              shots / "demo-stragglers.png")
        _load(page, base, "health", "demo-hang", ["Node health", "node-1"],
              shots / "demo-health.png")
    assert {"demo-health.png", "demo-incident.png", "demo-jobs.png", "demo-progress.png",
            "demo-stragglers.png"} <= {p.name for p in shots.iterdir()}


def test_simulated_culprits_and_hostile_text_in_the_browser(sim_store: FilledStore,
                                                            tmp_path: Path) -> None:
    shots = _shots(tmp_path)
    hang = sim_store.truth["sim-hang"]
    rank, node = hang["culprit_ranks"][0], hang["culprit_nodes"][0]
    with serving(sim_store.url, tmp_path) as base, browser() as page:
        _load(page, base, "incident", "sim-hang", [f"culprit nodes: {node}"],
              shots / "sim-incident.png")
        _load(page, base, "progress", "sim-hang",
              [f"culprit (incident sim-hang/0/1, hang): ranks {rank} on {node}"],
              shots / "sim-progress.png")
        _load(page, base, "incident", HOSTILE, ["culprit nodes:"], shots / "hostile.png")
        # stored text is shown as text: no image, link or colour it asks for
        assert page.get_by_text(HOSTILE, exact=True).count() >= 1
        assert page.locator('img[src="x"]').count() == 0
        assert page.locator('a[href*="e.invalid"]').count() == 0
        assert page.locator("strong", has_text="bold").count() == 0
