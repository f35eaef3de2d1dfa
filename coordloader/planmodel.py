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
        return sum(r.length for r in self.byte_runs)

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
        """sha256 of the canonical JSON: equal plans give equal digests on any machine."""
        if not self._digest:
            blob = json.dumps(self.to_json(with_digest=False), sort_keys=True,
                              separators=(",", ":")).encode()
            self._digest.append(hashlib.sha256(blob).hexdigest())
        return self._digest[0]
