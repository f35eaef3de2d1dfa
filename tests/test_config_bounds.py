"""config.json values and layout sizes are bounded by what the checkpoint holds before
anything proportional to them is built: a huge num_hidden_layers, more experts than the
names hold, or tp=1e9 fail at once with a PlanError instead of allocating gigabytes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import coordloader as cl
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.errors import PlanError
from coordloader.layout import MAX_WORLD_SIZE, Layout

from ranks import REPO


def _with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        os.chmod(os.path.join(dst, f), 0o644)
    p = os.path.join(dst, "config.json")
    cfg = json.load(open(p))
    cfg.update(changes)
    with open(p, "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_num_hidden_layers_beyond_the_names_is_refused_fast(tiny_qwen3_moe, tmp_path):
    ck = _with_config(tiny_qwen3_moe, tmp_path / "c", num_hidden_layers=10**12)
    t0 = time.perf_counter()
    with pytest.raises(PlanError, match=r"num_hidden_layers=1000000000000 .* layers 0\.\.1 only"):
        cl.make_plan(ck, Layout(tp=2))
    assert time.perf_counter() - t0 < 10


def test_num_hidden_layers_below_the_names_is_refused_unless_mtp(tiny_qwen3_moe, tmp_path):
    """A config with fewer layers than the names had the extra layers left out as MTP
    layers: the load passed (verify full too) without layer 1."""
    ck = _with_config(tiny_qwen3_moe, tmp_path / "c", num_hidden_layers=1)
    with pytest.raises(PlanError) as e:
        cl.load(ck, Layout(), rank=0)
    assert str(e.value) == (
        "config.json: num_hidden_layers=1 (num_nextn_predict_layers=0) but the checkpoint's "
        "tensor names hold layers 0..1; expected the config of this checkpoint (layers past "
        "num_hidden_layers are only left out as MTP layers when num_nextn_predict_layers "
        "covers them)")
    # declared as an MTP layer, it is left out on purpose
    ck = _with_config(tiny_qwen3_moe, tmp_path / "m", num_hidden_layers=1,
                      num_nextn_predict_layers=1)
    plan = cl.make_plan(ck, Layout())
    assert plan.excluded and all(".layers.1." in n for n in plan.excluded)


def test_more_experts_in_config_than_in_the_names_is_refused(tiny_qwen3_moe, tmp_path):
    n = json.load(open(os.path.join(tiny_qwen3_moe, "config.json")))["num_experts"]
    ck = _with_config(tiny_qwen3_moe, tmp_path / "c", num_experts=2 * n)
    with pytest.raises(PlanError, match=rf"says {2 * n} experts .* expert ids 0\.\.{n - 1} only"):
        cl.make_plan(ck, Layout(tp=2, ep=2))


def test_layout_size_cap():
    Layout(tp=MAX_WORLD_SIZE)
    for kw in ({"tp": MAX_WORLD_SIZE + 1}, {"dp": 10**9}, {"pp": 10**12},
               {"tp": 256, "dp": 256, "pp": 2}):
        with pytest.raises(PlanError, match="exceeds the maximum"):
            Layout(**kw)


def test_tp_beyond_every_tensor_dim_is_refused(tiny_qwen3_moe):
    meta = read_checkpoint(tiny_qwen3_moe)
    big = max(max(t.shape) for t in meta.tensors.values() if t.shape)
    with pytest.raises(PlanError, match=f"tp={2 * big} exceeds the largest dim .* \\({big}\\)"):
        cl.make_plan(meta, Layout(tp=2 * big))


@pytest.mark.slow   # a subprocess
def test_plan_cli_huge_tp_fails_fast(tiny_qwen3_moe):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "coordloader.plan", tiny_qwen3_moe, "--tp",
                        "1000000000"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "tp=1000000000 exceeds the maximum" in p.stderr, p.stderr
    assert time.perf_counter() - t0 < 30

