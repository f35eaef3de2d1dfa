"""What a rank sees of a checkpoint, small enough to compare across ranks.

In a distributed load each rank reads the headers of only a share of the files, and the
assembled metadata (hence the plan digest) comes from those gathered headers: two ranks
pointed at copies with the same shapes but other data (another download, another seed)
agree on the plan and load different bytes. So every rank also fingerprints every file it
may read, itself: its size, the sha256 of its header bytes, and the sha256 of sampled
blocks of its data (``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES``, spread evenly from the
first byte of data to the last; all of it when that is smaller), plus the whole bytes of the
side files (index, manifest) that steer the load. The ranks compare the fingerprints with
the plan digest before any tensor I/O.

Not compared on purpose: mtimes and inodes. Per-node copies of one checkpoint (rsync to
local NVMe) differ in both while holding the same bytes, and refusing them would refuse a
healthy launch. The data samples catch copies whose content differs throughout; an edit
confined to bytes between samples is not caught here: ``--verify digest`` compares every
byte each rank holds with the manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import NamedTuple, Sequence

from coordloader.checkpoint.reader import (
    _pread_exact,
    header_length,
    note_header_seen,
    open_regular,
    read_small_file,
)
from coordloader.errors import CheckpointError
from coordloader.text import format_ranks

SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 4096
ABSENT = -1          # FileIdentity.size of a side file that does not exist on this rank


class FileIdentity(NamedTuple):
    name: str
    size: int             # bytes on disk; ABSENT for a missing side file
    header_sha256: str    # safetensors: the header bytes; a side file: all of its bytes
    sample_sha256: str    # safetensors: the sampled data blocks; "" for a side file

    def differs_in(self, other: "FileIdentity") -> str:
        """Which part differs from ``other``, in words (``""`` when equal)."""
        if self.size != other.size:
            return "size"
        if self.header_sha256 != other.header_sha256:
            return "header" if self.sample_sha256 or other.sample_sha256 else "content"
        if self.sample_sha256 != other.sample_sha256:
            return "data"
        return ""


class CheckpointIdentity(NamedTuple):
    files: tuple[FileIdentity, ...]      # sorted by name

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.files).encode()).hexdigest()


def _sample_offsets(start: int, end: int) -> list[tuple[int, int]]:
    span = end - start
    if span <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return [(start, span)] if span > 0 else []
    step = (span - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1)
    return [(start + i * step, SAMPLE_BYTES) for i in range(SAMPLE_BLOCKS)]


def _safetensors_identity(root: str, name: str, read_from) -> FileIdentity:
    path = os.path.join(root, name)
    fd, st = open_regular(path, name)
    try:
        size = st.st_size
        n = header_length(fd, size, name)
        header = hashlib.sha256(_pread_exact(fd, n, 8, name)).hexdigest()
        if read_from is not None and (size, header) != (read_from.size, read_from.header_sha256):
            what = "size" if size != read_from.size else "header"
            raise CheckpointError(f"file's {what} is not what it was when the metadata handed "
                                  f"in was read: it changed since; read the checkpoint again",
                                  file=name)
        # the engines refuse this file if it changes from now on, also where another
        # rank parsed its header
        note_header_seen(path, st, header, replace=read_from is None)
        return FileIdentity(name, size, header, _sample_sha256(fd, 8 + n, size, name))
    finally:
        os.close(fd)


def _sample_sha256(fd: int, start: int, size: int, name: str) -> str:
    sample = hashlib.sha256()
    for off, length in _sample_offsets(start, size):
        sample.update(_pread_exact(fd, length, off, name))
    return sample.hexdigest()


def data_sample_sha256(root: str, name: str) -> str:
    """The sha256 of the sampled data blocks of safetensors file ``name`` under ``root``
    (``FileIdentity.sample_sha256``): it tells apart two files of the same header whose
    values differ throughout, such as two training steps of one model."""
    fd, st = open_regular(os.path.join(os.fspath(root), name), name)
    try:
        return _sample_sha256(fd, 8 + header_length(fd, st.st_size, name), st.st_size, name)
    finally:
        os.close(fd)


def _side_identity(root: str, name: str) -> FileIdentity:
    path = os.path.join(root, name)
    if not os.path.lexists(path):
        return FileIdentity(name, ABSENT, "", "")
    data = read_small_file(path, name, "side file")
    return FileIdentity(name, len(data), hashlib.sha256(data).hexdigest(), "")


def checkpoint_identity(root: str, shards: Sequence[str], side_files: Sequence[str] = (), *,
                        read_from: Sequence | None = None) -> CheckpointIdentity:
    """This rank's fingerprint of the safetensors ``shards`` and ``side_files`` under
    ``root`` (a side file may be absent; that is part of the identity). Each shard is
    noted as seen now (``note_header_seen``), so the engines refuse it if it changes
    from now on. ``read_from``: the FileInfos of metadata read earlier and handed in: a
    shard whose size or header is not its FileInfo's changed since and is refused, and a
    shard is noted only where this process holds no record of that header (one taken
    when the metadata was read must stay to refuse a file changed since; metadata read
    in another process, pickled to spawned ranks, leaves none)."""
    root = os.path.abspath(os.fspath(root))
    expect = {f.name: f for f in read_from or ()}
    files = [_safetensors_identity(root, n, expect.get(n)) for n in shards]
    files += [_side_identity(root, n) for n in side_files if n not in shards]
    return CheckpointIdentity(tuple(sorted(files)))


def identity_mismatch(identities: Sequence[CheckpointIdentity]) -> str | None:
    """None when every rank's identity is the same; else a message naming the first
    differing file (by name), what differs, and which ranks see which version."""
    if len({i.digest() for i in identities}) <= 1:
        return None
    names = sorted({f.name for i in identities for f in i.files})
    for name in names:
        seen = [next((f for f in i.files if f.name == name), None) for i in identities]
        groups: dict[FileIdentity | None, list[int]] = {}
        for r, f in enumerate(seen):
            groups.setdefault(f, []).append(r)
        if len(groups) == 1:
            continue
        versions = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        ref = versions[0][0]
        parts = []
        for f, ranks in versions:
            who = format_ranks(ranks)
            if f is None:
                parts.append(f"{who}: not read")
            elif f.size == ABSENT:
                parts.append(f"{who}: absent")
            else:
                what = f"{f.size} bytes, header {f.header_sha256[:12]}"
                if f.sample_sha256:
                    what += f", data sample {f.sample_sha256[:12]}"
                parts.append(f"{who}: {what}")
        part = next((f.differs_in(ref) for f, _ in versions[1:]
                     if f is not None and ref is not None and f.differs_in(ref)), "presence")
        odd = sorted(r for _, rs in versions[1:] for r in rs)
        return (f"ranks disagree on the checkpoint's identity: file {name} differs in its "
                f"{part} on {format_ranks(odd)} "
                f"({'; '.join(parts)}); every rank must read the same checkpoint (the same "
                f"files, or byte-identical copies)")
    return "ranks disagree on the checkpoint's identity"   # unreachable: digests cover files
