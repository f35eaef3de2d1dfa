"""Byte runs against a brute-force element map, and RunList sequence semantics."""
import pickle

import numpy as np
from hypothesis import given, settings, strategies as st

from coordloader.planmodel import ByteRun
from coordloader.runs import RunList, box_runs, merge_groups


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
