"""Generate the parts of docs/ that must match the code: the CLI reference (docs/cli.md,
from each tool's argparse parser), the worked layout examples in docs/layout.md (computed
by the real planner on published-architecture metadata), and the error-message examples
in docs/troubleshooting.md (produced by triggering each error).

    python tools/docgen.py            # rewrite docs/cli.md and the generated sections
    python tools/docgen.py --check    # exit 1 and show a diff when anything drifted

Hand-written docs hold generated sections between ``<!-- docgen:begin NAME -->`` and
``<!-- docgen:end NAME -->``; only the text between the markers is replaced. Generated
text is deterministic (no timings, temporary paths or ports), so tests/test_docs.py can
compare it with the committed files."""
from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import warnings
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")

# (module holding the parser, command line shown, what it is for). The parser is taken
# from the module's build_parser() when it has one; otherwise it is captured from main()
# (see _capture_parser), so every tool is documented from its real argparse definition.
CLI_TOOLS = (
    ("coordloader.cli.synth", "python -m coordloader.synth",
     "Write a synthetic checkpoint with a real architecture's tensor names and shapes."),
    ("coordloader.cli.plan", "python -m coordloader.plan",
     "Show what every rank would hold for a layout (no tensor I/O)."),
    ("coordloader.cli.load", "torchrun --nproc-per-node N -m coordloader.load",
     "Load a checkpoint onto every rank of a torch.distributed job (also "
     "`python -m coordloader.load` for one process)."),
    ("coordloader.cli.manifest", "python -m coordloader.manifest",
     "Write (or check) the per-tensor content-digest manifest used by `--verify digest`."),
    ("coordloader.cli.consolidate", "python -m coordloader.consolidate",
     "Turn a coordloader sharded checkpoint into a plain HF one."),
    ("coordloader.bench.cli", "python -m coordloader.bench",
     "Benchmark the planner, engines and verification against baselines."),
)


# --------------------------------------------------------------------------- CLI reference

class _Captured(Exception):
    pass


def _capture_parser(main: Callable) -> argparse.ArgumentParser:
    """The parser a ``main(argv)`` builds, taken at its parse_args call (nothing runs)."""
    orig = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def stop(self, *a, **k):
        raise _Captured(self)
    argparse.ArgumentParser.parse_args = stop
    argparse.ArgumentParser.parse_known_args = stop
    try:
        main(["--help"])
    except _Captured as c:
        return c.args[0]
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = orig
    raise RuntimeError(f"{main.__module__}.main() returned without parsing arguments")


def get_parser(module: str) -> tuple[argparse.ArgumentParser, str]:
    """-> (parser, where it came from)."""
    mod = importlib.import_module(module)
    if callable(getattr(mod, "build_parser", None)):
        return mod.build_parser(), f"`{module}.build_parser()`"
    return _capture_parser(mod.main), f"the parser built inside `{module}.main()`"


def _opt_label(a: argparse.Action) -> str:
    if not a.option_strings:
        return f"`{a.metavar or a.dest}`"
    flags = ", ".join(a.option_strings)
    if a.nargs == 0:
        return f"`{flags}`"
    mv = a.metavar or a.dest.upper()
    return f"`{flags} {mv}`"


def _default(a: argparse.Action) -> str:
    if a.nargs == 0:
        return "off" if not a.default else "on"
    if a.required or not a.option_strings:
        return "required"
    if a.default is None or a.default is argparse.SUPPRESS:
        return "—"
    return f"`{a.default}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _synopsis(prog: str, p: argparse.ArgumentParser) -> str:
    parts = [prog]
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        if not a.option_strings:
            if a.choices and not a.metavar:
                parts.append("{" + ",".join(map(str, a.choices)) + "}")
            else:
                parts.append(a.metavar or a.dest.upper())
            continue
        f = a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]
        s = f if a.nargs == 0 else f"{f} {a.metavar or a.dest.upper()}"
        parts.append(s if a.required else f"[{s}]")
    lines, cur = [], ""
    for w in parts:
        if cur and len(cur) + 1 + len(w) > 88:
            lines.append(cur)
            cur = "    " + w
        else:
            cur = f"{cur} {w}" if cur else w
    lines.append(cur)
    return " \\\n".join(lines)


def render_parser(prog: str, p: argparse.ArgumentParser) -> str:
    out = []
    if p.description:
        out += [_cell(p.description), ""]
    out += ["```text", _synopsis(prog, p), "```", ""]
    for g in p._action_groups:
        acts = [a for a in g._group_actions if not isinstance(a, argparse._HelpAction)]
        if not acts:
            continue
        out += [f"**{g.title}**", "", "| argument | default | meaning |", "|---|---|---|"]
        for a in acts:
            h = a.help if a.help and a.help is not argparse.SUPPRESS else ""
            if a.choices:
                ch = ", ".join(f"`{c}`" for c in a.choices)
                h = (h + " " if h else "") + f"(one of {ch})"
            out.append(f"| {_opt_label(a)} | {_default(a)} | {_cell(h)} |")
        out.append("")
    return "\n".join(out)


def cli_markdown() -> str:
    out = ["# CLI reference", "",
           "<!-- Generated by `python tools/docgen.py` from the argparse definitions; "
           "do not edit by hand (tests/test_docs.py fails when this file drifts). -->", "",
           "Every tool prints `--help`; this page is the same information in one place. "
           "Every tool follows one error policy: an error is one line on stderr, "
           "`coordloader: rank R: ErrorType: ...` for the distributed `load` and "
           "`coordloader TOOL: ErrorType: ...` for the others; the exit code is 1 for an error, "
           "2 for bad command-line usage, 130 on Ctrl-C (in a multi-rank load: on the interrupted "
           "rank; the others exit 1 naming it). See [troubleshooting](troubleshooting.md).",
           ""]
    for module, prog, what in CLI_TOOLS:
        out.append(f"- [`{prog}`](#{_anchor(prog)}): {what}")
    out.append("")
    for module, prog, what in CLI_TOOLS:
        out += [f"## `{prog}`", "", what, ""]
        p, src = get_parser(module)
        out += [f"Generated from {src}.", "", render_parser(prog, p)]
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    s = re.sub(r"[^\w\- ]", "", title.lower()).strip()
    return s.replace(" ", "-")


# --------------------------------------------------------------------------- layout examples

@functools.lru_cache(maxsize=None)
def _meta(arch: str, size: str = "full"):
    from coordloader.planning.planner import meta_from_specs
    from coordloader.synth.archs import arch_tensors
    cfg, specs = arch_tensors(arch, size)
    return cfg, meta_from_specs(cfg, specs, files=4)


def _ranges(ids) -> str:
    ids = list(ids)
    if not ids:
        return "—"
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}–{ids[j]}")
        i = j + 1
    return ", ".join(out)


def _box(pieces) -> str:
    if not pieces:
        return "— (padding only)"
    return " + ".join("[" + ", ".join(f"{a}:{b}" for a, b in pc.src) + "]" for pc in pieces)


def _label(name) -> tuple[str, str]:
    """(label, tensor name): a name is shown without its model prefix unless a
    (label, name) pair says otherwise."""
    if isinstance(name, tuple):
        return name
    head, _, rest = name.partition(".")
    return (rest if head in ("model", "bert") else name), name


def _slices_table(plan, ranks, names, meta) -> list[str]:
    """Rows: tensor; columns: ranks; cell: source box (local shape), replica marker."""
    out = []
    for label, name in map(_label, names):
        row = []
        for r in ranks:
            ts = plan.rank(r).by_name().get(name)
            if ts is None:
                row.append("not held")
                continue
            rep = f", replica {ts.replica}" if ts.replica else ""
            row.append(f"{_box(ts.pieces)} → {list(ts.local_shape)}{rep}")
        shape = list(meta.tensors[name].shape) if name in meta.tensors else ""
        out.append(f"| `{label}` {shape} | " + " | ".join(row) + " |")
    return out


def _experts_row(plan, ranks, layer_prefix: str) -> str:
    rx = re.compile(re.escape(layer_prefix) + r"experts\.(\d+)\.")
    cells = []
    for r in ranks:
        ids = sorted({int(m.group(1)) for ts in plan.rank(r).tensors
                      for m in [rx.search(ts.name)] if m})
        cells.append(f"{_ranges(ids)} ({len(ids)})")
    return "| experts of the layer (count) | " + " | ".join(cells) + " |"


def _coords_row(plan, ranks) -> str:
    cells = []
    for r in ranks:
        c = plan.rank(r).coords
        cells.append(" ".join(f"{k}={c[k]}" for k in ("tp", "dp", "pp", "ep", "moe_tp")))
    return "| coordinates | " + " | ".join(cells) + " |"


def _example(title: str, arch: str, layout, ranks, names, layer_prefix=None, note="") -> str:
    from coordloader.api import make_plan
    cfg, meta = _meta(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(meta, layout)
    lines = [f"#### {title}", "",
             f"`Layout({_layout_args(layout)})`, world size {layout.world_size}, "
             f"MoE group size {layout.moe_group_size}, moe_tp {layout.moe_tp}. "
             f"Cells: source box in the global tensor → local shape.", ""]
    lines += ["| tensor (global shape) | " + " | ".join(f"rank {r}" for r in ranks) + " |",
              "|---|" + "---|" * len(ranks), _coords_row(plan, ranks)]
    if layer_prefix:
        lines.append(_experts_row(plan, ranks, layer_prefix))
    lines += _slices_table(plan, ranks, names, meta)
    if note:
        lines += ["", note]
    lines.append("")
    return "\n".join(lines)


def _layout_args(layout) -> str:
    d = layout.to_dict()
    dflt = {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "ep_spans_dp": False, "expert_placement": "linear",
            "pp_layers": None, "allow_uneven": False, "include_mtp": False}
    return ", ".join(f"{k}={v!r}" for k, v in d.items() if dflt.get(k) != v)


def layout_examples() -> str:
    from coordloader.layout import Layout
    L = "model.layers."
    parts = []
    parts.append(_example(
        "Qwen3-30B-A3B at tp=4 ep=4", "qwen3_moe", Layout(tp=4, ep=4), [0, 1, 2, 3],
        ["model.embed_tokens.weight",
         L + "0.self_attn.q_proj.weight",
         L + "0.self_attn.k_proj.weight",
         L + "0.self_attn.o_proj.weight",
         L + "0.mlp.gate.weight",
         L + "0.mlp.experts.0.gate_proj.weight",
         L + "0.mlp.experts.127.down_proj.weight",
         "lm_head.weight"],
        layer_prefix=L + "0.mlp.",
        note="32 query heads and 4 K/V heads split 8 + 1 per rank; 128 experts placed "
             "linearly, 32 per ep rank, whole (moe_tp = 1). The vocabulary 151936 is a "
             "multiple of 64, so no padding rows. The router (`mlp.gate`) is replicated: "
             "rank 0 holds the primary copy, ranks 1–3 replicas 1–3."))
    parts.append(_example(
        "DeepSeek-V3 at tp=8 ep=8 (ranks 0, 3 and 7 shown)", "deepseek_v3",
        Layout(tp=8, ep=8), [0, 3, 7],
        ["model.embed_tokens.weight",
         L + "0.self_attn.q_a_proj.weight",
         L + "0.self_attn.q_b_proj.weight",
         L + "0.self_attn.q_b_proj.weight_scale_inv",
         L + "0.self_attn.kv_b_proj.weight",
         L + "0.self_attn.o_proj.weight",
         L + "0.mlp.gate_proj.weight",
         L + "0.mlp.down_proj.weight_scale_inv",
         L + "3.mlp.shared_experts.down_proj.weight",
         L + "3.mlp.experts.0.down_proj.weight",
         ("layers.61.eh_proj.weight (MTP)", L + "61.eh_proj.weight")],
        layer_prefix=L + "3.mlp.",
        note="128 heads: 16 per rank for `q_b_proj`/`kv_b_proj` (by heads). MLA's "
             "a-projections are replicated. Layers 0–2 are dense (`first_k_dense_replace`); "
             "from layer 3 the 256 routed experts are placed 32 per ep rank. FP8 "
             "`weight_scale_inv` tensors follow their weight in 128×128 blocks (dense "
             "`down_proj` 18432/8 = 2304 columns = 18 blocks). The MTP layer 61 is left out "
             "unless `include_mtp=True`."))
    parts.append(_example(
        "Qwen3-30B-A3B at tp=2 dp=2 ep=4, experts spanning DP", "qwen3_moe",
        Layout(tp=2, dp=2, ep=4, ep_spans_dp=True), [0, 1, 2, 3],
        [L + "0.self_attn.q_proj.weight",
         L + "0.self_attn.o_proj.weight",
         L + "0.mlp.experts.40.up_proj.weight",
         "lm_head.weight"],
        layer_prefix=L + "0.mlp.",
        note="Dense tensors follow `tp_rank` and are replicated across the two DP replicas "
             "(ranks 2 and 3 hold replica 1 of what ranks 0 and 1 hold). Experts are placed "
             "over the MoE group of all 4 ranks (`m = dp_rank*tp + tp_rank`), like vLLM's "
             "`--enable-expert-parallel` with data parallelism."))
    parts.append(_example(
        "Vocabulary padding: bert-base-uncased at tp=2", "bert", Layout(tp=2), [0, 1],
        ["bert.embeddings.word_embeddings.weight",
         "bert.encoder.layer.0.attention.self.query.weight",
         "bert.encoder.layer.0.attention.output.dense.bias"],
        note="The 30522-row vocabulary is padded to 30528 (a multiple of 64) and split "
             "15264 rows per rank: rank 1 holds rows 15264–30521 and 6 zero padding rows "
             "(`--verify shapes` checks they are zero). The bias of a row-parallel layer is "
             "replicated."))
    parts.append(_pp_example())
    return "\n".join(parts)


def _pp_example() -> str:
    from coordloader.api import make_plan
    from coordloader.layout import Layout
    lines = ["#### Pipeline stages", "",
             "Layers per stage (`Layout.stage_layers`, vLLM's `get_pp_indices` split), and "
             "which stage holds the embedding, final norm and `lm_head`:", "",
             "| model, layout | layers per stage | `embed_tokens` on | `norm`, `lm_head` on |",
             "|---|---|---|---|"]
    for arch, name, layout in (("qwen3_moe", "Qwen3-30B-A3B (48 layers)", Layout(tp=2, pp=2)),
                               ("llama", "Llama-3-8B (32 layers)", Layout(pp=3)),
                               ("deepseek_v3", "DeepSeek-V3 (61 layers)", Layout(pp=4)),
                               ("deepseek_v3", "DeepSeek-V3, explicit split",
                                Layout(pp=4, pp_layers=(13, 16, 16, 16)))):
        cfg, meta = _meta(arch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_plan(meta, layout)
        S = layout.tp * layout.dp
        stages = layout.stage_layers(cfg["num_hidden_layers"])

        def holders(n):
            st = sorted({r // S for r in range(layout.world_size) if n in plan.rank(r).by_name()})
            return ", ".join(f"stage {s}" for s in st)
        rng = ", ".join(f"{r.start}–{r.stop - 1} ({len(r)})" for r in stages)
        lines.append(f"| {name}, `Layout({_layout_args(layout)})` | {rng} | "
                     f"{holders('model.embed_tokens.weight')} | "
                     f"{holders('model.norm.weight')}; {holders('lm_head.weight')} |")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- error examples


_COLLECTIVE_SNIPPET = textwrap.dedent("""
    import sys
    from coordloader.dist.collective import init_group, run_phase, exit_on_error
    from coordloader.errors import SaveError
    def work(rank):
        if rank == 1:
            raise SaveError("cannot create the dump file: Permission denied",
                            file="/dump/rank-00001.safetensors", rank=rank)
    with exit_on_error():
        g = init_group("gloo", timeout_s=float(sys.argv[1]))
        run_phase("dump", work, g, g.rank)
        g.close()
""")


def _run_ranks(world: int, start: list[int], timeout_s: float) -> str:
    """Run the snippet as plain processes (no torchrun); -> rank 0's stderr."""
    from coordloader.dist.collective import free_port
    port = free_port()
    procs = []
    for r in start:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, "-c", _COLLECTIVE_SNIPPET, str(timeout_s)],
                                      env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      text=True))
    errs = []
    for p in procs:
        try:
            _, e = p.communicate(timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, e = p.communicate()
        errs.append(e)
    lines = [ln for ln in errs[0].splitlines() if ln.startswith("coordloader:")]
    return lines[-1] if lines else errs[0].strip()


def _catch(fn) -> tuple[str, str]:
    from coordloader.errors import CoordloaderError
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except CoordloaderError as e:
        return type(e).__name__, str(e)
    raise RuntimeError(f"{fn} did not raise a CoordloaderError")


def error_examples() -> list[tuple[str, str, str]]:
    """[(error class, situation, message)], each produced by triggering the error."""
    import json

    from coordloader.api import make_plan
    from coordloader.layout import Layout
    from coordloader.loader import load, load_detailed
    from coordloader.planning.planner import meta_from_specs
    from coordloader.synth import synthesize

    out = []
    tmp = tempfile.mkdtemp(prefix="docgen-")
    try:
        ck = os.path.join(tmp, "ckpt")
        synthesize(ck, "llama", "tiny")

        def add(situation, fn):
            cls, msg = _catch(fn)
            out.append((cls, situation, msg.replace(tmp, "/tmp/x")))

        # -- CheckpointError
        bad = os.path.join(tmp, "short")
        os.mkdir(bad)
        with open(os.path.join(bad, "model.safetensors"), "wb") as f:
            f.write(b"\x01\x02")
        from coordloader.checkpoint.reader import read_checkpoint
        add("a truncated download (file shorter than its 8-byte header length)",
            lambda: read_checkpoint(bad))
        pk = os.path.join(tmp, "pickle")
        os.mkdir(pk)
        open(os.path.join(pk, "pytorch_model.bin"), "wb").close()
        add("a PyTorch pickle checkpoint", lambda: read_checkpoint(pk))
        miss = os.path.join(tmp, "missing")
        os.mkdir(miss)
        with open(os.path.join(miss, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors"}}, f)
        add("an index naming a shard that is not there", lambda: read_checkpoint(miss))
        add("a path that does not exist", lambda: read_checkpoint(os.path.join(tmp, "nope")))

        # -- PlanError
        llama = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 32,
                 "num_key_value_heads": 8}
        add("tp does not divide the attention heads (Llama-3-8B's 32 heads at tp=3)",
            lambda: make_plan(meta_from_specs(llama, [("model.layers.0.self_attn.q_proj.weight",
                                                       "BF16", (4096, 4096))]), Layout(tp=3)))
        add("ep does not divide the MoE group", lambda: Layout(tp=4, ep=3))
        add("an explicit expert map that misses experts",
            lambda: Layout(tp=2, ep=2, expert_placement=((0, 1), (2,))).check_experts(4))
        add("a tensor no rule matches",
            lambda: make_plan(meta_from_specs(llama, [("model.extra_adapter.weight", "BF16", (8, 8))]),
                              Layout(tp=2)))
        from coordloader.synth.archs import arch_tensors
        cfg, specs = arch_tensors("deepseek_v3", "full")
        sub = [s for s in specs if s[0].startswith("model.layers.0.mlp.down_proj")]
        add("a block-quantised (FP8) weight split off its 128-element blocks (DeepSeek-V3 "
            "dense MLP at tp=32: 18432/32 = 576)",
            lambda: make_plan(meta_from_specs(dict(cfg, num_hidden_layers=1), sub),
                              Layout(tp=32)))

        # -- LoadError
        add("a multi-rank layout in a single process without a process group or rank=",
            lambda: load(ck, Layout(tp=2)))
        add("an unknown verify mode", lambda: load(ck, Layout(), verify="bytes"))

        # -- VerifyError
        from coordloader.verify.checks import verify_rank
        res = load_detailed(ck, Layout(tp=2), rank=0, verify="none")
        t = dict(res.tensors)
        t.pop("model.norm.weight")
        add("a rank missing a tensor of its plan (`--verify shapes`)",
            lambda: verify_rank(t, res.plan, 0, mode="shapes"))
        from coordloader.verify.manifest import write_manifest
        write_manifest(res.meta)
        one = load_detailed(ck, Layout(), verify="none")
        bad_t = dict(one.tensors)
        w = bad_t["model.layers.1.self_attn.v_proj.weight"].clone()
        w[3, 5] += 1
        bad_t["model.layers.1.self_attn.v_proj.weight"] = w
        add("a tensor whose content differs from the checkpoint's manifest (one element "
            "changed; shapes still match, so only `--verify digest` or `full` sees it)",
            lambda: verify_rank(bad_t, one.plan, 0, mode="digest", meta=one.meta))

        # -- SaveError
        from coordloader.handoff.save import save
        add("saving over an existing checkpoint without overwrite=True",
            lambda: save(ck, one.tensors, one.plan, rank=0, config=ck))

        # -- CollectiveError (real processes over gloo)
        out.append(("CollectiveError", "one rank fails inside a phase (rank 1 cannot write "
                    "its dump); every rank reports it (message printed by rank 0)",
                    _run_ranks(2, [0, 1], 60.0)))
        out.append(("CollectiveError", "a rank never starts (WORLD_SIZE=2, only rank 0 "
                    "launched, timeout 3 s)", _run_ranks(2, [0], 3.0)))
    finally:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _normalise(msg: str) -> str:
    msg = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", msg)
    msg = re.sub(r"\b\d+\.\d+ s\b", "N s", msg)
    return msg


def errors_markdown() -> str:
    lines = []
    for cls, situation, msg in error_examples():
        lines += [f"- **{cls}** — {situation}:", "", "  ```text", "  " + _normalise(msg),
                  "  ```", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- API signatures

def resolve(dotted: str):
    """The object named ``dotted``: attributes from the package first (``coordloader.load``
    is the function the package exports), else the longest importable module prefix
    (``coordloader.digest.digest_local``, where the package's ``digest`` is a function)."""
    parts = dotted.split(".")
    try:
        obj = importlib.import_module(parts[0])
        for a in parts[1:]:
            obj = getattr(obj, a)
        return obj
    except AttributeError:
        pass
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for a in parts[i:]:
            obj = getattr(obj, a)
        return obj
    raise ImportError(dotted)


def signature_text(dotted: str) -> str:
    """``name(param, *, kw=default, ...)`` without annotations: what docs/api.md shows."""
    import inspect
    obj = resolve(dotted)
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    return dotted + str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


# --------------------------------------------------------------------------- sections

SECTIONS: dict[str, tuple[str, Callable[[], str]]] = {
    "layout-examples": ("layout.md", layout_examples),
    "error-examples": ("troubleshooting.md", errors_markdown),
}

_BEGIN = "<!-- docgen:begin {} -->"
_END = "<!-- docgen:end {} -->"


def replace_section(text: str, name: str, body: str, where: str = "") -> str:
    b, e = _BEGIN.format(name), _END.format(name)
    i, j = text.find(b), text.find(e)
    if i < 0 or j < i:
        raise ValueError(f"{where}: markers {b} ... {e} not found")
    return text[:i + len(b)] + "\n" + body.rstrip() + "\n" + text[j:]


def expected_files(names=None) -> dict[str, str]:
    """{path: expected full text} of every generated file/section (read from disk)."""
    want: dict[str, str] = {}
    if names is None or "cli" in names:
        want[os.path.join(DOCS, "cli.md")] = cli_markdown()
    for name, (fname, fn) in SECTIONS.items():
        if names is not None and name not in names:
            continue
        path = os.path.join(DOCS, fname)
        cur = want.get(path)
        if cur is None:
            with open(path, encoding="utf-8") as f:
                cur = f.read()
        want[path] = replace_section(cur, name, fn(), path)
    return want


def check(names=None) -> list[str]:
    """Unified diffs of every file that differs from what the code generates."""
    diffs = []
    for path, text in expected_files(names).items():
        try:
            with open(path, encoding="utf-8") as f:
                cur = f.read()
        except FileNotFoundError:
            cur = ""
        if cur != text:
            rel = os.path.relpath(path, REPO)
            diffs.append("".join(difflib.unified_diff(cur.splitlines(True), text.splitlines(True),
                                                      rel + " (committed)", rel + " (generated)")))
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/docgen.py",
                                 description="Regenerate docs/cli.md and the generated sections "
                                             "of docs/*.md from the code.")
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 and print a diff when anything drifted")
    ap.add_argument("--only", default=None, metavar="NAME,...",
                    help="cli, " + ", ".join(SECTIONS) + " (default: all)")
    a = ap.parse_args(argv)
    names = a.only.split(",") if a.only else None
    if a.check:
        diffs = check(names)
        for d in diffs:
            sys.stdout.write(d)
        if diffs:
            print("\ndocs drifted from the code: run python tools/docgen.py", file=sys.stderr)
        return 1 if diffs else 0
    for path, text in expected_files(names).items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(path, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
