"""coordloader.save on hand-made plans: format, replicas, padding, overwrite, disk-full,
crash between the shard writes and the index, distributed error agreement."""
from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import coordloader as cl
from coordloader.checkpoint.formats import HF_INDEX, SHARDED_INDEX, shard_name
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.dist.collective import free_port
from coordloader.errors import SaveError
from coordloader.handoff.consolidate import read_full
from coordloader.handoff.save import save
from coordloader.layout import Layout
from coordloader.planning.model import Piece, Plan, RankPlan, TensorSlice

from ranks import spawn_and_wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _full_tensors():
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(8, 6, generator=g),                       # colwise
        "b.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),    # rowwise (dim 1)
        "n.weight": torch.randn(6, generator=g),                          # replicated
        "embed.weight": torch.randn(10, 4, generator=g),                  # vocab, padded to 16
        "gate_up.weight": torch.randn(8, 3, generator=g),                 # packed: 2 blocks of 4
        "scalar": torch.tensor(3.5),                                      # 0-dim
    }


def _ts(name, full, local_shape, pieces, replica=0):
    from coordloader.checkpoint.dtypes import from_torch
    return TensorSlice(name, "f", from_torch(full.dtype), tuple(full.shape), tuple(local_shape),
                       tuple(Piece(tuple(s), tuple(d)) for s, d in pieces), replica, ())


def make_plan_and_locals():
    """A 2-rank plan touching every case save must handle, and each rank's local dict."""
    f = _full_tensors()
    slices = {0: [], 1: []}
    locs = {0: {}, 1: {}}
    for r in (0, 1):
        slices[r].append(_ts("a.weight", f["a.weight"], (4, 6), [(((4 * r, 4 * r + 4), (0, 6)), (0, 0))]))
        locs[r]["a.weight"] = f["a.weight"][4 * r:4 * r + 4].clone()
        slices[r].append(_ts("b.weight", f["b.weight"], (4, 3), [(((0, 4), (3 * r, 3 * r + 3)), (0, 0))]))
        locs[r]["b.weight"] = f["b.weight"][:, 3 * r:3 * r + 3].clone()
        slices[r].append(_ts("n.weight", f["n.weight"], (6,), [(((0, 6),), (0,))], replica=r))
        locs[r]["n.weight"] = f["n.weight"].clone()
        # vocab 10 padded to 16, 8 rows per rank: rank 0 rows 0..8, rank 1 rows 8..10 + 6 pad
        rows = (0, 8) if r == 0 else (8, 10)
        slices[r].append(_ts("embed.weight", f["embed.weight"], (8, 4), [((rows, (0, 4)), (0, 0))]))
        loc = torch.full((8, 4), 7.0)  # padding filled with junk: it must never be written
        loc[:rows[1] - rows[0]] = f["embed.weight"][rows[0]:rows[1]]
        locs[r]["embed.weight"] = loc
        # packed gate_up: blocks [0,4) and [4,8); rank r gets rows 2r..2r+2 of each block
        slices[r].append(_ts("gate_up.weight", f["gate_up.weight"], (4, 3), [
            (((2 * r, 2 * r + 2), (0, 3)), (0, 0)), (((4 + 2 * r, 4 + 2 * r + 2), (0, 3)), (2, 0))]))
        locs[r]["gate_up.weight"] = torch.cat([f["gate_up.weight"][2 * r:2 * r + 2],
                                               f["gate_up.weight"][4 + 2 * r:4 + 2 * r + 2]])
        slices[r].append(_ts("scalar", f["scalar"], (), [((), ())], replica=r))
        locs[r]["scalar"] = f["scalar"].clone()
    ranks = tuple(RankPlan(r, {"tp": r, "dp": 0, "pp": 0, "ep": 0, "moe_tp": r},
                           tuple(sorted(slices[r], key=lambda t: t.name))) for r in (0, 1))
    return Plan(Layout(tp=2), "fp", ranks), locs, f


CFG = {"model_type": "toy"}


def save_local(out, plan, locs, **kw):
    kw.setdefault("config", CFG)
    res = []
    for r in range(plan.world_size):
        res.append(save(out, locs[r], plan, rank=r, **kw))
    return res


def assert_equal_ckpt(out, full):
    meta = read_checkpoint(str(out))
    assert set(meta.tensors) == set(full)
    for n, t in full.items():
        got = read_full(meta, n)
        assert got.dtype == t.dtype and got.shape == t.shape, n
        assert torch.equal(got.view(-1).view(torch.uint8) if got.dim() else got.reshape(1).view(torch.uint8),
                           t.reshape(-1).contiguous().view(torch.uint8)), n
    return meta


def test_save_format_and_roundtrip(tmp_path):
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "ck"
    res = save_local(out, plan, locs, config={"model_type": "toy"})
    assert res[-1].published and not res[0].published
    names = sorted(os.listdir(out))
    assert names == sorted(["config.json", SHARDED_INDEX, shard_name(0, 0),
                            shard_name(1, 0), "coordloader.manifest.json"])
    # nothing an HF reader would take for its own checkpoint
    assert not [n for n in names if n.startswith("model") or n.endswith((".safetensors", HF_INDEX))]
    idx = json.loads((out / SHARDED_INDEX).read_text())
    sec = idx
    assert idx["format"] == "coordloader-sharded" and sec["version"] == 2 and sec["layout"]["tp"] == 2
    assert idx["model"] == {"preset": None, "architectures": [], "model_type": "toy"}
    # replicas written once, by the primary (rank 0)
    assert [p["file"] for p in sec["tensors"]["n.weight"]["pieces"]] == [
        shard_name(0, 0)]
    assert sec["tensors"]["n.weight"]["pieces"][0]["key"] == "n.weight"
    assert [p["key"] for p in sec["tensors"]["b.weight"]["pieces"]] == [
        "b.weight@0:4,0:3", "b.weight@0:4,3:6"]
    assert len(sec["tensors"]["gate_up.weight"]["pieces"]) == 4
    # padding rows never written: rank 1's piece of embed holds 2 rows
    emb = {p["key"]: p["box"] for p in sec["tensors"]["embed.weight"]["pieces"]}
    assert emb == {"embed.weight@0:8,0:4": [[0, 8], [0, 4]], "embed.weight@8:10,0:4": [[8, 10], [0, 4]]}
    assert idx["total_size"] == sum(t.numel() * t.element_size() for t in full.values())
    assert set(idx["tensors"]) == set(full)
    # shard files explain themselves
    from safetensors import safe_open
    with safe_open(str(out / shard_name(1, 0)), "pt") as f:
        md = f.metadata()
        assert json.loads(md["embed.weight@8:10,0:4"]) == {"name": "embed.weight", "shape": [10, 4],
                                                           "box": [[8, 10], [0, 4]]}
        assert f.get_tensor("embed.weight@8:10,0:4").shape == (2, 4)
        assert "n.weight" not in f.keys()
    assert json.loads((out / "config.json").read_text()) == {"model_type": "toy"}
    meta = assert_equal_ckpt(out, full)
    # the manifest (digests summed from the pieces while saving) matches a fresh re-read
    from coordloader.verify import manifest as mf
    m = mf.load_manifest(str(out), meta, required=True)
    fresh = mf.compute(meta)
    assert {n: d.digest for n, d in m.tensors.items()} == {n: d.digest for n, d in fresh.items()}


def test_max_shard_bytes_splits_parts(tmp_path):
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "ck"
    res = save_local(out, plan, locs, max_shard_bytes=40)
    assert len(res[0].files) > 2 and res[0].files[1] == shard_name(0, 1)
    assert_equal_ckpt(out, full)


def test_refuses_existing_checkpoint_and_overwrite_replaces(tmp_path):
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "ck"
    save_local(out, plan, locs, max_shard_bytes=40)
    before = sorted(os.listdir(out))
    with pytest.raises(SaveError, match="already exists.*overwrite=True"):
        save(out, locs[0], plan, rank=0, config=CFG)
    assert sorted(os.listdir(out)) == before
    (out / "notes.txt").write_text("user file")
    save_local(out, plan, locs, overwrite=True)  # one part per rank now
    assert sorted(os.listdir(out)) == sorted([SHARDED_INDEX, shard_name(0, 0),
                                              shard_name(1, 0), "notes.txt", "config.json",
                                              "coordloader.manifest.json"])
    assert_equal_ckpt(out, full)


@pytest.mark.parametrize("key, msg", [
    (0, "rank 0: a state dict key is the int 0; expected a tensor name (a str)"),
    ("bad\ud800name", "rank 0, tensor 'bad\\ud800name': tensor name holds a lone surrogate "
                       "(\\ud800-\\udfff), which is not UTF-8; expected a UTF-8 name")])
def test_a_key_no_reader_takes_as_a_name_is_refused_before_the_old_checkpoint_goes(
        tmp_path, key, msg):
    """A lone surrogate in a name was published (the old checkpoint replaced by one every
    reader refuses); an int key failed with a bare TypeError (a CollectiveError on ranks)."""
    out = tmp_path / "ck"
    save(out, {"ok": torch.ones(2)}, config={"model_type": "toy"})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SaveError) as e:
        save(out, {"ok": torch.ones(2), key: torch.zeros(3)}, config={"model_type": "toy"},
             overwrite=True, digests=False)
    assert str(e.value) == msg
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

def test_a_wrappers_state_dict_is_refused_naming_the_wrapper(tmp_path):
    """torch.compile(model).state_dict() names every tensor '_orig_mod.…', a DDP module's
    'module.…': saved as they were, from_pretrained of the checkpoint initialised every
    weight at random (its table of unexpected keys the only sign)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    compiled = torch.compile(model).state_dict()
    assert sorted(compiled) == ["_orig_mod.0.bias", "_orig_mod.0.weight", "_orig_mod.1.bias",
                                "_orig_mod.1.weight"]
    ddp = {"module." + k: v for k, v in model.state_dict().items()}
    cases = {"compiled": (compiled, "rank 0, tensor '_orig_mod.0.weight': tensor name holds "
                                    "'_orig_mod', a module torch.compile's wrapper adds: the "
                                    "state dict is the wrapper's, not the model's; pass the "
                                    "model's (torch.distributed.checkpoint.state_dict."
                                    "get_model_state_dict(model) leaves wrappers out) or "
                                    "rename the keys"),
             "ddp": (ddp, "rank 0, tensor 'module.0.weight': every tensor name starts with "
                          "'module.', the prefix DistributedDataParallel adds: the state dict "
                          "is the wrapper's; pass model.module.state_dict() (or "
                          "get_model_state_dict(model))")}
    for name, (state, msg) in cases.items():
        with pytest.raises(SaveError) as e:
            save(tmp_path / name, state, config=CFG)
        assert str(e.value) == msg
        assert not (tmp_path / name).exists() or not os.listdir(tmp_path / name)
    # a model whose own modules are named 'module' (not every name) saves
    save(tmp_path / "own", {"module.w": torch.ones(2), "head.w": torch.ones(2)}, config=CFG)
    assert sorted(read_checkpoint(str(tmp_path / "own")).tensors) == ["head.w", "module.w"]


@pytest.mark.parametrize("what", ["shape", "dtype", "missing"])
def test_a_replica_of_another_shape_or_dtype_is_refused(tmp_path, what):
    """A slice the plan gives a rank as a replica (rank 1's model.norm.weight at tp=2,
    written by rank 0) was not looked at: another shape or dtype, the sign of another
    state passed, saved without a word. One left out still saves: it is not written."""
    from coordloader.synth import synthesize
    src = synthesize(str(tmp_path / "src"), "llama", "tiny")
    plan = cl.make_plan(src, Layout(tp=2))
    name = "model.norm.weight"
    assert plan.rank(1).by_name()[name].replica == 1
    out = tmp_path / "out"
    save(out, cl.load(src, Layout(tp=2), rank=0), plan, rank=0, config=src)
    st = cl.load(src, Layout(tp=2), rank=1)
    if what == "missing":
        del st[name]
        save(out, st, plan, rank=1, config=src)
        assert torch.equal(cl.load(str(out), Layout())[name], cl.load(src, Layout())[name])
        return
    st[name] = torch.zeros(3, 7) if what == "shape" else st[name].float()
    with pytest.raises(SaveError) as e:
        save(out, st, plan, rank=1, config=src)
    assert str(e.value) == {
        "shape": f"rank 1, tensor '{name}': local shape [3, 7] differs from the plan's local "
                 f"shape [128] (global shape [128])",
        "dtype": f"rank 1, tensor '{name}': dtype torch.float32 differs from the checkpoint "
                 f"dtype BF16 (torch.bfloat16); convert before saving"}[what]


def test_a_boxed_tensor_under_a_plan_is_held_to_its_global_shape_and_dtype(tmp_path):
    """handoff.md: a wrong shape or dtype of any slice passed is refused. A Boxed tensor
    beside a plan's slices was held to neither: an fp32 norm (the plan: BF16) and a box of
    global shape [100] (the plan: [128]) saved and reloaded as written."""
    from coordloader.handoff.pieces import Boxed
    from coordloader.synth import synthesize
    src = synthesize(str(tmp_path / "src"), "llama", "tiny")
    plan = cl.make_plan(src, Layout())
    name = "model.norm.weight"
    st = cl.load(src, Layout())
    for value, msg in [
            (Boxed(st[name].float(), (128,), (0,)),
             "Boxed dtype torch.float32 differs from the checkpoint dtype BF16 "
             "(torch.bfloat16); convert before saving"),
            (Boxed(st[name][:100], (100,), (0,)),
             "Boxed global shape [100] differs from the plan's global shape [128]")]:
        with pytest.raises(SaveError) as e:
            save(tmp_path / "out", dict(st, **{name: value}), plan, config=src)
        assert str(e.value) == f"rank 0, tensor '{name}': {msg}"
    save(tmp_path / "out", dict(st, **{name: Boxed(st[name], (128,), (0,))}), plan, config=src)
    assert torch.equal(cl.load(str(tmp_path / "out"), Layout())[name], st[name])


def test_bad_inputs_name_tensor_and_rank(tmp_path):
    plan, locs, _ = make_plan_and_locals()
    bad = dict(locs[1])
    del bad["a.weight"]
    save(tmp_path / "x", locs[0], plan, rank=0, config=CFG)
    with pytest.raises(SaveError, match=r"rank 1, tensor 'a.weight': .*missing"):
        save(tmp_path / "x", bad, plan, rank=1, config=CFG)
    bad = dict(locs[0], **{"b.weight": locs[0]["b.weight"].float()})
    with pytest.raises(SaveError, match=r"tensor 'b.weight': dtype"):
        save(tmp_path / "y", bad, plan, rank=0, config=CFG)
    bad = dict(locs[0], **{"a.weight": torch.zeros(3, 6)})
    with pytest.raises(SaveError, match=r"local shape \[3, 6\]"):
        save(tmp_path / "z", bad, plan, rank=0, config=CFG)
    with pytest.raises(SaveError, match="in order"):
        save(tmp_path / "w", locs[1], plan, rank=1, config=CFG)
    assert not any(n.startswith(".coordloader") for n in os.listdir(tmp_path / "x"))
    for d in ("y", "z"):   # refused before anything was written
        assert not (tmp_path / d).exists()


def test_digest_failure_names_shard_tensor_and_rank(tmp_path, monkeypatch):
    """A piece that cannot be digested stops the save with an error naming the shard file,
    the tensor, the rank and the piece, not a bare exception from the digest thread."""
    from coordloader.errors import VerifyError
    from coordloader.verify import digest as dgm
    real = dgm.digest_many

    def failing(items, **kw):
        out = real(items, **kw)
        return [VerifyError("boom")] + out[1:]
    monkeypatch.setattr(dgm, "digest_many", failing)
    plan, locs, _ = make_plan_and_locals()
    with pytest.raises(SaveError, match=r"rank 0, file rank-00000-part-00000\.coordloader-shard, "
                                         r"tensor 'a\.weight': "
                                         r"cannot digest the piece \[\[.*: boom"):
        save(tmp_path / "x", locs[0], plan, rank=0, config=CFG)
    assert not any(n.startswith(".coordloader") for n in os.listdir(tmp_path / "x"))


@pytest.mark.parametrize("where", ["shard", "index"])
def test_disk_full_keeps_previous_state(tmp_path, monkeypatch, where):
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "ck"
    save_local(out, plan, locs)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    new_locs = {r: {k: v * 2 if v.is_floating_point() else v for k, v in locs[r].items()} for r in locs}
    real_write = os.write

    def full_disk(fd, data):
        if where == "shard" or len(bytes(data[:1])) and bytes(data[:1]) == b"{":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    if where == "shard":
        monkeypatch.setattr(os, "write", full_disk)
        with pytest.raises(SaveError, match=r"rank 0, file rank-00000-part-00000.coordloader-shard: "
                                            r"no space left on device"):
            save(out, new_locs[0], plan, rank=0, overwrite=True, config=CFG)
    else:
        save(out, new_locs[0], plan, rank=0, overwrite=True, config=CFG)
        monkeypatch.setattr(os, "write", full_disk)  # the JSON index/record writes fail
        with pytest.raises(SaveError, match="no space left on device"):
            save(out, new_locs[1], plan, rank=1, overwrite=True, config=CFG)
    monkeypatch.setattr(os, "write", real_write)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert_equal_ckpt(out, full)


def test_save_refuses_without_config_naming_the_argument(tmp_path):
    plan, locs, _ = make_plan_and_locals()
    with pytest.raises(SaveError, match=r"config= is required.*source checkpoint directory.*"
                                        r"config\.json"):
        save(tmp_path / "x", locs[0], plan, rank=0)
    assert not (tmp_path / "x").exists()


def test_save_copies_config_and_companion_files_and_records_the_preset(tmp_path):
    from coordloader.synth import synthesize
    src = synthesize(str(tmp_path / "src"), "llama", "tiny")
    extras = {"generation_config.json": '{"do_sample": false}', "tokenizer.json": "{}",
              "tokenizer_config.json": '{"chat_template": "x"}', "chat_template.jinja": "{{ x }}",
              "special_tokens_map.json": "{}"}
    for n, text in extras.items():
        (tmp_path / "src" / n).write_text(text)
    layout = Layout(tp=2)
    import coordloader as cl
    plan = cl.make_plan(src, layout)
    for r in range(2):
        save(tmp_path / "out", cl.load(src, layout, rank=r), plan, rank=r, config=src)
    # weights in other formats stay behind: transformers would load a stale
    # pytorch_model.bin (the pretrained weights) in preference to the saved ones
    weights = ["pytorch_model.bin", "model.pt", "tf_model.h5", "flax_model.msgpack",
               "pytorch_model.bin.index.json", "model.gguf",
               # a TF1 checkpoint and numpy weights were carried along
               "model.ckpt.index", "model.ckpt.data-00000-of-00001", "model.ckpt.meta",
               "model.ckpt-1000.index", "model.ckpt-1000.data-00000-of-00001", "weights.npz"]
    for n in weights:
        (tmp_path / "src" / n).write_bytes(b"old weights")
    for r in range(2):
        save(tmp_path / "out", cl.load(src, layout, rank=r), plan, rank=r, config=src,
             overwrite=True)
    for n, text in extras.items():
        assert (tmp_path / "out" / n).read_text() == text, n
    assert not [n for n in weights if (tmp_path / "out" / n).exists()]
    assert (tmp_path / "out" / "config.json").read_bytes() == (tmp_path / "src" / "config.json").read_bytes()
    idx = json.loads((tmp_path / "out" / SHARDED_INDEX).read_text())
    assert idx["model"]["preset"] == "llama" and idx["model"]["architectures"] == ["LlamaForCausalLM"]


# ---- training-side state: boxes given by hand, whole tensors, no plan -------------------

def test_save_without_a_plan_takes_whole_and_boxed_tensors(tmp_path):
    """A plain state dict saved in one call without a plan; and FSDP-style dim-0 shards
    that no plan describes (coordloader.Boxed) next to a plan's slices."""
    from coordloader.handoff.pieces import Boxed
    f = _full_tensors()
    save(tmp_path / "whole", f, config=CFG)
    assert_equal_ckpt(tmp_path / "whole", f)
    plan, locs, full = make_plan_and_locals()
    w = torch.randn(8, 5)
    rows = {0: (0, 5), 1: (5, 8)}      # 5 + 3 rows: no plan's split
    for r in range(2):
        a, b = rows[r]
        save(tmp_path / "boxed", dict(locs[r], fsdp=Boxed(w[a:b], w.shape, (a, 0))), plan,
             rank=r, config=CFG)
    assert_equal_ckpt(tmp_path / "boxed", dict(full, fsdp=w))


def test_one_element_views_of_any_stride_are_saved(tmp_path):
    """torch calls a one-element tensor contiguous whatever its stride (``b[1::2]`` of a
    2-vector, a column of a one-row matrix): its byte view was refused with torch's raw
    "stride(-1) must be 1" and the save failed."""
    b = torch.arange(2, dtype=torch.float16)
    m = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
    f = {"b": b[1::2], "col": m.t()[1:, :1], "ok": torch.arange(3, dtype=torch.float32)}
    assert f["b"].stride() == (2,) and f["col"].shape == (1, 1) and f["col"].stride() != (1, 1)
    save(tmp_path / "ck", f, config=CFG)
    assert_equal_ckpt(tmp_path / "ck", {k: v.clone(memory_format=torch.contiguous_format)
                                        for k, v in f.items()})


def test_local_save_writes_a_box_several_ranks_hold_once(tmp_path):
    """Saving plan ranks in turn, a Boxed box both ranks held was refused as an overlap;
    a distributed save writes it once, from the lowest rank."""
    from coordloader.handoff.pieces import Boxed
    plan, locs, full = make_plan_and_locals()
    rep = torch.randn(3, 3)
    for r in range(2):
        save(tmp_path / "rep", dict(locs[r], rep=Boxed(rep, rep.shape, (0, 0))), plan, rank=r,
             config=CFG)
    assert_equal_ckpt(tmp_path / "rep", dict(full, rep=rep))
    pieces = read_checkpoint(str(tmp_path / "rep")).tensors["rep"].pieces
    assert [p.file for p in pieces] == ["rank-00000-part-00000.coordloader-shard"]


def test_save_refuses_gaps_and_overlaps_naming_ranks(tmp_path):
    from coordloader.handoff.pieces import Boxed
    w = _full_tensors()["a.weight"]
    with pytest.raises(SaveError, match=r"tensor 'a.weight': the pieces saved by rank 0 hold "
                                        r"18 elements of the global shape \[8, 6\]"):
        save(tmp_path / "gap", {"a.weight": Boxed(w[0:3], w.shape, (0, 0))}, config=CFG)
    assert not (tmp_path / "gap").exists() or not os.listdir(tmp_path / "gap")
    plan, locs, _ = make_plan_and_locals()
    with pytest.raises(SaveError, match=r"tensor 'fsdp': the pieces saved by rank 0 \[0:5,0:6\] "
                                        r"and rank 1 \[4:8,0:6\] overlap"):
        for r, (a, b) in enumerate([(0, 5), (4, 8)]):
            save(tmp_path / "overlap", dict(locs[r], fsdp=Boxed(w[a:b], w.shape, (a, 0))), plan,
                 rank=r, config=CFG)
    assert not os.path.exists(tmp_path / "overlap" / SHARDED_INDEX)


def test_local_and_global_shapes_are_labelled(tmp_path):
    plan, locs, _ = make_plan_and_locals()
    bad = dict(locs[0], **{"a.weight": torch.zeros(8, 6)})
    with pytest.raises(SaveError, match=r"local shape \[8, 6\] differs from the plan's local shape "
                                        r"\[4, 6\] \(global shape \[8, 6\]\)"):
        save(tmp_path / "x", bad, plan, rank=0, config=CFG)


# ---- publish: a kill at any step leaves old, new, or a refusal that says how to recover

class _Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so no ``except Exception`` cleanup runs."""


def _publish_steps(run) -> list[str]:
    from coordloader.handoff import publish as pub
    steps = []
    pub._test_hook = steps.append
    try:
        run()
    finally:
        pub._test_hook = None
    return steps


def _kill_at(step, run):
    from coordloader.handoff import publish as pub

    def hook(s):
        if s == step:
            raise _Killed(s)
    pub._test_hook = hook
    try:
        with pytest.raises(_Killed):
            run()
    finally:
        pub._test_hook = None


def _state(out, old, new):
    """"old" / "new" as read by coordloader's reader, or "refused" (with the message every
    reader must give for an interrupted publish)."""
    from coordloader.errors import CheckpointError
    try:
        meta = read_checkpoint(str(out))
    except CheckpointError as e:
        assert "a save into this directory was interrupted" in str(e), str(e)
        assert "coordloader.recover_save(" in str(e) and "overwrite=True" in str(e), str(e)
        return "refused"
    got = {n: read_full(meta, n) for n in meta.tensors}
    for label, want in (("old", old), ("new", new)):
        if got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want):
            return label
    raise AssertionError(f"{out} reads as neither the old nor the new checkpoint: {sorted(got)}")


def _bump(locs):
    return {r: {k: v + 1 if v.is_floating_point() else v for k, v in locs[r].items()} for r in locs}


@pytest.mark.parametrize("previous", ["sharded", "hf"])
def test_save_killed_at_every_publish_step(tmp_path, previous):
    from coordloader.handoff.publish import recover_save
    plan, locs, full = make_plan_and_locals()
    old = {n: t + 1 if t.is_floating_point() else t for n, t in full.items()}

    def make_old(out):
        if previous == "sharded":
            save_local(out, plan, _bump(locs))
        else:   # a plain HF checkpoint (model.safetensors) with other tensor names too
            from safetensors.torch import save_file
            os.makedirs(out)
            save_file({n: t.contiguous() for n, t in old.items()}, str(out / "model.safetensors"))
    steps = _publish_steps(lambda: save_local(tmp_path / "rec", plan, locs))
    assert steps[:3] == ["staged", "marked", "old-entries-removed"] and steps[-1] == "published"
    assert sum(s.startswith("moved ") for s in steps) == 5 and steps[-3] == f"moved {SHARDED_INDEX}"
    seen = []
    for k, step in enumerate(steps):
        out = tmp_path / f"k{k}"
        make_old(out)
        _kill_at(step, lambda: save_local(out, plan, locs, overwrite=True))
        state = _state(out, old, full)
        seen.append(state)
        # before the marker: the old checkpoint; from it on: refused; after the publish: new
        want = "old" if k == 0 else "new" if step == "published" else "refused"
        assert state == want, (step, state)
        assert not (out / HF_INDEX).exists() or k == 0, step   # no old HF index over new files
        if previous == "sharded" and 2 <= k < steps.index(f"moved {SHARDED_INDEX}"):
            # the old index (named like the new one) is gone while new shards move in
            assert not (out / SHARDED_INDEX).exists(), step
        if state == "refused":
            assert recover_save(out) and _state(out, old, full) == "new"
            assert not [n for n in os.listdir(out) if n.startswith(".coordloader")]
            assert "model.safetensors" not in os.listdir(out)
        # a save run again over whatever the kill left succeeds
        save_local(out, plan, _bump(_bump(locs)), overwrite=True)
        twice = {n: (t + 1) + 1 if t.is_floating_point() else t for n, t in full.items()}
        assert _state(out, twice, full) == "old"
    assert seen.count("refused") == len(steps) - 2


@pytest.mark.parametrize("at", ["marked", "old-entries-removed", "moved"])
def test_an_interrupted_publish_whose_new_files_are_lost_is_replaced_by_overwrite(tmp_path, at):
    """The staging directory of an interrupted publish deleted by hand: recover_save must
    refuse without touching the directory (it removed the old index first), and the
    remedy it names, a save with overwrite=True, must work (it met the same refusal)."""
    from coordloader.errors import SaveError
    from coordloader.handoff.publish import recover_save
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "out"
    save_local(out, plan, _bump(locs))
    steps = _publish_steps(lambda: save_local(tmp_path / "rec", plan, locs))
    step = next(s for s in steps if s.startswith(at))
    _kill_at(step, lambda: save_local(out, plan, locs, overwrite=True))
    stage = [n for n in os.listdir(out) if n.startswith(".coordloader-staging-")]
    assert len(stage) == 1
    shutil.rmtree(out / stage[0])
    before = sorted(os.listdir(out))
    if at == "marked":
        # nothing moved yet, and the old files have the new ones' names: they read as
        # moved in, so recovery publishes the old checkpoint as it was
        old = {n: t + 1 if t.is_floating_point() else t for n, t in full.items()}
        assert recover_save(out) and _state(out, old, full) == "old"
        return
    with pytest.raises(SaveError) as e:
        recover_save(out)
    assert "is neither in the staging directory" in str(e.value), str(e.value)
    assert "save it again with overwrite=True" in str(e.value), str(e.value)
    assert sorted(os.listdir(out)) == before
    with pytest.raises(SaveError, match="neither in the staging directory") as e:
        save_local(out, plan, locs)
    assert e.value.rank == 0   # rank 0's call found the marker
    # an overwrite that fails before its own publish leaves the directory refused (it
    # dropped the marker first: the mix of files then read as a checkpoint)
    _kill_at("staged", lambda: save_local(out, plan, locs, overwrite=True))
    assert _state(out, {}, full) == "refused"
    save_local(out, plan, locs, overwrite=True)
    assert _state(out, {}, full) == "new"
    assert not [n for n in os.listdir(out) if n.startswith(".coordloader")]


def test_consolidate_killed_at_every_publish_step(tmp_path):
    from coordloader.handoff.consolidate import consolidate
    from coordloader.handoff.publish import recover_save
    plan, locs, full = make_plan_and_locals()
    src = tmp_path / "src"
    save_local(src, plan, locs)
    old_src = tmp_path / "old-src"
    save_local(old_src, plan, _bump(locs))
    old = {n: t + 1 if t.is_floating_point() else t for n, t in full.items()}
    steps = _publish_steps(lambda: consolidate(str(src), str(tmp_path / "rec")))
    for k, step in enumerate(steps):
        out = tmp_path / f"k{k}"
        consolidate(str(old_src), str(out))
        _kill_at(step, lambda: consolidate(str(src), str(out), overwrite=True))
        state = _state(out, old, full)
        assert state == ("old" if k == 0 else "new" if step == "published" else "refused"), step
        if state == "refused":
            assert recover_save(out) and _state(out, old, full) == "new"


def _config_dir(path, templates: dict) -> str:
    """A config directory as transformers writes it: config.json, the default chat
    template, and each other named one under additional_chat_templates/."""
    os.makedirs(path / "additional_chat_templates")
    (path / "config.json").write_text(json.dumps(CFG))
    (path / "chat_template.jinja").write_text("{{ messages }}")
    for name, text in templates.items():
        (path / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    return str(path)


def _templates(out) -> dict:
    d = out / "additional_chat_templates"
    return {n: (d / n).read_text() for n in sorted(os.listdir(d))} if d.exists() else {}


def test_named_chat_templates_travel_and_replace_the_old_ones_at_every_publish_step(tmp_path):
    """transformers writes every named chat template but the default as
    additional_chat_templates/NAME.jinja: save(config=DIR) and consolidate left that folder
    behind, the output's tokenizer silently down to its default template (a tool-use prompt
    rendered another way). Its files travel as companions, published under the marker
    like the rest; an old checkpoint's templates go with it, at every step a kill can
    interrupt."""
    from coordloader.handoff.consolidate import consolidate
    from coordloader.handoff.publish import recover_save
    plan, locs, full = make_plan_and_locals()
    new_cfg = _config_dir(tmp_path / "new-cfg", {"tool_use": "{{ tools }}"})
    old_cfg = _config_dir(tmp_path / "old-cfg", {"old": "old", "tool_use": "old tools"})
    out = tmp_path / "saved"
    save_local(out, plan, locs, config=new_cfg)
    assert _templates(out) == {"tool_use.jinja": "{{ tools }}"}
    hf = tmp_path / "hf"
    consolidate(str(out), str(hf))
    assert _templates(hf) == {"tool_use.jinja": "{{ tools }}"}
    assert (hf / "chat_template.jinja").read_text() == "{{ messages }}"
    old = {n: t + 1 if t.is_floating_point() else t for n, t in full.items()}
    steps = _publish_steps(lambda: save_local(tmp_path / "rec", plan, locs, config=new_cfg))
    assert "moved additional_chat_templates/tool_use.jinja" in steps
    for k, step in enumerate(steps):
        out = tmp_path / f"k{k}"
        save_local(out, plan, _bump(locs), config=old_cfg)
        _kill_at(step, lambda: save_local(out, plan, locs, overwrite=True, config=new_cfg))
        state = _state(out, old, full)
        if state == "refused":
            assert recover_save(out)
            state = _state(out, old, full)
        want = ({"old.jinja": "old", "tool_use.jinja": "old tools"} if state == "old"
                else {"tool_use.jinja": "{{ tools }}"})
        assert (state, _templates(out)) == ("old" if k == 0 else "new", want), step
        assert not [n for n in os.listdir(out) if n.startswith(".coordloader")], step
    # a new checkpoint bringing no named template removes the old ones and their folder
    out = tmp_path / "k0"
    save_local(out, plan, locs, overwrite=True)
    assert not (out / "additional_chat_templates").exists()


def test_a_folder_inside_the_chat_templates_folder_is_left_alone(tmp_path):
    """A folder in additional_chat_templates/ of the checkpoint being overwritten (Jupyter's
    .ipynb_checkpoints) was listed among its files; removing it failed after the publish
    marker, and recover_save and an overwrite failed on it again: the directory stuck."""
    plan, locs, full = make_plan_and_locals()
    cfg = _config_dir(tmp_path / "cfg", {"tool_use": "{{ tools }}"})
    out = tmp_path / "out"
    save_local(out, plan, _bump(locs), config=cfg)
    (out / "additional_chat_templates" / ".ipynb_checkpoints").mkdir()
    (out / "additional_chat_templates" / "notes").mkdir()
    save_local(out, plan, locs, overwrite=True)   # brings no template
    old = {n: t + 1 if t.is_floating_point() else t for n, t in full.items()}
    assert _state(out, old, full) == "new"
    assert sorted(os.listdir(out / "additional_chat_templates")) == [".ipynb_checkpoints",
                                                                      "notes"]


def test_named_chat_templates_of_a_hub_snapshot_travel(tmp_path):
    """A config folder laid out as the HF hub cache (each file a link into blobs/): the
    named templates, links, were dropped when folders in there were left out."""
    plan, locs, _ = make_plan_and_locals()
    cfg = tmp_path / "snapshot"
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "a").write_text(json.dumps(CFG))
    (blobs / "b").write_text("{{ tools }}")
    (cfg / "additional_chat_templates").mkdir(parents=True)
    os.symlink(blobs / "a", cfg / "config.json")
    os.symlink(blobs / "b", cfg / "additional_chat_templates" / "tool_use.jinja")
    out = tmp_path / "out"
    save_local(out, plan, locs, config=str(cfg))
    assert _templates(out) == {"tool_use.jinja": "{{ tools }}"}
    assert not os.path.islink(out / "additional_chat_templates" / "tool_use.jinja")


_HOLD_STAGE = """
import sys, time
from coordloader.handoff import publish as pub
out, step = sys.argv[1], sys.argv[2]
if step == "staged":
    pub.prepare_target(out, False, None, "other-writer")
else:   # a save paused in its publish, after the marker
    import torch
    import coordloader as cl
    def hook(s):
        if s == step:
            print("ready", flush=True)
            time.sleep(60)
    pub._test_hook = hook
    cl.save(out, {"w": torch.ones(4)}, config={"model_type": "toy"}, overwrite=True)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("step", ["staged", "marked"])
def test_a_second_writer_into_a_directory_another_is_writing_is_refused(tmp_path, step):
    """A consolidate started into a directory another one was still writing removed the
    live one's staging directory as a killed save's leftover (the first then failed late,
    naming only its own file), or finished the other's publish under way as an interrupted
    one and then replaced it. A live writer holds a lock on its stage: the second is
    refused, naming it; once the first is gone (killed), its leftovers are removed."""
    from coordloader.handoff.publish import recover_save
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "out"
    if step == "marked":
        save_local(out, plan, _bump(locs))
    child = subprocess.Popen([sys.executable, "-c", _HOLD_STAGE, str(out), step],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        doing = "writing into" if step == "staged" else "publishing into"
        with pytest.raises(SaveError) as ei:
            save_local(out, plan, locs, overwrite=True)
        assert f"another save or consolidate is {doing} this directory now" in str(ei.value)
        assert "in use by a live process or thread" in str(ei.value)
        assert [n for n in os.listdir(out) if n.startswith(".coordloader-staging-")]
    finally:
        child.kill()
        child.wait()
    if step == "marked":   # the killed publish is finished, then replaced
        assert recover_save(out)
    save_local(out, plan, locs, overwrite=True)
    old = {n: t + 1 if t.is_floating_point() else t for n, t in full.items()}
    assert _state(out, old, full) == "new"
    assert not [n for n in os.listdir(out) if n.startswith(".coordloader")]


@pytest.mark.parametrize("step", ["staged", "marked"])
def test_a_second_writer_in_another_thread_of_the_process_is_refused(tmp_path, monkeypatch,
                                                                     step):
    """A save in a background thread and a second one into the same directory: the
    second took the first's live stage for an earlier call's leftover (the lock tells no
    writer of one process apart), removed it, and published; the first then either said
    it had published though the directory held the second's tensors, or left its publish
    marker over the second's checkpoint. The stage's thread tells them apart now."""
    import threading

    from coordloader.handoff import publish as pub
    out = tmp_path / "out"
    if step == "marked":
        save(out, {"w": torch.zeros(4)}, config=CFG)
    held, go, got = threading.Event(), threading.Event(), {}

    def hook(s):
        if s == step and threading.current_thread().name == "first":
            held.set()
            assert go.wait(60)
    monkeypatch.setattr(pub, "_test_hook", hook)

    def first():
        try:
            got["first"] = save(out, {"w": torch.ones(4)}, config=CFG, overwrite=True)
        except Exception as e:   # noqa: BLE001 - reported by the assertion below
            got["first"] = e
    t = threading.Thread(target=first, name="first")
    t.start()
    try:
        assert held.wait(60)
        with pytest.raises(SaveError) as ei:
            save(out, {"w": torch.full((4,), 2.0)}, config=CFG, overwrite=True)
        doing = "writing into" if step == "staged" else "publishing into"
        assert f"another save or consolidate is {doing} this directory now" in str(ei.value)
        assert "in use by a live process or thread" in str(ei.value)
    finally:
        go.set()
        t.join(60)
    assert not isinstance(got["first"], Exception), got["first"]
    assert got["first"].published
    assert_equal_ckpt(out, {"w": torch.ones(4)})
    assert not [n for n in os.listdir(out) if n.startswith(".coordloader")]


def test_a_local_mode_save_restarts_from_another_thread(tmp_path):
    """A local-mode save's rank-0 call ran in a pool thread that stays alive, and the save
    was abandoned before rank 1: restarting it from the main thread was refused as a live
    writer for as long as the pool thread lived. A stage no call runs on is an earlier
    call's, whichever thread made it."""
    from concurrent.futures import ThreadPoolExecutor
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "ck"
    with ThreadPoolExecutor(1) as pool:
        pool.submit(save, out, locs[0], plan, rank=0, config=CFG).result()   # then abandoned
        for r in range(plan.world_size):
            save(out, locs[r], plan, rank=r, config=CFG, overwrite=True)
    assert_equal_ckpt(out, full)


def test_a_forked_child_does_not_take_its_parents_live_stage(tmp_path, monkeypatch):
    """A child forked while a save ran in a thread inherited the record of the parent's
    stage, saw no live thread of its own on it, removed it and published; the parent was
    then told it had published, the directory holding the child's tensors. The child now
    tests the lock as another process does, and is refused."""
    import multiprocessing
    import threading

    from coordloader.handoff import publish as pub
    out = tmp_path / "out"
    held, go, got = threading.Event(), threading.Event(), {}

    def hook(s):
        if s == "staged" and threading.current_thread().name == "first":
            held.set()
            assert go.wait(60)
    monkeypatch.setattr(pub, "_test_hook", hook)

    def first():
        got["first"] = save(out, {"w": torch.ones(4)}, config=CFG)
    t = threading.Thread(target=first, name="first")
    t.start()
    try:
        assert held.wait(60)
        child = multiprocessing.get_context("fork").Process(target=_save_twos, args=(out,))
        child.start()
        child.join(60)
        assert child.exitcode == 3, child.exitcode   # refused as another writer
    finally:
        go.set()
        t.join(60)
    assert got["first"].published
    assert_equal_ckpt(out, {"w": torch.ones(4)})


def _save_twos(out):
    try:
        save(out, {"w": torch.full((4,), 2.0)}, config=CFG, overwrite=True)
    except SaveError as e:
        os._exit(3 if "another save or consolidate is writing into" in str(e) else 2)
    os._exit(0)


def test_a_publish_whose_stage_lost_its_files_publishes_nothing(tmp_path, monkeypatch):
    """A stage another writer removed before the marker: the publish found the files the
    other writer had published in place, took them for its own already moved, and
    reported success. It is refused before anything visible changes."""
    from coordloader.handoff import publish as pub
    out = tmp_path / "out"
    save(out, {"w": torch.zeros(4)}, config=CFG)

    def hook(s):
        if s == "staged":
            for stage in (n for n in os.listdir(out) if n.startswith(".coordloader-staging-")):
                for f in os.listdir(out / stage):
                    if os.path.isfile(out / stage / f) and f != ".lock":
                        os.unlink(out / stage / f)
    monkeypatch.setattr(pub, "_test_hook", hook)
    with pytest.raises(SaveError) as e:
        save(out, {"w": torch.ones(4)}, config=CFG, overwrite=True)
    # (the one rank of a save without a plan, named as every other refusal names it)
    assert re.fullmatch(r"rank 0, file \S+: the staging directory \.coordloader-staging-\S+ "
                        r"no longer holds \S+\.coordloader-shard.*, written there for this "
                        r"publish: another writer removed it; nothing was published",
                        str(e.value)), str(e.value)
    monkeypatch.setattr(pub, "_test_hook", None)
    assert_equal_ckpt(out, {"w": torch.zeros(4)})


def test_consolidate_over_same_named_shards_removes_the_old_index_first(tmp_path):
    """Consolidating over an HF checkpoint with the same shard names kept its index in
    place while the new shards moved in: a reader that ignores the marker (transformers,
    vLLM) read a mix of both checkpoints."""
    from safetensors.torch import save_file

    from coordloader.handoff.consolidate import consolidate
    from coordloader.handoff.publish import recover_save
    srcs = {}
    for v in (1, 2):
        srcs[v] = tmp_path / f"src{v}"
        srcs[v].mkdir()
        save_file({"a": torch.full((64,), float(v)), "b": torch.full((64,), float(v))},
                  str(srcs[v] / "model.safetensors"))
        (srcs[v] / "config.json").write_text('{"model_type": "x"}')
    steps = _publish_steps(lambda: consolidate(str(srcs[2]), str(tmp_path / "rec"),
                                               max_shard_bytes=256))
    moved = [s for s in steps if s.startswith("moved ")]
    assert moved == ["moved model-00001-of-00002.safetensors",
                     "moved model-00002-of-00002.safetensors", "moved config.json",
                     f"moved {HF_INDEX}"]
    for step in ("old-entries-removed", moved[0], moved[1]):
        out = tmp_path / step.replace(" ", "-")
        consolidate(str(srcs[1]), str(out), max_shard_bytes=256)
        _kill_at(step, lambda: consolidate(str(srcs[2]), str(out), max_shard_bytes=256,
                                           overwrite=True))
        assert not (out / HF_INDEX).exists(), step
        assert recover_save(out)
        meta = read_checkpoint(str(out))
        assert all(torch.equal(read_full(meta, n), torch.full((64,), 2.0)) for n in "ab")


_CRASH = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_save import make_plan_and_locals, save_local
    from coordloader.handoff import publish
    plan, locs, full = make_plan_and_locals()
    def hook(s):
        if s == sys.argv[2]:
            os.kill(os.getpid(), signal.SIGKILL)
    publish._test_hook = hook
    save_local(sys.argv[1], plan, locs, overwrite=True)
""")


@pytest.mark.parametrize("step", ["staged", f"moved {shard_name(1, 0)}"])
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_save_sigkilled_mid_publish(tmp_path, step):
    """The same with a real SIGKILL: nothing runs after the kill, not even ``finally``."""
    import coordloader as cl
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "ck"
    save_local(out, plan, _bump(locs))
    old = {n: t + 1 if t.is_floating_point() else t for n, t in full.items()}
    script = tmp_path / "crash.py"
    script.write_text(_CRASH.format(tests=os.path.join(ROOT, "tests")))
    p = subprocess.run([sys.executable, str(script), str(out), step], timeout=120, capture_output=True)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()[-2000:]
    assert _state(out, old, full) == ("old" if step == "staged" else "refused")
    if step != "staged":
        from coordloader.errors import CheckpointError
        with pytest.raises(CheckpointError, match="interrupted"):
            cl.load(str(out), Layout(tp=2), rank=0)
        assert cl.recover_save(out)
    assert _state(out, old, full) == ("old" if step == "staged" else "new")


def test_loose_shards_of_a_save_are_never_assembled(tmp_path):
    """Without its index, a sharded save's files are refused, whether discovered as loose
    files in a directory, named one by one, or (format 1) named like plain safetensors."""
    from coordloader.checkpoint.reader import discover
    from coordloader.errors import CheckpointError
    plan, locs, full = make_plan_and_locals()
    out = tmp_path / "ck"
    save_local(out, plan, locs)
    os.unlink(out / SHARDED_INDEX)
    with pytest.raises(CheckpointError, match="shards of a coordloader sharded save.*no index"):
        read_checkpoint(str(out))
    with pytest.raises(CheckpointError, match="one shard of a coordloader sharded save"):
        read_checkpoint(str(out / shard_name(0, 0)))
    # format 1 names: model-rank-*.safetensors, loose in a directory or renamed
    v1 = tmp_path / "v1"
    os.makedirs(v1)
    os.rename(out / shard_name(0, 0), v1 / "model-rank-00000-part-00000.safetensors")
    with pytest.raises(CheckpointError, match="no index"):
        discover(str(v1))
    os.rename(v1 / "model-rank-00000-part-00000.safetensors", v1 / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"holds piece 'a\.weight@0:4,0:6' of a coordloader"):
        read_checkpoint(str(v1))


# ---- distributed: two gloo processes -------------------------------------------------

def _dist_worker(rank, port, base, q):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        plan, locs, _ = make_plan_and_locals()
        for out, fail_rank in (("ok", -1), ("bad", 1)):
            mine = dict(locs[rank])
            if rank == fail_rank:
                del mine["b.weight"]
            try:
                r = save(os.path.join(base, out), mine, plan, config=CFG)
                q.put((out, rank, "ok", r.published))
            except Exception as e:  # noqa: BLE001
                q.put((out, rank, type(e).__name__, str(e)))
        # rank 1 given another out_dir (a node-local path), or digests=False; rank 1 not
        # seeing rank 0's staging directory (out_dir not on a shared file system)
        for case in ("outdir", "symlink", "digests", "unseen"):
            kw = {"digests": rank == 0} if case == "digests" else {}
            out = os.path.join(base, case + ({"outdir": "-1", "symlink": "-link"}.get(case, "")
                                             if rank == 1 else ""))
            real_isdir = os.path.isdir
            if case == "unseen" and rank == 1:
                os.path.isdir = lambda p: ".coordloader-staging-" not in str(p) and real_isdir(p)
            try:
                r = save(out, dict(locs[rank]), plan, config=CFG, **kw)
                q.put((case, rank, "ok", r.published))
            except Exception as e:  # noqa: BLE001
                q.put((case, rank, type(e).__name__, str(e)))
            finally:
                os.path.isdir = real_isdir
        # rank 1 never calls save: rank 0 must give up after timeout=, naming it
        if rank == 0:
            t = time.monotonic()
            try:
                save(os.path.join(base, "absent"), dict(locs[0]), plan, config=CFG, timeout=3)
                q.put(("absent", 0, "ok", time.monotonic() - t))
            except Exception as e:  # noqa: BLE001
                q.put(("absent", 0, type(e).__name__, f"{time.monotonic() - t:.1f} s: {e}"))
        else:
            time.sleep(10)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_distributed_save_and_error_agreement(tmp_path):
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").Queue()
    os.symlink(tmp_path / "symlink", tmp_path / "symlink-link")   # rank 1's path to it
    spawn_and_wait(_dist_worker, (free_port(), str(tmp_path), q), 2, "distributed save")
    res = {}
    for _ in range(13):
        r = q.get(timeout=10)
        res[r[:2]] = r[2:]
    plan, locs, full = make_plan_and_locals()
    # out_dirs that are other directories (a node-local path), or one rank 1 cannot see;
    # digests=False on rank 1 alone: refused in save-assign, nothing published (was: a
    # bare "No such file or directory" of a shard file; a checkpoint published without its
    # manifest). One directory reached through a symlink on rank 1 is one directory.
    for case, why in (
            ("outdir", "SaveError: rank 0's staging directory .coordloader-staging-"),
            ("digests", "ConfigError: ranks disagree on their save options (digests: rank 0 "
                        "True, rank 1 False); give every rank the same options"),
            ("unseen", "SaveError: rank 0's staging directory .coordloader-staging-")):
        for r in (0, 1):
            kind, msg = res[(case, r)]
            assert kind == "CollectiveError" and msg.startswith(
                f"phase save-assign: rank{'s 0,1' if case == 'digests' else ' 1'}: "
                f"{why}"), (case, r, msg)
        assert not os.path.exists(tmp_path / case / SHARDED_INDEX)
    assert "is not in out_dir" in res[("unseen", 0)][1] and "shared file system" in \
        res[("unseen", 0)][1]
    assert res[("symlink", 0)] == ("ok", True) and res[("symlink", 1)] == ("ok", False)
    assert_equal_ckpt(tmp_path / "symlink", full)
    assert res[("ok", 0)] == ("ok", True) and res[("ok", 1)] == ("ok", False)
    assert_equal_ckpt(tmp_path / "ok", full)
    ref = tmp_path / "ref"
    save_local(ref, plan, locs)
    for n in os.listdir(ref):  # same bytes as the single-process save
        assert (ref / n).read_bytes() == (tmp_path / "ok" / n).read_bytes(), n
    bad0, bad1 = res[("bad", 0)], res[("bad", 1)]
    assert bad1[0] in ("SaveError", "CollectiveError") and "b.weight" in bad1[1]
    assert bad0[0] == "CollectiveError" and "rank 1" in bad0[1] and "b.weight" in bad0[1], bad0
    absent = res[("absent", 0)]
    assert absent[0] == "CollectiveError" and "rank 1 did not arrive within 3 s" in absent[1], absent
    assert float(absent[1].split(" s:")[0]) < 3 + 5, absent   # was a fixed 300 s
    assert not os.path.exists(tmp_path / "bad" / SHARDED_INDEX)
    assert not [n for n in os.listdir(tmp_path / "bad") if n.startswith(".coordloader")]


@pytest.mark.parametrize("what", ["module", "list", "tensor", "none"])
def test_save_of_something_other_than_a_state_dict_is_refused(tmp_path, what):
    """A module, a list, a bare tensor or None passed as the state dict failed with a bare
    AttributeError ('Linear' object has no attribute 'items')."""
    from coordloader.errors import SaveError
    arg = {"module": torch.nn.Linear(2, 2), "list": [torch.zeros(2)], "tensor": torch.zeros(2),
           "none": None}[what]
    name = {"module": "Linear", "list": "list", "tensor": "Tensor", "none": "NoneType"}[what]
    hint = " (pass module.state_dict())" if what == "module" else ""
    with pytest.raises(SaveError) as e:
        save(tmp_path / "x", arg, config=CFG)
    assert str(e.value) == (f"rank 0: save() needs a state dict, a mapping of names to "
                            f"tensors; got {name}{hint}")
    assert not (tmp_path / "x").exists() or not os.listdir(tmp_path / "x")


_DTENSOR_LOCALS = """
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.two_tensor import TwoTensor
import coordloader as cl
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.handoff.consolidate import read_full
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu", (1,))
out, cfg = sys.argv[1], {"model_type": "toy"}
a = torch.arange(32.0).reshape(4, 8)
res = {}
for case, state in (("wrapper-local", {"w": DTensor.from_local(TwoTensor(a, a.clone()), mesh,
                                                               [Shard(0)])}),
                    ("boxed-dtensor", {"w": cl.Boxed(DTensor.from_local(a, mesh, [Shard(0)]),
                                                     (4, 8), (0, 0))}),
                    ("plain-local", {"w": DTensor.from_local(a.clone(), mesh, [Shard(0)])})):
    try:
        cl.save(os.path.join(out, case), state, config=cfg)
        res[case] = torch.equal(read_full(read_checkpoint(os.path.join(out, case)), "w"), a)
    except Exception as e:
        res[case] = f"{type(e).__name__}: {e}"
print(json.dumps(res))
dist.destroy_process_group()
"""


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_dtensors_with_a_wrapper_local_or_inside_boxed_are_refused(tmp_path):
    """A DTensor whose local tensor is a wrapper subclass (FSDP2 with torchao float8
    weights) and a Boxed wrapping a DTensor killed the process with SIGSEGV in the digest
    kernel (data_ptr() 0 read as an address); a DTensor of a plain local tensor saves."""
    pytest.importorskip("torch.testing._internal.two_tensor")
    p = subprocess.run([sys.executable, "-c", _DTENSOR_LOCALS, str(tmp_path), str(free_port())],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep
                                + os.environ.get("PYTHONPATH", "")))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == {
        "wrapper-local": "SaveError: rank 0, tensor "
                         "'w': the DTensor's local tensor is a TwoTensor, a tensor subclass "
                         "that wraps others; expected a tensor whose own storage holds its "
                         "values (unwrap or dequantize it to a plain tensor first)",
        "boxed-dtensor": "SaveError: rank 0, tensor "
                         "'w': the Boxed tensor is a DTensor; expected a plain local tensor (pass "
                         "the DTensor itself, whose placements give its boxes, or "
                         "Boxed(dtensor.to_local(), ...))",
        "plain-local": True}


LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 128, "vocab_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 2}


@pytest.mark.parametrize("name, shape, dtype, cfg", [
    # an EAGLE-3 style draft head: its own vocabulary
    ("lm_head.weight", (32, 64), torch.float32, dict(LLAMA_CFG, draft_vocab_size=32)),
    # a vision tower under a flat config (MiniCPM-V, Qwen2.5-VL): not the text model's heads
    ("vpm.encoder.layers.0.self_attn.k_proj.weight", (24, 24), torch.float32, LLAMA_CFG),
    ("visual.blocks.0.mlp.gate_proj.weight", (96, 24), torch.float32, LLAMA_CFG),
    # packed 4-bit weights stored as uint8: half the intermediate size along dim 1
    ("model.layers.0.mlp.down_proj.weight", (64, 64), torch.uint8, LLAMA_CFG),
], ids=["draft-head", "vision-k-proj", "vision-mlp", "packed-uint8"])
def test_shapes_config_json_does_not_describe_are_saved(tmp_path, name, shape, dtype, cfg):
    """Tensors that config.json's sizes do not describe (a draft head, a vision tower, packed
    quantized weights) were refused by every save once saved shapes were compared with
    every dim config.json states; only a distributed save's plain tensors, whose shapes
    are inferred, are compared, and only on the dim an FSDP shard cuts."""
    t = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape).to(dtype)
    cfg = {k: v for k, v in cfg.items() if k != "num_hidden_layers"}   # one tensor saved
    save(tmp_path / "x", {name: t}, config=cfg)
    got = cl.load_detailed(str(tmp_path / "x"), cl.Layout(), rank=0,
                           rules=[{"pattern": "*", "strategy": "replicate"}])
    assert torch.equal(got.tensors[name], t)


def _save_and_report(q, rank, out, mine, timeout=30, **kw):
    """A rank's save, its outcome put on ``q`` as (rank, "ok" or "Type: message")."""
    try:
        save(out, mine, timeout=timeout, **kw)
        q.put((rank, "ok"))
    except Exception as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))


def _local_shards_worker(rank, port, out, q, how):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        full = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)
        if how == "fsdp":   # every weight's Shard(0)
            mine = {"model.embed_tokens.weight": full[128 * rank:128 * (rank + 1)].clone()}
        else:               # ColwiseParallel q_proj's shard beside the replicated embedding
            mine = {"model.embed_tokens.weight": full,
                    "model.layers.0.self_attn.q_proj.weight":
                        torch.zeros(32, 64) + rank}
        _save_and_report(q, rank, out, mine, config=LLAMA_CFG)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
@pytest.mark.parametrize("how", ["fsdp", "tp"])
def test_ranks_shards_passed_as_whole_tensors_are_refused_on_every_rank(tmp_path, how):
    """Two ranks each passing their Shard(0) local tensor (dt.to_local()) as a plain tensor,
    no plan: rank 0's half was written as the whole embedding and save returned on both.
    'tp': a ColwiseParallel q_proj's shard beside a whole embedding (a first fix compared
    only the embedding's and norms' dim 0, and the half q_proj was saved)."""
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").Queue()
    out = str(tmp_path / "ck")
    spawn_and_wait(_local_shards_worker, (free_port(), out, q, how), 2, "2-rank save",
                   hard_s=90)
    res = dict(q.get(timeout=10) for _ in range(2))
    name, shape, what = (("model.embed_tokens.weight", [128, 64],
                          "128 along dim 0, but config.json says vocab_size=256")
                         if how == "fsdp" else
                         ("model.layers.0.self_attn.q_proj.weight", [32, 64],
                          "32 along dim 0, but config.json says "
                          "num_attention_heads*head_dim=64"))
    want = (f"CollectiveError: phase save-prepare: ranks 0,1: SaveError: tensor {name!r}: "
            f"global shape {shape} has {what}; expected the whole tensor (a plain tensor "
            f"saved without a plan is taken as the whole tensor: pass a rank's shard as a "
            f"DTensor or a coordloader Boxed, or save with the plan it was loaded with; a "
            f"whole tensor of another shape as Boxed(t, t.shape, (0,) * t.dim()))")
    assert res == {0: want, 1: want}
    assert not os.path.exists(out) or not os.listdir(out)


def _rank_kw_worker(rank, port, out, q):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        plan, locs, _ = make_plan_and_locals()
        if rank == 0:
            dist.barrier()          # rank 1 calls first: the order a race can give
        try:
            r = save(out, locs[rank], plan, rank=rank, config=CFG)
            q.put((rank, f"ok published={r.published}"))
        except Exception as e:  # noqa: BLE001
            q.put((rank, f"{type(e).__name__}: {e}"))
        if rank == 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _alone_worker(rank, port, out, q):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        norm = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (2,)), [Replicate()])
        off = distribute_tensor(torch.arange(4.0), DeviceMesh("cpu", [0]), [Replicate()])
        if rank == 1:   # saves alone (local mode), as one process of a group may
            emb = torch.arange(80.0).reshape(10, 8)
            for name, state in (("replicated", {"emb": emb, "norm": norm}),
                                ("off-mesh", {"emb": emb, "off": off})):
                try:
                    save(os.path.join(out, name), state, rank=0, config=CFG)
                    q.put((name, "ok"))
                except Exception as e:  # noqa: BLE001
                    q.put((name, f"{type(e).__name__}: {e}"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_a_replicated_dtensor_saved_alone_off_coordinate_0_is_written(tmp_path):
    """A process of a group saving alone (rank=0, local mode) holds every replicated
    DTensor whole; off mesh coordinate 0 it wrote none, without a word (the replicas were
    left to coordinate 0, which was not saving). A DTensor whose mesh leaves the process
    out was dropped the same way."""
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").Queue()
    spawn_and_wait(_alone_worker, (free_port(), str(tmp_path), q), 2, "save alone", hard_s=90)
    res = dict(q.get(timeout=10) for _ in range(2))
    assert res == {"replicated": "ok",
                   "off-mesh": "SaveError: rank 0, tensor 'off': is a DTensor whose device mesh "
                               "leaves this process out: it holds none of the tensor, and this "
                               "save is its only writer; save it from a process of its mesh"}
    meta = cl.read_checkpoint(str(tmp_path / "replicated"))
    assert sorted(meta.tensors) == ["emb", "norm"]
    got = cl.load(str(tmp_path / "replicated"), Layout(), rules=[{"pattern": "*", "strategy": "replicate"}])
    assert torch.equal(got["norm"], torch.arange(8.0))
    assert torch.equal(got["emb"], torch.arange(80.0).reshape(10, 8))
    assert not (tmp_path / "off-mesh").exists() or not any(
        n.endswith(".safetensors") for n in os.listdir(tmp_path / "off-mesh"))


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_every_rank_passing_its_own_rank_under_a_group_is_told_to_leave_it_out(tmp_path):
    """save(..., rank=dist.get_rank()) on every rank of a group runs one local-mode save
    per process at once (rank= is local mode, documented for one process saving the plan
    ranks in turn): the outcome depends on timing. Where it is refused, the message says
    why and what to do."""
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").Queue()
    out = str(tmp_path / "ck")
    spawn_and_wait(_rank_kw_worker, (free_port(), out, q), 2, "2-rank save", hard_s=90)
    res = dict(q.get(timeout=10) for _ in range(2))
    stage = [n for n in os.listdir(out) if n.startswith(".coordloader-staging")]
    assert res[1] == (
        f"SaveError: rank 1, file {os.path.join(out, stage[0])}: local-mode save: call save() "
        f"for ranks in order 0..1; rank 0 has not been saved into this staging directory; "
        f"this process is rank 1 of an initialised process group of 2: if every rank calls "
        f"save(), leave rank= out, so that they save together (distributed mode); rank= is "
        f"local mode, one process saving the ranks in turn")
    assert res[0] == "ok published=False"


@pytest.mark.parametrize("call", ["save", "save_local", "consolidate", "recover_save"])
def test_an_output_directory_that_is_not_a_path_is_refused(tmp_path, call):
    """A state dict passed before the directory (save(sd, dir)) failed with a bare
    TypeError from os.fspath."""
    import coordloader as cl
    from coordloader.errors import SaveError
    sd = {"w": torch.zeros(2)}
    save(tmp_path / "src", sd, config=CFG)
    run = {"save": lambda: cl.save(sd, tmp_path / "x", config=CFG),
           "save_local": lambda: cl.handoff.save.save_local(sd, tmp_path / "x", config=CFG),
           "consolidate": lambda: cl.consolidate(tmp_path / "src", sd),
           "recover_save": lambda: cl.recover_save(sd)}[call]
    with pytest.raises(SaveError) as e:
        run()
    hint = (" (the output directory comes first: save(out_dir, state_dict, ...))"
            if call.startswith("save") else "")
    rank = "rank 0: " if call.startswith("save") else ""
    assert str(e.value) == (f"{rank}output directory {str(sd)!r} is dict; expected a str or "
                            f"os.PathLike path{hint}")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_save_of_a_parameter_dict_is_a_state_dict(tmp_path):
    """nn.ParameterDict is a mapping in all but its type: it saved before the state dict
    check and must still."""
    d = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.arange(4.0))})
    save(tmp_path / "x", d, config=CFG)
    assert torch.equal(read_full(read_checkpoint(str(tmp_path / "x")), "w"), torch.arange(4.0))


@pytest.mark.parametrize("old", ["pytorch_model.bin", "sharded-bin", "with-safetensors"])
def test_weights_in_other_formats_count_as_the_checkpoint_there(tmp_path, old):
    """A pytorch_model.bin (as many HF repos ship beside model.safetensors) was neither
    refused nor removed: after save(overwrite=True) it sat beside the new sharded save,
    and transformers, finding no safetensors there, loaded the old weights from it."""
    out = tmp_path / "ck"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(CFG))
    old_files = {"pytorch_model.bin": ["pytorch_model.bin"],
                 "sharded-bin": ["pytorch_model-00001-of-00002.bin",
                                 "pytorch_model-00002-of-00002.bin",
                                 "pytorch_model.bin.index.json"],
                 "with-safetensors": ["pytorch_model.bin", "model.safetensors"]}[old]
    for n in old_files:
        if n.endswith(".index.json"):
            (out / n).write_text(json.dumps({"weight_map": {
                "a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}}))
        elif n.endswith(".safetensors"):
            from safetensors.torch import save_file
            save_file({"w": torch.zeros(2)}, str(out / n))
        else:
            torch.save({"w": torch.zeros(2)}, str(out / n))
    (out / "training_args.bin").write_bytes(b"not model weights")   # a Trainer's, kept
    with pytest.raises(SaveError, match="a checkpoint already exists here"):
        save(out, {"w": torch.arange(4.0)}, config=CFG)
    assert sorted(os.listdir(out)) == sorted(old_files + ["config.json", "training_args.bin"])
    save(out, {"w": torch.arange(4.0)}, config=CFG, overwrite=True)
    left = set(os.listdir(out))
    assert not left & set(old_files), left
    assert "training_args.bin" in left
    assert torch.equal(cl.load_detailed(str(out), cl.Layout(), rank=0,
                                        replicate_unmatched=True).tensors["w"],
                       torch.arange(4.0))


def test_empty_save_is_refused_and_the_previous_checkpoint_kept(tmp_path):
    """save(out, {}, overwrite=True) published an index without tensors, which every
    reader refuses, in place of a good checkpoint."""
    from coordloader.errors import SaveError
    out = tmp_path / "ck"
    save(out, {"w": torch.arange(4.0)}, config=CFG)
    with pytest.raises(SaveError) as e:
        save(out, {}, config=CFG, overwrite=True)
    assert str(e.value) == ("no rank passed any tensor: there is nothing to save (expected a "
                            "state dict with at least one tensor)")
    assert torch.equal(read_full(read_checkpoint(str(out)), "w"), torch.arange(4.0))
    assert not [n for n in os.listdir(out) if n.startswith(".coordloader")]


@pytest.mark.parametrize("old_name", ["model-00001-of-00001.safetensors", "weights.safetensors"])
def test_loose_safetensors_in_the_target_are_a_checkpoint(tmp_path, old_name):
    """A directory of loose .safetensors (an index lost, DCP's per-rank files) is a
    checkpoint to the reader, but not to the writer: overwrite=False replaced it."""
    from safetensors.torch import save_file

    from coordloader.errors import SaveError
    from coordloader.handoff.consolidate import consolidate
    src = tmp_path / "src"
    src.mkdir()
    save_file({"v": torch.ones(3)}, str(src / "model.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    save_file({"w": torch.zeros(2)}, str(out / old_name))
    before = (out / old_name).read_bytes()
    for write in (lambda **kw: consolidate(str(src), str(out), **kw),
                  lambda **kw: save(out, {"v": torch.ones(3)}, config=CFG, **kw)):
        with pytest.raises(SaveError, match="a checkpoint already exists here"):
            write()
        assert (out / old_name).read_bytes() == before
    consolidate(str(src), str(out), overwrite=True)
    consolidate(str(src), str(tmp_path / "rec"))
    meta = read_checkpoint(str(out))
    assert list(meta.tensors) == ["v"] and torch.equal(read_full(meta, "v"), torch.ones(3))
    # the old file is gone, or replaced by the new checkpoint's file of that name
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "rec"))


def test_overwrite_without_a_config_drops_the_old_models_config(tmp_path):
    """consolidate/save over another model's checkpoint, bringing no config.json, kept
    the old model's config beside the new weights."""
    from safetensors.torch import save_file

    from coordloader.handoff.consolidate import consolidate
    out = tmp_path / "out"
    out.mkdir()
    save_file({"a": torch.zeros(2)}, str(out / "model.safetensors"))
    (out / "config.json").write_text('{"model_type": "OLD_MODEL"}')
    src = tmp_path / "src"       # DCP-like output: weights, no config.json
    src.mkdir()
    save_file({"b": torch.ones(3)}, str(src / "model.safetensors"))
    consolidate(str(src), str(out), overwrite=True)
    assert not (out / "config.json").exists()
    consolidate(str(src), str(out), overwrite=True, config={"model_type": "NEW"})
    assert json.loads((out / "config.json").read_text()) == {"model_type": "NEW"}


def test_a_lone_manifest_in_the_output_counts_as_a_checkpoint(tmp_path):
    """An output directory holding only another checkpoint's manifest: consolidate of a
    source without one published beside it, exit 0, and every digest verify of the new
    checkpoint failed as a stale manifest. Refused now; --overwrite removes it."""
    from safetensors.torch import save_file

    from coordloader.handoff.consolidate import consolidate
    out = tmp_path / "out"
    out.mkdir()
    (out / "coordloader.manifest.json").write_text('{"format": "coordloader.manifest"}')
    src = tmp_path / "src"
    src.mkdir()
    save_file({"b": torch.ones(3)}, str(src / "model.safetensors"))
    with pytest.raises(SaveError, match="a checkpoint already exists here"):
        consolidate(str(src), str(out))
    assert sorted(os.listdir(out)) == ["coordloader.manifest.json"]
    consolidate(str(src), str(out), overwrite=True)
    assert "coordloader.manifest.json" not in os.listdir(out)


@pytest.mark.parametrize("cfg, what", [
    ({"weight_map": {"a": "model.safetensors"}, "metadata": {}},
     "a checkpoint index (it has weight_map)"),
    ({"hidden_size": 8}, "no model config"),
    ({"model_type": ""}, "model_type ''")])
def test_a_config_that_is_no_model_config_is_refused(tmp_path, cfg, what):
    """consolidate --config given the source's model.safetensors.index.json by mistake
    published it as config.json, exit 0, and the output could not be planned ("no
    sharding rule matches ... preset none detected")."""
    from safetensors.torch import save_file

    from coordloader.handoff.consolidate import consolidate
    src = tmp_path / "src"
    src.mkdir()
    save_file({"b": torch.ones(3)}, str(src / "model.safetensors"))
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    for given in (cfg, str(tmp_path / "c.json")):
        with pytest.raises(SaveError, match=f"is {re.escape(what)}: a model config"):
            consolidate(str(src), str(tmp_path / "out"), config=given)
        assert not (tmp_path / "out").exists()


def test_a_parameter_subclass_is_saved_like_a_plain_tensor(tmp_path):
    """A Parameter subclass over its own storage (vLLM's parameters are) was refused with
    the wrapper subclasses, which it is not; it is saved and loads back exactly."""
    class MyParam(torch.nn.Parameter):
        pass
    w = torch.arange(12.0).reshape(3, 4)
    v = torch.ones(2).as_subclass(type("T", (torch.Tensor,), {}))
    save(tmp_path / "out", {"w": MyParam(w.clone()), "v": v}, config=CFG)
    meta = read_checkpoint(str(tmp_path / "out"))
    assert torch.equal(read_full(meta, "w"), w) and torch.equal(read_full(meta, "v"), torch.ones(2))


@pytest.mark.parametrize("value, msg", [
    (torch.empty(2, device="meta"),
     "rank 0, tensor 'x': is on the meta device: it has no data to save (materialise it first)"),
    (torch.zeros(2, 2).to_sparse(),
     "rank 0, tensor 'x': is a sparse_coo tensor; expected a dense tensor (call "
     ".to_dense() first)"),
    ("nested", "rank 0, tensor 'x': is a nested tensor; expected a dense tensor (call "
               ".to_dense() first)"),
    (torch._neg_view(torch.ones(2)), "rank 0, tensor 'x': is a negative-bit tensor; expected a "
                                     "dense tensor (call .resolve_neg() first)"),
    (torch.zeros(2, dtype=torch.complex128),
     "rank 0, tensor 'x': has dtype torch.complex128, which coordloader does not save (its "
     "dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2, U16, U32, "
     "U64, F8_E8M0, C64); convert it first"),
    ("boxed-list", "rank 0, tensor 'x': the Boxed tensor is list; expected a torch.Tensor"),
    ("boxed-float", "rank 0, tensor 'x': Boxed global shape [4] and offset [1.5] must be "
                    "integers"),
    ("subclass", "rank 0, tensor 'x': is a TwoTensor, a tensor subclass that wraps others; "
                 "expected a tensor whose own storage holds its values (unwrap or dequantize "
                 "it to a plain tensor first)"),
    ("uninitialized", "rank 0, tensor 'x': is an UninitializedParameter (a lazy module's, "
                      "before its first forward); run the module once or initialize it first"),
    ("boxed-subclass", "rank 0, tensor 'x': the Boxed tensor is a TwoTensor, a tensor subclass "
                       "that wraps others; expected a tensor whose own storage holds its values "
                       "(unwrap or dequantize it to a plain tensor first)"),
], ids=["meta", "sparse", "nested", "negative-bit", "complex", "boxed-list", "boxed-float",
        "subclass", "uninitialized", "boxed-subclass"])
def test_tensors_that_cannot_be_written_are_named(tmp_path, value, msg):
    """Each of these raised a bare torch error (or one naming no tensor and no rank)."""
    from coordloader.errors import SaveError
    from coordloader.handoff.pieces import Boxed
    if value == "boxed-list":
        value = Boxed([1, 2], (2,), (0,))
    elif value == "boxed-float":
        value = Boxed(torch.zeros(2), (4,), (1.5,))
    elif value == "uninitialized":
        value = torch.nn.parameter.UninitializedParameter()
    elif value == "nested":   # failed untyped, reading its shape
        with warnings.catch_warnings():   # torch's prototype notice
            warnings.simplefilter("ignore")
            value = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(2)])
    elif value in ("subclass", "boxed-subclass"):
        # a wrapper subclass (as torchao's float8 training weights are) has no storage:
        # data_ptr() 0, which the digest kernel read as an address (SIGSEGV, digests=True)
        # and the writer refused with torch's words (digests=False)
        two = pytest.importorskip("torch.testing._internal.two_tensor")
        a = torch.arange(8.0).reshape(2, 4)
        wrapper = two.TwoTensor(a, a.clone())
        value = Boxed(wrapper, (2, 4), (0, 0)) if value == "boxed-subclass" else wrapper
    with pytest.raises(SaveError) as e:
        save(tmp_path / "out", {"x": value}, config=CFG)
    assert str(e.value) == msg
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


# ---- one box, two views of the tensor ------------------------------------------------

_VIEWS = {   # rank 1's Boxed view of the box rank 0 holds as Boxed(w, (4, 3), (0, 0))
    "shape": (lambda w: cl.Boxed(w + 100, (8, 3), (0, 0)), "F32 [4, 3] on rank 0 vs F32 [8, 3]"),
    "dtype": (lambda w: cl.Boxed(w.bfloat16(), (4, 3), (0, 0)),
              "F32 [4, 3] on rank 0 vs BF16 [4, 3]"),
}


def _views_worker(rank, port, out, q, how):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        w = torch.arange(12.0).reshape(4, 3)
        mine = {"w": cl.Boxed(w, (4, 3), (0, 0)) if rank == 0 else _VIEWS[how][0](w)}
        _save_and_report(q, rank, out, mine, config=CFG)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
@pytest.mark.parametrize("how", sorted(_VIEWS))
def test_ranks_holding_one_box_under_another_shape_or_dtype_are_refused(tmp_path, how):
    """Two ranks passing one box of 'w' under different global shapes or dtypes saved
    'ok': the lower rank's piece was kept and the other's view never compared, so the
    index recorded rank 0's view alone."""
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").Queue()
    out = str(tmp_path / "ck")
    spawn_and_wait(_views_worker, (free_port(), out, q, how), 2, "2-rank save", hard_s=90)
    res = dict(q.get(timeout=10) for _ in range(2))
    want = (f"CollectiveError: phase save-assign: ranks 0,1: SaveError: tensor 'w': ranks "
            f"disagree on dtype / global shape ({_VIEWS[how][1]} on rank 1); expected one "
            f"dtype and global shape for the tensor on every rank")
    assert res == {0: want, 1: want}
    assert not os.path.exists(out) or not os.listdir(out)


@pytest.mark.parametrize("how", sorted(_VIEWS))
def test_local_ranks_holding_one_box_under_another_shape_or_dtype_are_refused(tmp_path, how):
    """The same in local mode: rank 1's call compares with rank 0's record and ends the
    save, leaving no staging directory."""
    plan, locs, _ = make_plan_and_locals()
    w = torch.arange(12.0).reshape(4, 3)
    save(tmp_path / "ck", dict(locs[0], w=cl.Boxed(w, (4, 3), (0, 0))), plan, rank=0, config=CFG)
    with pytest.raises(SaveError) as e:
        save(tmp_path / "ck", dict(locs[1], w=_VIEWS[how][0](w)), plan, rank=1, config=CFG)
    assert str(e.value) == (f"tensor 'w': ranks disagree on dtype / global shape "
                            f"({_VIEWS[how][1]} on rank 1); expected one dtype and global "
                            f"shape for the tensor on every rank")
    assert not os.listdir(tmp_path / "ck")


# ---- a save that only rank 0 calls -----------------------------------------------------

def _rank0_only_worker(rank, port, out, q, how):
    import torch.distributed as dist

    import coordloader.handoff.save as save_mod
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 1 and how == "absent":
            time.sleep(8)      # in the training loop: save() is never called here
            return
        if rank == 1:          # in save(), its prepare slower than rank 0's timeout
            real = save_mod.resolve_config
            save_mod.resolve_config = lambda *a: (time.sleep(6), real(*a))[1]
        _save_and_report(q, rank, out, {"w": torch.ones(4, 4)}, config=CFG, timeout=3)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
@pytest.mark.parametrize("how", ["absent", "slow"])
def test_a_save_only_rank_0_calls_says_to_pass_rank_0(tmp_path, how):
    """`if rank == 0: save(out, full_state_dict, ...)` under an initialised group is
    distributed mode: rank 0 waited out the timeout (300 s by default) and said only
    'rank 1 did not arrive'. It now says that rank 1 never entered save() and how to save
    from one process; a rank that entered save() but is slow gets no such hint."""
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").Queue()
    out = str(tmp_path / "ck")
    spawn_and_wait(_rank0_only_worker, (free_port(), out, q, how), 2, "rank-0-only save",
                   hard_s=90)
    got = q.get(timeout=10)
    while got[0] != 0:
        got = q.get(timeout=10)
    said = "CollectiveError: phase save-prepare: rank 1 did not arrive within 3 s (arrived: 0)"
    if how == "absent":
        said += ("; rank 1 never entered save() (no heartbeat from it in this save's group): "
                 "under an initialised process group save() is distributed mode, which every "
                 "rank calls; if this process alone holds the whole state, pass rank=0 (local "
                 "mode)")
    assert got == (0, said)
    assert not os.path.exists(out) or not os.listdir(out)


@pytest.mark.parametrize("value,shown", [
    (None, "None"), ("1GB", "'1GB'"), (0, "0"), (-5, "-5"), (True, "True"), (2.5, "2.5"),
], ids=["none", "str", "zero", "negative", "bool", "float"])
def test_a_max_shard_bytes_that_is_not_a_positive_integer_is_refused(tmp_path, value, shown):
    """None or "1GB" raised a bare TypeError from comparing it with 0."""
    with pytest.raises(SaveError) as e:
        save(tmp_path / "ck", {"w": torch.ones(2)}, config=CFG, max_shard_bytes=value)
    assert str(e.value) == f"rank 0: max_shard_bytes must be a positive integer, got {shown}"
    assert not (tmp_path / "ck").exists()


def test_a_max_shard_bytes_written_as_a_float_of_an_integer_is_taken(tmp_path):
    """1e9, as sizes are often written, was taken before the check and refused by its
    first version."""
    save(tmp_path / "ck", {"w": torch.ones(2), "v": torch.ones(3)}, config=CFG,
         max_shard_bytes=8.0)   # 8 bytes: one tensor per file, as 8 would give
    assert sorted(n for n in os.listdir(tmp_path / "ck") if n.endswith(".coordloader-shard")) \
        == ["rank-00000-part-00000.coordloader-shard", "rank-00000-part-00001.coordloader-shard"]


_FIFO_IN_OUT_DIR = r'''
import os, sys, signal
import torch
from coordloader.handoff.save import save
from coordloader.errors import CoordloaderError
out, name, overwrite = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
os.makedirs(out, exist_ok=True)
os.mkfifo(os.path.join(out, name))
class Blocked(BaseException):
    pass
def fire(*_):
    raise Blocked
signal.signal(signal.SIGALRM, fire)
signal.alarm(20)                             # imports done: the save itself must not block
cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 0, "num_attention_heads": 1}
try:
    save(out, {"model.embed_tokens.weight": torch.ones(4, 4)}, config=cfg, overwrite=overwrite)
    print("SAVED", sorted(os.listdir(out)))
except CoordloaderError as e:
    print(type(e).__name__ + ": " + str(e))
except Blocked:
    print("BLOCKED")
'''


@pytest.mark.slow   # a subprocess per case
@pytest.mark.parametrize("name,overwrite,want", [
    ("model.safetensors.index.json", "0", "SaveError: rank 0, file {out}: a checkpoint already "
                                          "exists here; pass overwrite=True"),
    ("model.safetensors.index.json", "1", "SAVED ['config.json', 'coordloader-index.json'"),
    ("coordloader-publishing.json", "0", "SaveError: file {out}: the publish marker "
                                         "coordloader-publishing.json is unreadable (file "
                                         "coordloader-publishing.json: is a FIFO"),
], ids=["index-refused", "index-overwritten", "marker"])
def test_a_fifo_in_the_output_directory_never_blocks_a_save(tmp_path, name, overwrite, want):
    # save looks at the index and the publish marker already there: a FIFO under either
    # name blocked the save's open() for ever
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", _FIFO_IN_OUT_DIR, str(out), name, overwrite],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().startswith(want.format(out=out)), p.stdout


def test_overwrite_removes_the_shards_of_an_index_the_reader_would_refuse(tmp_path):
    # the old index is read to find the files a save over it removes: a duplicate key the
    # strict reader refuses must not leave the old model's shards beside the new one
    out = tmp_path / "ck"
    out.mkdir()
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for n in shards:
        (out / n).write_bytes(b"old weights")
    (out / HF_INDEX).write_text(
        '{"metadata": {"total_size": 1}, "metadata": {"total_size": 2}, "weight_map": '
        + json.dumps({"a": shards[0], "b": shards[1]}) + "}")
    save(out, {"model.embed_tokens.weight": torch.ones(4, 4)}, config=CFG, overwrite=True)
    left = set(os.listdir(out))
    assert not left & set(shards) and HF_INDEX not in left, left


def eio_reading(monkeypatch, file_name):
    """Every read of ``file_name`` through the reader fails with EIO."""
    from coordloader.checkpoint import reader
    real = reader._pread_exact

    def eio(fd, n, off, name):
        if name == file_name:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, off, name)
    monkeypatch.setattr(reader, "_pread_exact", eio)


def old_hf_checkpoint(tmp_path):
    """An HF checkpoint's index and its one shard in ``tmp_path/ck``."""
    out = tmp_path / "ck"
    out.mkdir()
    shard = "model-00001-of-00001.safetensors"
    (out / shard).write_bytes(b"old weights")
    (out / HF_INDEX).write_text(json.dumps({"weight_map": {"a": shard}}))
    return out, shard


def refused_keeping(out, shard):
    """A save over ``out`` refused for an I/O error on its index, the old files kept."""
    with pytest.raises(SaveError, match="reading the existing index .* failed: Input/output"):
        save(out, {"model.embed_tokens.weight": torch.ones(4, 4)}, config=CFG, overwrite=True)
    assert (out / shard).read_bytes() == b"old weights" and (out / HF_INDEX).exists()


def test_an_io_error_reading_the_old_index_is_a_save_error(tmp_path, monkeypatch):
    # going on would leave the old index's shards beside the new checkpoint
    out, shard = old_hf_checkpoint(tmp_path)
    eio_reading(monkeypatch, HF_INDEX)
    refused_keeping(out, shard)


def test_an_io_error_opening_the_old_index_is_a_save_error(tmp_path, monkeypatch):
    # open and stat errors reach the save as a CheckpointError's cause, not as a pread's
    out, shard = old_hf_checkpoint(tmp_path)
    real = os.open

    def eio(path, *a, **kw):
        if str(path).endswith(HF_INDEX):
            raise OSError(errno.EIO, "Input/output error")
        return real(path, *a, **kw)
    monkeypatch.setattr(os, "open", eio)
    refused_keeping(out, shard)


def test_an_io_error_reading_the_publish_marker_is_a_save_error(tmp_path, monkeypatch):
    from coordloader.handoff.publish import PUBLISH_MARKER
    out = tmp_path / "ck"
    out.mkdir()
    (out / PUBLISH_MARKER).write_text("{}")
    eio_reading(monkeypatch, PUBLISH_MARKER)
    with pytest.raises(SaveError, match="publish marker .* is unreadable .*Input/output error"):
        save(out, {"model.embed_tokens.weight": torch.ones(4, 4)}, config=CFG)


def test_an_unreadable_earlier_record_ends_a_local_save_naming_it(tmp_path):
    # rank 1 reads rank 0's record: a truncated one is a SaveError naming the file and the
    # rank reading it, and the staging directory goes (it was left, with a bare
    # JSONDecodeError)
    plan, locs, _ = make_plan_and_locals()
    out = tmp_path / "ck"
    save(out, locs[0], plan, rank=0, config=CFG)
    stage = next(n for n in os.listdir(out) if n.startswith(".coordloader-staging"))
    rec = out / stage / "rank-00000.json"
    rec.write_text(rec.read_text()[:20])
    with pytest.raises(SaveError, match=r"rank 0's record of this local-mode save is not valid "
                                        r"JSON") as ei:
        save(out, locs[1], plan, rank=1, config=CFG)
    assert ei.value.rank == 1 and ei.value.file == str(rec)
    assert not any(n.startswith(".coordloader-staging") for n in os.listdir(out))



def _refused_leaving(d, call) -> str:
    """The SaveError message of ``call``, which must leave directory ``d`` as it was."""
    before = sorted(os.listdir(d))
    with pytest.raises(SaveError) as ei:
        call()
    assert sorted(os.listdir(d)) == before
    return str(ei.value)

def test_save_refuses_a_directory_named_like_a_file_of_a_checkpoint(tmp_path):
    """save(CKPT/model.safetensors) beside a sharded checkpoint's files wrote a directory
    the reader takes as part of CKPT, which then no longer loaded (two checkpoints); any
    other name there, or that name in a directory holding no checkpoint, is a save as any
    other."""
    from coordloader.synth import synthesize
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny", shards=2)
    out = os.path.join(ck, "model.safetensors")
    assert _refused_leaving(ck, lambda: save(out, {"w": torch.arange(4.0)}, config=CFG)) == (
        f"rank 0, file {out}: output directory {out} would add model.safetensors to the "
        f"checkpoint directory {ck} (holding config.json, model-00001-of-00002.safetensors, "
        f"model-00002-of-00002.safetensors ...), where it would be read as part of that "
        f"checkpoint; choose another directory")
    read_checkpoint(ck)
    save(os.path.join(ck, "saved"), {"w": torch.arange(4.0)}, config=CFG)
    read_checkpoint(ck)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a checkpoint")
    alone = tmp_path / "notes" / "model.safetensors"
    save(alone, {"w": torch.arange(4.0)}, config=CFG)
    assert torch.equal(cl.load_detailed(str(alone), cl.Layout(), rank=0,
                                        replicate_unmatched=True).tensors["w"], torch.arange(4.0))


@pytest.mark.parametrize("layout", ["index+consolidated", "single+adapter"])
def test_overwrite_refuses_safetensors_the_old_checkpoint_does_not_list(tmp_path, layout):
    """save(overwrite=True) over a Mistral repo (consolidated.safetensors beside the HF
    index) or a model with a LoRA adapter left that file beside the new sharded index:
    vLLM reads every *.safetensors there, and coordloader's reader refuses the directory
    it had just written."""
    from safetensors.torch import save_file
    d = tmp_path / "model"
    d.mkdir()
    w = {"w": torch.arange(8.0)}
    if layout == "index+consolidated":
        save_file(w, str(d / "model-00001-of-00001.safetensors"))
        (d / HF_INDEX).write_text(json.dumps(
            {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
        stray = "consolidated.safetensors"
    else:
        save_file(w, str(d / "model.safetensors"))
        stray = "adapter_model.safetensors"
    save_file({"lora_A": torch.zeros(2)}, str(d / stray))
    (d / "config.json").write_text(json.dumps(CFG))
    assert _refused_leaving(d, lambda: save(d, {"w": torch.full((8,), 7.0)}, config=CFG,
                                            overwrite=True)) == (
        f"rank 0, file {d}: {stray} in the output directory is no part of the checkpoint the "
        f"save replaces; beside the new sharded save it would be read as a second checkpoint "
        f"(vLLM reads every *.safetensors file, and coordloader refuses such a directory): "
        f"move it out first")
    os.rename(d / stray, tmp_path / stray)
    save(d, {"w": torch.full((8,), 7.0)}, config=CFG, overwrite=True)
    got = cl.load_detailed(str(d), cl.Layout(), rank=0, replicate_unmatched=True).tensors["w"]
    assert torch.equal(got, torch.full((8,), 7.0))


def test_paths_holding_a_nul_are_refused_by_name(tmp_path):
    """save's and consolidate's output directory and config= path with a NUL character
    raised os's bare ``ValueError: embedded null byte``; load's config= called the file
    "not valid JSON"."""
    from coordloader.handoff.consolidate import consolidate
    src = tmp_path / "src"
    save(src, {"w": torch.arange(4.0)}, config=CFG)
    out, cfg = str(tmp_path / "o\0ut"), str(tmp_path / "c\0.json")
    with pytest.raises(SaveError) as ei:
        save(out, {"w": torch.ones(2)}, config=CFG)
    assert str(ei.value) == f"rank 0: output directory {out!r} holds a NUL character, which no file path can"
    with pytest.raises(SaveError) as ei:
        consolidate(str(src), out)
    assert str(ei.value) == f"output directory {out!r} holds a NUL character, which no file path can"
    with pytest.raises(SaveError) as ei:
        save(tmp_path / "o2", {"w": torch.ones(2)}, config=cfg)
    assert str(ei.value).endswith(f"cannot read the config given as config= (--config): path "
                                  f"{cfg!r} holds a NUL character, which no file path can")
    with pytest.raises(cl.PlanError) as ei:
        cl.load(str(src), cl.Layout(), rank=0, config=cfg)
    assert str(ei.value).endswith(f": path {cfg!r} holds a NUL character, which no file path can")
    from coordloader.synth import synthesize
    with pytest.raises(SaveError) as ei:
        synthesize(out, "llama")
    assert str(ei.value) == f"output directory {out!r} holds a NUL character, which no file path can"
    with pytest.raises(cl.VerifyError) as ei:
        cl.write_manifest(str(src), path=cfg)
    assert str(ei.value) == (f"write_manifest: path {cfg!r} holds a NUL character, which no "
                             f"file path can")
    assert sorted(os.listdir(tmp_path)) == ["src"]
