"""A checkpoint without config.json (issue 15, Found 4): one error naming the file and
the ways out, never a hint that leads to a silently replicated layout; --config / config=
supplies the file."""
from __future__ import annotations

import os
import shutil

import pytest

import coordloader as cl
from coordloader.cli import plan as plan_cli
from coordloader.errors import PlanError
from coordloader.layout import Layout


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("nocfg")
    src = cl.synthesize(str(base / "src"), "qwen3_moe", "tiny")
    bare = str(base / "bare")
    shutil.copytree(src, bare)
    os.unlink(os.path.join(bare, "config.json"))
    return src, bare


WAYS_OUT = (r"config\.json is missing from the checkpoint directory.*--config FILE.*"
            r"--rules PRESET together with --config FILE.*--replicate-unmatched is no fix.*whole "
            r"on every rank")


@pytest.mark.parametrize("rules", [None, "qwen3_moe"])
def test_missing_config_is_one_error_with_the_ways_out(ckpts, rules):
    _, bare = ckpts
    with pytest.raises(PlanError, match=WAYS_OUT) as e:
        cl.make_plan(bare, Layout(tp=2, ep=2), rules=rules)
    assert "lacks num_attention_heads" not in str(e.value)
    msg = str(e.value)
    assert msg.startswith("file config.json") and ("preset qwen3_moe needs" in msg) == bool(rules)


def test_config_argument_supplies_the_missing_file(ckpts):
    src, bare = ckpts
    want = cl.make_plan(src, Layout(tp=2, ep=2))
    cfg = os.path.join(src, "config.json")
    assert cl.make_plan(bare, Layout(tp=2, ep=2), config=cfg).digest() == want.digest()
    got = cl.load(bare, Layout(tp=2, ep=2), rank=1, config=cfg)
    ref = cl.load(src, Layout(tp=2, ep=2), rank=1)
    assert got.keys() == ref.keys() and all(got[k].equal(ref[k]) for k in ref)


def test_cli_config_flag_and_the_error_line(ckpts, capsys):
    src, bare = ckpts
    assert plan_cli.main([bare, "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert "config.json is missing" in err and "--config FILE" in err and err.count("\n") == 1
    assert plan_cli.main([bare, "--tp", "2", "--config", os.path.join(src, "config.json")]) == 0
