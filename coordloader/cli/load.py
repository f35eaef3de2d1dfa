"""`torchrun -m coordloader.load CKPT ...`: form the group from the environment, load this
rank's slices, verify, optionally dump and report."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Mapping

import torch

from coordloader.checkpoint.fileio import plain_output, write_output_file
from coordloader.checkpoint.identity import checkpoint_identity
from coordloader.checkpoint.reader import parse_strict_json
from coordloader.cli.common import (
    refuse_checkpoint_dir,
    refuse_checkpoint_file,
    refuse_over_inputs,
)
from coordloader.cli.plan import add_layout_args, experts_held, human, layout_from_args, ranges_str
from coordloader.dist import collective
from coordloader.engines import ENGINE_NAMES
from coordloader.errors import (
    CollectiveError,
    ConfigError,
    CoordloaderError,
    LoadError,
    SaveError,
    VerifyError,
)
from coordloader.handoff.dump import DUMP_NAME_RE, check_dump_target, dump_rank, remove_other_loads
from coordloader.layout import Layout
from coordloader.loader import VERIFY_MODES, load_detailed
from coordloader.text import ArgumentParser, positive_number

# a timeout of 0, negative, nan, inf or past a week would reach the store as a C++ error
# with a backtrace
seconds = positive_number("seconds", collective.MAX_TIMEOUT_S, collective.MIN_TIMEOUT_S)


def json_object(text: str) -> dict:
    """argparse type of --loader-config: parsed whatever the engine, so '{bad' is an error
    even when the engine that would read it is not chosen."""
    try:
        v = parse_strict_json(text)
    except ValueError as e:   # bad syntax, a duplicate key, NaN
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    except RecursionError:
        raise argparse.ArgumentTypeError("nested too deeply (expected a JSON object)") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(v).__name__}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m coordloader.load",
        description="Load a safetensors checkpoint onto every rank of a torch.distributed job "
                    "(run under torchrun: torchrun --nproc-per-node N -m coordloader.load CKPT "
                    "...). Each rank ends up with exactly its slices for the layout.")
    p.add_argument("checkpoint", help="checkpoint directory (or a .safetensors file)")
    add_layout_args(p.add_argument_group("layout"))
    e = p.add_argument_group("loading")
    e.add_argument("--engine", default="auto", choices=ENGINE_NAMES,
                   help="auto = instanttensor with CUDA and an NCCL group, else cpu (default auto)")
    e.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="where tensors go; cuda uses cuda:LOCAL_RANK (default: cuda when the "
                        "engine is instanttensor/auto and CUDA is available, else cpu)")
    e.add_argument("--loader-config", default=None, metavar="JSON", type=json_object,
                   help="instanttensor tuning, e.g. '{\"backend\": [\"URING\", \"AIO\"], "
                        "\"chunk_size\": 8388608, \"io_depth\": 64, \"buffer_size\": ...}'")
    e.add_argument("--verify", default="shapes", choices=VERIFY_MODES,
                   help="none, shapes (names/dtypes/shapes/zero padding; default), digest "
                        "(content digests vs the manifest; without one, replicas vs their "
                        "primaries only, said in a note), full (re-read and compare bytes)")
    e.add_argument("--timeout", type=seconds, default=600.0, metavar="S",
                   help="bound on every collective, seconds (default 600)")
    e.add_argument("--rank", type=int, default=None,
                   help="without torchrun: load this rank's share in a single process")
    o = p.add_argument_group("output")
    o.add_argument("--report", default=None, metavar="FILE",
                   help="write the per-rank summary (and the plan digest) as JSON to FILE "
                        "('-' = stdout, the table then goes to stderr)")
    o.add_argument("--dump", default=None, metavar="DIR",
                   help="write each rank's tensors to DIR/rank-00000.safetensors, ...")
    o.add_argument("--overwrite", action="store_true",
                   help="replace an existing --dump, with files of ranks past this layout (default: "
                        "refuse)")
    o.add_argument("--quiet", action="store_true", help="no progress bar, no summary table")
    return p


def summary_rows(per_rank: list[dict]) -> tuple[list[dict], dict]:
    total_held = sum(r["bytes_held"] for r in per_rank)
    total_read = sum(r["bytes_read"] for r in per_rank)
    wall = max((r["seconds"] for r in per_rank), default=0.0)
    totals = {"tensors": sum(r["tensors"] for r in per_rank), "bytes_held": total_held,
              "bytes_read": total_read, "seconds": wall,
              "gbps": total_held / wall / 1e9 if wall > 0 else 0.0,
              "read_amplification": total_read / total_held if total_held else 0.0}
    return per_rank, totals


def _coords_str(c: Mapping | None) -> str:
    if not c:
        return "-"
    return f"pp{c['pp']} dp{c['dp']} tp{c['tp']} ep{c['ep']}.{c['moe_tp']}"


def format_load_table(per_rank: list[dict], totals: dict) -> str:
    head = f"{'rank':>5} {'coords':<18} {'tensors':>8} {'held':>12} {'read':>12} " \
           f"{'read/held':>9} {'seconds':>8} {'GB/s':>7}  experts"
    lines = [head, "-" * len(head)]
    for r in per_rank:
        lines.append(f"{r['rank']:>5} {_coords_str(r.get('coords')):<18} {r['tensors']:>8} "
                     f"{human(r['bytes_held']):>12} "
                     f"{human(r['bytes_read']):>12} {r['read_amplification']:>9.3f} "
                     f"{r['seconds']:>8.3f} {r['gbps']:>7.2f}  {ranges_str(r.get('experts', []))}")
    lines.append("-" * len(head))
    lines.append(f"{'total':>5} {'':<18} {totals['tensors']:>8} "
                 f"{human(totals['bytes_held']):>12} "
                 f"{human(totals['bytes_read']):>12} {totals['read_amplification']:>9.3f} "
                 f"{totals['seconds']:>8.3f} {totals['gbps']:>7.2f}")
    lines.append("coords: ppS dpD tpT epE.M = pipeline stage S, data-parallel replica D, "
                 "tensor-parallel rank T, expert-parallel rank E and M its rank in the TP "
                 "split of each expert it owns; experts: ids the rank holds (part of)")
    return "\n".join(lines)


def _want_cuda(args) -> bool:
    return args.device == "cuda" or (args.device is None and args.engine in ("auto", "instanttensor")
                                     and torch.cuda.is_available())


def _init_from_env(args):
    """Form the group from torchrun's (or plain processes') environment: gloo for CPU,
    nccl for CUDA, device cuda:LOCAL_RANK. Returns (group handle or None, device)."""
    want_cuda = _want_cuda(args)
    if want_cuda and not torch.cuda.is_available():
        raise LoadError("--device cuda asked for, but CUDA is not available here")
    # read for CUDA only: a CPU run has no use for it, and a bad value refused before the
    # group formed left the other ranks to wait out --timeout for this one
    device = (torch.device("cuda", collective.env_int("LOCAL_RANK") or 0) if want_cuda
              else torch.device("cpu"))
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return None, device   # one process; half of the pair is init_group's to refuse
    g = collective.init_group("nccl" if want_cuda else "gloo", timeout_s=args.timeout)
    return (g if g.world > 1 else None), device


def _check_report_path(args) -> None:
    """ConfigError unless --report FILE may be written: not a file of the checkpoint, an
    input of this command or a rank's dump file, not a directory, in a directory that
    exists (found when the report is written, that cost the whole load first)."""
    if not args.report or args.report == "-":
        return
    refuse_checkpoint_file(args.report, args.checkpoint, "--report")
    refuse_over_inputs(args.report, "--report", args)
    if args.dump and (os.path.realpath(args.report) == os.path.realpath(args.dump) or (
            DUMP_NAME_RE.fullmatch(os.path.basename(args.report))
            and os.path.realpath(os.path.dirname(os.path.abspath(args.report)))
            == os.path.realpath(args.dump))):
        # a rank's dump file replaced by the report, exit 0
        raise ConfigError(f"--report {args.report} is a file of the --dump directory "
                          f"{args.dump}, where the ranks' tensors go; write it elsewhere",
                          file=args.report)
    if os.path.isdir(args.report):
        raise ConfigError(f"--report {args.report} is a directory; choose a file path",
                          file=args.report)
    parent = os.path.dirname(os.path.abspath(args.report))
    if not os.path.isdir(parent) and not (
            args.dump and os.path.realpath(parent) == os.path.realpath(args.dump)):
        # (the dump directory is made before the report is written)
        raise ConfigError(f"--report {args.report}: its directory does not exist",
                          file=args.report)


def _report_writable(args) -> bool:
    """Whether a failed load may write --report (the path itself passed its checks)."""
    try:
        _check_report_path(args)
    except CoordloaderError:
        return False
    return bool(args.report) and args.report != "-"


def _check_arguments(args, group) -> Layout:
    """The layout the arguments give, after the refusals that need no checkpoint read."""
    layout = layout_from_args(args)
    refuse_checkpoint_dir(args.dump, args.checkpoint, "--dump")
    if group is None or group.rank == 0:   # the one rank that writes it, on its own node
        _check_report_path(args)
        if (args.report and args.report != "-" and plain_output(args.report)
                and os.path.isdir(os.path.dirname(os.path.abspath(args.report)))):
            # replaced by the result when the load ends: a load killed before then (an
            # OOM kill, torchrun's SIGTERM after a peer died) left an earlier report
            # saying ok (in a --dump directory not made yet, there is none to leave; to a
            # descriptor, device or FIFO its reader would take both reports)
            _write_report(args.report, {
                "ok": False, "checkpoint": os.path.abspath(args.checkpoint),
                "layout": layout.to_dict(), "verify": args.verify,
                "error": {"type": "Unfinished", "message": "the load has not finished: it is "
                          "running, or it was killed before it could write its result"}})
    if args.dump and os.path.lexists(args.dump) and not os.path.isdir(args.dump):
        # found when the dump is written, it cost the whole load first
        raise ConfigError(f"--dump {args.dump} exists and is not a directory; choose a "
                          f"directory", file=args.dump)
    if group is not None:
        if group.world != layout.world_size:
            raise LoadError(f"launched with {group.world} ranks but the layout ({layout}) "
                            f"needs {layout.world_size} = pp*dp*tp; use --nproc-per-node "
                            f"{layout.world_size} (or change the layout)", rank=group.rank)
        if args.rank is not None:
            raise LoadError("--rank is for single-process use; under torchrun the rank "
                            "comes from the environment")
    return layout


def _failure_report(args, layout: Layout | None, e: BaseException) -> None:
    """--report of a failed load: the error, and a verify failure's whole list of problems
    (the message names five). Written over any earlier report, which would otherwise say
    ``ok`` of a load that failed; a report that cannot be written leaves ``e`` to say what
    failed."""
    cause = e.local_error if isinstance(e, CollectiveError) else e
    report = {"ok": False, "checkpoint": os.path.abspath(args.checkpoint),
              "layout": layout.to_dict() if layout is not None else None,
              "verify": args.verify, "error": {"type": type(e).__name__, "message": str(e)}}
    if isinstance(cause, VerifyError) and cause.report:
        report["verify_report"] = cause.report
    try:
        _write_report(args.report, report)
    except (CoordloaderError, OSError):
        pass


def _write_report(path: str, report: dict) -> None:
    """--report FILE, whole or not at all (a temporary renamed over it)."""
    try:
        write_output_file(path, json.dumps(report, indent=2, sort_keys=True,
                                           default=str).encode() + b"\n")
    except SaveError as e:
        raise LoadError(f"cannot write the report: {e.message}", file=path, rank=0) from None


def _run(args) -> int:
    group, layout = None, None
    try:
        group, device = _init_from_env(args)
        # in a phase: a rank refusing its own arguments (another --tp than the others, a
        # --report onto a checkpoint file) stopped before the group formed or outside
        # any phase, and the others waited out --timeout to call it absent or dead
        layout = collective.run_phase("arguments", _check_arguments, group, args, group)
        return _load(args, group, device, layout)
    except BaseException as e:   # Ctrl-C too: an earlier report would still say ok
        # outside any phase (a check load_detailed makes before its first, one between two):
        # the others name it at their next boundary, not once they have waited out
        # --timeout for this rank or called it dead
        collective.leave_failed(group, e)
        # rank 0 writes it; before the group formed, the process torchrun calls rank 0
        # (every rank writing one path would race on its temporary file)
        first = (group.rank == 0 if group is not None
                 else os.environ.get("RANK", "0").strip() in ("", "0"))
        if first and _report_writable(args):
            _failure_report(args, layout, e)
        raise
    finally:
        if group is not None:
            group.close()


def _load(args, group, device, layout: Layout) -> int:
    rank0 = group is None or group.rank == 0
    res = load_detailed(args.checkpoint, layout, group=group, rank=args.rank, device=device,
                        engine=args.engine, verify=args.verify, rules=args.rules,
                        progress=(not args.quiet) and rank0, loader_config=args.loader_config,
                        replicate_unmatched=args.replicate_unmatched, timeout=args.timeout,
                        config=args.config,
                        # the phases after load: a rank that dumps and one that does
                        # not would pair the dump with the summary's gather, and ranks
                        # dumping into different directories split one dump over them
                        agree={"--dump": os.path.abspath(args.dump) if args.dump
                               else None})
    mine = dict(res.stats.to_dict(), rank=res.rank, phases=res.phases,
                coords=dict(res.rank_plan.coords), experts=experts_held(res.rank_plan))
    if res.verify_report is not None:
        mine["verify"] = {k: v for k, v in res.verify_report.items()
                          if k in ("ok", "mode", "notes")}
    if args.dump:
        # every rank's refusal before any rank writes (after load_detailed has agreed
        # that every rank dumps): one refused while another wrote left a dump of two loads
        # another rank's file of another plan can only come from one process per rank
        # (--rank): in a group every rank writes its own file in this very step. Checked
        # here, once: dump_rank below is told not to again (alone=False). With it, the
        # files' identity (sampled data blocks too): one process per rank loading the
        # next step saved over the same headers is another load
        def check():
            # (in the phase: a file gone from one rank's copy since the load is named there)
            source = checkpoint_identity(res.meta.root, [f.name for f in res.meta.files],
                                         read_from=res.meta.files).digest()
            check_dump_target(args.dump, res.rank, layout.world_size, args.overwrite,
                              res.plan.digest() if group is None else None, source,
                              group=group is not None)
            return source
        source = collective.run_phase("dump-check", check, group)
        mine["dump"] = collective.run_phase("dump", lambda: dump_rank(
            args.dump, res.rank, res.tensors, plan_digest=res.plan.digest(),
            layout=layout.to_dict(), coords=dict(res.rank_plan.coords),
            overwrite=args.overwrite, world=layout.world_size, alone=False,
            source=source), group)
        if args.overwrite and group is not None:
            # every rank has written its own (the phase above agreed): what is not of this
            # load now is an earlier one's, left on a disk of some node's own
            collective.run_phase("dump-tidy", lambda: remove_other_loads(
                args.dump, res.rank, res.plan.digest(), source), group)
    # a phase like the others: a rank dying here is named, not a bare gloo timeout
    per_rank = collective.run_phase("summary", lambda: collective.gather_object(group, mine), group)
    def finish():
        if not rank0:
            return
        rows, totals = summary_rows(per_rank)
        # with the report on stdout the table goes to stderr, so stdout parses as JSON
        # alone (as plan --json -)
        out = sys.stderr if args.report == "-" else sys.stdout
        if not args.quiet:
            print(f"coordloader: {args.checkpoint} layout {layout} engine {res.stats.engine} "
                  f"verify {args.verify} plan {res.plan.digest()[:12]}", file=out)
            print(format_load_table(rows, totals), file=out, flush=True)
            vr = res.verify_report or {}
            if args.verify != "none" and vr:
                # the verdict is agreed (verify_rank gathers), so rank 0 speaks for all
                print(f"verify {args.verify}: passed on all {len(per_rank)} rank(s): "
                      f"{', '.join(vr.get('checks', []))}", file=out, flush=True)
                for note in vr.get("notes", []):
                    print(f"  note: {note}", file=out, flush=True)
        vr = res.verify_report or {}
        if (args.quiet and args.verify in ("digest", "full") and vr
                and "digest-manifest" not in vr.get("checks", [])):
            # the content was not proved against the manifest: said even when quiet
            print(f"coordloader: verify {args.verify}: {vr.get('manifest')}",
                  file=sys.stderr, flush=True)
        if args.report:
            report = {"ok": True, "checkpoint": os.path.abspath(args.checkpoint),
                      "layout": layout.to_dict(), "engine": res.stats.engine,
                      "verify": args.verify, "plan_digest": res.plan.digest(),
                      # the group's: the verify report sums every rank's stats
                      "verify_report": {k: v for k, v in (res.verify_report or {}).items()
                                        if k in ("ok", "mode", "checks", "manifest", "notes",
                                                 "stats")},
                      "ranks": rows, "totals": totals}
            if args.report == "-":
                sys.stdout.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
                sys.stdout.flush()
                return
            _write_report(args.report, report)

    # inside a phase: a failure on rank 0 (unwritable report) reaches every rank
    collective.run_phase("report", finish, group)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # single-process --rank N: the rank loaded is N (under torchrun: $RANK, as before)
    with collective.exit_on_error(rank=None if "RANK" in os.environ else args.rank):
        return _run(args)


if __name__ == "__main__":
    sys.exit(main())
