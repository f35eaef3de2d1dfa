"""``bench load``: the engines and the baselines side by side, per rank, warm and cold.

Each method runs as ``world`` separate rank processes started together (runner.py), on
the same plan; per repeat the load time is the slowest rank's wall. Methods alternate
within a repeat so a noisy neighbour on a shared machine hits them all alike.
"""
from __future__ import annotations

import time
from operator import add
from typing import Any, NamedTuple

from coordloader.bench.common import (
    MIN_PAIRS,
    can_drop_caches,
    ckpt_files,
    dir_bytes,
    median,
    rate,
    warm_files,
)
from coordloader.bench.runner import MethodFailed, run_ranks

CPU_METHODS = ["ceiling", "fresh_floor", "memcpy", "pcopy", "preadv", "span", "cpu", "st_whole", "cpu_into",
               "st_whole_into", "st_mmap_narrow", "st_slice"]
RSS_FACTOR, RSS_SLACK = 1.3, 300e6
# slice-exact methods a user could pick instead of the cpu engine: it must beat each
PEERS = ("span", "st_slice", "st_mmap_narrow")
# the physical limit: fresh memory (f) plus one copy of the held bytes (m), per repeat
LIMIT_KEY, LIMIT_PARTS = "floor_memcpy", ("fresh_floor", "memcpy")
LIMIT_FACTOR = 1.15
# the same with the copy at the rate the kernel copies out of the page cache (p): the
# limit of any read through it (info)
PAGE_LIMIT_KEY, PAGE_LIMIT_PARTS = "floor_pcopy", ("fresh_floor", "pcopy")
# methods that hold no tensors: their GB/s is of the bytes they move (the copy rate)
RATE_OF_REQUESTED = ("ceiling", "memcpy", "pcopy")


def load_methods(cuda: bool = True) -> list[str]:
    """The methods ``bench load`` runs by default (the CUDA ones only with ``cuda``)."""
    from coordloader.bench.methods import METHODS
    return CPU_METHODS + ["load_e2e"] + ([k for k, m in METHODS.items() if m.needs_cuda]
                                         if cuda else [])


def prepare(ckpt: str, layout) -> tuple[Any, Any]:
    from coordloader.api import make_plan
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.planning.cover import validate_cover
    meta = read_checkpoint(ckpt)
    plan = make_plan(meta, layout)
    validate_cover(plan, meta)
    return meta, plan


PAGE = 4096


def page_bytes(rank_plan) -> int:
    """Bytes of the distinct 4 KiB file pages under a rank's byte runs: what storage
    transfers for a cold slice-exact read of the plan, whatever the method (storage and
    the page cache work in whole pages, so a gap shorter than a page saves no I/O)."""
    import numpy as np

    from coordloader.planning.runs import groups_of
    by_file: dict[str, list] = {}
    for ts in rank_plan.tensors:
        for f, o, ln, _d, c, ss, _ds in groups_of(ts.byte_runs):
            if ln <= 0 or c <= 0:
                continue
            lst = by_file.setdefault(f, [])
            if c == 1 or ss - ln < PAGE:
                # no whole page fits in a gap: the span's pages are the runs' pages
                lst.append((np.array([o // PAGE]), np.array([(o + (c - 1) * ss + ln - 1) // PAGE + 1])))
            else:
                offs = o + np.arange(c, dtype=np.int64) * ss
                lst.append((offs // PAGE, (offs + ln - 1) // PAGE + 1))
    total = 0
    for lst in by_file.values():
        st = np.concatenate([a for a, _ in lst])
        en = np.concatenate([b for _, b in lst])
        order = np.argsort(st, kind="stable")
        st, en = st[order], en[order]
        reach = np.maximum.accumulate(en)
        # clip each interval's start to the furthest end before it: overlaps count once
        prev = np.concatenate([[st[0]], reach[:-1]])
        total += int(np.maximum(0, en - np.maximum(st, prev)).sum())
    return total * PAGE


def summarize(key: str, label: str, runs, *, bytes_key: str = "bytes_held") -> dict:
    """Medians over repeats; per rank and for the load as a whole (slowest rank)."""
    world = len(runs[0].ranks)
    per_rank = []
    for r in range(world):
        rs = [run.ranks[r] for run in runs]
        wall = median(x["wall"] for x in rs)
        held = rs[0]["bytes_held"]
        req = median(x["bytes_requested"] for x in rs)
        pc = median((x.get("extra") or {}).get("page_cache_bytes", x["bytes_requested"])
                    for x in rs)
        useful = held if bytes_key == "bytes_held" else req
        per_rank.append({
            "rank": r, "wall_s": wall, "bytes_held": held, "bytes_read": req,
            "read_amplification": (req / held) if held else None,
            "page_cache_bytes": pc,
            "page_cache_ratio": (pc / held) if held else None,
            "gbps": rate(useful, wall),
            "rss_peak": max(x["rss_peak"] for x in rs),
            "rss_ready": max(x["rss_ready"] for x in rs),
            "io_rchar": median(x["io_rchar"] for x in rs),
            "io_read_bytes": median(x["io_read_bytes"] for x in rs),
            "checksum": rs[0]["checksum"],
            "checksums_stable": len({x["checksum"] for x in rs}) == 1,
            "extra": rs[0].get("extra", {}),
        })
    wall = median(run.wall for run in runs)
    useful = sum(p["bytes_held"] if bytes_key == "bytes_held" else p["bytes_read"]
                 for p in per_rank)
    return {"key": key, "label": label, "repeats": len(runs), "wall_s": wall,
            "walls_s": [run.wall for run in runs], "ranks": per_rank,
            # per repeat, each rank's wall (a limit row sums two methods rank by rank)
            "rank_walls_s": [[x["wall"] for x in run.ranks] for run in runs],
            "gbps_per_rank": median(p["gbps"] for p in per_rank),
            "gbps_total": rate(useful, wall),
            "bytes_read_per_rank": max(p["bytes_read"] for p in per_rank),
            "bytes_held_per_rank": max(p["bytes_held"] for p in per_rank),
            "read_amplification": (max(p["read_amplification"] for p in per_rank)
                                   if all(p["read_amplification"] is not None for p in per_rank)
                                   else None),
            "page_cache_bytes_per_rank": max(p["page_cache_bytes"] for p in per_rank),
            "page_cache_ratio": (max(p["page_cache_ratio"] for p in per_rank)
                                 if all(p["page_cache_ratio"] is not None for p in per_rank)
                                 else None),
            "rss_peak_per_rank": max(p["rss_peak"] for p in per_rank)}


def _run_set(methods, repeats, *, cold, common, log) -> tuple[dict, dict]:
    from coordloader.bench.methods import METHODS
    runs: dict[str, list] = {m: [] for m in methods}
    failed: dict[str, str] = {}
    first = True
    for i in range(repeats):
        # a method's place in the order and the method before it must not bias the paired
        # ratios (what the one before leaves behind, a page cache to drop or freed memory
        # to fault back in, moves a cold run's wall): the orders are a Williams design,
        # in which each method holds each place, and follows each other method, equally
        # often over one cycle of n repeats (2n for an odd number n of methods)
        order = counterbalanced(methods, i)
        for m in order:
            if m in failed:
                continue
            t0 = time.perf_counter()
            try:
                if not cold and first:   # warm runs start from a page cache holding the files
                    warm_files(ckpt_files(common["ckpt"]))
                first = False
                runs[m].append(run_ranks(m, cold=cold, log=log, **common))
            except MethodFailed as e:
                failed[m] = str(e)
                log(f"[bench] {m} failed: {str(e).splitlines()[0]}")
                continue
            log(f"[bench]   {'cold' if cold else 'warm'} #{i + 1} {m:10s} "
                f"{runs[m][-1].wall:7.3f} s  ({time.perf_counter() - t0:.1f} s with start-up)")
    out = {}
    for m in methods:
        if runs[m]:
            s = summarize(m, METHODS[m].label, runs[m],
                          bytes_key="bytes_requested" if m in RATE_OF_REQUESTED else "bytes_held")
            out[m] = s
    return out, failed


def counterbalanced(methods, i: int) -> list:
    """Repeat ``i``'s order of ``methods``: row ``i`` of a Williams design (a Latin square
    whose rows put every ordered pair of methods next to each other once; for an odd
    number of methods, the square and its mirror, twice as many rows)."""
    n = len(methods)
    if n < 2:
        return list(methods)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:   # 0, 1, n-1, 2, n-2, ...: each difference mod n once
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    cycle = n if n % 2 == 0 else 2 * n
    row = i % cycle
    order = [methods[(x + row) % n] for x in first]
    return order[::-1] if row >= n else order


class Paired(NamedTuple):
    """Ratios ``num[i] / den[i]`` of two methods' walls in the same repeat ``i`` (the
    methods alternate within a repeat, so a pair shares the machine's state)."""
    median: float
    lo: float
    hi: float
    pairs: int


def paired(num: list[float], den: list[float]) -> Paired | None:
    xs = [a / b for a, b in zip(num, den) if b > 0]
    return Paired(median(xs), min(xs), max(xs), len(xs)) if xs else None


def limit_row(rows: dict, key: str = LIMIT_KEY, parts: tuple[str, str] = LIMIT_PARTS) -> dict | None:
    """The bench row of a limit: per repeat, the fresh-memory floor (f) plus one copy of
    the held bytes (``parts[1]``: (m) between user buffers, or (p) out of the page cache),
    rank by rank, its slowest rank's sum (the sum of the slowest of each was above every
    rank's own limit); per rank, the sum of their medians."""
    if not all(k in rows for k in parts):
        return None
    f, m = (rows[k] for k in parts)
    walls = [max(map(add, a, b)) for a, b in zip(f["rank_walls_s"], m["rank_walls_s"])]
    ranks = [{"rank": a["rank"], "wall_s": a["wall_s"] + b["wall_s"], "bytes_held": a["bytes_held"]}
             for a, b in zip(f["ranks"], m["ranks"])]
    label = ("(f)+(m) limit: fresh-memory floor + one memcpy of the held bytes"
             if parts[1] == "memcpy" else
             "(f)+(p) limit through the page cache: fresh-memory floor + one read of the held "
             "bytes from it")
    return {"key": key, "label": label, "repeats": len(walls), "wall_s": median(walls),
            "walls_s": walls, "ranks": ranks,
            "gbps_per_rank": median(rate(p["bytes_held"], p["wall_s"]) for p in ranks),
            "bytes_read_per_rank": None, "bytes_held_per_rank": None, "read_amplification": None,
            "page_cache_ratio": None, "rss_peak_per_rank": None, "derived": True}


def _target(value: Paired, goal: str, ok, **more) -> dict:
    """A paired target; judged (``ok``) on MIN_PAIRS pairs or more only."""
    few = ok is not None and value.pairs < MIN_PAIRS
    return {"value": value.median, "lo": value.lo, "hi": value.hi, "pairs": value.pairs,
            "target": goal, "ok": None if few else ok, "too_few_pairs": few, **more}


def _wrong_bytes(rows: dict) -> dict[str, str]:
    """The methods whose tensors differ from the reference's (``_compare``): a failed run,
    not a row (a GPU method returning wrong bytes passed as a timing)."""
    return {k: "its tensors' checksums differ from the cpu engine's (or are unstable "
               "across repeats): wrong bytes"
            for k, row in rows.items() if row.get("same_tensors") is False}


def _compare(rows: dict, cold: bool = False) -> dict:
    """Ratios against the cpu engine, checksum agreement, the targets. Targets against
    peers and the limit are medians of paired ratios, with their min-max over pairs.
    ``cold``: the limits are shown, not judged ((f)+(m) reads nothing from storage)."""
    cpu = rows.get("cpu")
    lim = limit_row(rows)
    if lim is not None:
        rows[LIMIT_KEY] = lim
    plim = limit_row(rows, PAGE_LIMIT_KEY, PAGE_LIMIT_PARTS)
    if plim is not None:
        rows[PAGE_LIMIT_KEY] = plim
    ref_sums = None
    for k in ("cpu", "preadv", "st_slice", "st_whole", "st_mmap_narrow"):
        if k in rows:
            ref_sums = [p["checksum"] for p in rows[k]["ranks"]]
            break
    for k, row in rows.items():
        if cpu:
            row["time_vs_cpu"] = row["wall_s"] / cpu["wall_s"]
        if row.get("derived"):
            row["same_tensors"] = None
            continue
        sums = [p["checksum"] for p in row["ranks"]]
        if all(s is None for s in sums):
            row["same_tensors"] = None
        else:
            row["same_tensors"] = (sums == ref_sums
                                   and all(p["checksums_stable"] for p in row["ranks"]))
    targets = {}
    peers = [k for k in PEERS if k in rows]
    if cpu and peers:
        # each peer on its own; the best peer is the one the engine leads by the least
        # (the lowest median of paired ratios), the figure the target is judged on. The
        # fastest by median wall can differ from it when pairs and medians disagree.
        each = {k: paired(rows[k]["walls_s"], cpu["walls_s"]) for k in peers}
        each = {k: r for k, r in each.items() if r is not None}
        # among the peers with enough pairs to be judged, when any has: a peer that
        # failed after two repeats is not the one to stand for the rest
        judged = [k for k in each if each[k].pairs >= MIN_PAIRS] or list(each)
        best = min(judged, key=lambda k: each[k].median) if judged else None
        for k, r in each.items():
            targets[f"cpu_vs_{k}"] = _target(r, ">= 1.0 (peer wall / cpu wall)",
                                             r.median >= 1.0, peer=k, label=rows[k]["label"])
        if best is not None:
            targets = {"cpu_vs_best_peer": dict(targets[f"cpu_vs_{best}"]), **targets}
    if cpu and lim is not None:
        r = paired(cpu["walls_s"], lim["walls_s"])
        goal = ("(info, cold) cpu wall / (f)+(m)" if cold else
                f"<= {LIMIT_FACTOR} (cpu wall / (f)+(m))")
        targets["cpu_vs_floor_memcpy"] = _target(r, goal, None if cold else r.median <= LIMIT_FACTOR)
    if cpu and plim is not None:
        r = paired(cpu["walls_s"], plim["walls_s"])
        targets["cpu_vs_floor_pcopy"] = _target(r, "(info) cpu wall / (f)+(p)", None)
    if lim is not None and plim is not None:
        # where a reader through the page cache with no cost of its own would stand
        # against the (f)+(m) goal: (p) is the copy every read(2) makes, (m) one between
        # mapped buffers, which only a mapping of the file gets
        r = paired(plim["walls_s"], lim["walls_s"])
        targets["floor_pcopy_vs_floor_memcpy"] = _target(
            r, "(info) (f)+(p) / (f)+(m): an ideal page-cache reader against the limit", None)
    if cpu and "st_whole" in rows:
        r = paired(rows["st_whole"]["walls_s"], cpu["walls_s"])
        targets["cpu_vs_whole_read"] = _target(r, ">= 3.0", r.median >= 3.0)
    if "cpu_into" in rows and "st_whole_into" in rows:
        r = paired(rows["st_whole_into"]["walls_s"], rows["cpu_into"]["walls_s"])
        targets["cpu_vs_whole_read_into_existing"] = _target(r, ">= 1.8", r.median >= 1.8)
    if cpu and "st_whole" in rows and "fresh_floor" in rows:
        f = rows["fresh_floor"]["wall_s"]
        if cpu["wall_s"] > f:
            x = (rows["st_whole"]["wall_s"] - f) / (cpu["wall_s"] - f)
            targets["cpu_vs_whole_read_above_fresh_floor"] = {"value": x, "target": "(info)",
                                                              "ok": None}
    if cpu and "st_mmap_narrow" in rows:
        x = rows["st_mmap_narrow"]["wall_s"] / cpu["wall_s"]
        targets["cpu_vs_mmap_narrow"] = {"value": x, "target": "(info)", "ok": None}
    if cpu and "preadv" in rows:
        # the same bytes per rank: the rate ratio is the ratio of walls, paired per repeat
        r = paired(rows["preadv"]["walls_s"], cpu["walls_s"])
        targets["cpu_vs_preadv_rate"] = _target(r, ">= 0.8", r.median >= 0.8)
    if cpu and "ceiling" in rows:
        x = cpu["gbps_per_rank"] / rows["ceiling"]["gbps_per_rank"]
        targets["cpu_vs_page_cache_ceiling"] = {"value": x, "target": "(info)", "ok": None}
    if cpu:
        worst = None
        for p in cpu["ranks"]:
            limit = RSS_FACTOR * p["bytes_held"] + RSS_SLACK
            v = p["rss_peak"] / limit
            worst = v if worst is None or v > worst else worst
        targets["cpu_rss_vs_limit"] = {"value": worst,
                                       "target": "<= 1.0 (peak RSS / (1.3 x held + 300 MB))",
                                       "ok": worst <= 1.0}
    return targets


def bench_load(ckpt: str, *, tp: int = 2, repeats: int = 3, cold: bool = True,
               cold_repeats: int = 1, methods: list[str] | None = None,
               timeout: float = 900.0, log=print) -> dict:
    import torch

    from coordloader.bench.methods import METHODS
    from coordloader.layout import Layout
    cuda_only = [k for k, m in METHODS.items() if m.needs_cuda]
    layout = Layout(tp=tp)
    t0 = time.perf_counter()
    meta, plan = prepare(ckpt, layout)
    ckpt_bytes = dir_bytes(ckpt)
    log(f"[bench] load: {ckpt} ({ckpt_bytes / 1e9:.2f} GB in {len(meta.files)} files, "
        f"{len(meta.tensors)} tensors), layout {layout}, plan in {time.perf_counter() - t0:.2f} s")
    notes = []
    if methods is None:
        methods = load_methods(torch.cuda.is_available())
        if not torch.cuda.is_available():
            notes.append("(d) raw instanttensor.safe_open and (e) the coordloader instanttensor "
                         "engine need CUDA: skipped on this machine")
    common = dict(ckpt=ckpt, layout=layout, meta=meta, plan=plan, world=layout.world_size,
                  timeout=timeout,
                  device="cuda" if torch.cuda.is_available() else "cpu")
    # CUDA methods need a cuda device; CPU methods run on the CPU either way
    runs = [sum(len(ts.byte_runs) for ts in rp.tensors) for rp in plan.ranks]
    held = [rp.bytes_held for rp in plan.ranks]
    pages = [page_bytes(rp) for rp in plan.ranks]
    out: dict[str, Any] = {"ckpt": ckpt, "checkpoint_bytes": ckpt_bytes,
                           "byte_runs_per_rank": runs,
                           "mean_run_bytes": [h / n if n else None for h, n in zip(held, runs)],
                           "bytes_held_plan": held, "page_bytes_per_rank": pages,
                           "files": len(meta.files), "tensors": len(meta.tensors),
                           "layout": layout.to_dict(), "world": layout.world_size,
                           "repeats": repeats, "notes": notes, "failed": {}}
    cpu_methods = [m for m in methods if m not in cuda_only]
    cuda_methods = [m for m in methods if m in cuda_only]
    warm, failed = _run_set(cpu_methods, repeats, cold=False,
                            common={**common, "device": "cpu"}, log=log)
    if cuda_methods:
        w2, f2 = _run_set(cuda_methods, repeats, cold=False, common=common, log=log)
        warm.update(w2)
        failed.update(f2)
    out["failed"].update(failed)
    out["warm"] = warm
    out["targets"] = _compare(warm)
    out["failed"].update(_wrong_bytes(warm))
    if cold and can_drop_caches():
        cold_rows, failed = _run_set(cpu_methods, cold_repeats, cold=True,
                                     common={**common, "device": "cpu"}, log=log)
        out["cold"] = cold_rows
        out["cold_targets"] = _compare(cold_rows, cold=True)
        failed.update(_wrong_bytes(cold_rows))
        out["failed"].update({f"{k} (cold)": v for k, v in failed.items()})
    elif cold:
        out["cold"] = None
        notes.append("cold cache not available (cannot write /proc/sys/vm/drop_caches)")
    else:
        out["cold"] = None
        notes.append("cold-cache runs not requested")
    if "cpu" in warm and ("st_whole" in warm or "cpu_vs_best_peer" in out["targets"]):
        h = {"cpu_s": warm["cpu"]["wall_s"]}
        if "st_whole" in warm:
            h.update(ratio=warm["st_whole"]["wall_s"] / warm["cpu"]["wall_s"],
                     whole_s=warm["st_whole"]["wall_s"])
        b = out["targets"].get("cpu_vs_best_peer")
        if b:
            h["peer"] = {"key": b["peer"], "label": b["label"], "ratio": b["value"],
                         "lo": b["lo"], "hi": b["hi"], "pairs": b["pairs"],
                         "peer_s": warm[b["peer"]]["wall_s"]}
        out["headline"] = h
    return out


def bench_single(method: str, ckpt: str, layout, *, repeats: int, options: dict | None = None,
                 timeout: float = 900.0, log=print, meta=None, plan=None,
                 bytes_key: str = "bytes_held") -> dict:
    """Warm repeats of one method (used by the verify and save benches)."""
    from coordloader.bench.methods import METHODS
    if meta is None or plan is None:
        meta, plan = prepare(ckpt, layout)
    runs = [run_ranks(method, ckpt=ckpt, layout=layout, meta=meta, plan=plan,
                      world=layout.world_size, options=options, timeout=timeout, log=log)
            for _ in range(repeats)]
    return summarize(method, METHODS[method].label, runs, bytes_key=bytes_key)
