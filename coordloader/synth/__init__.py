"""Synthetic checkpoints with real architecture naming, dtypes and shapes.

    python -m coordloader.synth --arch qwen3_moe --size tiny OUT [--shards N] [--seed S]
        [--metadata-only] [--overwrite]

Writes config.json, the shards (``model-00001-of-0000N.safetensors``) and
``model.safetensors.index.json`` (or one ``model.safetensors``) into OUT, atomically: the
files are built in a sibling temp directory that is renamed to OUT at the end.

Content: every tensor's bytes depend only on (seed, tensor name), never on the sharding, so
the same tensor is identical in any shard layout. Values are finite and small (|x| < 2 for
every float dtype, FP8 included; scales are positive) and never all zero. They are made by
masking counter-based random bits into a fixed exponent range, which runs at memory speed
(the point: ``small`` writes faster than 300 MB/s on 2 cores).

``--metadata-only`` writes the real headers and leaves the data regions as file holes: a
full DeepSeek-V3 (688 GB, 163 shards) takes a few MB of disk and can be read and planned.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import shutil
import threading
import warnings
from collections.abc import Iterator

import numpy as np

from coordloader.checkpoint import dtypes
from coordloader.checkpoint.fileio import fsync_dir, write_file_atomic, write_safetensors_stream
from coordloader.checkpoint.reader import is_checkpoint_file
from coordloader.errors import CoordloaderError, SaveError
from coordloader.synth import archs
from coordloader.text import nul_problem

arch_config = archs.arch_config
arch_tensors = archs.arch_tensors

_CHUNK = 16 << 20  # bytes generated per step: big enough for bulk speed, small for memory

# dtype -> (and-mask, or-bits) applied to each lane of random bits: keeps the sign and the low
# mantissa random, forces the exponent into a small range, so values are finite, not NaN,
# never zero, with magnitude about 2^-7 .. 2^-3 (FP8: 2^-3 .. 2).
_FLOAT_BITS = {
    "BF16": (0x81FF, 0x3C00, 2),
    "F16": (0x8FFF, 0x2000, 2),
    "F32": (0x81FFFFFF, 0x3C000000, 4),
    "F64": (0x803FFFFFFFFFFFFF, 0x3F80000000000000, 8),
    "F8_E4M3": (0x9F, 0x20, 1),
    "F8_E5M2": (0x8F, 0x30, 1),
}


def _lanes(value: int, width: int) -> np.uint64:
    # Repeat a width-byte pattern over the 8 bytes of a uint64 (little-endian lanes).
    out = 0
    for k in range(8 // width):
        out |= value << (8 * width * k)
    return np.uint64(out)


def _masks(dtype: str, positive: bool) -> tuple[np.uint64, np.uint64] | None:
    if dtype == "BOOL":
        return _lanes(0x01, 1), np.uint64(0)
    if dtype not in _FLOAT_BITS:
        return None  # integer dtypes: raw random bits are valid values
    andm, orm, w = _FLOAT_BITS[dtype]
    if positive:
        andm &= ~(1 << (8 * w - 1))  # clear the sign bit
    return _lanes(andm, w), _lanes(orm, w)


def _tensor_key(seed: int, name: str) -> int:
    h = hashlib.blake2b(f"coordloader-synth\0{seed}\0{name}".encode(), digest_size=16)
    return int.from_bytes(h.digest(), "little")


def tensor_chunks(seed: int, name: str, dtype: str, shape, chunk: int = _CHUNK
                  ) -> Iterator[memoryview]:
    """The synthetic bytes of one tensor, in pieces of at most ``chunk`` bytes."""
    nbytes = math.prod(shape) * dtypes.itemsize(dtype)
    if nbytes == 0:
        return
    chunk = max(8, chunk - chunk % 8)  # whole 64-bit words: same stream for any chunk size
    bg = np.random.Philox(key=_tensor_key(seed, name))
    masks = _masks(dtype, positive=name.endswith("_scale_inv"))
    done = 0
    while done < nbytes:
        n = min(chunk, nbytes - done)
        words = bg.random_raw((n + 7) // 8)
        if masks is not None:
            np.bitwise_and(words, masks[0], out=words)
            if masks[1]:
                np.bitwise_or(words, masks[1], out=words)
        yield memoryview(words.view(np.uint8))[:n]
        done += n


def tensor_bytes(seed: int, name: str, dtype: str, shape) -> bytes:
    """All synthetic bytes of one tensor (what ``synthesize`` writes for it)."""
    return b"".join(bytes(c) for c in tensor_chunks(seed, name, dtype, shape))


def _prefetch(it: Iterator, depth: int = 3) -> Iterator:
    """Runs ``it`` in a thread, ``depth`` items ahead: generation (numpy, GIL released)
    overlaps the writes."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(x) -> bool:
        """Queue ``x`` unless the consumer stopped (a blocking put on a full queue would
        hang this thread, and the consumer's join, once nobody reads)."""
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run():
        try:
            for item in it:
                if not put((item, None)):
                    return
            put((end, None))
        except BaseException as e:  # handed to the consumer
            put((end, e))

    t = threading.Thread(target=run, name="synth-gen", daemon=True)
    t.start()
    try:
        while True:
            item, err = q.get()
            if item is end:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
        t.join(timeout=5)


def split_shards(specs: list, count: int) -> list[list]:
    """Splits specs (in order) into exactly ``count`` non-empty contiguous groups of about
    equal bytes, like HF's max_shard_size split but with a fixed count."""
    if count < 1:
        raise CoordloaderError(f"shard count must be >= 1, got {count}")
    if count > len(specs):
        raise CoordloaderError(f"cannot split {len(specs)} tensors into {count} shards")
    sizes = [math.prod(s) * dtypes.itemsize(d) for _, d, s in specs]
    total = sum(sizes)
    groups: list[list] = [[] for _ in range(count)]
    k, cum = 0, 0
    n = len(specs)
    for i, (spec, size) in enumerate(zip(specs, sizes)):
        groups[k].append(spec)
        cum += size
        left_t, left_s = n - i - 1, count - k - 1
        # Move on at the byte target, or when each remaining shard needs one of the rest.
        if left_s > 0 and left_t > 0 and (cum * count >= total * (k + 1) or left_t == left_s):
            k += 1
    return groups


def _file_order(group: list) -> list:
    # As HF safetensors orders a file: larger itemsize first (keeps every tensor aligned to
    # its element size), then by name.
    return sorted(group, key=lambda t: (-dtypes.itemsize(t[1]), t[0]))


def _write_json(path: str, obj, fsync: bool) -> None:
    write_file_atomic(path, (json.dumps(obj, indent=2) + "\n").encode(), fsync=fsync)


def _foreign_entry(out_dir: str) -> str | None:
    """The first entry of ``out_dir`` that is no checkpoint file (a file of another name,
    or a directory), None when there is none: an overwrite deletes OUT whole, and must never
    take the user's own files with it."""
    with os.scandir(out_dir) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if not is_checkpoint_file(e.name) or e.is_dir(follow_symlinks=False):
            return e.name
    return None


def _check_replaceable(out_dir: str, overwrite: bool) -> None:
    if not os.listdir(out_dir):
        return
    if not overwrite:
        raise SaveError("output directory is not empty (pass overwrite=True / --overwrite "
                        "to replace it)", file=out_dir)
    foreign = _foreign_entry(out_dir)
    if foreign is not None:
        raise SaveError(f"output directory holds {foreign!r}, which is not a checkpoint file; "
                        f"overwrite replaces only a directory of checkpoint files (*.safetensors, "
                        f"their index, config.json, the manifest): move it out or choose "
                        f"another directory", file=out_dir)


def _prepare_out(out_dir: str, overwrite: bool) -> None:
    if os.path.islink(out_dir):
        # the final rename would put a directory in the link's place (the link gone, its
        # target left as it was)
        raise SaveError("output path is a symbolic link; pass the directory it points to",
                        file=out_dir)
    if os.path.lexists(out_dir):
        if not os.path.isdir(out_dir):
            raise SaveError("output path exists and is not a directory", file=out_dir)
        _check_replaceable(out_dir, overwrite)


def synthesize(out_dir: str, arch: str, size: str = "tiny", *, shards: int | None = None,
               metadata_only: bool = False, seed: int = 0, overwrite: bool = False,
               fsync: bool = False) -> str:
    """Writes a synthetic ``arch``/``size`` checkpoint into ``out_dir``; returns its path.
    ``overwrite`` replaces an ``out_dir`` that holds checkpoint files only (see
    ``is_checkpoint_file``); any other entry there is refused, never deleted.

    Files are renamed into place (readers never see partial files) but not fsynced unless
    ``fsync``: the data is regenerable from the seed, and fsync would cap the write at the
    disk's sustained speed (measured ~230-275 MB/s here vs ~800 MB/s without).
    """
    if not os.fspath(out_dir):
        # abspath("") is the current directory: an unset shell variable would name it
        raise SaveError("output directory is an empty path")
    if problem := nul_problem("output directory", os.fspath(out_dir)):
        raise SaveError(problem)
    out_dir = os.path.abspath(os.fspath(out_dir))
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        cwd = None
    real = os.path.realpath(out_dir)
    if cwd is not None and (cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep)):
        # the checkpoint is swapped in by renaming a directory over OUT: the caller's
        # current directory would be the one replaced, left deleted and empty
        raise SaveError("output directory is the current directory or holds it; name a "
                        "directory of its own (e.g. ./ckpt)", file=out_dir)
    cfg, specs = archs.arch_tensors(arch, size)
    total = sum(math.prod(s) * dtypes.itemsize(d) for _, d, s in specs)
    count = shards if shards is not None else archs.default_shards(arch, size, total)
    groups = split_shards(specs, count)
    _prepare_out(out_dir, overwrite)

    parent = os.path.dirname(out_dir)
    base = os.path.basename(out_dir)
    work = os.path.join(parent, f".{base}.synth-{os.getpid()}-{threading.get_ident()}")
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    except OSError as e:
        raise SaveError(f"cannot create the output directory: {e.strerror or e}",
                        file=out_dir) from None
    meta = {"format": "pt", "coordloader.synth": f"{arch}/{size}/seed={seed}"
            + ("/metadata-only" if metadata_only else "")}
    try:
        _write_json(os.path.join(work, "config.json"), cfg, fsync)
        names = (["model.safetensors"] if count == 1
                 else [archs.shard_name(arch, i, count) for i in range(count)])
        weight_map: dict[str, str] = {}
        for fname, group in zip(names, groups):
            ordered = _file_order(group)
            chunks = None
            if not metadata_only:
                chunks = _prefetch(c for name, dt, shape in ordered
                                   for c in tensor_chunks(seed, name, dt, shape))
            try:
                write_safetensors_stream(os.path.join(work, fname), ordered, chunks, meta,
                                         fsync=fsync)
            finally:
                if chunks is not None:
                    chunks.close()  # stops the generator thread if the write failed early
            for name, _, _ in group:
                weight_map[name] = fname
        if count > 1:
            _write_json(os.path.join(work, "model.safetensors.index.json"),
                        {"metadata": {"total_size": total},
                         "weight_map": dict(sorted(weight_map.items()))}, fsync)
        _swap_in(work, out_dir, overwrite, fsync)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out_dir


def _swap_in(work: str, out_dir: str, overwrite: bool, fsync: bool = False) -> None:
    # rename(2) replaces an absent or empty directory atomically; a non-empty one (overwrite,
    # checkpoint files only) is moved aside first and deleted after the new one is in place.
    old = None
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not overwrite:  # something appeared in OUT while we were writing
            raise SaveError("output directory became non-empty while writing; nothing replaced",
                            file=out_dir)
        old = work + ".old"
        try:
            os.rename(out_dir, old)
        except OSError as e:
            raise SaveError(f"cannot move the previous contents aside: {e.strerror or e}; "
                            f"nothing replaced", file=out_dir) from None
        if os.path.islink(old):   # OUT was swapped for a link since the check
            _put_back(old, out_dir)
            raise SaveError("output path became a symbolic link while writing; nothing "
                            "replaced", file=out_dir)
        # and once more now that nothing can be added under OUT's name: a file created
        # between the check and the rename is put back with the rest
        foreign = _foreign_entry(old)
        if foreign is not None:
            _put_back(old, out_dir)
            raise SaveError(f"output directory gained {foreign!r}, which is not a checkpoint "
                            f"file, while writing; nothing replaced", file=out_dir)
    try:
        os.rename(work, out_dir)
    except OSError as e:
        if old:
            _put_back(old, out_dir)   # the previous contents back where they were
        raise SaveError(f"cannot move the new checkpoint into place: {e.strerror or e}; "
                        f"nothing replaced", file=out_dir) from None
    if fsync:
        # the rename is an entry of OUT's parent: until that is on disk a crash can lose OUT,
        # every file in it fsynced or not
        fsync_dir(os.path.dirname(out_dir))
    if old:
        _remove_replaced(old, out_dir)


def _remove_replaced(old: str, out_dir: str) -> None:
    """Remove the previous OUT, moved aside to ``old``: its checkpoint files one by one,
    then the directory. What cannot go (a file written into it since, by a process whose
    working directory it was; a file another process holds open on NFS) keeps it, with a
    warning: the new checkpoint is in place, and nothing that is not ours is deleted."""
    left = []
    try:
        names = sorted(os.listdir(old))
    except OSError as e:
        names, left = [], [f"({e.strerror or e})"]
    for n in names:
        p = os.path.join(old, n)
        if is_checkpoint_file(n) and (os.path.islink(p) or not os.path.isdir(p)):
            try:
                os.unlink(p)
            except OSError as e:
                left.append(f"{n} ({e.strerror or e})")
        else:
            left.append(n)
    try:
        os.rmdir(old)
    except OSError:
        warnings.warn(f"{out_dir}: the new checkpoint is in place; the previous one could not "
                      f"be removed whole and is kept in {old} ({', '.join(left[:3]) or 'busy'})",
                      stacklevel=3)


def _put_back(old: str, out_dir: str) -> None:
    """The previous contents of OUT back under its name; SaveError saying where they are
    when that name is taken again meanwhile."""
    try:
        os.rename(old, out_dir)
    except OSError as e:
        raise SaveError(f"cannot put the previous contents back ({e.strerror or e}): they are "
                        f"in {old}", file=out_dir) from None
