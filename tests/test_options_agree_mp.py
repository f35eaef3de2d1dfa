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


def _run2(tmp, ckpt, extra: dict[int, list[str]], env_of=None, hooks=None):
    """Two ranks of the load; per rank: ``extra`` arguments, ``env_of`` variables, ``hooks``
    (rank_driver.py options; a checkpoint of its own as ``--ckpt``)."""
    port = free_port()

    def start(r):
        env = rank_env(port, r, 2, LOCAL_RANK=str(r), OMP_NUM_THREADS="1",
                       **(env_of or {}).get(r, {}))
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        drive = list((hooks or {}).get(r, ()))
        mine = ckpt
        if "--ckpt" in drive:
            i = drive.index("--ckpt")
            mine = drive[i + 1]
            del drive[i:i + 2]
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "rank_driver.py"),
               *drive, "--", mine, "--tp", "2", "--engine", "cpu",
               "--timeout", "30", "--quiet", *extra.get(r, [])]
        with open(tmp / f"err-{r}", "wb") as ef:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=ef,
                                    cwd=str(tmp), start_new_session=True)

    procs, ends, t0 = run_ranks([0, 1], start, HARD)
    return {r: (p.returncode, (tmp / f"err-{r}").read_text(), ends[r] - t0)
            for r, p in procs.items()}


@pytest.mark.slow   # rank processes
def test_ranks_tuned_apart_outside_the_collectives_load(tiny_qwen3_moe, tmp_path):
    """Only what shapes the engine's collectives (chunk_size, concurrency) is agreed: a
    node's own I/O depth or backend, or INSTANTTENSOR_DEBUG on one rank, was refused as a
    disagreement."""
    out = _run2(tmp_path, tiny_qwen3_moe, {0: ["--loader-config", '{"io_depth": 4}']},
                env_of={1: {"INSTANTTENSOR_DEBUG": "1", "INSTANTTENSOR_IO_DEPTH": "8"}})
    for r, (rc, err, _) in out.items():
        assert rc == 0, (r, err)


@pytest.mark.slow   # rank processes
@pytest.mark.parametrize("extra, want", [
    ({0: ["--verify", "full"], 1: ["--verify", "shapes"]},
     "verify: rank 0 'full', rank 1 'shapes'"),
    ({0: ["--verify", "none"]}, "verify: rank 0 'none', rank 1 'shapes'"),
    ({1: ["--dump", "DUMP"]}, "--dump: rank 0 None, rank 1 'DUMP'"),
    # (was: both exit 0, each directory holding one rank's file of the dump)
    ({0: ["--dump", "DUMP"], 1: ["--dump", "DUMP2"]}, "--dump: rank 0 'DUMP', rank 1 'DUMP2'"),
    ({1: ["--engine", "safetensors"]}, "engine: rank 0 'cpu', rank 1 'safetensors'"),
    # instanttensor's group mode lays out chunks and all-gathers by these: tuned apart, the
    # ranks would meet in mismatched collectives (was: both loaded)
    ({0: ["--loader-config", '{"chunk_size": 1048576}'],
      1: ["--loader-config", '{ "chunk_size" : 8388608 }']},
     """loader_config: rank 0 '{"chunk_size": 1048576}', rank 1 '{"chunk_size": 8388608}'"""),
], ids=["verify-full-vs-shapes", "verify-none-on-one", "dump-on-one", "dump-elsewhere",
        "engine", "loader-config"])
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


@pytest.mark.slow   # rank processes
@pytest.mark.parametrize("bad", [0, 1], ids=["store-host", "other-rank"])
def test_a_rank_refusing_outside_any_phase_is_named_by_every_rank_at_once(
        tiny_qwen3_moe, tmp_path, bad):
    """COORDLOADER_DIGEST_THREADS=0 on one rank, refused by a check the load makes before
    its first phase: the others were never told. The other rank called it dead once its
    heartbeat stopped; on the store host, the host first waited out --timeout (30 s) in
    close() for the other rank. Every rank now names the refusal at its next boundary."""
    out = _run2(tmp_path, tiny_qwen3_moe, {0: ["--verify", "digest"], 1: ["--verify", "digest"]},
                env_of={bad: {"COORDLOADER_DIGEST_THREADS": "0"}})
    why = ("ConfigError: COORDLOADER_DIGEST_THREADS='0': expected a whole number of threads "
           ">= 1 (or unset it for the default)")
    for r, (rc, err, took) in out.items():
        assert rc == 1, (r, err)
        line = rank_line(err, r, only=True)
        assert line == (f"coordloader: rank {r}: {why}" if r == bad else
                        f"coordloader: rank {r}: phase metadata-read: rank {bad}: {why}"), line
        assert took < 25, (r, took, err)   # not the 30 s timeout


@pytest.mark.slow   # rank processes
def test_a_file_gone_from_one_ranks_copy_after_the_load_is_named_by_the_dump_check(
        tiny_qwen3_moe, tmp_path):
    """The source identity --dump records was read between two phases: rank 1's copy
    losing a file after the load failed there, outside any phase, and rank 0 called rank 1
    dead. It is read in the dump-check phase: both ranks name the file."""
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(tiny_qwen3_moe, copy)
    name = sorted(f for f in os.listdir(copy) if f.endswith(".safetensors"))[0]
    out = _run2(tmp_path, tiny_qwen3_moe, {r: ["--dump", str(tmp_path / "dump")] for r in (0, 1)},
                hooks={1: ["--ckpt", str(copy), "--rename-phase", "verify", "--rename-from",
                           str(copy / name), "--rename-to", str(tmp_path / "moved")]})
    for r, (rc, err, _) in out.items():
        assert rc == 1, (r, err)
        assert rank_line(err, r, only=True) == (
            f"coordloader: rank {r}: phase dump-check: rank 1: CheckpointError: file {name}: "
            f"file does not exist"), err
    assert not os.path.exists(tmp_path / "dump") or not os.listdir(tmp_path / "dump")


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


def test_plans_and_configs_that_differ_name_the_ranks_as_ranges(monkeypatch):
    """The plan digests and model configs of four ranks, rank 3's other: the ranks were
    written as Python lists, one list per value ("ranks [0, 1, 2] -> ...")."""
    from coordloader import loader
    from coordloader.errors import PlanError

    class Plan:
        def digest(self):
            return "a" * 64
    calls = []

    def gather(group, value):   # the plan and the config alike: rank 3 differs
        calls.append(value)
        if len(calls) == 1:
            return [value] * 3 + [("b" * 64, value[1], value[2])]
        return [value] * 3 + ["cfg-other"]
    monkeypatch.setattr(loader.collective, "gather_object", gather)
    with pytest.raises(PlanError) as e:
        loader._compare_plan_digests(Plan(), object(), 0, None, {},
                                     config_of=lambda: {"num_attention_heads": 4})
    want = loader._config_digest({"num_attention_heads": 4})
    assert str(e.value) == (
        f"rank 0: ranks disagree on the plan digest (differing rank 3; plan digest: ranks 0-2 "
        f"'{'a' * 12}', rank 3 '{'b' * 12}'); the model config (config.json, or --config / "
        f"config=) differs between ranks (config digest: ranks 0-2 '{want}', rank 3 "
        f"'cfg-other'); give every node the same config")


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
