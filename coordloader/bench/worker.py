"""One rank of a bench run, in its own process.

Its own process so that peak RSS (``getrusage``) is the rank's alone and no method
inherits another's page mappings or allocator state. Processes are forked from a
multiprocessing *forkserver* that has torch imported already: start-up takes
milliseconds, and unlike a fork+exec'd subprocess (whose ``ru_maxrss`` starts at the
parent's peak, a Linux quirk of exec) the child's peak RSS is its own.

Protocol over a pipe: the worker sets up (process group, warm-up, the method's untimed
setup), sends ``("READY", {...})``, waits for ``"GO"`` (the runner releases all ranks
together, after dropping caches for a cold run), runs the timed section, sends
``("RESULT", {...})`` or ``("ERROR", {...})``.
"""
from __future__ import annotations

import os
import resource
import time
import traceback


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _proc_io() -> dict[str, int]:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except (OSError, ValueError):
        return {}


def _warm_up() -> None:
    """One-time lazy initialisations every method would pay once per process (numpy
    bridge, thread pool machinery, safetensors' extension): done before the timed
    section so a method is not charged for being first."""
    import concurrent.futures  # noqa: F401

    import numpy  # noqa: F401
    import torch
    torch.empty(8, dtype=torch.bfloat16).view(torch.uint8).numpy()
    torch.zeros(8).sum()
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        pass


def rank_main(spec: dict, conn) -> int:
    def _emit(tag: str, obj) -> None:
        conn.send((tag, obj))

    rank, world = spec["rank"], spec["world"]
    try:
        import torch

        from coordloader.bench.methods import METHODS, RankContext, checksum
        # a rank of a real job owns its share of the cores; without this two ranks'
        # intra-op pools would fight over the same cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        method = METHODS[spec["method"]]
        device = spec.get("device", "cpu")
        group = None
        if method.needs_group:
            from datetime import timedelta

            import torch.distributed as dist
            backend = "nccl" if device.startswith("cuda") else "gloo"
            if device.startswith("cuda"):
                torch.cuda.set_device(torch.device(device))
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec['port']}",
                                    rank=rank, world_size=world,
                                    timeout=timedelta(seconds=spec.get("timeout", 600)))
            group = dist.group.WORLD
        ctx = RankContext(ckpt=spec["ckpt"], rank=rank, world=world, layout=spec["layout"],
                          meta=spec["meta"], plan=spec["plan"],
                          rank_plan=spec["plan"].rank(rank) if spec["plan"] is not None else None,
                          device=device, group=group, options=spec.get("options", {}))
        _warm_up()
        state = method.setup(ctx)
        rss_ready = _maxrss_bytes()
        _emit("READY", {"rank": rank, "rss_ready": rss_ready})
        if conn.recv() != "GO":
            return 3
        if group is not None:
            import torch.distributed as dist
            dist.barrier(group)
        io0 = _proc_io()
        t0 = time.perf_counter()
        tensors, requested, extra = method.run(ctx, state)
        wall = time.perf_counter() - t0
        io1 = _proc_io()
        rss_peak = _maxrss_bytes()
        held = sum(t.numel() * t.element_size() for t in tensors.values()) if tensors else 0
        cs = checksum(tensors) if tensors and method.holds_slice else None
        _emit("RESULT", {"rank": rank, "wall": wall, "bytes_requested": requested,
                         "bytes_held": held, "rss_ready": rss_ready, "rss_peak": rss_peak,
                         "io_rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
                         "io_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
                         "checksum": cs, "extra": extra})
        if group is not None:
            import torch.distributed as dist
            dist.destroy_process_group()
        return 0
    except BaseException as e:  # the runner reports it as this method's failure
        _emit("ERROR", {"rank": rank, "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-4000:]})
        return 1
    finally:
        conn.close()
