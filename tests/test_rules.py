import collections
import json
import re

import pytest
from hypothesis import strategies as st

from coordloader.api import make_plan, read_rules
from coordloader.errors import PlanError
from coordloader.layout import Layout
from coordloader.planning.planner import meta_from_specs
from coordloader.planning.rules import RuleSet, detect_preset, make_rule, resolve_rules

CFG = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
       "num_hidden_layers": 1, "tie_word_embeddings": True}
SPECS = [("model.embed_tokens.weight", "BF16", (100, 8)), ("model.norm.weight", "F32", (8,)),
         ("model.layers.0.self_attn.q_proj.weight", "BF16", (8, 8)),
         ("model.layers.0.self_attn.k_proj.weight", "BF16", (4, 8)),
         ("model.layers.0.self_attn.v_proj.weight", "BF16", (4, 8)),
         ("model.layers.0.self_attn.o_proj.weight", "BF16", (8, 8)),
         ("model.layers.0.mlp.gate_up_proj.weight", "BF16", (12, 8)),
         ("model.layers.0.mlp.down_proj.weight", "BF16", (8, 6)),
         ("model.layers.0.mlp.experts.gate_up_proj", "BF16", (4, 6, 8)),
         ("model.layers.0.extra.weight", "F32", (3, 3))]


def test_detection():
    assert detect_preset({"architectures": ["DeepseekV3ForCausalLM"]}) == "deepseek_v3"
    assert detect_preset({"model_type": "mixtral"}) == "mixtral"
    assert detect_preset({"architectures": ["BertModel"]}) == "bert"
    assert detect_preset({"architectures": ["Foo"]}) is None and detect_preset(None) is None


def test_unmatched_is_error_or_replicated():
    meta = meta_from_specs(CFG, SPECS)
    with pytest.raises(PlanError, match="no sharding rule") as ei:
        make_plan(meta, Layout(tp=2))
    assert ei.value.tensor in ("model.layers.0.extra.weight", "model.layers.0.mlp.experts.gate_up_proj",
                               "model.layers.0.mlp.gate_up_proj.weight")
    # Followed blindly at tp=2, the replicate hint gives every rank every weight.
    assert "held whole on every rank" in str(ei.value)


def test_rule_file_extends_preset(tmp_path):
    meta = meta_from_specs(CFG, SPECS)
    f = tmp_path / "rules.json"
    f.write_text(json.dumps({"rules": [
        {"pattern": "*.mlp.gate_up_proj.weight", "strategy": "packed", "params": {"num_blocks": 2}},
        {"pattern": "re:.*\\.experts\\.gate_up_proj", "strategy": "expert", "params": {"dim": 0}},
        {"pattern": "*.never.*", "strategy": "replicate"},
    ]}))
    with pytest.warns(UserWarning, match="never"):
        plan = make_plan(meta, Layout(tp=2, ep=2), str(f), replicate_unmatched=True)
    r1 = plan.rank(1).by_name()
    gu = r1["model.layers.0.mlp.gate_up_proj.weight"]
    # packed [gate; up] of 6 rows each: rank 1 holds gate rows 3..6 and up rows 9..12
    assert gu.local_shape == (6, 8)
    assert [(p.src[0], p.dst) for p in gu.pieces] == [((3, 6), (0, 0)), ((9, 12), (3, 0))]
    fused = r1["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused.local_shape == (2, 6, 8) and [p.src[0] for p in fused.pieces] == [(2, 3), (3, 4)]
    assert r1["model.layers.0.extra.weight"].strategy == "replicate"
    assert r1["model.embed_tokens.weight"].local_shape == (64, 8)    # 100 -> 128 rows / 2


def test_tied_embeddings_on_first_and_last_stage():
    cfg = dict(CFG, num_hidden_layers=2)
    specs = SPECS[:2] + [(n.replace("layers.0", f"layers.{l}"), d, s) for l in (0, 1)
                         for n, d, s in SPECS[2:6]]
    plan = make_plan(meta_from_specs(cfg, specs), Layout(pp=2, tp=2))
    e0, e1 = (plan.rank(r).by_name()["model.embed_tokens.weight"] for r in (0, 2))
    assert e0.pieces == e1.pieces and (e0.replica, e1.replica) == (0, 1)
    assert "model.norm.weight" in plan.rank(2).by_name() and "model.norm.weight" not in plan.rank(0).by_name()


def test_override_and_bad_rules(tmp_path):
    meta = meta_from_specs(CFG, SPECS[:6])
    plan = make_plan(meta, Layout(tp=2), [{"pattern": "*.o_proj.weight", "strategy": "replicate"}])
    assert plan.rank(1).by_name()["model.layers.0.self_attn.o_proj.weight"].local_shape == (8, 8)
    for bad in ([{"pattern": "x", "strategy": "nope"}], [{"pattern": "x", "strategy": "colwise",
                                                          "params": {"dims": 1}}],
                [{"pattern": "re:(", "strategy": "replicate"}], [{"strategy": "replicate"}],
                {"mode": "bogus"}):
        with pytest.raises(PlanError):
            resolve_rules(CFG, bad)
    f = tmp_path / "bad.json"
    f.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        resolve_rules(CFG, read_rules(str(f)))
    with pytest.raises(PlanError, match="unknown preset 'no/such/rules.json'"):
        resolve_rules(CFG, "no/such/rules.json")   # the planner never opens a path itself
    rs = resolve_rules(CFG, {"mode": "replace", "rules": [{"pattern": "*", "strategy": "replicate"}]})
    assert rs.preset is None and len(rs) == 1


def test_heads_errors_name_tensor_and_layout():
    meta = meta_from_specs(CFG, SPECS[:6])
    with pytest.raises(PlanError) as ei:
        make_plan(meta, Layout(tp=3))
    assert "tp=3" in str(ei.value) and ei.value.tensor
    with pytest.raises(PlanError, match="exceeds"):
        make_plan(meta, Layout(tp=8))      # 4 query heads over 8 ranks


def test_split_errors_name_tensor_and_layout_once():
    """A colwise rule whose dim is out of range, or whose split does not divide, names the
    tensor and the layout exactly once (the split error used to be wrapped twice)."""
    cfg = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 2, "hidden_size": 4}
    meta = meta_from_specs(cfg, [("w", "BF16", (5, 4))])
    for params, what in (({"dim": 3}, "split dim 3 out of range for shape [5, 4]"),
                         ({}, "size 5 is not divisible by 2")):
        with pytest.raises(PlanError) as ei:
            make_plan(meta, Layout(tp=2),
                      rules={"rules": [{"pattern": "w", "strategy": "colwise", "params": params}]})
        msg = str(ei.value)
        assert msg.startswith("tensor 'w': ") and what in msg, msg
        assert msg.count("(layout tp=2 pp=1 dp=1 ep=1)") == 1, msg


@pytest.mark.parametrize("strategy, params, msg", [
    ("heads", {"num_heads": 2, "kv": "false"}, "param 'kv' must be true or false, got 'false'"),
    ("heads", {"num_heads": 2, "kv": 1}, "param 'kv' must be true or false, got 1"),
    ("packed", {"num_blocks": 2, "heads": [2, 2], "kv": ["false", True]},
     "param 'kv' must list one boolean (true or false) per block (2), got ['false', True]"),
    ("colwise", {"shared_expert": "yes"}, "param 'shared_expert' must be true or false"),
])
def test_boolean_params_are_booleans(strategy, params, msg):
    """A rule file's "kv": "false" was read as bool("false"), True: K/V heads replicated
    at a tp above the heads, where the rule said to refuse."""
    with pytest.raises(PlanError, match=re.escape(msg)):
        make_rule("x", strategy, params)


def test_named_expert_packing_declared_or_refused():
    """Packing params apply to per-expert tensors too (experts.N.gate_up_proj.weight
    [2I, H]): halves and interleaved pairs give different rows, and an undeclared split
    of a gate_up tensor is refused rather than handing a rank gate rows only."""
    cfg = {"num_experts": 2, "num_hidden_layers": 1}
    meta = meta_from_specs(cfg, [(f"model.layers.0.mlp.experts.{e}.gate_up_proj.weight", "BF16",
                                  (8, 4)) for e in range(2)])
    name = "model.layers.0.mlp.experts.0.gate_up_proj.weight"

    def rows(params, rank=1):
        rule = {"pattern": "*.gate_up_proj.weight", "strategy": "expert", "params": params}
        ts = make_plan(meta, Layout(tp=2), {"preset": None, "rules": [rule]}).rank(rank).by_name()[name]
        return [(p.src[0], p.dst[0]) for p in ts.pieces]
    with pytest.raises(PlanError, match="interleaved=2"):
        rows({"dim": 0})
    assert rows({"dim": 0, "num_blocks": 2}) == [((2, 4), 0), ((6, 8), 2)]
    assert rows({"dim": 0, "interleaved": 2}) == [((4, 8), 0)]
    assert rows({"dim": 0, "interleaved": 2, "split_unit": 2}) == [((4, 8), 0)]
    with pytest.raises(PlanError, match="whole split units of 6 rows"):
        rows({"dim": 0, "interleaved": 2, "split_unit": 3})
    with pytest.raises(PlanError, match="not divisible by 2"):    # one unit of 8 rows
        rows({"dim": 0, "interleaved": 2, "split_unit": 4})


def test_every_strategy_declares_its_placement():
    # a strategy the rule checker accepts but the planner cannot place would fail only
    # when a tensor first matched it; only a block scale is placed by following its weight
    from coordloader.planning.strategies import STRATEGIES
    assert {n for n, s in STRATEGIES.items() if s.place is None} == {"scale"}
    assert all(s.name == n for n, s in STRATEGIES.items())


def test_a_strategy_is_added_in_one_place(monkeypatch):
    # one Strategy entry is all the rule checker and the planner need
    from coordloader.planning.strategies import STRATEGIES, Strategy

    def check(p, where):
        p.setdefault("dim", 0)

    monkeypatch.setitem(STRATEGIES, "halves", Strategy(
        "halves", frozenset({"dim"}), check,
        lambda ctx, t, p: STRATEGIES["colwise"].place(ctx, t, p)))
    meta = meta_from_specs(None, [("w", "F32", (4, 2))])
    plan = make_plan(meta, Layout(tp=2), rules=[{"pattern": "w", "strategy": "halves"}])
    assert [rp.tensors[0].local_shape for rp in plan.ranks] == [(2, 2), (2, 2)]
    assert plan.ranks[0].tensors[0].strategy == "halves"
    with pytest.raises(PlanError, match="does not take params"):
        make_plan(meta, Layout(tp=2),
                  rules=[{"pattern": "w", "strategy": "halves", "params": {"kv": 1}}])


def test_a_conditional_regex_matches_as_it_does_alone():
    # (?(1)...) tests group 1 by number; inside the combined alternation group 1 was the
    # first rule's wrapper, so the name fell through to the catch-all rule
    cond = make_rule(r"re:(model\.)?(?(1)layers|x)\.w", "colwise", source="user")
    rs = RuleSet([cond, make_rule("*", "replicate", source="user")], user_count=2)
    assert [rs.match(n) for n in ("model.layers.w", "x.w", "model.x.w")] == [0, 0, 1]


@pytest.mark.parametrize("rx, msg", [
    ("(", "rules: rule #0 ('*.experts.*'): param 'id_regex' is a bad regular expression: "
          "missing ), unterminated subpattern at position 0"),
    (r"experts\.\d+\.", "rules: rule #0 ('*.experts.*'): param 'id_regex' must capture the "
                        r"expert id in group 1, got 'experts\\.\\d+\\.' without a group"),
])
def test_a_bad_expert_id_regex_is_refused_with_its_rule(rx, msg):
    """Was re.error / IndexError from the planner, naming no rule."""
    with pytest.raises(PlanError) as e:
        resolve_rules(None, {"preset": None, "rules": [
            {"pattern": "*.experts.*", "strategy": "expert", "params": {"id_regex": rx}}]})
    assert str(e.value) == msg


def test_an_expert_id_regex_capturing_no_digits_names_the_tensor():
    """int() of the captured 'a' was a bare ValueError."""
    meta = meta_from_specs({"num_hidden_layers": 1}, [("layers.0.experts.a.w", "BF16", (4, 4))])
    rules = {"preset": None, "rules": [{"pattern": "*.experts.*", "strategy": "expert",
                                        "params": {"id_regex": r"experts\.(\w+)\."}}]}
    with pytest.raises(PlanError) as e:
        make_plan(meta, Layout(tp=2, ep=2), rules)
    assert e.value.tensor == "layers.0.experts.a.w"
    assert "its group 1 is 'a', not an expert id (decimal digits)" in str(e.value)


def test_a_rowwise_dim_past_a_matrixs_rank_is_refused_not_replicated():
    """dim=2 on a 2-D weight held it whole on every rank, as if it were a bias: a typo
    in the rule became another layout. The 1-D bias of the same rule stays replicated."""
    specs = [s for s in SPECS if "proj" in s[0] and "gate_up" not in s[0]] + [
        ("model.layers.0.self_attn.o_proj.bias", "BF16", (8,))]
    meta = meta_from_specs(CFG, specs)
    rules = {"rules": [{"pattern": "*.o_proj.*", "strategy": "rowwise", "params": {"dim": 2}}]}
    with pytest.raises(PlanError) as e:
        make_plan(meta, Layout(tp=2), rules)
    assert e.value.tensor == "model.layers.0.self_attn.o_proj.weight"
    assert "rowwise split dim 2 out of range for shape [8, 8] (only a 1-D bias is held whole)" \
        in str(e.value)
    rules["rules"][0]["params"]["dim"] = 1
    held = make_plan(meta, Layout(tp=2), rules).ranks[1].by_name()
    assert held["model.layers.0.self_attn.o_proj.weight"].local_shape == (8, 4)
    assert held["model.layers.0.self_attn.o_proj.bias"].local_shape == (8,)



@pytest.mark.parametrize("lay", [Layout(tp=2), Layout(tp=2, ep=2), Layout(tp=1)],
                         ids=["moe_tp2", "ep2", "one"])
@pytest.mark.parametrize("name,shape,msg", [
    ("model.layers.0.mlp.experts.down_proj", (4, 8, 4), "for fused shape [4, 8, 4]"),
    ("model.layers.0.mlp.experts.3.down_proj.weight", (8, 4), "for shape [8, 4]")])
def test_an_expert_split_dim_past_the_shape_is_refused_at_every_layout(lay, name, shape, msg):
    """The dim was checked only where moe_tp > 1; elsewhere a bare IndexError (fused) or a
    rule passing at one layout and refused at another (per expert)."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 2,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "num_experts": 4,
           "tie_word_embeddings": True}
    meta = meta_from_specs(cfg, [(name, "BF16", shape)])
    rules = {"rules": [{"pattern": "*.experts.*", "strategy": "expert", "params": {"dim": 2}}]}
    with pytest.raises(PlanError) as e:
        make_plan(meta, lay, rules)
    assert e.value.tensor == name
    assert f"expert split dim 2 out of range {msg}" in str(e.value)


@pytest.mark.parametrize("lay", [Layout(tp=4), Layout()], ids=["tp4", "tp1"])
@pytest.mark.parametrize("cfg_kv", [4, 2, 1])
def test_a_config_of_other_head_counts_than_the_tensors_is_refused(lay, cfg_kv):
    """A config.json of another model (num_key_value_heads 4 where k_proj holds 2 heads of
    8 rows) had tp=4 cut k_proj into four half-heads, silently (with 1, every rank held
    both heads as its one); transformers refuses the size. Refused wherever tp > 1."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
           "num_attention_heads": 4, "num_key_value_heads": cfg_kv, "num_hidden_layers": 1,
           "tie_word_embeddings": True}
    k = "model.layers.0.self_attn.k_proj.weight"
    specs = [("model.embed_tokens.weight", "BF16", (64, 32)),
             ("model.layers.0.self_attn.q_proj.weight", "BF16", (32, 32)),
             (k, "BF16", (16, 32)), ("model.layers.0.self_attn.v_proj.weight", "BF16", (16, 32)),
             ("model.layers.0.self_attn.o_proj.weight", "BF16", (32, 32))]
    meta = meta_from_specs(cfg, specs)
    if cfg_kv == 2 or lay.tp == 1:   # held whole at tp=1: no head is cut
        got = make_plan(meta, lay).rank(1 % lay.world_size).by_name()[k]
        assert got.pieces[0].src[0] == (0, 8 if lay.tp == 4 else 16)   # whole heads of 8 rows
        return
    with pytest.raises(PlanError) as e:
        make_plan(meta, lay)
    assert e.value.tensor == k
    # one K/V head of config.json's, replicated at tp=4: k_proj held whole (2 heads) where
    # vLLM holds 8 rows
    assert str(e.value) == (f"tensor {k!r}: heads split of dim 0: size 16 is not "
                            f"num_heads={cfg_kv} times head_dim=8 ({cfg_kv * 8}); expected the "
                            f"config.json of this checkpoint (layout {lay})")


@pytest.mark.parametrize("case", ["qwen3-default-head-dim", "vision-tower"])
def test_the_heads_size_check_leaves_sizes_config_json_does_not_fix_alone(case):
    """A qwen3 config.json without head_dim (transformers' default 128, not hidden_size /
    heads) and a vision tower under a flat config: their heads are not config.json's
    text heads times hidden_size / heads, and were refused once they were compared."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
           "tie_word_embeddings": True}
    pre = "model.layers.0.self_attn."
    rows = {"q": 64, "k": 32, "v": 32}
    if case == "qwen3-default-head-dim":
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        rows = {"q": 512, "k": 256, "v": 256}
    else:
        pre = "vision_model.encoder.layers.0.self_attn."
        rows = {"q": 48, "k": 48, "v": 48}
    specs = [("model.embed_tokens.weight", "BF16", (64, 64))] + [
        (f"{pre}{x}_proj.weight", "BF16", (r, 64)) for x, r in rows.items()] + [
        (f"{pre}o_proj.weight", "BF16", (64, rows["q"]))]
    meta = meta_from_specs(cfg, specs)
    rules = None if case != "vision-tower" else "llama"
    k = make_plan(meta, Layout(tp=2), rules).rank(1).by_name()[f"{pre}k_proj.weight"]
    assert k.pieces[0].src[0] == (rows["k"] // 2, rows["k"])

def test_stage_layer_on_a_name_without_a_layer_is_refused():
    """stage 'layer' on a tensor outside the layers sent it to the last stage unasked."""
    specs = [s for s in SPECS if "proj" in s[0] and "gate_up" not in s[0]] + [
        ("model.final.weight", "F32", (8,))]
    meta = meta_from_specs(CFG, specs)
    rules = {"rules": [{"pattern": "model.final.weight", "strategy": "replicate",
                        "params": {"stage": "layer"}}]}
    with pytest.raises(PlanError) as e:
        make_plan(meta, Layout(pp=1), rules)
    assert e.value.tensor == "model.final.weight"
    assert "rule says stage 'layer' but the tensor's name holds no layer index" in str(e.value)
    rules["rules"][0]["params"]["stage"] = "last"
    assert "model.final.weight" in make_plan(meta, Layout(pp=1), rules).ranks[0].by_name()



@pytest.mark.parametrize("stage", [None, "layer", "first", "last", "all"])
def test_an_mtp_layer_stays_out_whatever_stage_a_rule_gives_it(stage):
    """A stage given by a rule brought an MTP layer back into the plan without include_mtp."""
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors("deepseek_v3", "tiny")
    meta = meta_from_specs(cfg, specs)
    n = f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight"
    assert n in meta.tensors
    params = {} if stage is None else {"stage": stage}
    rules = {"rules": [{"pattern": "*.eh_proj.weight", "strategy": "replicate", "params": params}]}
    plan = make_plan(meta, Layout(tp=2, pp=2), rules)
    assert n in plan.excluded
    assert not any(n in rp.by_name() for rp in plan.ranks)
    # with include_mtp the rule's stage is followed ('layer' and none: the last stage)
    plan = make_plan(meta, Layout(tp=2, pp=2, include_mtp=True), rules)
    held = sorted({plan.layout.coords(r).pp for r in range(plan.world_size)
                   if n in plan.rank(r).by_name()})
    assert held == {"first": [0], "all": [0, 1]}.get(stage, [1])

# ---- digit templates: match_all matches each distinct name-with-digits-as-0 once

_ATOMS = [r"a", r"\.", r"1", r"0", r"[0-9]", r"[1-5]", r"\d", r"\D", r"\w", r".", r"[^.]",
          r"[^5]", r"[a\d]", r"(?:a|1)", r"(?:\.|b)"]
_SUFFIX = ["", "*", "+", "?", "{2}", "{1,3}"]


@st.composite
def _regex_and_names(draw):
    parts = draw(st.lists(st.tuples(st.sampled_from(_ATOMS), st.sampled_from(_SUFFIX)),
                          min_size=1, max_size=6))
    rx = "".join(a + q for a, q in parts)
    alts = draw(st.lists(st.just(rx) | st.sampled_from([r".*\.1", r"a\d+", r"b.*"]),
                         min_size=1, max_size=3))
    names = draw(st.lists(st.text("a.b0123456789", max_size=8), min_size=1, max_size=12))
    names += draw(st.lists(st.from_regex(alts[0], fullmatch=True), max_size=4))
    return alts, names


@pytest.mark.slow
def test_match_all_equals_match_on_every_name():
    """Sound shortcut: for rule sets ``_digit_blind`` accepts, the template match picks the
    same rule as matching each name; for the others match_all matches each name."""
    from hypothesis import HealthCheck, given, settings

    from coordloader.planning.rules.ruleset import _digit_blind
    reached = collections.Counter()

    @settings(deadline=None, max_examples=400, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(_regex_and_names())
    def check(case):
        alts, names = case
        rs = RuleSet([make_rule("re:" + a, "replicate", source="user") for a in alts],
                     user_count=len(alts))
        blind = all(_digit_blind(r.regex_text) for r in rs.rules)
        want = [rs.match(n) for n in names]
        assert rs.match_all(names) == want, (alts, names)
        hits = sum(i is not None for i in want)
        reached["blind, some matched" if blind and hits else "blind" if blind else "not blind"] += 1
    check()
    assert reached["blind, some matched"] >= 80, reached
    assert reached["not blind"] >= 40, reached


def test_digit_blind_accepts_what_ignores_digits_only():
    from coordloader.planning.rules.ruleset import _digit_blind
    assert _digit_blind(make_rule("model.layers.*.mlp.experts.*.weight", "replicate").regex_text)
    for rx in (r"a[^.]+b", r"\d+", r"x[0-9]", r"[a-z\d]", r"\D", r"\w\s"):
        assert _digit_blind(rx), rx
    for rx in (r"layers\.3\.", r"[1-5]", r"[^5]", r"(a)\1", r"(?:a|b1)", r"[0-8]"):
        assert not _digit_blind(rx), rx


def test_config_naming_more_experts_than_the_names_hold_is_refused():
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors("qwen3_moe", "tiny")   # experts 0..15: ids of one and two digits
    with pytest.raises(PlanError, match=r"names hold expert ids 0\.\.15 only"):
        make_plan(meta_from_specs(dict(cfg, num_experts=17), specs), Layout(tp=2, ep=2))
    make_plan(meta_from_specs(dict(cfg, num_experts=16), specs), Layout(tp=2, ep=2))


def test_expert_ids_of_a_left_out_mtp_layer_count():
    # the names hold expert 8 only in the MTP layer, which the plan leaves out: it is still
    # an expert id of the checkpoint, as it always was
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors("deepseek_v3", "tiny")   # routed experts 0..7; layer 2 is MTP
    nl = cfg["num_hidden_layers"]
    extra = [(n.replace(".experts.7.", ".experts.8."), dt, sh) for n, dt, sh in specs
             if n.startswith(f"model.layers.{nl}.mlp.experts.7.")]
    assert extra
    meta = meta_from_specs(dict(cfg, n_routed_experts=9), specs + extra)
    plan = make_plan(meta, Layout(tp=1))
    assert extra[0][0] in plan.excluded
    with pytest.raises(PlanError, match=r"names hold expert ids 0\.\.8 only"):
        make_plan(meta_from_specs(dict(cfg, n_routed_experts=10), specs + extra), Layout(tp=1))


def test_a_digit_template_reads_every_ascii_digit_as_0_and_nothing_else():
    # one name's template is a bytes translation of its UTF-8 form; a list's, one string
    # translation: both read the ten ASCII digits as 0 and leave every other character,
    # non-ASCII digits and lone surrogates included
    from hypothesis import given, settings

    from coordloader.planning.rules.ruleset import digit_template, digit_templates
    table = {ord(c): "0" for c in "123456789"}

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.text(st.characters(blacklist_characters="\n"), max_size=12) |
                    st.sampled_from(["layers.17.mlp", "ñ٣.9", "a\ud800b1", "x9y"]), max_size=6))
    def check(names):
        want = [n.translate(table) for n in names]
        assert list(map(digit_template, names)) == want == digit_templates(names)

    check()


# ---- rule values a parser would have refused

def _llama(layers: int = 12):
    cfg = dict(CFG, num_hidden_layers=layers)
    specs = [("model.embed_tokens.weight", "BF16", (100, 8)), ("model.norm.weight", "F32", (8,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "self_attn.q_proj.weight", "BF16", (8, 8)),
                  (p + "self_attn.k_proj.weight", "BF16", (4, 8)),
                  (p + "self_attn.v_proj.weight", "BF16", (4, 8)),
                  (p + "self_attn.o_proj.weight", "BF16", (8, 8)),
                  (p + "mlp.down_proj.weight", "BF16", (8, 16)),
                  (p + "input_layernorm.weight", "F32", (8,))]
    return meta_from_specs(cfg, specs)


@pytest.mark.parametrize("regex", ["false", "no", 0, 1, [], {}])
def test_a_regex_flag_that_is_not_a_bool_is_refused(regex):
    """"regex": "false" read as true made the glob 1* a regular expression: layer 10's
    down_proj (which the glob names) was split, not replicated, without a word."""
    rule = {"pattern": "model.layers.1*.mlp.down_proj.weight", "strategy": "replicate",
            "regex": regex}
    with pytest.raises(PlanError, match=r"rules: rule #0 .*'regex' must be true or false"):
        make_plan(_llama(), Layout(tp=2), [rule])
    with pytest.raises(PlanError, match="starts with 're:'.*'regex' is false"):
        make_plan(_llama(), Layout(tp=2), [dict(rule, pattern="re:.*down_proj.weight",
                                                regex=False)])
    plan = make_plan(_llama(), Layout(tp=2), [dict(rule, regex=False)])
    assert plan.rank(1).by_name()["model.layers.10.mlp.down_proj.weight"].local_shape == (8, 16)


@pytest.mark.parametrize("params", [False, 0, "", [], "dim=1"])
def test_params_that_are_not_an_object_are_refused(params):
    rule = {"pattern": "*.o_proj.weight", "strategy": "colwise", "params": params}
    with pytest.raises(PlanError, match="params must be an object"):
        make_plan(_llama(), Layout(tp=2), [rule])


@pytest.mark.parametrize("strategy", [["colwise"], {"colwise": 1}, 3, None])
def test_a_strategy_that_is_not_a_string_is_refused_naming_the_rule(strategy):
    with pytest.raises(PlanError, match=r"rules: rule #0 .*strategy must be a string"):
        make_plan(_llama(), Layout(tp=2), [{"pattern": "*.o_proj.weight", "strategy": strategy}])


def test_rule_objects_are_checked_as_rules_of_a_file_are():
    """A Rule object skipped every check: a param typo (dims) split dim 0 where the same
    rule as a dict is refused, a missing kv raised a bare KeyError, an unknown strategy
    too, and a re: pattern was matched as a glob."""
    from coordloader.planning.rules import Rule
    meta = _llama()
    with pytest.raises(PlanError, match=r"rules: rule #0 .*does not take params \['dims'\]"):
        make_plan(meta, Layout(tp=2), [Rule("*.o_proj.weight", "colwise", (("dims", 1),))])
    with pytest.raises(PlanError, match="unknown strategy 'Colwise'"):
        make_plan(meta, Layout(tp=2), [Rule("*.o_proj.weight", "Colwise")])
    with pytest.raises(PlanError, match=r"RuleSet: rule #0 .*does not take params"):
        make_plan(meta, Layout(tp=2), RuleSet([Rule("*.o_proj.weight", "colwise",
                                                    (("dims", 1),))]))
    plan = make_plan(meta, Layout(tp=2), [Rule(r"re:.*\.o_proj\.weight", "replicate")])
    assert plan.rank(1).by_name()["model.layers.3.self_attn.o_proj.weight"].local_shape == (8, 8)
    with pytest.warns(UserWarning, match=r"from rules\) matches no tensor"):
        make_plan(meta, Layout(tp=2), [Rule("nothing.*", "replicate")])


def test_a_preset_typo_in_a_rule_file_names_the_file(tmp_path):
    f = tmp_path / "rules.json"
    f.write_text(json.dumps({"preset": "qwen3-moe", "rules": []}))
    with pytest.raises(PlanError, match=rf"{re.escape(str(f))}: unknown preset 'qwen3-moe' "
                                        rf".*did you mean 'qwen3_moe'\?"):
        read_rules(str(f))


def test_a_layer_tensor_stays_with_its_layer_whatever_stage_a_rule_gives():
    """A `*norm*` rule with stage last, meant for model.norm, took every layer's norms to
    the last stage: the first stage ran layers 0-5 without them, and loaded."""
    rules = [{"pattern": "*norm*", "strategy": "replicate", "params": {"stage": "last"}}]
    plan = make_plan(_llama(), Layout(pp=2), rules)
    first, last = plan.rank(0).by_name(), plan.rank(1).by_name()
    assert "model.layers.0.input_layernorm.weight" in first
    assert "model.layers.0.input_layernorm.weight" not in last
    assert "model.layers.11.input_layernorm.weight" in last
    assert "model.norm.weight" in last and "model.norm.weight" not in first
    # a vision tower's blocks are no decoder layers: a rule's stage keeps the tower whole
    specs = [("model.embed_tokens.weight", "BF16", (64, 16))] + [
        (f"model.layers.{i}.mlp.down_proj.weight", "BF16", (16, 16)) for i in range(4)] + [
        (f"model.visual.blocks.{b}.mlp.fc1.weight", "BF16", (8, 8)) for b in range(4)]
    meta = meta_from_specs({"num_hidden_layers": 4}, specs)
    plan = make_plan(meta, Layout(pp=2), {"mode": "replace", "rules": [
        {"pattern": "model.visual.*", "strategy": "replicate", "params": {"stage": "first"}},
        {"pattern": "*", "strategy": "replicate"}]})
    assert [sum(".visual." in t.name for t in rp.tensors) for rp in plan.ranks] == [4, 0]


def test_a_vision_tower_is_no_decoder_layers():
    """A tower's blocks were read as decoder layers: a tower deeper than the text model
    was refused (its blocks counted against num_hidden_layers), and at pp=2 block b went
    to the stage of decoder layer b, each stage holding part of the tower. vLLM builds the
    tower on every stage (only the first runs it) and must fill each copy: every stage
    holds it whole, with the projector into the text model (InternVL's mlp1, DeepSeek-VL2's
    projector.layers.N, Idefics3's connector, MiniCPM-V's resampler: the review found them
    on the last stage, or read as decoder layer 0). A decoder layer's own vision weights
    (CogVLM's vision experts) stay with their layer."""
    specs = [("model.embed_tokens.weight", "BF16", (64, 16))] + [
        (f"model.layers.{i}.mlp.{kind}.down_proj.weight", "BF16", (16, 16)) for i in range(2)
        for kind in ("language_mlp", "vision_mlp")] + [
        (f"model.visual.blocks.{b}.mlp.fc1.weight", "BF16", (8, 8)) for b in range(6)] + [
        ("model.visual.merger.mlp.0.weight", "BF16", (8, 8)), ("model.norm.weight", "BF16", (16,)),
        ("mlp1.0.weight", "BF16", (8, 8)), ("projector.layers.0.weight", "BF16", (8, 8)),
        ("model.connector.proj.weight", "BF16", (8, 8)), ("resampler.proj", "BF16", (8, 8))]
    meta = meta_from_specs({"num_hidden_layers": 2}, specs)
    plan = make_plan(meta, Layout(pp=2), {"mode": "replace", "rules": [
        {"pattern": "*", "strategy": "replicate"}]})
    held = [sorted(t.name for t in rp.tensors) for rp in plan.ranks]
    tower = [f"model.visual.blocks.{b}.mlp.fc1.weight" for b in range(6)] + [
        "model.visual.merger.mlp.0.weight", "mlp1.0.weight", "projector.layers.0.weight",
        "model.connector.proj.weight", "resampler.proj"]
    assert held == [sorted(["model.embed_tokens.weight",
                            "model.layers.0.mlp.language_mlp.down_proj.weight",
                            "model.layers.0.mlp.vision_mlp.down_proj.weight"] + tower),
                    sorted(["model.embed_tokens.weight",
                            "model.layers.1.mlp.language_mlp.down_proj.weight",
                            "model.layers.1.mlp.vision_mlp.down_proj.weight",
                            "model.norm.weight"] + tower)]
    with pytest.raises(PlanError) as e:
        make_plan(meta, Layout(pp=2), {"mode": "replace", "rules": [
            {"pattern": "model.visual.*", "strategy": "replicate", "params": {"stage": "layer"}},
            {"pattern": "*", "strategy": "replicate"}]})
    assert e.value.tensor == "model.visual.blocks.0.mlp.fc1.weight"
    assert ("rule says stage 'layer' but the tensor is a vision or audio tower's, whose "
            "blocks are no decoder layers; give it 'first', 'last' or 'all'") in str(e.value)


def test_a_dense_gate_up_given_plain_colwise_is_refused():
    """Plain colwise on a fused gate_up gave rank 0 all gate rows and rank 1 all up rows;
    the same mistake on an expert tensor was refused already."""
    specs = [("model.layers.0.mlp.gate_up_proj.weight", "BF16", (32, 8))]
    meta = meta_from_specs(dict(CFG), specs)
    rule = {"pattern": "*.gate_up_proj.weight", "strategy": "colwise"}
    for tp in (1, 2):   # refused at every layout
        with pytest.raises(PlanError, match="fused tensor packs gate and up.*'packed'") as e:
            make_plan(meta, Layout(tp=tp), {"mode": "replace", "rules": [rule]})
        assert e.value.tensor == "model.layers.0.mlp.gate_up_proj.weight"


def test_the_expert_count_is_read_with_the_rules_own_id_regex():
    """Without a count in config.json, the count from the names used the default pattern
    only: names expert_N with the rule's id_regex made 0 experts ("ep=1 exceeds the
    expert count 0") even at ep=1."""
    specs = [(f"model.layers.0.moe.expert_{e}.w.weight", "BF16", (8, 8)) for e in range(4)]
    meta = meta_from_specs({"num_hidden_layers": 1}, specs)
    rules = {"mode": "replace", "rules": [{"pattern": "*.expert_*", "strategy": "expert",
                                           "params": {"id_regex": r"expert_(\d+)\."}}]}
    plan = make_plan(meta, Layout(tp=2, ep=2), rules)
    assert sorted(plan.rank(1).by_name()) == [f"model.layers.0.moe.expert_{e}.w.weight"
                                              for e in (2, 3)]


def test_a_rule_shadowed_by_an_earlier_one_is_warned_as_such():
    rules = [{"pattern": "*.self_attn.*", "strategy": "replicate"},
             {"pattern": "*.self_attn.q_proj.weight", "strategy": "colwise"}]
    with pytest.warns(UserWarning) as w:
        make_plan(_llama(), Layout(tp=2), rules)
    msg = " ".join(str(x.message) for x in w)
    assert ("'*.self_attn.q_proj.weight' (colwise, from rules) takes no tensor: an earlier "
            "rule, '*.self_attn.*' (replicate), matches the tensors it matches (e.g. "
            "model.layers.0.self_attn.q_proj.weight) first") in msg


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3", "mixtral"])
def test_kv_cache_scales_are_held_whole_on_every_rank(arch):
    """An FP8 kv cache's k_scale/v_scale (0-d or [1]) matched no preset rule: the plan
    refused the checkpoint, where docs/reliability.md says vLLM's loaders get its value."""
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors(arch, "tiny")
    scales = {"model.layers.0.self_attn.k_proj.k_scale": (), "model.layers.0.self_attn.attn.v_scale": (1,)}
    meta = meta_from_specs(cfg, list(specs) + [(n, "F32", s) for n, s in scales.items()])
    plan = make_plan(meta, Layout(tp=2, ep=2) if arch != "llama" else Layout(tp=2))
    for rp in plan.ranks:
        for n, s in scales.items():
            assert rp.by_name()[n].local_shape == s and rp.by_name()[n].global_shape == s
