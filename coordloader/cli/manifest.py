"""`python -m coordloader.manifest CKPT: write or check a checkpoint's content manifest.`"""
from __future__ import annotations

import os
import time

import torch

from coordloader.checkpoint.reader import read_checkpoint
from coordloader.cli.common import run_command
from coordloader.errors import VerifyError
from coordloader.text import ArgumentParser, positive_count
from coordloader.verify.manifest import compute, load_manifest, write_manifest


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m coordloader.manifest",
                                 description="Write coordloader.manifest.json (per-tensor content "
                                             "digests) next to a safetensors checkpoint.")
    ap.add_argument("ckpt", help="checkpoint directory")
    # the default is resolved when run, not here: docs/cli.md is generated from this parser
    # and must read the same on every machine
    ap.add_argument("--jobs", type=positive_count("threads"), default=None,
                    help="worker threads, one tensor each (default: min(8, CPUs))")
    ap.add_argument("--check", action="store_true",
                    help="recompute and compare with the existing manifest instead of writing")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    # parallel over tensors, one intra-op thread each: torch's own pool on these
    # chunk-sized ops measured up to 10x slower on a busy 2-core machine
    torch.set_num_threads(1)
    return run_command("manifest", lambda: _run(args))


def _run(args) -> int:
    if args.jobs is None:
        args.jobs = min(8, os.cpu_count() or 1)
    if True:
        meta = read_checkpoint(args.ckpt)
        t0 = time.perf_counter()
        if args.check:
            man = load_manifest(meta.root, meta, required=True)
            got = compute(meta, jobs=args.jobs)
            bad = [n for n, d in got.items() if d.digest != man.tensors[n].digest]
            if bad:
                hint = man.changed_hint()
                raise VerifyError(f"{len(bad)} tensor(s) differ from the manifest: "
                                  + ", ".join(bad[:10]) + (f"; {hint}" if hint else ""),
                                  file=man.path)
            path = man.path
        else:
            path = write_manifest(meta, jobs=args.jobs)
        dt = time.perf_counter() - t0
        if not args.quiet:
            nbytes = meta.total_bytes
            print(f"{'checked' if args.check else 'wrote'} {path}: {len(meta.tensors)} tensors, "
                  f"{nbytes / 1e6:.1f} MB in {dt:.2f} s ({nbytes / max(dt, 1e-9) / 1e9:.2f} GB/s)")
        return 0

