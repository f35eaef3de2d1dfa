"""Position-weighted, linearly combinable content digests.

    digest(T) = sum over elements e of  w(e) * v(bits(e))   mod 2^64

* ``bits(e)`` is the element's raw bit pattern (the tensor is viewed as the same-width
  integer type, so -0.0 and +0.0, or two NaN payloads, differ).
* ``v`` maps the bits to an integer, one-to-one. For elements of 1, 2 or 4 bytes it reads
  each little-endian byte as a *signed* byte: ``v(u) = sum_k s_k * 256^k`` with ``s_k`` the
  k-th byte in [-128, 127], i.e. ``v(u) = u - 2 * (u & 0x80...80)``. That is what an int8
  matrix product computes from the data as it lies in memory, so the CPU path digests a
  tensor without copying or re-biasing it (see "CPU fast path"). ``v`` is injective (a
  balanced base-256 number is zero only when every digit is), and ``|v(u)| < 2^(8*width)``,
  so the arguments below hold as for the raw bits. For 64-bit elements ``v`` is the
  bijection ``x ^ (x >>> 32)``. Without it, two 64-bit values differing only in the top bit
  (+0.0 / -0.0 in F64, 0 / -2^63 in I64) would differ by 2^63, and since two odd weights
  always differ by an even number, swapping them would cancel out mod 2^64.
* ``w(e)`` depends only on the element's position in the *global* tensor: with ``C`` the
  global last dimension, ``r = i // C`` (the row, i.e. all leading dims flattened) and
  ``c = i % C`` for global linear index ``i``, ``w = hr(r) * hc(c)``, where ``hr`` and ``hc``
  are splitmix64-style hashes with different seeds, forced odd. The product is odd, so any
  single-element change changes the digest (odd numbers are invertible mod 2^64), and it is
  pseudo-random in both coordinates. Factoring the weight is what makes the digest cheap:
  a chunk costs one widening copy and one int64 gemv against a cached column-weight
  vector; the per-row weights are computed once per row, not per element.
* Exception for 1- and 2-byte elements (BF16, F16, FP8, ...): columns ``2g`` and ``2g+1``
  share ``hc(g)``, the odd one scaled by ``2^(8*width)``:
  ``w = hr(r) * hc(c >> 1) * 2^(8*width*(c & 1))``. An aligned pair then contributes
  ``hr * hc(g) * word`` where ``word`` is the two elements read as one little-endian
  integer (``v`` is bytewise, so ``v(word) = v(x0) + 2^(8*width) * v(x1)``), so the hot
  loop runs on half as many int64 values (measured ~2x for BF16).
  Detection guarantees survive: a change ``d`` (|d| < 2^(8*width)) of one element moves
  the digest by ``odd * 2^k * d`` with ``k <= 16``, never 0 mod 2^64; swapping the two
  elements of a pair moves it by ``odd * (1 - 2^(8*width)) * d``, odd factor again. The
  price is that odd-column elements only reach the top 48 (2-byte) / 56 (1-byte) bits.

Because the digest is a sum over elements with weights fixed by global position, the
digests of disjoint boxes that tile a tensor add up (mod 2^64) to the whole tensor's digest:
``combine`` is that sum. Everything runs as torch int64 ops on the tensor's own device
(int64 wrapping arithmetic is arithmetic mod 2^64), in bounded chunks. On CPU, elements
of 1, 2 or 4 bytes take an exact int8 matrix-product route to the same value (see "CPU
fast path" below; ``digest_many`` batches a rank's pieces through it).
"""
from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from enum import Enum
from functools import partial
from math import prod
from typing import Iterator, Sequence

import torch

from coordloader.checkpoint.dtypes import _BITS_VIEW
from coordloader.checkpoint.metadata import Box, box_numel, box_shape
from coordloader.errors import VerifyError

MASK64 = (1 << 64) - 1
# recorded in manifests; bump if the math changes (v3: signed-byte element values)
ALGORITHM = "coordloader-rowcol-splitmix64-v3"

# Default chunk sizes (elements per int64 work buffer). On CPU, 1M-element chunks measured
# best (BF16 8192x8192, 2 cores: 64K -> ~1 GB/s, 256K -> ~2 GB/s, 1M -> 2.3-3.5 GB/s,
# 4M -> <1 GB/s once the buffer falls out of cache); on accelerators bigger chunks
# amortise kernel launches.
CPU_CHUNK = 1 << 20            # 8 MiB of int64
DEVICE_CHUNK = 1 << 22         # 32 MiB of int64

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
SEED_ROW = 0x243F6A8885A308D3
SEED_COL = 0x13198A2E03707344

_ZERO_EXT = {2: 0xFFFF, 4: 0xFFFFFFFF}   # masks undoing sign extension of int16/int32
_SIGN_BITS = {1: 0x80, 2: 0x8080, 4: 0x80808080}   # each byte's top bit (v of the module doc)


def _s64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch scalars are signed)."""
    c &= MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def hash_weights(idx: torch.Tensor, seed: int) -> torch.Tensor:
    """Odd pseudo-random int64 weights for int64 indices (splitmix64 finaliser)."""
    z = idx * _s64(_GOLDEN) + _s64(seed)
    z ^= _shr(z, 30)
    z *= _s64(_M1)
    z ^= _shr(z, 27)
    z *= _s64(_M2)
    z ^= _shr(z, 31)
    z |= 1
    return z


def hash_weight_py(i: int, seed: int) -> int:
    """Pure-Python reference of ``hash_weights`` (tests and documentation)."""
    z = (i * _GOLDEN + seed) & MASK64
    z ^= z >> 30
    z = (z * _M1) & MASK64
    z ^= z >> 27
    z = (z * _M2) & MASK64
    z ^= z >> 31
    return z | 1


def _canon(global_shape: Sequence[int], box: Box) -> tuple[tuple[int, ...], Box]:
    """0-d tensors are digested as a 1-element 1-d tensor."""
    shape = tuple(int(s) for s in global_shape)
    if not shape:
        return (1,), ((0, 1),)
    return shape, tuple((int(a), int(b)) for a, b in box)


def iter_subboxes(box: Box, budget: int) -> Iterator[Box]:
    """Split ``box`` into row-major consecutive sub-boxes of at most ``budget`` elements
    (except that one element is never split). Each sub-box is a contiguous range of the
    box's row-major order, so a reader of a contiguously stored box can fetch it with one
    read: its offset is ``flat_offset(box, sub)``."""
    budget = max(1, int(budget))
    n = prod(b - a for a, b in box)
    if n == 0:
        return
    if n <= budget:
        yield box
        return
    yield from _split(box, budget, 0)


def _split(box: Box, budget: int, d: int) -> Iterator[Box]:
    # Dims before d have extent 1 here, so narrowing dim d keeps each part contiguous.
    a, b = box[d]
    per = prod(hi - lo for lo, hi in box[d + 1:])
    if per <= budget or d == len(box) - 1:
        k = max(1, budget // max(per, 1))
        for i in range(a, b, k):
            yield box[:d] + ((i, min(i + k, b)),) + box[d + 1:]
    else:
        for i in range(a, b):
            yield from _split(box[:d] + ((i, i + 1),) + box[d + 1:], budget, d + 1)


def flat_offset(box: Box, sub: Box) -> int:
    """Row-major element offset of ``sub``'s corner inside a contiguously stored ``box``."""
    off, stride = 0, 1
    for (a, b), (sa, _) in zip(reversed(box), reversed(sub)):
        off += (sa - a) * stride
        stride *= b - a
    return off


_UNSIGNED = {w: getattr(torch, n, None) for w, n in ((1, "uint8"), (2, "uint16"), (4, "uint32"))}
PAIRED = (1, 2)                              # element widths digested in column pairs
_WORD = {1: torch.int16, 2: torch.int32}     # the pair's word (widened like any element)
_LITTLE = sys.byteorder == "little"
_tls = threading.local()


class Route(str, Enum):
    """How a digest is computed; every route gives the same digest. AUTO takes the fastest
    this install has: on CPU the compiled kernel (unless COORDLOADER_DIGEST_KERNEL=0 or it
    failed its self-test), else the int8 product, else the int64 gemv; on an accelerator
    the elementwise multiply + sum. The others force one (tests and benchmarks); items a
    forced route cannot take (a kernel route given a tensor the kernel refuses, an int8
    route given a width it has no product for) take the int64 path."""
    AUTO = "auto"
    KERNEL = "kernel"           # the compiled loop (coordloader/verify/_digestkernel.c)
    INT8 = "int8"               # int8 products against byte weights
    INT64 = "int64"             # widen to int64, gemv against the weights
    ELEMENTWISE = "elementwise"  # widen, multiply, sum: the accelerator route, on any device


def _work_buffer(device: torch.device, n: int, slot: int = 0) -> torch.Tensor:
    """A per-thread, per-device int64 work buffer of at least ``n`` elements, reused across
    calls: a model has thousands of small tensors, and a fresh buffer per tensor costs page
    faults that measured as much as the digest itself."""
    cache = getattr(_tls, "bufs", None)
    if cache is None:
        cache = _tls.bufs = {}
    key = (str(device), slot)
    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        buf = cache[key] = torch.empty(n, dtype=torch.int64, device=device)
    return buf


_WEIGHTS: dict = {}          # (device, kind, range...) -> weight vector; shared by tensors
_WEIGHTS_MAX = 256           # of the same shape (a model's thousands of expert tensors)
_WEIGHT_MAX_LEN = 8192       # longer vectors are rebuilt (bounds the cache at 16 MiB)


def _cached(key: tuple, make, length: int = 0, cache: dict = _WEIGHTS):
    """``make()`` memoised in ``cache`` under ``key`` (at most _WEIGHTS_MAX entries);
    vectors longer than _WEIGHT_MAX_LEN are rebuilt each time."""
    if length > _WEIGHT_MAX_LEN:
        return make()
    w = cache.get(key)
    if w is None:
        if len(cache) >= _WEIGHTS_MAX:
            cache.clear()
        w = cache[key] = make()
    return w


def _try_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` viewed as a wider dtype when its strides and offset allow, else None."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def col_weight_py(c: int, width: int) -> int:
    """Pure-Python reference of the column weight of global column ``c``."""
    if width in PAIRED:
        return (hash_weight_py(c >> 1, SEED_COL) << (8 * width * (c & 1))) & MASK64
    return hash_weight_py(c, SEED_COL)


class _Accumulator:
    """Digest state for one global shape on one device."""

    def __init__(self, global_shape: tuple[int, ...], device: torch.device, chunk: int,
                 gemv: bool = True):
        self.shape = global_shape
        self.device = device
        self.cpu = device.type == "cpu" and gemv
        self.chunk = chunk
        self.acc = torch.zeros((), dtype=torch.int64, device=device)

    def _col_weights(self, c0: int, c1: int, width: int) -> torch.Tensor:
        """Weights of global columns [c0, c1) for elements of ``width`` bytes (see
        ``col_weight_py``)."""
        return _cached((str(self.device), "col", c0, c1, width in PAIRED and width),
                       lambda: _col_weight_vec(self.device, c0, c1, width), c1 - c0)

    def _row_weights(self, sub: Box) -> torch.Tensor:
        return _row_weight_vec(self.shape, sub[:-1], self.device)

    def _widen(self, bits: torch.Tensor, x: torch.Tensor) -> None:
        """x (int64, shape of bits) <- v(bits) (see module doc)."""
        width = bits.element_size()
        if width == 1:
            x.copy_(bits.view(torch.int8))   # one signed byte: v is the sign extension
            return
        uview = _UNSIGNED.get(width)
        zero_extended = False
        if uview is not None:
            try:
                # converting from the unsigned view zero-extends: no separate mask pass
                x.copy_(bits.view(uview))
                zero_extended = True
            except (RuntimeError, TypeError):
                pass  # a backend without unsigned copies: sign-extend, then mask
        if not zero_extended:
            x.copy_(bits)
            if width in _ZERO_EXT:
                x &= _ZERO_EXT[width]
        t = _work_buffer(self.device, x.numel(), 1)[:x.numel()].view(x.shape)
        if width == 8:
            torch.bitwise_right_shift(x, 32, out=t)
            t &= 0xFFFFFFFF
            x ^= t
        else:
            torch.bitwise_and(x, _SIGN_BITS[width], out=t)
            x.sub_(t, alpha=2)

    def add(self, bits: torch.Tensor, sub: Box) -> None:
        """Add the digest of ``bits`` (integer view, shape == box_shape(sub))."""
        if bits.numel() == 0:
            return
        width = bits.element_size()
        c0, c1 = sub[-1]
        rw = self._row_weights(sub)
        if width in PAIRED and _LITTLE:
            # Aligned column pairs as one word: w(2g+1) = w(2g) * 2^(8*width), so the pair's
            # contribution is hc(g) * (x[2g] + x[2g+1] << 8*width) — half the int64 work.
            a, b = c0 + (c0 & 1), c1 - (c1 & 1)
            if b > a:
                mid = bits.narrow(-1, a - c0, b - a)
                word = _try_view(mid, _WORD[width])
                if word is not None:
                    self._accumulate(word, rw, _word_weight_vec(self.device, a // 2, b // 2))
                    for e0 in ((c0,) if a > c0 else ()) + ((b,) if c1 > b else ()):
                        self._accumulate(bits.narrow(-1, e0 - c0, 1), rw,
                                         self._col_weights(e0, e0 + 1, width))
                    return
        self._accumulate(bits, rw, self._col_weights(c0, c1, width))

    def _accumulate(self, bits: torch.Tensor, rw: torch.Tensor, w: torch.Tensor) -> None:
        n = bits.numel()
        ncols = bits.shape[-1]
        x = _work_buffer(self.device, n)[:n]
        # widen into a same-shaped view of the contiguous buffer: handles any strides (a
        # dim-1 slice of a packed local tensor) without another temporary
        self._widen(bits, x.view(bits.shape))
        x = x.view(n // ncols, ncols)
        if self.cpu:
            s = torch.mv(x, w)          # fused multiply + row sum (int64 gemv, wraps mod 2^64)
        else:
            x *= w                      # no integer gemv on CUDA/ROCm
            s = x.sum(dim=1)
        s *= rw
        self.acc += s.sum()

    def value(self) -> int:
        return int(self.acc.item()) & MASK64


def _row_hash(lead: Box, row_strides: Sequence[int], device) -> torch.Tensor:
    """hr of the rows of box ``lead`` (leading dims; ``row_strides`` in rows), row-major."""
    ids = torch.zeros((), dtype=torch.int64, device=device)
    for (a, b), st in zip(lead, row_strides):
        ids = ids.unsqueeze(-1) + torch.arange(a, b, dtype=torch.int64, device=device) * st
    return hash_weights(ids.reshape(-1), SEED_ROW)


def _int_view(tensor: torch.Tensor) -> torch.Tensor:
    try:
        view = _BITS_VIEW[tensor.element_size()]
    except KeyError:
        raise VerifyError(f"cannot digest dtype {tensor.dtype} "
                          f"(element size {tensor.element_size()})") from None
    if tensor.dtype == view:
        return tensor
    if tensor.dim() == 0:
        return tensor.reshape(1).view(view).reshape(())
    return tensor.view(view)


def _default_chunk(device: torch.device) -> int:
    return CPU_CHUNK if device.type == "cpu" else DEVICE_CHUNK


def _prepare(tensor: torch.Tensor, global_box: Box, global_shape: Sequence[int]):
    """Validate one digest request -> (global shape, box, the data (0-d as 1-d)). The
    integer view is taken by the routes that need one (``_int_view``); the kernel reads
    raw bytes."""
    shape, box = _canon(global_shape, global_box)
    if tensor.layout != torch.strided or tensor.is_quantized:
        kind = "quantized" if tensor.is_quantized else str(tensor.layout)
        raise VerifyError(f"cannot digest a {kind} tensor ({tensor.dtype}): digests cover "
                          "plain strided tensors of checkpoint dtypes")
    if tensor.is_conj() or tensor.is_neg():
        # lazy conjugate/negative views: their memory holds the un-negated bits
        tensor = tensor.resolve_conj().resolve_neg()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if len(box) != len(shape) or any(not (0 <= a <= b <= s) for (a, b), s in zip(box, shape)):
        raise VerifyError(f"digest: box {[list(p) for p in box]} does not fit global shape {list(shape)}")
    if tensor.shape != tuple(b - a for a, b in box):
        raise VerifyError(f"digest: tensor shape {list(tensor.shape)} != box shape {list(box_shape(box))}")
    return shape, box, tensor


def digest(tensor: torch.Tensor, global_box: Box, global_shape: Sequence[int], *,
           chunk_elems: int | None = None, route: Route = Route.AUTO) -> int:
    """Digest of ``tensor`` holding the box ``global_box`` of a tensor of ``global_shape``.

    Returns a uint64 as a Python int. Extra memory is bounded regardless of the tensor's
    size: ``chunk_elems`` int64 elements (two buffers for 64-bit dtypes) on the torch
    routes, weight vectors of at most KERNEL_MAX_WEIGHTS entries on the compiled kernel's;
    the tensor may be non-contiguous (a view into a local tensor)."""
    return _digest_many_prepared([_prepare(tensor, global_box, global_shape)], chunk_elems, 1,
                                 False, Route(route))[0]


def _digest_slow(shape, box, bits, chunk_elems, gemv: bool = True) -> int:
    """The int64 widen + gemv (CPU) or multiply + sum (accelerators, or ``gemv=False``)."""
    chunk = int(chunk_elems or _default_chunk(bits.device))
    acc = _Accumulator(shape, bits.device, chunk, gemv)
    _add_box(acc, bits, box, chunk)
    return acc.value()


def _sub_views(bits: torch.Tensor, box: Box, budget: int):
    """(sub-box, the view of ``bits`` holding it) for ``iter_subboxes(box, budget)``."""
    for sub in iter_subboxes(box, budget):
        part = bits
        for d, ((a, _), (sa, sb)) in enumerate(zip(box, sub)):
            if sb - sa != part.shape[d]:
                part = part.narrow(d, sa - a, sb - sa)
        yield sub, part


def _add_box(acc: _Accumulator, bits: torch.Tensor, box: Box, chunk: int) -> None:
    for sub, part in _sub_views(bits, box, chunk):
        acc.add(part, sub)


def digest_local(tensor: torch.Tensor, pieces: Sequence, global_shape: Sequence[int], *,
                 chunk_elems: int | None = None, route: Route = Route.AUTO) -> list[int]:
    """Per-piece digests of a rank's local tensor: each ``Piece`` (src box, dst offset) is
    narrowed out of ``tensor`` at its destination offset and digested at its source box."""
    return digest_many([(piece_view(tensor, p, i), p.src, global_shape)
                        for i, p in enumerate(pieces)], chunk_elems=chunk_elems, route=route)


def piece_view(tensor: torch.Tensor, p, i: int = 0) -> torch.Tensor:
    """The view of local ``tensor`` that piece ``p`` (src box, dst offset) fills."""
    if tensor.dim() == 0:
        return tensor
    if len(p.src) != tensor.dim() or len(p.dst) != tensor.dim():
        raise VerifyError(f"piece {i}: rank {len(p.src)} box does not match local tensor rank {tensor.dim()}")
    view = tensor
    for d, ((a, b), o) in enumerate(zip(p.src, p.dst)):
        if o < 0 or o + (b - a) > tensor.shape[d]:
            raise VerifyError(f"piece {i}: destination [{o}, {o + b - a}) of dim {d} is outside the "
                              f"local tensor of shape {list(tensor.shape)}")
        if b - a != tensor.shape[d]:
            view = view.narrow(d, o, b - a)
    return view


# --------------------------------------------------------------------------- CPU fast path
#
# The same digest, computed as an int8 matrix product (torch._int_mm: oneDNN's int8 GEMM,
# one pass over the data at memory speed, no widening to int64).
#
# For elements of 1, 2 or 4 bytes the digest is linear in the element's little-endian
# bytes read as signed int8 (that is how ``v`` is defined): w(c) * v(u) = sum_k (w(c) *
# 256^k) * s_k. So a row of a box, read as K int8 bytes, contributes sum_j B_j * s_j with
# byte weights B_j = w(c0 + j // width) * 256^(j % width) (the column-pair scaling of
# narrow dtypes is inside w(c), so any column range works). Writing B_j = sum_l 256^l t_jl
# mod 2^64 with balanced digits t_jl in [-128, 127] (l < 8) makes the row an exact
# int8 x int8 -> int32 product S = s @ t (rows x 8), exact while |S| <= K * 2^14 < 2^31,
# i.e. K <= 2^16 bytes per row (wider rows are split); the row value is sum_l S_l * 256^l
# mod 2^64, which one int64 gemv combines, and the row weights follow as in the int64
# path. A big part (MM_DIRECT_BYTES or more) goes into the product as it lies in memory
# (a strided int8 view, no copy) when its rows are evenly spaced; small pieces that share
# a box and global shape (a model's many experts) are stacked into one product instead,
# so per-piece Python overhead is a few microseconds, not a dozen torch calls. (An
# orientation with the row weights as the left operand, hr limbs (8 x rows) @ data, was
# measured too: its 8 x K output costs more than it saves unless rows >> K.)
#
# 8-byte elements (mixed by x ^ (x >>> 32), not linear in the bytes), accelerators and
# big-endian hosts keep the int64 path. torch._int_mm is private API: it is self-tested
# once on extreme inputs and the int64 path is used if it is missing or inexact.

MM_ROW_BYTES = 1 << 14       # bytes of a row per product (exact up to 2^16: |S| <= 2^16 * 2^14 = 2^30;
                             # rows of 16 KiB measured faster than 64 KiB)
MM_BATCH_BYTES = 2 << 20     # data bytes per stacked product (1-4 MiB measured alike; 256 KiB slower)
# parts this big go into the product in place, not stacked. Measured (1 thread, cold): a 64 MiB
# BF16 tensor 7.3 GB/s in place vs 6.9 stacked, its dim-1 half 5.2 vs 3.8; but a model's
# 256 KiB expert slices ran 3.8 GB/s one product each vs 5.3 stacked (per-call overhead)
MM_DIRECT_BYTES = MM_BATCH_BYTES
_POW256 = None
_mm_ok: bool | None = None
_mm_lock = threading.Lock()


def _mm_selftest() -> bool:
    """True when torch._int_mm exists on CPU and is exact at the extremes this path uses
    (every product -128 * -128 or -128 * 127 over the widest row; a narrow-accumulator
    kernel that saturates would fail here), for contiguous and strided rows."""
    mm = getattr(torch, "_int_mm", None)
    if mm is None or MM_ROW_BYTES > 1 << 16:
        return False
    try:
        K = MM_ROW_BYTES
        t = torch.full((K, 8), -128, dtype=torch.int8)
        t[:, 1::2] = 127
        for m in (1, 3, 40):
            a = torch.full((m, K), -128, dtype=torch.int8)
            s = mm(a, t)
            want = torch.tensor([K * 16384, -K * 128 * 127] * 4, dtype=torch.int32)
            if s.dtype != torch.int32 or not torch.equal(s, want.expand(m, 8)):
                return False
        g = torch.Generator().manual_seed(1)
        for m, k in ((1, 4097), (7, 2048), (64, 1000)):
            a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
            b = torch.randint(-128, 128, (k, 8), dtype=torch.int8, generator=g)
            if not torch.equal(mm(a, b).to(torch.int64), a.to(torch.int64) @ b.to(torch.int64)):
                return False
            # the in-place route hands in rows of a wider tensor (row stride > K)
            w = torch.randint(-128, 128, (m, k + 24), dtype=torch.int8, generator=g)[:, 16:16 + k]
            if not torch.equal(mm(w, b).to(torch.int64), w.to(torch.int64) @ b.to(torch.int64)):
                return False
        return True
    except Exception:  # noqa: BLE001 — any failure means: use the int64 path
        return False


def int8_mm_available() -> bool:
    global _mm_ok, _POW256
    if _mm_ok is None:
        with _mm_lock:
            if _mm_ok is None:
                _POW256 = torch.tensor([1 << (8 * i) for i in range(8)], dtype=torch.int64)
                _mm_ok = _mm_selftest()
    return _mm_ok


_MM_WIDTHS = (1, 2, 4)


def _col_weight_vec(device, c0: int, c1: int, width: int) -> torch.Tensor:
    """w(c) of global columns [c0, c1) for elements of ``width`` bytes (``col_weight_py``)."""
    idx = torch.arange(c0, c1, dtype=torch.int64, device=device)
    if width in PAIRED:
        w = hash_weights(idx >> 1, SEED_COL)
        return torch.where((idx & 1).bool(), w * (1 << (8 * width)), w)
    return hash_weights(idx, SEED_COL)


def balanced_limbs(v: torch.Tensor) -> torch.Tensor:
    """int64 values (mod 2^64) -> int8 digits t[..., l] in [-128, 127] with
    sum_l t_l * 256^l == v mod 2^64."""
    out = []
    for _ in range(8):
        d = ((v + 128) & 255) - 128
        out.append(d)
        v = (v - d) >> 8   # exact: v - d is a multiple of 256 (mod 2^64, which is enough)
    return torch.stack(out, dim=-1).to(torch.int8)


def _byte_weights(c0: int, c1: int, width: int) -> torch.Tensor:
    """K x 8 int8 limbs of the byte weights of columns [c0, c1)."""
    def make():
        w = _col_weight_vec("cpu", c0, c1, width)
        b = (w.unsqueeze(1) * _POW256[:width]).reshape(-1)
        return balanced_limbs(b).contiguous()
    return _cached(("cpu", "bytes", c0, c1, width), make)


def _row_weight_vec(shape: tuple[int, ...], lead: Box, device="cpu") -> torch.Tensor:
    """hr of the rows of box ``lead`` (leading dims) of a tensor of ``shape``."""
    def make():
        strides = [prod(shape[d + 1:-1]) for d in range(len(shape) - 1)]
        return _row_hash(lead, strides, device).contiguous()
    return _cached((str(device), "row", shape, lead), make, prod(b - a for a, b in lead))


def _word_weight_vec(device, g0: int, g1: int) -> torch.Tensor:
    """hc(g) of column pairs [g0, g1): the weight of a pair read as one word."""
    return _cached((str(device), "word", g0, g1), lambda: hash_weights(
        torch.arange(g0, g1, dtype=torch.int64, device=device), SEED_COL), g1 - g0)


def _byte_buffer(n: int) -> torch.Tensor:
    buf = getattr(_tls, "mmbuf", None)
    if buf is None or buf.numel() < n:
        buf = _tls.mmbuf = torch.empty(max(n, MM_BATCH_BYTES), dtype=torch.int8)
    return buf[:n]


def _as_bytes(part: torch.Tensor) -> torch.Tensor:
    """``part`` (integer view) as int8 with the last dim in bytes (a view when it can be)."""
    if part.dtype != torch.int8:
        if part.stride(-1) != 1:
            part = part.contiguous()
        part = part.view(torch.int8)
    return part


def _as_matrix(part: torch.Tensor) -> torch.Tensor | None:
    """``part`` (integer view) as a (rows, K) int8 view of its own memory when its rows are
    evenly spaced with contiguous bytes, else None."""
    if part.dim() == 0 or (part.dim() > 1 and part.shape[-1] != 1 and part.stride(-1) != 1):
        return None
    try:
        m = part.view(torch.int8) if part.dtype != torch.int8 else part
        m = m.view(-1, m.shape[-1]) if m.dim() != 2 else m
    except RuntimeError:
        return None
    # rows that overlap (an expanded tensor's stride 0) are not a matrix oneDNN reads
    # correctly: measured wrong digests; those go through the stacked copy
    if m.shape[0] > 1 and (m.stride(1) != 1 or m.stride(0) < m.shape[1]):
        return None
    return m


def _finish(s: torch.Tensor, hr: torch.Tensor, nb: int) -> list[int]:
    """Per-part digests from the int32 limb sums ``s`` of ``nb`` parts' rows."""
    r = torch.mv(s.to(torch.int64), _POW256)   # row values mod 2^64 (int64 wraps)
    d = torch.mv(r.view(nb, -1), hr)           # sum over rows of hr * row value
    return [x & MASK64 for x in d.tolist()]


def _mm_direct(shape: tuple[int, ...], sub: Box, width: int, a: torch.Tensor) -> list[int]:
    """[digest] of one part given as an int8 (rows, K) view of its memory: no copy."""
    s = torch._int_mm(a, _byte_weights(sub[-1][0], sub[-1][1], width))
    return _finish(s, _row_weight_vec(shape, sub[:-1]), 1)


def _mm_batch(shape: tuple[int, ...], sub: Box, width: int, parts: list) -> list[int]:
    """Digests of ``parts`` (integer views, each holding box ``sub`` of a tensor of
    ``shape``) as one stacked int8 product."""
    rows = prod(b - a for a, b in sub[:-1])
    K = (sub[-1][1] - sub[-1][0]) * width
    nb = len(parts)
    buf = _byte_buffer(nb * rows * K)
    dst = buf.view(nb, *box_shape(sub)[:-1], K)
    if nb == 1:
        dst[0].copy_(_as_bytes(parts[0]))
    else:
        torch.stack([_as_bytes(p) for p in parts], out=dst)
    s = torch._int_mm(buf.view(nb * rows, K), _byte_weights(sub[-1][0], sub[-1][1], width))
    return _finish(s, _row_weight_vec(shape, sub[:-1]), nb)


def _mm_units(bits: torch.Tensor, box: Box, budget: int):
    """(sub-box, view) units of at most ``budget`` elements and MM_ROW_BYTES bytes a row."""
    width = bits.element_size()
    maxc = max(1, MM_ROW_BYTES // width)
    for sub, part in _sub_views(bits, box, budget):
        c0, c1 = sub[-1]
        if c1 - c0 <= maxc:
            yield sub, part
            continue
        for c in range(c0, c1, maxc):
            e = min(c + maxc, c1)
            yield sub[:-1] + ((c, e),), part.narrow(-1, c - c0, e - c)


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
    mm = route in (Route.AUTO, Route.INT8) and _LITTLE   # and int8_mm_available(), asked lazily
    gemv = route is not Route.ELEMENTWISE
    kitems: list = []     # (item, shape, box, bits): the compiled kernel's share

    def unit(i, shape, sub, width, part):
        if part.numel() * width >= MM_DIRECT_BYTES:
            a = _as_matrix(part)
            if a is not None:
                batches.append(([i], partial(_mm_direct, shape, sub, width, a)))
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
            if use_kernel and _kernel_fits(bits):
                kitems.append((i, shape, box, bits))
                continue
            bits = _int_view(bits)
            width = bits.element_size()
            if not (mm and width in _MM_WIDTHS and bits.device.type == "cpu"
                    and int8_mm_available()):
                out[i] = _digest_slow(shape, box, bits, chunk_elems, gemv)
                continue
            budget = int(chunk_elems or max(1, MM_BATCH_BYTES // width))
            n = bits.numel()
            if n <= budget and (box[-1][1] - box[-1][0]) * width <= MM_ROW_BYTES:
                # the common case, one unit: skip the sub-box machinery (per-piece
                # Python time is a visible share of the total for a model's small pieces)
                if n:
                    unit(i, shape, box, width, bits)
                continue
            for sub, part in _mm_units(bits, box, budget):
                if part.numel():
                    unit(i, shape, sub, width, part)
        except Exception as e:  # noqa: BLE001
            if not return_errors:
                raise
            out[i] = e
    for (shape, sub, width), units in groups.items():
        per = max(1, MM_BATCH_BYTES // max(1, box_numel(sub) * width))
        for k in range(0, len(units), per):
            chunk = units[k:k + per]
            batches.append(([i for i, _ in chunk],
                            partial(_mm_batch, shape, sub, width, [p for _, p in chunk])))
    # the kernel's items go out in groups of similar byte counts, one batch each, so a
    # model's thousands of small pieces cost one task switch per group, not per piece
    for grp in _kernel_groups(kitems, threads):
        batches.append(([it[0] for it in grp], partial(_kernel_batch, grp, return_errors)))

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


# --------------------------------------------------------------------------- CPU kernel
#
# The same digest from a compiled loop (coordloader/_digestkernel.c): for each row of the
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


def fallback_route() -> Route:
    """The CPU route AUTO takes where the kernel is not used."""
    return Route.INT8 if _LITTLE and int8_mm_available() else Route.INT64


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
        for dt in (torch.int8, torch.int16, torch.int32, torch.int64):
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
    return (bits.device.type == "cpu" and bits.element_size() in _BITS_VIEW
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


def combine(digests) -> int:
    """Digest of the union of disjoint boxes: the sum of their digests mod 2^64."""
    return sum(int(d) for d in digests) & MASK64


def fmt(d: int) -> str:
    """Canonical text form (manifests, reports)."""
    return f"{int(d) & MASK64:016x}"
