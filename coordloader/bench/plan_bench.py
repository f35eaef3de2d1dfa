"""``bench plan``: planner + exact-cover validation on full DeepSeek-V3 metadata.

The metadata comes from a metadata-only synthesized checkpoint (real headers, sparse
data: 163 files, ~92k tensors, 689 GB described, ~20 MB on disk), read once. Each
layout is planned and validated in this process; time is reported next to the number
of slices, pieces and byte runs the plan holds, so growth can be read as slices/s.
"""
from __future__ import annotations

import gc
import time

from coordloader.bench.common import median

# tp=8, ep=8 throughout (vLLM's DeepSeek-V3 serving shape), then pp and dp grow the world
SERIES = [(8, dict(tp=8, ep=8)), (16, dict(tp=8, ep=8, pp=2)), (32, dict(tp=8, ep=8, pp=4)),
          (64, dict(tp=8, ep=8, pp=8)), (128, dict(tp=8, ep=8, pp=8, dp=2)),
          (256, dict(tp=8, ep=8, pp=8, dp=4)), (512, dict(tp=8, ep=8, pp=8, dp=8)),
          (1024, dict(tp=8, ep=8, pp=8, dp=16))]
QUICK_WORLDS = (8, 64, 1024)
TARGETS = {8: 2.0, 1024: 30.0}


def plan_counts(plan) -> dict:
    slices = pieces = runs = 0
    for rp in plan.ranks:
        slices += len(rp.tensors)
        for ts in rp.tensors:
            pieces += len(ts.pieces)
            runs += len(ts.byte_runs)
    return {"slices": slices, "pieces": pieces, "byte_runs": runs}


def bench_plan(ckpt: str, *, worlds=None, repeats: int = 1, log=print) -> dict:
    from coordloader.api import make_plan
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.layout import Layout
    from coordloader.planning.cover import validate_cover
    t0 = time.perf_counter()
    meta = read_checkpoint(ckpt)
    t_meta = time.perf_counter() - t0
    log(f"[bench] plan: {ckpt}: {len(meta.tensors)} tensors in {len(meta.files)} files "
        f"({meta.total_bytes / 1e9:.0f} GB described), headers read in {t_meta:.2f} s")
    rows = []
    for world, kw in SERIES:
        if worlds is not None and world not in worlds:
            continue
        layout = Layout(**kw)
        assert layout.world_size == world
        # the two headline layouts get the repeats; the series points run once when large
        reps = repeats if world <= 64 or world in TARGETS else 1
        t_plan, t_cover, counts = [], [], None
        for _ in range(reps):
            gc.collect()
            t = time.perf_counter()
            plan = make_plan(meta, layout)
            t_plan.append(time.perf_counter() - t)
            t = time.perf_counter()
            validate_cover(plan, meta)
            t_cover.append(time.perf_counter() - t)
            counts = plan_counts(plan)
            del plan
        gc.collect()
        tp_, tc = median(t_plan), median(t_cover)
        total = tp_ + tc
        row = {"world": world, "layout": str(layout), **counts, "plan_s": tp_, "cover_s": tc,
               "total_s": total, "slices_per_s": counts["slices"] / total if total else None,
               "repeats": reps}
        if world in TARGETS:
            row["target_s"] = TARGETS[world]
            row["ok"] = total < TARGETS[world]
        rows.append(row)
        log(f"[bench]   {world:5d} ranks ({layout}): plan {tp_:7.2f} s + cover {tc:6.2f} s, "
            f"{counts['slices']:>9,d} slices, {row['slices_per_s']:,.0f} slices/s")
    return {"ckpt": ckpt, "tensors": len(meta.tensors), "files": len(meta.files),
            "described_bytes": meta.total_bytes, "metadata_s": t_meta, "rows": rows}
