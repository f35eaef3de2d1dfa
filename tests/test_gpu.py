"""The instanttensor engine on a real GPU, compared with the cpu engine (skipped without
CUDA). One process: the default single load group (process_group=None) and the filtered
path (tensor_filter with exact names)."""
from __future__ import annotations

import pytest
import torch

from helpers import tensor_bytes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("arch,kw", [("qwen3_moe", dict(tp=2, ep=2)), ("llama", dict(tp=2)),
                                     ("deepseek_v3", dict(dp=2, ep=2, ep_spans_dp=True))])
def test_instanttensor_equals_cpu_engine(tmp_path, arch, kw):
    from coordloader.api import make_plan
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.engines import select_engine
    from coordloader.layout import Layout
    from coordloader.planning.model import LoadGroup, Plan
    from coordloader.synth import synthesize
    ck = synthesize(str(tmp_path / arch), arch, "tiny")
    meta = read_checkpoint(ck)
    plan = make_plan(meta, Layout(**kw))
    files = tuple(f.name for f in meta.files)
    single = Plan(plan.layout, plan.fingerprint, plan.ranks, plan.excluded, ())
    filtered = Plan(plan.layout, plan.fingerprint, plan.ranks, plan.excluded,
                    (LoadGroup(files, tuple(range(plan.world_size)), "filtered"),))
    for rank in range(plan.world_size):
        rp = plan.rank(rank)
        want, _ = select_engine("cpu").load_rank(meta, rp, "cpu")
        for p in (single, filtered):
            got, stats = select_engine("instanttensor", "cuda:0", plan=p).load_rank(
                meta, rp, "cuda:0")
            assert sorted(got) == sorted(want)
            for name, t in got.items():
                assert t.device.type == "cuda"
                assert tensor_bytes(t) == tensor_bytes(want[name]), (rank, name)
            assert stats.bytes_held == rp.bytes_held


def test_load_auto_picks_instanttensor_on_cuda(tmp_path):
    from coordloader.layout import Layout
    from coordloader.loader import load_detailed
    from coordloader.synth import synthesize
    ck = synthesize(str(tmp_path / "q"), "qwen3_moe", "tiny")
    res = load_detailed(ck, Layout(tp=2, ep=2), rank=1, verify="shapes")
    assert res.stats.engine == "instanttensor"
    ref = load_detailed(ck, Layout(tp=2, ep=2), rank=1, engine="cpu", device="cpu")
    assert all(tensor_bytes(res.tensors[k]) == tensor_bytes(v) for k, v in ref.tensors.items())
