"""Hostile checkpoints through the whole loader (issue 7).

The reader's own tests (tests/test_checkpoint*.py) check each hostile input against
``read_checkpoint``. These check that the loader adds no bypass: ``coordloader.load`` on
a crafted checkpoint raises CheckpointError, quickly (hard alarm: a FIFO must not block),
with bounded memory (tracemalloc peak), and that files swapped after the metadata was
read (planning done, then the shard becomes a FIFO, a device, or shorter) are refused by
the engine instead of blocking or reading garbage."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

import coordloader as cl
from coordloader.errors import CheckpointError
from coordloader.layout import Layout
from coordloader.synth import synthesize

from stfiles import hard_timeout, write_raw

REPO = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
MEM_LIMIT = 32 << 20        # tracemalloc peak allowed while refusing a hostile input


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return {"one": synthesize(str(d / "one"), "llama", "tiny", shards=1),
            "two": synthesize(str(d / "two"), "llama", "tiny", shards=2)}


def _hdr(obj) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode()


def _single(tmp, base, header, length=None, data=b""):
    d = tmp / "ck"
    shutil.copytree(base["one"], d)
    write_raw(d / "model.safetensors", _hdr(header), data, length=length, pad=False)
    return d


def _index_name(tmp, base, fname):
    d = tmp / "ck"
    shutil.copytree(base["two"], d)
    idx = json.loads((d / INDEX).read_text())
    idx["weight_map"]["lm_head.weight"] = fname
    (d / INDEX).write_text(json.dumps(idx))
    return d


def _swap(tmp, base, how):
    d = tmp / "ck"
    shutil.copytree(base["one"], d)
    f = d / "model.safetensors"
    f.unlink()
    if how == "fifo":
        os.mkfifo(f)
    elif how == "dir":
        (d / "elsewhere").mkdir()
        os.symlink(d / "elsewhere", f)
    elif how == "dev":
        os.symlink("/dev/zero", f)
    return d


def _grown(tmp, base, name, size):
    """``name`` of the two-shard checkpoint grown (sparse) to ``size`` bytes."""
    d = tmp / "ck"
    shutil.copytree(base["two"], d)
    os.truncate(d / name, size)
    return d


W = {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}
CASES = {
    "header length 2**64-1": (lambda t, b: _single(t, b, b"{}", length=2**64 - 1),
                               "header length 18446744073709551615"),
    "header length 2**63": (lambda t, b: _single(t, b, b"{}", length=2**63),
                             "header length 9223372036854775808"),
    "huge shape": (lambda t, b: _single(t, b, {"w": dict(W, shape=[10**18] * 3)}, data=b"\0" * 8),
                   "2**63"),
    "negative offset": (lambda t, b: _single(t, b, {"w": dict(W, data_offsets=[-8, 0])}),
                        "tensor 'w': data_offsets [-8, 0]"),
    "offset past 2**64": (lambda t, b: _single(t, b, {"w": dict(W, data_offsets=[0, 2**64 + 8])}),
                          "tensor 'w': data_offsets [0, 18446744073709551624]"),
    "NaN in header": (lambda t, b: _single(t, b, b'{"w": {"dtype": "BF16", "shape": [NaN], '
                                                 b'"data_offsets": [0, 8]}}'), "NaN"),
    "huge JSON number": (lambda t, b: _single(t, b, b'{"w": {"dtype": "BF16", "shape": [1' +
                                                    b"0" * 5000 + b'], "data_offsets": [0, 8]}}'),
                         "5001 digits"),
    "deeply nested JSON": (lambda t, b: _single(t, b, b'{"w":' * 100_000), "nested too deeply"),
    # 2 MB of empty arrays took 40 MB parsed (a 95 MB header 2.4 GB)
    "JSON of empty arrays": (lambda t, b: _single(t, b, b'{"w":[' + b"[]," * 700_000 + b"[]]}"),
                             "header holds 700003 JSON arrays and objects in 2100010 bytes; "
                             "expected at most one per 12 bytes"),
    "index over 64 MiB": (lambda t, b: _grown(t, b, INDEX, (64 << 20) + 1),
                          f"index is {(64 << 20) + 1} bytes; expected at most {64 << 20}"),
    "config.json over 16 MiB": (lambda t, b: _grown(t, b, "config.json", (16 << 20) + 1),
                                f"config.json is {(16 << 20) + 1} bytes; expected at most "
                                f"{16 << 20}"),
    "duplicate keys": (lambda t, b: _single(t, b, b'{"w": {"dtype": "BF16", "shape": [4], '
                                                  b'"data_offsets": [0, 8]}, "w": {"dtype": "BF16", '
                                                  b'"shape": [4], "data_offsets": [0, 8]}}',
                                            data=b"\0" * 8), "duplicate"),
    "weight_map ../": (lambda t, b: _index_name(t, b, "../two/model-00001-of-00002.safetensors"),
                       "path separator"),
    "weight_map ..": (lambda t, b: _index_name(t, b, ".."), "'..'"),
    "weight_map sub/": (lambda t, b: _index_name(t, b, "sub/x.safetensors"), "path separator"),
    "weight_map NUL": (lambda t, b: _index_name(t, b, "x\x00.safetensors"), "NUL"),
    "weight_map absolute": (lambda t, b: _index_name(t, b, "/etc/passwd"), "path separator"),
    "symlink to a directory": (lambda t, b: _swap(t, b, "dir"), "is a directory"),
    "symlink to /dev/zero": (lambda t, b: _swap(t, b, "dev"), "character device"),
    "shard is a FIFO": (lambda t, b: _swap(t, b, "fifo"), "a FIFO"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loader_refuses_hostile_checkpoint(tmp_path, base, case):
    make, frag = CASES[case]
    ck = make(tmp_path, base)
    tracemalloc.start()
    try:
        with hard_timeout(20), pytest.raises(CheckpointError) as ei:
            cl.load(str(ck), Layout(tp=2), rank=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    msg = str(ei.value)
    print(f"{case}: {msg}")
    assert frag in msg, msg
    assert peak < MEM_LIMIT, f"{case}: {peak / 2**20:.1f} MiB traced while refusing"


_SWAP_AFTER_PLAN = r'''
import os, sys, json
import coordloader as cl
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.errors import CoordloaderError
ck, how = sys.argv[1], sys.argv[2]
meta = read_checkpoint(ck)                   # headers read, plan possible: then the swap
f = os.path.join(ck, meta.files[0].name)
os.unlink(f)
if how == "fifo":
    os.mkfifo(f)
elif how == "dev":
    os.symlink("/dev/zero", f)
elif how == "dir":
    os.mkdir(f)
import signal
class Blocked(BaseException):   # not an OSError: the engine must not turn it into a LoadError
    pass
def fire(*_):
    raise Blocked
signal.signal(signal.SIGALRM, fire)
signal.alarm(5)                              # the load itself must not block (imports done)
try:
    cl.load(meta, cl.Layout(tp=2), rank=0, engine="cpu")
    print("LOADED")
except CoordloaderError as e:
    print(type(e).__name__ + ": " + str(e))
except Blocked:
    print("BLOCKED for 5 s")
'''


@pytest.mark.parametrize("how", [
    "dev", "dir",
    "fifo",
])
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_engine_refuses_shard_swapped_after_planning(tmp_path, base, how):
    ck = tmp_path / "ck"
    shutil.copytree(base["one"], ck)
    try:
        p = subprocess.run([sys.executable, "-c", _SWAP_AFTER_PLAN, str(ck), how],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep +
                                    os.environ.get("PYTHONPATH", "")))
    except subprocess.TimeoutExpired:
        pytest.fail(f"load blocked on a shard swapped for a {how} after planning")
    out = p.stdout.strip()
    print(out)
    assert p.returncode == 0, p.stderr
    assert out.startswith("LoadError: ") and "model.safetensors" in out, out + p.stderr


def test_load_into_refuses_two_tensors_for_one_target(base):
    """A name_map sending two checkpoint tensors to one target filled it twice, the
    second silently overwriting the first."""
    import torch

    from coordloader.errors import LoadError
    meta = cl.read_checkpoint(base["one"])
    a, b = sorted(n for n, t in meta.tensors.items() if len(t.shape) == 1)[:2]
    assert meta.tensors[a].shape == meta.tensors[b].shape
    x = {"x": torch.zeros_like(cl.load(meta, Layout(), rank=0)[a])}
    with pytest.raises(LoadError) as e:
        cl.load_into(x, meta, Layout(), name_map=lambda n: "x" if n in (a, b) else None,
                     rank=0)
    assert str(e.value) == (f"rank 0, tensor {b!r}: checkpoint tensors {a!r} and {b!r} both "
                            f"map to the target 'x'; expected one checkpoint tensor per target "
                            f"(check name_map)")


def _two_tensor_file(path, first: float):
    import torch
    from safetensors.torch import save_file
    save_file({"a": torch.arange(4.0) + first, "b": torch.arange(4.0) + first + 100}, str(path))


_PP_RULES = [{"pattern": "model.layers.*.w", "strategy": "replicate"}]
_PP_CONFIG = {"architectures": ["X"], "model_type": "x", "num_hidden_layers": 2}


def _publish_layers(d: str, step: float, files=("a", "b"), note=None) -> None:
    """Layer 1 in a.safetensors, layer 0 in b.safetensors, each renamed into place
    (``note``: a __metadata__ entry, which changes the header)."""
    import torch
    from safetensors.torch import save_file
    for f, layer in (("a", 1), ("b", 0)):
        if f in files:
            save_file({f"model.layers.{layer}.w": torch.full((4, 4), step)}, f"{d}/{f}.tmp",
                      metadata=None if note is None else {"note": note})
            os.replace(f"{d}/{f}.tmp", f"{d}/{f}.safetensors")


def _replaced_worker(rank: int, port: int, d: str, case: str, out: str, meta=None) -> None:
    import torch.distributed as dist

    from coordloader import loader
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if case == "stale" and rank == 0:
        cl.make_plan(d, Layout(pp=2), _PP_RULES, config=_PP_CONFIG)   # reads every header
    dist.barrier()
    if case == "stale" and rank == 1:
        _publish_layers(d, 1.0)   # the next step, same headers
    dist.barrier()
    if case in ("replaced", "pickled"):
        # rank 0 holds layer 0, in b, whose header rank 1 parses (files[rank::world]); b is
        # replaced (same header, new data) after the plan is agreed, before rank 0 reads it
        loader.PHASE_HOOKS.append(
            lambda phase: _publish_layers(d, 7.0, "b") if phase == "load" and rank == 0 else None)
    src = d if meta is None else meta
    if case in ("meta", "other-header"):
        # metadata read by each rank, then the files replaced before the load: the load's
        # fingerprint of the new files must not stand for the old read
        src = cl.read_checkpoint(d)
        dist.barrier()
        if rank == 1:
            _publish_layers(d, 7.0, note="step 7" if case == "other-header" else None)
        dist.barrier()
    try:
        t = cl.load(src, Layout(pp=2), rules=_PP_RULES, config=_PP_CONFIG, verify="shapes",
                    timeout=60)
        got = "ok " + " ".join(f"{k}={v.flatten()[0].item()}" for k, v in sorted(t.items()))
    except Exception as e:   # noqa: BLE001 - the test compares the message
        got = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}").write_text(got)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["replaced", "stale", "meta", "pickled", "other-header"])
def test_file_changes_seen_by_every_rank_whoever_parsed_its_header(tmp_path, case):
    """'replaced': a file replaced after the plan was agreed loaded its new bytes on a rank
    that had not parsed its header itself, while the other held the old step's tensors.
    'stale': a rank that once read the headers of an older step refused the next step's
    files, which it had not parsed again, on every try. 'meta': metadata read before the
    files were replaced, handed to the load: refused (a first fix let the load's own
    fingerprint of the new files replace the record of the old read). 'pickled': metadata
    read in the parent, handed to spawned ranks that hold no record of it, a file replaced
    during the load: refused (a second fix recorded nothing then). 'other-header': the
    files republished with another header before the load of the metadata handed in:
    refused at metadata-read (a third fix recorded the new files, and the old header put
    back with other data during the load loaded that data)."""
    from coordloader.dist.collective import free_port

    from ranks import spawn_and_wait
    d = tmp_path / "ckpt"
    d.mkdir()
    _publish_layers(str(d), 0.0)
    meta = cl.read_checkpoint(str(d)) if case == "pickled" else None
    spawn_and_wait(_replaced_worker, (free_port(), str(d), case, str(tmp_path), meta), 2,
                   "2-rank load of a replaced file", hard_s=120)
    got = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    if case == "stale":
        assert got == ["ok model.layers.0.w=1.0", "ok model.layers.1.w=1.0"]
    elif case == "other-header":
        assert all(g.startswith("CollectiveError: phase metadata-read: ") and
                   "CheckpointError: file a.safetensors: file's size is not what it was when "
                   "the metadata handed in was read: it changed since; read the checkpoint "
                   "again" in g for g in got), got
    elif case == "meta":
        assert all(g.startswith("CollectiveError: phase load: rank") and
                   ("file a.safetensors: file changed after its header was read" in g or
                    "file b.safetensors: file changed after its header was read" in g)
                   for g in got), got
    else:   # replaced, pickled
        want = ("CollectiveError: phase load: rank 0: LoadError: file b.safetensors: file "
                "changed after its header was read")
        assert got[0].startswith(want) and got[1].startswith(want), got


def test_safetensors_engine_errors_name_the_file_not_its_descriptor(tmp_path, monkeypatch):
    """safe_open is given the checked descriptor's /proc/self/fd/N; its own error named
    that path (`unable to open file </proc/self/fd/126> ...`), meaningless to the user.
    Here safe_open's open fails for real (the engine's check takes the last descriptor
    RLIMIT_NOFILE allows, the engine kept from raising it): the message names the file
    instead."""
    from coordloader.engines import safetensors_engine as se
    from coordloader.errors import LoadError

    from helpers import few_descriptors
    _two_tensor_file(tmp_path / "model.safetensors", 0.0)
    meta = cl.read_checkpoint(str(tmp_path))
    monkeypatch.setattr(se, "descriptor_room", lambda files, rank: lambda: None)
    with few_descriptors(1), pytest.raises(LoadError) as e:   # one descriptor left
        cl.load_detailed(meta, Layout(), rank=0, engine="safetensors", verify="none",
                         replicate_unmatched=True)
    msg = str(e.value)
    head = "rank 0, file model.safetensors: safetensors cannot open it: "
    assert msg.startswith(head), msg
    # its words vary with the safetensors version ("unable to open file <P> in read-only
    # mode: Too many open files (24)", 0.8.0's "No such file or directory: P")
    assert "model.safetensors" in msg[len(head):] and "/proc/self/fd" not in msg, msg


@pytest.mark.parametrize("proc", [True, False], ids=["fd-path", "no-proc"])
def test_safetensors_engine_reads_the_file_it_checked(tmp_path, monkeypatch, proc):
    """The safetensors engine checked a file on one open and let safe_open open its path
    again: a same-header file renamed over the path in between (the next save, published
    by atomic rename) loaded its new bytes unnoticed. safe_open now opens the checked
    descriptor's /proc path, so the checked file is read; without /proc the path is
    compared with the descriptor after safe_open and the swap refused."""
    import safetensors
    import torch

    from coordloader.engines import safetensors_engine as se
    from coordloader.errors import LoadError
    f = tmp_path / "model.safetensors"
    _two_tensor_file(f, 0.0)
    meta = cl.read_checkpoint(str(tmp_path))
    real, opened = safetensors.safe_open, []

    def swap_then_open(path, *a, **k):   # runs between the engine's check and its open
        if not opened:
            _two_tensor_file(tmp_path / "new.safetensors", 7.0)
            os.replace(tmp_path / "new.safetensors", f)
        opened.append(str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(safetensors, "safe_open", swap_then_open)
    if not proc:
        monkeypatch.setattr(se, "fd_path", lambda fd: None)
    if proc:
        got = cl.load_detailed(meta, Layout(), rank=0, engine="safetensors",
                               replicate_unmatched=True).tensors
        assert torch.equal(got["a"], torch.arange(4.0))          # the checked file's bytes
        assert torch.equal(got["b"], torch.arange(4.0) + 100)
        assert opened[0].startswith("/proc/self/fd/")
    else:
        with pytest.raises(LoadError) as e:
            cl.load_detailed(meta, Layout(), rank=0, engine="safetensors",
                             replicate_unmatched=True)
        assert opened == [str(f)]
        assert str(e.value) == ("rank 0, file model.safetensors: file was replaced at its path "
                                "between its check and its read (another inode there now): "
                                "read the checkpoint again")
    monkeypatch.undo()
    # the swap did happen: read again, the file loads as it now is
    assert torch.equal(cl.load_detailed(str(tmp_path), Layout(), rank=0, engine="safetensors",
                                        replicate_unmatched=True).tensors["a"],
                       torch.arange(4.0) + 7)


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
@pytest.mark.parametrize("how", ["header", "replaced", "in-place", "in-place-mtime-kept"])
def test_engine_refuses_file_rewritten_at_same_size_after_header_read(tmp_path, how, engine):
    """A file rewritten at the same size after its header was read loaded its new bytes
    under the old plan: with the tensors' regions swapped, 'a' came back as 'b' (the
    safetensors engine, which reads each header anew, loaded the new file unnoticed)."""
    import struct

    import torch

    from coordloader.errors import LoadError
    f = tmp_path / "model.safetensors"
    _two_tensor_file(f, 0.0)
    meta = cl.read_checkpoint(str(tmp_path))
    if how == "header":     # same size and data, the two tensors' offsets swapped
        hdr = json.loads(f.read_bytes()[8:8 + meta.files[0].header_len])
        hdr["a"]["data_offsets"], hdr["b"]["data_offsets"] = (hdr["b"]["data_offsets"],
                                                              hdr["a"]["data_offsets"])
        raw = json.dumps(hdr, separators=(",", ":")).encode()
        raw += b" " * (meta.files[0].header_len - len(raw))
        data = f.read_bytes()[8 + meta.files[0].header_len:]
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        want = "file's header differs from the one the plan was made from"
    elif how == "replaced":  # same header, other values, a new file renamed over it
        _two_tensor_file(tmp_path / "new.safetensors", 7.0)
        os.replace(tmp_path / "new.safetensors", f)
        want = "file changed after its header was read"
    else:                    # same header, other values written into the same inode
        st = os.stat(f)
        time.sleep(0.05)     # past the coarse clock's tick: the rewrite comes later in life
        with open(f, "r+b") as fh:
            fh.seek(8 + meta.files[0].header_len)
            fh.write((torch.arange(4.0) + 7).numpy().tobytes())
        # "in-place": a later mtime (coarse clocks); "-mtime-kept": the old one set back, as
        # rsync --inplace -t does (only the ctime tells)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + (0 if how.endswith("kept") else 10**9)))
        want = "file changed after its header was read"
    assert os.path.getsize(f) == meta.files[0].size
    with pytest.raises(LoadError) as e:
        cl.load_detailed(meta, Layout(), rank=0, engine=engine, replicate_unmatched=True)
    assert str(e.value).startswith(f"rank 0, file model.safetensors: {want}"), str(e.value)
    # read again, the file loads as it now is
    assert torch.equal(cl.load_detailed(str(tmp_path), Layout(), rank=0, engine="cpu",
                                        replicate_unmatched=True).tensors["a"],
                       {"header": torch.arange(4.0) + 100, "replaced": torch.arange(4.0) + 7,
                        "in-place": torch.arange(4.0) + 7,
                        "in-place-mtime-kept": torch.arange(4.0) + 7}[how])


def _rewrite_data_in_place(path, first: float) -> None:
    """``path`` (a ``_two_tensor_file``) given ``_two_tensor_file(first)``'s values in its
    own inode: same size and header, other data, as a writer updating the file in place."""
    import torch
    st = os.stat(path)
    time.sleep(0.05)     # past the coarse clock's tick: the rewrite comes later in life
    with open(path, "r+b") as fh:
        fh.seek(st.st_size - 32)   # a, then b: four float32 each
        fh.write(torch.cat([torch.arange(4.0) + first, torch.arange(4.0) + first + 100])
                 .numpy().tobytes())


@pytest.mark.parametrize("after", [1, 2], ids=["between-reads", "after-the-last"])
@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_file_rewritten_in_place_while_it_is_read_is_refused(tmp_path, engine, after):
    """A file rewritten in place (same size and header, other data) after the engine's
    check and between its reads loaded as a mix, 'a' from the old bytes and 'b' from the
    new, with no error: every check ran before the reads. Each file's identity is taken
    again once it is read (the safetensors engine: also before each piece), so a rewrite
    during the last read is refused too."""
    from coordloader.engines import select_engine
    from coordloader.errors import LoadError
    f = tmp_path / "model.safetensors"
    _two_tensor_file(f, 0.0)
    meta = cl.read_checkpoint(str(tmp_path))
    rp = cl.make_plan(meta, Layout(), replicate_unmatched=True).rank(0)
    # the cpu engine: one 16-byte task per tensor, read in order on one thread; the
    # safetensors engine: one 16-byte piece per tensor
    eng = select_engine(engine, "cpu", threads=1, chunk_bytes=16)
    calls = []

    def rewrite_after_a_read(n):
        calls.append(n)
        if len(calls) == after:
            _rewrite_data_in_place(f, 7.0)

    with pytest.raises(LoadError) as e:
        eng.load_rank(meta, rp, "cpu", progress=rewrite_after_a_read)
    # the cpu engine checks once its reads are done, the safetensors engine before each
    # piece too (refused at the next piece)
    assert calls == ([16] * after if engine == "safetensors" else [16, 16]), calls
    assert str(e.value).startswith("rank 0, file model.safetensors: file changed during the "
                                   "load: its mtime and ctime moved after it was checked "
                                   "before the reads"), str(e.value)


@pytest.mark.parametrize("how", ["renamed-over", "removed", "renamed-away",
                                 "linked-and-unlinked", "chmod"])
@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_file_unlinked_while_it_is_read_still_loads_its_bytes(tmp_path, engine, how):
    """A new file renamed over the path, the file removed or renamed away, a hard link
    made and removed (a backup snapshot), a chmod, between two reads, move only the read
    file's ctime: the bytes read through the checked descriptor are all the checked
    file's, and the load is not refused for it (the last three were)."""
    import torch

    from coordloader.engines import select_engine
    f = tmp_path / "model.safetensors"
    _two_tensor_file(f, 0.0)
    meta = cl.read_checkpoint(str(tmp_path))
    rp = cl.make_plan(meta, Layout(), replicate_unmatched=True).rank(0)
    calls = []

    def unlink_after_first_read(n):
        if not calls:
            time.sleep(0.05)     # past the coarse clock's tick: the ctime does move
            if how == "removed":
                os.unlink(f)
            elif how == "renamed-away":
                os.replace(f, tmp_path / "old.safetensors")
            elif how == "linked-and-unlinked":
                os.link(f, tmp_path / "snapshot")
                os.unlink(tmp_path / "snapshot")
            elif how == "chmod":
                os.chmod(f, 0o444)
            else:
                _two_tensor_file(tmp_path / "new.safetensors", 7.0)
                os.replace(tmp_path / "new.safetensors", f)
        calls.append(n)

    got, _ = select_engine(engine, "cpu", threads=1, chunk_bytes=16).load_rank(
        meta, rp, "cpu", progress=unlink_after_first_read)
    assert calls == [16, 16], calls
    assert torch.equal(got["a"], torch.arange(4.0))
    assert torch.equal(got["b"], torch.arange(4.0) + 100)


_TRUNCATE_DURING_LOAD = r'''
import os, sys
import torch
from safetensors.torch import save_file
import coordloader as cl
from coordloader.engines import select_engine
from coordloader.errors import CoordloaderError
d, engine = sys.argv[1], sys.argv[2]
f = os.path.join(d, "model.safetensors")
save_file({"a": torch.zeros(4096), "b": torch.ones(4096)}, f)   # 16 KiB each
meta = cl.read_checkpoint(d)
rp = cl.make_plan(meta, cl.Layout(), replicate_unmatched=True).rank(0)
done = []
def truncate_after_first_read(n):
    if not done:
        done.append(n)
        os.truncate(f, 4096)   # 'b' lies pages past the end now
try:
    select_engine(engine, "cpu", threads=1, chunk_bytes=16384).load_rank(
        meta, rp, "cpu", progress=truncate_after_first_read)
    print("LOADED")
except CoordloaderError as e:
    print(type(e).__name__ + ": " + str(e))
'''


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_shard_truncated_during_the_load_is_a_load_error_not_a_crash(tmp_path, engine):
    """A shard truncated between two reads of the safetensors engine killed the process
    with SIGBUS: safe_open maps the file, and the slice it gives is a view of the
    mapping, read past the file's end. Its checked descriptor is held and fstat-ed before
    each piece. (The cpu engine's preadv found the end of the file; it now says the file
    changed.)"""
    p = subprocess.run([sys.executable, "-c", _TRUNCATE_DURING_LOAD, str(tmp_path), engine],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep +
                                os.environ.get("PYTHONPATH", "")))
    assert p.returncode == 0, f"exit {p.returncode} (-7: SIGBUS): {p.stderr[-2000:]}"
    size = os.path.getsize(tmp_path / "model.safetensors")
    assert size == 4096
    out = p.stdout.strip()
    assert out.startswith("LoadError: rank 0, file model.safetensors: file changed during the "
                          "load: its size ("), out
    assert " -> 4096 bytes), mtime and ctime moved after it was checked before the reads" in out


def test_config_and_rule_files_of_empty_arrays_are_refused_before_parsing(tmp_path):
    """A config= or rule file went through plain json.loads: 2 MB of empty arrays took
    tens of MB parsed; a config file over 16 MiB was read whole. Both now meet the
    checks a checkpoint's own config.json meets."""
    from coordloader.api import read_config, read_rules
    from coordloader.errors import PlanError
    bomb = tmp_path / "bomb.json"
    bomb.write_bytes(b'{"x":[' + b"[]," * 700_000 + b"[]]}")
    for call in (lambda: read_config(str(bomb)),
                 lambda: read_rules(str(bomb))):
        with pytest.raises(PlanError) as e:
            call()
        assert "holds 700003 JSON arrays and objects in 2100010 bytes; expected at most one " \
               "per 12 bytes" in str(e.value), str(e.value)
    big = tmp_path / "big.json"
    big.write_bytes(b"{}")
    os.truncate(big, (16 << 20) + 1)
    with pytest.raises(PlanError) as e:
        read_config(str(big))
    assert f"config file is {(16 << 20) + 1} bytes; expected at most {16 << 20}" in str(e.value)
