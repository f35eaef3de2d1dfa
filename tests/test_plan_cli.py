import json
import subprocess
import sys

import pytest

from coordloader.api import make_plan
from coordloader.cli.plan import format_plan_table, main, ranges_str, rank_rows
from coordloader.layout import Layout
from coordloader.planning.model import TensorSlice
from coordloader.planning.planner import meta_from_specs


@pytest.fixture(scope="module")
def ckpt(tiny_qwen3_moe):
    return tiny_qwen3_moe


def test_table_and_json(ckpt, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([ckpt, "--tp", "4", "--ep", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "experts" in text and "world 4" in text
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and len(doc["ranks"]) == 4 and len(doc["digest"]) == 64
    t = doc["ranks"][0]["tensors"][0]
    assert {"name", "file", "dtype", "global_shape", "local_shape", "replica", "pieces",
            "byte_runs"} <= set(t)
    TensorSlice.from_json(t)
    full = {int(l.split()[0]): l for l in text.splitlines() if l.strip()[:1].isdigit()}
    assert sorted(full) == [0, 1, 2, 3]
    assert main([ckpt, "--tp", "4", "--ep", "2", "--rank", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [l for l in lines if l.strip()[:1].isdigit()]
    assert rows == [full[3]]          # the same figures as in the whole table, alone


def test_json_write_failure_is_an_error_naming_the_file(ckpt, tmp_path, capsys):
    """The plan file is written via temp file + rename: a path that cannot be written is
    a one-line error naming it (exit 1), and an existing file is replaced whole."""
    bad = tmp_path / "no-such-dir" / "plan.json"
    assert main([ckpt, "--tp", "2", "--json", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("coordloader plan: SaveError: ") and str(bad) in err
    assert err.count("\n") == 1
    out = tmp_path / "plan.json"
    out.write_text("old")
    assert main([ckpt, "--tp", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]   # no temp file left


@pytest.mark.slow   # a subprocess
def test_json_to_stdout_is_only_json(ckpt):
    """`--json -` can be piped into a JSON parser: the table goes to stderr."""
    p = subprocess.run([sys.executable, "-m", "coordloader.plan", ckpt, "--tp", "2", "--ep", "2",
                        "--json", "-"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["version"] == 1 and len(doc["ranks"]) == 2
    assert "world 2" in p.stderr


@pytest.mark.slow   # a subprocess
def test_invalid_layout_exit_code_no_traceback(ckpt):
    p = subprocess.run([sys.executable, "-m", "coordloader.plan", ckpt, "--tp", "4", "--ep", "3"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("coordloader plan: PlanError: ")
    assert "does not divide" in p.stderr and "Traceback" not in p.stderr


def test_formatting_functions():
    assert ranges_str([96, 97, 98, 5]) == "5,96-98" and ranges_str([]) == "-"
    cfg = {"architectures": ["MixtralForCausalLM"], "num_attention_heads": 2, "num_key_value_heads": 2,
           "num_hidden_layers": 1, "num_local_experts": 4, "tie_word_embeddings": False}
    specs = [("model.embed_tokens.weight", "BF16", (64, 4)), ("lm_head.weight", "BF16", (64, 4)),
             ("model.norm.weight", "F32", (4,)),
             ("model.layers.0.self_attn.o_proj.weight", "BF16", (4, 4))]
    specs += [(f"model.layers.0.block_sparse_moe.experts.{e}.w{k}.weight", "BF16", (4, 4))
              for e in range(4) for k in (1, 2, 3)]
    plan = make_plan(meta_from_specs(cfg, specs), Layout(tp=2, ep=2))
    rows = rank_rows(plan)
    assert rows[1]["experts"] == [2, 3] and rows[0]["read_amplification"] > 1.0
    assert rows[0]["bytes_to_read"] == plan.rank(0).bytes_to_read
    assert "2,3" in format_plan_table(plan)   # one range style everywhere: a run of two is "a,b"


def test_layout_from_args_placement_forms(tmp_path):
    from coordloader.cli.plan import build_parser, layout_from_args
    from coordloader.errors import PlanError
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"expert_placement": [[1, 0], [3, 2]]}))
    base = ["ck", "--tp", "2", "--ep", "2", "--pp", "2", "--pp-layers", "1,3"]
    for v in (str(f), "[[1, 0], [3, 2]]"):
        L = layout_from_args(build_parser().parse_args(base + ["--placement", v]))
        assert L.expert_placement == ((1, 0), (3, 2)) and L.pp_layers == (1, 3)
    for bad, msg in ((["--placement", str(tmp_path / "none.json")], "cannot read --placement file"),
                     (["--placement", "[[1]"], "not valid JSON"),
                     (["--pp-layers", "1,x"], "comma-separated integers")):
        with pytest.raises(PlanError, match=msg):
            layout_from_args(build_parser().parse_args(base + bad))
