import dataclasses

import pytest

from coordloader.api import make_plan
from coordloader.checkpoint.tiling import tiling_problem
from coordloader.errors import PlanError, VerifyError
from coordloader.layout import Layout
from coordloader.planning.cover import check_cover, validate_cover
from coordloader.planning.model import ByteRun, Piece, Plan, RankPlan
from coordloader.planning.planner import meta_from_specs
from coordloader.planning.runs import RunList, box_runs

CFG = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
       "num_hidden_layers": 1, "tie_word_embeddings": False}
SPECS = [("model.embed_tokens.weight", "BF16", (100, 8)), ("lm_head.weight", "BF16", (100, 8)),
         ("model.norm.weight", "F32", (8,)),
         ("model.layers.0.self_attn.q_proj.weight", "BF16", (8, 8)),
         ("model.layers.0.self_attn.k_proj.weight", "BF16", (4, 8)),
         ("model.layers.0.self_attn.o_proj.weight", "BF16", (8, 8))]


def setup():
    meta = meta_from_specs(CFG, SPECS, files=2)
    return meta, make_plan(meta, Layout(tp=4, dp=2))


def replace_slice(plan, rank, which, **kw):
    ranks = list(plan.ranks)
    rp = ranks[rank]
    ranks[rank] = RankPlan(rp.rank, rp.coords, tuple(dataclasses.replace(s, **kw) if s.name == which else s
                                                     for s in rp.tensors))
    return Plan(plan.layout, plan.fingerprint, tuple(ranks), plan.excluded)


def test_valid_plan_passes():
    meta, plan = setup()
    validate_cover(plan, meta)


def test_tiling_problem_kinds():
    assert tiling_problem([((0, 2), (0, 4)), ((2, 4), (0, 4))], (4, 4)) is None
    assert tiling_problem([((0, 4), (0, 2)), ((0, 4), (2, 4))], (4, 4)) is None
    assert tiling_problem([((0, 2), (0, 4)), ((1, 4), (0, 4))], (4, 4))[0] == "overlap"
    assert tiling_problem([((0, 2), (0, 4))], (4, 4))[0] == "gap"
    assert tiling_problem([((0, 5), (0, 4))], (4, 4))[0] == "outside"
    # a zero-element tensor is tiled by its one empty box; elsewhere an empty box is refused
    assert tiling_problem([((0, 0), (0, 4))], (0, 4)) is None
    assert tiling_problem([((1, 1), (0, 4)), ((0, 4), (0, 4))], (4, 4))[0] == "outside"
    assert tiling_problem([((1, 1), (0, 4)), ((0, 4), (0, 4))], (4, 4), allow_empty=True) is None
    # checkerboard of 16 boxes in a random order
    boxes = [((i, i + 1), (j, j + 1)) for j in range(4) for i in (3, 1, 0, 2)]
    assert tiling_problem(boxes, (4, 4)) is None
    assert tiling_problem(boxes + [((2, 3), (1, 2))], (4, 4))[0] == "overlap"


def test_duplicated_primary_named():
    meta, plan = setup()
    n = "model.layers.0.self_attn.q_proj.weight"
    bad = replace_slice(plan, 1, n, pieces=plan.rank(0).by_name()[n].pieces,
                        byte_runs=plan.rank(0).by_name()[n].byte_runs)
    with pytest.raises(PlanError, match="duplicated primary") as ei:
        validate_cover(bad, meta)
    assert ei.value.tensor == n and ei.value.rank in (0, 1)


def test_missing_piece_and_bad_replica():
    meta, plan = setup()
    n = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(PlanError, match="missing piece|only replicas|replica that equals no primary"):
        validate_cover(replace_slice(plan, 2, n, replica=1), meta)
    # a replica (dp 1) whose boxes match no primary
    s = plan.rank(5).by_name()[n]
    assert s.replica == 1
    # columns 1..3: fits the local (8, 2) tensor, with exact byte runs, so only the replica
    # check can object (empty runs here would trip the byte-count check first)
    box = ((0, 8), (1, 3))
    sp = meta.tensors[n].pieces[0]
    runs = RunList(box_runs(sp.file, sp.start, sp.box, (8, 8), box, s.local_shape, (0, 0), 2))
    bad = replace_slice(plan, 5, n, pieces=(Piece(box, (0, 0)),), byte_runs=runs)
    with pytest.raises(PlanError, match="replica that equals no primary") as ei:
        validate_cover(bad, meta)
    assert ei.value.rank == 5 and ei.value.tensor == n


def test_bad_byte_runs_and_unknown_tensor():
    meta, plan = setup()
    n = "model.norm.weight"
    s = plan.rank(0).by_name()[n]
    with pytest.raises(PlanError, match="byte runs add up"):
        validate_cover(replace_slice(plan, 0, n, byte_runs=()), meta)
    # the right byte count, but read from the embedding's bytes
    emb = meta.tensors["model.embed_tokens.weight"].pieces[0]
    with pytest.raises(PlanError, match="outside the tensor's bytes"):
        validate_cover(replace_slice(plan, 0, n, byte_runs=(ByteRun(emb.file, emb.start,
                                                                    s.bytes_to_read, 0),)), meta)
    with pytest.raises(PlanError, match="not in the checkpoint"):
        validate_cover(replace_slice(plan, 0, n, name="nope"), meta)


def test_check_cover_views():
    shapes = {"a": (4, 6), "b": (3,)}
    good = [(0, [("a", [[[0, 2], [0, 6]]], 0), ("b", [[[0, 3]]], 0)]),
            (1, [("a", [Piece(((2, 4), (0, 6)), (0, 0))], 0), ("b", [[[0, 3]]], 1)])]
    check_cover(good, shapes)
    with pytest.raises(VerifyError, match="replica that equals no primary") as ei:
        check_cover(good + [(2, [("b", [[[0, 2]]], 2)])], shapes, error=VerifyError)
    assert ei.value.rank == 2
    with pytest.raises(PlanError, match="duplicated primary") as ei:
        check_cover(good + [(3, [("a", [[[1, 2], [0, 6]]], 0)])], shapes)
    assert ei.value.rank in (0, 3) and ei.value.tensor == "a"
    with pytest.raises(PlanError, match="no rank holds"):
        check_cover(good[:1] + [(1, [("a", [[[2, 4], [0, 6]]], 0)])], {"a": (4, 6), "b": (3,), "c": (1,)})
    check_cover(good, {"a": (4, 6), "b": (3,), "c": (1,)}, excluded=["c"])
    with pytest.raises(PlanError, match="outside"):
        check_cover([(0, [("b", [[[0, 4]]], 0)])], {"b": (3,)})


def test_check_cover_views_with_copy_pieces():
    """A piece marked as a copy (Piece.copy: a K/V head of a fused qkv on every TP rank)
    is a replica of one primary piece, whatever its slice's replica id says."""
    shapes = {"qkv": (6, 2)}
    k = ((4, 6), (0, 2))
    good = [(0, [("qkv", [Piece(((0, 2), (0, 2)), (0, 0)), Piece(k, (2, 0))], 0)]),
            (1, [("qkv", [Piece(((2, 4), (0, 2)), (0, 0)), Piece(k, (2, 0), True)], 0)])]
    check_cover(good, shapes)
    unmarked = good[:1] + [(1, [("qkv", [Piece(((2, 4), (0, 2)), (0, 0)), Piece(k, (2, 0))], 0)])]
    with pytest.raises(PlanError, match="duplicated primary"):
        check_cover(unmarked, shapes)
    off = good + [(2, [("qkv", [Piece(((3, 5), (0, 2)), (0, 0), True)], 0)])]
    with pytest.raises(VerifyError, match="copy equals no primary") as ei:
        check_cover(off, shapes, error=VerifyError)
    assert ei.value.rank == 2




def test_a_dp_replica_holding_another_ranks_part_is_refused():
    """Tiny llama at tp=2 dp=2, rank 3 (tp 1 of dp replica 1) given rank 2's slices with
    the same replica ids: replica 1 held [:, 0:64] of a split tensor twice and [:, 64:128]
    on no rank, and the cover passed, as each replica only had to equal *some* primary."""
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors("llama", "tiny")
    meta = meta_from_specs(cfg, specs)
    plan = make_plan(meta, Layout(tp=2, dp=2))
    validate_cover(plan, meta)
    ranks = tuple(rp if rp.rank != 3 else RankPlan(3, dict(rp.coords), tuple(plan.rank(2).tensors))
                  for rp in plan.ranks)
    bad = Plan(plan.layout, plan.fingerprint, ranks, plan.excluded, plan.load_groups)
    with pytest.raises(PlanError, match=r"replica 1 holds \[\S+\] twice \(ranks 2 and 3\) "
                                        r"and misses \[\S+\]") as ei:
        validate_cover(bad, meta)
    assert ei.value.rank == 3 and ei.value.tensor in meta.tensors
    # the same in the view form verify gathers
    views = [(0, [("w", [[[0, 4], [0, 2]]], 0)]), (1, [("w", [[[0, 4], [2, 4]]], 0)]),
             (2, [("w", [[[0, 4], [0, 2]]], 1)]), (3, [("w", [[[0, 4], [0, 2]]], 1)])]
    with pytest.raises(VerifyError) as ei:
        check_cover(views, {"w": (4, 4)}, error=VerifyError)
    assert ei.value.rank == 3 and ei.value.message == (
        "replica 1 holds [0:4,0:2] twice (ranks 2 and 3) and misses [0:4,2:4] (no rank holds "
        "it as replica 1): each replica of a primary's pieces is held by one rank")
    views[3] = (3, [("w", [[[0, 4], [2, 4]]], 1)])
    check_cover(views, {"w": (4, 4)})



def test_a_rank_class_holding_one_replica_id_twice_is_refused():
    """The same fault inside the planner's shared structures: at tp=2 dp=3, ranks 0, 2 and
    4 (one rank class) hold tp shard 0 as replicas 0, 1 and 2; a replica table giving
    rank 4 id 1 too was passed by the column proof (one primary per class sufficed)."""
    from coordloader.planning.model import SharedRankPlan, SharedSlices, share_of
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors("llama", "tiny")
    meta = meta_from_specs(cfg, specs)
    plan = make_plan(meta, Layout(tp=2, dp=3))
    validate_cover(plan, meta)
    sh = share_of(plan.rank(0))
    assert sh.ranks == (0, 2, 4)
    n = "model.layers.0.self_attn.o_proj.weight"
    k = sh.tables[[s.name for s in sh.slices].index(n)]
    assert [sh.replicas[k][r] for r in (0, 2, 4)] == [0, 1, 2]
    reps = list(sh.replicas)
    reps[k] = tuple(1 if r == 4 else i for r, i in enumerate(reps[k]))
    bad_sh = SharedSlices(sh.slices, sh.tables, tuple(reps), sh.ranks)
    bad = Plan(plan.layout, plan.fingerprint,
               tuple(SharedRankPlan.make(rp.rank, rp.coords, bad_sh) if rp.rank in sh.ranks else rp
                     for rp in plan.ranks), plan.excluded, plan.load_groups)
    with pytest.raises(PlanError, match=r"replica 1 holds \[\S+\] twice \(ranks 2 and 4\)") as ei:
        validate_cover(bad, meta)
    assert ei.value.rank == 4

def test_replica_ids_of_one_primary_are_one_rank_each_in_turn():
    """A primary's pieces may have more replicas than another's (a redundant expert set,
    an empty uneven chunk), but they are numbered 1, 2, ... with none skipped or held twice."""
    shapes = {"x": (4,)}
    good = [(0, [("x", [[[0, 2]]], 0)]), (1, [("x", [[[2, 4]]], 0)]), (2, [("x", [[[0, 2]]], 1)])]
    check_cover(good, shapes)
    with pytest.raises(PlanError) as ei:
        check_cover(good[:2] + [(2, [("x", [[[0, 2]]], 2)])], shapes)
    assert ei.value.message.startswith("[0:2] is held as replicas 0, 2 (ranks 0,2) but by no "
                                       "rank as replica 1")
    # a slice that holds no element has no part to lose: its replica ids are not checked
    check_cover(good + [(3, [("x", [], 0)]), (4, [("x", [], 1)]), (5, [("x", [], 1)])], shapes)
    # a redundant fused expert set: experts 0-1 on two ep ranks, 2-3 on one
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2, "hidden_size": 4,
           "num_hidden_layers": 1, "intermediate_size": 2, "vocab_size": 10,
           "num_local_experts": 4, "tie_word_embeddings": False}
    p = "model.layers.0."
    specs = [("model.embed_tokens.weight", "BF16", (10, 4)), ("model.norm.weight", "F32", (4,)),
             ("lm_head.weight", "BF16", (10, 4)), (p + "input_layernorm.weight", "F32", (4,)),
             (p + "self_attn.q_proj.weight", "BF16", (4, 4)),
             (p + "self_attn.k_proj.weight", "BF16", (2, 4)),
             (p + "self_attn.v_proj.weight", "BF16", (2, 4)),
             (p + "self_attn.o_proj.weight", "BF16", (4, 4)),
             (p + "self_attn.sinks", "F32", (2,)), (p + "mlp.router.weight", "BF16", (4, 4)),
             (p + "mlp.experts.gate_up_proj", "BF16", (4, 4, 4)),
             (p + "mlp.experts.down_proj", "BF16", (4, 2, 4))]
    meta = meta_from_specs(cfg, specs)
    plan = make_plan(meta, Layout(dp=3, ep=3, ep_spans_dp=True,
                                  expert_placement=((0, 1), (0, 1), (2, 3))))
    validate_cover(plan, meta)
    held = {rp.rank: rp.by_name()[p + "mlp.experts.down_proj"] for rp in plan.ranks}
    assert [(s.pieces[0].src[0][0], s.pieces[-1].src[0][1], s.replica)
            for s in held.values()] == [(0, 2, 0), (0, 2, 1), (2, 4, 0)]

def test_a_run_across_saved_pieces_back_to_back_in_a_file_is_valid(tmp_path):
    # A save at ep=2 writes each rank's fused experts as one piece per expert, back to back
    # in its file; a plan at tp=1 reads two such pieces in one run. The cover refused that
    # valid plan, and with it the plan CLI.
    import json

    import torch
    from safetensors.torch import save_file

    import coordloader as cl
    src, out = tmp_path / "src", str(tmp_path / "saved")
    src.mkdir()
    E, I, H = 4, 4, 8
    (src / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": E,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "hidden_size": H, "tie_word_embeddings": True}))
    g = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=g),
               "model.layers.0.mlp.experts.down_proj": torch.randn(E, H, I, generator=g)},
              str(src / "model.safetensors"))
    a = Layout(tp=2, ep=2)
    plan_a = make_plan(str(src), a)
    for r in range(a.world_size):
        cl.save(out, cl.load(str(src), a, rank=r), plan_a, rank=r, config=str(src))
    meta = cl.read_checkpoint(out)
    plan = make_plan(meta, Layout())
    crossing = [s.name for s in plan.rank(0).tensors
                if any(g[2] * g[4] > max(p.end - p.start for p in meta.tensors[s.name].pieces)
                       for g in s.byte_runs.groups)]
    assert crossing, "no run spans two saved pieces: the case is not reached"
    validate_cover(plan, meta)
    want, got = cl.load(str(src), Layout(), rank=0), cl.load(out, Layout(), rank=0)
    assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
