"""Writing safetensors files: exact headers, atomic replace, optional sparse (hole) data.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON (padded with spaces so the data region starts 8-aligned), then the data
region; each tensor's ``data_offsets`` are relative to the data start, contiguous, and the
last one ends at the end of the file.

Two writers share one core:
- ``write_safetensors(path, entries, ...)`` takes in-memory data (bytes / numpy / torch).
- ``write_safetensors_stream(path, specs, chunks, ...)`` takes an iterator of byte chunks
  covering the whole data region in order, so callers (synth) can generate data lazily and
  never hold a large file in memory.
Both write to ``path + ".tmp"`` (made afresh: whatever is there, a link too, is removed
first), fsync, and rename (``_atomic_fd``, also behind ``write_file_atomic`` for small
files): a reader never sees a half-written file.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from coordloader.checkpoint import dtypes
from coordloader.errors import SaveError

_ALIGN = 8
_MAX_WRITE = 1 << 30  # one os.write call stays below 2 GiB (Linux caps a write at ~2 GiB)


def _check_spec(path: str, key: Any, dtype: Any, shape: Any, seen: set[str]) -> int:
    """Validates one (key, dtype, shape) and returns its byte length."""
    if not isinstance(key, str) or not key:
        raise SaveError(f"tensor key must be a non-empty str, got {key!r}", file=path)
    if key == "__metadata__":
        raise SaveError("'__metadata__' is reserved and cannot name a tensor", file=path)
    if key in seen:
        raise SaveError("duplicate tensor key", file=path, tensor=key)
    seen.add(key)
    if not isinstance(dtype, str) or not dtypes.is_known(dtype):
        raise SaveError(f"unknown dtype {dtype!r}; expected one of {', '.join(dtypes.SUPPORTED)}",
                        file=path, tensor=key)
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise SaveError(f"shape must be a list of non-negative ints, got {shape!r}", file=path,
                        tensor=key)
    return math.prod(int(d) for d in shape) * dtypes.itemsize(dtype)


def _layout(path: str, specs: Sequence[tuple[str, str, Sequence[int]]]
            ) -> list[tuple[str, str, list[int], int, int]]:
    seen: set[str] = set()
    out = []
    offset = 0
    for key, dtype, shape in specs:
        n = _check_spec(path, key, dtype, shape, seen)
        out.append((key, dtype, [int(d) for d in shape], offset, offset + n))
        offset += n
    return out


def _header_from_layout(layout, metadata: dict[str, str] | None, path: str = "<memory>") -> bytes:
    head: dict[str, Any] = {}
    if metadata:
        if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SaveError("__metadata__ must be a str -> str map", file=path)
        head["__metadata__"] = dict(metadata)
    for key, dtype, shape, begin, end in layout:
        head[key] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
    # Pad so that 8 (length prefix) + header is a multiple of 8: the data region is aligned.
    raw += b" " * (-len(raw) % _ALIGN)
    return len(raw).to_bytes(8, "little") + raw


def header_bytes(entries: Sequence[tuple], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length prefix plus the padded JSON header for ``entries``.

    ``entries`` are (key, dtype, shape[, data]) tuples; data, if present, is ignored here.
    """
    return _header_from_layout(_layout("<memory>", [tuple(e[:3]) for e in entries]), metadata)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of stride 1 of a contiguous tensor, the same memory (no copy): torch
    calls a one-element tensor contiguous whatever its stride (``b[1::2]`` of a 2-vector),
    and its reshape keeps that stride, which ``view(torch.uint8)`` refuses."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = t.as_strided((1,), (1,), t.storage_offset())
    return flat


def as_bytes(data: Any) -> memoryview:
    """A flat byte view of bytes-like, numpy or torch data (no copy when already contiguous).

    torch tensors of any dtype (bf16, fp8, bool, unsigned) are reinterpreted as uint8 first,
    since numpy has no bf16/fp8 types.
    """
    if isinstance(data, (bytes, bytearray)):
        return memoryview(data)
    if isinstance(data, memoryview):
        return data.cast("B") if data.format != "B" or data.ndim != 1 else data
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = flat_view(t.contiguous())
        if t.numel() == 0:
            return memoryview(b"")
        return memoryview(t.view(torch.uint8).numpy())
    raise TypeError(f"unsupported tensor data type {type(data).__name__}")


def _write_all(fd: int, buf: memoryview) -> None:
    # os.write may write less than asked (signals, large sizes): loop until done.
    buf = buf.cast("B") if buf.format != "B" else buf
    while len(buf):
        n = os.write(fd, buf[:_MAX_WRITE])
        buf = buf[n:]


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (pwrite may write less than asked)."""
    buf = buf.cast("B") if buf.format != "B" else buf
    while len(buf):
        n = os.pwrite(fd, buf[:_MAX_WRITE], offset)
        buf = buf[n:]
        offset += n


def pread_into(fd: int, buf: memoryview, offset: int, *, file: str, tensor: str | None = None,
               error: type = SaveError) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (a short read continues where it stopped).
    End of file or an OS error raises ``error`` naming the file and the tensor read."""
    want, start = len(buf), offset
    while len(buf):
        try:
            n = os.preadv(fd, [buf], offset)
        except OSError as e:
            raise error(f"read of {want} bytes at byte {start} failed: {e.strerror}", file=file,
                        tensor=tensor) from None
        if n <= 0:
            raise error(f"unexpected end of file at byte {offset} while reading {want} bytes at "
                        f"{start}", file=file, tensor=tensor)
        buf = buf[n:]
        offset += n


def fsync_dir(directory: str) -> None:
    """Make the renames into ``directory`` durable (the one directory fsync of the package)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def _commit(tmp: str, path: str, fd: int, fsync: bool = True) -> None:
    """fsync + close ``fd`` (always closed on return or raise), then rename into place."""
    try:
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def _abort(tmp: str, fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _create_new(tmp: str) -> int:
    """A new file at ``tmp`` for writing. Whatever is there (a killed writer's leftover,
    a symlink) is removed first, never written through: opened with O_TRUNC, a link
    planted at the temporary's name had its target overwritten."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(tmp, flags, 0o644)
    except FileExistsError:
        if stat.S_ISDIR(os.lstat(tmp).st_mode):
            raise
        os.unlink(tmp)
        return os.open(tmp, flags, 0o644)


@contextmanager
def _atomic_fd(path: str, *, fsync: bool = True, tmp_suffix: str = ".tmp") -> Iterator[int]:
    """A write fd on ``path + tmp_suffix``; on a clean exit it is fsynced (if ``fsync``),
    closed and renamed to ``path``; on any error the temp file is removed, and an OSError
    becomes a SaveError naming ``path``."""
    tmp = path + tmp_suffix
    try:
        fd = _create_new(tmp)
    except OSError as e:
        raise SaveError(f"cannot create {tmp}: {e.strerror}", file=path) from e
    try:
        try:
            yield fd
        except BaseException:
            _abort(tmp, fd)
            raise
        try:
            _commit(tmp, path, fd, fsync)  # closes fd whatever happens
        except BaseException:
            _abort(tmp, None)
            raise
    except OSError as e:
        raise SaveError(f"write failed: {e.strerror or e}", file=path) from e


def write_file_atomic(path: str, data: bytes, *, fsync: bool = True,
                      tmp_suffix: str = ".tmp") -> None:
    """Writes ``data`` to ``path`` via temp file + rename (+ fsync of file and directory
    unless ``fsync=False``): readers see the old file or the new one, never a torn one."""
    with _atomic_fd(os.fspath(path), fsync=fsync, tmp_suffix=tmp_suffix) as fd:
        _write_all(fd, memoryview(data))


_OWN_FD_RE = re.compile(r"/(?:proc/(?:self|(\d+))/fd|dev/fd)/(\d+)")


def own_descriptor(path: str) -> int | None:
    """The descriptor of this process that ``path`` names through its links
    (``/dev/stdout`` -> ``/proc/self/fd/1``), or None."""
    p = os.path.abspath(os.fspath(path))
    for _ in range(16):
        m = _OWN_FD_RE.fullmatch(p)
        if m and (m.group(1) is None or int(m.group(1)) == os.getpid()):
            return int(m.group(2))
        if not os.path.islink(p):
            return None
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return None


def plain_output(path: str) -> bool:
    """Whether an output path holds a regular file or nothing (through its links): one
    that may be written twice (a placeholder, then the result), unlike a descriptor of
    this process, a device or a FIFO, whose reader would take both."""
    if own_descriptor(path) is not None:
        return False
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True


def write_output_file(path: str, data: bytes, *, fsync: bool = True) -> None:
    """A file the user named for output (``--report``, ``--json``), as a shell's ``>``
    would write it: a descriptor of this process (``/dev/stdout``: written where it
    stands, so ``>> run.log`` appends), a device or a FIFO there (``/dev/null``) is
    written as it is, not replaced by a regular file; through a symlink the target is
    replaced (``write_file_atomic``), not the link; else ``write_file_atomic``. Not for
    files of a checkpoint, whose links may point into a shared cache."""
    path = os.fspath(path)
    fd = own_descriptor(path)
    if fd is not None:
        try:
            _write_all(fd, memoryview(data))
        except OSError as e:
            raise SaveError(f"write failed: {e.strerror or e}", file=path) from e
        return
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError as e:
            raise SaveError(f"cannot open {path}: {e.strerror}", file=path) from e
        try:
            _write_all(fd, memoryview(data))
        except OSError as e:
            raise SaveError(f"write failed: {e.strerror or e}", file=path) from e
        finally:
            os.close(fd)
        return
    write_file_atomic(os.path.realpath(path) if os.path.islink(path) else path, data,
                      fsync=fsync)


class OpenFiles:
    """Files under ``root`` opened read-only once each, on first use (``pread`` on a shared
    descriptor is safe across threads); all closed by ``close()`` or on leaving a ``with``
    block. Raises OSError for a file that cannot be opened: the caller names it.

    ``check(path, fd, name)``, when given, runs on each file as it is opened (without
    blocking: ``O_NONBLOCK``, so a FIFO in its place is opened, not waited on), before
    any read through it; what it raises closes the file and propagates."""

    def __init__(self, root: str, check: Callable[[str, int, str], None] | None = None):
        self.root = root
        self.fds: dict[str, int] = {}
        self._check = check
        self._lock = threading.Lock()

    def fd(self, name: str) -> int:
        fd = self.fds.get(name)
        if fd is None:
            with self._lock:
                fd = self.fds.get(name)
                if fd is None:
                    fd = self.fds[name] = self._open(name)
        return fd

    def _open(self, name: str) -> int:
        path = os.path.join(self.root, name)
        if self._check is None:
            return os.open(path, os.O_RDONLY)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            self._check(path, fd, name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_safetensors(path: str, entries: Sequence[tuple], metadata: dict[str, str] | None = None,
                      *, sparse: bool = False) -> int:
    """Writes ``entries`` = [(key, dtype_name, shape, data), ...] in that order to ``path``.

    data: bytes / bytearray / memoryview / numpy array / torch tensor (raw bytes are written;
    their length must be numel * itemsize), or None when ``sparse`` (that range stays a file
    hole, reading back as zeros and using no disk). Returns the file size.
    """
    path = os.fspath(path)
    layout = _layout(path, [tuple(e[:3]) for e in entries])
    header = _header_from_layout(layout, metadata, path)
    datas = [entry[3] if len(entry) > 3 else None for entry in entries]
    if not sparse:
        for (key, *_), data in zip(layout, datas):
            if data is None:
                raise SaveError("no data given (None is only allowed with sparse=True)", file=path,
                                tensor=key)
    total = len(header) + (layout[-1][4] if layout else 0)
    with _atomic_fd(path) as fd:
        if sparse:
            # The file gets its final size first; only the header and given data are written,
            # the rest is a hole.
            os.ftruncate(fd, total)
            pwrite_all(fd, memoryview(header), 0)
        else:
            _write_all(fd, memoryview(header))
        # each entry's bytes are taken as it is written (a GPU tensor reaches host memory
        # one at a time, not all before the file is opened)
        for (key, dtype, shape, begin, end), data in zip(layout, datas):
            if data is None:
                continue
            try:
                buf = as_bytes(data)
            except (TypeError, RuntimeError, ValueError) as e:
                raise SaveError(f"cannot take raw bytes of the data: {e}", file=path,
                                tensor=key) from e
            if len(buf) != end - begin:
                raise SaveError(f"data has {len(buf)} bytes, expected {end - begin} for dtype "
                                f"{dtype} shape {shape}", file=path, tensor=key)
            if sparse:
                if len(buf):
                    pwrite_all(fd, buf, len(header) + begin)
            else:
                _write_all(fd, buf)
    return total


def write_safetensors_stream(path: str, specs: Sequence[tuple[str, str, Sequence[int]]],
                             chunks: Iterable[Any] | None, metadata: dict[str, str] | None = None,
                             *, fsync: bool = True) -> int:
    """Like write_safetensors, but the data region comes from ``chunks``: byte-like pieces that
    concatenated are exactly the data of ``specs`` in order. ``chunks=None`` leaves the whole
    data region a hole (a metadata-only file). ``fsync=False`` skips the fsync (the rename is
    still atomic for readers, but not crash-durable): for regenerable data such as synthetic
    checkpoints, where fsync would bound the write to the disk's sustained speed.
    Returns the file size."""
    path = os.fspath(path)
    layout = _layout(path, specs)
    header = _header_from_layout(layout, metadata, path)
    data_len = layout[-1][4] if layout else 0
    with _atomic_fd(path, fsync=fsync) as fd:
        if chunks is None:
            os.ftruncate(fd, len(header) + data_len)
            pwrite_all(fd, memoryview(header), 0)
        else:
            _write_all(fd, memoryview(header))
            written = 0
            for chunk in chunks:
                buf = as_bytes(chunk)
                written += len(buf)
                if written > data_len:
                    raise SaveError(f"data chunks exceed the {data_len} bytes the header declares",
                                    file=path)
                _write_all(fd, buf)
            if written != data_len:
                raise SaveError(f"data chunks gave {written} bytes, the header declares {data_len}",
                                file=path)
    return len(header) + data_len
