"""Strict safetensors checkpoint reader: discover the files, read and validate every
header, check the index against the files, and return frozen ``CheckpointMeta``.

Everything a crafted checkpoint could use against us is refused with a
``CheckpointError`` that names the file (and tensor) and what was expected, *before*
anything large is allocated or anything could block:

* only regular files are opened (``os.stat`` first, then ``O_NONBLOCK`` and an ``fstat``
  re-check), so a FIFO, socket, device or directory never blocks or streams forever;
* the 8-byte header length is checked against the file size and a 100 MB cap before
  the header is read, and only the header is read (``os.pread``), never the data;
* the JSON parser refuses duplicate keys, NaN/Infinity, floats and over-long integers,
  and deep nesting (``RecursionError`` is converted);
* file names from an index are plain names (no separators, ``..``, NUL): nothing
  outside the checkpoint directory is opened, except what a shard *symlink* in it points
  at (hub cache snapshots link to ``../../blobs/<sha>``), which must be a regular file;
* pickle checkpoints (``.bin``/``.pt``/``.pth``/``.ckpt``) are refused, never unpickled.

The loader splits header reading over ranks: each rank calls ``read_file_header`` on a
share of ``discover(root).files``, the ``FileHeader``s are all-gathered (they pickle),
and every rank calls ``assemble``. ``read_checkpoint`` does all three in one process.
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from hashlib import sha256
from itertools import accumulate, chain, repeat
from math import prod
from operator import itemgetter
from typing import Any, Iterable, NamedTuple

import numpy as np

from coordloader.checkpoint.dtypes import SUPPORTED, itemsize
from coordloader.checkpoint.formats import (
    CONFIG_NAME,
    DCP_SAVED_OFFSETS,
    DCP_SHARD_RE,
    DCP_SHARDING_INFO,
    DUMP_PLAN_DIGEST,
    DUMP_RANK,
    HF_INDEX_SUFFIX,
    HF_SINGLE,
    MANIFEST_NAME,
    NUMBERED_SHARD_RE,
    PUBLISH_MARKER,
    SHARD_SUFFIX,
    SHARDED_FORMAT,
    SHARDED_INDEX,
    SHARDED_VERSION,
    V1_SHARD_RE,
    V1_VERSION,
    interrupted_message,
)
from coordloader.checkpoint.metadata import (
    CheckpointMeta,
    FileInfo,
    SourcePiece,
    TensorInfo,
    TensorMap,
    TensorTable,
    box_numel,
    box_shape,
    piece_key,
    tensor_table,
    with_table,
)
from coordloader.checkpoint.tiling import TilingKind, tiling_problem
from coordloader.errors import CheckpointError
from coordloader.gcpause import gc_paused
from coordloader.text import first_items, nul_problem

MAX_HEADER_LEN = 100_000_000        # the safetensors format's own limit
MAX_JSON_FILE = 256 * 1024 * 1024   # side file cap (coordloader's index lists every piece)
MAX_HF_INDEX = 64 * 1024 * 1024     # a 92k-tensor HF index is ~9 MB
MAX_CONFIG = 16 * 1024 * 1024       # a config.json is kilobytes
# Parsed JSON takes several times its text, and an empty array or object (2-3 bytes of
# text) about 60 bytes: a large text made mostly of them is refused before it is parsed.
# A safetensors header has at most one per 16 bytes (a one-letter name, an empty shape).
_DENSE_FROM = 1 << 20
_BYTES_PER_CONTAINER = 12
_MAX_INT_DIGITS = 19                # every valid offset/dim is < 2**63 < 10**19
_INT_LIMIT = 1 << 63

SINGLE_FILE = HF_SINGLE
INDEX_SUFFIX = HF_INDEX_SUFFIX
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

_ITEMSIZE = {name: itemsize(name) for name in SUPPORTED}
_DTYPE_NAME = {name: name for name in SUPPORTED}   # one str object per dtype name
_DTYPE_LIST = ", ".join(SUPPORTED)
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))

# (key, dtype, shape, start, end): one stored tensor of a file, absolute byte offsets.
Entry = tuple[str, str, tuple[int, ...], int, int]


@dataclass(frozen=True)
class Discovery:
    """What ``discover`` found. Picklable; cheap to broadcast."""
    root: str                                   # absolute checkpoint directory
    files: tuple[str, ...]                      # safetensors files to read, sorted
    kind: str                                   # "single" | "index" | "directory" | "sharded"
    index_file: str | None = None               # name of the index, if one was used
    # index tensor -> file, the index's own dict (read only: copying ~92k entries on every
    # rank cost more than the check that uses it)
    weight_map: dict[str, str] | None = None
    coordloader: dict | None = None             # validated "coordloader" index section
    config: dict | None = None                  # parsed config.json
    total_size: int | None = None               # the index's metadata.total_size, if an int


@dataclass(frozen=True)
class FileHeader:
    """One file's validated header. ``entries`` are sorted by offset; picklable."""
    info: FileInfo
    entries: tuple[Entry, ...]


# --------------------------------------------------------------------------- strict JSON

class _Reject(ValueError):
    """Raised inside the JSON hooks; converted to CheckpointError with the file name (a
    ValueError, as json's own syntax errors are, for ``parse_strict_json``'s callers)."""


def _pairs_hook(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _Reject(f"duplicate key {k[:200]!r} in JSON object (keys must be unique)")
            seen.add(k)
    return d


def _const_hook(s):
    raise _Reject(f"{s} is not valid JSON (expected finite numbers only)")


def _int_hook(s):
    if len(s) > _MAX_INT_DIGITS + (s[0] == "-"):
        raise _Reject(f"integer {s[:24]}... with {len(s)} digits is out of range "
                      f"(expected < 2**63)")
    return int(s)


def _float_hook_header(s):
    raise _Reject(f"number {s[:40]} is not an integer (a safetensors header holds only "
                  f"integers, strings, lists and objects)")


def _float_hook_lenient(s):
    if len(s) > 400:
        raise _Reject(f"number with {len(s)} characters is out of range")
    v = float(s)
    if v != v or v in (float("inf"), float("-inf")):
        raise _Reject(f"number {s[:40]} overflows (expected a finite number)")
    return v


def _header_int_hook(s):
    if s == "-0":
        # JSON's -0 is an integer to Python and a float to the safetensors library (serde),
        # which refuses it where a size or offset goes: transformers and vLLM cannot open
        # the file (every other negative number is refused by the entry checks)
        raise _Reject("-0 is not an unsigned integer (the safetensors library reads it as "
                      "the float -0.0 and refuses the file)")
    return _int_hook(s)


_HEADER_DECODER_CHECKED = json.JSONDecoder(
    object_pairs_hook=_pairs_hook, parse_constant=_const_hook, parse_int=_header_int_hook,
    parse_float=_float_hook_header)
# Without parse_int the C scanner builds ints itself (~15% of header time saved); that is
# safe only while Python's int digit limit (default 4300) bounds the cost of a crafted
# 100 MB integer. Values >= 2**63 are then refused by the entry validation, and a -0 in a
# number's place (a string such as a date in __metadata__ may match too) sends the header
# to the checked decoder, which refuses it.
_HEADER_DECODER_FAST = json.JSONDecoder(
    object_pairs_hook=_pairs_hook, parse_constant=_const_hook, parse_float=_float_hook_header)
_NEG0_NUMBER = re.compile(rb"[\[,:]\s*-0\s*[,\]}]")


def _header_decoder(raw: bytes) -> json.JSONDecoder:
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if 0 < limit <= 5000 and not _NEG0_NUMBER.search(raw):
        return _HEADER_DECODER_FAST
    return _HEADER_DECODER_CHECKED

_INDEX_DECODER = json.JSONDecoder(object_pairs_hook=_pairs_hook, parse_constant=_const_hook,
                                  parse_int=_int_hook, parse_float=_float_hook_lenient)


def parse_strict_json(text: str | bytes) -> Any:
    """A JSON document parsed as coordloader parses config.json and the index: a duplicate
    key, NaN, Infinity or an out-of-range number is refused, not read as the last value or
    as a float that compares unequal to itself. For the JSON a user hands in (rule files,
    --placement, --loader-config, a save's config, the manifest). Raises ValueError
    (json.JSONDecodeError for bad syntax, UnicodeDecodeError for bytes that are not UTF-8)
    or RecursionError for deep nesting; the caller names the file."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")
    return _INDEX_DECODER.decode(text)


def refuse_dense_json(raw: bytes, file: str, what: str) -> None:
    """CheckpointError for a JSON text over 1 MiB made mostly of arrays and objects, before
    it is parsed (every JSON file coordloader reads that it did not just write itself goes
    through this)."""
    if len(raw) > _DENSE_FROM:
        n = raw.count(b"[") + raw.count(b"{")
        if n > len(raw) // _BYTES_PER_CONTAINER:
            raise CheckpointError(f"{what} holds {n} JSON arrays and objects in {len(raw)} "
                                  f"bytes; expected at most one per {_BYTES_PER_CONTAINER} "
                                  f"bytes (refused before parsing: it would take many times "
                                  f"its size in memory)", file=file)


def _parse_json(raw: bytes, decoder: json.JSONDecoder, file: str, what: str) -> dict:
    refuse_dense_json(raw, file, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} is not valid UTF-8 (byte {e.start}); expected a UTF-8 "
                              f"JSON object", file=file) from None
    try:
        obj = decoder.decode(text)
    except _Reject as e:
        raise CheckpointError(f"{what}: {e}", file=file) from None
    except RecursionError:
        raise CheckpointError(f"{what} is nested too deeply (expected a flat JSON object)",
                              file=file) from None
    except ValueError as e:  # JSONDecodeError, int digit limits, ...
        raise CheckpointError(f"{what} is not valid JSON ({str(e)[:200]}); expected a JSON "
                              f"object", file=file) from None
    if type(obj) is not dict:
        raise CheckpointError(f"{what} is a JSON {type(obj).__name__}, expected a JSON object",
                              file=file)
    return obj


# --------------------------------------------------------------------------- safe opening

def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a dangling symlink")):
        if test(mode):
            return word
    return "not a regular file"


def _check_name(name: Any, where: str, file: str | None) -> str:
    """A file name from an index or a caller: a plain name inside the checkpoint dir."""
    if type(name) is not str or not name:
        raise CheckpointError(f"{where}: file name {name!r} is not a non-empty string",
                              file=file)
    bad = None
    if "\x00" in name:
        bad = "a NUL byte"
    elif "/" in name or "\\" in name:
        bad = "a path separator"
    elif name == "..":
        bad = "'..'"
    elif os.path.isabs(name) or name == ".":
        bad = "an absolute or special path"
    if bad:
        raise CheckpointError(f"{where}: file name {name[:200]!r} contains {bad}; expected a "
                              f"plain file name inside the checkpoint directory", file=file)
    return name


def open_regular(path: str, name: str) -> tuple[int, os.stat_result]:
    """Open a regular file (following symlinks) read-only without ever blocking."""
    if problem := nul_problem("path", path):
        raise CheckpointError(problem)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise CheckpointError("symlink points to a missing file; expected a regular file",
                                  file=name) from None
        raise CheckpointError("file does not exist", file=name) from None
    except OSError as e:   # the OSError kept as the cause: a writer tells I/O errors apart
        raise CheckpointError(f"cannot stat file: {e.strerror}", file=name) from e
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"is {_kind(st.st_mode)}; expected a regular file", file=name)
    try:
        # O_NONBLOCK: belt and braces in case the path is swapped for a FIFO after stat.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"cannot open file: {e.strerror}", file=name) from e
    try:
        st2 = os.fstat(fd)
        if not stat.S_ISREG(st2.st_mode) or (st2.st_ino, st2.st_dev) != (st.st_ino, st.st_dev):
            raise CheckpointError("file changed type while being opened; expected a regular "
                                  "file", file=name)
    except BaseException:
        os.close(fd)
        raise
    return fd, st2


def _pread_exact(fd: int, n: int, offset: int, name: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) == n:
        return data
    parts, got = [data], len(data)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            raise CheckpointError(f"file ended at byte {offset + got} while reading {n} header "
                                  f"bytes (file shrank?)", file=name)
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def read_small_file(path: str, name: str, what: str, limit: int = MAX_JSON_FILE) -> bytes:
    """All bytes of a small side file (index, config, manifest): a regular file opened
    without ever blocking, at most ``limit`` bytes; CheckpointError naming ``name``."""
    fd, st = open_regular(path, name)
    try:
        if st.st_size > limit:
            raise CheckpointError(f"{what} is {st.st_size} bytes; expected at most "
                                  f"{limit}", file=name)
        return _pread_exact(fd, st.st_size, 0, name)
    finally:
        os.close(fd)


def read_json_document(path: str, name: str, what: str, limit: int = MAX_JSON_FILE) -> Any:
    """The JSON document of a small side file a user or a save hands in (a rule file, the
    manifest, a save's index or publish marker): read without ever blocking
    (``read_small_file``), refused before parsing when dense (``refuse_dense_json``), and
    parsed strictly (``parse_strict_json``). CheckpointError for the file itself;
    ValueError (UnicodeDecodeError for bytes that are not UTF-8) or RecursionError for its
    text, which the caller names in its own words."""
    raw = read_small_file(path, name, what, limit)
    refuse_dense_json(raw, name, what)
    return parse_strict_json(raw)


def _read_json_file(path: str, name: str, decoder: json.JSONDecoder, what: str,
                    limit: int = MAX_JSON_FILE) -> dict:
    return _parse_json(read_small_file(path, name, what, limit), decoder, name, what)


# --------------------------------------------------------------------------- one file

def _root_dir(root: str) -> str:
    root = os.path.abspath(os.fspath(root))
    if os.path.isdir(root):
        return root
    return os.path.dirname(root)


class _HeaderSeen(NamedTuple):
    stat: tuple[int, int, int, int, int]   # device, inode, size, mtime, ctime (ns)
    header_sha256: str


# Each file whose header this process read, by absolute path: what it was then. A file
# rewritten in place at the same size after its header was read would otherwise be loaded
# as new bytes under the old plan; the engines compare the file they open with this. Only
# this process's own reads count: another host's copy of the file has another inode and
# mtime, and a record for another header is of another version of the file. In a load
# over a process group each rank parses a share of the headers but fingerprints every
# file (identity.py), which notes each here too: a file whose header another rank read is
# checked alike, and a record left by an earlier read of an older version is replaced.
# The newest HEADERS_SEEN_MAX are kept (a process loading new step-N directories for
# ever grew without bound); a file read longer ago than that is checked as one never read.
_HEADERS_SEEN: OrderedDict[str, _HeaderSeen] = OrderedDict()
HEADERS_SEEN_MAX = 8192
_HEADERS_SEEN_LOCK = threading.Lock()


def note_header_seen(path: str, st: os.stat_result, header_sha256: str, *,
                     replace: bool = True) -> None:
    """Record that this process read the header ``header_sha256`` of the file at ``path``
    (``st``: the open file's stat), for ``changed_since_header``. ``replace=False`` keeps
    a record of the same header already there (taken when the metadata in use was read)."""
    path = os.path.abspath(path)
    with _HEADERS_SEEN_LOCK:
        if not replace:
            seen = _HEADERS_SEEN.get(path)
            if seen is not None and seen.header_sha256 == header_sha256:
                _HEADERS_SEEN.move_to_end(path)
                return
        _HEADERS_SEEN[path] = _HeaderSeen(stat_key(st), header_sha256)
        _HEADERS_SEEN.move_to_end(path)
        while len(_HEADERS_SEEN) > HEADERS_SEEN_MAX:
            _HEADERS_SEEN.popitem(last=False)


STAT_KEY_FIELDS = ("device", "inode", "size", "mtime", "ctime")   # stat_key's, in order


def stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What identifies a file's content without reading it: (device, inode) for a file
    replaced, (size, mtime, ctime) for one rewritten in place."""
    # the ctime too: a rewrite in place that sets the mtime back (rsync --inplace -t, cp
    # --preserve=timestamps onto the file) still moves it, and nothing can set it back
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def changed_since_header(path: str, st: os.stat_result, header_sha256: str) -> bool:
    """Whether the file at ``path`` (``st`` from the open file) has changed since this
    process read its header ``header_sha256``; False when this process never read it."""
    seen = _HEADERS_SEEN.get(os.path.abspath(path))
    return (seen is not None and seen.header_sha256 == header_sha256
            and seen.stat != stat_key(st))


def header_unchanged(fd: int, info: FileInfo) -> bool:
    """Whether the open file ``fd`` still starts with the header ``info`` was read from."""
    try:
        head = os.pread(fd, 8 + info.header_len, 0)
    except OSError:
        return False
    return (len(head) == 8 + info.header_len
            and int.from_bytes(head[:8], "little") == info.header_len
            and sha256(head[8:]).hexdigest() == info.header_sha256)


def header_length(fd: int, size: int, name: str) -> int:
    """The header length a safetensors file of ``size`` bytes open as ``fd`` states, checked
    against the file size and the format's limit before anything of that size is read."""
    if size < 8:
        raise CheckpointError(f"file is {size} bytes; a safetensors file needs at least 8 "
                              f"(the little-endian u64 header length)", file=name)
    n = int.from_bytes(_pread_exact(fd, 8, 0, name), "little")
    if n > size - 8:
        raise CheckpointError(f"header length {n} exceeds the file size {size} (expected at "
                              f"most {size - 8})", file=name)
    if n > MAX_HEADER_LEN:
        raise CheckpointError(f"header length {n} exceeds the {MAX_HEADER_LEN}-byte limit of "
                              f"the safetensors format", file=name)
    return n


def read_file_header(root: str, name: str) -> FileHeader:
    """Read and validate one safetensors file's header (never its data)."""
    _check_name(name, "file", name)
    path = os.path.join(_root_dir(root), name)
    fd, st = open_regular(path, name)
    try:
        size = st.st_size
        n = header_length(fd, size, name)
        raw = _pread_exact(fd, n, 8, name)
    finally:
        os.close(fd)
    with gc_paused():
        h = _header_from_raw(raw, name, n, size)
    note_header_seen(path, st, h.info.header_sha256)
    return h


def header_order(root: str, name: str) -> list[tuple[str, int, int]]:
    """(key, start, end) of each tensor of a file's header, in the header's own order (the
    reader's entries are sorted by offset), data offsets as written. For a file the reader
    validated already."""
    fd, st = open_regular(os.path.join(_root_dir(root), name), name)
    try:
        raw = _pread_exact(fd, header_length(fd, st.st_size, name), 8, name)
    finally:
        os.close(fd)
    hdr = _parse_json(raw, _header_decoder(raw), name, "header")
    return [(k, *v["data_offsets"]) for k, v in hdr.items() if k != "__metadata__"]


def _header_from_raw(raw: bytes, name: str, n: int, size: int) -> FileHeader:
    hdr = _parse_json(raw, _header_decoder(raw), name, "header")
    meta = hdr.pop("__metadata__", None)
    metadata: tuple[tuple[str, str], ...] = ()
    if meta is not None:
        if type(meta) is not dict or any(type(v) is not str for v in meta.values()):
            raise CheckpointError("__metadata__ must be a JSON object mapping strings to "
                                  "strings", file=name)
        metadata = tuple(sorted(meta.items()))
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_surrogates(hdr, metadata, name)
    data_start = 8 + n
    entries = _validate_entries(hdr, name, data_start, size)
    info = FileInfo(name=name, size=size, header_len=n, header_sha256=sha256(raw).hexdigest(),
                    metadata=metadata)
    return FileHeader(info=info, entries=entries)


def _stride_overflow(shape, isz: int) -> bool:
    """True if a zero-element ``shape`` still has a byte stride of 2**63 or more. Torch
    computes strides with zero dims counted as 1, so ``[0] + [2**62] * k`` holds no bytes
    yet cannot be allocated; a tensor with elements already has its size bounded."""
    n = isz
    for d in shape[1:]:
        n *= d or 1
        if n >= _INT_LIMIT:
            return True
    return False


def _numel(shape: list) -> int:
    if 0 in shape:
        return 0
    n = 1
    for d in shape:  # bail out early: a long list of huge dims must not build a huge int
        n *= d
        if n >= _INT_LIMIT:
            return n
    return n


# JSON's \ud800-\udfff escapes decode to str no UTF-8 can hold; the safetensors library
# (verify="full", the safetensors engine) refuses such a header, so the reader does too
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_surrogates(hdr: dict, metadata, file: str) -> None:
    for k in hdr:
        if not_utf8(k):
            raise CheckpointError("tensor name holds a lone surrogate (a \\ud800-\\udfff "
                                  "escape), which is not UTF-8; expected a UTF-8 name",
                                  file=file, tensor=k)
    for k, v in metadata:
        if not_utf8(k) or not_utf8(v):
            raise CheckpointError(f"__metadata__ entry {k!r} holds a lone surrogate (a "
                                  f"\\ud800-\\udfff escape), which is not UTF-8; expected "
                                  f"UTF-8 strings", file=file)


def not_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _validate_entries(hdr: dict, file: str, data_start: int, size: int) -> tuple[Entry, ...]:
    """Per-tensor checks, kept lean: ~90k tensors must validate in well under a second."""
    rows = []
    append = rows.append
    for key, ent in hdr.items():
        if type(ent) is not dict:
            raise CheckpointError(f"entry is a JSON {type(ent).__name__}; expected an object "
                                  f"with dtype, shape, data_offsets", file=file, tensor=key)
        if len(ent) != 3 or ent.keys() != _ENTRY_KEYS:
            missing = sorted(_ENTRY_KEYS - ent.keys())
            extra = sorted(set(ent) - _ENTRY_KEYS)
            raise CheckpointError(f"entry keys wrong (missing {missing}, unexpected "
                                  f"{[k[:50] for k in extra[:5]]}); expected exactly dtype, "
                                  f"shape, data_offsets", file=file, tensor=key)
        dtype = ent["dtype"]
        isz = _ITEMSIZE.get(dtype) if type(dtype) is str else None
        if isz is None:
            raise CheckpointError(f"unknown dtype {str(dtype)[:40]!r}; expected one of "
                                  f"{_DTYPE_LIST}", file=file, tensor=key)
        shape = ent["shape"]
        if type(shape) is not list:
            raise CheckpointError(f"shape is {type(shape).__name__}; expected a list of "
                                  f"non-negative integers", file=file, tensor=key)
        for d in shape:
            # type() check: JSON true must not pass as 1
            if type(d) is not int or not 0 <= d < _INT_LIMIT:
                raise CheckpointError(f"shape has element {str(d)[:40]}; expected a list of "
                                      f"non-negative integers below 2**63", file=file,
                                      tensor=key)
        offs = ent["data_offsets"]
        if (type(offs) is not list or len(offs) != 2 or type(offs[0]) is not int
                or type(offs[1]) is not int):
            raise CheckpointError(f"data_offsets is {str(offs)[:80]}; expected two integers "
                                  f"[begin, end]", file=file, tensor=key)
        b, e = offs
        if not 0 <= b <= e < _INT_LIMIT:
            raise CheckpointError(f"data_offsets [{str(b)[:40]}, {str(e)[:40]}]; expected "
                                  f"0 <= begin <= end < 2**63", file=file, tensor=key)
        nbytes = (prod(shape) if len(shape) <= 8 else _numel(shape)) * isz
        if e - b != nbytes:
            what = (f"{nbytes}" if nbytes < _INT_LIMIT else "more than 2**63")
            raise CheckpointError(f"data_offsets [{b}, {e}] span {e - b} bytes but shape "
                                  f"{str(shape)[:80]} of {dtype} needs {what}", file=file,
                                  tensor=key)
        if not nbytes and _stride_overflow(shape, isz):
            raise CheckpointError(f"shape {str(shape)[:80]} holds no elements but its strides "
                                  f"overflow (zero dims count as 1: their product of "
                                  f"{dtype} items is 2**63 bytes or more)", file=file,
                                  tensor=key)
        append((b, e, key, dtype, shape))
    rows.sort()
    # The data region must be tiled exactly: no overlaps, no gaps, ends at EOF.
    pos = 0
    prev = None
    entries = []
    # Equal shapes and dtypes become one object each: a file's experts and layers repeat a
    # few dozen shapes, so the pickled headers of the gather hold references instead of
    # ~92k tuples for DeepSeek-V3 (smaller, faster to unpickle), and assemble's box
    # lookups compare by identity. The cache is per file, bounded by its entries.
    shapes: dict[tuple, tuple] = {}
    for b, e, key, dtype, shape in rows:
        if b != pos:
            if b < pos:
                raise CheckpointError(f"data_offsets [{b}, {e}] overlap tensor {prev!r} "
                                      f"which ends at {pos}", file=file, tensor=key)
            raise CheckpointError(f"gap of {b - pos} bytes before data_offsets [{b}, {e}] "
                                  f"(expected tensors to be contiguous from {pos})", file=file,
                                  tensor=key)
        pos = e
        prev = key
        shape = tuple(shape)
        entries.append((key, _DTYPE_NAME[dtype], shapes.setdefault(shape, shape),
                        data_start + b, data_start + e))
    if data_start + pos != size:
        raise CheckpointError(f"tensor data ends at byte {data_start + pos} but the file is "
                              f"{size} bytes (expected the data to end exactly at end of file)",
                              file=file)
    return tuple(entries)


# --------------------------------------------------------------------------- discovery

def _refuse_pickle(name: str):
    raise CheckpointError("is a pickle checkpoint; coordloader loads only safetensors "
                          "(pickle files are never unpickled) - convert it to .safetensors",
                          file=name)


def checkpoint_path(root: Any) -> str:
    """``root`` as an absolute str path; CheckpointError for anything else (bytes, None)."""
    try:
        path = os.fspath(root)
    except TypeError:
        path = None
    if not isinstance(path, str):
        raise CheckpointError(f"checkpoint path {str(root)[:200]!r} is {type(root).__name__}; "
                              f"expected a str or os.PathLike path")
    if problem := nul_problem("checkpoint path", path):
        raise CheckpointError(problem)
    return os.path.abspath(path)


def is_checkpoint_file(name: str) -> bool:
    """Whether a file called ``name`` in a checkpoint directory is read as part of the
    checkpoint: by ``discover`` (weights, indexes, the publish marker), ``_read_config``,
    or the loader's manifest check. A file written there under such a name changes what
    loads, or makes the directory unloadable. Other names are ignored beside safetensors
    weights (pickle weights are looked at only in a directory without any)."""
    return (name.endswith((".safetensors", INDEX_SUFFIX, SHARD_SUFFIX))
            or name in (SHARDED_INDEX, CONFIG_NAME, PUBLISH_MARKER, MANIFEST_NAME))


def checkpoint_dir(checkpoint: str) -> str:
    """The directory of ``checkpoint`` (a checkpoint directory or a file in one), absolute."""
    root = os.path.abspath(checkpoint)
    return root if os.path.isdir(root) else os.path.dirname(root)


def checkpoint_file_at(out: str, checkpoint: str) -> str | None:
    """The name ``out`` (a file or directory an output would be written to) takes in the
    directory of ``checkpoint`` (a checkpoint directory or a file in one) where it lands
    directly there (by real path), else None. With ``is_checkpoint_file`` of that name:
    whether the output would be read as part of the checkpoint (a directory named
    ``model.safetensors`` in a sharded save makes it two checkpoints)."""
    target = os.path.realpath(os.path.abspath(out))
    if os.path.dirname(target) != os.path.realpath(checkpoint_dir(checkpoint)):
        return None
    return os.path.basename(target)


def read_with_checkpoint(out: str, checkpoint: str) -> str | None:
    """The name of ``out`` where an output there would be read as part of ``checkpoint``
    (``checkpoint_file_at`` a name ``is_checkpoint_file``), else None."""
    name = checkpoint_file_at(out, checkpoint)
    return name if name is not None and is_checkpoint_file(name) else None


def discover(root: str) -> Discovery:
    """Find the files of a checkpoint: a directory in HF layout (index + shards, a single
    model.safetensors, or loose *.safetensors), or a path to one .safetensors file."""
    path = checkpoint_path(root)
    try:
        st = os.stat(path)
    except OSError:
        raise CheckpointError("checkpoint path does not exist (expected a directory or a "
                              ".safetensors file)", file=path) from None
    if stat.S_ISREG(st.st_mode):
        d, base = os.path.split(path)
        refuse_interrupted(d)
        if base == SHARDED_INDEX:
            return _discover_sharded(d, _read_config(d))
        if base.endswith(SHARD_SUFFIX) or V1_SHARD_RE.match(base):
            raise CheckpointError("is one shard of a coordloader sharded save, holding pieces of "
                                  "tensors; pass the save's directory (its index lists every "
                                  "piece)", file=path)
        if DCP_SHARD_RE.match(base):
            raise CheckpointError("is one rank's shard of a torch DCP HuggingFaceStorageWriter "
                                  "save, holding pieces of tensors; pass the directory of all "
                                  "its shards", file=path)
        if base.endswith(INDEX_SUFFIX):
            return _discover_index(d, base, _read_config(d))
        if base.endswith(PICKLE_SUFFIXES):
            _refuse_pickle(base)
        if not base.endswith(".safetensors"):
            raise CheckpointError("is not a .safetensors file or an index (expected a "
                                  "checkpoint directory or a .safetensors file)", file=path)
        m = NUMBERED_SHARD_RE.match(base)
        if m and int(m.group(3)) > 1:
            # read alone it would load as a smaller model
            raise CheckpointError(f"is shard {int(m.group(2))} of a set of {int(m.group(3))} "
                                  f"(by its name), holding only some of the tensors; pass the "
                                  f"checkpoint's directory or its index", file=path)
        return Discovery(root=d, files=(base,), kind="single", config=_read_config(d))
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"checkpoint path is {_kind(st.st_mode)}; expected a directory "
                              f"or a .safetensors file", file=path)
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise CheckpointError(f"cannot list directory: {e.strerror}", file=path) from None
    refuse_interrupted(path)
    config = _read_config(path)
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if SHARDED_INDEX in names:
        if indexes:
            raise CheckpointError(f"holds both a coordloader sharded index ({SHARDED_INDEX}) and "
                                  f"a safetensors index {indexes[0]}; expected one checkpoint "
                                  f"per directory", file=path)
        # a save never leaves .safetensors files beside its index: any there (another
        # model's model.safetensors, DCP's per-rank shards, a numbered set) are another
        # checkpoint, the one vLLM (every *.safetensors) and transformers would read
        others = [n for n in names if n.endswith(".safetensors")]
        if others:
            readers = (f"transformers reads {SINGLE_FILE}" if SINGLE_FILE in others else
                       "vLLM reads every *.safetensors file")
            raise CheckpointError(f"holds both a coordloader sharded save ({SHARDED_INDEX}) and "
                                  f"{first_items(others, 2)}: two checkpoints, which readers "
                                  f"choose between differently ({readers}); expected one "
                                  f"checkpoint per directory: remove the stale one, or pass the path of "
                                  f"the index or file to load", file=path)
        return _discover_sharded(path, config)
    if indexes:
        if len(indexes) > 1:
            if "model" + INDEX_SUFFIX not in indexes:
                raise CheckpointError(f"several safetensors indexes {indexes[:5]}; expected one "
                                      f"(or model{INDEX_SUFFIX})", file=path)
            indexes = ["model" + INDEX_SUFFIX]
        return _discover_index(path, indexes[0], config, names)
    if SINGLE_FILE in names:
        dcp = [n for n in names if DCP_SHARD_RE.match(n)]
        if dcp:
            raise CheckpointError(f"holds {SINGLE_FILE} and torch DCP per-rank shards ({dcp[0]}, "
                                  f"...): two checkpoints; expected one checkpoint per "
                                  f"directory: remove the stale one", file=path)
        return Discovery(root=path, files=(SINGLE_FILE,), kind="single", config=config)
    shards = tuple(n for n in names if n.endswith(".safetensors"))
    loose = [n for n in names if V1_SHARD_RE.match(n) or n.endswith(SHARD_SUFFIX)]
    if loose:
        # pieces of a coordloader save without its index: assembling them would give each
        # piece as a tensor of its own (or a mix of two saves after an interrupted publish)
        raise CheckpointError(f"holds shards of a coordloader sharded save ({loose[0]}, ...) "
                              f"but no index: the save was interrupted before it was published, "
                              f"or its index was removed. Run the save again (overwrite=True); "
                              f"these shards cannot be read on their own", file=path)
    if shards:
        _check_numbered_sets(path, shards)
        _check_loose_beside_set(path, shards)
        return Discovery(root=path, files=shards, kind="directory", config=config)
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES) or n.endswith(".bin.index.json")]
    if pickles:
        _refuse_pickle(pickles[0])
    raise CheckpointError("no .safetensors files and no model.safetensors.index.json found "
                          "(expected a safetensors checkpoint directory)", file=path)


def _check_loose_beside_set(path: str, shards: tuple[str, ...]) -> None:
    """Without an index, a numbered set (or torch DCP's per-rank shards) is a checkpoint of
    its own: another .safetensors file beside it (Mistral's consolidated.safetensors, an
    adapter, a second set) would be read as part of it, each tensor twice or a stranger
    among them. Loose files that are neither are one checkpoint together."""
    groups: dict[str, str] = {}   # what the file belongs to -> its first file
    for n in shards:
        m = NUMBERED_SHARD_RE.match(n)
        kind = ("torch DCP shards" if DCP_SHARD_RE.match(n) else
                f"the numbered set {m.group(1)}-*-of-{m.group(3)}" if m else
                "a file of no numbered set")
        groups.setdefault(kind, n)
    if len(groups) > 1:
        (a, fa), (b, fb) = list(groups.items())[:2]
        # DCP's per-rank shards come without an index, and an index beside them is refused
        want = ("torch DCP's shards alone in their directory: move the other files out"
                if "torch DCP shards" in groups else
                "an index (model.safetensors.index.json) or one checkpoint per directory")
        raise CheckpointError(f"holds {fa} ({a}) and {fb} ({b}) but no index: which files "
                              f"make the checkpoint cannot be told; expected {want}",
                              file=path)


def _check_numbered_sets(path: str, shards: tuple[str, ...]) -> None:
    """Without an index, numbered shards (``model-00001-of-00004.safetensors``) must form
    whole sets, numbered 1..N or 0..N-1: a copy or download that lost a file would
    otherwise load as a smaller model. DCP's per-rank files are exempt (a rank may hold
    nothing of a numbered file)."""
    sets: dict[str, dict[int, dict[int, re.Match]]] = {}   # prefix -> total -> number -> its match
    for n in shards:
        m = None if DCP_SHARD_RE.match(n) else NUMBERED_SHARD_RE.match(n)
        if m:
            sets.setdefault(m.group(1), {}).setdefault(int(m.group(3)), {})[int(m.group(2))] = m
    for prefix, by_total in sorted(sets.items()):
        if len(by_total) > 1:
            a, b = (next(iter(by_total[t].values())).string for t in sorted(by_total)[:2])
            raise CheckpointError(f"holds shards of sets of different sizes ({a} and {b}) and "
                                  f"no index; expected one checkpoint per directory", file=path)
        (total, present), = by_total.items()
        first = 0 if 0 in present else 1
        outside = sorted(i for i in present if not first <= i < first + total)
        if outside:
            raise CheckpointError(f"has no index and numbered shard {present[outside[0]].string} lies "
                                  f"outside its set of {total} (numbered {first}.."
                                  f"{first + total - 1})", file=path)
        if len(present) < total:
            # name the missing files as the present ones are written (widths as they pad)
            m = next(iter(present.values()))
            width = len(m.group(2)) if len({len(v.group(2)) for v in present.values()}) == 1 else 0
            gone = (i for i in range(first, first + total) if i not in present)
            names = [f"{prefix}-{i:0{width}d}-of-{m.group(3)}.safetensors"
                     for i, _ in zip(gone, range(3))]
            more = total - len(present) - len(names)
            more = f" (and {more} more)" if more else ""
            alt = ""
            if first == 1 and len(present) == total - 1 and total not in present:
                # without shard 0 the set reads as numbered from 1: it may be 0..N-1
                alt = (f" (or {prefix}-{0:0{width}d}-of-{m.group(3)}.safetensors, if the set "
                       f"is numbered from 0)")
            raise CheckpointError(f"has no index and {len(present)} of the {total} numbered "
                                  f"shards: {', '.join(names)}{more} missing{alt}; the copy or "
                                  f"download is incomplete", file=path)


def refuse_interrupted(d: str) -> None:
    """CheckpointError when directory ``d`` holds the publish marker: a save into it is
    mid-publish or was killed there, and its files mix two checkpoints. Every reader of a
    checkpoint directory (and ``consolidate``, on its source) refuses it with this."""
    if os.path.lexists(os.path.join(d, PUBLISH_MARKER)):
        raise CheckpointError(interrupted_message(d), file=d)


def _discover_sharded(d: str, config: dict | None) -> Discovery:
    """A coordloader sharded save (format version 2): its index lists every piece."""
    with gc_paused():
        idx = _read_json_file(os.path.join(d, SHARDED_INDEX), SHARDED_INDEX, _INDEX_DECODER,
                              "index")
    if idx.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"index format {str(idx.get('format'))[:40]!r}; expected "
                              f"{SHARDED_FORMAT!r}", file=SHARDED_INDEX)
    section = _validate_section(idx, SHARDED_INDEX, SHARDED_VERSION, SHARD_SUFFIX)
    files = {p["file"] for spec in section["tensors"].values() for p in spec["pieces"]}
    if not files:
        raise CheckpointError("the index lists no tensors; expected at least one",
                              file=SHARDED_INDEX)
    for fname in sorted(files):
        if not os.path.lexists(os.path.join(d, fname)):
            raise CheckpointError(f"the index lists file {fname!r} which does not exist in the "
                                  f"checkpoint directory", file=SHARDED_INDEX)
    return Discovery(root=d, files=tuple(sorted(files)), kind="sharded",
                     index_file=SHARDED_INDEX, coordloader=section, config=config)


def _read_config(d: str) -> dict | None:
    p = os.path.join(d, "config.json")
    if not os.path.lexists(p):
        return None
    config = _read_json_file(p, "config.json", _INDEX_DECODER, "config.json", MAX_CONFIG)
    if not isinstance(config, dict):
        raise CheckpointError(f"config.json must hold a JSON object, got "
                              f"{type(config).__name__}", file="config.json")
    return config


def _weight_map_files(wm: dict, index_name: str) -> set[str]:
    """The distinct files of a weight_map, each a plain ``.safetensors`` name. The ~92k
    values of DeepSeek-V3 name 163 files: they are checked once per distinct name; on
    any problem the loop over every entry runs, to report the first one in index order
    (and its tensor) as it always did."""
    try:
        files = set(wm.values())
        ok = all(type(f) is str and f.endswith(".safetensors") for f in files)
        if ok:
            for f in files:
                _check_name(f, "weight_map", index_name)
    except (TypeError, CheckpointError):   # an unhashable value; a bad name
        ok = False
    if ok:
        return files
    files = set()
    for tname, fname in wm.items():
        if type(fname) is not str:
            raise CheckpointError(f"weight_map value is {type(fname).__name__}; expected a "
                                  f"file name string", file=index_name, tensor=tname)
        if fname not in files:
            _check_name(fname, "weight_map", index_name)
            if fname.endswith(PICKLE_SUFFIXES):
                _refuse_pickle(fname)
            if not fname.endswith(".safetensors"):
                raise CheckpointError(f"weight_map names file {fname!r}; expected .safetensors "
                                      f"files only", file=index_name, tensor=tname)
            files.add(fname)
    return files


def _discover_index(d: str, index_name: str, config: dict | None,
                    names: list[str] | None = None) -> Discovery:
    """``names``: the directory's listing where the directory was named (the index's path
    picks the index: then model.safetensors beside it is not another checkpoint)."""
    with gc_paused():
        idx = _read_json_file(os.path.join(d, index_name), index_name, _INDEX_DECODER, "index",
                              MAX_HF_INDEX)
    wm = idx.get("weight_map")
    if type(wm) is not dict:
        raise CheckpointError("index has no weight_map object; expected \"weight_map\": "
                              "{tensor name: file name}", file=index_name)
    files = _weight_map_files(wm, index_name)
    section = idx.get("coordloader")
    if section is not None:
        # format version 1 (coordloader <= 0.2): still read, so that saves made before
        # version 2 keep loading; consolidate turns one into a plain HF checkpoint
        section = _validate_section(section, index_name, V1_VERSION, ".safetensors")
        for spec in section["tensors"].values():
            for p in spec["pieces"]:
                files.add(p["file"])
    if not files:
        raise CheckpointError("the index lists no files (empty weight_map); expected tensor "
                              "name -> file name entries", file=index_name)
    if names is not None and SINGLE_FILE in names and SINGLE_FILE not in files:
        _refuse_index_beside_single(d, index_name, files)   # (naming it: one checkpoint)
    for fname in sorted(files):
        if not os.path.lexists(os.path.join(d, fname)):
            raise CheckpointError(f"the index lists file {fname!r} which does not exist in the "
                                  f"checkpoint directory", file=index_name)
    _check_unlisted(index_name, files, sorted(os.listdir(d)) if names is None else names)
    md = idx.get("metadata")
    total = md.get("total_size") if type(md) is dict else None
    return Discovery(root=d, files=tuple(sorted(files)), kind="index", index_file=index_name,
                     weight_map=wm, coordloader=section, config=config,
                     total_size=total if type(total) is int else None)


def _refuse_index_beside_single(d: str, index_name: str, files: set[str]) -> None:
    """model.safetensors beside an index that does not name it: two checkpoints (a save of
    one kind over the other), which transformers (model.safetensors first) and vLLM (the
    index's files) choose between differently."""
    listed = sorted(files)
    # none here: what transformers leaves when it saves unsharded over a sharded save
    if not any(os.path.lexists(os.path.join(d, f)) for f in listed):
        raise CheckpointError(f"lists files that are not here ({listed[0]}, ...) beside "
                              f"{SINGLE_FILE}, which transformers reads: a stale index of an "
                              f"earlier sharded save? expected one checkpoint per directory: "
                              f"remove the index if {SINGLE_FILE} is the checkpoint",
                              file=index_name)
    raise CheckpointError(f"lists {len(listed)} file(s) ({listed[0]}, ...) beside {SINGLE_FILE}: "
                          f"two checkpoints, which readers choose between differently "
                          f"(transformers reads {SINGLE_FILE}, vLLM the index's files); "
                          f"expected one checkpoint per directory: remove the stale one, or "
                          f"pass the path of the index or file to load", file=index_name)


def _check_unlisted(index_name: str, files: set[str], names: list[str]) -> None:
    """Files in the directory (``names``) the index leaves out that belong to a
    checkpoint: another file of a numbered set (``model-00001-of-00002``) the index names
    some of, whose tensors would be left out; torch DCP per-rank shards, another
    checkpoint."""
    sets: dict[tuple[str, str], set[int]] = {}
    names_dcp = False   # an index naming DCP shards is refused as such, once read
    for f in files:
        if DCP_SHARD_RE.match(f):
            names_dcp = True
        elif m := NUMBERED_SHARD_RE.match(f):
            sets.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    for n in names:
        if n in files:
            continue
        if DCP_SHARD_RE.match(n) and not names_dcp:
            raise CheckpointError(f"lists none of the torch DCP per-rank shards beside it ({n}, "
                                  f"...): two checkpoints; expected one checkpoint per "
                                  f"directory: remove the stale one", file=index_name)
        m = NUMBERED_SHARD_RE.match(n)
        if m and (m.group(1), m.group(3)) in sets:
            listed = sets[m.group(1), m.group(3)]
            raise CheckpointError(f"lists {len(listed)} of the {int(m.group(3))} files of its "
                                  f"numbered set but not {n}, which is in the directory: the "
                                  f"tensors of {n} would be left out; expected every file of "
                                  f"the set in the weight_map (an index edited or cut short?)",
                                  file=index_name)


def _is_box(box, ndim: int) -> bool:
    return (type(box) is list and len(box) == ndim and
            all(type(r) is list and len(r) == 2 and type(r[0]) is int and type(r[1]) is int
                for r in box))


def _validate_section(sec: Any, index_name: str, version: int, suffix: str) -> dict:
    """Structure of the coordloader sharded-format section (contents vs files: assemble):
    the whole index in version 2, the "coordloader" section of an HF index in version 1."""
    if type(sec) is not dict:
        raise CheckpointError("\"coordloader\" section is not a JSON object", file=index_name)
    if sec.get("version") != version or type(sec.get("version")) is not int:
        raise CheckpointError(f"\"coordloader\" version {sec.get('version')!r}; expected "
                              f"{version}", file=index_name)
    if "layout" in sec and type(sec["layout"]) is not dict:
        raise CheckpointError("\"coordloader\".layout is not a JSON object", file=index_name)
    tensors = sec.get("tensors")
    if type(tensors) is not dict:
        raise CheckpointError("\"coordloader\".tensors is not a JSON object; expected "
                              "{name: {dtype, shape, pieces}}", file=index_name)
    for name, spec in tensors.items():
        def bad(msg):
            raise CheckpointError(f"coordloader section: {msg}", file=index_name, tensor=name)
        if type(spec) is not dict:
            bad("entry is not an object; expected {dtype, shape, pieces}")
        if type(spec.get("dtype")) is not str or spec["dtype"] not in _ITEMSIZE:
            bad(f"unknown dtype {str(spec.get('dtype'))[:40]!r}; expected one of {_DTYPE_LIST}")
        shape = spec.get("shape")
        if type(shape) is not list or any(type(x) is not int or not 0 <= x < _INT_LIMIT
                                          for x in shape):
            bad(f"shape {str(shape)[:80]}; expected a list of non-negative integers")
        if _stride_overflow(shape, _ITEMSIZE[spec["dtype"]]):
            bad(f"shape {str(shape)[:80]}: its strides overflow (the product of its dims, zero "
                f"dims counted as 1, is 2**63 bytes or more)")
        pieces = spec.get("pieces")
        if type(pieces) is not list or not pieces:
            bad("pieces is not a non-empty list")
        for p in pieces:
            if type(p) is not dict or type(p.get("key")) is not str:
                bad(f"piece {str(p)[:80]} is not an object with file, key, box")
            _check_name(p.get("file"), f"coordloader section, tensor {name!r}", index_name)
            if not p["file"].endswith(suffix):
                bad(f"piece file {p['file']!r}; expected a {suffix} file")
            if not _is_box(p.get("box"), len(shape)):
                bad(f"piece box {str(p.get('box'))[:80]}; expected {len(shape)} [start, stop] "
                    f"integer pairs")
    return sec


# --------------------------------------------------------------------------- assembly

def assemble(root: str, discovery: Discovery, headers: Iterable[FileHeader]) -> CheckpointMeta:
    """Cross-file checks (index vs files, duplicates, pieces tiling) -> CheckpointMeta."""
    by_file: dict[str, FileHeader] = {}
    for h in headers:
        if h.info.name in by_file:
            raise CheckpointError("header given twice to assemble", file=h.info.name)
        by_file[h.info.name] = h
    want = set(discovery.files)
    if set(by_file) != want:
        missing = sorted(want - set(by_file))
        extra = sorted(set(by_file) - want)
        raise CheckpointError(f"headers do not match the discovered files (missing {missing[:5]},"
                              f" unexpected {extra[:5]})", file=discovery.index_file)
    names = sorted(by_file)
    files = tuple(by_file[n].info for n in names)
    extents = False
    with gc_paused():
        if discovery.coordloader is not None:
            tensors = _assemble_sharded(discovery, by_file, names)
            layout = discovery.coordloader.get("layout")
        elif _dcp_files(by_file, names):
            idx = discovery.index_file
            shards = [n for n in names if DCP_SHARD_RE.match(n)]
            if idx is not None and shards:
                # torch DCP's per-rank output has no index: one beside it is not of this
                # save, and reading only the files it names would drop pieces
                raise CheckpointError(f"names torch DCP per-rank shards ({shards[0]}, ...), which "
                                      f"hold pieces of tensors and come without an index; "
                                      f"expected an index of whole tensors, or DCP's shards "
                                      f"alone in their directory", file=idx)
            if idx is None:
                _check_dcp_numbering(discovery.root, names)
            tensors = _assemble_dcp(by_file, names, idx)
            if idx is not None:
                _check_dcp_index(discovery, tensors)
            layout = None
            extents = True
        else:
            tensors, table = _assemble_plain(discovery, by_file, names)
            meta = CheckpointMeta(root=discovery.root, files=files, tensors=tensors,
                                  config=discovery.config)
            return with_table(meta, table)
    return CheckpointMeta(root=discovery.root, files=files, tensors=tensors,
                          config=discovery.config, source_layout=layout,
                          shapes_from_extents=extents)


def _dcp_info(header: FileHeader) -> str | None:
    for k, v in header.info.metadata:
        if k == DCP_SHARDING_INFO:
            return v
    return None


def _dcp_files(by_file, names) -> bool:
    """True when the files are torch DCP's HF sharded output (every file carries
    DCP_SHARDING_INFO); a mix of such files and plain ones is refused."""
    marked = [n for n in names if _dcp_info(by_file[n]) is not None]
    if marked and len(marked) != len(names):
        plain = next(n for n in names if _dcp_info(by_file[n]) is None)
        raise CheckpointError(f"has no {DCP_SHARDING_INFO} metadata, but {marked[0]!r} in the "
                              f"same directory is a torch DCP shard; expected one checkpoint per "
                              f"directory", file=plain)
    return bool(marked)


def _check_dcp_numbering(root: str, names) -> None:
    """What the names of torch DCP's per-rank files prove about the set: one save states
    one file count M and numbers its files up to M (from 1 as documented; torch does not
    enforce it, so a 0-based mapping's file 0 is let be), and numbers ranks from shard 1,
    whose file rank 0 always writes (DCP's deduplication gives rank 0 the first tensor it
    holds, in both of its modes). Nothing more is provable: a rank left nothing by
    deduplication writes no file at all (a gap in the shard numbers, or no file K for that
    rank), and nothing on disk records the number of ranks, so a missing later rank's file
    that held only whole tensors cannot be told from one never written
    (docs/reliability.md)."""
    found = [(n, int(m[1]), int(m[2]), int(m[3]))
             for n, m in ((n, DCP_SHARD_RE.match(n)) for n in names) if m]
    if not found:
        return
    by_count: dict[int, str] = {}
    for n, _, _, count in found:
        by_count.setdefault(count, n)
    if len(by_count) > 1:
        (a, ca), (b, cb) = ((by_count[c], c) for c in sorted(by_count)[:2])
        raise CheckpointError(f"holds torch DCP shards of different saves: {a} is one of {ca} "
                              f"files per rank and {b} one of {cb}, while one save states one "
                              f"count in every file name; expected one checkpoint per "
                              f"directory", file=root)
    for n, _, k, count in found:
        if k > count:
            raise CheckpointError(f"holds {n}, file {k} of {count}: torch DCP numbers a save's "
                                  f"files up to their count; expected model-K-of-{count:05d} "
                                  f"with K at most {count}", file=root)
    n, lowest, _, count = min(found, key=lambda f: f[1])
    if lowest == 0:
        raise CheckpointError(f"holds {n}: torch DCP numbers each rank's files from "
                              f"shard-00001 (rank 0); expected shard-00001 and up", file=root)
    if lowest > 1:
        first = "model-00001-of-00001" if count == 1 else f"model-*-of-{count:05d}"
        raise CheckpointError(f"holds torch DCP shards from {n} up but no shard-00001-{first}"
                              f".safetensors, rank 0's file: rank 0 writes one whenever it "
                              f"holds a tensor, so the copy is incomplete and every tensor "
                              f"only it held would be missing; expected every rank's "
                              f"shard-*.safetensors file", file=root)


def _assemble_dcp(by_file, names, index: str | None = None) -> dict[str, TensorInfo]:
    """torch DCP ``HuggingFaceStorageWriter(save_distributed=True)`` output: every file
    holds one rank's pieces under the tensors' own names, and its ``__metadata__``
    ``DCP_SHARDING_INFO`` gives each piece's ``saved_offsets`` in the global tensor. DCP
    records no global shape: it is the extent of the pieces, which must tile it exactly
    once (the checks of coordloader's own sharded format). Saved without
    ``save_distributed``, DCP writes an index (``index``) and every tensor must be whole,
    at offset 0: every rank writes the same file names then."""
    found: dict[str, list] = {}   # name -> [(dtype, box, SourcePiece)]
    for fname in names:
        info = _parse_json(_dcp_info(by_file[fname]).encode(), _INDEX_DECODER, fname,
                           f"__metadata__ {DCP_SHARDING_INFO}")
        keys = set()
        for key, dtype, shape, start, end in by_file[fname].entries:
            keys.add(key)
            spec = info.get(key)
            offs = spec.get(DCP_SAVED_OFFSETS) if type(spec) is dict else None
            if (type(offs) is not list or len(offs) != len(shape)
                    or any(type(o) is not int or not 0 <= o < _INT_LIMIT for o in offs)):
                raise CheckpointError(f"{DCP_SHARDING_INFO} gives the tensor {str(spec)[:80]}; "
                                      f"expected {{\"{DCP_SAVED_OFFSETS}\": [{len(shape)} "
                                      f"non-negative integers]}}", file=fname, tensor=key)
            if index is not None and any(offs):
                raise CheckpointError(
                    f"{DCP_SHARDING_INFO} places the tensor at offsets {offs}, but the index "
                    f"{index!r} beside it lists whole tensors: torch DCP writes an index when "
                    f"it saves without save_distributed, where every rank writes the same file "
                    f"names and one rank's pieces overwrite another's; expected whole tensors "
                    f"(a state dict saved from one rank), or save_distributed=True output "
                    f"(per-rank files, no index)", file=fname, tensor=key)
            box = tuple((o, o + s) for o, s in zip(offs, shape))
            found.setdefault(key, []).append((dtype, box, SourcePiece(fname, box, start, end,
                                                                      key)))
        extra = sorted(set(info) - keys)
        if extra:
            raise CheckpointError(f"{DCP_SHARDING_INFO} lists {extra[0][:200]!r}, which the file "
                                  f"does not store", file=fname, tensor=extra[0])
    order = []
    for name, parts in found.items():
        dtypes = {d for d, _, _ in parts}
        if len({len(b) for _, b, _ in parts}) > 1:
            raise CheckpointError(f"pieces have different numbers of dims "
                                  f"{sorted({len(b) for _, b, _ in parts})}; expected one",
                                  file=parts[0][2].file, tensor=name)
        if len(dtypes) > 1:
            raise CheckpointError(f"pieces are stored as {sorted(dtypes)}; expected one dtype",
                                  file=parts[0][2].file, tensor=name)
        shape = tuple(max((b[d][1] for _, b, _ in parts), default=0)
                      for d in range(len(parts[0][1])))
        if _stride_overflow(list(shape), _ITEMSIZE[parts[0][0]]):
            raise CheckpointError(f"pieces span shape {list(shape)[:8]}, whose strides overflow",
                                  file=parts[0][2].file, tensor=name)
        if _numel(list(shape)) * _ITEMSIZE[parts[0][0]] >= _INT_LIMIT:
            # each piece is below 2**63 bytes (its header entry's check), their union need
            # not be: as a header's tensor, the whole must be too
            raise CheckpointError(f"pieces span shape {list(shape)[:8]}, {parts[0][0]}: the "
                                  f"tensor would be 2**63 bytes or more; expected below 2**63",
                                  file=parts[0][2].file, tensor=name)
        pieces = sorted((p for _, _, p in parts), key=lambda p: p.box)
        _check_tiling(name, shape, pieces, pieces[0].file)
        first = min((p.file, p.start) for p in pieces)
        order.append((first, name, TensorInfo(name, parts[0][0], shape, tuple(pieces))))
    order.sort(key=lambda t: t[0])
    return {name: t for _, name, t in order}


def _check_dcp_index(discovery: Discovery, tensors: dict[str, TensorInfo]) -> None:
    """The index torch DCP writes beside a save without save_distributed, against the
    whole tensors its files hold: each listed under its file, and its total_size the bytes
    they hold. torch sums every rank's bytes into it, so a rank's file overwritten by
    another's (the same names on every rank) shows there."""
    keys = list(tensors)
    _check_weight_map(discovery.weight_map, discovery.index_file, keys,
                      [t.pieces[0].file for t in tensors.values()], tensors)
    total = discovery.total_size
    if total is None:
        raise CheckpointError("gives no integer metadata.total_size: torch DCP writes there the "
                              "bytes every rank saved, the one record that tells a state dict "
                              "saved from one rank from a file another rank's write overwrote "
                              "(every rank writes the same file names without "
                              "save_distributed); expected the index torch wrote",
                              file=discovery.index_file)
    held = sum(p.end - p.start for t in tensors.values() for p in t.pieces)
    if total != held:
        raise CheckpointError(f"gives total_size {total} bytes, but its files hold {held} "
                              f"bytes of tensors: torch DCP sums every rank's bytes into it, "
                              f"and without save_distributed every rank writes the same file "
                              f"names (one rank's overwrote another's); expected a state dict "
                              f"saved from one rank, or save_distributed=True output",
                              file=discovery.index_file)


def _check_weight_map(wm: dict[str, str], idx: str, keys: list[str], files: list[str],
                      stored) -> None:
    """Each stored tensor ``keys[i]`` (in file ``files[i]``) listed under its file in the
    index ``idx``'s weight_map ``wm``, and each tensor listed there stored (``stored``: a
    container of the stored names)."""
    for key, fname in zip(keys, files):
        listed = wm.get(key)
        if listed != fname:
            if listed is None:
                raise CheckpointError(f"tensor is in the file but not in the index {idx!r}",
                                      file=fname, tensor=key)
            raise CheckpointError(f"tensor is in the file but the index {idx!r} maps it "
                                  f"to {listed!r}", file=fname, tensor=key)
    if len(keys) != len(wm):
        for key, fname in wm.items():
            if key not in stored:
                raise CheckpointError(f"the index {idx!r} lists the tensor in this file but "
                                      f"the file does not contain it", file=fname, tensor=key)


def _refuse_coordloader_parts(fname: str, header: FileHeader) -> None:
    """A file coordloader wrote that holds parts of tensors under their names: a shard of a
    coordloader save read without its index (renamed, copied out, or left by a crash),
    whose keys ``name@a:b`` are pieces, never tensors of their own; or one rank's
    ``--dump`` file, whose tensors are that rank's slices (a tp=2 rank's embedding is half
    of it), read as whole tensors of that shape."""
    md = dict(header.info.metadata)
    if DUMP_PLAN_DIGEST in md and DUMP_RANK in md:
        raise CheckpointError(f"is coordloader's --dump of rank {md[DUMP_RANK][:20]}'s local "
                              f"tensors, each this rank's slice of a checkpoint tensor under "
                              f"its name, not a checkpoint; load or consolidate the checkpoint "
                              f"it was loaded from (compare a dump with a load, or read it "
                              f"with a safetensors reader)", file=fname)
    for k, v in header.info.metadata:
        if "@" in k and v.startswith("{") and '"box"' in v:
            raise CheckpointError(f"holds piece {k[:120]!r} of a coordloader sharded save; read "
                                  f"the save's directory (its index lists every piece), not its "
                                  f"shards on their own", file=fname)


def _assemble_plain(discovery: Discovery, by_file, names) -> tuple[TensorMap, TensorTable]:
    """A plain checkpoint's tensors (records made when first read) and their table, both
    from the headers' entries: every rank assembles all ~92k tensors of DeepSeek-V3, so
    the checks here run in C over all of them at once."""
    wm = discovery.weight_map
    idx = discovery.index_file
    counts = [len(by_file[f].entries) for f in names]
    entries = list(chain.from_iterable(by_file[f].entries for f in names))
    files = list(chain.from_iterable(map(repeat, names, counts)))
    keys = list(map(itemgetter(0), entries))
    rows = dict(zip(keys, range(len(keys))))
    # the files up to the first that stores a tensor again (an earlier file's, or one its
    # own header lists twice), each checked in turn as it is reached
    upto = len(names)
    twice = len(rows) != len(keys)
    if twice:
        seen: set[str] = set()
        for upto, (fname, n) in enumerate(zip(names, accumulate(counts)), 1):
            seen.update(map(itemgetter(0), by_file[fname].entries))
            if len(seen) != n:
                break
    for fname in names[:upto]:
        _refuse_coordloader_parts(fname, by_file[fname])
    if twice:
        _refuse_stored_twice(by_file, names[:upto])
    table = tensor_table(keys, list(map(itemgetter(2), entries)),
                         list(map(itemgetter(1), entries)),
                         np.repeat(np.arange(len(names)), counts),
                         map(itemgetter(3), entries), map(itemgetter(4), entries), None)
    tensors = TensorMap.of_entries(rows, entries, files)
    if wm is not None and dict(zip(keys, files)) != wm:
        # after the duplicate check, so a tensor stored twice is reported as such
        _check_weight_map(wm, idx, keys, files, rows)
    return tensors, table


def _refuse_stored_twice(by_file, names) -> None:
    """Raise for the first tensor of the last of ``names`` that an earlier file, or an
    earlier entry of its own header (a header built by hand), stores."""
    first: dict[str, str] = {}
    for fname in names[:-1]:
        for ent in by_file[fname].entries:
            first.setdefault(ent[0], fname)
    last = names[-1]
    for ent in by_file[last].entries:
        if ent[0] in first:
            raise CheckpointError(f"tensor is stored in both {first[ent[0]]!r} and "
                                  f"{last!r}; expected each tensor in exactly one file",
                                  file=last, tensor=ent[0])
        first[ent[0]] = last
    raise AssertionError("no tensor stored twice")   # the caller counted one


def _assemble_sharded(discovery: Discovery, by_file, names) -> dict[str, TensorInfo]:
    idx = discovery.index_file
    stored: dict[tuple[str, str], Entry] = {}
    for fname in names:
        for ent in by_file[fname].entries:
            stored[(fname, ent[0])] = ent
    used: set[tuple[str, str]] = set()
    order = []
    spec_tensors = discovery.coordloader["tensors"]
    wm = discovery.weight_map
    for name, spec in spec_tensors.items():
        dtype, shape = spec["dtype"], tuple(spec["shape"])
        pieces = []
        for p in spec["pieces"]:
            fname = p["file"]
            box = tuple((a, b) for a, b in p["box"])
            for d, (a, b) in enumerate(box):
                if not 0 <= a <= b <= shape[d]:
                    raise CheckpointError(f"piece box {list(map(list, box))} dim {d} [{a}, {b}) "
                                          f"is outside the shape {list(shape)}", file=idx,
                                          tensor=name)
            key = piece_key(name, box, shape)
            if p["key"] != key:
                raise CheckpointError(f"piece key {p['key'][:200]!r}; expected {key!r} for box "
                                      f"{list(map(list, box))}", file=idx, tensor=name)
            ent = stored.get((fname, key))
            if ent is None:
                raise CheckpointError(f"the index lists piece {key!r} in this file but the file "
                                      f"does not contain it", file=fname, tensor=name)
            if (fname, key) in used:
                raise CheckpointError(f"piece {key!r} is listed twice in the index", file=fname,
                                      tensor=name)
            used.add((fname, key))
            if ent[1] != dtype:
                raise CheckpointError(f"piece {key!r} is stored as {ent[1]}; the index says "
                                      f"{dtype}", file=fname, tensor=name)
            if ent[2] != box_shape(box):
                raise CheckpointError(f"piece {key!r} is stored with shape {list(ent[2])}; its "
                                      f"box needs {list(box_shape(box))}", file=fname,
                                      tensor=name)
            pieces.append(SourcePiece(fname, box, ent[3], ent[4], key))
        listed = wm.get(name, "") if wm is not None else None
        if listed == "":
            raise CheckpointError("tensor is in the coordloader section but not in the "
                                  "weight_map", file=idx, tensor=name)
        if listed is not None and listed not in {p.file for p in pieces}:
            raise CheckpointError(f"weight_map maps the tensor to {listed!r}, which holds none "
                                  f"of its pieces", file=idx, tensor=name)
        _check_tiling(name, shape, pieces, idx)
        pieces.sort(key=lambda p: p.box)
        first = min((p.file, p.start) for p in pieces)
        order.append((first, name, TensorInfo(name, dtype, shape, tuple(pieces))))
    if len(used) != len(stored):
        for fname in names:
            for ent in by_file[fname].entries:
                if (fname, ent[0]) not in used:
                    raise CheckpointError("key is stored in the file but the index's "
                                          "coordloader section does not list it", file=fname,
                                          tensor=ent[0])
    for name in wm or ():
        if name not in spec_tensors:
            raise CheckpointError("tensor is in the weight_map but not in the coordloader "
                                  "section", file=idx, tensor=name)
    order.sort(key=lambda t: t[0])
    return {name: t for _, name, t in order}


def _check_tiling(name: str, shape: tuple[int, ...], pieces: list[SourcePiece],
                  file: str | None) -> None:
    """The pieces (inside the shape, checked by the caller) tile it exactly once."""
    prob = tiling_problem([p.box for p in pieces], shape, allow_empty=True)
    if prob is None:
        return
    if prob.kind is TilingKind.OVERLAP:
        a, b = ([list(r) for r in pieces[k].box] for k in (prob.first, prob.second))
        raise CheckpointError(f"pieces {a} and {b} overlap; expected the pieces to tile the "
                              f"tensor exactly once", file=file, tensor=name)
    vol = sum(box_numel(p.box) for p in pieces)
    raise CheckpointError(f"pieces cover {vol} of {prod(shape)} elements of shape {list(shape)}; "
                          f"expected them to tile the tensor exactly", file=file, tensor=name)


# --------------------------------------------------------------------------- all in one

def read_checkpoint(root: str) -> CheckpointMeta:
    """discover + read every header + assemble, in this process."""
    with gc_paused():  # one pause for the whole read, not one per file
        disc = discover(root)
        return assemble(root, disc, [read_file_header(disc.root, f) for f in disc.files])
