"""Exact cover: do boxes tile a tensor's shape exactly once?

The one implementation behind the reader (a sharded checkpoint's pieces), the planner
(every rank's primary pieces, a slice's pieces in its local tensor) and the verifier (what
the ranks report they hold). It lives in the lowest stage so that all three can use it.
"""
from __future__ import annotations

import heapq
from enum import Enum
from math import prod
from typing import NamedTuple, Sequence

from coordloader.checkpoint.metadata import Box


class TilingKind(str, Enum):
    OUTSIDE = "outside"   # box `first` has the wrong rank, leaves the shape, or is empty
    OVERLAP = "overlap"   # boxes `first` and `second` intersect
    GAP = "gap"           # the boxes cover fewer elements than the shape has


class TilingProblem(NamedTuple):
    kind: TilingKind
    first: int | None
    second: int | None
    detail: str


def fmt_box(box: Box) -> str:
    """``[a:b,c:d]``: the one way a box is written in messages."""
    return "[" + ",".join(f"{a}:{c}" for a, c in box) + "]"


def tiling_problem(boxes: Sequence[Box], shape: Sequence[int], *,
                   allow_empty: bool = False) -> TilingProblem | None:
    """None if ``boxes`` tile ``shape`` exactly once, else the first problem found.
    An extent may be empty only where the tensor's dim is 0 (a zero-element tensor is tiled
    by its one empty box), or anywhere with ``allow_empty`` (empty boxes then tile nothing).
    Called for every planned tensor: plain loops, no per-box generators."""
    nd = len(shape)
    total = 0
    empty = False
    for i, b in enumerate(boxes):
        if len(b) != nd:
            return TilingProblem(TilingKind.OUTSIDE, i, None,
                                 f"box {fmt_box(b)} has {len(b)} dims, the tensor has {nd}")
        v = 1
        for (a, c), s in zip(b, shape):
            if not (0 <= a <= c <= s) or (a == c and s and not allow_empty):
                return TilingProblem(TilingKind.OUTSIDE, i, None, f"box {fmt_box(b)} is empty "
                                     f"or outside the shape {list(shape)}")
            v *= c - a
        total += v
        empty = empty or not v
    if len(boxes) > 1:
        live = [i for i, b in enumerate(boxes) if not empty or all(c > a for a, c in b)]
        pair = None
        if len(live) > 1:
            pair = ((live[0], live[1]) if not nd
                    else _find_overlap([boxes[i] for i in live], live, 0))
        if pair is not None:
            i, j = sorted(pair)
            return TilingProblem(TilingKind.OVERLAP, i, j,
                                 f"boxes {fmt_box(boxes[i])} and {fmt_box(boxes[j])} overlap")
    numel = prod(shape)
    if total != numel:
        return TilingProblem(TilingKind.GAP, None, None,
                             f"the pieces cover {total} of {numel} elements")
    return None


def find_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """The indices of two intersecting non-empty boxes, or None."""
    live = [i for i, b in enumerate(boxes) if all(c > a for a, c in b)]
    if len(live) < 2:
        return None
    if not boxes[live[0]]:
        return live[0], live[1]
    return _find_overlap([boxes[i] for i in live], live, 0)


def _find_overlap(boxes: Sequence[Box], ids: Sequence[int], dim: int) -> tuple[int, int] | None:
    """Two boxes (by id) intersecting on every dim >= ``dim``, or None. A sweep, not all
    pairs: along ``dim``, at each distinct start the active boxes are checked recursively on
    the remaining dims; the last dim sorts and compares with the farthest-reaching box."""
    order = sorted(range(len(boxes)), key=lambda k: boxes[k][dim])
    if dim == len(boxes[0]) - 1:
        far = order[0]
        for k in order[1:]:
            if boxes[k][dim][0] < boxes[far][dim][1]:
                return ids[far], ids[k]
            if boxes[k][dim][1] > boxes[far][dim][1]:
                far = k
        return None
    active: list = []  # heap of (end, k)
    i, n = 0, len(order)
    while i < n:
        s = boxes[order[i]][dim][0]
        while active and active[0][0] <= s:
            heapq.heappop(active)
        while i < n and boxes[order[i]][dim][0] == s:
            heapq.heappush(active, (boxes[order[i]][dim][1], order[i]))
            i += 1
        if len(active) > 1:
            ks = [k for _, k in active]
            pair = _find_overlap([boxes[k] for k in ks], [ids[k] for k in ks], dim + 1)
            if pair:
                return pair
    return None
