"""The slice-exact CPU engine.

Each local tensor is allocated once and its byte runs (from the plan) land in the
tensor's own memory; nothing else is kept. The plan gives runs as strided groups
(``coordloader.runs.RunList``: ``count`` runs of ``length`` bytes, ``src_stride`` apart in
the file and ``dst_stride`` apart in the tensor), and the engine works on whole groups,
never on one Python object per run:

- a single run (a dim-0 slice, a whole tensor) is read with ``os.preadv`` straight into
  the tensor, cut into chunks of ``chunk_bytes`` so threads share big tensors; single runs
  that follow each other in the file (whole tensors stored back to back, e.g. the experts
  a rank owns) become one ``preadv`` with one iovec per run;
- the rows of a dim-1 slice whose gaps in the file are shorter than a page
  (``src_stride - length < 4096``) are read as one span of at most ``span_bytes`` at a
  time into a per-thread bounce buffer and copied into the tensor with one strided copy:
  the gaps share their pages with the wanted rows, so storage reads the same pages either way, and one syscall
  replaces thousands (a 256-byte row per ``preadv`` costs ~1 us of syscall and
  interpreter time for 256 bytes). ``LoadStats.bytes_read`` counts the plan's bytes (what
  lands in tensors); ``extra["gap_bytes"]`` the gap bytes copied from the page cache;
- rows with page-sized or larger gaps are read one ``preadv`` per row, in a tight loop.

Work is sorted by file offset (forward reads) and cut into tasks of about
``chunk_bytes`` (64 MiB: cold reads gain from large requests, about 10 % over 8 MiB here,
docs/benchmarks.md) handed to a thread pool; ``preadv`` and torch's copy release the GIL.

Tensors the engine allocates itself are fresh address space: before a read lands in one,
the reader thread maps the destination range with ``memory.prefault`` (one
``madvise(MADV_POPULATE_WRITE)``), not one page-fault trap per 4 KiB page. Each thread
does so for its own ranges, so the faults spread over the threads as the reads do.
Ranges the allocator handed back mapped already (a process loading again) are left alone.
Destinations handed in (``out``) are left as they are.
"""
from __future__ import annotations

import operator
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, NamedTuple

import numpy as np
import torch

from coordloader.checkpoint.metadata import CheckpointMeta
from coordloader.engines import (
    LoadStats,
    Progress,
    allocate,
    descriptor_room,
    host_out,
    refuse_changed,
    refuse_moved,
    to_device,
)
from coordloader.engines.memory import prefault
from coordloader.errors import LoadError
from coordloader.gcpause import gc_paused
from coordloader.planning.model import RankPlan
from coordloader.planning.runs import groups_of

_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
# Gaps shorter than a page never hold a whole page: reading through them touches no page
# that the wanted bytes do not touch already.
_PAGE = 4096
try:
    _IOV_MAX = max(1, min(1024, os.sysconf("SC_IOV_MAX")))
except (ValueError, OSError, AttributeError):
    _IOV_MAX = 16

# Work items. ``prefault``: (address, bytes) ranges of fresh destination memory to fault
# in first (none for destinations handed in); ``fd``/``fname`` are set when the item is
# queued for a file.


class Run(NamedTuple):
    """One run contiguous in the file and in the tensor, as queued; ``_tasks`` fuses runs
    that follow each other in the file into one VecRead."""
    off: int
    nbytes: int
    buf: memoryview
    name: str
    prefault: tuple


@dataclass
class VecRead:
    """Byte runs contiguous in the file, read with one multi-iovec preadv (runs that follow
    each other are fused into one item, so it is mutable)."""
    off: int
    nbytes: int
    bufs: list            # memoryviews of the destinations, in file order
    names: list           # their tensors, for messages
    prefault: list
    fd: int = -1
    fname: str = ""


class Strided(Enum):
    SPAN = 1    # read the rows' whole file span into a bounce buffer, then copy the rows
    ROWS = 2    # one read per row, straight into the destination


class StridedRead(NamedTuple):
    """``count`` rows of ``length`` bytes, ``src_stride`` apart in the file and
    ``dst_stride`` apart from ``dest`` in ``buf`` (a uint8 array for SPAN, a memoryview for
    ROWS)."""
    kind: Strided
    off: int
    count: int
    length: int
    src_stride: int
    buf: Any
    dest: int
    dst_stride: int
    name: str
    prefault: tuple
    fd: int = -1
    fname: str = ""


_by_offset = operator.attrgetter("off")


class _Memory:
    """A tensor's bytes as numpy sees them (``__array_interface__``), holding the tensor."""
    __slots__ = ("__array_interface__", "tensor")


def _byte_view(t: torch.Tensor) -> tuple[np.ndarray, memoryview]:
    """The bytes of a contiguous CPU tensor, no copy: a flat uint8 numpy array over its
    memory and a writable memoryview of it. Built from the address, not through torch and
    numpy views, which cost more than the rest of a tensor's queueing (the engine makes one
    per tensor, thousands per rank); the array's base holds the tensor, so neither
    outlives its memory. Not a ctypes array: ``c_ubyte * n`` makes a type per size (tens
    of us each, and kept until a full collection), which cost more than the views saved
    where a rank's tensors come in many sizes."""
    m = _Memory()
    m.tensor = t
    m.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.nbytes,),
                             "typestr": "|u1", "version": 3}
    a = np.asarray(m)
    return a, memoryview(a)


def default_threads() -> int:
    # enough to keep an NVMe queue busy; more only adds contention
    return max(2, min(8, os.cpu_count() or 2))


class CpuEngine:
    name = "cpu"

    def __init__(self, threads: int | None = None, chunk_bytes: int = 64 << 20,
                 span_bytes: int = 8 << 20):
        self.threads = max(1, int(threads)) if threads is not None else default_threads()
        # the most one read (and one task) covers: large, since a cold read's speed grows
        # with the request size (the kernel's readahead follows it)
        self.chunk_bytes = max(1, int(chunk_bytes))
        # the most file span one bounce-buffered read of strided rows covers: it bounds the
        # per-thread bounce buffer, which the chunk size would otherwise set
        self.span_bytes = max(1, int(span_bytes))

    def load_rank(self, meta: CheckpointMeta, rank_plan: RankPlan, device: Any = "cpu", *,
                  progress: Progress | None = None,
                  out: Mapping[str, torch.Tensor] | None = None):
        # thousands of views and work items, no cycles: a collection scan over them (and
        # the caller's objects) would cost more than queueing them (coordloader.gcpause)
        with gc_paused():
            return self._load_rank(meta, rank_plan, device, progress, out)

    def _load_rank(self, meta, rank_plan, device, progress, out):
        t0 = time.perf_counter()
        device = torch.device(device if device is not None else "cpu")
        rank = rank_plan.rank
        files = {f.name: f for f in meta.files}
        tensors: dict[str, torch.Tensor] = {}
        # file -> its Runs and StridedReads, in plan order
        items: dict[str, list] = {}
        held = 0
        host = host_out(out, rank_plan, device, rank=rank)
        for ts in rank_plan.tensors:
            t = allocate(ts, "cpu", host, rank=rank)
            # address of fresh memory to prefault; 0 for a destination handed in
            base = 0 if host is not None and ts.name in host else t.data_ptr()
            tensors[ts.name] = t
            nbytes = t.nbytes   # the slice's, as allocate checked
            held += nbytes
            runs = ts.byte_runs
            if not runs:
                continue
            view = _byte_view(t)
            for g in groups_of(runs):
                self._add_group(items, files, g, view, nbytes, ts.name, rank, base)

        fds: dict[str, int] = {}
        checked: dict[str, os.stat_result] = {}   # file -> its fstat as checked
        room = descriptor_room(len(items), rank)
        try:
            for fname in items:
                path = os.path.join(meta.root, fname)
                try:
                    # O_NONBLOCK: a shard swapped for a FIFO after planning must not block
                    # open(); it only affects FIFOs/devices, and regular files are checked below
                    fd = os.open(path, _O_FLAGS | getattr(os, "O_NONBLOCK", 0))
                except OSError as e:
                    raise LoadError(f"cannot open: {e.strerror}", file=fname, rank=rank) from None
                fds[fname] = fd
                checked[fname] = refuse_changed(path, fd, files[fname], rank)
                if hasattr(os, "posix_fadvise"):
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    except OSError:
                        pass
            tasks, gap_bytes = self._tasks(items, fds)

            def unmoved() -> None:
                for fname, fd in fds.items():
                    refuse_moved(fd, checked[fname], files[fname], rank)
            try:
                read = self._run(tasks, progress, rank)
            except LoadError:
                unmoved()   # a file truncated or rewritten meanwhile: the cause
                raise
            # a file rewritten in place while it was read passed every check before
            # the reads and now holds bytes of both versions
            unmoved()
        finally:
            for fd in fds.values():
                os.close(fd)
            room()

        if device.type != "cpu":
            to_device(tensors, device, out, rank=rank)
        stats = LoadStats(engine=self.name, tensors=len(tensors), bytes_read=read, bytes_held=held,
                          seconds=time.perf_counter() - t0,
                          extra={"threads": self.threads, "files": len(items), "tasks": len(tasks),
                                 "gap_bytes": gap_bytes})
        return tensors, stats

    # -- planning the reads -----------------------------------------------------------
    def _add_group(self, items, files, g, view, nbytes, tname, rank, base) -> None:
        """Validate one strided group (arithmetically: its runs' offsets are linear in the
        run index, so the first and last run bound them all) and queue its reads."""
        f, o, ln, d, c, ss, ds = g
        fi = files.get(f)
        if fi is None:
            raise LoadError(f"plan reads file {f!r}, which is not in the checkpoint",
                            tensor=tname, rank=rank)
        if c < 1 or ln < 0:
            raise LoadError(f"malformed byte-run group {g!r}", tensor=tname, rank=rank)
        ld, lo = d + (c - 1) * ds, o + (c - 1) * ss
        dmin, omin = min(d, ld), min(o, lo)
        dmax, omax = max(d, ld), max(o, lo)
        if dmin < 0 or dmax + ln > nbytes:
            bad = dmin if dmin < 0 else dmax
            raise LoadError(f"byte run dest [{bad}, {bad + ln}) outside the local tensor of "
                            f"{nbytes} bytes", tensor=tname, rank=rank)
        if omin < fi.data_start or omax + ln > fi.size:
            bad = omin if omin < fi.data_start else omax
            raise LoadError(f"byte run [{bad}, {bad + ln}) outside the data section "
                            f"[{fi.data_start}, {fi.size})", file=f, tensor=tname, rank=rank)
        if ln == 0:
            return
        lst = items.setdefault(f, [])
        arr, mv = view
        cb = self.chunk_bytes
        if c == 1:
            pos = 0
            while pos < ln:  # big runs in chunks, so threads share one big tensor
                n = min(ln - pos, cb)
                p = d + pos
                lst.append(Run(o + pos, n, mv[p:p + n], tname, ((base + p, n),) if base else ()))
                pos += n
            return
        # a row longer than span_bytes is read straight into the tensor: through the bounce
        # buffer it would grow that buffer to the row, per thread, and copy the row twice
        kind = (Strided.SPAN if ds >= ln and ln <= ss <= self.span_bytes and ss - ln < _PAGE
                else Strided.ROWS)
        # SPAN: rows in chunks of about span_bytes of file span; ROWS: chunk_bytes read
        per = max(1, self.span_bytes // ss if kind is Strided.SPAN else cb // ln)
        buf = arr if kind is Strided.SPAN else mv
        for i in range(0, c, per):
            k = min(per, c - i)
            d0 = d + i * ds
            pf = ()
            if base:
                dl = d0 + (k - 1) * ds
                pf = ((base + min(d0, dl), abs(dl - d0) + ln),)
            lst.append(StridedRead(kind, o + i * ss, k, ln, ss, buf, d0, ds, tname, pf))

    def _tasks(self, items: dict[str, list], fds: dict[str, int]) -> tuple[list[list], int]:
        """Sort each file's items by offset, fuse single runs that follow each other in the
        file into one multi-iovec read, and cut the items into tasks of about
        ``chunk_bytes`` so threads share the work evenly. -> (tasks, gap bytes)."""
        tasks, cur, cur_bytes = [], [], 0
        cb = self.chunk_bytes
        gap = 0
        for fname, lst in items.items():
            fd = fds[fname]
            lst.sort(key=_by_offset)
            prev = None   # the VecRead being extended
            for it in lst:
                if type(it) is Run:
                    if (prev is not None and prev.off + prev.nbytes == it.off
                            and len(prev.bufs) < _IOV_MAX and prev.nbytes + it.nbytes <= cb):
                        prev.bufs.append(it.buf)
                        prev.names.append(it.name)
                        prev.prefault.extend(it.prefault)
                        prev.nbytes += it.nbytes
                    else:
                        prev = VecRead(it.off, it.nbytes, [it.buf], [it.name],
                                       list(it.prefault), fd, fname)
                        cur.append(prev)
                    cur_bytes += it.nbytes
                else:
                    prev = None
                    cur.append(StridedRead._make(it[:-2] + (fd, fname)))
                    cur_bytes += it.count * it.length
                    if it.kind is Strided.SPAN:
                        gap += (it.count - 1) * (it.src_stride - it.length)
                if cur_bytes >= cb:
                    tasks.append(cur)
                    cur, cur_bytes, prev = [], 0, None
        if cur:
            tasks.append(cur)
        return tasks, gap

    # -- reading -----------------------------------------------------------------------
    def _run(self, tasks: list[list], progress: Progress | None, rank: int) -> int:
        stop = threading.Event()
        lock = threading.Lock()
        local = threading.local()
        sb = self.span_bytes

        def bounce(n: int):
            b = getattr(local, "buf", None)
            if b is None or b[0].size < n:
                t = np.empty(max(n, sb), dtype=np.uint8)
                b = local.buf = (t, memoryview(t).cast("B"))
            return b

        def work(task) -> int:
            done = 0
            for it in task:
                if stop.is_set():
                    return done
                if isinstance(it, VecRead):
                    for a, m in it.prefault:
                        prefault(a, m)
                    _read_vec(it.fd, it.bufs, it.off, it.nbytes, it.fname, it.names, rank)
                    done += it.nbytes
                    continue
                for a, m in it.prefault:
                    prefault(a, m)
                _, off, k, ln, ss, buf, d, ds, tname, _pf, fd, fname = it
                if it.kind is Strided.SPAN:
                    u8 = buf
                    span = (k - 1) * ss + ln
                    bt, bmv = bounce(span)
                    _read_vec(fd, [bmv[:span]], off, span, fname, [tname], rank)
                    # numpy, not torch: torch's intra-op threads copying into fresh
                    # (not yet faulted) pages ran 10x slower here; numpy's copy is one
                    # thread and releases the GIL
                    np.copyto(np.ndarray((k, ln), np.uint8, u8, d, (ds, 1)),
                              np.ndarray((k, ln), np.uint8, bt, 0, (ss, 1)))
                    done += k * ln
                else:
                    mv = buf
                    preadv = os.preadv
                    for i in range(k):
                        o, p = off + i * ss, d + i * ds
                        b = mv[p:p + ln]
                        try:
                            got = preadv(fd, [b], o)
                        except OSError as e:
                            raise LoadError(f"read of {ln} bytes at offset {o} failed: "
                                            f"{e.strerror}", file=fname, tensor=tname,
                                            rank=rank) from None
                        if got != ln:
                            _read_vec(fd, [b[got:]], o + got, ln - got, fname, [tname], rank)
                    done += k * ln
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


def _read_vec(fd: int, bufs: list, off: int, n: int, fname: str, names: list, rank) -> None:
    """Fill ``bufs`` (contiguous in the file from ``off``, ``n`` bytes in all; ``names[i]``
    the tensor of ``bufs[i]``, for errors) with ``preadv``; a short read continues where
    the kernel stopped."""
    pos = i = 0
    while True:
        try:
            got = os.preadv(fd, bufs, off + pos)
        except OSError as e:
            raise LoadError(f"read of {n - pos} bytes at offset {off + pos} failed: "
                            f"{e.strerror}", file=fname, tensor=names[min(i, len(names) - 1)],
                            rank=rank) from None
        if got == n - pos:
            return
        if got <= 0:
            raise LoadError(f"unexpected end of file at offset {off + pos} (wanted {n - pos} "
                            f"more bytes)", file=fname, tensor=names[min(i, len(names) - 1)],
                            rank=rank)
        pos += got
        k = 0
        while got >= len(bufs[k]):  # drop the buffers filled, trim the one filled in part
            got -= len(bufs[k])
            k += 1
        i += k
        bufs = [memoryview(bufs[k])[got:]] + bufs[k + 1:] if got else bufs[k:]
