"""The dashboard in a real browser: `tracehound ui` serving a store, Debian's Chromium driven by
Playwright (by its path: no browser is downloaded). Each view is loaded by its address, must
name the culprit, and is saved as a screenshot (into $TRACEHOUND_SCREENSHOTS when set, else the
test's temporary directory). And `tracehound run --ui` on a running job: its progress moving,
then its hang, read through the run that holds the store, as `diagnose` and `incidents` read
it from processes of their own meanwhile."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
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
from evidence_check import assert_facts_agree
from ui_harness import HOSTILE, FilledStore

from tracehound.tracing.ids import JobId
from tracehound.tracing.settings import TRACEHOUND_INGEST_TOKEN, TRACEHOUND_STORE
from tracehound.tracing.store import open_store
from tracehound.tracing.store.client import SharedStoreClient
from tracehound.tracing.store.sharing import endpoint_path

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
          cells: tuple[str, ...] = (), query: str = "") -> None:
    """Open a view by its address, wait until every text of `expect` is shown and every text
    of `cells` is in a table (tables draw on a canvas; their cells are in the page for screen
    readers, hidden), then save a screenshot."""
    page.goto(f"{base}/?view={view}&job={quote(job)}{query}")
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
        # the hang's incident and attempt by name: a loaded machine can add a newer one, a
        # straggler in the restarted attempt (tests/controller/test_demo_e2e.py)
        hang = f"&incident={quote('demo-hang/0/1', safe='')}&attempt=0"
        _load(page, base, "jobs", "demo-hang", ["Latest incident of each job", "demo-hang: "],
              shots / "demo-jobs.png", cells=("node-1",))
        _load(page, base, "incident", "demo-hang",
              ["Culprit ranks", "culprit nodes: node-1", "Timeline"],
              shots / "demo-incident.png", cells=("isolate", "resumed"), query=hang)
        page.get_by_text("rank 3 on node node-1", exact=False).first.wait_for()
        _load(page, base, "progress", "demo-hang",
              ["culprit (incident demo-hang/0/1, hang): ranks 3 on node-1", "Furthest behind",
               "rank 3 at #"], shots / "demo-progress.png", query=hang)
        assert page.locator("canvas, svg").count() > 0  # the heatmap is drawn
        # "Furthest behind" leads with the culprit and its state by the evidence
        page.locator('[role="gridcell"]').filter(
            has_text=re.compile(r"^culprit rank 3: ")).first.wait_for(state="attached")
        _load(page, base, "stragglers", "demo-hang", ["culprit ranks: 3", "Link latency"],
              shots / "demo-stragglers.png", query=hang)
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


# --- a running job, live --------------------------------------------------------------------

LIVE = "live"
OBSERVE_HANGS = "version: 1\nrules:\n  hang:\n    response: observe\n"
"""A policy that records a hang and does nothing about it: the job stays hung, the run holds the
store, until the test stops the run."""


def _example(name: str) -> str:
    spec = importlib.util.find_spec(f"tracehound.agent.examples.{name}")
    assert spec is not None and spec.origin is not None
    return spec.origin


def _dashboard_of(run: subprocess.Popen[bytes], log: Path) -> str:
    """The address `tracehound run --ui` printed, once the dashboard answers there."""
    while not (found := re.search(r"^dashboard: (http://\S+)$", log.read_text(), re.M)):
        assert run.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    base = found.group(1)
    while True:
        assert run.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as answer:
                if answer.status == 200:
                    return base
        except OSError:
            time.sleep(0.2)


def _highest_seq(page: Any) -> int:
    """The highest sequence id the progress view shows, once the view is drawn."""
    page.get_by_text("Furthest behind").first.wait_for(state="visible")
    line = page.get_by_text(re.compile(r"sequence ids \d+-\d+")).first.inner_text()
    found = re.search(r"sequence ids \d+-(\d+)", line)
    assert found, line
    return int(found.group(1))


def _shot(page: Any, path: Path) -> None:
    """A screenshot once the heatmap is drawn."""
    page.locator("canvas, svg").first.wait_for(state="visible")
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a drawn page, not a blank one


def _cli(cwd: Path, env: dict[str, str], *args: str) -> Any:
    """A `tracehound` command in a process of its own, on the default store of `cwd`."""
    done = subprocess.run([sys.executable, "-m", "tracehound.controller.cli", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_running_jobs_progress_then_its_hang_live(tmp_path: Path) -> None:
    """`tracehound run --ui` on a 2x2 gloo job: the progress view moves on between reloads; rank
    3 is stopped (SIGSTOP, its pid read through the store the run holds) and the view names it
    as the hang's culprit; `diagnose`, `incidents` and `status` read the same from processes of
    their own; Ctrl-C stops the run, its dashboard and its sharing of the store."""
    env = {k: v for k, v in os.environ.items()
           if k not in (TRACEHOUND_STORE, TRACEHOUND_INGEST_TOKEN)}  # the default store
    env["HOME"] = str(tmp_path)
    (tmp_path / "policy.yaml").write_text(OBSERVE_HANGS)
    port = _free_port()
    log = tmp_path / "run.log"
    shots = _shots(tmp_path)
    with log.open("wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "tracehound.controller.cli", "run", "--ui", "--ui-port",
             str(port), "--nnodes", "2", "--nproc-per-node", "2", "--job-id", LIVE,
             "--no-warm-spares", "--policy", "policy.yaml", "--hang-after", "3",
             _example("train_ddp"), "--steps", "1000000", "--step-sleep-ms", "50",
             "--checkpoint-every", "0", "--sync-loss-every", "1", "--pg-timeout-s", "900"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    held = tmp_path / ".tracehound" / "store"
    try:
        base = _dashboard_of(run, log)
        assert base == f"http://127.0.0.1:{port}"
        with browser() as page:
            page.goto(f"{base}/?view=progress&job={LIVE}")
            seen = [_highest_seq(page)]  # 0 until a collective of the group is stored
            while seen[-1] < max(seen[0], 1) + 5:  # the page reloaded shows the job moving on
                assert run.poll() is None, log.read_text()[-3000:]
                page.reload()
                seen.append(_highest_seq(page))
            latest = seen[-1]
            assert seen == sorted(seen), seen
            _shot(page, shots / "live-progress.png")

            store = open_store(f"chdb://{held}")
            try:
                assert isinstance(store, SharedStoreClient)  # the run holds it
                beats = {h.rank: h for h in store.latest_heartbeats(JobId(LIVE), 0)}
                os.kill(beats[3].pid, signal.SIGSTOP)
                # one incident per group the stopped rank holds up: the view names the latest
                culprit = re.compile(rf"culprit \(incident {LIVE}/0/\d+, hang\): ranks 3 on "
                                     "node-1")
                while True:
                    assert run.poll() is None, log.read_text()[-3000:]
                    stored = store.incidents(JobId(LIVE))
                    page.reload()
                    stalled = _highest_seq(page)  # drawn again
                    if page.get_by_text(culprit).count():
                        break
                    # drawn after the incident was stored, the page must name it
                    assert not stored, (stored, page.inner_text("body"))
            finally:
                store.close()
            _shot(page, shots / "live-hang.png")
            assert stalled >= latest

        # processes of their own read the store the run still holds
        listed = _cli(tmp_path, env, "incidents", "--job", LIVE, "--json")
        assert listed and {(i["kind"], tuple(i["culprit_ranks"]), tuple(i["culprit_nodes"]),
                            tuple(a["kind"] for a in i["actions"])) for i in listed} == {
            ("hang", (3,), ("node-1",), ("observe",))}, listed
        verdict = _cli(tmp_path, env, "diagnose", "--job", LIVE, "--json")
        assert (verdict["kind"], verdict["culprit_ranks"], verdict["culprit_nodes"]) == (
            "hang", [3], ["node-1"])
        status = _cli(tmp_path, env, "status", "--job", LIVE, "--json")
        assert status["ended"] is False and status["state"] == "suspect"
        assert {i["incident_id"] for i in status["open_incidents"]} <= {
            i["incident_id"] for i in listed}
        assert status["open_incidents"]
        assert endpoint_path(str(held)).exists()

        run.send_signal(signal.SIGINT)  # Ctrl-C
        assert run.wait() == 130, log.read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.wait()
    text = log.read_text()
    assert "interrupted; all ranks were stopped" in text
    assert not endpoint_path(str(held)).exists()  # it stopped sharing the store
    with pytest.raises(OSError):  # and its dashboard is gone
        urllib.request.urlopen(f"{base}/_stcore/health", timeout=5)
    # every fact of the live job's incidents agrees with the records it stored
    assert assert_facts_agree(f"chdb://{held}", LIVE) >= 1
