"""Raw safetensors building blocks for reader tests: valid files, and the pieces to break
them (independent of coordloader.synth / safetensors_io so the reader is tested against
the format, not against our own writer)."""
from __future__ import annotations

import json
import os
import signal
import struct
from contextlib import contextmanager
from math import prod

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
            "F8_E8M0": 1, "C64": 8}


def header_for(tensors, metadata=None):
    """tensors: [(name, dtype, shape)] laid out contiguously in order -> (header dict, data len)."""
    hdr = {}
    if metadata is not None:
        hdr["__metadata__"] = metadata
    pos = 0
    for name, dtype, shape in tensors:
        n = prod(shape) * ITEMSIZE[dtype]
        hdr[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    return hdr, pos


def raw_file(header, data=b"", *, length=None, pad=True) -> bytes:
    """8-byte LE length + header + data. header: dict (dumped), str or bytes, used as is.
    data: bytes or an int (that many deterministic bytes). length overrides the prefix."""
    if isinstance(header, dict):
        hb = json.dumps(header, separators=(",", ":")).encode()
    elif isinstance(header, str):
        hb = header.encode()
    else:
        hb = bytes(header)
    if pad and len(hb) % 8:
        hb += b" " * (8 - len(hb) % 8)
    if isinstance(data, int):
        data = bytes((i * 7 + 3) & 0xFF for i in range(data))
    n = len(hb) if length is None else length
    return struct.pack("<Q", n) + hb + data


def write_raw(path, header, data=b"", **kw) -> str:
    with open(path, "wb") as f:
        f.write(raw_file(header, data, **kw))
    return str(path)


def write_st(path, tensors, metadata=None) -> str:
    """A valid safetensors file with deterministic content."""
    hdr, n = header_for(tensors, metadata)
    return write_raw(path, hdr, n)


def write_index(directory, weight_map, coordloader=None, name="model.safetensors.index.json",
                raw=None) -> str:
    idx = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    if coordloader is not None:
        idx["coordloader"] = coordloader
    p = os.path.join(directory, name)
    with open(p, "w") as f:
        f.write(raw if raw is not None else json.dumps(idx))
    return p


def write_sharded(directory, shards: dict, *, index=True, **kw) -> dict:
    """shards: {file name: [(name, dtype, shape)]}. Writes the files and (optionally) an
    HF index; returns the weight_map."""
    wm = {}
    for fname, tensors in shards.items():
        write_st(os.path.join(directory, fname), tensors)
        for t in tensors:
            wm[t[0]] = fname
    if index:
        write_index(directory, wm, **kw)
    return wm


class Blocked(BaseException):
    """Raised by ``hard_timeout``; a BaseException so no ``except OSError`` /
    ``except Exception`` in the code under test can swallow it."""


@contextmanager
def hard_timeout(seconds=10, exc=Blocked):
    """A reader that blocks (e.g. opening a FIFO) or spins fails the test instead of
    hanging it: SIGALRM raises ``exc`` after ``seconds``."""
    def fire(*_):
        raise exc(f"blocked or spun for {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
