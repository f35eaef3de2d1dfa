"""The digest's definition: what a digest is, independent of how a route computes it.

    digest(T) = sum over elements e of  w(e) * v(bits(e))   mod 2^64

* ``bits(e)`` is the element's raw bit pattern (the tensor is viewed as the same-width
  integer type, so -0.0 and +0.0, or two NaN payloads, differ).
* ``v`` maps the bits to an integer, one-to-one. For elements of 1, 2 or 4 bytes it reads
  each little-endian byte as a *signed* byte: ``v(u) = sum_k s_k * 256^k`` with ``s_k`` the
  k-th byte in [-128, 127], i.e. ``v(u) = u - 2 * (u & 0x80...80)``. That is what an int8
  matrix product computes from the data as it lies in memory, so the CPU path digests a
  tensor without copying or re-biasing it (see "CPU fast path"). ``v`` is injective (a
  balanced base-256 number is zero only when every digit is), and ``|v(u)| < 2^(8*width)``,
  so the arguments below hold as for the raw bits.
* 8-byte elements (F64, I64, U64) are digested as their two 32-bit halves: the tensor of
  last dim ``C`` is read as the 4-byte tensor of last dim ``2C`` holding each element's low
  half (of its value, whatever the machine's byte order) at column ``2c`` and its high half
  at ``2c + 1``, and digested as that one. No one-to-one ``v`` over all 64 bits can be
  used: some change moves it by 2^63, and ``w * 2^63 = 2^63`` mod 2^64 for every odd
  ``w``, so two such changes anywhere cancel out (with ``v = x ^ (x >>> 32)``, flipping
  bits 63 and 31 of any two elements did: two near sign flips of F64 values).
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
of every width (8-byte ones as their halves) take an exact int8 matrix-product route to
the same value (see "CPU fast path" in ``routes``; ``digest_many`` batches a rank's
pieces through it).
"""
from __future__ import annotations

from math import prod
from typing import Iterator, Sequence

import torch

from coordloader.checkpoint.metadata import Box

MASK64 = (1 << 64) - 1
# recorded in manifests; bump if the math changes (v3: signed-byte element values; v4:
# 8-byte elements as their 4-byte halves)
ALGORITHM = "coordloader-rowcol-splitmix64-v4"

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
PAIRED = (1, 2)                              # element widths digested in column pairs


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



def col_weight_py(c: int, width: int) -> int:
    """Pure-Python reference of the column weight of global column ``c``."""
    if width in PAIRED:
        return (hash_weight_py(c >> 1, SEED_COL) << (8 * width * (c & 1))) & MASK64
    return hash_weight_py(c, SEED_COL)



def combine(digests) -> int:
    """Digest of the union of disjoint boxes: the sum of their digests mod 2^64."""
    return sum(int(d) for d in digests) & MASK64


def fmt(d: int) -> str:
    """Canonical text form (manifests, reports)."""
    return f"{int(d) & MASK64:016x}"
