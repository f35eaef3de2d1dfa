"""`python -m coordloader.synth OUT --arch A --size S: write a synthetic checkpoint.`"""
from __future__ import annotations

import math
import os
import time

from coordloader.checkpoint import dtypes
from coordloader.cli.common import run_command
from coordloader.synth import archs, synthesize
from coordloader.text import ArgumentParser, positive_count


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m coordloader.synth",
                                 description="Write a synthetic HF-style safetensors checkpoint "
                                             "with real architecture naming and shapes.")
    ap.add_argument("out", metavar="OUT",
                    help="output directory (must be empty or absent, unless --overwrite)")
    ap.add_argument("--arch", required=True, choices=archs.ARCHS)
    ap.add_argument("--size", default="tiny", choices=archs.SIZES)
    ap.add_argument("--shards", type=positive_count("shards"), default=None,
                    help="number of shard files (default: the published count for full)")
    ap.add_argument("--metadata-only", action="store_true",
                    help="real headers, data left as sparse holes (no disk used)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an OUT that holds only checkpoint files (*.safetensors, their "
                         "index, config.json, the manifest); anything else in it is refused")
    ap.add_argument("--fsync", action="store_true",
                    help="fsync every file (crash-durable; slower, bound by the disk)")
    args = ap.parse_args(argv)
    return run_command("synth", lambda: _run(args))


def _run(args) -> int:
    t0 = time.perf_counter()
    path = synthesize(args.out, args.arch, args.size, shards=args.shards,
                      metadata_only=args.metadata_only, seed=args.seed,
                      overwrite=args.overwrite, fsync=args.fsync)
    dt = time.perf_counter() - t0
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    _, specs = archs.arch_tensors(args.arch, args.size)
    total = sum(math.prod(s) * dtypes.itemsize(d) for _, d, s in specs)
    disk = sum(os.stat(os.path.join(path, f)).st_blocks * 512 for f in os.listdir(path))
    print(f"{path}: {args.arch}/{args.size}, {len(specs)} tensors in {len(files)} file(s), "
          f"{total:,} data bytes, {disk:,} bytes on disk, {dt:.2f} s"
          + (f" ({total / dt / 1e6:.0f} MB/s)" if not args.metadata_only and dt > 0 else ""))
    return 0

