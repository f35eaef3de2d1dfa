"""Verification, single process: each failure is broken on purpose and the exact diagnosis
asserted. A 2-rank world is simulated by running every rank's local share
(``local_payload``) and the shared verdict (``evaluate``) — the same two functions
``verify_rank`` runs around its one all_gather."""
from __future__ import annotations

import dataclasses
import os
import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordloader.checkpoint.reader import read_checkpoint
from coordloader.errors import VerifyError
from coordloader.layout import Layout
from coordloader.planning.model import Piece, Plan, RankPlan, TensorSlice
from coordloader.verify import checks as vf
from coordloader.verify.manifest import load_manifest, write_manifest

from helpers import flip_byte, flip_data_bytes


def make_ckpt(root):
    g = torch.Generator().manual_seed(7)
    ts = {
        "embed": torch.randn(10, 8, generator=g).to(torch.bfloat16),   # vocab 10, padded to 12
        "w_col": torch.randn(8, 6, generator=g),
        "w_row": torch.randn(6, 8, generator=g).to(torch.bfloat16),
        "norm": torch.randn(8, generator=g).to(torch.float16),
    }
    os.makedirs(root, exist_ok=True)
    save_file(ts, os.path.join(root, "model.safetensors"))
    return str(root), ts


def ts_(name, dtype, gshape, lshape, pieces, replica=0, strategy="colwise"):
    return TensorSlice(name, "model.safetensors", dtype, tuple(gshape), tuple(lshape),
                       tuple(Piece(tuple(map(tuple, s)), tuple(d)) for s, d in pieces), replica, (),
                       strategy)


def tp2_plan(meta) -> Plan:
    ranks = []
    for r in range(2):
        emb_rows = (6 * r, min(6 * r + 6, 10))
        tensors = (
            ts_("embed", "BF16", (10, 8), (6, 8), [((emb_rows, (0, 8)), (0, 0))], strategy="vocab"),
            ts_("norm", "F16", (8,), (8,), [(((0, 8),), (0,))], replica=r, strategy="replicate"),
            ts_("w_col", "F32", (8, 6), (4, 6), [(((4 * r, 4 * r + 4), (0, 6)), (0, 0))]),
            ts_("w_row", "BF16", (6, 8), (6, 4), [(((0, 6), (4 * r, 4 * r + 4)), (0, 0))],
                strategy="rowwise"),
        )
        ranks.append(RankPlan(r, {"tp": r, "dp": 0, "pp": 0, "ep": 0, "moe_tp": 0},
                              tuple(with_runs(meta, t) for t in tensors)))
    return Plan(Layout(tp=2), meta.fingerprint(), tuple(ranks))


def with_runs(meta, ts: TensorSlice) -> TensorSlice:
    """``ts`` with the byte runs of its pieces, as the planner gives them."""
    import dataclasses

    from coordloader.checkpoint.dtypes import itemsize
    from coordloader.planning.runs import slice_runs
    runs = slice_runs(meta.tensors[ts.name], ts.pieces, ts.local_shape, itemsize(ts.dtype))
    return dataclasses.replace(ts, byte_runs=runs)


def simulate_load(full: dict, rank_plan) -> dict:
    """What a correct engine produces for ``rank_plan`` (zero padding included)."""
    out = {}
    for ts in rank_plan.tensors:
        src = full[ts.name]
        local = torch.zeros(ts.local_shape, dtype=src.dtype)
        for p in ts.pieces:
            dst = tuple(slice(o, o + b - a) for o, (a, b) in zip(p.dst, p.src))
            local[dst] = src[tuple(slice(a, b) for a, b in p.src)]
        out[ts.name] = local
    return out


def world(per_rank, plan, mode, meta=None, manifest=None, manifest_error=None):
    payloads = [vf.local_payload(per_rank[r], plan.rank(r), mode, meta=meta)
                for r in range(plan.world_size)]
    # payloads travel through all_gather_object: they must pickle
    payloads = pickle.loads(pickle.dumps(payloads))
    return vf.evaluate(payloads, mode, meta=meta, manifest=manifest, manifest_error=manifest_error,
                       excluded=plan.excluded)


def checks(report):
    return [(f["rank"], f["tensor"], f["check"]) for f in report["failures"]]


@pytest.fixture
def setup(tmp_path):
    root, full = make_ckpt(tmp_path / "ck")
    meta = read_checkpoint(root)
    write_manifest(meta)
    man = load_manifest(root, meta)
    plan = tp2_plan(meta)
    loaded = [simulate_load(full, plan.rank(r)) for r in range(2)]
    return root, full, meta, man, plan, loaded


def test_correct_load_passes_every_mode(setup):
    root, full, meta, man, plan, loaded = setup
    for mode in ("shapes", "digest", "full"):
        rep = world(loaded, plan, mode, meta=meta, manifest=man)
        assert rep["ok"], rep["failures"]
    rep = world(loaded, plan, "digest", meta=meta, manifest=man)
    assert rep["checks"] == ["local", "cover", "digest-manifest"]
    assert rep["stats"]["bytes_digested"] > 0


def test_verify_rank_refuses_arguments_it_cannot_check_by(setup):
    """A rank past the plan was a bare IndexError, a negative one checked the last
    rank's plan and named it; a manifest path was a bare AttributeError, a list of tensors
    a torch shape error reported as a verify failure, a bool rank a bare TypeError."""
    import numpy as np
    root, full, meta, man, plan, loaded = setup
    for args, kw, msg in [
            ((5,), {}, "rank=5 outside the plan's world of 2"),
            ((-1,), {}, "rank=-1 outside the plan's world of 2"),
            ((True,), {}, "verify_rank: unexpected positional argument True; expected this rank "
                          "(an integer) or the mode (a str)"),
            ((0,), {"manifest": os.path.join(root, "coordloader.manifest.json")},
             "verify_rank: manifest must be a Manifest (verify.manifest.load_manifest), None "
             "or False, got str"),
            ((), {}, "verify_rank: a whole Plan needs this process's rank")]:
        with pytest.raises(VerifyError) as e:
            vf.verify_rank(loaded[0], plan, *args, mode="digest", meta=meta, **kw)
        assert str(e.value) == msg
    with pytest.raises(VerifyError) as e:
        vf.verify_rank(list(loaded[0].values()), plan, 0, mode="digest", meta=meta)
    assert str(e.value) == ("verify_rank: tensors must be a mapping of names to tensors, got "
                            "list")
    # a numpy integer is a rank: the rank whose tensors these are passes, the other not
    assert vf.verify_rank(loaded[1], plan, np.int64(1), mode="digest", meta=meta)["ok"]
    with pytest.raises(VerifyError):
        vf.verify_rank(loaded[1], plan, np.int64(0), mode="digest", meta=meta)


def test_flipped_byte_after_manifest_names_the_tensor(setup):
    root, full, meta, man, plan, loaded = setup
    path = os.path.join(root, "model.safetensors")
    meta_w = meta.tensors["w_col"].pieces[0]
    # flip a byte inside w_col rows 4..8 (rank 1's slice): last row's first element
    flip_byte(path, meta_w.start + (7 * 6) * 4 + 1)
    meta2 = read_checkpoint(root)
    assert meta2.fingerprint() == meta.fingerprint()          # headers/sizes unchanged
    full2 = load_file(path)
    loaded2 = [simulate_load(full2, plan.rank(r)) for r in range(2)]
    # shapes: nothing to see
    assert world(loaded2, plan, "shapes", meta=meta2, manifest=man)["ok"]
    rep = world(loaded2, plan, "digest", meta=meta2, manifest=man)
    # the manifest holds whole-tensor digests: the sum is wrong, every holder is named,
    # after the file whose sampled data is not the manifest's any more
    assert checks(rep) == [(None, None, "manifest"), (None, "w_col", "digest")]
    assert rep["failures"][0]["detail"].startswith("file model.safetensors holds other data")
    assert rep["failures"][1]["ranks"] == [0, 1]
    assert "differs from the manifest" in rep["failures"][1]["detail"]
    assert "rank 1 piece 0 [4:8,0:6]" in rep["failures"][1]["detail"]
    # full mode re-reads the (now flipped) file and finds the loaded bytes equal to it; the
    # manifest still flags the content. With the pre-flip tensors loaded, full pinpoints it.
    rep = world(loaded, plan, "full", meta=meta2, manifest=None, manifest_error=None)
    assert checks(rep) == [(1, "w_col", "bytes")]
    f = rep["failures"][0]
    assert f["piece"] == 0 and "first at global index [7, 0]" in f["detail"]


@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_without_a_group_compares_what_it_holds_whole(setup, rank):
    """One rank checked alone (no process group): the manifest comparison was skipped for
    every tensor, so a flipped byte in a tensor the rank holds whole (norm: primary on
    rank 0, replica on rank 1) passed verify=digest."""
    root, full, meta, man, plan, loaded = setup
    rep = vf.verify_rank(loaded[rank], plan, "digest", meta=meta, manifest=man, rank=rank)
    assert rep["checks"] == ["local", "plan cover", "digest-manifest"]
    assert rep["manifest"] == (f"compared with {man.path} (3 tensor(s) split over ranks with "
                               f"the rest of each re-read from the checkpoint: no process "
                               f"group)")
    bad = {k: v.clone() for k, v in loaded[rank].items()}
    bad["norm"].view(torch.int16)[3] ^= 0x40
    with pytest.raises(VerifyError) as e:
        vf.verify_rank(bad, plan, "digest", meta=meta, manifest=man, rank=rank)
    assert checks(e.value.report) == [(rank, "norm", "digest")]
    assert "content differs from the manifest" in e.value.report["failures"][0]["detail"]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", ["w_col", "w_row", "embed"])
def test_one_rank_without_a_group_proves_its_pieces_of_split_tensors(setup, rank, name):
    """A tensor split over ranks has one manifest digest, the sum over every rank's
    pieces: a rank checked alone skipped it, so verify=digest passed a flipped byte in
    its own share (load(..., rank=r) without a process group returned it)."""
    root, full, meta, man, plan, loaded = setup
    bad = {k: v.clone() for k, v in loaded[rank].items()}
    bad[name].view(-1)[:1].view(torch.int8)[0] ^= 0x40   # first element this rank holds
    with pytest.raises(VerifyError) as e:
        vf.verify_rank(bad, plan, "digest", meta=meta, manifest=man, rank=rank)
    assert checks(e.value.report) == [(rank, name, "digest")]
    detail = e.value.report["failures"][0]["detail"]
    assert detail.startswith("content differs from the manifest: this rank's pieces ")
    assert "the rest of the tensor re-read from the checkpoint" in detail


@pytest.mark.parametrize("sides", [(("digest", True), ("digest", False)),
                                   (("digest", True), ("shapes", True))],
                         ids=["manifest-on-one-rank", "other-modes"])
def test_ranks_verifying_against_other_modes_or_manifests_fail_together(setup, monkeypatch,
                                                                        sides):
    """verify_rank over a group, rank 1 holding a flipped byte of w_col: with the manifest
    on rank 0 only (node-local copies), or rank 1 in mode shapes, each rank's verdict
    rested on its own mode and manifest: rank 0 failed, rank 1 passed (or rank 0 passed,
    noting the digests it missed). Every rank now fails, naming the difference."""
    import torch.distributed as dist
    root, full, meta, man, plan, loaded = setup
    bad = [loaded[0], {k: v.clone() for k, v in loaded[1].items()}]
    bad[1]["w_col"].view(-1)[:1].view(torch.int8)[0] ^= 0x40
    monkeypatch.setattr(vf, "_process_group", lambda group: group)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    shared = {}

    def call(rank, gather):
        monkeypatch.setattr(dist, "all_gather_object", gather)
        mode, has = sides[rank]
        return vf.verify_rank(bad[rank], plan, mode, meta=meta, rank=rank, group="pg",
                              manifest=man if has else False)

    for rank in (0, 1):   # each rank's payload, as the gather would carry it
        def keep(out, obj, group=None, rank=rank):
            shared[rank] = pickle.loads(pickle.dumps(obj))
            raise RuntimeError("captured")
        with pytest.raises(Exception, match="captured"):
            call(rank, keep)
    reports = []
    for rank in (0, 1):
        def both(out, obj, group=None):
            out[:] = [shared[0], shared[1]]
        with pytest.raises(VerifyError) as e:
            call(rank, both)
        reports.append(e.value.report)
    assert reports[0]["failures"] == reports[1]["failures"]
    # what differs, and no more
    differs = (r"manifest: rank 0 '[0-9a-f]{12}', rank 1 'none'" if sides[1][1] is False
               else "mode: rank 0 'digest', rank 1 'shapes'")
    agreement = [f for f in reports[0]["failures"] if f["check"] == "agreement"]
    assert len(agreement) == 1 and re.fullmatch(
        rf"the ranks verified against different modes or manifests \({differs}\): every "
        rf"rank must verify alike, against the same manifest", agreement[0]["detail"]), agreement


def test_node_local_copies_with_the_same_unreadable_manifest_agree(tmp_path, monkeypatch):
    """Review of the agreement: two node-local copies at other paths, both holding the same
    stale manifest. The error each rank read names its own path, so the ranks were called
    to verify against different manifests and the stale manifest went unreported."""
    import json

    import torch.distributed as dist

    from coordloader.errors import CollectiveError
    metas = []
    for node in "ab":
        root, full = make_ckpt(tmp_path / node)
        path = write_manifest(read_checkpoint(root))
        doc = json.loads(open(path).read())
        doc["fingerprint"] = "0" * 64
        open(path, "w").write(json.dumps(doc))
        metas.append(read_checkpoint(root))
    plan = tp2_plan(metas[0])
    loaded = [simulate_load(full, plan.rank(r)) for r in range(2)]
    monkeypatch.setattr(vf, "_process_group", lambda group: group)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    shared = {}
    for rank in (0, 1):
        def keep(out, obj, group=None, rank=rank):
            shared[rank] = pickle.loads(pickle.dumps(obj))
            raise RuntimeError("captured")
        monkeypatch.setattr(dist, "all_gather_object", keep)
        with pytest.raises(CollectiveError, match="captured"):
            vf.verify_rank(loaded[rank], plan, rank, mode="digest", meta=metas[rank], group="pg")
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [shared[0],
                                                                                  shared[1]]))
    with pytest.raises(VerifyError) as e:
        vf.verify_rank(loaded[0], plan, 0, mode="digest", meta=metas[0], group="pg")
    assert [f["check"] for f in e.value.report["failures"]] == ["manifest"]
    assert "stale manifest" in e.value.report["failures"][0]["detail"]
    # a rank that returned at once (mode none) sent no payload: named, not a bare error
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [shared[0],
                                                                                  {"ok": True}]))
    with pytest.raises(CollectiveError) as e:
        vf.verify_rank(loaded[0], plan, 0, mode="digest", meta=metas[0], group="pg")
    assert str(e.value) == ("rank 0: verify: rank 1 sent no findings to the exchange (not in "
                            "verify_rank, or called with mode 'none', which exchanges "
                            "nothing); every rank must verify alike")


def test_a_load_agreed_on_mode_and_manifest_hashes_no_basis(setup, monkeypatch):
    """load agrees on the mode and the manifest's bytes before the load: its verify_rank
    (agreed=True) does not hash the manifest's digests again."""
    import torch.distributed as dist
    root, full, meta, man, plan, loaded = setup
    monkeypatch.setattr(vf, "_process_group", lambda group: group)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj]))

    def hashed(*a):
        raise AssertionError("hashed the manifest")
    monkeypatch.setattr(vf, "basis", hashed)
    one = Plan(plan.layout, plan.fingerprint, (plan.rank(0),))
    with pytest.raises(AssertionError, match="hashed the manifest"):
        vf.verify_rank(loaded[0], one, 0, mode="digest", meta=meta, group="pg")
    with pytest.raises(VerifyError, match=r"\[cover\]"):   # one rank of two: not hashed
        vf.verify_rank(loaded[0], one, 0, mode="digest", meta=meta, group="pg", agreed=True)


def test_one_rank_alone_counts_what_it_compared(tmp_path):
    """The note of a rank checked alone counted the split tensors re-read with their rest
    among those it "holds whole", and a zero-element split tensor as not compared."""
    import coordloader as cl
    ts = {"a": torch.randn(4, 4), "b": torch.randn(4, 4), "z": torch.zeros(0, 4),
          "r": torch.randn(4), "s": torch.randn(6, 2)}
    save_file(ts, str(tmp_path / "model.safetensors"))
    write_manifest(read_checkpoint(str(tmp_path)))
    rules = [{"pattern": p, "strategy": "colwise"} for p in "abz"] + [
        {"pattern": "r", "strategy": "replicate"},
        {"pattern": "s", "strategy": "colwise", "params": {"dim": 1}}]
    rep = cl.load_detailed(str(tmp_path), Layout(tp=2), rank=1, verify="digest",
                           rules=rules).verify_report
    assert rep["manifest"] == (f"compared with {tmp_path}/coordloader.manifest.json (4 "
                               f"tensor(s) split over ranks with the rest of each re-read "
                               f"from the checkpoint: no process group)")


def test_load_of_one_rank_without_a_group_refuses_a_flipped_byte_it_holds(tmp_path):
    """Through the public API, as reported: load(..., rank=0, verify="digest") with no
    process group returned the flipped value of a split tensor."""
    import coordloader as cl
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    save_file({"w": w, "v": torch.arange(8.0)}, str(tmp_path / "model.safetensors"))
    rules = [{"pattern": "w", "strategy": "colwise"}, {"pattern": "v", "strategy": "replicate"}]
    cl.write_manifest(cl.read_checkpoint(str(tmp_path)))
    for r in (0, 1):
        got = cl.load(str(tmp_path), Layout(tp=2), rank=r, rules=rules, verify="digest")
        assert torch.equal(got["w"], w[2 * r:2 * r + 2])
    off = read_checkpoint(str(tmp_path)).tensors["w"].pieces[0].start + 2 * 4 * 4   # w[2, 0]
    flip_byte(tmp_path / "model.safetensors", off)
    with pytest.raises(VerifyError) as e:
        cl.load(str(tmp_path), Layout(tp=2), rank=1, rules=rules, verify="digest")
    # the file's sampled data differs from the manifest's record: said first
    assert checks(e.value.report) == [(None, None, "manifest"), (1, "w", "digest")]
    assert e.value.report["failures"][0]["detail"].startswith(
        "file model.safetensors holds other data than when the manifest was written")


def _dcp_ckpt(root) -> torch.Tensor:
    """torch DCP's HF output: ``w`` (8x4 F32) as rows 0-4 and 4-8 in two per-rank files,
    each piece stored under the plain name ``w``. -> the full tensor."""
    import json
    os.makedirs(root)
    w = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    for r in range(2):
        save_file({"w": w[4 * r:4 * r + 4].contiguous()},
                  os.path.join(root, f"shard-0000{r + 1}-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [4 * r, 0]}})})
    return w


def test_full_and_digest_re_read_dcp_pieces_under_their_stored_key(tmp_path):
    """The re-reads of verify=full and of a rank's rest for verify=digest asked the files
    for ``w@0:4,0:4`` (coordloader's sharded key, rebuilt from the box), which torch DCP's
    files do not hold: a false VerifyError on an intact checkpoint."""
    import coordloader as cl
    root = str(tmp_path / "dcp")
    w = _dcp_ckpt(root)
    rep, col = [{"pattern": "w", "strategy": "replicate"}], [{"pattern": "w", "strategy": "colwise"}]
    got = cl.load(root, Layout(tp=1), rank=0, engine="cpu", verify="full", rules=rep)
    assert torch.equal(got["w"], w)
    cl.write_manifest(cl.read_checkpoint(root))
    for r in (0, 1):   # one rank without a group: re-reads the rows the other rank holds
        got = cl.load(root, Layout(tp=2), rank=r, engine="cpu", verify="digest", rules=col)
        assert torch.equal(got["w"], w[4 * r:4 * r + 4])
    # the re-read is of the right bytes: a flipped byte of the second file is named there
    f2 = os.path.join(root, "shard-00002-model-00001-of-00001.safetensors")
    flip_byte(f2, read_checkpoint(root).tensors["w"].pieces[1].start + 4 * 4 + 4)   # w[5, 1]
    loaded = {"w": w.clone()}
    meta = read_checkpoint(root)
    plan = cl.make_plan(meta, Layout(tp=1), rules=rep)
    with pytest.raises(VerifyError) as e:
        vf.verify_rank(loaded, plan, "full", meta=meta, rank=0)
    assert checks(e.value.report) == [(0, "w", "bytes")], e.value.report
    detail = e.value.report["failures"][0]["detail"]
    assert detail == ("1 element(s) differ from shard-00002-model-00001-of-00001.safetensors "
                      "in [4:8,0:4]; first at global index [5, 1]: holds bits 0x41a80000, "
                      "checkpoint has 0x41a80040")   # 21.0, its low byte flipped


def test_a_rank_checked_alone_names_a_checkpoint_it_cannot_re_read(setup):
    root, full, meta, man, plan, loaded = setup
    os.rename(os.path.join(root, "model.safetensors"), os.path.join(root, "moved"))
    with pytest.raises(VerifyError) as e:
        vf.verify_rank(loaded[0], plan, "digest", meta=meta, manifest=man, rank=0)
    # one finding for the file, not one per tensor it stores
    assert [(f["tensor"], f["check"], f["detail"]) for f in e.value.report["failures"]] == [
        (None, "file", "model.safetensors: cannot re-read it, so the pieces it stores are not "
                       "checked: cannot open: No such file or directory")]



@pytest.mark.parametrize("mode", ["digest", "full"])
def test_one_rank_without_a_group_checks_the_plans_cover(setup, mode):
    """A rank checked alone skipped the global cover: a plan giving rank 1 rank 0's rows
    of w_col (and leaving rows 4-8 to no rank) passed digest and full, each proving only
    that the bytes match the boxes the plan gave (the digest re-reads the complement of
    whatever the rank holds). The content modes check the plan's cover; shapes, the
    default, does not pay for it (seconds for an ep_spans_dp DeepSeek-V3 plan)."""
    import dataclasses
    root, full, meta, man, plan, loaded = setup
    r1 = plan.rank(1)
    wrong = dataclasses.replace(r1, tensors=tuple(
        with_runs(meta, dataclasses.replace(t, pieces=(Piece(((0, 4), (0, 6)), (0, 0)),)))
        if t.name == "w_col" else t for t in r1.tensors))
    bad_plan = dataclasses.replace(plan, ranks=(plan.rank(0), wrong))
    got = simulate_load(full, wrong)   # the bytes the wrong plan asks for, read right
    with pytest.raises(VerifyError) as e:
        vf.verify_rank(got, bad_plan, mode, meta=meta, manifest=man, rank=1)
    assert checks(e.value.report) == [(1, "w_col", "cover")]
    assert e.value.report["failures"][0]["detail"] == (
        "the plan: duplicated primary: boxes [0:4,0:6] and [0:4,0:6] overlap (ranks 0 and 1; "
        "tensor shape [8, 6])")
    rep = vf.verify_rank(loaded[1], plan, mode, meta=meta, manifest=man, rank=1)
    assert rep["ok"] and "plan cover" in rep["checks"]
    assert rep["notes"][0] == ("the plan's cover checked, not the other ranks' tensors (no "
                               "process group)")
    # checked on rank 0, the fault is rank 1's slice: named so
    with pytest.raises(VerifyError) as e:
        vf.verify_rank(loaded[0], bad_plan, mode, meta=meta, manifest=man, rank=0)
    assert checks(e.value.report) == [(1, "w_col", "cover")]
    rep = vf.verify_rank(got, bad_plan, "shapes", meta=meta, rank=1)
    assert rep["ok"] and rep["checks"] == ["local"]
    assert rep["notes"][0] == ("global cover skipped: only this rank's share was checked (no "
                               "process group)")

def test_rank_plan_form_alone_checks_one_share_not_the_whole(setup):
    """verify_rank(tensors, rank_plan, mode) on one rank of tp=2 ran the global cover over
    that rank's share alone and failed a correct load ("held by no rank")."""
    root, full, meta, man, plan, loaded = setup
    rep = vf.verify_rank(loaded[0], plan.rank(0), "digest", meta=meta, manifest=man)
    assert rep["ok"] and rep["checks"] == ["local", "digest-manifest"]
    assert rep["notes"][0] == ("global cover skipped: only this rank's share was checked (no "
                               "process group)")


def test_every_rank_loading_tp_rank0_slice(setup):
    root, full, meta, man, plan, loaded = setup
    wrong = [loaded[0], {k: v.clone() for k, v in loaded[0].items()}]
    # rank 1's embed must still be zero-padded (rank 0's slice has no padding): the shapes
    # match, so the local check passes apart from padding
    wrong[1]["embed"][4:] = 0
    rep = world(wrong, plan, "shapes", meta=meta, manifest=man)
    assert rep["ok"], rep["failures"]
    rep = world(wrong, plan, "digest", meta=meta, manifest=man)
    bad = {(t, c) for _, t, c in checks(rep)}
    assert bad == {("embed", "digest"), ("w_col", "digest"), ("w_row", "digest")}
    # without a manifest the only evidence is replicas (norm is identical): it says so
    rep = world(wrong, plan, "digest", meta=meta, manifest=None)
    assert rep["ok"] and "no manifest" in rep["manifest"]


def test_missing_tensor(setup):
    root, full, meta, man, plan, loaded = setup
    del loaded[1]["w_col"]
    rep = world(loaded, plan, "shapes", meta=meta)
    assert (1, "w_col", "missing") in checks(rep)
    cover = [f for f in rep["failures"] if f["check"] == "cover"]
    assert cover and cover[0]["tensor"] == "w_col" and "held by no rank: [4:8,0:6]" in cover[0]["detail"]


def test_extra_tensor(setup):
    root, full, meta, man, plan, loaded = setup
    loaded[0]["bogus"] = torch.zeros(2)
    rep = world(loaded, plan, "shapes", meta=meta)
    assert checks(rep) == [(0, "bogus", "unexpected")]


def test_wrong_dtype_and_shape(setup):
    root, full, meta, man, plan, loaded = setup
    loaded[0]["w_col"] = loaded[0]["w_col"].to(torch.float16)
    loaded[1]["w_row"] = loaded[1]["w_row"][:, :3]
    rep = world(loaded, plan, "digest", meta=meta, manifest=man)
    assert checks(rep) == [(0, "w_col", "shape"), (1, "w_row", "shape")]
    assert "F16" in rep["failures"][0]["detail"] and "[6, 3]" in rep["failures"][1]["detail"]


def test_padding_rows_not_zero(setup):
    root, full, meta, man, plan, loaded = setup
    loaded[1]["embed"][5, 3] = -0.0      # bits non-zero although the value compares equal
    rep = world(loaded, plan, "shapes", meta=meta)
    assert checks(rep) == [(1, "embed", "padding")]
    assert "[4:6,0:8]" in rep["failures"][0]["detail"]


def test_replica_differs_from_primary_without_manifest(setup):
    """Without a manifest nothing says which copy is wrong: both ranks are named."""
    root, full, meta, man, plan, loaded = setup
    loaded[1]["norm"][2] += 1
    rep = world(loaded, plan, "digest", meta=meta, manifest=None)
    assert checks(rep) == [(None, "norm", "digest")] and rep["failures"][0]["ranks"] == [0, 1]
    detail = rep["failures"][0]["detail"]
    assert " on rank 1 (piece 0) differs from the primary copy on rank 0 (piece 0): " in detail
    assert detail.endswith("; either may be the wrong one (no manifest says which; "
                           "verify='full' compares each with the checkpoint)")


def test_a_replica_mismatch_says_why_no_copy_is_blamed(setup):
    """A manifest without the tensor cannot say which copy is wrong: the message says that,
    not that there is no manifest."""
    import dataclasses
    root, full, meta, man, plan, loaded = setup
    loaded[1]["norm"][2] += 1
    partial = dataclasses.replace(man, tensors={n: d for n, d in man.tensors.items()
                                                if n != "norm"})
    rep = world(loaded, plan, "digest", meta=meta, manifest=partial)
    assert checks(rep) == [(None, "norm", "digest"), (None, "norm", "digest")]
    assert rep["failures"][0]["detail"] == "not in the manifest"
    assert "either may be the wrong one (the manifest has no entry for this tensor; " in \
        rep["failures"][1]["detail"]


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_the_intact_copy_is_not_blamed(setup, bad_rank):
    """norm: primary on rank 0, replica on rank 1. A corrupted primary blamed rank 1, the
    intact replica, alone (rank=1); the manifest finding named no single rank. Now the
    replica is blamed alone only when the primaries match the manifest."""
    root, full, meta, man, plan, loaded = setup
    loaded[bad_rank]["norm"].view(torch.int16)[3] ^= 0x40
    rep = world(loaded, plan, "digest", meta=meta, manifest=man)
    fl = rep["failures"]
    if bad_rank == 1:
        assert checks(rep) == [(1, "norm", "digest")]
        assert "whose content matches the manifest" in fl[0]["detail"]
    else:
        assert checks(rep) == [(None, "norm", "digest"), (0, "norm", "digest")]
        assert fl[0]["ranks"] == [0, 1] and "the primaries differ from the manifest too" in \
            fl[0]["detail"]
        assert "content differs from the manifest" in fl[1]["detail"]


def test_rank_with_a_different_plan_breaks_the_cover(setup):
    root, full, meta, man, plan, loaded = setup
    # rank 1 planned (and loaded) as if it were tp rank 0
    p0 = plan.rank(0)
    bogus = Plan(plan.layout, plan.fingerprint, (p0, RankPlan(1, p0.coords, tuple(
        t if t.name != "norm" else plan.rank(1).by_name()["norm"] for t in p0.tensors))))
    rep = world([loaded[0], loaded[0]], bogus, "shapes", meta=meta)
    msgs = {(f["tensor"], f["check"]) for f in rep["failures"]}
    assert ("w_col", "cover") in msgs and ("embed", "cover") in msgs
    assert any("overlap" in f["detail"] for f in rep["failures"])



def test_a_dp_replica_holding_another_ranks_part_breaks_the_cover(setup):
    """tp=2 dp=2, rank 3 (tp 1 of dp replica 1) planned and loaded as rank 2, with the same
    replica ids: each of its pieces equals a primary piece, but replica 1 holds tp shard 0
    twice and tp shard 1 on no rank. The gathered cover passed it."""
    root, full, meta, man, plan, loaded = setup
    ranks = []
    for r in range(4):
        tp, dp = r % 2, r // 2
        rp = plan.rank(tp)
        ranks.append(RankPlan(r, dict(rp.coords, dp=dp), tuple(
            dataclasses.replace(t, replica=r if t.name == "norm" else dp) for t in rp.tensors)))
    good = Plan(Layout(tp=2, dp=2), plan.fingerprint, tuple(ranks))
    rep = world([simulate_load(full, good.rank(r)) for r in range(4)], good, "digest", meta=meta,
                manifest=man)
    assert rep["ok"], rep["failures"]
    bad = Plan(good.layout, good.fingerprint,
               good.ranks[:3] + (RankPlan(3, good.rank(3).coords, good.rank(2).tensors),))
    rep = world([simulate_load(full, bad.rank(r)) for r in range(4)], bad, "digest", meta=meta,
                manifest=man)
    got = {f["tensor"]: f["detail"] for f in rep["failures"] if f["check"] == "cover"}
    assert got["w_col"] == ("replica 1 holds [0:4,0:6] twice (ranks 2 and 3) and misses [4:8,0:6] "
                            "(no rank holds it as replica 1): each replica of a primary's pieces "
                            "is held by one rank")
    assert got["norm"].startswith("replica 2 holds [0:8] twice (ranks 2 and 3)")
    assert set(got) == {"embed", "norm", "w_col", "w_row"}
    # a replica slice whose pieces are each a primary piece, but not one rank's together
    top, low = ((0, 4), (0, 6)), ((4, 8), (0, 6))
    probs = vf.cover_problems("w_col", (8, 6), [(0, top), (1, low)], [(2, top), (2, low)],
                              [(0, (top,), 0), (1, (low,), 0), (2, (top, low), 1)])
    assert probs == ["rank 2 holds replica pieces [0:4,0:6] + [4:8,0:6] that equal no one "
                     "rank's primary pieces"]

def test_stale_manifest_in_digest_mode(setup):
    root, full, meta, man, plan, loaded = setup
    full2 = dict(full)
    full2["norm"] = torch.zeros(9, dtype=torch.float16)
    save_file(full2, os.path.join(root, "model.safetensors"))
    meta2 = read_checkpoint(root)
    # verify_rank loads the manifest itself from meta.root and must refuse it
    one = Plan(Layout(), meta2.fingerprint(), (RankPlan(0, {"tp": 0}, (
        ts_("w_col", "F32", (8, 6), (8, 6), [(((0, 8), (0, 6)), (0, 0))]),)),),
        excluded=tuple(n for n in meta2.tensors if n != "w_col"))
    with pytest.raises(VerifyError, match="stale manifest") as ei:
        vf.verify_rank({"w_col": full["w_col"]}, one, 0, mode="digest", meta=meta2)
    assert [f["check"] for f in ei.value.report["failures"]] == ["manifest"]


def test_verify_rank_single_process_world_one(setup):
    root, full, meta, man, plan, loaded = setup
    rp = RankPlan(0, {"tp": 0}, tuple(
        ts_(n, {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}[t.dtype],
            t.shape, t.shape, [(tuple((0, s) for s in t.shape), (0,) * t.dim())])
        for n, t in sorted(full.items())))
    one = Plan(Layout(), meta.fingerprint(), (rp,))
    tensors = {n: t.clone() for n, t in full.items()}
    for mode in ("none", "shapes", "digest", "full"):
        rep = vf.verify_rank(tensors, rp, mode, meta=meta)
        assert rep["ok"] and rep["mode"] == mode
    # the loader's call form: (tensors, plan, rank, mode=..., meta=..., group=...)
    rep = vf.verify_rank(tensors, one, 0, mode="digest", meta=meta, group=None)
    assert rep["checks"][-1] == "digest-manifest"
    tensors["w_row"][0, 0] += 1
    with pytest.raises(VerifyError) as ei:
        vf.verify_rank(tensors, rp, "digest", meta=meta)
    assert ei.value.rank == 0 and "tensor 'w_row'" in str(ei.value)
    assert ei.value.report["failures"][0]["check"] == "digest"
    with pytest.raises(VerifyError) as ei:
        vf.verify_rank(tensors, rp, "full", meta=meta, manifest=False)
    f = ei.value.report["failures"][0]
    assert (f["tensor"], f["check"], f["piece"]) == ("w_row", "bytes", 0)
    # VerifyError with its report survives pickling (it crosses ranks)
    e2 = pickle.loads(pickle.dumps(ei.value))
    assert e2.report["failures"][0]["tensor"] == "w_row"


def test_one_rank_of_a_larger_plan_in_a_single_process(setup):
    root, full, meta, man, plan, loaded = setup
    rep = vf.verify_rank(loaded[1], plan, 1, mode="digest", meta=meta)
    assert rep["ok"] and "plan cover" in rep["checks"]
    assert any("the other ranks' tensors" in n for n in rep["notes"])


def test_cover_checker_finds_gaps_overlaps_and_stray_replicas():
    p = vf.cover_problems("t", (4, 4), [(0, ((0, 2), (0, 4))), (1, ((2, 4), (0, 2)))], [])
    assert p == ["primary pieces cover 12 of 16 elements; held by no rank: [2:4,2:4]"]
    p = vf.cover_problems("t", (4, 4), [(0, ((0, 3), (0, 4))), (1, ((2, 4), (0, 4)))], [])
    assert len(p) == 1 and "overlap" in p[0] and "rank 0" in p[0] and "rank 1" in p[0]
    p = vf.cover_problems("t", (4,), [(0, ((0, 4),))], [(1, ((0, 2),))])
    assert p == ["rank 1 holds replica piece [0:2] that matches no primary piece"]
    p = vf.cover_problems("t", (4,), [(0, ((0, 5),))], [])
    assert "outside" in p[0]
    assert vf.cover_problems("s", (), [(0, ())], [(1, ())]) == []


def test_unknown_mode():
    with pytest.raises(VerifyError, match="unknown verify mode"):
        vf.verify_rank({}, RankPlan(0, {}, ()), "bytes")


def test_full_mode_reads_multi_piece_checkpoint_tensors(tmp_path):
    """coordloader's sharded format: a tensor stored as 3 pieces in 2 files; a rank piece
    straddling them is re-read piecewise and compared."""
    import json as _json
    root = tmp_path / "sh"
    root.mkdir()
    g = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    save_file({"w@0:2,0:6": g[0:2].contiguous()}, str(root / "s0.safetensors"))
    save_file({"w@2:4,0:3": g[2:4, 0:3].contiguous(), "w@2:4,3:6": g[2:4, 3:6].contiguous()},
              str(root / "s1.safetensors"))
    idx = {"weight_map": {"w": "s0.safetensors"},
           "coordloader": {"version": 1, "layout": {}, "tensors": {
               "w": {"dtype": "F32", "shape": [4, 6], "pieces": [
                   {"file": "s0.safetensors", "key": "w@0:2,0:6", "box": [[0, 2], [0, 6]]},
                   {"file": "s1.safetensors", "key": "w@2:4,0:3", "box": [[2, 4], [0, 3]]},
                   {"file": "s1.safetensors", "key": "w@2:4,3:6", "box": [[2, 4], [3, 6]]}]}}}}
    (root / "model.safetensors.index.json").write_text(_json.dumps(idx))
    meta = read_checkpoint(str(root))
    write_manifest(meta)
    # rank holds columns 2..5 of every row (crosses all three stored pieces)
    rp = RankPlan(0, {}, (ts_("w", "F32", (4, 6), (4, 3), [(((0, 4), (2, 5)), (0, 0))]),))
    local = g[:, 2:5].clone()
    payload = vf.local_payload({"w": local}, rp, "full", meta=meta)
    assert payload.findings == []
    local[3, 1] += 1     # global element [3, 3]: stored in the third piece
    payload = vf.local_payload({"w": local}, rp, "full", meta=meta)
    (f,) = payload.findings
    assert f.check == "bytes" and "s1.safetensors" in f.detail and "[3, 3]" in f.detail


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_bad_digest_threads_setting_is_one_finding(setup, monkeypatch, value):
    """A bad COORDLOADER_DIGEST_THREADS is one finding naming the variable (so it reaches
    every rank through the collective), not a traceback on the ranks that read it; a good
    one digests as usual."""
    root, full, meta, man, plan, loaded = setup
    monkeypatch.setenv("COORDLOADER_DIGEST_THREADS", value)
    with pytest.raises(VerifyError) as ei:
        vf.verify_rank(loaded[0], plan, 0, mode="digest", meta=meta)
    (f,) = ei.value.report["failures"]
    assert f["rank"] == 0 and f["check"] == "error"
    assert f"COORDLOADER_DIGEST_THREADS={value!r}: expected a whole number" in f["detail"]
    # the whole world, with the manifest: one finding per rank and nothing else (the
    # digests still went out, so no tensor is reported as differing from the manifest)
    rep = world(loaded, plan, "digest", meta=meta, manifest=man)
    assert [(f["rank"], f["check"]) for f in rep["failures"]] == [(0, "error"), (1, "error")]
    monkeypatch.setenv("COORDLOADER_DIGEST_THREADS", "3")
    assert vf.verify_rank(loaded[0], plan, 0, mode="digest", meta=meta)["ok"]


@pytest.mark.parametrize("change", ["rewritten", "truncated"])
def test_full_mode_names_a_file_changed_since_the_load_not_the_loaded_bytes(
        tmp_path, tiny_checkpoint, monkeypatch, change):
    """A file changed after the load and before --verify full's re-read: the loaded
    tensors were what the file held, yet they were reported as wrong ("holds bits 0xbcca,
    checkpoint has 0xbccb"), or each tensor as a bare SafetensorError of the truncated
    file. Now: one finding naming the file and how it changed."""
    import shutil

    import coordloader
    from coordloader import loader

    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint("llama"), ck)
    name = sorted(f for f in os.listdir(ck) if f.endswith(".safetensors"))[0]
    path = ck / name
    os.chmod(path, 0o644)

    def change_it(phase):
        if phase == "verify":
            if change == "rewritten":
                flip_data_bytes(path, 7919, 1)
            else:
                os.truncate(path, os.path.getsize(path) // 2)
    monkeypatch.setattr(loader, "PHASE_HOOKS", [change_it])
    with pytest.raises(VerifyError) as ei:
        coordloader.load(str(ck), Layout(tp=2), rank=1, verify="full")
    problems = ei.value.report["failures"]
    assert [(p["check"], p["detail"].split(": cannot re-read it, so ")[0])
            for p in problems] == [("file", name)], problems
    want = ("file changed after its header was read" if change == "rewritten"
            else "its header was read when it had")
    assert want in problems[0]["detail"], problems


@pytest.mark.parametrize("engine", ["cpu", "safetensors"])
def test_a_load_inside_a_meta_device_context_loads_and_digests_as_outside(
        tmp_path, tiny_checkpoint, monkeypatch, engine):
    """Model skeletons are built under ``with torch.device("meta"):`` and loaded there too:
    the re-read for the digest made meta tensors (a good checkpoint failed its verify),
    the safetensors engine raised a bare NotImplementedError, and the digest self-tests,
    run first there, failed for the whole process (every later digest took a slower
    route, with a warning that the kernel failed its self-test)."""
    import shutil
    import warnings

    import coordloader as cl
    from coordloader.verify.digest import kernel, routes
    ck = str(tmp_path / "ck")
    shutil.copytree(tiny_checkpoint("llama"), ck)
    want = cl.load(ck, Layout(tp=2), rank=0)
    cl.write_manifest(read_checkpoint(ck))
    monkeypatch.setattr(kernel, "_kernel_ok", None)   # the self-tests run in the context
    monkeypatch.setattr(routes, "_mm_ok", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.device("meta"):
            got = cl.load(ck, Layout(tp=2), rank=0, engine=engine, verify="full")
            meta = read_checkpoint(ck)
            plan = cl.make_plan(meta, Layout(tp=2))
            report = vf.verify_rank(got, plan, 0, mode="digest", meta=meta,
                                    manifest=load_manifest(ck, meta))
    assert report["ok"] and "digest-manifest" in report["checks"], report
    assert sorted(got) == sorted(want) and all(
        got[n].device.type == "cpu" and torch.equal(got[n], want[n]) for n in want)
    # the self-tests that ran inside the context gave what they give outside it
    assert (kernel._kernel_ok, routes._mm_ok) != (None, None)
    if kernel._kernel_ok is not None:
        assert kernel._kernel_ok is (kernel._kernel_selftest() is None)
    if routes._mm_ok is not None:
        assert routes._mm_ok is routes._mm_selftest()


def test_a_finding_of_many_ranks_names_them_as_ranges():
    """A finding held by every rank of a large job printed the Python list of ranks (a
    1024-rank job: six kilobytes of one line, then clipped); it reads as ranges now."""
    f = vf.Finding(None, "digest", "wrong sum", tensor="w", ranks=tuple(range(1024)) + (2000,))
    assert f.render() == "ranks 0-1023,2000, tensor 'w': [digest] wrong sum"
    assert vf.Finding(None, "cover", "x", ranks=(4,)).render() == "rank 4: [cover] x"
