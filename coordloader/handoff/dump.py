"""``--dump DIR``: each rank writes its local tensors to ``DIR/rank-NNNNN.safetensors``
(checkpoint names, local shapes) with the plan digest in ``__metadata__``, so a load can
be inspected or compared offline with any safetensors reader."""
from __future__ import annotations

import json
import os
import re
from typing import Mapping

import torch

from coordloader.checkpoint import dtypes
from coordloader.checkpoint.fileio import write_safetensors
from coordloader.checkpoint.formats import DUMP_PLAN_DIGEST, DUMP_RANK, DUMP_SOURCE
from coordloader.errors import SaveError
from coordloader.handoff.pieces import check_tensor_name
from coordloader.handoff.publish import output_dir
from coordloader.layout import Layout, as_rank
from coordloader.text import MAX_NAME_CHARS, clip, first_items

DUMP_NAME_RE = re.compile(r"rank-(\d{5,})\.safetensors")


def dump_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank-{rank:05d}.safetensors")


def _dump_names(out_dir: str) -> list[str]:
    """The dump files' names in ``out_dir``, in rank order."""
    try:
        names = os.listdir(out_dir)
    except OSError:
        return []
    found = sorted((int(m.group(1)), n) for n in names if (m := DUMP_NAME_RE.fullmatch(n)))
    return [n for _, n in found]


def stale_dumps(out_dir: str, world: int) -> list[str]:
    """Dump files in ``out_dir`` of ranks a world of ``world`` does not have (a dump of
    another layout), in rank order."""
    return [n for n in _dump_names(out_dir)
            if int(DUMP_NAME_RE.fullmatch(n).group(1)) >= world]


def check_dump_target(out_dir: str, rank: int, world: int | None, overwrite: bool,
                      plan_digest: str | None = None, source: str | None = None, *,
                      group: bool = False) -> None:
    """The refusals of ``dump_rank``, checked on every rank before any rank writes (a phase
    of its own): a rank refused while another wrote left a dump of two loads. Rank 0 also
    refuses the files of ranks past ``world`` (left by a dump of another layout) unless
    ``overwrite``; ``dump_rank`` then removes them). ``world`` None: no such check.
    ``plan_digest`` (one process per rank dumping, ``--rank``): without ``overwrite``,
    another rank's file there of another plan (another layout or checkpoint), or of
    another ``source`` (the checkpoint's files' identity: the same headers holding other
    data, as the next training step saved over them), is refused: the directory would
    hold two loads' files. ``group`` (every rank of a group checking at once, before any
    writes): without ``overwrite`` every rank refuses any dump file it sees, and the
    files of ranks past ``world``: a directory of a node's own (node-local disk) held
    another load's files of ranks no rank of that node writes, and kept them."""
    path = dump_path(out_dir, rank)
    if os.path.isdir(path):
        raise SaveError("the dump target is a directory, not a file; remove it or choose "
                        "another --dump DIR", file=path, rank=rank)
    if os.path.lexists(path) and not overwrite:
        raise SaveError("a dump file already exists; pass --overwrite (overwrite=True) to "
                        "replace it", file=path, rank=rank)
    if plan_digest is not None and not overwrite:
        other = next(_other_loads(out_dir, plan_digest, source, skip=rank), None)
        if other is not None:
            name, theirs = other
            # (a file that cannot be read as a dump has no digest to show)
            whose = (f"unreadable as a dump; this load's plan digest {plan_digest[:12]}"
                     if theirs is None else
                     f"plan digest {theirs[:12]}, this load's {plan_digest[:12]}"
                     if theirs != plan_digest else
                     "the same plan over other data: the sampled bytes of its checkpoint's "
                     "files differ from this load's, a checkpoint of the same shapes or the "
                     "files saved over since")
            raise SaveError(f"holds {name}, a dump of another load ({whose}); choose "
                            f"another --dump DIR, or dump every rank of this load with "
                            f"--overwrite (overwrite=True), each rank replacing its own file",
                            file=out_dir, rank=rank)
    if group and not overwrite:
        # (what squats on another rank's name, not a file, is that rank's to refuse)
        found = [n for n in _dump_names(out_dir) if os.path.isfile(os.path.join(out_dir, n))]
        if found:
            raise SaveError(f"holds {found[0]}, the file of an earlier dump (each node's view "
                            f"of the directory is checked: on a disk of its own, files of ranks "
                            f"no rank there writes would stay beside this load's); pass "
                            f"--overwrite (overwrite=True) or choose an empty --dump DIR",
                            file=out_dir, rank=rank)
    stale = (stale_dumps(out_dir, world) if (rank == 0 or group) and world is not None
             else [])
    if stale and not overwrite:
        raise SaveError(f"holds the dump of ranks this layout of {world} rank(s) does not "
                        f"have ({first_items(stale, 4)}); "
                        f"pass --overwrite (overwrite=True) to replace the whole dump",
                        file=out_dir, rank=rank)


def _other_loads(out_dir: str, plan_digest: str, source: str | None, skip: int | None = None):
    """(name, its plan digest) of each dump file in ``out_dir``, in rank order, that is
    not of this load: another plan digest, or another ``source`` (when given), or a
    regular file unreadable as a dump (None for its digest). ``skip``: a rank whose file
    is left out (what squats on a rank's name, not a file, is that rank's to refuse)."""
    from coordloader.checkpoint.reader import read_file_header
    from coordloader.errors import CheckpointError
    for n in _dump_names(out_dir):
        if (skip is not None and int(DUMP_NAME_RE.fullmatch(n).group(1)) == skip
                or not os.path.isfile(os.path.join(out_dir, n))):
            continue
        try:
            meta = dict(read_file_header(out_dir, n).info.metadata)
        except CheckpointError:
            yield n, None
            continue
        theirs = meta.get(DUMP_PLAN_DIGEST)
        if theirs != plan_digest or (source is not None and meta.get(DUMP_SOURCE) != source):
            yield n, theirs


def remove_other_loads(out_dir: str, rank: int, plan_digest: str, source: str | None) -> list[str]:
    """Remove the dump files in ``out_dir`` that are not of this load (``_other_loads``);
    -> their names. For ``--overwrite`` in a group, once every rank has written its own:
    on a node's own disk, an earlier load's files of ranks no rank of that node writes
    stayed beside this load's (on a shared one every file is this load's by then)."""
    gone = []
    for n, _ in list(_other_loads(out_dir, plan_digest, source)):
        path = os.path.join(out_dir, n)
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise SaveError(f"cannot remove an earlier load's dump file: {e.strerror or e}",
                            file=path, rank=rank) from None
        gone.append(n)
    return gone


def dump_rank(out_dir: str, rank: int, tensors: Mapping[str, torch.Tensor], *,
              plan_digest: str, layout: dict | None = None, coords: dict | None = None,
              overwrite: bool = False, world: int | None = None, alone: bool = True,
              source: str | None = None) -> str:
    """Write one rank's tensors; returns the file path. Written atomically (temp file,
    fsync, rename, directory fsync) by ``safetensors_io.write_safetensors``: a reader
    (or a crash, or a full disk) sees the previous file or the new one, never a torn one.
    An existing dump file is replaced only with ``overwrite=True`` (``--overwrite``).
    ``world``: the ranks of the dump; rank 0 removes the files of ranks past it (with
    ``overwrite``; ``check_dump_target`` refuses them otherwise). ``alone``: this process
    dumps one rank by itself, so other ranks' files there must be of the same plan (in a
    group every rank writes its own file at once: not checked, nor read world times).
    ``source``: the identity of the checkpoint's files it was loaded from, recorded and
    (``alone``) compared with the other ranks' files."""
    rank = as_rank(rank, SaveError)
    if isinstance(layout, Layout):   # as every other entry point takes it
        layout = layout.to_dict()
    if hasattr(coords, "as_dict"):   # a rank plan's Coords
        coords = coords.as_dict()
    for what, v in (("layout", layout), ("coords", coords)):
        if v is not None and not isinstance(v, Mapping):
            raise SaveError(f"dump_rank: {what} must be a coordloader.Layout or a dict, got "
                            f"{type(v).__name__}", rank=rank)
    if rank < 0 or (world is not None and rank >= world):
        # (rank=-1 wrote rank--0001.safetensors)
        raise SaveError(f"dump_rank: rank {rank} outside the world of "
                        f"{world if world is not None else 'the dump'}", rank=rank)
    out_dir = output_dir(out_dir, rank)
    for name, t in tensors.items():   # before any file is touched
        check_tensor_name(name, rank)
        if not isinstance(t, torch.Tensor):
            raise SaveError(f"dump_rank: the value of {clip(repr(name), MAX_NAME_CHARS)} is "
                            f"{type(t).__name__}; expected a tensor", tensor=name, rank=rank)
    path = dump_path(out_dir, rank)
    # Checked before any work so a refused dump costs nothing; the rename below is what
    # makes the replacement itself safe.
    check_dump_target(out_dir, rank, world, overwrite, plan_digest if alone else None,
                      source if alone else None)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise SaveError(f"cannot create dump directory: {e.strerror or e}", file=out_dir,
                        rank=rank) from None
    # in a group every rank removes those it sees (a node's own disk holds some of them
    # only); on a shared one two ranks may remove one file
    for n in stale_dumps(out_dir, world) if (rank == 0 or not alone) and world is not None else ():
        try:
            os.unlink(os.path.join(out_dir, n))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise SaveError(f"cannot remove the dump of another layout: {e.strerror or e}",
                            file=os.path.join(out_dir, n), rank=rank) from None
    entries = []
    for name in sorted(tensors):
        t = tensors[name]
        # the writer takes each tensor to host memory as it writes it (one at a time)
        entries.append((name, dtypes.from_torch(t.dtype), list(t.shape), t))
    meta = {"format": "pt", DUMP_PLAN_DIGEST: plan_digest, DUMP_RANK: str(rank)}
    if source is not None:
        meta[DUMP_SOURCE] = source
    if layout is not None:
        meta["coordloader.layout"] = json.dumps(layout, sort_keys=True)
    if coords is not None:
        meta["coordloader.coords"] = json.dumps(dict(coords), sort_keys=True)
    try:
        write_safetensors(path, entries, meta)
    except SaveError as e:
        # keep the writer's message and tensor, add the rank (the CLI names it in the phase
        # message); the writer turns every OSError into a SaveError
        raise SaveError(f"cannot write dump: {e.message}", file=path, tensor=e.tensor,
                        rank=rank) from e
    return path
