"""``--dump DIR``: each rank writes its local tensors to ``DIR/rank-NNNNN.safetensors``
(checkpoint names, local shapes) with the plan digest in ``__metadata__``, so a load can
be inspected or compared offline with any safetensors reader."""
from __future__ import annotations

import json
import os
from typing import Mapping

import torch

from . import dtypes
from .errors import SaveError


def dump_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank-{rank:05d}.safetensors")


def dump_rank(out_dir: str, rank: int, tensors: Mapping[str, torch.Tensor], *,
              plan_digest: str, layout: dict | None = None, coords: dict | None = None) -> str:
    """Write one rank's tensors; returns the file path. Written atomically (temp file,
    fsync, rename) by ``safetensors_io.write_safetensors``."""
    from .safetensors_io import write_safetensors
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise SaveError(f"cannot create dump directory: {e.strerror}", file=out_dir,
                        rank=rank) from None
    entries = []
    for name in sorted(tensors):
        t = tensors[name]
        if t.device.type != "cpu":
            t = t.cpu()
        entries.append((name, dtypes.from_torch(t.dtype), list(t.shape), t.contiguous()))
    meta = {"format": "pt", "coordloader.plan_digest": plan_digest, "coordloader.rank": str(rank)}
    if layout is not None:
        meta["coordloader.layout"] = json.dumps(layout, sort_keys=True)
    if coords is not None:
        meta["coordloader.coords"] = json.dumps(dict(coords), sort_keys=True)
    path = dump_path(out_dir, rank)
    try:
        write_safetensors(path, entries, meta)
    except SaveError:
        raise
    except OSError as e:
        raise SaveError(f"cannot write dump: {e.strerror}", file=path, rank=rank) from None
    return path
