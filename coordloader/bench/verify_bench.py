"""``bench verify``: what content digests cost, alone and as a share of a CPU load.

Three figures on the same checkpoint and layout as ``bench load``:
- the digest rate of every rank's planned pieces (GB/s per rank, ranks run together),
  against the cpu engine's load wall time of the same slices;
- the manifest (per-tensor digests of the whole checkpoint, one process);
- ``coordloader.load(verify="digest")`` against ``verify="shapes"`` end to end over gloo.
"""
from __future__ import annotations

import os
import time

from .common import CACHE_DIR, median, rate
from .runner import MethodFailed, run_ranks


def _manifest(ckpt: str, meta, *, may_write: bool, log) -> dict:
    from ..manifest import manifest_path, write_manifest
    if not may_write:
        return {"available": os.path.exists(manifest_path(ckpt)), "written": False,
                "note": "checkpoint given by --ckpt: its directory is not written to"}
    t = time.perf_counter()
    write_manifest(meta, jobs=1)
    secs = time.perf_counter() - t
    log(f"[bench]   manifest of {meta.total_bytes / 1e9:.2f} GB in {secs:.2f} s "
        f"({rate(meta.total_bytes, secs):.2f} GB/s, 1 thread)")
    return {"available": True, "written": True, "seconds": secs,
            "gbps": rate(meta.total_bytes, secs), "bytes": meta.total_bytes}


def bench_verify(ckpt: str, *, tp: int = 2, repeats: int = 3, load_section: dict | None = None,
                 timeout: float = 900.0, log=print) -> dict:
    from ..layout import Layout
    from .load_bench import bench_single, prepare, summarize
    from .methods import METHODS
    layout = Layout(tp=tp)
    meta, plan = prepare(ckpt, layout)
    out: dict = {"ckpt": ckpt, "layout": layout.to_dict(), "notes": []}
    log(f"[bench] verify: {ckpt}, layout {layout}")

    dig = bench_single("digest", ckpt, layout, repeats=repeats, timeout=timeout, log=log,
                       meta=meta, plan=plan)
    out["digest"] = dig
    # the cpu engine's wall time for the same slices: from the load bench when it ran in
    # this invocation, else measured here
    if load_section and "cpu" in (load_section.get("warm") or {}):
        cpu = load_section["warm"]["cpu"]
    else:
        cpu = bench_single("cpu", ckpt, layout, repeats=repeats, timeout=timeout, log=log,
                           meta=meta, plan=plan)
    out["cpu_load"] = {"wall_s": cpu["wall_s"], "gbps_per_rank": cpu["gbps_per_rank"]}
    out["digest_fraction_of_load"] = dig["wall_s"] / cpu["wall_s"]
    log(f"[bench]   digest {dig['gbps_per_rank']:.2f} GB/s per rank, {dig['wall_s']:.3f} s = "
        f"{100 * out['digest_fraction_of_load']:.0f}% of the cpu load ({cpu['wall_s']:.3f} s)")

    may_write = os.path.abspath(ckpt).startswith(os.path.abspath(CACHE_DIR) + os.sep)
    out["manifest"] = _manifest(ckpt, meta, may_write=may_write, log=log)

    # shapes and digest alternate within each repeat, so a noisy neighbour hits both
    # alike; the cost of digest mode is the median of the paired differences
    e2e, runs = {}, {"shapes": [], "digest": []}
    try:
        for _ in range(repeats):
            for mode in ("shapes", "digest"):
                runs[mode].append(run_ranks(
                    "load_e2e", ckpt=ckpt, layout=layout, meta=meta, plan=plan,
                    world=layout.world_size, options={"verify": mode}, timeout=timeout,
                    log=log))
        for mode in ("shapes", "digest"):
            e2e[mode] = summarize("load_e2e", METHODS["load_e2e"].label, runs[mode])
    except MethodFailed as e:
        out["notes"].append(f"load(verify=...) failed: {str(e).splitlines()[0]}")
    if len(e2e) == 2:
        s, d = e2e["shapes"]["wall_s"], e2e["digest"]["wall_s"]
        out["e2e"] = {
            m: {"wall_s": r["wall_s"],
                "phases": _median_phases(r)} for m, r in e2e.items()}
        out["e2e"]["digest_adds"] = median((dr.wall - sr.wall) / sr.wall for sr, dr in
                                           zip(runs["shapes"], runs["digest"]))
        out["e2e"]["digest_adds_of_medians"] = (d - s) / s
        out["e2e"]["same_tensors"] = ([p["checksum"] for p in e2e["shapes"]["ranks"]]
                                      == [p["checksum"] for p in e2e["digest"]["ranks"]])
        log(f"[bench]   load(verify='shapes') {s:.3f} s, load(verify='digest') {d:.3f} s: "
            f"digest adds {100 * out['e2e']['digest_adds']:.0f}%")
    if not out["manifest"].get("available"):
        out["notes"].append("no manifest: verify='digest' compared primaries with replicas "
                            "only")
    out["target"] = {"what": "digest mode adds < 25% to a CPU load",
                     "value": out.get("e2e", {}).get("digest_adds",
                                                     out["digest_fraction_of_load"])}
    out["target"]["ok"] = out["target"]["value"] < 0.25
    return out


def _median_phases(row: dict) -> dict:
    """Per-phase seconds of the slowest rank (phases as load_detailed reports them)."""
    ph = [p["extra"].get("phases", {}) for p in row["ranks"]]
    keys = sorted({k for d in ph for k in d})
    return {k: max(d.get(k, 0.0) for d in ph) for k in keys}


__all__ = ["bench_verify"]
