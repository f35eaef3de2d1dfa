"""Exact-cover validation.

For every checkpoint tensor the primary pieces (replica 0, less the pieces marked as
copies: ``Piece.copy``) over all ranks must tile the tensor exactly once; every replica
must hold exactly the boxes of some primary (its copies aside), and the ranks holding one
primary's boxes hold them as replicas 0, 1, ..., n-1, one rank each (``replica_problems``:
so where every primary has n holders, each replica id tiles the tensor once, as replica 0
does); every copy piece must equal a primary piece; every tensor is held unless excluded
on purpose. For a plan we
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
box match. The replica ids are checked once per pattern of holdings (pieces objects and a
rank class's ids per replica table), and the patterns repeat across layers.
"""
from __future__ import annotations

from itertools import chain, compress, repeat
from math import prod
from operator import eq, index, is_, itemgetter
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.metadata import TensorTable, box_numel, full_box
from coordloader.checkpoint.tiling import fmt_box, tiling_problem
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
from coordloader.text import first_items, format_ranks

Box = tuple


def _as_box(p) -> Box:
    src = getattr(p, "src", p)
    return tuple((int(a), int(b)) for a, b in src)


def _core(prim: Mapping[str, list], held: Mapping[str, list], shapes: Mapping[str, Sequence[int]],
          excluded: Iterable[str], err, copies: Mapping[str, list] | None = None,
          boxes_of=None) -> None:
    """prim: name -> [(rank, boxes tuple, key)] of the primaries. held: name -> [(ranks,
    ids, key, src)], every holding of the tensor, the primaries' among them: ``ranks`` hold
    the same boxes, ``ids[i]`` the replica id on ``ranks[i]``; ``key`` an identity
    shortcut (a holding whose key equals a primary's key holds its boxes), ``src`` its
    boxes, or what ``boxes_of`` turns into them. copies: name -> [(rank, boxes tuple)] of
    pieces marked as copies; each box must be a primary piece's."""
    excluded = set(excluded)
    copies = copies or {}
    tiled: set = set()
    replicas_ok: set = set()   # (held alive by ``prim`` and ``held``: their ids are stable)

    def some_rank(name):
        if name in prim:
            return prim[name][0][0]
        if name in held:
            return held[name][0][0][0]
        return copies[name][0][0]

    # in a fixed order (not a set's): the first problem named is the same in every process
    for name in dict.fromkeys(chain(prim, held, copies)):
        if name not in shapes:
            raise err("tensor is not in the checkpoint", tensor=name, rank=some_rank(name))
        if name in excluded:
            raise err("tensor is excluded from the plan but a rank holds it", tensor=name,
                      rank=some_rank(name))
    for name, shape in shapes.items():
        ps = prim.get(name)
        if not ps:
            if name in excluded:
                continue
            if name in held or name in copies:
                raise err(f"only replicas of this tensor are held (no primary copy, shape "
                          f"{list(shape)})", tensor=name, rank=some_rank(name))
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
        hs = held.get(name)
        if hs:
            # the verdict depends on the holdings' keys and ids only (the primaries are the
            # holdings' members with id 0, in the same order), and the planner shares both
            # across the layers of a family (pieces objects; one ids tuple per rank class
            # and replica table): each distinct pattern is checked once
            sig = (tuple(map(_key, hs)), tuple(map(id, map(_ids, hs))))
            if sig not in replicas_ok:
                _check_replicas(name, ps, hs, boxes_of, err)
                replicas_ok.add(sig)
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


_key = itemgetter(2)
_ids = itemgetter(1)


def numbered(ids: Sequence) -> bool:
    """Whether ``ids`` are the integers 0, 1, ..., n-1 in some order (the replica ids the
    holders of one primary's boxes must have)."""
    try:
        return sorted(ids) == list(range(len(ids)))
    except TypeError:   # an id that is no integer: replica_problems names it
        return False


def _check_replicas(name, ps, hs, boxes_of, err) -> None:
    """Every holding of a tensor (``hs``, as ``_core`` takes them) holds some primary's
    boxes, and each primary's boxes are held as replicas 0..n-1, one rank each."""
    keys: dict = {}
    for i, p in enumerate(ps):
        keys.setdefault(p[2], i)
    sets = None
    ids_of: dict = {}   # primary's index -> the ids tuples of its holdings
    for u in hs:
        g = keys.get(u[2])
        if g is None:
            if sets is None:
                sets = {}
                for i, p in enumerate(ps):
                    sets.setdefault(tuple(p[1]), i)
            bx = u[3] if boxes_of is None else boxes_of(u[3])
            g = sets.get(tuple(bx))
            if g is None:
                raise err(f"replica that equals no primary: boxes {[list(map(list, b)) for b in bx]}",
                          tensor=name, rank=u[0][0])
        lst = ids_of.get(g)
        if lst is None:
            ids_of[g] = [u[1]]
        else:
            lst.append(u[1])
    if all(numbered(lst[0] if len(lst) == 1 else tuple(chain.from_iterable(lst)))
           for lst in ids_of.values()):
        return
    # a problem: group every holding by its primary again, with ranks, to name it
    groups: list = [(tuple(p[1]), []) for p in ps]
    for u in hs:
        g = keys.get(u[2])
        if g is None:
            g = sets[tuple(u[3] if boxes_of is None else boxes_of(u[3]))]
        groups[g][1].append((u[0], u[1]))
    probs = replica_problems(groups)
    if probs:
        msg, rank = probs[0]
        raise err(msg, tensor=name, rank=rank)


_ONE_IDS: dict = {}


def _one_id(replica) -> tuple:
    """(replica,), one tuple object per id: the replica check's patterns repeat across a
    plan's tensors (``_core`` keys them by the ids tuples' identity)."""
    try:
        t = _ONE_IDS.get(replica)
    except TypeError:   # unhashable: no integer, which the replica check names
        return (replica,)
    if t is None:
        t = (replica,)
        if len(_ONE_IDS) < 4096:
            _ONE_IDS[replica] = t
    return t


def replica_problems(groups: Sequence[tuple[tuple, Sequence]]) -> list[tuple[str, int]]:
    """The replica rule of one tensor, shared by the plan's cover and the verifier's: the
    ranks holding one primary's boxes hold them as replicas 0, 1, ..., n-1, one rank each
    (so no rank stands in for another's part under a replica id another rank holds, and
    where every primary has n holders each replica id tiles the tensor once; a redundant
    expert set or an empty uneven chunk has more holders than the rest). ``groups``: per
    primary, (its boxes, [(ranks, ids)] of every holding of them, the primary's among
    them; ``ids[i]`` the replica id on ``ranks[i]``). A primary that holds no element is
    left alone. -> (message, the rank to name) per primary that breaks the rule."""
    held_as = []   # per group: replica id -> the ranks holding it
    for _, units in groups:
        by: dict = {}
        for ranks, ids in units:
            for r, k in zip(ranks, ids):
                if type(k) is not int:
                    try:
                        k = index(k)
                    except TypeError:
                        return [(f"replica id {k!r} on rank {r} is not an integer", r)]
                by.setdefault(k, []).append(r)
        held_as.append(by)
    out = []
    for (bx, _), by in zip(groups, held_as):
        n = sum(map(len, by.values()))
        if len(by) == n and all(0 <= k < n for k in by):
            continue
        if not any(box_numel(b) for b in bx):
            continue
        what = " + ".join(map(fmt_box, bx))
        twice = sorted(k for k, rs in by.items() if len(rs) > 1)
        if twice:
            k = twice[0]
            rs = sorted(by[k])
            lack = [" + ".join(map(fmt_box, b2)) for (b2, _), by2 in zip(groups, held_as)
                    if k not in by2 and any(box_numel(b) for b in b2)]
            who = f"ranks {rs[0]} and {rs[1]}" if len(rs) == 2 else format_ranks(rs)
            out.append((f"replica {k} holds {what} twice ({who})"
                        + (f" and misses {first_items(lack, 4)} (no rank holds it as replica "
                           f"{k})" if lack else "")
                        + ": each replica of a primary's pieces is held by one rank", rs[1]))
        else:
            ks = sorted(by)
            lost = sorted(set(range(n)) - set(ks))
            rs = sorted(r for v in by.values() for r in v)
            odd = [k for k in ks if not 0 <= k < n] or ks[-1:]
            out.append((f"{what} is held as replicas {first_items([str(k) for k in ks], 8)} "
                        f"({format_ranks(rs)}) but by no rank as replica {lost[0]}: the "
                        f"replicas of a primary's pieces are numbered 1, 2, ... in turn",
                        by[odd[0]][0]))
    return out


def check_cover(views: Iterable, shapes: Mapping[str, Sequence[int]], *, excluded: Iterable[str] = (),
                error: type = PlanError) -> None:
    """Validate gathered per-rank views: ``views`` = [(rank, [(name, pieces, replica), ...])]
    with pieces as Piece objects (a copy piece, ``Piece.copy``, is checked as a replica of
    one primary piece) or source boxes ([[start, stop], ...]); ``shapes`` = the
    checkpoint's {name: shape}. Raises ``error`` (PlanError by default; the verifier may
    pass VerifyError) naming the rank and tensor: missing piece, duplicated primary,
    replica that equals no primary, replica id held twice or skipped, piece outside the
    tensor, unknown tensor."""
    prim: dict[str, list] = {}
    held: dict[str, list] = {}
    copies: dict[str, list] = {}
    for rank, entries in views:
        for name, pieces, replica in entries:
            # (a box given as a list has a ``copy`` method: only a Piece says it is one)
            bx = tuple(_as_box(p) for p in pieces if not (type(p) is Piece and p.copy))
            cp = tuple(_as_box(p) for p in pieces if type(p) is Piece and p.copy)
            if replica == 0:
                prim.setdefault(name, []).append((rank, bx, (rank, name)))
            held.setdefault(name, []).append(((rank,), _one_id(replica), (rank, name), bx))
            if cp:
                copies.setdefault(name, []).append((rank, cp))
    _core(prim, held, {k: tuple(v) for k, v in shapes.items()}, excluded, error, copies)


def validate_cover(plan, meta) -> None:
    """Raise PlanError unless ``plan`` covers ``meta`` exactly (see module doc)."""
    with gc_paused():   # many small tuples, all kept until the end: avoid repeated GC scans
        _validate_cover(plan, meta)


def _validate_cover(plan, meta) -> None:
    tensors = meta.tensors
    prim: dict[str, list] = {}
    held: dict[str, list] = {}
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
            held.setdefault(s.name, []).append(((r,), _one_id(s.replica), id(s.pieces), s))
    store = _store_of(members) if not prim and not held else None
    # each rank class's sids as an array, once for both the column proof and the rest
    arrays = ({k: np.array(sh.slices.sids, dtype=np.intp) for k, (sh, _) in members.items()}
              if store else {})
    proved = _proved_by_columns(store, members, arrays, meta, plan.excluded) if store else None
    # per table row: the tensor's replica ids proved on the columns (its holdings need not
    # be listed one by one)
    left = {k: ~proved.sids[a] for k, a in arrays.items()} if proved is not None else {}
    ids_ok = _replicas_by_columns(members, arrays, left, proved) if proved is not None else None
    all_ok = ids_ok is not None and bool(ids_ok.all())
    for k, (sh, ranks) in members.items():
        need = None
        if proved is not None:   # the slices of the tensors left, as objects
            sel = left[k]
            keep = sel.tolist()
            sh = SharedSlices(tuple(map(store.slice, compress(sh.slices.sids, keep))),
                              tuple(compress(sh.tables, keep)), sh.replicas, sh.ranks)
            if all_ok:
                need = ()
            else:
                r = proved.row[arrays[k][sel]]
                need = ((r < 0) | ~ids_ok[np.where(r < 0, 0, r)]).tolist()
        _share_entries(sh, ranks, tensors, ranges, pieces_ok, prim, held, done, copies, need,
                       None if proved is None else proved.zeros[k])
    # in the checkpoint's order, as without the columns: the first problem found is the same
    shapes = ({n: t.shape for n, t in tensors.items()} if proved is None else
              {n: tensors[n].shape for n in compress(proved.table.names, (~proved.tensors).tolist())})
    _core(prim, held, shapes, plan.excluded, PlanError, copies.of_name, _slice_boxes)


def _slice_boxes(s) -> tuple:
    return primary_boxes(s.pieces)


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
    row: np.ndarray   # per sid: its tensor's row (-1: a name the checkpoint lacks)
    zeros: dict       # per rank class (keyed as ``members``): ``_zero_members``
    tables: dict      # per rank class: its slices' replica tables as an array


def _proved_by_columns(store: SliceStore, members, arrays, meta, excluded) -> _Proved | None:
    """The slices and tensors whose cover is proved on the store's columns and the
    checkpoint's table (``TensorTable``), without an object: each tensor held whole by
    one rank class alone, its members holding replicas 0, 1, ..., n-1 of it, one each
    (one primary, and the replica rule holds), stored as one whole piece,
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
    # per tensor (row): slices held by a class whose members hold replicas 0..n-1 of
    # them, over every class; held by any other class
    primaries = np.zeros(rows, dtype=np.int64)
    others = np.zeros(rows, dtype=bool)
    zeros, tables = {}, {}
    for key, (sh, ranks) in members.items():
        try:
            zero = zeros[key] = _zero_members(sh, ranks)
        except PlanError:   # raised by the object checks, in their order
            return None
        tables[key] = np.array(sh.tables, dtype=np.int64)
        # a table whose members hold replicas 0..n-1, one each: its tensors' replicas
        # are proved with it (one class holds them, see below)
        one = np.array([k for k, z in zero.items() if numbered(z[2])], dtype=np.int64)
        sids = arrays[key]
        single = np.isin(tables[key], one)
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
    return _Proved(ok, good, table, row, zeros, tables)


def _replicas_by_columns(members, arrays, left, proved: _Proved) -> np.ndarray:
    """Per row of the checkpoint's table: True where the replica rule holds for the
    tensor's slices left to the object checks, proved on the sids: each such slice is
    listed by rank classes whose members hold replicas 0, 1, ..., n-1 of it (from its
    replica table, the same in every class listing it), one member each. Distinct slices
    of a tensor are distinct primaries (the tiling proves their boxes apart), so the rule
    holds for the tensor. The rest (False) is checked holding by holding in ``_core``,
    which names the problem. A tensor replicated on 1024 ranks in 256 classes costs a
    few array operations here, not 256 holdings: the distinct (classes, table) patterns
    are checked once each. ``left``: per rank class, which of its sids are not proved."""
    keys = list(members)
    n = len(proved.sids)
    rows = len(proved.tensors)
    words = (len(keys) + 63) // 64
    held_by = np.zeros((n, words), dtype=np.uint64)   # per sid: a bit per class listing it
    listed, tables = [], []
    for j, key in enumerate(keys):
        sel = left[key]
        a = arrays[key][sel]
        held_by[a, j >> 6] |= np.uint64(1 << (j & 63))
        listed.append(a)
        tables.append(proved.tables[key][sel])
    ok = np.ones(rows, dtype=bool)
    if not listed:
        return ok
    a = np.concatenate(listed)
    if not len(a):
        return ok
    t = np.concatenate(tables).astype(np.float64)
    count = np.bincount(a, minlength=n)
    at = np.flatnonzero(count)
    cnt = count[at]
    # one table per sid over its listings (sums of small integers: exact in float64)
    s1 = np.bincount(a, weights=t, minlength=n)[at]
    s2 = np.bincount(a, weights=t * t, minlength=n)[at]
    one_table = s2 * cnt == s1 * s1
    table = np.where(one_table, s1 // np.maximum(cnt, 1), -1).astype(np.int64)
    pattern = np.column_stack([held_by[at], table.astype(np.uint64)])
    uniq, inv = np.unique(pattern, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    good = np.zeros(len(uniq), dtype=bool)
    classes = np.zeros(len(uniq), dtype=np.int64)
    for u, pat in enumerate(uniq.tolist()):
        k = pat[-1]
        ids: list = []
        m = 0
        for w, bits in enumerate(pat[:-1]):
            while bits:
                low = bits & -bits
                z = proved.zeros[keys[(w << 6) + low.bit_length() - 1]].get(k)
                if z is None:   # (no table: ``k`` is the -1 of listings that disagree)
                    ids = [-1]
                    break
                ids.extend(z[2])
                m += 1
                bits ^= low
        classes[u] = m
        good[u] = numbered(ids)
    # a class listing a sid twice lists it once in ``held_by``: the counts must agree
    fine = good[inv] & one_table & (classes[inv] == cnt)
    r = proved.row[at[~fine]]
    ok[r[r >= 0]] = False
    return ok


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


def _share_entries(sh, ranks, tensors, ranges, pieces_ok, prim, held, done,
                   copies: _Copies, need=None, zero=None) -> None:
    """Add the primaries and holdings of a rank class (ranks sharing ``sh``) as the
    per-rank loop would, at the cost of one rank: each slice is checked once, and is one
    holding of the class's members, with their replica ids from its table (``need``: per
    slice, False where its tensor's replica ids are proved already and no holding is
    listed); the members whose replica id is 0 hold the primaries. ``zero``:
    ``_zero_members`` of the class, when known."""
    if zero is None:
        zero = _zero_members(sh, ranks)
    ranks = tuple(ranks)
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
    for s, k in (zip(sh.slices, sh.tables) if need is None else
                 compress(zip(sh.slices, sh.tables), need) if need else ()):
        lst = held.get(s.name)
        if lst is None:
            held[s.name] = [(ranks, zero[k][2], id(s.pieces), s)]
        else:
            lst.append((ranks, zero[k][2], id(s.pieces), s))
    # a slice object shared by several rank classes (a tensor replicated on every rank) is
    # checked once: visit only the slices not seen yet
    fresh = set(map(id, sh.slices)) - done
    if not fresh:
        return
    done |= fresh
    for s in compress(sh.slices, map(fresh.__contains__, map(id, sh.slices))):
        _check_slice(s, tensors, ranges, ranks[0], pieces_ok)
        _add_copies(s, ranks[0], copies)


def _zero_members(sh, ranks) -> dict:
    """Per replica table of rank class ``sh`` (members ``ranks``): (the members holding
    replica 0, the other members, every member's replica id); raises if a member holds
    none."""
    zero: dict = {}
    for k in set(sh.tables):
        rep = sh.replicas[k]
        ids = tuple([rep[r] for r in ranks])
        missing = [r for r, i in zip(ranks, ids) if i < 0]
        if missing:
            s = sh.slices[sh.tables.index(k)]
            raise PlanError("rank class lists a slice its member does not hold",
                            tensor=s.name, rank=missing[0])
        zero[k] = ([r for r, i in zip(ranks, ids) if i == 0],
                   [r for r, i in zip(ranks, ids) if i != 0], ids)
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
