"""Ranks agree on the checkpoint's identity, not only on its headers.

Each rank reads only a share of the headers, so two ranks pointed at copies with the same
shapes but other data (``synth --seed 1``) used to agree on the plan digest and load
different bytes, exit 0. Every rank now fingerprints every file it may read (size, header
bytes, sampled data blocks, index and manifest bytes) and the ranks compare fingerprints
with the plan digest."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from coordloader.checkpoint.identity import (
    SAMPLE_BYTES,
    checkpoint_identity,
    identity_mismatch,
)
from coordloader.dist.collective import free_port
from coordloader.synth import synthesize

from helpers import rank_line
from ranks import rank_env, run_ranks

SIDE = ["coordloader.manifest.json", "model.safetensors.index.json"]


def _shards(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def _load_two(tmp_path, ckpts) -> dict:
    """A 2-rank tp=2 load, rank r of ``ckpts[r]``: {rank: (exit status, stderr)}."""
    port = free_port()

    def start(r):
        env = rank_env(port, r, 2, LOCAL_RANK=str(r), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "coordloader.load", str(ckpts[r]), "--tp", "2",
               "--engine", "cpu", "--timeout", "20", "--quiet"]
        with open(tmp_path / f"err-{r}", "wb") as ef:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=ef,
                                    cwd=str(tmp_path), start_new_session=True)

    procs, _, _ = run_ranks(range(2), start, 90)
    return {r: (p.returncode, (tmp_path / f"err-{r}").read_text()) for r, p in procs.items()}


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    """(seed 0, a copy of it whose data, not headers, is seed 1's): synth records the seed
    in each header's __metadata__, so seed 1 as such differs in the headers already; the
    copy is the hard case, every header byte and size the same."""
    root = tmp_path_factory.mktemp("seeds")
    a = synthesize(str(root / "a"), "qwen3_moe", "tiny", shards=2, seed=0)
    b = synthesize(str(root / "b"), "qwen3_moe", "tiny", shards=2, seed=1)
    mixed = shutil.copytree(a, root / "a-header-b-data")
    for name in _shards(a):
        with open(os.path.join(a, name), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            f.seek(0)
            head = f.read(8 + n)
        with open(os.path.join(b, name), "rb") as f:
            f.seek(len(head))
            data = f.read()
        dst = os.path.join(mixed, name)
        os.chmod(dst, 0o644)
        with open(dst, "wb") as f:
            f.write(head + data)
    return a, str(mixed), b


def test_byte_identical_copy_elsewhere_has_the_same_identity(two_seeds, tmp_path):
    a, *_ = two_seeds
    time.sleep(0.01)   # the copy gets other mtimes and inodes: they are not compared
    c = shutil.copytree(a, tmp_path / "copy")
    assert os.stat(os.path.join(c, _shards(a)[0])).st_ino != os.stat(
        os.path.join(a, _shards(a)[0])).st_ino
    ia, ic = checkpoint_identity(a, _shards(a), SIDE), checkpoint_identity(c, _shards(c), SIDE)
    assert ia == ic and ia.digest() == ic.digest()
    assert identity_mismatch([ia, ic, ia]) is None


def test_other_seed_same_headers_differs_in_data_and_names_the_first_file(two_seeds):
    a, b, seed1 = two_seeds
    ia, ib = checkpoint_identity(a, _shards(a), SIDE), checkpoint_identity(b, _shards(b), SIDE)
    # same shapes and names: the headers and sizes agree, only the data differs
    assert [(f.name, f.size, f.header_sha256) for f in ia.files if f.sample_sha256] == \
        [(f.name, f.size, f.header_sha256) for f in ib.files if f.sample_sha256]
    msg = identity_mismatch([ia, ia, ia, ib])
    assert msg is not None
    first = _shards(a)[0]
    assert f"file {first} differs in its data on rank 3 " in msg, msg
    assert "ranks 0-2: " in msg and "rank 3: " in msg, msg
    msg = identity_mismatch([ia, checkpoint_identity(seed1, _shards(seed1), SIDE)])
    assert f"file {first} differs in its header on rank 1 " in msg, msg


def test_a_change_in_one_sampled_block_is_seen(tmp_path):
    # a shard whose data region is larger than the samples: change the last byte only
    p = synthesize(str(tmp_path / "c"), "llama", "tiny", seed=0)
    name = _shards(p)[0]
    before = checkpoint_identity(p, [name])
    path = os.path.join(p, name)
    assert os.path.getsize(path) > 64 * SAMPLE_BYTES
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    after = checkpoint_identity(p, [name])
    assert after.files[0].differs_in(before.files[0]) == "data"


def test_manifest_present_on_one_rank_only_is_named(two_seeds, tmp_path):
    a, *_ = two_seeds
    c = shutil.copytree(a, tmp_path / "copy")
    with_m = checkpoint_identity(a, _shards(a), SIDE)
    if os.path.exists(os.path.join(c, SIDE[0])):
        os.remove(os.path.join(c, SIDE[0]))
    else:
        with open(os.path.join(c, SIDE[0]), "w") as f:
            f.write("{}")
    msg = identity_mismatch([with_m, checkpoint_identity(c, _shards(c), SIDE)])
    assert msg is not None and f"file {SIDE[0]} differs" in msg and "rank 1" in msg, msg


@pytest.mark.slow
def test_ranks_on_copies_with_other_data_stop_naming_the_rank_and_file(two_seeds, tmp_path):
    a, b, _ = two_seeds
    for r, (rc, err) in _load_two(tmp_path, [a, b]).items():
        assert rc == 1, (r, err)
        line = rank_line(err, r)
        assert "phase metadata-assemble: " in line and "CheckpointError" in line, line
        assert f"file {_shards(a)[0]} differs in its data on rank 1 " in line, line


def test_metadata_handed_in_is_checked_against_the_files_as_they_are(two_seeds):
    """With metadata read earlier and handed to the load, a file whose header changed since
    (same size) had its new state recorded as seen, so the old header put back with other
    data during the load loaded that data; refused at the fingerprint now."""
    import dataclasses

    import coordloader as cl
    from coordloader.errors import CheckpointError
    a, _, _ = two_seeds
    meta = cl.read_checkpoint(a)
    assert checkpoint_identity(a, _shards(a), SIDE, read_from=meta.files) == \
        checkpoint_identity(a, _shards(a), SIDE)
    other = tuple(dataclasses.replace(f, header_sha256="0" * 64) if i == 1 else f
                  for i, f in enumerate(meta.files))
    with pytest.raises(CheckpointError) as e:
        checkpoint_identity(a, _shards(a), SIDE, read_from=other)
    assert str(e.value) == (f"file {meta.files[1].name}: file's header is not what it was when "
                            f"the metadata handed in was read: it changed since; read the "
                            f"checkpoint again")


def test_the_record_of_headers_read_is_bounded(tmp_path, monkeypatch):
    """A serving or RL process reading new step-N directories for ever kept one record per
    file path ever read (about 600 B each, deleted directories too): unbounded growth.
    The newest are kept; a file read longer ago is checked as one never read."""
    from coordloader.checkpoint import reader
    from coordloader.checkpoint.reader import read_checkpoint

    from stfiles import write_st
    monkeypatch.setattr(reader, "HEADERS_SEEN_MAX", 5)
    monkeypatch.setattr(reader, "_HEADERS_SEEN", type(reader._HEADERS_SEEN)())
    for step in range(12):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        write_st(str(d / "model.safetensors"), [("w", "F32", (4,))])
        read_checkpoint(str(d))
    seen = list(reader._HEADERS_SEEN)
    assert len(seen) == 5
    assert seen == [str(tmp_path / f"step-{s}" / "model.safetensors") for s in range(7, 12)]


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow   # rank processes
@pytest.mark.skipif(not _unshare_works(), reason="needs mount namespaces (unshare -m, root)")
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_dump_into_node_local_directories_holding_another_dump_is_refused(two_seeds,
                                                                            tmp_path,
                                                                            overwrite):
    """--dump DIR, one path on every node, each node's own disk (a mount namespace per
    rank here): node 1's held rank-00000 of another load, which no rank of node 1 writes;
    only rank 0 looked for other ranks' files, so the load exited 0 and node 1's
    directory held two loads' files. Refused now; with --overwrite (which the refusal
    advises) the earlier load's file is removed once every rank has written its own."""
    a, _, _ = two_seeds
    dump, disks = tmp_path / "dump", [tmp_path / "disk0", tmp_path / "disk1"]
    for d in (dump, *disks):
        d.mkdir()
    (disks[1] / "rank-00000.safetensors").write_bytes(b"an earlier dump's file")
    port = free_port()

    def start(r):
        env = rank_env(port, r, 2, LOCAL_RANK="0", OMP_NUM_THREADS="1")
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               'mount --bind "$0" "$1" && shift && exec "$@"', str(disks[r]), str(dump),
               sys.executable, "-m", "coordloader.load", a, "--tp", "2", "--engine", "cpu",
               "--timeout", "30", "--quiet", "--dump", str(dump)] + (
                   ["--overwrite"] if overwrite else [])
        with open(tmp_path / f"err-{r}", "wb") as ef:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=ef,
                                    start_new_session=True)

    procs, _, _ = run_ranks(range(2), start, 90)
    if overwrite:
        for r, p in procs.items():
            assert p.returncode == 0, (r, (tmp_path / f"err-{r}").read_text())
        assert os.listdir(disks[0]) == ["rank-00000.safetensors"]
        assert os.listdir(disks[1]) == ["rank-00001.safetensors"]   # the earlier one gone
        return
    for r, p in procs.items():
        err = (tmp_path / f"err-{r}").read_text()
        assert p.returncode == 1, (r, err)
        assert "phase dump-check: rank 1: SaveError" in err and "holds rank-00000" in err, err
    assert sorted(os.listdir(disks[0])) == [] and sorted(os.listdir(disks[1])) == [
        "rank-00000.safetensors"]


@pytest.mark.slow   # rank processes
def test_ranks_with_another_config_json_are_told_so(tmp_path):
    """Byte-identical weights, node 1's config.json stating other head counts (still
    consistent with the shapes): the plans differ and the message sent the user to the
    layout, rules or coordloader version; config.json is not in the files' fingerprint
    (fields that change no weight may differ), so it was never named."""
    import json

    from hfmodels import write_llama
    a, b = tmp_path / "node0", tmp_path / "node1"
    write_llama(str(a))
    shutil.copytree(a, b)
    cfg = json.loads((b / "config.json").read_text())
    cfg.update(num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    (b / "config.json").write_text(json.dumps(cfg))
    for r, (rc, err) in _load_two(tmp_path, [a, b]).items():
        assert rc == 1, (r, err)
        line = rank_line(err, r)
        assert "phase plan-agree" in line and "ranks disagree on the plan digest" in line, line
        assert ("the model config (config.json, or --config / config=) differs between "
                "ranks (config digest: rank 0 '") in line and "give every node the same config" in line


@pytest.mark.slow   # rank processes
def test_a_copy_with_a_tensor_more_names_the_file_not_the_healthy_copy(two_seeds, tmp_path):
    """Node 1's copy holds an extra tensor in one shard: every rank said rank 0's intact
    copy had a tensor "in the file but not in the index" (the headers were checked
    against each rank's own index before the fingerprints were compared)."""
    import torch
    from safetensors.torch import load_file, save_file
    a, _, _ = two_seeds
    b = tmp_path / "b"
    shutil.copytree(a, b)
    first = _shards(a)[0]
    t = load_file(str(b / first))
    t["extra.weight"] = torch.ones(4)
    save_file(t, str(b / first), metadata={"format": "pt"})
    for r, (rc, err) in _load_two(tmp_path, [a, b]).items():
        line = rank_line(err, r)
        assert rc == 1 and "phase metadata-assemble" in line, line
        assert f"ranks disagree on the checkpoint's identity: file {first} differs" in line
        assert "on rank 1" in line, line
