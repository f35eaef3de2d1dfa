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

from coordloader.bench.common import CACHE_DIR, can_drop_caches, median, rate
from coordloader.bench.runner import MethodFailed, run_ranks


def _manifest(ckpt: str, meta, *, may_write: bool, log) -> dict:
    from coordloader.verify.manifest import manifest_path, write_manifest
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


def _e2e_pairs(ckpt, layout, meta, plan, repeats: int, *, cold: bool, timeout, log) -> dict:
    """``repeats`` pairs of load(verify="shapes") and load(verify="digest") end to end,
    alternating so a noisy neighbour hits both alike -> the pairs' summary."""
    from coordloader.bench.load_bench import summarize
    from coordloader.bench.methods import METHODS
    runs = {"shapes": [], "digest": []}
    for _ in range(repeats):
        for mode in ("shapes", "digest"):
            runs[mode].append(run_ranks(
                "load_e2e", ckpt=ckpt, layout=layout, meta=meta, plan=plan,
                world=layout.world_size, options={"verify": mode}, cold=cold,
                timeout=timeout, log=log))
    e2e = {m: summarize("load_e2e", METHODS["load_e2e"].label, r) for m, r in runs.items()}
    s, d = e2e["shapes"]["wall_s"], e2e["digest"]["wall_s"]
    out = {m: {"wall_s": e2e[m]["wall_s"], "phases": _median_phases(runs[m])} for m in runs}
    # the cost of digest mode: the median of the paired differences
    out["digest_adds"] = median((dr.wall - sr.wall) / sr.wall for sr, dr in
                                zip(runs["shapes"], runs["digest"]))
    out["digest_adds_of_medians"] = (d - s) / s
    # the same cost read off the verify phase alone (slowest rank): unlike the walls, it
    # does not carry the load phase's own variation, which cold disk reads make large
    out["verify_phase_adds"] = median(
        (_verify_s(dr) - _verify_s(sr)) / sr.wall
        for sr, dr in zip(runs["shapes"], runs["digest"]))
    out["same_tensors"] = ([p["checksum"] for p in e2e["shapes"]["ranks"]]
                           == [p["checksum"] for p in e2e["digest"]["ranks"]])
    return out


def bench_verify(ckpt: str, *, tp: int = 2, repeats: int = 3, load_section: dict | None = None,
                 cold: bool = False, cold_repeats: int = 1, timeout: float = 900.0,
                 log=print) -> dict:
    from coordloader.bench.load_bench import bench_single, prepare
    from coordloader.layout import Layout
    layout = Layout(tp=tp)
    meta, plan = prepare(ckpt, layout)
    out: dict = {"ckpt": ckpt, "layout": layout.to_dict(), "notes": []}
    log(f"[bench] verify: {ckpt}, layout {layout}")

    dig = bench_single("digest", ckpt, layout, repeats=repeats, timeout=timeout, log=log,
                       meta=meta, plan=plan)
    out["digest"] = dig
    dig["route"], fallback = digest_routes()
    if dig["route"] == "kernel":
        # the same digests down the route that runs without the kernel, side by side
        fb = bench_single("digest", ckpt, layout, repeats=repeats, timeout=timeout, log=log,
                          meta=meta, plan=plan, options={"kernel": False})
        out["digest_fallback"] = {"route": fallback, "wall_s": fb["wall_s"],
                                  "gbps_per_rank": fb["gbps_per_rank"]}
    # the cpu engine's wall time for the same slices: from the load bench when it ran in
    # this invocation, else measured here
    if load_section and "cpu" in (load_section.get("warm") or {}):
        cpu = load_section["warm"]["cpu"]
    else:
        cpu = bench_single("cpu", ckpt, layout, repeats=repeats, timeout=timeout, log=log,
                           meta=meta, plan=plan)
    out["cpu_load"] = {"wall_s": cpu["wall_s"], "gbps_per_rank": cpu["gbps_per_rank"]}
    out["digest_fraction_of_load"] = dig["wall_s"] / cpu["wall_s"]
    fb = out.get("digest_fallback")
    log(f"[bench]   digest ({dig['route']}) {dig['gbps_per_rank']:.2f} GB/s per rank, "
        f"{dig['wall_s']:.3f} s = {100 * out['digest_fraction_of_load']:.0f}% of the cpu load "
        f"({cpu['wall_s']:.3f} s)" + (f"; {fb['route']} route {fb['gbps_per_rank']:.2f} GB/s, "
                                      f"{fb['wall_s']:.3f} s" if fb else ""))

    may_write = os.path.abspath(ckpt).startswith(os.path.abspath(CACHE_DIR) + os.sep)
    out["manifest"] = _manifest(ckpt, meta, may_write=may_write, log=log)

    # warm pairs; then, when allowed, cold ones (page cache dropped before each load):
    # what serving's first load pays
    sets = [("e2e", "", False, repeats)]
    if cold and can_drop_caches():
        sets.append(("e2e_cold", "cold: ", True, cold_repeats))
    elif cold:
        out["notes"].append("cold cache not available (cannot write /proc/sys/vm/drop_caches)")
    for key, tag, is_cold, n in sets:
        try:
            out[key] = r = _e2e_pairs(ckpt, layout, meta, plan, n, cold=is_cold,
                                      timeout=timeout, log=log)
        except MethodFailed as e:
            out["notes"].append(f"{tag}load(verify=...) failed: {str(e).splitlines()[0]}")
            continue
        log(f"[bench]   {tag}load(verify='shapes') {r['shapes']['wall_s']:.3f} s, "
            f"load(verify='digest') {r['digest']['wall_s']:.3f} s: "
            f"digest adds {100 * r['digest_adds']:.0f}%")
    if not out["manifest"].get("available"):
        out["notes"].append("no manifest: verify='digest' compared primaries with replicas "
                            "only")
    out["target"] = {"what": "digest mode adds < 25% to a CPU load",
                     "value": out.get("e2e", {}).get("digest_adds",
                                                     out["digest_fraction_of_load"])}
    out["target"]["ok"] = out["target"]["value"] < 0.25
    if "e2e_cold" in out:
        out["target"]["cold_value"] = out["e2e_cold"]["digest_adds"]
        out["target"]["cold_ok"] = out["target"]["cold_value"] < 0.25
    return out


def digest_routes() -> tuple[str, str]:
    """(the CPU digest route this install takes, the one it falls back to)."""
    from coordloader.verify import digest as dgm
    fallback = "int8 product" if dgm.fallback_route() is dgm.Route.INT8 else "int64 gemv"
    return ("kernel" if dgm.kernel_available() else fallback), fallback


def _verify_s(run) -> float:
    return max((r.get("extra") or {}).get("phases", {}).get("verify", 0.0) for r in run.ranks)


def _median_phases(runs) -> dict:
    """Per phase, the median over repeats of the slowest rank's seconds (phases as
    load_detailed reports them)."""
    per_run = [[(r.get("extra") or {}).get("phases", {}) for r in run.ranks] for run in runs]
    keys = sorted({k for ph in per_run for d in ph for k in d})
    return {k: median(max(d.get(k, 0.0) for d in ph) for ph in per_run) for k in keys}


__all__ = ["bench_verify"]
