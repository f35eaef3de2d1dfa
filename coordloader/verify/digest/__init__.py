"""Position-weighted, linearly combinable content digests (the definition and why it
works: ``definition``). This module picks the route: ``routes`` (torch: int64 gemv,
accelerator multiply+sum, CPU int8 products) or ``kernel`` (the compiled CPU loop); every
route gives the same digest."""
from __future__ import annotations

from contextlib import contextmanager
from enum import Enum
from functools import partial
from typing import Sequence

import torch

from coordloader.checkpoint.metadata import Box, box_numel
from coordloader.engines import on_host_default_device
from coordloader.errors import VerifyError
from coordloader.verify.digest import kernel, routes
from coordloader.verify.digest.definition import (
    ALGORITHM,
    MASK64,
    SEED_COL,
    SEED_ROW,
    col_weight_py,
    combine,
    flat_offset,
    fmt,
    hash_weight_py,
    hash_weights,
    iter_subboxes,
)
from coordloader.verify.digest.kernel import kernel_available
from coordloader.verify.digest.routes import _prepare, int8_mm_available, int_view, piece_view

__all__ = ["Route", "digest", "digest_local", "digest_many", "fallback_route", "kernel_available",
           "int8_mm_available", "int_view", "piece_view", "one_intra_op_thread", "ALGORITHM", "MASK64",
           "SEED_COL", "SEED_ROW", "col_weight_py", "combine", "flat_offset", "fmt",
           "hash_weight_py", "hash_weights", "iter_subboxes", "kernel", "routes"]


class Route(str, Enum):
    """How a digest is computed; every route gives the same digest. AUTO takes the fastest
    this install has: on CPU the compiled kernel (unless COORDLOADER_DIGEST_KERNEL=0 or it
    failed its self-test), else the int8 product, else the int64 gemv; on an accelerator
    the elementwise multiply + sum. The others force one (tests and benchmarks); items a
    forced route cannot take (a kernel route given a tensor the kernel refuses, an int8
    route off the CPU or on a big-endian host) take the int64 path."""
    AUTO = "auto"
    KERNEL = "kernel"           # the compiled loop (coordloader/verify/_digestkernel.c)
    INT8 = "int8"               # int8 products against byte weights
    INT64 = "int64"             # widen to int64, gemv against the weights
    ELEMENTWISE = "elementwise"  # widen, multiply, sum: the accelerator route, on any device



@on_host_default_device
def digest(tensor: torch.Tensor, global_box: Box, global_shape: Sequence[int], *,
           chunk_elems: int | None = None, route: Route = Route.AUTO) -> int:
    """Digest of ``tensor`` holding the box ``global_box`` of a tensor of ``global_shape``.

    Returns a uint64 as a Python int. Extra memory is bounded regardless of the tensor's
    size: two buffers of ``chunk_elems`` int64 elements on the torch routes, weight vectors
    of at most KERNEL_MAX_WEIGHTS entries on the compiled kernel's; the tensor may be
    non-contiguous (a view into a local tensor), except that an 8-byte tensor whose
    columns are not packed (a transposed view) is copied first."""
    return _digest_many_prepared([_prepare(tensor, global_box, global_shape)], chunk_elems, 1,
                                 False, Route(route))[0]



@on_host_default_device
def digest_local(tensor: torch.Tensor, pieces: Sequence, global_shape: Sequence[int], *,
                 chunk_elems: int | None = None, route: Route = Route.AUTO) -> list[int]:
    """Per-piece digests of a rank's local tensor: each ``Piece`` (src box, dst offset) is
    narrowed out of ``tensor`` at its destination offset and digested at its source box."""
    return digest_many([(piece_view(tensor, p, i), p.src, global_shape)
                        for i, p in enumerate(pieces)], chunk_elems=chunk_elems, route=route)



@on_host_default_device
def digest_many(items: Sequence, *, chunk_elems: int | None = None, threads: int = 1,
                return_errors: bool = False, route: Route = Route.AUTO) -> list:
    """``[digest(t, box, shape) for t, box, shape in items]``, computed together: on CPU,
    small pieces with the same box and global shape share one int8 product, and the
    products run on ``threads`` threads (torch ops release the GIL). With
    ``return_errors`` an item that cannot be digested yields its exception instead of
    raising."""
    prepared: list = []
    out: list = [None] * len(items)
    for i, (tensor, box, shape) in enumerate(items):
        try:
            prepared.append(_prepare(tensor, box, shape))
        except Exception as e:  # noqa: BLE001
            if not return_errors:
                raise
            prepared.append(None)
            out[i] = e
    res = _digest_many_prepared(prepared, chunk_elems, threads, return_errors, Route(route))
    return [o if o is not None else r for o, r in zip(out, res)]


@contextmanager
def one_intra_op_thread():
    """Run the enclosed torch ops on one intra-op thread (restored after). The products
    here are ~0.1 ms each: an OpenMP team per op only adds synchronisation, and on a busy
    machine a descheduled team member stalls every op (measured: the whole-checkpoint
    manifest took 7-12 s with torch's 2 threads on a loaded 2-core box, 0.3 s with 1).
    ``torch.set_num_threads`` acts on the calling thread's OpenMP setting (and on threads
    torch initialises later), so concurrent callers each restore their own."""
    prev = torch.get_num_threads()
    if prev > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if prev > 1:
            torch.set_num_threads(prev)


def _digest_many_prepared(prepared: list, chunk_elems, threads: int, return_errors: bool,
                          route: Route) -> list:
    out: list = [0] * len(prepared)
    groups: dict = {}     # (shape, sub, width) -> [(item, part)]: stacked products
    batches: list = []    # ([item per result], thunk -> [digest per item]): run on threads
    if route is Route.KERNEL and not kernel_available(forced=True):
        raise VerifyError("digest route 'kernel': the compiled kernel is not built or failed "
                          "its self-test")
    use_kernel = route is Route.KERNEL or (route is Route.AUTO and kernel_available())
    mm = route in (Route.AUTO, Route.INT8) and routes._LITTLE   # and int8_mm_available(), asked lazily
    gemv = route is not Route.ELEMENTWISE
    kitems: list = []     # (item, shape, box, bits): the compiled kernel's share

    def unit(i, shape, sub, width, part):
        if part.numel() * width >= routes.MM_DIRECT_BYTES:
            a = routes._as_matrix(part)
            if a is not None:
                batches.append(([i], partial(routes._mm_direct, shape, sub, width, a)))
                return
        g = groups.get((shape, sub, width))
        if g is None:
            g = groups[(shape, sub, width)] = []
        g.append((i, part))

    for i, p in enumerate(prepared):
        if p is None:
            continue
        shape, box, bits = p
        try:
            if use_kernel and kernel._kernel_fits(bits):
                kitems.append((i, shape, box, bits))
                continue
            bits = int_view(bits)
            width = bits.element_size()
            if not (mm and width in routes._MM_WIDTHS and bits.device.type == "cpu"
                    and int8_mm_available()):
                out[i] = routes._digest_slow(shape, box, bits, chunk_elems, gemv)
                continue
            budget = int(chunk_elems or max(1, routes.MM_BATCH_BYTES // width))
            n = bits.numel()
            if n <= budget and (box[-1][1] - box[-1][0]) * width <= routes.MM_ROW_BYTES:
                # the common case, one unit: skip the sub-box machinery (per-piece
                # Python time is a visible share of the total for a model's small pieces)
                if n:
                    unit(i, shape, box, width, bits)
                continue
            for sub, part in routes._mm_units(bits, box, budget):
                if part.numel():
                    unit(i, shape, sub, width, part)
        except Exception as e:  # noqa: BLE001
            if not return_errors:
                raise
            out[i] = e
    for (shape, sub, width), units in groups.items():
        per = max(1, routes.MM_BATCH_BYTES // max(1, box_numel(sub) * width))
        for k in range(0, len(units), per):
            chunk = units[k:k + per]
            batches.append(([i for i, _ in chunk],
                            partial(routes._mm_batch, shape, sub, width, [p for _, p in chunk])))
    # the kernel's items go out in groups of similar byte counts, one batch each, so a
    # model's thousands of small pieces cost one task switch per group, not per piece
    for grp in kernel._kernel_groups(kitems, threads):
        batches.append(([it[0] for it in grp], partial(kernel._kernel_batch, grp, return_errors)))

    def run(batch):
        try:
            return batch[1]()
        except Exception as e:  # noqa: BLE001
            if not return_errors:
                raise
            return e

    if threads > 1 and len(batches) > 1:
        from concurrent.futures import ThreadPoolExecutor

        def run1(batch):
            with one_intra_op_thread():
                return run(batch)
        with one_intra_op_thread(), ThreadPoolExecutor(
                max_workers=min(threads, len(batches)), thread_name_prefix="coordloader-digest") as ex:
            results = list(ex.map(run1, batches))
    else:
        with one_intra_op_thread():
            results = [run(b) for b in batches]
    for (items, _), res in zip(batches, results):
        for k, i in enumerate(items):
            if isinstance(out[i], Exception):
                continue
            r = res if isinstance(res, Exception) else res[k]
            if isinstance(r, Exception):
                out[i] = r
            else:
                out[i] = (out[i] + r) & MASK64
    return out



def fallback_route() -> Route:
    """The CPU route AUTO takes where the kernel is not used."""
    return Route.INT8 if routes._LITTLE and int8_mm_available() else Route.INT64
