"""python -m coordloader.consolidate: a sharded (or any) checkpoint -> plain HF checkpoint,
byte-equal tensors, standard index, bounded memory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import coordloader as cl
from coordloader.api import make_plan
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.errors import SaveError
from coordloader.handoff.consolidate import consolidate, read_full
from coordloader.handoff.save import save
from coordloader.layout import Layout
from coordloader.loader import load
from coordloader.synth import synthesize

from helpers import flip_byte, tensor_bits


def _hf_tensors(root):
    """Every tensor of a plain HF checkpoint, read with the HF safetensors library."""
    idx = json.load(open(os.path.join(root, "model.safetensors.index.json")))
    out = {}
    for name, f in idx["weight_map"].items():
        with safe_open(os.path.join(root, f), "pt") as h:
            out[name] = h.get_tensor(name)
    return out, idx


def _save_resharded(src, out, layout, **kw):
    plan = make_plan(src, layout)
    for r in range(layout.world_size):
        save(out, load(src, layout, rank=r), plan, rank=r, config=src, **kw)


@pytest.mark.parametrize("arch,layout", [("qwen3_moe", Layout(tp=2, ep=2)),
                                         ("deepseek_v3", Layout(tp=2, pp=2, include_mtp=True))])
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_cli_consolidate_is_byte_equal(tmp_path, arch, layout):
    src = synthesize(str(tmp_path / "src"), arch, "tiny", shards=2, seed=3)
    sharded = str(tmp_path / "sharded")
    _save_resharded(src, sharded, layout, max_shard_bytes=50_000)
    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, "-m", "coordloader.consolidate", sharded, str(out),
                        "--max-shard-size", str(300_000 / 2**30), "--block-mib", "0.01"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got, idx = _hf_tensors(out)
    want, _ = _hf_tensors(src)
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        assert torch.equal(tensor_bits(got[n]), tensor_bits(want[n])), n
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) > 1 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                        for i in range(1, len(files) + 1)]
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    assert "coordloader" not in idx
    assert json.load(open(out / "config.json")) == json.load(open(os.path.join(src, "config.json")))
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    assert os.path.exists(out / "model.safetensors.index.json")
    meta = read_checkpoint(str(out))
    assert all(t.is_whole for t in meta.tensors.values())
    # the saved checkpoint's manifest is carried over, valid for the new files
    from coordloader.verify import manifest as mf
    m = mf.load_manifest(str(out), meta, required=True)
    assert {n: d.digest for n, d in m.tensors.items()} == {n: d.digest for n, d in mf.compute(meta).items()}


@pytest.mark.parametrize("where", ["sampled", "between-samples"])
def test_a_source_whose_bytes_differ_from_its_manifest_is_refused(tmp_path, where):
    """The source's bytes no longer those its manifest describes (the next training step
    saved over with the same headers, or bit rot). Consolidate carried the old digests
    where the manifest's 16 sampled blocks missed the change, so the output's manifest
    failed every load without saying why; and where the samples caught it, dropped the
    manifest silently, so a corrupt source's output verified clean. Each tensor copied is
    now held against the manifest: refused, naming it, the output untouched."""
    from coordloader.verify import manifest as mf
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    # one 1 MiB tensor: the samples are 4 KiB blocks ~68 KiB apart, the first at byte 0
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3))
    save_file({"w": w}, str(src / "model.safetensors"))
    mf.write_manifest(read_checkpoint(str(src)))
    path = src / "model.safetensors"
    data = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    flip_byte(path, data + (8 if where == "sampled" else 8192))
    meta = read_checkpoint(str(src))
    assert bool(mf.load_manifest(str(src), meta).data_changed()) == (where == "sampled")
    with pytest.raises(SaveError) as e:
        consolidate(str(src), str(out))
    hint = (f"File model.safetensors holds other data than when the manifest was written "
            f"(sampled blocks differ; headers and sizes are the same): the checkpoint was "
            f"changed or saved again since (another training step?). If on purpose, the "
            f"manifest is stale: regenerate it with `python -m coordloader.manifest {src}`; "
            f"if not, the file is corrupt") if where == "sampled" else (
            f"The checkpoint was changed since the manifest was written (if on purpose, "
            f"regenerate it: `python -m coordloader.manifest {src}`), or the file is corrupt")
    assert str(e.value) == (f"file model.safetensors, tensor 'w': the source's bytes of this "
                            f"tensor differ from its manifest ({src / mf.MANIFEST_NAME}); "
                            f"nothing written. " + hint)
    assert not out.exists() or os.listdir(out) == []
    # the current manifest is carried, and verifies the output
    mf.write_manifest(read_checkpoint(str(src)))
    consolidate(str(src), str(out), overwrite=True)
    meta = read_checkpoint(str(out))
    m = mf.load_manifest(str(out), meta, required=True)
    assert m.data_changed() == ()
    assert {n: d.digest for n, d in m.tensors.items()} == {n: d.digest for n, d in mf.compute(meta).items()}


def test_bounded_memory_and_dim1_pieces(tmp_path):
    # one 4 MiB tensor saved as 4 dim-1 pieces (rowwise split), consolidated with 64 KiB blocks
    from coordloader.planning.model import Piece, Plan, RankPlan, TensorSlice
    full = torch.randn(1024, 1024)
    ranks = []
    for r in range(4):
        ts = TensorSlice("w", "f", "F32", (1024, 1024), (1024, 256),
                         (Piece(((0, 1024), (256 * r, 256 * r + 256)), (0, 0)),), 0, ())
        ranks.append(RankPlan(r, {"tp": r}, (ts,)))
    plan = Plan(Layout(tp=4), "fp", tuple(ranks))
    sharded = str(tmp_path / "s")
    for r in range(4):
        save(sharded, {"w": full[:, 256 * r:256 * r + 256].clone()}, plan, rank=r,
             config={"model_type": "toy"})
    del ranks
    tracemalloc.start()
    try:
        consolidate(sharded, str(tmp_path / "hf"), block_bytes=64 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # the tensor is 4 MiB; blocks of 64 KiB
    got, _ = _hf_tensors(tmp_path / "hf")
    assert torch.equal(got["w"], full)


def test_refusals(tmp_path):
    src = synthesize(str(tmp_path / "src"), "llama", "tiny")
    out = str(tmp_path / "hf")
    consolidate(src, out)
    # the CLI's flag named too (python -m coordloader.consolidate runs the same code)
    with pytest.raises(SaveError, match=r"already exists here; pass overwrite=True "
                                        r"\(--overwrite\) to replace it"):
        consolidate(src, out)
    consolidate(src, out, overwrite=True, max_shard_bytes=100_000)
    got, idx = _hf_tensors(out)
    assert len(set(idx["weight_map"].values())) > 1
    written = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert written == sorted(set(idx["weight_map"].values()))
    with pytest.raises(SaveError, match="is the source checkpoint"):
        consolidate(out, out, overwrite=True)
    os.symlink(out, tmp_path / "link")
    before = sorted(os.listdir(out))
    with pytest.raises(SaveError, match="is the source checkpoint"):
        consolidate(out, str(tmp_path / "link"), overwrite=True, max_shard_bytes=1 << 30)
    assert sorted(os.listdir(out)) == before
    p = subprocess.run([sys.executable, "-m", "coordloader.consolidate", str(tmp_path / "nope"), out + "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.startswith("coordloader consolidate: CheckpointError: ")
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("kw,shown", [
    ({"max_shard_bytes": 0}, "max_shard_bytes must be a positive integer, got 0"),
    ({"max_shard_bytes": -5}, "max_shard_bytes must be a positive integer, got -5"),
    ({"max_shard_bytes": "1GB"}, "max_shard_bytes must be a positive integer, got '1GB'"),
    ({"block_bytes": 0}, "block_bytes must be a positive integer, got 0"),
    ({"block_bytes": -1}, "block_bytes must be a positive integer, got -1"),
    ({"block_bytes": None}, "block_bytes must be a positive integer, got None"),
], ids=["shard-0", "shard-neg", "shard-str", "block-0", "block-neg", "block-none"])
def test_sizes_that_are_not_positive_integers_are_refused(tmp_path, kw, shown):
    """max_shard_bytes 0 or -5 and block_bytes 0 or -1 were taken without a word (one
    tensor per file, one row per block); None or a string, a bare TypeError."""
    src = str(tmp_path / "src")
    save(src, {"w": torch.ones(2), "v": torch.ones(3)}, config={"model_type": "toy"})
    with pytest.raises(SaveError) as e:
        consolidate(src, str(tmp_path / "hf"), **kw)
    assert str(e.value) == shown
    assert not (tmp_path / "hf").exists()


def test_sizes_written_as_floats_of_integers_are_taken(tmp_path):
    """block_bytes=1e6 failed in range() with a float; 5e9-style sizes are common."""
    src = str(tmp_path / "src")
    save(src, {"w": torch.arange(6.0), "v": torch.ones(3)}, config={"model_type": "toy"})
    consolidate(src, str(tmp_path / "hf"), max_shard_bytes=5e9, block_bytes=8.0)
    assert torch.equal(read_full(read_checkpoint(str(tmp_path / "hf")), "w"), torch.arange(6.0))


def test_save_warns_about_excluded_tensors(tmp_path):
    src = synthesize(str(tmp_path / "src"), "deepseek_v3", "tiny")
    plan = make_plan(src, Layout())
    assert plan.excluded
    with pytest.warns(UserWarning, match="excluded by the plan"):
        save(str(tmp_path / "s"), load(src, Layout(), rank=0), plan, rank=0, config=src)


# -- the source changing under a consolidate --------------------------------------------

_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
_CHANGED = ("file changed after its header was read (same size and header; another inode, "
            "mtime or ctime: replaced, rewritten in place, or its permissions or links "
            "changed): read the checkpoint again")
_LEFT = "; the output directory was left as it was"


def _save_generation(src, v, **kw):
    """One training save into ``src``: three 8x8 tensors of value ``v``, one file each."""
    save(src, {f"w{i}": torch.full((8, 8), float(v)) for i in range(3)}, config=_CFG,
         overwrite=True, **{"max_shard_bytes": 300, **kw})


def _tree(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@pytest.fixture
def race(tmp_path, monkeypatch):
    """A sharded source of three files (generation 1), an earlier consolidate of it in
    ``out`` (what the failing one must leave as it was), and ``at_second_open(fn)``: run
    ``fn`` just before the consolidate opens its second source file."""
    from coordloader.checkpoint import fileio
    src, out = str(tmp_path / "trained"), str(tmp_path / "hf")
    _save_generation(src, 1)
    files = sorted(f for f in os.listdir(src) if f.endswith(".coordloader-shard"))
    assert len(files) == 3
    consolidate(src, out)
    before = _tree(out)

    def at_second_open(fn):
        orig, opened = fileio.OpenFiles.fd, []

        def fd(self, name):
            if name not in self.fds and len(opened) == 1:
                fn()
            if name not in self.fds:
                opened.append(name)
            return orig(self, name)
        monkeypatch.setattr(fileio.OpenFiles, "fd", fd)

    return src, out, files, before, at_second_open


def test_a_save_into_the_source_during_a_consolidate_is_refused_not_mixed(race):
    # a training job re-saves into the source directory while the consolidate runs: was
    # published without an error, w0 from the first save and w1, w2 from the second
    src, out, files, before, at_second_open = race
    at_second_open(lambda: _save_generation(src, 2))
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True)
    assert str(ei.value) == (f"file {os.path.join(src, files[1])}: reading the source: "
                             f"{_CHANGED}{_LEFT}")
    assert _tree(out) == before


def test_a_source_file_that_disappears_is_named_as_the_source(race):
    # was: "file model-00001-of-00001.safetensors: writing an output shard failed: No such
    # file or directory", naming the output file
    src, out, files, before, at_second_open = race
    at_second_open(lambda: os.unlink(os.path.join(src, files[1])))
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True, max_shard_bytes=1 << 30)
    assert str(ei.value) == (f"file {os.path.join(src, files[1])}: reading the source: "
                             f"cannot open: No such file or directory{_LEFT}")
    assert _tree(out) == before


def test_a_save_into_the_source_after_its_data_was_read_is_refused(race, monkeypatch):
    # the data files open already (the save runs as the companions are listed): the data
    # read is the first save's, but the manifest and config.json copied beside it would be
    # the second's (the manifest was carried, and a verify=digest load of the output
    # refused it)
    import coordloader.handoff.consolidate as cons
    src, out, files, before, _ = race
    orig = cons.companion_files

    def companions(root, skip):
        _save_generation(src, 2)
        return orig(root, skip)
    monkeypatch.setattr(cons, "companion_files", companions)
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True)
    assert str(ei.value) == (f"file {os.path.join(src, files[0])}: reading the source: "
                             f"{_CHANGED}{_LEFT}")
    assert _tree(out) == before


def test_metadata_handed_in_from_before_a_resave_is_refused(race):
    # consolidate(meta=) with metadata read before the source was saved again, in another
    # shard split: was "writing an output shard failed: No such file or directory"
    src, out, files, before, _ = race
    meta = read_checkpoint(src)
    _save_generation(src, 3, max_shard_bytes=1 << 20)
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True, meta=meta)
    size = os.path.getsize(os.path.join(src, files[0]))
    assert str(ei.value) == (f"file {os.path.join(src, files[0])}: reading the source: file is "
                             f"{size} bytes, its header was read when it had "
                             f"{meta.files[0].size}: it changed during the consolidate{_LEFT}")
    assert _tree(out) == before


_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture
def hf_race(tmp_path, monkeypatch):
    """A plain HF source (index, two shards, config.json and tokenizer_config.json, a
    manifest) written by save A, an earlier consolidate of it in ``out`` (what a failing
    one must leave as it was), and ``after_opens(fn)``: run ``fn`` once the consolidate has
    opened and checked its sources, before it writes anything."""

    import coordloader.handoff.consolidate as cons
    from coordloader.verify.manifest import write_manifest
    src, out = str(tmp_path / "trained"), str(tmp_path / "hf")
    os.makedirs(src)
    save_file({"w0": torch.zeros(4, 8)}, os.path.join(src, _SHARDS[0]), {"format": "pt"})
    save_file({"w1": torch.ones(4, 8), "w2": torch.ones(4, 8)}, os.path.join(src, _SHARDS[1]),
              {"format": "pt"})
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"w0": _SHARDS[0], "w1": _SHARDS[1],
                                                  "w2": _SHARDS[1]}}, f)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({**_CFG, "note": "save A"}, f)
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 1024}, f)
    write_manifest(read_checkpoint(src))
    consolidate(src, out)
    before = _tree(out)
    assert {n: before[n] for n in ("config.json", "tokenizer_config.json")} == {
        n: open(os.path.join(src, n), "rb").read() for n in ("config.json", "tokenizer_config.json")}

    def after_opens(fn):
        orig = cons._plan_shards

        def plan(meta, max_shard_bytes):
            fn()
            return orig(meta, max_shard_bytes)
        monkeypatch.setattr(cons, "_plan_shards", plan)

    return src, out, before, after_opens


def test_a_save_into_the_source_killed_while_publishing_is_refused(hf_race):
    # save B into the source killed once its config.json had moved in: the old shards are
    # still in place, the publish marker too. Was published: save B's config.json beside
    # save A's data
    from coordloader.handoff import publish as pub
    src, out, before, after_opens = hf_race

    class Killed(Exception):
        pass

    def killed_save():
        def hook(step):
            if step == "moved config.json":
                raise Killed(step)
        pub._test_hook = hook
        try:
            with pytest.raises(Killed):
                save(src, {f"w{i}": torch.full((4, 8), 100.0) for i in range(3)},
                     config={**_CFG, "note": "save B"}, overwrite=True)
        finally:
            pub._test_hook = None
        assert set(_SHARDS) < set(os.listdir(src))
    after_opens(killed_save)
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True)
    assert str(ei.value) == (
        f"file {src}: reading the source: a save into this directory was interrupted while "
        f"publishing (coordloader-publishing.json is present): its files mix the previous "
        f"checkpoint and the new one. Every file of the new checkpoint is on disk: finish it "
        f"with coordloader.recover_save({src!r}), or run the save again with "
        f"overwrite=True{_LEFT}")
    assert _tree(out) == before


def test_metadata_handed_in_for_a_source_holding_the_publish_marker_is_refused(hf_race):
    # consolidate(meta=) skips the reader's own refusal of an interrupted directory
    src, out, before, _ = hf_race
    meta = read_checkpoint(src)
    with open(os.path.join(src, "coordloader-publishing.json"), "w") as f:
        f.write("{}")
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True, meta=meta)
    assert str(ei.value).startswith(
        f"file {src}: reading the source: a save into this directory was interrupted while "
        f"publishing (coordloader-publishing.json is present)")
    assert str(ei.value).endswith(_LEFT)
    assert _tree(out) == before


def _replace(path, data):
    """``path`` replaced by a new file (another inode) holding ``data``."""
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


def _other_manifest(path):
    # the same fingerprint (same shards, sizes, headers), other digests: another save of
    # the same shapes. load_manifest accepts it for the source's metadata
    doc = json.load(open(path))
    for t in doc["tensors"].values():
        t["digest"] = "%016x" % (int(t["digest"], 16) ^ 1)
    return json.dumps(doc).encode()


_CHANGED_SINCE = ("changed since the consolidate opened it (another device, inode, size, "
                  "mtime or ctime: replaced or rewritten), so it may be another save's than "
                  "the data read; run the consolidate again once the source is saved")


@pytest.mark.parametrize("name,change", [
    # save B's config.json renamed in, no marker (a tool that writes it by rename): was
    # published beside save A's data
    ("config.json", lambda p: _replace(p, json.dumps({**_CFG, "note": "save B"}).encode())),
    # rewritten in place, the same inode: was copied by path, the new content published
    ("tokenizer_config.json",
     lambda p: open(p, "w").write(json.dumps({"model_max_length": 4096, "x": 1}))),
    # another save's manifest of the same shapes: was carried beside save A's data, and a
    # verify=digest load of the output refused it
    ("coordloader.manifest.json", lambda p: _replace(p, _other_manifest(p))),
    # the index the metadata came from, replaced by other bytes (the same weight map)
    ("model.safetensors.index.json",
     lambda p: _replace(p, json.dumps(json.load(open(p)), indent=1).encode())),
], ids=["config-renamed-in", "tokenizer-rewritten-in-place", "manifest-renamed-in",
        "index-renamed-in"])
def test_a_companion_changed_after_the_sources_were_opened_is_refused(hf_race, name, change):
    src, out, before, after_opens = hf_race
    path = os.path.join(src, name)
    after_opens(lambda: change(path))
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True)
    assert str(ei.value) == f"file {path}: reading the source: {_CHANGED_SINCE}{_LEFT}"
    assert _tree(out) == before


def _same_bytes_in_place(path, data):
    """``path`` rewritten in place with ``data`` (the same size), its mtime set back: only
    its ctime tells."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _flip_case(path):
    data = open(path, "rb").read()
    return data.replace(b"save A", b"SAVE A")


@pytest.mark.parametrize("change", [
    # a chmod: the ctime moves
    lambda src: os.chmod(os.path.join(src, "config.json"), 0o600),
    # a backup tool hard-linking a companion: the ctime moves (and the link count)
    lambda src: os.link(os.path.join(src, "tokenizer_config.json"), os.path.join(src, ".bak")),
    # a touch: the mtime and ctime move
    lambda src: os.utime(os.path.join(src, "config.json")),
    # the index replaced by the same bytes: another inode
    lambda src: _replace(os.path.join(src, "model.safetensors.index.json"),
                         open(os.path.join(src, "model.safetensors.index.json"), "rb").read()),
], ids=["chmod-config", "hard-link-to-tokenizer", "touch-config", "index-same-bytes"])
def test_a_companion_whose_identity_moved_but_not_its_bytes_publishes(hf_race, change):
    # was refused (changed since the consolidate opened it): the identity moved, the bytes
    # did not; the output is the undisturbed consolidate's, byte for byte
    src, out, before, after_opens = hf_race
    after_opens(lambda: change(src))
    fresh = out + "-again"   # not the earlier output: a run that published nothing fails
    consolidate(src, fresh)
    assert _tree(fresh) == before


def _after_copy_of(monkeypatch, name: str, then) -> None:
    """Run ``then()`` once consolidate has copied the companion ``name``."""
    import coordloader.handoff.consolidate as cons
    orig_copy = cons._copy_companion

    def copy(fd, dst):
        digest = orig_copy(fd, dst)
        if os.path.basename(dst) == name:
            then()
        return digest
    monkeypatch.setattr(cons, "_copy_companion", copy)


@pytest.mark.parametrize("when", ["before-the-copy", "after-the-copy"])
def test_a_companion_rewritten_in_place_at_the_same_size_and_mtime_is_refused(
        hf_race, monkeypatch, when):
    # other bytes, the same inode, size and mtime: its bytes are compared, not only its
    # identity, and the copy's with the bytes opened
    src, out, before, after_opens = hf_race
    path = os.path.join(src, "config.json")
    new = _flip_case(path)
    if when == "before-the-copy":
        after_opens(lambda: _same_bytes_in_place(path, new))
    else:
        _after_copy_of(monkeypatch, "config.json", lambda: _same_bytes_in_place(path, new))
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True)
    assert str(ei.value) == f"file {path}: reading the source: {_CHANGED_SINCE}{_LEFT}"
    assert _tree(out) == before


def test_a_companion_copied_mid_rewrite_is_refused_though_its_bytes_came_back(
        hf_race, monkeypatch):
    # rewritten in place before the copy and back after it: the path holds the bytes
    # opened again, but the copy holds the others; refused, not published
    src, out, before, after_opens = hf_race
    path = os.path.join(src, "config.json")
    original = open(path, "rb").read()
    after_opens(lambda: _same_bytes_in_place(path, _flip_case(path)))
    _after_copy_of(monkeypatch, "config.json", lambda: _same_bytes_in_place(path, original))
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True)
    assert str(ei.value) == f"file {path}: reading the source: {_CHANGED_SINCE}{_LEFT}"
    assert _tree(out) == before


def test_a_companion_removed_after_the_sources_were_opened_is_refused(hf_race):
    # was published without the source's config.json (copied by path, gone by then)
    src, out, before, after_opens = hf_race
    path = os.path.join(src, "config.json")
    after_opens(lambda: os.unlink(path))
    with pytest.raises(SaveError) as ei:
        consolidate(src, out, overwrite=True)
    assert str(ei.value) == (f"file {path}: reading the source: is gone from its path since "
                             f"the consolidate opened it (No such file or directory): the "
                             f"source changed while it ran; run the consolidate again once "
                             f"the source is saved{_LEFT}")
    assert _tree(out) == before


def test_companions_are_copied_from_the_files_opened_with_the_data(hf_race, monkeypatch):
    # the bytes copied are those of the file opened and checked, even when its path
    # names another file by the time of the copy (the recheck then refuses the publish)
    import coordloader.handoff.consolidate as cons
    src, out, before, after_opens = hf_race
    path = os.path.join(src, "config.json")
    original = open(path, "rb").read()
    after_opens(lambda: _replace(path, b'{"note": "save B"}'))
    copied = {}
    orig_copy = cons._copy_companion

    def copy(fd, dst):
        digest = orig_copy(fd, dst)
        copied[os.path.basename(dst)] = open(dst, "rb").read()
        return digest
    monkeypatch.setattr(cons, "_copy_companion", copy)
    with pytest.raises(SaveError):
        consolidate(src, out, overwrite=True)
    assert copied["config.json"] == original
    assert _tree(out) == before


def test_a_killed_writers_temporary_is_not_carried_as_a_companion(tmp_path):
    """A write_manifest killed before its rename leaves coordloader.manifest.json.tmp.<pid>
    (the next one does not remove it: its name carries the dead pid); consolidate copied it
    into the new checkpoint as a companion."""
    src, out = tmp_path / "src", tmp_path / "out"
    cl.save(str(src), {"w": torch.ones(4)}, config={"model_type": "toy"})
    (src / "coordloader.manifest.json.tmp.448").write_text('{"half": ')
    (src / "notes.tmp").write_text("scratch")
    (src / "tokenizer.json").write_text("{}")
    cl.consolidate(str(src), str(out))
    names = set(os.listdir(out))
    assert "tokenizer.json" in names
    assert not {"coordloader.manifest.json.tmp.448", "notes.tmp"} & names, names


def test_a_tensor_of_several_files_that_differs_is_named_with_the_file_that_changed(tmp_path):
    """A tensor saved in pieces over two ranks' files, one byte of rank 1's piece flipped:
    the refusal named rank 0's file (the first piece's), then said rank 1's had changed."""
    from coordloader.checkpoint.formats import shard_name
    src = synthesize(str(tmp_path / "src"), "llama", "tiny")
    plan = make_plan(src, Layout(tp=2))
    out = str(tmp_path / "saved")
    for r in range(2):
        save(out, load(src, Layout(tp=2), rank=r), plan, rank=r, config=src)
    name = shard_name(1, 0)
    piece = next(p for p in read_checkpoint(out).tensors["lm_head.weight"].pieces
                 if p.file == name)
    flip_byte(os.path.join(out, name), piece.start)   # the file's first data: a sampled block
    with pytest.raises(SaveError) as e:
        consolidate(out, str(tmp_path / "hf"))
    assert (e.value.file, e.value.tensor) == (name, "lm_head.weight")
    assert str(e.value).startswith(f"file {name}, tensor ")
    assert f"File {name} holds other data than when the manifest was written" in str(e.value)


def test_metadata_of_another_checkpoint_than_the_source_is_refused(tmp_path):
    # consolidate(llama, out, meta=<qwen2's>) wrote qwen2's weights, and with out == src and
    # overwrite=True replaced the llama directory with them (the same-directory check held
    # out against meta's root only)
    llama = synthesize(str(tmp_path / "llama"), "llama", "tiny", seed=1)
    qwen = synthesize(str(tmp_path / "qwen2"), "qwen2", "tiny", seed=2)
    meta_qwen = read_checkpoint(qwen)
    before = sorted(os.listdir(llama))
    for out in (str(tmp_path / "out"), llama):
        with pytest.raises(SaveError) as ei:
            consolidate(llama, out, meta=meta_qwen, overwrite=True)
        assert str(ei.value) == (
            f"file {llama}: meta= is the metadata of the checkpoint in {qwen}, not of the "
            f"source {llama}; nothing written. Pass the source's own (read_checkpoint(src)), "
            f"or leave meta= out")
    assert not os.path.exists(tmp_path / "out")
    assert sorted(os.listdir(llama)) == before
    assert json.load(open(os.path.join(llama, "config.json")))["model_type"] == "llama"
    # out == src is refused whichever of src and meta's root it is held against
    with pytest.raises(SaveError, match="is the source checkpoint"):
        consolidate(llama, llama, meta=read_checkpoint(llama), overwrite=True)
    # the source's own metadata, given as its directory or one of its files, is taken
    meta = read_checkpoint(llama)
    consolidate(llama, str(tmp_path / "a"), meta=meta)
    consolidate(os.path.join(llama, meta.files[0].name), str(tmp_path / "b"), meta=meta)
    assert set(_hf_tensors(tmp_path / "a")[0]) == set(_hf_tensors(tmp_path / "b")[0]) == set(meta.tensors)


def test_an_output_that_reaches_the_source_by_another_path_is_refused(tmp_path, monkeypatch):
    # a bind mount of the source: its real path is not the source's, so only the identity
    # of the directory shows it (simulated: the real path made blind to the link)
    src = synthesize(str(tmp_path / "src"), "llama", "tiny", seed=1)
    os.symlink(src, tmp_path / "alias")
    monkeypatch.setattr(os.path, "realpath", os.path.abspath)
    before = sorted(os.listdir(src))
    with pytest.raises(SaveError, match="output directory is the source checkpoint"):
        consolidate(src, str(tmp_path / "alias"), overwrite=True)
    assert sorted(os.listdir(src)) == before


def test_a_config_directory_with_a_tokenizer_supplies_all_of_its_kind(tmp_path):
    # config=DIR copied DIR's tokenizer over the source's same-named files, but every file of
    # the source's tokenizer DIR lacks stayed (its named chat templates, generation config,
    # sentencepiece model): the output's tokenizer mixed two models'
    src = synthesize(str(tmp_path / "src"), "llama", "tiny", seed=1)
    theirs = {"tokenizer.json": "A-tok", "tokenizer_config.json": "{}",
              "tokenizer.model": "A-spm", "chat_template.jinja": "A-default",
              "additional_chat_templates/tool_use.jinja": "A-tool",
              "generation_config.json": '{"eos_token_id": 1}', "README.md": "A-readme"}
    for name, text in theirs.items():
        os.makedirs(os.path.dirname(os.path.join(src, name)), exist_ok=True)
        open(os.path.join(src, name), "w").write(text)
    b = tmp_path / "B"
    b.mkdir()
    cfg = json.load(open(os.path.join(src, "config.json")))
    (b / "config.json").write_text(json.dumps(cfg))
    (b / "tokenizer.json").write_text("B-tok")
    (b / "chat_template.jinja").write_text("B-default")
    out = tmp_path / "out"
    consolidate(src, str(out), config=str(b))
    assert sorted(os.listdir(out)) == ["README.md", "chat_template.jinja", "config.json",
                                       "model-00001-of-00001.safetensors",
                                       "model.safetensors.index.json", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "B-tok"
    assert (out / "chat_template.jinja").read_text() == "B-default"
    # a directory of config.json alone (DCP's missing config) leaves the source's tokenizer
    c = tmp_path / "C"
    c.mkdir()
    (c / "config.json").write_text(json.dumps(cfg))
    consolidate(src, str(out), config=str(c), overwrite=True)
    for name, text in theirs.items():
        assert (out / name).read_text() == text, name


@pytest.mark.parametrize("case", ["torn", "tensor-missing", "dtype"])
def test_a_malformed_or_mismatched_source_manifest_is_refused(tmp_path, case):
    # dropped without a word, exit 0, the output without a manifest, where `manifest --check`
    # and `load --verify digest` refuse it; a stale one (of other headers) is still dropped
    from coordloader.verify import manifest as mf
    src = synthesize(str(tmp_path / "src"), "llama", "tiny", seed=1)
    mf.write_manifest(read_checkpoint(src))
    path = os.path.join(src, mf.MANIFEST_NAME)
    doc = json.load(open(path))
    if case == "torn":
        open(path, "w").write(json.dumps(doc)[:-200])
    elif case == "tensor-missing":
        del doc["tensors"]["lm_head.weight"]
        json.dump(doc, open(path, "w"))
    else:
        doc["tensors"]["lm_head.weight"]["dtype"] = "F16"
        json.dump(doc, open(path, "w"))
    with pytest.raises(SaveError) as ei:
        consolidate(src, str(tmp_path / "out"))
    want = {"torn": "malformed manifest: ",
            "tensor-missing": "manifest does not match the checkpoint's tensors (missing "
                              "['lm_head.weight'], unexpected [])",
            "dtype": "manifest records F16[320, 128], checkpoint has BF16[320, 128]"}[case]
    assert str(ei.value).startswith(
        f"file {path}" + (", tensor 'lm_head.weight'" if case == "dtype" else "")
        + f": reading the source: {want}"), str(ei.value)
    assert str(ei.value).endswith(
        f"`manifest --check` and `load --verify digest` refuse it too: regenerate it (`python -m "
        f"coordloader.manifest {src}`), or remove it to consolidate without one; the output "
        f"directory was left as it was")
    assert not os.path.exists(tmp_path / "out")
    # a stale one (of other headers: the source saved again since) is not carried
    mf.write_manifest(read_checkpoint(src))
    doc = json.load(open(path))
    doc["fingerprint"] = "0" * 64
    json.dump(doc, open(path, "w"))
    consolidate(src, str(tmp_path / "out"))
    assert mf.MANIFEST_NAME not in os.listdir(tmp_path / "out")


def test_metadata_of_the_source_given_as_a_hub_file_or_beside_it_is_held_to_what_it_reads_as(
        tmp_path):
    # a hub snapshot's files are links into blobs/: the file's real path is no file of the
    # snapshot, and consolidate(FILE, out, meta=read_checkpoint(FILE)) was refused; and a
    # directory (or its index) with the metadata of one file beside its indexed checkpoint
    # (Mistral's consolidated.safetensors) was taken, writing that file's model under its name
    plain = synthesize(str(tmp_path / "plain"), "llama", "tiny", seed=1, shards=2)
    snap, blobs = tmp_path / "hub" / "snapshots" / "abc", tmp_path / "hub" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for n in os.listdir(plain):
        shutil.copy(os.path.join(plain, n), blobs / ("h-" + n))
        os.symlink(os.path.join("..", "..", "blobs", "h-" + n), snap / n)
    index = str(snap / "model.safetensors.index.json")
    consolidate(index, str(tmp_path / "a"), meta=read_checkpoint(index))
    consolidate(str(snap), str(tmp_path / "b"), meta=read_checkpoint(index))
    one = synthesize(str(tmp_path / "one"), "qwen2", "tiny", seed=2, shards=1)
    side = os.path.join(plain, "consolidated.safetensors")
    shutil.copy(os.path.join(one, "model.safetensors"), side)
    consolidate(side, str(tmp_path / "c"), meta=read_checkpoint(side))
    single = synthesize(str(tmp_path / "single"), "llama", "tiny", seed=3, shards=1)
    consolidate(single, str(tmp_path / "d"),
                meta=read_checkpoint(os.path.join(single, "model.safetensors")))
    for src in (plain, os.path.join(plain, "model.safetensors.index.json")):
        with pytest.raises(SaveError) as ei:
            consolidate(src, str(tmp_path / "e"), meta=read_checkpoint(side))
        assert str(ei.value) == (
            f"file {src}: meta= is the metadata of consolidated.safetensors in {plain}, not of "
            f"the source {src}; nothing written. Pass the source's own (read_checkpoint(src)), "
            f"or leave meta= out")
    assert not os.path.exists(tmp_path / "e")


def test_a_config_directory_without_a_tokenizer_leaves_the_sources(tmp_path):
    # model.save_pretrained(DIR) writes config.json and generation_config.json: such a
    # config= directory counted as supplying the tokenizer, and the output had none at all
    src = synthesize(str(tmp_path / "src"), "llama", "tiny", seed=1)
    for name, text in {"tokenizer.json": "S-tok", "chat_template.jinja": "S-chat",
                       "generation_config.json": '{"eos_token_id": 2}'}.items():
        (tmp_path / "src" / name).write_text(text)
    d = tmp_path / "saved"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    (d / "generation_config.json").write_text('{"eos_token_id": 2, "do_sample": true}')
    out = tmp_path / "out"
    consolidate(src, str(out), config=str(d))
    assert (out / "tokenizer.json").read_text() == "S-tok"
    assert (out / "chat_template.jinja").read_text() == "S-chat"
    assert json.loads((out / "generation_config.json").read_text())["do_sample"] is True
