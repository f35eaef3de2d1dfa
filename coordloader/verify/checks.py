"""Prove that each rank's tensor set matches its slice of the checkpoint.

Modes (each includes the ones before it):

* ``shapes`` — local: loaded names equal the plan's names exactly, each dtype and local
  shape matches, padding (local regions no piece covers, e.g. vocab padding rows) is zero.
  Global: ranks all-gather a compact view (names, piece boxes, replica ids and copy
  pieces — no data) and every rank checks the exact cover on it: primary pieces tile each
  tensor once, every replica piece (a piece of a replica slice, or a piece the plan marks
  as a copy: ``Piece.copy``) equals a primary piece, a replica slice holds one primary's
  pieces and the ranks holding them hold replicas 0, 1, ..., n-1 of them, one rank each
  (as the plan's cover: ``planning.cover.replica_problems``), no checkpoint tensor is held
  by nobody.
* ``digest`` — each rank digests its pieces (``coordloader.digest``, on the tensors' own
  device); per tensor the primary digests must sum to the manifest's digest and each
  replica's digest must equal its primary's. Without a manifest only the replica check
  is possible, and the report says so.
* ``full`` — additionally re-reads every piece through the HF ``safetensors`` library and
  compares bytes (slow, thorough; names the first differing element).

Collective discipline: local work never raises (problems become findings), then *one*
``all_gather_object`` carries every rank's view, findings and digests; every rank
evaluates the same gathered data with the same pure function, so all ranks reach the same
verdict and every rank raises ``VerifyError`` with the same report.
"""
from __future__ import annotations

import hashlib
import numbers
import os
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from math import prod
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import torch

from coordloader.checkpoint.dtypes import from_torch, itemsize, torch_dtype
from coordloader.checkpoint.metadata import Box, box_numel, box_shape, full_box
from coordloader.checkpoint.tiling import fmt_box, tiling_problem
from coordloader.dist.collective import options_disagreement
from coordloader.engines import (
    fd_path,
    intersect,
    narrow_box,
    on_host_default_device,
    open_checked,
    refuse_replaced,
)
from coordloader.errors import (
    CollectiveError,
    ConfigError,
    CoordloaderError,
    PlanError,
    VerifyError,
)
from coordloader.layout import as_rank
from coordloader.planning.cover import numbered, replica_problems, validate_cover
from coordloader.text import MAX_NAME_CHARS, clip, first_items, format_ranks
from coordloader.verify.digest import (
    Route,
    combine,
    digest,
    digest_many,
    fmt,
    int_view,
    iter_subboxes,
    piece_view,
)
from coordloader.verify.manifest import Manifest, load_manifest


class VerifyMode(str, Enum):
    """How much is checked; each mode includes the ones before it."""
    NONE = "none"
    SHAPES = "shapes"
    DIGEST = "digest"
    FULL = "full"

    @property
    def level(self) -> int:
        return _ORDER.index(self)


_ORDER = list(VerifyMode)
MODES = tuple(m.value for m in VerifyMode)
FULL_CHUNK_BYTES = 64 << 20
MAX_FINDINGS_PER_RANK = 200     # keep the gathered payload small when everything is wrong


# --------------------------------------------------------------------------- boxes

def box_subtract(box: Box, cut: Box) -> list[Box]:
    """``box`` minus ``cut`` as disjoint boxes (at most 2 per dim)."""
    if intersect(box, cut) is None:
        return [box]
    out = []
    rest = list(box)
    for d, ((a, b), (c0, c1)) in enumerate(zip(box, cut)):
        if a < c0:
            out.append(tuple(rest[:d]) + ((a, c0),) + tuple(rest[d + 1:]))
        if c1 < b:
            out.append(tuple(rest[:d]) + ((c1, b),) + tuple(rest[d + 1:]))
        rest[d] = (max(a, c0), min(b, c1))
    return [o for o in out if box_numel(o) > 0]


def uncovered(whole: Box, pieces: Iterable[Box], limit: int = 4096) -> list[Box] | None:
    """Regions of ``whole`` no piece covers; None if tracking them grows past ``limit``."""
    left = [whole]
    for p in pieces:
        nxt = []
        for b in left:
            nxt.extend(box_subtract(b, p))
        left = nxt
        if len(left) > limit:
            return None
    return left


def cover_problems(name: str, shape: tuple[int, ...], primaries: Sequence[tuple[int, Box]],
                   replicas: Sequence[tuple[int, Box]],
                   slices: Sequence[tuple[int, tuple[Box, ...], int]] = ()) -> list[str]:
    """Exact-cover problems of one tensor, given (rank, box) of its primary and replica
    pieces over all ranks, and (rank, its non-copy boxes, replica id) of every rank's slice
    of it. The tiling test is the one every stage uses (``tiling_problem``: sort/sweep,
    n log n for a valid tiling), and the replica rule the plan's cover's
    (``planning.cover.replica_problems``: the ranks holding one primary's boxes hold them
    as replicas 0, 1, ..., n-1, one rank each); this adds rank names, the uncovered regions
    of a gap, and a per-piece replica check."""
    shape = tuple(shape)
    boxes = [tuple(tuple(x) for x in b) for _, b in primaries]
    problems = []
    prob = tiling_problem(boxes, shape)
    if prob is not None:
        kind, i, j, detail = prob
        if kind == "outside":
            problems.append(f"rank {primaries[i][0]} holds primary piece {fmt_box(boxes[i])} outside "
                            f"the tensor's shape {list(shape)}")
        elif kind == "overlap":
            problems.append(f"primary pieces overlap: rank {primaries[i][0]} {fmt_box(boxes[i])} and "
                            f"rank {primaries[j][0]} {fmt_box(boxes[j])} (a region loaded twice as "
                            f"primary)")
        else:
            total = sum(box_numel(b) for b in boxes)
            gaps = uncovered(full_box(shape), boxes) if shape else None
            where = first_items([fmt_box(g) for g in gaps], 4) if gaps else ""
            problems.append(f"primary pieces cover {total} of {prod(shape)} elements"
                            + (f"; held by no rank: {where}" if where else ""))
    pboxes = set(boxes)
    stray = set()
    for r, b in replicas:
        b = tuple(tuple(x) for x in b)
        if b not in pboxes:
            stray.add(r)
            problems.append(f"rank {r} holds replica piece {fmt_box(b)} that matches no "
                            f"primary piece")
    if prob is None and slices and (len(slices) > 1 or slices[0][2] != 0):
        problems.extend(_replica_findings(slices, stray))
    return problems


def _replica_findings(slices: Sequence[tuple[int, tuple[Box, ...], int]], stray: set) -> list[str]:
    """The replica rule over one tensor's slices (rank, non-copy boxes as tuples, replica
    id), once its primaries tile it (no two hold the same boxes, but for empty ones): each
    replica slice holds one primary slice's boxes (``stray``: ranks whose replica pieces
    were named already), and ``planning.cover.replica_problems`` on the ids."""
    b0 = slices[0][1]
    ks = [k for _, bx, k in slices if bx == b0]
    if len(ks) == len(slices) and numbered(ks):   # one boxes held by all (experts, replicated)
        return []
    # per primary slice's boxes: every holding of them, as replica_problems takes them
    groups = {bx: (bx, []) for _, bx, k in slices if k == 0}
    problems = []
    for r, bx, k in slices:
        g = groups.get(bx)
        if g is None:
            if r not in stray:
                problems.append(f"rank {r} holds replica pieces {' + '.join(map(fmt_box, bx)) or '(none)'} "
                                f"that equal no one rank's primary pieces")
            continue
        g[1].append(((r,), (k,)))
    if all(numbered([ids[0] for _, ids in g[1]]) for g in groups.values()):
        return problems   # (the common case, without building replica_problems' messages)
    return problems + [msg for msg, _ in replica_problems(list(groups.values()))]



# --------------------------------------------------------------------------- local work

@dataclass(frozen=True)
class Finding:
    """One problem. ``rank``: the rank at fault when it is known; ``ranks``: the ranks
    involved (e.g. every holder of a tensor whose digest sum is wrong)."""
    rank: int | None
    check: str
    detail: str
    tensor: str | None = None
    piece: int | None = None
    box: Box | None = None
    ranks: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        """The report's form: JSON-ready (lists, not tuples)."""
        d = asdict(self)
        d["ranks"] = sorted(self.ranks) if self.ranks else ([self.rank] if self.rank is not None else [])
        d["box"] = [list(p) for p in self.box] if self.box is not None else None
        return d

    def render(self) -> str:
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        elif self.ranks:
            parts.append(format_ranks(self.ranks))
        if self.tensor is not None:
            parts.append(f"tensor {self.tensor!r}")
        if self.piece is not None:
            parts.append(f"piece {self.piece}" + (f" {fmt_box(self.box)}" if self.box else ""))
        return (", ".join(parts) + ": " if parts else "") + f"[{self.check}] {self.detail}"


# the start of every finding of content that is not the manifest's (the data-changed hint
# is added when one is made)
DIFFERS = "content differs from the manifest"


def _finding(rank, check, detail, tensor=None, piece=None, box=None, ranks=None) -> Finding:
    return Finding(rank, check, detail, tensor, piece,
                   tuple(tuple(x) for x in box) if box is not None else None,
                   tuple(ranks) if ranks is not None else ())


class ViewEntry(NamedTuple):
    """What a rank holds of one tensor, as every rank sees it after the gather (no data)."""
    name: str
    dtype: str
    global_shape: tuple[int, ...]
    replica: int
    boxes: tuple[Box, ...]
    # indices of the pieces that are copies of another rank's primary piece (Piece.copy):
    # replicas whatever ``replica`` says, so their digests are compared, never summed
    copies: tuple[int, ...] = ()


@dataclass
class Payload:
    """One rank's share of the verification, gathered to every rank."""
    rank: int
    view: list[ViewEntry]
    findings: list[Finding]
    digests: dict[str, list[str]]
    stats: dict[str, float]
    # what the rank verifies against (``basis``): the ranks compare it, as every rank's
    # verdict is computed from its own mode and manifest
    basis: Basis | None = None


class Basis(NamedTuple):
    mode: str
    manifest: str    # "none", "unreadable: ..." or the sha256 of the manifest's digests


def basis(mode: str, manifest: Manifest | None, manifest_error: str | None) -> Basis:
    """What a rank's verdict rests on besides the gathered payloads: its mode, and the
    manifest it compares with (its checkpoint fingerprint, algorithm and every digest)."""
    if manifest is None:
        return Basis(mode, "unreadable: " + manifest_error if manifest_error else "none")
    h = hashlib.sha256(f"{manifest.fingerprint}\0{manifest.algorithm}".encode())
    for name in sorted(manifest.tensors):
        t = manifest.tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{t.shape}\0{t.digest}".encode())
    return Basis(mode, h.hexdigest())


def _basis_findings(payloads: Sequence[Payload]) -> list[Finding]:
    """A failure on every rank where the ranks verified against different modes or
    manifests (``verify_rank`` called with other modes, or node-local copies holding
    other manifests): each rank's verdict would rest on its own, and a rank without the
    manifest would pass what another fails."""
    diffs = options_disagreement({p.rank: p.basis._asdict() for p in payloads
                                  if p.basis is not None}, show=_shown_basis)
    if not diffs:
        return []
    return [_finding(None, "agreement", f"the ranks verified against different modes or "
                     f"manifests ({diffs}): every rank must verify alike, against the same "
                     f"manifest")]


def _shown_basis(value: str) -> str:
    # a manifest by the head of its sha256 (the whole of it was compared); why one was
    # unreadable clipped, as it quotes a file
    is_sha = len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    return repr(value[:12] if is_sha else clip(value, MAX_NAME_CHARS))


class HeldPiece(NamedTuple):
    rank: int
    index: int      # the piece's index in the rank's TensorSlice
    box: Box


@dataclass
class Holders:
    """Per tensor: who declares which (dtype, global shape), and who holds which pieces."""
    decl: dict[tuple[str, tuple[int, ...]], list[int]] = field(default_factory=dict)
    prim: list[HeldPiece] = field(default_factory=list)
    repl: list[HeldPiece] = field(default_factory=list)
    # per rank's slice: (rank, the boxes of its pieces that are no copies, replica id)
    slices: list[tuple[int, tuple[Box, ...], int]] = field(default_factory=list)


def _check_padding(t: torch.Tensor, ts) -> str | None:
    if t.dim() == 0:
        return None
    local = full_box(tuple(ts.local_shape))
    dst = [tuple((o, o + (b - a)) for o, (a, b) in zip(p.dst, p.src)) for p in ts.pieces]
    gaps = uncovered(local, dst)
    if gaps is None:
        return "too many disjoint padding regions to check"
    bits = int_view(t)
    for g in gaps:
        region = narrow_box(bits, [a for a, _ in g], box_shape(g))
        nz = int(torch.count_nonzero(region).item())
        if nz:
            return (f"padding region {fmt_box(g)} (covered by no piece) has {nz} non-zero "
                    f"element(s); padding must be zero")
    return None


class _Unread(Exception):
    """A piece whose file cannot be re-read as the one the load read (``_FullReader.changed``
    says why, once per file)."""


class _FullReader:
    """Re-reads checkpoint pieces through the HF safetensors library (independent of the
    engines that did the load), each file checked first to be the one whose header the
    plan was made from: a file changed since the load would otherwise be compared as the
    loaded bytes being wrong."""

    def __init__(self, meta, rank: int | None = None):
        self.meta = meta
        self.rank = rank
        self.handles: dict[str, Any] = {}
        self.changed: dict[str, str] = {}   # file -> why it is not re-read

    def _open(self, file: str):
        h = self.handles.get(file)
        if h is not None:
            return h
        if file in self.changed:
            raise _Unread(file)
        from safetensors import safe_open
        info = next((f for f in self.meta.files if f.name == file), None)
        path = os.path.join(self.meta.root, file)
        try:
            if info is None:
                raise VerifyError("is not a file of the checkpoint's metadata", file=file)
            fd, _ = open_checked(path, info, self.rank, during="the load and its verify")
            try:
                checked = fd_path(fd)
                h = safe_open(checked or path, framework="pt")
                if checked is None:
                    refuse_replaced(path, fd, info, self.rank)
            finally:
                os.close(fd)
        except CoordloaderError as e:
            self.changed[file] = e.message
            raise _Unread(file) from None
        self.handles[file] = h
        return h

    def findings(self) -> list[Finding]:
        """One finding per file that could not be re-read (its pieces are not compared)."""
        return [_finding(self.rank, "file", f"{f}: cannot re-read it, so the pieces it stores are "
                                       f"not checked: {why}")
                for f, why in sorted(self.changed.items())]

    def compare(self, name: str, local: torch.Tensor, piece) -> str | None:
        info = self.meta.tensors.get(name)
        if info is None:
            return "not in the checkpoint"
        shape = tuple(info.shape)
        if not shape:
            sp = info.pieces[0]
            ref = self._open(sp.file).get_tensor(sp.key)
            a, b = int_view(ref.to(local.device)), int_view(local)
            return None if torch.equal(a, b) else "scalar differs from the checkpoint"
        for sp, sub, ref in self._reread(info, piece.src):
            mine = narrow_box(local, [o + a - p0 for o, (a, _), (p0, _) in
                                      zip(piece.dst, sub, piece.src)], box_shape(sub))
            rb, mb = int_view(ref.to(local.device)), int_view(mine)
            if tuple(rb.shape) != tuple(mb.shape):
                return f"re-read {list(rb.shape)} elements, holds {list(mb.shape)}"
            if not torch.equal(rb, mb):
                diff = rb != mb
                n = int(diff.sum().item())
                first = [int(x) for x in diff.nonzero()[0].tolist()]
                at = [a + i for (a, _), i in zip(sub, first)]
                w = rb.element_size() * 8
                mask = (1 << w) - 1
                got = int(mb[tuple(first)].item()) & mask
                want = int(rb[tuple(first)].item()) & mask
                return (f"{n} element(s) differ from {sp.file} in {fmt_box(sub)}; first at "
                        f"global index {at}: holds bits 0x{got:0{w // 4}x}, checkpoint has "
                        f"0x{want:0{w // 4}x}")
        return None

    def digest_box(self, name: str, box: Box) -> int:
        """The digest of the part ``box`` of checkpoint tensor ``name``, re-read in bounded
        chunks (digests add up over any split of a tensor)."""
        info = self.meta.tensors[name]
        shape = tuple(info.shape)
        return sum(digest(ref, sub, shape) for _, sub, ref in self._reread(info, box))

    def _reread(self, info, box: Box):
        """(stored piece, sub-box, its elements re-read) for the part ``box`` of the tensor
        ``info``: per stored piece it overlaps, in sub-boxes of at most FULL_CHUNK_BYTES."""
        budget = max(1, FULL_CHUNK_BYTES // itemsize(info.dtype))
        for sp in info.pieces:
            inter = intersect(box, sp.box)
            if inter is None:
                continue
            sl = self._open(sp.file).get_slice(sp.key)
            for sub in iter_subboxes(inter, budget):
                yield sp, sub, sl[tuple(slice(a - s0, b - s0)
                                        for (a, b), (s0, _) in zip(sub, sp.box))]


def rest_digests(tensors: Mapping[str, torch.Tensor], rank_plan, meta) -> tuple[dict, list]:
    """For each tensor ``rank_plan`` holds only part of: the digests of the rest of it
    (the regions none of the rank's pieces covers), re-read from the checkpoint. A rank
    loaded alone (no process group) proves its pieces against the manifest with them:
    the manifest holds one digest per whole tensor. -> ({name: [digest, ...]}, findings)."""
    out: dict[str, list[int]] = {}
    findings: list[Finding] = []
    reader = _FullReader(meta, rank_plan.rank)
    for ts in rank_plan.tensors:
        shape = tuple(ts.global_shape)
        if ts.name not in tensors or not shape:
            continue
        if prod(shape) == 0:   # no elements: nothing of it to re-read
            out[ts.name] = []
            continue
        gaps = uncovered(full_box(shape), [tuple(map(tuple, p.src)) for p in ts.pieces])
        if not gaps:
            continue
        try:
            if gaps is None:
                raise VerifyError("the rest of the tensor is too fragmented to re-read")
            out[ts.name] = [reader.digest_box(ts.name, g) for g in gaps]
        except _Unread:   # its file's one finding, below
            continue
        except CoordloaderError as e:
            findings.append(_finding(rank_plan.rank, "digest", f"cannot re-read the rest of the "
                                     f"tensor from the checkpoint: {e.message}", ts.name))
        except Exception as e:  # noqa: BLE001
            findings.append(_finding(rank_plan.rank, "digest", f"cannot re-read the rest of the "
                                     f"tensor from the checkpoint: {type(e).__name__}: {e}",
                                     ts.name))
    return out, findings + reader.findings()


def local_payload(tensors: Mapping[str, torch.Tensor], rank_plan, mode: str, *, meta=None) -> Payload:
    """This rank's share of the verification: compact view, local findings and (digest
    mode) per-piece digests. Never raises for a data problem: everything is a finding, so
    the rank still joins the collective that follows."""
    rank = rank_plan.rank
    level = VerifyMode(mode).level
    findings: list[Finding] = []
    view = []
    digests: dict[str, list[str]] = {}
    stats = {"tensors": 0, "bytes_digested": 0, "digest_s": 0.0, "bytes_compared": 0, "full_s": 0.0}
    want = rank_plan.by_name()
    jobs: list = []
    full = None
    try:
        missing = sorted(set(want) - set(tensors))
        extra = sorted(set(tensors) - set(want))
        for n in missing:
            findings.append(_finding(rank, "missing", "planned for this rank but not loaded", n))
        for n in extra:
            findings.append(_finding(rank, "unexpected", "loaded but not in this rank's plan", n))
        full = (_FullReader(meta, rank) if level >= VerifyMode.FULL.level and meta is not None
                else None)
        if level >= VerifyMode.FULL.level and meta is None:
            findings.append(_finding(rank, "full", "--verify full needs the checkpoint metadata"))
        for name, ts in want.items():
            if name not in tensors:
                continue
            t = tensors[name]
            view.append(ViewEntry(name, ts.dtype, tuple(ts.global_shape), ts.replica,
                                  tuple(tuple(tuple(x) for x in p.src) for p in ts.pieces),
                                  tuple(i for i, p in enumerate(ts.pieces) if p.copy)))
            stats["tensors"] += 1
            try:
                dt = torch_dtype(ts.dtype)
                if t.dtype != dt or tuple(t.shape) != tuple(ts.local_shape):
                    findings.append(_finding(rank, "shape", f"holds {from_torch_safe(t.dtype)} "
                                             f"{list(t.shape)}, the plan says {ts.dtype} "
                                             f"{list(ts.local_shape)}", name))
                    continue
                if ts.needs_zero_fill:
                    bad = _check_padding(t, ts)
                    if bad:
                        findings.append(_finding(rank, "padding", bad, name))
                if level >= VerifyMode.DIGEST.level:
                    jobs.append((name, t, ts))
                if full is not None:
                    t0 = time.perf_counter()
                    for i, p in enumerate(ts.pieces):
                        try:
                            bad = full.compare(name, t, p)
                        except _Unread:   # its file's one finding, below
                            continue
                        if bad:
                            findings.append(_finding(rank, "bytes", bad, name, i, p.src))
                    stats["full_s"] += time.perf_counter() - t0
                    stats["bytes_compared"] += ts.covered_numel * t.element_size()
            except CoordloaderError as e:
                findings.append(_finding(rank, "error", e.message, name))
            except Exception as e:  # noqa: BLE001 — a local crash must still reach the collective
                findings.append(_finding(rank, "error", f"{type(e).__name__}: {e}", name))
    except Exception as e:  # noqa: BLE001
        findings.append(_finding(rank, "error", f"{type(e).__name__}: {e}"))
    if full is not None:
        findings += full.findings()
    if jobs:
        # no more threads than torch's intra-op pool: a rank under torchrun or the bench owns
        # one core (OMP_NUM_THREADS=1)
        try:
            workers = digest_workers(cap=torch.get_num_threads())
        except CoordloaderError as e:   # one finding, and the digests still go out
            findings.append(_finding(rank, "error", e.message))
            workers = 1
        t0 = time.perf_counter()
        for name, res in digest_pieces(jobs, workers):
            if isinstance(res, str):
                findings.append(_finding(rank, "error", res, name))
            else:
                digests[name] = [fmt(d) for d in res]
        stats["digest_s"] += time.perf_counter() - t0
        stats["bytes_digested"] += sum(ts.covered_numel * t.element_size() for _, t, ts in jobs)
    if len(findings) > MAX_FINDINGS_PER_RANK:
        n = len(findings)
        findings = findings[:MAX_FINDINGS_PER_RANK] + [
            _finding(rank, "truncated", f"{n - MAX_FINDINGS_PER_RANK} more finding(s) on this rank")]
    return Payload(rank, view, findings, digests, stats)


def digest_workers(cap: int | None = None) -> int:
    """Threads digesting tensors in parallel: env COORDLOADER_DIGEST_THREADS when set, else
    the usable CPUs (at most 8, and at most ``cap``)."""
    env = os.environ.get("COORDLOADER_DIGEST_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"COORDLOADER_DIGEST_THREADS={env!r}: expected a whole number of "
                              "threads >= 1 (or unset it for the default)")
        return n
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(8, n, cap if cap is not None else n))


def digest_pieces(jobs, workers: int = 1, route=None):
    """Per-piece digests of every (name, tensor, slice) job -> [(name, digests | error)].

    All pieces go to ``digest.digest_many`` in one call: on CPU the compiled kernel takes
    them in batches (or, without it, the many small pieces that share a box are stacked
    into one int8 product), so a job costs a few microseconds of Python, not a dozen torch
    calls. ``workers`` threads (``digest_workers()``, capped by torch's intra-op thread
    count); ``digest_many`` sets torch's own pool to one thread while they run. ``route``:
    a ``digest.Route`` (default AUTO)."""
    items, owner = [], []
    errors: dict[str, str] = {}
    for name, t, ts in jobs:
        try:
            views = [piece_view(t, p, i) for i, p in enumerate(ts.pieces)]
        except CoordloaderError as e:
            errors[name] = e.message
            continue
        except Exception as e:  # noqa: BLE001 — becomes a finding, never a stranded rank
            errors[name] = f"{type(e).__name__}: {e}"
            continue
        for v, p in zip(views, ts.pieces):
            items.append((v, p.src, ts.global_shape))
            owner.append(name)
    res = digest_many(items, threads=workers, return_errors=True,   # one intra-op thread inside
                      route=route or Route.AUTO)
    out: dict[str, list] = {}
    for name, r in zip(owner, res):
        if name in errors:
            continue
        if isinstance(r, Exception):
            errors[name] = r.message if isinstance(r, CoordloaderError) else f"{type(r).__name__}: {r}"
            continue
        out.setdefault(name, []).append(r)
    return [(name, errors[name] if name in errors else out.get(name, [])) for name, _, _ in jobs]


def from_torch_safe(dt: torch.dtype) -> str:
    try:
        return from_torch(dt)
    except CoordloaderError:
        return str(dt)


# --------------------------------------------------------------------------- evaluation

def evaluate(payloads: Sequence[Payload], mode: str, *, meta=None, manifest=None,
             manifest_error: str | None = None, excluded: Iterable[str] = (),
             complete: bool = True, rest: Mapping[str, list[int]] | None = None,
             plan_cover: bool = False) -> dict:
    """The verdict over every rank's payload (pure: every rank computes the same one).

    ``complete`` says the payloads are the whole world; otherwise (one rank of a larger
    plan checked in a single process) the global cover is skipped, and a tensor split
    over ranks is compared with the manifest through ``rest`` (``rest_digests``: the
    digests of the parts the rank does not hold, re-read from the checkpoint);
    ``plan_cover``: the whole plan's cover was checked instead (its findings are the
    payload's)."""
    mode = VerifyMode(mode)
    failures = [f for p in sorted(payloads, key=lambda p: p.rank) for f in p.findings]
    disagree = _basis_findings(payloads)
    failures += disagree
    checks = ["local"]
    notes: list[str] = []
    bad_tensor = {f.tensor for f in failures if f.tensor is not None}
    holders = _holders(payloads)
    cover_ok: set[str] = set()
    if complete:
        checks.append("cover")
        cover_ok = _cover_findings(holders, meta, set(excluded), failures)
    elif plan_cover:
        checks.append("plan cover")
        notes.append("the plan's cover checked, not the other ranks' tensors (no process "
                     "group)")
    else:
        notes.append("global cover skipped: only this rank's share was "
                     "checked (no process group)")
    manifest_info = None
    if disagree:   # what rests on a rank's own mode and manifest: one report everywhere
        notes.append("digests not compared: the ranks verified against different modes or "
                     "manifests")
    elif mode.level >= VerifyMode.DIGEST.level:
        if manifest_error:
            failures.append(_finding(None, "manifest", manifest_error))
        digests = {p.rank: p.digests for p in payloads}
        compared = split = with_rest = 0
        for name in sorted(holders):
            if complete and name not in cover_ok:
                continue
            if name in bad_tensor:
                notes.append(f"{name}: digests not compared (local check failed)")
                continue
            h = holders[name]
            if not complete and manifest is not None:
                # only this rank's share: a tensor it holds whole is still compared with
                # the manifest; one split over ranks cannot be (its digest is their sum)
                h = _whole_here(name, h)
                if h is None:
                    if rest is not None and name in rest:
                        compared += 1
                        with_rest += 1
                        _rest_findings(name, holders[name], digests, rest[name], manifest,
                                       failures, notes)
                        continue
                    split += 1
                    _digest_findings(name, holders[name], digests, None, failures, notes)
                    continue
            compared += manifest is not None
            _digest_findings(name, h, digests, manifest, failures, notes)
        if manifest is not None and any(f.check == "digest" and f.detail.startswith(DIFFERS)
                                        for f in failures):
            hint = manifest.changed_hint()
            if hint:   # first: it explains the findings after it (all of another step's)
                failures.insert(0, _finding(None, "manifest", hint))
        if manifest is not None and compared:
            checks.append("digest-manifest")
            manifest_info = f"compared with {manifest.path}"
            if with_rest:
                manifest_info += (f" ({with_rest} tensor(s) split over ranks with the rest of "
                                  f"each re-read from the checkpoint: no process group)")
            if split:
                manifest_info += (f" for the {compared - with_rest} tensor(s) this rank holds "
                                  f"whole; "
                                  f"{split} split over ranks not compared (no process group)")
                notes.append(manifest_info)
        else:
            checks.append("digest-replicas")
            manifest_info = ((("no manifest: every byte compared with the checkpoint re-read "
                               "(full)" if mode.level >= VerifyMode.FULL.level else
                               "no manifest: checked replicas against primaries only")
                              + " (create one with `python -m coordloader.manifest CKPT`)")
                             if manifest is None
                             else f"not compared with {manifest.path}: every tensor this rank "
                                  f"holds is split over ranks (no process group)")
            notes.append(manifest_info)
    if mode.level >= VerifyMode.FULL.level:
        checks.append("full")
    return {"ok": not failures, "mode": mode.value, "ranks": sorted(p.rank for p in payloads),
            "checks": checks, "manifest": manifest_info, "notes": notes,
            "failures": [f.to_dict() for f in failures], "stats": _sum_stats(payloads)}


def _whole_here(name: str, h: Holders) -> Holders | None:
    """``h`` with the pieces that tile the whole tensor as its primaries (this rank's
    primary pieces, else its replica pieces, else both: a slice with copy pieces), or None
    when none does."""
    if len(h.decl) != 1:
        return None
    (_, gshape), = h.decl.keys()
    for pieces in (h.prim, h.repl, h.prim + h.repl if h.prim and h.repl else []):
        if pieces and not cover_problems(name, gshape, [(p.rank, p.box) for p in pieces], []):
            return h if pieces is h.prim else Holders(h.decl, list(pieces), [])
    return None


def _holders(payloads: Sequence[Payload]) -> dict[str, Holders]:
    """The gathered view, per tensor."""
    holders: dict[str, Holders] = {}
    for p in payloads:
        for v in p.view:
            h = holders.setdefault(v.name, Holders())
            h.decl.setdefault((v.dtype, tuple(v.global_shape)), []).append(p.rank)
            copies = v.copies
            for i, b in enumerate(v.boxes):
                (h.prim if v.replica == 0 and i not in copies else h.repl).append(
                    HeldPiece(p.rank, i, tuple(b)))
            # (local_payload's boxes are tuples, and stay tuples through the gather)
            h.slices.append((p.rank, v.boxes if not copies else
                             tuple(b for i, b in enumerate(v.boxes) if i not in copies), v.replica))
    return holders


def _cover_findings(holders: Mapping[str, Holders], meta, excluded: set[str],
                    failures: list[Finding]) -> set[str]:
    """Append the global cover's findings; -> the tensors whose cover is right."""
    cover_ok: set[str] = set()
    for name in sorted(holders):
        h = holders[name]
        decl = h.decl
        info = meta.tensors.get(name) if meta is not None else None
        if info is not None:
            truth = (info.dtype, tuple(info.shape))
            for (dt, gs), rs in decl.items():
                if (dt, gs) != truth:
                    failures.append(_finding(rs[0], "cover",
                                             f"{format_ranks(rs)} plan it as {dt} {list(gs)}, "
                                             f"the checkpoint has {truth[0]} {list(truth[1])}",
                                             name))
        elif meta is not None:
            rs = sorted({r for v in decl.values() for r in v})
            failures.append(_finding(rs[0], "cover", f"held by {format_ranks(rs)} but not in the "
                                     "checkpoint", name))
            continue
        if len(decl) > 1:
            desc = "; ".join(f"{format_ranks(rs)}: {dt} {list(gs)}" for (dt, gs), rs in decl.items())
            failures.append(_finding(min(min(v) for v in decl.values()), "cover",
                                     f"ranks disagree on dtype/shape ({desc})", name))
            continue
        (_, gshape), = decl.keys()
        probs = cover_problems(name, gshape, [(p.rank, p.box) for p in h.prim],
                               [(p.rank, p.box) for p in h.repl], h.slices)
        for msg in probs:
            rs = sorted({p.rank for p in h.prim + h.repl})
            failures.append(_finding(rs[0] if len(rs) == 1 else None, "cover", msg, name,
                                     ranks=rs))
        if not probs:
            cover_ok.add(name)
    if meta is not None:
        for name in meta.tensors:
            if name not in holders and name not in excluded:
                failures.append(_finding(None, "cover", "checkpoint tensor held by no rank "
                                         "(and not excluded by the plan)", name))
    return cover_ok


def _manifest_entry(name: str, manifest, failures: list[Finding]):
    """The manifest's entry for ``name``; None, with the finding, when it has none."""
    md = manifest.get(name)
    if md is None:
        failures.append(_finding(None, "digest", "not in the manifest", name))
    return md


def _rest_findings(name: str, h: Holders, digests: Mapping[int, Mapping[str, list[str]]],
                   rest: list[int], manifest, failures: list[Finding], notes: list[str]) -> None:
    """One rank's pieces of a split tensor, with the rest of it re-read from the
    checkpoint, against the manifest. Every piece the rank holds counts, primary, replica
    or copy alike: ``rest`` is the part none of them covers."""
    pieces = h.prim + h.repl
    d = [digests.get(r, {}).get(name) for r, _, _ in pieces]
    if any(x is None for x in d):
        notes.append(f"{name}: not compared with the manifest (digests missing)")
        return
    md = _manifest_entry(name, manifest, failures)
    if md is None:
        return
    got = combine([int(x[i], 16) for x, (_, i, _) in zip(d, pieces)] + list(rest))
    if got != md.digest:
        r = pieces[0].rank
        held = ", ".join(fmt_box(b) for _, _, b in pieces)
        failures.append(_finding(r, "digest", f"{DIFFERS}: this rank's "
                                 f"pieces {held} and the rest of the tensor re-read from the "
                                 f"checkpoint sum to {fmt(got)}, manifest has {fmt(md.digest)} "
                                 f"(verify='full' compares this rank's pieces with the "
                                 f"checkpoint)", name))


def _digest_findings(name: str, h: Holders, digests: Mapping[int, Mapping[str, list[str]]],
                     manifest, failures: list[Finding], notes: list[str]) -> None:
    """Replicas against their primary; with a manifest, the primaries' sum against it. A
    replica that disagrees with its primary is blamed alone only when the primaries' sum
    matches the manifest; else either copy may be the wrong one, and both ranks are named."""
    prim_d = {}
    for r, i, b in h.prim:
        d = digests.get(r, {}).get(name)
        if d is not None:
            prim_d[b] = (r, i, int(d[i], 16))
    differ = []   # (replica rank, its piece, box, its digest text, primary's (rank, piece, digest))
    for r, i, b in h.repl:
        d = digests.get(r, {}).get(name)
        if d is None or b not in prim_d:
            continue
        if int(d[i], 16) != prim_d[b][2]:
            differ.append((r, i, b, d[i], prim_d[b]))
    primaries_ok = None   # True / False once compared with the manifest
    why = "no manifest says which"
    if manifest is not None:
        if len(prim_d) < len(h.prim):
            # a holder sent no digests (its failure is already a finding): a partial sum
            # would only add a false "content differs"
            notes.append(f"{name}: not compared with the manifest (primary digests missing)")
            why = "primary digests are missing, so the manifest could not say which"
        else:
            md = _manifest_entry(name, manifest, failures)
            if md is None:
                why = "the manifest has no entry for this tensor"
            else:
                got = combine(d for _, _, d in prim_d.values())
                primaries_ok = got == md.digest
                why = "the primaries differ from the manifest too"
    for r, i, b, d, (pr, pi, pd) in differ:
        if primaries_ok:
            failures.append(_finding(r, "digest", f"replica digest {d} differs from the "
                                     f"primary copy on rank {pr} (piece {pi}): {fmt(pd)}, "
                                     f"whose content matches the manifest", name, i, b))
        else:
            failures.append(_finding(None, "digest", f"replica digest {d} on rank {r} (piece "
                                     f"{i}) differs from the primary copy on rank {pr} (piece "
                                     f"{pi}): {fmt(pd)}; either may be the wrong one ({why}; "
                                     f"verify='full' compares each with the checkpoint)",
                                     name, None, b, ranks=(pr, r)))
    if primaries_ok is False:
        who = ", ".join(f"rank {r} piece {i} {fmt_box(b)}"
                        for b, (r, i, _) in sorted(prim_d.items(), key=lambda kv: kv[1][0]))
        rs = sorted({r for r, _, _ in prim_d.values()})
        failures.append(_finding(rs[0] if len(rs) == 1 else None, "digest",
                                 f"{DIFFERS}: primary pieces sum "
                                 f"to {fmt(got)}, manifest has {fmt(md.digest)}; "
                                 f"held by {who}", name, ranks=rs))


def _sum_stats(payloads: Sequence[Payload]) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for key in ("tensors", "bytes_digested", "digest_s", "bytes_compared", "full_s"):
        stats[key] = sum(p.stats.get(key, 0) for p in payloads)
    if stats["digest_s"] > 0:
        stats["digest_gbps"] = stats["bytes_digested"] / stats["digest_s"] / 1e9
    return stats


def render(f: Mapping) -> str:
    """A report finding (its dict form) as one line."""
    box = tuple(map(tuple, f["box"])) if f.get("box") else None
    return Finding(f.get("rank"), f["check"], f["detail"], f.get("tensor"), f.get("piece"), box,
                   tuple(f.get("ranks") or ())).render()


# --------------------------------------------------------------------------- entry point

def _process_group(group):
    """None for single-process use; else the torch ProcessGroup (accepts a ProcessGroup,
    coordloader.collective.Group or anything with a ``pg`` attribute)."""
    if group is None:
        return None
    pg = getattr(group, "pg", group)
    if pg is None:
        return None
    import torch.distributed as dist
    if dist.get_world_size(pg) <= 1:
        return None
    return pg


@on_host_default_device
def verify_rank(tensors: Mapping[str, torch.Tensor], rank_plan, *args, mode: str | None = None,
                meta=None, manifest=None, group=None, plan=None, rank: int | None = None,
                agreed: bool = False) -> dict:
    """Verify this rank's loaded ``tensors`` against ``rank_plan``; returns the report, or
    raises ``VerifyError(report=...)`` on every rank when any rank found a problem.

    Call forms: ``verify_rank(tensors, rank_plan, mode, ...)`` or
    ``verify_rank(tensors, plan, rank, mode=..., ...)`` (a whole ``Plan`` and this rank's
    index; the plan also supplies the excluded tensors and the world size).

    ``manifest``: a ``manifest.Manifest``; None = load ``coordloader.manifest.json`` from
    ``meta.root`` when ``meta`` is given (digest/full modes); False = do not use one.
    ``group``: None = single process (no collectives); else a ProcessGroup or a
    ``coordloader.collective.Group``; every member must call verify_rank, with the same
    mode and manifest (compared unless ``agreed``: the caller made them agree already, as
    ``load`` does; hashing a manifest of 92 k digests takes a tenth of a second or more)."""
    for a in args:
        if isinstance(a, str):
            mode = a
        elif isinstance(a, numbers.Integral) and not isinstance(a, bool):
            rank = a
        else:
            raise VerifyError(f"verify_rank: unexpected positional argument "
                              f"{clip(repr(a), MAX_NAME_CHARS)}; expected this rank (an "
                              f"integer) or the mode (a str)")
    mode = mode or "shapes"
    if mode not in MODES:
        raise VerifyError(f"unknown verify mode {mode!r}; expected one of {', '.join(MODES)}")
    if not isinstance(tensors, Mapping):
        raise VerifyError(f"verify_rank: tensors must be a mapping of names to tensors, got "
                          f"{type(tensors).__name__}")
    if not (manifest is None or manifest is False or isinstance(manifest, Manifest)):
        raise VerifyError(f"verify_rank: manifest must be a Manifest (verify.manifest."
                          f"load_manifest), None or False, got {type(manifest).__name__}")
    if hasattr(rank_plan, "ranks") and hasattr(rank_plan, "rank") and callable(rank_plan.rank):
        plan = rank_plan
        if rank is None:
            raise VerifyError("verify_rank: a whole Plan needs this process's rank")
        rank = as_rank(rank, VerifyError)
        if not 0 <= rank < plan.world_size:
            # a negative index was the last rank's plan, checked and named as that rank
            raise VerifyError(f"rank={rank} outside the plan's world of {plan.world_size}")
        rank_plan = plan.rank(rank)
    if not (hasattr(rank_plan, "tensors") and hasattr(rank_plan, "by_name")):
        # (a plan's JSON: a bare AttributeError)
        raise VerifyError(f"verify_rank: expected a Plan (with this rank) or a rank's plan, "
                          f"got {type(rank_plan).__name__}")
    if meta is not None and not hasattr(meta, "tensors"):
        # (a checkpoint path: reported as a verify failure of the manifest)
        raise VerifyError(f"verify_rank: meta must be a CheckpointMeta (read_checkpoint(dir)), "
                          f"got {type(meta).__name__}")
    if mode == "none":
        return {"ok": True, "mode": "none", "ranks": [rank_plan.rank], "checks": [], "notes": [],
                "failures": [], "manifest": None, "stats": {}}
    t_start = time.perf_counter()
    pg = _process_group(group)

    manifest_error = unreadable = None   # unreadable: the error less its file's path
    if VerifyMode(mode).level >= VerifyMode.DIGEST.level and manifest is None and meta is not None:
        try:
            manifest = load_manifest(meta.root, meta)
        except CoordloaderError as e:
            manifest, manifest_error = None, str(e)
            unreadable = e.message.replace(meta.root, "CKPT")   # its advice names the root
        except Exception as e:  # noqa: BLE001
            manifest_error = unreadable = f"cannot read the manifest: {type(e).__name__}: {e}"
            manifest = None
    if manifest is False:
        manifest = None

    payload = local_payload(tensors, rank_plan, mode, meta=meta)
    rest = None
    plan_cover = False
    if pg is None:
        payloads = [payload]
        # one rank's share is the whole only in a world of one; a rank plan given alone
        # does not say its world, so its share is taken as partial
        complete = plan is not None and plan.world_size == 1
        if (not complete and plan is not None and meta is not None
                and VerifyMode(mode).level >= VerifyMode.DIGEST.level):
            # the other ranks' tensors are not here, but their plans are: a plan giving
            # this rank another rank's part passes every check of its own bytes (the
            # digests re-read the complement of whatever it holds). The content modes
            # only: with a rank class per rank (ep_spans_dp) it walks every rank's slices,
            # seconds for DeepSeek-V3, which the default mode does not pay
            plan_cover = True
            try:
                validate_cover(plan, meta)
            except PlanError as e:
                payload.findings.append(_finding(
                    rank_plan.rank if e.rank is None else e.rank, "cover",
                    f"the plan: {e.message}", e.tensor))
        if (not complete and manifest is not None and meta is not None
                and VerifyMode(mode).level >= VerifyMode.DIGEST.level):
            rest, found = rest_digests(tensors, rank_plan, meta)
            payload.findings.extend(found)
    else:
        import torch.distributed as dist
        world = dist.get_world_size(pg)
        # node-local copies sit at other paths: the basis is the manifest, not where it is
        payload.basis = None if agreed else basis(mode, manifest, unreadable)
        payloads = [None] * world
        try:
            dist.all_gather_object(payloads, payload, group=pg)
        except Exception as e:
            raise CollectiveError(f"verify: exchanging findings failed (a rank died or timed out, "
                                  f"or called verify_rank with mode 'none', which exchanges "
                                  f"nothing?): {type(e).__name__}: {e}",
                                  rank=rank_plan.rank) from None
        strays = [r for r, p in enumerate(payloads) if not isinstance(p, Payload)]
        if strays:   # another collective's object: that rank is not in verify_rank
            raise CollectiveError(f"verify: {format_ranks(strays)} sent no findings to the exchange "
                                  f"(not in verify_rank, or called with mode 'none', which "
                                  f"exchanges nothing); every rank must verify alike",
                                  rank=rank_plan.rank)
        complete = True
    report = evaluate(payloads, mode, meta=meta, manifest=manifest, manifest_error=manifest_error,
                      excluded=plan.excluded if plan is not None else (), complete=complete,
                      rest=rest, plan_cover=plan_cover)
    report["rank"] = rank_plan.rank
    report["seconds"] = time.perf_counter() - t_start
    if not report["ok"]:
        fl = report["failures"]
        head = "; ".join(render(f) for f in fl[:5]) + (f"; ... ({len(fl) - 5} more)" if len(fl) > 5 else "")
        raise VerifyError(f"verify {mode} failed ({len(fl)} problem(s)): {head}",
                          rank=rank_plan.rank, report=report)
    return report
