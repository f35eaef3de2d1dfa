"""Synthetic checkpoints and the safetensors writer.

Expected tensor tables are computed here from config.json keys with formulas written for the
test (not from coordloader.archs), so a wrong table in the generator fails these tests.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from coordloader import synth
from coordloader.checkpoint.fileio import header_bytes, write_safetensors, write_safetensors_stream
from coordloader.cli.synth import main as synth_main
from coordloader.errors import CoordloaderError, SaveError

ARCHS = ["llama", "qwen2", "qwen3_moe", "mixtral", "deepseek_v3", "bert"]
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


# ---------------------------------------------------------------- expected tables (formulas)

def _expect_decoder(cfg: dict) -> dict[str, tuple[str, tuple]]:
    """llama / qwen2 / qwen3_moe / mixtral, from the HF modeling code's parameter shapes."""
    dt = {"bfloat16": "BF16", "float32": "F32"}[cfg["torch_dtype"]]
    H, V, nh = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"]
    hd = cfg["head_dim"] if "head_dim" in cfg else H // nh
    want: dict[str, tuple[str, tuple]] = {"model.embed_tokens.weight": (dt, (V, H)),
                                          "model.norm.weight": (dt, (H,))}
    if not cfg["tie_word_embeddings"]:
        want["lm_head.weight"] = (dt, (V, H))
    for n in range(cfg["num_hidden_layers"]):
        L = f"model.layers.{n}"
        want[f"{L}.input_layernorm.weight"] = (dt, (H,))
        want[f"{L}.post_attention_layernorm.weight"] = (dt, (H,))
        for proj, rows in (("q", nh * hd), ("k", kv * hd), ("v", kv * hd)):
            want[f"{L}.self_attn.{proj}_proj.weight"] = (dt, (rows, H))
            if cfg["model_type"] == "qwen2":
                want[f"{L}.self_attn.{proj}_proj.bias"] = (dt, (rows,))
        want[f"{L}.self_attn.o_proj.weight"] = (dt, (H, nh * hd))
        if cfg["model_type"] == "qwen3_moe":
            want[f"{L}.self_attn.q_norm.weight"] = (dt, (hd,))
            want[f"{L}.self_attn.k_norm.weight"] = (dt, (hd,))
            E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
            want[f"{L}.mlp.gate.weight"] = (dt, (E, H))
            for e in range(E):
                want[f"{L}.mlp.experts.{e}.gate_proj.weight"] = (dt, (I, H))
                want[f"{L}.mlp.experts.{e}.up_proj.weight"] = (dt, (I, H))
                want[f"{L}.mlp.experts.{e}.down_proj.weight"] = (dt, (H, I))
        elif cfg["model_type"] == "mixtral":
            E, I = cfg["num_local_experts"], cfg["intermediate_size"]
            want[f"{L}.block_sparse_moe.gate.weight"] = (dt, (E, H))
            for e in range(E):
                want[f"{L}.block_sparse_moe.experts.{e}.w1.weight"] = (dt, (I, H))
                want[f"{L}.block_sparse_moe.experts.{e}.w3.weight"] = (dt, (I, H))
                want[f"{L}.block_sparse_moe.experts.{e}.w2.weight"] = (dt, (H, I))
        else:
            I = cfg["intermediate_size"]
            want[f"{L}.mlp.gate_proj.weight"] = (dt, (I, H))
            want[f"{L}.mlp.up_proj.weight"] = (dt, (I, H))
            want[f"{L}.mlp.down_proj.weight"] = (dt, (H, I))
    return want


def _expect_deepseek(cfg: dict) -> dict[str, tuple[str, tuple]]:
    H, V, nh = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    bo, bi = cfg["quantization_config"]["weight_block_size"]
    want: dict[str, tuple[str, tuple]] = {}

    def fp8(name, out_f, in_f):
        want[name + ".weight"] = ("F8_E4M3", (out_f, in_f))
        want[name + ".weight_scale_inv"] = ("F32", (math.ceil(out_f / bo), math.ceil(in_f / bi)))

    def bf16(name, *shape):
        want[name] = ("BF16", tuple(shape))

    bf16("model.embed_tokens.weight", V, H)
    bf16("model.norm.weight", H)
    bf16("lm_head.weight", V, H)
    n_layers = cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    for n in range(n_layers):
        L = f"model.layers.{n}"
        bf16(f"{L}.input_layernorm.weight", H)
        bf16(f"{L}.post_attention_layernorm.weight", H)
        fp8(f"{L}.self_attn.q_a_proj", cfg["q_lora_rank"], H)
        bf16(f"{L}.self_attn.q_a_layernorm.weight", cfg["q_lora_rank"])
        fp8(f"{L}.self_attn.q_b_proj", nh * qk, cfg["q_lora_rank"])
        fp8(f"{L}.self_attn.kv_a_proj_with_mqa", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H)
        bf16(f"{L}.self_attn.kv_a_layernorm.weight", cfg["kv_lora_rank"])
        fp8(f"{L}.self_attn.kv_b_proj", nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
            cfg["kv_lora_rank"])
        fp8(f"{L}.self_attn.o_proj", H, nh * cfg["v_head_dim"])
        if n < cfg["first_k_dense_replace"]:
            I = cfg["intermediate_size"]
            fp8(f"{L}.mlp.gate_proj", I, H)
            fp8(f"{L}.mlp.up_proj", I, H)
            fp8(f"{L}.mlp.down_proj", H, I)
        else:
            E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            bf16(f"{L}.mlp.gate.weight", E, H)
            want[f"{L}.mlp.gate.e_score_correction_bias"] = ("F32", (E,))
            for e in range(E):
                fp8(f"{L}.mlp.experts.{e}.gate_proj", I, H)
                fp8(f"{L}.mlp.experts.{e}.up_proj", I, H)
                fp8(f"{L}.mlp.experts.{e}.down_proj", H, I)
            SI = I * cfg["n_shared_experts"]
            fp8(f"{L}.mlp.shared_experts.gate_proj", SI, H)
            fp8(f"{L}.mlp.shared_experts.up_proj", SI, H)
            fp8(f"{L}.mlp.shared_experts.down_proj", H, SI)
        if n >= cfg["num_hidden_layers"]:  # MTP module
            bf16(f"{L}.embed_tokens.weight", V, H)
            bf16(f"{L}.enorm.weight", H)
            bf16(f"{L}.hnorm.weight", H)
            bf16(f"{L}.eh_proj.weight", H, 2 * H)
            bf16(f"{L}.shared_head.norm.weight", H)
            bf16(f"{L}.shared_head.head.weight", V, H)
    return want


def _expect_bert(cfg: dict) -> dict[str, tuple[str, tuple]]:
    H, V, I = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    want: dict[str, tuple[str, tuple]] = {}

    def lin(name, o, i):
        want[name + ".weight"] = ("F32", (o, i))
        want[name + ".bias"] = ("F32", (o,))

    def norm(name):
        want[name + ".weight"] = ("F32", (H,))
        want[name + ".bias"] = ("F32", (H,))

    want["bert.embeddings.word_embeddings.weight"] = ("F32", (V, H))
    P = cfg["max_position_embeddings"]
    want["bert.embeddings.position_embeddings.weight"] = ("F32", (P, H))
    want["bert.embeddings.token_type_embeddings.weight"] = ("F32", (cfg["type_vocab_size"], H))
    norm("bert.embeddings.LayerNorm")
    for n in range(cfg["num_hidden_layers"]):
        L = f"bert.encoder.layer.{n}"
        for part in ("query", "key", "value"):
            lin(f"{L}.attention.self.{part}", H, H)
        lin(f"{L}.attention.output.dense", H, H)
        norm(f"{L}.attention.output.LayerNorm")
        lin(f"{L}.intermediate.dense", I, H)
        lin(f"{L}.output.dense", H, I)
        norm(f"{L}.output.LayerNorm")
    lin("bert.pooler.dense", H, H)
    want["cls.predictions.bias"] = ("F32", (V,))
    lin("cls.predictions.transform.dense", H, H)
    norm("cls.predictions.transform.LayerNorm")
    lin("cls.seq_relationship", 2, H)
    return want


def expected(cfg: dict) -> dict[str, tuple[str, tuple]]:
    if cfg["model_type"] == "deepseek_v3":
        return _expect_deepseek(cfg)
    if cfg["model_type"] == "bert":
        return _expect_bert(cfg)
    return _expect_decoder(cfg)


# ---------------------------------------------------------------- reading helpers

def read_header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def checkpoint_headers(root: str) -> dict[str, dict]:
    """file -> header, through the index when there is one."""
    idx = os.path.join(root, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    return {name: read_header(os.path.join(root, name))[1] for name in files}


def table_of(headers: dict[str, dict]) -> dict[str, tuple[str, tuple]]:
    out = {}
    for hdr in headers.values():
        for k, v in hdr.items():
            if k != "__metadata__":
                assert k not in out, f"{k} in two files"
                out[k] = (v["dtype"], tuple(v["shape"]))
    return out


def data_bytes(headers: dict[str, dict]) -> int:
    return sum(v["data_offsets"][1] - v["data_offsets"][0]
               for h in headers.values() for k, v in h.items() if k != "__metadata__")


# ---------------------------------------------------------------- tiny checkpoints

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {a: synth.synthesize(str(root / a), a, "tiny", seed=7) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_matches_config_formulas_and_opens_with_hf(tiny, arch):
    root = tiny[arch]
    with open(os.path.join(root, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == arch
    headers = checkpoint_headers(root)
    got = table_of(headers)
    want = expected(cfg)
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not bad, bad
    total = data_bytes(headers)
    assert total == sum(math.prod(s) * ITEMSIZE[d] for d, s in want.values())
    assert total < 16 << 20  # "tiny": a few MB (deepseek_v3 ~10 MB: 128-blocks at tp 8)
    idx = os.path.join(root, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            index = json.load(f)
        assert index["metadata"]["total_size"] == total
        assert set(index["weight_map"]) == set(want)
        for name, fname in index["weight_map"].items():
            assert name in headers[fname]
    # HF safetensors opens every file; values are finite, small and not all zero.
    seen = 0
    for fname, hdr in headers.items():
        path = os.path.join(root, fname)
        assert os.path.getsize(path) == 8 + read_header(path)[0] + max(
            v["data_offsets"][1] for k, v in hdr.items() if k != "__metadata__")
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert tuple(t.shape) == want[name][1]
                x = t.float()
                assert torch.isfinite(x).all(), name
                assert x.abs().max() < 2, name
                assert (x != 0).any(), name
                if name.endswith("_scale_inv"):
                    assert (x > 0).all(), name
                seen += 1
    assert seen == len(want)


def test_tiny_dims_divisible_for_tp8(tiny):
    for arch in ARCHS:
        with open(os.path.join(tiny[arch], "config.json")) as f:
            cfg = json.load(f)
        assert cfg["num_attention_heads"] % 8 == 0, arch
        assert cfg["intermediate_size"] % 8 == 0, arch
    with open(os.path.join(tiny["bert"], "config.json")) as f:
        assert json.load(f)["vocab_size"] % 64 != 0  # exercises vocab padding
    with open(os.path.join(tiny["deepseek_v3"], "config.json")) as f:
        ds = json.load(f)
    # Per-rank FP8 splits stay whole 128-blocks up to tp 8 (q_b, kv_b colwise; o_proj rowwise).
    heads = ds["num_attention_heads"] // 8
    assert heads * (ds["qk_nope_head_dim"] + ds["qk_rope_head_dim"]) % 128 == 0
    assert heads * (ds["qk_nope_head_dim"] + ds["v_head_dim"]) % 128 == 0
    assert heads * ds["v_head_dim"] % 128 == 0
    assert ds["intermediate_size"] // 8 % 128 == 0 and ds["moe_intermediate_size"] // 8 % 128 == 0


def test_deepseek_tiny_has_mtp_and_shard_names(tiny):
    root = tiny["deepseek_v3"]
    files = sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))
    assert files == [f"model-0000{i}-of-000003.safetensors" for i in (1, 2, 3)]
    got = table_of(checkpoint_headers(root))
    assert "model.layers.2.eh_proj.weight" in got  # num_hidden_layers = 2 -> MTP is layer 2
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"


def test_files_keep_elements_aligned(tiny):
    for arch in ARCHS:
        for fname, hdr in checkpoint_headers(tiny[arch]).items():
            for k, v in hdr.items():
                if k != "__metadata__":
                    assert v["data_offsets"][0] % ITEMSIZE[v["dtype"]] == 0, (arch, fname, k)


# ---------------------------------------------------------------- determinism

def _tensors(root):
    out = {}
    for fname in checkpoint_headers(root):
        out.update({k: t.reshape(-1).view(torch.uint8)
                    for k, t in load_file(os.path.join(root, fname)).items()})
    return out


def test_deterministic_by_seed_and_independent_of_sharding(tmp_path):
    a = synth.synthesize(str(tmp_path / "a"), "qwen3_moe", "tiny", seed=3)
    b = synth.synthesize(str(tmp_path / "b"), "qwen3_moe", "tiny", seed=3)
    c = synth.synthesize(str(tmp_path / "c"), "qwen3_moe", "tiny", seed=4)
    d = synth.synthesize(str(tmp_path / "d"), "qwen3_moe", "tiny", seed=3, shards=5)
    for fname in os.listdir(a):
        with open(os.path.join(a, fname), "rb") as f1, open(os.path.join(b, fname), "rb") as f2:
            assert f1.read() == f2.read(), fname
    ta, tc, td = _tensors(a), _tensors(c), _tensors(d)
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) == 5
    assert ta.keys() == tc.keys() == td.keys()
    assert all(torch.equal(ta[k], td[k]) for k in ta)
    assert not any(torch.equal(ta[k], tc[k]) for k in ta)
    # Different tensors of the same shape differ (shifted/swapped slices stay detectable).
    assert not torch.equal(ta["model.layers.0.mlp.experts.0.up_proj.weight"],
                           ta["model.layers.0.mlp.experts.1.up_proj.weight"])


def test_file_content_is_tensor_bytes_for_any_chunking(tiny):
    root = tiny["deepseek_v3"]
    for fname in checkpoint_headers(root):
        with safe_open(os.path.join(root, fname), framework="pt") as f:
            for name in list(f.keys())[:40]:
                t = f.get_tensor(name)
                raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
                dt = read_header(os.path.join(root, fname))[1][name]["dtype"]
                assert raw == synth.tensor_bytes(7, name, dt, tuple(t.shape)), name
    want = synth.tensor_bytes(1, "x", "BF16", (3, 1001))
    for chunk in (8, 1000, 1003, 5):
        got = b"".join(bytes(c) for c in synth.tensor_chunks(1, "x", "BF16", (3, 1001), chunk))
        assert got == want, chunk


# ---------------------------------------------------------------- full, metadata only

def _disk_bytes(root):
    return sum(os.stat(os.path.join(root, f)).st_blocks * 512 for f in os.listdir(root))


def test_qwen3_moe_full_metadata_only(tmp_path):
    t0 = time.perf_counter()
    root = synth.synthesize(str(tmp_path / "q"), "qwen3_moe", "full", metadata_only=True)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60
    headers = checkpoint_headers(root)
    assert len(headers) == 16
    assert data_bytes(headers) == 61_064_245_248  # the published index total_size
    with open(os.path.join(root, "model.safetensors.index.json")) as f:
        assert json.load(f)["metadata"]["total_size"] == 61_064_245_248
    with open(os.path.join(root, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"],
            cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == \
        (2048, 768, 128, 48, 4, 151936)
    assert table_of(headers) == expected(cfg)
    assert _disk_bytes(root) < 50 << 20
    # A hole reads back as zeros through the HF library.
    name = "model.layers.47.mlp.experts.127.down_proj.weight"
    fname = next(f for f, h in headers.items() if name in h)
    with safe_open(os.path.join(root, fname), framework="pt") as f:
        t = f.get_slice(name)[:2]
        assert t.shape == (2, 768) and not t.float().any()


@pytest.mark.slow
def test_deepseek_v3_full_metadata_only(tmp_path):
    t0 = time.perf_counter()
    root = synth.synthesize(str(tmp_path / "ds"), "deepseek_v3", "full", metadata_only=True)
    assert time.perf_counter() - t0 < 60
    shards = sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))
    assert len(shards) == 163
    assert shards[0] == "model-00001-of-000163.safetensors"
    assert shards[-1] == "model-00163-of-000163.safetensors"
    headers = checkpoint_headers(root)
    assert set(headers) == set(shards)
    with open(os.path.join(root, "config.json")) as f:
        cfg = json.load(f)
    got = table_of(headers)
    assert len(got) == 91_991  # tensors in the published checkpoint
    assert got == expected(cfg)
    # Element count of the published checkpoint (weights + scales), 684,531,386,000.
    assert sum(math.prod(s) for _, s in got.values()) == 684_531_386_000
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert _disk_bytes(root) < 50 << 20
    sizes = [os.path.getsize(os.path.join(root, f)) for f in shards]
    assert max(sizes) < 6e9  # about 4.2 GB a shard, like the published one


def test_published_totals_by_formula():
    # Index total_size of the published checkpoints, from the test's own formulas.
    def total(cfg):
        return sum(math.prod(s) * ITEMSIZE[d] for d, s in expected(cfg).values())
    assert total(synth.arch_config("llama", "full")) == 16_060_522_496
    assert total(synth.arch_config("qwen2", "full")) == 15_231_233_024
    assert total(synth.arch_config("mixtral", "full")) == 93_405_585_408
    assert total(synth.arch_config("qwen3_moe", "full")) == 61_064_245_248


def test_arch_tensors_for_deepseek_full():
    # (its speed is a bench figure, not a unit-test bound)
    cfg, specs = synth.arch_tensors("deepseek_v3", "full")
    assert len(specs) == 91_991 and cfg["num_hidden_layers"] == 61


def test_arch_config_returns_copies_and_rejects_unknown():
    a = synth.arch_config("llama", "tiny")
    a["hidden_size"] = -1
    assert synth.arch_config("llama", "tiny")["hidden_size"] != -1
    with pytest.raises(CoordloaderError, match="unknown arch"):
        synth.arch_config("gpt2", "tiny")
    with pytest.raises(CoordloaderError, match="unknown size"):
        synth.arch_config("llama", "huge")


# ---------------------------------------------------------------- output directory handling

def test_refuses_non_empty_out_and_overwrites_on_request(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(SaveError, match="not empty"):
        synth.synthesize(str(out), "llama", "tiny")
    assert os.listdir(out) == ["keep.txt"]
    # overwrite replaces checkpoint files only: the user's own file is never deleted
    with pytest.raises(SaveError, match="holds 'keep.txt', which is not a checkpoint file"):
        synth.synthesize(str(out), "llama", "tiny", overwrite=True)
    assert os.listdir(out) == ["keep.txt"]
    os.remove(out / "keep.txt")
    synth.synthesize(str(out), "llama", "tiny", shards=2)
    (out / "coordloader.manifest.json").write_text("{}")
    synth.synthesize(str(out), "llama", "tiny", overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if p != "o"]  # no temp dirs left behind


def test_an_output_that_cannot_be_made_is_a_save_error(tmp_path, monkeypatch):
    """A parent that is a file failed with a bare FileExistsError; a failing move into
    place with an untyped OSError, the previous contents left aside."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SaveError) as e:
        synth.synthesize(str(tmp_path / "afile" / "sub"), "llama", "tiny")
    assert str(e.value) == (f"file {tmp_path / 'afile' / 'sub'}: cannot create the output "
                            f"directory: File exists")
    out = tmp_path / "o"
    out.mkdir()
    (out / "config.json").write_text("x")
    real = os.rename

    def rename(a, b):
        if os.path.basename(str(a)).startswith(".o.synth-") and not str(a).endswith(".old"):
            raise OSError(13, "Permission denied")
        return real(a, b)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(SaveError, match="cannot move the new checkpoint into place: Permission "
                                        "denied; nothing replaced"):
        synth.synthesize(str(out), "llama", "tiny", overwrite=True)
    assert os.listdir(out) == ["config.json"] and (out / "config.json").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["afile", "o"]


def test_empty_out_dir_is_filled(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    synth.synthesize(str(out), "bert", "tiny")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_overwrite_never_deletes_what_is_not_a_checkpoint(tmp_path, monkeypatch):
    """--overwrite deleted OUT whole (the user's files and subdirectories with it), and an
    empty OUT (an unset shell variable) named the current directory."""
    out = tmp_path / "o"
    synth.synthesize(str(out), "llama", "tiny")

    def refused(first):
        with pytest.raises(SaveError, match=f"holds '{first}', which is not a checkpoint file"):
            synth.synthesize(str(out), "llama", "tiny", overwrite=True)

    (out / "notes.txt").write_text("x")
    (out / "sub").mkdir()
    (out / "sub" / "y").write_text("y")
    refused("notes.txt")
    os.remove(out / "notes.txt")
    refused("sub")
    assert (out / "sub" / "y").read_text() == "y"
    shutil.rmtree(out / "sub")
    (out / "old.safetensors").mkdir()   # a directory, whatever its name
    refused("old.safetensors")
    os.rmdir(out / "old.safetensors")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["o"]
    monkeypatch.chdir(out)
    (out / "keep.txt").write_text("x")
    with pytest.raises(SaveError, match="empty path"):
        synth.synthesize("", "llama", "tiny", overwrite=True)
    assert synth_main(["", "--arch", "llama", "--overwrite"]) == 1
    assert (out / "keep.txt").read_text() == "x"


def _hook_renames(monkeypatch, out, *, aside=None, swapped=None) -> list:
    """Patch os.rename around an overwrite of ``out``: ``aside()`` runs just before OUT is
    moved aside, ``swapped(moved)`` just after the new checkpoint is renamed into OUT.
    -> the list the moved-aside path is appended to."""
    real_rename = os.rename
    moved: list = []

    def rename(a, b):
        moving_out = os.path.abspath(a) == str(out) and not os.path.islink(a)
        if moving_out and aside is not None:
            aside()
        real_rename(a, b)
        if moving_out:
            moved.append(b)
        elif moved and os.path.abspath(b) == str(out) and swapped is not None:
            swapped(moved[0])
    monkeypatch.setattr(os, "rename", rename)
    return moved


def test_a_file_added_to_out_just_before_the_swap_is_kept(tmp_path, monkeypatch):
    """A file made in OUT between the last check and the move aside was deleted with the
    previous checkpoint: it is now found in the moved directory, and OUT is put back."""
    out = tmp_path / "o"
    synth.synthesize(str(out), "llama", "tiny")
    before = sorted(os.listdir(out))
    _hook_renames(monkeypatch, out, aside=lambda: (out / "notes.txt").write_text("mine"))
    with pytest.raises(SaveError, match="gained 'notes.txt', which is not a checkpoint file, "
                                        "while writing; nothing replaced") as ei:
        synth.synthesize(str(out), "llama", "tiny", overwrite=True)
    assert ei.value.file == str(out)
    monkeypatch.undo()
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(out)) == sorted(before + ["notes.txt"])
    assert sorted(os.listdir(tmp_path)) == ["o"]


def test_a_file_written_into_the_replaced_out_after_the_swap_is_kept(tmp_path, monkeypatch):
    """A process whose working directory is OUT writes into the moved-aside directory: the
    file was deleted with it (rmtree). Only the checked checkpoint files are removed now,
    and the directory is kept, with a warning naming it, when anything else is left."""
    out = tmp_path / "o"
    synth.synthesize(str(out), "llama", "tiny")
    moved = _hook_renames(monkeypatch, out, swapped=lambda old: Path(old, "late.txt").write_text(
        "mine"))
    with pytest.warns(UserWarning, match=r"the new checkpoint is in place; the previous one "
                                         r"could not be removed whole and is kept in .* "
                                         r"\(late.txt\)"):
        synth.synthesize(str(out), "llama", "tiny", overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert open(os.path.join(moved[0], "late.txt")).read() == "mine"
    assert os.listdir(moved[0]) == ["late.txt"]


def test_out_swapped_for_a_link_while_writing_deletes_nothing_behind_it(tmp_path,
                                                                        monkeypatch):
    """OUT replaced by a symbolic link between the last check and the move aside: the
    removal then listed the link's target and deleted its checkpoint files."""
    out, victim = tmp_path / "o", tmp_path / "victim"
    synth.synthesize(str(out), "llama", "tiny")
    synth.synthesize(str(victim), "llama", "tiny")

    def to_link():
        shutil.rmtree(out)
        out.symlink_to(victim)
    _hook_renames(monkeypatch, out, aside=to_link)
    with pytest.raises(SaveError, match="output path became a symbolic link while writing; "
                                        "nothing replaced") as ei:
        synth.synthesize(str(out), "llama", "tiny", overwrite=True)
    assert ei.value.file == str(out)
    monkeypatch.undo()
    assert sorted(os.listdir(victim)) == ["config.json", "model.safetensors"]
    assert out.is_symlink()


def test_a_symlink_out_is_refused(tmp_path):
    """Replacing a link to a directory put a new directory in the link's place."""
    tgt = tmp_path / "tgt"
    synth.synthesize(str(tgt), "llama", "tiny")
    before = sorted(os.listdir(tgt))
    lnk = tmp_path / "lnk"
    lnk.symlink_to(tgt)
    for overwrite in (False, True):
        with pytest.raises(SaveError, match="symbolic link"):
            synth.synthesize(str(lnk), "llama", "tiny", overwrite=overwrite)
    os.remove(tgt / "config.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "lnk2").symlink_to(empty)
    with pytest.raises(SaveError, match="symbolic link"):
        synth.synthesize(str(tmp_path / "lnk2"), "llama", "tiny")
    assert lnk.is_symlink() and (tmp_path / "lnk2").is_symlink()
    assert sorted(os.listdir(tgt)) == [n for n in before if n != "config.json"]
    assert sorted(os.listdir(tmp_path)) == ["empty", "lnk", "lnk2", "tgt"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fds through /proc")
def test_fsync_makes_the_rename_into_out_durable(tmp_path, monkeypatch):
    """--fsync fsynced every file but not OUT's parent after the temp directory was renamed
    to OUT: a crash could still lose the whole checkpoint."""
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(a, b):
        events.append(("rename", os.fspath(b)))
        return real_rename(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    parent = os.path.realpath(tmp_path)
    out = os.path.join(parent, "o")
    for overwrite in (False, True):   # into an absent OUT, then over the previous one
        events.clear()
        synth.synthesize(out, "llama", "tiny", fsync=True, overwrite=overwrite)
        last = len(events) - 1 - events[::-1].index(("rename", out))
        assert ("fsync", parent) in events[last + 1:], events


def test_split_shards_exact_count():
    _, specs = synth.arch_tensors("mixtral", "tiny")
    for n in (1, 2, 3, 7, len(specs)):
        groups = synth.split_shards(specs, n)
        assert len(groups) == n and all(groups)
        assert [s for g in groups for s in g] == specs
    with pytest.raises(CoordloaderError):
        synth.split_shards(specs, len(specs) + 1)


# ---------------------------------------------------------------- CLI

@pytest.mark.slow   # two interpreters start
def test_cli(tmp_path):
    out = str(tmp_path / "cli")
    cmd = [sys.executable, "-m", "coordloader.synth", "--arch", "qwen3_moe", "--size", "tiny",
           out, "--shards", "3", "--seed", "5"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "117 tensors in 3 file(s)" in r.stdout
    assert os.path.exists(os.path.join(out, "model-00003-of-00003.safetensors"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("coordloader synth: SaveError: ")
    assert "not empty" in r.stderr
    # The remaining paths in-process (a subprocess costs a torch import each).
    assert synth_main([out, "--arch", "qwen3_moe", "--shards", "3", "--overwrite",
                       "--metadata-only"]) == 0
    with pytest.raises(SystemExit):
        synth_main(["--arch", "nope", out])


# ---------------------------------------------------------------- safetensors_io

def test_write_torch_tensors_roundtrip_hf(tmp_path):
    g = torch.Generator().manual_seed(0)
    ts = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "f32": torch.randn(7, generator=g),
        "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "strided": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }
    dt = {"bf16": "BF16", "fp8": "F8_E4M3", "f32": "F32", "i64": "I64", "bool": "BOOL",
          "scalar": "F16", "empty": "BF16", "strided": "F32"}
    path = str(tmp_path / "t.safetensors")
    entries = [(k, dt[k], list(v.shape), v) for k, v in ts.items()]
    size = write_safetensors(path, entries, {"format": "pt"})
    assert size == os.path.getsize(path)
    assert not os.path.exists(path + ".tmp")
    back = load_file(path)
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8),
                           v.contiguous().reshape(-1).view(torch.uint8)), k
    with open(path, "rb") as f:
        raw = f.read()
    assert raw.startswith(header_bytes(entries, {"format": "pt"}))
    n = struct.unpack("<Q", raw[:8])[0]
    assert n % 8 == 0 and raw[8 + n - 1:8 + n] in (b"}", b" ")
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_write_bytes_numpy_and_order(tmp_path):
    path = str(tmp_path / "b.safetensors")
    arr = np.arange(4, dtype=np.float32)
    write_safetensors(path, [("z", "U8", [3], b"\x01\x02\x03"), ("a", "F32", [4], arr),
                             ("m", "I16", [1], memoryview(b"\x05\x00"))])
    _, hdr = read_header(path)
    assert [k for k in hdr] == ["z", "a", "m"]
    assert hdr["a"]["data_offsets"] == [3, 19]
    back = load_file(path)
    assert back["a"].tolist() == [0, 1, 2, 3] and back["m"].item() == 5


def test_sparse_holes_use_no_disk(tmp_path):
    path = str(tmp_path / "s.safetensors")
    big = 256 << 20
    write_safetensors(path, [("hole", "U8", [big], None), ("x", "F32", [2], b"\0\0\x80?" * 2)],
                      sparse=True)
    st = os.stat(path)
    assert st.st_size > big and st.st_blocks * 512 < 1 << 20
    back = load_file(path)
    assert back["x"].tolist() == [1.0, 1.0]
    with safe_open(path, framework="pt") as f:
        assert not f.get_slice("hole")[:4096].any()


@pytest.mark.parametrize("entries,match", [
    ([("a", "F32", [2], b"123")], "expected 8"),
    ([("a", "F99", [1], b"1234")], "unknown dtype"),
    ([("a", "U8", [1], b"1"), ("a", "U8", [1], b"1")], "duplicate"),
    ([("a", "U8", [-1], b"")], "non-negative"),
    ([("a", "U8", [1.5], b"")], "non-negative"),
    ([("__metadata__", "U8", [1], b"1")], "reserved"),
    ([("a", "U8", [1], None)], "sparse=True"),
    ([("a", "U8", [1], object())], "raw bytes"),
])
def test_write_rejects_bad_entries(tmp_path, entries, match):
    path = str(tmp_path / "bad.safetensors")
    with pytest.raises(SaveError, match=match) as ei:
        write_safetensors(path, entries)
    assert ei.value.file == path
    assert not os.path.exists(path) and not os.path.exists(path + ".tmp")


def test_bad_metadata(tmp_path):
    with pytest.raises(SaveError, match="str -> str"):
        write_safetensors(str(tmp_path / "m.safetensors"), [("a", "U8", [1], b"1")], {"k": 1})


def test_failed_stream_keeps_previous_file(tmp_path):
    path = str(tmp_path / "keep.safetensors")
    write_safetensors(path, [("a", "U8", [4], b"abcd")])
    before = open(path, "rb").read()

    def chunks():
        yield b"ab"
        raise RuntimeError("generator broke")
    with pytest.raises(RuntimeError):
        write_safetensors_stream(path, [("a", "U8", [4])], chunks())
    with pytest.raises(SaveError, match="gave 2 bytes"):
        write_safetensors_stream(path, [("a", "U8", [4])], iter([b"xy"]))
    with pytest.raises(SaveError, match="exceed"):
        write_safetensors_stream(path, [("a", "U8", [4])], iter([b"xyzzy"]))
    assert open(path, "rb").read() == before
    assert not os.path.exists(path + ".tmp")


@settings(deadline=None, max_examples=40)
@given(st.lists(st.tuples(st.sampled_from(["U8", "BF16", "F32", "F8_E4M3", "I64"]),
                          st.lists(st.integers(0, 5), max_size=3)), max_size=6),
       st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_header_valid_for_hf(tmp_path_factory, specs, metadata):
    sizes = {"U8": 1, "BF16": 2, "F32": 4, "F8_E4M3": 1, "I64": 8}
    entries = [(f"t{i}.w", d, s, bytes((i * 31 + j * 7) % 251 for j in range(
        math.prod(s) * sizes[d]))) for i, (d, s) in enumerate(specs)]
    path = str(tmp_path_factory.mktemp("h") / "h.safetensors")
    write_safetensors(path, entries, metadata or None)
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    assert (8 + n) % 8 == 0
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == {e[0] for e in entries}
        for k, d, s, data in entries:
            t = f.get_tensor(k)
            assert list(t.shape) == s
            if t.numel():
                assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == data


def test_prefetch_closed_early_does_not_wait_on_its_producer():
    """A consumer that stops after one item (an error mid-write) closes the generator at
    once: a producer blocked on a full queue, with its last item or with its end mark or
    error to hand over, sees the stop instead of the close waiting out its 5 s join."""
    import threading

    from coordloader.synth import _prefetch

    def failing():
        yield from range(3)
        raise ValueError("generation failed")

    for source in (lambda: iter(range(1000)), lambda: iter(range(3)), failing):
        g = _prefetch(source(), depth=2)
        assert next(g) == 0
        time.sleep(0.3)                  # the producer fills the queue and blocks
        t0 = time.perf_counter()
        g.close()
        assert time.perf_counter() - t0 < 1.0
        assert not any(t.name == "synth-gen" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("where", [".", ".."])
def test_synth_into_the_current_directory_is_refused(tmp_path, monkeypatch, where):
    """`synth .` in an empty directory renamed the new checkpoint over it: the caller's
    current directory was left deleted and empty, exit 0."""
    from coordloader.errors import SaveError
    here = tmp_path / "work" / "sub"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    with pytest.raises(SaveError, match="is the current directory or holds it"):
        synth.synthesize(where, "llama", "tiny")
    assert os.path.samefile(os.getcwd(), here) and os.listdir(here) == []
