"""The plan's load groups (the instanttensor engine's cost model): per pipeline stage, the
files its ranks need most of are read once and all-gathered ("group"), the others read by
each rank for its own tensors ("filtered")."""
import pytest

from coordloader.api import make_plan
from coordloader.checkpoint.metadata import CheckpointMeta, FileInfo, SourcePiece, TensorInfo
from coordloader.layout import Layout
from coordloader.planning.model import LoadGroup
from coordloader.planning.planner import meta_from_specs
from coordloader.synth.archs import arch_tensors

F32_ROW = 4 * 4   # bytes in one row of a 4x4 float32 tensor


def _sharded_meta() -> CheckpointMeta:
    """Layer 0's ``x`` is stored in two pieces, rows 0-1 in a.safetensors and rows 2-3 in
    b.safetensors; layer 1's ``y`` whole in a.safetensors, after x's piece."""
    a0 = 8 + 64
    x_a = SourcePiece("a.safetensors", ((0, 2), (0, 4)), a0, a0 + 2 * F32_ROW,
                      "model.layers.0.x@0:2,0:4")
    y_a = SourcePiece("a.safetensors", ((0, 4), (0, 4)), x_a.end, x_a.end + 4 * F32_ROW,
                      "model.layers.1.y")
    x_b = SourcePiece("b.safetensors", ((2, 4), (0, 4)), a0, a0 + 2 * F32_ROW,
                      "model.layers.0.x@2:4,0:4")
    tensors = {"model.layers.0.x": TensorInfo("model.layers.0.x", "F32", (4, 4), (x_a, x_b)),
               "model.layers.1.y": TensorInfo("model.layers.1.y", "F32", (4, 4), (y_a,))}
    files = (FileInfo("a.safetensors", y_a.end, 64, "0" * 64),
             FileInfo("b.safetensors", x_b.end, 64, "1" * 64))
    return CheckpointMeta("<memory>", files, tensors, {"num_hidden_layers": 2})


def test_load_groups_weigh_each_files_share_of_a_multi_piece_tensor():
    # tp=2 pp=2, every tensor replicated: stage 0 (ranks 0, 1) needs x, a third of a's
    # bytes (filtered: below 1/2 + 0.1) and all of b's (group); stage 1 (ranks 2, 3)
    # needs y, two thirds of a's bytes (group), and nothing of b
    plan = make_plan(_sharded_meta(), Layout(tp=2, pp=2),
                     rules=[{"pattern": "*", "strategy": "replicate"}])
    assert plan.load_groups == (
        LoadGroup(("b.safetensors",), (0, 1), "group"),
        LoadGroup(("a.safetensors",), (0, 1), "filtered"),
        LoadGroup(("a.safetensors",), (2, 3), "group"),
    )


def _split_rows(meta: CheckpointMeta, every: int) -> CheckpointMeta:
    """``meta`` with the last rows of every ``every``-th 2-d tensor moved into a file of
    their own, each file's pieces laid out one after another after its header, as the
    reader finds them (a stored piece per file holding part of a tensor)."""
    moved = {}
    for i, (name, t) in enumerate(meta.tensors.items()):
        if len(t.shape) == 2 and t.shape[0] > 1 and i % every == 0:
            cut = t.shape[0] // 2
            moved[name] = [(t.pieces[0].file, ((0, cut), (0, t.shape[1]))),
                           ("z-rows.safetensors", ((cut, t.shape[0]), (0, t.shape[1])))]
    end: dict[str, int] = {}
    tensors = {}
    for name, t in meta.tensors.items():
        row = (t.pieces[0].end - t.pieces[0].start) // max(t.shape[0], 1) if t.shape else 0
        pieces = []
        for file, box in moved.get(name, [(t.pieces[0].file, t.pieces[0].box)]):
            start = end.get(file, 72)
            n = (box[0][1] - box[0][0]) * row if name in moved else t.pieces[0].end - t.pieces[0].start
            end[file] = start + n
            pieces.append(SourcePiece(file, box, start, start + n, name))
        tensors[name] = TensorInfo(name, t.dtype, t.shape, tuple(pieces))
    files = tuple(FileInfo(f, end[f], 64, f[0] * 64) for f in sorted(end))
    return CheckpointMeta("<memory>", files, tensors, meta.config)


def _by_definition(plan, meta: CheckpointMeta) -> tuple:
    """Load groups straight from their definition, rank by rank: per stage, a file goes
    "filtered" when its representative ranks need less than 1/ranks + STORAGE_TO_NET of
    its bytes on average (a tensor needed counts its stored bytes in the file once per
    slice held), else "group"; files they need nothing of are left out."""
    from coordloader.planning.planner import STORAGE_TO_NET
    L = plan.layout
    S = L.tp * L.dp
    size: dict[str, int] = {}
    for t in meta.tensors.values():
        for p in t.pieces:
            size[p.file] = size.get(p.file, 0) + p.end - p.start
    out = []
    for s in range(L.pp):
        ranks = tuple(range(s * S, (s + 1) * S))
        reps = ranks if L.ep_spans_dp else ranks[:L.tp]
        need: dict[str, int] = {}
        for r in reps:
            for sl in plan.ranks[r].tensors:
                for p in meta.tensors[sl.name].pieces:
                    need[p.file] = need.get(p.file, 0) + p.end - p.start
        grp = [f for f in sorted(need) if need[f] / len(reps) / size[f] >= 1 / len(ranks) + STORAGE_TO_NET]
        filt = [f for f in sorted(need) if f not in grp]
        out += [LoadGroup(tuple(g), ranks, m) for g, m in ((grp, "group"), (filt, "filtered")) if g]
    return tuple(out)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "llama"])
@pytest.mark.parametrize("layout", [dict(tp=2, ep=2), dict(tp=2, ep=2, dp=3, pp=2),
                                    dict(tp=2, dp=2, ep=4, ep_spans_dp=True), dict(tp=4, pp=2)],
                         ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_load_groups_follow_their_definition(arch, layout, split):
    cfg, specs = arch_tensors(arch, "tiny")
    meta = meta_from_specs(cfg, specs, files=4)
    if split:
        meta = _split_rows(meta, 3)
    if arch == "llama":
        layout = {k: v for k, v in layout.items() if k not in ("ep", "ep_spans_dp")}
    plan = make_plan(meta, Layout(**layout))
    want = _by_definition(plan, meta)
    assert plan.load_groups == want


@pytest.mark.parametrize("change", ["a file unlisted", "sizes of no data", "files unsorted"])
def test_load_groups_read_file_sizes_from_the_stored_pieces(change):
    # metadata built by hand may list its files out of order, leave one out or give sizes
    # the pieces do not fill: a file's size is still its tensors' stored bytes
    import dataclasses
    cfg, specs = arch_tensors("qwen3_moe", "tiny")
    meta = _split_rows(meta_from_specs(cfg, specs, files=4), 3)
    files = {"a file unlisted": meta.files[1:],
             "sizes of no data": tuple(dataclasses.replace(f, size=8) for f in meta.files),
             "files unsorted": meta.files[::-1]}[change]
    odd = dataclasses.replace(meta, files=files)
    plan = make_plan(odd, Layout(tp=2, ep=2, pp=2))
    assert plan.load_groups == _by_definition(plan, odd) == make_plan(
        meta, Layout(tp=2, ep=2, pp=2)).load_groups
