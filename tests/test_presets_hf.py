"""Presets against checkpoints transformers itself writes.

Each family: a tiny random model from its transformers config, every parameter refilled
with seeded values (transformers starts biases at zero and norms at one, which would hide
a swapped slice), written by ``save_pretrained`` in several shards with a vocab that is
not a multiple of 64. ``coordloader.load(..., rank=r)`` gives every rank's tensors in this
process; each is compared with a reference slicer written here from vLLM's model files,
not from the planner."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch
from safetensors import safe_open

import coordloader as cl

transformers = pytest.importorskip("transformers")

VOCAB = 100          # not a multiple of 64: the last TP rank holds zero padding rows
PAD = 64


class Coords(NamedTuple):
    tp: int
    tp_rank: int
    ep: int          # 1 when experts are only split by TP
    moe_tp: int
    ep_rank: int
    moe_tp_rank: int


def coords_of(layout: dict, rank: int) -> Coords:
    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    tp_rank = rank % tp
    moe_tp = tp // ep
    return Coords(tp, tp_rank, ep, moe_tp, tp_rank // moe_tp, tp_rank % moe_tp)


# --- the reference: vLLM's parallel layers, one function each ---------------------------

def split(t: torch.Tensor, dim: int, parts: int, i: int) -> torch.Tensor:
    """ColumnParallelLinear (dim 0) / RowParallelLinear (dim 1): equal contiguous chunks."""
    n = t.shape[dim] // parts
    assert n * parts == t.shape[dim], (t.shape, dim, parts)
    return t.narrow(dim, i * n, n)


def vocab_parallel(t: torch.Tensor, c: Coords) -> torch.Tensor:
    """VocabParallelEmbedding / ParallelLMHead: rows padded to 64, split over TP."""
    vp = -(-t.shape[0] // PAD) * PAD
    padded = torch.zeros((vp,) + tuple(t.shape[1:]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    return split(padded, 0, c.tp, c.tp_rank)


def qkv_heads(t: torch.Tensor, heads: int, c: Coords, kv: bool) -> torch.Tensor:
    """QKVParallelLinear: whole heads per rank; K/V heads replicate when tp > kv heads."""
    hd = t.shape[0] // heads
    if c.tp > heads:
        assert kv
        h = c.tp_rank // (c.tp // heads)
        return t.narrow(0, h * hd, hd)
    return split(t, 0, c.tp, c.tp_rank)


def linear_experts(num: int, c: Coords) -> range:
    """FusedMoE's linear expert placement over the EP ranks."""
    base, rem = divmod(num, c.ep)
    q = c.ep_rank
    start = q * base + min(q, rem)
    return range(start, start + base + (q < rem))


# --- families -----------------------------------------------------------------------------

class Family(NamedTuple):
    name: str
    make: Callable[[], object]                 # -> a transformers model
    reference: Callable[[str, torch.Tensor, dict, Coords], torch.Tensor | None]
    layouts: tuple


def _qwen2_moe_model():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                         mlp_only_layers=[1], tie_word_embeddings=False)
    return Qwen2MoeForCausalLM(cfg)


def _qwen2_moe_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM qwen2_moe.py: Qwen2MoeAttention (QKVParallelLinear with bias, RowParallelLinear
    o_proj), Qwen2MoeSparseMoeBlock (ReplicatedLinear gate, FusedMoE experts, shared_expert
    a Qwen2MoeMLP, shared_expert_gate a replicated nn.Linear), dense Qwen2MoeMLP on
    mlp_only_layers, VocabParallelEmbedding and ParallelLMHead."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_parallel(t, c)
    parts = name.split(".")
    leaf = ".".join(parts[3:])                 # after model.layers.N.
    if leaf.startswith("self_attn.q_proj."):
        return qkv_heads(t, cfg["num_attention_heads"], c, kv=False)
    if leaf.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return qkv_heads(t, cfg["num_key_value_heads"], c, kv=True)
    if leaf == "self_attn.o_proj.weight":
        return split(t, 1, c.tp, c.tp_rank)
    if leaf.startswith("mlp.experts."):
        e, proj = int(parts[5]), parts[6]
        if e not in linear_experts(cfg["num_experts"], c):
            return None
        return split(t, 1 if proj == "down_proj" else 0, c.moe_tp, c.moe_tp_rank)
    if leaf in ("mlp.gate.weight", "mlp.shared_expert_gate.weight"):
        return t
    if leaf in ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                "mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return split(t, 0, c.tp, c.tp_rank)
    if leaf in ("mlp.shared_expert.down_proj.weight", "mlp.down_proj.weight"):
        return split(t, 1, c.tp, c.tp_rank)
    if name.endswith("norm.weight"):
        return t
    raise AssertionError(f"reference has no vLLM rule for {name}")


def _bert_model():
    from transformers import BertConfig, BertModel
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48,
                     max_position_embeddings=40, type_vocab_size=2)
    return BertModel(cfg)


def _bert_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM bert.py: BertEmbedding (word, position and token type embeddings all
    VocabParallelEmbedding), BertSelfAttention (QKVParallelLinear), BertSelfOutput and
    BertOutput (RowParallelLinear: bias whole), BertIntermediate (ColumnParallelLinear),
    LayerNorms and BertPooler's nn.Linear replicated."""
    if name.startswith("embeddings.") and name.endswith("_embeddings.weight"):
        return vocab_parallel(t, c)
    if ".attention.self." in name:
        return qkv_heads(t, cfg["num_attention_heads"], c, kv=False)
    if name.endswith(("attention.output.dense.weight", ".output.dense.weight")):
        return split(t, 1, c.tp, c.tp_rank)
    if ".intermediate.dense." in name:
        return split(t, 0, c.tp, c.tp_rank)
    if "LayerNorm" in name or name.startswith("pooler.") or name.endswith("output.dense.bias"):
        return t
    raise AssertionError(f"reference has no vLLM rule for {name}")


def _phi3_model():
    from transformers import Phi3Config, Phi3ForCausalLM
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False)
    return Phi3ForCausalLM(cfg)


def _phi3_kv1_model():
    """phi3 with one K/V head: tp 2 and 4 replicate it inside the fused qkv_proj."""
    from transformers import Phi3Config, Phi3ForCausalLM
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False)
    return Phi3ForCausalLM(cfg)


def _phi3_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM phi3.py (LlamaForCausalLM): the checkpoint's fused qkv_proj goes through
    QKVParallelLinear.weight_loader with shard id None (cut into q, k, v by head counts,
    each sliced by heads, concatenated); gate_up_proj through MergedColumnParallelLinear
    the same way (two equal halves, each split over TP); o_proj/down_proj RowParallelLinear."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_parallel(t, c)
    if name.endswith("self_attn.qkv_proj.weight"):
        h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg["hidden_size"] // h
        q, k, v = t.split([h * hd, kv * hd, kv * hd])
        return torch.cat([qkv_heads(q, h, c, False), qkv_heads(k, kv, c, True),
                          qkv_heads(v, kv, c, True)])
    if name.endswith("mlp.gate_up_proj.weight"):
        return torch.cat([split(x, 0, c.tp, c.tp_rank) for x in t.chunk(2)])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return split(t, 1, c.tp, c.tp_rank)
    if name.endswith("norm.weight"):
        return t
    raise AssertionError(f"reference has no vLLM rule for {name}")


def _gemma3_model():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, sliding_window=16, pad_token_id=0)
    return Gemma3ForCausalLM(cfg)


def _gemma3_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM gemma3.py: Gemma3Attention (QKVParallelLinear, RowParallelLinear o_proj,
    GemmaRMSNorm q_norm/k_norm), Gemma3MLP (MergedColumnParallelLinear gate_up,
    RowParallelLinear down), a tied VocabParallelEmbedding; every norm replicated."""
    if name == "model.embed_tokens.weight":
        return vocab_parallel(t, c)
    if name.endswith("self_attn.q_proj.weight"):
        return qkv_heads(t, cfg["num_attention_heads"], c, kv=False)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        return qkv_heads(t, cfg["num_key_value_heads"], c, kv=True)
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return split(t, 0, c.tp, c.tp_rank)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return split(t, 1, c.tp, c.tp_rank)
    if name.endswith("norm.weight"):
        return t
    raise AssertionError(f"reference has no vLLM rule for {name}")


def _glm4_moe_model():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    cfg = Glm4MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                        moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, num_nextn_predict_layers=0, use_qk_norm=True,
                        attention_bias=True, tie_word_embeddings=False)
    return Glm4MoeForCausalLM(cfg)


def _glm4_moe_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM glm4_moe.py: Glm4MoeAttention (QKVParallelLinear with bias, RowParallelLinear
    o_proj, replicated q_norm/k_norm), Glm4MoE (ReplicatedLinear gate and its
    e_score_correction_bias, FusedMoE experts, shared_experts a Glm4MoeMLP), dense
    Glm4MoeMLP in the first_k_dense_replace layers, VocabParallelEmbedding, ParallelLMHead."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_parallel(t, c)
    parts = name.split(".")
    if ".self_attn.q_proj." in name:
        return qkv_heads(t, cfg["num_attention_heads"], c, kv=False)
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return qkv_heads(t, cfg["num_key_value_heads"], c, kv=True)
    if ".mlp.experts." in name:
        if int(parts[5]) not in linear_experts(cfg["n_routed_experts"], c):
            return None
        return split(t, 1 if parts[6] == "down_proj" else 0, c.moe_tp, c.moe_tp_rank)
    if ".mlp.gate." in name or name.endswith("norm.weight"):
        return t
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return split(t, 0, c.tp, c.tp_rank)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return split(t, 1, c.tp, c.tp_rank)
    raise AssertionError(f"reference has no vLLM rule for {name}")


def _gpt_oss_model():
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                       tie_word_embeddings=False)
    # the published checkpoint's non-expert tensors are bf16
    return GptOssForCausalLM(cfg).to(torch.bfloat16)


def _moe_intermediate_range(size: int, c: Coords, unit: int = 1) -> tuple[int, int]:
    """vLLM gpt_oss.py's tp_rank_start/tp_rank_end over the MoE TP ranks: a per-rank size of
    cdiv(size / unit, moe_tp) units of ``unit`` elements (unit 32 for MXFP4), the last rank
    short."""
    per = -(-(size // unit) // c.moe_tp) * unit
    start = c.moe_tp_rank * per
    return start, min(start + per, size)


def _gpt_oss_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM gpt_oss.py (``_load_weights_other``, bf16): QKVParallelLinear q/k/v with
    biases, RowParallelLinear o_proj (bias whole), ``sinks`` narrowed to the rank's heads
    (``head_start = tp_rank * heads // tp``), the router an nn.Linear (whole), and the fused
    experts: with EP a run of whole experts, else ``w13 = gate_up[:, :, 2*start:2*end]``
    (interleaved gate/up pairs kept together), ``w13_bias[:, 2*start:2*end]``,
    ``w2 = down[:, start:end, :]`` and w2_bias whole."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_parallel(t, c)
    leaf = name.rsplit(".", 1)[1]
    if ".self_attn.q_proj." in name:
        return qkv_heads(t, cfg["num_attention_heads"], c, kv=False)
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return qkv_heads(t, cfg["num_key_value_heads"], c, kv=True)
    if name.endswith("self_attn.o_proj.weight"):
        return split(t, 1, c.tp, c.tp_rank)
    if name.endswith("self_attn.sinks"):
        per = cfg["num_attention_heads"] // c.tp
        return t.narrow(0, c.tp_rank * per, per)
    if ".mlp.experts." in name:
        mine = t[list(linear_experts(cfg["num_local_experts"], c))]
        a, b = _moe_intermediate_range(cfg["intermediate_size"], c)
        if leaf == "gate_up_proj":
            return mine[:, :, 2 * a:2 * b]
        if leaf == "gate_up_proj_bias":
            return mine[:, 2 * a:2 * b]
        if leaf == "down_proj":
            return mine[:, a:b, :]
        if leaf == "down_proj_bias":
            return mine
    if ".mlp.router." in name or name.endswith(("norm.weight", "o_proj.bias")):
        return t
    raise AssertionError(f"reference has no vLLM rule for {name}")


def _llama4_model():
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    cfg = Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16,
                           intermediate_size_mlp=48, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=1, interleave_moe_layer_step=2,
                           tie_word_embeddings=False)
    return Llama4ForCausalLM(cfg).to(torch.bfloat16)


def _llama4_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM llama4.py: Llama4Attention (QKVParallelLinear, RowParallelLinear o_proj); on
    every interleave_moe_layer_step-th layer a Llama4MoE (ReplicatedLinear router, FusedMoE
    experts loaded by ``load_moe_expert_weights``: gate_up_proj [E, H, 2I] chunked into
    gate and up halves on its last dim, each transposed and split over the MoE TP ranks;
    down_proj [E, I, H] split on I; shared_expert a LlamaMLP), elsewhere a LlamaMLP."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_parallel(t, c)
    if ".self_attn.q_proj." in name:
        return qkv_heads(t, cfg["num_attention_heads"], c, kv=False)
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return qkv_heads(t, cfg["num_key_value_heads"], c, kv=True)
    if ".feed_forward.experts." in name:
        mine = t[list(linear_experts(cfg["num_local_experts"], c))]
        if name.endswith("gate_up_proj"):
            return torch.cat([split(h, 2, c.moe_tp, c.moe_tp_rank) for h in mine.chunk(2, dim=-1)],
                             dim=2)
        return split(mine, 1, c.moe_tp, c.moe_tp_rank)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return split(t, 0, c.tp, c.tp_rank)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return split(t, 1, c.tp, c.tp_rank)
    if ".feed_forward.router." in name or name.endswith("norm.weight"):
        return t
    raise AssertionError(f"reference has no vLLM rule for {name}")


def _qwen3_next_model():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                          moe_intermediate_size=16, shared_expert_intermediate_size=24,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, num_experts=4, num_experts_per_tok=2,
                          linear_num_key_heads=4, linear_num_value_heads=8,
                          linear_key_head_dim=8, linear_value_head_dim=4,
                          linear_conv_kernel_dim=4, full_attention_interval=2,
                          decoder_sparse_step=1, mlp_only_layers=[3], tie_word_embeddings=False)
    return Qwen3NextForCausalLM(cfg).to(torch.bfloat16)


def _qwen3_next_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM qwen3_next.py: Qwen3NextAttention's QKVParallelLinear over 2x the heads (query
    and output gate per head), RowParallelLinear o_proj, replicated q_norm/k_norm; the gated
    DeltaNet (qwen_gdn_linear_attn.py, Qwen3-Next layout): in_proj_qkvz and in_proj_ba
    MergedColumnParallelLinear with one output (a contiguous 1/tp of the rows), conv1d
    through mamba_v2_sharded_weight_loader (q, k, v channel blocks each cut to 1/tp),
    dt_bias/A_log through sharded_weight_loader(0), out_proj RowParallelLinear, RMSNormGated
    whole; Qwen3NextSparseMoeBlock (ReplicatedLinear gate and shared_expert_gate, FusedMoE
    experts, shared_expert a Qwen2MoeMLP), a Qwen2MoeMLP on mlp_only_layers."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_parallel(t, c)
    parts = name.split(".")
    if ".self_attn.q_proj." in name:
        return qkv_heads(t, 2 * cfg["num_attention_heads"], c, kv=False)
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return qkv_heads(t, cfg["num_key_value_heads"], c, kv=True)
    if ".linear_attn." in name:
        leaf = ".".join(parts[4:])
        if leaf in ("in_proj_qkvz.weight", "in_proj_ba.weight", "dt_bias", "A_log"):
            return split(t, 0, c.tp, c.tp_rank)
        if leaf == "conv1d.weight":
            kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
            vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
            return torch.cat([split(b, 0, c.tp, c.tp_rank) for b in t.split([kd, kd, vd])])
        if leaf == "out_proj.weight":
            return split(t, 1, c.tp, c.tp_rank)
    if ".mlp.experts." in name:
        if int(parts[5]) not in linear_experts(cfg["num_experts"], c):
            return None
        return split(t, 1 if parts[6] == "down_proj" else 0, c.moe_tp, c.moe_tp_rank)
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "norm.weight")):
        return t
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return split(t, 0, c.tp, c.tp_rank)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return split(t, 1, c.tp, c.tp_rank)
    raise AssertionError(f"reference has no vLLM rule for {name}")


FAMILIES = {
    "qwen2_moe": Family("qwen2_moe", _qwen2_moe_model, _qwen2_moe_reference,
                        (dict(tp=2), dict(tp=4), dict(tp=2, ep=2), dict(tp=4, ep=4))),
    "bert": Family("bert", _bert_model, _bert_reference, (dict(tp=2),)),
    "phi3": Family("phi3", _phi3_model, _phi3_reference, (dict(tp=2), dict(tp=4))),
    "phi3_kv1": Family("phi3_kv1", _phi3_kv1_model, _phi3_reference, (dict(tp=2), dict(tp=4))),
    "gemma3": Family("gemma3", _gemma3_model, _gemma3_reference, (dict(tp=2), dict(tp=4))),
    "glm4_moe": Family("glm4_moe", _glm4_moe_model, _glm4_moe_reference,
                       (dict(tp=2), dict(tp=4), dict(tp=2, ep=2), dict(tp=4, ep=4))),
    "gpt_oss": Family("gpt_oss", _gpt_oss_model, _gpt_oss_reference,
                      (dict(tp=2), dict(tp=4), dict(tp=2, ep=2), dict(tp=4, ep=4))),
    "llama4": Family("llama4", _llama4_model, _llama4_reference,
                     (dict(tp=2), dict(tp=4), dict(tp=2, ep=2), dict(tp=4, ep=4))),
    "qwen3_next": Family("qwen3_next", _qwen3_next_model, _qwen3_next_reference,
                         (dict(tp=2), dict(tp=4), dict(tp=2, ep=2), dict(tp=4, ep=4))),
}


def _refill(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """family name -> a directory transformers wrote; each family built once per session."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            torch.manual_seed(0)
            model = FAMILIES[family].make()
            _refill(model, seed=1234)
            out = tmp_path_factory.mktemp(f"hf-{family}")
            model.save_pretrained(out, max_shard_size="20KB")
            assert len(list(out.glob("*.safetensors"))) > 2, "want several shards"
            built[family] = out
        return built[family]
    return get


def _full_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def compare_rank(path: Path, family: Family, layout: dict, rank: int, got: dict,
                 full: dict | None = None) -> int:
    """Assert that ``got`` (rank ``rank``'s tensors) equals the family's reference slices;
    -> the number of tensors compared."""
    cfg = json.loads((path / "config.json").read_text())
    full = _full_tensors(path) if full is None else full
    c = coords_of(layout, rank)
    want = {}
    for n, t in full.items():
        r = family.reference(n, t, cfg, c)
        if r is not None:
            want[n] = r
    assert set(got) == set(want), (rank, sorted(set(got) ^ set(want)))
    for n, w in want.items():
        assert got[n].shape == w.shape, (rank, n, tuple(got[n].shape), tuple(w.shape))
        assert torch.equal(got[n], w), (rank, n)
    return len(want)


def check_family(path: Path, family: Family, layout: dict, rules=None) -> None:
    full = _full_tensors(path)
    for rank in range(layout.get("tp", 1)):
        got = cl.load(str(path), cl.Layout(**layout), rank=rank, rules=rules)
        compare_rank(path, family, layout, rank, got, full)


# --- shared experts under vLLM's sequence-parallel MoE ---------------------------------------

# vLLM's --tensor-parallel-size 2 --data-parallel-size 2 --enable-expert-parallel
SP_MOE = dict(tp=2, dp=2, ep=4, ep_spans_dp=True)


def _meta_of(hf_checkpoint, family: str):
    if family == "deepseek_v3":   # no transformers class here: the synthesized naming
        from coordloader.planning.planner import meta_from_specs
        from coordloader.synth.archs import arch_tensors
        return meta_from_specs(*arch_tensors("deepseek_v3", "tiny"))
    return cl.read_checkpoint(str(hf_checkpoint(family)))


@pytest.mark.parametrize("family, shared, whole", [
    ("deepseek_v3", ".mlp.shared_experts.", True),
    ("llama4", ".feed_forward.shared_expert.", True),
    ("qwen3_next", ".mlp.shared_expert.", True),
    ("qwen2_moe", ".mlp.shared_expert.", False),
    ("glm4_moe", ".mlp.shared_experts.", False),
])
def test_shared_experts_whole_where_vllm_runs_the_moe_sequence_parallel(
        hf_checkpoint, family, shared, whole):
    """vLLM with expert parallelism at tp > 1 and dp > 1 runs the MoE on a
    sequence-parallel split (ParallelConfig.use_sequence_parallel_moe, its default
    all2all backend) and builds deepseek_v2's, llama4's and qwen3_next's shared experts
    with disable_tp: each rank holds them whole. The plan split them over tp. qwen2_moe
    and glm4_moe keep theirs split, and so does every other layout."""
    meta = _meta_of(hf_checkpoint, family)
    names = sorted(n for n in meta.tensors if shared in n and n.endswith("_proj.weight"))
    assert len(names) >= 3, sorted(meta.tensors)
    for kw, want_whole in ((SP_MOE, whole), (dict(tp=2, dp=2, ep_spans_dp=True), False),
                           (dict(tp=2, ep=2), False)):
        layout = cl.Layout(**kw)
        plan = cl.make_plan(meta, layout)
        cl.validate_cover(plan, meta)
        for r in range(layout.world_size):
            held = plan.rank(r).by_name()
            tp_rank = layout.coords(r).tp
            for n in set(names) - set(plan.excluded):   # deepseek's MTP layer is left out
                shape = meta.tensors[n].shape
                box = [(0, d) for d in shape]
                if not want_whole:
                    dim = 1 if ".down_proj." in n else 0
                    half = shape[dim] // 2
                    box[dim] = (tp_rank * half, tp_rank * half + half)
                assert [p.src for p in held[n].pieces] == [tuple(box)], (kw, r, n)
    if family == "llama4":   # and the bytes: rank 3 of SP_MOE holds each one whole
        full = _full_tensors(hf_checkpoint(family))
        got = cl.load(str(hf_checkpoint(family)), cl.Layout(**SP_MOE), rank=3)
        for n in names:
            assert torch.equal(got[n], full[n]), n


def test_qwen2_moe_detected(hf_checkpoint):
    path = hf_checkpoint("qwen2_moe")
    cfg = json.loads((path / "config.json").read_text())
    assert cl.planning.rules.detect_preset(cfg) == "qwen2_moe"
    assert cl.planning.rules.detect_preset({"model_type": "qwen2_moe"}) == "qwen2_moe"


@pytest.mark.parametrize("layout", FAMILIES["qwen2_moe"].layouts, ids=str)
def test_qwen2_moe_matches_vllm(hf_checkpoint, layout):
    check_family(hf_checkpoint("qwen2_moe"), FAMILIES["qwen2_moe"], layout)


@pytest.mark.parametrize("layout", FAMILIES["bert"].layouts, ids=str)
def test_bert_matches_vllm(hf_checkpoint, layout):
    check_family(hf_checkpoint("bert"), FAMILIES["bert"], layout)


def test_bert_sequence_classification_head_held_whole(tmp_path):
    """BertForSequenceClassification maps to the bert preset, whose rules had none for its
    classifier: the plan was refused. vLLM's bert.py builds it as an nn.Linear, whole."""
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48,
                     max_position_embeddings=40, type_vocab_size=2, num_labels=3)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    _refill(model, seed=9)
    model.save_pretrained(tmp_path)
    full = _full_tensors(tmp_path)
    assert {"classifier.weight", "classifier.bias"} <= set(full)
    for rank in range(2):
        got = cl.load(str(tmp_path), cl.Layout(tp=2), rank=rank)
        for n in ("classifier.weight", "classifier.bias"):
            assert torch.equal(got[n], full[n]), (rank, n)


def test_mixtral_in_memory_names_plan(tmp_path):
    """transformers 5 holds Mixtral's router as mlp.gate in memory (what state_dict() and
    DCP write; save_pretrained writes block_sparse_moe.gate): its plan was refused."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from coordloader.checkpoint.dtypes import from_torch
    from coordloader.planning.planner import meta_from_specs
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    sd = MixtralForCausalLM(cfg).state_dict()
    gate = "model.layers.0.mlp.gate.weight"
    assert gate in sd and "model.layers.0.mlp.experts.gate_up_proj" in sd, sorted(sd)
    meta = meta_from_specs(cfg.to_dict(), [(n, from_torch(t.dtype), tuple(t.shape))
                                           for n, t in sd.items()])
    plan = cl.make_plan(meta, cl.Layout(tp=2, ep=2))
    cl.validate_cover(plan, meta)
    for r in range(2):
        ts = plan.rank(r).by_name()[gate]
        assert ts.local_shape == ts.global_shape == tuple(sd[gate].shape)


def test_phi3_detected(hf_checkpoint):
    cfg = json.loads((hf_checkpoint("phi3") / "config.json").read_text())
    assert cl.planning.rules.detect_preset(cfg) == "phi3"


@pytest.mark.parametrize("layout", FAMILIES["phi3"].layouts, ids=str)
def test_phi3_matches_vllm(hf_checkpoint, layout):
    check_family(hf_checkpoint("phi3"), FAMILIES["phi3"], layout)


# --- a fused qkv_proj whose K/V heads replicate (tp > num_key_value_heads) ---------------

QKV = "model.layers.0.self_attn.qkv_proj.weight"
# (family, tp) where tp exceeds the K/V heads: 1 head at tp 2 and 4, 2 heads at tp 4
KV_REPLICATED = [("phi3_kv1", 2), ("phi3_kv1", 4), ("phi3", 4)]


def vllm_qkv_rows(H: int, KV: int, hd: int, tp: int, tp_rank: int) -> list[tuple[int, int, bool]]:
    """QKVParallelLinear's rows of a fused qkv on ``tp_rank``, by vLLM's formulas:
    num_heads = H / tp, num_kv_heads = max(1, KV / tp), num_kv_head_replicas =
    max(1, tp / KV), K/V shard = tp_rank // num_kv_head_replicas. -> per block (q, k, v)
    (start row, stop row, held by a lower TP rank too: a copy of its primary)."""
    nh, nkv, reps = H // tp, max(1, KV // tp), max(1, tp // KV)
    shard = tp_rank // reps
    q = tp_rank * nh * hd
    k = H * hd + shard * nkv * hd
    v = (H + KV) * hd + shard * nkv * hd
    copy = tp_rank % reps != 0
    return [(q, q + nh * hd, False), (k, k + nkv * hd, copy), (v, v + nkv * hd, copy)]


@pytest.mark.parametrize("family,tp", KV_REPLICATED, ids=str)
def test_fused_qkv_with_replicated_kv_heads_plans_vllm_rows_and_covers(hf_checkpoint, family, tp):
    """vLLM copies the K/V head to every rank of its group and so does the plan; the
    copies are marked (Piece.copy), so the exact cover holds: primaries tile qkv_proj once
    and each copy equals the primary of the lowest rank holding that head."""
    path = hf_checkpoint(family)
    cfg = json.loads((path / "config.json").read_text())
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // H
    meta = cl.read_checkpoint(str(path))
    plan = cl.make_plan(meta, cl.Layout(tp=tp))
    cl.validate_cover(plan, meta)
    width = cfg["hidden_size"]
    for r in range(tp):
        ts = plan.rank(r).by_name()[QKV]
        want, loc = [], 0
        for a, b, copy in vllm_qkv_rows(H, KV, hd, tp, r):
            want.append((((a, b), (0, width)), (loc, 0), copy))
            loc += b - a
        assert [(p.src, p.dst, p.copy) for p in ts.pieces] == want, r
        assert ts.local_shape == (loc, width) and ts.replica == 0
    # the JSON carries the mark (optional: absent on every other piece) and reads back
    js = plan.to_json(with_digest=False)
    r1 = next(t for t in js["ranks"][1]["tensors"] if t["name"] == QKV)
    assert [p.get("copy") for p in r1["pieces"]] == [None, True, True]
    r0 = next(t for t in js["ranks"][0]["tensors"] if t["name"] == QKV)
    assert all("copy" not in p for p in r0["pieces"])
    back = cl.planning.model.TensorSlice.from_json(r1)
    assert back == plan.rank(1).by_name()[QKV]


@pytest.mark.parametrize("family,tp", KV_REPLICATED, ids=str)
def test_fused_qkv_cover_refuses_copies_that_are_not_copies(hf_checkpoint, family, tp):
    """Negative: the copy mark must be where vLLM's copy is. Unmarked, the K/V head is a
    duplicated primary; marked on its first holder too, nobody holds it as primary; a copy
    box shifted off the primary's rows equals no primary piece."""
    import dataclasses

    from coordloader.planning.model import Piece, Plan, RankPlan
    meta = cl.read_checkpoint(str(hf_checkpoint(family)))
    plan = cl.make_plan(meta, cl.Layout(tp=tp))

    def with_pieces(rank, fix):
        ranks = []
        for rp in plan.ranks:
            ts = list(rp.tensors)
            if rp.rank == rank:
                ts = [dataclasses.replace(t, pieces=tuple(fix(t.pieces))) if t.name == QKV
                      else t for t in ts]
            ranks.append(RankPlan(rp.rank, rp.coords, tuple(ts)))
        return Plan(plan.layout, plan.fingerprint, tuple(ranks), plan.excluded,
                    plan.load_groups)

    def flag(pieces, value):
        return [Piece(p.src, p.dst, value) if i else p for i, p in enumerate(pieces)]

    def shifted(pieces):   # the K copy one row up, into the q rows: same size, no primary
        return [Piece(((p.src[0][0] - 1, p.src[0][1] - 1),) + p.src[1:], p.dst, True)
                if i == 1 else p for i, p in enumerate(pieces)]

    for rank, fix, msg in [(1, lambda ps: flag(ps, False), "duplicated primary"),
                           (0, lambda ps: flag(ps, True), "missing piece"),
                           (1, shifted, "copy equals no primary")]:
        with pytest.raises(cl.errors.PlanError, match=msg) as ei:
            cl.validate_cover(with_pieces(rank, fix), meta)
        assert ei.value.tensor == QKV


@pytest.mark.parametrize("family,tp", KV_REPLICATED, ids=str)
def test_fused_qkv_with_replicated_kv_heads_loads_and_verifies(hf_checkpoint, tmp_path,
                                                              family, tp):
    """Every rank loaded in this process with verify full and digest against a manifest,
    each byte-exact with vLLM's reference; then the world's verdict over all ranks'
    payloads (what the ranks all-gather): cover and digest sums pass, each K/V byte
    summed once. A flipped byte in one rank's K/V copy (or in the primary it copies) is
    refused."""
    import shutil

    from coordloader.handoff.pieces import collect_pieces
    from coordloader.verify import checks as vf
    from coordloader.verify.manifest import load_manifest
    src = hf_checkpoint(family)
    path = tmp_path / "ck"
    shutil.copytree(src, path)
    meta = cl.read_checkpoint(str(path))
    cl.write_manifest(meta)
    man = load_manifest(str(path), meta)
    layout = dict(tp=tp)
    full = _full_tensors(path)
    loaded = []
    for r in range(tp):
        for mode in ("full", "digest"):
            res = cl.load_detailed(str(path), cl.Layout(**layout), rank=r, verify=mode)
            assert res.verify_report["ok"], res.verify_report
            assert "digest-manifest" in res.verify_report["checks"]
            compare_rank(path, FAMILIES[family], layout, r, res.tensors, full)
        loaded.append(res.tensors)
    plan = res.plan

    def world(tensors, mode):
        payloads = [vf.local_payload(tensors[r], plan.rank(r), mode, meta=meta)
                    for r in range(tp)]
        return vf.evaluate(payloads, mode, meta=meta, manifest=man, excluded=plan.excluded)

    for mode in ("digest", "full"):
        rep = world(loaded, mode)
        assert rep["ok"], rep["failures"]
        assert rep["checks"][:3] == ["local", "cover", "digest-manifest"]
        assert not [n for n in rep["notes"] if QKV in n], rep["notes"]
    # a save writes each K/V head once: by its primary holder, never from a copy
    for r in range(tp):
        ts = plan.rank(r).by_name()[QKV]
        boxes = [p.box for p in collect_pieces(loaded[r], plan.rank(r), r) if p.name == QKV]
        assert boxes == [p.src for p in ts.pieces if not p.copy]
    # one rank's copy of a K/V head corrupted after the load: the replica check names it,
    # and the manifest sum (primaries only) still matches, so only the copy is blamed
    k_rows = vllm_qkv_rows(*_heads(path), tp, 1)[1]
    assert k_rows[2]
    bad = [dict(t) for t in loaded]
    q_n = plan.rank(1).by_name()[QKV].pieces[1].dst[0]
    bad[1][QKV] = bad[1][QKV].clone()
    bad[1][QKV].view(torch.int16)[q_n, 3] ^= 0x40
    rep = world(bad, "digest")
    assert [(f["rank"], f["tensor"], f["check"]) for f in rep["failures"]] == [(1, QKV, "digest")]
    assert "differs from the primary copy on rank 0" in rep["failures"][0]["detail"]
    with pytest.raises(cl.errors.VerifyError, match="differs from the manifest"):
        vf.verify_rank(bad[1], plan, 1, mode="digest", meta=meta, manifest=man)
    # the primary on rank 0 corrupted: the manifest sum fails and the copy disagrees
    bad = [dict(t) for t in loaded]
    bad[0][QKV] = bad[0][QKV].clone()
    bad[0][QKV].view(torch.int16)[plan.rank(0).by_name()[QKV].pieces[1].dst[0], 3] ^= 0x40
    rep = world(bad, "digest")
    fl = rep["failures"]
    assert all(f["tensor"] == QKV and f["check"] == "digest" for f in fl), fl
    assert sum("content differs from the manifest" in f["detail"] for f in fl) == 1, fl
    # rank 0 is not blamed for its copies alone: each disagreeing pair is named, the
    # intact copy is not singled out
    copies = sorted(tuple(f["ranks"]) for f in fl
                    if "differs from the primary copy on rank 0" in f["detail"])
    assert copies == [(0, r) for r in range(1, tp // KV_of(path))], fl
    assert all(f["rank"] is None for f in fl if f["ranks"] != [0]), fl


def KV_of(path: Path) -> int:
    return _heads(path)[1]


def _heads(path: Path) -> tuple[int, int, int]:
    cfg = json.loads((path / "config.json").read_text())
    H = cfg["num_attention_heads"]
    return H, cfg["num_key_value_heads"], cfg["hidden_size"] // H


def test_reference_catches_fused_blocks_split_as_one(hf_checkpoint):
    """A planted wrong rule (gate_up_proj split as one packed block instead of two
    halves) gives different bytes, and the reference sees it; as plain colwise the planner
    refuses it first."""
    rules = [{"pattern": "*.mlp.gate_up_proj.weight", "strategy": "packed",
              "params": {"num_blocks": 1}}]
    with pytest.raises(AssertionError, match="gate_up_proj"):
        check_family(hf_checkpoint("phi3"), FAMILIES["phi3"], dict(tp=2), rules=rules)
    with pytest.raises(cl.errors.PlanError, match="fused tensor packs gate and up"):
        check_family(hf_checkpoint("phi3"), FAMILIES["phi3"], dict(tp=2),
                     rules=[dict(rules[0], strategy="colwise", params={})])


def test_gemma3_detected(hf_checkpoint):
    cfg = json.loads((hf_checkpoint("gemma3") / "config.json").read_text())
    assert cl.planning.rules.detect_preset(cfg) == "gemma3"


@pytest.mark.parametrize("layout", FAMILIES["gemma3"].layouts, ids=str)
def test_gemma3_matches_vllm(hf_checkpoint, layout):
    check_family(hf_checkpoint("gemma3"), FAMILIES["gemma3"], layout)


def test_glm4_moe_detected(hf_checkpoint):
    cfg = json.loads((hf_checkpoint("glm4_moe") / "config.json").read_text())
    assert cl.planning.rules.detect_preset(cfg) == "glm4_moe"


@pytest.mark.parametrize("layout", FAMILIES["glm4_moe"].layouts, ids=str)
def test_glm4_moe_matches_vllm(hf_checkpoint, layout):
    check_family(hf_checkpoint("glm4_moe"), FAMILIES["glm4_moe"], layout)


def test_kimi_k2_rides_on_deepseek_v3():
    """Kimi-K2's config.json names DeepseekV3ForCausalLM with model_type kimi_k2 (and a
    remote-code auto_map); either key alone must pick the deepseek_v3 preset."""
    from transformers import DeepseekV3Config
    cfg = DeepseekV3Config(vocab_size=VOCAB).to_dict()
    kimi = dict(cfg, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
                auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    assert cl.planning.rules.detect_preset(kimi) == "deepseek_v3"
    assert cl.planning.rules.detect_preset(dict(kimi, architectures=None)) == "deepseek_v3"


# --- fused 3-D experts (transformers 5 in memory: experts.gate_up_proj [E, 2I, H]) --------

FUSED_RULES = [
    {"pattern": "*.mlp.experts.gate_up_proj", "strategy": "expert",
     "params": {"dim": 0, "num_blocks": 2}},
    {"pattern": "*.mlp.experts.down_proj", "strategy": "expert", "params": {"dim": 1}},
]


@pytest.fixture(scope="session")
def fused_experts_ckpt(tmp_path_factory):
    """The fused expert tensors of a transformers 5 Qwen2Moe model, as its modules hold them,
    written with safetensors beside the model's config.json."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = _qwen2_moe_model()
    _refill(model, seed=99)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if ".mlp.experts." in k}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd, sorted(sd)
    out = tmp_path_factory.mktemp("fused-experts")
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(model.config.to_dict()))
    return out


def _fused_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM FusedMoE: experts by linear placement; inside each, w13 holds gate and up
    halves each split over moe_tp, w2 split on its input (last) dim."""
    mine = t[list(linear_experts(cfg["num_experts"], c))]
    if name.endswith("gate_up_proj"):
        return torch.cat([split(h, 1, c.moe_tp, c.moe_tp_rank) for h in mine.chunk(2, dim=1)],
                         dim=1)
    return split(mine, 2, c.moe_tp, c.moe_tp_rank)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=4, ep=2)], ids=str)
def test_fused_experts_split_per_packed_half(fused_experts_ckpt, layout):
    fam = Family("fused", lambda: None, _fused_reference, ())
    check_family(fused_experts_ckpt, fam, layout, rules=FUSED_RULES)


def test_fused_gate_up_split_without_declared_halves_is_refused(fused_experts_ckpt):
    rules = [dict(FUSED_RULES[0], params={"dim": 0}), FUSED_RULES[1]]
    with pytest.raises(cl.errors.PlanError, match="gate_up_proj.*num_blocks=2"):
        cl.make_plan(str(fused_experts_ckpt), cl.Layout(tp=2), rules=rules)


@pytest.fixture(scope="session")
def fused_qwen2_moe_state(tmp_path_factory):
    """A whole transformers 5 Qwen2Moe model as ``model.state_dict()`` holds it (fused
    experts, the names DCP and FSDP2 state carry), beside its config.json."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = _qwen2_moe_model()
    _refill(model, seed=7)
    out = tmp_path_factory.mktemp("fused-qwen2-moe")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(model.config.to_dict()))
    return out


def _fused_qwen2_moe_reference(name, t, cfg, c):
    if ".mlp.experts." in name:
        return _fused_reference(name, t, cfg, c)
    return _qwen2_moe_reference(name, t, cfg, c)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=4, ep=2)], ids=str)
def test_preset_splits_fused_experts_like_vllm(fused_qwen2_moe_state, layout):
    """No rules given: the qwen2_moe preset recognises the fused expert tensors. At tp=4
    ep=2 every expert is split over 2 ranks (moe_tp=2): each rank must get its share of
    the gate half AND of the up half, not all of one half."""
    names = set(json.loads((fused_qwen2_moe_state / "config.json").read_text()))
    assert "num_experts" in names
    fam = Family("fused_qwen2_moe", lambda: None, _fused_qwen2_moe_reference, ())
    check_family(fused_qwen2_moe_state, fam, layout)


def assert_same_state(model, want: dict) -> None:
    """``model``'s state dict is ``want`` (from_pretrained's), key for key, bit for bit."""
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_load_into_fills_fused_expert_parameters(hf_checkpoint):
    """A transformers 5 MoE model holds experts fused (gate_up_proj [E, 2I, H]); its
    checkpoint stores them one by one. load_into applies transformers' own conversion
    mapping (many checkpoint tensors into one parameter): every parameter ends equal to
    what from_pretrained gives."""
    from transformers import AutoModelForCausalLM
    path = hf_checkpoint("qwen2_moe")
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in _full_tensors(path))
    want = AutoModelForCausalLM.from_pretrained(str(path))
    torch.manual_seed(5)
    model = _qwen2_moe_model()
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())
    # whole vocab tensors, as the transformers module holds them (no vocab padding)
    whole = [{"pattern": n, "strategy": "replicate"} for n in ("*embed_tokens.weight", "lm_head.weight")]
    res = cl.load_into(model, str(path), cl.Layout(), rank=0, rules=whole)
    assert set(dict(model.named_parameters())) <= set(res.loaded)   # rotary buffers are computed
    assert "model.layers.0.mlp.experts.gate_up_proj" in res.loaded
    assert_same_state(model, want.state_dict())


def test_load_into_refuses_converters_of_another_transformers_by_name(hf_checkpoint,
                                                                     monkeypatch):
    """load_into matches checkpoint names through transformers 5.25's private
    WeightConverter._scoped_match: a transformers without it failed with a bare
    AttributeError from deep in load_into."""
    import transformers
    from transformers.core_model_loading import WeightConverter

    def gone(self, key):   # as on a transformers without it (its renamings keep theirs)
        raise AttributeError("'WeightConverter' object has no attribute '_scoped_match'")
    path = hf_checkpoint("qwen2_moe")
    model = _qwen2_moe_model()
    monkeypatch.setattr(WeightConverter, "_scoped_match", gone)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    whole = [{"pattern": n, "strategy": "replicate"} for n in ("*embed_tokens.weight", "lm_head.weight")]
    with pytest.raises(cl.LoadError) as e:
        cl.load_into(model, str(path), cl.Layout(), rank=0, rules=whole)
    msg = str(e.value)
    assert msg.startswith("rank 0, tensor 'model.layers.0.mlp.experts.0.down_proj.weight': "
                          f"cannot apply transformers {transformers.__version__}'s weight "
                          f"converter ["), msg
    assert "(AttributeError: " in msg and "load with from_pretrained" in msg, msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_load_into_refuses_converters_without_the_fields_it_reads(hf_checkpoint, monkeypatch):
    """The converters' operations, read before any name is matched, failed with a bare
    AttributeError where the first refusal of another transformers' converters did not
    reach."""
    import transformers
    import transformers.conversion_mapping as cm
    from transformers.core_model_loading import WeightConverter
    path = hf_checkpoint("qwen2_moe")
    model = _qwen2_moe_model()
    made = cm.get_model_conversion_mapping

    def then_without_operations(*a, **k):   # built, then read as on a transformers without
        out = made(*a, **k)
        monkeypatch.setattr(WeightConverter, "operations", property(lambda self: self.gone),
                            raising=False)
        return out
    monkeypatch.setattr(cm, "get_model_conversion_mapping", then_without_operations)
    whole = [{"pattern": n, "strategy": "replicate"} for n in ("*embed_tokens.weight", "lm_head.weight")]
    with pytest.raises(cl.LoadError) as e:
        cl.load_into(model, str(path), cl.Layout(), rank=0, rules=whole)
    msg = str(e.value)
    assert msg.startswith(f"rank 0: cannot apply transformers {transformers.__version__}'s "
                          f"weight converter WeightConverter("), msg
    assert "(AttributeError: " in msg and "load with from_pretrained" in msg, msg


def test_load_into_fuses_experts_in_the_expert_maps_order(hf_checkpoint):
    """An explicit expert map lists a rank's experts in slot order ((3, 1) on ep rank 0):
    load_into stacked them by id, expert 1 in slot 0, where a fused checkpoint's load
    puts expert 3 (the planner's local order)."""
    path = hf_checkpoint("qwen2_moe")
    ref = _from_pretrained_state(path)
    layout = cl.Layout(dp=2, ep=2, ep_spans_dp=True, expert_placement=((3, 1), (0, 2)))
    whole = [{"pattern": n, "strategy": "replicate"} for n in ("*embed_tokens.weight", "lm_head.weight")]
    for rank, owned in ((0, (3, 1)), (1, (0, 2))):
        model = _qwen2_moe_model()
        moe = [(i, la.mlp.experts) for i, la in enumerate(model.model.layers)
               if hasattr(la.mlp, "experts")]
        assert moe
        for _, ex in moe:   # this rank's experts only
            ex.gate_up_proj = torch.nn.Parameter(torch.zeros(2, *ex.gate_up_proj.shape[1:]))
            ex.down_proj = torch.nn.Parameter(torch.zeros(2, *ex.down_proj.shape[1:]))
        cl.load_into(model, str(path), layout, rank=rank, rules=whole)
        for i, ex in moe:
            for w in ("gate_up_proj", "down_proj"):
                full = ref[f"model.layers.{i}.mlp.experts.{w}"]
                got = getattr(ex, w)
                assert torch.equal(got, full[list(owned)]), (rank, i, w)


def _from_pretrained_state(path) -> dict:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path)).state_dict()


@pytest.mark.parametrize("drop, up", [("experts.3.up_proj", "0-2"), ("up_proj", "none")])
def test_load_into_refuses_fused_sources_with_different_experts(hf_checkpoint, drop, up):
    """One source of a fusion lacking experts the other has (here name_map drops them)
    failed in torch.cat / torch.stack with a bare RuntimeError; now a LoadError names the
    fused parameter and each source's experts."""
    path = hf_checkpoint("qwen2_moe")
    model = _qwen2_moe_model()
    whole = [{"pattern": n, "strategy": "replicate"} for n in ("*embed_tokens.weight", "lm_head.weight")]
    with pytest.raises(cl.LoadError) as ei:
        cl.load_into(model, str(path), cl.Layout(), rank=0, rules=whole,
                     name_map=lambda n: None if drop in n and "shared" not in n else n)
    assert str(ei.value) == (
        "rank 0: transformers fuses this rank's model.layers.0.mlp.experts.*.gate_proj.weight "
        f"for experts 0-3; model.layers.0.mlp.experts.*.up_proj.weight for experts {up} into "
        "'model.layers.0.mlp.experts.gate_up_proj'; expected the same experts of every source "
        "(check the checkpoint and name_map)")


@pytest.mark.parametrize("by", ["transformers", "name_map"])
def test_load_into_fuses_mixtral_experts_through_leading_dot_patterns(tmp_path, by):
    """Mixtral's conversion patterns start with a "." (".experts.*.w1.weight" ->
    ".experts.gate_up_proj"); load_into matched a source only right after a ".", so these
    never matched and the per-expert w1/w3/w2 were refused (or, strict=False, skipped with
    the fused experts left stale). The checkpoint save_pretrained writes holds
    ".block_sparse_moe.", the model ".mlp.": load_into applies transformers' own renaming
    (it needed a name_map doing it), and a name_map doing it still works."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    _refill(model, seed=77)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert any(".block_sparse_moe.experts.0.w3.weight" in k for k in _full_tensors(tmp_path))
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    torch.manual_seed(5)
    model = MixtralForCausalLM(cfg)
    whole = [{"pattern": n, "strategy": "replicate"} for n in ("*embed_tokens.weight", "lm_head.weight")]
    rename = (None if by == "transformers" else
              (lambda n: n.replace(".block_sparse_moe.", ".mlp.")))
    res = cl.load_into(model, str(tmp_path), cl.Layout(), rank=0, rules=whole, name_map=rename)
    assert set(dict(model.named_parameters())) <= set(res.loaded)
    assert_same_state(model, want)


@pytest.fixture(scope="module")
def olmo_hybrid_ckpt(tmp_path_factory):
    """A transformers 5 OlmoHybrid: its model holds one ``linear_attn.conv1d.weight``, its
    checkpoint q/k/v_conv1d, which transformers joins with a Concatenate alone (no
    MergeModulelist first: the sources have no expert index)."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM
    cfg = OlmoHybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           pad_token_id=0, eos_token_id=1,
                           layer_types=["linear_attention", "full_attention"],
                           linear_num_key_heads=2, linear_num_value_heads=2,
                           linear_key_head_dim=8, linear_value_head_dim=8)
    model = OlmoHybridForCausalLM(cfg)
    _refill(model, seed=31)
    out = tmp_path_factory.mktemp("olmo-hybrid")
    model.save_pretrained(out)
    return out, lambda: OlmoHybridForCausalLM(cfg)


OLMO_CONV = "model.layers.0.linear_attn.conv1d.weight"
OLMO_QKV = ", ".join(f"model.layers.0.linear_attn.{x}_conv1d.weight" for x in "qkv")


def test_load_into_fuses_sources_without_an_expert_index(olmo_hybrid_ckpt):
    """Each source of a Concatenate not preceded by a MergeModulelist is one tensor, not a
    list of experts: load_into failed with a bare TypeError from torch.cat. Every
    parameter now ends equal to what from_pretrained gives."""
    from transformers import AutoModelForCausalLM
    path, make = olmo_hybrid_ckpt
    assert "model.layers.0.linear_attn.k_conv1d.weight" in _full_tensors(path)
    want = AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
    torch.manual_seed(5)
    model = make()
    res = cl.load_into(model, str(path), cl.Layout(), rank=0,
                       rules=[{"pattern": "*", "strategy": "replicate"}])
    assert OLMO_CONV in res.loaded
    assert set(dict(model.named_parameters())) <= set(res.loaded)
    assert_same_state(model, want)


def test_load_into_refuses_a_missing_source_of_a_concatenation(olmo_hybrid_ckpt):
    """Without one of q/k/v the concatenation is shorter than the parameter: the fused
    parameter and the missing source are named."""
    path, make = olmo_hybrid_ckpt
    with pytest.raises(cl.LoadError) as ei:
        cl.load_into(make(), str(path), cl.Layout(), rank=0,
                     rules=[{"pattern": "*", "strategy": "replicate"}],
                     name_map=lambda n: None if n.endswith("0.linear_attn.k_conv1d.weight") else n)
    assert str(ei.value) == (
        f"rank 0: transformers fuses {OLMO_QKV} into {OLMO_CONV!r}; this rank has no "
        "model.layers.0.linear_attn.k_conv1d.weight (check the checkpoint and name_map)")


def test_load_into_refuses_fusion_steps_that_leave_several_tensors(olmo_hybrid_ckpt, monkeypatch):
    """Steps that do not end in one tensor (a MergeModulelist alone over three sources)
    are refused before any read, naming the fused parameter and the steps."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import MergeModulelist, WeightConverter
    path, make = olmo_hybrid_ckpt
    real = conversion_mapping.get_model_conversion_mapping

    def merge_only(model):   # transformers' own mapping, q/k/v merged instead of joined
        return [WeightConverter(c.source_patterns, c.target_patterns, [MergeModulelist(dim=0)])
                if isinstance(c, WeightConverter) and "conv1d" in c.target_patterns[0] else c
                for c in real(model)]
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", merge_only)
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cl.LoadError) as ei:
        cl.load_into(model, str(path), cl.Layout(), rank=0,
                     rules=[{"pattern": "*", "strategy": "replicate"}])
    assert str(ei.value) == (
        f"rank 0: transformers fuses this rank's slices of {OLMO_QKV} into {OLMO_CONV!r}, "
        "but they do not fuse: transformers' steps (MergeModulelist(dim=0)) do not join "
        "them into one tensor")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _regex_pattern_model(kind: str):
    """A tiny transformers model whose conversion mapping writes its source patterns as
    regexes (r"\\.experts.*.w1.weight" -> ".experts.gate_up_proj")."""
    import transformers as T
    if kind == "kimi_linear":
        cfg = T.KimiLinearConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                 moe_intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                                 qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                                 num_local_experts=4, num_experts_per_tok=2,
                                 mlp_layer_types=["sparse", "sparse"],
                                 layer_types=["linear_attention", "full_attention"],
                                 linear_head_dim=16, linear_num_heads=4, pad_token_id=0,
                                 bos_token_id=1, eos_token_id=2)
        return lambda: T.KimiLinearForCausalLM(cfg)
    cfg = T.DeepseekV4Config(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=32, q_lora_rank=16, num_experts_per_tok=2,
                             n_routed_experts=4, n_shared_experts=1,
                             layer_types=["heavily_compressed_attention",
                                          "compressed_sparse_attention"],
                             mlp_layer_types=["moe", "moe"], o_groups=2, o_lora_rank=16,
                             index_n_heads=4, index_head_dim=16, index_topk=8,
                             num_nextn_predict_layers=0, qk_rope_head_dim=8, hc_mult=2,
                             sliding_window=8)
    return lambda: T.DeepseekV4ForCausalLM(cfg)


@pytest.fixture(scope="module", params=["kimi_linear", "deepseek_v4"])
def regex_pattern_ckpt(request, tmp_path_factory):
    make = _regex_pattern_model(request.param)
    model = make()
    _refill(model, seed=41)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    return out, make


def test_load_into_fuses_experts_through_regex_source_patterns(regex_pattern_ckpt):
    """kimi_linear, deepseek_v4 (and minimax_m3_vl, mistral_large4_text) write their
    source patterns as regexes (r"\\.experts.*.w1.weight"): load_into escaped them into a
    literal backslash, matched nothing and refused the checkpoint save_pretrained wrote
    ("no target entry ...experts.0.w1.weight"). Matched by transformers' own converters,
    every parameter ends equal to what from_pretrained gives."""
    from transformers import AutoModelForCausalLM
    path, make = regex_pattern_ckpt
    names = _full_tensors(path)
    assert any(re.search(r"\.experts\.0\.w1\.weight$", k) for k in names)
    want = AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
    torch.manual_seed(5)
    model = make()
    res = cl.load_into(model, str(path), cl.Layout(), rank=0,
                       rules=[{"pattern": "*", "strategy": "replicate"}])
    assert any(n.endswith(".experts.gate_up_proj") for n in res.loaded)
    assert set(dict(model.named_parameters())) <= set(res.loaded)
    assert_same_state(model, want)


def test_load_into_refuses_an_expert_wildcard_matching_no_index(regex_pattern_ckpt):
    """transformers' "*" matches any text, dots included: a checkpoint name whose "*" part
    is no expert index has no slot to go to, and is refused naming the pattern (stacking
    it in name order, as transformers does, could put it in another expert's slot)."""
    path, make = regex_pattern_ckpt
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cl.LoadError) as ei:
        cl.load_into(model, str(path), cl.Layout(), rank=0,
                     rules=[{"pattern": "*", "strategy": "replicate"}],
                     name_map=lambda n: n.replace(".experts.1.w1.", ".experts.1.a.w1."))
    moe = "model.layers.0.block_sparse_moe" if "kimi" in path.name else "model.layers.0.ffn"
    assert str(ei.value) == (
        f"rank 0, tensor '{moe}.experts.1.w1.weight': transformers' pattern "
        f"'\\\\.experts.*.w1.weight' matches '{moe}.experts.1.a.w1.weight' with '1.a' for "
        "its '*'; expected an expert index (0, 1, ...) to place it by")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_load_into_refuses_two_tensors_for_one_expert_of_a_fusion(regex_pattern_ckpt):
    """Two checkpoint tensors for one expert of one source (here name_map sends expert 1's
    w1 to expert 0's): the slot held whichever came last; both are named."""
    path, make = regex_pattern_ckpt
    moe = "model.layers.0.block_sparse_moe" if "kimi" in path.name else "model.layers.0.ffn"
    with pytest.raises(cl.LoadError) as ei:
        cl.load_into(make(), str(path), cl.Layout(), rank=0,
                     rules=[{"pattern": "*", "strategy": "replicate"}],
                     name_map=lambda n: n.replace(".experts.1.w1.", ".experts.0.w1."))
    assert str(ei.value) == (
        f"rank 0, tensor '{moe}.experts.1.w1.weight': checkpoint tensors "
        f"'{moe}.experts.0.w1.weight' and '{moe}.experts.1.w1.weight' are both expert 0 "
        "source '\\\\.experts.*.w1.weight' of 'model.layers.0.mlp.experts.gate_up_proj'; "
        "expected one (check name_map)")


# --- gpt_oss: interleaved gate/up pairs; llama4: fused block halves -------------------------

def test_gpt_oss_llama4_qwen3_next_detected(hf_checkpoint):
    for fam in ("gpt_oss", "llama4", "qwen3_next"):
        cfg = json.loads((hf_checkpoint(fam) / "config.json").read_text())
        assert cl.planning.rules.detect_preset(cfg) == fam
        assert cl.planning.rules.detect_preset({"model_type": cfg["model_type"]}) == fam


@pytest.mark.parametrize("layout", FAMILIES["gpt_oss"].layouts, ids=str)
def test_gpt_oss_matches_vllm(hf_checkpoint, layout):
    check_family(hf_checkpoint("gpt_oss"), FAMILIES["gpt_oss"], layout)


@pytest.mark.parametrize("layout", FAMILIES["llama4"].layouts, ids=str)
def test_llama4_matches_vllm(hf_checkpoint, layout):
    check_family(hf_checkpoint("llama4"), FAMILIES["llama4"], layout)


@pytest.mark.parametrize("layout", FAMILIES["qwen3_next"].layouts, ids=str)
def test_qwen3_next_matches_vllm(hf_checkpoint, layout):
    check_family(hf_checkpoint("qwen3_next"), FAMILIES["qwen3_next"], layout)


def test_qwen3_next_linear_attention_refuses_split_key_head_groups(hf_checkpoint):
    """tp 8 > the 4 key heads of the linear attention: vLLM cannot view its rank's rows
    as whole key-head groups either, so the plan is refused, naming the tensor."""
    with pytest.raises(cl.errors.PlanError, match=r"linear_attn\..*tp=8 exceeds the 4 heads"):
        cl.make_plan(str(hf_checkpoint("qwen3_next")), cl.Layout(tp=8),
                     rules=[{"pattern": "*.self_attn.*", "strategy": "replicate"}])


def test_qwen3_next_mtp_draft_tensors_are_left_out(hf_checkpoint):
    """The published Qwen3-Next checkpoint carries the MTP draft tensors under ``mtp.``;
    vLLM's main model drops them (its draft model loads them), and the plan refused the
    checkpoint (no rule for mtp.fc.weight). They are left out as DeepSeek's MTP layers
    are; with include_mtp they follow the rules, on the last stage."""
    from coordloader.planning.planner import meta_from_specs
    meta = cl.read_checkpoint(str(hf_checkpoint("qwen3_next")))
    specs = [(n, t.dtype, t.shape) for n, t in meta.tensors.items()]
    mtp = [("mtp.fc.weight", "BF16", (32, 64)), ("mtp.layers.0.input_layernorm.weight", "BF16",
                                                 (32,)), ("mtp.norm.weight", "BF16", (32,))]
    full = meta_from_specs(meta.config, specs + mtp)
    plan = cl.make_plan(full, cl.Layout(tp=2, pp=2))
    base = cl.make_plan(meta_from_specs(meta.config, specs), cl.Layout(tp=2, pp=2))
    assert plan.excluded == tuple(sorted(base.excluded + tuple(n for n, _, _ in mtp)))
    assert [[t.name for t in rp.tensors] for rp in plan.ranks] == [
        [t.name for t in rp.tensors] for rp in base.ranks]
    cl.validate_cover(plan, full)
    with pytest.raises(cl.errors.PlanError, match="mtp.fc.weight.*no sharding rule"):
        cl.make_plan(full, cl.Layout(tp=2, pp=2, include_mtp=True))
    plan = cl.make_plan(full, cl.Layout(tp=2, pp=2, include_mtp=True),
                        rules=[{"pattern": "mtp.fc.weight", "strategy": "colwise"}])
    cl.validate_cover(plan, full)
    held = sorted((t.name, rp.rank, t.local_shape, t.pieces[0].src) for rp in plan.ranks
                  for t in rp.tensors if t.name.startswith("mtp."))
    assert held == [("mtp.fc.weight", 2, (16, 64), ((0, 16), (0, 64))),
                    ("mtp.fc.weight", 3, (16, 64), ((16, 32), (0, 64))),
                    ("mtp.layers.0.input_layernorm.weight", 2, (32,), ((0, 32),)),
                    ("mtp.layers.0.input_layernorm.weight", 3, (32,), ((0, 32),)),
                    ("mtp.norm.weight", 2, (32,), ((0, 32),)),
                    ("mtp.norm.weight", 3, (32,), ((0, 32),))]


def test_reference_catches_interleaved_pairs_split_as_halves(hf_checkpoint):
    """A planted wrong rule: gpt-oss's interleaved gate/up pairs declared as block halves."""
    rules = [{"pattern": "*.mlp.experts.gate_up_proj", "strategy": "expert",
              "params": {"dim": 1, "num_blocks": 2}}]
    with pytest.raises(AssertionError, match="gate_up_proj"):
        check_family(hf_checkpoint("gpt_oss"), FAMILIES["gpt_oss"], dict(tp=2), rules=rules)


def test_reference_catches_block_halves_split_as_interleaved(hf_checkpoint):
    """The reverse: llama4's gate and up halves declared as interleaved pairs."""
    rules = [{"pattern": "*.feed_forward.experts.gate_up_proj", "strategy": "expert",
              "params": {"dim": 1, "interleaved": 2}}]
    with pytest.raises(AssertionError, match="gate_up_proj"):
        check_family(hf_checkpoint("llama4"), FAMILIES["llama4"], dict(tp=2), rules=rules)


@pytest.mark.parametrize("family,pattern", [("gpt_oss", "*.mlp.experts.gate_up_proj"),
                                            ("gpt_oss", "*.mlp.experts.gate_up_proj_bias"),
                                            ("llama4", "*.feed_forward.experts.gate_up_proj")])
def test_gate_up_split_without_declared_packing_is_refused(hf_checkpoint, family, pattern):
    rules = [{"pattern": pattern, "strategy": "expert", "params": {"dim": 1 if "bias" not in
                                                                   pattern else 0}}]
    with pytest.raises(cl.errors.PlanError, match="gate_up_proj.*interleaved=2"):
        cl.make_plan(str(hf_checkpoint(family)), cl.Layout(tp=2), rules=rules)
    # with whole experts (moe_tp 1) nothing is split, so nothing needs declaring
    cl.make_plan(str(hf_checkpoint(family)), cl.Layout(tp=2, ep=2), rules=rules)


def test_expert_packing_params_are_checked():
    from coordloader.planning.rules import make_rule
    with pytest.raises(cl.errors.PlanError, match="exclusive"):
        make_rule("*.gate_up_proj", "expert", {"dim": 0, "num_blocks": 2, "interleaved": 2})
    with pytest.raises(cl.errors.PlanError, match="split 'dim'"):
        make_rule("*.gate_up_proj", "expert", {"interleaved": 2})
    with pytest.raises(cl.errors.PlanError, match="positive integer"):
        make_rule("*.gate_up_proj", "expert", {"dim": 0, "split_unit": 0})


# --- gpt-oss as published: MXFP4 expert storage ---------------------------------------------

def _write_gpt_oss_mxfp4(out: Path, intermediate: int) -> Path:
    """A hand-written checkpoint in the layout of openai/gpt-oss-*: per layer the router and
    the experts as ``*_blocks`` (uint8, two FP4 values a byte, 32-value blocks of 16 bytes)
    and ``*_scales`` (uint8, one per block) plus bf16 biases, with a config that says
    ``quant_method: mxfp4``."""
    from safetensors.torch import save_file
    from transformers import GptOssConfig
    E, H, I = 4, 64, intermediate
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_local_experts=E, num_experts_per_tok=2).to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    g = torch.Generator().manual_seed(7)

    def u8(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def bf16(*shape):
        return torch.randn(shape, generator=g).to(torch.bfloat16)
    for f in range(2):        # one file per layer: several shards
        p = f"model.layers.{f}.mlp."
        save_file({p + "router.weight": bf16(E, H), p + "router.bias": bf16(E),
                   p + "experts.gate_up_proj_blocks": u8(E, 2 * I, H // 32, 16),
                   p + "experts.gate_up_proj_scales": u8(E, 2 * I, H // 32),
                   p + "experts.gate_up_proj_bias": bf16(E, 2 * I),
                   p + "experts.down_proj_blocks": u8(E, H, I // 32, 16),
                   p + "experts.down_proj_scales": u8(E, H, I // 32),
                   p + "experts.down_proj_bias": bf16(E, H)},
                  str(out / f"model-{f + 1:05d}-of-00002.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _gpt_oss_mxfp4_reference(name: str, t: torch.Tensor, cfg: dict, c: Coords):
    """vLLM gpt_oss.py ``_load_weights_mxfp4``: with EP a run of whole experts; else the
    intermediate range [start, end) moves in whole 32-element blocks (per rank
    cdiv(I/32, tp) blocks, the last rank short), w13 blocks viewed as (E, 2I, -1) and cut
    ``[:, 2*start:2*end]`` (interleaved pairs, as the scales and w13 bias), w2 blocks viewed
    as (E, H, I/2) bytes and cut ``[..., start//2:end//2]``, w2 scales
    ``[..., start//32:end//32]``, w2 bias whole."""
    if ".mlp.router." in name:
        return t
    I = cfg["intermediate_size"]
    mine = t[list(linear_experts(cfg["num_local_experts"], c))]
    n = mine.shape[0]
    a, b = _moe_intermediate_range(I, c, unit=32)
    leaf = name.rsplit(".", 1)[1]
    if leaf == "gate_up_proj_blocks":
        return mine.reshape(n, 2 * I, -1)[:, 2 * a:2 * b].reshape(n, 2 * (b - a),
                                                                   *mine.shape[2:])
    if leaf in ("gate_up_proj_scales", "gate_up_proj_bias"):
        return mine[:, 2 * a:2 * b]
    if leaf == "down_proj_blocks":
        h = mine.shape[1]
        return mine.reshape(n, h, I // 2)[..., a // 2:b // 2].reshape(n, h, (b - a) // 32, 16)
    if leaf == "down_proj_scales":
        return mine[..., a // 32:b // 32]
    if leaf == "down_proj_bias":
        return mine
    raise AssertionError(f"reference has no vLLM rule for {name}")


@pytest.fixture(scope="session")
def gpt_oss_mxfp4(tmp_path_factory):
    """intermediate size -> a hand-written MXFP4 gpt-oss checkpoint, made once."""
    made: dict[int, Path] = {}

    def get(intermediate: int) -> Path:
        if intermediate not in made:
            made[intermediate] = _write_gpt_oss_mxfp4(
                tmp_path_factory.mktemp(f"gpt-oss-mxfp4-{intermediate}"), intermediate)
        return made[intermediate]
    return get


MXFP4 = Family("gpt_oss_mxfp4", lambda: None, _gpt_oss_mxfp4_reference, ())


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=4), dict(tp=2, ep=2),
                                    dict(tp=4, ep=2)], ids=str)
def test_gpt_oss_mxfp4_matches_vllm(gpt_oss_mxfp4, layout):
    # I = 128: four 32-element blocks, an even split at moe_tp 2 and 4
    check_family(gpt_oss_mxfp4(128), MXFP4, layout)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_oss_mxfp4_uneven_blocks_match_vllm_cdiv(gpt_oss_mxfp4, tp):
    """I = 96 holds three blocks (as gpt-oss-120b's 90 at tp 4): vLLM gives each rank
    cdiv(3, tp) blocks and the last rank what is left (at tp 4, nothing); that is
    allow_uneven's torch.chunk split, and without it the plan is refused."""
    path = gpt_oss_mxfp4(96)
    with pytest.raises(cl.errors.PlanError, match="not divisible"):
        cl.make_plan(str(path), cl.Layout(tp=tp))
    check_family(path, MXFP4, dict(tp=tp, allow_uneven=True))


def test_reference_catches_mxfp4_split_off_its_blocks(gpt_oss_mxfp4):
    """Without split_unit the gate_up pairs split at element granularity (the bf16 rule);
    at I = 96, tp = 2 that is 48 elements, not vLLM's two 32-element blocks."""
    rules = [{"pattern": "re:.*\\.experts\\.gate_up_proj_(bias|blocks|scales)",
              "strategy": "expert", "params": {"dim": 0, "interleaved": 2}}]
    with pytest.raises(AssertionError, match="gate_up_proj"):
        check_family(gpt_oss_mxfp4(96), MXFP4, dict(tp=2, allow_uneven=True), rules=rules)



@pytest.mark.parametrize("storage", ["mxfp4", "bf16"])
def test_gpt_oss_config_of_the_other_storage_is_refused(gpt_oss_mxfp4, hf_checkpoint, storage,
                                                        tmp_path):
    """The gate/up split unit follows config.json's quant_method (as vLLM's loader choice),
    down_proj's the tensors' shapes: MXFP4 tensors under a config without it (I = 96, tp 2,
    allow_uneven) gave a rank gate/up of intermediate [0, 48) and down_proj of [0, 64),
    and loaded; bf16 experts under a stale mxfp4 config the converse."""
    import shutil
    src = gpt_oss_mxfp4(96) if storage == "mxfp4" else hf_checkpoint("gpt_oss")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    cfg = json.loads((ck / "config.json").read_text())
    if storage == "mxfp4":
        cfg.pop("quantization_config")
    else:
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(cl.errors.PlanError) as e:
        cl.make_plan(str(ck), cl.Layout(tp=2, allow_uneven=True))
    other = "bf16" if storage == "bf16" else "MXFP4"
    assert e.value.file == "config.json" and ".mlp.experts." in e.value.tensor
    assert f"is gpt-oss's {other} storage" in str(e.value)
    assert "Give this checkpoint's own config.json" in str(e.value)

# --- the new presets over real torch.distributed: 2 gloo ranks on loopback ------------------

MP_CASES = ([(fam, layout) for fam in ("gpt_oss", "llama4", "qwen3_next", "qwen2_moe", "glm4_moe")
             for layout in (dict(tp=2), dict(tp=2, ep=2))]
            + [(fam, dict(tp=2)) for fam in ("phi3", "phi3_kv1", "gemma3", "gpt_oss_mxfp4")])


def _mp_worker(rank: int, world: int, port: int, paths: dict, out_dir: str):
    """One rank: cl.load over the default gloo group for every case, each rank's tensors
    compared with the reference; the outcome written to summary-<rank>.json."""
    import os
    import time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    summary = {"cases": [], "errors": []}
    t0 = time.perf_counter()
    try:
        for fam, layout in MP_CASES:
            family = MXFP4 if fam == "gpt_oss_mxfp4" else FAMILIES[fam]
            try:
                got = cl.load(paths[fam], cl.Layout(**layout), engine="cpu", timeout=60)
                n = compare_rank(Path(paths[fam]), family, layout, rank, got)
                summary["cases"].append([fam, layout, n])
            except Exception as e:      # recorded; the test names the case
                summary["errors"].append([fam, layout, f"{type(e).__name__}: {e}"])
    finally:
        summary["total_s"] = round(time.perf_counter() - t0, 2)
        Path(out_dir, f"summary-{rank}.json").write_text(json.dumps(summary))
        dist.destroy_process_group()


@pytest.mark.slow
def test_new_presets_load_over_gloo_match_vllm(hf_checkpoint, gpt_oss_mxfp4, tmp_path):
    """The issue-16 presets (gpt_oss bf16 and MXFP4, llama4, qwen3_next, qwen2_moe, glm4_moe,
    phi3 (also with one K/V head, copied to both ranks inside the fused qkv_proj), gemma3)
    loaded by two real ranks over gloo (plan digest agreement, per-rank reads,
    verify), each rank byte-exact against the reference slicer."""
    from coordloader.dist.collective import free_port

    from ranks import spawn_and_wait
    paths = {f: str(hf_checkpoint(f)) for f, _ in MP_CASES if f != "gpt_oss_mxfp4"}
    paths["gpt_oss_mxfp4"] = str(gpt_oss_mxfp4(128))
    spawn_and_wait(_mp_worker, (2, free_port(), paths, str(tmp_path)), 2,
                   "2-rank preset loads", hard_s=240)
    for rank in range(2):
        s = json.loads((tmp_path / f"summary-{rank}.json").read_text())
        assert not s["errors"], (rank, s["errors"])
        assert [(f, lay) for f, lay, _ in s["cases"]] == [(f, lay) for f, lay in MP_CASES]
        assert all(n > 0 for _, _, n in s["cases"]), s["cases"]


# ---- config.json without num_key_value_heads: transformers' default, as vLLM reads it

@pytest.mark.parametrize("model_type", sorted(set(
    __import__("coordloader.planning.rules.presets", fromlist=["x"])._MODEL_TYPES)))
def test_kv_heads_default_is_transformers_own(model_type):
    """Where config.json leaves num_key_value_heads out, vLLM (through transformers'
    config class) uses the class default, which is not num_attention_heads for Mistral,
    Qwen3-MoE and others: the preset must split K/V heads of the same size."""
    from transformers import AutoConfig

    from coordloader.planning.rules.presets import kv_heads_default
    try:
        want = AutoConfig.for_model(model_type, num_attention_heads=24, hidden_size=24 * 16)
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} has no model_type {model_type}")
    want = getattr(want, "num_key_value_heads", None)
    if want is None:
        pytest.skip(f"{model_type}'s config has no num_key_value_heads")
    assert kv_heads_default({"model_type": model_type}, 24) == want
    # an explicit null is num_attention_heads where transformers takes it at all (some
    # classes refuse it, qwen2_moe keeps None: vLLM cannot build those)
    try:
        null = AutoConfig.for_model(model_type, num_attention_heads=24, hidden_size=24 * 16,
                                    num_key_value_heads=None).num_key_value_heads
    except Exception:   # noqa: BLE001 - huggingface_hub's validation error, whatever its type
        null = None
    got = kv_heads_default({"model_type": model_type, "num_key_value_heads": None}, 24)
    assert got == 24 and null in (None, 24)


def test_mistral_without_num_key_value_heads_loads_vllms_kv_heads(tmp_path):
    """MistralConfig's default is 8 K/V heads; the preset took num_attention_heads (32),
    so at tp=16 every rank got 2 rows of the wrong head, and the pieces still tiled."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=128, intermediate_size=128,
                        num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=4)
    model = MistralForCausalLM(cfg)
    _refill(model, seed=7)
    model.save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    del c["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    full = _full_tensors(tmp_path)
    tp = 16
    for rank in (0, 1, 2, 15):
        got = cl.load(str(tmp_path), cl.Layout(tp=tp), rank=rank)
        c_ = coords_of({"tp": tp}, rank)
        for n in ("k_proj", "v_proj"):
            name = f"model.layers.0.self_attn.{n}.weight"
            assert torch.equal(got[name], qkv_heads(full[name], 8, c_, kv=True)), (rank, name)
        name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(got[name], qkv_heads(full[name], 32, c_, kv=False)), rank


def _rewritten(path: Path, out: Path, change) -> str:
    """``path``'s checkpoint as one file, its tensors changed by ``change(tensors)``."""
    import shutil

    from safetensors.torch import save_file
    out.mkdir()
    shutil.copy(path / "config.json", out / "config.json")
    tensors = _full_tensors(path)
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_load_into_leaves_computed_buffers_and_requires_persistent_ones(hf_checkpoint,
                                                                        tmp_path):
    """A checkpoint holding a tensor named as a module's non-persistent buffer (a rotary
    table, which the module computes and from_pretrained never loads) overwrote it, and
    the model's outputs differed from from_pretrained's. A persistent buffer the
    checkpoint lacks (glm4_moe's router e_score_correction_bias) kept its stale value
    under strict, listed in not_loaded only."""
    from transformers import AutoModelForCausalLM
    whole = [{"pattern": n, "strategy": "replicate"} for n in ("*embed_tokens.weight", "lm_head.weight")]
    src = hf_checkpoint("glm4_moe")
    inv = "model.rotary_emb.inv_freq"

    def doubled(t):
        t[inv] = AutoModelForCausalLM.from_pretrained(str(src)).model.rotary_emb.inv_freq * 2
    path = _rewritten(src, tmp_path / "inv", doubled)
    want = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(5)
    model = _glm4_moe_model()
    res = cl.load_into(model, path, cl.Layout(), rank=0, rules=whole)
    assert inv in res.skipped and inv not in res.loaded
    assert torch.equal(model.model.rotary_emb.inv_freq, want.model.rotary_emb.inv_freq)
    assert_same_state(model, want.state_dict())
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    path = _rewritten(src, tmp_path / "nobias", lambda t: t.pop(bias))
    with pytest.raises(cl.LoadError) as e:
        cl.load_into(_glm4_moe_model(), path, cl.Layout(), rank=0, rules=whole)
    assert str(e.value).startswith(f"rank 0: no checkpoint tensor of this rank fills the "
                                   f"target {bias!r}")
    res = cl.load_into(_glm4_moe_model(), path, cl.Layout(), rank=0, rules=whole, strict=False)
    assert res.not_loaded == [bias]


def test_load_into_a_vocab_table_of_unpadded_rows_says_how(hf_checkpoint):
    """A transformers model holds its vocabulary tables unpadded, the `vocab` rule pads
    them as vLLM does: the refusal named a slice larger than the checkpoint's tensor, with
    no word of padding; the rule it names now loads the model as from_pretrained does."""
    from transformers import AutoModelForCausalLM
    path = hf_checkpoint("qwen2_moe")
    want = AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
    model = _qwen2_moe_model()
    rules = []
    for name in ("lm_head.weight", "model.embed_tokens.weight"):   # the plan's order
        with pytest.raises(cl.LoadError) as e:
            cl.load_into(model, str(path), cl.Layout(), rank=0, rules=rules)
        assert str(e.value) == (
            f"rank 0, tensor {name!r}: target {name!r} is torch.float32 [{VOCAB}, 32], this "
            f"rank's slice is torch.float32 [128, 32] (the 'vocab' rule pads [{VOCAB}, 32] to "
            f"a multiple of its pad_to rows, as vLLM's vocabulary-parallel layers hold it; "
            f"for a target of unpadded rows pass rules=[{{'pattern': {name!r}, 'strategy': "
            f"'vocab', 'params': {{'pad_to': 1}}}}])")
        rules.append({"pattern": name, "strategy": "vocab", "params": {"pad_to": 1}})
    cl.load_into(model, str(path), cl.Layout(), rank=0, rules=rules)
    assert_same_state(model, want)


def test_load_into_a_base_model_skips_or_maps_fused_experts_as_other_tensors(hf_checkpoint):
    """A base model (no `model.` prefix) has no entry for the fused experts a CausalLM
    checkpoint's tensors make: strict=False skipped every plain tensor but refused those
    ("no such entry", naming no checkpoint tensor); strict names the missing entry, as for
    a plain tensor, and a name_map dropping the prefix fills the base model."""
    from transformers import AutoModelForCausalLM, Qwen2MoeModel
    path = hf_checkpoint("qwen2_moe")
    names = sorted(_full_tensors(path))
    want = AutoModelForCausalLM.from_pretrained(str(path)).model.state_dict()
    base = Qwen2MoeModel(_qwen2_moe_model().config)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    whole = [{"pattern": n, "strategy": "replicate"} for n in ("*embed_tokens.weight", "lm_head.weight")]
    res = cl.load_into(base, str(path), cl.Layout(), rank=0, rules=whole, strict=False)
    assert res.loaded == [] and sorted(res.skipped) == names
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())
    with pytest.raises(cl.LoadError) as e:
        cl.load_into(base, str(path), cl.Layout(), rank=0, rules=whole,
                     name_map=lambda n: None if n == "lm_head.weight" else n)
    assert str(e.value) == ("rank 0, tensor 'model.embed_tokens.weight': no target entry "
                            "'model.embed_tokens.weight' for this checkpoint tensor (pass "
                            "name_map= or strict=False)")
    strip = {n: n.removeprefix("model.") for n in names if n.startswith("model.")}
    with pytest.raises(cl.LoadError) as e:   # the plain tensors mapped, the experts not
        cl.load_into(base, str(path), cl.Layout(), rank=0, rules=whole,
                     name_map=lambda n: None if n == "lm_head.weight" else
                     n if ".experts." in n else strip[n])
    assert str(e.value) == ("rank 0, tensor 'model.layers.0.mlp.experts.0.down_proj.weight': "
                            "no target entry 'model.layers.0.mlp.experts.down_proj', into "
                            "which transformers fuses this rank's experts [0, 1, 2, 3] (pass "
                            "name_map= or strict=False)")
    cl.load_into(base, str(path), cl.Layout(), rank=0, rules=whole,
                 name_map=lambda n: strip.get(n))
    assert_same_state(base, want)
