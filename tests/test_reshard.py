"""Resharding round trips: synthesize -> load at layout A -> coordloader.save -> load at
layout B == direct load at B of the original checkpoint, byte for byte.

The multi-process part runs the real distributed path (4 spawned gloo processes, every
source layout A saved by a distributed save); the loads at B are checked in this process,
rank by rank (``load(..., rank=r)``), which also covers the single-process world=1 case.
The hypothesis part saves in local mode (one process, every rank in turn)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coordloader.api import make_plan
from coordloader.checkpoint.formats import SHARD_SUFFIX, SHARDED_INDEX
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.dist.collective import free_port
from coordloader.errors import PlanError
from coordloader.handoff.save import save
from coordloader.layout import Layout
from coordloader.loader import load
from coordloader.planning.cover import validate_cover
from coordloader.synth import synthesize

from helpers import tensor_bits
from ranks import spawn_and_wait

pytestmark = pytest.mark.slow   # rank processes and resharded saves

# source layouts, saved by a distributed save over 4 (or the first 2) spawned processes
SOURCE_LAYOUTS = {
    "tp4": Layout(tp=4),
    "tp2ep2": Layout(tp=2, ep=2),
    "pp2tp2": Layout(pp=2, tp=2),
    "dp2": Layout(dp=2),
}
ARCH_SOURCES = {"qwen3_moe": ["tp4", "tp2ep2", "pp2tp2", "dp2", "dp2ep2"], "llama": ["tp4", "pp2tp2"]}
MOE_EXTRA = {"dp2ep2": Layout(dp=2, ep=2, ep_spans_dp=True)}
TARGET_LAYOUTS = [Layout(), Layout(tp=2), Layout(tp=4, ep=2), Layout(pp=2, tp=2), Layout(tp=8)]


def assert_same_load(src: str, resharded: str, layout: Layout, **kw) -> None:
    # the plan of the resharded checkpoint passes the cover check (`coordloader.plan` runs it)
    validate_cover(make_plan(resharded, layout), read_checkpoint(resharded))
    for r in range(layout.world_size):
        want = load(src, layout, rank=r, **kw)
        got = load(resharded, layout, rank=r, **kw)
        assert list(got) == list(want), (layout, r)
        for n in want:
            assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, (layout, r, n)
            assert torch.equal(tensor_bits(got[n]), tensor_bits(want[n])), f"{layout} rank {r}: {n} differs"


def _worker(rank: int, port: int, jobs: list, q) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=4)
        pair = dist.new_group([0, 1])  # world-2 source layouts run on ranks 0 and 1
        for src, layout_dict, out in jobs:
            layout = Layout.from_dict(layout_dict)
            group = None if layout.world_size == 4 else pair
            if rank < layout.world_size:
                tensors = load(src, layout, group=group)            # distributed load at A
                plan = make_plan(src, layout)
                save(out, tensors, plan, group=group, config=os.path.join(src, "config.json"))
            dist.barrier()
            # and a distributed resharded load at a world-4 target, against the direct one
            b = Layout(tp=2, pp=2) if layout.pp == 1 else Layout(tp=4)
            got, want = load(out, b, verify="digest"), load(src, b)
            assert list(got) == list(want)
            for n in want:
                assert torch.equal(tensor_bits(got[n]), tensor_bits(want[n])), (layout, b, n)
        dist.barrier()
        q.put((rank, "ok"))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(jobs: list) -> None:
    import torch.multiprocessing as mp
    q = mp.get_context("spawn").Queue()
    spawn_and_wait(_worker, (free_port(), jobs, q), 4, "resharding job")
    res = dict(q.get(timeout=10) for _ in range(4))
    assert res == {r: "ok" for r in range(4)}, res


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Both archs, every source layout, saved by one 4-process job."""
    base = tmp_path_factory.mktemp("reshard")
    out, jobs = {}, []
    for arch in ("qwen3_moe", "llama"):
        src = synthesize(str(base / arch / "src"), arch, "tiny", shards=3, seed=7)
        for name in ARCH_SOURCES[arch]:
            lay = SOURCE_LAYOUTS.get(name) or MOE_EXTRA[name]
            dst = str(base / arch / name)
            jobs.append((src, lay.to_dict(), dst))
            out[(arch, name)] = (src, dst)
    _spawn(jobs)
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_distributed_save_then_load_anywhere(saved, arch):
    for (a, name), (src, dst) in saved.items():
        if a != arch:
            continue
        assert os.path.exists(os.path.join(dst, SHARDED_INDEX))
        assert os.path.exists(os.path.join(dst, "coordloader.manifest.json"))
        files = sorted(f for f in os.listdir(dst) if f.endswith(SHARD_SUFFIX))
        world = SOURCE_LAYOUTS.get(name, MOE_EXTRA.get(name)).world_size
        assert {f.split("-part-")[0] for f in files} <= {f"rank-{r:05d}" for r in range(world)}
        for b in TARGET_LAYOUTS:
            if arch == "llama" and b.ep > 1:
                continue
            assert_same_load(src, dst, b)


def test_consolidate_of_resharded_equals_original(saved, tmp_path):
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.handoff.consolidate import consolidate, read_full
    src, dst = saved[("qwen3_moe", "tp2ep2")]
    out = tmp_path / "hf"
    consolidate(dst, str(out), max_shard_bytes=200_000, block_bytes=4096)
    a, b = read_checkpoint(src), read_checkpoint(str(out))
    assert list(b.tensors) == list(a.tensors) or set(b.tensors) == set(a.tensors)
    assert all(t.is_whole for t in b.tensors.values()) and len(b.files) > 1
    for n in a.tensors:
        assert torch.equal(tensor_bits(read_full(a, n)), tensor_bits(read_full(b, n))), n


# ---- hypothesis: random model, random source and target layouts ------------------------

ARCHS = ["llama", "qwen2", "qwen3_moe", "mixtral", "bert", "deepseek_v3"]


@st.composite
def layouts(draw, max_world=4):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2]))
    assume(tp * pp * dp <= max_world)
    spans = draw(st.booleans()) and dp > 1
    g = tp * dp if spans else tp
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if g % e == 0]))
    placement = draw(st.sampled_from(["linear", "round_robin"]))
    return Layout(tp=tp, pp=pp, dp=dp, ep=ep, ep_spans_dp=spans, expert_placement=placement)


def _plan_or_none(src, layout):
    try:
        return make_plan(src, layout)
    except PlanError:
        return None


_CACHE: dict = {}


# deepseek_v3's MTP layers are excluded by default: save says so, as it should (the
# warning itself is asserted in test_consolidate); both loads compared here exclude them alike
@pytest.mark.filterwarnings("ignore:coordloader.save.*excluded by the plan:UserWarning")
@settings(deadline=None, max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(arch=st.sampled_from(ARCHS), seed=st.integers(0, 3), shards=st.integers(1, 3),
       a=layouts(), b=layouts(), max_shard=st.sampled_from([1 << 30, 20_000]))
def test_hypothesis_resharded_load_equals_direct(tmp_path_factory, arch, seed, shards, a, b, max_shard):
    key = (arch, seed, shards)
    if key not in _CACHE:
        _CACHE[key] = synthesize(str(tmp_path_factory.mktemp("h") / "src"), arch, "tiny",
                                 shards=shards, seed=seed)
    src = _CACHE[key]
    plan = _plan_or_none(src, a)
    assume(plan is not None and _plan_or_none(src, b) is not None)
    out = str(tmp_path_factory.mktemp("hs"))
    for r in range(a.world_size):
        save(out, load(src, a, rank=r), plan, rank=r, max_shard_bytes=max_shard, overwrite=True,
             config=src)
    assert_same_load(src, out, b)
