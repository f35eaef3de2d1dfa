"""Frozen plan objects and their canonical JSON form (schema version 1, a public
interface documented in docs/plan-schema.md). Built by ``coordloader.plan``; consumed by
engines, the verifier and the CLI."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from math import prod
from typing import Any, Mapping

from .metadata import Box, box_numel

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Piece:
    src: Box                 # box in the global tensor
    dst: tuple[int, ...]     # offset of the box's corner in the local tensor


@dataclass(frozen=True)
class ByteRun:
    file: str      # checkpoint file name
    offset: int    # absolute byte offset in the file
    length: int    # bytes
    dest: int      # byte offset in the (contiguous) local tensor


@dataclass(frozen=True)
class TensorSlice:
    name: str
    file: str                       # file of the first byte run (HF: the tensor's file)
    dtype: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    replica: int                    # 0 = primary copy of these pieces
    byte_runs: tuple[ByteRun, ...]
    strategy: str = "replicate"     # rule strategy that produced it (diagnostics)

    @property
    def local_numel(self) -> int:
        return prod(self.local_shape)

    @property
    def covered_numel(self) -> int:
        return sum(box_numel(p.src) for p in self.pieces)

    @property
    def needs_zero_fill(self) -> bool:
        """True when pieces do not fill the local tensor (vocab padding rows)."""
        return self.covered_numel != self.local_numel

    @property
    def bytes_to_read(self) -> int:
        total = getattr(self.byte_runs, "total_bytes", None)  # coordloader.runs.RunList
        return total if total is not None else sum(r.length for r in self.byte_runs)

    def to_json(self) -> dict:
        files = {r.file for r in self.byte_runs}
        multi = len(files) > 1
        runs = [[r.offset, r.length, r.dest] + ([r.file] if multi else []) for r in self.byte_runs]
        return {
            "name": self.name, "file": None if multi else self.file, "dtype": self.dtype,
            "global_shape": list(self.global_shape), "local_shape": list(self.local_shape),
            "replica": self.replica, "strategy": self.strategy,
            "pieces": [{"src": [list(p) for p in pc.src], "dst": list(pc.dst)} for pc in self.pieces],
            "byte_runs": runs,
        }

    @staticmethod
    def from_json(d: Mapping) -> "TensorSlice":
        runs = []
        for r in d["byte_runs"]:
            f = r[3] if len(r) > 3 else d["file"]
            runs.append(ByteRun(f, int(r[0]), int(r[1]), int(r[2])))
        pieces = tuple(Piece(tuple((int(a), int(b)) for a, b in p["src"]), tuple(int(x) for x in p["dst"]))
                       for p in d["pieces"])
        return TensorSlice(d["name"], d["file"] if d["file"] is not None else runs[0].file, d["dtype"],
                           tuple(d["global_shape"]), tuple(d["local_shape"]), pieces,
                           int(d["replica"]), tuple(runs), d.get("strategy", "replicate"))


@dataclass(frozen=True)
class RankPlan:
    rank: int
    coords: Mapping[str, int]        # tp, dp, pp, ep, moe_tp
    tensors: tuple[TensorSlice, ...]  # sorted by name

    @property
    def bytes_held(self) -> int:
        from .dtypes import itemsize
        return sum(t.local_numel * itemsize(t.dtype) for t in self.tensors)

    @property
    def bytes_to_read(self) -> int:
        return sum(t.bytes_to_read for t in self.tensors)

    def by_name(self) -> dict[str, TensorSlice]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> dict:
        return {"rank": self.rank, "coords": dict(self.coords),
                "tensors": [t.to_json() for t in self.tensors]}


@dataclass(frozen=True)
class LoadGroup:
    """How the instanttensor engine fetches a set of files (chosen by the cost model)."""
    files: tuple[str, ...]
    ranks: tuple[int, ...]   # members of the process group ("group" mode)
    mode: str                # "group" (split reads + all-gather) or "filtered" (own tensors only)


@dataclass(frozen=True)
class Plan:
    layout: Any                      # coordloader.layout.Layout
    fingerprint: str                 # CheckpointMeta.fingerprint()
    ranks: tuple[RankPlan, ...]
    excluded: tuple[str, ...] = ()   # checkpoint tensors left out on purpose
    load_groups: tuple[LoadGroup, ...] = ()
    _digest: list = field(default_factory=list, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank(self, r: int) -> RankPlan:
        return self.ranks[r]

    def to_json(self, *, with_digest: bool = True) -> dict:
        d = {"version": SCHEMA_VERSION}
        if with_digest:
            d["digest"] = self.digest()
        d.update({
            "fingerprint": self.fingerprint,
            "layout": self.layout.to_dict(),
            "ranks": [r.to_json() for r in self.ranks],
            "excluded": list(self.excluded),
            "load_groups": [{"files": list(g.files), "ranks": list(g.ranks), "mode": g.mode}
                            for g in self.load_groups],
        })
        return d

    def digest(self) -> str:
        """sha256 over a canonical encoding of every field: equal plans give equal digests on
        any machine. Not the hash of to_json() (that expands millions of byte runs): the
        header is canonical JSON, then each slice contributes a canonical encoding of its
        fields, with byte runs as little-endian int64 arrays; encodings of pieces and runs
        shared between replicas are computed once."""
        if not self._digest:
            self._digest.append(_plan_digest(self))
        return self._digest[0]


def _canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _runs_digest(runs) -> bytes:
    # Short lists: JSON of the expanded runs; long ones: int64 arrays. The choice depends on
    # the number of runs only, so a RunList and a tuple of the same runs hash alike.
    if len(runs) <= 64:
        groups = getattr(runs, "groups", None)
        if groups is not None and all(g[4] == 1 for g in groups):
            return b"S" + repr([(g[0], g[1], g[2], g[3]) for g in groups]).encode()
        return b"S" + repr([(r.file, r.offset, r.length, r.dest) for r in runs]).encode()
    import numpy as np
    arrays = getattr(runs, "arrays", None)
    if arrays is not None:
        files, fi, off, ln, dst = arrays()
    else:
        files, fidx = [], {}
        for r in runs:
            if r.file not in fidx:
                fidx[r.file] = len(files)
                files.append(r.file)
        fi = np.fromiter((fidx[r.file] for r in runs), np.int64)
        off = np.fromiter((r.offset for r in runs), np.int64)
        ln = np.fromiter((r.length for r in runs), np.int64)
        dst = np.fromiter((r.dest for r in runs), np.int64)
    h = hashlib.sha256(_canon(list(files)))
    for a in (fi, off, ln, dst):
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
    return h.digest()


def _plan_digest(plan: "Plan") -> str:
    h = hashlib.sha256(b"coordloader-plan-v1")
    h.update(_canon({
        "version": SCHEMA_VERSION, "fingerprint": plan.fingerprint,
        "layout": plan.layout.to_dict(), "excluded": list(plan.excluded),
        "load_groups": [{"files": list(g.files), "ranks": list(g.ranks), "mode": g.mode}
                        for g in plan.load_groups]}))
    base_cache: dict = {}
    runs_cache: dict = {}
    for rp in plan.ranks:
        h.update(b"\x00R" + _canon([rp.rank, dict(rp.coords), len(rp.tensors)]))
        for t in rp.tensors:
            # the planner marks replicas with "_base", the slice whose other fields they copy
            key = id(t.__dict__.get("_base", t))
            b = base_cache.get(key)
            if b is None:
                rd = runs_cache.get(id(t.byte_runs))
                if rd is None:
                    rd = runs_cache[id(t.byte_runs)] = _runs_digest(t.byte_runs)
                # repr of str/int tuples is canonical (and the same on every CPython)
                b = (repr((
                    t.name, t.file, t.dtype, tuple(t.global_shape), tuple(t.local_shape),
                    t.strategy, tuple((tuple(map(tuple, p.src)), tuple(p.dst)) for p in t.pieces)
                )).encode() + b"\x00" + rd)
                base_cache[key] = b
            h.update(b)
            h.update(t.replica.to_bytes(8, "little"))
    return h.hexdigest()
