"""A tensor with a checkpoint tensor's global shape that holds only this rank's boxes.

Serving engines build their fused, sharded parameters in per-layer weight loaders that
narrow *whole* checkpoint tensors at their own tp-rank offsets. Handing those loaders a
``GlobalShapeTensor`` lets each model's own loader place the rank's slices (no per-model
offset table here): shape, ndim, dtype and device are the global tensor's; narrowing,
slicing, ``select``, ``unbind``, ``unsqueeze``/``squeeze``, ``split``/``chunk``,
``detach``, ``transpose``/``permute`` (``t``, ``mT``, ``movedim``, ``swapaxes``) and a
``view``/``reshape`` that only inserts or removes size-1 dims (vLLM's loaders do that to
a 1-element tensor) give lazy views: a view is a global box and, per view dim, the
global dim it shows; strides and contiguity are what torch reports for the same ops on
the whole tensor. Indexing one dim by a contiguous ascending run of indices, ``clone``
and ``contiguous()`` of a non-contiguous view give lazy *copies*, as torch does: boxes
like views, but with a zero record of their own (``zero_`` on a copy leaves the
checkpoint tensor as it was). The data is read only when a view is copied out (``copy_``
into a parameter, or ``materialize()``: the box gathered from the held pieces, then
permuted to the view's dim order), and only when every element of the view is held.
``zero_`` writes zeros over a view's box, as on a real tensor (gpt-oss zeroes a bias on
TP ranks other than 0 before copying it): later reads of the tensor it was called on,
and of that tensor's views, see zeros there, whether held or not; a copy taken before
keeps the values it had. Any other data access (a dtype conversion,
``repeat_interleave``, a ``view`` that regroups elements across dims, arithmetic) raises
``FitError`` naming the op, the tensor, the requested box and the held boxes: a loader
that would compute on the full tensor before narrowing would otherwise load wrong values.
Views of a tensor made outside ``torch.inference_mode()`` cannot be taken inside it
(refused the same way; copies and a copy of the whole tensor work there, and views under
``torch.no_grad()``).

Every copied-out box is recorded, so after loading ``unconsumed`` tells which held
elements no loader used (exact fit: each element asked for was held or zeroed, each held
element was copied out, zeroed or not).
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from coordloader.checkpoint.dtypes import torch_dtype
from coordloader.checkpoint.metadata import Box, box_numel, box_shape
from coordloader.checkpoint.tiling import fmt_box
from coordloader.engines import intersect, narrow_box
from coordloader.errors import FitError
from coordloader.planning.model import Piece, TensorSlice
from coordloader.verify.checks import uncovered

aten = torch.ops.aten


def fmt_boxes(boxes: Iterable[Box]) -> str:
    return "{" + ", ".join(fmt_box(b) for b in boxes) + "}"


@dataclass(eq=False)
class HeldTensor:
    """One checkpoint tensor on this rank: its local data, where each planned piece sits
    in it, and the boxes loaders have copied out so far (shared by all views)."""
    name: str
    global_shape: tuple[int, ...]
    local: torch.Tensor
    pieces: tuple[Piece, ...]
    rank: int | None = None
    consumed: list[Box] = field(default_factory=list)
    zeroed: list[Box] = field(default_factory=list)    # boxes zero_()ed on the tensor itself

    @property
    def held_boxes(self) -> tuple[Box, ...]:
        return tuple(p.src for p in self.pieces)

    def refuse(self, what: str, box: Box) -> FitError:
        return FitError(f"{what}; requested box {fmt_box(box)} of global shape "
                        f"{list(self.global_shape)}, held boxes {fmt_boxes(self.held_boxes)}",
                        tensor=self.name, rank=self.rank)

    def holds(self, box: Box, zeroed: Iterable[Box] = ()) -> bool:
        """Whether every element of ``box`` is held or in one of the ``zeroed`` boxes."""
        return uncovered(box, self.held_boxes + tuple(zeroed)) == []

    def gather(self, box: Box, zeroed: list[Box] | None = None, *,
               record: bool = True) -> torch.Tensor:
        """The elements of global ``box`` as a tensor of ``box_shape(box)``; FitError unless
        every one is held or in a ``zeroed`` box (it reads as zero; default: the boxes
        zeroed on the checkpoint tensor itself). Recorded as consumed unless ``record`` is
        False (the caller records it once the data has gone where it was asked)."""
        zeroed = self.zeroed if zeroed is None else zeroed
        if any(a == b for a, b in box):   # an empty narrow (torch allows it) asks for nothing
            return torch.empty(box_shape(box), dtype=self.local.dtype, device=self.local.device)
        if not self.holds(box, zeroed):
            raise self.refuse("asked for elements this rank does not hold (the serving "
                              "engine's split differs from the plan's)", box)
        out = torch.empty(box_shape(box), dtype=self.local.dtype, device=self.local.device)
        for p in self.pieces:
            ov = intersect(p.src, box)
            if ov is None:
                continue
            shape = box_shape(ov)
            src = narrow_box(self.local, [d + o[0] - s[0] for d, o, s in zip(p.dst, ov, p.src)], shape)
            narrow_box(out, [o[0] - b[0] for o, b in zip(ov, box)], shape).copy_(src)
        for z in zeroed:                  # the local data stays as read; zeros win here
            ov = intersect(z, box)
            if ov is not None:
                narrow_box(out, [o[0] - b[0] for o, b in zip(ov, box)], box_shape(ov)).zero_()
        if record:
            self.consumed.append(box)
        return out

    def unconsumed(self) -> list[Box]:
        """Held elements no loader copied out, as disjoint boxes."""
        left: list[Box] = []
        for held in self.held_boxes:
            parts = [ov for c in self.consumed if (ov := intersect(held, c)) is not None]
            left.extend(self._uncovered(held, parts))
        return left

    def _uncovered(self, whole: Box, parts: list[Box], max_cells: int = 1 << 22) -> list[Box]:
        """The regions of ``whole`` no box of ``parts`` (inside it) covers. The boxes' edges
        cut ``whole`` into a grid of cells, each one covered or not (any number of
        fragments); a grid too large falls back to box subtraction, and where that
        fragments past its limit too, the check says it gave up (never "all used")."""
        edges = [sorted({lo, hi} | {p[d][0] for p in parts} | {p[d][1] for p in parts})
                 for d, (lo, hi) in enumerate(whole)]
        cells = 1
        for e in edges:
            cells *= len(e) - 1
        if cells > max_cells:
            got = uncovered(whole, parts, limit=1024)
            if got is None:
                raise self.refuse(f"the exact-fit check gave up: {len(parts)} copied-out "
                                  f"boxes cut a held box into {cells} cells", whole)
            return got
        at = [{x: i for i, x in enumerate(e)} for e in edges]
        covered = torch.zeros([len(e) - 1 for e in edges], dtype=torch.bool)
        for p in parts:
            covered[tuple(slice(i[a], i[b]) for i, (a, b) in zip(at, p))] = True
        left: list[Box] = []
        for cell in (~covered).nonzero().tolist():
            box = tuple((e[i], e[i + 1]) for e, i in zip(edges, cell))
            prev = left[-1] if left else None
            if prev is not None and prev[:-1] == box[:-1] and prev[-1][1] == box[-1][0]:
                box = left.pop()[:-1] + ((prev[-1][0], box[-1][1]),)    # one run
            left.append(box)
        return left


# one dim of a view: the global dim it shows, or None for a size-1 dim unsqueeze added
ViewDim = int | None


class GlobalShapeTensor(torch.Tensor):
    """See the module docstring. Build with ``global_tensor``."""

    _held: HeldTensor
    _box: Box                      # the view's region, in global coordinates
    _dims: tuple[ViewDim, ...]     # global dims not listed here were fixed by select
    _zeroed: list[Box]             # zeroed boxes, shared by the views of one tensor or copy
    _meta: torch.Tensor            # the same ops on a meta tensor: torch's strides
    #                                (None only inside __torch_dispatch__, until _layout)

    @staticmethod
    def __new__(cls, held: HeldTensor, box: Box, dims: tuple[ViewDim, ...],
                zeroed: list[Box], meta: torch.Tensor | None):
        shape = tuple(1 if g is None else box[g][1] - box[g][0] for g in dims)
        if meta is not None and shape != tuple(meta.shape):   # the box bookkeeping is wrong
            raise held.refuse(f"internal: a view of shape {list(shape)} where torch gives "
                              f"{list(meta.shape)}", box)
        layout = {} if meta is None else dict(strides=meta.stride(),
                                              storage_offset=meta.storage_offset())
        t = torch.Tensor._make_wrapper_subclass(cls, shape, **layout, dtype=held.local.dtype,
                                                device=held.local.device, requires_grad=False)
        t._held, t._box, t._dims, t._zeroed, t._meta = held, box, dims, zeroed, meta
        return t

    def __repr__(self, *, tensor_contents=None) -> str:   # default repr would read the data
        return (f"GlobalShapeTensor({self._held.name!r}, shape={list(self.shape)}, "
                f"box={fmt_box(self._box)}, held={fmt_boxes(self._held.held_boxes)})")

    @property
    def checkpoint_name(self) -> str:
        return self._held.name

    @property
    def box(self) -> Box:
        return self._box

    @property
    def dims(self) -> tuple[ViewDim, ...]:
        """Per view dim, the global dim it shows (None: a dim unsqueeze added)."""
        return self._dims

    def materialize(self, *, record: bool = True) -> torch.Tensor:
        """This view's data as a plain tensor (recorded as consumed unless ``record`` is
        False): the box gathered in global dim order, its dims then put in the view's
        order."""
        data = self._held.gather(self._box, self._zeroed, record=record)
        shown = [g for g in self._dims if g is not None]
        fixed = [g for g in range(len(self._box)) if g not in shown]   # size 1: selected
        return data.permute(shown + fixed).reshape(self.shape).contiguous()

    # -- lazy views ----------------------------------------------------------------------

    def _view(self, box: Box, dims: tuple[ViewDim, ...]) -> "GlobalShapeTensor":
        # torch's layout is set by __torch_dispatch__ (_layout)
        return GlobalShapeTensor(self._held, box, dims, self._zeroed, None)

    def _layout(self, meta: torch.Tensor, *, copy: bool) -> "GlobalShapeTensor":
        """This view with the strides torch gives (``meta``); a copy (``copy``: what torch
        returns as a new tensor) gets its own zero record, starting from the zeros it
        copied."""
        zeroed = list(self._zeroed) if copy else self._zeroed
        return GlobalShapeTensor(self._held, self._box, self._dims, zeroed, meta)

    def _dim(self, d: int, ndim: int | None = None) -> int:
        n = self.dim() if ndim is None else ndim
        if not -max(n, 1) <= d < max(n, 1):        # a 0-d tensor takes dim 0 and -1
            raise self._held.refuse(f"dim {d} out of range for a {n}-d view", self._box)
        return d % n if n else 0

    def _sized_dim(self, d: int, op: str) -> int:
        """``_dim`` for an op that takes the dim's elements apart (select, unbind, split),
        which a 0-d view has none of: refused as torch refuses it."""
        if self.dim() == 0:
            raise self._held.refuse(f"{op} of a 0-d view (torch takes a tensor of at least "
                                    f"1 dim)", self._box)
        return self._dim(d)

    def _slice(self, d: int, start, stop, step: int) -> "GlobalShapeTensor":
        d = self._dim(d)
        n = self.shape[d]
        if step != 1:
            raise self._held.refuse(f"a strided slice (step {step}) of dim {d} is not a box", self._box)
        start = 0 if start is None else start
        stop = n if stop is None or stop >= sys.maxsize else stop
        start = min(max(start + n if start < 0 else start, 0), n)
        stop = min(max(stop + n if stop < 0 else stop, start), n)
        g = self._dims[d]
        if start == stop and g is None:
            raise self._held.refuse(f"an empty slice [{start}:{stop}] of an added dim {d}",
                                    self._box)
        if g is None:
            return self._view(self._box, self._dims)
        lo = self._box[g][0]
        return self._view(self._box[:g] + ((lo + start, lo + stop),) + self._box[g + 1:], self._dims)

    def _select(self, d: int, index: int) -> "GlobalShapeTensor":
        d = self._sized_dim(d, "select")
        n = self.shape[d]
        if not -n <= index < n:
            raise self._held.refuse(f"index {index} out of range for dim {d} of size {n}", self._box)
        index %= n
        g = self._dims[d]
        dims = self._dims[:d] + self._dims[d + 1:]
        if g is None:
            return self._view(self._box, dims)
        lo = self._box[g][0]
        return self._view(self._box[:g] + ((lo + index, lo + index + 1),) + self._box[g + 1:], dims)

    def _unsqueeze(self, d: int) -> "GlobalShapeTensor":
        d = self._dim(d, self.dim() + 1)
        return self._view(self._box, self._dims[:d] + (None,) + self._dims[d:])

    def _squeeze(self, ds: Iterable[int]) -> "GlobalShapeTensor":
        drop = {self._dim(d) for d in ds}
        drop = {d for d in drop if self.dim() and self.shape[d] == 1}   # 0-d: stays
        return self._view(self._box, tuple(g for i, g in enumerate(self._dims) if i not in drop))

    def _reshape(self, size) -> "GlobalShapeTensor | None":
        """``view``/``reshape`` to ``size`` when it only inserts or removes size-1 dims
        (vLLM's default_weight_loader views a 1-element tensor to its parameter's shape,
        the kv-cache scale loader reshapes it to ``()``): the other dims keep their order,
        so each element keeps its row-major place and it is a squeeze of every size-1
        dim, then an unsqueeze at each size-1 dim of ``size``. None for any other size:
        it regroups elements across dims, which a box with a dim per view dim cannot
        show."""
        size = [int(s) for s in size]
        if size.count(-1) == 1:                 # torch infers it from the other sizes
            rest = math.prod(s for s in size if s != -1)
            if rest == 0 or self.numel() % rest:
                return None
            size[size.index(-1)] = self.numel() // rest
        if any(s < 0 for s in size) or [s for s in size if s != 1] != [
                s for s in self.shape if s != 1]:
            return None
        out = self._squeeze(range(self.dim()))
        for d, s in enumerate(size):             # ascending: dims before d are in place
            if s == 1:
                out = out._unsqueeze(d)
        return out

    def _permute(self, order) -> "GlobalShapeTensor":
        n = self.dim()
        ds = [self._dim(d) for d in order]
        if sorted(ds) != list(range(n)):
            raise self._held.refuse(f"permute({list(order)}) is not a permutation of the "
                                    f"{n} dims", self._box)
        return self._view(self._box, tuple(self._dims[d] for d in ds))

    def _transpose(self, d0: int, d1: int) -> "GlobalShapeTensor":
        order = list(range(self.dim()))
        a, b = self._dim(d0), self._dim(d1)
        order[a], order[b] = b, a
        return self._permute(order)

    def _index(self, indices) -> "GlobalShapeTensor":
        """``t[idx]`` with one integer index tensor (after leading full dims): a view when
        the indices are a contiguous ascending run (vLLM's local expert ids), which is a
        slice; any other index picks elements that are no box."""
        lead = 0
        while lead < len(indices) and indices[lead] is None:
            lead += 1
        idx = indices[lead] if lead < len(indices) else None
        if isinstance(idx, torch.Tensor) and idx.dtype not in (torch.int64, torch.int32):
            # uint8 and bool index tensors are masks to torch, no ids
            raise self._held.refuse(f"aten.index.Tensor: an index tensor of dtype {idx.dtype} "
                                    f"(a mask, for uint8 and bool) picks no box (answered "
                                    f"lazily: one int64 or int32 index tensor that is one "
                                    f"run, as vLLM's local expert ids)", self._box)
        ok = (isinstance(idx, torch.Tensor) and not isinstance(idx, GlobalShapeTensor)
              and idx.dim() == 1 and len(idx) > 0
              and all(i is None for i in indices[lead + 1:]) and lead < self.dim())
        if ok:
            n = self.shape[lead]
            vals = [int(v) for v in idx.tolist()]
            if all(-n <= v < n for v in vals):
                vals = [v % n for v in vals]
                if vals == list(range(vals[0], vals[0] + len(vals))):
                    return self._slice(lead, vals[0], vals[0] + len(vals), 1)
        what = (f"indices {idx.tolist()[:16]} of dim {lead}" if ok else "this index")
        raise self._held.refuse(f"aten.index.Tensor: {what} are out of range or not a "
                                f"contiguous ascending run, so they pick no box (answered "
                                f"lazily: one index tensor that is one run, as vLLM's local "
                                f"expert ids)", self._box)

    def _zero(self) -> "GlobalShapeTensor":
        """``zero_``: the box reads as zeros from now on, in every view of the tensor this
        view aliases (the checkpoint tensor, or a copy); the local data is kept as read.
        Returns this view, as in-place ops do."""
        if all(a < b for a, b in self._box):
            self._zeroed.append(self._box)
        return self

    def _split(self, sizes: list[int], d: int) -> list["GlobalShapeTensor"]:
        out, at = [], 0
        for s in sizes:
            out.append(self._slice(d, at, at + s, 1))
            at += s
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        out = cls._answer(func, args, kwargs)
        if func is aten.zero_.default or not isinstance(out, (GlobalShapeTensor, tuple, list)):
            return out
        copy = func.overloadpacket in (aten.clone, aten.index)    # torch returns new tensors
        # (detach too: ``.data`` dispatches it and gives the result a counter of its own)
        if (torch.is_inference_mode_enabled() and not copy and func is not aten.detach.default
                and not args[0].is_inference()):
            # torch ties a view to its base's version counter after this returns, which an
            # inference-mode view of a tensor made outside inference mode cannot take: its
            # bare error named no tensor. A copy (clone, index) has no base to tie to, and a
            # copy_ of the whole tensor works there, as on a plain tensor.
            raise args[0]._held.refuse(
                f"{func} of a checkpoint tensor under torch.inference_mode(), where its views "
                f"cannot be taken; load the weights outside inference mode (torch.no_grad() "
                f"is enough)", args[0]._box)
        # the same op on meta tensors: torch's own checks, strides and storage offsets
        meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        if isinstance(out, GlobalShapeTensor):
            return out._layout(meta, copy=copy)
        return type(out)(o._layout(m, copy=copy) for o, m in zip(out, meta, strict=True))

    @classmethod
    def _answer(cls, func, args, kwargs):
        """The op's result with the views' own layout (or the op's value, for copy_)."""
        pkt = func.overloadpacket
        if pkt is aten.copy_:
            dst, src = args[0], args[1]
            if isinstance(dst, GlobalShapeTensor):
                raise dst._held.refuse("writing into a checkpoint tensor", dst._box)
            out = dst.copy_(src.materialize(record=False), *args[2:], **kwargs)
            # consumed once copied: a copy torch refused (shapes that do not broadcast)
            # used nothing, and a loader that went on past it left the elements unused
            src._held.consumed.append(src._box)
            return out
        self = args[0]
        if not isinstance(self, GlobalShapeTensor):
            raise _refusal(func, args, kwargs, next(a for a in tree_leaves((args, kwargs))
                                                     if isinstance(a, GlobalShapeTensor)))
        a = list(args[1:])

        def arg(i: int, name: str, default):
            return a[i] if len(a) > i else kwargs.get(name, default)

        if pkt is aten.slice:
            return self._slice(arg(0, "dim", 0), arg(1, "start", None), arg(2, "end", None),
                               arg(3, "step", 1))
        if pkt is aten.narrow:
            start = arg(1, "start", 0)
            return self._slice(arg(0, "dim", 0), start, start + arg(2, "length", 0), 1)
        if pkt is aten.select:
            return self._select(arg(0, "dim", 0), arg(1, "index", 0))
        if pkt is aten.unbind:
            d = self._sized_dim(arg(0, "dim", 0), "unbind")
            return tuple(self._select(d, i) for i in range(self.shape[d]))
        if pkt is aten.unsqueeze:
            return self._unsqueeze(arg(0, "dim", 0))
        if pkt is aten.squeeze:
            d = arg(0, "dim", None)
            ds = range(self.dim()) if d is None else ([d] if isinstance(d, int) else d)
            return self._squeeze(ds)
        if pkt is aten.split or pkt is aten.split_with_sizes:
            d = self._sized_dim(arg(1, "dim", 0), "split")
            n = self.shape[d]
            sz = arg(0, "split_size", None) if pkt is aten.split else arg(0, "split_sizes", None)
            if isinstance(sz, int):
                if sz < 0 or (sz == 0 and n > 0):  # as torch refuses it
                    raise self._held.refuse(f"split size {sz} of dim {d} of size {n} (torch "
                                            f"takes a positive size, or 0 for a size-0 dim)",
                                            self._box)
                # a size-0 dim splits into one empty chunk
                sz = [min(sz, n - s) for s in range(0, n, sz)] if n else [0]
            elif sum(sz) != n or any(s < 0 for s in sz):
                # torch refuses these too: a view of other offsets must not pass for one
                raise self._held.refuse(f"split sizes {list(sz)} of dim {d} do not add up to "
                                        f"its size {n}", self._box)
            return self._split(list(sz), d)
        if pkt in (aten.detach, aten.alias, aten.clone):
            return self._view(self._box, self._dims)
        if pkt is aten.permute:
            return self._permute(list(arg(0, "dims", ())))
        if pkt is aten.transpose:
            return self._transpose(arg(0, "dim0", 0), arg(1, "dim1", 1))
        if pkt is aten.t:
            if self.dim() > 2:
                raise self._held.refuse(f"t() expects a tensor with <= 2 dimensions, but this "
                                        f"view is {self.dim()}-d", self._box)
            return self._transpose(0, 1) if self.dim() == 2 else self._view(self._box, self._dims)
        if pkt is aten.index and func is aten.index.Tensor:
            return self._index(list(arg(0, "indices", [])))
        if func is aten.zero_.default:
            return self._zero()
        # not view.dtype: it reinterprets the bytes, which is no box of elements.
        # _unsafe_view aliases its input as view does (reshape calls it on the clone it
        # made when a view could not be had), so neither is a copy in __torch_dispatch__
        if func in (aten.view.default, aten._unsafe_view.default):
            out = self._reshape(arg(0, "size", ()))
            if out is not None:
                return out
        raise _refusal(func, args, kwargs, self)


# the in-place ops that write the whole of the tensor they are given (a view of a
# parameter): what the weight loaders fill parameters with, from a checkpoint tensor
# (copy_ out of a GlobalShapeTensor) or a constant (vLLM zeroes a padded vocab's rows)
_FILLS = frozenset((aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default))


class _CountWrites(TorchDispatchMode):
    def __init__(self, counts: dict[int, int]):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dst = args[0] if func in _FILLS and args else None
        # a copy counts when it is out of the checkpoint: one from a plain tensor may be
        # computed from the parameter's own memory (vLLM's composed_weight_loader rewrites
        # a whole parameter from itself), which would count rows never filled
        if (isinstance(dst, torch.Tensor) and not isinstance(dst, GlobalShapeTensor)
                and dst.device.type != "meta"
                and (func is not aten.copy_.default or isinstance(args[1], GlobalShapeTensor))):
            try:
                key = dst.untyped_storage().data_ptr()
            except RuntimeError:   # a wrapper subclass without storage of its own
                return out
            self.counts[key] = self.counts.get(key, 0) + dst.numel()
        return out


@contextlib.contextmanager
def recording_writes():
    """Count, per destination storage (by its data pointer), the elements the block's
    copies out of GlobalShapeTensors and fill_/zero_ calls write into plain tensors (the
    dict yielded)."""
    counts: dict[int, int] = {}
    with _CountWrites(counts):
        yield counts


def _refusal(func, args, kwargs, view: GlobalShapeTensor) -> FitError:
    """``refuse_op`` for an op not answered: named by the checkpoint tensor it would change
    (``_written``), else by ``view``. Only refusals walk the op's schema for that."""
    written = _written(func, args, kwargs)
    return refuse_op(func, written[0] if written else view, writes=bool(written))


LAZY = ("narrow/slice/select/unbind/squeeze/unsqueeze/split/chunk/detach/transpose/permute "
        "and view/reshape that only insert or remove size-1 dims give views, index by a "
        "contiguous run/clone/contiguous give copies, zero_ writes zeros, copy_ reads them "
        "out")


def _written(func, args, kwargs) -> list[GlobalShapeTensor]:
    """The GlobalShapeTensors among the arguments ``func`` writes (``self`` of an
    in-place op, ``out=``), per its schema."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            out.extend(x for x in tree_leaves(v) if isinstance(x, GlobalShapeTensor))
    return out


def _to_meta(x):
    return x._meta if isinstance(x, GlobalShapeTensor) else x


def refuse_op(func, t: GlobalShapeTensor, *, writes: bool) -> FitError:
    """The FitError for an op a GlobalShapeTensor does not answer: which op, and whether
    it changes ``t`` in place, needs elements this rank does not hold (a loader computing
    before narrowing) or would only compute on held ones (an op this class does not
    answer)."""
    if writes:
        why = (f"{func} changes a checkpoint tensor in place (of the in-place ops only "
               f"zero_ is answered)")
    elif t._held.holds(t._box):
        why = (f"{func} is not answered on a checkpoint tensor, although this rank holds "
               f"every element of the box (only {LAZY})")
    elif t._held.holds(t._box, t._zeroed):
        why = (f"{func} is not answered on a checkpoint tensor, although every element of "
               f"the box is held by this rank or was zeroed (only {LAZY})")
    else:
        why = (f"{func} would read or compute on elements this rank does not hold: the "
               f"loader computes before narrowing the tensor to this rank's slice "
               f"(only {LAZY})")
    if torch.is_inference_mode_enabled():
        why += ("; under torch.inference_mode() torch hands composite ops (reshape, chunk, "
                "flatten, movedim) here whole: load outside it (torch.no_grad() is enough)")
    return t._held.refuse(why, t._box)


def full(held: HeldTensor) -> Box:
    return tuple((0, s) for s in held.global_shape)


def global_tensor(name: str, local: torch.Tensor, ts: TensorSlice, *,
                  rank: int | None = None) -> GlobalShapeTensor:
    """The global-shape view of one planned tensor: ``local`` is what the engine loaded
    for ``ts`` (local shape, pieces at their planned destinations)."""
    if tuple(local.shape) != tuple(ts.local_shape) or local.dtype != torch_dtype(ts.dtype):
        raise FitError(f"local tensor is {local.dtype} {list(local.shape)}, the plan says "
                       f"{ts.dtype} {list(ts.local_shape)}", tensor=name, rank=rank)
    held = HeldTensor(name, tuple(ts.global_shape), local, tuple(ts.pieces), rank)
    meta = torch.empty(held.global_shape, dtype=local.dtype, device="meta")
    return GlobalShapeTensor(held, full(held), tuple(range(len(ts.global_shape))),
                             held.zeroed, meta)


class Unconsumed(NamedTuple):
    name: str
    boxes: tuple[Box, ...]    # held boxes (or parts of them) no loader copied out
    numel: int


def unconsumed(tensors: Mapping[str, GlobalShapeTensor]) -> list[Unconsumed]:
    """Exact fit, the second half: held elements no loader used, per tensor."""
    out = []
    for name, t in sorted(tensors.items()):
        left = t._held.unconsumed()
        if left:
            out.append(Unconsumed(name, tuple(left), sum(box_numel(b) for b in left)))
    return out

