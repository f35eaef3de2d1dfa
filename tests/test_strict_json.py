"""Every JSON a user hands in is parsed as strictly as config.json and the index: a key
given twice, NaN or Infinity is refused naming what was read, never taken as the last
value (a rule's strategy, an expert map) or as a float that equals nothing."""
from __future__ import annotations

import json

import pytest

import coordloader as cl
from coordloader.api import read_rules
from coordloader.checkpoint.reader import parse_strict_json, read_checkpoint
from coordloader.errors import LoadError, PlanError, SaveError, VerifyError
from coordloader.handoff.save import save
from coordloader.layout import Layout
from coordloader.synth import synthesize
from coordloader.verify import manifest as mf

# (text, what the refusal says)
BAD = [
    pytest.param('{"a": 1, "a": 2}', "duplicate key 'a'", id="duplicate-key"),
    pytest.param('{"a": NaN}', "NaN is not valid JSON", id="nan"),
    pytest.param('{"a": [-Infinity]}', "-Infinity is not valid JSON", id="infinity"),
    pytest.param('{"a": 1e400}', "number 1e400 overflows", id="overflow"),
]


@pytest.mark.parametrize("text, msg", BAD)
def test_parse_strict_json_refuses(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_strict_json(text)
    with pytest.raises(ValueError, match=msg):
        parse_strict_json(text.encode())
    assert parse_strict_json(b' {"a": [1, 2.5, "x", null]} ') == {"a": [1, 2.5, "x", None]}


def test_rule_file_with_a_strategy_given_twice_is_refused(tmp_path):
    # json.loads kept the last strategy: the o_proj became replicated without a word
    f = tmp_path / "rules.json"
    f.write_text('{"mode": "extend", "rules": [{"pattern": "*.o_proj.weight", '
                 '"strategy": "rowwise", "strategy": "replicate"}]}')
    with pytest.raises(PlanError, match=rf"rule file {f} is not valid JSON: duplicate key "
                                        r"'strategy'"):
        read_rules(str(f))


@pytest.mark.parametrize("text, msg", BAD)
def test_placement_inline_and_file_refused(tmp_path, text, msg):
    from coordloader.cli.plan import build_parser, layout_from_args
    doc = text.replace('"a"', '"expert_placement"')
    f = tmp_path / "map.json"
    f.write_text(doc)
    base = ["ck", "--tp", "2", "--ep", "2"]
    for v in (doc, str(f)):
        with pytest.raises(PlanError, match=f"not valid JSON: "
                                            f"{msg.replace(repr('a'), repr('expert_placement'))}"):
            layout_from_args(build_parser().parse_args(base + ["--placement", v]))


@pytest.mark.parametrize("text, msg", BAD)
def test_loader_config_refused(text, msg, capsys):
    from coordloader.cli.load import build_parser
    from coordloader.engines.instanttensor_engine import parse_loader_config
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["ckpt", "--loader-config", text])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--loader-config" in err and msg in err
    with pytest.raises(LoadError, match=f"--loader-config is not valid JSON: {msg}"):
        parse_loader_config(text)


def test_manifest_with_a_tensor_given_twice_is_refused(tmp_path):
    root = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    meta = read_checkpoint(root)
    mf.write_manifest(meta)
    path = mf.manifest_path(root)
    text = open(path).read()
    name = next(iter(json.loads(text)["tensors"]))
    # the same tensor listed again with another digest: the first entry was dropped
    twice = text.replace(f'"{name}": {{', f'"{name}": {{"dtype": "BF16", "shape": [1], '
                         f'"digest": "0000000000000000"}}, "{name}": {{', 1)
    open(path, "w").write(twice)
    with pytest.raises(VerifyError, match=f"malformed manifest: duplicate key '{name}'") as ei:
        mf.load_manifest(root, meta)
    assert ei.value.file == path


@pytest.mark.parametrize("text, msg", BAD[:2])
def test_save_config_refused_as_the_reader_would(tmp_path, text, msg):
    """A config the reader refuses must not be written: the save finished and its output
    then failed to load."""
    src = synthesize(str(tmp_path / "src"), "llama", "tiny")
    cfg = json.loads(open(f"{src}/config.json").read())
    bad = json.dumps(cfg)[:-1] + ", " + text[1:]
    (tmp_path / "config.json").write_text(bad)
    layout = Layout(tp=1)
    plan = cl.make_plan(src, layout)
    with pytest.raises(SaveError, match=f"config is not valid JSON: {msg}") as ei:
        save(tmp_path / "out", cl.load(src, layout, rank=0), plan, rank=0,
             config=str(tmp_path / "config.json"))
    assert ei.value.file == str(tmp_path / "config.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cfg, msg", [
    ({1: "a", "1": "b"}, "duplicate key '1'"),
    ({"seed": 2**70}, "out of range"),
    ({"blob": "x" * (17 << 20)}, "bytes as JSON; expected at most 16777216"),
    ({"lists": [[] for _ in range(200_000)]}, "JSON arrays and objects in"),
], ids=["int-and-str-key", "huge-int", "over-16-MiB", "dense"])
def test_save_config_dict_the_reader_would_refuse_is_refused(tmp_path, cfg, msg):
    """config= as a dict was written with json.dumps as it came: keys 1 and "1" as one
    key twice, an int past 2**63, more than the reader takes of a config.json; the save
    finished and its output failed to load."""
    src = synthesize(str(tmp_path / "src"), "llama", "tiny")
    layout = Layout(tp=1)
    doc = dict(json.loads(open(f"{src}/config.json").read()), **{str(k): v for k, v in cfg.items()
                                                                   if not isinstance(k, int)})
    doc.update({k: v for k, v in cfg.items() if isinstance(k, int)})
    with pytest.raises(SaveError, match=f"config= dict is not JSON the reader accepts: .*{msg}"):
        save(tmp_path / "out", cl.load(src, layout, rank=0), cl.make_plan(src, layout), rank=0,
             config=doc)
    assert not (tmp_path / "out").exists()


def test_save_config_dict_with_infinity_is_written_as_transformers_writes_it(tmp_path):
    """Mamba2's default time_step_limit is (0.0, inf): json.dumps wrote Infinity, which
    the reader refuses, and a first fix refused the dict. transformers writes such a float
    as {"__float__": "Infinity"}, and so does save now."""
    src = synthesize(str(tmp_path / "src"), "llama", "tiny")
    layout = Layout(tp=1)
    doc = dict(json.loads(open(f"{src}/config.json").read()),
               time_step_limit=(0.0, float("inf")), bound=float("-inf"), odd=float("nan"))
    save(tmp_path / "out", cl.load(src, layout, rank=0), cl.make_plan(src, layout), rank=0,
         config=doc)
    got = read_checkpoint(str(tmp_path / "out")).config
    assert got["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    assert got["bound"] == {"__float__": "-Infinity"} and got["odd"] == {"__float__": "NaN"}
