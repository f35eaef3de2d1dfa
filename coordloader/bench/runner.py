"""Launch the ranks of one bench method as separate processes, release them together,
collect their results. Hard timeouts everywhere: a stuck rank is killed and reported,
never waited on forever."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from coordloader.bench.common import ckpt_files, drop_caches, evict_files
from coordloader.dist.collective import free_port
from coordloader.text import format_ranks


class MethodFailed(RuntimeError):
    pass


@dataclass
class RankRun:
    """What the ranks of one repeat reported (one dict per rank, by rank)."""
    ranks: list[dict]

    @property
    def wall(self) -> float:
        """The load ends when its slowest rank ends."""
        return max(r["wall"] for r in self.ranks)


_CTX = None


def _context():
    """The forkserver, started once with torch and the bench modules imported."""
    global _CTX
    if _CTX is None:
        import multiprocessing as mp
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "numpy", "coordloader.bench.worker",
                                    "coordloader.bench.methods"])
        _CTX = ctx
    return _CTX


def _entry(spec, conn) -> None:
    from coordloader.bench.worker import rank_main
    os._exit(rank_main(spec, conn))


def run_ranks(method: str, *, ckpt: str, layout, meta, plan, world: int, device: str = "cpu",
              options: dict | None = None, cold: bool = False, timeout: float = 600.0,
              log=print) -> RankRun:
    """One repeat: start ``world`` rank processes, wait until every one is set up, (drop
    the page cache,) say GO, gather the results."""
    ctx = _context()
    port = free_port()
    procs, conns = [], []
    try:
        for r in range(world):
            dev = device if not device.startswith("cuda") else f"cuda:{r % max(1, _cuda_count())}"
            spec = {"method": method, "ckpt": ckpt, "rank": r, "world": world, "layout": layout,
                    "meta": meta, "plan": plan, "device": dev, "port": port,
                    "options": options or {}, "timeout": timeout}
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_entry, args=(spec, child), daemon=True,
                            name=f"coordloader-bench-{method}-{r}")
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        deadline = time.monotonic() + timeout

        def collect(tag: str) -> dict:
            got: dict = {}
            while len(got) < world:
                if time.monotonic() > deadline:
                    raise MethodFailed(f"{method}: timed out after {timeout:.0f} s waiting for "
                                       f"{tag} from {format_ranks(set(range(world)) - set(got))}")
                for r, c in enumerate(conns):
                    if r in got:
                        continue
                    try:
                        if not c.poll(0.05):
                            if not procs[r].is_alive() and not c.poll(0):
                                raise MethodFailed(f"{method}: rank {r} exited (code "
                                                   f"{procs[r].exitcode}) before {tag}")
                            continue
                        t, d = c.recv()
                    except EOFError:
                        raise MethodFailed(f"{method}: rank {r} closed its pipe before {tag} "
                                           f"(exit code {procs[r].exitcode})") from None
                    if t == "ERROR":
                        raise MethodFailed(f"{method}: rank {r}: {d['error']}\n{d['traceback']}")
                    if t == tag:
                        got[r] = d
            return got

        collect("READY")
        if cold:
            if not drop_caches():
                evict_files(ckpt_files(ckpt))
        for c in conns:
            c.send("GO")
        results = collect("RESULT")
        for p in procs:
            p.join(timeout=max(5.0, deadline - time.monotonic()))
        return RankRun([results[r] for r in range(world)])
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in conns:
            c.close()


def _cuda_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0
