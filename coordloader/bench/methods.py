"""The load methods compared by ``bench load``, each run inside one rank's own process.

Every method gets the same rank plan and must leave the rank holding its slices in its
own memory: results are written into tensors the method allocated (never a lazy view of
an mmap), and a checksum of every local tensor, taken after the timed section, is compared
across methods by the runner so no method can win by doing less.

A method is a pair ``setup(ctx) -> state`` (untimed: open nothing that the real load
would have to open, only allocate what the method's definition says is preallocated)
and ``run(ctx, state) -> (tensors or None, bytes_requested, extra)`` (timed).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.metadata import box_shape
from coordloader.engines import allocate, narrow_box, select_engine
from coordloader.engines.memory import prefault_tensor
from coordloader.planning.runs import groups_of


@dataclass
class RankContext:
    ckpt: str
    rank: int
    world: int
    layout: Any                 # coordloader.layout.Layout
    meta: Any                   # CheckpointMeta
    plan: Any                   # Plan
    rank_plan: Any              # RankPlan
    device: str = "cpu"
    group: Any = None           # torch.distributed group, when the method needs one
    options: dict = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return [os.path.join(self.meta.root, f.name) for f in self.meta.files]


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    setup: Callable
    run: Callable
    needs_group: bool = False
    needs_cuda: bool = False
    holds_slice: bool = True     # leaves the rank's planned tensors (checksum compared)


# -- helpers ----------------------------------------------------------------------------

def _copy_pieces(dst: torch.Tensor, ts, full: torch.Tensor) -> int:
    """Copy the planned pieces of ``full`` (the whole global tensor) into ``dst``."""
    n = 0
    for p in ts.pieces:
        shape = box_shape(p.src)
        src = narrow_box(full, [a for a, _ in p.src], shape)
        narrow_box(dst, p.dst, shape).copy_(src)
        n += src.numel()
    return n * itemsize(ts.dtype)


def _byte_view(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """Order-independent over names, sensitive to every byte's value and position: each
    tensor's content digest (``coordloader.verify.digest``, position-weighted; a byte sum
    with a strided second sum missed rows swapped 7 apart). Run after the timed section
    (on several threads); it also touches every byte of every result."""
    import hashlib

    from coordloader.checkpoint.metadata import full_box
    from coordloader.verify.digest import digest_many
    names = sorted(tensors)
    items = []
    for name in names:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        items.append((t, full_box(tuple(t.shape)), tuple(t.shape)))
    sums = digest_many(items, threads=min(4, os.cpu_count() or 1))
    acc = [f"{n}:{tuple(tensors[n].shape)}:{s}" for n, s in zip(names, sums)]
    return hashlib.sha256("\n".join(acc).encode()).hexdigest()[:16]


def _pread_full(fd: int, mv: memoryview, off: int, what: str) -> None:
    """Fill ``mv`` from ``fd`` at ``off`` (one-thread baselines: a plain ``preadv`` loop)."""
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], off + got)
        if n <= 0:
            raise OSError(f"short read in {what} at {off + got}")
        got += n


def _plan_runs(ctx):
    """(path, offset, length, slice name, dest) for the rank's byte runs, by file and
    offset (forward reads)."""
    out = []
    for ts in ctx.rank_plan.tensors:
        for r in ts.byte_runs:
            out.append((os.path.join(ctx.meta.root, r.file), r.offset, r.length, ts.name, r.dest))
    out.sort(key=lambda x: (x[0], x[1]))
    return out


# -- (e0) coordloader cpu engine ----------------------------------------------------------

def _cpu_setup(ctx):
    return select_engine("cpu", "cpu", **ctx.options.get("engine_options", {}))


def _cpu_run(ctx, engine):
    tensors, stats = engine.load_rank(ctx.meta, ctx.rank_plan, "cpu")
    # bytes_read counts the plan's bytes (what lands in tensors); the gaps of rows read
    # as one span into the bounce buffer are copied out of the page cache too
    gap = int(stats.extra.get("gap_bytes", 0) or 0)
    return tensors, stats.bytes_read, {"engine_seconds": stats.seconds,
                                       "engine_extra": dict(stats.extra),
                                       "page_cache_bytes": stats.bytes_read + gap}


# -- (b) every rank reads every tensor whole with safetensors, then narrows -------------

def _no_setup(ctx):
    return None


def _whole_read(ctx, dsts=None):
    """The default-loader pattern: iterate over every tensor of every file, read it whole
    into the rank's memory, narrow to what this rank holds, copy into the parameter, drop
    it. ``get_tensor`` of safetensors (0.4+) returns a tensor backed by the file's mmap,
    so it is ``clone()``d: every byte of every tensor is copied into the rank's own memory,
    as a loader that reads files without mmap (or moves each tensor to its device) does.
    Without the clone this is ``st_mmap_narrow`` below. ``dsts``: existing destinations
    (the into-existing pair), else fresh ones."""
    from safetensors import safe_open
    wanted = ctx.rank_plan.by_name()
    out, read = {}, 0
    for path in ctx.files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                full = f.get_tensor(key).clone()     # materialised: every byte copied
                read += full.numel() * full.element_size()
                ts = wanted.get(key)
                if ts is not None:
                    dst = dsts[key] if dsts is not None else allocate(ts, "cpu")
                    _copy_pieces(dst, ts, full)
                    out[key] = dst
                del full
    return out, read, {"page_cache_bytes": read}


def _st_whole_run(ctx, _):
    return _whole_read(ctx)


# -- the same two, into destinations that already exist (``load_into`` a built model) ----

def _prefaulted_setup(ctx):
    """The rank's destinations, allocated and zeroed before the timed section: a model
    whose parameters exist (vLLM builds the model, then loads weights into it). Both
    methods of this pair get the same, so neither pays for fresh memory."""
    return {ts.name: allocate(ts, "cpu").zero_() for ts in ctx.rank_plan.tensors}


def _cpu_into_setup(ctx):
    """The engine (made untimed, as ``cpu``'s: its first import was charged to this method
    alone) and the prefaulted destinations."""
    return _cpu_setup(ctx), _prefaulted_setup(ctx)


def _cpu_into_run(ctx, state):
    engine, dsts = state
    tensors, stats = engine.load_rank(ctx.meta, ctx.rank_plan, "cpu", out=dsts)
    gap = int(stats.extra.get("gap_bytes", 0) or 0)
    return tensors, stats.bytes_read, {"page_cache_bytes": stats.bytes_read + gap}


def _st_whole_into_run(ctx, dsts):
    """(b) with the narrowed pieces copied into the existing destinations."""
    return _whole_read(ctx, dsts)


# -- (f) the fresh-memory floor: what materialising the result alone costs ----------------

def _fresh_floor_run(ctx, _):
    """Allocate the rank's tensors and map every 4 KiB page, the cheapest way known here
    (``memory.prefault``, one system call a tensor, as the cpu engine does; then one byte
    written in each page, which faults whatever prefault could not map): the page faults
    and zeroing every method that returns fresh tensors pays, with nothing read. Under
    nested virtualisation (this project's CI VM) this is most of a fast load."""
    out = {}
    for ts in ctx.rank_plan.tensors:
        t = allocate(ts, "cpu")
        prefault_tensor(t)
        t.reshape(-1).view(torch.uint8)[::4096].fill_(1)
        out[ts.name] = t
    # returned, so that they are freed after the clock as every other method's tensors
    # are (freeing 600 MB inside it cost the floor ~15 %); nothing is read
    return out, 0, {}


# -- (m) one memory copy of the held bytes: with (f), the limit of any load --------------

def _memcpy_setup(ctx):
    """Source and destination of the rank's held bytes, both written (faulted) before the
    timed section: the timed copy is memory bandwidth alone."""
    n = ctx.rank_plan.bytes_held
    return torch.ones(n, dtype=torch.uint8).numpy(), torch.zeros(n, dtype=torch.uint8).numpy()


def _memcpy_run(ctx, bufs):
    """One thread's copy of the held bytes (numpy: one thread, as the engine's copies):
    (f) + (m) is what a load costs that materialises fresh tensors and moves every byte
    once, from memory already holding it (the page cache, warm)."""
    import numpy as np
    src, dst = bufs
    np.copyto(dst, src)
    return None, int(src.nbytes), {}


# -- (p) one read of the held bytes out of the page cache: the kernel's copy rate --------

def _pcopy_setup(ctx):
    """A destination for the rank's held bytes, written (faulted) before the timed
    section, and the checkpoint files to read them from."""
    n = ctx.rank_plan.bytes_held
    return torch.zeros(n, dtype=torch.uint8).numpy(), ctx.files


def _pcopy_run(ctx, state):
    """One thread reading as many bytes as the rank holds, in 8 MiB ``preadv`` calls (the
    engine's span size), from the files in order into mapped memory: what copying the
    held bytes out of the page cache costs, the one copy a read through it cannot avoid
    (warm; cold it includes storage). Each rank starts ``rank x held`` bytes into the
    files taken as one stream (wrapping round), so cold the ranks fetch bytes of their
    own from storage, as a load does, not all the same first ones. (m) is the same copy
    between two user buffers."""
    dst, files = state
    mv = memoryview(dst)
    sizes = [os.stat(p).st_size for p in files]
    total = sum(sizes)
    if not total:
        return None, 0, {}
    skip = ctx.rank_plan.rank * len(mv) % total
    pos, chunk = 0, 8 << 20
    while pos < len(mv):
        for path, size in zip(files, sizes):
            if skip >= size:
                skip -= size
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                for off in range(skip, size, chunk):
                    n = min(chunk, size - off, len(mv) - pos)
                    if n <= 0:
                        break
                    _pread_full(fd, mv[pos:pos + n], off, path)
                    pos += n
            finally:
                os.close(fd)
            skip = 0
            if pos >= len(mv):
                break
    return None, pos, {}


# -- (b') lazy mmap get_tensor, narrow, clone: touches only the slice's bytes -----------

def _st_mmap_narrow_run(ctx, _):
    """What (b) costs when ``get_tensor`` hands back an mmap-backed view and only the
    narrowed slice is copied out: the tensors this rank does not hold are never touched,
    and of the ones it holds only the slice's bytes (and the 4 KiB pages under them) are.
    Not a whole read: shown so the reader sees what the lazy path costs."""
    from safetensors import safe_open
    wanted = ctx.rank_plan.by_name()
    out, copied = {}, 0
    for path in ctx.files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                ts = wanted.get(key)
                if ts is None:
                    continue          # a lazy loader skips what it does not hold
                full = f.get_tensor(key)                # mmap-backed, nothing read yet
                dst = allocate(ts, "cpu")
                copied += _copy_pieces(dst, ts, full)   # narrow + copy: slice bytes only
                out[key] = dst
                del full
    return out, copied, {"page_cache_bytes": copied}


# -- (c) HF safetensors get_slice, per rank -----------------------------------------------

def _st_slice_run(ctx, _):
    from safetensors import safe_open
    by_file: dict[str, list] = {}
    for ts in ctx.rank_plan.tensors:
        by_file.setdefault(ts.file, []).append(ts)
    out, read = {}, 0
    for fname, slices in by_file.items():
        with safe_open(os.path.join(ctx.meta.root, fname), framework="pt", device="cpu") as f:
            for ts in slices:
                dst = allocate(ts, "cpu")
                sl = f.get_slice(ts.name)
                for p in ts.pieces:
                    part = sl[tuple(slice(a, b) for a, b in p.src)]
                    narrow_box(dst, p.dst, box_shape(p.src)).copy_(part)
                    read += part.numel() * part.element_size()
                out[ts.name] = dst
    return out, read, {}


# -- (a) page-cache ceiling: whole files, sequential, into a preallocated buffer --------

def _ceiling_setup(ctx):
    total = sum(os.path.getsize(p) for p in ctx.files)
    buf = bytearray(total)      # zero-filled: its pages are faulted in before timing
    return buf


def _ceiling_run(ctx, buf):
    mv = memoryview(buf)
    pos, chunk = 0, 64 << 20
    for path in ctx.files:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size, chunk):
                n = min(chunk, size - off)
                _pread_full(fd, mv[pos:pos + n], off, path)
                pos += n
        finally:
            os.close(fd)
    return None, pos, {}


# -- (a') one thread, os.preadv of exactly the plan's byte ranges ----------------------

def _fresh_tensors(ctx) -> dict[str, torch.Tensor]:
    """The rank's destinations, allocated inside the timed section: every method that
    returns fresh tensors (the engine, get_slice, mmap+narrow) pays for allocating them,
    so the one-thread baselines do too."""
    return {ts.name: allocate(ts, "cpu") for ts in ctx.rank_plan.tensors}


def _preadv_setup(ctx):
    # the run list: the timed part is allocation and the reads
    return _plan_runs(ctx)


def _preadv_run(ctx, runs):
    tensors = _fresh_tensors(ctx)
    views = {n: _byte_view(t) for n, t in tensors.items()}
    fds: dict[str, int] = {}
    read = 0
    try:
        for path, off, length, name, dest in runs:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            _pread_full(fd, views[name][dest:dest + length], off, path)
            read += length
    finally:
        for fd in fds.values():
            os.close(fd)
    return tensors, read, {"runs": len(runs)}


# -- (a'') one thread, each slice's covering span read once, runs copied out -------------

def _span_run(ctx, _):
    """What an engine can do when a slice is many short runs (one per row of a dim-1
    split): one read of the span from the first run to the last into a bounce buffer,
    then one strided tensor copy per group of runs. Few syscalls for more bytes: read
    amplification up to the split factor on those tensors."""
    tensors = _fresh_tensors(ctx)
    flat = {n: t.reshape(-1).view(torch.uint8) for n, t in tensors.items()}
    fds: dict[str, int] = {}
    buf = torch.empty(0, dtype=torch.uint8)
    read = plan_bytes = 0
    try:
        for ts in ctx.rank_plan.tensors:
            dst = flat[ts.name]
            for fname, off, ln, dest, count, sstride, dstride in groups_of(ts.byte_runs):
                fd = fds.get(fname)
                if fd is None:
                    fd = fds[fname] = os.open(os.path.join(ctx.meta.root, fname), os.O_RDONLY)
                n = (count - 1) * sstride + ln
                contiguous = count == 1 or (sstride == ln and dstride == ln)
                if contiguous:
                    target = dst[dest:dest + n]
                else:
                    if buf.numel() < n:
                        buf = torch.empty(n, dtype=torch.uint8)
                    target = buf[:n]
                _pread_full(fd, memoryview(target.numpy()).cast("B"), off, fname)
                read += n
                plan_bytes += count * ln
                if not contiguous:
                    src = target.as_strided((count, ln), (sstride, 1))
                    dst.as_strided((count, ln), (dstride, 1), dest).copy_(src)
    finally:
        for fd in fds.values():
            os.close(fd)
    # asked for: the plan's bytes; copied from the page cache: the spans, gaps included
    return tensors, plan_bytes, {"page_cache_bytes": read}


# -- (d) raw instanttensor.safe_open, distributed over the group -------------------------

def _it_raw_setup(ctx):
    return {ts.name: allocate(ts, ctx.device) for ts in ctx.rank_plan.tensors}


def _it_raw_run(ctx, dsts):
    """Every group member receives every tensor of the files (InstantTensor splits the
    reads and all-gathers): narrow the planned pieces into the destinations, drop the
    rest. This is what a user gets from InstantTensor without a planner."""
    import instanttensor
    wanted = ctx.rank_plan.by_name()
    dev = torch.device(ctx.device)
    read = 0
    # a communicator of one rank is refused (RuntimeError: "A communicatior should not be
    # provided if world_size == 1"): one rank reads alone
    with instanttensor.safe_open(ctx.files, framework="pt", device=dev.index or 0,
                                 process_group=ctx.group if ctx.world > 1 else None,
                                 copy=False) as f:
        for name, t in f.tensors():
            read += t.numel() * t.element_size()
            ts = wanted.get(name)
            if ts is not None:
                _copy_pieces(dsts[name], ts, t)
    torch.cuda.synchronize(dev)
    # InstantTensor reads ~1/world of the bytes per rank and all-gathers the rest
    return dsts, read // max(1, ctx.world), {"bytes_received": read}


# -- (e) coordloader instanttensor engine -------------------------------------------------

def _it_engine_setup(ctx):
    return select_engine("instanttensor", ctx.device, plan=ctx.plan, group=ctx.group,
                         loader_config=ctx.options.get("loader_config"))


def _it_engine_run(ctx, engine):
    tensors, stats = engine.load_rank(ctx.meta, ctx.rank_plan, ctx.device)
    torch.cuda.synchronize(torch.device(ctx.device))
    return tensors, stats.bytes_read, {"engine_extra": dict(stats.extra)}


# -- coordloader.load end to end (headers split over ranks, plan agreed, load, verify) --

def _load_e2e_setup(ctx):
    from coordloader.loader import load_detailed
    return load_detailed


def _load_e2e_run(ctx, load_detailed):
    verify = ctx.options.get("verify", "shapes")
    ckpt = ctx.options.get("load_ckpt", ctx.ckpt)
    layout = ctx.options.get("load_layout", ctx.layout)
    res = load_detailed(ckpt, layout, group=ctx.group, device=ctx.device,
                        engine=ctx.options.get("engine", "cpu"), verify=verify)
    gap = int((res.stats.extra or {}).get("gap_bytes", 0) or 0)
    return res.tensors, res.stats.bytes_read, {"verify": verify, "phases": dict(res.phases),
                                               "page_cache_bytes": res.stats.bytes_read + gap}


# -- digest of every planned piece (the cost --verify digest adds on top of a load) ------

def _loaded_setup(ctx):
    """The rank's slices, loaded by the cpu engine before the timed section."""
    tensors, _ = select_engine("cpu", "cpu").load_rank(ctx.meta, ctx.rank_plan, "cpu")
    return tensors


def _digest_setup(ctx):
    """The rank's slices loaded (untimed), the digest route chosen by options["kernel"]
    (default: the compiled kernel when built) and its one-time self-test run, so the timed
    section is what every later --verify digest in a process pays."""
    from coordloader.verify import digest as dgm
    dgm.kernel_available()
    dgm.int8_mm_available()
    return _loaded_setup(ctx)


def _digest_route(ctx):
    from coordloader.verify import digest as dgm
    return dgm.Route.AUTO if ctx.options.get("kernel", True) else dgm.fallback_route()


def _digest_run(ctx, tensors):
    # verify's own digest step, with verify's thread count
    from coordloader.verify.checks import digest_pieces, digest_workers
    jobs = [(ts.name, tensors[ts.name], ts) for ts in ctx.rank_plan.tensors]
    digest_pieces(jobs, digest_workers(cap=torch.get_num_threads()), route=_digest_route(ctx))
    return tensors, sum(ts.covered_numel * itemsize(ts.dtype) for ts in ctx.rank_plan.tensors), {}


# -- coordloader.save of the rank's share (tensors loaded untimed first: _loaded_setup) -

def _save_run(ctx, tensors):
    from coordloader.handoff.save import save
    out = ctx.options["save_dir"]
    # config.json travels with the state so the saved checkpoint's preset is detected
    save(out, tensors, ctx.plan, group=ctx.group, overwrite=True, config=ctx.meta.root,
         digests=ctx.options.get("save_digests", True))
    n = sum(t.numel() * t.element_size() for ts, t in
            ((ts, tensors[ts.name]) for ts in ctx.rank_plan.tensors) if ts.replica == 0)
    return None, n, {"primary_bytes": n}


METHODS: dict[str, Method] = {m.key: m for m in [
    Method("cpu", "coordloader cpu engine (its default reader threads: max(2, min(8, CPUs)))",
           _cpu_setup, _cpu_run),
    Method("preadv", "(a') preadv of the same byte ranges, 1 thread", _preadv_setup, _preadv_run),
    Method("span", "(a'') preadv of each slice's span + copy-out, 1 thread", _no_setup,
           _span_run),
    Method("ceiling", "(a) page-cache ceiling: whole files, sequential", _ceiling_setup,
           _ceiling_run, holds_slice=False),
    Method("st_whole", "(b) safetensors whole read (materialised) + narrow", _no_setup,
           _st_whole_run),
    Method("cpu_into", "coordloader cpu engine into existing tensors (load_into)", _cpu_into_setup,
           _cpu_into_run),
    Method("st_whole_into", "(b) whole read + narrow, into existing tensors", _prefaulted_setup,
           _st_whole_into_run),
    Method("fresh_floor", "(f) fresh-memory floor: allocate + map every page, no reads",
           _no_setup, _fresh_floor_run, holds_slice=False),
    Method("memcpy", "(m) one memcpy of the held bytes, 1 thread, memory already mapped",
           _memcpy_setup, _memcpy_run, holds_slice=False),
    Method("pcopy", "(p) one read of the held bytes from the page cache, 1 thread, memory "
           "already mapped", _pcopy_setup, _pcopy_run, holds_slice=False),
    Method("st_mmap_narrow", "(b') safetensors mmap get_tensor + narrow + clone (slice bytes only)",
           _no_setup, _st_mmap_narrow_run),
    Method("st_slice", "(c) safetensors get_slice per rank", _no_setup, _st_slice_run),
    Method("it_raw", "(d) instanttensor.safe_open distributed + narrow", _it_raw_setup,
           _it_raw_run, needs_group=True, needs_cuda=True),
    Method("it_engine", "(e) coordloader instanttensor engine", _it_engine_setup,
           _it_engine_run, needs_group=True, needs_cuda=True),
    Method("load_e2e", "coordloader.load() end to end (gloo)", _load_e2e_setup, _load_e2e_run,
           needs_group=True),
    Method("digest", "digest of every planned piece", _digest_setup, _digest_run),
    Method("save", "coordloader.save of the rank's primary pieces", _loaded_setup, _save_run,
           needs_group=True, holds_slice=False),
]}
