"""The watcher driven step by step over a real store (the server and the embedded engine), on a
clock the test moves: a job that reports like one under `tracehound instrument`
(`watch_fakes.ReportingJob`), with the faults injected into what it reports. The real
multi-process job is test_watch_e2e's.

What is checked: a stopped rank becomes one incident whose command runs once; the job's states
and its end (exited, or stopped reporting) with how long; Slurm's drain and requeue, and the next
attempt adopted; a watcher stopped dead between recording an incident and acting, or while its
command ran, leaves one incident and one action after a second watcher took over; and a glob
of jobs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from store_urls import store_url_of
from supervisor_fakes import Clock
from watch_fakes import FakeSlurm, ReportingJob, SlurmError

from tracehound.analysis.settings import DetectionSettings, HangSettings
from tracehound.controller.actions.command import CommandActions
from tracehound.controller.actions.observe import ObserveActions
from tracehound.controller.actions.port import Chain, IncidentActions, Outcome
from tracehound.controller.actions.slurm import SlurmActions
from tracehound.controller.policy.recovery import PlannedAction
from tracehound.controller.supervision.supervisor import SupervisorSettings
from tracehound.controller.supervision.watcher import (
    EventKind,
    Watcher,
    WatchEvent,
    WatchFleet,
    WatchSettings,
)
from tracehound.tracing.events import ActionKind, Incident, JobPhase, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore, open_store


@pytest.fixture(params=[pytest.param("embedded", id="embedded")])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TraceStore]:
    """A fresh store: on the embedded engine, or on the server where a test says `ON_SERVER`.
    The watcher reads through the port only (the store's own contract, cluster mode included,
    is tests/tracing's), so each test runs on one of them, not both: the embedded engine's
    queries run in the test's own process, three times the server's cost there."""
    for url in store_url_of(request.param, request, tmp_path):
        with open_store(url) as opened:
            yield opened


ON_SERVER = pytest.mark.parametrize(
    "store", [pytest.param("server", marks=pytest.mark.clickhouse_server, id="server")],
    indirect=True)
"""A watcher test on the ClickHouse server instead of the embedded engine."""


SETTINGS = WatchSettings(
    supervisor=SupervisorSettings(poll_s=0.5, detection=DetectionSettings(
        hang=HangSettings(after_s=5.0))),
    silent_after_s=20.0, end_grace_s=5.0, discover_s=2.0)


class Killed(BaseException):
    """Stands for a SIGKILL of the watcher at the point where it is raised: nothing after it
    runs (no journal is drained, no action recorded)."""


class KilledBefore:
    """An action adapter that dies as its first step is taken (`after`: once that step ran)."""

    def __init__(self, inner: IncidentActions, *, after: bool = False) -> None:
        self.inner, self.after = inner, after

    @property
    def kinds(self) -> frozenset[ActionKind]:
        return self.inner.kinds

    def describe(self) -> str:
        return self.inner.describe()

    def check(self) -> None:
        self.inner.check()

    def plan(self, verdict: object, policy: tuple[PlannedAction, ...]
             ) -> tuple[PlannedAction, ...]:
        return self.inner.plan(verdict, policy)  # type: ignore[arg-type]

    def take(self, step: PlannedAction, incident: Incident) -> Outcome:
        if self.after:
            self.inner.take(step, incident)
        raise Killed(f"killed while taking {step.kind.value}")

    def close(self) -> None:
        self.inner.close()


class Harness:
    def __init__(self, store: TraceStore, tmp_path: Path, job: str = "w1") -> None:
        self.store, self.tmp_path = store, tmp_path
        self.clock = Clock()
        self.job = ReportingJob(store, self.clock, JobId(job))
        self.events: list[WatchEvent] = []
        self.runs = tmp_path / "cmd-runs.jsonl"

    def command(self) -> CommandActions:
        return CommandActions(f"cat >> {self.runs}", state_dir=self.tmp_path / "w" / "commands")

    def watcher(self, actions: IncidentActions | None = None) -> Watcher:
        watcher = Watcher(job=self.job.job, store=self.store,
                          actions=actions or Chain(ObserveActions(), self.command()),
                          settings=SETTINGS, workdir=self.tmp_path / "w", clock=self.clock,
                          sleep=self.clock.sleep, on_event=self.events.append)
        watcher.start()
        return watcher

    def drive(self, watcher: Watcher, until: Callable[[], bool], steps: int = 200) -> None:
        """Step the watcher (the job reporting before each step) until `until()` holds."""
        for _ in range(steps):
            self.job.tick()
            delay = watcher.step()
            if until() or delay is None:
                return
            self.clock.sleep(delay)
        raise AssertionError(f"not reached in {steps} steps; events: "
                             f"{[e.text for e in self.events]}")

    def kinds(self) -> list[EventKind]:
        return [e.kind for e in self.events]

    def command_runs(self) -> list[dict[str, object]]:
        if not self.runs.exists():
            return []
        return [json.loads(line) for line in self.runs.read_text().splitlines()]

    def states(self) -> list[JobState]:
        return self.store.job_states(self.job.job)


@ON_SERVER
def test_a_hung_rank_going_on_inside_its_collective_is_that_hang_ending_not_a_new_one(
        store: TraceStore, tmp_path: Path) -> None:
    """A rank SIGSTOPped inside a collective and continued: for a moment every rank reports
    waiting in that collective, none lagging (an unlocalized hang by the snapshot alone), until
    the call completes. The watcher takes that for the recorded hang ending: one incident."""
    h = Harness(store, tmp_path)
    watcher = h.watcher()
    h.drive(watcher, lambda: EventKind.WATCHING in h.kinds())
    h.drive(watcher, lambda: h.clock.now > h.events[-1].time_us + 3_000_000)
    h.job.stop(3)
    h.drive(watcher, lambda: EventKind.INCIDENT in h.kinds())
    h.job.resume(inside=6)
    resumed_at = h.clock.now
    h.drive(watcher, lambda: h.clock.now > resumed_at + 3_000_000)
    h.drive(watcher, lambda: h.states()[-1].state is JobPhase.RUNNING)
    assert [(i.kind, i.culprit_ranks) for i in store.incidents(h.job.job)] == [("hang", (3,))]
    assert [r["incident"] for r in h.command_runs()] == ["w1/0/1"]


def test_ranks_that_report_after_the_others_add_their_node_and_no_unknown_one(
        store: TraceStore, tmp_path: Path) -> None:
    """A launcher starts a job's nodes apart (a requeued Slurm job under load): the group names
    all four ranks while node-1's have not reported. The watcher names the nodes it knows and
    counts the ranks not heard from; their node joins the job's nodes when they report."""
    h = Harness(store, tmp_path)
    h.job.late = {2, 3}
    watcher = h.watcher()
    h.drive(watcher, lambda: EventKind.WATCHING in h.kinds())
    watching = next(e for e in h.events if e.kind is EventKind.WATCHING)
    assert (watching.data["ranks"], watching.data["nodes"], watching.data["unreported"]) == (
        4, ["node-0"], 2)
    assert "2 rank(s) not reported yet" in watching.text
    assert h.states()[-1].nodes == ("node-0",) and list(watcher.pool.current) == ["node-0"]
    h.job.late = set()
    h.drive(watcher, lambda: list(watcher.pool.current) == ["node-0", "node-1"])
    assert all("unknown" not in s.nodes for s in h.states())


def test_a_stopped_rank_is_one_incident_whose_command_runs_once_and_the_job_ends_finished(
        store: TraceStore, tmp_path: Path) -> None:
    h = Harness(store, tmp_path)
    watcher = h.watcher()
    h.drive(watcher, lambda: EventKind.WATCHING in h.kinds())
    watching = next(e for e in h.events if e.kind is EventKind.WATCHING)
    assert (watching.data["ranks"], watching.data["nodes"]) == (4, ["node-0", "node-1"])
    h.drive(watcher, lambda: h.clock.now > watching.time_us + 3_000_000)
    h.job.stop(3)
    stopped_at = h.clock.now
    h.drive(watcher, lambda: EventKind.INCIDENT in h.kinds())
    h.drive(watcher, lambda: h.clock.now > stopped_at + 20_000_000)  # the hang goes on

    (incident,) = store.incidents(h.job.job)
    assert (incident.kind, incident.culprit_ranks, incident.culprit_nodes) == (
        "hang", (3,), ("node-1",))
    assert 5.0 <= (incident.detected_at_us - stopped_at) / 1e6 <= 6.5  # hang_after + a poll
    kinds = [ActionKind(a.kind) for a in incident.actions]
    assert kinds == [ActionKind.OBSERVE, ActionKind.COMMAND]
    observe, command = incident.actions
    assert observe.detail.startswith("not acted on: the policy's plan is stop_job attempt 0, "
                                     "isolate_node node-1, restart attempt 1")
    assert observe.rule == "rules.hang.isolate_from" and command.rule == "on_incident"
    assert command.ok and "exited with status 0" in command.detail
    assert h.command_runs() == [{"job": "w1", "incident": "w1/0/1", "kind": "hang",
                                 "culprit_ranks": [3], "culprit_nodes": ["node-1"],
                                 "confidence": incident.confidence,
                                 "summary": incident.summary}]

    h.job.resume()
    h.drive(watcher, lambda: h.states()[-1].state is JobPhase.RUNNING)
    h.job.gone = True
    h.drive(watcher, lambda: watcher.done)
    assert [s.state for s in h.states()] == [JobPhase.RUNNING, JobPhase.DIAGNOSING,
                                             JobPhase.STALLED, JobPhase.RUNNING,
                                             JobPhase.FINISHED]
    assert all(s.controller.startswith("watch ") for s in h.states())
    ended = h.events[-1]
    assert (ended.kind, ended.data["how"], ended.data["state"], ended.data["ranks"]) == (
        EventKind.ENDED, "exited", "finished", 4)
    assert ended.data["after_s"] > 20
    assert "its 4 ranks exited" in h.states()[-1].detail
    assert len(store.incidents(h.job.job)) == 1 and len(h.command_runs()) == 1


@ON_SERVER
def test_reports_that_reach_the_store_late_delay_a_verdict_but_make_no_rank_look_silent(
        store: TraceStore, tmp_path: Path) -> None:
    h = Harness(store, tmp_path)
    h.job.lag_us = 8_000_000  # every report 8 s late: longer than the hang and silence limits
    watcher = h.watcher(ObserveActions())
    h.drive(watcher, lambda: EventKind.WATCHING in h.kinds())
    began = h.clock.now
    h.drive(watcher, lambda: h.clock.now > began + 30_000_000)
    assert store.incidents(h.job.job) == []
    assert h.states()[-1].state is JobPhase.RUNNING
    h.job.stop(1)
    stopped = h.clock.now
    h.drive(watcher, lambda: bool(store.incidents(h.job.job)))
    (incident,) = store.incidents(h.job.job)
    assert (incident.kind, incident.culprit_ranks) == ("hang", (1,))
    # judged as of the reports: the hang threshold, then the reports' delay
    assert 5.0 + 8.0 <= (incident.detected_at_us - stopped) / 1e6 <= 5.0 + 8.0 + 1.5


def test_a_job_that_stops_reporting_ends_failed_saying_so_and_after_how_long(
        store: TraceStore, tmp_path: Path) -> None:
    h = Harness(store, tmp_path)
    watcher = h.watcher(ObserveActions())
    h.drive(watcher, lambda: EventKind.WATCHING in h.kinds())
    h.drive(watcher, lambda: h.clock.now > h.events[-1].time_us + 4_000_000)
    h.job.silent = True
    went_silent = h.clock.now
    h.drive(watcher, lambda: watcher.done)
    ended = h.events[-1]
    assert (ended.data["how"], ended.data["state"]) == ("stopped reporting", "failed")
    assert ended.data["silent_s"] >= SETTINGS.silent_after_s
    assert (h.clock.now - went_silent) / 1e6 <= SETTINGS.silent_after_s + SETTINGS.end_grace_s + 3
    assert "stopped reporting: nothing from any of them for" in h.states()[-1].detail
    assert store.incidents(h.job.job) == []


def test_a_job_that_has_not_reported_yet_is_waited_for(store: TraceStore,
                                                       tmp_path: Path) -> None:
    h = Harness(store, tmp_path)
    watcher = h.watcher(ObserveActions())
    h.job.silent = True
    for _ in range(3):
        h.job.tick()
        h.clock.sleep(watcher.step() or 0)
    assert h.kinds() == [EventKind.WAITING]  # said once
    assert "has no records" in h.events[0].text and "waiting for it to report" in h.events[0].text
    h.job.silent = False
    h.drive(watcher, lambda: EventKind.WATCHING in h.kinds())


@ON_SERVER
@pytest.mark.parametrize("after", [False, True], ids=["before its command", "while it ran"])
def test_a_watcher_killed_between_detecting_and_acting_leaves_one_incident_and_one_action(
        store: TraceStore, tmp_path: Path, after: bool) -> None:
    h = Harness(store, tmp_path)
    first = h.watcher(Chain(ObserveActions(), KilledBefore(h.command(), after=after)))
    h.drive(first, lambda: EventKind.WATCHING in h.kinds())
    h.job.stop(2)
    with pytest.raises(Killed):
        h.drive(first, lambda: False)
    (recorded,) = store.incidents(h.job.job)  # stored before the watcher acted
    assert [ActionKind(a.kind) for a in recorded.actions] == [ActionKind.OBSERVE]
    assert h.states()[-1].state is JobPhase.DIAGNOSING
    assert len(h.command_runs()) == (1 if after else 0)

    second = h.watcher()  # same journal and store, as after a restart
    h.drive(second, lambda: h.clock.now > recorded.detected_at_us + 15_000_000)
    (incident,) = store.incidents(h.job.job)
    assert incident.incident_id == recorded.incident_id
    commands = [a for a in incident.actions if ActionKind(a.kind) is ActionKind.COMMAND]
    assert len(commands) == 1
    assert len(h.command_runs()) == 1  # run exactly once, by whichever watcher
    if after:
        assert not commands[0].ok and commands[0].detail.startswith("not run again")
    else:
        assert commands[0].ok and h.command_runs()[0]["culprit_ranks"] == [2]
    assert h.states()[-1].state is JobPhase.STALLED
    assert [e.data.get("picked_up") for e in h.events if e.kind is EventKind.WATCHING] == [
        False, True]


def test_slurm_drains_and_requeues_once_across_a_restart_and_the_next_attempt_is_watched(
        store: TraceStore, tmp_path: Path) -> None:
    h = Harness(store, tmp_path, job="slurm-77")
    fake = FakeSlurm()

    def slurm() -> SlurmActions:
        def over(attempt: int) -> bool:
            return any(a > attempt for a in store.attempts(h.job.job))

        return SlurmActions(fake, job="slurm-77", slurm_job="77", errors=(SlurmError,),
                            attempt_over=over)

    first = h.watcher(KilledBefore(slurm(), after=True))  # dies once the drain is done
    h.drive(first, lambda: EventKind.WATCHING in h.kinds())
    h.job.stop(3)
    with pytest.raises(Killed):
        h.drive(first, lambda: False)
    assert fake.calls == [("drain", "node-1", "tracehound slurm-77/0/1")]

    second = h.watcher(slurm())
    assert fake.calls == [("drain", "node-1", "tracehound slurm-77/0/1"), ("requeue", "77")]
    (incident,) = store.incidents(h.job.job)
    drain, requeue = incident.actions
    assert (ActionKind(drain.kind), drain.target, drain.ok) == (ActionKind.ISOLATE_NODE,
                                                                 "node-1", True)
    assert "not drained again" in drain.detail  # the first watcher's drain, found in Slurm
    assert (ActionKind(requeue.kind), requeue.target, requeue.ok) == (ActionKind.RESTART,
                                                                       "slurm job 77", True)
    assert drain.rule == requeue.rule == "rules.hang.isolate_from"
    assert h.states()[-1].state is JobPhase.RESTARTING and h.states()[-1].attempt == 1
    assert h.states()[-1].isolated == ("node-1",)

    # Slurm runs the job again, without the drained node
    h.job.restart(1, {0: "node-0", 1: "node-0", 2: "node-2", 3: "node-2"})
    fake.job = "RUNNING"
    h.drive(second, lambda: h.states()[-1].attempt == 1
            and h.states()[-1].state is JobPhase.RUNNING)
    watching = [e for e in h.events if e.kind is EventKind.WATCHING][-1]
    assert (watching.data["attempt"], watching.data["nodes"]) == (1, ["node-0", "node-2"])
    h.job.gone = True
    h.drive(second, lambda: second.done)
    assert h.states()[-1].state is JobPhase.FINISHED
    assert fake.calls == [("drain", "node-1", "tracehound slurm-77/0/1"), ("requeue", "77")]
    assert len(store.incidents(h.job.job)) == 1


@ON_SERVER
def test_a_glob_watches_each_matching_job_that_reports_and_no_supervised_one(
        store: TraceStore, tmp_path: Path) -> None:
    clock = Clock()
    events: list[WatchEvent] = []
    empty = WatchFleet(store=store, make_watcher=lambda job: None,  # type: ignore[arg-type,return-value]
                       pattern="prod-*", settings=SETTINGS, clock=clock, sleep=clock.sleep,
                       on_event=events.append)
    empty.step()
    empty.step()
    assert [e.text for e in events] == [
        f"no job in {store.url} matches 'prod-*' yet (the store holds no job); waiting for "
        "one to report"]
    events.clear()
    jobs = {name: ReportingJob(store, clock, JobId(name))
            for name in ("prod-a", "prod-b", "dev-c", "prod-d")}
    store.record_state(JobState(job="prod-d", time_us=clock.now, seq=1, state=JobPhase.RUNNING,
                                attempt=0, controller="host-x:4242"))

    def make(job: JobId) -> Watcher:
        return Watcher(job=job, store=store, actions=ObserveActions(), settings=SETTINGS,
                       workdir=tmp_path / job, clock=clock, sleep=clock.sleep,
                       on_event=events.append)

    fleet = WatchFleet(store=store, make_watcher=make, pattern="prod-*", settings=SETTINGS,
                       clock=clock, sleep=clock.sleep, on_event=events.append)
    fleet.start()
    clock.sleep(fleet.step() or 0)
    assert [e.kind for e in events] == [EventKind.WAITING]
    assert "no job matching 'prod-*' reports now (prod-d: " in events[0].text
    for name in ("prod-a", "dev-c", "prod-d"):
        jobs[name].tick()
    for _ in range(12):
        for name in ("prod-a", "dev-c", "prod-d"):
            jobs[name].tick()
        clock.sleep(fleet.step() or 0)
    assert sorted(w.spec.job for w in fleet) == ["prod-a"]
    skipped = [e for e in events if e.kind is EventKind.SKIPPED]
    assert [e.job for e in skipped] == ["prod-d"] and "host-x:4242" in skipped[0].text
    jobs["prod-b"].tick()  # starts to report later: watched too
    for _ in range(8):
        for name in ("prod-a", "prod-b"):
            jobs[name].tick()
        clock.sleep(fleet.step() or 0)
    assert sorted(w.spec.job for w in fleet) == ["prod-a", "prod-b"]
    jobs["prod-a"].gone = True
    for _ in range(30):
        for name in ("prod-a", "prod-b"):
            jobs[name].tick()
        clock.sleep(fleet.step() or 0)
    assert sorted(w.spec.job for w in fleet) == ["prod-b"]
    ended = [e for e in events if e.kind is EventKind.ENDED]
    assert [(e.job, e.data["how"]) for e in ended] == [("prod-a", "exited")]
    fleet.close(drain_s=1.0)
