"""Baseline engine over the HF ``safetensors`` library.

For every planned piece it asks ``safe_open(file).get_slice(key)[...]`` for the part of
each overlapping source piece (a plain HF checkpoint has one source piece per tensor;
coordloader's sharded format may have several) and copies it into the preallocated
local tensor. Independent of the plan's byte runs, so it doubles as a cross-check of the
cpu engine and as the benchmark baseline.

``safe_open`` maps each file, and ``get_slice(key)[...]`` is a view of that mapping
(safetensors 0.8.0): a read of a page past the end of a file truncated under the mapping
is a SIGBUS that kills the process, which no Python code can catch. The engine keeps each
file's checked descriptor open for the load and, before each piece is taken from a file,
``fstat``s it (``refuse_moved``): a file truncated, or rewritten in place, since its check
is refused with a LoadError naming it. Once every piece is copied each file is checked
once more, so a rewrite during the last reads is refused, not loaded as a mix. What
remains: a truncation between that ``fstat`` and the end of the piece's copy out of the
mapping (``get_slice``, then ``copy_overlap``) still kills the process. The ``cpu``
engine (what ``auto`` picks without CUDA) reads with ``preadv`` and raises a LoadError
for a truncation at any point.
"""
from __future__ import annotations

import os
import re
import time
from contextlib import ExitStack
from typing import Any, Mapping

import torch

from coordloader.checkpoint import dtypes
from coordloader.checkpoint.metadata import CheckpointMeta, box_shape
from coordloader.engines import (
    LoadStats,
    Progress,
    allocate,
    copy_overlap,
    descriptor_room,
    fd_path,
    host_out,
    intersect,
    needed_files,
    open_checked,
    refuse_moved,
    refuse_replaced,
    slice_nbytes,
    to_device,
)
from coordloader.errors import LoadError
from coordloader.planning.model import RankPlan


def _named(e: Exception, via: str | None, fname: str) -> str:
    """``e``'s text with the ``/proc/self/fd/N`` path safe_open was given (``via``) replaced
    by the file's name: the descriptor is closed by then, its number means nothing."""
    msg = str(e)
    return msg if via is None else re.sub(re.escape(via) + r"(?!\d)", fname, msg)


class SafetensorsEngine:
    name = "safetensors"

    def load_rank(self, meta: CheckpointMeta, rank_plan: RankPlan, device: Any = "cpu", *,
                  progress: Progress | None = None,
                  out: Mapping[str, torch.Tensor] | None = None):
        try:
            from safetensors import safe_open
        except ImportError:
            raise LoadError("the safetensors engine needs the 'safetensors' package "
                            "(pip install safetensors)") from None
        t0 = time.perf_counter()
        device = torch.device(device if device is not None else "cpu")
        rank = rank_plan.rank
        tensors: dict[str, torch.Tensor] = {}
        files = {f.name: f for f in meta.files}
        held = read = 0
        with ExitStack() as stack:
            handles: dict[str, Any] = {}
            vias: dict[str, str | None] = {}   # file -> the /proc path safe_open opened
            # file -> (checked descriptor, its fstat as checked), held for the load
            checked: dict[str, tuple[int, os.stat_result]] = {}
            # safe_open keeps no descriptor of its own: one per file is this engine's
            stack.callback(descriptor_room(len(needed_files(meta, rank_plan)), rank))

            def handle(fname: str):
                h = handles.get(fname)
                if h is None:
                    path = os.path.join(meta.root, fname)
                    fi = files.get(fname)
                    if fi is None:
                        raise LoadError("plan reads a file which is not in the checkpoint",
                                        file=fname, rank=rank)
                    # safe_open reads the file's header anew: a file rewritten since the
                    # plan was made would be read under its new layout, unnoticed. It
                    # opens the file it was checked on (the descriptor's /proc path), not
                    # the path again: a new file renamed over it in between would be read.
                    # The descriptor stays open: its fstat is the mapped inode's, wherever
                    # the path points (see unmoved)
                    fd, st = open_checked(path, fi, rank)
                    stack.callback(os.close, fd)
                    checked[fname] = (fd, st)
                    via = fd_path(fd)
                    try:
                        h = stack.enter_context(safe_open(via or path, framework="pt",
                                                          device="cpu"))
                    except Exception as e:
                        raise LoadError(f"safetensors cannot open it: {_named(e, via, fname)}",
                                        file=fname, rank=rank) from None
                    if via is None:
                        refuse_replaced(path, fd, fi, rank)
                    vias[fname] = via
                    handles[fname] = h
                return h

            def unmoved(fname: str) -> None:
                # a file truncated under the mapping is a SIGBUS at the first read past
                # its end, which kills the process: refused here, before the read
                fd, st = checked[fname]
                refuse_moved(fd, st, files[fname], rank)

            host = host_out(out, rank_plan, device, rank=rank)
            for ts in rank_plan.tensors:
                info = meta.tensors.get(ts.name)
                if info is None:
                    raise LoadError("planned tensor is not in the checkpoint", tensor=ts.name,
                                    rank=rank)
                dt = dtypes.torch_dtype(ts.dtype)
                dst = allocate(ts, "cpu", host, rank=rank)
                held += slice_nbytes(ts)
                isz = dtypes.itemsize(ts.dtype)
                for pc in ts.pieces:
                    for sp in info.pieces:
                        ov = intersect(pc.src, sp.box)
                        if ov is None:
                            continue
                        key = sp.key
                        h = handle(sp.file)
                        unmoved(sp.file)
                        try:
                            sl = h.get_slice(key)
                            rel = tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(ov, sp.box))
                            part = sl[rel] if rel else h.get_tensor(key)
                        except Exception as e:
                            unmoved(sp.file)   # a file changed meanwhile: the cause
                            raise LoadError(f"safetensors failed to read key {key!r}: "
                                            f"{_named(e, vias.get(sp.file), sp.file)}",
                                            file=sp.file, tensor=ts.name, rank=rank) from None
                        if part.dtype != dt:
                            part = part.view(dt)
                        part = part.reshape(box_shape(ov))
                        # part is a view of the mapping: this copy is the read
                        n = copy_overlap(dst, pc.src, pc.dst, part, ov)
                        read += n * isz
                        if progress is not None:
                            progress(n * isz)
                tensors[ts.name] = dst
            # a rewrite in place during a file's last reads passed the checks before them
            for fname in checked:
                unmoved(fname)
        if device.type != "cpu":
            to_device(tensors, device, out, rank=rank)
        return tensors, LoadStats(engine=self.name, tensors=len(tensors), bytes_read=read,
                                  bytes_held=held, seconds=time.perf_counter() - t0)
