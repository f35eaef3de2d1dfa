"""InstantTensor engine contract tests on CPU.

``FakeSafeOpen`` stands in for the CUDA-bound ``instanttensor.safe_open``: same
signature (checked against the installed package), same observable behaviour — the file
list is sorted in place, tensors stream in file-then-offset order, group mode yields every
tensor of the files on every rank, ``tensor_filter`` with a process group raises
ValueError, a non-CUDA device raises ValueError, and with ``copy=False`` each yielded
tensor is a view into a ring buffer that is overwritten before the next yield (so an
engine that keeps references instead of copying fails these tests), and the handle keeps
the list it streams as ``filename``. ``FakeSafeOpen.ORDER`` (a test sets it; the
signature stays the real one's) streams the files in another order: "reversed" (a
library build that orders its list otherwise, and says so in ``filename``) or "hidden"
(reversed, and no ``filename`` on the handle)."""
from __future__ import annotations

import contextlib
import fnmatch
import inspect
import json
import os
import re
import time
from typing import Literal, Optional, Union

import instanttensor
import pytest
import torch

from coordloader.engines import instanttensor_engine as ite
from coordloader.engines import select_engine
from coordloader.errors import LoadError
from coordloader.planning.model import LoadGroup, Plan, RankPlan

from test_engine_cpu import (  # noqa: F401
    DCP_FILES,
    ckpt,
    dcp_ckpt,
    multi_piece_ckpt,
    plans_for,
    reference,
    same_bytes,
    slice_of,
    split_box,
)

CALLS: list[dict] = []


class FakeSafeOpen:
    ORDER: Literal["sorted", "reversed", "hidden"] = "sorted"

    def __init__(self, filename: Union[str, list[str]], framework: str,
                 device: Union[int, str, torch.device], process_group=None, *,
                 buffer_size: Optional[int] = None, chunk_size: Optional[int] = None,
                 concurrency: Optional[int] = None, io_depth: Optional[int] = None,
                 max_free_mem_usage: Optional[float] = None, load_now: bool = True,
                 copy: bool = True, backend=None,
                 tensor_filter: Optional[list[str]] = None,
                 tensor_name_match_mode: Literal["exact", "glob", "regex"] = "glob"):
        if tensor_filter is not None and process_group is not None:
            raise ValueError("tensor_filter requires process_group=None")
        size = getattr(process_group, "size", None)   # (tests' stand-in groups have none)
        if callable(size) and size() == 1:
            # the real one reads the world size from the communicator (LoaderManager::open)
            raise RuntimeError("Internal error: A communicatior should not be provided if "
                               "world_size == 1")
        if isinstance(filename, str):
            filename = [filename]
        filename.sort(reverse=self.ORDER != "sorted")  # the real one sorts the caller's list in place
        if self.ORDER != "hidden":
            self.filename = filename   # the real one's attribute: the list it streams
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            raise ValueError("InstantTensor only supports CUDA devices for now")
        if framework != "pt":
            raise ValueError("InstantTensor only supports pytorch for now")
        self.device_idx = device.index
        CALLS.append(dict(files=[os.path.basename(f) for f in filename], process_group=process_group,
                          copy=copy, backend=backend, chunk_size=chunk_size, io_depth=io_depth,
                          tensor_filter=tensor_filter, mode=tensor_name_match_mode))
        if tensor_filter is None:
            keep = lambda n: True  # noqa: E731
        elif tensor_name_match_mode == "exact":
            keep = set(tensor_filter).__contains__
        elif tensor_name_match_mode == "glob":
            keep = lambda n: any(fnmatch.fnmatchcase(n, p) for p in tensor_filter)  # noqa: E731
        else:
            keep = lambda n: any(re.fullmatch(p, n) for p in tensor_filter)  # noqa: E731
        self.items = []
        for f in filename:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                hdr = json.loads(fh.read(n))
            file_meta = hdr.pop("__metadata__", None)
            if file_meta is not None and file_meta.get("format", "pt") != "pt":
                raise ValueError("InstantTensor only supports pytorch format for now")
            if not hdr:   # as the real read_safetensors_metadata refuses a file of none
                raise ValueError(f"Invalid safetensors file {f!r}: no tensor metadata found")
            ordered = sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0])
            # the real one requires each tensor to end where the next (in this order) starts
            if any(a[1]["data_offsets"][1] != b[1]["data_offsets"][0]
                   for a, b in zip(ordered, ordered[1:])):
                raise ValueError("Safetensors data offsets must be contiguous")
            for k, v in ordered:
                if keep(k):
                    self.items.append((f, k, v, 8 + n))
        self.copy = copy
        self.entered = False

    def __enter__(self):
        self.entered = True
        return self

    def __exit__(self, *exc):
        self.entered = False

    def tensors(self):
        from coordloader.checkpoint import dtypes
        # like the real buffer: at least the largest tensor, reused for every tensor
        ring = torch.empty(max([v["data_offsets"][1] - v["data_offsets"][0]
                                for _, _, v, _ in self.items] + [1]), dtype=torch.uint8)
        for f, k, v, start in self.items:
            # the real tensors() synchronises torch.cuda.current_stream() before its loader
            # may reuse the slot: only the current device's stream. With another device
            # current, a copy_ queued on this device's stream could read the next chunk
            # (silently, on a GPU); the fake refuses it loudly instead
            if torch.cuda.current_device() != self.device_idx:
                raise RuntimeError(f"tensors() of a handle on cuda:{self.device_idx} with "
                                   f"cuda:{torch.cuda.current_device()} current")
            a, b = v["data_offsets"]
            ring.fill_(0xA5)  # the previous tensor's bytes are gone
            with open(f, "rb") as fh:
                fh.seek(start + a)
                data = fh.read(b - a)
            buf = ring[:len(data)]
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf)
            t = buf.view(dtypes.torch_dtype(v["dtype"])).reshape(v["shape"])
            yield k, (t.clone() if self.copy else t)


def test_fake_signature_matches_real_instanttensor():
    real = inspect.signature(instanttensor.safe_open)
    fake = inspect.signature(FakeSafeOpen)
    assert list(real.parameters) == list(fake.parameters)
    for name, p in real.parameters.items():
        q = fake.parameters[name]
        assert (p.kind, p.default) == (q.kind, q.default), name


def test_real_instanttensor_behaves_like_the_fake_on_refusals(ckpt):
    """What the fake mimics is what the real package does (checked before any CUDA use)."""
    meta, _ = ckpt
    path = os.path.join(meta.root, "a.safetensors")
    with pytest.raises(ValueError, match="tensor_filter requires process_group=None"):
        instanttensor.safe_open([path], framework="pt", device=0, process_group=object(),
                                tensor_filter=["x"])
    with pytest.raises(ValueError, match="tensor_filter requires process_group=None"):
        FakeSafeOpen([path], framework="pt", device=0, process_group=object(), tensor_filter=["x"])


class FakeCurrentDevice:
    """``torch.cuda.device`` on a machine without CUDA: makes its device the one
    ``torch.cuda.current_device()`` answers (``CURRENT``), and puts the previous one back,
    so that ``FakeSafeOpen.tensors()`` sees which device the engine made current."""
    CURRENT = 0

    def __init__(self, device):
        self.idx = device if isinstance(device, int) else torch.device(device).index

    def __enter__(self):
        self.prev, FakeCurrentDevice.CURRENT = FakeCurrentDevice.CURRENT, self.idx

    def __exit__(self, *exc):
        FakeCurrentDevice.CURRENT = self.prev
        return False


@contextlib.contextmanager
def faked_instanttensor(gloo_as_nccl: bool = False):
    """The instanttensor engine on CPU: ``FakeSafeOpen`` for safe_open, destinations in
    host memory, CUDA said available, ``FakeCurrentDevice`` for the current device.
    ``gloo_as_nccl``: the engine takes gloo groups as the NCCL ones it needs (the fake's
    collectives, like the real one's, go over the group it is given)."""
    with pytest.MonkeyPatch.context() as mp:
        if gloo_as_nccl:
            real = ite.cuda_backend
            mp.setattr(ite, "cuda_backend",
                       lambda pg: "nccl" if real(pg) == "gloo" else real(pg))
        mp.setattr(ite, "_safe_open", lambda: FakeSafeOpen)
        mp.setattr(ite, "_allocation_device", lambda dev: torch.device("cpu"))
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(FakeCurrentDevice, "CURRENT", 0)
        mp.setattr(torch.cuda, "device", FakeCurrentDevice)
        mp.setattr(torch.cuda, "current_device", lambda: FakeCurrentDevice.CURRENT)
        yield


@pytest.fixture()
def fake_cuda():
    CALLS.clear()
    with faked_instanttensor():
        yield CALLS


def _plan(meta, rps, groups=()):
    from coordloader.layout import Layout
    return Plan(Layout(tp=len(rps)), meta.fingerprint(), tuple(rps), (), tuple(groups))


def _refusal(monkeypatch, opener, meta, rp) -> str:
    """The LoadError message of the instanttensor engine loading ``rp`` through ``opener``
    (a fake of instanttensor's safe_open)."""
    monkeypatch.setattr(ite, "_safe_open", lambda: opener)
    with pytest.raises(LoadError) as e:
        select_engine("instanttensor", "cuda:0", plan=_plan(meta, [rp])).load_rank(
            meta, rp, "cuda:0")
    return str(e.value)


def _check(got, rp, full):
    assert sorted(got) == sorted(t.name for t in rp.tensors)
    for ts in rp.tensors:
        want = reference(full[ts.name], [(p.src, p.dst) for p in ts.pieces], ts.local_shape)
        assert same_bytes(got[ts.name], want), (rp.rank, ts.name)


def test_group_mode_default_one_group_of_all_files(ckpt, fake_cuda):
    meta, full = ckpt
    rps = plans_for(meta)
    plan = _plan(meta, rps)
    for rp in rps:
        eng = select_engine("instanttensor", "cuda:0", plan=plan)
        got, stats = eng.load_rank(meta, rp, "cuda:0")
        _check(got, rp, full)
        assert stats.bytes_held == rp.bytes_held
        assert stats.extra["bytes_streamed"] == meta.total_bytes  # every tensor streamed past
    call = fake_cuda[-1]
    assert call["files"] == ["a.safetensors", "b.safetensors"] and call["copy"] is False
    assert call["tensor_filter"] is None and call["process_group"] is None  # world 1: no group


def test_filtered_mode_reads_only_own_keys(ckpt, fake_cuda):
    meta, full = ckpt
    rps = plans_for(meta)
    groups = [LoadGroup(("a.safetensors",), (0, 1), "group"),
              LoadGroup(("b.safetensors",), (0, 1), "filtered")]
    plan = _plan(meta, rps, groups)
    rp = rps[1]
    got, stats = select_engine("instanttensor", "cuda:0", plan=plan,
                               loader_config='{"chunk_size": 4096}').load_rank(meta, rp, 0)
    _check(got, rp, full)
    assert [c["files"] for c in fake_cuda] == [["a.safetensors"], ["b.safetensors"]]
    assert fake_cuda[1]["tensor_filter"] == sorted(["o.weight", "experts.w", "fp8.weight", "mask"])
    assert fake_cuda[1]["mode"] == "exact" and fake_cuda[1]["process_group"] is None
    assert all(c["chunk_size"] == 4096 for c in fake_cuda)


def test_files_outside_every_group_are_still_loaded(ckpt, fake_cuda):
    meta, full = ckpt
    rps = plans_for(meta)
    plan = _plan(meta, rps, [LoadGroup(("a.safetensors",), (0,), "group")])
    got, _ = select_engine("instanttensor", "cuda:0", plan=plan).load_rank(meta, rps[1], "cuda:0")
    _check(got, rps[1], full)
    # rank 1 is in no group: everything it needs comes through one filtered call
    assert len(fake_cuda) == 1 and fake_cuda[0]["files"] == ["a.safetensors", "b.safetensors"]
    assert fake_cuda[0]["tensor_filter"] == sorted(t.name for t in rps[1].tensors)
    CALLS.clear()
    got, _ = select_engine("instanttensor", "cuda:0", plan=plan).load_rank(meta, rps[0], "cuda:0")
    _check(got, rps[0], full)
    assert [(c["files"], c["tensor_filter"] is None) for c in fake_cuda] == \
        [(["a.safetensors"], True), (["b.safetensors"], False)]


def test_multi_piece_sources_stream_by_piece_key(tmp_path, fake_cuda):
    meta, full = multi_piece_ckpt(tmp_path)
    pieces = [(split_box((8, 6), 0, 1, 2), (0, 0))]
    rp = RankPlan(1, {}, (slice_of(meta, "w", pieces),))
    got, _ = select_engine("instanttensor", "cuda:0", plan=_plan(meta, [rp, rp])).load_rank(
        meta, rp, "cuda:0")
    assert same_bytes(got["w"], reference(full, pieces, (4, 6)))


def test_dcp_pieces_under_one_key_in_two_files_stream_to_their_own_boxes(tmp_path, fake_cuda):
    """torch DCP's output: both files hold keys ``w`` and ``v``. The engine keyed the stream
    by key alone, rebuilt as ``w@0:4,0:6``: every DCP key was unknown. Each yielded ``w``
    is now matched to its file by stream position, in group mode (every tensor of both
    files streams) and in filtered mode (the filter ``["v", "w"]`` keeps both files'
    pieces, the rank's rows sit in one of them)."""
    meta, full = dcp_ckpt(tmp_path)
    rows = [((2, 6), (0, 6)), ((5, 8), (0, 6))]   # across both files / in the second only
    rps = [RankPlan(r, {}, (slice_of(meta, "w", [(b, (0, 0))]),
                            slice_of(meta, "v", [(((r, r + 2), (0, 2)), (0, 0))])))
           for r, b in enumerate(rows)]
    for groups in ([], [LoadGroup(DCP_FILES, (0, 1), "filtered")]):
        for rp in rps:
            CALLS.clear()
            got, stats = select_engine("instanttensor", "cuda:0", plan=_plan(meta, rps, groups)) \
                .load_rank(meta, rp, "cuda:0")
            _check(got, rp, full)
            assert [c["files"] for c in CALLS] == [list(DCP_FILES)]
            assert CALLS[0]["tensor_filter"] == (["v", "w"] if groups else None)
            assert stats.extra["bytes_streamed"] == meta.total_bytes


def test_a_dcp_file_streaming_a_key_its_header_did_not_list_is_named(tmp_path, fake_cuda,
                                                                        monkeypatch):
    """A yielded key the metadata does not list in the file the stream position gives
    (here every position of the second file is attributed to a file without tensors)
    is refused, naming that file."""
    meta, _ = dcp_ckpt(tmp_path)
    rp = RankPlan(0, {}, (slice_of(meta, "w", [(((0, 8), (0, 6)), (0, 0))]),))
    real = ite._stream_files
    monkeypatch.setattr(ite, "_stream_files",
                        lambda *a: [(f.replace("00002", "00003"), k, at) for f, k, at in real(*a)])
    first = min((p for t in meta.tensors.values() for p in t.pieces if p.file == DCP_FILES[1]),
                key=lambda p: p.start).key   # the second file's first tensor in the stream
    with pytest.raises(LoadError) as e:
        select_engine("instanttensor", "cuda:0", plan=_plan(meta, [rp])).load_rank(
            meta, rp, "cuda:0")
    assert str(e.value) == (f"rank 0, file {DCP_FILES[1].replace('00002', '00003')}: "
                            f"instanttensor yielded key {first!r}, which the checkpoint "
                            f"metadata does not list in this file (file changed?)")


@pytest.mark.parametrize("header", ["same", "other"])
def test_a_file_renamed_over_its_path_after_the_check_is_refused(tmp_path, fake_cuda,
                                                                 monkeypatch, header):
    """The engine checked each file on one open, then instanttensor opened the paths
    again: a file renamed over one in between (the next save) loaded its bytes unnoticed
    under a same header, or failed as an unknown key under another. The checked
    descriptors stay open through the stream, and each path must still name its file."""
    from safetensors.torch import save_file

    from coordloader.checkpoint.reader import read_checkpoint
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    meta = read_checkpoint(str(tmp_path))

    def swap_then_open(*a, **k):   # runs between the engine's check and instanttensor's open
        save_file({"w" if header == "same" else "x": torch.ones(4, 4)},
                  str(tmp_path / "new.safetensors"))
        os.replace(tmp_path / "new.safetensors", tmp_path / "model.safetensors")
        return FakeSafeOpen(*a, **k)

    rp = RankPlan(0, {}, (slice_of(meta, "w", [(((0, 4), (0, 4)), (0, 0))]),))
    assert _refusal(monkeypatch, swap_then_open, meta, rp) == (
        "rank 0, file model.safetensors: file was replaced at its path "
                            "between its check and its read (another inode there now): "
                            "read the checkpoint again")
    assert len(CALLS) == 1   # instanttensor did open it: the refusal came after


def test_a_file_rewritten_in_place_while_it_streams_is_refused(tmp_path, fake_cuda):
    """A file rewritten in place (same size and header, other data) while instanttensor
    streamed it loaded as a mix of its two versions with no error: every check ran
    before the stream. Each checked descriptor's identity is taken again after it."""
    import time

    from safetensors.torch import save_file

    from coordloader.checkpoint.reader import read_checkpoint
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(4), "b": torch.zeros(4)}, str(f))
    meta = read_checkpoint(str(tmp_path))
    rp = RankPlan(0, {}, tuple(slice_of(meta, k, [(((0, 4),), (0,))]) for k in ("a", "b")))
    streamed = []

    def rewrite_after_first(n):   # the fake reads each tensor as it yields it
        if not streamed:
            time.sleep(0.05)      # past the coarse clock's tick
            with open(f, "r+b") as fh:
                fh.seek(os.path.getsize(f) - 32)
                fh.write(torch.ones(8).numpy().tobytes())
        streamed.append(n)

    with pytest.raises(LoadError) as e:
        select_engine("instanttensor", "cuda:0", plan=_plan(meta, [rp])).load_rank(
            meta, rp, "cuda:0", progress=rewrite_after_first)
    assert streamed == [16, 16]   # 'b' did stream the new bytes
    assert str(e.value).startswith("rank 0, file model.safetensors: file changed during the "
                                   "load: its mtime and ctime moved after it was checked "
                                   "before the reads"), str(e.value)


def test_non_cuda_device_refused_before_instanttensor(ckpt, monkeypatch):
    meta, _ = ckpt
    CALLS.clear()
    monkeypatch.setattr(ite, "_safe_open", lambda: FakeSafeOpen)
    rp = plans_for(meta)[0]
    with pytest.raises(LoadError, match="CUDA devices only.*use --engine cpu"):
        select_engine("instanttensor", "cpu").load_rank(meta, rp, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LoadError, match="CUDA is not available"):
        select_engine("instanttensor").load_rank(meta, rp, "cuda:0")
    assert CALLS == []


def test_loader_config_conversion_and_refusals():
    cfg = ite.parse_loader_config('{"backend": "URING", "chunk_size": 1048576, "io_depth": 8}')
    assert cfg == {"backend": instanttensor.Backend.URING, "chunk_size": 1048576, "io_depth": 8}
    cfg = ite.parse_loader_config({"backend": ["URING", "AIO"], "buffer_size": 1 << 20})
    assert cfg["backend"] == [instanttensor.Backend.URING, instanttensor.Backend.AIO]
    with pytest.raises(LoadError, match=r"unknown backend .uring.*AIO.*URING.*MMAP"):
        ite.parse_loader_config('{"backend": "uring"}')
    for key in ("filename", "framework", "device", "process_group", "copy", "tensor_filter"):
        with pytest.raises(LoadError, match=f"cannot set {key}"):
            ite.parse_loader_config({key: 1})
    with pytest.raises(LoadError, match="unknown option.*chunk_sz.*chunk_size"):
        ite.parse_loader_config('{"chunk_sz": 1}')
    with pytest.raises(LoadError, match="not valid JSON"):
        ite.parse_loader_config("{backend: URING}")
    with pytest.raises(LoadError, match="backend list is empty"):
        ite.parse_loader_config({"backend": []})


def test_open_calls_decides_which_safe_open_calls_a_rank_makes():
    """The pure decision behind load_rank: group members open their group's files even
    when they need nothing there; filtered groups only for the keys needed; needed files
    no group of the rank covers get one filtered call of their own."""
    from coordloader.engines.instanttensor_engine import OpenCall, open_calls
    groups = [LoadGroup(("a", "b"), (0, 1), "group"), LoadGroup(("c",), (0, 1), "filtered"),
              LoadGroup(("d",), (1,), "group")]
    pgs = ["pg01", None, None]
    need = {"c": {"w@1", "w@0"}, "e": {"x"}}
    assert open_calls(groups, pgs, 0, need) == [
        OpenCall(["a", "b"], "pg01", None, 2),       # nothing needed in a, b: still a member
        OpenCall(["c"], None, ["w@0", "w@1"], 1),
        OpenCall(["e"], None, ["x"], 1)]
    # rank 1 needs nothing in c: no filtered call there; d is its own one-rank group
    assert open_calls(groups, pgs, 1, {"d": {"y"}}) == [
        OpenCall(["a", "b"], "pg01", None, 2), OpenCall(["d"], None, None, 1)]
    assert open_calls([], [], 0, {}) == []


def test_real_instanttensor_keeps_the_list_it_streams_as_filename():
    """What the engine reads the stream's file order from, in the real package's source:
    the sorted list is kept as ``self.filename`` and its tensors stream file by file in
    that list's order (``FakeSafeOpen`` does the same; CUDA is needed to build one)."""
    src = inspect.getsource(instanttensor.safe_open.__init__)
    assert "filename.sort()" in src and "self.filename = filename" in src
    assert re.search(r"for f_idx, f in enumerate\(self\.filename\):", src)
    assert "for tensor_index, (name, metadata) in enumerate(self.ordered_tensor_metadatas)" \
        in inspect.getsource(instanttensor.safe_open.tensors)


def _dcp_rank_plans(meta):
    rows = [((0, 4), (0, 6)), ((4, 8), (0, 6))]   # rank 0 in the first file, rank 1 the second
    return [RankPlan(r, {}, (slice_of(meta, "w", [(b, (0, 0))]),
                             slice_of(meta, "v", [(((r, r + 1), (0, 2)), (0, 0))])))
            for r, b in enumerate(rows)]


def test_dcp_pieces_are_attributed_in_the_order_the_handle_streams_its_files(
        tmp_path, fake_cuda, monkeypatch):
    """Each yielded tensor was attributed to a file by its position, assuming the files
    stream in Python-sorted order: a library streaming them otherwise gave rank 0 rows
    4:8 of ``w`` as its rows 0:4, no error (same key, same shape). The order is now the
    handle's own (its ``filename``)."""
    monkeypatch.setattr(FakeSafeOpen, "ORDER", "reversed")
    meta, full = dcp_ckpt(tmp_path)
    rps = _dcp_rank_plans(meta)
    for groups in ([], [LoadGroup(DCP_FILES, (0, 1), "filtered")]):
        for rp in rps:
            CALLS.clear()
            got, _ = select_engine("instanttensor", "cuda:0", plan=_plan(meta, rps, groups)) \
                .load_rank(meta, rp, "cuda:0")
            _check(got, rp, full)
            assert CALLS[0]["files"] == list(reversed(DCP_FILES))


def test_a_stream_whose_file_order_is_not_given_is_refused_where_keys_repeat(
        tmp_path, fake_cuda, monkeypatch, ckpt):
    """Without the handle's file order, a key stored in several of the files (torch DCP)
    cannot be attributed: refused, not guessed. Keys each in one file are attributed by
    key (the plain checkpoint loads)."""
    monkeypatch.setattr(FakeSafeOpen, "ORDER", "hidden")
    meta, full = ckpt
    rps = plans_for(meta)
    for rp in rps:
        got, _ = select_engine("instanttensor", "cuda:0", plan=_plan(meta, rps)).load_rank(
            meta, rp, "cuda:0")
        _check(got, rp, full)
    assert CALLS[-1]["files"] == ["b.safetensors", "a.safetensors"]
    (tmp_path / "dcp").mkdir()
    meta, _ = dcp_ckpt(tmp_path / "dcp")
    rps = _dcp_rank_plans(meta)
    with pytest.raises(LoadError) as e:
        select_engine("instanttensor", "cuda:0", plan=_plan(meta, rps)).load_rank(
            meta, rps[0], "cuda:0")
    assert str(e.value) == (
        f"rank 0: instanttensor does not say in which order it streams the 2 files "
        f"({DCP_FILES[0]}, ...; its handle has no 'filename' list of them), and key(s) "
        f"['v', 'w'] are stored in several of them (torch DCP's per-rank files): which file "
        f"a streamed tensor comes from cannot be told; use --engine cpu")


def test_a_yielded_tensor_of_another_dtype_or_shape_is_refused(tmp_path, fake_cuda,
                                                                monkeypatch):
    """A yielded tensor was only reshaped to its piece's box, so any tensor of the same
    element count was copied in: one of another dtype was converted value by value, one
    of another file (a handle streaming its files in another order than its ``filename``
    says) landed in the wrong rows. Its dtype and shape must be the stored piece's."""
    meta, full = dcp_ckpt(tmp_path)
    rp = _dcp_rank_plans(meta)[0]

    class Retyped(FakeSafeOpen):   # yields w's F32 bytes as I32: same shape and size
        def tensors(self):
            for k, t in super().tensors():
                yield k, (t.view(torch.int32) if t.dtype == torch.float32 else t)

    class Misordered(FakeSafeOpen):   # filename sorted, streams the files reversed
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.items.sort(key=lambda it: it[0], reverse=True)   # stable: offsets kept

    for fake, key, got, want in ((Retyped, "w", "torch.int32 [4, 6]", "torch.float32 [4, 6]"),
                                 (Misordered, "v", "torch.int32 [1, 2]", "torch.int32 [2, 2]")):
        assert _refusal(monkeypatch, fake, meta, rp) == (
            f"rank 0, file {DCP_FILES[0]}, tensor {key!r}: instanttensor yielded key {key!r} "
            f"as {got}; the checkpoint metadata has it in this file as {want} (file changed, or "
            f"the stream attributed to the wrong file?)")


def test_a_rank_of_many_files_gets_room_for_their_descriptors(tmp_path, fake_cuda):
    """The engine holds a checked descriptor of every file while instanttensor, which
    opens them all itself, streams: more files than the soft RLIMIT_NOFILE allows failed
    'cannot open: Too many open files'. The soft limit is raised for the load, as the cpu
    engine does, and put back after."""
    import resource

    import coordloader as cl
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.layout import Layout

    from helpers import few_descriptors, many_files
    n = 100
    many_files(str(tmp_path), n)
    meta = read_checkpoint(str(tmp_path))
    plan = cl.make_plan(meta, Layout(), replicate_unmatched=True)
    with few_descriptors(40) as low:
        got, _ = select_engine("instanttensor", "cuda:0", plan=plan).load_rank(
            meta, plan.rank(0), "cuda:0")
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low
    assert all(torch.equal(got[f"t{i}"], torch.full((4,), float(i))) for i in range(n))


def test_a_stream_that_skips_a_tensor_is_refused_not_attributed_to_the_next_file(
        tmp_path, fake_cuda, monkeypatch):
    """Tensors were attributed to files by counting: a stream yielding one tensor fewer
    than the metadata lists would credit every later one to the wrong file, and DCP's
    same-shaped pieces under one key in every file passed every check. The key expected
    at each position (each file's keys in the order of their bytes) is checked."""
    meta, _ = dcp_ckpt(tmp_path)
    rp = _dcp_rank_plans(meta)[0]
    first, second = (p.key for p in sorted(
        (p for t in meta.tensors.values() for p in t.pieces if p.file == DCP_FILES[0]),
        key=lambda p: p.start))

    class Skipping(FakeSafeOpen):   # drops the first file's first tensor
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            del self.items[0]

    assert _refusal(monkeypatch, Skipping, meta, rp) == (
        f"rank 0, file {DCP_FILES[0]}: instanttensor yielded key {second!r} where the "
        f"checkpoint metadata has {first!r} next in this file (the stream skipped or added a "
        f"tensor, or the file changed?)")


def test_a_zero_element_tensor_sharing_its_start_loads_in_header_order(tmp_path, fake_cuda):
    """safetensors writes ``z.bias`` (F32 [0], data_offsets [0, 0]) before ``a.weight``
    ([0, 32]) in the header; instanttensor sorts a file's tensors by start alone, stably,
    so ``z.bias`` streams first, while the engine expected the (start, key) order of the
    metadata and refused a valid checkpoint in group mode. A tie may now stream in any
    order; the fake sorts exactly as the real package does."""
    from safetensors.torch import save_file

    import coordloader as cl
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.layout import Layout
    w = torch.arange(16, dtype=torch.bfloat16).reshape(4, 4)
    save_file({"a.weight": w, "z.bias": torch.zeros(0)}, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "model.safetensors", "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        assert list(json.loads(fh.read(n))) == ["z.bias", "a.weight"]
    meta = read_checkpoint(str(tmp_path))
    rp = cl.make_plan(meta, Layout(), replicate_unmatched=True).rank(0)
    plan = _plan(meta, [rp], [LoadGroup(("model.safetensors",), (0,), "group")])
    got, _ = select_engine("instanttensor", "cuda:0", plan=plan).load_rank(meta, rp, "cuda:0")
    assert torch.equal(got["a.weight"], w) and got["z.bias"].shape == (0,)
    assert CALLS[-1]["tensor_filter"] is None   # group mode: every tensor streams


def test_the_fake_orders_a_files_tensors_as_real_instanttensor_does():
    """The real package's order, from its source: a stable sort of the header's items by
    their start (so equal starts keep header order), as ``FakeSafeOpen`` sorts."""
    src = inspect.getsource(instanttensor.safe_open.__init__)
    assert ('sorted(tensor_metadata.items(), key=lambda kv: kv[1]["data_offsets"][0])'
            in src)
    assert ('sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0])'
            in inspect.getsource(FakeSafeOpen.__init__))
    # and refuses what the fake refuses: a file of no tensor, offsets not contiguous
    assert "Safetensors data offsets must be contiguous" in src
    assert "no tensor metadata found" in inspect.getsource(inspect.getmodule(instanttensor.safe_open))


def test_the_load_device_is_current_while_instanttensor_streams(ckpt, fake_cuda):
    """The engine passed ``device=1`` to safe_open with cuda:0 current: instanttensor's
    tensors() synchronises only the current device's stream before its loader reuses a
    ring-buffer slot, so the engine's copy_ on cuda:1 could read the next chunk's bytes.
    The load device is now current for every open, stream and copy (and not after)."""
    meta, full = ckpt
    rps = plans_for(meta)
    for groups in ([], [LoadGroup(("a.safetensors", "b.safetensors"), (0, 1), "filtered")]):
        got, _ = select_engine("instanttensor", "cuda:1", plan=_plan(meta, rps, groups)).load_rank(
            meta, rps[0], "cuda:1")
        _check(got, rps[0], full)
        assert torch.cuda.current_device() == 0


def test_real_instanttensor_synchronises_the_current_stream_only():
    """What the fake's current-device check stands for, in the real package's source."""
    src = inspect.getsource(instanttensor.safe_open.tensors)
    assert "stream = torch.cuda.current_stream()" in src and "stream.synchronize()" in src


class _Group:
    """A process group as far as the engine choice looks: ``dist.get_backend`` of it
    (patched) answers ``backend``."""
    def __init__(self, backend: str):
        self.backend = backend


@pytest.fixture()
def group_backends(monkeypatch):
    """``_Group``s for process groups; their collectives those of ranks that all agree."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "get_backend", lambda pg=None: pg.backend)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_picks_the_cpu_engine_for_a_group_without_nccl(group_backends):
    """A gloo group (vLLM's CPU group, a gloo job on GPU machines) with a CUDA device:
    ``auto`` picked instanttensor, whose safe_open failed with ``AttributeError:
    'ProcessGroupGloo' object has no attribute '_comm_ptr'``. It now picks cpu there."""
    from coordloader.engines import cuda_backend, resolve_engine_name
    from coordloader.engines.cpu import CpuEngine
    for backend, want in (("gloo", "cpu"), ("nccl", "instanttensor"),
                          ("cpu:gloo,cuda:nccl", "instanttensor"), ("cpu:gloo", "cpu")):
        assert resolve_engine_name("auto", "cuda:0", _Group(backend)) == want, backend
    assert cuda_backend(_Group("cpu:gloo,cuda:nccl")) == "nccl" and cuda_backend(None) is None
    assert resolve_engine_name("auto", "cuda:0") == "instanttensor"   # no group: one process
    assert resolve_engine_name("auto", "cpu", _Group("nccl")) == "cpu"
    assert isinstance(select_engine("auto", "cuda:0", group=_Group("gloo")), CpuEngine)


def test_instanttensor_over_a_group_without_nccl_is_refused_by_name(ckpt, fake_cuda,
                                                                     group_backends,
                                                                     monkeypatch):
    """Asked for by name over a gloo group, the engine refuses before any safe_open
    (was: safe_open's ``AttributeError: 'ProcessGroupGloo' object has no attribute
    '_comm_ptr'`` wrapped in a LoadError)."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    meta, _ = ckpt
    rps = plans_for(meta)
    plan = _plan(meta, rps, [LoadGroup(("a.safetensors", "b.safetensors"), (0, 1), "group")])
    with pytest.raises(LoadError) as e:
        select_engine("instanttensor", "cuda:0", plan=plan, group=_Group("gloo")).load_rank(
            meta, rps[0], "cuda:0")
    assert str(e.value) == (
        "rank 0: the instanttensor engine needs an NCCL process group (it hands the group's "
        "NCCL communicator to its loader); the load's group runs CUDA collectives with gloo: "
        "pass an NCCL group, or use --engine cpu")
    assert CALLS == []


def test_stage_groups_are_made_once_per_default_group(ckpt, fake_cuda, group_backends,
                                                      monkeypatch):
    """Each load made a new process group per stage load group (pp > 1) and never
    destroyed it: an NCCL communicator leaked per stage group per load. They are made
    once per default group, and again for a new default group."""
    import torch.distributed as dist
    made: list[list[int]] = []

    def new_group(ranks):
        made.append(ranks)
        return _Group("nccl")
    monkeypatch.setattr(dist, "new_group", new_group)
    meta, full = ckpt
    two = plans_for(meta)
    rps = [RankPlan(r, {}, two[r % 2].tensors) for r in range(4)]
    files = ("a.safetensors", "b.safetensors")
    plan = _plan(meta, rps, [LoadGroup(files, (0, 1), "group"), LoadGroup(files, (2, 3), "group")])
    used = []
    for world in (_Group("nccl"), _Group("nccl")):   # a default group, then a new one
        monkeypatch.setattr(dist.distributed_c10d._world, "default_pg", world)
        for _ in range(2):
            CALLS.clear()
            got, _ = select_engine("instanttensor", "cuda:0", plan=plan).load_rank(
                meta, rps[2], "cuda:0")
            _check(got, rps[2], full)
            used.append(CALLS[0]["process_group"])
    assert made == [[0, 1], [2, 3]] * 2   # every rank makes every stage's group, in order
    assert used[0] is used[1] is not used[2] and used[2] is used[3]


class CollectiveSafeOpen(FakeSafeOpen):
    """``FakeSafeOpen`` making the real one's first collective: its ``__init__``
    all_reduces its memory budget (MIN) over ``process_group`` before anything else."""
    def __init__(self, *a, process_group=None, **k):
        if process_group is not None:
            import torch.distributed as dist
            budget = torch.tensor([1 << 30])
            dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=process_group)
        super().__init__(*a, process_group=process_group, **k)


def _prepare_fails_worker(rank: int, port: int, meta, plan, out_dir: str):
    """Three group-mode loads over gloo: rank 0's allocation fails (CUDA out of memory),
    then its check of a file, then nothing. Writes what each load raised, and when."""
    import datetime

    import torch.distributed as dist

    from coordloader import engines
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=PREPARE_TIMEOUT_S))
    results = []
    with faked_instanttensor(gloo_as_nccl=True), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ite, "_safe_open", lambda: CollectiveSafeOpen)
        for case in ("allocate", "check", "import", "config", None):
            with pytest.MonkeyPatch.context() as fault:
                if rank == 0 and case == "allocate":
                    def oom(*a, **k):
                        raise torch.OutOfMemoryError("CUDA out of memory (rank 0 only)")
                    fault.setattr(ite, "allocate", oom)
                if rank == 0 and case == "check":
                    def changed(path, info, rank, **k):
                        raise LoadError("file changed after its header was read",
                                        file=info.name, rank=rank)
                    fault.setattr(engines, "open_checked", changed)
                if rank == 0 and case == "import":
                    def broken():   # what _instanttensor() raises on a broken install
                        raise LoadError("the instanttensor engine needs the 'instanttensor' "
                                        "package: libcudart.so.13: cannot open shared object")
                    fault.setattr(ite, "_safe_open", broken)
                if rank == 0 and case == "config":   # the import parsing loader_config makes
                    def broken_import():
                        raise LoadError("the instanttensor engine needs the 'instanttensor' "
                                        "package: libcudart.so.13 (config)")
                    fault.setattr(ite, "_instanttensor", broken_import)
                cfg = '{"chunk_size": 4096}' if case == "config" else None
                t0 = time.monotonic()
                try:
                    select_engine("instanttensor", "cuda:0", plan=plan,
                                  loader_config=cfg).load_rank(meta, plan.rank(rank), "cuda:0")
                    results.append([case, "ok", time.monotonic() - t0])
                except Exception as e:
                    results.append([case, f"{type(e).__name__}: {e}", time.monotonic() - t0])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    # torch's teardown of gloo at interpreter exit aborted now and then ("terminate called
    # without an active exception", one run in seven here, from the first version of this
    # test on), after both ranks had written their results and destroyed their groups
    os._exit(0)


PREPARE_TIMEOUT_S = 30


def _group_load_of_two_ranks(worker, ckpt, tmp_path) -> tuple:
    """``worker(rank, port, meta, plan, out_dir)`` in 2 gloo processes loading both files in
    one group; -> what each rank wrote (``rank{r}.json``)."""
    from coordloader.dist.collective import free_port

    from ranks import spawn_and_wait
    meta, _ = ckpt
    plan = _plan(meta, plans_for(meta), [LoadGroup(("a.safetensors", "b.safetensors"), (0, 1),
                                                   "group")])
    spawn_and_wait(worker, (free_port(), meta, plan, str(tmp_path)), 2, "2-rank load",
                   hard_s=3 * PREPARE_TIMEOUT_S)
    return tuple(json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))


@pytest.mark.slow   # rank processes over gloo
def test_a_rank_failing_before_the_first_collective_stops_every_rank_by_name(ckpt, tmp_path):
    """Rank 0 failed a rank-local step of the load (allocation out of CUDA memory, the
    check of a changed file, the import of instanttensor on a broken install, when the
    engine is made or when it opens) and left;
    rank 1 waited in safe_open's own all_reduce until the process group's timeout (NCCL:
    a watchdog crash), the cause never named. Every rank now prepares first and the
    ranks agree before the first collective: rank 0 raises its cause, rank 1 names rank
    0, at once, and the group still loads after."""
    r0, r1 = _group_load_of_two_ranks(_prepare_fails_worker, ckpt, tmp_path)
    assert [c for c, _, _ in r0] == [c for c, _, _ in r1] == ["allocate", "check", "import",
                                                              "config", None]
    for case in (0, 1, 2, 3):
        assert r1[case][1] == ("LoadError: rank 1: rank 0 failed to prepare the instanttensor "
                               "load (destinations, file checks; its own error says why): "
                               "not loading"), r1
    assert r0[0][1] == ("LoadError: rank 0: preparing the instanttensor load failed: "
                        "OutOfMemoryError: CUDA out of memory (rank 0 only)")
    assert r0[1][1] == ("LoadError: rank 0, file a.safetensors: file changed after its "
                        "header was read")
    assert r0[2][1] == ("LoadError: the instanttensor engine needs the 'instanttensor' "
                        "package: libcudart.so.13: cannot open shared object")
    assert r0[3][1] == ("LoadError: the instanttensor engine needs the 'instanttensor' "
                        "package: libcudart.so.13 (config)")
    assert r0[4][1] == r1[4][1] == "ok"
    assert all(t < PREPARE_TIMEOUT_S / 2 for _, _, t in r0 + r1), (r0, r1)


class StreamingSafeOpen(FakeSafeOpen):
    """``FakeSafeOpen`` whose stream, like the real one's in group mode, makes a collective
    over ``process_group`` for every tensor (the real one all-gathers each chunk)."""
    def __init__(self, *a, process_group=None, **k):
        super().__init__(*a, process_group=process_group, **k)
        self.group = process_group

    def tensors(self):
        import torch.distributed as dist
        for item in super().tensors():
            if self.group is not None:
                dist.all_reduce(torch.ones(1), group=self.group)
            yield item


def _progress_fails_worker(rank: int, port: int, meta, plan, out_dir: str):
    """A group-mode load over gloo whose progress callback raises on rank 0 at the
    second tensor. Writes what the load raised on this rank, and when."""
    import datetime

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=PREPARE_TIMEOUT_S))
    seen = []

    def progress(nbytes):
        seen.append(nbytes)
        if rank == 0 and len(seen) == 2:
            raise OSError("the progress bar's terminal went away")

    with faked_instanttensor(gloo_as_nccl=True), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ite, "_safe_open", lambda: StreamingSafeOpen)
        t0 = time.monotonic()
        try:
            got, _ = select_engine("instanttensor", "cuda:0", plan=plan).load_rank(
                meta, plan.rank(rank), "cuda:0", progress=progress)
            result = ["ok", time.monotonic() - t0, sorted(got)]
        except Exception as e:
            result = [f"{type(e).__name__}: {e}", time.monotonic() - t0, None]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)   # (see _prepare_fails_worker)


@pytest.mark.slow   # rank processes over gloo
def test_a_rank_failing_mid_stream_drains_it_so_the_others_finish(ckpt, tmp_path):
    """Rank 0's progress callback raised mid-stream: rank 0 left the stream, and rank 1
    waited in the stream's next collective until the group's timeout (NCCL: a watchdog
    crash). Rank 0 now drains the stream with the group and then raises its own error,
    naming the key and callback's error; rank 1 finishes the stream at once."""
    meta, _ = ckpt
    r0, r1 = _group_load_of_two_ranks(_progress_fails_worker, ckpt, tmp_path)
    plan = _plan(meta, plans_for(meta))
    assert r0[0].startswith("LoadError: rank 0: taking key ") and r0[0].endswith(
        "from instanttensor's stream failed: OSError: the progress bar's terminal went "
        "away"), r0
    assert r1[0] == "ok" and r1[2] == sorted(t.name for t in plan.rank(1).tensors), r1
    assert r0[1] < PREPARE_TIMEOUT_S / 2 and r1[1] < PREPARE_TIMEOUT_S / 2, (r0, r1)


def _records_alive() -> int:
    import gc

    from coordloader.checkpoint.metadata import TensorInfo
    gc.collect()
    return sum(type(o) is TensorInfo for o in gc.get_objects())


def test_a_plain_checkpoint_streams_without_a_record_of_every_tensor(tiny_checkpoint,
                                                                      fake_cuda):
    """Each rank streams every tensor of its group's files and checks each against the
    metadata: the engine made the record of every tensor of the checkpoint for that
    (92 k on DeepSeek-V3), most of them other ranks'. A plain checkpoint's tensors are
    checked against their header entries; each rank makes the records of its own."""
    from safetensors.torch import load_file

    import coordloader as cl
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.layout import Layout
    root = tiny_checkpoint("qwen3_moe")
    full = {}
    for f in sorted(os.listdir(root)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(root, f)))
    layout = Layout(ep=2, tp=2)
    for rank in range(layout.world_size):
        meta = read_checkpoint(root)
        plan = cl.make_plan(meta, layout)
        before = _records_alive()
        got, stats = select_engine("instanttensor", "cuda:0", plan=plan).load_rank(
            meta, plan.rank(rank), "cuda:0")
        made = _records_alive() - before
        _check(got, plan.rank(rank), full)
        assert stats.extra["bytes_streamed"] == meta.total_bytes   # every tensor streamed past
        experts = sum(".experts." in n for n in meta.tensors)
        # the rank's own records: not those of the other rank's half of the experts
        assert experts > 20 and made <= len(meta.tensors) - experts // 2
        assert CALLS[-1]["tensor_filter"] is None


def test_a_plain_checkpoints_streamed_tensor_of_another_dtype_is_refused(tiny_checkpoint,
                                                                       fake_cuda, monkeypatch):
    """The checks against a plain checkpoint's header entries are the checks against its
    records: a yielded tensor of another dtype (same shape and size) is refused naming
    the file and tensor, as it was."""
    import coordloader as cl
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.layout import Layout
    root = tiny_checkpoint("qwen3_moe")
    meta = read_checkpoint(root)
    plan = cl.make_plan(meta, Layout(ep=2, tp=2))
    # the first tensor streamed: the first file's, by offset
    first = min(meta.files, key=lambda f: f.name).name
    name, info = min(((n, t) for n, t in meta.tensors.items() if t.pieces[0].file == first),
                     key=lambda nt: nt[1].pieces[0].start)
    assert info.dtype == "BF16"
    meta = read_checkpoint(root)   # records unmade again

    class Retyped(FakeSafeOpen):   # BF16 bytes yielded as F16
        def tensors(self):
            for k, t in super().tensors():
                yield k, (t.view(torch.float16) if t.dtype == torch.bfloat16 else t)

    monkeypatch.setattr(ite, "_safe_open", lambda: Retyped)
    with pytest.raises(LoadError) as e:
        select_engine("instanttensor", "cuda:0", plan=plan).load_rank(meta, plan.rank(1),
                                                                       "cuda:0")
    assert str(e.value) == (
        f"rank 1, file {first}, tensor {name!r}: instanttensor yielded key {name!r} as "
        f"torch.float16 {list(info.shape)}; the checkpoint metadata has it in this file as "
        f"torch.bfloat16 {list(info.shape)} (file changed, or the stream attributed to the "
        f"wrong file?)")


def test_a_stream_that_leaves_out_a_file_is_refused_not_attributed_to_it(tmp_path, fake_cuda,
                                                                         monkeypatch):
    """DCP's per-rank files split evenly hold the same keys with the same shapes: a stream
    that left out the first file (its ``filename`` listing both) had the second file's
    tensors checked and attributed position by position as the first file's, and the load
    returned rows 4-8 of ``w`` as rows 0-4. The stream must end where the metadata does."""
    from test_engine_cpu import write_dcp_files
    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    v = torch.arange(100, 108, dtype=torch.int32).reshape(4, 2)
    write_dcp_files(tmp_path, {"w": w, "v": v}, {"w": ((0, 4), (4, 8)), "v": ((0, 2), (2, 4))})
    from coordloader.checkpoint.reader import read_checkpoint
    meta = read_checkpoint(str(tmp_path))
    pieces = [(((0, 4), (0, 6)), (0, 0))]
    rp = RankPlan(0, {}, (slice_of(meta, "w", pieces),))

    class LeavesOutAFile(FakeSafeOpen):   # filename lists both; the first never streams
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.items = [it for it in self.items if it[0] != self.filename[0]]

    assert _refusal(monkeypatch, LeavesOutAFile, meta, rp) == (
        f"rank 0, file {DCP_FILES[1]}: instanttensor's stream ended after 2 of the 4 "
        f"tensor(s) the checkpoint metadata lists in {DCP_FILES[0]} and others, before key "
        f"'w' of this file (the stream skipped tensors, or the file changed?)")
    monkeypatch.setattr(ite, "_safe_open", lambda: FakeSafeOpen)
    got, _ = select_engine("instanttensor", "cuda:0", plan=_plan(meta, [rp])).load_rank(
        meta, rp, "cuda:0")
    assert torch.equal(got["w"], w[0:4])


def test_a_file_of_no_tensor_is_left_out_of_the_default_group(tmp_path, fake_cuda):
    """A plan without load groups was streamed as one group of every file, and
    instanttensor refuses a file that holds no tensor (``no tensor metadata found``),
    which the reader and the cpu engine accept as a shard of the checkpoint."""
    from safetensors.torch import save_file

    import coordloader as cl
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.layout import Layout
    w = torch.arange(12.0).reshape(3, 4)
    save_file({"w": w}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({}, str(tmp_path / "model-00002-of-00002.safetensors"))
    meta = read_checkpoint(str(tmp_path))
    assert len(meta.files) == 2
    rp = cl.make_plan(meta, Layout(), replicate_unmatched=True).rank(0)
    got, _ = select_engine("instanttensor", "cuda:0", plan=_plan(meta, [rp])).load_rank(
        meta, rp, "cuda:0")
    assert torch.equal(got["w"], w)
    assert [c["files"] for c in CALLS] == [["model-00001-of-00002.safetensors"]]


def test_the_bench_reads_alone_at_world_1(tmp_path, fake_cuda, monkeypatch):
    """bench's it_raw gave instanttensor its one-rank group, which the real package
    refuses ("A communicatior should not be provided if world_size == 1"): the method
    failed on every one-GPU machine, the GPU check script's whole bench step with it."""
    import types

    import coordloader as cl
    from coordloader.bench import methods
    from coordloader.checkpoint import dtypes
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.layout import Layout
    from coordloader.synth import synthesize
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    meta = read_checkpoint(ck)
    plan = cl.make_plan(meta, Layout())
    ctx = methods.RankContext(ck, 0, 1, Layout(), meta, plan, plan.rank(0), device="cuda:0",
                              group=types.SimpleNamespace(size=lambda: 1))
    monkeypatch.setattr(instanttensor, "safe_open", FakeSafeOpen)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: None)
    dsts = {ts.name: torch.empty(ts.local_shape, dtype=dtypes.torch_dtype(ts.dtype))
            for ts in plan.rank(0).tensors}
    got, _, _ = methods._it_raw_run(ctx, dsts)
    from safetensors import safe_open
    with safe_open(os.path.join(ck, "model.safetensors"), "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    assert got.keys() == want.keys()
    for k in want:   # the vocab tables padded to 64 rows, zeros past the checkpoint's
        assert torch.equal(got[k][:want[k].shape[0]], want[k]), k
    assert [c["process_group"] for c in fake_cuda] == [None]


def test_a_file_of_another_format_is_refused_before_any_read(tmp_path, fake_cuda):
    """An MLX/TF/Flax export (__metadata__ format other than "pt") loads with the cpu
    engine, but InstantTensor raises ValueError on it, on CUDA only, after the ranks had
    agreed to stream."""
    from safetensors.torch import save_file

    import coordloader as cl
    from coordloader.checkpoint.reader import read_checkpoint
    save_file({"w": torch.arange(4.0)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "mlx"})
    meta = read_checkpoint(str(tmp_path))
    plan = cl.make_plan(meta, cl.Layout(), replicate_unmatched=True)
    assert torch.equal(cl.load_detailed(str(tmp_path), cl.Layout(), engine="cpu",
                                        replicate_unmatched=True).tensors["w"], torch.arange(4.0))
    with pytest.raises(LoadError) as e:
        select_engine("instanttensor", "cuda:0", plan=plan).load_rank(meta, plan.rank(0),
                                                                      "cuda:0")
    assert str(e.value) == ("rank 0, file model.safetensors: its __metadata__ format is 'mlx'; "
                            "InstantTensor loads only files of format 'pt': load with "
                            "engine='cpu' (--engine cpu)")
    assert fake_cuda == []


@pytest.mark.parametrize("zero_first", [True, False])
def test_a_zero_size_tensor_after_its_neighbour_in_the_header_is_refused_by_name(
        tmp_path, zero_first):
    """A zero-size tensor starting where a tensor of bytes does, after it in the header:
    the cpu engine loads it, InstantTensor (ordering by start, stably in header order)
    refuses the file as not contiguous, on CUDA only and naming no tensor. Before it in
    the header, both load."""
    import coordloader as cl
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.planning.model import LoadGroup, Plan

    from stfiles import write_raw
    w = torch.arange(16, dtype=torch.bfloat16).reshape(4, 4)
    entries = [("a.weight", {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]}),
               ("z.bias", {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]})]
    write_raw(str(tmp_path / "model.safetensors"),
              dict(entries[::-1] if zero_first else entries), w.view(torch.uint8).numpy().tobytes())
    meta = read_checkpoint(str(tmp_path))
    rp = cl.make_plan(meta, cl.Layout(), replicate_unmatched=True).rank(0)
    plan = Plan(cl.Layout(), meta.fingerprint(), (rp,), (),
                (LoadGroup(("model.safetensors",), (0,), "group"),))
    with faked_instanttensor():
        eng = select_engine("instanttensor", "cuda:0", plan=plan)
        if zero_first:
            got, _ = eng.load_rank(meta, rp, "cuda:0")
            assert torch.equal(got["a.weight"].cpu(), w) and got["z.bias"].numel() == 0
            return
        with pytest.raises(LoadError) as e:
            eng.load_rank(meta, rp, "cuda:0")
    assert str(e.value) == ("rank 0, file model.safetensors: tensor 'z.bias' holds no bytes and "
                            "starts where 'a.weight' does, after it in the header: InstantTensor "
                            "reads the file as not contiguous and refuses it; load with "
                            "engine='cpu' (--engine cpu)")


def test_a_tie_in_a_piece_of_a_sharded_tensor_is_refused_by_name(tmp_path):
    """The same tie where the zero-size entry is one piece of a tensor stored in several
    (a sharded save's empty shard): the file holding it is read again for its order, as a
    whole tensor's is, and refused by name before any read."""
    import dataclasses

    import coordloader as cl
    from coordloader.checkpoint.metadata import CheckpointMeta, TensorInfo
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.planning.model import LoadGroup, Plan

    from stfiles import write_raw
    w = torch.arange(16, dtype=torch.bfloat16).reshape(4, 4)
    headers = {"a.safetensors": {"a.weight": {"dtype": "BF16", "shape": [4, 4],
                                              "data_offsets": [0, 32]},
                                 "z.bias": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}},
               "b.safetensors": {"z.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}}
    data = {"a.safetensors": w.view(torch.uint8).numpy().tobytes(),
            "b.safetensors": torch.ones(2).view(torch.uint8).numpy().tobytes()}
    for name in headers:   # each alone, for its records, and both together, for the load
        (tmp_path / name[0]).mkdir()
        for d in (tmp_path, tmp_path / name[0]):
            write_raw(str(d / name), headers[name], data[name])
    one, two = (read_checkpoint(str(tmp_path / d)) for d in "ab")
    empty, full = one.tensors["z.bias"].pieces[0], two.tensors["z.bias"].pieces[0]
    z = TensorInfo("z.bias", "F32", (2,), (dataclasses.replace(empty, box=((0, 0),)), full))
    meta = CheckpointMeta(str(tmp_path), one.files + two.files,
                          {"a.weight": one.tensors["a.weight"], "z.bias": z})
    rp = cl.make_plan(meta, cl.Layout(), replicate_unmatched=True).rank(0)
    plan = Plan(cl.Layout(), meta.fingerprint(), (rp,), (),
                (LoadGroup(("a.safetensors", "b.safetensors"), (0,), "group"),))
    with faked_instanttensor(), pytest.raises(LoadError) as e:
        select_engine("instanttensor", "cuda:0", plan=plan).load_rank(meta, rp, "cuda:0")
    assert str(e.value) == ("rank 0, file a.safetensors: tensor 'z.bias' holds no bytes and "
                            "starts where 'a.weight' does, after it in the header: InstantTensor "
                            "reads the file as not contiguous and refuses it; load with "
                            "engine='cpu' (--engine cpu)")


@pytest.mark.parametrize("cfg, msg", [
    ('{"io_depth": 2048}', "io_depth=2048: expected at most 1024 (instanttensor's MAX_IO_DEPTH)"),
    ('{"chunk_size": "8M"}', "chunk_size='8M': expected a whole number"),
    ('{"max_free_mem_usage": 0}', "max_free_mem_usage=0: expected a number with 0 < value <= 1"),
    ('{"buffer_size": -1}', "buffer_size=-1: expected a whole number >= 1"),
    ('{"concurrency": -1}', "concurrency=-1: expected a whole number >= 0"),
    ('{"load_now": "no"}', "load_now='no': expected true or false"),
    ('{"chunk_size": 1073741825}', "chunk_size=1073741825: expected at most 1073741824 bytes "
                                   "once rounded up to whole pages (instanttensor's "
                                   "MAX_CHUNK_SIZE)"),
    # each value valid, the two together refused by instanttensor's _determine_io_params
    ('{"backend": "MMAP", "concurrency": 0}', "concurrency=0 with backend MMAP: instanttensor "
                                             "needs concurrency >= 1 there (0 is for the "
                                             "buffered backends)"),
    ('{"backend": ["CUFILE", "MMAP"], "concurrency": 0}', "concurrency=0 with backend CUFILE or "
                                                          "MMAP: instanttensor needs concurrency "
                                                          ">= 1 there (0 is for the buffered "
                                                          "backends)")])
def test_loader_config_values_instanttensor_refuses_are_refused_everywhere(tmp_path, cfg, msg):
    """Option names were checked, values not: each of these passed on CPU and failed on
    the GPU machine only (instanttensor's ValueError), and load_now "no" was taken as true."""
    import coordloader as cl
    from coordloader.synth import synthesize
    assert instanttensor._impl.MAX_IO_DEPTH == 1024   # the bound the message names
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    with pytest.raises(LoadError) as e:
        cl.load(ck, cl.Layout(), engine="cpu", loader_config=cfg)
    assert str(e.value) == f"--loader-config: {msg}"
    assert ite.parse_loader_config('{"io_depth": 64, "max_free_mem_usage": 0.8, '
                                   '"concurrency": 0, "load_now": false}') == {
        "io_depth": 64, "max_free_mem_usage": 0.8, "concurrency": 0, "load_now": False}
    import numpy as np  # numpy numbers, which the package takes, from Python callers
    cfg = {"io_depth": np.int64(8), "max_free_mem_usage": np.float32(0.5)}
    assert ite.parse_loader_config(cfg) == cfg
