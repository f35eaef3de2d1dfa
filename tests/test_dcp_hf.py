"""torch DCP's own HF output, written by the real ``HuggingFaceStorageWriter`` from 2 gloo
ranks (FSDP2 ``fully_shard`` and TP DTensors), read directly: pieces from each file's
``DCP_SHARDING_INFO``, the same exact-cover checks as coordloader's sharded format; loaded
at tp=4 byte-exact against the source checkpoint, and consolidated into a plain HF
checkpoint whose logits equal the source model's (issue 15, Found 3)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import coordloader as cl
from coordloader.dist.collective import free_port
from coordloader.errors import CheckpointError
from coordloader.layout import Layout

from hfmodels import write_llama
from ranks import spawn_and_wait

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _moe_model():
    """A transformers 5 Qwen2Moe (fused experts in memory), the same on every process."""
    from test_presets_hf import _qwen2_moe_model, _refill
    torch.manual_seed(0)
    model = _qwen2_moe_model()
    _refill(model, seed=11)
    return model


def _dcp_worker(rank, port, src, out_fsdp, out_tp, cl_fsdp, cl_tp, cl_moe, out_full,
                out_every):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import AutoModelForCausalLM
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        # FSDP2: every parameter a DTensor Shard(0) (uneven where 2 does not divide)
        model = AutoModelForCausalLM.from_pretrained(src)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(
            out_fsdp, save_distributed=True))
        # without save_distributed (HuggingFaceStorageWriter's default): rank 0's full
        # state dict, written with an index; and every rank's pieces, which go to the same
        # file names on every rank (torch's index still sums every rank's bytes)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        dcp.save(full, storage_writer=HuggingFaceStorageWriter(out_full))
        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(out_every))
        # the same DTensor state through coordloader.save, with no plan
        cl.save(cl_fsdp, model.state_dict(), config=src)
        # TP: q/k/v/gate/up Shard(0), o/down Shard(1), the rest plain replicated tensors
        model = AutoModelForCausalLM.from_pretrained(src)
        plan = {f"model.layers.{i}.{m}": style for i in range(len(model.model.layers))
                for m, style in (("self_attn.q_proj", ColwiseParallel()),
                                 ("self_attn.k_proj", ColwiseParallel()),
                                 ("self_attn.v_proj", ColwiseParallel()),
                                 ("self_attn.o_proj", RowwiseParallel()),
                                 ("mlp.gate_proj", ColwiseParallel()),
                                 ("mlp.up_proj", ColwiseParallel()),
                                 ("mlp.down_proj", RowwiseParallel()))}
        parallelize_module(model, mesh, plan)
        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(
            out_tp, save_distributed=True))
        cl.save(cl_tp, model.state_dict(), config=src)
        # FSDP2 over a MoE model: the fused expert tensors are DTensors split on dim 0
        moe = _moe_model()
        fully_shard(moe, mesh=mesh)
        cl.save(cl_moe, moe.state_dict(), config=moe.config.to_dict())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dcp_out(tmp_path_factory):
    base = tmp_path_factory.mktemp("dcp")
    src = write_llama(str(base / "src"), dtype=torch.float32)
    outs = {k: str(base / k) for k in ("fsdp2", "tp", "cl-fsdp2", "cl-tp", "cl-moe", "full",
                                       "every")}
    spawn_and_wait(_dcp_worker, (free_port(), src, outs["fsdp2"], outs["tp"], outs["cl-fsdp2"],
                                 outs["cl-tp"], outs["cl-moe"], outs["full"], outs["every"]), 2,
                   "DCP HF save from 2 gloo ranks", hard_s=150)
    return src, outs, base


@pytest.mark.parametrize("kind", ["fsdp2", "tp"])
def test_dcp_sharded_output_loads_at_tp4_byte_exact(dcp_out, kind):
    src, outs, _ = dcp_out
    out = outs[kind]
    files = sorted(os.listdir(out))
    assert files and all(f.startswith("shard-") and f.endswith(".safetensors") for f in files)
    assert "config.json" not in files          # DCP writes none: passed with config=
    meta = cl.read_checkpoint(out)
    assert max(len(t.pieces) for t in meta.tensors.values()) == 2
    layout = Layout(tp=4)
    for r in range(4):
        got = cl.load(out, layout, rank=r, config=src, verify="shapes")
        want = cl.load(src, layout, rank=r)
        assert got.keys() == want.keys(), r
        for n in want:
            assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), (kind, r, n)


@pytest.mark.parametrize("kind", ["fsdp2", "tp"])
def test_dcp_output_loads_with_every_engine_and_verifies_full_and_digest(dcp_out, kind,
                                                                          tmp_path):
    """DCP stores every rank's piece under the tensor's plain name; the safetensors engine
    and the re-reads of verify=full and of a lone rank's verify=digest asked for
    coordloader's sharded key ``name@a:b,...`` instead (``File does not contain tensor``)."""
    import shutil
    src, outs, _ = dcp_out
    out = str(tmp_path / kind)
    shutil.copytree(outs[kind], out)            # the manifest goes beside the copy
    meta = cl.read_checkpoint(out)
    cl.write_manifest(meta)
    layout = Layout(tp=4)
    for r in range(4):                          # each rank alone: no process group
        want = cl.load(src, layout, rank=r)
        for engine, verify in (("safetensors", "full"), ("cpu", "full"), ("safetensors", "digest")):
            got = cl.load(out, layout, rank=r, config=src, engine=engine, verify=verify)
            assert got.keys() == want.keys(), (r, engine)
            for n in want:
                assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), \
                    (kind, r, engine, n)
    assert {p.key for t in meta.tensors.values() for p in t.pieces} == set(meta.tensors)


def test_dcp_output_consolidates_to_a_checkpoint_transformers_loads(dcp_out):
    src, outs, base = dcp_out
    hf = str(base / "hf")
    cl.consolidate(outs["fsdp2"], hf, config=src)
    assert json.loads(open(os.path.join(hf, "config.json")).read())["architectures"] == \
        ["LlamaForCausalLM"]
    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(src)(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(hf)(ids).logits
    assert torch.equal(want, got)


def test_dcp_pieces_that_do_not_tile_are_refused(dcp_out, tmp_path):
    """The exact-cover check holds for DCP output too: a piece missing leaves a gap (here
    rank 1's file named as rank 0's, so that the shard numbers do not give it away), two
    copies of one rank's file overlap."""
    import shutil
    _, outs, _ = dcp_out
    files = sorted(os.listdir(outs["fsdp2"]))
    gap = tmp_path / "gap"
    os.makedirs(gap)
    shutil.copy(os.path.join(outs["fsdp2"], files[1]), gap / files[0])
    with pytest.raises(CheckpointError, match="expected them to tile the tensor exactly"):
        cl.read_checkpoint(str(gap))
    dup = tmp_path / "dup"
    shutil.copytree(outs["fsdp2"], dup)
    shutil.copy(dup / files[0], dup / files[0].replace("shard-00001", "shard-00009"))
    with pytest.raises(CheckpointError, match="overlap"):
        cl.read_checkpoint(str(dup))
    with pytest.raises(CheckpointError, match="one rank's shard of a torch DCP"):
        cl.read_checkpoint(os.path.join(outs["fsdp2"], files[0]))


def test_dcp_output_missing_its_last_rank_is_refused_against_the_config(dcp_out, tmp_path):
    """DCP records no global shape: without the last rank's file every tensor split on
    dim 0 shrank to the pieces present and loaded at half size without an error. The
    sizes config.json states (vocab, hidden) catch it."""
    import shutil
    src, outs, _ = dcp_out
    files = sorted(os.listdir(outs["fsdp2"]))
    short = tmp_path / "short"
    os.makedirs(short)
    shutil.copy(os.path.join(outs["fsdp2"], files[0]), short / files[0])
    cfg = json.load(open(os.path.join(src, "config.json")))
    with pytest.raises(CheckpointError) as e:
        cl.load(str(short), cl.Layout(), rank=0, config=cfg)
    assert str(e.value) == (
        f"file {files[0]}, tensor 'lm_head.weight': torch DCP's per-rank shards reach "
        f"{cfg['vocab_size'] // 2} along dim 0 of this tensor, but config.json says "
        f"vocab_size={cfg['vocab_size']}: DCP records no global shape, so a missing rank's "
        f"file shrinks the tensors; expected every rank's shard-*.safetensors file")
    # all of it: the config agrees
    assert cl.make_plan(outs["fsdp2"], cl.Layout(tp=2), config=cfg).world_size == 2


def test_dcp_shards_beside_an_index_are_refused(dcp_out, tmp_path):
    """An index beside DCP's per-rank files (which come without one) named one rank's file
    only: the load read that rank's pieces as whole tensors of half the size."""
    import json
    import shutil
    _, outs, _ = dcp_out
    d = tmp_path / "indexed"
    shutil.copytree(outs["fsdp2"], d)
    first = sorted(os.listdir(d))[0]
    names = cl.read_checkpoint(outs["fsdp2"]).tensors
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(names, first)}))
    with pytest.raises(CheckpointError) as e:
        cl.read_checkpoint(str(d))
    assert str(e.value) == (f"file model.safetensors.index.json: names torch DCP per-rank shards "
                            f"({first}, ...), which hold pieces of tensors and come without an "
                            f"index; expected an index of whole tensors, or DCP's shards alone "
                            f"in their directory")


def test_dcp_full_state_saved_without_save_distributed_loads_byte_exact(dcp_out):
    """HuggingFaceStorageWriter's default (no save_distributed) writes rank 0's full state
    dict as model-00001-of-00001.safetensors, marked DCP_SHARDING_INFO (offsets 0), with
    an index: it was refused as per-rank shards beside an index."""
    src, outs, _ = dcp_out
    assert sorted(os.listdir(outs["full"])) == ["model-00001-of-00001.safetensors",
                                                "model.safetensors.index.json"]
    layout = Layout(tp=2)
    for r in range(2):
        got = cl.load(outs["full"], layout, rank=r, config=src, verify="full")
        want = cl.load(src, layout, rank=r)
        assert got.keys() == want.keys(), r
        for n in want:
            assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), (r, n)


def _every_rank_file_as_left(outs, tmp_path, rank_file: int) -> str:
    """The output of every rank saving its pieces without save_distributed, as torch
    leaves it when rank ``rank_file``'s write lands last: that rank's pieces under the one
    file name, beside torch's own index (which sums every rank's bytes)."""
    import shutil
    d = tmp_path / f"every{rank_file}"
    os.makedirs(d)
    shutil.copy(os.path.join(outs["every"], "model.safetensors.index.json"), d)
    shards = sorted(os.listdir(outs["fsdp2"]))   # the same pieces, one file per rank
    shutil.copy(os.path.join(outs["fsdp2"], shards[rank_file]),
                d / "model-00001-of-00001.safetensors")
    return str(d)


def test_every_ranks_pieces_saved_without_save_distributed_are_refused(dcp_out, tmp_path):
    """Without save_distributed every rank writes its pieces to the same file names, so
    the file holds whichever rank's write landed last: rank 0's pieces sit at offset 0
    and would load as whole tensors of half the size; rank 1's name their offsets. Both
    are refused: torch's index counts every rank's bytes, and lists whole tensors."""
    _, outs, _ = dcp_out
    # torch's real output: the ranks' writes race, leaving one rank's pieces or a torn
    # file (its data shorter than its size, a header of one rank over another's bytes):
    # which refusal names it depends on the race; the two files a race leaves whole are
    # built below and their refusals pinned
    with pytest.raises(CheckpointError):
        cl.read_checkpoint(outs["every"])
    idx = json.load(open(os.path.join(outs["every"], "model.safetensors.index.json")))
    held = cl.read_checkpoint(outs["fsdp2"]).total_bytes
    rank0 = _every_rank_file_as_left(outs, tmp_path, 0)
    with pytest.raises(CheckpointError) as e:
        cl.read_checkpoint(rank0)
    assert idx["metadata"]["total_size"] == held
    assert str(e.value).startswith(
        f"file model.safetensors.index.json: gives total_size {held} bytes, but its files "
        f"hold ")
    assert str(e.value).endswith(
        "bytes of tensors: torch DCP sums every rank's bytes into it, and without "
        "save_distributed every rank writes the same file names (one rank's overwrote "
        "another's); expected a state dict saved from one rank, or save_distributed=True "
        "output")
    # an index whose total_size was lost (edited, re-serialised) cannot tell them apart
    for total in (None, float(held), str(held)):
        doc = dict(idx, metadata={} if total is None else {"total_size": total})
        with open(os.path.join(rank0, "model.safetensors.index.json"), "w") as f:
            json.dump(doc, f)
        with pytest.raises(CheckpointError, match="gives no integer metadata.total_size"):
            cl.read_checkpoint(rank0)
    with pytest.raises(CheckpointError) as e:
        cl.read_checkpoint(_every_rank_file_as_left(outs, tmp_path, 1))
    assert "places the tensor at offsets [" in str(e.value)
    assert str(e.value).endswith(
        "but the index 'model.safetensors.index.json' beside it lists whole tensors: torch "
        "DCP writes an index when it saves without save_distributed, where every rank writes "
        "the same file names and one rank's pieces overwrite another's; expected whole "
        "tensors (a state dict saved from one rank), or save_distributed=True output "
        "(per-rank files, no index)")


@pytest.mark.parametrize("kind", ["cl-fsdp2", "cl-tp"])
def test_cl_save_of_dtensor_state_loads_anywhere(dcp_out, kind):
    """FSDP2 / TP DTensor state -> coordloader.save (no plan: boxes from the placements)
    -> load at tp=2 and tp=4: every slice equals the source's."""
    src, outs, _ = dcp_out
    out = outs[kind]
    assert "coordloader-index.json" in os.listdir(out)
    meta = cl.read_checkpoint(out)
    assert max(len(t.pieces) for t in meta.tensors.values()) == 2
    for layout in (Layout(tp=2), Layout(tp=4)):
        for r in range(layout.world_size):
            got = cl.load(out, layout, rank=r, verify="digest")
            want = cl.load(src, layout, rank=r)
            assert got.keys() == want.keys()
            for n in want:
                assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), (kind, r, n)


def _strided_worker(rank, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        g = torch.Generator().manual_seed(3)
        full = {"colwise": torch.randn(8, 6, generator=g), "rowwise": torch.randn(6, 8, generator=g),
                "uneven": torch.randn(7, 3, generator=g), "norm": torch.randn(6, generator=g),
                "empty_rows": torch.empty(0, 6), "empty_cols": torch.empty(6, 0)}
        # FSDP2 over TP on the same dim (_StridedShard), TP rowwise under FSDP dim 0,
        # an uneven Shard with Replicate, a replicated tensor, and tensors without elements
        placements = {"colwise": [_StridedShard(0, split_factor=2), Shard(0)],
                      "rowwise": [Shard(0), Shard(1)],
                      "uneven": [Replicate(), Shard(0)],
                      "norm": [Replicate(), Replicate()],
                      "empty_rows": [Shard(0), Shard(1)],
                      "empty_cols": [Replicate(), Shard(0)]}
        state = {n: distribute_tensor(t, mesh, placements[n]) for n, t in full.items()}
        cl.save(out, state, config={"model_type": "toy"})
    finally:
        dist.destroy_process_group()


def test_cl_save_of_strided_and_2d_dtensors(tmp_path):
    out = str(tmp_path / "s")
    spawn_and_wait(_strided_worker, (free_port(), out), 4, "4-rank DTensor save", hard_s=90)
    g = torch.Generator().manual_seed(3)
    full = {"colwise": torch.randn(8, 6, generator=g), "rowwise": torch.randn(6, 8, generator=g),
            "uneven": torch.randn(7, 3, generator=g), "norm": torch.randn(6, generator=g),
            "empty_rows": torch.empty(0, 6), "empty_cols": torch.empty(6, 0)}
    from coordloader.handoff.consolidate import read_full
    meta = cl.read_checkpoint(out)
    # a tensor without elements is one empty piece (it used to vanish from the save)
    assert {n: len(t.pieces) for n, t in meta.tensors.items()} == \
        {"colwise": 4, "rowwise": 4, "uneven": 2, "norm": 1, "empty_rows": 1, "empty_cols": 1}
    for n, t in full.items():
        got = read_full(meta, n)
        assert got.shape == t.shape and torch.equal(got, t), n


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, ep=2), dict(tp=4, ep=2)], ids=str)
def test_cl_save_of_fsdp2_moe_state_loads_at_any_ep(dcp_out, layout, tmp_path):
    """FSDP2 state of a transformers 5 MoE model (fused gate_up_proj / down_proj) ->
    cl.save -> load at ep 1/2, experts split over 2 ranks at tp=4 ep=2: equal to a direct
    load of the same state written whole (whose split test_presets_hf checks against an
    independent vLLM-style reference)."""
    from safetensors.torch import save_file
    _, outs, _ = dcp_out
    whole = tmp_path / "whole"
    os.makedirs(whole)
    model = _moe_model()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(whole / "model.safetensors"))
    (whole / "config.json").write_text(json.dumps(model.config.to_dict()))
    L = Layout(**layout)
    for r in range(L.world_size):
        got = cl.load(outs["cl-moe"], L, rank=r, verify="digest")
        want = cl.load(str(whole), L, rank=r)
        assert got.keys() == want.keys() and any("experts.gate_up_proj" in n for n in got)
        for n in want:
            assert torch.equal(got[n], want[n]), (layout, r, n)


_ROWWISE = ("o_proj", "down_proj")
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _tp4_dcp_files(src: str, out, ranks) -> None:
    """DCP-style per-rank files of a TP=4 save of ``src`` (q/k/v/gate/up split on dim 0,
    o/down on dim 1, the replicated tensors spread over ranks 0..2 as DCP's dedup
    balances them), written for ``ranks`` only."""
    from safetensors.torch import load_file, save_file
    sd = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(src, f)))
    files = [({}, {}) for _ in range(4)]
    for i, (n, t) in enumerate(sorted(sd.items())):
        if any(k in n for k in _ROWWISE + _COLWISE):
            d = 1 if any(k in n for k in _ROWWISE) else 0
            off = 0
            for r, c in enumerate(torch.tensor_split(t, 4, dim=d)):
                files[r][0][n] = c.contiguous()
                files[r][1][n] = {"saved_offsets": [off if k == d else 0 for k in range(t.dim())]}
                off += c.shape[d]
        else:
            files[i % 3][0][n] = t
            files[i % 3][1][n] = {"saved_offsets": [0] * t.dim()}
    os.makedirs(out)
    for r in ranks:
        save_file(files[r][0], os.path.join(out, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": json.dumps(files[r][1])})


def test_dcp_tp_output_missing_its_last_rank_is_refused_on_the_sharded_dims(dcp_out, tmp_path):
    """TP=4 DCP output whose last rank held no replicated tensor: without its file, q/k/v
    and gate/up shrank to 3/4 along dim 0 and o/down along dim 1, and loaded at that
    size (verify="shapes" too), since only dim 0 of embed/lm_head/norms was compared."""
    src = dcp_out[0]
    cfg = json.load(open(os.path.join(src, "config.json")))
    full, short = tmp_path / "full", tmp_path / "short"
    _tp4_dcp_files(src, full, range(4))
    _tp4_dcp_files(src, short, range(3))
    for r in range(2):   # all four files: every check agrees, byte-exact
        got = cl.load(str(full), Layout(tp=2), rank=r, config=cfg)
        want = cl.load(src, Layout(tp=2), rank=r)
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), (r, n)
    name = next(n for n in cl.read_checkpoint(str(short)).tensors if "_proj" in n)
    t = cl.read_checkpoint(str(full)).tensors[name]
    dim = 1 if any(k in name for k in _ROWWISE) else 0
    key = {"o_proj": "num_attention_heads*head_dim", "down_proj": "intermediate_size",
           "gate_proj": "intermediate_size", "up_proj": "intermediate_size",
           "q_proj": "num_attention_heads*head_dim"}.get(name.split(".")[-2],
                                                         "num_key_value_heads*head_dim")
    with pytest.raises(CheckpointError) as e:
        cl.load(str(short), Layout(), rank=0, config=cfg, verify="shapes")
    assert str(e.value) == (
        f"file shard-00003-model-00001-of-00001.safetensors, tensor {name!r}: torch DCP's "
        f"per-rank shards reach {t.shape[dim] * 3 // 4} along dim {dim} of this tensor, but "
        f"config.json says {key}={t.shape[dim]}: DCP records no global shape, so a missing "
        f"rank's file shrinks the tensors; expected every rank's shard-*.safetensors file")


@pytest.mark.parametrize("kind", ["fsdp2", "tp4"])
def test_dcp_output_missing_its_last_rank_is_not_consolidated(dcp_out, kind, tmp_path):
    """consolidate(config=...) of DCP output without its last rank's file wrote the
    shrunken tensors as a plain HF checkpoint, beside a config.json stating the full
    sizes, which coordloader then loaded without a word. It is refused, and the target
    is left as it was."""
    import shutil
    src, outs, _ = dcp_out
    short = tmp_path / "short"
    if kind == "fsdp2":
        files = sorted(os.listdir(outs["fsdp2"]))
        os.makedirs(short)
        shutil.copy(os.path.join(outs["fsdp2"], files[0]), short / files[0])
        want = "reach 150 along dim 0 of this tensor, but config.json says vocab_size=300"
    else:
        _tp4_dcp_files(src, short, range(3))
        want = "along dim 1 of this tensor, but config.json says intermediate_size=256"
    hf = tmp_path / "hf"
    with pytest.raises(CheckpointError, match=want):
        cl.consolidate(str(short), str(hf), config=src)
    assert not hf.exists() or os.listdir(hf) == []
    # the whole output still consolidates
    full = tmp_path / "full"
    _tp4_dcp_files(src, full, range(4))
    cl.consolidate(str(full), str(tmp_path / "ok"), config=src)
    got = cl.load(str(tmp_path / "ok"), Layout(), rank=0)
    ref = cl.load(src, Layout(), rank=0)
    assert got.keys() == ref.keys()
    for n in ref:
        assert torch.equal(got[n].view(torch.uint8), ref[n].view(torch.uint8)), n


def _tiny_models():
    """Tiny transformers 5 models of every preset family whose names the extent check
    reads: their own shapes, as DCP would record them whole."""
    import test_presets_hf as ph
    from transformers import (
        DeepseekV3Config,
        LlamaConfig,
        MistralConfig,
        OPTConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )
    small = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    yield "llama", LlamaConfig(**small)
    yield "mistral", MistralConfig(**small, head_dim=None)
    # OPT-350m's embeddings and head are word_embed_proj_dim wide, not hidden_size: a whole
    # save of it was refused as short
    yield "opt", OPTConfig(vocab_size=100, hidden_size=32, word_embed_proj_dim=16, ffn_dim=48,
                           num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=False)
    yield "qwen2", Qwen2Config(**small)
    yield "qwen3", Qwen3Config(**small, head_dim=16)
    yield "qwen3_moe", Qwen3MoeConfig(**small, head_dim=16, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    yield "deepseek_v3", DeepseekV3Config(
        **{**small, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1)
    for f in ("qwen2_moe", "bert", "phi3", "gemma3", "glm4_moe", "gpt_oss", "llama4",
              "qwen3_next"):
        yield f, getattr(ph, f"_{f}_model")().config


@pytest.mark.parametrize("family, cfg", list(_tiny_models()), ids=lambda x: x if
                         isinstance(x, str) else "")
def test_dcp_extent_check_agrees_with_every_presets_own_shapes(family, cfg):
    """The extent check may only refuse what is short: a whole DCP save of each family
    (shapes from the transformers model itself) passes it, and one row or column less on
    any dim it compares is named. Qwen3-Next's gated q_proj is twice heads*head_dim; MLA
    attention (DeepSeek) is not compared."""
    from transformers import AutoModel, AutoModelForCausalLM

    from coordloader.checkpoint import metadata as md
    auto = AutoModel if family == "bert" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    doc = cfg.to_dict()

    def meta(sh):
        return md.CheckpointMeta(root="/x", files=(), config=doc, shapes_from_extents=True,
                                 tensors={n: md.TensorInfo(n, "F32", s, ()) for n, s in sh.items()})
    assert md.extent_mismatch(meta(shapes)) is None, family
    checked = 0
    for n, s in shapes.items():
        for suffix, dim, size in md._CONFIG_DIMS:
            if n.endswith(suffix) and len(s) > dim and size(doc) is not None:
                short = dict(shapes)
                short[n] = tuple(x - 1 if d == dim else x for d, x in enumerate(s))
                bad = md.extent_mismatch(meta(short))
                assert bad is not None and (bad[0], bad[3], bad[4]) == (n, s[dim] - 1, dim), (n, bad)
                checked += 1
    assert checked or family in ("bert", "phi3"), family


def test_dcp_extent_check_leaves_a_vision_tower_under_a_flat_config_alone():
    """The Hub's Qwen2.5-VL config.json states the text model's sizes at its top level:
    the vision tower's mlp (intermediate 24) was compared with the text model's 64 and a
    whole DCP save refused as missing a rank's file. The text model is still compared."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from coordloader.checkpoint import metadata as md
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=128),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                           out_hidden_size=32))
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    nested = cfg.to_dict()
    flat = {**nested["text_config"], **{k: v for k, v in nested.items() if k != "text_config"}}

    def meta(sh, doc):
        return md.CheckpointMeta(root="/x", files=(), config=doc, shapes_from_extents=True,
                                 tensors={n: md.TensorInfo(n, "F32", s, ()) for n, s in sh.items()})
    vision = "model.visual.blocks.0.mlp.down_proj.weight"
    assert shapes[vision] == (16, 24)
    assert md.extent_mismatch(meta(shapes, flat)) is None
    text = "model.language_model.layers.0.mlp.down_proj.weight"
    short = dict(shapes, **{text: (32, 32)})
    assert md.extent_mismatch(meta(short, flat)) == (text, "intermediate_size", 64, 32, 1)

@pytest.mark.parametrize("family, cfg", [(f, c) for f, c in _tiny_models()
                                         if f in ("qwen3_moe", "deepseek_v3", "qwen2_moe",
                                                  "gpt_oss", "llama4", "qwen3_next")],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_dcp_fused_experts_short_of_the_configs_count_are_named(family, cfg):
    """An EP save (experts a DTensor Shard(0), the rest deduplicated to rank 0) without its
    last rank's file holds half of every fused expert tensor and nothing else short:
    consolidate wrote [2, ...] experts beside a config of 4 (load refused it only later,
    in the planner). The experts count of config.json is compared with dim 0."""
    from transformers import AutoModel, AutoModelForCausalLM

    from coordloader.checkpoint import metadata as md
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg) if family != "bert" else AutoModel(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    fused = sorted(n for n in shapes if n.endswith((".experts.gate_up_proj", ".experts.down_proj")))
    assert fused, family
    for n in fused:
        shapes[n] = (shapes[n][0] // 2,) + shapes[n][1:]
    doc = cfg.to_dict()
    meta = md.CheckpointMeta(root="/x", files=(), config=doc, shapes_from_extents=True,
                             tensors={k: md.TensorInfo(k, "F32", s, ()) for k, s in shapes.items()})
    name, key, want, got, dim = md.extent_mismatch(meta)
    assert name in fused and (dim, got * 2) == (0, want) and key in md.EXPERT_COUNT_KEYS
    assert doc[key] == want


def _moe_dense_first() -> dict:
    """Qwen3-MoE whose first layer is dense (mlp_only_layers=[0]), as DeepSeek-style models
    have: its layer 0 tensors are replicated under expert parallelism, its experts are not."""
    from hfmodels import QWEN3_MOE
    return {**QWEN3_MOE, "mlp_only_layers": [0]}


def _dcp3_worker(rank, port, base):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import AutoModelForCausalLM
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        def save(state, name, **kw):
            dcp.save(state, storage_writer=HuggingFaceStorageWriter(
                os.path.join(base, name), save_distributed=True, **kw))
        # DDP: every rank holds every tensor whole; deduplication spreads them over ranks
        sd = AutoModelForCausalLM.from_pretrained(os.path.join(base, "llama")).state_dict()
        save(sd, "ddp")
        save(sd, "ddp-map", fqn_to_index_mapping={
            n: 1 if n == "model.embed_tokens.weight" else 2 for n in sd})
        # EP: fused experts split over the ranks, the dense first layer and the rest whole
        moe = AutoModelForCausalLM.from_pretrained(os.path.join(base, "moe")).state_dict()
        mesh = init_device_mesh("cpu", (3,))
        save({n: distribute_tensor(t, mesh, [Shard(0)]) if ".experts." in n else t
              for n, t in moe.items()}, "moe-ep", fqn_to_index_mapping={
            n: 1 if n.startswith("model.embed") or ".layers.0." in n else 2 for n in moe})
        # two pipeline stages, the first on ranks 0 and 1 with a single tensor: rank 1 is
        # left nothing by deduplication and writes no file
        save({"a": torch.arange(4.0)} if rank < 2 else {"b": torch.full((3,), 2.0)}, "gap")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dcp3_out(tmp_path_factory):
    from hfmodels import _write
    base = tmp_path_factory.mktemp("dcp3")
    write_llama(str(base / "llama"))
    _write(str(base / "moe"), "Qwen3MoeForCausalLM", "Qwen3MoeConfig", _moe_dense_first(), 0,
           torch.bfloat16, "150KB")
    # the reference: the state as DCP is handed it (experts fused in memory; save_pretrained
    # wrote them per expert), whole in one file
    from safetensors.torch import save_file
    moe = transformers.AutoModelForCausalLM.from_pretrained(str(base / "moe"))
    os.makedirs(base / "moe-whole")
    save_file({k: v.contiguous() for k, v in moe.state_dict().items()},
              str(base / "moe-whole" / "model.safetensors"))
    (base / "moe-whole" / "config.json").write_text(json.dumps(moe.config.to_dict()))
    spawn_and_wait(_dcp3_worker, (free_port(), str(base)), 3, "DCP HF save from 3 gloo ranks",
                   hard_s=150)
    return base


def _copy_without(src, dst, *drop):
    import shutil
    os.makedirs(dst)
    for n in os.listdir(src):
        if n not in drop:
            shutil.copy(os.path.join(src, n), os.path.join(dst, n))
    return str(dst)


def _refused_once_renamed(d: str, old: str, new: str) -> str:
    """The CheckpointError reading ``d`` gives once its file ``old`` is renamed ``new``."""
    os.rename(os.path.join(d, old), os.path.join(d, new))
    with pytest.raises(CheckpointError) as e:
        cl.read_checkpoint(d)
    return str(e.value)


def test_dcp_output_without_rank_0s_file_is_refused(dcp3_out, tmp_path):
    """DDP state saved by DCP from 3 ranks: deduplication writes each whole tensor in one
    rank's file only, so without rank 0's file the rest loaded as the whole model (17 of 21
    tensors, no error). Rank 0 always writes, so its file missing is refused by name."""
    full = str(dcp3_out / "ddp")
    assert sorted(os.listdir(full)) == [f"shard-0000{r}-model-00001-of-00001.safetensors"
                                        for r in (1, 2, 3)]
    src = str(dcp3_out / "llama")
    got = cl.load(full, Layout(), rank=0, config=src)
    want = cl.load(src, Layout(), rank=0)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    short = _copy_without(full, tmp_path / "short", "shard-00001-model-00001-of-00001.safetensors")
    with pytest.raises(CheckpointError) as e:
        cl.load(short, Layout(), rank=0, config=src)
    assert str(e.value) == (
        f"file {short}: holds torch DCP shards from shard-00002-model-00001-of-00001.safetensors "
        f"up but no shard-00001-model-00001-of-00001.safetensors, rank 0's file: rank 0 writes "
        f"one whenever it holds a tensor, so the copy is incomplete and every tensor only it "
        f"held would be missing; expected every rank's shard-*.safetensors file")
    assert _refused_once_renamed(short, "shard-00002-model-00001-of-00001.safetensors",
                                 "shard-00000-model-00001-of-00001.safetensors") == (
        f"file {short}: holds shard-00000-model-00001-of-00001.safetensors: torch DCP numbers "
        f"each rank's files from shard-00001 (rank 0); expected shard-00001 and up")


def test_dcp_files_of_two_saves_or_past_their_count_are_refused(dcp3_out, tmp_path):
    """Every file of one save states the same count M (the writer's fqn_to_index_mapping)
    and is numbered at most M: a file of another save beside them, or a name past the
    count, is refused naming both."""
    import shutil
    mixed = _copy_without(dcp3_out / "ddp-map", tmp_path / "mixed")
    shutil.copy(dcp3_out / "ddp" / "shard-00003-model-00001-of-00001.safetensors", mixed)
    with pytest.raises(CheckpointError) as e:
        cl.read_checkpoint(mixed)
    assert str(e.value) == (
        f"file {mixed}: holds torch DCP shards of different saves: "
        f"shard-00003-model-00001-of-00001.safetensors is one of 1 files per rank and "
        f"shard-00001-model-00001-of-00002.safetensors one of 2, while one save states one "
        f"count in every file name; expected one checkpoint per directory")
    past = _copy_without(dcp3_out / "ddp-map", tmp_path / "past")
    assert _refused_once_renamed(past, "shard-00002-model-00002-of-00002.safetensors",
                                 "shard-00002-model-00003-of-00002.safetensors") == (
        f"file {past}: holds shard-00002-model-00003-of-00002.safetensors, file 3 of 2: torch "
        f"DCP numbers a save's files up to their count; expected model-K-of-00002 with K at "
        f"most 2")


def test_dcp_output_with_shard_gaps_and_uneven_file_sets_loads(dcp3_out):
    """What a valid DCP save may look like, and so is never refused: a rank left nothing
    by deduplication writes no file (shard 2 absent between 1 and 3), and a rank writes
    only the files K it holds tensors of (DDP with a mapping, and EP of a MoE model whose
    first layer is dense)."""
    gap = str(dcp3_out / "gap")
    assert sorted(os.listdir(gap)) == ["shard-00001-model-00001-of-00001.safetensors",
                                       "shard-00003-model-00001-of-00001.safetensors"]
    from coordloader.handoff.consolidate import read_full
    meta = cl.read_checkpoint(gap)
    assert meta.tensors.keys() == {"a", "b"}
    assert torch.equal(read_full(meta, "a"), torch.arange(4.0))
    assert torch.equal(read_full(meta, "b"), torch.full((3,), 2.0))
    files = {k: sorted(os.listdir(dcp3_out / k)) for k in ("ddp-map", "moe-ep")}
    assert files["ddp-map"] == ["shard-00001-model-00001-of-00002.safetensors",
                                "shard-00001-model-00002-of-00002.safetensors",
                                "shard-00002-model-00002-of-00002.safetensors",
                                "shard-00003-model-00002-of-00002.safetensors"]
    assert len(files["moe-ep"]) == 6
    for kind, src, layout in (("ddp-map", "llama", Layout(tp=2)),
                              ("moe-ep", "moe-whole", Layout(tp=2, ep=2))):
        src = str(dcp3_out / src)
        for r in range(layout.world_size):
            got = cl.load(str(dcp3_out / kind), layout, rank=r, config=src)
            want = cl.load(src, layout, rank=r)
            assert got.keys() == want.keys(), (kind, r)
            for n in want:
                assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), \
                    (kind, r, n)


@pytest.mark.parametrize("other", ["index", "single", "adapter"])
def test_dcp_shards_beside_another_checkpoint_are_refused(dcp_out, tmp_path, other):
    """torch DCP's per-rank shards beside model.safetensors, or beside an index that names
    none of them: the other checkpoint was loaded and the shards ignored, no word; beside
    an adapter's file, the adapter's tensors loaded among the model's."""
    import shutil

    from safetensors.torch import save_file
    _, outs, _ = dcp_out
    d = tmp_path / "both"
    shutil.copytree(outs["fsdp2"], d)
    shard = sorted(os.listdir(d))[0]
    save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    if other == "adapter":
        os.rename(d / "model.safetensors", d / "adapter_model.safetensors")
    if other == "index":
        os.rename(d / "model.safetensors", d / "model-00001-of-00001.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(CheckpointError) as e:
        cl.read_checkpoint(str(d))
    if other == "index":
        assert str(e.value) == (f"file model.safetensors.index.json: lists none of the torch "
                                f"DCP per-rank shards beside it ({shard}, ...): two "
                                f"checkpoints; expected one checkpoint per directory: remove "
                                f"the stale one")
    elif other == "adapter":
        assert str(e.value) == (f"file {d}: holds adapter_model.safetensors (a file of no "
                                f"numbered set) and {shard} (torch DCP shards) but no index: "
                                f"which files make the checkpoint cannot be told; expected "
                                f"torch DCP's shards alone in their directory: move the other "
                                f"files out")
    else:
        assert str(e.value) == (f"file {d}: holds model.safetensors and torch DCP per-rank "
                                f"shards ({shard}, ...): two checkpoints; expected one "
                                f"checkpoint per directory: remove the stale one")



def test_dcp_extent_check_takes_the_classes_default_kv_heads():
    """A Mistral config.json without num_key_value_heads (transformers' default 8): the
    extent check took num_attention_heads (32) and refused a whole DCP save's k_proj."""
    from coordloader.checkpoint import metadata as md
    cfg = {"model_type": "mistral", "hidden_size": 128, "num_attention_heads": 32,
           "head_dim": 4, "intermediate_size": 128}
    shapes = {"model.layers.0.self_attn.q_proj.weight": (128, 128),
              "model.layers.0.self_attn.k_proj.weight": (32, 128),
              "model.layers.0.self_attn.v_proj.weight": (32, 128)}

    def meta(sh):
        return md.CheckpointMeta(root="/x", files=(), config=cfg, shapes_from_extents=True,
                                 tensors={n: md.TensorInfo(n, "F32", s, ()) for n, s in sh.items()})
    assert md.extent_mismatch(meta(shapes)) is None
    short = dict(shapes, **{"model.layers.0.self_attn.k_proj.weight": (16, 128)})
    assert md.extent_mismatch(meta(short)) == ("model.layers.0.self_attn.k_proj.weight",
                                        "num_key_value_heads*head_dim", 32, 16, 0)


def test_dcp_pieces_spanning_2_63_bytes_are_refused():
    """Each piece of a DCP tensor below 2**63 bytes (its header entry's check), their union
    not: the reader accepted a global shape of 2**63 + 4096 I8 elements, planned it, and
    the load ended in torch's bare allocation error. Sparse files on tmpfs (ext4 holds no
    file this large)."""
    from coordloader.errors import CheckpointError

    from helpers import shm_dir, write_sparse_st
    with shm_dir() as root:
        for i, (n, off) in enumerate(((2**63 - 4096, 0), (8192, 2**63 - 4096))):
            write_sparse_st(
                os.path.join(root, f"shard-0000{i + 1}-model-00001-of-00001.safetensors"),
                {"__metadata__": {"DCP_SHARDING_INFO": json.dumps({"v": {"saved_offsets": [off]}})},
                 "v": {"dtype": "I8", "shape": [n], "data_offsets": [0, n]}})
        with pytest.raises(CheckpointError) as ei:
            cl.read_checkpoint(root)
        assert str(ei.value) == (
            "file shard-00001-model-00001-of-00001.safetensors, tensor 'v': pieces span shape "
            "[9223372036854779904], I8: the tensor would be 2**63 bytes or more; expected below "
            "2**63")


@pytest.mark.parametrize("rows", [136, 64])
def test_dcp_pieces_past_the_configs_size_say_the_config_does_not_fit(tmp_path, rows):
    """An embedding of 136 rows (a vocabulary padded in training, or a smaller model's
    config) under vocab_size=128 was called "a missing rank's file shrinks the tensors":
    pieces reaching past the config's size cannot come from a missing file."""
    from safetensors.torch import save_file
    src = tmp_path / "dcp"
    src.mkdir()
    emb = torch.randn(rows, 16)
    half = rows // 2
    for r, (a, b) in enumerate([(0, half), (half, rows)]):
        save_file({"model.embed_tokens.weight": emb[a:b].contiguous()},
                  str(src / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": json.dumps(
                      {"model.embed_tokens.weight": {"saved_offsets": [a, 0]}})})
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128,
           "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
           "intermediate_size": 32}
    with pytest.raises(CheckpointError) as ei:
        cl.consolidate(str(src), str(tmp_path / "hf"), config=cfg)
    head = ("file shard-00002-model-00001-of-00001.safetensors, tensor "
            f"'model.embed_tokens.weight': torch DCP's per-rank shards reach {rows} along dim 0 "
            "of this tensor")
    assert str(ei.value) == head + (
        ", past the vocab_size=128 config.json says: the config does not fit the weights "
        "(another model's config, or a vocabulary padded in training); pass the config the "
        "model was trained with (config= / --config)" if rows > 128 else
        ", but config.json says vocab_size=128: DCP records no global shape, so a missing "
        "rank's file shrinks the tensors; expected every rank's shard-*.safetensors file")
    assert not (tmp_path / "hf").exists()
