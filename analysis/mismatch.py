"""Mismatch: the ranks of a group disagree on the op, size, dtype or order of a collective.

Three sources, all decided by majority vote within the group (the rank that differs from the
majority is the culprit; Flight Recorder's own analyzer blames whichever side it sees first):

1. Recorded collectives that disagree (`Observation.disagreements`): the rows of one (group, seq)
   do not share one op, size, dtype and shape (every input and output tensor, every part of a
   coalesced call: `tracing.shapes`; compared where every row has one). A size difference alone
   does not count for ops whose members legitimately pass different sizes
   (`DetectionSettings.mismatch.size_exempt_ops`; the store leaves those out before its limit).
   When the store's limit cut the list, the verdict says how many disagreeing collectives were
   not read (`Observation.disagreements_dropped`).
2. Heartbeats: members pending on the same sequence id of a group with different ops (a
   broadcast against an all_reduce hangs everyone with equal sequence ids), or with one op but
   different sizes, dtypes or shapes (`GroupProgress.pending_nbytes`, `pending_dtype`,
   `pending_shape`: a size mismatch
   that hangs instead of completing). Conclusive at once: one sequence id is one collective on
   every member. Members whose heartbeats carry no dtype (older recorders) have no say on size
   and dtype; the exempt ops' sizes are not compared.
3. Sequence shift: every member of a group is still reporting and pending in it, a strict
   majority on one sequence id `s` for `hang_after_s`, and a minority pending on another id that
   it entered at least `hang_after_s` before the last heartbeat of every member. The minority
   issued an extra (ahead) or a missing (behind) collective. Control dependency alone would
   blame the majority for a shift ahead (they "never entered" the minority's collective). The
   heartbeats of one snapshot are not taken at one moment: a rank that has just come back from
   a long pause (a checkpoint write) runs through the calls its peers waited in and enters the
   next ones before its peers' next heartbeats say those calls completed. Requiring the
   majority still pending `hang_after_s` after the minority entered its call keeps that from
   reading as a shift.

A vote among the members seen so far stands only if they hold a majority of the whole group
(its size as the group was reported): the rows and heartbeats of the other members may not have
arrived yet, and two of four members that disagree are no tie of two (`_partial`).

A vote needs a majority. When the group has none (two members that disagree), its sibling
groups decide (recorded collectives only): the other groups of the window with as many members
at the same sequence id that agree among themselves (`Disagreement.peer_*`, the same program
run by other data-parallel groups). If at least MIN_SIBLING_VOTES of them ran one of the tied
calls, the members that ran something else are the culprits. When the group has a majority,
the vote within the group stands, and siblings that ran what the majority ran only add
confidence. Without either, the members are all named, with WEAK confidence, unless one of them
also stands out in another group, or left the group (it is no longer pending in it while the
other waits there: it issued fewer collectives), which puts it first as LIKELY.
Send/recv ops (point-to-point) are never compared.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from tracehound.analysis.common import (
    US_PER_S,
    is_counted_group,
    is_p2p_group,
    is_p2p_op,
    ordered_nodes,
    rank_nodes,
    who,
)
from tracehound.analysis.confidence import CERTAIN, LIKELY, STRONG, WEAK, raised
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import GroupProgress, IncidentKind
from tracehound.tracing.shapes import comparable, difference
from tracehound.tracing.summaries import Disagreement, group_order


@dataclass(frozen=True, slots=True)
class _Finding:
    group: str
    seq: int
    culprits: tuple[int, ...]
    """Ranks that differ from the majority (all of them when there is no majority)."""
    members: int
    majority: str
    """What the majority did, in words (`all_reduce of 4096 B float32`, `all_reduce #88`)."""
    theirs: Mapping[int, str]
    """What each culprit did, in words."""
    what: str
    """`op`, `size`, `dtype`, `shape` (the whole signature: every input and output, every part
    of a coalesced call; `tracing.shapes`) or `sequence`."""
    source: str
    """`recorded` (completed or failed events) or `pending` (heartbeats)."""
    tie: bool
    shift: int = 0
    """For a sequence shift: the first culprit's sequence id minus the majority's."""
    siblings: int = 0
    """How many sibling groups ran what `majority` says (0: unknown, too few, or otherwise)."""
    by_siblings: bool = False
    """The group had no majority: its siblings decided."""


MIN_SIBLING_VOTES = 2
"""Sibling groups that must have run one call for it to break a tie within a group."""


def _describe(op: str, nbytes: int, dtype: str, shape: str = "") -> str:
    brief = f"{op} of {nbytes} B {dtype}"
    if not shape:
        return brief
    return f"{brief} shaped {shape if len(shape) <= 160 else shape[:157] + '...'}"


def _against(op: str, nbytes: int, dtype: str, shape: str, top_shape: str, *,
             tie: bool) -> str:
    """A member's call described, with how its shape differs from the majority's `top_shape`
    (none in a tie: there is no majority to differ from)."""
    text = _describe(op, nbytes, dtype, shape)
    gap = difference(shape, top_shape) if shape != top_shape and not tie else ""
    return f"{text} ({gap})" if gap else text


def _known_shapes(shapes: Sequence[str], n: int) -> tuple[str, ...]:
    """The members' shape texts where every member has one, else none at all (""): a member
    whose source says nothing of shapes has no say, and neither has the comparison."""
    return tuple(shapes) if len(shapes) == n and all(shapes) else ("",) * n


def _partial(seen: int, top_n: int, tie: bool, size: int) -> bool:
    """Whether a vote among the `seen` members whose calls are known so far cannot stand yet:
    some of the group's `size` members are not seen (their rows or heartbeats have not arrived)
    and those seen have no majority of the whole group. The missing members decide it later;
    until then two of four members that disagree are not a tie between the two."""
    return seen < size and (tie or 2 * top_n <= size)


def _from_disagreement(d: Disagreement, exempt: tuple[str, ...],
                       size: int = 0) -> _Finding | None:
    shapes = _known_shapes(d.shapes, len(d.ranks))
    keys = [
        ("p2p" if is_p2p_op(op) else op, n, dt, sh)
        for op, n, dt, sh in zip(d.ops, d.nbytes, d.dtypes, shapes, strict=True)
    ]
    if len({k[0] for k in keys}) == 1 and keys[0][0] == "p2p":
        return None
    ops, dtypes = {k[0] for k in keys}, {k[2] for k in keys}
    uneven = len(ops) == 1 and keys[0][0] in exempt
    # the root's side of a rooted op is not compared, nor sizes where they differ legitimately
    keys = [(op, 0 if uneven else n, dt, comparable(sh, raw, exempt))
            for (op, n, dt, sh), raw in zip(keys, d.ops, strict=True)]
    if len(set(keys)) == 1:
        return None
    counts = Counter(keys)
    (top, top_n), *rest = counts.most_common()
    tie = bool(rest) and rest[0][1] == top_n
    if _partial(len(keys), top_n, tie, size):
        return None
    reference = (
        ("p2p" if is_p2p_op(d.peer_op) else d.peer_op,
         0 if uneven else d.peer_nbytes, d.peer_dtype)
        if d.peer_groups >= MIN_SIBLING_VOTES else None
    )
    by_siblings = False
    if tie and reference is not None:
        # the siblings' reference names no shape: it decides when one tied call matches it
        matching = [k for k, n in counts.items() if k[:3] == reference and n == top_n]
        if len(matching) == 1:
            top, tie, by_siblings = matching[0], False, True
    culprits = tuple(
        r for r, k in zip(d.ranks, keys, strict=True) if tie or k != top
    )
    what = ("op" if len(ops) > 1 else "dtype" if len(dtypes) > 1
            else "size" if len({k[1] for k in keys}) > 1 else "shape")
    row_of_top = next(i for i, k in enumerate(keys) if k == top)
    top_shape = shapes[row_of_top] if what == "shape" else ""

    theirs = {r: _against(d.ops[i], d.nbytes[i], d.dtypes[i],
                          shapes[i] if what == "shape" else "", top_shape, tie=tie)
              for i, r in enumerate(d.ranks) if r in culprits}
    return _Finding(
        group=d.group, seq=d.seq, culprits=culprits, members=len(d.ranks),
        majority=_describe(d.ops[row_of_top], d.nbytes[row_of_top], d.dtypes[row_of_top],
                           top_shape),
        theirs=theirs, what=what, source="recorded", tie=tie,
        siblings=d.peer_groups if reference is not None and top[:3] == reference else 0,
        by_siblings=by_siblings,
    )


def _from_pending_shapes(
    group: str, seq: int, rows: Sequence[tuple[int, GroupProgress]], exempt: tuple[str, ...],
    size: int = 0,
) -> _Finding | None:
    """Members pending in one collective (one sequence id, one op) that pass different sizes,
    dtypes or shapes. Members that report no dtype have no say; sizes of exempt ops are not
    compared (their shapes without sizes are); shapes count where every member reports one."""
    op = rows[0][1].pending_op
    known = [(r, g) for r, g in rows if g.pending_dtype]
    if is_p2p_op(op) or len(known) < 2:
        return None
    uneven = op in exempt
    shapes = _known_shapes([g.pending_shape for _, g in known], len(known))
    keys = [(0 if uneven else g.pending_nbytes, g.pending_dtype, comparable(sh, op, exempt))
            for (_, g), sh in zip(known, shapes, strict=True)]
    if len(set(keys)) < 2:
        return None
    counts = Counter(keys).most_common()
    tie = counts[0][1] == counts[1][1]
    if _partial(len(keys), counts[0][1], tie, size):
        return None
    top = counts[0][0]
    culprits = tuple(sorted(r for (r, _), k in zip(known, keys, strict=True)
                            if tie or k != top))
    what = ("dtype" if len({k[1] for k in keys}) > 1
            else "size" if len({k[0] for k in keys}) > 1 else "shape")
    at = next(i for i, k in enumerate(keys) if k == top)
    top_g, top_shape = known[at][1], (shapes[at] if what == "shape" else "")

    return _Finding(
        group=group, seq=seq, culprits=culprits, members=len(known),
        majority=_describe(op, top_g.pending_nbytes, top[1], top_shape),
        theirs={r: _against(op, g.pending_nbytes, g.pending_dtype,
                            sh if what == "shape" else "", top_shape, tie=tie)
                for (r, g), sh in zip(known, shapes, strict=True) if r in culprits},
        what=what, source="pending", tie=tie,
    )


def _from_pending(
    group: str,
    entries: Sequence[tuple[int, GroupProgress, int]],
    members: int,
    hang_us: int,
    now_us: int,
    *,
    fresh_after_us: int = 0,
    exempt: tuple[str, ...] = (),
) -> list[_Finding]:
    """Findings of one group from its members' heartbeats: (rank, progress, heartbeat time) per
    member that reported progress in the group; `members` is the group's size; heartbeats
    before `fresh_after_us` are stale."""
    pending = [(r, g, beat_us) for r, g, beat_us in entries if g.pending_op]
    findings: list[_Finding] = []
    by_seq: dict[int, list[tuple[int, GroupProgress]]] = {}
    for r, g, _ in pending:
        by_seq.setdefault(g.last_enqueued, []).append((r, g))
    # 2. same sequence id, different ops (or one op, different sizes or dtypes)
    for seq, rows in sorted(by_seq.items()):
        ops = [("p2p" if is_p2p_op(g.pending_op) else g.pending_op) for _, g in rows]
        if len(set(ops)) < 2:
            shape = _from_pending_shapes(group, seq, rows, exempt, members)
            if shape is not None:
                findings.append(shape)
            continue
        counts = Counter(ops).most_common()
        tie = counts[0][1] == counts[1][1]
        if _partial(len(rows), counts[0][1], tie, members):
            continue
        top = counts[0][0]
        culprits = tuple(sorted(r for (r, _), op in zip(rows, ops, strict=True)
                                if tie or op != top))
        findings.append(_Finding(
            group=group, seq=seq, culprits=culprits, members=len(rows),
            majority=f"{top} #{seq}",
            theirs={r: f"{g.pending_op} #{seq}" for r, g in rows if r in culprits},
            what="op", source="pending", tie=tie,
        ))
    if findings:
        return findings
    # 3. sequence shift: everyone reporting and pending here, a strict majority stalled on one id
    if (len(pending) != members or len(by_seq) < 2
            or not all(beat_us >= fresh_after_us for *_, beat_us in pending)):
        return findings
    seq, rows = max(by_seq.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    if 2 * len(rows) <= members:
        return findings
    if not any(now_us - g.last_enqueue_us >= hang_us for _, g in rows):
        return findings
    op = rows[0][1].pending_op
    # A member whose call behind the majority's is one the majority completed is stuck in it:
    # it issued that call (its peers could not have completed a collective it never joined),
    # its work there never completed (on a GPU: the kernel or the device), and the later calls
    # its peers wait in are not issued yet. That is a hang (or hardware), not a call too few.
    done = min(g.last_completed for _, g in rows)
    culprits = tuple(sorted(r for r, g, _ in pending
                            if g.last_enqueued != seq and g.last_enqueued > done))
    if not culprits:
        return findings
    # every member still pending where it is `hang_us` after the culprits entered their calls
    entered_us = max(g.last_enqueue_us for r, g, _ in pending if r in culprits)
    if min(beat_us for *_, beat_us in pending) < entered_us + hang_us:
        return findings
    theirs = {
        r: f"{g.pending_op} #{g.last_enqueued}" for r, g, _ in pending if r in culprits
    }
    findings.append(_Finding(
        group=group, seq=seq, culprits=culprits, members=members, majority=f"{op} #{seq}",
        theirs=theirs, what="sequence", source="pending", tie=False,
        shift=next(g.last_enqueued for r, g, _ in pending if r == culprits[0]) - seq,
    ))
    return findings


def _pending_findings(obs: Observation, settings: DetectionSettings) -> list[_Finding]:
    snap = obs.snapshot
    exited = {e.rank for e in snap.exits}
    fresh_after = snap.now_us - int(settings.hang.heartbeat_timeout_s * US_PER_S)
    hang_us = int(settings.hang.after_s * US_PER_S)
    by_group: dict[str, list[tuple[int, GroupProgress, int]]] = {}
    pending_groups: set[str] = set()
    for hb in snap.heartbeats:
        if hb.rank in exited:
            continue
        for g in hb.groups:
            by_group.setdefault(g.group, []).append((int(hb.rank), g, int(hb.time_us)))
            if g.pending_op:
                pending_groups.add(g.group)
    sizes: dict[str, int] = {}
    for info in snap.groups:
        sizes.setdefault(info.group, len(info.ranks))
    findings: list[_Finding] = []
    for group in sorted(pending_groups, key=group_order):
        if is_p2p_group(group) or is_counted_group(group):
            continue
        entries = by_group[group]
        size = max(sizes.get(group, 0), len(entries))
        # the call each member is blocked on first (the oldest in flight), then the last entered
        found: list[_Finding] = []
        for view in ([(r, _blocked_on(g), beat_us) for r, g, beat_us in entries], entries):
            found = _from_pending(group, view, size, hang_us, snap.now_us,
                                  fresh_after_us=fresh_after,
                                  exempt=settings.mismatch.size_exempt_ops)
            if found:
                break
        findings += found
    return findings


def _blocked_on(g: GroupProgress) -> GroupProgress:
    """A member's progress as of the oldest call it has in flight (the one its group is
    blocked on; with a single call pending that is the last one entered)."""
    if not g.oldest_seq or not g.oldest_op:
        return g
    return msgspec.structs.replace(
        g, last_enqueued=g.oldest_seq, pending_op=g.oldest_op,
        pending_nbytes=g.oldest_nbytes, pending_dtype=g.oldest_dtype,
        pending_shape=g.oldest_shape)


def _left_group(obs: Observation, f: _Finding) -> set[int]:
    """The culprits of a tied finding not pending in its group while all the others are."""
    pending = {
        int(hb.rank): any(g.group == f.group and g.pending_op for g in hb.groups)
        for hb in obs.snapshot.heartbeats if hb.rank in f.culprits
    }
    if len(pending) != len(f.culprits):
        return set()
    left = {r for r, p in pending.items() if not p}
    return left if len(left) == 1 else set()


def _siblings_words(f: _Finding) -> str:
    """What the sibling groups add to a finding's sentence ("" when they add nothing)."""
    if f.siblings < MIN_SIBLING_VOTES:
        return ""
    return (
        f", as did {f.siblings} other groups of {f.members} members at the same sequence id"
        + (" (the group itself has no majority)" if f.by_siblings else "")
    )


def _hung_shape(f: _Finding) -> bool:
    """A size or dtype difference seen in pending calls: the collective hangs."""
    return f.source == "pending" and f.what in ("size", "dtype", "shape")


def _dropped_words(dropped: int) -> str:
    return (
        f"{dropped} more disagreeing collective{'s' if dropped != 1 else ''} of the window "
        "lay past the store's limit and were not read"
    )


def _what_words(f: _Finding) -> str:
    return {
        "op": "a different op",
        "size": "a different size",
        "dtype": "a different dtype",
        "shape": "different tensor shapes",
    }[f.what]


def _vote_confidence(lead: _Finding, minority: float) -> float:
    """How sure a decided vote is: one member against the rest is certain, a small minority
    (under a third) strong, a larger one likely; a tie broken by sibling groups is strong for
    one member, likely for more; sibling groups that ran what the majority ran raise a vote
    within the group one level. A sequence shift is at most strong: an extra collective on one
    rank can look like a missing one on the others."""
    single = len(lead.culprits) == 1
    if lead.by_siblings:
        confidence = STRONG if single else LIKELY
    else:
        confidence = CERTAIN if single else STRONG if minority < 0.34 else LIKELY
        if lead.siblings >= MIN_SIBLING_VOTES:
            confidence = raised(confidence)
    if lead.what == "sequence":
        confidence = min(confidence, STRONG)
    return confidence


def detect_mismatch(obs: Observation, settings: DetectionSettings) -> Verdict | None:
    """The ranks that differ from their group's majority (see the module docstring)."""
    exempt = settings.mismatch.size_exempt_ops
    sizes: dict[str, int] = {}
    for info in obs.snapshot.groups:
        sizes.setdefault(info.group, len(info.ranks))
    findings = [
        f for d in obs.disagreements if not is_p2p_group(d.group)
        if (f := _from_disagreement(d, exempt, sizes.get(d.group, 0))) is not None
    ]
    findings += _pending_findings(obs, settings)
    if not findings:
        return None
    nodes = rank_nodes(obs.snapshot)
    # A rank standing out in several collectives (or groups) is the likelier culprit.
    votes: Counter[int] = Counter()
    for f in findings:
        for r in f.culprits:
            votes[r] += 1 if f.tie else 2
    decided = [f for f in findings if not f.tie]
    if decided:
        # At equal votes, a majority within a group outweighs one borrowed from its siblings.
        own = {r for f in decided if not f.by_siblings for r in f.culprits}
        culprits = sorted({r for f in decided for r in f.culprits},
                          key=lambda r: (-votes[r], r not in own, r))
        lead = min(decided, key=lambda f: (-max(votes[r] for r in f.culprits), f.by_siblings,
                                           f.source, group_order(f.group), f.seq))
        minority = len(lead.culprits) / max(lead.members, 1)
        confidence = _vote_confidence(lead, minority)
    else:
        lead = findings[0]
        # No majority: a member that left the group (it is no longer pending in it while the
        # others wait there) issued fewer collectives than they did.
        left = _left_group(obs, lead)
        for r in left:
            votes[r] += 1
        culprits = sorted({r for f in findings for r in f.culprits}, key=lambda r: (-votes[r], r))
        top = votes[culprits[0]]
        confidence = LIKELY if sum(1 for r in culprits if votes[r] == top) == 1 else WEAK
    cap = settings.max_evidence
    evidence: list[Evidence] = []
    dropped = obs.disagreements_dropped
    for f in sorted(findings, key=lambda f: (f is not lead, f.tie, group_order(f.group), f.seq)):
        for r in f.culprits:
            if len(evidence) >= cap:
                break
            ran, waits = ("waits in", "wait in") if _hung_shape(f) else ("ran", "ran")
            detail = (
                f"rank {r} on node {nodes.get(r, 'unknown')} {ran} {f.theirs[r]} as "
                f"#{f.seq} of group {f.group} while "
                + (
                    f"{f.members - len(f.culprits)} of its {f.members} peers {waits} "
                    f"{f.majority}"
                    if not f.tie
                    else f"the others {waits} {f.majority} (no majority)"
                )
                + _siblings_words(f)
            )
            if f.source == "recorded" and dropped:
                detail += f"; {_dropped_words(dropped)}"
                dropped = 0
            if f.what == "sequence":
                detail = (
                    f"rank {r} on node {nodes.get(r, 'unknown')} is pending in {f.theirs[r]} of "
                    f"group {f.group} while {f.members - len(f.culprits)} of its {f.members} "
                    f"peers are pending in {f.majority}"
                )
            evidence.append(Evidence(
                fact=Fact.DIFFERS, rank=r, node=nodes.get(r, "unknown"), detail=detail,
                group=f.group, seq=f.seq, value=float(f.members),
            ))
    ranks = tuple(culprits)
    if lead.tie:
        summary = (
            f"the {lead.members} members of group {lead.group} disagree on collective "
            f"#{lead.seq} ({', '.join(sorted(set(lead.theirs.values())))}); no majority "
            f"singles out one: {who(ranks, nodes)}"
        )
    elif lead.what == "sequence":
        more = "more" if lead.shift > 0 else "fewer"
        summary = (
            f"{who(ranks, nodes)} issued {abs(lead.shift)} collective(s) {more} than its peers "
            f"in group {lead.group}: it is pending in {lead.theirs[lead.culprits[0]]} while "
            f"{lead.members - len(lead.culprits)} of {lead.members} members are pending in "
            f"{lead.majority}"
        )
    elif _hung_shape(lead):
        summary = (
            f"{who(ranks, nodes)} called collective #{lead.seq} of group {lead.group} with "
            f"{_what_words(lead)} and the group hangs in it: it waits in "
            f"{lead.theirs[lead.culprits[0]]} while {lead.members - len(lead.culprits)} of "
            f"{lead.members} members wait in {lead.majority}"
        )
    else:
        summary = (
            f"{who(ranks, nodes)} ran {_what_words(lead)} at collective #{lead.seq} of group "
            f"{lead.group}: {lead.theirs[lead.culprits[0]]} while "
            f"{lead.members - len(lead.culprits)} of {lead.members} members ran {lead.majority}"
            + _siblings_words(lead)
        )
    if obs.disagreements_dropped:
        summary += f" ({_dropped_words(obs.disagreements_dropped)})"
    return Verdict(
        job=obs.snapshot.job, attempt=obs.snapshot.attempt, kind=IncidentKind.MISMATCH,
        culprit_ranks=ranks, culprit_nodes=ordered_nodes(ranks, nodes), confidence=confidence,
        basis=Basis.MAJORITY_VOTE, summary=summary, evidence=tuple(evidence),
        observed_at_us=obs.snapshot.now_us, group=lead.group,
    )
