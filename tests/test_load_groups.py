"""The plan's load groups (the instanttensor engine's cost model): per pipeline stage, the
files its ranks need most of are read once and all-gathered ("group"), the others read by
each rank for its own tensors ("filtered")."""
from coordloader.api import make_plan
from coordloader.checkpoint.metadata import CheckpointMeta, FileInfo, SourcePiece, TensorInfo
from coordloader.layout import Layout
from coordloader.planning.model import LoadGroup

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
