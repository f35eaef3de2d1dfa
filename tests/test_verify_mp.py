"""Verification over real multi-process gloo runs (2 ranks, one spawned job, hard timeout):
every failure broken on purpose must make *every* rank raise VerifyError with the same
diagnosis (rank, tensor, check); plus an end-to-end ``load_detailed(verify="digest")`` on a
synthesized checkpoint whose shard had a byte flipped after its manifest was written."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from coordloader.dist.collective import free_port

from helpers import flip_byte
from ranks import spawn_and_wait

pytestmark = pytest.mark.slow   # rank processes over gloo

WORLD = 2


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    from test_verify import make_ckpt

    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.synth import synthesize
    from coordloader.verify.manifest import MANIFEST_NAME, write_manifest
    base = tmp_path_factory.mktemp("vmp")
    ok, _ = make_ckpt(base / "ok")
    write_manifest(read_checkpoint(ok))
    # flipped: a byte of w_col row 7 changed after the manifest was written
    flipped = str(base / "flipped")
    shutil.copytree(ok, flipped)
    meta = read_checkpoint(flipped)
    flip_byte(os.path.join(flipped, "model.safetensors"),
              meta.tensors["w_col"].pieces[0].start + 7 * 6 * 4 + 2, 0x21)
    # stale: the manifest claims a different size for the shard
    stale = str(base / "stale")
    shutil.copytree(ok, stale)
    mpath = os.path.join(stale, MANIFEST_NAME)
    doc = json.load(open(mpath))
    doc["files"][0]["size"] += 8
    doc["fingerprint"] = "0" * 64
    json.dump(doc, open(mpath, "w"))
    # a synthesized model, manifest, then one byte flipped in an expert tensor
    synth = synthesize(str(base / "q"), "qwen3_moe", "tiny")
    smeta = read_checkpoint(synth)
    write_manifest(smeta)
    target = next(n for n in smeta.tensors if ".experts.1.down_proj" in n)
    sp = smeta.tensors[target].pieces[0]
    flip_byte(os.path.join(synth, sp.file), (sp.start + sp.end) // 2, 0x21)
    return {"ok": ok, "flipped": flipped, "stale": stale, "synth": synth, "synth_target": target}


def _outcome(fn) -> dict:
    from coordloader.errors import CoordloaderError, VerifyError
    try:
        rep = fn()
        return {"ok": True, "checks": rep.get("checks"), "notes": rep.get("notes")}
    except VerifyError as e:
        return {"ok": False, "type": "VerifyError", "msg": str(e),
                "failures": [[f["rank"], f["tensor"], f["check"], f.get("ranks")]
                             for f in e.report.get("failures", [])]}
    except CoordloaderError as e:
        cause = getattr(e, "local_error", None)
        return {"ok": False, "type": type(e).__name__, "msg": str(e),
                "cause": type(cause).__name__ if cause is not None else None}


def _worker(rank: int, port: int, fx: dict, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist
    from safetensors.torch import load_file
    from test_verify import simulate_load, tp2_plan

    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.layout import Layout
    from coordloader.loader import load_detailed
    from coordloader.verify.checks import verify_rank
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.group.WORLD
    res: dict = {}
    try:
        meta = read_checkpoint(fx["ok"])
        plan = tp2_plan(meta)
        full = load_file(os.path.join(fx["ok"], "model.safetensors"))
        good = simulate_load(full, plan.rank(rank))

        def run(name, tensors, mode, m=meta):
            res[name] = _outcome(lambda: verify_rank(tensors, plan, rank, mode=mode, meta=m, group=pg))

        for mode in ("shapes", "digest", "full"):
            run(f"ok-{mode}", good, mode)
        # byte flipped in the shard after the manifest was written
        fmeta = read_checkpoint(fx["flipped"])
        ffull = load_file(os.path.join(fx["flipped"], "model.safetensors"))
        run("flipped-shapes", simulate_load(ffull, plan.rank(rank)), "shapes", fmeta)
        run("flipped-digest", simulate_load(ffull, plan.rank(rank)), "digest", fmeta)
        # every rank loads tp rank 0's slice (padding rows of rank 1 kept zero)
        tp0 = simulate_load(full, plan.rank(0))
        tp0["embed"][4:] = 0 if rank == 1 else tp0["embed"][4:]
        run("tp0-shapes", tp0, "shapes")
        run("tp0-digest", tp0, "digest")
        # a missing tensor on rank 1, an extra tensor on rank 0, padding on rank 1
        t = dict(good)
        if rank == 1:
            del t["w_col"]
        run("missing", t, "shapes")
        t = dict(good)
        if rank == 0:
            t["bogus"] = torch.zeros(3)
        run("extra", t, "shapes")
        t = {k: v.clone() for k, v in good.items()}
        if rank == 1:
            t["embed"][5, 0] = 1.0
        run("padding", t, "shapes")
        # a stale manifest is refused (shapes mode does not read it)
        smeta = read_checkpoint(fx["stale"])
        run("stale-digest", good, "digest", smeta)
        run("stale-shapes", good, "shapes", smeta)
        # end to end through the loader (cpu engine, its own phases and group)
        res["load-digest"] = _outcome(lambda: load_detailed(fx["synth"], Layout(tp=2), group=pg,
                                                            verify="digest", timeout=60).verify_report)
        res["load-shapes"] = _outcome(lambda: load_detailed(fx["synth"], Layout(tp=2), group=pg,
                                                            verify="shapes", timeout=60).verify_report)
    finally:
        with open(os.path.join(out_dir, f"vmp-{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def test_verify_failures_reach_every_rank(fixtures, tmp_path):
    spawn_and_wait(_worker, (free_port(), fixtures, str(tmp_path)), WORLD, "verify job")
    out = [json.load(open(tmp_path / f"vmp-{r}.json")) for r in range(WORLD)]
    if os.environ.get("COORDLOADER_VMP_DUMP"):
        print(json.dumps(out, indent=1))

    def same(name):
        """Every rank reached the same verdict; returns rank 0's outcome."""
        a = out[0][name]
        for o in out[1:]:
            assert o[name].get("ok") == a.get("ok") and o[name].get("failures") == a.get("failures"), \
                (name, out)
        return a

    def fails(name):
        return [tuple(f[:3]) for f in same(name)["failures"]]

    for mode in ("shapes", "digest", "full"):
        assert same(f"ok-{mode}")["ok"], out
    assert same("ok-digest")["checks"] == ["local", "cover", "digest-manifest"]
    assert same("flipped-shapes")["ok"]
    f = same("flipped-digest")
    # the flipped file's sampled data differs from the manifest's record: said first
    assert fails("flipped-digest") == [(None, None, "manifest"), (None, "w_col", "digest")]
    assert f["failures"][1][3] == [0, 1]
    assert "w_col" in f["msg"] and "differs from the manifest" in f["msg"]
    assert same("tp0-shapes")["ok"]
    assert {(t, c) for _, t, c in fails("tp0-digest")} == {
        ("embed", "digest"), ("w_col", "digest"), ("w_row", "digest")}
    assert (1, "w_col", "missing") in fails("missing")
    assert fails("extra") == [(0, "bogus", "unexpected")]
    assert fails("padding") == [(1, "embed", "padding")]
    assert fails("stale-digest") == [(None, None, "manifest")]
    assert "stale manifest" in same("stale-digest")["msg"]
    assert same("stale-shapes")["ok"]
    # through the loader: every rank stops, naming the corrupted tensor
    target = fixtures["synth_target"]
    for o in out:
        assert not o["load-digest"]["ok"] and target in o["load-digest"]["msg"], o["load-digest"]
        # load() raises the VerifyError itself (with its report), not the phase wrapper
        assert o["load-digest"]["type"] == "VerifyError", o["load-digest"]
        assert o["load-shapes"]["ok"]
