"""coordloader as a vLLM load format: ``vllm serve MODEL --load-format coordloader``.

vLLM's own formats hand every rank every whole checkpoint tensor and let each layer's
``weight_loader`` narrow it. Here each rank plans and reads only its slices (coordloader's
planner and engine over vLLM's own process groups), wraps them as ``GlobalShapeTensor``s
so the same ``weight_loader``s place them unchanged, then checks what vLLM cannot:

- exact fit: every element a loader narrowed was held (else the loader raises
  ``FitError`` at once) and every held element was copied out by some loader;
- expert slots: the experts vLLM keeps on this rank are the experts coordloader loaded;
- every parameter of a linear, embedding or fused-MoE module filled by the loaders
  (``check_filled``: vLLM's own check exempts those modules);
- vLLM's own ``track_weights_loading`` (every other parameter initialised from the
  checkpoint).

A failure on any rank fails the load on every rank (one agreed phase), naming the rank
and tensor. Registered through the ``vllm.general_plugins`` entry point (``register``), so
vLLM's worker processes see it too. Options come through
``--model-loader-extra-config`` (``LOADER_OPTIONS``); unknown keys are refused.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, NamedTuple

from coordloader.errors import ConfigError, FitError
from coordloader.layout import Layout

LOAD_FORMAT = "coordloader"

# key -> (type, meaning); the only keys --model-loader-extra-config may carry
LOADER_OPTIONS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "engine": (str, "coordloader engine: auto or cpu (host memory; vLLM copies to the device)"),
    "verify": (str, "verify mode after the load: none, shapes, digest"),
    "rules": ((str, list, dict), "preset name, rule file path, a rule file's content (an "
                                 "object) or a list of rules, instead of detecting from "
                                 "config.json"),
    "timeout": ((int, float), "seconds a rank waits for the others at each phase"),
    "loader_config": (dict, "engine options (as the load CLI's --loader-config)"),
    "replicate_unmatched": (bool, "hold every tensor no rule matches whole on every rank (the "
                                  "planner's advice for an architecture with no preset)"),
}


@dataclass(frozen=True)
class LoaderOptions:
    engine: str = "cpu"
    verify: str = "shapes"
    rules: Any = None
    timeout: float | None = None
    loader_config: dict | None = None
    replicate_unmatched: bool = False

    @staticmethod
    def parse(extra: Any) -> "LoaderOptions":
        """``model_loader_extra_config`` -> options; ConfigError naming the key otherwise."""
        if extra is None:
            return LoaderOptions()
        if not isinstance(extra, Mapping):
            raise ConfigError(f"--model-loader-extra-config for load format {LOAD_FORMAT!r} must "
                              f"be a JSON object, got {type(extra).__name__}")
        unknown = sorted(map(str, set(extra) - set(LOADER_OPTIONS)))
        if unknown:
            raise ConfigError(f"--model-loader-extra-config: unknown key(s) {', '.join(unknown)} for "
                              f"load format {LOAD_FORMAT!r}; known: {', '.join(LOADER_OPTIONS)}")
        for key, value in extra.items():
            kind, meaning = LOADER_OPTIONS[key]
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ConfigError(f"--model-loader-extra-config: {key} ({meaning}) has the wrong "
                                  f"type: {value!r}")
        if extra.get("engine", "auto") not in ("auto", "cpu"):
            # the instanttensor engine would need vLLM's device group, which load() does not
            # take yet; host reads + vLLM's own copy to the device are correct everywhere
            raise ConfigError(f"--model-loader-extra-config: engine {extra['engine']!r} is not "
                              f"available under vLLM; use auto or cpu")
        from coordloader.dist.collective import timeout_problem
        problem = timeout_problem(extra.get("timeout"))
        if problem:
            raise ConfigError(f"--model-loader-extra-config: {problem}")
        opts = dict(extra)
        opts["engine"] = "cpu"
        return LoaderOptions(**opts)


class VllmRank(NamedTuple):
    """Where this vLLM worker sits, read from vLLM's parallel config and groups."""
    layout: Layout
    rank: int           # coordloader's rank for the worker's tp/pp coordinates
    cpu_group: Any      # vLLM's world group over gloo: metadata, plan and phase agreement


def pp_partition(value: str | None, pp: int) -> tuple[int, ...] | None:
    """``VLLM_PP_LAYER_PARTITION`` ("8,7,...": layers per stage, which vLLM's
    get_pp_indices follows) as ``Layout.pp_layers``; None when unset or pp is 1."""
    if value is None or pp <= 1:
        return None
    try:
        counts = tuple(int(x) for x in value.split(","))
    except ValueError:
        counts = ()
    if len(counts) != pp or any(c < 0 for c in counts):
        raise ConfigError(f"VLLM_PP_LAYER_PARTITION={value!r}: expected {pp} comma-separated "
                          f"non-negative layer counts, one per pipeline stage")
    return counts


def layout_of(tp: int, pp: int, dp: int, expert_parallel: bool, placement: str,
              pp_layers: tuple[int, ...] | None = None) -> Layout:
    """The coordloader layout that places slices where vLLM's layers expect them.

    Without expert parallelism vLLM splits every expert over the TP x DP ranks of a stage
    (``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``: ``ep=1``, ``moe_tp = dp *
    tp``, moe_tp rank ``dp_rank * tp + tp_rank``); with it, experts are spread over the
    same ranks (vLLM's ``ep_size = dp * tp``, ``ep_rank = dp_rank * tp + tp_rank``), whole.
    Either way the MoE group spans DP: ``ep_spans_dp``."""
    if expert_parallel:
        return Layout(tp=tp, pp=pp, dp=dp, ep=tp * dp, ep_spans_dp=dp > 1,
                      expert_placement=placement, pp_layers=pp_layers)
    return Layout(tp=tp, pp=pp, dp=dp, ep_spans_dp=dp > 1, pp_layers=pp_layers)


def coordinate_rank(layout: Layout, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
    """coordloader's global rank with these coordinates (TP innermost, then DP, then PP)."""
    return (pp_rank * layout.dp + dp_rank) * layout.tp + tp_rank


def vllm_rank() -> VllmRank:
    from vllm.config import get_current_vllm_config
    from vllm.distributed import parallel_state as ps

    pc = get_current_vllm_config().parallel_config
    if getattr(pc, "prefill_context_parallel_size", 1) > 1 or \
            getattr(pc, "decode_context_parallel_size", 1) > 1:
        raise ConfigError(f"load format {LOAD_FORMAT!r} does not plan context parallelism "
                          f"(prefill/decode_context_parallel_size > 1)")
    if pc.data_parallel_size > 1:
        # vLLM's world group then spans every DP replica (rank = dp_rank * world + rank),
        # with or without expert parallelism; the format plans one replica's TP x PP ranks
        raise ConfigError(f"load format {LOAD_FORMAT!r}: data parallelism "
                          f"(data_parallel_size={pc.data_parallel_size}"
                          f"{', with expert parallelism' if pc.enable_expert_parallel else ''}) "
                          f"is not supported yet")
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    layout = layout_of(tp, pp, 1, pc.enable_expert_parallel, pc.expert_placement_strategy,
                       pp_partition(os.environ.get("VLLM_PP_LAYER_PARTITION"), pp))
    tp_rank = ps.get_tp_group().rank_in_group
    pp_rank = ps.get_pp_group().rank_in_group
    rank = coordinate_rank(layout, tp_rank, pp_rank, 0)
    world = ps.get_world_group()
    if world.world_size != layout.world_size or world.rank_in_group != rank:
        raise ConfigError(f"load format {LOAD_FORMAT!r}: vLLM's world group (rank "
                          f"{world.rank_in_group} of {world.world_size}) does not match the "
                          f"layout {layout} (this worker is tp {tp_rank}, pp {pp_rank}, so "
                          f"coordloader rank {rank})")
    return VllmRank(layout, rank, world.cpu_group)


_LAYER_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\..*?experts\.(\d+)\.")


def planned_experts(names) -> dict[int, set[int]]:
    """layer -> expert ids this rank's plan holds a slice of (per-expert checkpoint names)."""
    out: dict[int, set[int]] = {}
    for n in names:
        m = _LAYER_EXPERT.search(n)
        if m:
            out.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return out


_MODULE_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _KeptExperts(NamedTuple):
    layer: int
    ids: set[int]         # the expert ids vLLM keeps on this rank
    total: int            # the layer's global expert count
    mapped: bool          # from an expert map (experts placed over ranks), not all local


def _kept_experts(model):
    """Each routed-experts module's kept experts, from its global -> local expert map
    (None: every expert is local, split over TP)."""
    for name, mod in model.named_modules():
        if not hasattr(mod, "_expert_map") or not hasattr(mod, "global_num_experts"):
            continue
        m = _MODULE_LAYER.search(name)
        if m is None:
            continue
        emap, n = mod._expert_map, int(mod.global_num_experts)
        ids = set(range(n)) if emap is None else \
            {e for e, slot in enumerate(emap.tolist()) if slot >= 0}
        yield _KeptExperts(int(m.group(1)), ids, n, emap is not None)


def vllm_experts(model) -> dict[int, set[int]]:
    """layer -> expert ids vLLM keeps on this rank."""
    return {k.layer: k.ids for k in _kept_experts(model)}


def check_expert_slots(planned: dict[int, set[int]], kept: dict[int, set[int]], rank: int) -> None:
    """FitError unless, for every MoE layer both know, vLLM's experts are coordloader's."""
    for layer in sorted(set(planned) & set(kept)):
        if planned[layer] != kept[layer]:
            only_v = sorted(kept[layer] - planned[layer])
            only_c = sorted(planned[layer] - kept[layer])
            raise FitError(f"layer {layer}: vLLM keeps experts the plan did not load "
                           f"{only_v[:16]} and the plan loaded experts vLLM does not keep "
                           f"{only_c[:16]} (expert placement differs)", rank=rank)


# Names vLLM's model loaders skip on purpose: rotary caches that old conversions saved,
# and, when the embedding is tied, an lm_head the checkpoint ships anyway (AutoWeightsLoader
# skip_prefixes). They are fed to load_weights like the rest, but not counted as unused.
_ROTARY_CACHES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_HEAD = "lm_head.weight"


def vllm_skips(tensors: Mapping[str, Any], tied: bool) -> set[str]:
    """The names of this rank's ``tensors`` vLLM's loaders skip on purpose. A tied model's
    lm_head counts only where it equals this rank's slice of the embedding the head is
    tied to: a different one skipped would serve the embedding as the head, unnoticed."""
    skip = {n for n in tensors if any(c in n for c in _ROTARY_CACHES)}
    if tied and _head_is_embedding(tensors):
        skip |= {n for n in tensors if n.startswith("lm_head.")}
    return skip


def _head_is_embedding(tensors: Mapping[str, Any]) -> bool:
    """Whether this rank's lm_head slice equals its slice of the one input embedding (the
    two are split alike, by vocab rows)."""
    import torch
    head = tensors.get(_HEAD)
    embeds = [n for n in tensors if n.endswith("embed_tokens.weight")]
    if head is None or len(embeds) != 1:
        return False
    emb = tensors[embeds[0]]
    # compared as bytes: torch.equal has no CPU kernel for the float8 dtypes
    return (head.shape == emb.shape and head.dtype == emb.dtype
            and torch.equal(head.contiguous().reshape(-1).view(torch.uint8),
                            emb.contiguous().reshape(-1).view(torch.uint8)))


def checkpoint_ships_head(ckpt: str) -> bool:
    """Whether the checkpoint holds an lm_head of its own, in any format coordloader reads
    (vLLM looks in *.safetensors files only, so not into coordloader's sharded save)."""
    from coordloader.checkpoint.reader import read_checkpoint
    return any(n.endswith(_HEAD) for n in read_checkpoint(ckpt).tensors)


def refuse_mtp_draft(model_config) -> None:
    """ConfigError before the model is built where vLLM loads a multi-token-prediction
    draft for speculative decoding through this format (its config's ``model_type`` ends
    in ``_mtp``): the draft is the checkpoint's layers past num_hidden_layers, which every
    plan of this format leaves out, so its load_weights would get none of them, and vLLM
    would blame the checkpoint for lacking them."""
    hf = getattr(model_config, "hf_config", None)
    mt = getattr(hf, "model_type", None)
    if isinstance(mt, str) and mt.endswith("_mtp"):
        raise ConfigError(f"load format {LOAD_FORMAT!r} does not load a multi-token-prediction "
                          f"draft (speculative decoding, model_type {mt!r}): it plans the "
                          f"main model, leaving the MTP layers out; serve without MTP "
                          f"speculative decoding, or with a separate draft model",
                          file=getattr(model_config, "model", None))


def untie_if_head_shipped(model_config, ckpt: str) -> bool:
    """vLLM's ``ModelConfig.maybe_untie_word_embeddings`` for a checkpoint vLLM cannot look
    into: a config that says the embeddings are tied, with an lm_head shipped anyway, gets
    the head built untied so that it loads (vLLM re-ties the two after the load when they
    are equal). -> whether it untied."""
    hf = getattr(model_config, "hf_config", None)
    if not getattr(hf, "tie_word_embeddings", False) or not checkpoint_ships_head(ckpt):
        return False
    hf.tie_word_embeddings = False
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    text.tie_word_embeddings = False
    if hasattr(model_config, "word_embeddings_untied_by_checkpoint"):
        model_config.word_embeddings_untied_by_checkpoint = True
    return True


def _tied(model, config) -> bool:
    """Whether vLLM ties the model's lm_head to its embedding: the model's own (resolved)
    config, else the checkpoint's config.json."""
    tie = getattr(getattr(model, "config", None), "tie_word_embeddings", None)
    if tie is None and isinstance(config, Mapping):
        tie = config.get("tie_word_embeddings")
    return tie is True


def placement_vllm_used(vr: VllmRank, model) -> VllmRank:
    """``vr`` with the expert placement vLLM really applied on this rank. vLLM falls back
    from round_robin to linear for most models (without expert groups, say) with only a
    warning; planning the strategy it was asked for would then refuse a load vLLM's own
    loader serves. The placement asked for is kept when it matches (or nothing tells)."""
    lay = vr.layout
    if lay.ep <= 1 or lay.expert_placement not in ("linear", "round_robin"):
        return vr
    kept = next((k for k in _kept_experts(model) if k.mapped), None)
    if kept is None:
        return vr
    ep_rank = lay.coords(vr.rank).ep
    other = "linear" if lay.expert_placement == "round_robin" else "round_robin"
    for placement in (lay.expert_placement, other):
        cand = replace(lay, expert_placement=placement)
        if set(cand.experts_of(ep_rank, kept.total)) == kept.ids:
            return vr._replace(layout=cand)
    return vr


class LoadReport(dict):
    """What one rank's coordloader load cost, attached to the model as
    ``model.coordloader_report`` for benches and tests."""


def check_filled(model, writes: Mapping[int, int], rank: int) -> None:
    """FitError unless the weight loaders filled every parameter of each module with an
    unquantized method (linear, embedding, fused MoE): vLLM's own check exempts those
    modules (a quantized method computes their parameters after loading), so a checkpoint
    missing a weight (``down_proj``, or ``k_proj`` of a fused ``qkv_proj``) was served as
    uninitialised memory. ``writes``: elements the loaders wrote into each storage (by data
    pointer: copied out of the checkpoint, or zeroed as a padded vocab's rows). An
    embedding counts as filled once any of it is; a KV-cache method's scales default when
    a checkpoint has none."""
    short = []
    for mname, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None or "KVCache" in type(qm).__name__:
            continue
        embedding = hasattr(module, "shard_indices")   # vLLM's VocabParallelEmbedding
        for pname, p in module.named_parameters(recurse=False):
            n = p.numel()
            got = writes.get(p.untyped_storage().data_ptr(), 0) if n else 0
            if n and (got == 0 if embedding else got < n):
                short.append((f"{mname}.{pname}" if mname else pname, got, n))
    if short:
        name, got, n = short[0]
        more = f" (and {len(short) - 1} more: {', '.join(s[0] for s in short[1:4])})" \
            if len(short) > 1 else ""
        raise FitError(f"vLLM's parameter {name} got {got} of its {n} elements from the "
                       f"checkpoint{more}: a tensor it is built from (a fused qkv_proj's k_proj, "
                       f"a layer's down_proj) is missing from the checkpoint, or from this "
                       f"rank's plan (a rule's stage, where vLLM builds the module on every "
                       f"pipeline stage), and the rest would be served as uninitialised memory",
                       rank=rank)


def load_into_vllm(model, ckpt: str, vr: VllmRank, opts: LoaderOptions, *,
                   track=None, quantized: bool = False) -> LoadReport:
    """Plan, load and verify this rank's slices, feed them to ``model.load_weights``, and
    check the fit; every rank fails together if any rank fails."""
    from coordloader.dist import collective
    from coordloader.integrations.globaltensor import global_tensor, recording_writes, unconsumed
    from coordloader.loader import load_detailed

    adopt = collective.adopted(vr.cpu_group, opts.timeout) if vr.layout.world_size > 1 \
        else contextlib.nullcontext()
    with adopt as group:
        t0 = time.perf_counter()
        res = load_detailed(ckpt, vr.layout, group=group, rank=vr.rank, engine=opts.engine,
                            verify=opts.verify, rules=opts.rules, loader_config=opts.loader_config,
                            timeout=opts.timeout, replicate_unmatched=opts.replicate_unmatched)
        t_load = time.perf_counter() - t0
        by = res.rank_plan.by_name()

        def fit():
            wrapped = {n: global_tensor(n, t, by[n], rank=vr.rank) for n, t in res.tensors.items()}
            with recording_writes() as writes:
                loaded = model.load_weights(iter(sorted(wrapped.items())))
            tied = _tied(model, res.meta.config)
            skipped = vllm_skips(res.tensors, tied)
            left = [u for u in unconsumed(wrapped) if u.name not in skipped]
            if tied and any(u.name == _HEAD for u in left):
                raise FitError("vLLM tied the lm_head to the input embedding (config.json: "
                               "tie_word_embeddings), but the checkpoint ships an lm_head.weight "
                               "that differs from the embedding on this rank; set "
                               "tie_word_embeddings to false in config.json, or pass "
                               "--hf-overrides '{\"tie_word_embeddings\": false}'",
                               tensor=_HEAD, rank=vr.rank)
            if left:
                u = left[0]
                held = res.tensors[u.name].numel()
                why = ("no loader took any of it: vLLM's model has no parameter for it (its own "
                       "loaders drop such a tensor, an unused bias or head), or it is named "
                       "otherwise than vLLM expects" if u.numel == held and held else
                       "the plan's split differs from vLLM's, or the rule holds more than the "
                       "layer needs")
                raise FitError(f"{len(left)} held tensor(s) not fully used by vLLM's weight loaders, "
                               f"first: {u.numel} elements in {list(map(list, u.boxes[:4]))} "
                               f"({why})", tensor=u.name, rank=vr.rank)
            experts = planned_experts(by)
            check_expert_slots(experts, vllm_experts(model), vr.rank)
            if not quantized:
                check_filled(model, writes, vr.rank)
            if track is not None:
                track(model, loaded)
            return experts

        experts = collective.run_phase("vllm-fit", fit, group)
        report = LoadReport(rank=vr.rank, layout=str(vr.layout), tensors=len(res.tensors),
                            bytes_read=res.stats.bytes_read, bytes_held=res.stats.bytes_held,
                            seconds_load=t_load, seconds_total=time.perf_counter() - t0,
                            engine=res.stats.engine,
                            experts={str(k): sorted(v) for k, v in sorted(experts.items())})
        return report


def _local_checkpoint(model_config) -> str:
    path = model_config.model
    if not os.path.isdir(path):
        raise ConfigError(f"load format {LOAD_FORMAT!r} reads a local checkpoint directory; "
                          f"{path!r} is not one (download it first, e.g. "
                          f"`huggingface-cli download {path} --local-dir DIR`)", file=path)
    return path


def _loader_class():
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class CoordloaderModelLoader(BaseModelLoader):
        """vLLM model loader: each rank reads only its slices (see the module docstring)."""

        def __init__(self, load_config):
            super().__init__(load_config)
            self.options = LoaderOptions.parse(load_config.model_loader_extra_config)
            self.report: LoadReport | None = None

        def download_model(self, model_config) -> None:
            _local_checkpoint(model_config)

        def load_model(self, vllm_config, model_config, *args, **kw):
            refuse_mtp_draft(model_config)
            # before the model is built: vLLM decided on tying from *.safetensors files
            untie_if_head_shipped(model_config, _local_checkpoint(model_config))
            return super().load_model(vllm_config, model_config, *args, **kw)

        def load_weights(self, model, model_config) -> None:
            ckpt = _local_checkpoint(model_config)
            quantized = model_config.quantization is not None

            def track(m, loaded):
                if loaded is not None and not quantized:
                    # vLLM's own check, unchanged: every parameter came from the checkpoint
                    DefaultModelLoader.track_weights_loading(self, m, loaded)

            vr = placement_vllm_used(vllm_rank(), model)
            self.report = load_into_vllm(model, ckpt, vr, self.options, track=track,
                                         quantized=quantized)
            model.coordloader_report = self.report

    return CoordloaderModelLoader


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``--load-format coordloader`` known."""
    from vllm.model_executor.model_loader import register_model_loader
    register_model_loader(LOAD_FORMAT)(_loader_class())
