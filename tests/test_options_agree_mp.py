"""Ranks of one `python -m coordloader.load` job given different options.

Options outside the plan decide which phases and collectives a rank makes after the load
(--verify, --dump) or inside it (--engine). Two plain processes, one option differing;
both must stop in plan-agree, before any tensor I/O, with the same one line naming the
option and each rank's value: not load with one rank verifying less than the report
claims, nor pair one rank's dump with the other's summary gather (gloo text after
--timeout, a different line per rank)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coordloader.dist.collective import free_port

from helpers import rank_line
from ranks import rank_env, run_ranks

HARD = 60.0


def _run2(tmp, ckpt, extra: dict[int, list[str]]):
    port = free_port()

    def start(r):
        env = rank_env(port, r, 2, LOCAL_RANK=str(r), OMP_NUM_THREADS="1")
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        cmd = [sys.executable, "-m", "coordloader.load", ckpt, "--tp", "2", "--engine", "cpu",
               "--timeout", "30", "--quiet", *extra.get(r, [])]
        with open(tmp / f"err-{r}", "wb") as ef:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=ef,
                                    cwd=str(tmp), start_new_session=True)

    procs, ends, t0 = run_ranks([0, 1], start, HARD)
    return {r: (p.returncode, (tmp / f"err-{r}").read_text(), ends[r] - t0)
            for r, p in procs.items()}


@pytest.mark.slow   # rank processes
@pytest.mark.parametrize("extra, want", [
    ({0: ["--verify", "full"], 1: ["--verify", "shapes"]},
     "verify: rank 0 'full', rank 1 'shapes'"),
    ({0: ["--verify", "none"]}, "verify: rank 0 'none', rank 1 'shapes'"),
    ({1: ["--dump", "DUMP"]}, "--dump: rank 0 None, rank 1 'DUMP'"),
    # (was: both exit 0, each directory holding one rank's file of the dump)
    ({0: ["--dump", "DUMP"], 1: ["--dump", "DUMP2"]}, "--dump: rank 0 'DUMP', rank 1 'DUMP2'"),
    ({1: ["--engine", "safetensors"]}, "engine: rank 0 'cpu', rank 1 'safetensors'"),
], ids=["verify-full-vs-shapes", "verify-none-on-one", "dump-on-one", "dump-elsewhere",
        "engine"])
def test_ranks_with_different_options_stop_before_loading(tiny_qwen3_moe, tmp_path, extra, want):
    dirs = {"DUMP": str(tmp_path / "dump"), "DUMP2": str(tmp_path / "dump2")}
    extra = {r: [dirs.get(a, a) for a in args] for r, args in extra.items()}
    for k, v in dirs.items():
        want = want.replace(f"'{k}'", repr(v))
    out = _run2(tmp_path, tiny_qwen3_moe, extra)
    lines = set()
    for r, (rc, err, _) in out.items():
        assert rc == 1, (r, err)
        line = rank_line(err, r, only=True)
        assert "phase plan-agree" in line and "ConfigError: ranks disagree on their options" \
            in line and want in line, line
        lines.add(line.split(": ", 2)[2])
    assert len(lines) == 1, lines   # every rank prints the same message
    assert not any(os.path.exists(v) for v in dirs.values())   # before any tensor I/O or dump


def test_options_that_are_not_hashable_are_compared(monkeypatch):
    """``agree=`` values a caller passes (a list, a dict) are compared by equality: a
    difference is the ConfigError naming them, not a TypeError from hashing them."""
    from coordloader import loader
    from coordloader.errors import ConfigError

    class Plan:
        def digest(self):
            return "p"
    seen = []

    def gather(group, value):   # rank 0's value, and rank 1's with another list
        seen.append(value)
        return [value, (value[0], value[1], (("files", ["b"]),))]
    monkeypatch.setattr(loader.collective, "gather_object", gather)
    with pytest.raises(ConfigError, match=r"files: rank 0 \['a'\], rank 1 \['b'\]"):
        loader._compare_plan_digests(Plan(), object(), 0, None, {"files": ["a"]})
    assert len(seen) == 1


@pytest.mark.slow   # rank processes
@pytest.mark.parametrize("extra, want", [
    ({1: ["--tp", "1"]}, "rank 1: LoadError: launched with 2 ranks but the layout (tp=1 pp=1 "
                         "dp=1 ep=1) needs 1"),
    # (rank 0 writes the report, so rank 0 checks its path)
    ({0: ["--report", "CKPT/model.safetensors"]},
     "rank 0: ConfigError: file CKPT/model.safetensors: --report CKPT/model.safetensors "
     "would add model.safetensors to the checkpoint directory"),
], ids=["world-on-one", "report-onto-the-checkpoint-on-one"])
def test_a_rank_refusing_its_arguments_is_named_at_once(tiny_qwen3_moe, tmp_path, extra, want):
    """One rank refusing its own arguments stopped outside any phase (before the group
    formed, or just after): the other waited out --timeout (30 s) and called it absent
    ("did not join") or dead."""
    extra = {r: [a.replace("CKPT", tiny_qwen3_moe) for a in args] for r, args in extra.items()}
    want = want.replace("CKPT", tiny_qwen3_moe)
    out = _run2(tmp_path, tiny_qwen3_moe, extra)
    for r, (rc, err, took) in out.items():
        assert rc == 1, (r, err)
        line = rank_line(err, r, only=True)
        assert f"phase arguments: {want}" in line, line
        assert took < 20, (r, took, line)   # well inside --timeout 30
