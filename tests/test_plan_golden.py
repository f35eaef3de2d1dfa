"""Golden shapes against hand-computed vLLM layouts (full published dims, metadata only)."""
import pytest

from coordloader.api import make_plan
from coordloader.errors import PlanError
from coordloader.layout import Layout
from coordloader.planning.cover import validate_cover
from coordloader.planning.planner import meta_from_specs
from coordloader.synth.archs import arch_tensors


def meta(arch, size="full", files=8):
    cfg, specs = arch_tensors(arch, size)
    return meta_from_specs(cfg, specs, files=files)


@pytest.fixture(scope="module")
def dsv3():
    return meta("deepseek_v3", files=163)


@pytest.fixture(scope="module")
def dsv3_plan(dsv3):
    plan = make_plan(dsv3, Layout(tp=8, ep=8))
    validate_cover(plan, dsv3)
    return plan


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_deepseek_v3_tp8_ep8(dsv3_plan, dsv3):
    r3 = dsv3_plan.rank(3).by_name()
    L = "model.layers.5."
    assert r3[L + "self_attn.q_b_proj.weight"].local_shape == (3072, 1536)
    assert r3[L + "self_attn.q_b_proj.weight_scale_inv"].local_shape == (24, 12)
    assert r3[L + "self_attn.kv_b_proj.weight"].local_shape == (4096, 512)
    o = r3[L + "self_attn.o_proj.weight"]
    assert o.local_shape == (7168, 2048)
    assert r3[L + "self_attn.o_proj.weight_scale_inv"].local_shape == (56, 16)
    # dim-1 slice of a [7168, 16384] FP8 tensor: one 2048-byte run per row
    assert len(o.byte_runs) == 7168 and {r.length for r in o.byte_runs} == {2048}
    assert o.pieces[0].src == ((0, 7168), (3 * 2048, 4 * 2048))
    kva = r3[L + "self_attn.kv_a_proj_with_mqa.weight"]
    assert kva.local_shape == kva.global_shape == (576, 7168) and kva.replica == 3
    assert r3[L + "mlp.shared_experts.gate_proj.weight"].local_shape == (256, 7168)
    assert r3[L + "mlp.shared_experts.down_proj.weight"].local_shape == (7168, 256)
    emb = r3["model.embed_tokens.weight"]
    assert emb.local_shape == (16160, 7168) and not emb.needs_zero_fill
    assert emb.pieces[0].src == ((3 * 16160, 4 * 16160), (0, 7168))
    assert r3["lm_head.weight"].local_shape == (16160, 7168)
    experts = {int(n.split(".")[5]) for n in r3 if ".mlp.experts." in n}
    assert experts == set(range(96, 128))
    e = r3[L + "mlp.experts.100.down_proj.weight"]
    assert e.local_shape == (7168, 2048) and e.replica == 0 and len(e.byte_runs) == 1
    assert r3[L + "mlp.experts.100.down_proj.weight_scale_inv"].local_shape == (56, 16)
    # dense first layers
    assert r3["model.layers.0.mlp.gate_proj.weight"].local_shape == (2304, 7168)
    assert r3["model.layers.0.mlp.down_proj.weight_scale_inv"].local_shape == (56, 18)
    # MTP layer 61 excluded by default
    assert all(n.startswith("model.layers.61.") for n in dsv3_plan.excluded)
    assert "model.layers.61.eh_proj.weight" in dsv3_plan.excluded
    assert not any(n.startswith("model.layers.61.") for n in r3)


def test_deepseek_v3_tp32_dense_mlp_not_block_multiple(dsv3):
    with pytest.raises(PlanError) as ei:
        make_plan(dsv3, Layout(tp=32, ep=32))
    msg = str(ei.value)
    assert "576" in msg and "128" in msg and "tp=32" in msg and "mlp" in msg


def test_deepseek_v3_include_mtp_pp(dsv3):
    plan = make_plan(dsv3, Layout(tp=8, pp=2, ep=8, include_mtp=True))
    assert not plan.excluded
    last = plan.rank(8).by_name()
    assert "model.layers.61.eh_proj.weight" in last
    assert last["model.layers.61.embed_tokens.weight"].local_shape == (16160, 7168)
    assert "model.embed_tokens.weight" not in last and "lm_head.weight" in last
    first = plan.rank(0).by_name()
    assert "model.embed_tokens.weight" in first and "model.norm.weight" not in first
    # vLLM get_pp_indices: 61 layers over 2 stages -> 31 + 30
    assert "model.layers.30.input_layernorm.weight" in first
    assert "model.layers.31.input_layernorm.weight" in last


@pytest.mark.slow   # full-size metadata
def test_qwen3_30b_a3b_tp8_kv_replicated():
    m = meta("qwen3_moe")
    plan = make_plan(m, Layout(tp=8))
    validate_cover(plan, m)
    k = "model.layers.0.self_attn.k_proj.weight"
    shapes = [plan.rank(r).by_name()[k] for r in range(8)]
    assert all(s.local_shape == (128, 2048) for s in shapes)
    # 4 KV heads over 8 ranks: head r // 2, ranks 2h (primary) and 2h+1 (replica)
    assert [s.replica for s in shapes] == [0, 1] * 4
    assert [s.pieces[0].src[0] for s in shapes] == [(128 * (r // 2), 128 * (r // 2 + 1)) for r in range(8)]
    assert plan.rank(0).by_name()["model.layers.0.self_attn.q_proj.weight"].local_shape == (512, 2048)
    # ep=1 with moe_tp=8: experts split 8 ways, gate/up dim 0, down dim 1
    e = plan.rank(5).by_name()
    assert e["model.layers.0.mlp.experts.7.gate_proj.weight"].local_shape == (96, 2048)
    assert e["model.layers.0.mlp.experts.7.down_proj.weight"].local_shape == (2048, 96)
    assert e["model.layers.0.self_attn.q_norm.weight"].local_shape == (128,)


def test_minilm_vocab_padding_tp2():
    m = meta("bert", "small", files=1)
    plan = make_plan(m, Layout(tp=2))
    validate_cover(plan, m)
    w = [plan.rank(r).by_name()["embeddings.word_embeddings.weight"] for r in range(2)]
    assert [s.local_shape for s in w] == [(15264, 384)] * 2      # 30528 / 2
    assert w[0].pieces[0].src == ((0, 15264), (0, 384)) and not w[0].needs_zero_fill
    assert w[1].pieces[0].src == ((15264, 30522), (0, 384)) and w[1].needs_zero_fill
    r0 = plan.rank(0).by_name()
    assert r0["encoder.layer.0.attention.self.query.weight"].local_shape == (192, 384)
    assert r0["encoder.layer.0.attention.output.dense.weight"].local_shape == (384, 192)
    assert r0["encoder.layer.0.attention.output.dense.bias"].local_shape == (384,)
    assert r0["encoder.layer.0.intermediate.dense.weight"].local_shape == (768, 384)
    assert r0["encoder.layer.0.output.dense.weight"].local_shape == (384, 768)
    # vLLM's BERT splits the position and token type embeddings like the vocab
    assert r0["embeddings.position_embeddings.weight"].local_shape == (256, 384)
    assert r0["embeddings.token_type_embeddings.weight"].local_shape == (32, 384)
    assert plan.rank(1).by_name()["pooler.dense.weight"].replica == 1


def test_llama3_8b_and_mixtral():
    m = meta("llama")
    plan = make_plan(m, Layout(tp=8))
    r = plan.rank(2).by_name()
    assert r["model.layers.0.self_attn.q_proj.weight"].local_shape == (512, 4096)
    assert r["model.layers.0.self_attn.k_proj.weight"].local_shape == (128, 4096)
    assert r["model.layers.0.self_attn.o_proj.weight"].local_shape == (4096, 512)
    assert r["model.layers.0.mlp.gate_proj.weight"].local_shape == (1792, 4096)
    assert r["model.embed_tokens.weight"].local_shape == (16032, 4096)
    mx = meta("mixtral")
    plan = make_plan(mx, Layout(tp=8, ep=8))
    validate_cover(plan, mx)
    r = plan.rank(6).by_name()
    assert {n.split(".")[5] for n in r if ".experts." in n} == {"6"}
    assert r["model.layers.0.block_sparse_moe.experts.6.w2.weight"].local_shape == (4096, 14336)
    plan = make_plan(mx, Layout(tp=8, ep=2))    # moe_tp = 4
    r = plan.rank(5).by_name()
    assert r["model.layers.0.block_sparse_moe.experts.5.w1.weight"].local_shape == (3584, 4096)
    assert r["model.layers.0.block_sparse_moe.experts.5.w2.weight"].local_shape == (4096, 3584)
    assert not any(".experts.3." in n for n in r)
