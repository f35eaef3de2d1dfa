"""The torch routes: widen to int64 and gemv (CPU) or multiply and sum (accelerators), and
the CPU's int8-product fast path. Every route computes the digest of ``definition``."""
from __future__ import annotations

import sys
import threading
from math import prod
from typing import Sequence

import torch

from coordloader.checkpoint.dtypes import _BITS_VIEW
from coordloader.checkpoint.metadata import Box, box_shape
from coordloader.errors import VerifyError
from coordloader.verify.digest.definition import (
    _SIGN_BITS,
    _ZERO_EXT,
    CPU_CHUNK,
    DEVICE_CHUNK,
    MASK64,
    PAIRED,
    SEED_COL,
    SEED_ROW,
    _canon,
    hash_weights,
    iter_subboxes,
)

_UNSIGNED = {w: getattr(torch, n, None) for w, n in ((1, "uint8"), (2, "uint16"), (4, "uint32"))}
_WORD = {1: torch.int16, 2: torch.int32}     # the pair's word (widened like any element)
_LITTLE = sys.byteorder == "little"
_tls = threading.local()



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


def int_view(tensor: torch.Tensor) -> torch.Tensor:
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


def _has_data(t: torch.Tensor) -> bool:
    """Whether a CPU tensor's data pointer points at memory: a wrapper tensor subclass (a
    float8 or quantized training weight, a DTensor) has no storage and reports 0, and
    reading its elements there is a read of address 0."""
    try:
        return t.data_ptr() != 0
    except Exception:  # noqa: BLE001 — a subclass that refuses data_ptr has no data either
        return False


def no_data(t: torch.Tensor) -> str:
    return (f"cannot digest a {type(t).__name__} of shape {list(t.shape)}: it holds no data of its "
            f"own (a wrapper tensor subclass); digests cover plain strided tensors of "
            f"checkpoint dtypes")


def _prepare(tensor: torch.Tensor, global_box: Box, global_shape: Sequence[int]):
    """Validate one digest request -> (global shape, box, the data (0-d as 1-d)). The
    integer view is taken by the routes that need one (``int_view``); the kernel reads
    raw bytes."""
    shape, box = _canon(global_shape, global_box)
    if tensor.layout != torch.strided or tensor.is_quantized:
        kind = "quantized" if tensor.is_quantized else str(tensor.layout)
        raise VerifyError(f"cannot digest a {kind} tensor ({tensor.dtype}): digests cover "
                          "plain strided tensors of checkpoint dtypes")
    if tensor.device.type == "cpu" and tensor.numel() and not _has_data(tensor):
        raise VerifyError(no_data(tensor))
    if tensor.is_conj() or tensor.is_neg():
        # lazy conjugate/negative views: their memory holds the un-negated bits
        tensor = tensor.resolve_conj().resolve_neg()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if len(box) != len(shape) or any(not (0 <= a <= b <= s) for (a, b), s in zip(box, shape)):
        raise VerifyError(f"digest: box {[list(p) for p in box]} does not fit global shape {list(shape)}")
    if tensor.shape != tuple(b - a for a, b in box):
        raise VerifyError(f"digest: tensor shape {list(tensor.shape)} != box shape {list(box_shape(box))}")
    if tensor.element_size() == 8:
        shape, box, tensor = _halves(shape, box, tensor)
    return shape, box, tensor


def _halves(shape: tuple[int, ...], box: Box, tensor: torch.Tensor):
    """An 8-byte tensor as its 32-bit halves (``definition``): the 4-byte tensor of last dim
    2C holding each element's low half at column 2c and its high half at 2c + 1."""
    halves = int_view(_packed_columns(tensor)).view(torch.int32)
    if not _LITTLE:   # memory holds the high half first: the definition reads numbers
        halves = halves.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    (a, b) = box[-1]
    return shape[:-1] + (2 * shape[-1],), box[:-1] + ((2 * a, 2 * b),), halves



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
# 8-byte elements take it as their 4-byte halves (``_prepare``); accelerators and
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


def _packed_columns(t: torch.Tensor) -> torch.Tensor:
    """``t`` with stride 1 along its last dim, as a view as narrower elements needs (a copy
    only when its columns are apart)."""
    if t.stride(-1) == 1:
        return t
    # a last dim of size 1 may have any stride, which contiguous() keeps (the tensor counts
    # as contiguous); its one column is at offset 0 whatever the stride says
    return (t.as_strided(t.shape, t.stride()[:-1] + (1,), t.storage_offset())
            if t.shape[-1] <= 1 else t.contiguous())


def _as_bytes(part: torch.Tensor) -> torch.Tensor:
    """``part`` (integer view) as int8 with the last dim in bytes (a view when it can be)."""
    return part if part.dtype == torch.int8 else _packed_columns(part).view(torch.int8)


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
