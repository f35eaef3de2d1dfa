"""Multi-process loads over gloo on 127.0.0.1: 2 and 4 ranks, several architectures and
layouts in one spawned job per world size (process start-up dominates on 2 cores).

Every rank's tensors are compared, byte for byte, with a reference it computes itself:
the whole tensor read with the HF ``safetensors`` library, sliced by the plan's piece
boxes with plain torch indexing (never the planner's byte runs), padding zero; and for
the simple dense cases also by vLLM's formulas (q/k/v/gate/up colwise, o/down rowwise)
without the plan at all. One real ``torchrun -m coordloader.load`` with ``--dump`` and
``--report`` checks the entry point and the dumped files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from coordloader.dist.collective import free_port

from helpers import tensor_bytes
from ranks import spawn_and_wait

pytestmark = pytest.mark.slow   # rank processes over gloo

HARD_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    return {a: tiny_checkpoint(a) for a in ("qwen3_moe", "deepseek_v3", "llama")}


def reference_check(ckpt: str, res) -> int:
    """Compare res.tensors with slices of the whole tensors read by HF safetensors."""
    from safetensors import safe_open
    rp = res.plan.rank(res.rank)
    assert sorted(res.tensors) == sorted(t.name for t in rp.tensors)
    handles = {}
    n = 0
    for ts in rp.tensors:
        info = res.meta.tensors[ts.name]
        f = info.file
        if f not in handles:
            handles[f] = safe_open(os.path.join(ckpt, f), framework="pt", device="cpu")
        full = handles[f].get_tensor(ts.name)
        want = torch.zeros(ts.local_shape, dtype=full.dtype)
        for pc in ts.pieces:
            src = tuple(slice(a, b) for a, b in pc.src)
            dst = tuple(slice(o, o + b - a) for o, (a, b) in zip(pc.dst, pc.src))
            want[dst] = full[src]
        got = res.tensors[ts.name]
        assert got.dtype == full.dtype and tuple(got.shape) == tuple(ts.local_shape), ts.name
        assert tensor_bytes(got) == tensor_bytes(want), f"rank {res.rank} {ts.name}"
        n += 1
    return n


def vllm_formula_check(ckpt: str, res, tp: int, tp_rank: int) -> int:
    """Dense llama projections by vLLM's split formulas, independent of the plan."""
    from safetensors import safe_open
    n = 0
    for name, got in res.tensors.items():
        kind = next((k for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                 "o_proj", "down_proj") if f".{k}.weight" in name), None)
        if kind is None:
            continue
        with safe_open(os.path.join(ckpt, res.meta.tensors[name].file), "pt") as f:
            full = f.get_tensor(name)
        dim = 1 if kind in ("o_proj", "down_proj") else 0
        cfg = res.meta.config
        kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if kind in ("k_proj", "v_proj") and tp >= kv:
            # vLLM: K/V heads replicate when tp > num_kv_heads
            head = tp_rank // (tp // kv)
            want = full.narrow(0, head * hd, hd)
        else:
            size = full.shape[dim] // tp
            want = full.narrow(dim, tp_rank * size, size)
        assert tensor_bytes(got) == tensor_bytes(want), f"rank {res.rank} {name} (vLLM formula)"
        n += 1
    return n


def _layouts(world: int):
    from coordloader.layout import Layout
    if world == 2:
        return [("qwen3_moe", Layout(tp=2)), ("llama", Layout(tp=2)),
                ("qwen3_moe", Layout(tp=2, ep=2)),
                ("deepseek_v3", Layout(dp=2, ep=2, ep_spans_dp=True))]
    return [("qwen3_moe", Layout(tp=4, ep=4)), ("llama", Layout(tp=4)),
            ("qwen3_moe", Layout(pp=2, tp=2)), ("llama", Layout(pp=2, tp=2)),
            ("qwen3_moe", Layout(dp=2, tp=2, ep=4, ep_spans_dp=True)),
            ("deepseek_v3", Layout(dp=4, ep=4, ep_spans_dp=True)),
            ("deepseek_v3", Layout(pp=2, dp=2, ep=2, ep_spans_dp=True))]


def _with_fake_instanttensor(fn):
    """Run fn with the CPU stand-in for instanttensor.safe_open (see
    test_engine_instanttensor): exercises load groups / dist.new_group over gloo."""
    from test_engine_instanttensor import faked_instanttensor
    with faked_instanttensor(gloo_as_nccl=True):
        return fn()


def _worker(rank: int, world: int, port: int, ckpts: dict, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from coordloader.errors import CoordloaderError
    from coordloader.layout import Layout
    from coordloader.loader import load_detailed, load_into
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    summary = {"cases": [], "checked": 0, "init_s": time.perf_counter() - t_start}
    try:
        for i, (arch, layout) in enumerate(_layouts(world)):
            # the safetensors engine (slow baseline) on the first two cases only
            for engine in ("cpu", "safetensors") if i < 2 else ("cpu",):
                t0 = time.perf_counter()
                res = load_detailed(ckpts[arch], layout, engine=engine, timeout=60)
                summary.setdefault("times", []).append(round(time.perf_counter() - t0, 3))
                summary["checked"] += reference_check(ckpts[arch], res)
                assert res.stats.bytes_read <= 1.01 * res.stats.bytes_held + 1
                if arch == "llama" and layout.pp == 1 and engine == "cpu":
                    c = layout.coords(rank)
                    summary["formula"] = summary.get("formula", 0) + vllm_formula_check(
                        ckpts[arch], res, layout.tp, c.tp)
                summary["cases"].append([arch, str(layout), engine, len(res.tensors)])
        # instanttensor engine (CPU stand-in) with the plan's load groups over gloo
        arch, layout = _layouts(world)[2 if world == 4 else 3]
        res = _with_fake_instanttensor(lambda: load_detailed(
            ckpts[arch], layout, engine="instanttensor", device="cuda:0", timeout=60))
        summary["checked"] += reference_check(ckpts[arch], res)
        summary["cases"].append([arch, str(layout), "instanttensor-fake", len(res.tensors)])
        # load_into a state dict of preallocated tensors
        arch, layout = _layouts(world)[0]
        ref = load_detailed(ckpts[arch], layout)
        target = {k: torch.zeros_like(v) for k, v in ref.tensors.items()}
        r = load_into(target, ckpts[arch], layout)
        assert sorted(r.loaded) == sorted(target) and not r.not_loaded
        assert all(tensor_bytes(target[k]) == tensor_bytes(v) for k, v in ref.tensors.items())
        # ranks that disagree on the plan all stop, naming the ranks
        odd = Layout(tp=layout.tp, dp=layout.dp, pp=layout.pp, ep=layout.ep,
                     ep_spans_dp=layout.ep_spans_dp,
                     expert_placement="round_robin" if rank == world - 1 else "linear")
        try:
            load_detailed(ckpts["qwen3_moe"], odd, timeout=60)
            summary["disagree"] = "no error"
        except CoordloaderError as e:
            summary["disagree"] = str(e)
        # a failure on one rank only (a missing rules file) reaches every rank
        try:
            load_detailed(ckpts["qwen3_moe"], layout, timeout=60,
                          rules=os.path.join(out_dir, "missing.json") if rank == 1 else None)
            summary["one_rank_error"] = "no error"
        except CoordloaderError as e:
            summary["one_rank_error"] = f"{type(e).__name__}: {e}"
    finally:
        summary["total_s"] = time.perf_counter() - t_start
        with open(os.path.join(out_dir, f"summary-{world}-{rank}.json"), "w") as f:
            json.dump(summary, f)
        dist.destroy_process_group()


def _spawn(world: int, ckpts, out_dir):
    spawn_and_wait(_worker, (world, free_port(), ckpts, str(out_dir)), world,
                   f"{world}-rank job", hard_s=HARD_TIMEOUT_S)
    return [json.load(open(out_dir / f"summary-{world}-{r}.json")) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_multirank_loads_equal_reference(world, ckpts, tmp_path):
    sums = _spawn(world, ckpts, tmp_path)
    n_cases = len(_layouts(world)) + 2 + 1
    for r, s in enumerate(sums):
        assert len(s["cases"]) == n_cases, s
        assert s["checked"] > 0
        assert s["formula"] >= 7  # llama tp=2: q,k,v,o,gate,up,down per layer
        # plan disagreement: every rank stops, naming the odd rank
        assert (f"disagree on the plan digest (differing rank {world - 1}; plan digest: "
                in s["disagree"]), s["disagree"]
        msg = s["one_rank_error"]
        assert "missing.json" in msg, msg
        if r != 1:
            assert "rank 1" in msg and "CollectiveError" in msg, msg


def test_torchrun_entry_point_dump_and_report(ckpts, tmp_path):
    """The real entry point under torchrun: summary table, --report JSON, --dump files
    equal to the reference slices (plan digest in their metadata)."""
    from safetensors import safe_open

    from coordloader.api import make_plan
    from coordloader.layout import Layout
    ck = ckpts["llama"]
    dump, report = tmp_path / "dump", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "coordloader.load", ck, "--tp", "2", "--engine", "cpu", "--dump", str(dump),
           "--report", str(report), "--timeout", "60"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=HARD_TIMEOUT_S, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "total" in p.stdout and "GB/s" in p.stdout
    rep = json.loads(report.read_text())
    plan = make_plan(ck, Layout(tp=2))
    assert len(rep["ranks"]) == 2 and len(rep["plan_digest"]) == 64
    assert rep["totals"]["bytes_held"] == sum(r.bytes_held for r in plan.ranks)
    # the verify stats are the group's, once: each rank's row once showed the group's sum
    # as its own
    assert rep["verify_report"]["stats"]["tensors"] == rep["totals"]["tensors"]
    assert all("stats" not in r["verify"] for r in rep["ranks"])
    for r in range(2):
        path = dump / f"rank-{r:05d}.safetensors"
        rp = plan.rank(r)
        with safe_open(str(path), "pt") as f:
            assert f.metadata()["coordloader.plan_digest"] == rep["plan_digest"]
            assert sorted(f.keys()) == sorted(t.name for t in rp.tensors)
            for ts in rp.tensors:
                with safe_open(os.path.join(ck, ts.file), "pt") as g:
                    full = g.get_tensor(ts.name)
                want = torch.zeros(ts.local_shape, dtype=full.dtype)
                for pc in ts.pieces:
                    want[tuple(slice(o, o + b - a) for o, (a, b) in zip(pc.dst, pc.src))] = \
                        full[tuple(slice(a, b) for a, b in pc.src)]
                assert tensor_bytes(f.get_tensor(ts.name)) == tensor_bytes(want), (r, ts.name)
    # a dump refused on one rank is refused on every rank before any writes: rank 1 wrote
    # its file while rank 0 refused, which left a dump of two loads
    os.unlink(dump / "rank-00001.safetensors")
    before = (dump / "rank-00000.safetensors").read_bytes()
    again = list(cmd)
    again[again.index("--master-port") + 1] = str(free_port())
    p = subprocess.run(again, capture_output=True, text=True, timeout=HARD_TIMEOUT_S, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "phase dump-check: rank 0: SaveError" in p.stderr and "a dump file already exists" \
        in p.stderr, p.stderr
    assert sorted(os.listdir(dump)) == ["rank-00000.safetensors"]
    assert (dump / "rank-00000.safetensors").read_bytes() == before
    # the dump of a larger layout: refused without --overwrite, replaced whole with it
    (dump / "rank-00003.safetensors").write_bytes(b"old")
    again[again.index("--master-port") + 1] = str(free_port())
    p = subprocess.run(again + ["--overwrite"], capture_output=True, text=True,
                       timeout=HARD_TIMEOUT_S, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(os.listdir(dump)) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    # the checkpoint's own directory: its files would be read as part of the checkpoint
    mine = cmd[:cmd.index("--dump") + 1] + [ck, "--quiet"]
    mine[mine.index("--master-port") + 1] = str(free_port())
    p = subprocess.run(mine, capture_output=True, text=True, timeout=HARD_TIMEOUT_S, env=env)
    assert p.returncode == 1 and f"--dump {ck} is the checkpoint directory" in p.stderr, p.stderr
    assert not [n for n in os.listdir(ck) if n.startswith("rank-")]
    # --rank under torchrun is refused, each rank naming itself (not the --rank given), in
    # one agreed line
    mine = cmd[:cmd.index("--dump")] + ["--rank", "1", "--quiet"]
    mine[mine.index("--master-port") + 1] = str(free_port())
    p = subprocess.run(mine, capture_output=True, text=True, timeout=HARD_TIMEOUT_S, env=env)
    assert p.returncode == 1
    for r in range(2):
        assert (f"coordloader: rank {r}: phase arguments: ranks 0,1: LoadError: --rank is for "
                f"single-process use") in p.stderr, p.stderr
    # a wrong world size is one clean line, non-zero exit, no traceback
    bad = cmd[:cmd.index("--tp") + 1] + ["4", "--quiet"]
    bad[bad.index("--master-port") + 1] = str(free_port())
    p = subprocess.run(bad, capture_output=True, text=True, timeout=HARD_TIMEOUT_S, env=env)
    assert p.returncode != 0
    assert "launched with 2 ranks but the layout" in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("coordloader: rank")]
    assert len(lines) == 2, p.stderr
    # the ranks print one line each; a traceback (if any) is torchrun's own, none of ours
    assert "coordloader/load.py" not in p.stderr and "coordloader/engines" not in p.stderr
