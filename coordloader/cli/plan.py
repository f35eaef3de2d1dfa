"""``python -m coordloader.plan CKPT --tp 8 --ep 8 ...``: plan a layout, validate the
cover, print a per-rank table, optionally write the plan as JSON (docs/plan-schema.md).
Errors (bad layout, rules, checkpoint) print one line and exit 1, without a traceback
(usage errors: argparse's exit 2)."""
from __future__ import annotations

import argparse
import json
import sys

from coordloader.api import make_plan, read_json_file
from coordloader.checkpoint.fileio import write_output_file
from coordloader.checkpoint.reader import parse_strict_json, read_checkpoint
from coordloader.cli.common import refuse_checkpoint_file, refuse_over_inputs, run_command
from coordloader.errors import PlanError
from coordloader.layout import Layout
from coordloader.planning.cover import validate_cover
from coordloader.planning.placement import EXPERT_RE
from coordloader.planning.runs import groups_of
from coordloader.text import MAX_NAME_CHARS, ArgumentParser, clip, format_ranges, positive_count


def parse_placement(v: str):
    """--placement: linear | round_robin | an inline JSON map | FILE.json holding the map
    (a list of expert-id lists, one per ep rank, or an object with "expert_placement"/"map")."""
    if v in ("linear", "round_robin"):
        return v
    if v.lstrip()[:1] in ("[", "{"):
        try:
            m = parse_strict_json(v)
        except ValueError as e:   # bad syntax, a duplicate key, NaN
            raise PlanError(f"--placement: {v!r} is not valid JSON: {e}") from None
        except RecursionError:
            raise PlanError(f"--placement: {clip(repr(v), MAX_NAME_CHARS)} is nested too "
                            f"deeply (expected a list of expert-id lists)") from None
    else:
        m = read_json_file(v, "--placement file")
    if isinstance(m, dict):
        m = m.get("expert_placement", m.get("map"))
    if not isinstance(m, list) or not all(isinstance(x, list) and all(isinstance(e, int) for e in x)
                                          for x in m):
        raise PlanError(f"--placement: {v} must hold a list of expert-id lists, one per ep rank")
    return tuple(tuple(x) for x in m)


def parse_pp_layers(v: str | None) -> tuple[int, ...] | None:
    if not v:
        return None
    try:
        return tuple(int(x) for x in v.split(","))
    except ValueError:
        raise PlanError(f"--pp-layers must be comma-separated integers, got {v!r}") from None


def layout_from_args(a) -> Layout:
    """The Layout of the shared layout flags (--tp --pp --dp --ep --ep-spans-dp --placement
    --pp-layers --allow-uneven --include-mtp); used by the plan and load CLIs."""
    return Layout(tp=a.tp, pp=a.pp, dp=a.dp, ep=a.ep, ep_spans_dp=a.ep_spans_dp,
                  expert_placement=parse_placement(a.placement), pp_layers=parse_pp_layers(a.pp_layers),
                  allow_uneven=a.allow_uneven, include_mtp=a.include_mtp)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def ranges_str(ids) -> str:
    """Expert ids for a table cell."""
    return format_ranges(ids, empty="-", max_chars=40)


def rank_rows(plan, ranks=None) -> list[dict]:
    """Per-rank figures (of ``ranks``, default all): tensors, bytes held (local tensors,
    padding included), bytes to read (exact byte runs), read amplification (file span a
    one-range-per-slice reader would fetch / bytes to read; 1.00 for dim-0 slices, up to tp
    for dim-1 slices), experts."""
    rows = []
    span_cache: dict = {}
    for rp in (plan.ranks if ranks is None else [plan.rank(r) for r in ranks]):
        read = rp.bytes_to_read
        span = 0
        for t in rp.tensors:
            k = id(t.byte_runs)
            sp = span_cache.get(k)
            if sp is None:
                lo: dict = {}
                for g in groups_of(t.byte_runs):
                    a, b = g.src_span()
                    x = lo.get(g.file)
                    lo[g.file] = (a, b) if x is None else (min(x[0], a), max(x[1], b))
                sp = span_cache[k] = sum(b - a for a, b in lo.values())
            span += sp
        rows.append({"rank": rp.rank, "coords": dict(rp.coords), "tensors": len(rp.tensors),
                     "bytes_held": rp.bytes_held, "bytes_to_read": read,
                     "read_amplification": (span / read) if read else 1.0,
                     "experts": experts_held(rp)})
    return rows


def experts_held(rank_plan) -> list[int]:
    """Logical expert ids of which the rank holds (a part of) at least one tensor."""
    experts = set()
    for t in rank_plan.tensors:
        if t.strategy == "expert" or (t.strategy == "scale" and ".experts." in t.name):
            m = EXPERT_RE.search(t.name)
            if m:
                experts.add(int(m.group(1)))
            elif t.strategy == "expert":
                experts.update(p.src[0][0] for p in t.pieces)
    return sorted(experts)


def format_plan_table(plan, rank: int | None = None) -> str:
    # one rank's figures only: at 1024 ranks the others cost seconds
    rows = rank_rows(plan, None if rank is None else [rank])
    hdr = f"{'rank':>5} {'pp':>3} {'dp':>3} {'tp':>3} {'ep':>3} {'moe_tp':>6} {'tensors':>8} " \
          f"{'held':>11} {'to read':>11} {'amp':>5}  experts"
    lines = [f"plan {plan.digest()[:16]}  layout {plan.layout}  world {plan.world_size}", hdr]
    for r in rows:
        c = r["coords"]
        lines.append(f"{r['rank']:>5} {c['pp']:>3} {c['dp']:>3} {c['tp']:>3} {c['ep']:>3} "
                     f"{c['moe_tp']:>6} {r['tensors']:>8} {human(r['bytes_held']):>11} "
                     f"{human(r['bytes_to_read']):>11} {r['read_amplification']:>5.2f}  "
                     f"{ranges_str(r['experts'])}")
    tot = sum(r["bytes_to_read"] for r in rows)
    lines.append(f"total to read {human(tot)} over {len(rows)} ranks; excluded tensors: "
                 f"{len(plan.excluded)}" + (f" ({', '.join(plan.excluded[:3])}...)" if plan.excluded else ""))
    lines.append("amp: file span a reader taking one contiguous range per slice would fetch, "
                 "over the exact bytes to read (coordloader's engines read the exact runs)")
    if plan.load_groups:
        lines.append("load groups: " + "; ".join(f"{g.mode} {len(g.files)} files x {len(g.ranks)} ranks"
                                                  for g in plan.load_groups))
    return "\n".join(lines)


def add_layout_args(g) -> None:
    """The layout flags (read back by ``layout_from_args``) and the rule flags, shared by
    ``python -m coordloader.plan`` and ``coordloader.load`` so both CLIs take the same
    layout the same way. ``g``: a parser or an argument group."""
    for k, what in (("tp", "tensor"), ("pp", "pipeline"), ("dp", "data"), ("ep", "expert")):
        g.add_argument(f"--{k}", type=positive_count("ranks"), default=1,
                       help=f"{what}-parallel size (default 1)")
    g.add_argument("--ep-spans-dp", action="store_true",
                   help="the MoE group spans TP x DP ranks (vLLM --enable-expert-parallel with DP)")
    g.add_argument("--placement", default="linear",
                   help="expert placement: linear (vLLM), round_robin, or one expert-id list per "
                        "ep rank as inline JSON or a FILE.json (default linear)")
    g.add_argument("--pp-layers", default=None,
                   help="explicit layers per pipeline stage, comma separated (e.g. 13,12,12,11)")
    g.add_argument("--allow-uneven", action="store_true",
                   help="allow splits that do not divide (torch.chunk semantics)")
    g.add_argument("--include-mtp", action="store_true",
                   help="load DeepSeek MTP layers (index >= num_hidden_layers) and Qwen3-Next's "
                        "mtp.* draft tensors on the last stage")
    g.add_argument("--rules", default=None,
                   help="a preset name, or a JSON rule file overriding/extending the preset")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="the model's config.json, when the checkpoint directory has none (or to "
                        "use instead of its own)")
    g.add_argument("--replicate-unmatched", action="store_true",
                   help="hold tensors no rule matches whole on every rank (no sharding) "
                        "instead of failing")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m coordloader.plan",
                                description="Plan which slice of each tensor every rank holds.")
    p.add_argument("checkpoint", help="checkpoint directory")
    add_layout_args(p)
    p.add_argument("--rank", type=int, default=None, help="show only this rank")
    p.add_argument("--json", default=None,
                   help="write the plan (schema v1) to FILE ('-' = stdout, the table then "
                        "goes to stderr)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("plan", lambda: _run(args))


def _run(args) -> int:
    layout = layout_from_args(args)
    if args.rank is not None and not 0 <= args.rank < layout.world_size:
        raise PlanError(f"--rank {args.rank} outside world of size {layout.world_size} ({layout})")
    refuse_checkpoint_file(args.json, args.checkpoint, "--json")
    refuse_over_inputs(args.json, "--json", args)
    meta = read_checkpoint(args.checkpoint)
    plan = make_plan(meta, layout, args.rules, replicate_unmatched=args.replicate_unmatched,
                     config=args.config)
    validate_cover(plan, meta)
    if args.json and args.json != "-":
        # before the table: a reader of the table that stops early (| head) ended the
        # command at the print, the plan file never written.
        # temp file + rename: an interrupted write never leaves a torn plan file
        # a line of its own: through /dev/stdout the table followed on the same line
        write_output_file(args.json, json.dumps(plan.to_json()).encode() + b"\n", fsync=False)
    # with the plan on stdout the table goes to stderr, so stdout parses as JSON alone
    print(format_plan_table(plan, rank=args.rank),
          file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        json.dump(plan.to_json(), sys.stdout)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
