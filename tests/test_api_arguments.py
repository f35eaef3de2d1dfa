"""The public API's arguments as users pass them: numpy integers where integers go, a
pathlib path where a path goes, and the mistakes (a rank's plan for a plan, a typo'd
keyword, a timeout of 0 with no group) refused by name, never a bare error from deep
inside or a value taken for another."""
from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np
import pytest
import torch

import coordloader as cl
from coordloader.errors import ConfigError, PlanError, SaveError


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_numpy_integers_make_the_same_layout(llama):
    """Layout(tp=np.int64(2)) was refused with "tp must be a positive integer, got
    np.int64(2)", while rank=np.int64(1) and numpy expert ids were taken."""
    got = cl.Layout(tp=np.int64(2), ep=np.int32(1), pp=np.uint8(1))
    assert got == cl.Layout(tp=2) and type(got.tp) is int and hash(got) == hash(cl.Layout(tp=2))
    assert cl.make_plan(llama, got).digest() == cl.make_plan(llama, cl.Layout(tp=2)).digest()
    for bad, shown in ((2.0, "2.0 (float)"), (True, "True (bool)"), ("2", "'2' (str)")):
        with pytest.raises(PlanError) as ei:
            cl.Layout(tp=bad)
        assert str(ei.value) == f"layout: tp must be a positive integer, got {shown}"


def test_a_boxed_tensor_takes_numpy_integers(tmp_path):
    """Boxed shapes and offsets computed with numpy were refused as not integers."""
    w = torch.arange(12.).reshape(4, 3)
    out = tmp_path / "out"
    cl.save(out, {"w": cl.Boxed(w, (np.int64(4), np.int64(3)), (np.int64(0), np.int32(0)))},
            config={"model_type": "toy"})
    got = cl.load(str(out), cl.Layout(), rules=[{"pattern": "w", "strategy": "replicate"}])
    assert torch.equal(got["w"], w)


def test_a_rule_file_given_as_a_pathlib_path(tmp_path, llama):
    """config= and the checkpoint took an os.PathLike, rules= refused one; bytes were
    parsed as a list of rules ("rule #0: expected an object")."""
    path = tmp_path / "rules.json"
    path.write_text(json.dumps([{"pattern": "*.o_proj.weight", "strategy": "rowwise"}]))
    as_str = cl.make_plan(llama, cl.Layout(tp=2), rules=str(path)).digest()
    assert cl.make_plan(llama, cl.Layout(tp=2), rules=pathlib.Path(path)).digest() == as_str
    with pytest.raises(PlanError, match="rules= must be a preset name, a rule file path"):
        cl.make_plan(llama, cl.Layout(tp=2), rules=os.fsencode(path))


@pytest.mark.parametrize("timeout", ["10", 0, -1, float("nan")])
def test_a_timeout_that_is_no_timeout_is_refused_without_a_group_too(tmp_path, llama, timeout):
    """Checked only when a group was adopted: alone, load(timeout=0) passed, and the same
    call failed first under torchrun."""
    with pytest.raises(ConfigError, match="timeout must be a"):
        cl.load(llama, cl.Layout(), timeout=timeout)
    with pytest.raises(ConfigError, match="timeout must be a"):
        cl.save(tmp_path / "out", {"w": torch.ones(2)}, config={"model_type": "toy"},
                timeout=timeout)
    assert not (tmp_path / "out").exists()


def test_a_rank_outside_the_plan_is_named(llama):
    plan = cl.make_plan(llama, cl.Layout(tp=2))
    assert plan.rank(np.int64(1)) is plan.ranks[1]
    for bad in (2, -1):   # -1 was the last rank's plan
        with pytest.raises(PlanError) as ei:
            plan.rank(bad)
        assert str(ei.value) == f"rank {bad} outside the plan's world of 2 (tp=2 pp=1 dp=1 ep=1)"
    with pytest.raises(PlanError, match="rank= must be an integer, got True"):
        plan.rank(True)


def test_save_refuses_what_is_not_a_plan(tmp_path, llama):
    """A rank's plan or a layout passed as the plan failed deep in the save with a bare
    AttributeError."""
    res = cl.load_detailed(llama, cl.Layout(tp=2), rank=0)
    for bad, hint in ((res.plan.rank(0), " (pass the whole plan, not plan.rank(r))"),
                      (cl.Layout(tp=2), "")):
        with pytest.raises(SaveError) as ei:
            cl.save(tmp_path / "out", res.tensors, bad, rank=0, config=llama)
        assert str(ei.value) == (f"rank 0: plan must be a coordloader Plan (make_plan(...), or "
                                 f"load_detailed(...).plan) or None, got "
                                 f"{type(bad).__name__}{hint}")
    assert not (tmp_path / "out").exists()


def test_load_into_names_a_typod_keyword(llama):
    """load_into(..., strcit=False) raised a TypeError naming the private _load_detailed()."""
    with pytest.raises(TypeError) as ei:
        cl.load_into({}, llama, cl.Layout(), strcit=False)
    assert str(ei.value).startswith("load_into() got an unexpected keyword argument 'strcit'; "
                                    "it takes name_map, strict and load()'s keywords: config, ")


def test_more_argument_mistakes_are_refused_by_name(tmp_path, llama):
    """write_manifest given the checkpoint's path, verify_rank given a plan's JSON or a
    path as meta, dump_rank given rank -1, load given group="gloo": bare AttributeError,
    TypeError or torch's ValueError, a verify "failure" of the manifest, or a file named
    rank--0001.safetensors."""
    import shutil

    from coordloader.errors import CollectiveError, VerifyError
    from coordloader.handoff.dump import dump_rank
    from coordloader.verify.checks import verify_rank
    ck = str(tmp_path / "ck")
    shutil.copytree(llama, ck)
    assert cl.write_manifest(ck) == os.path.join(ck, "coordloader.manifest.json")
    meta = cl.read_checkpoint(ck)
    for kw, msg in (({"jobs": "2"}, "jobs must be a positive integer, got '2'"),
                    ({"progress": True}, "progress must be a callable(name, info) or None, got bool")):
        with pytest.raises(VerifyError, match=re.escape(msg)):
            cl.write_manifest(meta, **kw)
    with pytest.raises(VerifyError, match=r"meta must be a CheckpointMeta \(read_checkpoint"):
        cl.write_manifest(3)
    res = cl.load_detailed(ck, cl.Layout(tp=2), rank=0)
    with pytest.raises(VerifyError, match="expected a Plan .* got dict"):
        verify_rank(res.tensors, res.plan.to_json(), 0)
    with pytest.raises(VerifyError, match="meta must be a CheckpointMeta .* got str"):
        verify_rank(res.tensors, res.plan, 0, mode="digest", meta=ck)
    with pytest.raises(SaveError, match="rank -1 outside the world of 2"):
        dump_rank(str(tmp_path / "dump"), -1, res.tensors, plan_digest=res.plan.digest(), world=2)
    # a name no reader takes (a lone surrogate), a value that is no tensor: refused before a
    # file is written (the first replaced a good dump with one every reader refuses)
    with pytest.raises(SaveError, match="lone surrogate"):
        dump_rank(str(tmp_path / "dump"), 0, {"\ud800": torch.ones(1)}, plan_digest="p")
    with pytest.raises(SaveError, match="the value of 'w' is list; expected a tensor"):
        dump_rank(str(tmp_path / "dump"), 0, {"w": [1.0]}, plan_digest="p")
    with pytest.raises(SaveError, match="dump_rank: layout must be a coordloader.Layout or a dict, "
                                        "got str"):
        dump_rank(str(tmp_path / "dump"), 0, {"w": torch.ones(1)}, plan_digest="p", layout="tp=2")
    assert not (tmp_path / "dump").exists()
    # a Layout, as every other entry point takes it (a bare TypeError from json before)
    path = dump_rank(str(tmp_path / "dump2"), 0, {"w": torch.ones(1)}, plan_digest="p",
                     layout=cl.Layout(tp=2), world=2, coords=cl.Layout(tp=2).coords(0))
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["coordloader.layout"])["tp"] == 2
        assert json.loads(f.metadata()["coordloader.coords"]) == cl.Layout(tp=2).coords(0).as_dict()
    with pytest.raises(CollectiveError, match="group= must be a torch.distributed ProcessGroup"):
        cl.load(ck, cl.Layout(), group="gloo")


_MANY_FILES = r'''
import os, resource, sys
import coordloader as cl
ck = sys.argv[1]
used = len(os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if sys.argv[2] == "tight":   # the files fit under the hard limit, the engines' spare not
    hard = used + 90
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, hard))   # 80 files: past it
seen = []
print(cl.write_manifest(ck, progress=lambda name, info: seen.append((name, info.shape))))
assert len(seen) == 80 and seen[0][1] == (4,), seen[:2]
assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == used + 40   # put back
'''


@pytest.mark.slow   # a subprocess each
@pytest.mark.parametrize("room", ["roomy", "tight"])
def test_write_manifest_makes_room_for_every_file_as_loads_do(tmp_path, room):
    """It held every file open with no room made: a checkpoint of more files than the
    soft descriptor limit left failed with "Too many open files" where load and
    consolidate raise the limit (and where the hard limit leaves room for the files but
    not the engines' spare, it goes on as it did). Its progress is called (name, info),
    as documented."""
    import subprocess
    import sys

    from stfiles import write_st
    ck = tmp_path / "ck"
    ck.mkdir()
    for i in range(80):
        write_st(str(ck / f"model-{i + 1:05d}-of-00080.safetensors"), [(f"w{i}", "F32", (4,))])
    script = tmp_path / "many.py"
    script.write_text(_MANY_FILES)
    p = subprocess.run([sys.executable, str(script), str(ck), room], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (ck / "coordloader.manifest.json").exists()


def test_the_planner_given_a_path_says_it_takes_metadata():
    """build_plan refused a path as "must be a path or CheckpointMeta, got str"."""
    from coordloader.planning.planner import build_plan
    with pytest.raises(PlanError) as e:
        build_plan("/tmp", cl.Layout())
    assert str(e.value) == ("checkpoint metadata must be a CheckpointMeta, got str "
                            "(coordloader.make_plan takes a path)")
