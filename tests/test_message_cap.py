"""One message cap for every command (``coordloader.text.clip``): a 10 MB tensor name, a
megabyte-long argument or rule pattern gives a bounded message that still says what was
expected (its tail), never the input in full nor a message cut before its point."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from coordloader.errors import PlanError
from coordloader.text import MAX_MESSAGE_CHARS, clip

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = "y" * 10_000_000
BOUND = MAX_MESSAGE_CHARS + 200     # the line's prefix ("coordloader plan: PlanError: ")


def test_clip_keeps_head_and_tail_and_says_how_much_was_cut():
    text = "tensor '" + "x" * 50_000 + "': no sharding rule matches this tensor"
    out = clip(text, 300)
    assert len(out) <= 300
    assert out.startswith("tensor 'xxx") and out.endswith("no sharding rule matches this tensor")
    cut = int(out.split("...[")[1].split(" chars cut]")[0])
    assert len(out) - len(f"...[{cut} chars cut]...") + cut == len(text)
    assert clip("short", 300) == "short"


def test_error_with_a_10mb_tensor_name_is_bounded_and_keeps_its_point():
    e = PlanError("no sharding rule matches this tensor", tensor=LONG)
    assert len(str(e)) < 400 and str(e).endswith("no sharding rule matches this tensor")
    e = PlanError(f"tensor {LONG!r}: no sharding rule matches this tensor")
    assert len(str(e)) <= MAX_MESSAGE_CHARS and str(e).endswith("matches this tensor")


@pytest.fixture(scope="module")
def long_named(tmp_path_factory):
    d = tmp_path_factory.mktemp("longname")
    save_file({LONG: torch.zeros(4)}, str(d / "model.safetensors"))
    # a llama config, so the preset is found and the long name is what no rule matches
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "hidden_size": 64,
        "vocab_size": 128}))
    return str(d)


def _run(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=cwd)


@pytest.mark.parametrize("cmd", [
    ("coordloader.plan", "{ckpt}", "--tp", "2"),
    ("coordloader.load", "{ckpt}", "--tp", "2", "--rank", "0", "--engine", "cpu"),
], ids=["plan", "load"])
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_every_command_caps_the_10mb_name_and_keeps_the_point(long_named, cmd):
    r = _run(*[a.format(ckpt=long_named) for a in cmd])
    assert r.returncode != 0
    assert len(r.stderr) < BOUND, len(r.stderr)
    assert "chars cut]" in r.stderr and "no sharding rule matches" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("tool", ["plan", "load", "manifest", "consolidate", "synth", "bench"])
def test_usage_error_quoting_a_huge_argument_is_bounded(tool, capsys):
    from coordloader.cli import main
    huge = "9" * 1_000_000 + "x"
    args = {"plan": ["ckpt", "--tp", huge], "load": ["ckpt", "--tp", huge],
            "manifest": ["ckpt", "--jobs", huge], "consolidate": ["a", "b", "--bogus" + huge],
            "synth": ["--arch", huge, "out"], "bench": ["all", "--bogus" + huge]}[tool]
    with pytest.raises(SystemExit) as ei:
        main([tool, *args])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert len(err) < BOUND + 3000, len(err)   # + the usage text
    assert "chars cut]" in err


def test_unknown_tool_is_bounded(capsys):
    from coordloader.cli import main
    assert main(["x" * 1_000_000]) == 2
    assert len(capsys.readouterr().err) < BOUND + 3000


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_unmatched_rule_warning_is_bounded(tiny_checkpoint, tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"pattern": "z" * 1_000_000, "strategy": "replicate"}]))
    r = _run("coordloader.plan", tiny_checkpoint("llama"), "--tp", "1", "--rules", str(rules))
    assert r.returncode == 0, r.stderr[-500:]
    assert "matches no tensor" in r.stderr and len(r.stderr) < BOUND, len(r.stderr)
