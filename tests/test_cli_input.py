"""Bad command-line input is a usage error (exit 2, one line naming the option), never a
store error with a C++ backtrace."""
from __future__ import annotations

import os

import pytest

from coordloader.cli.load import build_parser

from helpers import flip_data_bytes


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "inf", "-inf", "soon"])
def test_timeout_must_be_positive_and_finite(bad, capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["ckpt", "--timeout", bad])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout" in err and "Traceback" not in err


@pytest.mark.parametrize("bad", ["1e-300", "1e-6", "0.0005", "0.05"])
def test_a_timeout_below_what_the_store_takes_is_a_usage_error(bad, capsys):
    """A sub-millisecond --timeout reached the store as a deadline of 0 ms: rank 0 aborted
    in C++ (exit 134, a backtrace), naming its own store as a foreign listener."""
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["ckpt", "--timeout", bad])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "--timeout" in err and "at least 0.1 seconds" in err, err


def test_timeout_accepts_seconds():
    assert build_parser().parse_args(["ckpt", "--timeout", "2.5"]).timeout == 2.5


@pytest.mark.parametrize("bad", ["{bad", "[1, 2]", "3"])
def test_loader_config_is_parsed_under_any_engine(bad, capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["ckpt", "--engine", "auto", "--loader-config", bad])
    assert ei.value.code == 2 and "--loader-config" in capsys.readouterr().err


def test_loader_config_object_is_kept():
    a = build_parser().parse_args(["ckpt", "--loader-config", '{"io_depth": 64}'])
    assert a.loader_config == {"io_depth": 64}


@pytest.mark.parametrize("port, wanted", [
    ("99999", "MASTER_PORT=99999 is not a TCP port; expected an integer in 1-65535"),
    ("0", "MASTER_PORT=0 is not a TCP port"),
    ("29x", "MASTER_PORT='29x' is not an integer"),
])
def test_master_port_out_of_range_or_not_an_integer_is_named(monkeypatch, port, wanted):
    from coordloader.dist.collective import init_group
    from coordloader.errors import CollectiveError
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(CollectiveError, match=wanted.replace("(", r"\(")):
        init_group(timeout_s=1)


@pytest.mark.parametrize("env, wanted", [
    ({"WORLD_SIZE": "2"}, "environment variable WORLD_SIZE=2 is set but RANK is not"),
    ({"RANK": "1"}, "environment variable RANK=1 is set but WORLD_SIZE is not"),
])
def test_half_of_the_rank_environment_is_refused(monkeypatch, env, wanted):
    """WORLD_SIZE=2 without RANK ran as one process, a world of one, and exited 0: each of
    the group's processes loaded alone."""
    from coordloader.dist.collective import init_group
    from coordloader.errors import CollectiveError
    for v in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(CollectiveError, match=wanted):
        init_group(timeout_s=1)
    # neither, or a world of one said half-way, is one process
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    g = init_group(timeout_s=1)
    assert (g.rank, g.world) == (0, 1)


@pytest.mark.parametrize("tool, flag, name", [("load", "--report", "model.safetensors"),
                                              ("plan", "--json", "config.json")])
def test_an_output_never_replaces_a_file_of_the_checkpoint(tmp_path, monkeypatch, capsys, tool,
                                                           flag, name):
    """load --report and plan --json replaced whatever file they were given, the
    checkpoint's own shard or config.json included, and exited 0."""
    import importlib

    from coordloader.synth import synthesize
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    before = (tmp_path / "ck" / name).read_bytes()
    def main(argv):   # load exits through the distributed error policy, plan returns
        try:
            return importlib.import_module(f"coordloader.cli.{tool}").main(argv)
        except SystemExit as e:
            return e.code
    assert main([ck, flag, str(tmp_path / "ck" / name)]) == 1
    assert (tmp_path / "ck" / name).read_bytes() == before
    assert (f"ConfigError: file {tmp_path / 'ck' / name}: {flag} {tmp_path / 'ck' / name} would "
            f"replace {name} in the checkpoint directory {ck}; write it elsewhere"
            in capsys.readouterr().err)
    assert main([ck, flag, str(tmp_path / "out.json")]) == 0 and (tmp_path / "out.json").exists()


@pytest.mark.parametrize("tool, flag, name", [("load", "--report", "model.safetensors.index.json"),
                                              ("load", "--report", "coordloader.manifest.json"),
                                              ("plan", "--json", "plan.safetensors")])
def test_an_output_never_adds_a_file_the_reader_would_read(tmp_path, monkeypatch, capsys, tool,
                                                           flag, name):
    """The guard fired only on a file that existed: a new report named like an index, or a
    plan named like a shard, was written into the checkpoint and read as part of it (the
    checkpoint no longer loaded)."""
    import importlib

    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.synth import synthesize
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    before = sorted(os.listdir(ck))
    def main(argv):   # load exits through the distributed error policy, plan returns
        try:
            return importlib.import_module(f"coordloader.cli.{tool}").main(argv)
        except SystemExit as e:
            return e.code
    out = str(tmp_path / "ck" / name)
    assert main([ck, "--quiet", flag, out] if tool == "load" else [ck, flag, out]) == 1
    assert (f"ConfigError: file {out}: {flag} {out} would add {name} to the checkpoint "
            f"directory {ck}, where it would be read as part of the checkpoint; write it "
            f"elsewhere" in capsys.readouterr().err)
    assert sorted(os.listdir(ck)) == before
    read_checkpoint(ck)
    # any other name there is ignored by the reader, and allowed
    assert main([ck, flag, str(tmp_path / "ck" / "notes.json")]) == 0
    read_checkpoint(ck)


def test_an_output_directory_is_never_named_as_a_file_of_the_checkpoint(tmp_path, monkeypatch,
                                                                         capsys):
    """`load SRC --dump SRC/model.safetensors`, `consolidate . model.safetensors` run inside
    a sharded save: the output directory, named like a checkpoint file in the checkpoint's
    directory, exited 0 and the source no longer loaded ("holds both ... two
    checkpoints")."""
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.cli import consolidate, load
    from coordloader.synth import synthesize
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny", shards=2)
    before = sorted(os.listdir(ck))
    out = os.path.join(ck, "model.safetensors")
    with pytest.raises(SystemExit) as ei:
        load.main([ck, "--quiet", "--dump", out])
    assert ei.value.code == 1
    assert (f"ConfigError: file {out}: --dump {out} would add model.safetensors to the "
            f"checkpoint directory {ck}, where it would be read as part of the checkpoint; "
            f"write it elsewhere" in capsys.readouterr().err)
    monkeypatch.chdir(ck)
    assert consolidate.main([".", "model.safetensors"]) == 1
    assert (f"SaveError: file model.safetensors: output directory model.safetensors would add "
            f"model.safetensors to the checkpoint directory {ck} (holding config.json, "
            f"model-00001-of-00002.safetensors, model-00002-of-00002.safetensors ...), where "
            f"it would be read as part of that checkpoint; choose another directory"
            in capsys.readouterr().err)
    assert sorted(os.listdir(ck)) == before
    read_checkpoint(ck)
    # a directory of any other name there is not read as the checkpoint's, and allowed
    assert consolidate.main([".", "hf"]) == 0
    read_checkpoint(ck)


def test_load_report_dash_is_stdout(tmp_path, monkeypatch, capsys):
    """--report - wrote a file named '-'; plan --json - means stdout, and so does it now,
    the table then on stderr."""
    import json

    from coordloader.cli.load import main
    from coordloader.synth import synthesize
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    monkeypatch.chdir(tmp_path)
    assert main([ck, "--report", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["checkpoint"] == ck and "read/held" in err
    assert not os.path.lexists(tmp_path / "-")


def _no_torchrun_env(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)


def _exit_code(main, argv):
    try:   # load exits through the distributed error policy, plan returns
        return main(argv)
    except SystemExit as e:
        return e.code


def test_a_mistyped_preset_is_named_as_such(tmp_path, capsys):
    """--rules qwen3-moe said the rule file does not exist, and named no preset."""
    from coordloader.cli.plan import main
    from coordloader.planning.rules import PRESETS
    from coordloader.synth import synthesize
    ck = synthesize(str(tmp_path / "ck"), "qwen3_moe", "tiny")
    assert main([ck, "--rules", "qwen3-moe"]) == 1
    err = capsys.readouterr().err
    assert ("PlanError: rules 'qwen3-moe' is neither a rule file nor a preset (presets: "
            + ", ".join(PRESETS) + "); did you mean 'qwen3_moe'?") in err
    assert main([ck, "--rules", str(tmp_path / "none.json")]) == 1
    err = capsys.readouterr().err
    assert "is neither a rule file nor a preset" in err and "did you mean" not in err


@pytest.mark.parametrize("engine", ["cpu", "auto", "safetensors"])
def test_loader_config_keys_are_checked_under_every_engine(tmp_path, monkeypatch, capsys,
                                                           engine):
    """A mistyped --loader-config key was accepted by the cpu/auto engine and refused only
    on a GPU machine, by the instanttensor engine."""
    pytest.importorskip("instanttensor")
    from coordloader.cli.load import main
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    argv = [ck, "--quiet", "--engine", engine, "--device", "cpu", "--loader-config"]
    assert _exit_code(main, argv + ['{"chunk_sise": 5}']) == 1
    err = capsys.readouterr().err
    assert "LoadError: --loader-config has unknown option(s) chunk_sise; " in err
    assert "accepts" in err and "chunk_size" in err.split("accepts")[1]
    assert _exit_code(main, argv + ['{"chunk_size": 5}']) == 0


def test_dump_onto_a_file_or_report_onto_a_directory_is_refused_before_the_load(
        tmp_path, monkeypatch, capsys):
    """--dump FILE (and --report DIR) ran the whole load and failed only then, the dump
    creating the directory."""
    import coordloader.cli.load as load_cli
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    target = tmp_path / "afile"
    target.write_text("x")

    def load_detailed(*a, **k):
        raise AssertionError("loaded before refusing --dump")
    monkeypatch.setattr(load_cli, "load_detailed", load_detailed)
    assert _exit_code(load_cli.main, [ck, "--quiet", "--dump", str(target)]) == 1
    assert (f"ConfigError: file {target}: --dump {target} exists and is not a directory"
            in capsys.readouterr().err)
    assert target.read_text() == "x"
    # --report onto a directory: the whole load, then "write failed: Is a directory"
    assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(tmp_path)]) == 1
    assert (f"ConfigError: file {tmp_path}: --report {tmp_path} is a directory; choose a "
            f"file path" in capsys.readouterr().err)


@pytest.mark.parametrize("flag", ["--max-shard-size", "--block-mib"])
@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "big"])
def test_consolidate_sizes_must_be_positive_and_finite(flag, bad, capsys):
    """--max-shard-size -1 was clamped to one byte (a file per tensor) and nan raised an
    untyped ValueError."""
    from coordloader.cli.consolidate import main
    with pytest.raises(SystemExit) as ei:
        main(["src", "out", flag, bad])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and f"argument {flag}: '{bad}'" in err and "Traceback" not in err


@pytest.mark.parametrize("tool, flag", [("plan", "--rules"), ("plan", "--config"),
                                        ("plan", "--placement"), ("load", "--config"),
                                        ("consolidate", "--config")])
def test_a_fifo_given_as_an_input_file_is_refused_without_waiting(tmp_path, monkeypatch,
                                                                   capsys, tool, flag):
    """A FIFO given as --rules, --config or --placement blocked in open() forever; the
    checkpoint's own side files were already refused as such."""
    import importlib
    import os
    import threading

    from coordloader.synth import synthesize
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    ck = synthesize(str(tmp_path / "ck"), "qwen3_moe", "tiny")
    fifo = str(tmp_path / "f.json")
    os.mkfifo(fifo)
    argv = [ck, str(tmp_path / "out")] if tool == "consolidate" else [ck]
    argv += [flag, fifo] + (["--ep", "2", "--tp", "2"] if flag == "--placement" else [])
    done: list = []

    def run():
        try:
            done.append(importlib.import_module(f"coordloader.cli.{tool}").main(argv))
        except SystemExit as e:
            done.append(e.code)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():   # unblock the open() so the thread ends, then fail
        with open(fifo, "w"):
            pass
        pytest.fail(f"{tool} {flag} FIFO: still blocked after 30 s")
    err = capsys.readouterr().err
    assert done == [1] and "is a FIFO; expected a regular file" in err, (done, err)


@pytest.mark.parametrize("bad", ["1e10", "1e300"])
def test_timeout_past_what_the_store_takes_is_a_usage_error(bad, capsys):
    """--timeout 1e10 crashed the store with a C++ backtrace (time_t overflow), 1e300 an
    untyped OverflowError."""
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["ckpt", "--timeout", bad])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "--timeout" in err and "at most" in err, err


@pytest.mark.parametrize("flag", ["--max-shard-size", "--block-mib"])
def test_consolidate_sizes_past_any_disk_are_a_usage_error(flag, capsys):
    from coordloader.cli.consolidate import main
    with pytest.raises(SystemExit) as ei:
        main(["src", "out", flag, "1e300"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and f"argument {flag}: '1e300'" in err and "at most" in err, err


def test_deeply_nested_inline_json_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["ckpt", "--loader-config", "[" * 5000])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "--loader-config" in err and "Traceback" not in err, err


def test_deeply_nested_inline_placement_is_a_plan_error():
    from coordloader.cli.plan import parse_placement
    from coordloader.errors import PlanError
    with pytest.raises(PlanError, match="--placement: .* is nested too deeply"):
        parse_placement("[" * 5000)


def test_a_single_process_rank_is_the_rank_an_error_names(tmp_path, monkeypatch, capsys):
    """load --rank 1 printed 'coordloader: rank 0: ...' for the errors of rank 1."""
    from coordloader.cli.load import main
    from coordloader.synth import synthesize
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    with pytest.raises(SystemExit) as ei:
        main([ck, "--tp", "2", "--rank", "7", "--quiet"])
    assert ei.value.code == 1
    assert capsys.readouterr().err.startswith("coordloader: rank 7: LoadError: ")


def test_quiet_digest_without_a_manifest_still_says_what_was_not_proved(tmp_path, monkeypatch,
                                                                        capsys):
    """--verify digest --quiet on a checkpoint without a manifest exited 0 silently: the
    note that only replicas were compared was part of the summary --quiet hides."""
    from coordloader.cli.load import main
    from coordloader.synth import synthesize
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    assert main([ck, "--verify", "digest", "--quiet"]) == 0
    assert ("coordloader: verify digest: no manifest: checked replicas against primaries only"
            in capsys.readouterr().err)
    # full compared every byte with the checkpoint: said so, not "replicas only"
    assert main([ck, "--verify", "full", "--quiet"]) == 0
    assert ("coordloader: verify full: no manifest: every byte compared with the checkpoint "
            "re-read (full)" in capsys.readouterr().err)


@pytest.mark.parametrize("argv", [["synth", "--shards", "0"], ["synth", "--shards", "-1"],
                                  ["plan", "--tp", "0"], ["load", "--ep", "-2"]])
def test_a_count_below_one_is_a_usage_error(tmp_path, argv, capsys):
    """synth --shards 0 exited 1 with a bare CoordloaderError, plan/load --tp 0 as a
    PlanError: docs/cli.md gives exit 2 for bad usage, as manifest --jobs 0."""
    import importlib
    main = importlib.import_module(f"coordloader.cli.{argv[0]}").main
    assert _exit_code(main, [str(tmp_path / "ck"), *argv[1:]]) == 2
    assert "expected a whole number of" in capsys.readouterr().err


def test_an_output_onto_an_input_or_a_dump_file_is_refused_before_the_load(
        tmp_path, monkeypatch, capsys):
    """load --config my.json --report my.json (and plan --rules r.json --json r.json)
    replaced the input with the output, exit 0, and the next run read a report as its
    config; --report dd/rank-00001.safetensors beside --dump dd replaced that rank's dump
    with the report, exit 0."""
    import json

    import coordloader.cli.load as load_cli
    import coordloader.cli.plan as plan_cli
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    cfg = tmp_path / "my.json"
    cfg.write_text((tmp_path / "ck" / "config.json").read_text())
    rules = tmp_path / "r.json"
    rules.write_text(json.dumps({"mode": "extend", "rules": []}))
    before = {p: p.read_bytes() for p in (cfg, rules)}

    def load_detailed(*a, **k):
        raise AssertionError("loaded before refusing the output")
    monkeypatch.setattr(load_cli, "load_detailed", load_detailed)
    assert _exit_code(load_cli.main, [ck, "--quiet", "--config", str(cfg),
                                      "--report", str(cfg)]) == 1
    assert (f"ConfigError: file {cfg}: --report {cfg} is the --config file this command "
            f"reads; write it elsewhere" in capsys.readouterr().err)
    assert _exit_code(plan_cli.main, [ck, "--rules", str(rules), "--json", str(rules)]) == 1
    assert (f"ConfigError: file {rules}: --json {rules} is the --rules file this command "
            f"reads; write it elsewhere" in capsys.readouterr().err)
    # --config DIR reads DIR/config.json
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(cfg.read_text())
    assert _exit_code(load_cli.main, [ck, "--quiet", "--config", str(hf), "--report",
                                      str(hf / "config.json")]) == 1
    assert (f"--report {hf / 'config.json'} is the --config file this command reads"
            in capsys.readouterr().err)
    assert (hf / "config.json").read_text() == cfg.read_text()
    dump = tmp_path / "dd"
    for report in (dump / "rank-00000.safetensors", dump):
        assert _exit_code(load_cli.main, [ck, "--quiet", "--tp", "2", "--rank", "0", "--dump",
                                          str(dump), "--report", str(report)]) == 1
        assert (f"ConfigError: file {report}: --report {report} is a file of the --dump "
                f"directory {dump}, where the ranks' tensors go; write it elsewhere"
                in capsys.readouterr().err)
    assert {p: p.read_bytes() for p in (cfg, rules)} == before and not dump.exists()
    # a report of another name beside the dump files is no dump file
    monkeypatch.undo()
    _no_torchrun_env(monkeypatch)
    assert _exit_code(load_cli.main, [ck, "--quiet", "--tp", "2", "--rank", "0", "--dump",
                                      str(dump), "--report", str(dump / "report.json")]) == 0
    assert sorted(os.listdir(dump)) == ["rank-00000.safetensors", "report.json"]
    assert json.loads((dump / "report.json").read_text())["ok"] is True


def test_rank_without_world_size_is_refused_by_the_load_command(tmp_path, monkeypatch, capsys):
    """RANK=1 without WORLD_SIZE loaded alone as a world of one and exited 0 (the
    documented refusal was init_group's, which the command never reached)."""
    import coordloader.cli.load as load_cli
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    monkeypatch.setenv("RANK", "1")
    assert _exit_code(load_cli.main, [ck, "--quiet"]) == 1
    assert capsys.readouterr().err == (
        "coordloader: rank 1: environment variable RANK=1 is set but WORLD_SIZE is not; "
        "expected both (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or "
        "neither for one process\n")


@pytest.mark.slow   # a subprocess
def test_plan_writes_its_json_when_the_tables_reader_stops_early(tmp_path):
    """`plan ck --json p.json | head -1`: the table came first, its broken pipe ended the
    command, and p.json was never written."""
    import json
    import subprocess
    import sys

    from coordloader.synth import synthesize
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    out = tmp_path / "p.json"
    r, w = os.pipe()
    os.close(r)   # the reader gone before the first line: every write to stdout fails
    try:
        subprocess.run([sys.executable, "-m", "coordloader.plan", ck, "--tp", "2", "--json",
                        str(out)], stdout=w, stderr=subprocess.DEVNULL, timeout=120)
    finally:
        os.close(w)
    assert json.loads(out.read_text())["layout"]["tp"] == 2


def test_a_failed_load_writes_its_report_with_every_problem(tmp_path, monkeypatch, capsys):
    """On a VerifyError no --report was written: the docs send users there for the
    problems past the five the message names, and an earlier run's report stayed in its
    place saying ok."""
    import json

    import coordloader.cli.load as load_cli
    from coordloader.checkpoint.reader import read_checkpoint
    from coordloader.cli.manifest import main as manifest_main
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    assert manifest_main(["--quiet", ck]) == 0
    rep = tmp_path / "rep.json"
    assert _exit_code(load_cli.main, [ck, "--quiet", "--verify", "digest",
                                      "--report", str(rep)]) == 0
    assert json.loads(rep.read_text())["verify_report"]["ok"] is True
    flip_data_bytes(tmp_path / "ck" / "model.safetensors", 9000, 4)   # in many tensors
    capsys.readouterr()
    assert _exit_code(load_cli.main, [ck, "--quiet", "--verify", "digest",
                                      "--report", str(rep)]) == 1
    err = capsys.readouterr().err
    got = json.loads(rep.read_text())
    assert got["ok"] is False and got["layout"]["tp"] == 1
    assert err.startswith("coordloader: rank 0: VerifyError: verify digest failed"), err
    assert got["error"] == {"type": "VerifyError",
                            "message": "rank 0: " + err.split("VerifyError: ", 1)[1].rstrip("\n")}
    fails = got["verify_report"]["failures"]
    assert len(fails) > 5 and err.endswith(f"... ({len(fails) - 5} more)\n")
    assert {f["tensor"] for f in fails} - {None} <= set(read_checkpoint(ck).tensors)


def test_one_process_per_rank_dumps_of_other_data_are_refused(tmp_path, monkeypatch, capsys):
    """`load A --rank 0 --dump D`, then `load B --rank 1 --dump D` where B has A's headers
    and other data (the next training step saved over the path): the dump guard compared
    plan digests only, and D held two checkpoints' slices, exit 0."""
    import shutil

    import coordloader.cli.load as load_cli
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    a = synthesize(str(tmp_path / "A"), "llama", "tiny")
    b = str(tmp_path / "B")
    shutil.copytree(a, b)
    flip_data_bytes(os.path.join(b, "model.safetensors"), 1000, 0x10)
    d = tmp_path / "D"
    assert _exit_code(load_cli.main, [a, "--quiet", "--tp", "2", "--rank", "0",
                                      "--dump", str(d)]) == 0
    capsys.readouterr()
    assert _exit_code(load_cli.main, [b, "--quiet", "--tp", "2", "--rank", "1",
                                      "--dump", str(d)]) == 1
    assert capsys.readouterr().err == (
        f"coordloader: rank 1: SaveError: file {d}: holds rank-00000.safetensors, a dump of "
        f"another load (the same plan over other data: the sampled bytes of its checkpoint's "
        f"files differ from this load's, a checkpoint of the same shapes or the files saved "
        f"over since); choose another --dump DIR, or dump every rank of this load with "
        f"--overwrite (overwrite=True), each rank replacing its own file\n")
    assert sorted(os.listdir(d)) == ["rank-00000.safetensors"]
    assert _exit_code(load_cli.main, [a, "--quiet", "--tp", "2", "--rank", "1",
                                      "--dump", str(d)]) == 0


def test_settings_found_only_after_the_load_are_refused_before_it(tmp_path, monkeypatch,
                                                                   capsys):
    """--report into a missing directory failed after the whole load and verify; a bad
    COORDLOADER_DIGEST_THREADS was reported as a verify failure of the content; manifest
    --jobs 0 or -3 was accepted; an empty --config was called missing from the checkpoint
    directory; --pp-layers of another count than --pp was worded as a negative count."""
    import coordloader.cli.load as load_cli
    from coordloader.cli.manifest import main as manifest_main
    from coordloader.cli.plan import main as plan_main
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")

    def load_detailed(*a, **k):
        raise AssertionError("loaded before refusing")
    monkeypatch.setattr(load_cli, "load_detailed", load_detailed)
    report = tmp_path / "no-such-dir" / "r.json"
    assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(report)]) == 1
    assert (f"ConfigError: file {report}: --report {report}: its directory does not exist"
            in capsys.readouterr().err)
    monkeypatch.undo()
    _no_torchrun_env(monkeypatch)
    monkeypatch.setenv("COORDLOADER_DIGEST_THREADS", "0")
    assert _exit_code(load_cli.main, [ck, "--quiet", "--verify", "digest"]) == 1
    assert capsys.readouterr().err == (
        "coordloader: rank 0: ConfigError: COORDLOADER_DIGEST_THREADS='0': expected a whole "
        "number of threads >= 1 (or unset it for the default)\n")
    monkeypatch.delenv("COORDLOADER_DIGEST_THREADS")
    for jobs in ("0", "-3"):
        with pytest.raises(SystemExit) as e:
            manifest_main(["--jobs", jobs, ck])
        assert e.value.code == 2
        assert f"argument --jobs: {jobs!r}: expected a whole number of threads >= 1" in \
            capsys.readouterr().err
    assert not os.path.exists(os.path.join(ck, "coordloader.manifest.json"))
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert plan_main([ck, "--config", str(empty)]) == 1
    assert ("the model config (config.json, or the one given with --config / config=) is "
            "empty: the architecture preset is detected from it" in capsys.readouterr().err)
    assert plan_main([ck, "--pp-layers", "1,1"]) == 1
    assert ("layout: pp_layers [1, 1] must give a non-negative layer count for each of the "
            "pp=1 stages (it gives 2 count(s))" in capsys.readouterr().err)


def test_every_failed_load_writes_its_report_but_no_refused_report_path(tmp_path, monkeypatch,
                                                                      capsys):
    """A failure before the load (an argument refused, half of the rank environment) left
    an earlier run's report saying ok; a report path refused itself is never written."""
    import json

    import coordloader.cli.load as load_cli
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    rep = tmp_path / "rep.json"
    assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(rep)]) == 0
    assert json.loads(rep.read_text())["ok"] is True
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, env, want in [
            (["--dump", str(afile)], {}, "ConfigError"),
            (["--pp-layers", "1,1"], {}, "PlanError"),
            ([], {"WORLD_SIZE": "2"}, "CollectiveError")]:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(rep), *argv]) == 1
        capsys.readouterr()
        got = json.loads(rep.read_text())
        assert got["ok"] is False and got["error"]["type"] == want, got
        _no_torchrun_env(monkeypatch)
        rep.write_text('{"ok": true}')
    # another rank before the group formed leaves the report to rank 0 (every rank
    # writing one path raced on its temporary file)
    monkeypatch.setenv("RANK", "1")
    assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(rep)]) == 1
    assert rep.read_text() == '{"ok": true}'
    _no_torchrun_env(monkeypatch)
    # Ctrl-C: a load that did not finish
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(load_cli, "load_detailed", interrupted)
    assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(rep)]) == 130
    assert json.loads(rep.read_text())["error"]["type"] == "KeyboardInterrupt"
    monkeypatch.undo()
    _no_torchrun_env(monkeypatch)
    cfg = tmp_path / "my.json"
    cfg.write_text((tmp_path / "ck" / "config.json").read_text())
    before = cfg.read_text()
    assert _exit_code(load_cli.main, [ck, "--quiet", "--config", str(cfg), "--pp-layers", "1,1",
                                      "--report", str(cfg)]) == 1
    assert cfg.read_text() == before


def test_only_the_rank_writing_the_report_checks_its_path(tmp_path):
    """Every rank refused a --report whose directory was missing where it ran, though only
    rank 0 writes it (rank 1 on another node, another working directory)."""
    import argparse

    from coordloader.cli.load import _check_arguments, build_parser
    from coordloader.errors import ConfigError
    args = build_parser().parse_args([str(tmp_path), "--tp", "2", "--report",
                                      str(tmp_path / "no-such-dir" / "r.json")])
    with pytest.raises(ConfigError) as e:
        _check_arguments(args, argparse.Namespace(rank=0, world=2))
    assert str(e.value).endswith(f"--report {args.report}: its directory does not exist")
    assert _check_arguments(args, argparse.Namespace(rank=1, world=2)).world_size == 2


def test_a_load_under_way_leaves_no_earlier_report_saying_ok(tmp_path, monkeypatch):
    """A load killed mid-way (an OOM kill; torchrun's SIGTERM once a peer died) left the
    earlier run's --report saying "ok": true: the report says unfinished from the start."""
    import json

    import coordloader.cli.load as load_cli
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    rep = tmp_path / "rep.json"
    assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(rep)]) == 0
    assert json.loads(rep.read_text())["ok"] is True
    seen = []
    real = load_cli.load_detailed

    def loading(*a, **kw):   # what a kill at this point leaves
        seen.append(json.loads(rep.read_text()))
        return real(*a, **kw)

    monkeypatch.setattr(load_cli, "load_detailed", loading)
    assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(rep)]) == 0
    assert seen[0]["ok"] is False and seen[0]["error"]["type"] == "Unfinished"
    assert "killed before it could write its result" in seen[0]["error"]["message"]
    assert json.loads(rep.read_text())["ok"] is True


def test_outputs_are_written_through_a_link_and_into_a_fifo(tmp_path, monkeypatch):
    """--report onto a symlink replaced the link with a file (its target kept the earlier
    report, "ok": true); --json onto a FIFO or device (/dev/null, /dev/stdout) replaced it
    with a regular file, as root the system's own device."""
    import json
    import select
    import stat
    import threading

    import coordloader.cli.load as load_cli
    from coordloader.cli.plan import main as plan_main
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    (tmp_path / "results").mkdir()
    target = tmp_path / "results" / "rep.json"
    target.write_text(json.dumps({"ok": True, "stale": True}))
    link = tmp_path / "rep.json"
    link.symlink_to(target)
    assert _exit_code(load_cli.main, [ck, "--quiet", "--report", str(link)]) == 0
    assert link.is_symlink() and "stale" not in json.loads(target.read_text())

    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # a reader, so the writer's open returns
    got, stop = [], threading.Event()

    def drain():
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:   # a writer, nothing written yet
                return
            if not chunk:   # no writer
                return
            got.append(chunk)

    def read():
        while not stop.is_set():
            select.select([fd], [], [], 0.05)
            drain()
        drain()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert _exit_code(plan_main, [ck, "--tp", "2", "--json", str(fifo)]) == 0
    finally:
        stop.set()
        reader.join(10)
        os.close(fd)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert json.loads(b"".join(got))["layout"]["tp"] == 2
    assert b"".join(got).endswith(b"}\n")   # a line of its own (the table followed on it)


@pytest.mark.slow   # two load subprocesses
def test_a_report_to_stdout_appends_to_a_redirected_log_and_a_fifo_gets_one(tmp_path):
    """--report /dev/stdout with stdout appended to a log (>> run.log): the report went
    through /proc/self/fd/1 to run.log and renamed a new file over it (the log's lines
    gone, the final report in a file named 'run.log (deleted)'); onto a FIFO the reader
    took the placeholder report (ok false, Unfinished) and the load then waited forever
    for a reader of the final one."""
    import json
    import subprocess
    import sys
    import threading

    from coordloader.synth import synthesize
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    load = [sys.executable, "-m", "coordloader.load", ck, "--quiet", "--report"]
    log = tmp_path / "run.log"
    log.write_text("earlier line\n")
    with open(log, "a") as f:
        assert subprocess.run(load + ["/dev/stdout"], stdout=f, env=env,
                              timeout=120).returncode == 0
    text = log.read_text()
    assert text.startswith("earlier line\n") and sorted(os.listdir(tmp_path)) == ["ck", "run.log"]
    assert json.loads(text[len("earlier line\n"):])["ok"] is True and text.endswith("}\n")

    fifo = tmp_path / "rep.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    p = subprocess.run(load + [str(fifo)], env=env, timeout=120, capture_output=True)
    reader.join(10)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(got[0])["ok"] is True   # one document: the result


def test_a_cpu_load_does_not_read_local_rank(tmp_path, monkeypatch):
    """LOCAL_RANK='x' refused a CPU run, which has no use for it, before the group formed:
    the other ranks waited out --timeout for this one."""
    import coordloader.cli.load as load_cli
    from coordloader.synth import synthesize
    _no_torchrun_env(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "x")
    ck = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    assert _exit_code(load_cli.main, [ck, "--quiet", "--device", "cpu"]) == 0
