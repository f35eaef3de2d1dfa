"""``python -m coordloader.bench vllm``: vLLM started on the same checkpoint with
``--load-format coordloader`` and with vLLM's own ``safetensors`` format, alternating,
each start with the checkpoint's pages evicted (cold): model start time and the bytes
each worker fetched from storage, side by side. Needs an environment where ``import
vllm`` works (docs/serving.md); each start runs in the driver process
(coordloader.bench.vllm_driver)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import NamedTuple

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.reader import read_checkpoint

FORMATS = ("safetensors", "coordloader")


def bench_vllm(ckpt: str, *, tp: int, repeats: int, timeout: float, log) -> dict:
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vLLM is not importable here; run in the vLLM environment "
                           "(docs/serving.md)")
    meta = read_checkpoint(ckpt)
    total = sum(t.numel * itemsize(t.dtype) for t in meta.tensors.values())
    jobs = [dict(name=f"{fmt}-{i}", checkpoint=ckpt, format=fmt, tp=tp, generate=False, cold=True)
            for i in range(repeats) for fmt in (FORMATS if i % 2 == 0 else FORMATS[::-1])]
    with tempfile.TemporaryDirectory() as d:
        jf, out = os.path.join(d, "jobs.json"), os.path.join(d, "out.json")
        with open(jf, "w") as f:
            json.dump(jobs, f)
        log(f"[bench] vllm: {len(jobs)} vLLM starts at tp={tp} on {ckpt}")
        subprocess.run([sys.executable, "-m", "coordloader.bench.vllm_driver", jf, out],
                       timeout=timeout, check=False, capture_output=True)
        with open(out) as f:
            res = json.load(f)
    isolated = {"safetensors": [_isolated_read(ckpt, "safetensors", tp, 0, timeout)] * tp,
                "coordloader": [_isolated_read(ckpt, "coordloader", tp, r, timeout)
                                for r in range(tp)]}
    rows = {}
    for fmt in FORMATS:
        runs = [res[j["name"]] for j in jobs if j["format"] == fmt and j["name"] in res]
        errors = [r["error"]["message"] for r in runs if "error" in r]
        if errors:
            raise RuntimeError(f"{fmt}: {errors[0][:500]}")
        starts = [r["seconds_init"] for r in runs]
        # storage reads of each rank, per start: the median over starts, per rank
        per_rank = [statistics.median(r["workers"][k]["read_bytes"] or 0 for r in runs)
                    for k in range(tp)]
        row = {"start_s": statistics.median(starts), "start_min_s": min(starts),
               "start_max_s": max(starts), "read_bytes_per_rank": per_rank, "starts": len(runs),
               "isolated_read_per_rank": isolated[fmt]}
        if fmt == "coordloader":
            reps = [r["workers"][k]["report"] for r in runs for k in range(tp)]
            row["planned_read_per_rank"] = [reps[k]["bytes_read"] for k in range(tp)]
            row["load_s"] = statistics.median(x["seconds_total"] for x in reps)
        rows[fmt] = row
    def ratio(field: str) -> list:
        return [getattr(c, field) / getattr(s, field) if getattr(s, field) else None
                for c, s in zip(isolated["coordloader"], isolated["safetensors"])]
    return {"tp": tp, "checkpoint": ckpt, "checkpoint_bytes": total, "rows": rows,
            "asked_ratio_per_rank": ratio("asked"), "fetched_ratio_per_rank": ratio("fetched")}


# One rank's reads alone, in a fresh process after evicting the checkpoint: what a rank
# fetches when nothing else on the machine shares its page cache (one rank per node, or
# any rank of a cold start). vLLM's iterator is the one its safetensors format runs on
# every rank, over every weight file.
_READ_ALONE = {
    "safetensors": """
import glob, os, sys
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
files = sorted(glob.glob(os.path.join(sys.argv[1], "*.safetensors")))
before, asked = read_bytes(), 0
for _name, t in safetensors_weights_iterator(files, False):
    asked += t.numel() * t.element_size()
print(asked, read_bytes() - before)
""",
    "coordloader": """
import sys
import coordloader as cl
before = read_bytes()
res = cl.load_detailed(sys.argv[1], cl.Layout(tp=int(sys.argv[2])), rank=int(sys.argv[3]),
                       verify="none")
print(res.stats.bytes_read, read_bytes() - before)
""",
}


class ReadAlone(NamedTuple):
    asked: int      # bytes of tensor data the loader asked the files for
    fetched: int    # bytes the kernel fetched from storage for it (pages, readahead)


def _isolated_read(ckpt: str, fmt: str, tp: int, rank: int, timeout: float) -> ReadAlone:
    from coordloader.bench.common import evict_files
    evict_files(os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".safetensors"))
    prelude = "from coordloader.bench.vllm_driver import _read_bytes as read_bytes\n"
    p = subprocess.run([sys.executable, "-c", prelude + _READ_ALONE[fmt], ckpt, str(tp), str(rank)],
                       capture_output=True, text=True, timeout=timeout, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{fmt} read alone failed: {p.stderr[-800:]}")
    asked, fetched = p.stdout.strip().splitlines()[-1].split()
    return ReadAlone(int(asked), int(fetched))


def vllm_section(sec: dict) -> str:
    tp = sec["tp"]
    out = [f"### vLLM model start, cold page cache (tp={tp}, checkpoint "
           f"{sec['checkpoint_bytes'] / 1e6:.1f} MB)", "",
           "| load format | start s (median, min–max) | asked per rank alone, MB | "
           "fetched per rank alone, MB | fetched per worker in vLLM, MB |",
           "|---|---:|---:|---:|---:|"]
    for fmt, r in sec["rows"].items():
        asked = ", ".join(f"{x[0] / 1e6:.1f}" for x in r["isolated_read_per_rank"])
        alone = ", ".join(f"{x[1] / 1e6:.1f}" for x in r["isolated_read_per_rank"])
        reads = ", ".join(f"{b / 1e6:.1f}" for b in r["read_bytes_per_rank"])
        out.append(f"| {fmt} | {r['start_s']:.1f} ({r['start_min_s']:.1f}–{r['start_max_s']:.1f}) "
                   f"| {asked} | {alone} | {reads} |")

    def fmt_ratio(xs):
        return ", ".join("–" if x is None else f"{x:.2f}" for x in xs)
    out += ["", f"- coordloader / safetensors per rank: asked {fmt_ratio(sec['asked_ratio_per_rank'])}, "
                f"fetched from storage {fmt_ratio(sec['fetched_ratio_per_rank'])}",
            "- 'alone': one rank's load in a fresh process after evicting the checkpoint "
            "(vLLM's `safetensors_weights_iterator`, which its format runs on every rank, vs "
            "coordloader's load of that rank). 'asked': tensor bytes requested from the files; "
            "'fetched': `read_bytes` of /proc/self/io, whole pages plus the kernel's readahead, "
            "so a split inside rows narrower than a few pages fetches the whole tensor",
            "- 'in vLLM': each worker's `read_bytes` during a cold vLLM start; the workers of "
            "one machine share the page cache, so whichever touches a page first is charged "
            "for it and the per-worker figures split the checkpoint for both formats"]
    return "\n".join(out) + "\n"
