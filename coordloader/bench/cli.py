"""``python -m coordloader.bench {plan,load,verify,save,all}``: argument parsing and the
run of the chosen sections. Each section is independent: one that fails is reported and
the others still run. The last line printed is always the headline (report.headline)."""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from coordloader.bench import report
from coordloader.bench.common import MIN_PAIRS, cached_checkpoint, machine_info
from coordloader.bench.common import log_err as log
from coordloader.errors import CoordloaderError
from coordloader.text import ArgumentParser, positive_count, positive_number

SECTIONS = ("load", "verify", "save", "plan")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog="python -m coordloader.bench",
        description="Benchmark coordloader's planner, engines and verification against "
                    "baselines on this machine's storage; writes a markdown table, a JSON "
                    "file and PNG plots, and prints the headline ratio as the last line.")
    ap.add_argument("what", choices=("plan", "load", "verify", "save", "vllm", "all"),
                    help="which benchmark: plan (planner + cover on DeepSeek-V3 metadata), "
                         "load (engines vs baselines), verify (digest cost), save (save and "
                         "resharded load), vllm (vLLM start with --load-format coordloader vs "
                         "safetensors; needs vLLM, not part of all), all")
    ap.add_argument("--quick", action="store_true",
                    help="fewer repeats, no cold-cache runs, fewer planner layouts "
                         "(under 5 minutes on 2 cores)")
    ap.add_argument("--ckpt", metavar="PATH",
                    help="checkpoint for load/verify/save (default: synthesize --arch/--size "
                         "once under $COORDLOADER_BENCH_CACHE or /tmp/coordloader-bench)")
    ap.add_argument("--plan-ckpt", metavar="PATH",
                    help="checkpoint whose metadata the plan bench uses (default: a "
                         "metadata-only synthesized full DeepSeek-V3)")
    ap.add_argument("--arch", default="qwen3_moe", help="architecture to synthesize (default "
                                                        "qwen3_moe)")
    ap.add_argument("--size", default="small", choices=("tiny", "small", "full"),
                    help="size to synthesize (default small, ~1.2 GB for qwen3_moe)")
    ap.add_argument("--tp", type=_ranks, default=2, help="tensor-parallel ranks of the load "
                                                      "benches (default 2)")
    ap.add_argument("--out", metavar="DIR", default="bench-out",
                    help="output directory for results.md, results.json and plots "
                         "(default bench-out)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="repeats per method, medians reported (default 7, the pairs a "
                         "paired target is judged on; 1 with --quick)")
    ap.add_argument("--cold-repeats", type=int, default=1,
                    help="cold-cache repeats per method (default 1)")
    ap.add_argument("--no-cold", action="store_true", help="skip cold-cache runs")
    ap.add_argument("--worlds", metavar="N,N,...", type=_worlds,
                    help="rank counts for the plan bench (default 8,16,...,1024; with --quick "
                         "8,64,1024)")
    from coordloader.bench.load_bench import load_methods
    ap.add_argument("--methods", metavar="M,M,...",
                    help=f"load methods to run (default: all that apply): {', '.join(load_methods())}")
    ap.add_argument("--timeout", type=positive_number("seconds"), default=900.0,
                    help="seconds before a stuck rank is killed (default 900)")
    return ap


_ranks = positive_count("ranks")


def _worlds(text: str) -> list[int]:
    return [_ranks(x) for x in text.split(",")]


def repeats_of(a) -> int:
    """The repeats per method: given, else 1 with --quick, else MIN_PAIRS (the paired
    targets are judged on that many pairs: fewer by default would judge none)."""
    return a.repeats if a.repeats is not None else (1 if a.quick else MIN_PAIRS)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    repeats = repeats_of(a)
    if repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2
    if a.cold_repeats < 1:   # (0 ran no cold repeat and said nothing)
        print("--cold-repeats must be >= 1 (--no-cold skips the cold runs)", file=sys.stderr)
        return 2
    methods = a.methods.split(",") if a.methods else None
    if methods:
        from coordloader.bench.load_bench import load_methods
        known = load_methods()   # what --help lists: digest and save are not load methods
        bad = [m for m in methods if m not in known]
        if bad:
            print(f"unknown load method(s) {', '.join(bad)}; expected some of "
                  f"{', '.join(known)}", file=sys.stderr)
            return 2
        twice = sorted({m for m in methods if methods.count(m) > 1})
        if twice:   # a method's extra walls were paired with another repeat's
            print(f"load method(s) named twice in --methods: {', '.join(twice)}",
                  file=sys.stderr)
            return 2
    sections = SECTIONS if a.what == "all" else (a.what,)
    results: dict = {"machine": machine_info(), "quick": a.quick, "repeats": repeats,
                     "argv": sys.argv[1:] if argv is None else list(argv), "errors": {}}
    ckpt = None

    def load_ckpt() -> str:
        nonlocal ckpt
        if ckpt is None:
            ckpt = os.path.abspath(a.ckpt) if a.ckpt else cached_checkpoint(a.arch, a.size,
                                                                           log=log)
        return ckpt

    for sec in sections:
        try:
            if sec == "load":
                from coordloader.bench.load_bench import bench_load
                results["load"] = bench_load(load_ckpt(), tp=a.tp, repeats=repeats,
                                             cold=not (a.no_cold or a.quick),
                                             cold_repeats=a.cold_repeats, methods=methods,
                                             timeout=a.timeout, log=log)
            elif sec == "verify":
                from coordloader.bench.verify_bench import bench_verify
                results["verify"] = bench_verify(load_ckpt(), tp=a.tp, repeats=repeats,
                                                 load_section=results.get("load"),
                                                 cold=not (a.no_cold or a.quick),
                                                 cold_repeats=a.cold_repeats,
                                                 timeout=a.timeout, log=log)
            elif sec == "save":
                from coordloader.bench.save_bench import bench_save
                results["save"] = bench_save(load_ckpt(), tp=a.tp, repeats=repeats,
                                             timeout=a.timeout, log=log)
            elif sec == "vllm":
                from coordloader.bench.vllm_bench import bench_vllm
                results["vllm"] = bench_vllm(load_ckpt(), tp=a.tp, repeats=repeats,
                                             timeout=a.timeout, log=log)
            elif sec == "plan":
                from coordloader.bench.plan_bench import QUICK_WORLDS, bench_plan
                pc = (os.path.abspath(a.plan_ckpt) if a.plan_ckpt else
                      cached_checkpoint("deepseek_v3", "full", metadata_only=True, log=log))
                worlds = a.worlds or (QUICK_WORLDS if a.quick else None)
                results["plan"] = bench_plan(pc, worlds=worlds, repeats=repeats, log=log)
        except Exception as e:  # one section's failure must not hide the others' figures
            results["errors"][sec] = f"{type(e).__name__}: {e}"
            log(f"[bench] {sec} failed: {type(e).__name__}: {e}")
            if not isinstance(e, CoordloaderError):   # a typed error says it all; others are bugs
                log(traceback.format_exc())
        # a method that failed is a failed run too, not only a whole section
        got = results.get(sec)
        for m, why in ((got.get("failed") if isinstance(got, dict) else None) or {}).items():
            results["errors"][f"{sec}: {m}"] = why
    results["seconds"] = time.perf_counter() - t_start
    from coordloader.bench.plots import write_plots
    try:
        plots, note = write_plots(a.out, results)
        results["plots"] = plots
        if note:
            results.setdefault("notes", []).append(note)
        paths = report.write(a.out, results)
    except OSError as e:
        print(f"coordloader bench: cannot write the results to {a.out}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    print(report.render(results))
    print(f"wrote {paths['markdown']}, {paths['json']}"
          + (", " + ", ".join(plots) if plots else "") + f" in {results['seconds']:.0f} s")
    print(report.headline(results))
    return 1 if results["errors"] else 0
