"""Layer families: the planner places the same tensor of different layers once, and the plan
is what placing every tensor on its own gives, slice for slice, where a rule singles out
one layer, a block scale follows such a weight, or an expert id pattern reads the layer."""
import dataclasses
import warnings

import pytest

from coordloader.api import make_plan
from coordloader.errors import CheckpointError, PlanError
from coordloader.layout import Layout
from coordloader.planning import planner as planner_mod
from coordloader.planning.cover import validate_cover
from coordloader.planning.planner import meta_from_specs
from coordloader.synth.archs import arch_tensors


@pytest.fixture(scope="module")
def dsv3():
    cfg, specs = arch_tensors("deepseek_v3", "small")   # 6 layers + 1 MTP layer, fp8 scales
    return meta_from_specs(cfg, specs, files=5)


def plan_alone(monkeypatch, meta, layout, rules=None):
    """The plan with every tensor placed on its own (no family shares a placement)."""
    with monkeypatch.context() as m:
        m.setattr(planner_mod._Planner, "_families",
                  lambda self, names, *rest: [[i] for i in range(len(names))])
        return make_plan(meta, layout, rules)


def slices(plan):
    return [[(t.name, t.local_shape, t.pieces, tuple(t.byte_runs), t.replica) for t in rp.tensors]
            for rp in plan.ranks]


def same_as_alone(monkeypatch, meta, layout, rules=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(meta, layout, rules)
        alone = plan_alone(monkeypatch, meta, layout, rules)
    validate_cover(plan, meta)
    assert plan.digest() == alone.digest()
    assert slices(plan) == slices(alone)
    return plan


@pytest.mark.parametrize("kw", [dict(tp=2, ep=2, pp=2), dict(tp=2, ep=2, pp=3, include_mtp=True),
                                pytest.param(dict(tp=4, ep=2, dp=2), marks=pytest.mark.slow),
                                dict(tp=1, dp=4, ep=4, ep_spans_dp=True)],
                         ids=["pp2", "pp3-mtp", "moe_tp", "ep_spans_dp"])
def test_families_give_the_plan_of_tensors_placed_alone(monkeypatch, dsv3, kw):
    same_as_alone(monkeypatch, dsv3, Layout(**kw))


@pytest.mark.slow
def test_a_rule_for_one_layers_weight_moves_that_layers_scale_only(monkeypatch, dsv3):
    # o_proj is row-parallel; layer 3's alone is held whole, and so must be its block
    # scale, which matches the same (preset) scale rule as every other layer's
    w = "model.layers.3.self_attn.o_proj.weight"
    rules = {"rules": [{"pattern": w, "strategy": "replicate"}]}
    plan = same_as_alone(monkeypatch, dsv3, Layout(tp=2), rules)
    held = plan.ranks[1].by_name()
    for layer, whole in ((2, False), (3, True), (4, False)):
        for n in (f"model.layers.{layer}.self_attn.o_proj.weight",
                  f"model.layers.{layer}.self_attn.o_proj.weight_scale_inv"):
            s = held[n]
            assert (s.local_shape == s.global_shape) is whole, n


def test_an_expert_id_pattern_reading_the_layer_places_each_layer_apart(monkeypatch, dsv3):
    # a (contrived) user pattern taking the expert id from the layer index: every expert
    # of layer L goes to the owner of expert L, so the layers differ (7 "experts": the
    # layers the names hold, as the pattern reads them)
    rules = {"rules": [{"pattern": "model.layers.*.mlp.experts.*", "strategy": "expert",
                        "params": {"id_regex": r"layers\.(\d+)\.", "num_experts": 7}}]}
    plan = same_as_alone(monkeypatch, dsv3, Layout(tp=4, ep=4, expert_placement="round_robin"),
                         rules)
    owners = {}
    for rp in plan.ranks:
        for t in rp.tensors:
            if ".mlp.experts." in t.name and t.name.endswith("gate_proj.weight"):
                layer = int(t.name.split(".")[2])
                owners.setdefault(layer, set()).add(rp.rank)
    # round-robin placement over 4 ranks: expert L is on rank L % 4
    assert owners == {layer: {layer % 4} for layer in range(1, 6)}   # layer 6 is MTP, left out


def test_a_block_scale_follows_a_weight_whose_expert_id_pattern_reads_the_layer(monkeypatch,
                                                                                 dsv3):
    # the user rule takes the weights only: their block scales keep the preset's scale rule
    # and must follow each layer's weight to the owner of expert L, not layer 1's owner
    rules = {"rules": [{"pattern": "model.layers.*.mlp.experts.*.weight", "strategy": "expert",
                        "params": {"id_regex": r"layers\.(\d+)\.", "num_experts": 7}}]}
    plan = same_as_alone(monkeypatch, dsv3, Layout(tp=4, ep=4, expert_placement="round_robin"),
                         rules)
    for layer in range(1, 6):
        w = f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"
        for n in (w, w + "_scale_inv"):
            assert [rp.rank for rp in plan.ranks if n in rp.by_name()] == [layer % 4], n


def test_a_bar_in_a_dtype_does_not_join_two_families():
    # family keys are strings: a dtype holding the key's separator must not make two
    # tensors' keys equal (the second would be planned with the first one's dtype)
    base = meta_from_specs(None, [("h.x|0|m.h.3.h..h..w", "BF16", (4,)),
                                  ("m.h..h..h.5.w", "BF16", (4,))])
    t = base.tensors["m.h..h..h.5.w"]
    odd = dataclasses.replace(base, tensors={**base.tensors,
                                             t.name: dataclasses.replace(t, dtype="BF16|0|h.x")})
    with pytest.raises(CheckpointError, match="unknown dtype"):
        make_plan(odd, Layout(tp=1), replicate_unmatched=True)


def test_rules_looked_up_by_template_hold_the_planned_names_only():
    # without a rule that reads digits, a name's rule is its digit template's; names left
    # out under a prefix (MTP) are not planned: not in the mapping, as with a dict
    from coordloader.planning.planner import _ByTemplate
    from coordloader.planning.rules.ruleset import digit_template
    tensors = {n: None for n in ("model.layers.3.w", "model.layers.12.w", "mtp.layers.0.w")}
    planned = ["model.layers.12.w", "model.layers.3.w"]
    rule = ("r", {})
    m = _ByTemplate({digit_template(n): rule for n in planned}, planned, tensors, "mtp.")
    assert m["model.layers.3.w"] is rule and m["model.layers.12.w"] is rule
    assert "mtp.layers.0.w" not in m and "model.layers.4.w" not in m and 3 not in m
    for name in ("mtp.layers.0.w", "model.layers.4.w"):
        with pytest.raises(KeyError):
            m[name]
    assert list(m) == planned and len(m) == 2 and dict(m) == {n: rule for n in planned}


def test_scales_of_some_weights_only_follow_them(monkeypatch, dsv3):
    # a block-scale template whose weights are not one template's names (some weights
    # left unquantised, some scales without their weight): each scale still joins its own
    # weight's family, as placing every tensor on its own gives
    names = sorted(n for n in dsv3.tensors if n.endswith("_scale_inv") and ".layers.2." in n)
    dropped = {n for i, n in enumerate(names) if i % 3 == 0}
    some = dataclasses.replace(dsv3, tensors={n: t for n, t in dsv3.tensors.items()
                                              if n not in dropped})
    same_as_alone(monkeypatch, some, Layout(tp=2, ep=2, pp=2))
    orphan = names[1][:-len("_scale_inv")]
    lone = dataclasses.replace(dsv3, tensors={n: t for n, t in dsv3.tensors.items()
                                              if n != orphan})
    with pytest.raises(PlanError, match="block scale without its weight") as ei:
        make_plan(lone, Layout(tp=2, ep=2, pp=2))
    assert ei.value.tensor == names[1]


def test_names_and_shapes_of_builtin_subclasses_plan_as_before():
    # names that are str subclasses (numpy's, from an array) and shapes that are tuple
    # subclasses (torch.Size) plan as plain ones do
    import numpy as np
    import torch
    cfg, specs = arch_tensors("llama", "tiny")
    plain = make_plan(meta_from_specs(cfg, specs), Layout(tp=2))
    odd = meta_from_specs(cfg, [(np.str_(n), d, s) for n, d, s in specs])
    named = make_plan(odd, Layout(tp=2))
    validate_cover(named, odd)
    assert ([(t.name, t.pieces) for t in named.rank(1).tensors]
            == [(t.name, t.pieces) for t in plain.rank(1).tensors])
    meta = meta_from_specs(cfg, specs)
    sized = dataclasses.replace(meta, tensors={n: dataclasses.replace(t, shape=torch.Size(t.shape))
                                               for n, t in meta.tensors.items()})
    plan = make_plan(sized, Layout(tp=2))
    validate_cover(plan, sized)
    assert len(plan.rank(0).tensors) == len(plain.rank(0).tensors)


def expert_placements(monkeypatch, meta, layout):
    """The expert tensors the planner placed through (each family's first name)."""
    from coordloader.planning.placement import Placer
    seen = []
    place = Placer.place

    def spy(self, n):
        seen.append(n)
        return place(self, n)

    monkeypatch.setattr(Placer, "place", spy)
    make_plan(meta, layout)
    monkeypatch.undo()
    return {n for n in seen if ".experts." in n}


def test_the_experts_of_one_owner_set_are_placed_once(monkeypatch, dsv3):
    # 32 experts x 3 weights (+ block scales) x 5 MoE layers: placed per owner set, not
    # per expert (ids 0-9 and 10-31 are two digit templates, joined by their owners), so
    # expert 0 stands for the first rank's and 16 for the second's, in layer 1 for layers
    # 1-5 and in layer 6 for the MTP layer (left out)
    ep2 = expert_placements(monkeypatch, dsv3, Layout(tp=2, ep=2))
    assert {n.split(".experts.")[1].split(".")[0] for n in ep2} == {"0", "16"}
    assert {n.split(".")[2] for n in ep2} == {"1", "6"}
    assert len(ep2) == 2 * 3 * 2 * 2   # owner set x proj x (weight, scale) x (layers, MTP)
    same_as_alone(monkeypatch, dsv3, Layout(tp=2, ep=2))


@pytest.mark.parametrize("kw", [
    dict(tp=4, ep=4, expert_placement="round_robin"),
    dict(tp=4, ep=4, expert_placement=tuple(tuple(range(q * 8, q * 8 + 8)) + ((q + 1) % 4 * 8,)
                                            for q in range(4))),   # redundant experts
    dict(tp=1, dp=3, ep=3, ep_spans_dp=True, allow_uneven=True),   # 11, 11 and 10 experts
    pytest.param(dict(tp=2, ep=2, pp=2, dp=2, ep_spans_dp=True, include_mtp=True),
                 marks=pytest.mark.slow),
], ids=["round_robin", "redundant", "uneven", "pp-mtp-spans-dp"])
def test_expert_families_by_owner_set_give_the_plan_of_tensors_placed_alone(monkeypatch, dsv3,
                                                                               kw):
    same_as_alone(monkeypatch, dsv3, Layout(**kw))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_expert_families_of_other_names_give_the_plan_of_tensors_placed_alone(monkeypatch,
                                                                               arch):
    # Mixtral's w1/w2/w3 share one digit template: the name part keeps them apart
    cfg, specs = arch_tensors(arch, "small")
    meta = meta_from_specs(cfg, specs, files=3)
    same_as_alone(monkeypatch, meta, Layout(tp=2, ep=2, pp=2))


def test_an_expert_id_outside_the_experts_is_named_as_when_placed_alone(monkeypatch, dsv3):
    big = dataclasses.replace(dsv3, config={**dsv3.config, "n_routed_experts": 16})
    with pytest.raises(PlanError) as ours:
        make_plan(big, Layout(tp=2, ep=2))
    with pytest.raises(PlanError) as alone:
        plan_alone(monkeypatch, big, Layout(tp=2, ep=2))
    assert str(ours.value) == str(alone.value)
