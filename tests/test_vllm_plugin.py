"""The vLLM load format's pure parts, without vLLM: options, layout and rank mapping,
expert-slot check. The real vLLM runs are in test_vllm_e2e.py."""
from __future__ import annotations

import pytest
import torch

import coordloader as cl
from coordloader.errors import ConfigError, FitError
from coordloader.integrations.vllm import (
    LoaderOptions,
    check_expert_slots,
    coordinate_rank,
    layout_of,
    planned_experts,
)


def test_options_default_and_known_keys():
    assert LoaderOptions.parse(None) == LoaderOptions()
    o = LoaderOptions.parse({"engine": "cpu", "verify": "digest", "rules": "llama", "timeout": 30})
    assert (o.engine, o.verify, o.rules, o.timeout) == ("cpu", "digest", "llama", 30)
    # a rule file's content, as make_plan takes it (it was refused as the wrong type)
    doc = {"preset": "llama", "mode": "extend",
           "rules": [{"pattern": "*.o_proj.weight", "strategy": "rowwise"}]}
    assert LoaderOptions.parse({"rules": doc}).rules == doc
    cl.planning.rules.resolve_rules({"model_type": "llama", "num_attention_heads": 4,
                                     "num_key_value_heads": 2}, doc)   # the planner takes it
    with pytest.raises(ConfigError, match="engine .instanttensor. is not available under vLLM"):
        LoaderOptions.parse({"engine": "instanttensor"})


@pytest.mark.parametrize("extra, msg", [
    ({"engnie": "cpu"}, "unknown key(s) engnie for load format 'coordloader'; known: engine"),
    ({1: 2}, "unknown key(s) 1 for load format 'coordloader'; known: engine"),
    ({"timeout": "10"}, "timeout (seconds a rank waits"),
    ({"timeout": True}, "timeout (seconds a rank waits"),
    ({"timeout": float("nan")}, "timeout must be a finite number of seconds from 0.1 to"),
    ({"timeout": 0}, "timeout must be a finite number of seconds from 0.1 to"),
    ({"timeout": 10**400}, "timeout must be a finite number of seconds from 0.1 to"),
    ({"loader_config": "[1]"}, "loader_config (engine options"),
    ({"replicate_unmatched": "yes"}, "replicate_unmatched (hold every tensor"),
    ([("engine", "cpu")], "must be a JSON object, got list"),
])
def test_bad_options_are_refused_naming_the_key(extra, msg):
    with pytest.raises(ConfigError) as e:
        LoaderOptions.parse(extra)
    assert msg in str(e.value)


def test_layout_without_expert_parallel_splits_experts_over_tp():
    lay = layout_of(tp=4, pp=2, dp=1, expert_parallel=False, placement="linear")
    assert (lay.tp, lay.pp, lay.ep, lay.moe_tp) == (4, 2, 1, 4)


def test_layout_without_expert_parallel_splits_experts_over_tp_and_dp():
    """vLLM with DP and no EP flattens the experts' TP over the TP x DP ranks: each rank
    holds a distinct quarter of every expert at tp=2 dp=2, where the layout gave ranks 0
    and 2 the same half (moe_tp = tp)."""
    lay = layout_of(tp=2, pp=1, dp=2, expert_parallel=False, placement="linear")
    assert (lay.ep, lay.moe_tp, lay.ep_spans_dp) == (1, 4, True)
    # vLLM's flatten_tp_rank = dp_rank * tp + tp_rank
    assert [lay.coords(r).moe_tp for r in range(4)] == [
        lay.coords(r).dp * 2 + lay.coords(r).tp for r in range(4)] == [0, 1, 2, 3]


def test_layout_with_expert_parallel_keeps_experts_whole():
    lay = layout_of(tp=2, pp=1, dp=1, expert_parallel=True, placement="round_robin")
    assert (lay.ep, lay.moe_tp, lay.expert_placement) == (2, 1, "round_robin")


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, 3)])
def test_coordinate_rank_inverts_layout_coords(tp, pp, dp):
    lay = cl.Layout(tp=tp, pp=pp, dp=dp)
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert coordinate_rank(lay, c.tp, c.pp, c.dp) == r


def test_planned_experts_reads_layer_and_expert_ids():
    names = ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.1.w2",
             "model.layers.12.block_sparse_moe.experts.7.w1.weight", "model.layers.1.mlp.gate.weight",
             "model.layers.2.mlp.shared_experts.down_proj.weight"]
    assert planned_experts(names) == {0: {1, 3}, 12: {7}}


def test_expert_slot_mismatch_names_layer_rank_and_both_sides():
    check_expert_slots({0: {0, 1}}, {0: {0, 1}, 1: {2, 3}}, rank=0)   # layer 1 not planned here
    with pytest.raises(FitError) as e:
        check_expert_slots({0: {0, 1}, 1: {0, 1}}, {0: {0, 1}, 1: {1, 2}}, rank=1)
    msg = str(e.value)
    assert "rank 1" in msg and "layer 1" in msg and "[2]" in msg and "[0]" in msg, msg


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_data_parallel_is_refused_naming_it(monkeypatch, expert_parallel):
    """vLLM's world group spans the DP replicas (world_size_across_dp); without expert
    parallelism this was refused as a world-group mismatch that did not name DP. The
    modules below stand in for vLLM's config and parallel_state, as vLLM sets them for
    tp=2 dp=2 on the worker at dp rank 1, tp rank 0."""
    import sys
    import types
    from types import SimpleNamespace as NS

    from coordloader.integrations.vllm import vllm_rank
    pc = NS(prefill_context_parallel_size=1, decode_context_parallel_size=1,
            tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=2,
            enable_expert_parallel=expert_parallel, expert_placement_strategy="linear")
    config = types.ModuleType("vllm.config")
    config.get_current_vllm_config = lambda: NS(parallel_config=pc)
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tp_group = lambda: NS(rank_in_group=0)
    ps.get_pp_group = lambda: NS(rank_in_group=0)
    ps.get_dp_group = lambda: NS(rank_in_group=1)
    ps.get_world_group = lambda: NS(world_size=4, rank_in_group=2, cpu_group=None)
    distributed = types.ModuleType("vllm.distributed")
    distributed.parallel_state = ps
    for name, mod in {"vllm": types.ModuleType("vllm"), "vllm.config": config,
                      "vllm.distributed": distributed,
                      "vllm.distributed.parallel_state": ps}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    with pytest.raises(ConfigError) as e:
        vllm_rank()
    assert str(e.value) == ("load format 'coordloader': data parallelism (data_parallel_size=2"
                            + (", with expert parallelism" if expert_parallel else "")
                            + ") is not supported yet")


class _ExpertsModule(torch.nn.Module):
    """What vLLM's FusedMoE keeps of its placement: a global -> local expert map."""

    def __init__(self, kept, n):
        super().__init__()
        self.global_num_experts = n
        slots = iter(range(len(kept)))
        self._expert_map = torch.tensor([next(slots) if e in kept else -1 for e in range(n)])


@pytest.mark.parametrize("asked, kept_by_rank, used", [
    # vLLM fell back from round_robin to linear (no expert groups): the plan follows it
    ("round_robin", {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}, "linear"),
    ("round_robin", {0: {0, 2, 4, 6}, 1: {1, 3, 5, 7}}, "round_robin"),
    ("linear", {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}, "linear"),
    # neither: the plan keeps what was asked, and the fit check names both sides
    ("round_robin", {0: {0, 1, 2, 7}, 1: {3, 4, 5, 6}}, "round_robin"),
])
def test_placement_follows_what_vllm_applied(asked, kept_by_rank, used):
    """vLLM applies round_robin only to models with expert groups (else linear, with a
    warning); planning round_robin regardless refused a load vLLM's own loader serves."""
    from coordloader.integrations.vllm import VllmRank, placement_vllm_used
    for rank, kept in kept_by_rank.items():
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Module()])
        model.layers[0].experts = _ExpertsModule(kept, 8)
        lay = layout_of(tp=2, pp=1, dp=1, expert_parallel=True, placement=asked)
        vr = placement_vllm_used(VllmRank(lay, rank, None), model)
        assert vr.layout.expert_placement == used
        assert vr.layout == cl.Layout(tp=2, ep=2, expert_placement=used) and vr.rank == rank


def test_vllm_pp_layer_partition_sets_the_stages():
    """vLLM's get_pp_indices follows VLLM_PP_LAYER_PARTITION; the layout ignored it, so
    every stage held other layers than vLLM's (a FitError on a load vLLM serves)."""
    from coordloader.integrations.vllm import pp_partition
    lay = layout_of(tp=1, pp=2, dp=1, expert_parallel=False, placement="linear",
                    pp_layers=pp_partition("3,1", 2))
    assert lay.stage_layers(4) == [range(0, 3), range(3, 4)]
    assert pp_partition(None, 2) is None and pp_partition("3,1", 1) is None
    for bad in ("3", "3,1,0", "a,b", "3,-1"):
        with pytest.raises(ConfigError) as e:
            pp_partition(bad, 2)
        assert str(e.value) == (f"VLLM_PP_LAYER_PARTITION={bad!r}: expected 2 comma-separated "
                                f"non-negative layer counts, one per pipeline stage")
