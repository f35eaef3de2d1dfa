"""What a training rank holds, as boxes of global tensors: the input of ``save``.

A value of the state dict ``save`` receives is one of

- a plain ``torch.Tensor`` with a plan: the plan's slice of that tensor on this rank
  (``coordloader.load``'s output, modified in place);
- a plain ``torch.Tensor`` without a plan: the whole tensor (held whole by every rank
  that passes it: written once, by the lowest such rank);
- a ``DTensor`` (FSDP2 ``fully_shard``, TP ``parallelize_module``): its boxes come from
  its placements (``Shard``, ``Replicate``, ``_StridedShard``), computed by torch's own
  placement code on index vectors, so no placement is reimplemented here;
- a :class:`Boxed` plain local tensor: the box of the global tensor it holds, for
  training code that shards by hand (FSDP-style dim-0 shards, any other box).

Any set of boxes over the ranks that tiles each tensor exactly once is a checkpoint;
``save`` refuses gaps and overlaps naming the tensor and the ranks.
"""
from __future__ import annotations

import numbers
from typing import Mapping, NamedTuple, Sequence

import torch

from coordloader.checkpoint.dtypes import SUPPORTED, from_torch, itemsize
from coordloader.checkpoint.metadata import Box, box_numel, box_shape, piece_key
from coordloader.checkpoint.reader import not_utf8
from coordloader.engines import layout_kind, uninitialized, wraps_other_tensors
from coordloader.errors import CoordloaderError, SaveError
from coordloader.text import MAX_NAME_CHARS, clip


class Boxed(NamedTuple):
    """A plain local tensor holding ``tensor.shape`` elements of the global tensor of
    ``global_shape``, starting at ``offset`` (one start per dim)."""
    tensor: torch.Tensor
    global_shape: Sequence[int]
    offset: Sequence[int]


class PieceOut(NamedTuple):
    """One box of one tensor this rank may write, and where it sits in the local tensor."""
    name: str
    dtype: str
    shape: tuple[int, ...]     # global shape
    box: Box                   # in the global tensor
    key: str                   # key in the shard file
    nbytes: int
    view: torch.Tensor         # the box's data (a view into the local tensor)
    decided: bool              # primary fixed by a plan; else the lowest rank holding it


def _fmt(shape) -> str:
    return str(list(shape))


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(t, DTensor)


def _runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """(global start, global stop, local start) of the contiguous runs of an index vector."""
    if idx.numel() == 0:
        return []
    vals = idx.tolist()
    out, start, local = [], vals[0], 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[i - 1] + 1:
            out.append((start, vals[i - 1] + 1, local))
            if i < len(vals):
                start, local = vals[i], i
    return out


def dtensor_boxes(name: str, t, rank: int, alone: bool) -> tuple[tuple[int, ...], list[tuple[Box, tuple]]]:
    """(global shape, [(global box, local offset)]) of a DTensor on this rank; no boxes
    where the tensor's mesh leaves this rank out, refused when this rank saves ``alone``
    (the tensor would be left out of the checkpoint). A box replicated over a mesh dim is
    every replica's: the ranks holding it agree on one writer, as for plain tensors."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    mesh, placements = t.device_mesh, t.placements
    gshape = tuple(t.shape)
    coord = mesh.get_coordinate()
    if coord is None:   # this rank is not in the tensor's mesh: it holds nothing
        if alone:
            raise SaveError("is a DTensor whose device mesh leaves this process out: it holds "
                            "none of the tensor, and this save is its only writer; save it "
                            "from a process of its mesh", tensor=name, rank=rank)
        return gshape, []
    idx = [torch.arange(n) for n in gshape]
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise SaveError(f"is a DTensor with a Partial placement on mesh dim {i} (a pending "
                            f"reduction); reduce it first (redistribute to Shard/Replicate, or "
                            f"full_tensor())", tensor=name, rank=rank)
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, _StridedShard)):
            raise SaveError(f"is a DTensor with placement {p!r} on mesh dim {i}; expected Shard, "
                            f"Replicate or _StridedShard", tensor=name, rank=rank)
        d = p.dim
        # torch's own split of a 1-D index vector along dim 0, same kind of placement
        one_d = (_StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard)
                 else Shard(0))
        parts, _ = one_d._split_tensor(idx[d], mesh.size(i), with_padding=False)
        idx[d] = parts[coord[i]]
    local = tuple(int(x.numel()) for x in idx)
    if tuple(t.to_local().shape) != local:
        raise SaveError(f"DTensor of global shape {_fmt(gshape)} with placements {placements}: "
                        f"its local tensor has local shape {_fmt(t.to_local().shape)}, but the "
                        f"placements give local shape {_fmt(local)} on this rank",
                        tensor=name, rank=rank)
    if 0 in gshape:   # no elements, so no runs to box: the empty tensor is one box
        return gshape, [(tuple((0, n) for n in gshape), (0,) * len(gshape))]
    return gshape, _product([_runs(x) for x in idx])


def _product(runs_per_dim: list[list[tuple[int, int, int]]]) -> list[tuple[Box, tuple]]:
    out: list[tuple[Box, tuple]] = [((), ())]
    for runs in runs_per_dim:
        out = [(box + ((a, b),), dst + (loc,)) for box, dst in out for a, b, loc in runs]
    return out


def _local(name, t, rank: int, what: str = "") -> torch.Tensor:
    """``t`` detached, once it is a tensor whose bytes can be written; SaveError naming
    the tensor and the rank otherwise (no bare torch error from deep in the writer)."""
    if not isinstance(t, torch.Tensor):
        raise SaveError(f"{what}is {type(t).__name__}; expected a torch.Tensor", tensor=name,
                        rank=rank)
    if _is_dtensor(t):   # only inside Boxed: a DTensor in the state dict has its own path
        raise SaveError(f"{what}is a DTensor; expected a plain local tensor (pass the DTensor "
                        f"itself, whose placements give its boxes, or Boxed(dtensor.to_local(), "
                        f"...))", tensor=name, rank=rank)
    lazy = uninitialized(t)
    if lazy is not None:
        raise SaveError(f"{what}is {lazy}", tensor=name, rank=rank)
    if wraps_other_tensors(t):
        # a float8 or quantized training weight, any wrapper tensor: a wrapper has no
        # storage (data_ptr 0), and its bytes, if it has any, are not the weight's
        raise SaveError(f"{what}is a {type(t).__name__}, a tensor subclass that wraps others; "
                        f"expected a tensor whose own storage holds its values (unwrap or "
                        f"dequantize it to a plain tensor first)", tensor=name, rank=rank)
    if t.is_meta:
        raise SaveError(f"{what}is on the meta device: it has no data to save (materialise "
                        f"it first)", tensor=name, rank=rank)
    kind = layout_kind(t)
    if kind is not None:   # (a nested tensor failed untyped, on its shape)
        fix = {"negative-bit": ".resolve_neg()", "conjugate-bit": ".resolve_conj()"}.get(
            kind, ".to_dense()")
        raise SaveError(f"{what}is a {kind} tensor; expected a dense tensor (call {fix} "
                        f"first)", tensor=name, rank=rank)
    try:
        from_torch(t.dtype)
    except CoordloaderError:
        raise SaveError(f"{what}has dtype {t.dtype}, which coordloader does not save (its "
                        f"dtypes: {', '.join(SUPPORTED)}); convert it first",
                        tensor=name, rank=rank) from None
    return t.detach()


def _ints(v) -> bool:
    # numpy's integers too (a shape or offset computed from an array)
    return all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in v)


def _piece(name, data, gshape, box, dst, decided) -> PieceOut:
    dt = from_torch(data.dtype)
    view = data
    for d, (s, n) in enumerate(zip(dst, box_shape(box))):
        if s != 0 or n != view.shape[d]:
            view = view.narrow(d, s, n)
    return PieceOut(name, dt, tuple(gshape), tuple(box), piece_key(name, box, tuple(gshape)),
                    box_numel(box) * itemsize(dt), view, decided)


# the module names torch's wrappers add to a state dict taken from the wrapper, not the
# model: torch.compile's, FSDP1's and activation checkpointing's
_WRAPPER_SEGMENTS = {"_orig_mod": "torch.compile's wrapper",
                     "_fsdp_wrapped_module": "FSDP's wrapper",
                     "_checkpoint_wrapped_module": "activation checkpointing's wrapper"}


def _check_wrapper_names(names, rank: int) -> None:
    """SaveError where the names are a wrapper's: the checkpoint would hold no name the
    model has, and from_pretrained of it initialises every weight at random with a table
    of unexpected keys, no error."""
    names = list(names)
    for name in names:
        for seg in name.split("."):
            if seg in _WRAPPER_SEGMENTS:
                raise SaveError(f"tensor name holds {seg!r}, a module {_WRAPPER_SEGMENTS[seg]} "
                                f"adds: the state dict is the wrapper's, not the model's; pass "
                                f"the model's (torch.distributed.checkpoint.state_dict."
                                f"get_model_state_dict(model) leaves wrappers out) or rename "
                                f"the keys", tensor=name, rank=rank)
    if names and all(n.startswith("module.") for n in names):
        raise SaveError("every tensor name starts with 'module.', the prefix "
                        "DistributedDataParallel adds: the state dict is the wrapper's; pass "
                        "model.module.state_dict() (or get_model_state_dict(model))",
                        tensor=names[0], rank=rank)


def check_tensor_name(name, rank: int | None) -> None:
    """A state dict key every reader takes as a tensor name: written, any other would be
    refused by the readers only after the save had replaced the previous checkpoint."""
    if type(name) is not str:
        raise SaveError(f"a state dict key is the {type(name).__name__} "
                        f"{clip(repr(name), MAX_NAME_CHARS)}; expected a tensor name (a str)",
                        rank=rank)
    if not_utf8(name):
        raise SaveError("tensor name holds a lone surrogate (\\ud800-\\udfff), which is not "
                        "UTF-8; expected a UTF-8 name", tensor=name, rank=rank)


def _check_planned(ts, what: str, gshape, dtype, name: str, rank: int) -> None:
    """SaveError where a tensor the plan also slices has another global shape (``gshape``
    None: not stated, a plain tensor's local shape is checked instead) or dtype than the
    plan's (the checkpoint it was loaded from). ``what``: "DTensor ", "Boxed " or ""."""
    from coordloader.checkpoint.dtypes import torch_dtype
    if ts is None:
        return
    if gshape is not None and tuple(ts.global_shape) != tuple(gshape):
        raise SaveError(f"{what}global shape {_fmt(gshape)} differs from the plan's global "
                        f"shape {_fmt(ts.global_shape)}", tensor=name, rank=rank)
    if dtype != torch_dtype(ts.dtype):
        raise SaveError(f"{what}dtype {dtype} differs from the checkpoint dtype {ts.dtype} "
                        f"({torch_dtype(ts.dtype)}); convert before saving", tensor=name,
                        rank=rank)


def collect_pieces(tensors, rank_plan, rank: int, alone: bool = False) -> list[PieceOut]:
    """Every piece this rank holds, from the plan's slices (plain tensors), the
    placements (DTensors) or the boxes given (``Boxed``); a plain tensor without a plan
    is whole. Vocab padding rows of a plan's slice are covered by no piece: never written.
    ``alone``: no other process saves (local mode)."""
    if isinstance(tensors, torch.nn.ParameterDict):   # a mapping in all but its type
        tensors = dict(tensors.items())
    if not isinstance(tensors, Mapping):
        hint = " (pass module.state_dict())" if isinstance(tensors, torch.nn.Module) else ""
        raise SaveError(f"save() needs a state dict, a mapping of names to tensors; got "
                        f"{type(tensors).__name__}{hint}", rank=rank)
    for name in tensors:
        check_tensor_name(name, rank)
    _check_wrapper_names(tensors, rank)
    out: list[PieceOut] = []
    planned = {ts.name: ts for ts in rank_plan.tensors} if rank_plan is not None else {}
    for ts in planned.values():
        if ts.replica == 0 and ts.name not in tensors:
            raise SaveError("the plan gives this rank a primary slice of the tensor, but it is "
                            "missing from the tensors passed to save()", tensor=ts.name, rank=rank)
    for name, v in tensors.items():
        if _is_dtensor(v):
            gshape, boxes = dtensor_boxes(name, v, rank, alone)
            _check_planned(planned.get(name), "DTensor ", gshape, v.dtype, name, rank)
            if boxes:
                local = _local(name, v.to_local(), rank, "the DTensor's local tensor ")
                if 0 in gshape:   # the whole empty tensor, whatever this rank's share
                    local = local.new_empty(gshape)
                out += [_piece(name, local, gshape, b, d, False) for b, d in boxes]
            continue
        if isinstance(v, Boxed):
            t = _local(name, v.tensor, rank, "the Boxed tensor ")
            gshape, off = tuple(v.global_shape), tuple(v.offset)
            if not (_ints(gshape) and _ints(off)):
                raise SaveError(f"Boxed global shape {list(gshape)} and offset {list(off)} must be "
                                f"integers", tensor=name, rank=rank)
            gshape, off = tuple(map(int, gshape)), tuple(map(int, off))
            if len(off) != t.dim() or len(gshape) != t.dim() or any(
                    o < 0 or o + s > g for o, s, g in zip(off, t.shape, gshape)):
                raise SaveError(f"Boxed local shape {_fmt(t.shape)} at offset {_fmt(off)} does "
                                f"not fit in the global shape {_fmt(gshape)}", tensor=name, rank=rank)
            _check_planned(planned.get(name), "Boxed ", gshape, t.dtype, name, rank)
            box = tuple((o, o + s) for o, s in zip(off, t.shape))
            out.append(_piece(name, t, gshape, box, (0,) * t.dim(), False))
            continue
        if not isinstance(v, torch.Tensor):
            raise SaveError(f"expected a torch.Tensor, DTensor or coordloader Boxed, got "
                            f"{type(v).__name__}", tensor=name, rank=rank)
        t = _local(name, v, rank)
        ts = planned.get(name)
        if rank_plan is None:
            out.append(_piece(name, t, t.shape, tuple((0, n) for n in t.shape), (0,) * t.dim(),
                              False))
            continue
        if ts is None:
            raise SaveError("is not in the plan's slices for this rank; pass it as a DTensor or a "
                            "coordloader Boxed tensor (or save without a plan)", tensor=name,
                            rank=rank)
        # a replica (another rank's primary copy) is not written, but one of another shape
        # or dtype is the wrong state passed all the same
        if tuple(t.shape) != tuple(ts.local_shape):
            raise SaveError(f"local shape {_fmt(t.shape)} differs from the plan's local shape "
                            f"{_fmt(ts.local_shape)} (global shape {_fmt(ts.global_shape)})",
                            tensor=name, rank=rank)
        _check_planned(ts, "", None, t.dtype, name, rank)
        if ts.replica != 0:
            continue
        # a copy piece (Piece.copy) is another rank's primary: written once, by that rank
        out += [_piece(name, t, ts.global_shape, pc.src, pc.dst, True) for pc in ts.pieces
                if not pc.copy]
    return out


def disagreement(name: str, first: tuple[str, Sequence[int], int],
                 other: tuple[str, Sequence[int], int]) -> SaveError:
    """The refusal of two ranks' pieces of ``name`` with different (dtype, global shape,
    rank): the index can record one view of a tensor only, and whichever it kept, the
    other rank's bytes would be read as something they are not."""
    (dt_a, sh_a, r_a), (dt_b, sh_b, r_b) = first, other
    return SaveError(f"ranks disagree on dtype / global shape ({dt_a} {list(sh_a)} on rank "
                     f"{r_a} vs {dt_b} {list(sh_b)} on rank {r_b}); expected one dtype and "
                     f"global shape for the tensor on every rank", tensor=name)


def undecided(pieces: list[PieceOut]) -> list[tuple[str, Box, str, tuple[int, ...]]]:
    """The (name, box, dtype, global shape) of the pieces whose writer the ranks still have
    to agree on. Dtype and shape travel with the box: of the ranks holding one box only
    the lowest writes it, so the others' view of the tensor is compared here or never."""
    return [(p.name, p.box, p.dtype, p.shape) for p in pieces if not p.decided]


def keep_primaries(pieces: list[PieceOut], held: list[list[tuple]], rank: int) -> list[PieceOut]:
    """Drop the undecided pieces a lower rank also holds (the same box of the same
    tensor): every replicated box is written once, by the lowest rank holding it.
    ``held[r]``: rank r's (name, box, dtype, global shape) as ``undecided`` gives them.
    SaveError (``disagreement``) where two ranks hold one box under different dtypes or
    global shapes; every rank sees the same ``held``, so every rank refuses alike."""
    first: dict[tuple[str, Box], tuple[str, tuple[int, ...], int]] = {}
    for r, keys in enumerate(held):
        for name, box, dtype, shape in keys:
            view = (dtype, tuple(shape), r)
            seen = first.setdefault((name, tuple(map(tuple, box))), view)
            if seen[:2] != view[:2]:
                raise disagreement(name, seen, view)
    return [p for p in pieces
            if p.decided or first.get((p.name, p.box), (None, None, rank))[2] == rank]
