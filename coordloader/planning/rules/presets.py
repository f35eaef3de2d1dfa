"""Architecture presets: ordered rules whose split dims follow vLLM's weight loaders
(QKVParallelLinear by heads, MergedColumnParallelLinear gate/up on dim 0,
RowParallelLinear on dim 1 with a replicated bias, VocabParallelEmbedding/ParallelLMHead
padded to 64 rows, ReplicatedLinear for MLA's a-projections and routers, FusedMoE experts
placed by EP and split by the MoE TP size). Head and expert counts come from config.json."""
from __future__ import annotations

from typing import Mapping

from coordloader.checkpoint.metadata import EXPERT_COUNT_KEYS, config_head_dim, kv_heads_default
from coordloader.errors import PlanError
from coordloader.planning.rules.names import PRESETS
from coordloader.planning.rules.ruleset import Rule, make_rule
from coordloader.text import MAX_NAME_CHARS, clip

# config.json "architectures" entries -> preset
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "LlamaModel": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen2Model": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen2MoeModel": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral", "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3", "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v3",
    "BertModel": "bert", "BertForMaskedLM": "bert", "BertForSequenceClassification": "bert",
    "BertForPreTraining": "bert",
    "GptOssForCausalLM": "gpt_oss",
    "Llama4ForCausalLM": "llama4",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_MODEL_TYPES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2_moe",
    "qwen3": "qwen3_moe",
    "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
    "kimi_k2": "deepseek_v3", "bert": "bert", "phi3": "phi3",
    "gemma3_text": "gemma3", "glm4_moe": "glm4_moe",
    "gpt_oss": "gpt_oss",
    "llama4_text": "llama4",
    "qwen3_next": "qwen3_next",
}


def detect_preset(config: Mapping | None) -> str | None:
    """Preset name from config.json (``architectures`` first, then ``model_type``)."""
    if not config:
        return None
    archs = config.get("architectures") or ()
    if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
        raise PlanError(f"config.json: architectures must be a list of strings, got "
                        f"{clip(repr(archs), MAX_NAME_CHARS)}")
    for a in archs:
        if a in _ARCHITECTURES:
            return _ARCHITECTURES[a]
    mt = config.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise PlanError(f"config.json: model_type must be a string, got "
                        f"{clip(repr(mt), MAX_NAME_CHARS)}")
    return _MODEL_TYPES.get(mt)


# Presets whose checkpoints hold multi-token-prediction (MTP) draft tensors under a name
# prefix instead of as layers past num_hidden_layers (DeepSeek's way): vLLM's main model
# drops them (Qwen3-Next: WeightsMapper "mtp." -> None) and its draft model loads them.
# Left out unless the layout asks for MTP (include_mtp), then on the last stage, as
# DeepSeek's MTP layers.
MTP_PREFIX = {"qwen3_next": "mtp."}


def _cfg_int(config: Mapping, *keys, default=None, preset: str = "") -> int | None:
    for k in keys:
        v = config.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"config.json: {k} must be a positive integer, got "
                                f"{clip(repr(v), MAX_NAME_CHARS)} (preset {preset})")
            return v
    return default


def num_experts_of(config: Mapping | None) -> int | None:
    if not config:
        return None
    return _cfg_int(config, *EXPERT_COUNT_KEYS)


def block_of(config: Mapping | None) -> list[int]:
    q = (config or {}).get("quantization_config") or {}
    if not isinstance(q, Mapping):
        raise PlanError(f"config.json: quantization_config must be an object, got "
                        f"{clip(repr(q), MAX_NAME_CHARS)}")
    b = q.get("weight_block_size")
    if b is None:
        return [128, 128]
    if not (isinstance(b, list) and b and all(type(x) is int and x > 0 for x in b)):
        raise PlanError(f"config.json: quantization_config.weight_block_size must be a list "
                        f"of positive integers, got {clip(repr(b), MAX_NAME_CHARS)}")
    return list(b)


def missing_config_error(preset: str | None, tensor: str | None = None,
                         config: Mapping | None = None) -> PlanError:
    """The one error for a checkpoint without config.json that needs one (or with an
    empty one, ``config`` {}: its own or the one given): which preset (or that none could
    be detected), what it needs from the config, and the ways out."""
    need = (f"preset {preset} needs its sizes" if preset else
            "the architecture preset is detected from it, and a preset needs its sizes")
    what = ("config.json is missing from the checkpoint directory" if config is None else
            "the model config (config.json, or the one given with --config / config=) is "
            "empty")
    return PlanError(
        f"{what}: {need} (num_attention_heads, "
        f"num_key_value_heads, num_hidden_layers, the expert count). Ways out: give the model's "
        f"config.json with --config FILE (config= in Python) or copy it into the checkpoint "
        f"directory; or --rules PRESET together with --config FILE holding the values the preset "
        f"needs; or a rule file giving every tensor a strategy with explicit sizes "
        f"(num_heads=...). --replicate-unmatched is no fix for a sharded layout: it holds every "
        f"unmatched tensor whole on every rank", file="config.json", tensor=tensor)


def preset_rules(name: str, config: Mapping | None) -> list[Rule]:
    if name not in PRESETS:
        raise PlanError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    if not config:
        # every preset needs head counts from it; say so once, with the ways out, instead
        # of "config.json lacks num_attention_heads"
        raise missing_config_error(name, config=config)
    src = f"preset:{name}"

    def R(pattern, strategy, **params):
        return make_rule(pattern, strategy, params, regex=True, source=src)

    if name == "bert":
        return _bert(config, R)

    heads = _cfg_int(config, "num_attention_heads", preset=name)
    kv_heads = _cfg_int(config, "num_key_value_heads", preset=name)
    if kv_heads is None:
        kv_heads = kv_heads_default(config, heads)

    def need(v, key):
        if v is None:
            raise PlanError(f"preset {name}: config.json lacks {key}, needed to split attention "
                            f"heads; pass a rule file with explicit num_heads")
        return v

    rules = [
        R(r".*_scale_inv", "scale", block=block_of(config)),
        # an FP8 kv cache's per-tensor scales (k_proj.k_scale, attn.v_scale, ...): vLLM
        # loads each whole on every rank (default_weight_loader, its kv-scale loader)
        R(r".*\.(k|v|q|prob)_scale", "replicate"),
        # MTP layers carry their own embedding and head: same vocab split
        R(r"(?:.*\.)?embed_tokens\.weight", "vocab"),
        R(r"lm_head\.weight", "vocab", stage="last"),
        R(r".*\.shared_head\.head\.weight", "vocab"),
    ]
    if name == "deepseek_v3":
        rules += [
            R(r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight", "replicate"),
            R(r".*\.self_attn\.(q_b_proj|kv_b_proj|q_proj)\.weight", "heads",
              num_heads=need(heads, "num_attention_heads")),
            R(r".*\.self_attn\.o_proj\.weight", "rowwise"),
            R(r".*\.mlp\.gate\.(weight|e_score_correction_bias)", "replicate"),
            R(r".*\.eh_proj\.weight", "replicate"),
            # vLLM deepseek_v2.py: shared_experts a DeepseekV2MLP, held whole (disable_tp)
            # when the MoE runs sequence-parallel (``Layout.sequence_parallel_moe``)
            R(r".*\.mlp\.shared_experts\.(gate|up)_proj\.weight", "colwise",
              shared_expert=True),
            R(r".*\.mlp\.shared_experts\.down_proj\.weight", "rowwise", shared_expert=True),
        ]
    elif name == "phi3":
        rules += _phi3(config, R, need(heads, "num_attention_heads"),
                       need(kv_heads, "num_key_value_heads"))
    else:
        # rows per head where config.json fixes them (a class default of its own is not
        # assumed); Qwen3-Next's q_proj holds each head's query and output gate
        hd = config_head_dim(config)
        q_hd = {} if hd is None else {"head_dim": hd * (2 if name == "qwen3_next" else 1)}
        kv_hd = {} if hd is None else {"head_dim": hd}
        rules += [
            R(r".*\.self_attn\.q_proj\.(weight|bias)", "heads",
              num_heads=need(heads, "num_attention_heads"), **q_hd),
            R(r".*\.self_attn\.[kv]_proj\.(weight|bias)", "heads",
              num_heads=need(kv_heads, "num_key_value_heads"), kv=True, **kv_hd),
            R(r".*\.self_attn\.o_proj\.(weight|bias)", "rowwise"),
        ]
    # gemma3 (text), as vLLM's gemma3.py: Llama's split (QKVParallelLinear, merged gate/up,
    # row o/down, tied VocabParallelEmbedding); its q_norm/k_norm and four norms per layer
    # are replicated by the norm rule below
    n_exp = num_experts_of(config)
    exp = {"num_experts": n_exp} if n_exp else {}
    if name == "mixtral":
        rules += [
            # transformers 5 holds the router as mlp.gate in memory (state_dict, DCP);
            # save_pretrained writes block_sparse_moe.gate
            R(r".*\.(block_sparse_moe|mlp)\.gate\.weight", "replicate"),
            R(r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight", "expert", dim=0, **exp),
            R(r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight", "expert", dim=1, **exp),
        ]
    if name == "glm4_moe":
        # GLM-4.5/4.6, as vLLM's glm4_moe.py: the router (with its e_score_correction_bias)
        # is a ReplicatedLinear; shared experts, dense first layers and the MTP layer's
        # eh_proj follow the DeepSeek-style rules below
        rules += [R(r".*\.mlp\.gate\.(weight|e_score_correction_bias)", "replicate"),
                  R(r".*\.eh_proj\.weight", "replicate")]
    if name == "gpt_oss":
        rules += _gpt_oss(config, R, need(heads, "num_attention_heads"), exp)
    if name == "llama4":
        rules += _llama4(R, exp)
    if name == "qwen3_next":
        rules += _qwen3_next(config, R)
    if name in ("qwen3_moe", "qwen2", "qwen2_moe", "qwen3_next"):
        # vLLM qwen2_moe.py: shared_expert is a Qwen2MoeMLP (merged gate/up colwise, down
        # rowwise); gate is a ReplicatedLinear and shared_expert_gate a plain nn.Linear
        rules += [R(r".*\.mlp\.gate\.weight", "replicate"),
                  R(r".*\.mlp\.shared_expert_gate\.weight", "replicate"),
                  R(r".*\.mlp\.shared_expert\.(gate|up)_proj\.weight", "colwise"),
                  R(r".*\.mlp\.shared_expert\.down_proj\.weight", "rowwise")]
    rules += [
        # transformers 5 holds the experts of a layer fused in memory (what state_dict() and
        # DCP write): gate_up_proj [E, 2I, H] packs gate and up halves, each split over
        # moe_tp like vLLM's w13; down_proj [E, H, I] splits on its input dim like w2
        R(r".*\.experts\.gate_up_proj", "expert", dim=0, num_blocks=2, **exp),
        R(r".*\.experts\.down_proj", "expert", dim=1, **exp),
        R(r".*\.experts\.\d+\.(gate|up)_proj\.weight", "expert", dim=0, **exp),
        R(r".*\.experts\.\d+\.down_proj\.weight", "expert", dim=1, **exp),
        # dense MLP and DeepSeek's shared experts: like vLLM's MLP (merged gate/up, row down)
        R(r".*\.mlp\.(shared_experts\.)?(gate|up)_proj\.(weight|bias)", "colwise"),
        R(r".*\.mlp\.(shared_experts\.)?down_proj\.(weight|bias)", "rowwise"),
        R(r".*norm\.(weight|bias)", "replicate"),          # all norms incl. q_norm/k_norm, enorm/hnorm
        R(r".*rotary_emb\.inv_freq", "replicate"),
    ]
    return rules


def _phi3(config, R, heads: int, kv_heads: int) -> list[Rule]:
    """phi3 (Phi-3, Phi-4), as vLLM's phi3.py (a Llama with stacked params): the checkpoint
    already holds the fused qkv_proj and gate_up_proj that QKVParallelLinear and
    MergedColumnParallelLinear load with shard id None, i.e. cut into q/k/v (gate/up)
    blocks, each split over TP on its own."""
    hidden = _cfg_int(config, "hidden_size", preset="phi3")
    hd = _cfg_int(config, "head_dim", preset="phi3") or (hidden // heads if hidden else None)
    if hd is None:
        raise PlanError("preset phi3: config.json lacks head_dim and hidden_size, needed to "
                        "cut qkv_proj into q, k and v")
    return [
        R(r".*\.self_attn\.qkv_proj\.weight", "packed",
          blocks=[heads * hd, kv_heads * hd, kv_heads * hd], heads=[heads, kv_heads, kv_heads],
          kv=[False, True, True]),
        R(r".*\.self_attn\.o_proj\.weight", "rowwise"),
        R(r".*\.mlp\.gate_up_proj\.weight", "packed", num_blocks=2),
    ]


def _gpt_oss(config, R, heads: int, exp: dict) -> list[Rule]:
    """gpt_oss (gpt-oss-20b/120b), as vLLM's gpt_oss.py (``_load_weights_other`` for bf16,
    ``_load_weights_mxfp4`` for the published MXFP4 storage). q/k/v (with biases) by heads,
    o_proj rowwise, the per-head attention ``sinks`` by heads, the router (weight and bias)
    replicated. Experts are fused with the expert on dim 0; gate and up are *interleaved*
    pairs on the 2I dim and vLLM takes a contiguous run of pairs (``2*start:2*end``), so a
    rank keeps both members of each of its pairs. The intermediate dim is split in whole
    elements for bf16, and in whole 32-element MXFP4 blocks for the MXFP4 storage (vLLM
    rounds its per-rank size up to a block: an uneven block count needs allow_uneven, whose
    torch.chunk split is vLLM's cdiv). down_proj_bias is whole per expert (vLLM adds it on
    TP rank 0 only)."""
    quant = (config.get("quantization_config") or {}).get("quant_method")
    unit = {"split_unit": 32} if quant == "mxfp4" else {}
    e = r".*\.mlp\.experts\."
    return [
        R(r".*\.self_attn\.sinks", "heads", num_heads=heads),
        R(r".*\.mlp\.router\.(weight|bias)", "replicate"),
        # bf16 [E, H, 2I]: pairs on the last dim
        R(e + r"gate_up_proj", "expert", dim=1, interleaved=2, **unit, **exp),
        # bias [E, 2I], MXFP4 blocks [E, 2I, H/32, 16] and scales [E, 2I, H/32]
        R(e + r"gate_up_proj_(bias|blocks|scales)", "expert", dim=0, interleaved=2, **unit,
          **exp),
        R(e + r"down_proj", "expert", dim=0, **exp),                     # bf16 [E, I, H]
        # MXFP4 blocks [E, H, I/32, 16] and scales [E, H, I/32]: whole blocks of I
        R(e + r"down_proj_(blocks|scales)", "expert", dim=1, **exp),
        R(e + r"down_proj_bias", "expert", **exp),                       # [E, H]
    ]


_GPT_OSS_MXFP4 = ("_blocks", "_scales")
_GPT_OSS_BF16 = (".experts.gate_up_proj", ".experts.down_proj")


def storage_problem(preset: str | None, config: Mapping, names) -> tuple[str, str] | None:
    """(tensor, what is wrong) where the preset's split depends on how config.json says the
    checkpoint is stored and a tensor is stored another way. gpt-oss: the gate/up split
    moves by 32-element MXFP4 blocks under ``quant_method: mxfp4`` (so does vLLM, by the
    config), while down_proj's follows the tensors' shapes: a config of the other storage
    would give a rank gate/up and down_proj of different intermediate ranges."""
    if preset != "gpt_oss":
        return None
    mxfp4 = (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    for n in names:
        if ".experts." not in n:
            continue
        if not mxfp4 and n.endswith(_GPT_OSS_MXFP4) and ".experts.gate_up" in n:
            return n, ("is gpt-oss's MXFP4 storage but config.json's quantization_config does "
                       "not say quant_method mxfp4")
        if mxfp4 and n.endswith(_GPT_OSS_BF16):
            return n, ("is gpt-oss's bf16 storage but config.json's quantization_config says "
                       "quant_method mxfp4")
    return None


def _llama4(R, exp: dict) -> list[Rule]:
    """llama4 text (Llama 4 Scout/Maverick language model), as vLLM's llama4.py: attention
    like Llama (vLLM permutes q/k rows inside each head for its rotary, so whole heads
    stay whole); every ``interleave_moe_layer_step``-th layer is a Llama4MoE (router a
    ReplicatedLinear, fused experts, shared_expert a LlamaMLP), the others a LlamaMLP of
    intermediate_size_mlp; the tensor names say which. Fused experts as
    ``load_moe_expert_weights``: gate_up_proj [E, H, 2I] is chunked into gate and up
    *halves* on its last dim, each split over moe_tp; down_proj [E, I, H] split on I."""
    f = r".*\.feed_forward\."
    return [
        R(f + r"router\.weight", "replicate"),
        R(f + r"experts\.gate_up_proj", "expert", dim=1, num_blocks=2, **exp),
        R(f + r"experts\.down_proj", "expert", dim=0, **exp),
        R(f + r"(gate|up)_proj\.weight", "colwise"),
        R(f + r"down_proj\.weight", "rowwise"),
        # shared_expert: whole when the MoE runs sequence-parallel (disable_tp in vLLM)
        R(f + r"shared_expert\.(gate|up)_proj\.weight", "colwise", shared_expert=True),
        R(f + r"shared_expert\.down_proj\.weight", "rowwise", shared_expert=True),
    ]


def _qwen3_next(config, R) -> list[Rule]:
    """qwen3_next (Qwen3-Next), as vLLM's qwen3_next.py and its gated DeltaNet layer
    (layers/mamba/gdn/qwen_gdn_linear_attn.py, ``gqa_interleaved_layout``). Full-attention
    layers: q_proj holds each head's query and output gate (QKVParallelLinear of 2x the
    heads), so it splits by heads like q/k/v elsewhere. Linear-attention layers:
    in_proj_qkvz and in_proj_ba are one output shard each whose rows are grouped per key
    head, so a rank takes whole key-head groups; conv1d packs q, k and v channels, each
    split on its own (mamba_v2_sharded_weight_loader); dt_bias and A_log one value per
    value head; out_proj rowwise; the gated norm replicated. The MoE block is qwen2_moe's
    with the shared expert kept as a Qwen3NextMLP, held whole under a sequence-parallel
    MoE (``Layout.sequence_parallel_moe``). The MTP draft tensors (``mtp.*``) are
    loaded by vLLM's draft model, not this one: left out (``MTP_PREFIX``); with
    include_mtp they follow these rules where they match, on the last stage."""
    nk = _cfg_int(config, "linear_num_key_heads", preset="qwen3_next")
    nv = _cfg_int(config, "linear_num_value_heads", preset="qwen3_next")
    hk = _cfg_int(config, "linear_key_head_dim", preset="qwen3_next")
    hv = _cfg_int(config, "linear_value_head_dim", preset="qwen3_next")
    if None in (nk, nv, hk, hv):
        raise PlanError("preset qwen3_next: config.json lacks linear_num_key_heads, "
                        "linear_num_value_heads, linear_key_head_dim or "
                        "linear_value_head_dim, needed to split the linear attention")
    la = r".*\.linear_attn\."
    return [
        R(la + r"in_proj_(qkvz|ba)\.weight", "heads", num_heads=nk),
        R(la + r"conv1d\.weight", "packed", blocks=[nk * hk, nk * hk, nv * hv],
          heads=[nk, nk, nv]),
        R(la + r"(dt_bias|A_log)", "heads", num_heads=nv),
        R(la + r"out_proj\.weight", "rowwise"),
        # the shared expert is a Qwen2MoeMLP given is_sequence_parallel: whole when the MoE
        # runs sequence-parallel (qwen2_moe's own shared expert is not given it)
        R(r".*\.mlp\.shared_expert\.(gate|up)_proj\.weight", "colwise", shared_expert=True),
        R(r".*\.mlp\.shared_expert\.down_proj\.weight", "rowwise", shared_expert=True),
    ]


def _bert(config, R) -> list[Rule]:
    heads = _cfg_int(config, "num_attention_heads", preset="bert")
    if heads is None:
        raise PlanError("preset bert: config.json lacks num_attention_heads")
    p = r"(?:.*\.)?"
    return [
        # vLLM bert.py builds all three embeddings as VocabParallelEmbedding
        R(p + r"embeddings\.(word|position|token_type)_embeddings\.weight", "vocab",
          stage="first"),
        R(p + r"embeddings\.(LayerNorm\.(weight|bias)|position_ids|token_type_ids)", "replicate",
          stage="first"),
        R(r".*\.attention\.self\.(query|key|value)\.(weight|bias)", "heads", num_heads=heads),
        R(r".*\.attention\.output\.dense\.(weight|bias)", "rowwise"),
        R(r".*\.intermediate\.dense\.(weight|bias)", "colwise"),
        R(r".*\.output\.dense\.(weight|bias)", "rowwise"),
        R(r".*LayerNorm\.(weight|bias)", "replicate"),
        R(p + r"pooler\.dense\.(weight|bias)", "replicate", stage="last"),
        # pretraining heads (BertForPreTraining / MaskedLM): small, and vLLM's BERT has no
        # parallel version of them, so every rank of the last stage keeps them whole
        R(r"cls\..*", "replicate", stage="last"),
        # BertForSequenceClassification's head: an nn.Linear in vLLM's bert.py too
        R(r"classifier\.(weight|bias)", "replicate", stage="last"),
    ]
