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
               "start_max_s": max(starts), "read_bytes_per_rank": per_rank, "starts": len(runs)}
        if fmt == "coordloader":
            reps = [r["workers"][k]["report"] for r in runs for k in range(tp)]
            row["planned_read_per_rank"] = [reps[k]["bytes_read"] for k in range(tp)]
            row["load_s"] = statistics.median(x["seconds_total"] for x in reps)
        rows[fmt] = row
    ratio = [c / s if s else None for c, s in zip(rows["coordloader"]["read_bytes_per_rank"],
                                                  rows["safetensors"]["read_bytes_per_rank"])]
    return {"tp": tp, "checkpoint": ckpt, "checkpoint_bytes": total, "rows": rows,
            "read_ratio_per_rank": ratio}


def vllm_section(sec: dict) -> str:
    tp = sec["tp"]
    out = [f"### vLLM model start, cold page cache (tp={tp}, checkpoint "
           f"{sec['checkpoint_bytes'] / 1e6:.1f} MB)", "",
           "| load format | start s (median, min–max) | storage reads per rank, MB |",
           "|---|---:|---:|"]
    for fmt, r in sec["rows"].items():
        reads = ", ".join(f"{b / 1e6:.1f}" for b in r["read_bytes_per_rank"])
        out.append(f"| {fmt} | {r['start_s']:.1f} ({r['start_min_s']:.1f}–{r['start_max_s']:.1f}) "
                   f"| {reads} |")
    ratio = ", ".join("–" if x is None else f"{x:.2f}" for x in sec["read_ratio_per_rank"])
    out += ["", f"- coordloader / safetensors storage reads per rank: {ratio} (each worker's "
                f"`read_bytes` in /proc/self/io: everything it fetched from storage, checkpoint "
                f"and otherwise)"]
    return "\n".join(out) + "\n"
