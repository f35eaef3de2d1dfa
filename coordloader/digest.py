"""Position-weighted, linearly combinable content digests (DESIGN.md, "Content digests").

    digest(T) = sum over elements e of  w(e) * v(bits(e))   mod 2^64

* ``bits(e)`` is the element's raw bit pattern zero-extended to 64 bits (the tensor is
  viewed as the same-width integer type, so -0.0 and +0.0, or two NaN payloads, differ).
* ``v`` is the identity for elements up to 32 bits wide; for 64-bit elements it is the
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
  integer, so the hot loop runs on half as many int64 values (measured ~2x for BF16).
  Detection guarantees survive: a change ``d`` (|d| < 2^(8*width)) of one element moves
  the digest by ``odd * 2^k * d`` with ``k <= 16``, never 0 mod 2^64; swapping the two
  elements of a pair moves it by ``odd * (1 - 2^(8*width)) * d``, odd factor again. The
  price is that odd-column elements only reach the top 48 (2-byte) / 56 (1-byte) bits.

Because the digest is a sum over elements with weights fixed by global position, the
digests of disjoint boxes that tile a tensor add up (mod 2^64) to the whole tensor's digest:
``combine`` is that sum. Everything runs as torch int64 ops on the tensor's own device
(int64 wrapping arithmetic is arithmetic mod 2^64), in bounded chunks.
"""
from __future__ import annotations

import sys
import threading
from math import prod
from typing import Iterator, Sequence

import torch

from .errors import VerifyError
from .metadata import Box, box_shape

MASK64 = (1 << 64) - 1
ALGORITHM = "coordloader-rowcol-splitmix64-v2"  # recorded in manifests; bump if the math changes

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

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ZERO_EXT = {2: 0xFFFF, 4: 0xFFFFFFFF}   # masks undoing sign extension of int16/int32


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
USE_CPU_GEMV = True   # tests switch it off to run the accelerator code path on CPU


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


def _cached(key: tuple, make, length: int) -> torch.Tensor:
    if length > _WEIGHT_MAX_LEN:
        return make()
    w = _WEIGHTS.get(key)
    if w is None:
        if len(_WEIGHTS) >= _WEIGHTS_MAX:
            _WEIGHTS.clear()
        w = _WEIGHTS[key] = make()
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


def release_buffers() -> None:
    """Drop this thread's cached work buffers."""
    _tls.bufs = {}


class _Accumulator:
    """Digest state for one global shape on one device."""

    def __init__(self, global_shape: tuple[int, ...], device: torch.device, chunk: int):
        self.shape = global_shape
        self.C = global_shape[-1]
        lead = global_shape[:-1]
        # stride of each leading dim in units of rows
        self.row_strides = [prod(lead[d + 1:]) for d in range(len(lead))]
        self.device = device
        self.cpu = device.type == "cpu" and USE_CPU_GEMV
        self.chunk = chunk
        self.acc = torch.zeros((), dtype=torch.int64, device=device)

    def _col_weights(self, c0: int, c1: int, width: int) -> torch.Tensor:
        """Weights of global columns [c0, c1) for elements of ``width`` bytes (see
        ``col_weight_py``)."""
        def make():
            idx = torch.arange(c0, c1, dtype=torch.int64, device=self.device)
            if width in PAIRED:
                w = hash_weights(idx >> 1, SEED_COL)
                return torch.where((idx & 1).bool(), w * (1 << (8 * width)), w)
            return hash_weights(idx, SEED_COL)
        return _cached((str(self.device), "col", c0, c1, width in PAIRED and width), make, c1 - c0)

    def _word_weights(self, g0: int, g1: int) -> torch.Tensor:
        return _cached((str(self.device), "word", g0, g1), lambda: hash_weights(
            torch.arange(g0, g1, dtype=torch.int64, device=self.device), SEED_COL), g1 - g0)

    def _row_weights(self, sub: Box) -> torch.Tensor:
        lead = sub[:-1]

        def make():
            ids = torch.zeros((), dtype=torch.int64, device=self.device)
            for (a, b), st in zip(lead, self.row_strides):
                ids = ids.unsqueeze(-1) + torch.arange(a, b, dtype=torch.int64, device=self.device) * st
            return hash_weights(ids.reshape(-1), SEED_ROW)
        return _cached((str(self.device), "row", lead, tuple(self.row_strides)), make,
                       prod(b - a for a, b in lead))

    def _widen(self, bits: torch.Tensor, x: torch.Tensor) -> None:
        """x (int64, shape of bits) <- bits zero-extended (64-bit: mixed, see module doc)."""
        width = bits.element_size()
        uview = _UNSIGNED.get(width)
        if uview is not None and bits.dtype != torch.uint8:
            try:
                # converting from the unsigned view zero-extends: no separate mask pass
                x.copy_(bits.view(uview))
                return
            except (RuntimeError, TypeError):
                pass  # a backend without unsigned copies: sign-extend, then mask
        x.copy_(bits)
        if width in _ZERO_EXT:
            x &= _ZERO_EXT[width]
        elif width == 8:
            t = _work_buffer(self.device, x.numel(), 1)[:x.numel()].view(x.shape)
            torch.bitwise_right_shift(x, 32, out=t)
            t &= 0xFFFFFFFF
            x ^= t

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
                    self._accumulate(word, rw, self._word_weights(a // 2, b // 2))
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


def _int_view(tensor: torch.Tensor) -> torch.Tensor:
    try:
        view = _INT_VIEW[tensor.element_size()]
    except KeyError:
        raise VerifyError(f"cannot digest dtype {tensor.dtype} (element size {tensor.element_size()})") from None
    if tensor.dtype == view:
        return tensor
    if tensor.dim() == 0:
        return tensor.reshape(1).view(view).reshape(())
    return tensor.view(view)


def _default_chunk(device: torch.device) -> int:
    return CPU_CHUNK if device.type == "cpu" else DEVICE_CHUNK


def digest(tensor: torch.Tensor, global_box: Box, global_shape: Sequence[int], *,
           chunk_elems: int | None = None) -> int:
    """Digest of ``tensor`` holding the box ``global_box`` of a tensor of ``global_shape``.

    Returns a uint64 as a Python int. Extra memory is bounded by ``chunk_elems`` int64
    elements (two buffers for 64-bit dtypes) regardless of the tensor's size; the tensor
    may be non-contiguous (a view into a local tensor)."""
    shape, box = _canon(global_shape, global_box)
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if len(box) != len(shape) or any(not (0 <= a <= b <= s) for (a, b), s in zip(box, shape)):
        raise VerifyError(f"digest: box {[list(p) for p in box]} does not fit global shape {list(shape)}")
    if tuple(tensor.shape) != box_shape(box):
        raise VerifyError(f"digest: tensor shape {list(tensor.shape)} != box shape {list(box_shape(box))}")
    bits = _int_view(tensor)
    chunk = int(chunk_elems or _default_chunk(tensor.device))
    acc = _Accumulator(shape, tensor.device, chunk)
    _add_box(acc, bits, box, chunk)
    return acc.value()


def _add_box(acc: _Accumulator, bits: torch.Tensor, box: Box, chunk: int) -> None:
    for sub in iter_subboxes(box, chunk):
        part = bits
        for d, ((a, _), (sa, sb)) in enumerate(zip(box, sub)):
            if sb - sa != part.shape[d]:
                part = part.narrow(d, sa - a, sb - sa)
        acc.add(part, sub)


def digest_local(tensor: torch.Tensor, pieces: Sequence, global_shape: Sequence[int], *,
                 chunk_elems: int | None = None) -> list[int]:
    """Per-piece digests of a rank's local tensor: each ``Piece`` (src box, dst offset) is
    narrowed out of ``tensor`` at its destination offset and digested at its source box."""
    out = []
    for i, p in enumerate(pieces):
        view = tensor
        if tensor.dim() == 0:
            out.append(digest(tensor, p.src, global_shape, chunk_elems=chunk_elems))
            continue
        if len(p.src) != tensor.dim() or len(p.dst) != tensor.dim():
            raise VerifyError(f"piece {i}: rank {len(p.src)} box does not match local tensor rank {tensor.dim()}")
        for d, ((a, b), o) in enumerate(zip(p.src, p.dst)):
            if o < 0 or o + (b - a) > tensor.shape[d]:
                raise VerifyError(f"piece {i}: destination [{o}, {o + b - a}) of dim {d} is outside the "
                                  f"local tensor of shape {list(tensor.shape)}")
            view = view.narrow(d, o, b - a)
        out.append(digest(view, p.src, global_shape, chunk_elems=chunk_elems))
    return out


def combine(digests) -> int:
    """Digest of the union of disjoint boxes: the sum of their digests mod 2^64."""
    return sum(int(d) for d in digests) & MASK64


def fmt(d: int) -> str:
    """Canonical text form (manifests, reports)."""
    return f"{int(d) & MASK64:016x}"
