"""Byte runs against a brute-force element map, and RunList sequence semantics."""
import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coordloader.planning.model import ByteRun
from coordloader.planning.runs import RunList, box_runs, merge_groups


@st.composite
def case(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(nd))
    src = tuple(sorted(draw(st.tuples(st.integers(0, s), st.integers(0, s)))) for s in shape)
    src = tuple((a, b) if b > a else (0, s) for (a, b), s in zip(src, shape))
    o = tuple(sorted(draw(st.tuples(st.integers(a, b), st.integers(a, b)))) for a, b in src)
    o = tuple((a, b) if b > a else (a0, b0) for (a, b), (a0, b0) in zip(o, src))
    local = tuple(b - a + draw(st.integers(0, 2)) for a, b in o)
    corner = tuple(draw(st.integers(0, l - (b - a))) for (a, b), l in zip(o, local))
    return shape, src, o, local, corner, draw(st.sampled_from([1, 2, 4]))


@settings(deadline=None, max_examples=200)
@given(case())
def test_runs_match_brute_force(c):
    shape, src, o, local, corner, isz = c
    sshape = tuple(b - a for a, b in src)
    start = 1000
    runs = RunList(merge_groups(box_runs("f", start, src, sshape, o, local, corner, isz)))
    # expected: byte of global element x at src offset -> local offset
    want = {}
    for x in np.ndindex(*[b - a for a, b in o]):
        g = [a + i for (a, _), i in zip(o, x)]
        so = np.ravel_multi_index([gi - a for gi, (a, _) in zip(g, src)], sshape)
        do = np.ravel_multi_index([ci + i for ci, i in zip(corner, x)], local)
        for k in range(isz):
            want[start + so * isz + k] = do * isz + k
    got = {}
    for r in runs:
        for k in range(r.length):
            assert r.offset + k not in got
            got[r.offset + k] = r.dest + k
    assert got == want
    assert runs.total_bytes == len(want)
    if all((b - a) == s for (a, b), s in zip(o, sshape)) and local == sshape:
        assert len(runs) == 1          # whole tensor: one run


def test_runlist_sequence():
    rl = RunList([("a", 10, 4, 0, 3, 100, 4), ("b", 0, 2, 12, 1, 0, 0)])
    exp = (ByteRun("a", 10, 4, 0), ByteRun("a", 110, 4, 4), ByteRun("a", 210, 4, 8), ByteRun("b", 0, 2, 12))
    assert len(rl) == 4 and tuple(rl) == exp and rl == exp and rl[2] == exp[2] and rl[-1] == exp[3]
    assert rl == RunList.from_runs(exp) and hash(rl) == hash(RunList.from_runs(exp))
    assert pickle.loads(pickle.dumps(rl)) == rl and rl.total_bytes == 14
    files, fi, off, ln, dst = rl.arrays()
    assert files == ("a", "b") and off.tolist() == [10, 110, 210, 0] and dst.tolist() == [0, 4, 8, 12]


@settings(deadline=None, max_examples=300)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 6), st.sampled_from([2, 4]),
                          st.integers(-3, 6), st.integers(1, 4), st.sampled_from([0, 2, 4]),
                          st.sampled_from([-2, 0, 2, 4])), max_size=6))
def test_digest_runs_key_is_canonical(groups):
    """The plan digest's run encoding depends on the run sequence only: grouped or not,
    and it equals a brute-force greedy folding of the expanded runs."""
    from coordloader.planning.model import _runs_key
    gs = [(f, o * 2, ln, d, c, ss if c > 1 else 0, ds if c > 1 else 0)
          for f, o, ln, d, c, ss, ds in groups]
    rl = RunList(gs)
    runs = tuple(rl)
    out, cur = [], None
    for r in runs:
        if cur and cur[0] == r.file and cur[2] == r.length and (
                cur[4] == 1 or (r.offset == cur[1] + cur[4] * cur[5]
                                and r.dest == cur[3] + cur[4] * cur[6])):
            if cur[4] == 1:
                cur[5], cur[6] = r.offset - cur[1], r.dest - cur[3]
            cur[4] += 1
        else:
            if cur:
                out.append(tuple(cur))
            cur = [r.file, r.offset, r.length, r.dest, 1, 0, 0]
    if cur:
        out.append(tuple(cur))
    assert _runs_key(rl) == _runs_key(runs) == _runs_key(RunList.from_runs(runs)) == tuple(out)


def test_plan_digest_ignores_sharing_and_sees_every_run():
    from dataclasses import replace

    from coordloader.api import make_plan
    from coordloader.layout import Layout
    from coordloader.planning.model import Plan, RankPlan
    from coordloader.planning.planner import meta_from_specs
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors("deepseek_v3", "tiny")
    meta = meta_from_specs(cfg, specs, files=2)
    plan = make_plan(meta, Layout(tp=2, dp=2))
    d = plan.digest()

    def rebuild(fn):
        ranks = tuple(RankPlan(rp.rank, rp.coords, tuple(fn(t) for t in rp.tensors))
                      for rp in plan.ranks)
        return Plan(plan.layout, plan.fingerprint, ranks, plan.excluded, plan.load_groups)

    # no shared objects, runs as plain tuples of ByteRuns: same digest
    flat = rebuild(lambda t: replace(t, byte_runs=tuple(t.byte_runs),
                                     pieces=tuple(replace(p) for p in t.pieces)))
    assert flat.digest() == d
    # one row of one dim-1 slice moved by one byte: another digest
    victim = next(t for t in plan.ranks[1].tensors if len(t.byte_runs) > 3)

    def shift(t):
        if t is not victim:
            return t
        runs = list(t.byte_runs)
        r = runs[2]
        runs[2] = ByteRun(r.file, r.offset + 1, r.length, r.dest)
        return replace(t, byte_runs=tuple(runs))
    assert rebuild(shift).digest() != d
    assert rebuild(lambda t: replace(t, replica=t.replica + (t is victim))).digest() != d


def test_plan_digest_not_carried_by_replace():
    from dataclasses import replace

    from coordloader.api import make_plan
    from coordloader.layout import Layout
    from coordloader.planning.planner import meta_from_specs
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors("llama", "tiny")
    meta = meta_from_specs(cfg, specs)
    plan = make_plan(meta, Layout(tp=2))
    d = plan.digest()
    swapped = replace(plan, ranks=plan.ranks[::-1])
    assert swapped.digest() != d and plan.digest() == d


def test_plan_digest_rows_are_the_repr_of_each_slices_fields():
    """The digest's table entry of a slice is the repr of the tuple of its fields (the
    canonical form docs/plan-schema.md promises), however it is built: the shared middle
    fields and the one-run shortcut write it out piece by piece."""
    from dataclasses import replace

    from coordloader.planning.model import Piece, TensorSlice, _Rows, _runs_key
    whole = (Piece(((0, 4), (0, 8)), (0, 0)),)
    half = (Piece(((0, 4), (0, 4)), (0, 0)),)
    slices = [
        TensorSlice("a.weight", "f1", "BF16", (4, 8), (4, 8), whole, 0,
                    RunList.single("f1", 128, 64), "replicate"),
        # same pieces object, other tensor and shapes: the middle is not reused wrongly
        TensorSlice("b.weight", "f1", "F32", (4, 8), (4, 8), whole, 0,
                    RunList.single("f1", 512, 128), "colwise"),
        TensorSlice("c.weight", "f2", "BF16", [4, 8], [4, 4], half, 0,
                    RunList(box_runs("f2", 0, ((0, 4), (0, 8)), (4, 8), ((0, 4), (0, 4)),
                                     (4, 4), (0, 0), 2)), "rowwise"),
        # runs as plain ByteRuns, an offset given as a numpy int
        TensorSlice("d.weight", "f2'x", "BF16", (4, 8), (4, 8), whole, 0,
                    (ByteRun("f2'x", np.int64(64), 64, 0),), "replicate"),
    ]
    slices.append(replace(slices[0], local_shape=(4, 4)))
    rows = _Rows()
    rows(slices)
    want = [repr((t.name, t.file, t.dtype, tuple(t.global_shape), tuple(t.local_shape),
                  t.strategy, tuple((tuple(map(tuple, p.src)), tuple(p.dst)) for p in t.pieces),
                  _runs_key(t.byte_runs))).encode() for t in slices]
    assert list(rows.number) == want


def test_a_familys_runs_are_each_tensors_own():
    # the planner works out a split family's runs for its first tensor and moves them to
    # each other tensor's bytes: every slice's runs are what its own record gives
    from coordloader.api import make_plan
    from coordloader.checkpoint.dtypes import itemsize
    from coordloader.layout import Layout
    from coordloader.planning.model import share_of
    from coordloader.planning.planner import meta_from_specs
    from coordloader.planning.runs import slice_runs
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors("deepseek_v3", "tiny")
    meta = meta_from_specs(cfg, specs, files=3)
    store = share_of(make_plan(meta, Layout(tp=4, pp=2)).ranks[0]).slices.store
    split = [i for i, r in enumerate(store.runs) if r is not None]
    assert len({store.names[i] for i in split}) > 20
    for i in split:
        f = store.forms[store.form[i]]
        want = slice_runs(meta.tensors[store.names[i]], f.pieces, f.local_shape, itemsize(f.dtype))
        got = store.runs[i]
        assert (got.groups, len(got), got.total_bytes, list(got)) == (
            want.groups, len(want), want.total_bytes, list(want)), store.names[i]
