"""Zero-element tensors (a dim of size 0) plan, load and verify like any other: their
pieces have empty extents on the zero dims, which the cover checks must accept there
(and only there)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import coordloader as cl
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.dist.collective import free_port
from coordloader.planning.cover import tiling_problem

from ranks import spawn_and_wait

RULES = [{"pattern": "v", "strategy": "colwise"}, {"pattern": "m", "strategy": "rowwise"},
         {"pattern": "w", "strategy": "colwise"}, {"pattern": "r", "strategy": "replicate"}]


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(18)
    save_file({"w": torch.zeros(0), "v": torch.randn(4, generator=g), "m": torch.zeros(4, 0),
               "r": torch.zeros(0, 3)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_zero_element_plan_covers(ckpt, tp):
    meta = read_checkpoint(ckpt)
    plan = cl.make_plan(meta, cl.Layout(tp=tp), rules=RULES)
    cl.validate_cover(plan, meta)
    for rp in plan.ranks:
        assert {s.name for s in rp.tensors} == {"w", "v", "m", "r"}


def test_empty_extent_only_on_a_zero_dim():
    assert tiling_problem([((0, 0), (0, 3))], (0, 3)) is None
    assert tiling_problem([((0, 0),)], (0,)) is None
    # an empty box of a tensor that has elements is still refused
    assert tiling_problem([((0, 4),), ((2, 2),)], (4,))[0] == "outside"
    assert tiling_problem([((0, 4), (1, 1))], (4, 2))[0] == "outside"


@pytest.mark.parametrize("verify", ["shapes", "digest", "full"])
def test_zero_element_load_tp1(ckpt, verify):
    got = cl.load(ckpt, cl.Layout(tp=1), device="cpu", rules=RULES, verify=verify)
    assert {k: tuple(v.shape) for k, v in got.items()} == {
        "w": (0,), "v": (4,), "m": (4, 0), "r": (0, 3)}


def _worker(rank: int, port: int, ckpt: str, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        res = {}
        for verify in ("shapes", "full"):
            t = cl.load(ckpt, cl.Layout(tp=2), rules=RULES, verify=verify, timeout=60)
            res[verify] = {k: [list(v.shape), v.tolist()] for k, v in t.items()}
        with open(os.path.join(out, f"r{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero_element_load_tp2_verifies(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spawn_and_wait(_worker, (free_port(), ckpt, str(out)), 2, "zero-element tp=2 load",
                   hard_s=120)
    from safetensors.torch import load_file
    v = load_file(os.path.join(ckpt, "model.safetensors"))["v"]
    for r in range(2):
        res = json.load(open(out / f"r{r}.json"))
        for verify in ("shapes", "full"):
            got = res[verify]
            assert got["w"][0] == [0] and got["r"][0] == [0, 3] and got["m"][0] == [4, 0]
            assert got["v"] == [[2], v[2 * r:2 * r + 2].tolist()]
