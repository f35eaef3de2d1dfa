"""Per-architecture configs (tiny / small / full) and the tensor tables they imply.

``full`` configs are the published ones (Llama-3-8B, Qwen2-7B, Qwen3-30B-A3B, Mixtral-8x7B,
DeepSeek-V3, bert-base-uncased). ``small`` is a real small model where one exists
(Qwen2-0.5B, all-MiniLM-L12) or a scaled model of about 0.3-1.5 GB (qwen3_moe ~1.2 GB, used
by load benchmarks). ``tiny`` keeps every dim divisible by tp up to 8 (and DeepSeek's FP8
splits on 128-blocks) so unit tests can use any layout, at well under 10 MB.

Tensor names, dtypes and shapes follow the HF checkpoints (``model.layers.N.self_attn.q_proj
.weight``, mixtral ``block_sparse_moe.experts.E.w1``, DeepSeek FP8 weights with F32
``weight_scale_inv`` and the MTP layer at index ``num_hidden_layers``, ...). The tables are
derived from the config by ``tensors_from_config`` only, so any config of these model types
(not just the presets here) gets its table.
"""
from __future__ import annotations

import copy
import math

from coordloader.errors import CoordloaderError

ARCHS = ("llama", "qwen2", "qwen3_moe", "mixtral", "deepseek_v3", "bert")
SIZES = ("tiny", "small", "full")

TensorSpec = tuple  # (name, dtype, shape tuple)

_LLAMA_FULL = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}

_QWEN2_FULL = {  # Qwen/Qwen2-7B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.37.2", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 152064,
}

_QWEN3_MOE_FULL = {  # Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

_MIXTRAL_FULL = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}

_DEEPSEEK_V3_FULL = {  # deepseek-ai/DeepSeek-V3
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}

_BERT_FULL = {  # google-bert/bert-base-uncased
    "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
    "gradient_checkpointing": False, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
    "position_embedding_type": "absolute", "torch_dtype": "float32",
    "transformers_version": "4.6.0.dev0", "type_vocab_size": 2, "use_cache": True,
    "vocab_size": 30522,
}


def _derive(base: dict, **changes) -> dict:
    cfg = copy.deepcopy(base)
    cfg.update(changes)
    return cfg


_CONFIGS: dict[tuple[str, str], dict] = {
    ("llama", "full"): _LLAMA_FULL,
    ("llama", "small"): _derive(_LLAMA_FULL, hidden_size=1024, intermediate_size=4096,
                                num_attention_heads=16, num_key_value_heads=4,
                                num_hidden_layers=8, vocab_size=32000,
                                max_position_embeddings=4096),
    ("llama", "tiny"): _derive(_LLAMA_FULL, hidden_size=128, intermediate_size=256,
                               num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
                               vocab_size=320, max_position_embeddings=256),
    ("qwen2", "full"): _QWEN2_FULL,
    # Qwen/Qwen2-0.5B: the real small one, with tied embeddings (no lm_head tensor).
    ("qwen2", "small"): _derive(_QWEN2_FULL, hidden_size=896, intermediate_size=4864,
                                num_attention_heads=14, num_key_value_heads=2,
                                num_hidden_layers=24, max_window_layers=24, vocab_size=151936,
                                tie_word_embeddings=True, max_position_embeddings=131072),
    # Tied like Qwen2-0.5B so unit tests cover the tied-embedding path; kv 4 replicates at tp 8.
    ("qwen2", "tiny"): _derive(_QWEN2_FULL, hidden_size=128, intermediate_size=384,
                               num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2,
                               max_window_layers=2, vocab_size=384, tie_word_embeddings=True,
                               max_position_embeddings=256, sliding_window=256),
    ("qwen3_moe", "full"): _QWEN3_MOE_FULL,
    # ~1.24 GB: 64 experts x 10 layers dominate, as in the real model.
    ("qwen3_moe", "small"): _derive(_QWEN3_MOE_FULL, hidden_size=1024, head_dim=128,
                                    intermediate_size=3072, moe_intermediate_size=256,
                                    num_attention_heads=16, num_key_value_heads=4,
                                    num_experts=64, num_experts_per_tok=8, num_hidden_layers=10,
                                    max_window_layers=10, vocab_size=32768),
    # head_dim * heads != hidden on purpose (as in the full model: 32 x 128 vs 2048).
    ("qwen3_moe", "tiny"): _derive(_QWEN3_MOE_FULL, hidden_size=128, head_dim=32,
                                   intermediate_size=256, moe_intermediate_size=64,
                                   num_attention_heads=8, num_key_value_heads=4, num_experts=16,
                                   num_experts_per_tok=4, num_hidden_layers=2,
                                   max_window_layers=2, vocab_size=448,
                                   max_position_embeddings=256),
    ("mixtral", "full"): _MIXTRAL_FULL,
    ("mixtral", "small"): _derive(_MIXTRAL_FULL, hidden_size=1024, intermediate_size=1536,
                                  num_attention_heads=16, num_key_value_heads=4,
                                  num_hidden_layers=6, max_position_embeddings=4096),
    ("mixtral", "tiny"): _derive(_MIXTRAL_FULL, hidden_size=128, intermediate_size=128,
                                 num_attention_heads=8, num_key_value_heads=2,
                                 num_hidden_layers=2, num_local_experts=8, vocab_size=320,
                                 max_position_embeddings=256),
    ("deepseek_v3", "full"): _DEEPSEEK_V3_FULL,
    # Head dims chosen so q_b/kv_b/o_proj splits stay whole 128-blocks for tp <= 8.
    ("deepseek_v3", "small"): _derive(_DEEPSEEK_V3_FULL, hidden_size=1024, intermediate_size=2048,
                                      moe_intermediate_size=1024, n_routed_experts=32,
                                      n_group=8, topk_group=4, num_attention_heads=16,
                                      num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256,
                                      num_hidden_layers=6, first_k_dense_replace=1,
                                      vocab_size=32768, max_position_embeddings=4096),
    # Every FP8 split up to tp 8 stays whole 128-blocks, as vLLM requires of block-quantised
    # layers: 16 heads x (nope 64 + rope 64) for q_b, x (64 + v 64) for kv_b, x v 64 for o_proj;
    # (moe_)intermediate 1024 = 8 x 128 for experts/MLPs at moe_tp 8. kv_a_proj_with_mqa has
    # 128 + 64 = 192 rows, so its scale has a partial block (like the real 576 -> 5 blocks).
    # hidden 128 and 8 experts keep it at ~8 MB.
    ("deepseek_v3", "tiny"): _derive(_DEEPSEEK_V3_FULL, hidden_size=128, intermediate_size=1024,
                                     moe_intermediate_size=1024, n_routed_experts=8, n_group=4,
                                     topk_group=2, num_experts_per_tok=2, num_attention_heads=16,
                                     num_key_value_heads=16, q_lora_rank=128, kv_lora_rank=128,
                                     qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                                     num_hidden_layers=2, first_k_dense_replace=1,
                                     vocab_size=512, max_position_embeddings=256),
    ("bert", "full"): _BERT_FULL,
    # sentence-transformers/all-MiniLM-L12-v2 dims.
    ("bert", "small"): _derive(_BERT_FULL, architectures=["BertModel"], hidden_size=384,
                               intermediate_size=1536, num_attention_heads=12,
                               num_hidden_layers=12),
    # vocab 250 is not a multiple of 64 (or 8): exercises vocab padding.
    ("bert", "tiny"): _derive(_BERT_FULL, hidden_size=64, intermediate_size=128,
                              num_attention_heads=8, num_hidden_layers=2, vocab_size=250,
                              max_position_embeddings=64),
}

# Shard counts of the published checkpoints; tiny/small use these small counts so the
# multi-file paths are exercised.
_DEFAULT_SHARDS = {
    ("llama", "full"): 4, ("qwen2", "full"): 4, ("qwen3_moe", "full"): 16,
    ("mixtral", "full"): 19, ("deepseek_v3", "full"): 163, ("bert", "full"): 1,
    ("llama", "tiny"): 1, ("qwen2", "tiny"): 2, ("qwen3_moe", "tiny"): 2, ("mixtral", "tiny"): 2,
    ("deepseek_v3", "tiny"): 3, ("bert", "tiny"): 1,
}


def _check(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise CoordloaderError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise CoordloaderError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")


def arch_config(arch: str, size: str = "tiny") -> dict:
    """The config.json dict of ``arch`` at ``size`` (a fresh copy)."""
    _check(arch, size)
    return copy.deepcopy(_CONFIGS[(arch, size)])


def default_shards(arch: str, size: str, total_bytes: int) -> int:
    """Shard count: the published one for full, small fixed counts for tiny, ~512 MB a
    shard (at most 3) for small."""
    _check(arch, size)
    if (arch, size) in _DEFAULT_SHARDS:
        return _DEFAULT_SHARDS[(arch, size)]
    return max(1, min(3, math.ceil(total_bytes / (512 << 20))))


def shard_name(arch: str, index: int, count: int) -> str:
    """HF shard file name; DeepSeek-V3's published shards use six digits for the count
    (``model-00001-of-000163.safetensors``), which is kept so readers meet both forms."""
    width = 6 if arch == "deepseek_v3" else 5
    return f"model-{index + 1:05d}-of-{count:0{width}d}.safetensors"


_TORCH_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _dtype(cfg: dict) -> str:
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    try:
        return _TORCH_DTYPE[name]
    except KeyError:
        raise CoordloaderError(f"config torch_dtype {name!r} not supported; expected one of "
                               f"{', '.join(_TORCH_DTYPE)}") from None


def _llama_family(cfg: dict) -> list[TensorSpec]:
    """llama, qwen2, qwen3_moe, mixtral: embed, decoder layers, final norm, lm_head."""
    mt = cfg["model_type"]
    dt = _dtype(cfg)
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    I = cfg["intermediate_size"]
    qkv_bias = mt == "qwen2" or bool(cfg.get("attention_bias"))
    out: list[TensorSpec] = [("model.embed_tokens.weight", dt, (V, H))]
    for i in range(L):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", dt, (H,)))
        a = p + "self_attn."
        out.append((a + "q_proj.weight", dt, (nh * hd, H)))
        out.append((a + "k_proj.weight", dt, (nkv * hd, H)))
        out.append((a + "v_proj.weight", dt, (nkv * hd, H)))
        if qkv_bias:
            out.append((a + "q_proj.bias", dt, (nh * hd,)))
            out.append((a + "k_proj.bias", dt, (nkv * hd,)))
            out.append((a + "v_proj.bias", dt, (nkv * hd,)))
        out.append((a + "o_proj.weight", dt, (H, nh * hd)))
        if mt == "qwen3_moe":
            out.append((a + "q_norm.weight", dt, (hd,)))
            out.append((a + "k_norm.weight", dt, (hd,)))
        out.append((p + "post_attention_layernorm.weight", dt, (H,)))
        if mt == "mixtral":
            out += _moe(p + "block_sparse_moe.", cfg["num_local_experts"], H, dt,
                        (("w1", I, H), ("w2", H, I), ("w3", I, H)))
        elif mt == "qwen3_moe" and _qwen3_sparse(cfg, i):
            MI = cfg["moe_intermediate_size"]
            out += _moe(p + "mlp.", cfg["num_experts"], H, dt,
                        (("gate_proj", MI, H), ("up_proj", MI, H), ("down_proj", H, MI)))
        else:
            out.extend(_mlp(p + "mlp.", H, I, dt))
    out.append(("model.norm.weight", dt, (H,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", dt, (V, H)))
    return out


def _qwen3_sparse(cfg: dict, layer: int) -> bool:
    # HF Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, every decoder_sparse_step.
    step = cfg.get("decoder_sparse_step", 1) or 1
    return (layer not in (cfg.get("mlp_only_layers") or []) and cfg.get("num_experts", 0) > 0
            and (layer + 1) % step == 0)


def _moe(m: str, E: int, H: int, dt: str, projs) -> list[TensorSpec]:
    """Router ``{m}gate.weight`` then, per expert, ``{m}experts.{e}.{proj}.weight`` of
    shape (out, in) for each (proj, out, in) of ``projs``."""
    out: list[TensorSpec] = [(m + "gate.weight", dt, (E, H))]
    for e in range(E):
        x = f"{m}experts.{e}."
        out += [(f"{x}{proj}.weight", dt, (o, i)) for proj, o, i in projs]
    return out


def _mlp(prefix: str, H: int, I: int, dt: str) -> list[TensorSpec]:
    return [(prefix + "gate_proj.weight", dt, (I, H)), (prefix + "up_proj.weight", dt, (I, H)),
            (prefix + "down_proj.weight", dt, (H, I))]


def _deepseek(cfg: dict) -> list[TensorSpec]:
    dt = _dtype(cfg)
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qr, kvr = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    I, MI = cfg["intermediate_size"], cfg["moe_intermediate_size"]
    E, S = cfg["n_routed_experts"], cfg.get("n_shared_experts") or 0
    first_dense, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1) or 1
    mtp = cfg.get("num_nextn_predict_layers", 0) or 0
    q = cfg.get("quantization_config")
    if q:
        bo, bi = q.get("weight_block_size", [128, 128])

        def lin(name: str, o: int, i: int) -> list[TensorSpec]:
            # FP8 block quantisation: the weight plus one F32 inverse scale per 128x128 block.
            return [(name + ".weight", "F8_E4M3", (o, i)),
                    (name + ".weight_scale_inv", "F32", (-(-o // bo), -(-i // bi)))]
    else:
        def lin(name: str, o: int, i: int) -> list[TensorSpec]:
            return [(name + ".weight", dt, (o, i))]

    def layer(i: int) -> list[TensorSpec]:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        t: list[TensorSpec] = [(p + "input_layernorm.weight", dt, (H,))]
        if qr:
            t += lin(a + "q_a_proj", qr, H)
            t.append((a + "q_a_layernorm.weight", dt, (qr,)))
            t += lin(a + "q_b_proj", nh * (nope + rope), qr)
        else:
            t += lin(a + "q_proj", nh * (nope + rope), H)
        t += lin(a + "kv_a_proj_with_mqa", kvr + rope, H)
        t.append((a + "kv_a_layernorm.weight", dt, (kvr,)))
        t += lin(a + "kv_b_proj", nh * (nope + vd), kvr)
        t += lin(a + "o_proj", H, nh * vd)
        t.append((p + "post_attention_layernorm.weight", dt, (H,)))
        m = p + "mlp."
        if E and i >= first_dense and i % freq == 0:
            t.append((m + "gate.weight", dt, (E, H)))
            if cfg.get("topk_method") == "noaux_tc":
                t.append((m + "gate.e_score_correction_bias", "F32", (E,)))
            for e in range(E):
                x = f"{m}experts.{e}."
                t += lin(x + "gate_proj", MI, H) + lin(x + "up_proj", MI, H) + \
                    lin(x + "down_proj", H, MI)
            if S:
                x = m + "shared_experts."
                t += lin(x + "gate_proj", MI * S, H) + lin(x + "up_proj", MI * S, H) + \
                    lin(x + "down_proj", H, MI * S)
        else:
            t += lin(m + "gate_proj", I, H) + lin(m + "up_proj", I, H) + lin(m + "down_proj", H, I)
        return t

    out: list[TensorSpec] = [("model.embed_tokens.weight", dt, (V, H))]
    for i in range(L):
        out += layer(i)
    out.append(("model.norm.weight", dt, (H,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", dt, (V, H)))
    # MTP modules (layers L .. L+mtp-1) as published: own embed/head copies, BF16 eh_proj.
    for k in range(mtp):
        i = L + k
        p = f"model.layers.{i}."
        out.append((p + "embed_tokens.weight", dt, (V, H)))
        out.append((p + "enorm.weight", dt, (H,)))
        out.append((p + "hnorm.weight", dt, (H,)))
        out.append((p + "eh_proj.weight", dt, (H, 2 * H)))
        out += layer(i)
        out.append((p + "shared_head.norm.weight", dt, (H,)))
        out.append((p + "shared_head.head.weight", dt, (V, H)))
    return out


def _bert(cfg: dict) -> list[TensorSpec]:
    dt = _dtype(cfg)
    H, V, L, I = (cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"],
                  cfg["intermediate_size"])
    # BertModel checkpoints (MiniLM) have no "bert." prefix and no pretraining heads.
    headless = cfg.get("architectures") == ["BertModel"]
    b = "" if headless else "bert."

    def dense(name: str, o: int, i: int) -> list[TensorSpec]:
        return [(name + ".weight", dt, (o, i)), (name + ".bias", dt, (o,))]

    def ln(name: str) -> list[TensorSpec]:
        return [(name + ".weight", dt, (H,)), (name + ".bias", dt, (H,))]

    out: list[TensorSpec] = [
        (b + "embeddings.word_embeddings.weight", dt, (V, H)),
        (b + "embeddings.position_embeddings.weight", dt, (cfg["max_position_embeddings"], H)),
        (b + "embeddings.token_type_embeddings.weight", dt, (cfg["type_vocab_size"], H)),
    ] + ln(b + "embeddings.LayerNorm")
    for i in range(L):
        p = f"{b}encoder.layer.{i}."
        out += dense(p + "attention.self.query", H, H) + dense(p + "attention.self.key", H, H) + \
            dense(p + "attention.self.value", H, H) + dense(p + "attention.output.dense", H, H) + \
            ln(p + "attention.output.LayerNorm") + dense(p + "intermediate.dense", I, H) + \
            dense(p + "output.dense", H, I) + ln(p + "output.LayerNorm")
    out += dense(b + "pooler.dense", H, H)
    if not headless:
        # bert-base-uncased ships its pretraining heads; the MLM decoder is tied to the
        # word embeddings and so not stored.
        out += [("cls.predictions.bias", dt, (V,))] + \
            dense("cls.predictions.transform.dense", H, H) + \
            ln("cls.predictions.transform.LayerNorm") + dense("cls.seq_relationship", 2, H)
    return out


_BUILDERS = {"llama": _llama_family, "qwen2": _llama_family, "qwen3_moe": _llama_family,
             "mixtral": _llama_family, "deepseek_v3": _deepseek, "bert": _bert}


def tensors_from_config(cfg: dict) -> list[TensorSpec]:
    """[(name, dtype, shape)] in checkpoint (layer) order for a config of a known model_type."""
    mt = cfg.get("model_type")
    if mt not in _BUILDERS:
        raise CoordloaderError(f"config model_type {mt!r} not supported; expected one of "
                               f"{', '.join(_BUILDERS)}")
    try:
        return _BUILDERS[mt](cfg)
    except KeyError as e:
        raise CoordloaderError(f"config of model_type {mt!r} lacks key {e.args[0]!r}") from None


def arch_tensors(arch: str, size: str = "tiny") -> tuple[dict, list[TensorSpec]]:
    """(config, [(name, dtype, shape)]) of ``arch`` at ``size``; pure, no I/O."""
    cfg = arch_config(arch, size)
    return cfg, tensors_from_config(cfg)
