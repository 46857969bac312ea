"""The entry point of the analysis: one observation in, the single best verdict out.

Every detector runs on the same observation; the verdict kinds rank by how conclusive their
evidence is:

    crash > mismatch > hang > hardware > slow_link > straggler > silent_hang > node_outlier

- A crash stalls its peers and a mismatch hangs its group: their own evidence (an exit, a vote)
  explains the stall better than the stall does.
- A stall (peers wait on a rank that is alive and busy outside collectives) stands as it is
  and hides the window anomalies while it lasts; only a critical health event on the busy
  rank's node (not a warning) that can stop it (`analysis.hardware`: a fault of its GPU, an
  NVLink or network link down) turns it into a hardware verdict, and the window's straggler
  verdict replaces it when it leads with the busy rank (with steps of tens of seconds a
  straggler's peers wait seconds on it at every step: a stall at every look). A stall whose
  busy ranks have been busy for less than the job's typical step is the rhythm of long
  pipeline steps (stages wait seconds on each other every step), not news: the window's
  anomalies come first and it stands only without them.
- Where no traced collective has been pending for the hang threshold, a job that stands still
  (`analysis.standstill`: every rank not frozen has stopped progressing, while some are frozen or
  are seen waiting in collectives the trace does not show) is judged as a hang or a stall all
  the same: missing coverage never makes such a job healthy.
- A hang that control dependency cannot localize is handed to the stack traces (silent hang).
  Where they single no rank out either, and no health event does, every member waits and none
  stands out (none lags, is frozen, is stuck elsewhere or disagrees on the call): the verdict is
  an unlocalized hang that names no culprit rank. The group's nodes are its suspects (the
  network, the collective library), in `Fact.SUSPECT` evidence, and the summary says what was
  ruled out. The policy treats it as unsure.
- A hardware health event on the culprit node of a hang, silent hang, slow link, straggler or
  node outlier turns that verdict into a hardware verdict on that node when it is relevant to
  the symptom: a kind that can cause it, on the culprit's GPU, near its onset (the table in
  `analysis.hardware`). Any other warning is kept in the verdict as context evidence. Among
  the anomalies without a hang, any one so correlated wins over the uncorrelated ones.
- A slow node (every rank of one node late at its inter-node collectives, none of them late
  within it) gives a hardware verdict only with a relevant health event on that node (NVLink,
  network, throttling, a GPU fault: not a low-grade warning), and only when no other
  detector fired: a straggler or a slow link makes the nodes of its pipeline late too.
- A slow link whose ranks include a straggler's is dropped: a slow GPU starts its transfers
  late and slows them too, while a slow link leaves its ends' compute as it was
  (`analysis.links` already leaves out links with a rank that computes markedly longer).
- The machine-level outlier model corroborates a straggler or slow link on the node it flags
  (one notch more confidence, `analysis.confidence.STEP`, and its evidence), and stands alone
  only when nothing else fired.

Pure: no I/O, no clock; `Observation.snapshot.now_us` is the analysis' notion of now.
"""

from __future__ import annotations

from dataclasses import replace

from tracehound.analysis.common import rank_nodes, typical_step_us
from tracehound.analysis.confidence import nudged
from tracehound.analysis.detect import detect_crash, detect_hang
from tracehound.analysis.hardware import (
    correlate_hardware,
    detect_slow_node,
    detect_throttled_gpu,
    with_health_evidence,
)
from tracehound.analysis.links import detect_slow_link
from tracehound.analysis.mismatch import detect_mismatch
from tracehound.analysis.observation import Observation
from tracehound.analysis.outliers import detect_node_outliers
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot, with_recorded
from tracehound.analysis.stacks import detect_silent_hang
from tracehound.analysis.standstill import detect_standstill
from tracehound.analysis.straggler import detect_straggler
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.errors import TemporaryStoreError
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.store import TraceStore

_CORROBORATED = frozenset({IncidentKind.STRAGGLER, IncidentKind.SLOW_LINK})


def _corroborate(verdict: Verdict, outliers: Verdict | None) -> Verdict:
    """A straggler or slow-link verdict whose culprit node the outlier model flags too."""
    if outliers is None or verdict.kind not in _CORROBORATED:
        return verdict
    shared = set(verdict.culprit_nodes) & set(outliers.culprit_nodes)
    if not shared:
        return verdict
    extra = tuple(e for e in outliers.evidence if e.node in shared)
    return replace(
        verdict, confidence=nudged(verdict.confidence),
        evidence=verdict.evidence + extra,
    )


def _explained(verdict: Verdict, obs: Observation, settings: DetectionSettings) -> Verdict:
    """The hardware verdict a relevant health event makes of `verdict`, else `verdict` with the
    culprit nodes' other health samples as context."""
    return correlate_hardware(verdict, obs, settings) or with_health_evidence(verdict, obs,
                                                                              settings)


def _slow_at_everything(straggler: Verdict | None, stall: Verdict,
                        settings: DetectionSettings) -> Verdict | None:
    """The window's straggler verdict when it leads with the stall's busy rank: peers wait on
    it now because it computes longer at every step (long steps make a straggler's peers wait
    seconds at a time), with the stall's facts added; None otherwise."""
    if straggler is None or straggler.culprit_ranks[0] not in stall.culprit_ranks:
        return None
    lead = straggler.culprit_ranks[0]
    now = tuple(e for e in stall.evidence if e.rank == lead)
    return replace(straggler, evidence=straggler.evidence + now[: settings.max_evidence])


def _within_a_step(stall: Verdict, snap: JobSnapshot) -> bool:
    """Whether every busy rank of a stall has been outside collectives for less than the job's
    typical step: with steps of tens of seconds, pipeline stages wait seconds on each other at
    every step, so such a stall is the step's rhythm, not news (False without step times)."""
    step_us = typical_step_us(snap)
    busy = [e.value for e in stall.evidence if e.fact is Fact.BUSY]
    return step_us > 0 and bool(busy) and max(busy) * 1e6 < step_us


def _whole_job(verdict: Verdict, snap: JobSnapshot) -> bool:
    """Whether a verdict names every rank of the job (nobody stands out)."""
    ranks = set(snap.expected_ranks) | {int(hb.rank) for hb in snap.heartbeats}
    return len(ranks) > 1 and set(verdict.culprit_ranks) >= ranks


def diagnose_observation(obs: Observation | JobSnapshot,
                         settings: DetectionSettings | None = None) -> Verdict | None:
    """The best verdict for the observation, or None while nothing is wrong. This is the one
    entry point of the analysis: the supervisor, `tracehound diagnose`, the benchmarks and the
    recorded (golden) traces all go through it. A bare snapshot is an observation without window
    summaries, stacks or health samples (`Observation.of`)."""
    if isinstance(obs, JobSnapshot):
        obs = Observation.of(obs)
    settings = settings or DetectionSettings()
    verdict = _diagnose(obs, settings)
    if (verdict is not None and verdict.kind is IncidentKind.HANG
            and verdict.basis is Basis.UNLOCALIZED):
        return _unlocalized(verdict, obs, settings)
    return verdict


def diagnose_with_records(store: TraceStore, obs: Observation,
                          settings: DetectionSettings | None = None
                          ) -> tuple[Verdict | None, Observation]:
    """`diagnose_observation` of an observation read from `store`, with where each lagging
    rank got to taken from the freshest source: where the verdict says ranks have not entered
    a collective (`Fact.LAGGING`), their stored records in that group beyond their heartbeats
    are read (`snapshot.with_recorded`, one small query per group) and, when any are ahead,
    the analysis runs again with them, so that no fact says less than the records those ranks
    shipped. A store that does not answer that query leaves the verdict as the heartbeats
    gave it. The verdict and the observation it was judged on."""
    verdict = diagnose_observation(obs, settings)
    if verdict is None:
        return None, obs
    snap = obs.snapshot
    heard: dict[tuple[int, str], int] = {
        (int(hb.rank), str(g.group)): g.last_enqueued for hb in snap.heartbeats
        for g in hb.groups}
    wanted: dict[str, tuple[int, list[int]]] = {}
    for ev in verdict.evidence:
        if ev.fact is Fact.LAGGING and ev.group:
            since, ranks = wanted.get(ev.group, (1 << 62, []))
            ranks.append(ev.rank)
            wanted[ev.group] = (min(since, heard.get((ev.rank, ev.group), 0) + 1), ranks)
    if not wanted:
        return verdict, obs
    try:
        fresher = with_recorded(store, snap, wanted)
    except TemporaryStoreError:
        return verdict, obs
    if fresher is snap:
        return verdict, obs
    obs = replace(obs, snapshot=fresher)
    return diagnose_observation(obs, settings), obs


def _unlocalized(verdict: Verdict, obs: Observation, settings: DetectionSettings) -> Verdict:
    """An unlocalized hang as it is reported: no culprit rank; the nodes of the ranks it would
    otherwise name (the members that wait) as suspects, and what was ruled out."""
    nodes = rank_nodes(obs.snapshot)
    on_node: dict[str, list[int]] = {}
    for r in sorted(verdict.culprit_ranks):
        on_node.setdefault(nodes.get(r, "unknown"), []).append(r)
    where = f"group {verdict.group}" if verdict.group else "the job's groups"
    suspects = [
        Evidence(
            fact=Fact.SUSPECT, rank=ranks[0], node=node, group=verdict.group,
            value=float(len(ranks)),
            detail=(f"node {node} (rank{'s' if len(ranks) > 1 else ''} "
                    f"{_listed(ranks)}) waits with the others in {where}: not a culprit, a "
                    "suspect (its network links, the collective library)"),
        )
        for node, ranks in on_node.items()  # in the order of their first rank
    ][:settings.max_evidence]
    listed = ", ".join(on_node)
    summary = (
        f"{verdict.summary}. Not localized, no culprit rank: none lags, is frozen, is stuck "
        "elsewhere or called the collective differently (op, size, dtype). Suspect the network "
        f"or the collective library of {where}, on node{'s' if len(on_node) > 1 else ''} "
        f"{listed}"
    )
    return replace(verdict, culprit_ranks=(), culprit_nodes=(), summary=summary,
                   evidence=(*suspects, *verdict.evidence))


def _listed(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _diagnose(obs: Observation, settings: DetectionSettings) -> Verdict | None:
    snap = obs.snapshot
    crash = detect_crash(snap, settings, obs.clocks)
    if crash is not None:
        return with_health_evidence(crash, obs, settings)
    mismatch = detect_mismatch(obs, settings)
    if mismatch is not None:
        return mismatch
    hang = detect_hang(snap, settings) or detect_standstill(snap, settings)
    stall: Verdict | None = None
    straggler: Verdict | None = None
    if hang is not None:
        if hang.kind is IncidentKind.STALL:
            # A busy rank is alive: only a critical device event (a GPU fallen off the bus, an
            # uncorrectable ECC error) relevant to it makes its machine the cause.
            stopped = correlate_hardware(replace(hang, kind=IncidentKind.HANG), obs, settings,
                                         critical_only=True)
            if stopped is not None:
                return stopped
            straggler = detect_straggler(obs, settings)
            slow = _slow_at_everything(straggler, hang, settings)
            if slow is not None:
                return _explained(slow, obs, settings)
            if not _within_a_step(hang, snap):
                return with_health_evidence(hang, obs, settings)
            stall = hang
        else:
            if hang.basis is Basis.UNLOCALIZED or _whole_job(hang, snap):
                hang = detect_silent_hang(obs, settings, stall=hang) or hang
            return _explained(hang, obs, settings)

    outliers = detect_node_outliers(obs, settings)
    link = detect_slow_link(obs, settings)
    if stall is None:  # (a stall's branch judged the window's straggler already)
        straggler = detect_straggler(obs, settings)
    if link is not None and straggler is not None and (
        set(link.culprit_ranks) & set(straggler.culprit_ranks)
    ):
        link = None  # a slow GPU makes its transfers look slow too: the straggler explains both
    anomalies = [
        _corroborate(v, outliers)
        for v in (link, straggler, detect_silent_hang(obs, settings), outliers)
        if v is not None
    ]
    for verdict in anomalies:
        hardware = correlate_hardware(verdict, obs, settings)
        if hardware is not None:
            return hardware
    if anomalies:
        return with_health_evidence(anomalies[0], obs, settings)
    if stall is not None:
        return with_health_evidence(stall, obs, settings)
    return detect_throttled_gpu(obs, settings) or detect_slow_node(obs, settings)
