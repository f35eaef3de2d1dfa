"""cpu and safetensors engines on hand-written safetensors files and hand-built plans.

The helpers here (header parsing, byte runs of a box) are written independently of the
checkpoint reader and the planner, so the engines are tested on their own."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from coordloader.checkpoint import dtypes
from coordloader.checkpoint.metadata import (
    CheckpointMeta,
    FileInfo,
    SourcePiece,
    TensorInfo,
    full_box,
)
from coordloader.engines import select_engine
from coordloader.errors import LoadError
from coordloader.planning.model import ByteRun, Piece, RankPlan, TensorSlice

from helpers import open_fds

# -- helpers (also used by test_engine_instanttensor) ----------------------------------------

def meta_of(root: str, files: list[str], sharded: dict | None = None) -> CheckpointMeta:
    """CheckpointMeta of hand-written files. ``sharded``: name -> (dtype, shape, [(file,
    key, box)]) for tensors stored as pieces (keys ``name@a:b,...``)."""
    infos, entries = [], {}
    for fname in sorted(files):
        path = os.path.join(root, fname)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            raw = f.read(n)
        hdr = json.loads(raw)
        md = hdr.pop("__metadata__", {})
        infos.append(FileInfo(fname, os.path.getsize(path), n, hashlib.sha256(raw).hexdigest(),
                              tuple(sorted(md.items()))))
        for k, v in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            entries[(fname, k)] = (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0],
                                   8 + n + v["data_offsets"][1])
    tensors = {}
    claimed = set()
    for name, (dt, shape, parts) in (sharded or {}).items():
        pcs = []
        for fname, key, box in parts:
            e = entries[(fname, key)]
            claimed.add((fname, key))
            pcs.append(SourcePiece(fname, tuple(map(tuple, box)), e[2], e[3], key))
        tensors[name] = TensorInfo(name, dt, tuple(shape), tuple(pcs))
    for (fname, k), (dt, shape, a, b) in entries.items():
        if (fname, k) not in claimed:
            tensors[k] = TensorInfo(k, dt, shape, (SourcePiece(fname, full_box(shape), a, b, k),))
    return CheckpointMeta(root=root, files=tuple(infos), tensors=tensors)


def _ravel(idx, shape) -> int:
    off = 0
    for i, s in zip(idx, shape):
        off = off * s + i
    return off


def runs_for(info: TensorInfo, src: tuple, dst: tuple, local_shape: tuple, isz: int) -> list:
    """Byte runs of the planned box ``src`` (placed at ``dst``), row by row, merged."""
    runs = []
    for sp in info.pieces:
        ov = []
        for (a, b), (c, d) in zip(src, sp.box):
            ov.append((max(a, c), min(b, d)))
        if any(lo >= hi for lo, hi in ov) and ov:
            continue
        sshape = tuple(b - a for a, b in sp.box)
        if not ov:  # 0-dim tensor
            runs.append(ByteRun(sp.file, sp.start, isz, 0))
            continue
        last = ov[-1]
        for head in itertools.product(*[range(lo, hi) for lo, hi in ov[:-1]]):
            g = tuple(head) + (last[0],)
            so = sp.start + isz * _ravel([x - b0 for x, (b0, _) in zip(g, sp.box)], sshape)
            do = isz * _ravel([o + x - a for o, x, (a, _) in zip(dst, g, src)], local_shape)
            n = isz * (last[1] - last[0])
            if runs and runs[-1].file == sp.file and runs[-1].offset + runs[-1].length == so \
                    and runs[-1].dest + runs[-1].length == do:
                r = runs[-1]
                runs[-1] = ByteRun(r.file, r.offset, r.length + n, r.dest)
            else:
                runs.append(ByteRun(sp.file, so, n, do))
    return runs


def slice_of(meta, name, pieces, local_shape=None, replica=0) -> TensorSlice:
    """pieces: list of (src box, dst offset)."""
    info = meta.tensors[name]
    if local_shape is None:
        local_shape = tuple(b - a for a, b in pieces[0][0])
    isz = dtypes.itemsize(info.dtype)
    runs = []
    for src, dst in pieces:
        runs += runs_for(info, tuple(src), tuple(dst), tuple(local_shape), isz)
    return TensorSlice(name, info.file, info.dtype, info.shape, tuple(local_shape),
                       tuple(Piece(tuple(map(tuple, s)), tuple(d)) for s, d in pieces), replica,
                       tuple(runs))


def split_box(shape, dim, k, n):
    size = shape[dim] // n
    return tuple((k * size, (k + 1) * size) if d == dim else (0, s) for d, s in enumerate(shape))


def reference(full: torch.Tensor, pieces, local_shape) -> torch.Tensor:
    """Expected local tensor, by plain torch indexing of the whole tensor."""
    out = torch.zeros(local_shape, dtype=full.dtype)
    for src, dst in pieces:
        sl_src = tuple(slice(a, b) for a, b in src)
        sl_dst = tuple(slice(o, o + b - a) for o, (a, b) in zip(dst, src))
        out[sl_dst] = full[sl_src]
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return a.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == \
        b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture()
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = {
        "embed.weight": torch.randn(10, 8, generator=g, dtype=torch.float32).to(torch.bfloat16),
        "q.weight": torch.randn(8, 12, generator=g, dtype=torch.float32),
        "o.weight": torch.randn(6, 16, generator=g, dtype=torch.float32).to(torch.float16),
        "experts.w": torch.randint(-100, 100, (4, 6, 5), generator=g, dtype=torch.int64),
        "fp8.weight": torch.randint(0, 255, (8, 8), generator=g, dtype=torch.uint8)
        .view(torch.float8_e4m3fn),
        "mask": torch.rand(7, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.float32),
    }
    save_file({k: t[k] for k in ("embed.weight", "q.weight", "scalar")},
              str(tmp_path / "a.safetensors"))
    save_file({k: t[k] for k in ("o.weight", "experts.w", "fp8.weight", "mask")},
              str(tmp_path / "b.safetensors"))
    meta = meta_of(str(tmp_path), ["a.safetensors", "b.safetensors"])
    return meta, t


def plans_for(meta, n=2):
    """Per rank: vocab-padded dim-0 split, dim-0, dim-1, middle-dim split, replicated."""
    out = []
    for k in range(n):
        sl = []
        # vocab 10 padded to 12 over 2 ranks: rank 0 rows 0..5, rank 1 rows 6..9 + 2 zero rows
        rows = (k * 6, min(10, k * 6 + 6))
        sl.append(slice_of(meta, "embed.weight", [(((rows[0], rows[1]), (0, 8)), (0, 0))],
                           local_shape=(6, 8)))
        sl.append(slice_of(meta, "q.weight", [(split_box((8, 12), 0, k, n), (0, 0))]))
        sl.append(slice_of(meta, "o.weight", [(split_box((6, 16), 1, k, n), (0, 0))]))
        sl.append(slice_of(meta, "experts.w", [(split_box((4, 6, 5), 1, k, n), (0, 0, 0))]))
        # packed: two blocks of dim 0, each split, concatenated locally
        blk = [((a * 4 + k * 2, a * 4 + k * 2 + 2), (0, 8)) for a in range(2)]
        sl.append(slice_of(meta, "fp8.weight", [(blk[0], (0, 0)), (blk[1], (2, 0))],
                           local_shape=(4, 8)))
        sl.append(slice_of(meta, "mask", [(((0, 7),), (0,))], replica=k))
        sl.append(slice_of(meta, "scalar", [((), ())], local_shape=(), replica=k))
        out.append(RankPlan(k, {"tp": k}, tuple(sorted(sl, key=lambda s: s.name))))
    return out


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_engines_match_reference_slices(ckpt, engine):
    meta, full = ckpt
    for rp in plans_for(meta):
        eng = select_engine(engine, "cpu")
        got, stats = eng.load_rank(meta, rp, "cpu")
        assert sorted(got) == sorted(t.name for t in rp.tensors)
        for ts in rp.tensors:
            want = reference(full[ts.name], [(p.src, p.dst) for p in ts.pieces], ts.local_shape)
            assert same_bytes(got[ts.name], want), (engine, rp.rank, ts.name)
        assert stats.bytes_held == rp.bytes_held
        assert stats.bytes_read == sum(p_bytes for p_bytes in
                                       (ts.covered_numel * dtypes.itemsize(ts.dtype)
                                        for ts in rp.tensors))
        assert stats.bytes_read <= 1.01 * stats.bytes_held
        assert stats.tensors == len(rp.tensors) and stats.seconds > 0


def test_cpu_engine_threads_short_reads_and_progress(ckpt, monkeypatch):
    meta, full = ckpt
    real = os.preadv

    def short(fd, bufs, off):  # the kernel may return fewer bytes: the engine must loop
        mv = memoryview(bufs[0])
        return real(fd, [mv[:3]], off)

    monkeypatch.setattr(os, "preadv", short)
    rp = plans_for(meta)[1]
    seen = []
    eng = select_engine("cpu", "cpu", threads=3, chunk_bytes=16)  # many tiny tasks
    got, stats = eng.load_rank(meta, rp, "cpu", progress=seen.append)
    for ts in rp.tensors:
        want = reference(full[ts.name], [(p.src, p.dst) for p in ts.pieces], ts.local_shape)
        assert same_bytes(got[ts.name], want), ts.name
    assert sum(seen) == stats.bytes_read == rp.bytes_to_read


def test_cpu_engine_reads_into_given_destinations(ckpt):
    meta, full = ckpt
    rp = plans_for(meta)[0]
    out = {ts.name: torch.full(ts.local_shape, 7, dtype=dtypes.torch_dtype(ts.dtype))
           if ts.dtype not in ("F8_E4M3", "BOOL") else
           torch.empty(ts.local_shape, dtype=dtypes.torch_dtype(ts.dtype))
           for ts in rp.tensors}
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    got, _ = select_engine("cpu").load_rank(meta, rp, "cpu", out=out)
    for ts in rp.tensors:
        assert got[ts.name].data_ptr() == ptrs[ts.name]
        want = reference(full[ts.name], [(p.src, p.dst) for p in ts.pieces], ts.local_shape)
        assert same_bytes(out[ts.name], want)
    bad = dict(out, **{"q.weight": torch.empty(3, 3)})
    with pytest.raises(LoadError, match="q.weight"):
        select_engine("cpu").load_rank(meta, rp, "cpu", out=bad)


def test_cpu_engine_errors_name_file_tensor_offset_and_leak_no_fd(ckpt, monkeypatch, tmp_path):
    meta, _ = ckpt
    rp = plans_for(meta)[0]
    before = len(open_fds())
    for _ in range(30):
        select_engine("cpu").load_rank(meta, rp, "cpu")
    # EOF mid-read (file shrank between the size check and the read)
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 0)
    for _ in range(20):
        with pytest.raises(LoadError) as ei:
            select_engine("cpu", threads=2, chunk_bytes=8).load_rank(meta, rp, "cpu")
        msg = str(ei.value)
        m = re.search(r"rank 0, file (\S+), tensor '([^']+)': unexpected end of file at offset \d+",
                      msg)
        assert m and meta.tensors[m[2]].file == m[1], msg
    monkeypatch.undo()
    # the file changed size after its header was read
    with open(tmp_path / "b.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(LoadError, match="b.safetensors.*changed"):
        select_engine("cpu").load_rank(meta, rp, "cpu")
    os.remove(tmp_path / "a.safetensors")
    with pytest.raises(LoadError, match="a.safetensors.*cannot open"):
        select_engine("cpu").load_rank(meta, rp, "cpu")
    assert len(open_fds()) == before


def test_cpu_engine_refuses_runs_outside_tensor_or_file(ckpt):
    meta, _ = ckpt
    ts = slice_of(meta, "q.weight", [(split_box((8, 12), 0, 0, 2), (0, 0))])
    r = ts.byte_runs[0]
    over = dataclasses.replace(ts, byte_runs=(ByteRun(r.file, r.offset, r.length + 4, r.dest),))
    with pytest.raises(LoadError, match="outside the local tensor"):
        select_engine("cpu").load_rank(meta, RankPlan(0, {}, (over,)), "cpu")
    fi = meta.file(r.file)
    past = dataclasses.replace(ts, byte_runs=(ByteRun(r.file, fi.size - 4, 8, 0),))
    with pytest.raises(LoadError, match="outside the data section"):
        select_engine("cpu").load_rank(meta, RankPlan(0, {}, (past,)), "cpu")


def multi_piece_ckpt(tmp_path) -> tuple[CheckpointMeta, torch.Tensor]:
    """coordloader's sharded format: an 8x6 F32 ``w`` stored as two column pieces in two
    files (keys ``w@0:8,0:3`` and ``w@0:8,3:6``). -> (meta, the full tensor)."""
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    save_file({"w@0:8,0:3": full[:, :3].contiguous()}, str(tmp_path / "p0.safetensors"))
    save_file({"w@0:8,3:6": full[:, 3:].contiguous()}, str(tmp_path / "p1.safetensors"))
    meta = meta_of(str(tmp_path), ["p0.safetensors", "p1.safetensors"], sharded={
        "w": ("F32", (8, 6), [("p0.safetensors", "w@0:8,0:3", [(0, 8), (0, 3)]),
                              ("p1.safetensors", "w@0:8,3:6", [(0, 8), (3, 6)])])})
    return meta, full


def test_multi_piece_sources(tmp_path):
    """coordloader's sharded format: a tensor stored as pieces in two files."""
    meta, full = multi_piece_ckpt(tmp_path)
    for k in range(2):  # target: dim-0 split over 2 ranks (crosses both source pieces)
        pieces = [(split_box((8, 6), 0, k, 2), (0, 0))]
        rp = RankPlan(k, {}, (slice_of(meta, "w", pieces),))
        want = reference(full, pieces, (4, 6))
        for engine in ("cpu", "safetensors"):
            got, stats = select_engine(engine).load_rank(meta, rp, "cpu")
            assert same_bytes(got["w"], want), engine
            assert stats.bytes_read == 4 * 6 * 4


DCP_FILES = ("shard-00001-model-00001-of-00001.safetensors",
             "shard-00002-model-00001-of-00001.safetensors")


def write_dcp_files(root, full: dict[str, torch.Tensor], rows: dict) -> None:
    """torch DCP's per-rank files of ``full``'s tensors: file ``r`` of DCP_FILES holds rows
    ``rows[name][r]`` of each, under the tensor's own name, its offsets in
    DCP_SHARDING_INFO."""
    for r, fname in enumerate(DCP_FILES):
        info = {k: {"saved_offsets": [rows[k][r][0], 0]} for k in full}
        save_file({k: full[k][slice(*rows[k][r])].contiguous() for k in full},
                  str(root / fname), metadata={"DCP_SHARDING_INFO": json.dumps(info)})


def dcp_ckpt(tmp_path) -> tuple[CheckpointMeta, dict[str, torch.Tensor]]:
    """torch DCP's HF output (``HuggingFaceStorageWriter(save_distributed=True)``): one file
    per rank, each rank's piece stored under the tensor's own name, so both files hold a
    key ``w`` (8x6 F32, rows 0-4 and 4-8) and a key ``v`` (3x2 I32, rows 0-2 and 2-3).
    -> (meta, the full tensors)."""
    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    v = torch.arange(100, 106, dtype=torch.int32).reshape(3, 2)
    rows = {"w": ((0, 4), (4, 8)), "v": ((0, 2), (2, 3))}
    full = {"w": w, "v": v}
    write_dcp_files(tmp_path, full, rows)
    meta = meta_of(str(tmp_path), list(DCP_FILES), sharded={
        k: (dt, tuple(full[k].shape), [(f, k, [rows[k][r], (0, full[k].shape[1])])
                                       for r, f in enumerate(DCP_FILES)])
        for k, dt in (("w", "F32"), ("v", "I32"))})
    return meta, full


def test_dcp_pieces_stored_under_the_tensors_name_in_every_file(tmp_path):
    """torch DCP stores each piece under the plain name: the safetensors engine asked for
    ``w@0:4,0:6`` (coordloader's sharded key, rebuilt from the box) and failed."""
    meta, full = dcp_ckpt(tmp_path)
    assert [(p.file, p.key) for p in meta.tensors["w"].pieces] == [(f, "w") for f in DCP_FILES]
    targets = [  # rows crossing the files' boundary, columns spanning both pieces, all
        ("w", [(((2, 6), (0, 6)), (0, 0))]), ("w", [(split_box((8, 6), 1, 1, 2), (0, 0))]),
        ("w", [(((0, 8), (0, 6)), (0, 0))]), ("v", [(((1, 3), (0, 2)), (0, 0))])]
    for name, pieces in targets:
        rp = RankPlan(0, {}, (slice_of(meta, name, pieces),))
        want = reference(full[name], pieces, box_shape_of(pieces))
        for engine in ("cpu", "safetensors"):
            got, stats = select_engine(engine).load_rank(meta, rp, "cpu")
            assert same_bytes(got[name], want), (engine, name, pieces)
            assert stats.bytes_read == want.numel() * want.element_size()


def box_shape_of(pieces) -> tuple[int, ...]:
    return tuple(b - a for a, b in pieces[0][0])


def test_select_engine_names():
    assert select_engine("auto", "cpu").name == "cpu"
    with pytest.raises(LoadError, match="unknown engine"):
        select_engine("fast")
    if not torch.cuda.is_available():
        assert select_engine("auto").name == "cpu"


def strided(runs):
    """The same runs as strided groups (consecutive runs with one length and constant file
    and destination strides folded), built here independently of the planner."""
    from coordloader.planning.runs import RunList
    groups = []
    for r in runs:
        if groups:
            f, o, ln, d, c, ss, ds = groups[-1]
            if f == r.file and ln == r.length and r.offset > o and r.dest > d:
                if c == 1:
                    groups[-1] = (f, o, ln, d, 2, r.offset - o, r.dest - d)
                    continue
                if r.offset == o + c * ss and r.dest == d + c * ds:
                    groups[-1] = (f, o, ln, d, c + 1, ss, ds)
                    continue
        groups.append((r.file, r.offset, r.length, r.dest, 1, 0, 0))
    return RunList(groups)


@pytest.mark.parametrize("page", [0, 4096])       # 0: one read per row; 4096: span + copy
@pytest.mark.parametrize("short", [False, True])
def test_cpu_engine_strided_groups(ckpt, monkeypatch, page, short):
    """Plans whose byte runs are strided groups (the planner's RunList): rows read one by
    one or as spans through a bounce buffer, contiguous runs fused into one multi-iovec
    read; with tiny chunks, several threads and short reads."""
    from coordloader.engines import cpu
    meta, full = ckpt
    monkeypatch.setattr(cpu, "_PAGE", page)
    if short:
        real = os.preadv

        def short_read(fd, bufs, off):  # at most 5 bytes, into the first buffer only
            return real(fd, [memoryview(bufs[0])[:5]], off)

        monkeypatch.setattr(os, "preadv", short_read)
    # (chunk, span): big reads with big spans, everything tiny, and big reads with spans
    # cut into single rows (the bounce buffer is bounded by span_bytes, not chunk_bytes)
    for chunk, span in ((1 << 20, 1 << 20), (16, 16), (1 << 20, 16)):
        for rp in plans_for(meta):
            tensors = []
            for ts in rp.tensors:
                runs = strided(ts.byte_runs)
                assert list(runs) == list(ts.byte_runs)
                tensors.append(dataclasses.replace(ts, byte_runs=runs))
            assert any(g[4] > 1 for t in tensors for g in t.byte_runs.groups)
            rp2 = RankPlan(rp.rank, rp.coords, tuple(tensors))
            seen = []
            eng = select_engine("cpu", "cpu", threads=3, chunk_bytes=chunk, span_bytes=span)
            assert (eng.chunk_bytes, eng.span_bytes) == (chunk, span)
            got, stats = eng.load_rank(meta, rp2, "cpu", progress=seen.append)
            for ts in rp2.tensors:
                want = reference(full[ts.name], [(p.src, p.dst) for p in ts.pieces], ts.local_shape)
                assert same_bytes(got[ts.name], want), (page, chunk, span, rp.rank, ts.name)
            assert sum(seen) == stats.bytes_read == rp.bytes_to_read
            if page and span > 16:   # (16-byte spans are single rows)
                assert stats.extra["gap_bytes"] > 0


def test_cpu_engine_bounce_buffer_stays_within_span_bytes(ckpt, monkeypatch):
    """Rows longer than span_bytes went through the bounce buffer, grown to a whole row per
    thread (a 1 GiB row: 2 GiB of memory for 1 GiB held) and copied twice."""
    import numpy as np
    meta, full = ckpt
    span = 16
    sizes, real_empty = [], np.empty

    def empty(shape, *a, **kw):
        sizes.append(int(np.prod(shape)))
        return real_empty(shape, *a, **kw)

    monkeypatch.setattr(np, "empty", empty)
    eng = select_engine("cpu", "cpu", threads=2, chunk_bytes=1 << 20, span_bytes=span)
    rows = 0
    for rp in plans_for(meta):
        tensors = [dataclasses.replace(ts, byte_runs=strided(ts.byte_runs)) for ts in rp.tensors]
        rows += sum(1 for t in tensors for g in t.byte_runs.groups if g[4] > 1 and g[2] > span)
        got, _ = eng.load_rank(meta, RankPlan(rp.rank, rp.coords, tuple(tensors)), "cpu")
        for ts in tensors:
            want = reference(full[ts.name], [(p.src, p.dst) for p in ts.pieces], ts.local_shape)
            assert same_bytes(got[ts.name], want), (rp.rank, ts.name)
    assert rows, "no strided rows longer than span_bytes: the case is not reached"
    assert max(sizes, default=0) <= span, sizes

def test_cpu_engine_fuses_adjacent_runs_into_one_read(ckpt, monkeypatch):
    """Whole tensors stored back to back are read with one preadv of several iovecs."""
    meta, full = ckpt
    names = ["o.weight", "experts.w", "fp8.weight", "mask"]   # all of b.safetensors, in order
    sl = [slice_of(meta, n, [(full_box(meta.tensors[n].shape), (0,) * len(meta.tensors[n].shape))])
          for n in names]
    calls = []
    real = os.preadv

    def counting(fd, bufs, off):
        calls.append(len(bufs))
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", counting)
    got, stats = select_engine("cpu", "cpu", threads=1).load_rank(meta, RankPlan(0, {}, tuple(sl)),
                                                                   "cpu")
    assert calls == [len(names)]
    for n in names:
        assert same_bytes(got[n], full[n]), n


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_non_cpu_device_fills_out_or_copies_and_checks_shapes(ckpt, engine, monkeypatch):
    """Engines that read into host memory move the result to the device afterwards: into
    ``out[name]`` when given (shape/dtype checked, a LoadError naming the tensor), else a
    copy. The ``meta`` device stands in for CUDA."""
    meta, _ = ckpt
    rp = plans_for(meta)[0]
    host, _ = select_engine(engine).load_rank(meta, rp, "cpu")
    name = next(iter(host))
    dst = torch.empty(host[name].shape, dtype=host[name].dtype, device="meta")
    got, _ = select_engine(engine).load_rank(meta, rp, "meta", out={name: dst})
    assert got[name] is dst and all(t.device.type == "meta" for t in got.values())
    bad = {name: torch.empty((1,), dtype=dst.dtype, device="meta")}
    with pytest.raises(LoadError, match=f"rank 0, tensor '{name}': destination has shape \\[1\\]"):
        select_engine(engine).load_rank(meta, rp, "meta", out=bad)
    # and before any slice is set up or read (host_out runs first)
    import importlib
    mod = importlib.import_module({"cpu": "coordloader.engines.cpu",
                                   "safetensors": "coordloader.engines.safetensors_engine"}[engine])

    def no_reads(*a, **k):
        raise AssertionError("the engine started on the slices before checking out=")
    monkeypatch.setattr(mod, "allocate", no_reads)
    with pytest.raises(LoadError, match="destination has shape"):
        select_engine(engine).load_rank(meta, rp, "meta", out=bad)


def test_prefault_maps_whole_pages_inside_the_range():
    """memory.prefault maps the pages of a fresh tensor in one call: writing them
    afterwards takes (almost) no page faults. Pages only partly inside are left alone."""
    import resource

    from coordloader.engines import memory
    assert not memory.prefault(4096 + 1, 4096)          # no whole page inside: nothing
    t = torch.empty(64 << 20, dtype=torch.uint8)        # address space only, not faulted
    if not memory.prefault_tensor(t):
        pytest.skip("no MADV_POPULATE_WRITE on this system")
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t[::4096].fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    assert faults < (64 << 20) // 4096 // 8, faults     # ~16k pages without prefault


def test_prefault_leaves_memory_already_mapped_alone(monkeypatch):
    """Memory written before (an allocator's reused pages) is not populated again: that
    walk cost a long-lived process on every load. A fresh range still is. (Anonymous
    mappings of their own, so neither range depends on what the allocator hands out.)"""
    import ctypes
    import mmap

    from coordloader.engines import memory
    if memory._MADVISE is None:
        pytest.skip("no madvise on this system")
    calls = []
    real = memory._MADVISE
    monkeypatch.setattr(memory, "_MADVISE",
                        lambda a, n, adv: calls.append((a, n)) or real(a, n, adv))
    n = 4 << 20
    used, fresh = mmap.mmap(-1, n), mmap.mmap(-1, n)
    used.write(b"\1" * n)                                # every page mapped
    addr = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in (used, fresh)]
    assert not memory.prefault(addr[0], n) and calls == []
    if not memory.prefault(addr[1], n):
        pytest.skip("no MADV_POPULATE_WRITE on this system")
    assert calls == [(addr[1], n)]


def test_cpu_engine_prefaults_fresh_destinations_only(ckpt, monkeypatch):
    """The reader threads prefault the destination ranges of the tensors the engine
    allocated (every byte a run writes lies in a prefaulted range), never a destination
    handed in through ``out``."""
    from coordloader.engines import cpu
    meta, full = ckpt
    calls = []
    monkeypatch.setattr(cpu, "prefault", lambda a, n: calls.append((a, n)))
    monkeypatch.setattr(cpu, "_PAGE", 4096)
    for rp in plans_for(meta):
        tensors = tuple(dataclasses.replace(ts, byte_runs=strided(ts.byte_runs))
                        for ts in rp.tensors)
        rp2 = RankPlan(rp.rank, rp.coords, tensors)
        calls.clear()
        got, _ = select_engine("cpu", "cpu", threads=2, chunk_bytes=64).load_rank(meta, rp2, "cpu")
        for ts in rp2.tensors:
            base = got[ts.name].data_ptr()
            covered = bytearray(got[ts.name].numel() * got[ts.name].element_size())
            for lo, n in calls:   # the ranges that fall in this tensor
                for i in range(max(lo - base, 0), min(lo + n - base, len(covered))):
                    covered[i] = 1
            for r in ts.byte_runs:
                assert all(covered[r.dest:r.dest + r.length]), ts.name
            want = reference(full[ts.name], [(p.src, p.dst) for p in ts.pieces], ts.local_shape)
            assert same_bytes(got[ts.name], want)
        calls.clear()
        select_engine("cpu", "cpu").load_rank(meta, rp2, "cpu", out=got)
        assert calls == []


def test_prefault_gives_up_once_the_kernel_lacks_it(monkeypatch):
    """EINVAL (a kernel older than MADV_POPULATE_WRITE) turns prefault off for the
    process; another failure (ENOMEM) is left to the reads and tried again next time."""
    import ctypes
    import errno

    from coordloader.engines import memory
    calls = []

    def fake(err):
        def madvise(addr, n, advice):
            calls.append(advice)
            ctypes.set_errno(err)
            return -1
        return madvise
    monkeypatch.setattr(memory, "_unsupported", False)
    monkeypatch.setattr(memory, "_MADVISE", fake(errno.ENOMEM))
    assert not memory.prefault(0, 3 * 4096) and not memory.prefault(0, 3 * 4096)
    assert calls == [memory.MADV_POPULATE_WRITE] * 2 and not memory._unsupported
    monkeypatch.setattr(memory, "_MADVISE", fake(errno.EINVAL))
    assert not memory.prefault(0, 3 * 4096) and not memory.prefault(0, 3 * 4096)
    assert len(calls) == 3 and memory._unsupported


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_a_slice_too_big_for_memory_is_named_with_its_size(tmp_path, engine):
    """A layout too small for the model: the allocation of a rank's slice failed with
    torch's bare "DefaultCPUAllocator: can't allocate memory", naming neither the tensor
    nor what to do. A 256 TiB tensor in a sparse file on tmpfs (ext4 holds no file this
    large): past the 128 TiB of a process's address space, so no overcommit policy lets
    its allocation through."""
    import coordloader as cl
    from coordloader.errors import LoadError

    from helpers import shm_dir, write_sparse_st
    n = 2 ** 48
    with shm_dir() as root:
        write_sparse_st(os.path.join(root, "model.safetensors"),
                        {"w": {"dtype": "I8", "shape": [n], "data_offsets": [0, n]}})
        with pytest.raises(LoadError) as ei:
            cl.load(root, cl.Layout(), rank=0, engine=engine,
                    rules=[{"pattern": "w", "strategy": "replicate"}])
    msg = str(ei.value)
    assert msg.startswith(f"rank 0, tensor 'w': cannot allocate this rank's slice, I8 [{n}] "
                          f"({n} bytes) on cpu: RuntimeError: ") and msg.endswith(
        "split the model over more ranks (a larger tp, ep or pp), or load into tensors of "
        "your own (out=)"), msg


def test_byte_view_is_the_tensors_memory_and_keeps_it_alive():
    """The engine's byte view is built from the tensor's address: it must cover exactly
    the tensor's bytes (a one-element view of stride 2 included) and keep the tensor
    alive as long as a read may land in it."""
    import gc

    from coordloader.engines.cpu import _byte_view
    src = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    t = src.clone()
    arr, mv = _byte_view(t)
    del t
    gc.collect()
    torch.empty(1 << 20, dtype=torch.uint8).fill_(0xAB)   # reuse freed memory, if any
    assert bytes(mv) == src.view(torch.uint8).numpy().tobytes()
    pair = torch.tensor([1.5, -2.0], dtype=torch.float16)
    one = pair[1::2]                                        # one element, stride 2
    _, mv1 = _byte_view(one)
    mv1[:] = torch.tensor([7.0], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    assert pair.tolist() == [1.5, 7.0]
    _, empty = _byte_view(torch.empty(0, 4))
    assert empty.nbytes == 0


def test_byte_views_of_many_sizes_make_no_type_per_size():
    """A ctypes byte view (``c_ubyte * n``) made a new type per tensor size: 40-70 us each,
    more than the torch and numpy views it replaced saved, on a rank whose tensors come in
    many sizes, and each kept (a reference cycle, promoted by the engine's GC pause) until
    a full collection."""
    import gc

    from coordloader.engines.cpu import _byte_view
    types = lambda: sum(1 for o in gc.get_objects() if issubclass(type(o), type))  # noqa: E731
    ts = [torch.zeros(977_000 + i, dtype=torch.uint8) for i in range(40)]
    gc.collect()
    before = types()
    views = [_byte_view(t) for t in ts]
    assert types() == before
    for t, (a, mv) in zip(ts, views):
        mv[-1] = 7
        assert t[-1].item() == 7 and mv.nbytes == t.nbytes
    del views


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_mx_scales_and_complex_tensors_load_slice_exact(tmp_path, engine):
    """F8_E8M0 (MX block scales) and C64 are safetensors dtypes the library reads; the
    reader refused both as an "unknown dtype" (and the docs called the file invalid)."""
    from safetensors import safe_open

    import coordloader as cl
    g = torch.Generator().manual_seed(5)
    full = {"scales": torch.randint(0, 255, (6, 10), generator=g, dtype=torch.uint8)
            .view(torch.float8_e8m0fnu),
            "rot": torch.randn(8, 3, generator=g, dtype=torch.complex64)}
    save_file(full, str(tmp_path / "model.safetensors"))
    rules = [{"pattern": "scales", "strategy": "rowwise"},
             {"pattern": "rot", "strategy": "colwise"}]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for rank in range(2):
            plan = cl.make_plan(str(tmp_path), cl.Layout(tp=2), rules)
            got = cl.load(str(tmp_path), cl.Layout(tp=2), rank=rank, rules=rules,
                          engine=engine, verify="digest")
            for ts in plan.rank(rank).tensors:
                t = got[ts.name]
                assert t.dtype == full[ts.name].dtype and tuple(t.shape) == ts.local_shape
                for p in ts.pieces:
                    src = f.get_slice(ts.name)[tuple(slice(a, b) for a, b in p.src)]
                    dst = t[tuple(slice(d, d + b - a) for d, (a, b) in zip(p.dst, p.src))]
                    assert dst.view(torch.uint8).equal(src.view(torch.uint8)), (ts.name, rank)
            assert {ts.name: ts.local_shape for ts in plan.rank(rank).tensors} == {
                "scales": (6, 5), "rot": (4, 3)}
