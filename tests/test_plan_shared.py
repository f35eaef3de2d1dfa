"""Rank classes: ranks whose coordinates give the same slices share one SharedSlices, and
the plan, its JSON, its digest and cover validation are what per-rank planning gives."""
import dataclasses
import re

import pytest

from coordloader.api import make_plan
from coordloader.errors import PlanError
from coordloader.layout import Layout
from coordloader.planning.cover import validate_cover
from coordloader.planning.model import Plan, RankPlan, SharedRankPlan, share_of
from coordloader.planning.planner import meta_from_specs
from coordloader.synth.archs import arch_tensors

LAYOUT = Layout(tp=2, ep=2, dp=3, pp=2)


@pytest.fixture(scope="module")
def meta():
    cfg, specs = arch_tensors("deepseek_v3", "tiny")
    return meta_from_specs(cfg, specs, files=3)


@pytest.fixture(scope="module")
def plan(meta):
    return make_plan(meta, LAYOUT)


def plain(plan):
    """The same plan with every rank a plain RankPlan holding its own slice objects."""
    ranks = tuple(RankPlan(rp.rank, dict(rp.coords), tuple(rp.tensors)) for rp in plan.ranks)
    return Plan(plan.layout, plan.fingerprint, ranks, plan.excluded, plan.load_groups)


def test_dp_replicas_share_one_rank_class(plan):
    shares = {}
    for rp in plan.ranks:
        shares.setdefault(id(share_of(rp)), []).append(rp.rank)
    # one class per (pp, tp) coordinate: the 3 dp replicas of each share it
    assert sorted(shares.values()) == [[s * 6 + t, s * 6 + 2 + t, s * 6 + 4 + t]
                                       for s in range(2) for t in range(2)]


def test_shared_plan_equals_per_rank_plan(plan, meta):
    flat = plain(plan)
    assert all(share_of(rp) is None for rp in flat.ranks)
    assert flat == plan and plan == flat
    assert flat.to_json() == plan.to_json()
    assert flat.digest() == plan.digest()
    validate_cover(plan, meta)
    validate_cover(flat, meta)


def test_replica_ids_follow_rank_order(plan):
    # a tp-split tensor: the dp replicas of tp rank 1 on stage 0 are ranks 1, 3, 5
    name = "model.layers.0.self_attn.o_proj.weight"
    got = [plan.rank(r).by_name()[name] for r in (1, 3, 5)]
    assert [s.replica for s in got] == [0, 1, 2]
    assert got[0].pieces is got[1].pieces and got[1].byte_runs is got[2].byte_runs
    # replicated on the whole stage: replica id = stage-local index
    norm = "model.layers.0.input_layernorm.weight"
    assert [plan.rank(r).by_name()[norm].replica for r in range(6)] == list(range(6))


def with_replicas(plan, table, fix):
    """``plan`` with replica table ``table`` rewritten by ``fix`` (rank -> id) in every share."""
    sh0 = share_of(plan.ranks[0])
    replicas = list(sh0.replicas)
    replicas[table] = tuple(fix(r, i) for r, i in enumerate(replicas[table]))
    replicas = tuple(replicas)
    new = {}
    ranks = []
    for rp in plan.ranks:
        sh = share_of(rp)
        if id(sh) not in new:
            new[id(sh)] = dataclasses.replace(sh, replicas=replicas)
        ranks.append(SharedRankPlan.make(rp.rank, rp.coords, new[id(sh)]))
    return Plan(plan.layout, plan.fingerprint, tuple(ranks), plan.excluded, plan.load_groups)


def table_of(plan, name, rank):
    sh = share_of(plan.rank(rank))
    return sh.tables[[s.name for s in sh.slices].index(name)]


def test_cover_catches_two_primaries_in_a_rank_class(plan, meta):
    k = table_of(plan, "model.layers.0.self_attn.o_proj.weight", 1)
    bad = with_replicas(plan, k, lambda r, i: 0 if r == 3 else i)
    with pytest.raises(PlanError, match="duplicated primary") as ei:
        validate_cover(bad, meta)
    assert ei.value.rank == 3


def test_cover_catches_a_class_of_replicas_only(plan, meta):
    name = "model.layers.0.self_attn.o_proj.weight"
    k = table_of(plan, name, 1)
    bad = with_replicas(plan, k, lambda r, i: i + 1 if i >= 0 and r % 2 == 1 else i)
    with pytest.raises(PlanError, match="missing piece") as ei:
        validate_cover(bad, meta)
    assert ei.value.tensor is not None
    # the holders as ranges (a Python list, cut at 16, named a few of a large world)
    assert re.search(r"; held by ranks? [0-9,-]+\)$", ei.value.message), ei.value.message


def test_cover_catches_a_member_that_does_not_hold_its_class_slice(plan, meta):
    k = table_of(plan, "model.layers.0.self_attn.o_proj.weight", 1)
    bad = with_replicas(plan, k, lambda r, i: -1 if r == 5 else i)
    with pytest.raises(PlanError, match="does not hold") as ei:
        validate_cover(bad, meta)
    assert ei.value.rank == 5


def test_cover_proves_each_tensor_despite_shared_pieces(plan, meta):
    """Same-shaped tensors share pieces objects and cover proves a tiling once per
    (shape, boxes objects): a later tensor whose rank-1 class holds rank 0's pieces (a
    duplicated primary and a missing half) must still fail, after its twins passed."""
    r0, r1 = plan.rank(0).by_name(), plan.rank(1).by_name()   # tp ranks 0 and 1 of stage 0
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert r0[a].pieces is r0[b].pieces and r0[b].pieces is not r1[b].pieces
    sh1 = share_of(plan.rank(1))
    wrong = dataclasses.replace(r1[b], pieces=r0[b].pieces, byte_runs=r0[b].byte_runs)
    bad_sh = dataclasses.replace(sh1, slices=tuple(wrong if s.name == b else s for s in sh1.slices))
    ranks = tuple(SharedRankPlan.make(rp.rank, rp.coords, bad_sh) if share_of(rp) is sh1 else rp
                  for rp in plan.ranks)
    bad = Plan(plan.layout, plan.fingerprint, ranks, plan.excluded, plan.load_groups)
    with pytest.raises(PlanError, match="duplicated primary") as ei:
        validate_cover(bad, meta)
    assert ei.value.tensor == b


@pytest.fixture(scope="module")
def dsv3_full():
    cfg, specs = arch_tensors("deepseek_v3", "full")
    return meta_from_specs(cfg, specs, files=163)


# digests of the per-rank planner before rank classes: sharing must not change a byte
GOLDEN = [
    pytest.param(dict(tp=8, ep=8),
                 "2ac1fceb9472b923b2fd3c0a7aba31950dc890138ea899c796bb095e1499a213", id="tp8ep8"),
    pytest.param(dict(tp=8, ep=8, dp=16, pp=8),
                 "2576a8c3b230e2617a6e5e0053dde77cb8379ea39e8da25b36c0618593af9cac",
                 id="tp8ep8dp16pp8", marks=pytest.mark.slow),   # 1024 ranks
]


@pytest.mark.parametrize("kw,digest", GOLDEN)
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_deepseek_v3_full_digest_golden(dsv3_full, kw, digest):
    plan = make_plan(dsv3_full, Layout(**kw))
    assert plan.digest() == digest
    validate_cover(plan, dsv3_full)


def test_a_plan_of_no_tensors_has_a_digest():
    # no tensor, so no replica table to gather the ranks' replica ids from: the digest
    # still names the layout's ranks (it raised ValueError from a reshape)
    empty = meta_from_specs({"num_hidden_layers": 0}, [])
    one, two = (make_plan(empty, Layout(dp=n)) for n in (1, 2))
    validate_cover(two, empty)
    assert one.digest() == make_plan(empty, Layout(dp=1)).digest() != two.digest()
    assert len(two.ranks) == 2 and not two.rank(1).tensors
