"""Fuzz the header / index reader with mutations of real headers (issue 7): whatever the
bytes, the reader returns consistent metadata or raises CheckpointError — never another
exception, a hang, a large allocation, or an open() of a path outside the checkpoint
directory. ~2,200 examples in total across the tests below."""
from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import struct
import tempfile
import tracemalloc
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordloader.checkpoint.metadata import CheckpointMeta
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.errors import CheckpointError

from stfiles import hard_timeout, header_for, raw_file

MEM_LIMIT = 50 * 1024 * 1024
FUZZ = settings(deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
M = "model.safetensors"


def _bases() -> list[bytes]:
    """Real headers: one written by the HF safetensors library, one shaped like a real
    sharded model file (metadata, MoE names, FP8 weight + F32 scale, zero-size)."""
    out = []
    d = tempfile.mkdtemp(prefix="ckfuzz-base-")
    try:
        from safetensors.torch import save_file
        g = torch.Generator().manual_seed(1)
        save_file({"model.embed_tokens.weight": torch.randn(4, 3, generator=g).to(torch.bfloat16),
                   "lm_head.bias": torch.arange(3, dtype=torch.int64),
                   "flag": torch.ones(2, dtype=torch.bool)},
                  os.path.join(d, "hf.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "hf.safetensors"), "rb") as f:
            out.append(f.read())
    except ImportError:
        pass
    finally:
        shutil.rmtree(d, ignore_errors=True)
    hdr, n = header_for([("model.layers.3.mlp.experts.7.down_proj.weight", "F8_E4M3", [4, 8]),
                         ("model.layers.3.mlp.experts.7.down_proj.weight_scale_inv", "F32", [1, 1]),
                         ("model.layers.3.mlp.gate.e_score_correction_bias", "F32", [3]),
                         ("model.layers.3.self_attn.kv_a_layernorm.weight", "BF16", [2]),
                         ("empty", "F16", [0, 5]), ("scalar", "F64", [])],
                        metadata={"format": "pt", "producer": "ckfuzz"})
    out.append(raw_file(hdr, n))
    return out


BASES = _bases()


@contextmanager
def watched(root: str):
    """Record every path opened (os.open, open, io.open) and bound time while the reader
    runs; afterwards check nothing outside ``root`` was opened."""
    opened: list[str] = []
    real_os_open, real_open, real_io_open = os.open, builtins.open, io.open

    def os_open(path, *a, **k):
        opened.append(os.fspath(path))
        return real_os_open(path, *a, **k)

    def py_open(file, *a, **k):
        if not isinstance(file, int):
            opened.append(os.fspath(file))
        return real_open(file, *a, **k)

    # TimeoutError (an Exception): hypothesis still shrinks a case that hangs
    with hard_timeout(10, exc=TimeoutError):
        os.open, builtins.open, io.open = os_open, py_open, py_open
        try:
            yield opened
        finally:
            os.open, builtins.open, io.open = real_os_open, real_open, real_io_open
    for p in opened:
        assert os.path.dirname(os.path.abspath(p)) == root, f"opened {p!r} outside {root}"


@pytest.fixture(scope="module")
def traced():
    # Trace allocations only while the reader runs (check_read): tracing hypothesis's own
    # data generation would triple the run time.
    assert not tracemalloc.is_tracing()
    yield


def check_read(root: str):
    """Run the reader; only CheckpointError may escape; memory and paths are bounded."""
    tracemalloc.start()
    try:
        with watched(root):
            try:
                meta = read_checkpoint(root)
            except CheckpointError as e:
                assert str(e)
                meta = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEM_LIMIT, f"reader peaked at {peak} bytes"
    if meta is not None:  # accepted: it must describe the bytes on disk consistently
        assert isinstance(meta, CheckpointMeta)
        for t in meta.tensors.values():
            for p in t.pieces:
                f = meta.file(p.file)
                assert f.data_start <= p.start <= p.end <= f.size
    return meta


_ROOT = tempfile.mkdtemp(prefix="ckfuzz-")  # one directory, the file rewritten per example


def run_on(raw: bytes):
    with open(os.path.join(_ROOT, M), "wb") as f:
        f.write(raw)
    return check_read(_ROOT)


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    shutil.rmtree(_ROOT, ignore_errors=True)


def test_bases_are_valid(traced):
    for raw in BASES:
        assert run_on(raw) is not None


@settings(FUZZ, max_examples=600)
@given(base=st.sampled_from(range(len(BASES))),
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1,
                      max_size=8),
       in_header=st.booleans())
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_fuzz_byte_flips(traced, base, flips, in_header):
    raw = bytearray(BASES[base])
    hlen = struct.unpack("<Q", raw[:8])[0]
    span = 8 + hlen if in_header else len(raw)  # mostly hit the header/length prefix
    for pos, x in flips:
        raw[pos % span] ^= x
    run_on(bytes(raw))


@settings(FUZZ, max_examples=300)
@given(base=st.sampled_from(range(len(BASES))), cut=st.integers(0, 10**6))
def test_fuzz_truncations(traced, base, cut):
    raw = BASES[base]
    run_on(raw[:cut % len(raw)])


@settings(FUZZ, max_examples=300)
@given(base=st.sampled_from(range(len(BASES))),
       length=st.one_of(st.integers(0, 2**64 - 1), st.integers(2**64 - 2**16, 2**64 - 1),
                        st.integers(0, 4096), st.integers(99_999_000, 100_001_000)))
def test_fuzz_lengths(traced, base, length):
    raw = BASES[base]
    run_on(struct.pack("<Q", length) + raw[8:])


KEYS = st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", "w", "F32"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64),
                    st.integers(0, 64), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=8), st.sampled_from(["F32", "BF16", "U8", "F8_E4M3", "F4"]))
JSON = st.recursive(SCALARS, lambda ch: st.lists(ch, max_size=4) |
                    st.dictionaries(KEYS | st.text(max_size=4), ch, max_size=4), max_leaves=12)


@settings(FUZZ, max_examples=600)
@given(base=st.sampled_from(range(len(BASES))), value=JSON,
       where=st.sampled_from(["whole", "entry", "dtype", "shape", "data_offsets", "meta",
                              "extra"]),
       pick=st.integers(0, 100), extra_data=st.integers(-8, 8))
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_fuzz_json_values(traced, base, value, where, pick, extra_data):
    raw = BASES[base]
    hlen = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + hlen])
    data = raw[8 + hlen:]
    names = [k for k in hdr if k != "__metadata__"]
    name = names[pick % len(names)]
    if where == "whole":
        hdr = value
    elif where == "entry":
        hdr[name] = value
    elif where == "meta":
        hdr["__metadata__"] = value
    elif where == "extra":
        hdr["zz"] = value
    else:
        hdr[name][where] = value
    text = json.dumps(hdr)  # NaN/Infinity come out as bare tokens, huge ints as digits
    data = data[:len(data) + extra_data] if extra_data < 0 else data + b"\0" * extra_data
    run_on(raw_file(text, data))


@settings(FUZZ, max_examples=400)
@given(names=st.lists(st.one_of(
           st.sampled_from(["s1.safetensors", "s2.safetensors", "../s1.safetensors",
                            "/etc/passwd", "..", "s1.safetensors\x00", "sub/s1.safetensors",
                            "..\\s1.safetensors", "s3.safetensors", "x.bin", ".", ""]),
           st.text(max_size=12)), min_size=1, max_size=4),
       tensors=st.lists(st.sampled_from(["a", "b", "c", "ghost"]), min_size=1, max_size=4),
       junk=st.one_of(st.none(), JSON))
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_fuzz_index(traced, names, tensors, junk):
    root = tempfile.mkdtemp(prefix="ckfuzz-idx-")
    try:
        for fname, ts in (("s1.safetensors", [("a", "F32", [2])]),
                          ("s2.safetensors", [("b", "U8", [3]), ("c", "BF16", [1, 2])])):
            hdr, n = header_for(ts)
            with open(os.path.join(root, fname), "wb") as f:
                f.write(raw_file(hdr, n))
        if junk is not None:
            idx = {"weight_map": junk}
        else:
            idx = {"weight_map": {t: names[i % len(names)] for i, t in enumerate(tensors)}}
        with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps(idx))
        check_read(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_watch_catches_outside_open(tmp_path):
    """The fuzz tests' path guard itself can fail."""
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    with pytest.raises(AssertionError, match="outside"):
        with watched(_ROOT):
            fd = os.open(str(outside), os.O_RDONLY)
            os.close(fd)


def _brute_overlap(boxes) -> bool:
    return any(all(a0 < b1 and a1 < b0 for (a0, b0), (a1, b1) in zip(x, y))
               for i, x in enumerate(boxes) for y in boxes[i + 1:])


@st.composite
def _boxes(draw):
    ndim = draw(st.integers(1, 3))
    n = draw(st.integers(2, 7))
    out = []
    for _ in range(n):
        box = []
        for _ in range(ndim):
            a = draw(st.integers(0, 5))
            box.append((a, a + draw(st.integers(1, 4))))
        out.append(tuple(box))
    return out


@settings(FUZZ, max_examples=400)
@given(boxes=_boxes())
def test_overlap_sweep_matches_brute_force(boxes):
    """The sorted sweep used to check that a tensor's pieces tile it finds an overlap
    exactly when some pair of boxes intersects, and the pair it names does intersect."""
    from coordloader.checkpoint.tiling import find_overlap
    pair = find_overlap(boxes)
    assert (pair is not None) == _brute_overlap(boxes)
    if pair is not None:
        i, j = pair
        assert i != j and _brute_overlap([boxes[i], boxes[j]])
