"""``bench save``: ``coordloader.save`` throughput and resharded vs direct load.

Layout A (tp=2, the load bench's) saves its state; layout B (tp=2, ep=2: experts whole on
their owner, so every expert's two tp halves come from two different shard files) loads
that sharded checkpoint, against a direct load of the original at B. The two must give
the same tensors (checksums compared).
"""
from __future__ import annotations

import os
import shutil

from coordloader.bench.common import CACHE_DIR, dir_bytes
from coordloader.bench.runner import MethodFailed


def bench_save(ckpt: str, *, tp: int = 2, repeats: int = 3, timeout: float = 900.0,
               log=print) -> dict:
    from coordloader.bench.load_bench import bench_single, prepare
    from coordloader.layout import Layout
    layout_a = Layout(tp=tp)
    layout_b = Layout(tp=tp, ep=tp)
    meta, plan = prepare(ckpt, layout_a)
    save_dir = os.path.join(CACHE_DIR, f"save-{os.getpid()}")
    out: dict = {"ckpt": ckpt, "layout_saved": str(layout_a), "layout_loaded": str(layout_b),
                 "notes": []}
    log(f"[bench] save: {ckpt} saved at {layout_a}, loaded back at {layout_b}")
    try:
        shutil.rmtree(save_dir, ignore_errors=True)
        row = bench_single("save", ckpt, layout_a, repeats=repeats, timeout=timeout, log=log,
                           options={"save_dir": save_dir}, meta=meta, plan=plan,
                           bytes_key="bytes_requested")
        out["save"] = row
        out["saved_bytes"] = dir_bytes(save_dir)
        log(f"[bench]   save {row['wall_s']:.3f} s, {row['gbps_per_rank']:.2f} GB/s per rank "
            f"({out['saved_bytes'] / 1e9:.2f} GB written)")
        rows = {}
        for tag, src in (("direct", ckpt), ("resharded", save_dir)):
            m_b, p_b = prepare(src, layout_b)
            rows[tag + "_engine"] = bench_single("cpu", src, layout_b, repeats=repeats,
                                                 timeout=timeout, log=log, meta=m_b, plan=p_b)
            try:
                rows[tag + "_e2e"] = bench_single("load_e2e", src, layout_b, repeats=repeats,
                                                  timeout=timeout, log=log, meta=m_b, plan=p_b)
            except MethodFailed as e:
                out["notes"].append(f"load() of {tag} failed: {str(e).splitlines()[0]}")
        out["loads"] = rows
        d, r = rows["direct_engine"], rows["resharded_engine"]
        out["resharded_vs_direct"] = r["wall_s"] / d["wall_s"]
        out["same_tensors"] = ([p["checksum"] for p in d["ranks"]]
                               == [p["checksum"] for p in r["ranks"]])
        log(f"[bench]   cpu engine at {layout_b}: direct {d['wall_s']:.3f} s, resharded "
            f"{r['wall_s']:.3f} s ({out['resharded_vs_direct']:.2f}x), same tensors: "
            f"{out['same_tensors']}")
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)
    return out
