"""Manifest: streaming per-tensor digests, atomic write, stale manifests refused, CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from coordloader.checkpoint.metadata import full_box
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.cli.manifest import main as manifest_main
from coordloader.errors import SaveError, VerifyError
from coordloader.verify import manifest as mf
from coordloader.verify.digest import digest


def tensors_a():
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed.weight": torch.randn(10, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.w": torch.randn(8, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g).to(torch.float16),
        "model.scale": torch.tensor(3, dtype=torch.int64),
        "model.mask": torch.tensor([True, False, True]),
    }


def write_hf(root, tensors, shards=2):
    """A plain HF checkpoint: ``shards`` files and an index."""
    os.makedirs(root, exist_ok=True)
    names = list(tensors)
    wm = {}
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, os.path.join(root, fn))
        wm.update({n: fn for n in part})
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return str(root)


def flip_byte(path, offset_from_end=3):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))


def test_manifest_digests_equal_in_memory_digests(tmp_path):
    ts = tensors_a()
    root = write_hf(tmp_path / "ck", ts)
    meta = read_checkpoint(root)
    path = mf.write_manifest(meta, jobs=2)
    assert os.path.basename(path) == mf.MANIFEST_NAME
    m = mf.load_manifest(root, meta)
    for n, t in ts.items():
        assert m.tensors[n].digest == digest(t, full_box(tuple(t.shape)), tuple(t.shape)), n
        assert m.tensors[n].shape == tuple(t.shape)
    # bounded reads: tiny read chunks give the same digests
    for n in ts:
        assert mf.tensor_digest(meta, meta.tensors[n], read_chunk_bytes=5) == m.tensors[n].digest
    # the checkpoint reader ignores the manifest file
    assert read_checkpoint(root).fingerprint() == meta.fingerprint()


def test_sharded_tensor_digest_is_sum_of_pieces(tmp_path):
    root = tmp_path / "sh"
    root.mkdir()
    g = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    b = torch.arange(5, dtype=torch.int32)
    save_file({"w@0:2,0:6": g[0:2].contiguous(), "b": b}, str(root / "s0.safetensors"))
    save_file({"w@2:4,0:3": g[2:4, 0:3].contiguous(), "w@2:4,3:6": g[2:4, 3:6].contiguous()},
              str(root / "s1.safetensors"))
    idx = {"weight_map": {"w": "s0.safetensors", "b": "s0.safetensors"},
           "coordloader": {"version": 1, "layout": {}, "tensors": {
               "w": {"dtype": "F32", "shape": [4, 6], "pieces": [
                   {"file": "s0.safetensors", "key": "w@0:2,0:6", "box": [[0, 2], [0, 6]]},
                   {"file": "s1.safetensors", "key": "w@2:4,0:3", "box": [[2, 4], [0, 3]]},
                   {"file": "s1.safetensors", "key": "w@2:4,3:6", "box": [[2, 4], [3, 6]]}]},
               "b": {"dtype": "I32", "shape": [5], "pieces": [
                   {"file": "s0.safetensors", "key": "b", "box": [[0, 5]]}]}}}}
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))
    meta = read_checkpoint(str(root))
    assert len(meta.tensors["w"].pieces) == 3
    mf.write_manifest(meta)
    m = mf.load_manifest(str(root), meta)
    assert m.tensors["w"].digest == digest(g, full_box((4, 6)), (4, 6))
    assert m.tensors["b"].digest == digest(b, full_box((5,)), (5,))


def test_atomic_write_keeps_old_manifest_on_failure(tmp_path, monkeypatch):
    root = write_hf(tmp_path / "ck", tensors_a())
    meta = read_checkpoint(root)
    path = mf.write_manifest(meta)
    before = open(path, "rb").read()

    def boom(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(mf.os, "replace", boom)
    with pytest.raises(SaveError, match="No space left"):
        mf.write_manifest(meta)
    assert open(path, "rb").read() == before
    assert [p for p in os.listdir(root) if ".tmp" in p] == []


def test_stale_manifest_refused_naming_the_change(tmp_path):
    ts = tensors_a()
    root = write_hf(tmp_path / "ck", ts)
    meta = read_checkpoint(root)
    mf.write_manifest(meta)
    # rewrite one shard with a changed tensor shape
    ts2 = dict(ts)
    ts2["model.layers.0.w"] = torch.zeros(8, 9)
    write_hf(root, ts2)
    meta2 = read_checkpoint(root)
    with pytest.raises(VerifyError, match=r"stale manifest.*model-00002-of-00002.safetensors") as ei:
        mf.load_manifest(root, meta2)
    assert "changed size" in str(ei.value) or "different header" in str(ei.value)
    # a flipped data byte keeps the fingerprint: the manifest still loads (digest catches it)
    write_hf(root, ts)
    meta3 = read_checkpoint(root)
    mf.write_manifest(meta3)
    flip_byte(os.path.join(root, "model-00001-of-00002.safetensors"))
    assert mf.load_manifest(root, read_checkpoint(root)) is not None


def test_manifest_of_another_step_with_the_same_headers_says_so(tmp_path, capsys):
    """A manifest written for one training step, kept beside the next step saved over it
    (same names, shapes, sizes and headers: the fingerprint is equal): every tensor failed
    as "content differs from the manifest", as if the ranks had loaded wrong bytes. The
    manifest records each file's sampled data; the failure now says first that the files
    hold other data than when it was written, and still names each tensor."""
    from coordloader.layout import Layout
    from coordloader.planning.planner import build_plan
    from coordloader.verify import checks as vf
    root = write_hf(tmp_path / "ck", tensors_a())
    meta = read_checkpoint(root)
    mf.write_manifest(meta)
    step2 = {n: (t + 1 if t.is_floating_point() else t) for n, t in tensors_a().items()}
    write_hf(tmp_path / "ck", step2)
    meta2 = read_checkpoint(root)
    assert meta2.fingerprint() == meta.fingerprint()
    man = mf.load_manifest(root, meta2)
    assert man.data_changed() == ("model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors")
    hint = ("file model-00001-of-00002.safetensors and 1 more holds other data than when the "
            "manifest was written (sampled blocks differ; headers and sizes are the same): the "
            "checkpoint was changed or saved again since (another training step?). If on "
            "purpose, the manifest is stale: regenerate it with `python -m "
            f"coordloader.manifest {meta2.root}`; if not, the file is corrupt")
    rules = [{"pattern": "*", "strategy": "replicate"}]
    plan = build_plan(meta2, Layout(), rules)
    held = {n: t for n, t in step2.items()}
    rep = vf.evaluate([vf.local_payload(held, plan.rank(0), "digest", meta=meta2)], "digest",
                      meta=meta2, manifest=man)
    fl = rep["failures"]
    assert fl[0] == {"rank": None, "check": "manifest", "detail": hint, "tensor": None,
                     "piece": None, "box": None, "ranks": []}
    assert {f["tensor"] for f in fl[1:]} == {n for n, t in step2.items() if t.is_floating_point()}
    assert manifest_main([root, "--check"]) == 1
    assert capsys.readouterr().err.rstrip().endswith(hint)
    # a manifest written before the samples were recorded: no files named
    doc = json.loads(open(mf.manifest_path(root)).read())
    for f in doc["files"]:
        del f["data_sample_sha256"]
    open(mf.manifest_path(root), "w").write(json.dumps(doc))
    assert mf.load_manifest(root, meta2).data_changed() == ()
    mf.write_manifest(meta2)   # regenerated: nothing differs
    assert mf.load_manifest(root, meta2).data_changed() == ()
    assert manifest_main([root, "--check"]) == 0


def test_data_samples_are_read_only_to_explain_a_failure(tmp_path, monkeypatch):
    """Loading a manifest reads no data samples (a clean verify pays nothing for them); a
    malformed 'files' list is a malformed manifest, and an entry naming a file the
    checkpoint does not have (a path outside it) is never read."""
    from coordloader.checkpoint import identity
    root = write_hf(tmp_path / "ck", tensors_a())
    meta = read_checkpoint(root)
    mf.write_manifest(meta)
    read = []
    real = identity.data_sample_sha256
    monkeypatch.setattr(mf, "data_sample_sha256", lambda r, n: read.append(n) or real(r, n))
    man = mf.load_manifest(root, meta)
    assert read == []
    assert man.data_changed() == () and len(read) == 2
    doc = json.loads(open(mf.manifest_path(root)).read())
    doc["files"].append({"name": "../outside.safetensors", "data_sample_sha256": "0" * 64})
    open(mf.manifest_path(root), "w").write(json.dumps(doc))
    assert set(mf.load_manifest(root, meta).samples) == {f.name for f in meta.files}
    for bad, msg in (({"data_sample_sha256": "0" * 64}, "a 'files' entry is not an object "
                      "with a name"), ({"name": meta.files[0].name, "data_sample_sha256": 5},
                                       "data_sample_sha256 of 'model-00001-of-00002"
                                       ".safetensors' is not a string")):
        doc["files"] = [bad]
        open(mf.manifest_path(root), "w").write(json.dumps(doc))
        with pytest.raises(VerifyError, match=f"malformed manifest: {msg}") as ei:
            mf.load_manifest(root, meta)
        assert ei.value.file == mf.manifest_path(root)


def test_manifest_of_another_digest_algorithm_is_stale(tmp_path):
    """A manifest written by a coordloader whose digest math differs (v2 -> v3 changed
    the element values) is refused by name, with the command that fixes it."""
    root = write_hf(tmp_path / "ck", tensors_a())
    meta = read_checkpoint(root)
    path = mf.write_manifest(meta)
    doc = json.load(open(path))
    assert doc["algorithm"] == mf.ALGORITHM
    doc["algorithm"] = "coordloader-rowcol-splitmix64-v2"
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(VerifyError, match=r"stale manifest: its digests use algorithm "
                                          r"'coordloader-rowcol-splitmix64-v2'.*regenerate it "
                                          r"with `python -m coordloader.manifest") as ei:
        mf.load_manifest(root, meta)
    assert ei.value.file == path


def test_missing_and_malformed_manifest(tmp_path):
    root = write_hf(tmp_path / "ck", tensors_a())
    meta = read_checkpoint(root)
    assert mf.load_manifest(root, meta) is None
    with pytest.raises(VerifyError, match="no manifest"):
        mf.load_manifest(root, meta, required=True)
    with open(mf.manifest_path(root), "w") as f:
        f.write("{not json")
    with pytest.raises(VerifyError, match="malformed manifest"):
        mf.load_manifest(root, meta)
    # a shape too large for an int was an untyped OverflowError
    mf.write_manifest(meta)
    doc = json.loads(open(mf.manifest_path(root)).read())
    doc["tensors"][next(iter(doc["tensors"]))]["shape"] = [1e400]
    open(mf.manifest_path(root), "w").write(json.dumps(doc).replace("Infinity", "1e400"))
    # (refused as it is parsed, as config.json and the index would be)
    with pytest.raises(VerifyError, match=r"malformed manifest: number 1e400 overflows"):
        mf.load_manifest(root, meta)


@pytest.mark.parametrize("edit", [lambda d: "-" + d, lambda d: "1" + d, lambda d: "0x" + d,
                                  lambda d: d[:8] + "_" + d[8:], lambda d: d[:-2],
                                  lambda d: 12345, lambda d: None],
                         ids=["negative", "65 bits", "0x", "underscore", "short", "int", "null"])
def test_a_manifest_digest_that_is_not_16_hex_digits_is_malformed(tmp_path, edit):
    """A hand-edited digest of 2^64 or more, or negative, was taken (int(x, 16)) and the
    finding printed it masked: "primary pieces sum to D, manifest has D", blaming rank 0
    for a manifest no digest can equal."""
    root = write_hf(tmp_path / "ck", tensors_a())
    meta = read_checkpoint(root)
    mf.write_manifest(meta)
    doc = json.loads(open(mf.manifest_path(root)).read())
    entry = doc["tensors"]["model.layers.0.w"]
    entry["digest"] = edit(entry["digest"])
    open(mf.manifest_path(root), "w").write(json.dumps(doc))
    with pytest.raises(VerifyError) as ei:
        mf.load_manifest(root, meta)
    assert ei.value.message == f"malformed manifest: digest {entry['digest']!r} is not 16 hex digits"
    assert ei.value.file == mf.manifest_path(root)


def test_manifest_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    """A FIFO in the manifest's place blocked the load (and --check) forever."""
    import signal
    root = write_hf(tmp_path / "ck", tensors_a())
    meta = read_checkpoint(root)
    os.mkfifo(mf.manifest_path(root))

    def blocked(*_):
        raise AssertionError("load_manifest blocked on a FIFO")
    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(10)
    try:
        with pytest.raises(VerifyError) as e:
            mf.load_manifest(root, meta)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert str(e.value) == (f"file {mf.manifest_path(root)}: cannot read the manifest: is a "
                            f"FIFO; expected a regular file")


@pytest.mark.slow   # a subprocess
def test_cli_writes_then_check_names_corrupted_tensor(tmp_path, capsys):
    ts = tensors_a()
    root = write_hf(tmp_path / "ck", ts, shards=1)
    # one real subprocess for the module entry point; the rest in-process (fast)
    r = subprocess.run([sys.executable, "-m", "coordloader.manifest", root, "--jobs", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and os.path.exists(mf.manifest_path(root))
    assert manifest_main([root, "--check"]) == 0
    meta = read_checkpoint(root)
    last = max(meta.tensors.values(), key=lambda t: t.pieces[0].end)
    flip_byte(os.path.join(root, last.file), offset_from_end=1)
    capsys.readouterr()
    assert manifest_main([root, "--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("coordloader manifest: VerifyError: ") and last.name in err
    assert manifest_main([str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("coordloader manifest: CheckpointError: ") and err.count("\n") == 1


def test_a_manifest_of_a_file_beside_an_indexed_checkpoint_never_replaces_the_dirs(tmp_path,
                                                                                   capsys):
    # `manifest DIR/consolidated.safetensors` (Mistral's repos ship one beside the index)
    # replaced DIR's manifest with one of that file: `load DIR --verify digest` then failed,
    # calling the untouched checkpoint changed
    from coordloader.synth import synthesize
    src = synthesize(str(tmp_path / "m"), "llama", "tiny", shards=2, seed=1)
    one = os.path.join(src, "consolidated.safetensors")
    save_file({"x": torch.ones(3)}, one)
    assert manifest_main([src, "--quiet"]) == 0
    path = os.path.join(src, "coordloader.manifest.json")
    before = open(path, "rb").read()
    assert manifest_main([one, "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"coordloader manifest: VerifyError: file {path}: is the manifest of "
        f"model-00001-of-00002.safetensors, model-00002-of-00002.safetensors (2 file(s)), not "
        f"of consolidated.safetensors, the checkpoint given; a directory holds one manifest, of "
        f"the checkpoint the directory reads as, so nothing was written. To make a manifest of "
        f"consolidated.safetensors, put it in a directory of its own; to regenerate this one, "
        f"run `python -m coordloader.manifest {src}`\n")
    assert open(path, "rb").read() == before
    meta = read_checkpoint(src)
    assert mf.load_manifest(src, meta) is not None
    # the directory's own checkpoint replaces a manifest of the other file (written before)
    os.remove(path)
    mf.write_manifest(read_checkpoint(one))   # no manifest there: written
    assert manifest_main([src, "--quiet"]) == 0
    assert mf.load_manifest(src, meta) is not None
    # elsewhere, by path=, any manifest is written
    mf.write_manifest(read_checkpoint(one), path=str(tmp_path / "other.json"))
