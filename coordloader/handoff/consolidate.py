"""``python -m coordloader.consolidate SHARDED OUT``: turn any checkpoint the reader
understands (coordloader's sharded format, or plain HF) into a plain HF checkpoint: one
tensor per name, shards split by size, the standard ``model.safetensors.index.json``.

Memory stays bounded by the block size, or one row of a tensor where a row is larger
(a block is at least one row): every output file is first created at its
final size with a hole for the data (``write_safetensors(..., sparse=True)``), then each
tensor is assembled one *row block* (a range of dim 0) at a time from the source pieces
that overlap it, read with ``preadv`` and written with ``pwrite`` into its region. At most
one block plus one piece slab of it is in memory (and the block before it, digested on a
thread, where the source has a manifest to hold the copy against). Publishing is ``handoff/publish.py``'s:
staging directory inside OUT, fsync, then the moves under a marker, index last.

The source is read as the engines read a checkpoint: every source file is opened once,
before anything is written, and checked to be the file whose header the metadata was read
from (``refuse_changed``); every read goes through those descriptors. The files copied or
read beside the data (config.json, tokenizer files, the manifest, the index) are opened
then too, their identity and a digest of their bytes recorded; the companions are copied
from those descriptors. Before the publish the source is checked again: no publish marker,
each data file the one read, each of those files unchanged at its path (the same identity,
or, where only that moved, as a chmod, a hard link, a touch or a rewrite with the same
bytes moves it, the same bytes as when opened). A save into the source directory while
this runs (whose manifest or config would be copied beside the old data) is refused,
never mixed in.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from math import prod

import numpy as np

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.fileio import OpenFiles, fsync_dir, pread_into, pwrite_all
from coordloader.checkpoint.formats import HF_INDEX, HF_INDEX_SUFFIX, SHARDED_INDEX
from coordloader.checkpoint.metadata import CheckpointMeta, TensorInfo, box_shape, check_extents
from coordloader.checkpoint.reader import (
    MAX_HF_INDEX,
    MAX_JSON_FILE,
    open_regular,
    read_small_file,
    refuse_interrupted,
    stat_key,
)
from coordloader.engines import (
    descriptor_room,
    on_host_default_device,
    refuse_changed,
    refuse_changed_path,
)
from coordloader.errors import CheckpointError, LoadError, SaveError
from coordloader.handoff.publish import (
    MAX_COMPANION_BYTES,
    check_sizes,
    companion_files,
    companion_path,
    config_supplies_tokenizer,
    end_stage,
    os_error,
    output_dir,
    prepare_target,
    publish,
    publish_error,
    resolve_config,
    stage_config,
    sync_companion_dirs,
    tokenizer_companion,
    write_json_durable,
    writer_error,
)
from coordloader.handoff.save import staged_manifest
from coordloader.text import first_items
from coordloader.verify.manifest import MANIFEST_NAME

DEFAULT_BLOCK_BYTES = 64 * 2**20
_NP_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class ConsolidateResult:
    out_dir: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float


def iter_row_blocks(t: TensorInfo, src: OpenFiles, block_bytes: int = DEFAULT_BLOCK_BYTES):
    """Yield (row_start, numpy block of raw element bits) covering ``t`` along dim 0; each
    block is assembled from the overlapping source pieces (sweep over pieces sorted by
    their dim-0 start, so no all-pairs overlap test)."""
    isz = itemsize(t.dtype)
    npdt = _NP_BITS[isz]
    if len(t.shape) == 0:
        (p,) = t.pieces
        buf = np.empty((), dtype=npdt)
        pread_into(src.fd(p.file), memoryview(buf.reshape(1).view(np.uint8)), p.start,
                   file=os.path.join(src.root, p.file), tensor=t.name)
        yield 0, buf
        return
    rows = t.shape[0]
    row_elems = prod(t.shape[1:])
    rows_per_block = max(1, block_bytes // max(1, row_elems * isz))
    pieces = sorted(t.pieces, key=lambda p: p.box[0][0])
    active, nxt = [], 0  # sweep: pieces whose dim-0 range may overlap the current block
    for r0 in range(0, rows, rows_per_block):
        r1 = min(rows, r0 + rows_per_block)
        block = np.empty((r1 - r0,) + tuple(t.shape[1:]), dtype=npdt)
        while nxt < len(pieces) and pieces[nxt].box[0][0] < r1:
            active.append(pieces[nxt])
            nxt += 1
        active = [p for p in active if p.box[0][1] > r0]
        for p in active:
            (a, b) = p.box[0]
            i0, i1 = max(a, r0), min(b, r1)
            if i0 >= i1:
                continue
            pshape = box_shape(p.box)
            slab = prod(pshape[1:]) * isz
            part = np.empty((i1 - i0,) + tuple(pshape[1:]), dtype=npdt)
            if part.size:
                pread_into(src.fd(p.file), memoryview(part.reshape(-1).view(np.uint8)),
                           p.start + (i0 - a) * slab, file=os.path.join(src.root, p.file),
                           tensor=t.name)
            idx = (slice(i0 - r0, i1 - r0),) + tuple(slice(x, y) for x, y in p.box[1:])
            block[idx] = part
        yield r0, block
    if rows == 0:
        yield 0, np.empty(tuple(t.shape), dtype=npdt)


def read_full(meta: CheckpointMeta, name: str):
    """The whole tensor ``name`` as a torch tensor (tests, small tools)."""
    import torch

    from coordloader.checkpoint.dtypes import torch_dtype
    t = meta.tensors[name]
    if t.numel == 0:
        return torch.empty(t.shape, dtype=torch_dtype(t.dtype))
    src = OpenFiles(meta.root)
    try:
        blocks = [b for _, b in iter_row_blocks(t, src, 1 << 62)]
    finally:
        src.close()
    arr = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    raw = torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy())
    return raw.view(torch_dtype(t.dtype)).reshape(t.shape)


_DURING = "the consolidate"


def _source_error(detail: str, path: str) -> SaveError:
    return SaveError(f"reading the source: {detail}; the output directory was left as it was",
                     file=path)


def _refuse_publishing(meta: CheckpointMeta) -> None:
    """The readers' refusal of a directory holding the publish marker, as a SaveError
    naming the source directory: a save into it is publishing (or was killed doing so), so
    its data files may still be the previous save's while its config.json, manifest or
    tokenizer files are already the new one's."""
    try:
        refuse_interrupted(meta.root)
    except CheckpointError as e:
        raise _source_error(e.message, meta.root) from None


def _open_sources(meta: CheckpointMeta) -> OpenFiles:
    """Every source file of ``meta`` opened once, each checked (``refuse_changed``, the
    engines' check) to be the file whose header ``meta`` was read from. SaveError naming
    the source file and what changed otherwise, or the source directory while a save into
    it is publishing."""
    _refuse_publishing(meta)
    infos = {f.name: f for f in meta.files}

    def check(path: str, fd: int, name: str) -> None:
        info = infos.get(name)
        if info is None:   # a piece names a file the metadata does not list: never read it
            raise _source_error("not a file of the checkpoint's metadata", path)
        try:
            refuse_changed(path, fd, info, None, during=_DURING)
        except LoadError as e:
            raise _source_error(e.message, path) from None

    srcs = OpenFiles(meta.root, check)
    try:
        for f in meta.files:
            path = os.path.join(meta.root, f.name)
            try:
                srcs.fd(f.name)
            except OSError as e:
                raise _source_error(f"cannot open: {e.strerror}", path) from None
    except BaseException:
        srcs.close()
        raise
    return srcs


# name: (descriptor, identity, sha256 of its bytes when opened, or None past the cap)
Described = dict[str, tuple[int, tuple[int, ...], bytes | None]]


def _fd_digest(fd: int, limit: int) -> bytes | None:
    """sha256 of the bytes of the file open on ``fd``, read in bounded chunks; None when it
    holds more than ``limit`` bytes (then only its identity is compared)."""
    h, off = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 16, off):   # small chunks: memory stays bounded
        off += len(chunk)
        if off > limit:
            return None
        h.update(chunk)
    return h.digest()


# descriptors for the files opened beside the data (config.json, tokenizer files, the
# manifest, the index), past the data files' own
_SIDE_FILES = 32


def _open_described(meta: CheckpointMeta, fds: Described,
                    tokenizer_elsewhere: bool = False) -> list[str]:
    """Open, into ``fds`` (name: descriptor, identity, digest), every file of the source
    that is not data but is copied or read beside it: the companion files (config.json,
    tokenizer files ...), the manifest, the index. Opened with the data files, before
    anything is written: the companions are copied from these descriptors, and
    ``_recheck_sources`` compares each path's identity with the one recorded here and,
    where that moved, its bytes with the digest recorded here. These files are small
    (companions at most MAX_COMPANION_BYTES, the index and manifest the reader's cap).
    Returns the companions' names (what travels along): without those of the tokenizer's
    kind where ``tokenizer_elsewhere`` (``config=`` supplies them)."""
    data = {f.name for f in meta.files}
    companions = [n for n in companion_files(meta.root, data)
                  if not (tokenizer_elsewhere and tokenizer_companion(n))]
    names = set(companions)
    try:
        listing = os.listdir(meta.root)
    except OSError as e:
        raise _source_error(f"cannot list the source directory: {e.strerror}", meta.root) from None
    names |= {n for n in listing if n not in data and (
        n in (MANIFEST_NAME, SHARDED_INDEX) or n.endswith(HF_INDEX_SUFFIX))}
    for name in sorted(names):
        path = os.path.join(meta.root, name)
        try:
            fd, st = open_regular(path, path)   # never blocks; a regular file
        except CheckpointError as e:
            raise _source_error(e.message, path) from None
        fds[name] = (fd, stat_key(st), None)
        limit = MAX_COMPANION_BYTES if name in companions else MAX_JSON_FILE
        try:
            fds[name] = (fd, stat_key(st), _fd_digest(fd, limit))
        except OSError as e:
            raise _source_error(f"cannot read: {e.strerror}", path) from None
    return companions


def _copy_companion(fd: int, dst: str) -> bytes:
    """The companion open on ``fd`` (the file whose identity was recorded) into ``dst``,
    fsynced (the publish renames it). Returns the sha256 of the bytes copied."""
    h = hashlib.sha256()
    with open(dst, "wb") as out:
        off = 0
        while chunk := os.pread(fd, 1 << 16, off):   # small: memory stays bounded
            out.write(chunk)
            h.update(chunk)
            off += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return h.digest()


def _same_bytes(path: str, digest: bytes | None, limit: int) -> bool:
    """Whether the file now at ``path`` holds the bytes whose sha256 is ``digest``: read
    with ``read_small_file`` (a regular file, never blocking on a FIFO, at most ``limit``
    bytes). False where it cannot be read, is larger, or no digest was recorded."""
    if digest is None:
        return False
    try:
        data = read_small_file(path, path, "file", limit)
    except CheckpointError:
        return False
    return hashlib.sha256(data).digest() == digest


def _recheck_sources(meta: CheckpointMeta, described: Described,
                     copied: dict[str, bytes | None] | None = None) -> None:
    """The source still the one read, just before the publish: no save into the source
    directory publishing now or killed while publishing (whose new config.json can sit
    beside the old data files), each data file the one read (the data came through
    descriptors opened first), and each file copied or read beside the data (config.json,
    tokenizer files, manifest, index) unchanged at its path since it was opened with the
    data: the same save's. Unchanged is the same identity, or, where only that moved (a
    chmod, a hard link made by a backup tool, a touch, a replacement with the same bytes),
    the same bytes at the path as when opened; a companion's copy (``copied``: name:
    sha256 of the bytes copied) must hold the bytes opened too."""
    copied = copied or {}
    _refuse_publishing(meta)
    for f in meta.files:
        path = os.path.join(meta.root, f.name)
        try:
            refuse_changed_path(path, f, None, during=_DURING)
        except LoadError as e:
            raise _source_error(e.message, path) from None
    for name, (_, ident, digest) in sorted(described.items()):
        path = os.path.join(meta.root, name)
        try:
            now = stat_key(os.stat(path))
        except OSError as e:
            raise _source_error(f"is gone from its path since the consolidate opened it "
                                f"({e.strerror}): the source changed while it ran; run the "
                                f"consolidate again once the source is saved", path) from None
        # the size when opened bounds the read: a larger file now is other bytes
        size = ident[2]   # stat_key: (dev, ino, size, mtime, ctime)
        if ((name in copied and copied[name] != digest)
                or (now != ident and not _same_bytes(path, digest, size))):
            raise _source_error("changed since the consolidate opened it (another device, "
                                "inode, size, mtime or ctime: replaced or rewritten), so it may "
                                "be another save's than the data read; run the consolidate "
                                "again once the source is saved", path)


def _close_all(srcs: OpenFiles, described: Described, room) -> None:
    srcs.close()
    for fd, _, _ in described.values():
        os.close(fd)
    described.clear()
    room()


def _plan_shards(meta: CheckpointMeta, max_shard_bytes: int) -> list[list[TensorInfo]]:
    shards, cur, size = [], [], 0
    for t in meta.tensors.values():
        nb = t.numel * itemsize(t.dtype)
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nb
    if cur or not shards:
        shards.append(cur)
    return shards


def _data_offsets(path: str) -> tuple[int, dict[str, tuple[int, int]]]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    return 8 + n, {k: tuple(v["data_offsets"]) for k, v in head.items() if k != "__metadata__"}


def _source_manifest(meta: CheckpointMeta):
    """The source's manifest where it is the manifest of these files (None where there is
    none, or it is stale: of other headers). SaveError for one that is malformed or does
    not match the checkpoint's tensors: `manifest --check` and `load --verify digest`
    refuse it, and dropped without a word it left an output with no manifest, exit 0."""
    from coordloader.errors import VerifyError
    from coordloader.verify import manifest as mf
    try:
        return mf.load_manifest(meta.root, meta, skip_stale=True)
    except VerifyError as e:
        raise SaveError(f"reading the source: {e.message}; `manifest --check` and `load "
                        f"--verify digest` refuse it too: regenerate it (`python -m "
                        f"coordloader.manifest {meta.root}`), or remove it to consolidate "
                        f"without one; the output directory was left as it was",
                        file=e.file, tensor=e.tensor) from None


class _Digests:
    """The digest of each tensor as it is copied, summed over its row blocks, to hold
    against the source's manifest: a manifest is carried only for the bytes it describes.
    Its file fingerprint and 16 sampled blocks pass a file rewritten with other values
    between the samples (another training step saved over), and a manifest dropped as
    stale where the samples differ left a corrupt source's output verifying clean."""

    def __init__(self, manifest):
        self.manifest = manifest
        self.got: dict[str, int] = {}
        # one block digested on a thread while the next is read and written (the kernel
        # releases the GIL): one block more in memory at a time
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="consolidate-digest")
        self._pending: Future | None = None

    def add(self, t: TensorInfo, r0: int, block: np.ndarray) -> None:
        self._wait()
        self._pending = self._pool.submit(self._digest, t, r0, block)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _digest(self, t: TensorInfo, r0: int, block: np.ndarray) -> None:
        import torch

        from coordloader.checkpoint.dtypes import bits_dtype
        from coordloader.verify.digest import digest, one_intra_op_thread
        bits = torch.from_numpy(block.reshape(block.shape or (1,))).view(bits_dtype(t.dtype))
        shape = tuple(t.shape) or (1,)   # a 0-d tensor as one element, as digest() takes it
        box = ((r0, r0 + bits.shape[0]),) + tuple((0, n) for n in shape[1:])
        with one_intra_op_thread():   # (the torch routes, without the compiled kernel)
            d = digest(bits, box, shape)
        self.got[t.name] = self.got.get(t.name, 0) + d

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def check(self, meta: CheckpointMeta) -> None:
        from coordloader.verify.digest import MASK64
        self._wait()
        for name in sorted(self.got):
            want = self.manifest.get(name)
            if want is None or want.digest == self.got[name] & MASK64:
                continue
            changed = self.manifest.data_changed()   # (the samples read once)
            hint = self.manifest.changed_hint(changed)
            # the file of the tensor's pieces whose samples show the change, else its only one
            files = sorted({p.file for p in meta.tensors[name].pieces})
            file = next((f for f in files if f in changed), files[0] if len(files) == 1 else None)
            raise SaveError(
                f"the source's bytes of this tensor differ from its manifest "
                f"({self.manifest.path}); nothing written. "
                + (hint[:1].upper() + hint[1:] if hint else
                   f"The checkpoint was changed since the manifest was written (if on purpose, "
                   f"regenerate it: `python -m coordloader.manifest {meta.root}`), or the file "
                   f"is corrupt"),
                file=file, tensor=name)


def _refuse_other_meta(src, meta: CheckpointMeta) -> None:
    """SaveError unless ``meta`` is the metadata of ``src``: the data written is meta's, so
    the metadata of another checkpoint (kept from an earlier step) wrote that checkpoint
    under src's name, and the same-directory check, held against meta's root, let
    ``out == src`` replace src with another model. ``src``'s directory (by real path; the
    file itself is not resolved: a hub snapshot's files are links into its blobs) is
    meta's root, and ``src`` a directory or an index reads no fewer of the files there than
    meta's (one file read by its path beside an indexed checkpoint is not the directory's
    checkpoint); a data file is one of meta's."""
    from coordloader.checkpoint.reader import discover
    try:
        path = os.path.abspath(os.fspath(src))
    except TypeError:
        raise SaveError(f"source {str(src)[:200]!r} is {type(src).__name__}; expected a str "
                        f"or os.PathLike path") from None
    ours = sorted(f.name for f in meta.files)
    is_dir = os.path.isdir(path)
    d, base = (path, None) if is_dir else os.path.split(path)
    same_dir = ok = os.path.realpath(d) == os.path.realpath(meta.root)
    if ok and not (not is_dir and base in ours):
        ok = is_dir or base == SHARDED_INDEX or base.endswith(HF_INDEX_SUFFIX)
        if ok:
            try:
                theirs = set(discover(path).files)
            except CheckpointError:
                theirs = None   # (a source that reads as no checkpoint: the reader's to report)
            # a file of meta's there that the source does not read (one beside an indexed
            # checkpoint); files of meta's gone since (metadata from before a save into the
            # source) are the source check's to report, naming the file
            ok = theirs is None or not any(
                n not in theirs and os.path.lexists(os.path.join(d, n)) for n in ours)
    if not ok:
        what = (f"the checkpoint in {meta.root}" if not same_dir else
                f"{first_items(ours, 3, ', ...')} in {meta.root}")
        raise SaveError(f"meta= is the metadata of {what}, not of the source "
                        f"{os.fspath(src)}; nothing written. Pass the source's own "
                        f"(read_checkpoint(src)), or leave meta= out", file=os.fspath(src))


def _refuse_out_is_source(out_dir: str, src, meta: CheckpointMeta) -> None:
    """SaveError when the output directory is the source's (an overwrite replaced the
    source's files): by real path (a symlink to it), and, where the output exists, by
    identity (a bind mount of it, which the real path does not show). One in the
    source's directory under a checkpoint file's name is ``prepare_target``'s to refuse,
    as for every save."""
    sources = [meta.root, os.fspath(src)]   # (src a path: read or checked above)
    same = any(os.path.realpath(out_dir) == os.path.realpath(s) for s in sources)
    if not same and os.path.exists(out_dir):
        for s in sources:
            try:
                same = same or os.path.samefile(out_dir, s)
            except OSError:   # (a source gone is the reader's to report)
                pass
    if same:
        raise SaveError("output directory is the source checkpoint; choose another directory",
                        file=out_dir)


@on_host_default_device
def consolidate(src: str, out_dir: str, *, max_shard_bytes: int = 5 * 2**30,
                block_bytes: int = DEFAULT_BLOCK_BYTES, overwrite: bool = False,
                meta: CheckpointMeta | None = None, config=None) -> ConsolidateResult:
    """Write ``src`` (any checkpoint the reader accepts, torch DCP's HF sharded output
    included) as a plain HF checkpoint in ``out_dir``. ``config`` (a dict, a path to
    config.json, or a checkpoint directory whose generation config, tokenizer files and
    chat template come too) is written in place of the source's own: DCP's output has
    none, and transformers needs one. A directory holding a tokenizer (tokenizer files,
    chat templates, also under ``additional_chat_templates/``) supplies all files of its
    kind (generation and processor configs too): the source's are not carried, so the
    output never mixes two models' tokenizers; a directory without one (config.json, or
    with generation_config.json) leaves the source's in place. The source's other companions
    (a README, a license) travel as without ``config``. ``meta``, the source's metadata already read, must
    be ``src``'s own (another checkpoint's is refused); the output directory may not be the
    source's. Raises SaveError / CheckpointError naming the file."""
    from coordloader.checkpoint.fileio import write_safetensors
    t0 = time.perf_counter()
    max_shard_bytes, block_bytes = check_sizes(None, max_shard_bytes=max_shard_bytes,
                                               block_bytes=block_bytes)
    cfg = resolve_config(config, None) if config is not None else None
    if meta is None:
        from coordloader.checkpoint.reader import read_checkpoint
        meta = read_checkpoint(src)
    else:
        _refuse_other_meta(src, meta)
    # torch DCP's shapes are the extents of the pieces present: a missing rank's file
    # would be written out as smaller tensors under a config.json that states the sizes
    check_extents(meta, cfg.doc if cfg is not None else None)
    out_dir = output_dir(out_dir)
    _refuse_out_is_source(out_dir, src, meta)
    # every source file opened and checked before anything is written; read only through
    # these, and the companions copied from theirs
    try:   # every source file stays open for the run, as in the cpu engine's load
        room = descriptor_room(len(meta.files) + _SIDE_FILES, None)
    except LoadError as e:
        raise SaveError(e.message, file=meta.root) from None
    try:
        srcs = _open_sources(meta)
    except BaseException:
        room()
        raise
    described: Described = {}
    try:
        companions = _open_described(meta, described, config_supplies_tokenizer(cfg))
        manifest = _source_manifest(meta)   # (refused before anything is written)
        stage = prepare_target(out_dir, overwrite, None, "consolidate-" + uuid.uuid4().hex[:12])
    except BaseException:
        _close_all(srcs, described, room)
        raise
    stage_dir = os.path.join(out_dir, stage)
    digests = None
    try:
        digests = _Digests(manifest) if manifest is not None else None
        shards = _plan_shards(meta, max_shard_bytes)
        n = len(shards)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map, total = {}, 0
        for fname, group in zip(names, shards):
            path = os.path.join(stage_dir, fname)
            entries = [(t.name, t.dtype, list(t.shape), None) for t in group]
            try:
                write_safetensors(path, entries, {"format": "pt"}, sparse=True)
            except SaveError as e:
                raise writer_error(e, fname, None, "creating an output shard") from e
            data_start, offs = _data_offsets(path)
            fd = os.open(path, os.O_RDWR)
            try:
                for t in group:
                    begin = data_start + offs[t.name][0]
                    row_bytes = prod(t.shape[1:]) * itemsize(t.dtype) if t.shape else itemsize(t.dtype)
                    for r0, block in iter_row_blocks(t, srcs, block_bytes):
                        if digests is not None:
                            digests.add(t, r0, block)
                        if block.size:
                            flat = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
                            pwrite_all(fd, memoryview(flat),
                                        begin + r0 * row_bytes)
                    weight_map[t.name] = fname
                    total += t.numel * itemsize(t.dtype)
                os.fsync(fd)
            except OSError as e:
                raise os_error(e, fname, None, "writing an output shard") from e
            finally:
                os.close(fd)
        # Small companion files (config.json, tokenizer files ...) travel along, copied
        # from the descriptors opened with the data; the source index/manifest/data files
        # do not (they describe the source files).
        extras = list(companions)
        copied = {}
        for entry in extras:
            copied[entry] = _copy_companion(described[entry][0], companion_path(stage_dir, entry))
        sync_companion_dirs(stage_dir)
        if cfg is not None:
            extras = sorted(set(extras) | set(stage_config(stage_dir, cfg)))
        # Content is unchanged, so the source's digests carry over, once held against the
        # bytes copied: a manifest for the new files (their fingerprint). A stale source
        # manifest (of other headers) is not carried.
        if digests is not None:
            try:
                digests.check(meta)
            except SaveError:
                # a source saved over while this ran differs from the manifest too: that
                # is what to say, where it is what happened
                _recheck_sources(meta, described, copied)
                raise
            write_json_durable(os.path.join(stage_dir, MANIFEST_NAME),
                               staged_manifest(stage_dir, names, dict(manifest.tensors)))
            extras.append(MANIFEST_NAME)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json_durable(os.path.join(stage_dir, HF_INDEX), index, limit=MAX_HF_INDEX)
        fsync_dir(stage_dir)
        _recheck_sources(meta, described, copied)
        publish(out_dir, stage, names + extras, HF_INDEX)
    except OSError as e:
        raise publish_error(e, out_dir, stage, getattr(e, "filename", None) or out_dir, None,
                            "consolidating") from e
    finally:
        if digests is not None:
            digests.close()
        _close_all(srcs, described, room)
        # after the publish marker the stage holds the new files recover_save moves in
        end_stage(out_dir, stage)
    return ConsolidateResult(out_dir, tuple(names), len(weight_map), total, time.perf_counter() - t0)
