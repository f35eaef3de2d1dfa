"""Exact-cover validation.

For every checkpoint tensor the primary pieces (replica 0, less the pieces marked as
copies: ``Piece.copy``) over all ranks must tile the tensor exactly once; every replica
must hold exactly the boxes of some primary (its copies aside); every copy piece must
equal a primary piece; every tensor is held unless excluded on purpose. For a plan we
also check each slice on its own: pieces inside the tensor and inside the local shape,
byte runs inside the tensor's bytes in its files and adding up to the pieces' volume.

Sort/sweep based: per tensor the boxes are sorted along the dim where their starts vary
most and swept with an active list, so a valid tiling costs O(n log n) per tensor
(O(n*k) with k boxes overlapping along the sweep dim). Slices that share their pieces and
runs objects (the planner shares them across replicas) are checked once, and a tiling is
proved once per distinct (shape, boxes objects): the planner shares the pieces of
same-shaped tensors, so 90 k expert tensors need a handful of proofs. Cost follows the
distinct slices, not the ranks: a rank class is visited once, a slice object shared by
several classes is checked once, and replicas in a class that holds the primary need no
box match.
"""
from __future__ import annotations

from itertools import chain, compress, repeat
from math import prod
from operator import eq, index, is_
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.metadata import TensorTable, full_box
from coordloader.checkpoint.tiling import tiling_problem
from coordloader.errors import CheckpointError, PlanError
from coordloader.gcpause import gc_paused
from coordloader.planning.model import (
    Piece,
    SharedSlices,
    SliceColumns,
    copy_boxes,
    primary_boxes,
    share_of,
)
from coordloader.planning.runs import RunList, groups_of
from coordloader.planning.store import SliceStore
from coordloader.text import format_ranks

Box = tuple


def _as_box(p) -> Box:
    src = getattr(p, "src", p)
    return tuple((int(a), int(b)) for a, b in src)


def _core(prim: Mapping[str, list], reps: Mapping[str, list], shapes: Mapping[str, Sequence[int]],
          excluded: Iterable[str], err, copies: Mapping[str, list] | None = None) -> None:
    """prim/reps: name -> [(rank, boxes tuple, key)], ``key`` an identity shortcut: a
    replica whose key equals a primary's key holds the same boxes. copies: name ->
    [(rank, boxes tuple)] of pieces marked as copies; each box must be a primary piece's."""
    excluded = set(excluded)
    copies = copies or {}
    tiled: set = set()
    # in a fixed order (not a set's): the first problem named is the same in every process
    for name in dict.fromkeys(chain(prim, reps, copies)):
        if name not in shapes:
            r = (prim.get(name) or reps.get(name) or copies.get(name))[0][0]
            raise err("tensor is not in the checkpoint", tensor=name, rank=r)
        if name in excluded:
            r = (prim.get(name) or reps.get(name) or copies.get(name))[0][0]
            raise err("tensor is excluded from the plan but a rank holds it", tensor=name, rank=r)
    for name, shape in shapes.items():
        ps = prim.get(name)
        if not ps:
            if name in excluded:
                continue
            rs = reps.get(name) or copies.get(name)
            if rs:
                raise err(f"only replicas of this tensor are held (no primary copy, shape "
                          f"{list(shape)})", tensor=name, rank=rs[0][0])
            raise err(f"no rank holds this tensor (shape {list(shape)}) and it is not excluded",
                      tensor=name)
        # a tiling depends on the shape and the boxes only, and the planner shares boxes
        # objects across same-shaped tensors: each distinct tiling is proved once (the
        # boxes stay alive in ``prim`` meanwhile, so their ids are stable)
        mk = (shape, id(ps[0][1])) if len(ps) == 1 else (shape,) + tuple([id(p[1]) for p in ps])
        if mk not in tiled:
            if len(ps) == 1:
                flat = ps[0][1]
                owner = None
            else:
                flat, owner = [], []
                for r, bx, _ in ps:
                    flat.extend(bx)
                    owner.extend([r] * len(bx))
            prob = tiling_problem(flat, shape)
            if prob is not None:
                kind, i, j, detail = prob
                ri = None if i is None else (ps[0][0] if owner is None else owner[i])
                if kind == "overlap":
                    rj = ps[0][0] if owner is None else owner[j]
                    raise err(f"duplicated primary: {detail} (ranks {ri} and {rj}; tensor shape "
                              f"{list(shape)})", tensor=name, rank=rj)
                if kind == "outside":
                    raise err(f"piece outside the tensor: {detail}", tensor=name, rank=ri)
                raise err(f"missing piece: {detail} (tensor shape {list(shape)}; held by "
                          f"{format_ranks(p[0] for p in ps)})", tensor=name)
            tiled.add(mk)
        rs = reps.get(name)
        if rs:
            keys = {p[2] for p in ps}
            sets = None
            for r, bx, k in rs:
                if k in keys:
                    continue
                if sets is None:
                    sets = {tuple(p[1]) for p in ps}
                if tuple(bx) not in sets:
                    raise err(f"replica that equals no primary: boxes {[list(map(list, b)) for b in bx]}",
                              tensor=name, rank=r)
        cs = copies.get(name)
        if cs:
            # the primaries tile the tensor once: a copy equal to one of their boxes
            # holds exactly one primary piece's elements
            boxes = {b for p in ps for b in p[1]}
            for r, bx in cs:
                for b in bx:
                    if b not in boxes:
                        raise err(f"piece marked as a copy equals no primary piece: box "
                                  f"{[list(x) for x in b]}", tensor=name, rank=r)


def check_cover(views: Iterable, shapes: Mapping[str, Sequence[int]], *, excluded: Iterable[str] = (),
                error: type = PlanError) -> None:
    """Validate gathered per-rank views: ``views`` = [(rank, [(name, pieces, replica), ...])]
    with pieces as Piece objects (a copy piece, ``Piece.copy``, is checked as a replica of
    one primary piece) or source boxes ([[start, stop], ...]); ``shapes`` = the
    checkpoint's {name: shape}. Raises ``error`` (PlanError by default; the verifier may
    pass VerifyError) naming the rank and tensor: missing piece, duplicated primary,
    replica that equals no primary, piece outside the tensor, unknown tensor."""
    prim: dict[str, list] = {}
    reps: dict[str, list] = {}
    copies: dict[str, list] = {}
    for rank, entries in views:
        for name, pieces, replica in entries:
            # (a box given as a list has a ``copy`` method: only a Piece says it is one)
            bx = tuple(_as_box(p) for p in pieces if not (type(p) is Piece and p.copy))
            cp = tuple(_as_box(p) for p in pieces if type(p) is Piece and p.copy)
            (prim if replica == 0 else reps).setdefault(name, []).append((rank, bx, (rank, name)))
            if cp:
                copies.setdefault(name, []).append((rank, cp))
    _core(prim, reps, {k: tuple(v) for k, v in shapes.items()}, excluded, error, copies)


def validate_cover(plan, meta) -> None:
    """Raise PlanError unless ``plan`` covers ``meta`` exactly (see module doc)."""
    with gc_paused():   # many small tuples, all kept until the end: avoid repeated GC scans
        _validate_cover(plan, meta)


def _validate_cover(plan, meta) -> None:
    tensors = meta.tensors
    prim: dict[str, list] = {}
    reps: dict[str, list] = {}
    copies = _Copies({}, set(), {})
    checked: set = set()
    ranges: dict[str, dict] = {}
    pieces_ok: dict = {}
    members: dict = {}   # id(SharedSlices) -> (share, its ranks in this plan)
    done: set = set()    # ids of shared slices already checked
    for rp in plan.ranks:
        r = rp.rank
        sh = share_of(rp)
        if sh is not None:   # a rank class: checked once below, not once per member
            members.setdefault(id(sh), (sh, []))[1].append(r)
            continue
        for s in rp.tensors:
            key = (id(s.pieces), id(s.byte_runs), s.local_shape, s.name)
            if key not in checked:
                _check_slice(s, tensors, ranges, r, pieces_ok)
                checked.add(key)
            _add_copies(s, r, copies)
            if s.replica == 0:
                prim.setdefault(s.name, []).append((r, primary_boxes(s.pieces), id(s.pieces)))
            else:
                reps.setdefault(s.name, []).append((r, s, id(s.pieces)))
    store = _store_of(members) if not prim and not reps else None
    # each rank class's sids as an array, once for both the column proof and the rest
    arrays = ({k: np.array(sh.slices.sids, dtype=np.intp) for k, (sh, _) in members.items()}
              if store else {})
    proved = _proved_by_columns(store, members, arrays, meta, plan.excluded) if store else None
    for k, (sh, ranks) in members.items():
        if proved is not None:   # the slices of the tensors left, as objects
            keep = (~proved.sids[arrays[k]]).tolist()
            sh = SharedSlices(tuple(map(store.slice, compress(sh.slices.sids, keep))),
                              tuple(compress(sh.tables, keep)), sh.replicas, sh.ranks)
        _share_entries(sh, ranks, tensors, ranges, pieces_ok, prim, reps, done, copies)
    # replicas whose pieces object is not shared with a primary need their boxes (the
    # others are matched by key and their slot is never read)
    for name, rs in reps.items():
        keys = {p[2] for p in prim.get(name, ())}
        for i, (r, s, k) in enumerate(rs):
            if k not in keys:
                rs[i] = (r, primary_boxes(s.pieces), ("rank", r))
    # in the checkpoint's order, as without the columns: the first problem found is the same
    shapes = ({n: t.shape for n, t in tensors.items()} if proved is None else
              {n: tensors[n].shape for n in compress(proved.table.names, (~proved.tensors).tolist())})
    _core(prim, reps, shapes, plan.excluded, PlanError, copies.of_name)


def _store_of(members) -> SliceStore | None:
    """The SliceStore every rank class's slices are columns of, or None."""
    store = None
    for sh, _ in members.values():
        sl = sh.slices
        if type(sl) is not SliceColumns or (store is not None and sl.store is not store):
            return None
        store = sl.store
    return store


class _Proved(NamedTuple):
    """What ``_proved_by_columns`` proved: per sid of the store, and per row of the
    checkpoint's table (its tensor is covered)."""
    sids: np.ndarray
    tensors: np.ndarray
    table: TensorTable


def _proved_by_columns(store: SliceStore, members, arrays, meta, excluded) -> _Proved | None:
    """The slices and tensors whose cover is proved on the store's columns and the
    checkpoint's table (``TensorTable``), without an object: each tensor held whole by
    one primary (one rank; replicas only in its own class), stored as one whole piece,
    as one run over exactly its bytes. Their slices pass every check ``_check_slice``
    makes, and one whole box tiles a tensor. Any other slice, and every other tensor, is
    left to the checks on slice objects (which name the problem). None when the plan is
    not one the planner built (a slice no rank holds, a column value that is no integer),
    or the metadata has no table. ``arrays``: per rank class (keyed as ``members``), its
    sids as an array."""
    n = len(store)
    held = np.zeros(n, dtype=bool)
    for sids in arrays.values():
        held[sids] = True
    if not held.all():
        return None
    try:
        table = meta.table()
        rows = len(table.names)
        if not rows:
            return None
        got = _slices_proved(store, table, meta.files)
    except (CheckpointError, TypeError, ValueError, OverflowError):
        # records the table cannot hold, or columns of no integers: the object checks
        # name the problem
        return None
    if got is None:
        return None
    ok, row = got
    # per tensor (row): primary slices held, over every class; held as a replica in a
    # class without the primary
    primaries = np.zeros(rows, dtype=np.int64)
    others = np.zeros(rows, dtype=bool)
    for key, (sh, ranks) in members.items():
        try:
            zero = _zero_members(sh, ranks)
        except PlanError:   # raised by the object checks, in their order
            return None
        one = np.array([k for k, z in zero.items() if len(z[0]) == 1], dtype=np.int64)
        sids = arrays[key]
        single = np.isin(np.array(sh.tables, dtype=np.int64), one)
        r1 = row[sids[single]]
        np.add.at(primaries, r1[r1 >= 0], 1)
        r2 = row[sids[~single]]
        others[r2[r2 >= 0]] = True
    good = np.zeros(rows, dtype=bool)
    good[row[ok]] = True
    # a tensor of one proved slice and no other
    slices = np.bincount(row[row >= 0], minlength=rows)
    good &= (primaries == 1) & ~others & (slices == 1)
    if excluded:
        gone = set(excluded)
        good &= ~np.fromiter(map(gone.__contains__, table.names), dtype=bool, count=rows)
    ok &= good[np.where(ok, row, 0)]
    return _Proved(ok, good, table)


def _slices_proved(store: SliceStore, table: TensorTable, files) -> tuple | None:
    """(per sid: a whole tensor's one run, checked against the table; per sid: its
    tensor's table row, -1 for a name the checkpoint lacks), or None for a form index out
    of range. A value that is no integer (or does not fit 64 bits) raises: the caller then
    proves nothing."""
    n, forms = len(store), store.forms
    form = _ints(store.form, n)
    if n and not (0 <= form.min() and form.max() < len(forms)):
        return None
    # per form: its tensors' shape and dtype ids in the table, and their bytes (-1: a form
    # that does not hold its tensor whole in one primary piece)
    shape_of = dict(zip(table.shapes, range(len(table.shapes))))
    dtype_of = dict(zip(table.dtypes, range(len(table.dtypes))))
    f_shape = np.array([shape_of.get(f.global_shape, -1) for f in forms], dtype=np.int64)
    f_dtype = np.array([dtype_of.get(f.dtype, -1) for f in forms], dtype=np.int64)
    nbytes = [prod(f.global_shape) * b if b else -1 for f, b in zip(forms, map(_whole_form, forms))]
    f_bytes = np.array([b if b < 2 ** 63 else -1 for b in nbytes], dtype=np.int64)
    # each sid's row: the one it names if that row holds its tensor's name, else found by
    # name (-1: a name the checkpoint lacks)
    rows = len(table.names)
    row = _ints(store.tensor, n)
    bad = (row < 0) | (row >= rows)
    same = np.fromiter(map(eq, map(table.names.__getitem__, np.where(bad, 0, row).tolist()),
                           store.names), dtype=bool, count=n)
    same &= ~bad
    if not same.all():
        by_name = dict(zip(table.names, range(rows)))
        for i in np.flatnonzero(~same).tolist():
            row[i] = by_name.get(store.names[i], -1)
    ok = (same & np.fromiter(map(is_, store.runs, repeat(None)), dtype=bool, count=n)
          & (f_bytes[form] > 0))
    at = np.flatnonzero(ok)
    r, f = row[at], form[at]
    index = dict(zip((fi.name for fi in files), range(len(files))))
    file = np.fromiter(map(index.get, store.files, repeat(-1)), dtype=np.int64, count=n)
    length = f_bytes[f]
    # the table's start <= end < 2**63 (its records are checked): no sum that could wrap
    ok[at] = ((table.shape[r] == f_shape[f]) & (table.dtype[r] == f_dtype[f]) & table.whole[r]
              & (table.file[r] == file[at]) & (_ints(store.lengths, n)[at] == length)
              & (table.start[r] == _ints(store.starts, n)[at])
              & (table.end[r] - table.start[r] == length))
    return ok, row


def _ints(column, n: int) -> np.ndarray:
    """``column`` as int64; TypeError for a value that is no integer (bools count, as in
    the object checks), OverflowError for one that does not fit."""
    return np.fromiter(map(index, column), dtype=np.int64, count=n)


def _whole_form(f) -> int:
    """Bytes per element when form ``f`` holds its tensor whole in one primary piece
    (the pieces check passes and the box tiles the tensor), else 0."""
    if len(f.pieces) != 1 or f.local_shape != f.global_shape:
        return 0
    p = f.pieces[0]
    gs = f.global_shape
    if p.copy or p.src != full_box(gs) or p.dst != (0,) * len(gs):
        return 0
    if tiling_problem((p.src,), gs) is not None:
        return 0
    try:
        return itemsize(f.dtype)
    except CheckpointError:   # the object checks name the slice
        return 0


class _Copies(NamedTuple):
    """The copy pieces found so far: name -> [(rank, copy boxes)], recorded once per
    (tensor, pieces object); and id(pieces) -> their copy boxes (pieces objects are
    shared, and most hold none: one lookup per slice)."""
    of_name: dict
    recorded: set
    boxes_of: dict


def _add_copies(s, rank, cp: _Copies) -> None:
    """Record the copy pieces of slice ``s`` (held by ``rank``): every holder of its pieces
    object holds the same copies."""
    pcs = s.pieces
    boxes = cp.boxes_of.get(id(pcs))
    if boxes is None:
        boxes = cp.boxes_of[id(pcs)] = copy_boxes(pcs)
    if boxes:
        k = (s.name, id(pcs))
        if k not in cp.recorded:
            cp.recorded.add(k)
            cp.of_name.setdefault(s.name, []).append((rank, boxes))


def _share_entries(sh, ranks, tensors, ranges, pieces_ok, prim, reps, done,
                   copies: _Copies) -> None:
    """Add the primaries and replicas of a rank class (ranks sharing ``sh``) as the per-rank
    loop would, at the cost of one rank: each slice is checked once; per replica table,
    the members whose replica id is 0 hold the primaries, and one member with another id
    stands for the replicas (they share the primary's pieces, so one match proves all;
    none is needed when the class holds the primary itself)."""
    zero = _zero_members(sh, ranks)
    with_prims = {k for k, z in zero.items() if z[0]}
    if with_prims:
        boxes_of: dict = {}   # id(pieces) -> their source boxes (pieces objects are shared)
        # (compress: the slices of tables without primaries here are skipped in C)
        for s, k in compress(zip(sh.slices, sh.tables), map(with_prims.__contains__, sh.tables)):
            pcs = s.pieces
            boxes = boxes_of.get(id(pcs))
            if boxes is None:
                boxes = boxes_of[id(pcs)] = primary_boxes(pcs)
            lst = prim.get(s.name)
            if lst is None:
                lst = prim[s.name] = []
            for r in zero[k][0]:
                lst.append((r, boxes, id(pcs)))
    # a slice object shared by several rank classes (a tensor replicated on every rank) is
    # checked, and stands for its replicas, once: visit only the slices not seen yet
    fresh = set(map(id, sh.slices)) - done
    if not fresh:
        return
    done |= fresh
    for s, k in compress(zip(sh.slices, sh.tables), map(fresh.__contains__, map(id, sh.slices))):
        _check_slice(s, tensors, ranges, ranks[0], pieces_ok)
        _add_copies(s, ranks[0], copies)
        prims, others = zero[k]
        # replicas in a class that also holds the primary copy hold its very pieces: only
        # a class of replicas alone must be matched against the primaries of other classes
        if others and not prims:
            reps.setdefault(s.name, []).append((others[0], s, id(s.pieces)))


def _zero_members(sh, ranks) -> dict:
    """Per replica table of rank class ``sh`` (members ``ranks``): (the members holding
    replica 0, the other members); raises if a member holds none."""
    zero: dict = {}
    for k in set(sh.tables):
        rep = sh.replicas[k]
        held = [(r, rep[r]) for r in ranks]
        missing = [r for r, i in held if i < 0]
        if missing:
            s = sh.slices[sh.tables.index(k)]
            raise PlanError("rank class lists a slice its member does not hold",
                            tensor=s.name, rank=missing[0])
        zero[k] = ([r for r, i in held if i == 0], [r for r, i in held if i != 0])
    return zero


def _check_slice(s, tensors, ranges, rank, pieces_ok=None) -> None:
    t = tensors.get(s.name)
    if t is None:
        raise PlanError("tensor is not in the checkpoint", tensor=s.name, rank=rank)
    gs, ls = s.global_shape, s.local_shape
    if type(gs) is not tuple:
        gs = tuple(gs)
    if type(ls) is not tuple:
        ls = tuple(ls)
    if gs != t.shape or s.dtype != t.dtype:
        raise PlanError(f"slice says {s.dtype}{list(gs)}, checkpoint has "
                        f"{t.dtype}{list(t.shape)}", tensor=s.name, rank=rank)
    # the pieces checks depend on (pieces, local shape, global shape, dtype) only: the
    # planner shares one pieces tuple across same-shaped tensors (experts), so check it once
    pkey = (id(s.pieces), ls, t.shape, t.dtype)
    got = None if pieces_ok is None else pieces_ok.get(pkey)
    if got is None:
        isz = itemsize(t.dtype)
        got = (_check_pieces(s, t, ls, rank) * isz, prod(ls) * isz)
        if pieces_ok is not None:
            pieces_ok[pkey] = got
    covered_bytes, lbytes = got
    runs = s.byte_runs
    if type(runs) is RunList:
        total, groups = runs.total_bytes, runs.groups
    else:
        groups = groups_of(runs)
        total = sum(g[2] * g[4] for g in groups)
    if total != covered_bytes:
        raise PlanError(f"byte runs add up to {total} bytes, the pieces hold {covered_bytes}",
                        tensor=s.name, rank=rank)
    src = t.pieces
    if len(src) == 1:   # a plain checkpoint: one stored piece, no per-tensor span table
        sp = src[0]
        f0, a0, b0 = sp.file, sp.start, sp.end
        rg = None
    else:
        rg = ranges.get(s.name)
        if rg is None:
            rg = ranges[s.name] = _file_spans(src)
    for g in groups:
        f, o, ln, d, c, _, _ = g
        if c == 1:   # the common case, kept free of method calls: this runs per group
            lo, hi, dlo, dhi = o, o + ln, d, d + ln
        else:
            (lo, hi), (dlo, dhi) = g.src_span(), g.dst_span()
        if rg is None:
            if f != f0 or lo < a0 or hi > b0:
                raise PlanError(f"byte run {o}+{ln} in {f} lies outside the tensor's bytes "
                                f"[({a0}, {b0})] in {f0}", tensor=s.name, rank=rank)
        else:
            spans = rg.get(f, ())
            for a, b in spans:
                if a <= lo and hi <= b:
                    break
            else:
                raise PlanError(f"byte run {o}+{ln} in {f} lies outside the tensor's bytes "
                                f"{spans}", tensor=s.name, rank=rank)
        if dlo < 0 or dhi > lbytes:
            raise PlanError(f"byte run to dest {d}+{ln} lies outside the local tensor ({lbytes} "
                            f"bytes)", tensor=s.name, rank=rank)


def _file_spans(pieces) -> dict:
    """file -> the tensor's byte spans in it, pieces back to back joined: the planner
    merges a run across two stored pieces that lie back to back in a file (one read)."""
    by_file: dict = {}
    for sp in pieces:
        by_file.setdefault(sp.file, []).append((sp.start, sp.end))
    for f, spans in by_file.items():
        spans.sort()
        joined = [spans[0]]
        for a, b in spans[1:]:
            if a == joined[-1][1]:
                joined[-1] = (joined[-1][0], b)
            else:
                joined.append((a, b))
        by_file[f] = joined
    return by_file


def _check_pieces(s, t, ls, rank) -> int:
    """Pieces inside the tensor and the local shape, not overlapping locally; -> the
    number of elements they hold."""
    nd = len(t.shape)
    if len(ls) != nd:
        raise PlanError(f"local shape {list(ls)} has a different rank than {list(t.shape)}",
                        tensor=s.name, rank=rank)
    covered = 0
    for p in s.pieces:
        v = 1
        if len(p.src) != nd or len(p.dst) != nd:
            raise PlanError(f"piece {[list(x) for x in p.src]} -> {list(p.dst)} does not have "
                            f"{nd} dims", tensor=s.name, rank=rank)
        for (a, b), o, g, l in zip(p.src, p.dst, t.shape, ls):
            if not (0 <= a < b <= g or a == b == g == 0) or not (0 <= o and o + b - a <= l):
                raise PlanError(f"piece {[list(x) for x in p.src]} -> {list(p.dst)} lies outside the "
                                f"tensor {list(t.shape)} or the local shape {list(ls)}",
                                tensor=s.name, rank=rank)
            v *= b - a
        covered += v
    if len(s.pieces) > 1:
        dboxes = [tuple((o, o + b - a) for (a, b), o in zip(p.src, p.dst)) for p in s.pieces]
        prob = tiling_problem(dboxes, ls)
        if prob is not None and prob[0] != "gap":
            raise PlanError(f"pieces overlap in the local tensor: {prob[3]}", tensor=s.name, rank=rank)
    if covered > prod(ls):
        raise PlanError(f"pieces hold {covered} elements but the local shape {list(ls)} has "
                        f"{prod(ls)}", tensor=s.name, rank=rank)
    return covered
