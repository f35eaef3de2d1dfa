"""Fuzz config.json and rule files (issue 18): whatever they hold, reading and planning
either succeed or raise a typed CoordloaderError, never another exception, a hang or a
runaway allocation. The header / index reader has its own fuzz (test_checkpoint_fuzz.py).

At least 500 generated cases per input kind and run: config.json as parsed values (600)
and as bytes on disk (200), rule files as parsed values (600) and as files on disk (200)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordloader.api import make_plan
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.errors import CoordloaderError
from coordloader.layout import Layout
from coordloader.planning.strategies import STRATEGIES

from stfiles import hard_timeout

FUZZ = settings(deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
ARCHS = ("llama", "qwen3_moe", "mixtral", "deepseek_v3", "bert")

# values a config or a rule parameter could hold, hostile ones weighted in
NUMBERS = st.one_of(st.integers(-3, 70), st.sampled_from([0, -1, 2**31, 2**63, 10**12, 10**30]),
                    st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS,
                    st.text(max_size=12), st.sampled_from(["", "re:(", "re:.*", "*", "a" * 5000]))
JSON = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=4),
                                                 st.dictionaries(st.text(max_size=8), c,
                                                                 max_size=4)), max_leaves=12)
CONFIG_KEYS = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
               "head_dim", "intermediate_size", "moe_intermediate_size", "vocab_size",
               "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts",
               "first_k_dense_replace", "num_nextn_predict_layers", "tie_word_embeddings",
               "architectures", "model_type", "quantization_config", "kv_lora_rank",
               "q_lora_rank", "num_experts_per_tok", "text_config"]
LAYOUTS = st.sampled_from([dict(tp=1), dict(tp=2), dict(tp=4), dict(tp=2, ep=2),
                           dict(tp=2, pp=2), dict(tp=2, dp=2, ep=4, ep_spans_dp=True),
                           dict(tp=8), dict(pp=3)])


@pytest.fixture(scope="module")
def metas(tiny_checkpoint):
    return {a: read_checkpoint(tiny_checkpoint(a)) for a in ARCHS}


def plan_or_typed_error(build):
    """Run ``build()`` (it reads and/or plans): success or a CoordloaderError only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "rule matches no tensor" is a warning, not a failure
        try:
            with hard_timeout(20):
                build()
        except CoordloaderError:
            pass


@st.composite
def config_mutations(draw, base: dict):
    cfg = json.loads(json.dumps(base))
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)                        # not even an object
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "set", "set", "drop", "nest"]))
        key = draw(st.sampled_from(CONFIG_KEYS + sorted(cfg)))
        if op == "set":
            cfg[key] = draw(JSON)
        elif op == "drop":
            cfg.pop(key, None)
        else:                                   # the same values under text_config
            cfg["text_config"] = {key: draw(JSON)}
    return cfg


@settings(FUZZ, max_examples=600)
@given(data=st.data(), arch=st.sampled_from(ARCHS), layout=LAYOUTS)
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_fuzz_config_values(metas, data, arch, layout):
    meta = metas[arch]
    cfg = data.draw(config_mutations(dict(meta.config or {})))
    plan_or_typed_error(lambda: make_plan(dataclasses.replace(meta, config=cfg),
                                          Layout(**layout)))


@pytest.fixture(scope="module")
def ckpt_copies(tiny_checkpoint, tmp_path_factory):
    """Per arch: a directory whose shards link to the tiny checkpoint's, so each case only
    rewrites config.json."""
    out = {}
    for a in ARCHS:
        src = tiny_checkpoint(a)
        d = tmp_path_factory.mktemp(f"cfg-{a}")
        for f in os.listdir(src):
            if f != "config.json":
                os.symlink(os.path.join(src, f), d / f)
        with open(os.path.join(src, "config.json"), "rb") as f:
            out[a] = (str(d), f.read())
    return out


@settings(FUZZ, max_examples=200)
@given(arch=st.sampled_from(ARCHS), layout=LAYOUTS,
       how=st.sampled_from(["flip", "cut", "json", "deep", "dup", "nan"]),
       pos=st.integers(0, 10**6), byte=st.integers(0, 255), value=JSON)
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_fuzz_config_json_bytes(ckpt_copies, arch, layout, how, pos, byte, value):
    d, raw = ckpt_copies[arch]
    if how == "flip":
        b = bytearray(raw)
        b[pos % len(b)] = byte
        raw = bytes(b)
    elif how == "cut":
        raw = raw[:pos % len(raw)]
    elif how == "json":
        raw = json.dumps(value).encode()
    elif how == "deep":
        raw = b"[" * (1000 + pos % 200000)
    elif how == "dup":
        raw = b'{"num_hidden_layers": 2, "num_hidden_layers": 3}'
    else:
        raw = raw.replace(b"}", b', "num_hidden_layers": NaN}', 1)
    with open(os.path.join(d, "config.json"), "wb") as f:
        f.write(raw)
    plan_or_typed_error(lambda: make_plan(read_checkpoint(d), Layout(**layout)))


@st.composite
def rule_files(draw):
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    rules = []
    for _ in range(draw(st.integers(0, 5))):
        strategy = draw(st.one_of(st.sampled_from(sorted(STRATEGIES)), st.text(max_size=6)))
        allowed = sorted(STRATEGIES[strategy].params if strategy in STRATEGIES else ()) + ["bogus"]
        params = {k: draw(st.one_of(JSON, st.integers(0, 8), st.sampled_from(
                     ["first", "last", "all", "layer", r"experts\.(\d+)\."])))
                  for k in draw(st.lists(st.sampled_from(allowed), max_size=3, unique=True))}
        rule = {"pattern": draw(st.one_of(
                    st.sampled_from(["*", "model.layers.*.mlp.*", "*.weight", "lm_head.weight",
                                     "re:.*experts\\.(\\d+)\\..*", "re:(a", "re:(?P<r0>x)",
                                     "re:(.)\\1", "re:" + "(x)" * 200, ""]),
                    st.text(max_size=10), JSON)),
                "strategy": strategy, "params": params}
        if draw(st.booleans()):
            rule[draw(st.sampled_from(["regex", "comment", "extra"]))] = draw(JSON)
        rules.append(rule)
    if draw(st.booleans()):
        return rules
    doc = {"rules": rules, "preset": draw(st.one_of(st.sampled_from(
        ["auto", "llama", "qwen3_moe", "deepseek_v3", "nope"]), st.none(), JSON)),
        "mode": draw(st.sampled_from(["extend", "replace", "other"]))}
    return doc


@settings(FUZZ, max_examples=600)
@given(arch=st.sampled_from(ARCHS), layout=LAYOUTS, rules=rule_files(),
       unmatched=st.booleans())
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_fuzz_rule_values(metas, arch, layout, rules, unmatched):
    plan_or_typed_error(lambda: make_plan(metas[arch], Layout(**layout), rules,
                                          replicate_unmatched=unmatched))


@settings(FUZZ, max_examples=200)
@given(arch=st.sampled_from(ARCHS), layout=LAYOUTS, rules=rule_files(),
       how=st.sampled_from(["as_is", "cut", "deep", "nan", "dup", "binary"]),
       pos=st.integers(0, 10**6))
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_fuzz_rule_file_on_disk(metas, arch, layout, rules, how, pos):
    raw = json.dumps(rules).encode()
    if how == "cut":
        raw = raw[:pos % (len(raw) + 1)]
    elif how == "deep":
        raw = b"[" * (1000 + pos % 200000) + b"]" * (1000 + pos % 200000)
    elif how == "nan":
        raw = b'[{"pattern": "*", "strategy": "colwise", "params": {"dim": NaN}}]'
    elif how == "dup":
        raw = b'[{"pattern": "*", "pattern": "x", "strategy": "replicate"}]'
    elif how == "binary":
        raw = bytes((pos >> (i % 20)) & 0xFF for i in range(64))
    d = tempfile.mkdtemp(prefix="rulefuzz-")
    try:
        path = os.path.join(d, "rules.json")
        with open(path, "wb") as f:
            f.write(raw)
        plan_or_typed_error(lambda: make_plan(metas[arch], Layout(**layout), path))
    finally:
        shutil.rmtree(d, ignore_errors=True)
