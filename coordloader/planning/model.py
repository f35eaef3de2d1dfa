"""Frozen plan objects and their canonical JSON form (schema version 1, a public
interface documented in docs/plan-schema.md). Built by ``coordloader.plan``; consumed by
engines, the verifier and the CLI."""
from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from itertools import compress
from math import prod
from typing import Any, Mapping, NamedTuple

import numpy as np

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.metadata import Box, box_numel
from coordloader.errors import PlanError
from coordloader.gcpause import gc_paused
from coordloader.layout import as_rank

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Piece:
    src: Box                 # box in the global tensor
    dst: tuple[int, ...]     # offset of the box's corner in the local tensor
    # True: a copy of a box that another rank class holds as its primary piece (the K/V
    # heads of a fused qkv replicated when tp > num_kv_heads: the q rows make every TP
    # rank's slice its own class, so the slice's replica id cannot say it). A copy never
    # counts as primary, whatever the slice's ``replica``; cover proves its box equals a
    # primary piece's. False everywhere else, and then absent from the JSON and the digest.
    copy: bool = False


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
    # A replica's primary copy (replica 0 of the same class), whose fields it repeats but
    # for ``replica``; None on a primary. Not data: ignored by ==, hash, repr and to_json.
    # Plan.digest() encodes a class's shared fields once, keyed by it. init=False, so
    # dataclasses.replace() (which may change any field) never carries a stale one over;
    # only ``replica_of`` sets it.
    base: TensorSlice | None = field(default=None, init=False, compare=False, repr=False)

    # cached: engines and verify ask for these per slice, thousands of times a load
    # (cached_property writes the instance __dict__ directly, so frozen is no obstacle)
    @cached_property
    def local_numel(self) -> int:
        return prod(self.local_shape)

    @cached_property
    def covered_numel(self) -> int:
        return sum(box_numel(p.src) for p in self.pieces)

    @cached_property
    def needs_zero_fill(self) -> bool:
        """True when pieces do not fill the local tensor (vocab padding rows)."""
        return self.covered_numel != self.local_numel

    @property
    def bytes_to_read(self) -> int:
        total = getattr(self.byte_runs, "total_bytes", None)  # coordloader.runs.RunList
        return total if total is not None else sum(r.length for r in self.byte_runs)

    @classmethod
    def build(cls, name: str, file: str, dtype: str, global_shape: tuple[int, ...],
              local_shape: tuple[int, ...], pieces: tuple[Piece, ...], replica: int,
              byte_runs: tuple[ByteRun, ...], strategy: str,
              base: TensorSlice | None = None) -> TensorSlice:
        """The same slice as ``TensorSlice(...)`` (every field positional, ``base`` too), built
        with one instance-dict assignment instead of the frozen __init__'s one
        object.__setattr__ per field. The planner builds ~100 k slices per DeepSeek-V3 plan
        and the __init__ cost ~8 % of make_plan (docs/architecture.md, "The plan objects").
        No validation either way; the instance dict holds exactly the declared fields."""
        s = object.__new__(cls)
        object.__setattr__(s, "__dict__", {
            "name": name, "file": file, "dtype": dtype, "global_shape": global_shape,
            "local_shape": local_shape, "pieces": pieces, "replica": replica,
            "byte_runs": byte_runs, "strategy": strategy, "base": base})
        return s

    def replica_of(self, replica: int) -> TensorSlice:
        """This primary slice's copy on a rank that holds it as replica ``replica``."""
        return TensorSlice.build(self.name, self.file, self.dtype, self.global_shape,
                                 self.local_shape, self.pieces, replica, self.byte_runs,
                                 self.strategy, self if self.base is None else self.base)

    def to_json(self) -> dict:
        files = {r.file for r in self.byte_runs}
        multi = len(files) > 1
        runs = [[r.offset, r.length, r.dest] + ([r.file] if multi else []) for r in self.byte_runs]
        return {
            "name": self.name, "file": None if multi else self.file, "dtype": self.dtype,
            "global_shape": list(self.global_shape), "local_shape": list(self.local_shape),
            "replica": self.replica, "strategy": self.strategy,
            "pieces": [_piece_json(pc) for pc in self.pieces],
            "byte_runs": runs,
        }

    @staticmethod
    def from_json(d: Mapping) -> "TensorSlice":
        runs = []
        for r in d["byte_runs"]:
            f = r[3] if len(r) > 3 else d["file"]
            runs.append(ByteRun(f, int(r[0]), int(r[1]), int(r[2])))
        pieces = tuple(Piece(tuple((int(a), int(b)) for a, b in p["src"]), tuple(int(x) for x in p["dst"]),
                             bool(p.get("copy", False)))
                       for p in d["pieces"])
        return TensorSlice(d["name"], d["file"] if d["file"] is not None else runs[0].file, d["dtype"],
                           tuple(d["global_shape"]), tuple(d["local_shape"]), pieces,
                           int(d["replica"]), tuple(runs), d.get("strategy", "replicate"))


def _piece_json(pc: Piece) -> dict:
    d = {"src": [list(p) for p in pc.src], "dst": list(pc.dst)}
    if pc.copy:   # optional: absent on every piece that is not a copy
        d["copy"] = True
    return d


def primary_boxes(pieces) -> tuple:
    """The source boxes of ``pieces`` that are not copies (``Piece.copy``)."""
    return tuple([p.src for p in pieces if not p.copy])


def copy_boxes(pieces) -> tuple:
    """The source boxes of ``pieces`` that are copies of another rank class's primary."""
    return tuple([p.src for p in pieces if p.copy])


@dataclass(frozen=True)
class RankPlan:
    rank: int
    coords: Mapping[str, int]        # tp, dp, pp, ep, moe_tp
    tensors: tuple[TensorSlice, ...]  # sorted by name

    @property
    def bytes_held(self) -> int:
        return sum(t.local_numel * itemsize(t.dtype) for t in self.tensors)

    @property
    def bytes_to_read(self) -> int:
        return sum(t.bytes_to_read for t in self.tensors)

    def by_name(self) -> dict[str, TensorSlice]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> dict:
        return {"rank": self.rank, "coords": dict(self.coords),
                "tensors": [t.to_json() for t in self.tensors]}


class LoadGroupMode(str, Enum):
    """How a set of files is fetched. A str, so the plan JSON keeps writing "group"."""
    GROUP = "group"         # the members split the reads and all-gather
    FILTERED = "filtered"   # each rank reads only its own tensors (tensor_filter)


class Form(NamedTuple):
    """The fields a slice shares with the other slices of its layer family's class (all
    but its name and byte runs)."""
    dtype: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    strategy: str


class SliceColumns(Sequence):
    """A rank class's slices (replica 0, name order) as sids of a SliceStore
    (``planning.store``): a sequence of TensorSlice whose items are built on first use."""

    __slots__ = ("store", "sids")

    def __init__(self, store, sids: tuple[int, ...]):
        object.__setattr__(self, "store", store)
        object.__setattr__(self, "sids", tuple(sids))

    def __setattr__(self, name: str, value) -> None:
        # read-only: a rank's slices are built from these once, and cover and the digest
        # read them again
        raise AttributeError(f"SliceColumns is read-only: {name} cannot be set")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"SliceColumns is read-only: {name} cannot be deleted")

    def __reduce__(self):
        return SliceColumns, (self.store, self.sids)

    def __len__(self) -> int:
        return len(self.sids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(map(self.store.slice, self.sids[i]))
        return self.store.slice(self.sids[i])

    def __iter__(self):
        return map(self.store.slice, self.sids)

    @property
    def names(self) -> list[str]:
        return list(map(self.store.names.__getitem__, self.sids))

    def __eq__(self, other):
        if isinstance(other, SliceColumns) and other.store is self.store:
            return self.sids == other.sids
        if isinstance(other, (tuple, SliceColumns)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self):
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"SliceColumns({len(self.sids)} slices)"


@dataclass(frozen=True)
class SharedSlices:
    """What every rank of a *rank class* holds alike: ranks whose coordinates give the same
    slices (DP replicas, and any other symmetry the planner finds) share one of these, and
    only their replica ids differ. The planner builds each once, so planning, the digest
    and cover validation cost by distinct ranks, not by world size."""
    # replica-0 form of each slice, sorted by name (SliceColumns from the planner)
    slices: Sequence[TensorSlice]
    tables: tuple[int, ...]               # per slice: the replica table giving its replica id
    replicas: tuple[tuple[int, ...], ...]  # replicas[table][rank] (-1: not held); plan-wide
    ranks: tuple[int, ...]                # the ranks of the class, ascending

    def replica_ids(self, rank: int) -> tuple[int, ...]:
        """The replica id of each of ``slices`` on ``rank`` (one C-level gather)."""
        row = [tbl[rank] for tbl in self.replicas]
        n = len(self.tables)
        if n == 0:
            return ()
        if n == 1:
            return (row[self.tables[0]],)
        return self._gather(row)

    @cached_property
    def _gather(self):
        from operator import itemgetter
        return itemgetter(*self.tables)

    def slices_of(self, rank: int) -> tuple[TensorSlice, ...]:
        """``rank``'s own slices: the shared ones, copied where its replica id is not 0."""
        return tuple(b if rep == 0 else b.replica_of(rep)
                     for b, rep in zip(self.slices, self.replica_ids(rank)))


class SharedRankPlan(RankPlan):
    """A RankPlan whose slices come from its rank class's SharedSlices (``share``), built on
    first use of ``tensors``: a 1024-rank plan is assembled without 12 M slice objects, and
    a process that loads one rank materialises that rank only. Equal to the RankPlan with
    the same fields. Built by ``make``; RankPlan's own __init__ (as dataclasses.replace()
    calls it) gives one with its ``tensors`` set and no ``share``."""

    share: SharedSlices | None = None   # set per instance by make(); not a dataclass field

    @cached_property
    def tensors(self) -> tuple[TensorSlice, ...]:   # type: ignore[override]
        return self.share.slices_of(self.rank)

    @staticmethod
    def make(rank: int, coords: Mapping[str, int], share: SharedSlices) -> SharedRankPlan:
        rp = object.__new__(SharedRankPlan)
        # frozen: set the way a dataclass __init__ sets its own fields; ``tensors`` is left
        # unset so that the cached_property builds it on first use
        object.__setattr__(rp, "rank", rank)
        object.__setattr__(rp, "coords", coords)
        object.__setattr__(rp, "share", share)
        return rp

    def __eq__(self, other):
        if not isinstance(other, RankPlan):
            return NotImplemented
        return (self.rank, self.coords, self.tensors) == (other.rank, other.coords, other.tensors)

    __hash__ = RankPlan.__hash__

    def __repr__(self) -> str:
        n = len(self.tensors) if self.share is None else len(self.share.slices)
        return f"SharedRankPlan(rank={self.rank}, coords={dict(self.coords)}, slices={n})"


def share_of(rp: RankPlan) -> SharedSlices | None:
    """The rank class ``rp`` shares its slices with, or None for a plain RankPlan."""
    return getattr(rp, "share", None)


def slice_count(rp: RankPlan) -> int:
    """len(rp.tensors) without materialising a shared rank's slices."""
    sh = share_of(rp)
    return len(rp.tensors) if sh is None else len(sh.slices)


@dataclass(frozen=True)
class LoadGroup:
    """How the instanttensor engine fetches a set of files (chosen by the cost model)."""
    files: tuple[str, ...]
    ranks: tuple[int, ...]   # members of the process group ("group" mode)
    mode: str                # a LoadGroupMode value


@dataclass(frozen=True)
class Plan:
    layout: Any                      # coordloader.layout.Layout
    fingerprint: str                 # CheckpointMeta.fingerprint()
    ranks: tuple[RankPlan, ...]
    excluded: tuple[str, ...] = ()   # checkpoint tensors left out on purpose
    load_groups: tuple[LoadGroup, ...] = ()
    # digest() memo; not an init field, so dataclasses.replace() starts a fresh one
    _digest: list = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank(self, r: int) -> RankPlan:
        """Rank ``r``'s plan; PlanError for a rank outside the world (a negative index
        was the last rank's)."""
        r = as_rank(r, PlanError)
        if not 0 <= r < len(self.ranks):
            raise PlanError(f"rank {r} outside the plan's world of {len(self.ranks)} "
                            f"({self.layout})")
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
            # many small tuples, all kept until the end: the cyclic GC would rescan the
            # plan's objects over and over (most of the cost on a large plan)
            with gc_paused():
                self._digest.append(_plan_digest(self))
        return self._digest[0]


def _canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _runs_key(runs) -> tuple:
    """Canonical encoding of a byte-run list: the greedy left-to-right folding of its runs
    into arithmetic groups ``(file, offset, length, dest, count, src_stride, dst_stride)``
    (a run joins the current group when it has the same file and length and continues
    both strides; a one-run group takes any such run and the strides it implies). It
    depends on the sequence of runs only -- a RunList and a tuple of the same ByteRuns,
    however grouped, encode alike -- and costs O(groups), not O(runs)."""
    groups = getattr(runs, "groups", None)
    if groups is None:
        groups = [(r.file, r.offset, r.length, r.dest, 1, 0, 0) for r in runs]
    if len(groups) == 1:
        f, o, ln, d, c, ss, ds = groups[0]
        if c == 1:
            return ((f, o, ln, d, 1, 0, 0),)
        if c > 1:
            return ((f, o, ln, d, c, ss, ds),)
    out = []
    cur = None   # [file, offset, length, dest, count, src_stride, dst_stride]
    for f, o, ln, d, c, ss, ds in groups:
        if c <= 0:
            continue
        i = 0    # runs of this group taken by the current group
        if cur is not None and cur[0] == f and cur[2] == ln:
            if cur[4] == 1:
                cur[4], cur[5], cur[6] = 2, o - cur[1], d - cur[3]
                i = 1
            elif o == cur[1] + cur[4] * cur[5] and d == cur[3] + cur[4] * cur[6]:
                cur[4] += 1
                i = 1
            if i and c > 1 and ss == cur[5] and ds == cur[6]:
                cur[4] += c - 1
                i = c
        if i < c:
            if cur is not None:
                out.append(tuple(cur))
            rem = c - i
            cur = [f, o + i * ss, ln, d + i * ds, rem, ss if rem > 1 else 0, ds if rem > 1 else 0]
    if cur is not None:
        out.append(tuple(cur))
    return tuple(out)


def _plan_digest(plan: "Plan") -> str:
    import array
    h = hashlib.sha256(b"coordloader-plan-v3")
    h.update(_canon({
        "version": SCHEMA_VERSION, "fingerprint": plan.fingerprint,
        "layout": plan.layout.to_dict(), "excluded": list(plan.excluded),
        "load_groups": [{"files": list(g.files), "ranks": list(g.ranks), "mode": g.mode}
                        for g in plan.load_groups]}))
    # Every distinct slice (all fields but the replica id) is encoded once as the repr of a
    # tuple of its fields (repr of str/int tuples is canonical and self-delimiting, the same
    # on every CPython) into a table, numbered by first appearance; each rank then adds
    # two int64 arrays: its slices' table numbers and replica ids. The table is keyed by
    # the encoding (content), so equal plans give equal digests however their objects are
    # shared; ids only memoise work (see _Rows). A rank of a rank class (SharedRankPlan)
    # reuses its class's table numbers and gathers its replica ids without building its
    # slices.
    rows_of = _Rows()
    # id(SharedSlices) -> its rows bytes (the same for all its ranks), and the numpy
    # gather of its ranks' replica ids: a 1024-rank plan has 12 M of them
    shared_rows: dict = {}
    tables: dict = {}        # id(replica tables) -> them as one [table, rank] int64 array
    for rp in plan.ranks:
        sh = share_of(rp)
        if sh is not None:
            got = shared_rows.get(id(sh))
            if got is None:
                R = tables.get(id(sh.replicas))
                if R is None:
                    # (a plan of no tensors has no table: reshape cannot infer its width)
                    R = tables[id(sh.replicas)] = (
                        np.array(sh.replicas, dtype="<i8").reshape(len(sh.replicas), -1)
                        if sh.replicas else np.zeros((0, plan.world_size), dtype="<i8"))
                got = shared_rows[id(sh)] = (rows_of(sh.slices), R,
                                             np.array(sh.tables, dtype=np.intp))
            rows, R, idx = got
            # canonical: little-endian int64, whatever the machine
            replicas = R[idx, rp.rank].tobytes() if len(idx) else b""
            n = len(sh.slices)
        else:
            rows = rows_of(rp.tensors)
            a = array.array("q", [t.replica for t in rp.tensors])
            if sys.byteorder != "little":   # canonical: little-endian int64 ("q" is 8 bytes)
                a.byteswap()
            replicas = a.tobytes()
            n = len(rp.tensors)
        h.update(b"\x00R" + _canon([rp.rank, dict(rp.coords), n]))
        h.update(rows)
        h.update(replicas)
    h.update(b"\x00T" + rows_of.table.digest())
    return h.hexdigest()


class _Rows:
    """Table numbers of slices for Plan.digest(), the table hashed as it grows. The
    encoding of the fields a layer family's slices share (pieces, shapes, dtype, strategy)
    is computed once per distinct set (the planner shares pieces objects across replicas
    and same-shaped tensors), and a replica reuses its primary's row
    (``TensorSlice.base``: the slice whose other fields it copies). The objects live
    in the plan meanwhile, so ids are stable."""

    def __init__(self):
        self.table = hashlib.sha256()
        self.number: dict[bytes, int] = {}
        self.row_of: dict = {}
        self.pieces_of: dict = {}
        # the encoding of the fields between file and runs, which the slices of one class
        # of a layer family share: (id(pieces), dtype, shapes, strategy) -> their repr
        self.middle_of: dict = {}
        # id(SliceStore) -> (per sid its table number or -1, per form its middle part)
        self.sid_rows: dict = {}

    def __call__(self, slices) -> bytes:
        """Little-endian int64 table numbers of ``slices``."""
        import array
        if type(slices) is SliceColumns:
            return self._columns(slices)
        number, row_of = self.number, self.row_of
        rows = array.array("q")
        for t in slices:
            b = t.base
            if b is None:
                b = t
            k = row_of.get(id(b))
            if k is None:
                d = t.__dict__   # plain attribute reads, without the descriptor lookups
                # the repr of the tuple (name, file, dtype, global shape, local shape,
                # strategy, pieces key, runs key), written out: a tuple's repr is its items'
                # reprs joined by ", " in parentheses, and the items in the middle repeat
                # across a layer family, so their part is made once
                pcs = d["pieces"]
                gs, ls = d["global_shape"], d["local_shape"]
                if type(gs) is not tuple or type(ls) is not tuple:   # a slice built by hand
                    gs, ls = tuple(gs), tuple(ls)
                mid = self._middle(pcs, d["dtype"], gs, ls, d["strategy"])
                enc = f"({d['name']!r}, {d['file']!r}, {mid}, {_runs_repr(d['byte_runs'])})".encode()
                k = number.get(enc)
                if k is None:
                    k = number[enc] = len(number)
                    self.table.update(enc)
                row_of[id(b)] = k
            rows.append(k)
        if sys.byteorder != "little":
            rows.byteswap()
        return rows.tobytes()

    def _middle(self, pcs, dtype, gs, ls, strategy) -> str:
        mk = (id(pcs), dtype, gs, ls, strategy)
        mid = self.middle_of.get(mk)
        if mid is None:
            pk = self.pieces_of.get(id(pcs))
            if pk is None:
                # a copy piece adds a third item; every other piece encodes as before the
                # field existed
                pk = self.pieces_of[id(pcs)] = tuple(
                    (tuple(map(tuple, p.src)), tuple(p.dst)) + ((True,) if p.copy else ())
                    for p in pcs)
            mid = self.middle_of[mk] = ", ".join(map(repr, (dtype, gs, ls, strategy, pk)))
        return mid

    def _columns(self, sc: SliceColumns) -> bytes:
        """``__call__`` for a rank class held as SliceColumns: each sid of its store is
        encoded once, as the slice object it stands for would be, from the columns."""
        import array
        store = sc.store
        got = self.sid_rows.get(id(store))
        if got is None:   # the store lives in the plan meanwhile: its id is stable
            got = self.sid_rows[id(store)] = (
                [-1] * len(store),
                [self._middle(f.pieces, f.dtype, f.global_shape, f.local_shape, f.strategy)
                 for f in store.forms])
        rows, mids = got
        new = list(compress(sc.sids, map((0).__gt__, map(rows.__getitem__, sc.sids))))
        if new:
            files = list(map(store.files.__getitem__, new))
            encs = list(map(str.encode, map(
                _ONE_RUN_ROW.format, map(store.names.__getitem__, new), files,
                map(mids.__getitem__, map(store.form.__getitem__, new)), files,
                map(store.starts.__getitem__, new), map(store.lengths.__getitem__, new))))
            runs = store.runs
            for i, sid in enumerate(new):
                if runs[sid] is not None:   # not one run: written as a slice's are
                    encs[i] = (f"({store.names[sid]!r}, {store.files[sid]!r}, {mids[store.form[sid]]}, "
                               f"{_runs_repr(runs[sid])})").encode()
            number = self.number
            first = len(number)
            if any(map(number.__contains__, encs)) or len(set(encs)) != len(encs):
                ks = []
                for enc in encs:   # numbered by first appearance, as __call__ does
                    k = number.get(enc)
                    if k is None:
                        k = number[enc] = len(number)
                        self.table.update(enc)
                    ks.append(k)
            else:
                ks = range(first, first + len(encs))
                number.update(zip(encs, ks))
                self.table.update(b"".join(encs))
            for sid, k in zip(new, ks):
                rows[sid] = k
        out = array.array("q", map(rows.__getitem__, sc.sids))
        if sys.byteorder != "little":
            out.byteswap()
        return out.tobytes()


# a slice of one run (a whole tensor): its row as __call__ writes it -- name, file, the
# middle fields, and _runs_key's one group (file, offset, length, dest 0, count 1, no strides)
_ONE_RUN_ROW = "({!r}, {!r}, {}, (({!r}, {!r}, {!r}, 0, 1, 0, 0),))"


def _runs_repr(runs) -> str:
    """repr(_runs_key(runs)), written out for one run (a whole tensor)."""
    groups = getattr(runs, "groups", None)
    if groups is not None and len(groups) == 1 and groups[0][4] == 1:
        f, o, ln, dst = groups[0][:4]
        return f"(({f!r}, {o!r}, {ln!r}, {dst!r}, 1, 0, 0),)"
    return repr(_runs_key(runs))
