"""The compiled CPU route (``_digestkernel.c``), self-tested against the torch route."""
from __future__ import annotations

import os
from math import prod

import torch

from coordloader.checkpoint.metadata import Box
from coordloader.errors import VerifyError
from coordloader.verify.digest.definition import MASK64, PAIRED
from coordloader.verify.digest.routes import (
    _LITTLE,
    _cached,
    _col_weight_vec,
    _digest_slow,
    _has_data,
    _mm_lock,
    _row_weight_vec,
    _sub_views,
    _word_weight_vec,
    no_data,
)

# --------------------------------------------------------------------------- CPU kernel
#
# The same digest from a compiled loop (coordloader/verify/_digestkernel.c): for each row of the
# box, sum_c w(c) * v(x[r, c]) in wrapping uint64 arithmetic, times hr(r), summed. It reads
# the data once where it lies (any leading-dim strides; the columns of a row contiguous),
# with no copy, no widening buffer and no per-piece product set-up. Measured on this
# project's 2-core VM, one thread: 14-31 GB/s by element width against 5-8 GB/s for the
# int8-product route. The weights come from the same torch hashes as every other route,
# so the C code holds no part of the digest's definition but the element value v.
# Optional: without a C compiler at install time the int8-product route is used.

try:
    from coordloader.verify import _digestkernel as _kernel
except ImportError:  # not built (no C compiler at install time)
    _kernel = None
# whether Route.AUTO may take the kernel (a forced Route.KERNEL takes it regardless)
KERNEL_BY_DEFAULT = os.environ.get("COORDLOADER_DIGEST_KERNEL", "1") != "0"
KERNEL_GROUP_BYTES = 8 << 20    # data bytes per batch of kernel items (threads take batches)


_kernel_ok: bool | None = None



def kernel_available(*, forced: bool = False) -> bool:
    """The kernel is built, passed its self-test (run on the first call) and, unless
    ``forced``, is not switched off by COORDLOADER_DIGEST_KERNEL=0."""
    global _kernel_ok
    if _kernel is None or not _LITTLE or not (KERNEL_BY_DEFAULT or forced):
        return False
    if _kernel_ok is None:
        with _mm_lock:
            if _kernel_ok is None:
                problem = _kernel_selftest()
                _kernel_ok = problem is None
                if problem:
                    import warnings
                    warnings.warn(f"coordloader: the compiled digest kernel failed its self-test "
                                  f"({problem}); digests use the torch routes", RuntimeWarning,
                                  stacklevel=4)
    return _kernel_ok


def _kernel_selftest() -> str | None:
    """None when the kernel, as built for this CPU (a target_clones variant picked at load
    time), gives the int64 route's digest for every element width, on both the word-pair
    and the element paths, strided rows and rows wider than one column block. Run once; a
    kernel that disagrees is never used, so a miscompiled variant cannot pass wrong
    digests off as right. Else what went wrong."""
    try:
        g = torch.Generator().manual_seed(0x5EED)
        # 8224 bytes a row: 1028 to 8224 columns, over one 1024-column block at every width
        base = torch.randint(-2**31, 2**31, (2, 4, 2056), dtype=torch.int32, generator=g)
        for dt in (torch.int8, torch.int16, torch.int32):   # 8-byte elements come as halves
            full = base.view(dt)                         # same bytes, elements of this width
            shape = tuple(full.shape)
            cols = shape[-1]
            for box in (((0, 2), (0, 4), (0, cols)),               # contiguous (pairs as words)
                        ((0, 2), (1, 3), (1, cols - 2)),            # strided rows, element path
                        ((0, 2), (1, 4), (4, 4 + 2 * 510))):        # strided rows, words
                t = full[box[0][0]:box[0][1], box[1][0]:box[1][1], box[2][0]:box[2][1]]
                if _kernel_one(shape, box, t) != _digest_slow(shape, box, t, None):
                    return f"it disagrees with the torch digest on {dt} box {list(box)}"
        return None
    except Exception as e:  # noqa: BLE001 — any failure means: use the torch routes
        return f"{type(e).__name__}: {e}"


KERNEL_MAX_DIMS = 64


def _kernel_fits(bits: torch.Tensor) -> bool:
    """The kernel takes CPU tensors whose rows are contiguous runs of elements (``_prepare``
    has already refused or resolved every tensor whose memory is not its values)."""
    return (bits.device.type == "cpu" and bits.element_size() in (1, 2, 4)
            and bits.dim() <= KERNEL_MAX_DIMS and (bits.stride(-1) == 1 or bits.shape[-1] <= 1))


def _kernel_args(shape: tuple[int, ...], box: Box, width: int):
    """(element width the kernel reads, column weights, row weights, their pointers),
    cached whole: looking up the pieces one by one cost a rank's 2,013 pieces 5 ms.

    1- and 2-byte elements on an even column range are read as words of two (BF16 pairs
    as 4-byte words): the pair's weights are w(2g) = hc(g) and w(2g+1) = hc(g) << 8*width,
    so the pair contributes hc(g) * v(word), v being bytewise. Every row starts at global
    column c0, so with c0 even the pairs line up in every row whatever the row strides.
    Half the multiplies: measured 0.040 -> 0.025 s for a rank's qwen3_moe-small pieces.
    A ragged range keeps per-element weights (same digest)."""
    c0, c1 = box[-1]

    def make():
        if width in PAIRED and not (c0 & 1) and not (c1 & 1):
            kw, colw = 2 * width, _word_weight_vec("cpu", c0 // 2, c1 // 2)
        else:
            kw, colw = width, _col_weight_vec("cpu", c0, c1, width)
        roww = _row_weight_vec(shape, box[:-1])
        return kw, colw, roww, colw.data_ptr(), roww.data_ptr()
    return _cached(("cpu", "kernel", shape, box, width), make,
                   max(c1 - c0, prod(b - a for a, b in box[:-1])))


KERNEL_MAX_WEIGHTS = 1 << 20   # rows or columns per call: weight vectors stay <= 8 MiB


def _kernel_one(shape: tuple[int, ...], box: Box, t: torch.Tensor) -> int:
    rows = prod(b - a for a, b in box[:-1])
    if rows > KERNEL_MAX_WEIGHTS or box[-1][1] - box[-1][0] > KERNEL_MAX_WEIGHTS:
        # a (1e8, 1) tensor would need 800 MB of row weights: sub-boxes of at most
        # KERNEL_MAX_WEIGHTS elements (so rows and columns) each, summed
        return sum(_kernel_call(shape, sub, part)
                   for sub, part in _sub_views(t, box, KERNEL_MAX_WEIGHTS)) & MASK64
    return _kernel_call(shape, box, t)


def _kernel_call(shape: tuple[int, ...], box: Box, t: torch.Tensor) -> int:
    width = t.element_size()
    kw, colw, roww, cp, rp = _kernel_args(shape, box, width)
    sizes = tuple(t.shape)
    if kw != width:
        sizes = sizes[:-1] + (sizes[-1] // 2,)
    strides = [s * width for s in t.stride()[:-1]]
    if t.numel() and not _has_data(t):   # the C loop would read address 0
        raise VerifyError(no_data(t))
    # colw and roww stay referenced here while the kernel reads them
    return _kernel.rows(t.data_ptr(), kw, sizes, strides, cp, rp)


def _kernel_batch(units: list, return_errors: bool) -> list:
    res = []
    for _, shape, box, bits in units:
        try:
            res.append(_kernel_one(shape, box, bits))
        except Exception as e:  # noqa: BLE001
            if not return_errors:
                raise
            res.append(e)
    return res


def _kernel_groups(kitems: list, threads: int) -> list:
    """``kitems`` cut into consecutive groups of about KERNEL_GROUP_BYTES (a single big
    tensor is a group of its own), at least ``threads`` groups when there are that many
    items, so every thread has work."""
    if not kitems:
        return []
    total = sum(b.numel() * b.element_size() for *_, b in kitems)
    budget = max(1, min(KERNEL_GROUP_BYTES, total // max(1, threads)))
    groups, cur, size = [], [], 0
    for it in kitems:
        cur.append(it)
        size += it[3].numel() * it[3].element_size()
        if size >= budget:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups
