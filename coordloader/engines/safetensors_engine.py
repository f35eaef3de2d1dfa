"""Baseline engine over the HF ``safetensors`` library.

For every planned piece it asks ``safe_open(file).get_slice(key)[...]`` for the part of
each overlapping source piece (a plain HF checkpoint has one source piece per tensor;
coordloader's sharded format may have several) and copies it into the preallocated
local tensor. Independent of the plan's byte runs, so it doubles as a cross-check of the
cpu engine and as the benchmark baseline.
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
    fd_path,
    host_out,
    intersect,
    open_checked,
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
                    # The descriptor is closed once safe_open has mapped the file (the
                    # mapping is of the checked inode; safe_open keeps no descriptor):
                    # holding one per file for the whole load ran out of descriptors
                    # (RLIMIT_NOFILE, often 1024) on checkpoints of that many files
                    fd, _ = open_checked(path, fi, rank)
                    try:
                        via = fd_path(fd)
                        try:
                            h = stack.enter_context(safe_open(via or path, framework="pt",
                                                              device="cpu"))
                        except Exception as e:
                            raise LoadError(f"safetensors cannot open it: {_named(e, via, fname)}",
                                            file=fname, rank=rank) from None
                        if via is None:
                            refuse_replaced(path, fd, fi, rank)
                    finally:
                        os.close(fd)
                    vias[fname] = via
                    handles[fname] = h
                return h

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
                        try:
                            sl = handle(sp.file).get_slice(key)
                            rel = tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(ov, sp.box))
                            part = sl[rel] if rel else handle(sp.file).get_tensor(key)
                        except LoadError:
                            raise
                        except Exception as e:
                            raise LoadError(f"safetensors failed to read key {key!r}: "
                                            f"{_named(e, vias.get(sp.file), sp.file)}",
                                            file=sp.file, tensor=ts.name, rank=rank) from None
                        if part.dtype != dt:
                            part = part.view(dt)
                        part = part.reshape(box_shape(ov))
                        n = copy_overlap(dst, pc.src, pc.dst, part, ov)
                        read += n * isz
                        if progress is not None:
                            progress(n * isz)
                tensors[ts.name] = dst
        if device.type != "cpu":
            to_device(tensors, device, out, rank=rank)
        return tensors, LoadStats(engine=self.name, tensors=len(tensors), bytes_read=read,
                                  bytes_held=held, seconds=time.perf_counter() - t0)
