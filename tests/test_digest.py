"""Content digests: linearity over exact partitions, sensitivity to changes, swaps and
shifts, chunking invariance, and agreement with a pure-Python reference."""
from __future__ import annotations

import warnings
from math import prod

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coordloader.checkpoint.metadata import box_numel, full_box
from coordloader.errors import VerifyError
from coordloader.planning.model import Piece
from coordloader.verify.digest import (
    MASK64,
    SEED_ROW,
    Route,
    col_weight_py,
    combine,
    digest,
    digest_local,
    flat_offset,
    hash_weight_py,
    hash_weights,
    iter_subboxes,
)

# (torch dtype, bytes per element); bool only takes 0/1 bytes
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.float8_e8m0fnu,
          torch.complex64]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SETTINGS = settings(deadline=None, max_examples=60,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _size(dt):
    return torch.empty((), dtype=dt).element_size()


def make_tensor(raw: bytes, shape, dt) -> torch.Tensor:
    if dt == torch.bool:
        raw = bytes(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=_INT[_size(dt)]).clone()
    return t.view(dt).reshape(shape)


def set_bits(t: torch.Tensor, flat_index: int, value: int) -> torch.Tensor:
    """Copy of ``t`` with element ``flat_index`` set to the raw bit pattern ``value``."""
    out = t.clone()
    iv = out.view(_INT[out.element_size()]).reshape(-1)
    w = out.element_size() * 8
    v = value & ((1 << w) - 1)
    if v >= 1 << (w - 1) and iv.dtype != torch.uint8:
        v -= 1 << w
    iv[flat_index] = v
    return out


def bits_of(t: torch.Tensor) -> list[int]:
    w = t.element_size() * 8
    return [x & ((1 << w) - 1) for x in t.reshape(-1).view(_INT[t.element_size()]).tolist()]


@st.composite
def tensors(draw, max_dims=3, max_side=6):
    nd = draw(st.integers(1, max_dims))
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=nd, max_size=nd)))
    dt = draw(st.sampled_from(DTYPES))
    raw = draw(st.binary(min_size=prod(shape) * _size(dt), max_size=prod(shape) * _size(dt)))
    return make_tensor(raw, shape, dt)


@st.composite
def partitions(draw, box, depth=3):
    """A random exact partition of ``box`` into sub-boxes (guillotine cuts)."""
    splittable = [d for d, (a, b) in enumerate(box) if b - a > 1]
    if depth == 0 or not splittable or draw(st.integers(0, 3)) == 0:
        return [box]
    d = draw(st.sampled_from(splittable))
    a, b = box[d]
    cut = draw(st.integers(a + 1, b - 1))
    left = box[:d] + ((a, cut),) + box[d + 1:]
    right = box[:d] + ((cut, b),) + box[d + 1:]
    return draw(partitions(left, depth - 1)) + draw(partitions(right, depth - 1))


def sub(t, box):
    for d, (a, b) in enumerate(box):
        t = t.narrow(d, a, b - a)
    return t


def piece_sum(t, parts, chunk=None):
    return combine(digest(sub(t, p), p, t.shape, chunk_elems=chunk) for p in parts)


def reference(t: torch.Tensor) -> int:
    """The documented definition, in plain Python: 8-byte elements as their 32-bit halves,
    the low half at column 2c, the high half at 2c + 1 of a last dim twice as long."""
    width = t.element_size()
    bits = bits_of(t.contiguous())
    C = (tuple(t.shape) or (1,))[-1]
    if width == 8:
        width, C = 4, 2 * C
        bits = [h for u in bits for h in (u & 0xFFFFFFFF, u >> 32)]
    tot = 0
    for i, u in enumerate(bits):
        v = u - 2 * (u & int.from_bytes(b"\x80" * width, "little"))
        tot += hash_weight_py(i // C, SEED_ROW) * col_weight_py(i % C, width) * v
    return tot & MASK64


def reference_box(t: torch.Tensor, box) -> int:
    """The definition for the elements of ``box`` of the global tensor ``t``: v(0) = 0, so
    that is the digest of ``t`` with everything outside ``box`` zeroed."""
    z = torch.zeros_like(t)
    sub(z, box).copy_(sub(t, box))
    return reference(z)


def test_hash_matches_python_reference():
    idx = torch.tensor([0, 1, 2, 12345, 2**40 + 7, 2**62], dtype=torch.int64)
    got = [x & MASK64 for x in hash_weights(idx, SEED_ROW).tolist()]
    assert got == [hash_weight_py(int(i), SEED_ROW) for i in idx]
    assert all(g & 1 for g in got)


@SETTINGS
@given(tensors(max_side=5))
def test_matches_reference(t):
    assert digest(t, full_box(tuple(t.shape)), tuple(t.shape)) == reference(t)


@SETTINGS
@given(st.data())
def test_partition_sums_to_whole_and_chunking_invariant(data):
    t = data.draw(tensors())
    whole = digest(t, full_box(tuple(t.shape)), tuple(t.shape))
    parts = data.draw(partitions(full_box(tuple(t.shape))))
    assert sum(box_numel(p) for p in parts) == t.numel()
    chunk = data.draw(st.integers(1, max(1, t.numel())))
    assert piece_sum(t, parts) == whole
    assert piece_sum(t, parts, chunk) == whole
    assert digest(t, full_box(tuple(t.shape)), tuple(t.shape), chunk_elems=chunk) == whole


@SETTINGS
@given(st.data())
def test_single_element_change_detected(data):
    t = data.draw(tensors())
    parts = data.draw(partitions(full_box(tuple(t.shape))))
    before = piece_sum(t, parts)
    i = data.draw(st.integers(0, t.numel() - 1))
    w = t.element_size() * 8
    old = bits_of(t)[i]
    new = data.draw(st.integers(0, 1 if t.dtype == torch.bool else (1 << w) - 1))
    assume(new != old)
    assert piece_sum(set_bits(t, i, new), parts) != before


@SETTINGS
@given(st.data())
def test_swap_of_unequal_elements_detected(data):
    t = data.draw(tensors())
    assume(t.numel() >= 2)
    parts = data.draw(partitions(full_box(tuple(t.shape))))
    i = data.draw(st.integers(0, t.numel() - 1))
    j = data.draw(st.integers(0, t.numel() - 1))
    b = bits_of(t)
    assume(i != j and b[i] != b[j])
    swapped = set_bits(set_bits(t, i, b[j]), j, b[i])
    assert piece_sum(swapped, parts) != piece_sum(t, parts)


def test_sign_of_zero_swaps_in_64_bit_types_are_detected():
    # +0.0/-0.0 differ by 2^63 in F64: odd weights alone would cancel that out.
    for dt in (torch.float64, torch.int64, torch.uint64):
        t = torch.zeros(2, 3, dtype=torch.int64)
        t[0, 1] = -(2**63)
        t = t.view(dt)
        s = t.clone().view(torch.int64)
        s[0, 1], s[1, 2] = 0, -(2**63)
        assert digest(t, full_box((2, 3)), (2, 3)) != digest(s.view(dt), full_box((2, 3)), (2, 3))


@SETTINGS
@given(st.data())
def test_shifted_piece_detected(data):
    t = data.draw(tensors())
    shape = tuple(t.shape)
    parts = data.draw(partitions(full_box(shape)))
    k = data.draw(st.integers(0, len(parts) - 1))
    p = parts[k]
    shifts = [(d, s) for d, (a, b) in enumerate(p) for s in (-1, 1) if 0 <= a + s and b + s <= shape[d]]
    assume(shifts)
    d, s = data.draw(st.sampled_from(shifts))
    piece_data = sub(t, p)
    assume(any(bits_of(piece_data)))   # an all-zero piece reads the same anywhere
    moved = p[:d] + ((p[d][0] + s, p[d][1] + s),) + p[d + 1:]
    # The rank holds the right bytes but claims (or was given) the wrong box.
    assert digest(piece_data, moved, shape) != digest(piece_data, p, shape)
    total = combine([digest(sub(t, q), q, shape) for j, q in enumerate(parts) if j != k]
                    + [digest(piece_data, moved, shape)])
    assert total != piece_sum(t, parts)


@SETTINGS
@given(st.data())
def test_iter_subboxes_tile_contiguously(data):
    nd = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd)))
    box = full_box(shape)
    budget = data.draw(st.integers(1, prod(shape) + 2))
    subs = list(iter_subboxes(box, budget))
    offs = [flat_offset(box, s) for s in subs]
    # consecutive, contiguous, within budget
    pos = 0
    for s, o in zip(subs, offs):
        assert o == pos and box_numel(s) <= budget
        pos += box_numel(s)
    assert pos == prod(shape)


def test_digest_local_pieces_and_non_contiguous_views():
    g = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    whole = digest(g, full_box((8, 6)), (8, 6))
    # a "packed" local tensor: rows 0-1 and 4-5 of the global tensor concatenated on dim 1
    local = torch.cat([g[0:2], g[4:6]], dim=1)
    pieces = [Piece(((0, 2), (0, 6)), (0, 0)), Piece(((4, 6), (0, 6)), (0, 6))]
    ds = digest_local(local, pieces, (8, 6))
    assert ds[0] == digest(g[0:2], ((0, 2), (0, 6)), (8, 6))
    assert ds[1] == digest(g[4:6], ((4, 6), (0, 6)), (8, 6))
    rest = [((2, 4), (0, 6)), ((6, 8), (0, 6))]
    assert combine(ds + [digest(sub(g, b), b, (8, 6)) for b in rest]) == whole
    # column slices (non-contiguous views) sum up too, at any chunk size
    cols = [((0, 8), (0, 1)), ((0, 8), (1, 4)), ((0, 8), (4, 6))]
    for chunk in (1, 5, None):
        assert combine(digest(sub(g, b), b, (8, 6), chunk_elems=chunk) for b in cols) == whole


def test_zero_dim_and_empty():
    s = torch.tensor(3.5)
    assert digest(s, (), ()) == digest(s.reshape(1), ((0, 1),), (1,)) != 0
    e = torch.empty(0, 4)
    assert digest(e, ((0, 0), (0, 4)), (0, 4)) == 0


def test_bad_boxes_are_typed_errors():
    t = torch.zeros(2, 3)
    with pytest.raises(VerifyError, match="box shape"):
        digest(t, ((0, 2), (0, 2)), (2, 3))
    with pytest.raises(VerifyError, match="does not fit"):
        digest(t, ((1, 3), (0, 3)), (2, 3))
    with pytest.raises(VerifyError, match="outside the local tensor"):
        digest_local(t, [Piece(((0, 2), (0, 3)), (1, 0))], (4, 3))


def test_position_matters_not_just_content():
    g = torch.randn(4, 4).to(torch.bfloat16)
    a = digest(g[0:2], ((0, 2), (0, 4)), (4, 4))
    b = digest(g[0:2], ((2, 4), (0, 4)), (4, 4))
    c = digest(g[0:2].clone(), ((0, 2), (0, 4)), (4, 4))
    assert a != b and a == c
    # the same box in a tensor of a different shape has different weights
    assert digest(g, full_box((4, 4)), (4, 4)) != digest(g.reshape(2, 8), full_box((2, 8)), (2, 8))


def use_route(monkeypatch, route: str):
    """The digest Route for one of the test's route names (passed as ``route=`` to every
    digest call): the compiled kernel, the int8 product (in place or stacked: the size
    threshold decides), the int64 gemv, the accelerator mul+sum, or that with the
    sign-extend+mask fallback (backends without unsigned copies). Installs the route's
    call-counting spy."""
    dgm = _dgm()
    if route == "kernel":
        if dgm.kernel._kernel is None:
            pytest.skip("the digest kernel is not built (no C compiler at install time)")
        assert dgm.kernel_available(forced=True)   # (runs the self-test once, before the spy)
        monkeypatch.setattr(dgm.kernel, "_kernel", _KernelSpy(dgm.kernel._kernel))
        return dgm.Route.KERNEL
    if route in ("in_place", "stacked"):
        assert dgm.int8_mm_available()
        monkeypatch.setattr(dgm.routes, "MM_DIRECT_BYTES", 0 if route == "in_place" else 1 << 60)
        name = "_mm_direct" if route == "in_place" else "_mm_batch"
        monkeypatch.setattr(dgm.routes, name, _CallSpy(getattr(dgm.routes, name)))
        return dgm.Route.INT8
    if route == "gemv":
        return dgm.Route.INT64
    if route == "mask":
        monkeypatch.setattr(dgm.routes, "_UNSIGNED", {})
    return dgm.Route.ELEMENTWISE


class _CallSpy:
    """A route's workhorse, counting its calls: a route test must reach its route."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


class _KernelSpy:
    def __init__(self, kernel):
        self.rows = _CallSpy(kernel.rows)


def route_calls(route: str) -> int:
    """Calls that reached ``route``'s spy (use_route installs it); 1 for routes without
    one."""
    dgm = _dgm()
    spy = {"kernel": lambda: dgm.kernel._kernel.rows, "in_place": lambda: dgm.routes._mm_direct,
           "stacked": lambda: dgm.routes._mm_batch}.get(route)
    return spy().calls if spy else 1


def test_kernel_splits_long_boxes_and_takes_views_as_they_read(monkeypatch):
    """Boxes with more rows or columns than KERNEL_MAX_WEIGHTS are digested in sub-boxes
    (bounded weight vectors), with the same digest; conjugate and negative views digest
    as the values they present (the kernel never reads their raw memory); quantized
    tensors are refused by name."""
    r = use_route(monkeypatch, "kernel")
    dgm = _dgm()
    monkeypatch.setattr(dgm.kernel, "KERNEL_MAX_WEIGHTS", 16)
    g = torch.Generator().manual_seed(17)
    for shape, parts in (((100, 3), 7), ((3, 100), 7), ((5, 7, 9), 21)):
        t = (torch.randn(*shape, generator=g) * 100).to(torch.bfloat16)
        before = route_calls("kernel")
        assert digest(t, full_box(shape), shape, route=r) == reference(t)
        assert route_calls("kernel") - before >= parts     # sub-boxes of <= 16 elements
    c = torch.randn(4, 6, generator=g, dtype=torch.complex64)
    box = full_box((4, 6))
    assert digest(c.conj(), box, (4, 6), route=r) \
        == digest(c.conj().resolve_conj(), box, (4, 6), route=r) != digest(c, box, (4, 6), route=r)
    neg = c.conj().imag          # a lazy negative view
    assert neg.is_neg()
    assert digest(neg, box, (4, 6), route=r) == digest(neg.resolve_neg(), box, (4, 6), route=r)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # quantized tensors are deprecated in torch
        q = torch.quantize_per_tensor(torch.randn(2, 3), 0.1, 0, torch.qint8)
    with pytest.raises(VerifyError, match=r"cannot digest a quantized tensor \(torch.qint8\)"):
        digest(q, full_box((2, 3)), (2, 3), route=r)


@pytest.mark.parametrize("route", ["kernel", "in_place", "stacked", "gemv", "mul_sum", "mask"])
def test_code_paths_agree(monkeypatch, route):
    """Every route computes the digest of the Python reference, for every element width."""
    r = use_route(monkeypatch, route)
    g = torch.Generator().manual_seed(3)
    for dt in (torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int16):
        t = (torch.randn(5, 7, 3, generator=g) * 1000).to(dt)
        assert digest(t, full_box((5, 7, 3)), (5, 7, 3), chunk_elems=4, route=r) == reference(t)
        # a narrowed middle dim: leading strides that are not one row apart
        v = t[:, 2:6]
        box = ((0, 5), (2, 6), (0, 3))
        assert digest(v, box, (5, 7, 3), route=r) == reference_box(t, box)
        # an even column range in rows an odd number of elements apart (BF16 pairs as
        # words on unaligned addresses)
        u = (torch.randn(4, 9, generator=g) * 1000).to(dt)
        assert digest(u[:, 2:8], ((0, 4), (2, 8)), (4, 9), route=r) \
            == reference_box(u, ((0, 4), (2, 8)))
    assert route_calls(route) > 0


def test_kernel_is_built_where_a_compiler_is():
    """pip install builds the kernel wherever a C compiler exists; a silent fallback would
    cost 2-3x in every --verify digest."""
    import shutil
    import sysconfig
    if not (shutil.which(sysconfig.get_config_var("CC") or "cc") or shutil.which("cc")):
        pytest.skip("no C compiler: the kernel is optional")
    assert _dgm().kernel._kernel is not None, "the digest kernel is not built: pip install -e ."


def test_a_kernel_that_fails_its_self_test_is_not_used(monkeypatch):
    """A kernel build that disagrees with the torch digest (a miscompiled variant for this
    CPU) is caught by the self-test on first use: a warning, and the torch routes digest."""
    dgm = _dgm()
    if dgm.kernel._kernel is None:
        pytest.skip("the digest kernel is not built")

    class OffByOne:
        def rows(self, *a):
            return (dgm.kernel._kernel_real.rows(*a) + 1) & MASK64

    monkeypatch.setattr(dgm.kernel, "_kernel_real", dgm.kernel._kernel, raising=False)
    monkeypatch.setattr(dgm.kernel, "_kernel", OffByOne())
    monkeypatch.setattr(dgm.kernel, "_kernel_ok", None)
    monkeypatch.setattr(dgm.kernel, "KERNEL_BY_DEFAULT", True)
    with pytest.warns(RuntimeWarning, match="self-test .it disagrees with the torch digest on "
                                            "torch.int8 box"):
        assert not dgm.kernel_available()
    t = (torch.randn(4, 6) * 100).to(torch.bfloat16)
    assert digest(t, full_box((4, 6)), (4, 6)) == reference(t)   # not off by one
    monkeypatch.setattr(dgm.kernel, "_kernel", dgm.kernel._kernel_real)
    monkeypatch.setattr(dgm.kernel, "_kernel_ok", None)
    assert dgm.kernel_available()                                 # the real one passes


def test_kernel_refuses_bad_arguments():
    dgm = _dgm()
    if dgm.kernel._kernel is None:
        pytest.skip("the digest kernel is not built")
    w = torch.ones(4, dtype=torch.int64)
    t = torch.zeros(2, 4, dtype=torch.int32)
    rows = dgm.kernel._kernel.rows
    assert rows(t.data_ptr(), 4, (2, 4), (16,), w.data_ptr(), w.data_ptr()) == 0
    # sum_r roww[r] * sum_c colw[c] * v(x[r, c]), v = signed little-endian bytes, mod 2^64
    x = torch.tensor([[1, -1, 0x7F80, 5], [0x01020304, -2**31, 7, 0]], dtype=torch.int32)
    colw = torch.tensor([1, 2, 3, -1], dtype=torch.int64)
    roww = torch.tensor([5, -3], dtype=torch.int64)

    def v(u):
        u &= 0xFFFFFFFF
        return sum(((((u >> 8 * k) & 255) ^ 128) - 128) << 8 * k for k in range(4))
    want = sum(int(roww[r]) * int(colw[c]) * v(int(x[r, c])) for r in range(2) for c in range(4))
    assert rows(x.data_ptr(), 4, (2, 4), (16,), colw.data_ptr(), roww.data_ptr()) == want & MASK64
    # the second row alone: one leading dim of extent 1, and no leading dims at all
    assert rows(x[1].data_ptr(), 4, (1, 4), (16,), colw.data_ptr(), roww[1:].data_ptr()) == \
        rows(x[1].data_ptr(), 4, (4,), (), colw.data_ptr(), roww[1:].data_ptr())
    for width in (3, 8):   # 8-byte elements come as their 4-byte halves
        with pytest.raises(ValueError, match=f"width {width} is not 1, 2 or 4"):
            rows(t.data_ptr(), width, (2, 4), (16,), w.data_ptr(), w.data_ptr())
    with pytest.raises(ValueError, match="one stride per leading dim"):
        rows(t.data_ptr(), 4, (2, 4), (), w.data_ptr(), w.data_ptr())
    with pytest.raises(ValueError, match="more than 64 dims"):
        rows(t.data_ptr(), 4, (1,) * 65, (0,) * 64, w.data_ptr(), w.data_ptr())
    with pytest.raises(ValueError, match="negative size"):
        rows(t.data_ptr(), 4, (-1, 4), (16,), w.data_ptr(), w.data_ptr())


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_column_pairs_with_ragged_edges(dt):
    """Narrow dtypes go through the paired-word path; boxes starting or ending on an odd
    column mix word and element paths. Every column split must still add up, for
    contiguous and strided (narrowed) inputs alike."""
    g = torch.Generator().manual_seed(5)
    full = (torch.randn(6, 10, generator=g) * 50).to(dt)
    whole = reference(full)
    assert digest(full, full_box((6, 10)), (6, 10)) == whole
    for cuts in ([0, 1, 10], [0, 3, 4, 10], [0, 2, 7, 10], [0, 5, 6, 9, 10]):
        boxes = [((0, 6), (a, b)) for a, b in zip(cuts, cuts[1:])]
        for chunk in (None, 3):
            strided = combine(digest(sub(full, b), b, (6, 10), chunk_elems=chunk) for b in boxes)
            packed = combine(digest(sub(full, b).contiguous(), b, (6, 10), chunk_elems=chunk)
                             for b in boxes)
            assert strided == packed == whole, (cuts, chunk)


def _dgm():
    from coordloader.verify import digest as dgm
    return dgm


def test_balanced_limbs_reconstruct_mod_2_64():
    dgm = _dgm()
    g = torch.Generator().manual_seed(11)
    v = torch.cat([torch.randint(-2**63, 2**63 - 1, (2000,), dtype=torch.int64, generator=g),
                   torch.tensor([0, 1, -1, 127, 128, -128, -129, 2**63 - 1, -2**63,
                                 2**63 - 128, -2**63 + 127], dtype=torch.int64)])
    t = dgm.routes.balanced_limbs(v)
    assert t.dtype == torch.int8
    back = sum(t[:, l].to(torch.int64) << (8 * l) for l in range(8))
    assert torch.equal(back, v)


# parts go into the int8 product in place (a strided view of the data) at or above
# MM_DIRECT_BYTES, stacked into a copy below it; the compiled kernel reads them in place
ROUTES = pytest.mark.parametrize("route", ["kernel", "in_place", "stacked"])


@ROUTES
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x80, 0x7F])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32, torch.uint8])
def test_extreme_bytes(monkeypatch, route, fill, dt):
    """Every byte at an extreme of the signed/unsigned range (the int32 sums' worst case),
    on rows wider than one product (split into column blocks)."""
    r = use_route(monkeypatch, route)
    dgm = _dgm()
    # an odd column count (elementwise on the kernel) and an even one across the kernel's
    # 1024-column blocks (BF16/FP8 pairs as words)
    for n in (dgm.routes.MM_ROW_BYTES // _size(dt) * 2 + 3, 2 * 1024 + 6):
        t = torch.full((3, n * _size(dt)), fill, dtype=torch.uint8).view(dt)
        assert digest(t, ((0, 3), (0, n)), (3, n), route=r) == reference(t)
        part = t[:, 2:n - 2]   # an even column range of rows an odd number of elements apart
        assert digest(part, ((0, 3), (2, n - 2)), (3, n), route=r) \
            == reference_box(t, ((0, 3), (2, n - 2)))
    assert route_calls(route) > 0


@ROUTES
def test_digest_many_matches_digest_and_reports_errors(monkeypatch, route):
    """Batched digests (stacked products or in place, threads, column blocks) equal
    one-by-one digests of the int64 path; a bad item yields its error without spoiling
    the others."""
    r = use_route(monkeypatch, route)
    dgm = _dgm()
    monkeypatch.setattr(dgm.routes, "MM_ROW_BYTES", 64)        # force column blocks
    monkeypatch.setattr(dgm.routes, "MM_BATCH_BYTES", 512)     # force several batches
    g = torch.Generator().manual_seed(7)
    items = []
    for i in range(40):
        dt = [torch.bfloat16, torch.float32, torch.int8, torch.float64][i % 4]
        t = (torch.randn(6, 50, generator=g) * 100).to(dt)
        items.append((t[:3], ((0, 3), (0, 50)), (6, 50)))
        items.append((t[:, 7:41], ((0, 6), (7, 41)), (6, 50)))
        items.append((t[2], ((2, 3), (0, 50)), (6, 50))) if i == 0 else None
    items = [it for it in items if it is not None]
    items[0:0] = [(torch.zeros(2, 2), ((0, 3), (0, 2)), (4, 2))]     # shape != box
    want = [digest(t.unsqueeze(0) if t.dim() == 1 else t, b, s, route=dgm.Route.INT64)
            for t, b, s in items[1:]]
    items = [(t.unsqueeze(0) if t.dim() == 1 else t, b, s) for t, b, s in items]
    for threads in (1, 3):
        got = dgm.digest_many(items, threads=threads, return_errors=True, route=r)
        assert isinstance(got[0], VerifyError)
        assert got[1:] == want
    with pytest.raises(VerifyError):
        dgm.digest_many(items, route=r)
    assert route_calls(route) > 0


@ROUTES
def test_views_with_overlapping_or_broadcast_rows(monkeypatch, route):
    """Expanded (stride-0) and transposed views digest like their contiguous copies on
    every route: the in-place int8 product must not be handed rows that overlap (oneDNN
    read a stride-0 matrix wrongly), against the Python reference."""
    r = use_route(monkeypatch, route)
    g = torch.Generator().manual_seed(13)
    views = [
        (torch.randn(1, 96, generator=g) * 50).to(torch.bfloat16).expand(40, 96),
        (torch.randn(7, 1, generator=g) * 50).to(torch.float32).expand(7, 33),
        (torch.randn(30, 20, generator=g) * 50).to(torch.bfloat16).t(),
        (torch.randn(5, 4, 24, generator=g) * 50).to(torch.float16)[:, 1],
    ]
    for v in views:
        box, shape = full_box(tuple(v.shape)), tuple(v.shape)
        got = digest(v, box, shape, route=r)
        assert got == digest(v.contiguous(), box, shape, route=r) == reference(v.contiguous())
    assert route_calls(route) > 0


@pytest.mark.parametrize("route", [r for r in Route if r is not Route.AUTO], ids=lambda r: r.name)
@pytest.mark.parametrize("dt", [torch.float16, torch.int32, torch.float64, torch.uint8],
                         ids=str)
def test_a_size_one_last_dim_of_any_stride_digests_like_its_copy(route, dt):
    """A [3, 1] view with stride (1, 3) (a transposed row) and a 1-element view with stride
    2 count as contiguous, so contiguous() kept them as they were and the int8 route's
    view as bytes raised torch's bare RuntimeError: a correct load_into reported corrupt."""
    base = torch.arange(1, 4).to(dt)
    col = torch.zeros(1, 3, dtype=dt)
    col[0] = base
    one = torch.zeros(2, dtype=dt)
    one[0] = base[1]
    for view, box, shape in ((col.t(), ((0, 3), (0, 1)), (3, 1)), (one[::2], ((1, 2),), (3,))):
        assert view.is_contiguous() and view.stride(-1) != 1
        assert digest(view, box, shape, route=route) == digest(view.clone(), box, shape), view


@pytest.mark.parametrize("route", list(Route), ids=lambda r: r.name)
def test_a_wrapper_subclass_without_storage_is_refused_not_read_at_address_0(route):
    """A wrapper tensor subclass (torch's TwoTensor here; torchao's float8 training
    weights, a DTensor) has no storage: data_ptr() is 0. The kernel read its elements at
    address 0 and the process died with SIGSEGV (coordloader.save, load_into's verify)."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    a = torch.randn(4, 8)
    t = two_tensor.TwoTensor(a, a.clone())
    assert t.data_ptr() == 0
    if route is Route.KERNEL and _dgm().kernel._kernel is None:
        pytest.skip("the digest kernel is not built")
    with pytest.raises(VerifyError) as e:
        digest(t, full_box((4, 8)), (4, 8), route=route)
    assert str(e.value) == ("cannot digest a TwoTensor of shape [4, 8]: it holds no data of its "
                            "own (a wrapper tensor subclass); digests cover plain strided "
                            "tensors of checkpoint dtypes")
    # the kernel's own call refuses a null pointer too, whoever prepared the tensor
    if _dgm().kernel._kernel is not None:
        with pytest.raises(VerifyError, match="cannot digest a TwoTensor of shape"):
            _dgm().kernel._kernel_one((4, 8), full_box((4, 8)), t)
    # an empty one holds nothing to read: digest 0, as any empty tensor
    e0 = two_tensor.TwoTensor(torch.empty(0, 8), torch.empty(0, 8))
    assert digest(e0, ((0, 0), (0, 8)), (0, 8), route=route) == 0


@pytest.mark.parametrize("route", list(Route), ids=lambda r: r.name)
@pytest.mark.parametrize("dt", [torch.float64, torch.int64, torch.uint64], ids=str)
def test_two_8_byte_elements_flipped_in_bits_63_and_31_change_the_digest(route, dt):
    """8-byte elements were valued x ^ (x >>> 32): flipping bits 63 and 31 of an element
    moved that by exactly 2^63, and w * 2^63 = 2^63 mod 2^64 for every odd weight, so two
    such changes anywhere (two near sign flips of F64 values, on one rank or two) left
    the digest as it was. Each 32-bit half now has a weight of its own."""
    g = torch.Generator().manual_seed(7)
    t = torch.randint(-2**62, 2**62, (6, 5), dtype=torch.int64, generator=g).view(dt)
    box, shape = full_box((6, 5)), (6, 5)
    bad = t.clone().view(torch.int64)
    flip = torch.tensor(-0x7FFFFFFF80000000, dtype=torch.int64)   # bits 63 and 31
    bad[0, 1] ^= flip
    bad[4, 3] ^= flip
    assert digest(bad.view(dt), box, shape, route=route) != digest(t, box, shape, route=route)
    # and a sign flip of two F64 values, the case the x ^ (x >>> 32) mix was for
    neg = t.clone().view(torch.int64)
    neg[2, 2] ^= torch.tensor(-2**63, dtype=torch.int64)
    neg[5, 0] ^= torch.tensor(-2**63, dtype=torch.int64)
    assert digest(neg.view(dt), box, shape, route=route) != digest(t, box, shape, route=route)


@pytest.mark.parametrize("route", list(Route), ids=lambda r: r.name)
def test_an_8_byte_tensor_digests_as_its_4_byte_halves(route):
    """The definition: an 8-byte tensor of last dim C is the 4-byte tensor of last dim 2C
    holding each element's low half at column 2c, its high half at 2c + 1; a transposed
    view (columns not packed) digests as its copy."""
    g = torch.Generator().manual_seed(3)
    t = torch.randint(-2**63, 2**63 - 1, (4, 6), dtype=torch.int64, generator=g).view(torch.float64)
    halves = torch.stack([t.view(torch.int64) & 0xFFFFFFFF, (t.view(torch.int64) >> 32) & 0xFFFFFFFF],
                         dim=-1).reshape(4, 12).to(torch.int64).to(torch.int32)
    box = ((1, 3), (2, 5))
    want = digest(sub(halves, ((1, 3), (4, 10))).contiguous(), ((1, 3), (4, 10)), (4, 12))
    assert digest(sub(t, box), box, (4, 6), route=route) == want
    tt = t.t().contiguous().t()   # the same values, columns strided
    assert tt.stride(-1) != 1
    assert digest(sub(tt, box), box, (4, 6), route=route) == want
