"""The slice-exact CPU engine.

Each local tensor is allocated once; its byte runs (from the plan) are read with
``os.preadv`` straight into the tensor's own memory. Nothing else is read: a dim-0 slice
is one run, a dim-1 slice one run per row, so bytes read equal bytes held (padding rows
are zeroed, not read). Runs are grouped per file (each file opened once), sorted by
offset so the kernel sees forward reads, and cut into tasks of a few MB handed to a
small thread pool (``preadv`` releases the GIL; a couple of threads keep the queue of a
fast disk busy without thrashing a slow one).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import torch

from ..errors import LoadError
from ..metadata import CheckpointMeta
from ..planmodel import RankPlan
from . import LoadStats, Progress, allocate, slice_nbytes

_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's memory (no copy)."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        # view() reinterprets the same storage; bool/fp8/bf16 all have a byte view
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


class CpuEngine:
    name = "cpu"

    def __init__(self, threads: int | None = None, chunk_bytes: int = 8 << 20):
        self.threads = threads if threads is not None else max(2, min(4, os.cpu_count() or 2))
        self.chunk_bytes = max(1, int(chunk_bytes))

    def load_rank(self, meta: CheckpointMeta, rank_plan: RankPlan, device: Any = "cpu", *,
                  progress: Progress | None = None,
                  out: Mapping[str, torch.Tensor] | None = None):
        t0 = time.perf_counter()
        device = torch.device(device if device is not None else "cpu")
        rank = rank_plan.rank
        files = {f.name: f for f in meta.files}
        tensors: dict[str, torch.Tensor] = {}
        # (file, offset, length, memoryview, tensor name), validated against the metadata
        items: dict[str, list] = {}
        held = 0
        for ts in rank_plan.tensors:
            host_out = out if device.type == "cpu" else None
            t = allocate(ts, "cpu", host_out, rank=rank)
            tensors[ts.name] = t
            nbytes = slice_nbytes(ts)
            held += nbytes
            if not ts.byte_runs:
                continue
            mv = _byte_view(t)
            for r in ts.byte_runs:
                fi = files.get(r.file)
                if fi is None:
                    raise LoadError(f"plan reads file {r.file!r}, which is not in the checkpoint",
                                    tensor=ts.name, rank=rank)
                if r.length < 0 or r.dest < 0 or r.dest + r.length > nbytes:
                    raise LoadError(f"byte run dest [{r.dest}, {r.dest + r.length}) outside the "
                                    f"local tensor of {nbytes} bytes", tensor=ts.name, rank=rank)
                if r.offset < fi.data_start or r.offset + r.length > fi.size:
                    raise LoadError(f"byte run [{r.offset}, {r.offset + r.length}) outside the data "
                                    f"section [{fi.data_start}, {fi.size})", file=r.file,
                                    tensor=ts.name, rank=rank)
                if r.length:
                    items.setdefault(r.file, []).append(
                        (r.offset, r.length, mv[r.dest:r.dest + r.length], ts.name))

        fds: dict[str, int] = {}
        try:
            for fname in items:
                path = os.path.join(meta.root, fname)
                try:
                    fd = os.open(path, _O_FLAGS)
                except OSError as e:
                    raise LoadError(f"cannot open: {e.strerror}", file=fname, rank=rank) from None
                fds[fname] = fd
                size = os.fstat(fd).st_size
                if size != files[fname].size:
                    raise LoadError(f"file is {size} bytes, its header was read when it had "
                                    f"{files[fname].size}: it changed during the load",
                                    file=fname, rank=rank)
                if hasattr(os, "posix_fadvise"):
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    except OSError:
                        pass
            tasks = self._tasks(items, fds)
            read = self._run(tasks, progress, rank)
        finally:
            for fd in fds.values():
                os.close(fd)

        if device.type != "cpu":
            for name, t in list(tensors.items()):
                if out is not None and name in out:
                    dst = out[name]
                    if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
                        raise LoadError(f"destination has shape {list(dst.shape)} dtype {dst.dtype}, "
                                        f"the plan needs {list(t.shape)} {t.dtype}",
                                        tensor=name, rank=rank)
                    dst.copy_(t)
                    tensors[name] = dst
                else:
                    tensors[name] = t.to(device)
        stats = LoadStats(engine=self.name, tensors=len(tensors), bytes_read=read, bytes_held=held,
                          seconds=time.perf_counter() - t0,
                          extra={"threads": self.threads, "files": len(items)})
        return tensors, stats

    def _tasks(self, items: dict[str, list], fds: dict[str, int]) -> list[list]:
        """Cut the runs into tasks of about ``chunk_bytes``: big runs are split, small
        ones (rows of a dim-1 slice) batched, so threads share the work evenly."""
        tasks, cur, cur_bytes = [], [], 0
        cb = self.chunk_bytes
        for fname, runs in items.items():
            fd = fds[fname]
            runs.sort(key=lambda x: x[0])
            for off, length, mv, tname in runs:
                pos = 0
                while pos < length:
                    n = min(length - pos, cb - cur_bytes)
                    cur.append((fd, fname, off + pos, mv[pos:pos + n], tname))
                    cur_bytes += n
                    pos += n
                    if cur_bytes >= cb:
                        tasks.append(cur)
                        cur, cur_bytes = [], 0
        if cur:
            tasks.append(cur)
        return tasks

    def _run(self, tasks: list[list], progress: Progress | None, rank: int) -> int:
        stop = threading.Event()
        lock = threading.Lock()

        def work(task) -> int:
            done = 0
            for fd, fname, off, mv, tname in task:
                if stop.is_set():
                    return done
                got, n = 0, len(mv)
                while got < n:
                    try:
                        k = os.preadv(fd, [mv[got:]], off + got)
                    except OSError as e:
                        raise LoadError(f"read of {n - got} bytes at offset {off + got} failed: "
                                        f"{e.strerror}", file=fname, tensor=tname,
                                        rank=rank) from None
                    if k == 0:
                        raise LoadError(f"unexpected end of file at offset {off + got} (wanted "
                                        f"{n - got} more bytes)", file=fname, tensor=tname,
                                        rank=rank)
                    got += k
                done += n
            if progress is not None:
                with lock:
                    progress(done)
            return done

        if len(tasks) <= 1 or self.threads <= 1:
            return sum(work(t) for t in tasks)
        total = 0
        first_error = None
        with ThreadPoolExecutor(max_workers=min(self.threads, len(tasks)),
                                thread_name_prefix="coordloader-read") as pool:
            futures = [pool.submit(work, t) for t in tasks]
            for f in futures:
                try:
                    total += f.result()
                except BaseException as e:  # stop the others, report the first failure
                    stop.set()
                    if first_error is None:
                        first_error = e
        if first_error is not None:
            raise first_error
        return total
