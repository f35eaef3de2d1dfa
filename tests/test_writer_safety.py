"""Writer safety (issue 7) for every writer: save, --dump, manifest, synth.

Checked by recording the real os.fsync / os.replace calls of a write (the order is the
guarantee: a file is fsynced under its temporary name, renamed into place, the directory
fsynced; an index is renamed in only after everything it points at is durable), and by
injecting ENOSPC: the previous state stays byte-identical, no temporary is left, and the
error names the file and says what happened. Refusal to overwrite is checked for dump
here (save's own tests cover save)."""
from __future__ import annotations

import errno
import os

import pytest
import torch

import coordloader as cl
from coordloader.api import make_plan
from coordloader.checkpoint.formats import SHARD_SUFFIX, SHARDED_INDEX
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.errors import SaveError
from coordloader.handoff.dump import dump_path, dump_rank
from coordloader.layout import Layout
from coordloader.synth import synthesize

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthesize(str(tmp_path_factory.mktemp("w") / "ck"), "llama", "tiny", shards=2)


class Events(list):
    """(op, path...) of fsync / replace / rename calls, real paths."""

    def index_of(self, op, *paths, after=-1):
        for i, e in enumerate(self):
            if i > after and e[0] == op and all(p is None or p == q for p, q in zip(paths, e[1:])):
                return i
        raise AssertionError(f"no {op} {paths} after event {after} in:\n" +
                             "\n".join(map(str, self)))


@pytest.fixture
def events(monkeypatch):
    ev = Events()
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        try:
            p = os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            p = "?"
        real_fsync(fd)
        ev.append(("fsync", p))

    def move(real, op):
        def f(a, b, *k, **kw):
            real(a, b, *k, **kw)
            ev.append(("replace", os.path.realpath(a), os.path.realpath(b)))
        return f

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", move(real_replace, "replace"))
    monkeypatch.setattr(os, "rename", move(real_rename, "rename"))
    return ev


def assert_published_durably(ev: Events, final: str) -> int:
    """fsync(temp) -> replace(temp, ..., final) -> fsync(directory): the data was fsynced
    under some earlier name of the file (a chain of renames: temp -> staging -> final)
    before the first rename, and the final directory after the last. Returns the index
    of the rename into ``final``."""
    final = os.path.realpath(final)
    i = ev.index_of("replace", None, final)
    names, j = [final], i
    while True:                       # walk the renames back to the first name
        src = ev[j][1]
        names.append(src)
        prev = [k for k in range(j) if ev[k][0] == "replace" and ev[k][2] == src]
        if not prev:
            break
        j = prev[-1]
    assert any(e[0] == "fsync" and e[1] in names for e in ev[:j]), \
        (f"{final}: no fsync of its data before the first rename; names {names}", ev)
    ev.index_of("fsync", os.path.dirname(final), after=i)      # the rename itself is durable
    return i


def _rank_tensors(ck, layout):
    return {r: cl.load(ck, layout, rank=r) for r in range(layout.world_size)}


# ------------------------------------------------------------------------------ ordering

def test_dump_fsyncs_then_renames_then_fsyncs_dir(tmp_path, tiny, events):
    t = cl.load(tiny, Layout(tp=2), rank=1)
    path = dump_rank(str(tmp_path / "d"), 1, t, plan_digest="x")
    assert_published_durably(events, path)


def test_manifest_write_is_durable(tmp_path, tiny, events):
    import shutil
    ck = str(tmp_path / "ck")
    shutil.copytree(tiny, ck)
    path = cl.write_manifest(read_checkpoint(ck))
    assert_published_durably(events, path)


def test_save_publishes_the_index_last_after_every_shard_is_durable(tmp_path, tiny, events):
    layout = Layout(tp=2)
    plan = make_plan(tiny, layout)
    locs = _rank_tensors(tiny, layout)
    out = tmp_path / "saved"
    events.clear()
    for r in range(2):
        cl.save(out, locs[r], plan, rank=r, config=tiny)
    out = os.path.realpath(out)
    i_index = assert_published_durably(events, os.path.join(out, SHARDED_INDEX))
    shards = [n for n in os.listdir(out) if n.endswith(SHARD_SUFFIX)]
    assert len(shards) == 2
    for n in shards:
        assert assert_published_durably(events, os.path.join(out, n)) < i_index, n
    # a directory fsync between the last shard rename and the index rename
    last = max(events.index_of("replace", None, os.path.join(out, n)) for n in shards)
    assert events.index_of("fsync", out, after=last) < i_index
    # and the result is a checkpoint equal to the source
    back = cl.load(str(out), Layout(), rank=0)
    src = cl.load(tiny, Layout(), rank=0)
    assert back.keys() == src.keys() and all(torch.equal(back[k], src[k]) for k in src)


def test_synth_publishes_the_whole_directory_in_one_rename(tmp_path, events):
    """synth builds the checkpoint in a hidden sibling directory (shards, then the index,
    each temp + rename) and publishes it with one directory rename: OUT is absent or
    complete. It does NOT fsync the shard data (synthetic data, written at full speed on
    purpose); see docs/reliability.md."""
    out = os.path.realpath(synthesize(str(tmp_path / "s"), "llama", "tiny", shards=2))
    moves = [e for e in events if e[0] == "replace"]
    assert moves[-1][2] == out and os.path.basename(moves[-1][1]).startswith(".")
    stage = moves[-1][1]
    inside = [os.path.relpath(e[2], stage) for e in moves[:-1]]
    shards = [n for n in inside if n.endswith(".safetensors")]
    assert sorted(shards) == sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert max(inside.index(n) for n in shards) < inside.index(INDEX)
    assert not os.path.exists(stage)


# ------------------------------------------------------------------------- overwrite

def test_dump_refuses_to_overwrite_without_overwrite(tmp_path, tiny):
    d = str(tmp_path / "d")
    t0 = cl.load(tiny, Layout(tp=2), rank=0)
    path = dump_rank(d, 0, t0, plan_digest="first")
    before = open(path, "rb").read()
    with pytest.raises(SaveError, match=r"rank 0, file .*rank-00000\.safetensors: a dump file "
                                        r"already exists; pass --overwrite"):
        dump_rank(d, 0, t0, plan_digest="second")
    assert open(path, "rb").read() == before
    dump_rank(d, 0, t0, plan_digest="second", overwrite=True)
    assert open(path, "rb").read() != before
    # a directory squatting on the name is named as such, even with overwrite
    os.mkdir(dump_path(d, 1))
    with pytest.raises(SaveError, match="is a directory"):
        dump_rank(d, 1, t0, plan_digest="x", overwrite=True)
    # a dump directory under a regular file
    with pytest.raises(SaveError, match=r"cannot create dump directory: Not a directory"):
        dump_rank(os.path.join(path, "sub"), 0, t0, plan_digest="x")


def test_dump_of_one_rank_refuses_a_directory_holding_another_loads_ranks(tmp_path, tiny):
    """One process per rank (--rank) dumping into one DIR: rank 1 of a tp=4 load went in
    beside rank 0 of a tp=2 load without complaint, a dump of two loads. Another rank's
    file of another plan is refused now, unless overwrite; the same plan's is not."""
    d = str(tmp_path / "d")
    a = cl.make_plan(tiny, Layout(tp=2))
    b = cl.make_plan(tiny, Layout(tp=4))
    dump_rank(d, 0, cl.load(tiny, Layout(tp=2), rank=0), plan_digest=a.digest(), world=2)
    t1 = cl.load(tiny, Layout(tp=4), rank=1)
    with pytest.raises(SaveError) as ei:
        dump_rank(d, 1, t1, plan_digest=b.digest(), world=4)
    assert ei.value.message == (
        f"holds rank-00000.safetensors, a dump of another load (plan digest "
        f"{a.digest()[:12]}, this load's {b.digest()[:12]}); choose another --dump DIR, or "
        f"dump every rank of this load with --overwrite (overwrite=True), each rank "
        f"replacing its own file")
    assert not os.path.exists(dump_path(d, 1))
    # the same load's other rank goes in beside it
    dump_rank(d, 1, cl.load(tiny, Layout(tp=2), rank=1), plan_digest=a.digest(), world=2)
    dump_rank(str(tmp_path / "e"), 1, t1, plan_digest=b.digest(), world=4)
    dump_rank(d, 1, t1, plan_digest=b.digest(), world=4, overwrite=True)   # asked for


# --------------------------------------------------------------------------- ENOSPC

def _no_tmp(d):
    return [n for n in os.listdir(d) if ".tmp" in n]


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_dump_disk_full_keeps_previous_file(tmp_path, tiny, monkeypatch, where):
    d = str(tmp_path / "d")
    t = cl.load(tiny, Layout(tp=2), rank=0)
    path = dump_rank(d, 0, t, plan_digest="old")
    before = open(path, "rb").read()
    real = getattr(os, where)

    def full(fd, *a):
        if where == "write" or os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, *a)

    monkeypatch.setattr(os, where, full)
    with pytest.raises(SaveError, match=r"rank 0, file .*rank-00000\.safetensors: cannot write "
                                        r"dump: .*No space left on device"):
        dump_rank(d, 0, {k: v * 2 for k, v in t.items()}, plan_digest="new", overwrite=True)
    monkeypatch.setattr(os, where, real)
    assert open(path, "rb").read() == before
    assert _no_tmp(d) == []


def test_manifest_disk_full_keeps_previous_manifest(tmp_path, tiny, monkeypatch):
    import shutil
    ck = str(tmp_path / "ck")
    shutil.copytree(tiny, ck)
    meta = read_checkpoint(ck)
    path = cl.write_manifest(meta)
    before = open(path, "rb").read()
    real = os.fsync

    def full(fd):   # delayed allocation: ENOSPC surfaces at fsync
        if ".tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    os.unlink(path)
    with open(path, "wb") as f:   # an older manifest, different bytes
        f.write(before.replace(b'"version"', b'"version" '))
    older = open(path, "rb").read()
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SaveError, match=r"manifest.*No space left on device"):
        cl.write_manifest(meta)
    monkeypatch.setattr(os, "fsync", real)
    assert open(path, "rb").read() == older
    assert _no_tmp(ck) == []


def test_writer_takes_each_tensors_bytes_as_it_writes_it(tmp_path, monkeypatch):
    """write_safetensors (save, --dump, consolidate) converts one entry to bytes, writes
    it, then the next: a rank's GPU tensors reach host memory one at a time, not all before
    the file is opened. A bad last entry still publishes nothing."""
    from coordloader.checkpoint import fileio as sio
    events = []
    real_bytes, real_write = sio.as_bytes, sio._write_all
    monkeypatch.setattr(sio, "as_bytes", lambda d: events.append("bytes") or real_bytes(d))
    monkeypatch.setattr(sio, "_write_all", lambda fd, b: events.append("write") or real_write(fd, b))
    entries = [(f"t{i}", "F32", [4], torch.full((4,), float(i))) for i in range(3)]
    sio.write_safetensors(str(tmp_path / "a.safetensors"), entries)
    assert events == ["write"] + ["bytes", "write"] * 3      # header, then entry by entry
    bad = entries[:2] + [("t2", "F32", [4], torch.zeros(3))]
    with pytest.raises(SaveError, match="data has 12 bytes, expected 16") as ei:
        sio.write_safetensors(str(tmp_path / "b.safetensors"), bad)
    assert ei.value.tensor == "t2" and ei.value.file.endswith("b.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_dump_of_another_layout_is_refused_or_replaced_whole(tmp_path, tiny):
    """Files of ranks past the layout (a dump at tp=4, then tp=2 into the same directory)
    stayed beside the new ones, with --overwrite too: a dump of two loads."""
    from coordloader.handoff.dump import check_dump_target
    d = str(tmp_path / "d")
    t0 = {"w": torch.arange(4.0)}
    for r in range(4):
        dump_rank(d, r, t0, plan_digest="tp4", world=4)
    with pytest.raises(SaveError) as e:
        check_dump_target(d, 0, 2, overwrite=False)
    assert "a dump file already exists" in str(e.value)
    os.unlink(dump_path(d, 0))
    with pytest.raises(SaveError) as e:
        check_dump_target(d, 0, 2, overwrite=False)
    assert str(e.value) == (f"rank 0, file {d}: holds the dump of ranks this layout of 2 "
                            f"rank(s) does not have (rank-00002.safetensors, "
                            f"rank-00003.safetensors); pass --overwrite (overwrite=True) to "
                            f"replace the whole dump")
    check_dump_target(d, 1, 2, overwrite=True)
    dump_rank(d, 0, t0, plan_digest="tp2", world=2, overwrite=True)
    assert sorted(os.listdir(d)) == ["rank-00000.safetensors", "rank-00001.safetensors"]


def test_dump_rank_without_a_world_writes_in_any_rank_order(tmp_path):
    """dump_rank(world=None) checked rank 0 against a world of 1: rank 1's file, written
    first, was refused as the dump of another layout."""
    d = str(tmp_path / "d")
    t = {"w": torch.arange(4.0)}
    dump_rank(d, 1, t, plan_digest="x")
    dump_rank(d, 0, t, plan_digest="x")
    assert sorted(os.listdir(d)) == ["rank-00000.safetensors", "rank-00001.safetensors"]


def test_another_ranks_file_unreadable_as_a_dump_is_named_so(tmp_path):
    """A file in another rank's dump name that is no dump was shown with "plan digest
    None", as if a dump had a digest of None."""
    d = str(tmp_path / "dump")
    os.makedirs(d)
    open(dump_path(d, 0), "wb").write(b"not a dump")
    with pytest.raises(SaveError) as ei:
        dump_rank(d, 1, {"x": torch.ones(2)}, plan_digest="a" * 64, world=2)
    assert ei.value.message == (
        f"holds rank-00000.safetensors, a dump of another load (unreadable as a dump; this "
        f"load's plan digest {'a' * 12}); choose another --dump DIR, or dump every rank of "
        f"this load with --overwrite (overwrite=True), each rank replacing its own file")


def test_a_dump_is_refused_as_a_checkpoint(tmp_path, tiny):
    """A --dump directory holds each rank's local tensors under the checkpoint's names:
    read as a checkpoint (load, consolidate), rank 0's file gave 106 of the tiny
    checkpoint's tensors at half their shape, exit 0, and a consolidate of it passed
    verify full. Each dump file says it is one (its rank and plan digest)."""
    from coordloader.errors import CheckpointError
    d = str(tmp_path / "d")
    plan = make_plan(tiny, Layout(tp=2))
    for r in range(2):
        dump_rank(d, r, cl.load(tiny, Layout(tp=2), rank=r), plan_digest=plan.digest())
    want = ("file rank-00000.safetensors: is coordloader's --dump of rank 0's local tensors, "
            "each this rank's slice of a checkpoint tensor under its name, not a checkpoint; "
            "load or consolidate the checkpoint it was loaded from (compare a dump with a "
            "load, or read it with a safetensors reader)")
    for read in (lambda: read_checkpoint(d), lambda: read_checkpoint(dump_path(d, 0)),
                 lambda: cl.consolidate(d, str(tmp_path / "out"), config=tiny)):
        with pytest.raises(CheckpointError) as e:
            read()
        assert str(e.value) == want
    assert not os.path.exists(tmp_path / "out")
    os.remove(dump_path(d, 1))   # one rank's file alone
    with pytest.raises(CheckpointError, match="is coordloader's --dump of rank 0's"):
        cl.load(d, Layout(), rank=0)


def test_save_refuses_an_index_readers_would_refuse_and_keeps_the_old_one(tmp_path, monkeypatch):
    # A save of many pieces could publish an index over the readers' size cap: the old
    # checkpoint replaced by one that no reader opens. Shown at a small cap.
    from coordloader.handoff import publish
    out = tmp_path / "ck"
    cl.save(str(out), {"w": torch.arange(4.0)}, config={"model_type": "toy"})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(publish, "MAX_JSON_FILE", 4096)
    many = {f"layer{i:03d}.weight": torch.full((2,), float(i)) for i in range(100)}
    with pytest.raises(SaveError, match=r"file .*/coordloader-index\.json: this file would be "
                       r"\d+ bytes, over the 4096 bytes readers accept for it; nothing was "
                       r"published \(the previous checkpoint, if any, is untouched\)\Z"):
        cl.save(str(out), many, config={"model_type": "toy"}, overwrite=True, digests=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()
    got = read_checkpoint(str(out))
    assert list(got.tensors) == ["w"]


def test_consolidate_refuses_an_hf_index_over_the_readers_cap(tmp_path, monkeypatch, tiny):
    """consolidate wrote an HF index under save's 256 MiB cap, where readers accept 64 MiB
    for an HF index: published, then refused by every reader."""
    from coordloader.checkpoint import reader
    from coordloader.handoff import consolidate as cons
    plan = make_plan(tiny, Layout(tp=2))
    src = tmp_path / "saved"
    for r in range(2):
        cl.save(str(src), cl.load(tiny, Layout(tp=2), rank=r), plan, rank=r, config=tiny)
    monkeypatch.setattr(cons, "MAX_HF_INDEX", 512)
    monkeypatch.setattr(reader, "MAX_HF_INDEX", 512)
    out = tmp_path / "hf"
    with pytest.raises(SaveError, match=r"file .*/model\.safetensors\.index\.json: this file "
                       r"would be \d+ bytes, over the 512 bytes readers accept for it"):
        cl.consolidate(str(src), str(out), max_shard_bytes=100_000)
    assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.iterdir())


@pytest.mark.parametrize("writer", ["save", "consolidate"])
def test_a_failure_after_publishing_began_says_how_to_finish(tmp_path, monkeypatch, writer):
    """ENOSPC once the publish marker was written said 'the previous state of the directory
    is intact', while the old model.safetensors was already gone and every reader refused
    the directory; it now says what readers say, and recover_save finishes the publish."""
    from safetensors.torch import save_file
    out = tmp_path / "out"
    out.mkdir()
    save_file({"w": torch.zeros(4, 4)}, str(out / "model.safetensors"))
    (out / "config.json").write_text('{"model_type": "toy"}')
    new = {"w": torch.ones(4, 4)}
    if writer == "consolidate":
        src = tmp_path / "src"
        cl.save(str(src), new, config={"model_type": "toy"})
    index = "coordloader-index.json" if writer == "save" else "model.safetensors.index.json"
    real = os.replace

    def replace(a, b, *k, **kw):
        if os.path.basename(b) == index and "staging" in str(a):
            raise OSError(errno.ENOSPC, "No space left on device", b)
        return real(a, b, *k, **kw)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(SaveError) as e:
        if writer == "save":
            cl.save(str(out), new, config={"model_type": "toy"}, overwrite=True)
        else:
            cl.consolidate(str(src), str(out), overwrite=True)
    what = "publishing the checkpoint" if writer == "save" else "consolidating"
    assert f"{what} failed after publishing began (No space left on device): a save into " \
           f"this directory was interrupted while publishing" in str(e.value), str(e.value)
    assert f"coordloader.recover_save({str(out)!r})" in str(e.value)
    assert "intact" not in str(e.value)
    monkeypatch.undo()
    assert cl.recover_save(str(out))
    assert torch.equal(cl.load(str(out), Layout(), rank=0, rules=[
        {"pattern": "*", "strategy": "replicate"}])["w"], new["w"])


def test_an_atomic_write_never_writes_through_a_link_at_its_temporary(tmp_path):
    """The temporary (``path + ".tmp"``) was opened with O_TRUNC: a symlink planted at
    that name had its target truncated and overwritten, and a killed writer's leftover was
    written over in place. Whatever is there is removed, and the new file made afresh."""
    from coordloader.checkpoint.fileio import write_file_atomic
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "report.json"
    os.symlink(victim, str(out) + ".tmp")
    write_file_atomic(str(out), b'{"ok": 1}\n')
    assert victim.read_text() == "keep me"
    assert out.read_bytes() == b'{"ok": 1}\n' and not out.is_symlink()
    assert not os.path.lexists(str(out) + ".tmp")
    (tmp_path / "report.json.tmp").write_text("half writ")   # a killed writer's
    write_file_atomic(str(out), b"new\n")
    assert out.read_bytes() == b"new\n" and not os.path.lexists(str(out) + ".tmp")
