"""Compact byte-run lists.

A slice along dim 1 of a row-major tensor needs one read per row: DeepSeek-V3's o_proj
alone gives 7168 runs per rank and layer, millions per plan. Materialising each as a
Python object would dominate planning time and memory, so the planner stores runs as
*strided groups* (``RunGroup``: file, offset, length, dest, count, src_stride, dst_stride) -- run
``i`` of a group reads ``length`` bytes at ``offset + i*src_stride`` into
``dest + i*dst_stride`` -- and ``RunList`` presents them as the immutable sequence of
``model.ByteRun`` that the plan model promises (iteration, len, indexing, equality
with a plain tuple of ByteRuns). Engines that want vectorised access use ``arrays()``."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Iterator, NamedTuple

import numpy as np

from coordloader.checkpoint.metadata import TensorInfo, full_box
from coordloader.planning.model import ByteRun, Piece


class RunGroup(NamedTuple):
    """``count`` runs of ``length`` bytes: run i reads at ``offset + i*src_stride`` of
    ``file`` into byte ``dest + i*dst_stride`` of the local tensor (strides 0 when
    ``count`` is 1). A tuple, so the hot paths build and unpack it as one."""
    file: str
    offset: int
    length: int
    dest: int
    count: int
    src_stride: int
    dst_stride: int

    def src_span(self) -> tuple[int, int]:
        """[lo, hi) of the file bytes the group's runs lie in (a stride may be negative)."""
        last = self.offset + (self.count - 1) * self.src_stride
        return min(self.offset, last), max(self.offset, last) + self.length

    def dst_span(self) -> tuple[int, int]:
        """[lo, hi) of the destination bytes the group's runs write."""
        last = self.dest + (self.count - 1) * self.dst_stride
        return min(self.dest, last), max(self.dest, last) + self.length



class RunList(Sequence):
    __slots__ = ("groups", "_n", "_total", "_hash", "_cum")

    def __init__(self, groups=()):
        self.groups: tuple[RunGroup, ...] = tuple(groups)
        n = t = 0
        for g in self.groups:
            n += g[4]
            t += g[2] * g[4]
        self._n = n
        self._total = t
        self._hash = None
        self._cum = None

    def moved(self, file: str, delta: int) -> "RunList":
        """These runs read from ``file``, ``delta`` bytes further on: the runs of the same
        slice of a tensor of the same shape stored whole elsewhere (runs are merged by the
        offsets' differences, which a move keeps)."""
        rl = RunList.__new__(RunList)
        rl.groups = tuple([RunGroup(file, g[1] + delta, g[2], g[3], g[4], g[5], g[6])
                           for g in self.groups])
        rl._n = self._n
        rl._total = self._total
        rl._hash = None
        rl._cum = self._cum
        return rl

    @staticmethod
    def single(file: str, offset: int, length: int) -> "RunList":
        """One run of ``length`` bytes at ``offset`` of ``file`` into byte 0: a whole
        tensor, the planner's most common slice (built without the generic __init__)."""
        rl = RunList.__new__(RunList)
        rl.groups = (RunGroup(file, offset, length, 0, 1, 0, 0),)
        rl._n = 1
        rl._total = length
        rl._hash = None
        rl._cum = None
        return rl

    @staticmethod
    def from_runs(runs) -> "RunList":
        if isinstance(runs, RunList):
            return runs
        return RunList(RunGroup(r.file, r.offset, r.length, r.dest, 1, 0, 0) for r in runs)

    # -- sequence ------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[ByteRun]:
        for f, o, ln, d, c, ss, ds in self.groups:
            if c == 1:
                yield ByteRun(f, o, ln, d)
            else:
                for i in range(c):
                    yield ByteRun(f, o + i * ss, ln, d + i * ds)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("run index out of range")
        if self._cum is None:
            cum, s = [], 0
            for g in self.groups:
                s += g[4]
                cum.append(s)
            self._cum = cum
        k = bisect.bisect_right(self._cum, i)
        f, o, ln, d, c, ss, ds = self.groups[k]
        j = i - (self._cum[k] - c)
        return ByteRun(f, o + j * ss, ln, d + j * ds)

    @property
    def total_bytes(self) -> int:
        return self._total

    def files(self) -> tuple[str, ...]:
        out = []
        for g in self.groups:
            if g[0] not in out:
                out.append(g[0])
        return tuple(out)

    def arrays(self):
        """-> (files, file_index, offsets, lengths, dests) with int64 numpy arrays, one
        entry per run, in order."""
        files = self.files()
        fidx = {f: i for i, f in enumerate(files)}
        if not self.groups:
            z = np.zeros(0, np.int64)
            return files, z, z, z, z
        cnt = np.fromiter((g[4] for g in self.groups), np.int64, len(self.groups))
        def rep(k):
            return np.repeat(np.fromiter((g[k] for g in self.groups), np.int64, len(self.groups)), cnt)
        # index of each run inside its group
        starts = np.cumsum(cnt) - cnt
        within = np.arange(self._n, dtype=np.int64) - np.repeat(starts, cnt)
        fi = np.repeat(np.fromiter((fidx[g[0]] for g in self.groups), np.int64, len(self.groups)), cnt)
        return files, fi, rep(1) + within * rep(5), rep(2), rep(3) + within * rep(6)

    # -- value semantics -----------------------------------------------------
    def __eq__(self, other):
        if isinstance(other, RunList):
            if self.groups == other.groups:
                return True
            if self._n != other._n or self._total != other._total:
                return False
            a, b = self.arrays(), other.arrays()
            return ([a[0][i] for i in a[1]] == [b[0][i] for i in b[1]]
                    and all(np.array_equal(x, y) for x, y in zip(a[2:], b[2:])))
        if isinstance(other, (tuple, list)):
            return len(other) == self._n and all(x == y for x, y in zip(self, other))
        return NotImplemented

    def __ne__(self, other):
        r = self.__eq__(other)
        return r if r is NotImplemented else not r

    def __hash__(self):
        # consistent with equality against a tuple of ByteRuns
        if self._hash is None:
            self._hash = hash(tuple(self))
        return self._hash

    def __reduce__(self):
        return (RunList, (self.groups,))

    def __repr__(self):
        return f"RunList({self._n} runs, {self._total} bytes, {len(self.groups)} groups)"


def groups_of(runs) -> tuple[RunGroup, ...]:
    """The strided groups of a RunList, or one single-run group per ByteRun of a plain
    sequence (plans read from JSON, slices built by hand)."""
    return RunList.from_runs(runs).groups


def box_runs(file: str, src_start: int, src_box, src_shape, o_box, local_shape, dst_corner,
             isz: int) -> list[RunGroup]:
    """Strided groups reading overlap box ``o_box`` (global coords) of a source piece stored
    row-major at byte ``src_start`` holding ``src_box`` (global coords, shape ``src_shape``)
    into a row-major local tensor of ``local_shape``, where global point x lands at local
    ``x - o_box.start + dst_corner``. Closed form: O(number of groups), and a dim-0 slice
    or any box contiguous in both source and destination is a single run."""
    n = len(o_box)
    if n == 0:
        return [RunGroup(file, src_start, isz, 0, 1, 0, 0)]
    if n == 2:  # fast path: most tensors are matrices
        (a0, b0), (a1, b1) = o_box
        S1, L1 = src_shape[1], local_shape[1]
        e0, e1 = b0 - a0, b1 - a1
        if e0 <= 0 or e1 <= 0:
            return []
        so = src_start + ((a0 - src_box[0][0]) * S1 + a1 - src_box[1][0]) * isz
        do = (dst_corner[0] * L1 + dst_corner[1]) * isz
        if (e1 == S1 and e1 == L1) or e0 == 1:
            return [RunGroup(file, so, e0 * e1 * isz, do, 1, 0, 0)]
        return [RunGroup(file, so, e1 * isz, do, e0, S1 * isz, L1 * isz)]
    if n == 1:
        (a0, b0), = o_box
        if b0 <= a0:
            return []
        return [RunGroup(file, src_start + (a0 - src_box[0][0]) * isz, (b0 - a0) * isz, dst_corner[0] * isz,
                 1, 0, 0)]
    ext = [b - a for a, b in o_box]
    # innermost dims that are whole in both source and destination fold into the run
    k = n - 1
    while k > 0 and ext[k] == src_shape[k] and ext[k] == local_shape[k]:
        k -= 1
    run = isz
    for j in range(k, n):
        run *= ext[j]
    if run == 0:
        return []
    # element strides
    sst = [1] * n
    dst = [1] * n
    for j in range(n - 2, -1, -1):
        sst[j] = sst[j + 1] * src_shape[j + 1]
        dst[j] = dst[j + 1] * local_shape[j + 1]
    so = sum((o_box[j][0] - src_box[j][0]) * sst[j] for j in range(n))
    do = sum(dst_corner[j] * dst[j] for j in range(n))
    if k == 0:
        return [RunGroup(file, src_start + so * isz, run, do * isz, 1, 0, 0)]
    cnt = ext[k - 1]
    ss, ds = sst[k - 1] * isz, dst[k - 1] * isz
    if k == 1 or all(e == 1 for e in ext[:k - 1]):   # one group (e.g. one expert of a fused tensor)
        if cnt == 1:
            return [RunGroup(file, src_start + so * isz, run, do * isz, 1, 0, 0)]
        return [RunGroup(file, src_start + so * isz, run, do * isz, cnt, ss, ds)]
    # more outer dims: one group per index of dims 0..k-2 (rare: sliced 3-D tensors)
    out = []
    for idx in np.indices(ext[:k - 1]).reshape(k - 1, -1).T:
        s_off = so + sum(int(idx[j]) * sst[j] for j in range(k - 1))
        d_off = do + sum(int(idx[j]) * dst[j] for j in range(k - 1))
        out.append(RunGroup(file, src_start + s_off * isz, run, d_off * isz, cnt, ss if cnt > 1 else 0,
                    ds if cnt > 1 else 0))
    return out


def merge_groups(groups: list[RunGroup]) -> list[RunGroup]:
    """Merge consecutive single runs adjacent in both the file and the destination."""
    out: list[RunGroup] = []
    for g in groups:
        if out:
            p = out[-1]
            if (p.count == 1 and g.count == 1 and p.file == g.file
                    and p.offset + p.length == g.offset and p.dest + p.length == g.dest):
                out[-1] = RunGroup(p.file, p.offset, p.length + g.length, p.dest, 1, 0, 0)
                continue
        out.append(g)
    return out


def slice_runs(t: TensorInfo, pieces: tuple[Piece, ...], lshape: tuple[int, ...],
               isz: int, full_boxes: dict | None = None) -> RunList:
    """The byte runs of a slice of ``t`` (``isz`` bytes per element) holding ``pieces`` in a
    local tensor of shape ``lshape``: per piece and per stored piece of ``t`` it overlaps,
    the runs of the overlap, merged into strided groups. ``full_boxes`` (shape -> its whole
    box) memoises the whole boxes across the calls of one plan."""
    groups = []
    src = t.pieces
    full = None if full_boxes is None else full_boxes.get(t.shape)
    if full is None:
        full = full_box(t.shape)
        if full_boxes is not None:
            full_boxes[t.shape] = full
    if len(src) == 1 and src[0].box == full:
        sp = src[0]
        if len(pieces) == 1 and lshape == t.shape and pieces[0].src == sp.box:
            return RunList.single(sp.file, sp.start, sp.end - sp.start)
        for pc in pieces:
            groups += box_runs(sp.file, sp.start, sp.box, t.shape, pc.src, lshape, pc.dst, isz)
    else:
        for pc in pieces:
            for sp in src:
                o = []
                for (a, b), (c, d) in zip(pc.src, sp.box):
                    lo, hi = max(a, c), min(b, d)
                    if hi <= lo:
                        break
                    o.append((lo, hi))
                else:
                    if len(o) != len(pc.src):
                        continue
                    corner = tuple(pc.dst[j] + o[j][0] - pc.src[j][0] for j in range(len(o)))
                    sshape = tuple(d - c for c, d in sp.box)
                    groups += box_runs(sp.file, sp.start, sp.box, sshape, tuple(o), lshape,
                                       corner, isz)
    if len(groups) > 1:
        groups = merge_groups(groups)
    return RunList(groups)
