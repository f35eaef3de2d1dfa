"""Smoke tests of the bench machinery (``python -m coordloader.bench``) on a tiny
checkpoint: rank processes, the output files, the table, the headline line. The real
benchmark is never run here."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from statistics import median

import pytest

pytestmark = pytest.mark.slow   # runs the benchmarks in worker processes

pytest.importorskip("safetensors")

PEER = (r"(\d+\.\d+)x the speed of the best peer, [^`]+ \(`(\w+)`\) \((\d+\.\d+) s vs "
        r"(\d+\.\d+) s median wall, paired min-max (\d+\.\d+)-(\d+\.\d+) over (\d+) repeats\)")
WHOLE = (r"(\d+\.\d+)x the speed of safetensors whole-read\+narrow \((\d+\.\d+) s vs "
         r"(\d+\.\d+) s median wall\)")
HEADLINE = re.compile(rf"^headline: coordloader cpu engine {PEER}; {WHOLE}, 2 ranks, warm page cache$")
HEADLINE_WHOLE = re.compile(rf"^headline: coordloader cpu engine {WHOLE}, 2 ranks, warm page cache$")


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_qwen3_moe):
    return tiny_qwen3_moe


def _bench(args, timeout=120):
    env = {**os.environ, "COORDLOADER_BENCH_CACHE": "/nonexistent-bench-cache"}
    return subprocess.run([sys.executable, "-m", "coordloader.bench", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_load_bench_outputs_and_headline(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    p = _bench(["load", "--ckpt", tiny_ckpt, "--repeats", "2", "--no-cold", "--out", str(out),
                "--methods", "ceiling,fresh_floor,memcpy,pcopy,preadv,span,cpu,st_whole,cpu_into,"
                "st_whole_into,st_mmap_narrow,st_slice"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.rstrip("\n").splitlines()
    m = HEADLINE.match(lines[-1])
    assert m, lines[-1]
    assert m[2] in ("span", "st_slice", "st_mmap_narrow") and m[7] == "2"
    assert float(m[5]) <= float(m[1]) <= float(m[6])
    ratio, cpu_s, whole_s = (float(x) for x in m.groups()[7:])
    # the seconds are printed rounded to 1 ms: the ratio must fit them within that rounding
    h = 0.0005
    assert (whole_s - h) / (cpu_s + h) - 0.005 <= ratio <= (whole_s + h) / max(cpu_s - h, 1e-9) + 0.005
    assert ratio == pytest.approx(res_ratio(out), abs=0.006)

    md = (out / "results.md").read_text()
    assert "| method |" in md and "(`cpu`)" in md and "(`st_whole`)" in md
    res = json.loads((out / "results.json").read_text())
    warm = res["load"]["warm"]
    assert set(warm) == {"ceiling", "fresh_floor", "memcpy", "floor_memcpy", "pcopy",
                         "floor_pcopy", "preadv", "span",
                         "cpu", "st_whole", "cpu_into", "st_whole_into", "st_mmap_narrow",
                         "st_slice"}
    assert "(`st_mmap_narrow`)" in md and "page-cache bytes copied / held" in md
    # every slice-holding method left each rank exactly the same tensors
    for k in ("preadv", "span", "cpu", "st_whole", "cpu_into", "st_whole_into", "st_mmap_narrow",
              "st_slice"):
        assert warm[k]["same_tensors"] is True, k
        assert [r["rank"] for r in warm[k]["ranks"]] == [0, 1]
        for r in warm[k]["ranks"]:
            assert r["bytes_held"] > 0 and r["wall_s"] > 0 and r["rss_peak"] > 0
    # the whole-read baseline reads every tensor whole: about twice what a tp=2 rank holds
    assert warm["st_whole"]["read_amplification"] > 1.5
    assert warm["st_whole"]["page_cache_ratio"] > 1.5
    # the lazy mmap variant copies only the slices' bytes out of the page cache
    assert warm["st_mmap_narrow"]["read_amplification"] == pytest.approx(1.0)
    assert warm["cpu"]["read_amplification"] <= 1.01
    # the engine's page-cache copies = plan bytes + the sub-page gaps of span reads
    for r in warm["cpu"]["ranks"]:
        gap = r["extra"]["engine_extra"]["gap_bytes"]
        assert r["page_cache_bytes"] == r["bytes_read"] + gap
    assert warm["span"]["page_cache_ratio"] >= warm["span"]["read_amplification"] == 1.0
    pages = res["load"]["page_bytes_per_rank"]
    assert all(p % 4096 == 0 and p >= h for p, h in zip(pages, res["load"]["bytes_held_plan"]))
    assert warm["ceiling"]["bytes_read_per_rank"] == res["load"]["checkpoint_bytes"]
    if res["plots"]:
        assert (out / "load_gbps.png").stat().st_size > 1000
    assert "cold-cache runs not requested" in res["load"]["notes"]
    # the floor holds nothing to compare and reads nothing; it holds every byte the ranks
    # hold until after its clock, as the methods that load do
    assert warm["fresh_floor"]["same_tensors"] is None
    assert [r["bytes_read"] for r in warm["fresh_floor"]["ranks"]] == [0, 0]
    assert [r["bytes_held"] for r in warm["fresh_floor"]["ranks"]] == res["load"]["bytes_held_plan"]
    targets = res["load"]["targets"]
    assert targets["cpu_vs_whole_read_into_existing"]["value"] == pytest.approx(median(
        a / b for a, b in zip(warm["st_whole_into"]["walls_s"], warm["cpu_into"]["walls_s"])))
    assert "(`cpu_into`)" in md and "cpu_vs_whole_read_into_existing" in md
    # the limit row: per repeat, the floor plus one memcpy of the held bytes
    lim = warm["floor_memcpy"]

    def limit(f, m):   # rank by rank, the slowest rank's sum
        return [max(x + y for x, y in zip(a, b)) for a, b in zip(warm[f]["rank_walls_s"],
                                                                 warm[m]["rank_walls_s"])]
    assert lim["walls_s"] == pytest.approx(limit("fresh_floor", "memcpy"))
    assert warm["memcpy"]["gbps_per_rank"] > 0    # the memcpy rate: bytes copied / wall
    # the same with the copy out of the page cache: (p) read as many bytes as each rank holds
    assert [r["bytes_read"] for r in warm["pcopy"]["ranks"]] == res["load"]["bytes_held_plan"]
    assert warm["floor_pcopy"]["walls_s"] == pytest.approx(limit("fresh_floor", "pcopy"))
    assert targets["cpu_vs_floor_pcopy"]["ok"] is None and "(`floor_pcopy`)" in md
    assert "(`floor_memcpy`)" in md and "cpu_vs_floor_memcpy" in md and "cpu_vs_best_peer" in md
    for k in ("cpu_vs_best_peer", "cpu_vs_span", "cpu_vs_st_slice", "cpu_vs_st_mmap_narrow",
              "cpu_vs_floor_memcpy"):
        t = targets[k]
        assert t["pairs"] == 2 and t["lo"] <= t["value"] <= t["hi"], k


def test_verify_bench_pairs_shapes_and_digest(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    p = _bench(["verify", "--ckpt", tiny_ckpt, "--repeats", "2", "--no-cold", "--out", str(out)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ver = json.loads((out / "results.json").read_text())["verify"]
    e = ver["e2e"]
    assert e["same_tensors"] is True
    assert "verify" in e["shapes"]["phases"] and e["digest"]["phases"]["verify"] > 0
    assert ver["target"]["value"] == e["digest_adds"] and "verify_phase_adds" in e
    assert "e2e_cold" not in ver
    # the route this install digests with, and the fallback timed beside the kernel
    from coordloader.bench.verify_bench import digest_routes
    route, fallback = digest_routes()
    assert ver["digest"]["route"] == route
    md = (out / "results.md").read_text()
    if route == "kernel":
        assert ver["digest_fallback"]["route"] == fallback and ver["digest_fallback"]["wall_s"] > 0
        assert f"the same down the {fallback} route" in md
    else:
        assert "digest_fallback" not in ver
    # --ckpt is not written to: no manifest, and the report says what digest mode compared
    assert not ver["manifest"]["written"]
    assert any("primaries with replicas" in n for n in ver["notes"])
    md = (out / "results.md").read_text()
    assert "digest mode adds (median of paired repeats)" in md


def res_ratio(out):
    load = json.loads((out / "results.json").read_text())["load"]
    return load["warm"]["st_whole"]["wall_s"] / load["warm"]["cpu"]["wall_s"]


def test_plan_bench_on_small_metadata(tmp_path):
    from coordloader.synth import synthesize
    ckpt = synthesize(str(tmp_path / "dsv3"), "deepseek_v3", "tiny", metadata_only=True)
    out = tmp_path / "out"
    p = _bench(["plan", "--plan-ckpt", ckpt, "--worlds", "8,16", "--repeats", "3",
                "--out", str(out)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    last = p.stdout.rstrip("\n").splitlines()[-1]
    assert re.match(r"^headline: planner\+cover \d+\.\d+ s for 16 ranks \([\d,]+ slices, "
                    r"[\d,]+ slices/s\)$", last), last
    plan = json.loads((out / "results.json").read_text())["plan"]
    rows = plan["rows"]
    split = plan["metadata_split"]   # the per-rank metadata phase of an 8-rank load
    assert split["world"] == 8 and len(split["rank_s"]) == 8 and split["target_s"] == 0.3
    assert split["slowest_s"] == max(split["rank_s"]) >= split["median_s"] > 0
    assert split["slowest_best_s"] > 0 and split["slowest_cpu_s"] > 0
    assert set(split["steps_slowest"]) >= {"discover", "headers", "identity", "gather",
                                           "assemble"}
    assert "Metadata phase of a 8-rank load" in (out / "results.md").read_text()
    assert [(r["kind"], r["world"]) for r in rows] == [
        (k, w) for k in ("pp+dp", "dp", "ep_spans_dp") for w in (8, 16)]
    by = {(r["kind"], r["world"]): r for r in rows}
    # pp=2 splits the layers over stages: the same slices, spread over twice the ranks
    assert by["pp+dp", 16]["slices"] >= by["pp+dp", 8]["slices"] > 0
    # dp=2 doubles the slices but not the rank classes: each tp rank's replicas share one
    assert by["dp", 16]["slices"] == 2 * by["dp", 8]["slices"]
    assert by["dp", 16]["rank_classes"] == by["dp", 8]["rank_classes"] == 8
    # what a load pays besides the plan: its digest, timed beside it
    assert all(r["digest_s"] > 0 for r in rows)
    assert "| digest s |" in (out / "results.md").read_text()
    # the target's total: the median of each repeat's plan + cover, the first one kept
    for r in rows:
        assert len(r["totals_s"]) == r["repeats"] == 3
        assert r["total_s"] == median(r["totals_s"])
    assert "| first s | repeats |" in (out / "results.md").read_text()


def test_a_default_run_has_the_pairs_its_targets_are_judged_on():
    """The default was 3 repeats, so a default run judged no paired target (7 pairs)."""
    from coordloader.bench.cli import build_parser, repeats_of
    from coordloader.bench.common import MIN_PAIRS
    assert repeats_of(build_parser().parse_args(["load"])) == MIN_PAIRS == 7
    assert repeats_of(build_parser().parse_args(["load", "--quick"])) == 1
    assert repeats_of(build_parser().parse_args(["load", "--repeats", "3"])) == 3


def test_unknown_method_is_refused(tmp_path, capsys):
    from coordloader.bench.cli import main
    assert main(["load", "--ckpt", str(tmp_path), "--methods", "cpu,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    # a method twice: its extra walls were paired with another repeat's
    assert main(["load", "--ckpt", str(tmp_path), "--methods", "cpu,cpu,span"]) == 2
    assert "named twice in --methods: cpu" in capsys.readouterr().err
    assert main(["load", "--ckpt", str(tmp_path), "--cold-repeats", "0"]) == 2
    assert "--cold-repeats must be >= 1" in capsys.readouterr().err


def test_compare_flags_different_tensors():
    from coordloader.bench.load_bench import _compare

    def row(wall, sums, held=100, peak=200e6):
        return {"wall_s": wall, "walls_s": [wall] * 7, "rank_walls_s": [[wall] * 2] * 7,
                "gbps_per_rank": held / wall / 1e9, "ranks": [
            {"checksum": s, "checksums_stable": True, "bytes_held": held, "rss_peak": peak}
            for s in sums]}
    rows = {"cpu": row(1.0, ["a", "b"]), "st_whole": row(4.0, ["a", "b"]),
            "preadv": row(0.9, ["a", "X"]), "ceiling": row(0.5, [None, None])}
    t = _compare(rows)
    assert "cpu_vs_best_peer" not in t and "cpu_vs_floor_memcpy" not in t   # none in the run
    assert rows["st_whole"]["same_tensors"] is True
    assert rows["preadv"]["same_tensors"] is False      # a rank got other bytes: flagged
    assert rows["ceiling"]["same_tensors"] is None      # holds no slices: not compared
    assert t["cpu_vs_whole_read"]["value"] == pytest.approx(4.0) and t["cpu_vs_whole_read"]["ok"]
    assert t["cpu_vs_preadv_rate"]["value"] == pytest.approx(0.9)
    assert t["cpu_rss_vs_limit"]["ok"]
    # judged on paired repeats like the others: one pair is shown, not judged (was: a
    # ratio of medians, judged on one repeat)
    few = {k: dict(v, walls_s=v["walls_s"][:1], rank_walls_s=v["rank_walls_s"][:1])
           for k, v in rows.items()}
    t = _compare(few)
    assert t["cpu_vs_whole_read"]["ok"] is None and t["cpu_vs_whole_read"]["too_few_pairs"]
    assert t["cpu_vs_preadv_rate"]["ok"] is None


def test_compare_pairs_repeats_against_the_best_peer_and_the_limit():
    """Peers and the limit are compared per repeat (ratio of the two walls of the same
    repeat), median and min-max over the pairs; the best peer is the one the engine leads
    by the least (lowest paired median); a target is judged on MIN_PAIRS (7) pairs or more."""
    from coordloader.bench.load_bench import _compare

    def row(walls, sums=("a", "b"), held=100):
        walls = list(walls)
        w = sorted(walls)[len(walls) // 2]
        return {"wall_s": w, "walls_s": walls, "label": "x", "gbps_per_rank": held / w / 1e9,
                "rank_walls_s": [[x] * len(sums) for x in walls],
                "ranks": [{"rank": r, "wall_s": w, "checksum": s, "checksums_stable": True,
                           "bytes_held": held, "rss_peak": 1e6} for r, s in enumerate(sums)]}
    rows = {"cpu": row([1.0, 2.0, 1.0] * 3), "span": row([1.1, 1.8, 1.2] * 3),
            "st_slice": row([1.5, 2.5, 1.4] * 3),
            "fresh_floor": row([0.5, 1.0, 0.5] * 3, (None, None)),
            "memcpy": row([0.4, 0.5, 0.3] * 3, (None, None)),
            "pcopy": row([0.5, 1.0, 0.5] * 3, (None, None))}
    t = _compare(rows)
    b = t["cpu_vs_best_peer"]
    assert b["peer"] == "span" and (b["lo"], b["value"], b["hi"]) == pytest.approx((0.9, 1.1, 1.2))
    assert b["ok"] is True and b["pairs"] == 9 and not b["too_few_pairs"]
    assert t["cpu_vs_st_slice"]["value"] == pytest.approx(1.4)
    lim = rows["floor_memcpy"]
    assert lim["walls_s"] == pytest.approx([0.9, 1.5, 0.8] * 3) and lim["same_tensors"] is None
    f = t["cpu_vs_floor_memcpy"]
    assert (f["lo"], f["value"], f["hi"]) == pytest.approx((1.0 / 0.9, 1.25, 2.0 / 1.5))
    assert f["ok"] is False                                     # 1.25 > 1.15
    # through the page cache: the floor plus its copy rate, for information only
    assert rows["floor_pcopy"]["walls_s"] == pytest.approx([1.0, 2.0, 1.0] * 3)
    g = t["cpu_vs_floor_pcopy"]
    assert (g["lo"], g["value"], g["hi"], g["ok"]) == (1.0, 1.0, 1.0, None)
    # and the page-cache limit against (f)+(m), paired per repeat, for information
    h = t["floor_pcopy_vs_floor_memcpy"]
    assert (h["lo"], h["value"], h["hi"], h["ok"], h["pairs"]) == pytest.approx(
        (1.0 / 0.9, 1.25, 2.0 / 1.5, None, 9))
    # 3 pairs: shown, not judged
    few = _compare({k: row(v["walls_s"][:3], *( (("a", "b"),) if v["ranks"][0]["checksum"]
                                                 else ((None, None),)))
                    for k, v in rows.items() if "walls_s" in v and not v.get("derived")})
    assert few["cpu_vs_best_peer"]["ok"] is None and few["cpu_vs_best_peer"]["too_few_pairs"]
    assert few["cpu_vs_floor_memcpy"]["ok"] is None


def test_the_limit_sums_floor_and_copy_rank_by_rank():
    """The limit added the slowest rank's floor to the slowest rank's copy: with the floor
    slowest on rank 0 and the copy on rank 1 it was above every rank's own limit, and the
    engine looked closer to it than it is."""
    from coordloader.bench.load_bench import limit_row
    f = {"walls_s": [0.30], "rank_walls_s": [[0.30, 0.20]],
         "ranks": [{"rank": r, "wall_s": w, "bytes_held": 1} for r, w in enumerate((0.30, 0.20))]}
    m = {"walls_s": [0.12], "rank_walls_s": [[0.06, 0.12]],
         "ranks": [{"rank": r, "wall_s": w, "bytes_held": 1} for r, w in enumerate((0.06, 0.12))]}
    lim = limit_row({"fresh_floor": f, "memcpy": m})
    assert lim["walls_s"] == pytest.approx([0.36]) and lim["wall_s"] == pytest.approx(0.36)


def test_the_best_peer_is_the_lowest_paired_ratio_not_the_fastest_median():
    """span has the lowest median wall, but the engine leads st_slice by less, pair for
    pair: st_slice was not the "best peer", and a met 1.05 hid a missed 0.95."""
    from coordloader.bench.load_bench import _compare

    def row(walls):
        w = sorted(walls)[len(walls) // 2]
        return {"wall_s": w, "walls_s": walls, "label": "x", "gbps_per_rank": 1.0,
                "ranks": [{"rank": 0, "wall_s": w, "checksum": "a", "checksums_stable": True,
                           "bytes_held": 1, "rss_peak": 1}]}
    cpu = [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    span = [1.05, 1.05, 1.05, 1.05, 2.1, 2.1, 2.1]    # median wall 1.05 s: the fastest
    slc = [2.0, 2.0, 2.0, 0.95, 1.9, 1.9, 1.9]        # median wall 1.9 s; pairs: 0.95 x4
    t = _compare({"cpu": row(cpu), "span": row(span), "st_slice": row(slc)})
    assert rows_best(t) == ("st_slice", pytest.approx(0.95))
    assert t["cpu_vs_best_peer"]["ok"] is False
    assert t["cpu_vs_span"]["value"] == pytest.approx(1.05)


def test_a_peer_with_too_few_pairs_does_not_stand_for_the_best():
    """A peer that failed after two repeats (0.5 by its two pairs) was chosen as the best
    peer, "not judged", hiding a judged miss against span."""
    from coordloader.bench.load_bench import _compare

    def row(walls):
        w = sorted(walls)[len(walls) // 2]
        return {"wall_s": w, "walls_s": walls, "label": "x", "gbps_per_rank": 1.0,
                "ranks": [{"rank": 0, "wall_s": w, "checksum": "a", "checksums_stable": True,
                           "bytes_held": 1, "rss_peak": 1}]}
    t = _compare({"cpu": row([1.0] * 9), "span": row([0.95] * 9), "st_slice": row([0.5] * 2)})
    assert rows_best(t) == ("span", pytest.approx(0.95)) and t["cpu_vs_best_peer"]["ok"] is False


def rows_best(t):
    return t["cpu_vs_best_peer"]["peer"], t["cpu_vs_best_peer"]["value"]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 9, 13])
def test_counterbalanced_order_puts_each_method_in_each_place_and_after_each_other(n):
    """Over a cycle (n repeats, 2n for odd n) each method holds each place equally often
    and follows each other method equally often; a rotation with reversal balanced only
    n = 3 (at 13 methods, cpu followed span in nearly every repeat)."""
    from collections import Counter

    from coordloader.bench.load_bench import counterbalanced
    ms = [f"m{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = [counterbalanced(ms, i) for i in range(cycle)]
    assert all(sorted(o) == sorted(ms) for o in orders)
    for pos in range(n):
        assert Counter(o[pos] for o in orders) == {m: cycle // n for m in ms}
    follows = Counter((o[j], o[j + 1]) for o in orders for j in range(n - 1))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_page_bytes_counts_distinct_pages():
    from types import SimpleNamespace as NS

    from coordloader.bench.load_bench import page_bytes
    from coordloader.planning.runs import RunList

    def rp(*groups):
        return NS(tensors=[NS(byte_runs=RunList(groups))])
    P = 4096
    # one run inside one page; the same page again (counted once); a run over a boundary
    assert page_bytes(rp(("f", 10, 100, 0, 1, 0, 0))) == P
    assert page_bytes(rp(("f", 10, 100, 0, 1, 0, 0), ("f", 200, 8, 0, 1, 0, 0))) == P
    assert page_bytes(rp(("f", P - 8, 16, 0, 1, 0, 0))) == 2 * P
    # 256-byte rows 512 apart (a dim-1 half): every page of the span is touched
    assert page_bytes(rp(("f", 0, 256, 0, 64, 512, 256))) == 8 * P
    # rows a page or more apart: only their own pages
    assert page_bytes(rp(("f", 0, 256, 0, 4, 3 * P, 256))) == 4 * P
    # other files do not share pages
    assert page_bytes(rp(("f", 0, 8, 0, 1, 0, 0), ("g", 0, 8, 0, 1, 0, 0))) == 2 * P


def test_headline_fallbacks():
    from coordloader.bench.report import headline
    assert headline({}).startswith("headline: n/a (")
    h = headline({"load": {"world": 2, "headline": {"ratio": 3.5, "cpu_s": 0.2, "whole_s": 0.7}}})
    assert HEADLINE_WHOLE.match(h)
    peer = {"key": "span", "label": "(a'') one-thread span", "ratio": 1.1, "lo": 0.9, "hi": 1.3,
            "pairs": 7, "peer_s": 0.22}
    h = headline({"load": {"world": 2, "headline": {"ratio": 3.5, "cpu_s": 0.2, "whole_s": 0.7,
                                                    "peer": peer}}})
    assert HEADLINE.match(h), h


def test_repeats_vary_the_order_and_the_neighbours(monkeypatch):
    """A method's place in a repeat's order and the method run before it must not bias its
    paired ratios: the repeats vary the order (a fixed design, so reruns match), every
    method meets more than one predecessor and place, and the walls stay paired by
    repeat."""
    from types import SimpleNamespace

    from coordloader.bench import load_bench

    methods = ["cpu", "span", "st_slice", "st_mmap_narrow"]
    repeats = 8

    def run(order):
        def run_ranks(m, **common):
            order.append(m)
            return SimpleNamespace(wall=float(len(order)))
        monkeypatch.setattr(load_bench, "run_ranks", run_ranks)
        monkeypatch.setattr(load_bench, "warm_files", lambda files: None)
        monkeypatch.setattr(load_bench, "ckpt_files", lambda ckpt: [])
        monkeypatch.setattr(load_bench, "summarize",
                            lambda m, label, runs, **kw: [r.wall for r in runs])
        return load_bench._run_set(methods, repeats, cold=True, common={"ckpt": "x"},
                                   log=lambda s: None)

    order: list[str] = []
    out, failed = run(order)
    assert failed == {}
    n = len(methods)
    reps = [order[i * n:(i + 1) * n] for i in range(repeats)]
    assert all(sorted(r) == sorted(methods) for r in reps)
    for m in methods:
        assert len({r.index(m) for r in reps}) > 1
        # within a repeat (not only where one repeat meets the next)
        before = {r[r.index(m) - 1] for r in reps if r.index(m)}
        assert len(before) > 1, (m, before)
        # walls listed by repeat, whatever the method's place in it
        assert out[m] == [float(i * n + r.index(m) + 1) for i, r in enumerate(reps)]
    again: list[str] = []
    run(again)
    assert again == order


def test_failed_methods_fail_the_run_and_bad_input_is_a_usage_error(tiny_ckpt, tmp_path):
    """--timeout 0 failed every method and exited 0; --tp 0 and --worlds x printed a
    traceback; --out naming a file raised a bare FileExistsError."""
    p = _bench(["load", "--ckpt", tiny_ckpt, "--timeout", "0", "--out", str(tmp_path / "o")])
    assert p.returncode == 2 and "--timeout" in p.stderr and "Traceback" not in p.stderr
    p = _bench(["load", "--ckpt", tiny_ckpt, "--repeats", "1", "--no-cold", "--timeout",
                "0.001", "--methods", "span,cpu", "--out", str(tmp_path / "o")])
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    for bad in (["--tp", "0"], ["--worlds", "x"]):
        p = _bench(["plan", *bad, "--out", str(tmp_path / "o")])
        assert p.returncode == 2 and bad[0] in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "afile").write_text("x")
    p = _bench(["load", "--ckpt", tiny_ckpt, "--repeats", "1", "--no-cold", "--methods", "span",
                "--out", str(tmp_path / "afile")])
    assert p.returncode == 1 and "cannot write the results to" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


_FLIP_SITE = '''
import dataclasses, torch
from coordloader.bench import methods as m
_orig = m.METHODS["st_whole"]

def _run(ctx, state, _run=_orig.run):
    tensors, req, extra = _run(ctx, state)
    t = tensors[sorted(tensors)[0]].view(-1).view(torch.uint8)
    t[0] ^= 0xFF
    return tensors, req, extra

m.METHODS["st_whole"] = dataclasses.replace(_orig, run=_run)
'''


def test_a_method_returning_wrong_bytes_fails_the_run(tiny_ckpt, tmp_path):
    """A row whose tensors differ from the cpu engine's was marked same_tensors false in
    the report and the run exited 0: launch/gpu_check.sh, judging by the exit status,
    would call a wrong-bytes instanttensor row "bench_it ok". Here st_whole stands in for
    it, one byte of its result flipped in the bench's rank processes."""
    import json
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FLIP_SITE)
    out = tmp_path / "out"
    env = {**os.environ, "COORDLOADER_BENCH_CACHE": "/nonexistent-bench-cache",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "coordloader.bench", "load", "--ckpt", tiny_ckpt,
                        "--methods", "cpu,st_whole", "--tp", "1", "--repeats", "1",
                        "--no-cold", "--out", str(out)], capture_output=True, text=True,
                       timeout=300, env=env)
    res = json.loads(next(out.glob("*.json")).read_text())
    assert res["load"]["warm"]["st_whole"]["same_tensors"] is False
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "wrong bytes" in res["errors"]["load: st_whole"]


@pytest.mark.parametrize("swap", ["rows-0-7", "elements-3-10", "experts-0-7"])
def test_the_checksum_sees_bytes_moved_where_their_sum_stays(swap):
    """The "same tensors" check summed every byte and every 7th: rows, heads or experts
    swapped 7 apart (the same bytes in each place mod 7) passed as the same tensors."""
    import torch

    from coordloader.bench.methods import checksum
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 8, 4, generator=g).to(torch.bfloat16)
    moved = t.clone()
    if swap == "rows-0-7":
        moved = moved.view(-1, 4)
        moved[[0, 7]] = moved[[7, 0]]
    elif swap == "elements-3-10":
        moved = moved.view(-1)
        moved[[3, 10]] = moved[[10, 3]]
    else:
        moved[[0, 7]] = moved[[7, 0]]
    moved = moved.view(16, 8, 4)
    assert not torch.equal(moved, t)
    assert checksum({"w": t}) == checksum({"w": t.clone()})
    assert checksum({"w": moved}) != checksum({"w": t})


def test_cold_limits_are_shown_not_judged_and_pcopy_reads_each_ranks_own_bytes(tmp_path):
    """Cold, (f)+(m) reads nothing from storage, yet the limit target was judged there
    (0.83, "met (cold)"); and (p) made every rank read the same first bytes, so cold it
    fetched half of what a load of the plan must."""
    from types import SimpleNamespace

    from coordloader.bench.load_bench import _compare
    from coordloader.bench.methods import METHODS

    def row(walls, sums=("a", "b")):
        return {"wall_s": walls[0], "walls_s": walls, "rank_walls_s": [[w] * 2 for w in walls],
                "label": "x", "gbps_per_rank": 1.0,
                "ranks": [{"rank": r, "wall_s": walls[0], "checksum": s, "checksums_stable": True,
                           "bytes_held": 100, "rss_peak": 1e6} for r, s in enumerate(sums)]}
    rows = {"cpu": row([1.0] * 7), "fresh_floor": row([0.9] * 7, (None, None)),
            "memcpy": row([0.3] * 7, (None, None))}
    assert _compare(dict(rows))["cpu_vs_floor_memcpy"]["ok"] is True
    cold = _compare(dict(rows), cold=True)["cpu_vs_floor_memcpy"]
    assert cold["ok"] is None and cold["target"].startswith("(info, cold)")

    data = bytes(range(256)) * 64   # two files of 8 KiB, 16 KiB in all
    files = []
    for i in range(2):
        (tmp_path / f"f{i}").write_bytes(data[i * 8192:(i + 1) * 8192])
        files.append(str(tmp_path / f"f{i}"))
    m = METHODS["pcopy"]
    for rank in range(3):
        ctx = SimpleNamespace(rank_plan=SimpleNamespace(rank=rank, bytes_held=6000),
                              files=files)
        state = m.setup(ctx)
        _, n, _ = m.run(ctx, state)
        start = rank * 6000 % len(data)
        want = (data + data)[start:start + 6000]   # wrapping round the files
        assert n == 6000 and bytes(state[0]) == want, rank


def test_a_limit_row_reads_no_storage_of_its_own_in_the_table():
    from coordloader.bench.report import load_table
    rank = {"rank": 0, "wall_s": 1.0, "io_read_bytes": 5e8}
    rows = {"cpu": {"label": "c", "wall_s": 1.0, "gbps_per_rank": 1.0, "ranks": [rank],
                    "bytes_read_per_rank": 1, "read_amplification": 1.0,
                    "rss_peak_per_rank": 1},
            "floor_pcopy": {"label": "l", "wall_s": 1.0, "gbps_per_rank": 1.0, "derived": True,
                            "ranks": [{"rank": 0, "wall_s": 1.0}], "bytes_read_per_rank": None,
                            "read_amplification": None, "rss_peak_per_rank": None}}
    table = load_table(rows, "cold", storage=True)
    line = next(x for x in table.splitlines() if "`floor_pcopy`" in x)
    assert "500 MB" in table and " 0 MB" not in line and "| – |" in line


def test_cpu_into_builds_its_engine_untimed_as_cpu_does(tmp_path, monkeypatch):
    """cpu_into made its engine (and imported the engine module, 6-25 ms) inside its
    clock, cpu in its setup: the setup's state holds the engine, and the timed run makes
    none and loads the planned bytes into the setup's destinations."""
    import torch

    import coordloader as cl
    from coordloader.bench import methods
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.engines import select_engine
    from coordloader.engines.cpu import CpuEngine
    from coordloader.synth import synthesize
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    meta = read_checkpoint(ck)
    plan = cl.make_plan(meta, cl.Layout(tp=2))
    want, _ = select_engine("cpu", "cpu").load_rank(meta, plan.rank(1), "cpu")
    ctx = methods.RankContext(ck, 1, 2, cl.Layout(tp=2), meta, plan, plan.rank(1))
    state = methods.METHODS["cpu_into"].setup(ctx)
    engine, dsts = state
    assert isinstance(engine, CpuEngine)

    def made(*a, **k):
        raise AssertionError("the timed run made an engine")
    monkeypatch.setattr(methods, "select_engine", made)
    tensors, _, _ = methods.METHODS["cpu_into"].run(ctx, state)
    assert sorted(tensors) == sorted(want)
    assert [n for n in want if tensors[n].data_ptr() != dsts[n].data_ptr()] == []
    assert [n for n in want if not torch.equal(dsts[n], want[n])] == []
