"""Strict checkpoint reader: one test per hostile / malformed input, plus the layouts it
must accept. Files are built as raw bytes (tests/stfiles.py), not with our own writer."""
from __future__ import annotations

import json
import os
import pickle
import re
import socket
import struct
import tracemalloc
from dataclasses import fields
from hashlib import sha256

import pytest
import torch
from safetensors.torch import save_file

from coordloader.checkpoint import reader as ck
from coordloader.checkpoint.metadata import CheckpointMeta, FileInfo, SourcePiece, TensorInfo
from coordloader.checkpoint.reader import (
    Discovery,
    FileHeader,
    assemble,
    discover,
    read_checkpoint,
    read_file_header,
)
from coordloader.errors import CheckpointError, VerifyError

from stfiles import (
    hard_timeout,
    header_for,
    raw_file,
    write_index,
    write_raw,
    write_sharded,
    write_st,
)

M = "model.safetensors"


def bad(path, *fragments, fn=read_checkpoint):
    with hard_timeout():
        with pytest.raises(CheckpointError) as ei:
            fn(str(path))
    msg = str(ei.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return ei.value


def one(tmp_path, header, data=b"", **kw):
    write_raw(tmp_path / M, header, data, **kw)
    return tmp_path


GOOD = [("a", "F32", [2, 3]), ("b", "BF16", [4]), ("c", "U8", [])]


# ------------------------------------------------------------------ file size / length prefix

def test_file_shorter_than_8_bytes(tmp_path):
    (tmp_path / M).write_bytes(b"\x05\x00\x00")
    bad(tmp_path, M, "3 bytes", "at least 8")


def test_empty_file(tmp_path):
    (tmp_path / M).write_bytes(b"")
    bad(tmp_path, M, "0 bytes", "at least 8")


def test_header_length_larger_than_file(tmp_path):
    one(tmp_path, {}, length=1000)
    bad(tmp_path, M, "header length 1000 exceeds the file size")


def test_header_length_near_2_pow_64_no_allocation(tmp_path):
    one(tmp_path, {}, length=2**64 - 1)
    tracemalloc.start()
    try:
        bad(tmp_path, M, str(2**64 - 1), "exceeds the file size")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_header_length_over_100mb_checked_before_reading(tmp_path):
    # A sparse 200 MB file whose prefix claims a 150 MB header: refused by the cap, and
    # nothing of that size is allocated.
    p = tmp_path / M
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", 150_000_000) + b"{}")
        f.truncate(200_000_000)
    tracemalloc.start()
    try:
        bad(tmp_path, M, "header length 150000000", "100000000-byte limit")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


# ------------------------------------------------------------------ JSON level

def test_header_not_utf8(tmp_path):
    one(tmp_path, b'{"a\xff\xfe": 1}')
    bad(tmp_path, M, "not valid UTF-8", "JSON object")


def test_header_not_json(tmp_path):
    one(tmp_path, '{"a": {"dtype": ')
    bad(tmp_path, M, "not valid JSON", "expected a JSON object")


@pytest.mark.parametrize("text,kind", [("[1, 2]", "list"), ('"x"', "str"), ("7", "int"),
                                       ("null", "NoneType")])
def test_header_not_an_object(tmp_path, text, kind):
    one(tmp_path, text)
    bad(tmp_path, M, f"JSON {kind}", "expected a JSON object")


def test_duplicate_keys_refused(tmp_path):
    hdr = ('{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
           '"w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}')
    one(tmp_path, hdr, 2)
    bad(tmp_path, M, "duplicate key 'w'")


def test_tensor_name_that_is_no_utf8_refused(tmp_path):
    """A JSON escape of a lone surrogate gave a name no UTF-8 holds: the cpu engine loaded
    it, and verify="full" (through the safetensors library, which refuses the file)
    reported the load corrupt."""
    one(tmp_path, '{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', 1)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(tmp_path))
    assert str(e.value) == ("file model.safetensors, tensor '\\ud800': tensor name holds a lone "
                            "surrogate (a \\ud800-\\udfff escape), which is not UTF-8; expected "
                            "a UTF-8 name")


def test_metadata_that_is_no_utf8_refused(tmp_path):
    """The same in a __metadata__ value: loaded, then a false corruption from verify."""
    one(tmp_path, '{"__metadata__": {"note": "\\ud800"}, '
                  '"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', 1)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(tmp_path))
    assert str(e.value) == ("file model.safetensors: __metadata__ entry 'note' holds a lone "
                            "surrogate (a \\ud800-\\udfff escape), which is not UTF-8; "
                            "expected UTF-8 strings")
    # an escaped backslash before "ud800" is an ordinary string
    one(tmp_path, '{"__metadata__": {"note": "\\\\ud800"}, '
                  '"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', 1)
    assert read_checkpoint(str(tmp_path)).files[0].metadata == (("note", "\\ud800"),)


def test_duplicate_keys_inside_entry_refused(tmp_path):
    hdr = '{"w": {"dtype": "U8", "dtype": "F32", "shape": [1], "data_offsets": [0, 1]}}'
    one(tmp_path, hdr, 1)
    bad(tmp_path, M, "duplicate key 'dtype'")


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_refused(tmp_path, const):
    one(tmp_path, '{"w": {"dtype": "U8", "shape": [%s], "data_offsets": [0, 1]}}' % const, 1)
    bad(tmp_path, M, const, "finite numbers")


def test_huge_integer_refused(tmp_path):
    one(tmp_path, '{"w": {"dtype": "U8", "shape": [%s], "data_offsets": [0, 1]}}' % ("9" * 5000), 1)
    bad(tmp_path, M, "5000 digits")


def test_huge_integer_refused_without_int_digit_limit(tmp_path):
    # With Python's int digit limit switched off the reader parses ints itself and refuses
    # long ones before converting (a 100 MB integer would take minutes to convert).
    import sys
    one(tmp_path, '{"w": {"dtype": "U8", "shape": [%s], "data_offsets": [0, 1]}}' % ("9" * 5000), 1)
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        bad(tmp_path, M, "5000 digits", "2**63")
    finally:
        sys.set_int_max_str_digits(old)


@pytest.mark.parametrize("ent,frag", [
    ({"dtype": "U8", "shape": [2**63], "data_offsets": [0, 1]}, "below 2**63"),
    ({"dtype": "U8", "shape": [1], "data_offsets": [2**64 + 1, 2**64 + 2]}, "end < 2**63"),
    ({"dtype": "U8", "shape": [1], "data_offsets": [0, 10**40]}, "end < 2**63")])
def test_integers_at_least_2_pow_63_refused(tmp_path, ent, frag):
    entry(tmp_path, ent, 1)
    bad(tmp_path, M, "tensor 'w'", frag)


def test_huge_float_refused(tmp_path):
    one(tmp_path, '{"w": {"dtype": "U8", "shape": [1e999], "data_offsets": [0, 1]}}', 1)
    bad(tmp_path, M, "1e999", "not an integer")


@pytest.mark.parametrize("nest", ["[" * 100_000, '{"a":' * 100_000, "[1," * 50_000])
def test_deeply_nested_json_refused(tmp_path, nest):
    one(tmp_path, '{"w": ' + nest)
    bad(tmp_path, M, "nested too deeply")


def test_metadata_not_str_to_str(tmp_path):
    hdr, n = header_for(GOOD, metadata={"format": "pt", "step": 3})
    one(tmp_path, hdr, n)
    bad(tmp_path, M, "__metadata__", "strings to strings")


def test_metadata_not_an_object(tmp_path):
    hdr, n = header_for(GOOD, metadata=["format", "pt"])
    one(tmp_path, hdr, n)
    bad(tmp_path, M, "__metadata__", "strings to strings")


# ------------------------------------------------------------------ tensor entries

def entry(tmp_path, ent, data=4, name="w"):
    one(tmp_path, {name: ent}, data)
    return tmp_path


def test_entry_not_an_object(tmp_path):
    entry(tmp_path, [1, 2])
    bad(tmp_path, M, "tensor 'w'", "JSON list", "dtype, shape, data_offsets")


def test_entry_missing_and_extra_keys(tmp_path):
    entry(tmp_path, {"dtype": "U8", "shape": [4], "offsets": [0, 4]})
    bad(tmp_path, M, "tensor 'w'", "missing ['data_offsets']", "unexpected ['offsets']")


def test_unknown_dtype(tmp_path):
    entry(tmp_path, {"dtype": "F4", "shape": [4], "data_offsets": [0, 4]})
    bad(tmp_path, M, "tensor 'w'", "unknown dtype 'F4'", "BF16", "F8_E4M3", "U64")


def test_dtype_not_a_string(tmp_path):
    entry(tmp_path, {"dtype": ["U8"], "shape": [4], "data_offsets": [0, 4]})
    bad(tmp_path, M, "tensor 'w'", "unknown dtype")


@pytest.mark.parametrize("shape,frag", [(4, "shape is int"), ({"a": 4}, "shape is dict"),
                                        ([2, -2], "element -2"), ([True, 4], "element True"),
                                        ([4, "1"], "element 1"), ([[4]], "element [4]")])
def test_shape_not_list_of_non_negative_ints(tmp_path, shape, frag):
    entry(tmp_path, {"dtype": "U8", "shape": shape, "data_offsets": [0, 4]})
    bad(tmp_path, M, "tensor 'w'", frag, "non-negative integers")


@pytest.mark.parametrize("offs", [4, [0], [0, 4, 4], [False, 4], [0, "4"], None])
def test_data_offsets_not_two_ints(tmp_path, offs):
    entry(tmp_path, {"dtype": "U8", "shape": [4], "data_offsets": offs})
    bad(tmp_path, M, "tensor 'w'", "expected two integers")


def test_data_offsets_begin_after_end(tmp_path):
    entry(tmp_path, {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]})
    bad(tmp_path, M, "tensor 'w'", "[4, 0]", "begin <= end")


def test_data_offsets_negative(tmp_path):
    entry(tmp_path, {"dtype": "U8", "shape": [4], "data_offsets": [-4, 0]})
    bad(tmp_path, M, "tensor 'w'", "0 <= begin")


def test_byte_length_mismatch(tmp_path):
    entry(tmp_path, {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]})
    bad(tmp_path, M, "tensor 'w'", "span 4 bytes", "needs 8")


def test_huge_shape_no_overflow_no_allocation(tmp_path):
    entry(tmp_path, {"dtype": "F64", "shape": [10**18, 10**18, 10**18], "data_offsets": [0, 4]})
    bad(tmp_path, M, "tensor 'w'", "more than 2**63")


def test_long_list_of_huge_dims_is_fast(tmp_path):
    # 200k dims of 10**18: a naive product would build a 12-million-digit integer.
    entry(tmp_path, {"dtype": "U8", "shape": [10**18] * 200_000, "data_offsets": [0, 4]})
    bad(tmp_path, M, "tensor 'w'", "more than 2**63")


def test_offsets_overlap(tmp_path):
    one(tmp_path, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                   "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6)
    bad(tmp_path, M, "tensor 'b'", "overlap tensor 'a'")


def test_offsets_gap(tmp_path):
    one(tmp_path, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                   "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}}, 10)
    bad(tmp_path, M, "tensor 'b'", "gap of 2 bytes")


def test_data_not_starting_at_zero(tmp_path):
    one(tmp_path, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6)
    bad(tmp_path, M, "tensor 'a'", "gap of 2 bytes")


def test_trailing_bytes_after_data(tmp_path):
    hdr, n = header_for(GOOD)
    one(tmp_path, hdr, n + 3)
    e = bad(tmp_path, M, "end exactly at end of file")
    assert e.file == M


def test_data_beyond_end_of_file(tmp_path):
    hdr, n = header_for(GOOD)
    one(tmp_path, hdr, n - 1)
    bad(tmp_path, M, "end exactly at end of file")


def test_empty_header_with_data(tmp_path):
    one(tmp_path, {}, 8)
    bad(tmp_path, M, "end exactly at end of file")


# ------------------------------------------------------------------ file types / paths

def test_symlink_to_directory_refused(tmp_path):
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / M)
    bad(tmp_path, M, "is a directory", "regular file")


def test_symlink_to_device_refused(tmp_path):
    os.symlink("/dev/zero", tmp_path / M)
    bad(tmp_path, M, "character device", "regular file")


def test_fifo_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / M)
    bad(tmp_path, M, "a FIFO", "regular file")


def test_fifo_shard_in_index_refused(tmp_path):
    wm = write_sharded(tmp_path, {"s1.safetensors": GOOD[:1], "s2.safetensors": GOOD[1:]})
    os.unlink(tmp_path / "s2.safetensors")
    os.mkfifo(tmp_path / "s2.safetensors")
    assert wm
    bad(tmp_path, "s2.safetensors", "a FIFO")


def test_socket_refused(tmp_path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / M))
        bad(tmp_path, M, "a socket")
    finally:
        s.close()


def test_dangling_symlink_refused(tmp_path):
    os.symlink(tmp_path / "nowhere", tmp_path / M)
    bad(tmp_path, M, "missing file")


def test_read_file_header_refuses_path_names(tmp_path):
    write_st(tmp_path / M, GOOD)
    for name in ["../x.safetensors", "/etc/passwd", "a\\b.safetensors", "a\x00b"]:
        with pytest.raises(CheckpointError, match="plain file name"):
            read_file_header(str(tmp_path), name)


# ------------------------------------------------------------------ index

def sharded_ok(tmp_path):
    return write_sharded(tmp_path, {"model-00001-of-00002.safetensors": GOOD[:2],
                                    "model-00002-of-00002.safetensors": GOOD[2:]})


def test_weight_map_missing(tmp_path):
    sharded_ok(tmp_path)
    write_index(tmp_path, None, raw='{"metadata": {}}')
    bad(tmp_path, "model.safetensors.index.json", "no weight_map", "tensor name: file name")


def test_weight_map_not_str_to_str(tmp_path):
    sharded_ok(tmp_path)
    write_index(tmp_path, {"a": ["model-00001-of-00002.safetensors"]})
    bad(tmp_path, "model.safetensors.index.json", "tensor 'a'", "expected a file name string")


@pytest.mark.parametrize("value,frag", [
    (7, "value is int"), (["x.safetensors"], "value is list"),
    ("x.bin", "pickle checkpoint"), ("x.txt", "expected .safetensors files only")])
def test_weight_map_first_bad_entry_named_in_index_order(tmp_path, value, frag):
    # the distinct file names are checked once each; a problem is still reported at the
    # first entry in index order, with its tensor
    wm = sharded_ok(tmp_path)
    wm = {"z": "model-00001-of-00002.safetensors", "m": value, "b2": value, **wm}
    write_index(tmp_path, wm)
    with pytest.raises(CheckpointError) as ei:
        read_checkpoint(str(tmp_path))
    assert frag in str(ei.value)
    if "pickle" not in frag:
        assert ei.value.tensor == "m"


@pytest.mark.parametrize("fname,frag", [
    ("sub/x.safetensors", "path separator"), ("..\\x.safetensors", "path separator"),
    ("../x.safetensors", "path separator"), ("..", "'..'"),
    ("/etc/passwd", "path separator"), ("x\x00.safetensors", "NUL"), ("", "non-empty")])
def test_weight_map_unsafe_names(tmp_path, fname, frag):
    wm = sharded_ok(tmp_path)
    wm["a"] = fname
    write_index(tmp_path, wm)
    bad(tmp_path, "model.safetensors.index.json", frag)


def test_weight_map_absolute_name_without_slash(tmp_path):
    assert ck._check_name("x.safetensors", "t", None) == "x.safetensors"
    # '..' inside a plain name is no traversal (only a separator or the name '..' is)
    assert ck._check_name("model-v1..2.safetensors", "t", None) == "model-v1..2.safetensors"
    with pytest.raises(CheckpointError, match="absolute"):
        ck._check_name(".", "t", None)


def test_index_empty_weight_map(tmp_path):
    sharded_ok(tmp_path)
    write_index(tmp_path, {})
    bad(tmp_path, "model.safetensors.index.json", "lists no files")


def test_no_fd_leak_on_errors(tmp_path):
    cases = []
    for i, (hdr, data, kw) in enumerate([({}, b"", {"length": 2**64 - 1}), ("[1]", b"", {}),
                                         ({"w": {"dtype": "X"}}, b"", {}),
                                         (header_for(GOOD)[0], 5, {})]):
        d = tmp_path / f"c{i}"
        d.mkdir()
        write_raw(d / M, hdr, data, **kw)
        cases.append(d)
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / M)
    cases.append(tmp_path / "fifo")
    (tmp_path / "ok").mkdir()
    write_st(tmp_path / "ok" / M, GOOD)
    before = len(os.listdir("/proc/self/fd"))
    # the count is compared exactly: one fd leaked by any case fails after one round
    for d in cases:
        bad(d)
    read_checkpoint(str(tmp_path / "ok"))
    assert len(os.listdir("/proc/self/fd")) == before


def test_index_listed_file_missing(tmp_path):
    wm = sharded_ok(tmp_path)
    wm["z"] = "model-00003-of-00003.safetensors"
    write_index(tmp_path, wm)
    bad(tmp_path, "model.safetensors.index.json", "model-00003-of-00003.safetensors",
        "does not exist")


def test_index_tensor_absent_from_its_file(tmp_path):
    wm = sharded_ok(tmp_path)
    wm["ghost"] = "model-00002-of-00002.safetensors"
    write_index(tmp_path, wm)
    bad(tmp_path, "model-00002-of-00002.safetensors", "tensor 'ghost'",
        "does not contain it")


def test_tensor_in_file_not_in_index(tmp_path):
    wm = sharded_ok(tmp_path)
    del wm["b"]
    write_index(tmp_path, wm)
    bad(tmp_path, "model-00001-of-00002.safetensors", "tensor 'b'", "not in the index")


def test_tensor_in_file_index_says_other_file(tmp_path):
    wm = sharded_ok(tmp_path)
    wm["b"] = "model-00002-of-00002.safetensors"
    write_index(tmp_path, wm)
    bad(tmp_path, "model-00001-of-00002.safetensors", "tensor 'b'",
        "maps it to 'model-00002-of-00002.safetensors'")


@pytest.mark.parametrize("index", [True, False], ids=["with_index", "no_index"])
def test_same_tensor_in_two_files(tmp_path, index):
    write_sharded(tmp_path, {"s1.safetensors": GOOD[:2], "s2.safetensors": GOOD[1:]},
                  index=index)
    bad(tmp_path, "tensor 'b'", "stored in both 's1.safetensors' and 's2.safetensors'")


@pytest.mark.parametrize("index", [True, False], ids=["with_index", "no_index"])
def test_tensor_stored_again_files_later(tmp_path, index):
    # the first file that stores it and the first that stores it again, files in between
    write_sharded(tmp_path, {"s1.safetensors": GOOD[:2], "s2.safetensors": [("d", "F32", [1])],
                             "s3.safetensors": [("e", "F32", [2]), GOOD[1]],
                             "s4.safetensors": [GOOD[1]]}, index=index)
    bad(tmp_path, "file s3.safetensors, tensor 'b'",
        "stored in both 's1.safetensors' and 's3.safetensors'")


def test_header_built_with_a_name_twice_is_refused_by_name(tmp_path):
    # headers gathered from other ranks reach assemble() without the JSON parser's
    # duplicate-key check: a header repeating a name is the same CheckpointError
    write_st(tmp_path / M, GOOD)
    h = ck.read_file_header(str(tmp_path), M)
    doubled = ck.FileHeader(h.info, h.entries + h.entries[1:2])
    with pytest.raises(CheckpointError) as ei:
        ck.assemble(str(tmp_path), ck.discover(str(tmp_path)), [doubled])
    assert ei.value.file == M and ei.value.tensor == "b"
    assert f"stored in both {M!r} and {M!r}" in str(ei.value)


def test_index_not_json_and_duplicate_keys(tmp_path):
    sharded_ok(tmp_path)
    write_index(tmp_path, None, raw='{"weight_map": {"a": "x.safetensors", '
                                    '"a": "y.safetensors"}}')
    bad(tmp_path, "model.safetensors.index.json", "duplicate key 'a'")
    write_index(tmp_path, None, raw='{"weight_map": {"a": NaN}}')
    bad(tmp_path, "model.safetensors.index.json", "NaN")
    write_index(tmp_path, None, raw='{"weight_map": ' + "[" * 50_000)
    bad(tmp_path, "model.safetensors.index.json", "nested too deeply")


def test_index_is_a_fifo(tmp_path):
    sharded_ok(tmp_path)
    os.unlink(tmp_path / "model.safetensors.index.json")
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    bad(tmp_path, "model.safetensors.index.json", "a FIFO")


def test_bad_config_json(tmp_path):
    write_st(tmp_path / M, GOOD)
    (tmp_path / "config.json").write_text('{"a": 1, "a": 2}')
    bad(tmp_path, "config.json", "duplicate key 'a'")
    (tmp_path / "config.json").write_text('[1]')
    bad(tmp_path, "config.json", "expected a JSON object")


# ------------------------------------------------------------------ pickle checkpoints

def test_pickle_directory_refused(tmp_path):
    evil = tmp_path / "pytorch_model.bin"
    evil.write_bytes(b"\x80\x04crash")
    (tmp_path / "config.json").write_text("{}")
    bad(tmp_path, "pytorch_model.bin", "only safetensors", "never unpickled")


@pytest.mark.parametrize("ext", [".bin", ".pt", ".pth", ".ckpt"])
def test_pickle_file_path_refused(tmp_path, ext):
    p = tmp_path / ("model" + ext)
    p.write_bytes(b"\x80\x04crash")
    bad(p, "model" + ext, "only safetensors")


def test_index_listing_pickle_refused(tmp_path):
    wm = sharded_ok(tmp_path)
    (tmp_path / "pytorch_model-00001.bin").write_bytes(b"x")
    wm["a"] = "pytorch_model-00001.bin"
    write_index(tmp_path, wm)
    bad(tmp_path, "pytorch_model-00001.bin", "only safetensors")


def test_no_checkpoint_at_all(tmp_path):
    (tmp_path / "README.md").write_text("hi")
    bad(tmp_path, str(tmp_path), "no .safetensors files")
    bad(tmp_path / "missing", str(tmp_path / "missing"), "does not exist")


# ------------------------------------------------------------------ accepted layouts

def check_bytes(meta: CheckpointMeta):
    """Every tensor's absolute byte range holds the deterministic pattern of its offset."""
    for t in meta.tensors.values():
        for p in t.pieces:
            with open(os.path.join(meta.root, p.file), "rb") as f:
                f.seek(p.start)
                data = f.read(p.end - p.start)
            fi = meta.file(p.file)
            rel = p.start - fi.data_start
            assert data == bytes(((rel + i) * 7 + 3) & 0xFF for i in range(len(data)))


def test_single_file(tmp_path):
    tensors = [("z", "F16", [3, 2]), ("a", "I64", [2]), ("flag", "BOOL", [5]),
               ("empty", "F32", [0, 7]), ("s", "F8_E4M3", [])]
    hdr, n = header_for(tensors, metadata={"format": "pt", "b": "x"})
    raw = raw_file(hdr, n)
    (tmp_path / M).write_bytes(raw)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eps": 1e-6}))
    meta = read_checkpoint(str(tmp_path))
    assert meta.root == str(tmp_path)
    assert meta.config == {"model_type": "llama", "eps": 1e-6}
    hlen = struct.unpack("<Q", raw[:8])[0]
    assert meta.files == (FileInfo(M, len(raw), hlen, sha256(raw[8:8 + hlen]).hexdigest(),
                                   (("b", "x"), ("format", "pt"))),)
    assert list(meta.tensors) == ["z", "a", "flag", "empty", "s"]
    z = meta.tensors["z"]
    assert z == TensorInfo("z", "F16", (3, 2), (SourcePiece(M, ((0, 3), (0, 2)), 8 + hlen,
                                                            8 + hlen + 12, "z"),))
    assert meta.tensors["empty"].pieces[0].start == meta.tensors["empty"].pieces[0].end
    assert meta.tensors["s"].shape == ()
    assert meta.total_bytes == n
    check_bytes(meta)


def test_tensors_sorted_by_offset_not_header_order(tmp_path):
    hdr = {"late": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
           "zero2": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]},
           "early": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
           "zero1": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}
    one(tmp_path, hdr, 6)
    meta = read_checkpoint(str(tmp_path))
    assert list(meta.tensors) == ["zero1", "early", "zero2", "late"]


def test_no_tensors(tmp_path):
    one(tmp_path, {"__metadata__": {"k": "v"}})
    meta = read_checkpoint(str(tmp_path))
    assert meta.tensors == {} and meta.files[0].metadata == (("k", "v"),)


def test_path_to_single_file(tmp_path):
    write_st(tmp_path / "weights.safetensors", GOOD)
    write_st(tmp_path / "other.safetensors", GOOD)
    meta = read_checkpoint(str(tmp_path / "weights.safetensors"))
    assert [f.name for f in meta.files] == ["weights.safetensors"]
    assert meta.root == str(tmp_path)
    d = discover(str(tmp_path / "weights.safetensors"))
    h = read_file_header(str(tmp_path / "weights.safetensors"), "weights.safetensors")
    assert assemble(str(tmp_path), d, [h]) == meta
    check_bytes(meta)


def test_sharded_with_index(tmp_path):
    shards = {"model-00002-of-00003.safetensors": [("l1.w", "BF16", [4, 4]), ("l1.b", "F32", [4])],
              "model-00001-of-00003.safetensors": [("embed", "F32", [8, 2])],
              "model-00003-of-00003.safetensors": [("head", "F16", [2, 8]), ("l2.w", "U8", [3])]}
    write_sharded(tmp_path, shards)
    (tmp_path / "stray.safetensors").write_bytes(b"not used: the index decides")
    meta = read_checkpoint(str(tmp_path))
    assert [f.name for f in meta.files] == sorted(shards)
    assert list(meta.tensors) == ["embed", "l1.w", "l1.b", "head", "l2.w"]
    assert meta.tensors["head"].file == "model-00003-of-00003.safetensors"
    assert all(t.is_whole for t in meta.tensors.values())
    check_bytes(meta)


def test_six_digit_zero_based_names(tmp_path):
    shards = {f"model-{i:06d}-of-{3:06d}.safetensors": [(f"t{i}", "F32", [i + 1])]
              for i in range(3)}
    write_sharded(tmp_path, shards)
    meta = read_checkpoint(str(tmp_path))
    assert [f.name for f in meta.files] == [f"model-{i:06d}-of-000003.safetensors"
                                            for i in range(3)]
    assert list(meta.tensors) == ["t0", "t1", "t2"]


def test_other_index_name(tmp_path):
    write_sharded(tmp_path, {"a.safetensors": GOOD}, name="diffusion_pytorch_model"
                  ".safetensors.index.json")
    meta = read_checkpoint(str(tmp_path))
    assert set(meta.tensors) == {"a", "b", "c"}


def test_hub_cache_symlinks(tmp_path):
    # snapshots/<rev>/<file> -> ../../blobs/<sha>: links leave the directory, targets are
    # regular files: allowed.
    blobs = tmp_path / "blobs"
    snap = tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    wm = write_sharded(work, {"model-00001-of-00002.safetensors": GOOD[:1],
                              "model-00002-of-00002.safetensors": GOOD[1:]})
    assert wm
    for i, name in enumerate(sorted(os.listdir(work))):
        os.rename(work / name, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / name)
    meta = read_checkpoint(str(snap))
    assert len(meta.files) == 2 and set(meta.tensors) == {"a", "b", "c"}
    check_bytes(meta)


def test_directory_without_index(tmp_path):
    write_sharded(tmp_path, {"part-b.safetensors": GOOD[1:], "part-a.safetensors": GOOD[:1]},
                  index=False)
    meta = read_checkpoint(str(tmp_path))
    assert discover(str(tmp_path)).kind == "directory"
    assert [f.name for f in meta.files] == ["part-a.safetensors", "part-b.safetensors"]
    assert list(meta.tensors) == ["a", "b", "c"]


def test_directory_without_index_needs_every_numbered_shard(tmp_path):
    """A sharded HF checkpoint copied without its index and one shard would load as a
    smaller model; the names say how many files the set has."""
    a, b = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    write_sharded(tmp_path, {a: GOOD[:1], b: GOOD[1:]}, index=False)
    assert list(read_checkpoint(str(tmp_path)).tensors) == ["a", "b", "c"]
    os.remove(tmp_path / b)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(tmp_path))
    assert str(e.value) == (f"file {tmp_path}: has no index and 1 of the 2 numbered shards: "
                            f"{b} missing (or model-00000-of-00002.safetensors, if the set is "
                            f"numbered from 0); the copy or download is incomplete")
    write_st(tmp_path / "model-00002-of-00003.safetensors", GOOD[1:2])
    with pytest.raises(CheckpointError, match="sets of different sizes"):
        read_checkpoint(str(tmp_path))


@pytest.mark.parametrize("names", [
    # DeepSeek-V3's own shards pad the count to 6 digits
    ["model-00001-of-000003.safetensors", "model-00002-of-000003.safetensors",
     "model-00003-of-000003.safetensors"],
    ["model-000000-of-000003.safetensors", "model-000001-of-000003.safetensors",
     "model-000002-of-000003.safetensors"],
    ["model-1-of-3.safetensors", "model-2-of-3.safetensors", "model-3-of-3.safetensors"],
], ids=["count-6-digits", "from-0", "unpadded"])
def test_numbered_shards_of_any_width_must_be_whole(tmp_path, names):
    write_sharded(tmp_path, {names[0]: GOOD[:1], names[1]: GOOD[1:2], names[2]: GOOD[2:]},
                  index=False)
    assert list(read_checkpoint(str(tmp_path)).tensors) == ["a", "b", "c"]
    os.remove(tmp_path / names[1])
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(tmp_path))
    assert str(e.value) == (f"file {tmp_path}: has no index and 2 of the 3 numbered shards: "
                            f"{names[1]} missing; the copy or download is incomplete")


def test_a_set_numbered_from_0_without_shard_0_names_both_readings(tmp_path):
    """Without shard 0 a set numbered 0..N-1 reads as 1..N missing N: the message named a
    file that never existed."""
    write_sharded(tmp_path, {"model-1-of-3.safetensors": GOOD[:1],
                             "model-2-of-3.safetensors": GOOD[1:]}, index=False)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(tmp_path))
    assert str(e.value) == (f"file {tmp_path}: has no index and 2 of the 3 numbered shards: "
                            f"model-3-of-3.safetensors missing (or model-0-of-3.safetensors, if "
                            f"the set is numbered from 0); the copy or download is incomplete")


def test_path_to_one_numbered_shard_is_refused(tmp_path):
    """A path to one file of a set loaded it alone, as a smaller model."""
    a, b = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    write_sharded(tmp_path, {a: GOOD[:1], b: GOOD[1:]})
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(tmp_path / b))
    assert str(e.value) == (f"file {tmp_path / b}: is shard 2 of a set of 2 (by its name), "
                            f"holding only some of the tensors; pass the checkpoint's directory "
                            f"or its index")
    write_st(tmp_path / "model-00001-of-00001.safetensors", GOOD)
    assert list(read_checkpoint(str(tmp_path / "model-00001-of-00001.safetensors")).tensors) == [
        "a", "b", "c"]


def test_numbered_shard_outside_its_set_is_refused(tmp_path):
    write_sharded(tmp_path, {"model-00001-of-00002.safetensors": GOOD[:1],
                             "model-00002-of-00002.safetensors": GOOD[1:2],
                             "model-00003-of-00002.safetensors": GOOD[2:]}, index=False)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(tmp_path))
    assert str(e.value) == (f"file {tmp_path}: has no index and numbered shard "
                            f"model-00003-of-00002.safetensors lies outside its set of 2 "
                            f"(numbered 1..2)")


def test_model_safetensors_preferred_without_index(tmp_path):
    write_st(tmp_path / M, GOOD)
    write_st(tmp_path / "consolidated.safetensors", GOOD)
    assert discover(str(tmp_path)).files == (M,)
    assert len(read_checkpoint(str(tmp_path)).tensors) == 3


def test_pieces_pickle_and_split_reading(tmp_path):
    sharded_ok(tmp_path)
    disc = discover(str(tmp_path))
    assert isinstance(disc, Discovery)
    disc2 = pickle.loads(pickle.dumps(disc))
    assert disc2 == disc
    headers = [pickle.loads(pickle.dumps(read_file_header(str(tmp_path), f)))
               for f in reversed(disc.files)]
    assert all(isinstance(h, FileHeader) for h in headers)
    assert assemble(str(tmp_path), disc2, headers) == read_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="missing"):
        assemble(str(tmp_path), disc, headers[:1])
    e = pickle.loads(pickle.dumps(CheckpointError("x", file="f", tensor="t")))
    assert (e.file, e.tensor, str(e)) == ("f", "t", "file f, tensor 't': x")


def test_assembled_records_equal_init_built(tmp_path):
    # assemble builds TensorInfo / SourcePiece without their __init__ (speed): the records
    # must be the same as the dataclass constructors give, in every observable way
    sharded_ok(tmp_path)
    meta = read_checkpoint(str(tmp_path))
    assert meta.tensors
    for name, t in meta.tensors.items():
        p = t.pieces[0]
        p2 = SourcePiece(p.file, p.box, p.start, p.end, p.key)
        t2 = TensorInfo(t.name, t.dtype, t.shape, (p2,))
        assert t == t2 and hash(t) == hash(t2) and repr(t) == repr(t2)
        for a, b in ((t, t2), (p, p2)):   # slotted: every field set, nothing else held
            assert not hasattr(a, "__dict__")
            assert [getattr(a, f.name) for f in fields(a)] == [getattr(b, f.name) for f in fields(b)]
        assert t.is_whole
        assert pickle.loads(pickle.dumps(t)) == t
        with pytest.raises(AttributeError):
            t.name = "x"


def _records_alive() -> int:
    import gc
    gc.collect()
    return sum(type(o) is TensorInfo for o in gc.get_objects())


def test_reading_a_checkpoint_makes_each_record_when_it_is_first_read(tiny_checkpoint):
    # every rank assembles every tensor's metadata; a load reads the records of the tensors
    # its rank holds: the others are never made
    import threading
    path = tiny_checkpoint("deepseek_v3")
    before = _records_alive()
    meta = read_checkpoint(path)
    names = list(meta.tensors)
    assert len(names) > 50 and _records_alive() == before
    assert len(meta.tensors) == len(names) and names[3] in meta.tensors
    assert "absent" not in meta.tensors and meta.tensors.get("absent", 7) == 7
    with pytest.raises(KeyError):
        meta.tensors["absent"]
    assert meta.table().names == names and _records_alive() == before
    # made in any order, from two threads, each record is the one __init__ gives; a third
    # of them left unmade
    got: dict = {}
    threads = [threading.Thread(target=lambda part: got.update(
        (n, meta.tensors[n]) for n in part), args=(names[k::3][::-1],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _records_alive() == before + len(got)
    for n, t in got.items():
        p = t.pieces[0]
        want = TensorInfo(n, t.dtype, t.shape, (SourcePiece(p.file, p.box, p.start, p.end, n),))
        assert t == want and repr(t) == repr(want) and meta.tensors.get(n) is t
        row = names.index(n)
        table = meta.table()
        assert (p.file, p.start, p.end, t.shape, t.dtype) == (
            meta.files[table.file[row]].name, table.start[row], table.end[row],
            table.shapes[table.shape[row]], table.dtypes[table.dtype[row]])
    del want
    # reading them all makes the rest, in the tensors' order, keeping those made before
    values = list(meta.tensors.values())
    assert [t.name for t in values] == names and _records_alive() == before + len(names)
    assert all(values[names.index(n)] is t for n, t in got.items())
    assert [n for n, _ in meta.tensors.items()] == names
    eager = CheckpointMeta(meta.root, meta.files, dict(zip(names, values)), meta.config)
    assert read_checkpoint(path) == meta == eager and read_checkpoint(path).tensors == eager.tensors
    assert pickle.loads(pickle.dumps(read_checkpoint(path))) == meta


def test_planning_with_a_config_given_reads_the_tensor_table_not_every_record(tiny_checkpoint):
    # make_plan(config=...) plans metadata with another config: the same tensors, so the
    # same table, not one built again from every record
    from coordloader.api import make_plan, with_config
    from coordloader.layout import Layout
    path = tiny_checkpoint("deepseek_v3")
    before = _records_alive()
    meta = read_checkpoint(path)
    config = dict(meta.config, note="given")
    assert with_config(meta, config).table() is meta.table()
    plan = make_plan(meta, Layout(tp=2, ep=2), config=config)
    assert plan.digest() == make_plan(meta, Layout(tp=2, ep=2)).digest()
    assert _records_alive() - before < len(meta.tensors)
    # metadata without a table gets none early: a bad layout or rule set is still the
    # error named first, as without a config
    from coordloader.errors import PlanError
    odd = CheckpointMeta(meta.root, meta.files, {"w": TensorInfo(
        "w", "BF16", [4, 4], (SourcePiece(meta.files[0].name, ((0, 4), (0, 4)), 100, 132, "w"),))})
    for args in ((odd, "tp=2"), (odd, Layout(), "no-such-rules")):
        with pytest.raises(PlanError) as plain:
            make_plan(*args)
        with pytest.raises(PlanError) as given:
            make_plan(*args, config=config)
        assert str(given.value) == str(plain.value)


def test_planning_places_tensors_by_name_and_shape_without_their_records(tiny_checkpoint):
    # placement reads a tensor's name and shape, the load groups a whole tensor's one
    # stored piece from the table: the planner makes the records of the first tensor of
    # each family split into several runs only, and plans as with every record made
    from coordloader.api import make_plan
    from coordloader.layout import Layout
    path = tiny_checkpoint("deepseek_v3")
    before = _records_alive()
    meta = read_checkpoint(path)
    layout = Layout(tp=2, ep=2, pp=2)
    plan = make_plan(meta, layout)
    assert _records_alive() - before < len(meta.tensors) // 4
    eager = read_checkpoint(path)
    list(eager.tensors.values())
    assert make_plan(eager, layout).digest() == plan.digest()
    assert meta.tensors.shape(names := next(iter(meta.tensors))) == eager.tensors[names].shape
    with pytest.raises(KeyError):
        meta.tensors.shape("absent")


def _lazy_map(n: int):
    from coordloader.checkpoint.metadata import TensorMap
    entries = [(f"t{i}", "F32", (i % 7, 3), 8 * i, 8 * i + (i % 7) * 12) for i in range(n)]
    names = [e[0] for e in entries]
    return TensorMap.of_entries(dict(zip(names, range(n))), entries, ["a.safetensors"] * n), names


def test_records_read_from_threads_while_another_reads_them_all_are_each_made_once():
    # a record is made once whatever the threads: two reading names one by one (get and
    # []), two every record at once; none is missed, None, or made twice
    import sys
    import threading
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for _ in range(20):
            tm, names = _lazy_map(4000)
            got: dict = {}
            errors: list = []

            def one_by_one(part, how):
                try:
                    got.update((k, tm.get(k) if how == "get" else tm[k]) for k in part)
                except Exception as e:   # reported below, with the others'
                    errors.append(repr(e))

            def all_at_once():
                try:
                    assert [t.name for t in tm.values()] == names
                except Exception as e:
                    errors.append(repr(e))
            threads = [threading.Thread(target=one_by_one, args=(names[0::2], "get")),
                       threading.Thread(target=one_by_one, args=(names[1::2], "[]")),
                       threading.Thread(target=all_at_once), threading.Thread(target=all_at_once)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors
            assert all(got[k] is tm[k] and got[k].name == k for k in names)
    finally:
        sys.setswitchinterval(interval)




def test_reading_a_manifest_compares_the_table_not_every_record(tiny_checkpoint, tmp_path):
    # every rank of a --verify digest load reads the manifest: its dtypes and shapes are
    # compared with the table's, so the ranks make only the records they read
    import shutil

    from coordloader.verify import manifest as mf
    root = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint("deepseek_v3"), root)
    mf.write_manifest(read_checkpoint(root))
    before = _records_alive()
    meta = read_checkpoint(root)
    man = mf.load_manifest(root, meta, required=True)
    assert _records_alive() == before and len(man.tensors) == len(meta.tensors)
    # a mismatch is still named, with the checkpoint's dtype and shape
    name = next(n for n in meta.tensors if len(meta.tensors.shape(n)) == 2)
    doc = json.load(open(mf.manifest_path(root)))
    doc["tensors"][name]["shape"] = [1, 1]
    with open(mf.manifest_path(root), "w") as f:
        json.dump(doc, f)
    with pytest.raises(VerifyError, match=r"manifest records \w+\[1, 1\], checkpoint has "
                                          + meta.tensors[name].dtype) as e:
        mf.load_manifest(root, read_checkpoint(root), required=True)
    assert e.value.tensor == name and str(list(meta.tensors[name].shape)) in str(e.value)
    # records no table can hold (built by hand) are compared one by one, after the check
    # of the names, as before
    import dataclasses
    mf.write_manifest(meta)
    t = meta.tensors[name]
    odd = dataclasses.replace(meta, tensors={**meta.tensors, name: dataclasses.replace(
        t, dtype=[t.dtype])})
    with pytest.raises(VerifyError, match=r"checkpoint has \['") as e:
        mf.load_manifest(root, odd, required=True)
    assert e.value.tensor == name
    fewer = dataclasses.replace(odd, tensors={n: r for n, r in odd.tensors.items() if n != name})
    with pytest.raises(VerifyError, match="manifest does not match the checkpoint's tensors"):
        mf.load_manifest(root, fewer, required=True)

@pytest.mark.slow   # forked children
def test_a_child_forked_while_a_thread_reads_every_record_reads_them_too():
    # nothing a thread holds while it makes records can be left held in a forked child
    import signal
    import threading
    import time
    for _ in range(5):
        tm, names = _lazy_map(60_000)
        t = threading.Thread(target=lambda: list(tm.values()))
        t.start()
        time.sleep(0.005)
        pid = os.fork()
        if pid == 0:   # the child: every record, or exit 1
            try:
                ok = [tm[k].name for k in names] == names and len(list(tm.values())) == len(names)
            finally:
                os._exit(0 if ok else 1)
        t.join()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish reading the records in 20 s")
        assert os.waitstatus_to_exitcode(status) == 0


def test_a_collector_callback_may_read_records_while_they_are_made():
    # a __del__ or gc callback reading the map while this thread makes a record of it
    import gc
    import threading
    tm, names = _lazy_map(3000)
    seen: list = []

    def callback(phase, info):
        if phase == "start":
            seen.append(tm.get(names[-1 - len(seen) % len(names)]))
    threshold = gc.get_threshold()

    def read():
        gc.callbacks.append(callback)
        gc.set_threshold(1)
        try:
            for k in names:
                assert tm[k].name == k
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(callback)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "reading the records deadlocked in a collector callback"
    assert seen and all(r is tm[r.name] for r in seen)

def _table_fields(table) -> list:
    return [v.tolist() if hasattr(v, "tolist") else v for v in table]


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_the_readers_tensor_table_is_the_records(tiny_checkpoint, arch):
    # the reader builds a plain checkpoint's table from the headers; a copy of the
    # metadata builds its own from the records: the planner and cover may read either
    import dataclasses
    meta = read_checkpoint(tiny_checkpoint(arch))
    table = meta.table()
    assert table.names == list(meta.tensors)
    fresh = dataclasses.replace(meta)
    assert fresh.table() is not table
    assert _table_fields(fresh.table()) == _table_fields(table)
    row = table.names.index(next(n for n in table.names if n.endswith("scale_inv") or
                                 ".experts." in n))
    t = meta.tensors[table.names[row]]
    assert (table.shapes[table.shape[row]], table.dtypes[table.dtype[row]]) == (t.shape, t.dtype)
    assert (meta.files[table.file[row]].name, table.start[row], table.end[row]) == (
        t.pieces[0].file, t.pieces[0].start, t.pieces[0].end)
    assert table.whole.all()
    with pytest.raises(ValueError, match="read-only"):
        table.start[row] = 0


def test_a_checkpoints_tensors_are_read_only(tmp_path):
    import copy
    sharded_ok(tmp_path)
    meta = read_checkpoint(str(tmp_path))
    name = next(iter(meta.tensors))
    for change in (lambda m: m.__setitem__("x", m[name]), lambda m: m.__delitem__(name),
                   lambda m: m.pop(name), lambda m: m.update(x=m[name]), lambda m: m.clear(),
                   lambda m: m.setdefault("x", m[name]), lambda m: m.popitem()):
        with pytest.raises(TypeError, match="read-only"):
            change(meta.tensors)
    assert list(meta.tensors) == meta.table().names
    with pytest.raises(TypeError, match="read-only"):
        meta.tensors.__init__(x=meta.tensors[name])
    for other in (pickle.loads(pickle.dumps(meta)), copy.deepcopy(meta)):
        assert other == meta and type(other.tensors) is type(meta.tensors)
        with pytest.raises(TypeError, match="read-only"):
            other.tensors["x"] = other.tensors[name]
        with pytest.raises(ValueError, match="read-only"):
            other.table().start[0] = 1
        assert other.table().names == meta.table().names
    # metadata built by hand holds its tensors read-only too, apart from the caller's dict
    mine = dict(meta.tensors)
    built = CheckpointMeta(meta.root, meta.files, mine)
    mine.pop(name)
    assert name in built.tensors and built.table().names == list(meta.tensors)



def test_a_record_listed_under_another_name_is_refused(tmp_path):
    # the planner places a tensor by its key and reads its records by name: a record
    # under another key (an expert's id renamed) planned experts onto the wrong owners
    import dataclasses
    sharded_ok(tmp_path)
    meta = read_checkpoint(str(tmp_path))
    a, b = list(meta.tensors)[:2]
    swapped = {**meta.tensors, a: meta.tensors[b], b: meta.tensors[a]}
    with pytest.raises(CheckpointError) as e:
        dataclasses.replace(meta, tensors=swapped)
    assert e.value.tensor == a and str(e.value) == (
        f"tensor {a!r}: the record of tensor {b!r} is listed under {a!r}; expected each "
        f"tensor's record under its own name")
    renamed = {n: dataclasses.replace(t, name="x." + n) for n, t in meta.tensors.items()}
    with pytest.raises(CheckpointError, match="is listed under"):
        CheckpointMeta(meta.root, meta.files, renamed)
    assert dataclasses.replace(meta, tensors=dict(meta.tensors.items())) == meta

def test_a_table_of_records_marks_what_is_not_one_whole_piece():
    from coordloader.checkpoint.metadata import with_table
    a = SourcePiece("a.safetensors", ((0, 2), (0, 4)), 72, 104, "x@a")
    b = SourcePiece("b.safetensors", ((2, 4), (0, 4)), 72, 104, "x@b")
    y = SourcePiece("gone.safetensors", ((0, 4),), 72, 88, "y")
    files = (FileInfo("a.safetensors", 104, 64, "0" * 64), FileInfo("b.safetensors", 104, 64, "1" * 64))
    meta = CheckpointMeta("<memory>", files, {
        "x": TensorInfo("x", "F32", (4, 4), (a, b)), "y": TensorInfo("y", "F32", (4,), (y,)),
        "z": TensorInfo("z", "F32", (0,), ())})
    table = meta.table()
    assert table.whole.tolist() == [False, False, False]
    assert table.file.tolist() == [0, -1, -1] and table.start.tolist() == [72, 72, 0]
    with pytest.raises(ValueError, match="a tensor table for metadata that has one"):
        with_table(meta, table)
    fresh = CheckpointMeta("<memory>", files, dict(reversed(meta.tensors.items())))
    with pytest.raises(ValueError, match="or of other tensors"):
        with_table(fresh, table)   # the same tensors in another order


def test_a_table_of_records_leaves_out_offsets_it_cannot_hold():
    # a hand-built record whose offsets do not fit (or run backwards) is not whole in the
    # table: the planner and cover then read its record; a shape that is no tuple is named
    import dataclasses
    big = SourcePiece("a.safetensors", ((0, 4),), 2 ** 63 - 10, 2 ** 64, "x")
    back = SourcePiece("a.safetensors", ((0, 4),), 88, 72, "y")
    files = (FileInfo("a.safetensors", 104, 64, "0" * 64),)
    meta = CheckpointMeta("<memory>", files, {"x": TensorInfo("x", "F32", (4,), (big,)),
                                              "y": TensorInfo("y", "F32", (4,), (back,))})
    table = meta.table()
    assert table.whole.tolist() == [False, False] and table.file.tolist() == [-1, -1]
    odd = dataclasses.replace(meta, tensors={"y": TensorInfo("y", "F32", [4], (back,))})
    with pytest.raises(CheckpointError, match=r"shape \[4\] is a list; expected a tuple") as ei:
        odd.table()
    assert ei.value.tensor == "y"


def test_header_entries_share_equal_shapes_and_dtypes(tmp_path):
    # equal shapes / dtypes of one file are one object each (a smaller gather pickle);
    # the values, and what the pickled headers assemble to, are unchanged
    write_st(tmp_path / M, [("a", "BF16", [4, 2]), ("b", "BF16", [4, 2]), ("c", "F32", [3]),
                            ("d", "F32", [4, 2])])
    ents = read_file_header(str(tmp_path), M).entries
    assert [(k, d, s) for k, d, s, _, _ in ents] == [
        ("a", "BF16", (4, 2)), ("b", "BF16", (4, 2)), ("c", "F32", (3,)), ("d", "F32", (4, 2))]
    assert ents[0][2] is ents[1][2] is ents[3][2] and ents[0][1] is ents[1][1]
    h = pickle.loads(pickle.dumps([read_file_header(str(tmp_path), M)]))
    meta = assemble(str(tmp_path), discover(str(tmp_path)), h)
    assert meta == read_checkpoint(str(tmp_path))
    assert meta.fingerprint() == read_checkpoint(str(tmp_path)).fingerprint()


def test_fingerprint_changes_with_header(tmp_path):
    write_st(tmp_path / M, GOOD)
    fp1 = read_checkpoint(str(tmp_path)).fingerprint()
    write_st(tmp_path / M, GOOD, metadata={"x": "y"})
    assert read_checkpoint(str(tmp_path)).fingerprint() != fp1


def test_cross_check_with_hf_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open
    g = torch.Generator().manual_seed(0)
    ts = {"w": torch.randn(5, 3, generator=g).to(torch.bfloat16),
          "b": torch.arange(7, dtype=torch.int64), "m": torch.rand(4, generator=g) > 0.5,
          "e": torch.zeros(0, 3), "s": torch.tensor(2.5, dtype=torch.float64),
          "q": torch.randn(3, 4, generator=g).to(torch.float8_e4m3fn)}
    safetensors_torch.save_file(ts, str(tmp_path / M), metadata={"format": "pt"})
    meta = read_checkpoint(str(tmp_path))
    raw = (tmp_path / M).read_bytes()
    with safe_open(str(tmp_path / M), "pt") as f:
        assert set(f.keys()) == set(meta.tensors)
        assert f.metadata() == dict(meta.files[0].metadata)
        for name in f.keys():
            t = f.get_tensor(name)
            info = meta.tensors[name]
            assert info.shape == tuple(t.shape)
            p = info.pieces[0]
            assert raw[p.start:p.end] == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------ coordloader sharded format

def write_coordloader(d, tensors, *, layout=None, extra_keys=(), key_override=None,
                      stored_override=None, wm_override=None):
    """tensors: {name: (dtype, shape, [(file, box)])}. Writes each piece under its key
    with the box's shape, the shard files, and an index with a coordloader section."""
    files: dict[str, list] = {}
    sec = {"version": 1, "layout": layout or {"tp": 2}, "tensors": {}}
    wm = {}
    for name, (dtype, shape, pieces) in tensors.items():
        plist = []
        for fname, box in pieces:
            whole = all(a == 0 and b == s for (a, b), s in zip(box, shape))
            key = name if whole else name + "@" + ",".join(f"{a}:{b}" for a, b in box)
            if key_override and (name, tuple(map(tuple, box))) in key_override:
                key = key_override[(name, tuple(map(tuple, box)))]
            st_dtype, st_shape = dtype, [b - a for a, b in box]
            if stored_override and key in stored_override:
                st_dtype, st_shape = stored_override[key]
            files.setdefault(fname, []).append((key, st_dtype, st_shape))
            plist.append({"file": fname, "key": key, "box": [list(r) for r in box]})
            wm.setdefault(name, fname)
        sec["tensors"][name] = {"dtype": dtype, "shape": list(shape), "pieces": plist}
    for fname, k in extra_keys:
        files.setdefault(fname, []).append(k)
    for fname, ents in files.items():
        write_st(os.path.join(d, fname), ents)
    write_index(d, wm_override if wm_override is not None else wm, coordloader=sec)


def tp2(shape=(4, 6)):
    r, c = shape
    return {"w": ("BF16", list(shape), [("rank-0.safetensors", [[0, r // 2], [0, c // 2]]),
                                        ("rank-1.safetensors", [[0, r // 2], [c // 2, c]]),
                                        ("rank-0.safetensors", [[r // 2, r], [0, c // 2]]),
                                        ("rank-1.safetensors", [[r // 2, r], [c // 2, c]])]),
            "norm": ("F32", [6], [("rank-1.safetensors", [[0, 6]])]),
            "bias": ("F32", [6], [("rank-0.safetensors", [[0, 3]]),
                                  ("rank-1.safetensors", [[3, 6]])])}


def test_coordloader_sharded_format(tmp_path):
    write_coordloader(tmp_path, tp2(), layout={"tp": 2, "ep": 1})
    meta = read_checkpoint(str(tmp_path))
    assert meta.source_layout == {"tp": 2, "ep": 1}
    w = meta.tensors["w"]
    assert w.shape == (4, 6) and w.dtype == "BF16" and not w.is_whole
    assert [p.box for p in w.pieces] == [((0, 2), (0, 3)), ((0, 2), (3, 6)), ((2, 4), (0, 3)),
                                         ((2, 4), (3, 6))]
    assert [p.file for p in w.pieces] == ["rank-0.safetensors", "rank-1.safetensors",
                                          "rank-0.safetensors", "rank-1.safetensors"]
    # each piece carries the key its file stores it under (the index's "key")
    assert [p.key for p in w.pieces] == ["w@0:2,0:3", "w@0:2,3:6", "w@2:4,0:3", "w@2:4,3:6"]
    assert [p.key for p in meta.tensors["bias"].pieces] == ["bias@0:3", "bias@3:6"]
    assert all(p.end - p.start == 2 * 3 * 2 for p in w.pieces)
    assert meta.tensors["norm"].is_whole and meta.tensors["norm"].pieces[0].key == "norm"
    assert list(meta.tensors) == ["w", "bias", "norm"]  # by first piece: file, then offset
    assert meta.total_bytes == 4 * 6 * 2 + 6 * 4 + 6 * 4
    check_bytes(meta)


def test_coordloader_many_pieces_tile(tmp_path):
    pieces = [(f"r{i % 4}.safetensors", [[0, 3], [i, i + 1]]) for i in range(64)]
    write_coordloader(tmp_path, {"w": ("U8", [3, 64], pieces)})
    assert len(read_checkpoint(str(tmp_path)).tensors["w"].pieces) == 64


def test_coordloader_overlapping_pieces(tmp_path):
    t = tp2()
    # [0,3) on dim 1 of rows 2..4 overlaps [2,4)x[0,3) — replace it by [2,4)x[1,4) etc.
    t["w"][2][2] = ("rank-0.safetensors", [[1, 3], [0, 3]])
    write_coordloader(tmp_path, t)
    bad(tmp_path, "file model.safetensors.index.json, tensor 'w'", "overlap", "tile the tensor exactly")


def test_coordloader_pieces_leave_a_hole(tmp_path):
    t = tp2()
    del t["w"][2][3]
    write_coordloader(tmp_path, t)
    bad(tmp_path, "file model.safetensors.index.json, tensor 'w'", "cover 18 of 24 elements")


def test_coordloader_box_outside_shape(tmp_path):
    t = tp2()
    t["bias"][2][1] = ("rank-1.safetensors", [[3, 7]])
    write_coordloader(tmp_path, t)
    bad(tmp_path, "file model.safetensors.index.json, tensor 'bias'", "outside the shape [6]")


def test_coordloader_dtype_mismatch(tmp_path):
    write_coordloader(tmp_path, tp2(), stored_override={"bias@0:3": ("I32", [3])})
    bad(tmp_path, "rank-0.safetensors", "tensor 'bias'", "stored as I32", "index says F32")


def test_coordloader_stored_shape_mismatch(tmp_path):
    write_coordloader(tmp_path, tp2(), stored_override={"bias@0:3": ("F32", [1, 3])})
    bad(tmp_path, "rank-0.safetensors", "tensor 'bias'", "shape [1, 3]", "needs [3]")


def test_coordloader_key_not_in_section(tmp_path):
    write_coordloader(tmp_path, tp2(), extra_keys=[("rank-1.safetensors", ("stray", "U8", [2]))])
    bad(tmp_path, "rank-1.safetensors", "tensor 'stray'", "does not list it")


def test_coordloader_wrong_key_format(tmp_path):
    write_coordloader(tmp_path, tp2(), key_override={("bias", ((0, 3),)): "bias.part0"})
    bad(tmp_path, "file model.safetensors.index.json, tensor 'bias'", "piece key 'bias.part0'",
        "expected 'bias@0:3'")


def test_coordloader_piece_missing_from_file(tmp_path):
    write_coordloader(tmp_path, tp2())
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["coordloader"]["tensors"]["norm"]["pieces"][0]["file"] = "rank-0.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    bad(tmp_path, "rank-0.safetensors", "tensor 'norm'", "does not contain it")


def test_coordloader_tensor_missing_from_weight_map(tmp_path):
    wm = {"w": "rank-0.safetensors", "bias": "rank-0.safetensors"}
    write_coordloader(tmp_path, tp2(), wm_override=wm)
    bad(tmp_path, "file model.safetensors.index.json, tensor 'norm'", "not in the weight_map")


def test_coordloader_bad_section(tmp_path):
    write_coordloader(tmp_path, tp2())
    p = tmp_path / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    idx["coordloader"]["version"] = 2
    p.write_text(json.dumps(idx))
    bad(tmp_path, "model.safetensors.index.json", "version 2", "expected 1")
    idx["coordloader"]["version"] = 1
    idx["coordloader"]["tensors"]["w"]["pieces"][0]["file"] = "../rank-0.safetensors"
    p.write_text(json.dumps(idx))
    bad(tmp_path, "model.safetensors.index.json", "path separator")
    idx["coordloader"]["tensors"]["w"]["pieces"][0]["file"] = "rank-0.safetensors"
    idx["coordloader"]["tensors"]["w"]["pieces"][0]["box"] = [[0, 2]]
    p.write_text(json.dumps(idx))
    bad(tmp_path, "file model.safetensors.index.json, tensor 'w'", "expected 2 [start, stop] integer pairs")


def test_overlap_sweep_cases():
    from coordloader.checkpoint.tiling import find_overlap as f
    assert f([((0, 2), (0, 2)), ((2, 4), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (2, 4))]) is None
    assert f([((0, 3), (0, 2)), ((2, 4), (1, 2))]) is not None
    assert f([((0, 3), (0, 1)), ((2, 4), (1, 2))]) is None  # touch on dim 0, not dim 1
    assert f([((0, 10), (0, 1), (0, 5)), ((5, 6), (0, 1), (4, 9))]) is not None
    # a long box starting first must still be checked against boxes starting later
    assert sorted(f([((0, 100), (0, 1)), ((1, 2), (1, 2)), ((50, 51), (0, 1))])) == [0, 2]


def test_zero_element_stride_overflow_in_header(tmp_path):
    # holds no bytes, so the offsets check passes, but torch cannot build its strides
    shape = [0] + [2**62] * 10000
    one(tmp_path, {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    bad(tmp_path, f"file {M}, tensor 'w'", "strides overflow")


def test_zero_element_tensor_is_read(tmp_path):
    one(tmp_path, header_for([("w", "F32", [0]), ("m", "F32", [4, 0]), ("v", "F32", [4])])[0],
        16)
    meta = read_checkpoint(str(tmp_path))
    assert meta.tensors["w"].shape == (0,) and meta.tensors["m"].shape == (4, 0)


def test_coordloader_zero_element_stride_overflow_in_index(tmp_path):
    write_coordloader(tmp_path, {"w": ("F32", [0, 2**62, 2**62],
                                       [("rank-0.safetensors", [[0, 0], [0, 1], [0, 1]])])})
    bad(tmp_path, "file model.safetensors.index.json, tensor 'w'", "strides overflow")


@pytest.mark.parametrize("root", [b"/tmp", None, 123])
def test_checkpoint_path_of_another_type_is_refused(root):
    import coordloader as cl
    from coordloader.layout import Layout
    want = (f"checkpoint path {str(root)!r} is {type(root).__name__}; expected a str or "
            f"os.PathLike path")
    for call in (lambda: read_checkpoint(root), lambda: cl.load(root, Layout(), rank=0)):
        with pytest.raises(CheckpointError) as e:
            call()
        assert str(e.value) == want


def test_make_plan_takes_a_pathlib_path_as_load_does(tmp_path):
    """make_plan(pathlib.Path) was refused with "checkpoint must be a path"."""
    import coordloader as cl
    from coordloader.layout import Layout
    write_sharded(tmp_path, {"model-00001-of-00001.safetensors": GOOD}, index=False)
    assert cl.make_plan(tmp_path, Layout(), replicate_unmatched=True).world_size == 1


# -- two checkpoints in one directory: transformers, vLLM and an index choose differently

def _hf_pair(tmp_path, first: str, then: str):
    """transformers' save_pretrained of two models into one directory ('single' or
    'sharded' each), as a training script saving over an earlier save does."""
    from hfmodels import write_llama
    d = str(tmp_path / "ck")
    for seed, how in ((1, first), (2, then)):
        write_llama(d, seed=seed, shard_size="1GB" if how == "single" else "150KB")
    return d


def test_a_sharded_save_beside_model_safetensors_is_refused(tmp_path):
    """transformers keeps model.safetensors when it saves sharded over it: transformers
    then reads model.safetensors, vLLM and coordloader the index's files (silently)."""
    d = _hf_pair(tmp_path, "single", "sharded")
    assert {"model.safetensors", "model.safetensors.index.json"} <= set(os.listdir(d))
    e = bad(d)
    assert re.fullmatch(r"file model\.safetensors\.index\.json: lists \d+ file\(s\) \(model-00001-"
                        r"of-\d+\.safetensors, \.\.\.\) beside model\.safetensors: two "
                        r"checkpoints, which readers choose between differently \(transformers "
                        r"reads model\.safetensors, vLLM the index's files\); expected one "
                        r"checkpoint per directory: remove the stale one, or pass the path of the "
                        r"index or file to load", str(e)), str(e)
    # the path of either loads it
    assert list(read_checkpoint(os.path.join(d, "model.safetensors")).tensors)
    assert read_checkpoint(os.path.join(d, "model.safetensors.index.json")).files


def test_a_stale_index_beside_model_safetensors_is_named_stale(tmp_path):
    """transformers saving unsharded over a sharded save removes the shards, not the index:
    the refusal said only that the index lists a file that does not exist."""
    d = _hf_pair(tmp_path, "sharded", "single")
    assert not [n for n in os.listdir(d) if n.startswith("model-")]
    e = bad(d)
    assert re.fullmatch(r"file model\.safetensors\.index\.json: lists files that are not here "
                        r"\(model-00001-of-\d+\.safetensors, \.\.\.\) beside model\.safetensors, "
                        r"which transformers reads: a stale index of an earlier sharded save\? "
                        r"expected one checkpoint per directory: remove the index if "
                        r"model\.safetensors is the checkpoint", str(e)), str(e)
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    assert len(read_checkpoint(d).tensors) == 21


def test_model_safetensors_beside_a_coordloader_save_is_refused(tmp_path):
    """A script's save_pretrained into a directory holding a coordloader save: the old
    save was loaded, transformers read the new model.safetensors."""
    import coordloader as cl

    from hfmodels import write_llama
    src = write_llama(str(tmp_path / "src"), seed=1)
    d = str(tmp_path / "ck")
    cl.save(d, cl.load(src, cl.Layout(), rank=0), config=src)
    write_llama(d, seed=2, shard_size="1GB")
    e = bad(d)
    assert str(e) == (f"file {d}: holds both a coordloader sharded save "
                            f"(coordloader-index.json) and model.safetensors: two checkpoints, "
                            f"which readers choose between differently (transformers reads "
                            f"model.safetensors); expected one checkpoint per directory: "
                            f"remove the stale one, or pass the path of the index or file "
                            f"to load")



@pytest.mark.parametrize("other", ["numbered", "dcp"])
def test_other_safetensors_beside_a_coordloader_save_are_refused(tmp_path, other):
    """torch DCP's per-rank shards or a numbered set without its index written into a
    directory holding a coordloader save: the old save loaded (its index read, the other
    files ignored), verify included, while vLLM reads every *.safetensors there."""
    from safetensors.torch import save_file

    import coordloader as cl
    d = str(tmp_path / "ck")
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4,
           "num_attention_heads": 1, "num_key_value_heads": 1, "num_hidden_layers": 1,
           "vocab_size": 8, "intermediate_size": 8}
    cl.save(d, {"model.embed_tokens.weight": torch.zeros(8, 4)}, rank=0, config=cfg)
    new = {"model.embed_tokens.weight": torch.full((8, 4), 7.0)}
    names = (["shard-00001-model-00001-of-00001.safetensors"] if other == "dcp" else
             ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    for n in names:
        save_file(new, os.path.join(d, n))
    e = bad(d)
    readers = "vLLM reads every *.safetensors file"
    assert str(e) == (f"file {d}: holds both a coordloader sharded save "
                      f"(coordloader-index.json) and {', '.join(names)}: two checkpoints, "
                      f"which readers choose between differently ({readers}); expected one "
                      f"checkpoint per directory: remove the stale one, or pass the path of "
                      f"the index or file to load")
    # the save is still read where asked for by its index
    assert list(read_checkpoint(os.path.join(d, "coordloader-index.json")).tensors) == [
        "model.embed_tokens.weight"]

def test_an_index_leaving_out_a_file_of_its_set_is_refused(tmp_path):
    """An index naming only model-00001-of-0000N loaded that file's tensors as the model
    (14 of 21, no lm_head); the set's other files were in the directory."""
    from hfmodels import write_llama
    d = write_llama(str(tmp_path / "ck"))
    p = os.path.join(d, "model.safetensors.index.json")
    idx = json.load(open(p))
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) >= 2
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v == files[0]}
    json.dump(idx, open(p, "w"))
    e = bad(d)
    n = len(files)
    assert str(e) == (f"file model.safetensors.index.json: lists 1 of the {n} files of "
                            f"its numbered set but not {files[1]}, which is in the directory: "
                            f"the tensors of {files[1]} would be left out; expected every file "
                            f"of the set in the weight_map (an index edited or cut short?)")


@pytest.mark.parametrize("stranger, kind", [
    ("consolidated.safetensors", "a file of no numbered set"),
    ("adapter-00001-of-00001.safetensors", "the numbered set adapter-*-of-00001")])
def test_a_numbered_set_beside_another_file_without_an_index_is_refused(tmp_path, stranger,
                                                                       kind):
    """Mistral's consolidated.safetensors (or a second numbered set) beside numbered
    shards, no index: both read as one checkpoint (each tensor twice, or a stranger's
    tensors among the model's)."""
    from hfmodels import write_llama
    d = write_llama(str(tmp_path / "ck"))
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    save_file({"layers.0.attention.wk.weight": torch.zeros(2)}, os.path.join(d, stranger))
    e = bad(d)
    first, second = sorted([stranger, "model-00001-of-00006.safetensors"])
    kinds = {stranger: kind, "model-00001-of-00006.safetensors":
             "the numbered set model-*-of-00006"}
    assert str(e) == (f"file {d}: holds {first} ({kinds[first]}) and {second} "
                            f"({kinds[second]}) but no index: which files make the checkpoint "
                            f"cannot be told; expected an index (model.safetensors.index.json) "
                            f"or one checkpoint per directory")


def test_an_index_naming_model_safetensors_and_more_is_one_checkpoint(tmp_path):
    """An index naming model.safetensors beside another file (an MTP head kept apart) is one
    checkpoint: it was refused as two."""
    d = tmp_path / "ck"
    d.mkdir()
    save_file({"a": torch.ones(2)}, str(d / "model.safetensors"))
    save_file({"mtp.w": torch.zeros(2)}, str(d / "mtp.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model.safetensors", "mtp.w": "mtp.safetensors"}}))
    assert sorted(read_checkpoint(str(d)).tensors) == ["a", "mtp.w"]


def test_checkpoint_path_holding_a_nul_is_refused():
    """A path with a NUL character raised os.stat's bare ``ValueError: embedded null
    byte``, naming no path."""
    import coordloader as cl
    from coordloader.layout import Layout
    want = ("checkpoint path '/tmp/ckpt\\x00x' holds a NUL character, which no file path "
            "can")
    for call in (lambda: read_checkpoint("/tmp/ckpt\0x"),
                 lambda: cl.load("/tmp/ckpt\0x", Layout(), rank=0),
                 lambda: cl.make_plan("/tmp/ckpt\0x", Layout())):
        with pytest.raises(CheckpointError) as e:
            call()
        assert str(e.value) == want


@pytest.mark.parametrize("header", [
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}',
    '{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[2],'
    '"data_offsets":[0,8]}}',
], ids=["offset", "shape"])
def test_minus_zero_in_a_header_is_refused_as_safetensors_refuses_it(tmp_path, header):
    """JSON's -0 read as 0: the file loaded (digest verify included) where the safetensors
    library, transformers and vLLM refuse it (serde reads -0 as a float)."""
    from safetensors import safe_open
    path = write_raw(tmp_path / M, header, 8)
    with pytest.raises(Exception, match="-0.0"):
        safe_open(path, "pt")
    bad(tmp_path, f"file {M}: header: -0 is not an unsigned integer (the safetensors "
                  f"library reads it as the float -0.0 and refuses the file)")
    # a "-0" inside a string is no number
    write_raw(tmp_path / M, '{"__metadata__":{"note":"[1,-0]"},'
                            '"a-0":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8)
    assert list(read_checkpoint(str(tmp_path)).tensors) == ["a-0"]
    safe_open(path, "pt")
    # and a header where "-0" stands in no number position keeps the fast decoder
    from coordloader.checkpoint import reader
    assert reader._header_decoder(b'{"__metadata__":{"date":"2025-01-02"},"blk-0":{}}') \
        is reader._HEADER_DECODER_FAST
    assert reader._header_decoder(b'{"a":{"shape":[ -0 ]}}') is reader._HEADER_DECODER_CHECKED
