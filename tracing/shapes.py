"""A call's whole signature as one text: the shape and dtype of every tensor it takes and every
tensor it fills, in order, so that two members of a collective can be compared on all of it.

A record's `op`, `nbytes` and `dtype` say what a call is in brief (its first input's dtype, its
inputs' bytes). That misses a call whose members agree on their inputs and differ in what they
receive (an all_gather's output list, a reduce_scatter's output size), and a coalesced call
whose parts differ one by one while their totals agree. The `shape` of a record holds the rest:

    [5,5]:float32 [3]:float32 -> [10,5]:float32 [6]:float32

inputs, then ` -> ` and outputs, each `[dims]:dtype` (`[]` a scalar). "" when unknown (a
recorder or a dump that does not say): such a member has no say on shapes. A call of more than
`MAX_PARTS` tensors keeps its first ones and a checksum of the rest (`+N more #crc`), so two
long texts are equal exactly when the whole signatures are.

Members are compared on `comparable`: the whole text, but for the root's side of a rooted op
(a gather's outputs and a scatter's inputs are the root's list, and a non-root's is empty), and
with only the dtypes (`sizes_removed`) for ops whose members legitimately pass different sizes
(an all_to_all with uneven splits). The store's summary query does the same with the same
patterns (`SIZES`, `OUTPUTS`, `INPUTS`).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence

MAX_PARTS = 32
"""Tensors spelled out in a shape text; past them, a count and a checksum of the rest."""

SIZES = r"\[[0-9,]*\]:"
"""The size part of one tensor in a shape text (a regular expression, in RE2's subset)."""

OUTPUTS = r" -> .*$"
"""The outputs of a shape text (a regular expression, in RE2's subset)."""

INPUTS = r"^.*-> "
"""The inputs of a shape text (a regular expression, in RE2's subset)."""

ROOT_SIDE = {"gather": OUTPUTS, "scatter": INPUTS}
"""Rooted ops -> the side only their root fills."""

_SIZES = re.compile(SIZES)
_ROOT_SIDE = {op: re.compile(pattern) for op, pattern in ROOT_SIDE.items()}
_ARROW = " -> "

Part = tuple[Sequence[int], str]
"""One tensor: its dims and its dtype's name."""


def _part(dims: Sequence[int], dtype: str) -> str:
    return "[" + ",".join(str(int(d)) for d in dims) + "]:" + (dtype or "?")


def _side(parts: Sequence[Part]) -> str:
    texts = [_part(d, t) for d, t in parts]
    if len(texts) <= MAX_PARTS:
        return " ".join(texts)
    rest = " ".join(texts[MAX_PARTS:])
    return " ".join(texts[:MAX_PARTS]) + (
        f" +{len(texts) - MAX_PARTS} more #{zlib.crc32(rest.encode()):08x}")


def shape_text(inputs: Sequence[Part], outputs: Sequence[Part] = ()) -> str:
    """The shape text of a call that takes `inputs` and fills `outputs` ("" for none at all)."""
    if not inputs and not outputs:
        return ""
    return _side(inputs) + (_ARROW + _side(outputs) if outputs else "")


def sizes_removed(shape: str) -> str:
    """`shape` with only the dtypes left (`[5,5]:float32 -> [2]:float32` -> `float32 ->
    float32`)."""
    return _SIZES.sub("", shape)


def comparable(shape: str, op: str, uneven_ops: Iterable[str] = ()) -> str:
    """What of `shape` the members of an `op` must agree on (see the module docstring)."""
    side = _ROOT_SIDE.get(op)
    if side is not None:
        shape = side.sub("", shape)
    return sizes_removed(shape) if op in uneven_ops else shape


def joined(shapes: Iterable[str]) -> str:
    """The shape text of a coalesced call from its parts' texts, part by part: the inputs of
    all parts, then their outputs. Parts whose shape is unknown ("") make the whole unknown."""
    ins: list[str] = []
    outs: list[str] = []
    for shape in shapes:
        if not shape:
            return ""
        left, _, right = shape.partition(_ARROW)
        ins += left.split(" ") if left else []
        outs += right.split(" ") if right else []
    if not ins and not outs:
        return ""
    return " ".join(ins) + (_ARROW + " ".join(outs) if outs else "")


def difference(mine: str, theirs: str) -> str:
    """Where two shape texts first differ, in words: `output 2 is [4,4]:float32 against
    [5,5]:float32`; "" when they are equal or one is unknown."""
    if not mine or not theirs or mine == theirs:
        return ""
    sides = [s.partition(_ARROW) for s in (mine, theirs)]
    for index, name in ((0, "input"), (2, "output")):
        a = sides[0][index].split(" ") if sides[0][index] else []
        b = sides[1][index].split(" ") if sides[1][index] else []
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return f"{name} {i + 1} is {x} against {y}"
        if len(a) != len(b):
            return f"{len(a)} {name}s against {len(b)}"
    return f"{mine} against {theirs}"
