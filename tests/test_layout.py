import pytest

from coordloader.errors import PlanError
from coordloader.layout import Layout


def test_coords_tp_innermost():
    L = Layout(tp=4, dp=2, pp=2, ep=2)
    c = L.coords(13)
    assert (c.tp, c.dp, c.pp) == (1, 1, 1) and (c.ep, c.moe_tp) == (0, 1)
    S = Layout(tp=4, dp=2, ep=8, ep_spans_dp=True)
    assert S.moe_tp == 1 and S.coords(6).ep == 6


def test_placements_and_owners_agree():
    for L in (Layout(tp=4, ep=4), Layout(tp=3, ep=3, expert_placement="round_robin"),
              Layout(tp=2, ep=2, expert_placement=((0, 1, 2), (2, 3, 4)))):
        E = 5
        for q in range(L.ep):
            for e in L.experts_of(q, E):
                assert q in L.owners_of(e, E)
        assert {e for q in range(L.ep) for e in L.experts_of(q, E)} == set(range(E))
    assert Layout(tp=4, ep=4).experts_of(1, 10) == (3, 4, 5)


def test_stage_layers_like_vllm():
    assert [len(r) for r in Layout(pp=4).stage_layers(10)] == [2, 3, 3, 2]
    assert [len(r) for r in Layout(pp=2).stage_layers(61)] == [31, 30]
    assert [len(r) for r in Layout(pp=2, pp_layers=(1, 3)).stage_layers(4)] == [1, 3]


@pytest.mark.parametrize("kw", [dict(tp=0), dict(tp=4, ep=3), dict(tp=2, ep=4), dict(ep=2, tp=2,
                                expert_placement=((0,),)), dict(expert_placement="zigzag"),
                                dict(pp=2, pp_layers=(1,))])
def test_invalid_layouts(kw):
    with pytest.raises(PlanError):
        Layout(**kw)


def test_ep_over_dp_without_ep_spans_dp_says_how():
    """vLLM's DP + EP spreads experts over the TP x DP ranks: the same layout without
    ep_spans_dp was refused with only "exceeds the MoE group size 1"."""
    with pytest.raises(PlanError) as ei:
        Layout(tp=1, dp=4, ep=4)
    assert str(ei.value) == (
        "layout: ep=4 exceeds the MoE group size 1 (tp=1); experts spread over the TP x DP "
        "ranks (vLLM's --data-parallel-size with --enable-expert-parallel) need "
        "ep_spans_dp=True")
    # no such hint where ep_spans_dp would not fit either: more ep ranks than TP x DP, or
    # an ep that does not divide TP x DP
    for kw, group in ((dict(tp=1, dp=2, ep=4), "1 (tp=1)"), (dict(tp=2, dp=3, ep=4), "2 (tp=2)")):
        with pytest.raises(PlanError) as ei:
            Layout(**kw)
        assert str(ei.value) == f"layout: ep=4 exceeds the MoE group size {group}"


def test_expert_checks():
    with pytest.raises(PlanError, match="misses"):
        Layout(tp=2, ep=2, expert_placement=((0,), (2,))).check_experts(3)
    with pytest.raises(PlanError, match="exceeds the expert count"):
        Layout(tp=8, ep=8).check_experts(4)
    with pytest.raises(PlanError):
        Layout(pp=3).stage_layers(2)
    assert Layout.from_dict(Layout(tp=2, ep=2, expert_placement=((1, 0), (0,))).to_dict()).expert_placement \
        == ((1, 0), (0,))


@pytest.mark.parametrize("kw, msg", [
    (dict(tp=2, ep=2, expert_placement=[[0.9, 1], [2, 3]]),
     "layout: an explicit expert map is a list of integer expert ids per ep rank, got "
     "[[0.9, 1], [2, 3]]"),
    (dict(tp=2, ep=2, expert_placement=[[True, False], [2, 3]]),
     "layout: an explicit expert map is a list of integer expert ids per ep rank, got "
     "[[True, False], [2, 3]]"),
    (dict(tp=2, ep=2, expert_placement=[[0, 0, 1], [2]]),
     "layout: explicit expert map lists expert 0 twice on ep rank 0 ([0, 0, 1]); a replica "
     "goes on another ep rank"),
    (dict(pp=2, pp_layers="11"),
     "layout: pp_layers must be a list of integer layer counts, got '11'"),
])
def test_expert_ids_and_layer_counts_are_not_coerced(kw, msg):
    """int() turned expert id 0.9 into 0, True into 1, and pp_layers "11" into (1, 1)."""
    with pytest.raises(PlanError) as e:
        Layout(**kw)
    assert str(e.value) == msg


@pytest.mark.parametrize("k", ["ep_spans_dp", "allow_uneven", "include_mtp"])
@pytest.mark.parametrize("v", ["false", 0, None])
def test_flags_must_be_booleans(k, v):
    """A string "false" (a JSON plan or config written by hand) was truthy: ep_spans_dp="false"
    silently placed the experts over TP x DP."""
    with pytest.raises(PlanError) as e:
        Layout(tp=2, dp=2, ep=4, **{k: v}) if k == "ep_spans_dp" else Layout(tp=2, **{k: v})
    assert str(e.value) == f"layout: {k} must be true or false, got {v!r}"


@pytest.mark.parametrize("call, msg", [
    # fewer experts than ep ranks: ep ranks 2, 3 own nothing (experts_of refuses it)
    (lambda: Layout(tp=4, ep=4).owners_of(1, 2), "layout: ep=4 exceeds the expert count 2"),
    # an id past the experts: a ZeroDivisionError (linear, 3 of 2 over 4), or an owner
    # of an expert that does not exist
    (lambda: Layout(tp=4, ep=4).owners_of(3, 2), "layout: expert 3 outside the 2 experts"),
    (lambda: Layout(tp=4, ep=4).owners_of(8, 8), "layout: expert 8 outside the 8 experts"),
    (lambda: Layout(tp=4, ep=4, expert_placement="round_robin").owners_of(-1, 8),
     "layout: expert -1 outside the 8 experts"),
    # an ep rank past ep: experts 10 and 11 of 8
    (lambda: Layout(tp=4, ep=4).experts_of(5, 8),
     "layout: ep rank 5 outside 0..3 (tp=4 pp=1 dp=1 ep=4)"),
    (lambda: Layout(tp=4).coords(1.5),
     "layout: rank 1.5 outside world of size 4 (tp=4 pp=1 dp=1 ep=1)"),
])
def test_expert_and_rank_queries_refuse_out_of_range_arguments(call, msg):
    with pytest.raises(PlanError) as e:
        call()
    assert str(e.value) == msg


@pytest.mark.parametrize("placement", ["linear", "round_robin", ((3, 1), (0, 2))])
def test_local_order_is_experts_of_order_without_the_expert_count(placement):
    """load_into stacks a rank's fused experts in local_order; it must be experts_of's
    order (the planner's slots), for every placement, from the ids alone."""
    lay = Layout(dp=2, ep=2, ep_spans_dp=True, expert_placement=placement)
    for q in range(2):
        own = lay.experts_of(q, 4)
        assert lay.local_order(q, sorted(own)) == list(own)
        assert lay.local_order(q, sorted(own, reverse=True)) == list(own)


def test_a_layouts_text_names_the_fields_a_refusal_may_come_from():
    """A plan refusing an expert map printed the layout as "tp=2 pp=1 dp=1 ep=2", without
    the map that caused it (nor pp_layers): the user could not tell which field to fix."""
    assert str(Layout(tp=2, ep=2)) == "tp=2 pp=1 dp=1 ep=2"
    assert str(Layout(tp=2, ep=2, expert_placement=((0, 1, 2), (2, 3)))) == \
        "tp=2 pp=1 dp=1 ep=2 expert_placement=[0 1 2],[2 3]"
    assert str(Layout(tp=2, pp=2, ep=2, expert_placement="round_robin", pp_layers=(1, 3))) == \
        "tp=2 pp=2 dp=1 ep=2 expert_placement=round_robin pp_layers=1,3"
    long = str(Layout(tp=2, ep=2, expert_placement=(tuple(range(128)), tuple(range(128, 256)))))
    assert long.startswith("tp=2 pp=1 dp=1 ep=2 expert_placement=[0 1 2 ") and len(long) < 400


def test_a_fused_expert_tensor_refusing_a_redundant_expert_names_the_map(tmp_path):
    """transformers 5 / gpt-oss fused expert tensors take a redundant expert only where the
    ep ranks holding it hold the same set (docs/layout.md): the refusal names the map."""
    import coordloader as cl

    from hfmodels import write_gpt_oss
    ck = write_gpt_oss(str(tmp_path / "gpt"))
    with pytest.raises(cl.PlanError) as ei:
        cl.make_plan(ck, Layout(tp=2, ep=2, expert_placement=((0, 1, 2), (2, 3))))
    assert ("expert 2 is placed on ep ranks 0 and 1 with different expert sets" in str(ei.value)
            and "(layout tp=2 pp=1 dp=1 ep=2 expert_placement=[0 1 2],[2 3])" in str(ei.value)), \
        str(ei.value)
