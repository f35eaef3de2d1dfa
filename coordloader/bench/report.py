"""Markdown tables, the JSON file and the headline line of a bench run."""
from __future__ import annotations

import json
import math
import os

from coordloader.bench.common import MIN_PAIRS

HEADLINE_PREFIX = "headline:"


def _f(x, fmt="{:.3f}", none="–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def _mb(n) -> str:
    return _f(None if n is None else n / 1e6, "{:,.0f} MB")


def _ok(v) -> str:
    return {True: "yes", False: "**NO**", None: "–"}[v]


def load_table(rows: dict, title: str, storage: bool = False) -> str:
    """``storage``: add the bytes the kernel read from storage for all ranks together
    (sum of each rank's ``/proc/self/io`` read_bytes, readahead included; a page two ranks
    need is charged to the one that faults it in first, so only the sum is meaningful):
    for cold runs only."""
    if not rows:
        return ""
    out = [f"**{title}**", "",
           "| method | wall s (slowest rank, median) | GB/s per rank | per-rank walls s | "
           "bytes read / rank | read ampl. | page-cache bytes copied / held | "
           + ("storage read, all ranks | " if storage else "") +
           "peak RSS / rank | time vs cpu engine | same tensors |",
           "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if storage else "") + "---:|---:|:---:|"]
    for key, r in rows.items():
        sto = ""
        if storage:
            # a limit row is a sum of two methods' walls: it read nothing of its own
            got = [p.get("io_read_bytes") for p in r["ranks"]]
            sto = (_mb(sum(got)) if not r.get("derived") and None not in got else _mb(None)) + " | "
        walls = ", ".join(_f(p["wall_s"]) for p in r["ranks"])
        out.append(f"| {r['label']} (`{key}`) | {_f(r['wall_s'])} | {_f(r['gbps_per_rank'], '{:.2f}')}"
                   f" | {walls} | {_mb(r['bytes_read_per_rank'])} | "
                   f"{_f(r['read_amplification'], '{:.2f}')} | "
                   f"{_f(r.get('page_cache_ratio'), '{:.2f}')} | {sto}{_mb(r['rss_peak_per_rank'])} | "
                   f"{_f(r.get('time_vs_cpu'), '{:.2f}x')} | {_ok(r.get('same_tensors'))} |")
    return "\n".join(out) + "\n"


def _spread(t: dict) -> str:
    if t.get("lo") is None:
        return "–"
    return f"{t['lo']:.2f}–{t['hi']:.2f} ({t['pairs']} pairs)"


def _met(t: dict) -> str:
    if t.get("too_few_pairs"):
        return f"– ({t['pairs']} pairs < {MIN_PAIRS}: not judged)"
    return _ok(t.get("ok"))


def _cold_cell(k: str, c: dict) -> str:
    """The cold figure with its own spread and, for the best peer, its own peer (the
    warm and the cold best peer can differ)."""
    if not c:
        return "–"
    cell = _f(c.get("value"), "{:.2f}")
    if k == "cpu_vs_best_peer" and c.get("peer"):
        cell += f" (`{c['peer']}`)"
    if c.get("lo") is not None:
        cell += f", {_spread(c)}"
    return cell


def load_section(sec: dict) -> str:
    out = [f"### Load: {os.path.basename(sec['ckpt'].rstrip('/'))}, "
           f"{sec['checkpoint_bytes'] / 1e9:.2f} GB in {sec['files']} files, "
           f"{sec['world']} ranks at tp={sec['layout']['tp']}, {sec['repeats']} repeats", ""]
    rows = [r for r in sec["warm"].values() if r["bytes_held_per_rank"]]
    if rows:
        runs = sec.get("byte_runs_per_rank") or []
        if runs:
            mean = [x for x in sec.get("mean_run_bytes", []) if x]
            out.append(f"The plan reads {max(runs):,} byte runs per rank (mean "
                       f"{min(mean):,.0f} bytes per run: every row of a dim-1 slice is its "
                       f"own run).")
        pages, held = sec.get("page_bytes_per_rank"), sec.get("bytes_held_plan")
        if pages and held:
            out.append(f"The distinct 4 KiB file pages under a rank's byte runs total "
                       f"{max(pages) / 1e6:,.0f} MB ({max(p / h for p, h in zip(pages, held)):.2f}x "
                       "the bytes held): what storage transfers for a cold slice-exact read, "
                       "whatever the method, since storage and the page cache move whole pages.")
        base = min(p["rss_ready"] for r in rows for p in r["ranks"])
        out.append(f"Bytes held per rank: {max(r['bytes_held_per_rank'] for r in rows) / 1e6:,.0f} MB. "
                   "GB/s = bytes held / wall (the ceiling row: file bytes / wall; the memcpy "
                   "row: bytes copied / wall). Bytes read = "
                   "what the method asks for (the cpu engine: the plan's bytes); read ampl. = "
                   "bytes read / held; page-cache bytes copied = what is copied out of the page "
                   "cache, including the sub-page gaps a span read carries (cpu engine: plan "
                   "bytes + `gap_bytes`). Peak RSS "
                   f"includes the interpreter and torch (about {base / 1e6:,.0f} MB before "
                   "the load).")
        out.append("")
    out.append(load_table(sec["warm"], "Warm page cache"))
    if sec.get("cold"):
        out.append(load_table(sec["cold"], "Cold page cache (dropped before each run; storage "
                              "read = sum of the ranks' /proc/self/io read_bytes, readahead "
                              "included)", storage=True))
    if sec.get("targets"):
        cold_t = sec.get("cold_targets") or {}
        out += ["Targets: ratios against peers, the limit and the whole read into existing "
                "tensors are medians of ratios paired within a repeat (the methods alternate "
                "inside each repeat, in a counterbalanced order), with their min-max over "
                f"the pairs; judged on {MIN_PAIRS} pairs or more. The best peer is the one the engine "
                "leads by the least (lowest paired median), warm and cold each its own.", "",
                "| target | warm | pairs min-max (warm) | met (warm) | cold (pairs min-max) "
                "| met (cold) | goal |",
                "|---|---:|---:|:---:|---:|:---:|---|"]
        for k, t in sec["targets"].items():
            c = cold_t.get(k) or {}
            name = f"{k} (`{t['peer']}`)" if k == "cpu_vs_best_peer" else k
            out.append(f"| {name} | {_f(t['value'], '{:.2f}')} | {_spread(t)} | {_met(t)} | "
                       f"{_cold_cell(k, c)} | {_met(c) if c else '–'} | {t['target']} |")
        out.append("")
    for n in sec.get("notes", []):
        out.append(f"- {n}")
    for k, v in sec.get("failed", {}).items():
        out.append(f"- **{k} failed**: {v.splitlines()[0]} (details in results.json)")
    return "\n".join(out) + "\n"


def plan_section(sec: dict) -> str:
    out = [f"### Plan + exact-cover validation: DeepSeek-V3 full metadata "
           f"({sec['tensors']:,} tensors, {sec['files']} files, "
           f"{sec['described_bytes'] / 1e9:.0f} GB described; headers read in "
           f"{sec['metadata_s']:.2f} s)", "",
           "Total = the median over repeats of plan + cover (the target's figure; plan s "
           "and cover s are their own medians, first = the first repeat's total); a load "
           "computes the plan and its digest on every rank (digest s), not the cover. "
           "Rows without a target past 64 ranks run once.", "",
           "| kind | ranks | layout | rank classes | slices | pieces | byte runs | plan s | "
           "cover s | total s | first s | repeats | digest s | slices/s | target |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sec["rows"]:
        tgt = f"<= {r['target_s']:g} s: {_ok(r['ok'])}" if "target_s" in r else ""
        out.append(f"| {r.get('kind', '')} | {r['world']} | {r['layout']} | "
                   f"{r.get('rank_classes', '')} | {r['slices']:,} | {r['pieces']:,} | "
                   f"{r['byte_runs']:,} | {r['plan_s']:.2f} | {r['cover_s']:.2f} | "
                   f"{r['total_s']:.2f} | {_f((r.get('totals_s') or [None])[0], '{:.2f}')} | "
                   f"{r.get('repeats', '')} | {_f(r.get('digest_s'), '{:.2f}')} | "
                   f"{r['slices_per_s']:,.0f} | {tgt} |")
    m = sec.get("metadata_split")
    if m:
        steps = ", ".join(f"{k} {v:.3f}" for k, v in m["steps_slowest"].items())
        out += ["", f"Metadata phase of a {m['world']}-rank load, per rank (discover, read "
                f"files[r::{m['world']}] headers, identity fingerprint of all {m['files']} "
                f"files, gather, assemble all headers); simulated: {m['simulated']}.", "",
                "| ranks | slowest rank s | median rank s | all samples min-max s | "
                "slowest rank, best repeat s | slowest rank CPU s | slowest rank's steps s | "
                "repeats | target |",
                "|---:|---:|---:|---:|---:|---:|---|---:|---|",
                f"| {m['world']} | {m['slowest_s']:.3f} | {m['median_s']:.3f} | "
                f"{m['min_s']:.3f}-{m['max_s']:.3f} | {m['slowest_best_s']:.3f} | "
                f"{m['slowest_cpu_s']:.3f} | {steps} | {m['repeats']} | "
                f"<= {m['target_s']:g} s: {_ok(m['ok'])} |"]
    return "\n".join(out) + "\n"


def _phase_rows(pairs: dict, prefix: str) -> list[str]:
    rows = []
    for mode in ("shapes", "digest"):
        ph = ", ".join(f"{k} {v:.3f}" for k, v in pairs[mode]["phases"].items())
        rows.append(f"| {prefix}phases, verify='{mode}' (s, slowest rank, median of repeats) | {ph} |")
    return rows


def verify_section(sec: dict) -> str:
    d = sec["digest"]
    out = [f"### Verify: content digests, {sec['layout']['tp']} ranks at tp={sec['layout']['tp']}",
           "", "| what | value |", "|---|---:|",
           f"| digest of every planned piece, per rank ({d.get('route', '?')} route) | "
           f"{d['gbps_per_rank']:.2f} GB/s, {d['wall_s']:.3f} s |"]
    if sec.get("digest_fallback"):
        fb = sec["digest_fallback"]
        out.append(f"| the same down the {fb['route']} route (what runs without the kernel) | "
                   f"{fb['gbps_per_rank']:.2f} GB/s, {fb['wall_s']:.3f} s "
                   f"({fb['wall_s'] / d['wall_s']:.2f}x the time) |")
    out += [f"| cpu engine load of the same slices | {sec['cpu_load']['wall_s']:.3f} s |",
            f"| digest time / load time | {100 * sec['digest_fraction_of_load']:.0f}% |"]
    m = sec.get("manifest") or {}
    if m.get("written"):
        out.append(f"| manifest (whole checkpoint, 1 thread) | {m['gbps']:.2f} GB/s, "
                   f"{m['seconds']:.2f} s |")
    e = sec.get("e2e")
    if e:
        out.append(f"| load(verify='shapes') end to end | {e['shapes']['wall_s']:.3f} s |")
        out.append(f"| load(verify='digest') end to end | {e['digest']['wall_s']:.3f} s |")
        out.append(f"| digest mode adds (median of paired repeats) | "
                   f"{100 * e['digest_adds']:.0f}% (target < 25%: {_ok(e['digest_adds'] < 0.25)}) |")
        out.append(f"| the same, from the verify phase alone (digest - shapes) / shapes wall | "
                   f"{100 * e['verify_phase_adds']:.0f}% |")
        out += _phase_rows(e, "")
    c = sec.get("e2e_cold")
    if c:
        out.append(f"| cold cache: load(verify='shapes') / load(verify='digest') end to end | "
                   f"{c['shapes']['wall_s']:.3f} s / {c['digest']['wall_s']:.3f} s |")
        out.append(f"| cold cache: digest mode adds (median of paired repeats; disk time varies "
                   f"run to run) | {100 * c['digest_adds']:.0f}% |")
        out.append(f"| cold cache: the same, from the verify phase alone | "
                   f"{100 * c['verify_phase_adds']:.0f}% |")
        out += _phase_rows(c, "cold cache: ")
    out.append("")
    for n in sec.get("notes", []):
        out.append(f"- {n}")
    return "\n".join(out) + "\n"


def save_section(sec: dict) -> str:
    if "save" not in sec:
        return "### Save\n\n" + "\n".join(f"- {n}" for n in sec.get("notes", [])) + "\n"
    s = sec["save"]
    out = [f"### Save and resharded load (saved at {sec['layout_saved']}, "
           f"loaded at {sec['layout_loaded']})", "", "| what | wall s | GB/s per rank |",
           "|---|---:|---:|",
           f"| coordloader.save, per rank (primary pieces, digests on) | {s['wall_s']:.3f} | "
           f"{s['gbps_per_rank']:.2f} |"]
    for k, r in sec.get("loads", {}).items():
        out.append(f"| {k.replace('_', ' ')} load at {sec['layout_loaded']} | {r['wall_s']:.3f} | "
                   f"{r['gbps_per_rank']:.2f} |")
    if "resharded_vs_direct" in sec:
        out.append(f"| resharded / direct (cpu engine) | {sec['resharded_vs_direct']:.2f}x | "
                   f"same tensors: {_ok(sec['same_tensors'])} |")
    out.append("")
    for n in sec.get("notes", []):
        out.append(f"- {n}")
    return "\n".join(out) + "\n"


def headline(results: dict) -> str:
    """One line, always the last one printed. Format (stable, parsed by tests):
    ``headline: coordloader cpu engine P.PPx the speed of the best peer, LABEL (`KEY`)
    (C s vs B s median wall, paired min-max L-H over N repeats); X.XXx the speed of
    safetensors whole-read+narrow (C s vs W s median wall), R ranks, warm page cache``
    (a ratio = other wall / cpu engine wall: above 1 the engine is faster; either part
    alone when the run had only the peers or only the whole read), or, without a load
    section, the planner's or ``headline: n/a (...)``."""
    load = results.get("load") or {}
    h = load.get("headline")
    if h:
        parts = []
        p = h.get("peer")
        if p:
            parts.append(f"{p['ratio']:.2f}x the speed of the best peer, {p['label']} "
                         f"(`{p['key']}`) ({h['cpu_s']:.3f} s vs {p['peer_s']:.3f} s median wall, "
                         f"paired min-max {p['lo']:.2f}-{p['hi']:.2f} over {p['pairs']} repeats)")
        if "ratio" in h:
            parts.append(f"{h['ratio']:.2f}x the speed of safetensors whole-read+narrow "
                         f"({h['cpu_s']:.3f} s vs {h['whole_s']:.3f} s median wall)")
        return (f"{HEADLINE_PREFIX} coordloader cpu engine {'; '.join(parts)}, "
                f"{load['world']} ranks, warm page cache")
    plan = results.get("plan")
    if plan and plan.get("rows"):
        big = plan["rows"][-1]
        return (f"{HEADLINE_PREFIX} planner+cover {big['total_s']:.2f} s for {big['world']} ranks "
                f"({big['slices']:,} slices, {big['slices_per_s']:,.0f} slices/s)")
    ver = results.get("verify")
    if ver:
        return (f"{HEADLINE_PREFIX} digest {ver['digest']['gbps_per_rank']:.2f} GB/s per rank, "
                f"{100 * ver['target']['value']:.0f}% on top of a cpu load")
    sv = results.get("save")
    if sv and "save" in sv:
        return (f"{HEADLINE_PREFIX} save {sv['save']['gbps_per_rank']:.2f} GB/s per rank, "
                f"resharded load {sv['resharded_vs_direct']:.2f}x the direct load time")
    return (f"{HEADLINE_PREFIX} n/a (the load section did not run the cpu engine with a "
            f"peer or the whole-read baseline)")


def render(results: dict) -> str:
    m = results["machine"]
    parts = [f"## Results ({m['time']}, {m.get('cpu_model', '?')}, {m['cpus']} CPUs, "
             f"{m.get('mem_total_gb', '?')} GB RAM, torch {m['torch']}, "
             f"{'CUDA' if m['cuda'] else 'no GPU'})", ""]
    if results.get("quick"):
        parts.append("_--quick run: fewer repeats and layouts; indicative only._\n")
    if results.get("load"):
        parts.append(load_section(results["load"]))
    if results.get("plan"):
        parts.append(plan_section(results["plan"]))
    if results.get("verify"):
        parts.append(verify_section(results["verify"]))
    if results.get("save"):
        parts.append(save_section(results["save"]))
    if results.get("vllm"):
        from coordloader.bench.vllm_bench import vllm_section
        parts.append(vllm_section(results["vllm"]))
    for k, v in results.get("errors", {}).items():
        parts.append(f"- **{k} bench failed**: {v.splitlines()[0]} (details in results.json)")
    return "\n".join(parts)


def write(out_dir: str, results: dict) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "results.md")
    js = os.path.join(out_dir, "results.json")
    with open(md, "w") as f:
        f.write(render(results))
    with open(js, "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    return {"markdown": md, "json": js}


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)
