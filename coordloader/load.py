"""Load a checkpoint onto every rank of a ``torch.distributed`` group.

Library: ``load(ckpt, layout, ...) -> dict[name, Tensor]`` (this rank's tensors),
``load_detailed(...)`` (tensors, plan, stats), ``load_into(model_or_state_dict, ...)``.
Command line: ``torchrun --nproc-per-node N -m coordloader.load CKPT --tp .. --ep ..``.

Phases, each ended by an agreement among the ranks (a failure anywhere stops every rank
with the failing rank's message, never a hang):

1. metadata: each rank reads the headers of a share of the files (``files[r::world]``),
   ``all_gather_object``, every rank assembles the same ``CheckpointMeta``;
2. plan: every rank builds the (pure) plan; the ranks compare ``Plan.digest()`` before any
   tensor I/O;
3. load: the engine moves this rank's bytes;
4. verify: local check of names, dtypes, shapes, zero padding (``coordloader.verify`` for
   the global and digest modes).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from . import collective
from .gcpause import gc_paused
from .errors import CollectiveError, LoadError, PlanError, SaveError, VerifyError
from .layout import Layout
from .plan_cli import add_layout_args, experts_held, human, layout_from_args, ranges_str
from .safetensors_io import write_file_atomic
from .engines import ENGINE_NAMES, LoadStats, resolve_engine_name, select_engine

VERIFY_MODES = ("none", "shapes", "digest", "full")


@dataclass
class LoadResult:
    tensors: dict
    plan: Any
    meta: Any
    stats: LoadStats
    rank: int
    world: int
    phases: dict = field(default_factory=dict)   # phase -> seconds
    verify_report: dict | None = None

    @property
    def rank_plan(self):
        return self.plan.rank(self.rank)


# -- process-group plumbing ------------------------------------------------------------

def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() else None


def _resolve_group(group, rank, layout: Layout, timeout=None):
    """-> (group handle or None, rank, world). ``group`` (a ProcessGroup or a
    collective.Group) wins; else the default group when one is initialised; else
    single-process use (``rank`` given, or a world-1 layout)."""
    dist = _dist()
    world_needed = layout.world_size
    if group is None and dist is not None and dist.is_initialized():
        group = dist.group.WORLD
    if group is not None:
        handle = group if isinstance(group, collective.Group) else \
            collective.wrap_group(group, timeout_s=timeout)
        g_rank, g_world = handle.rank, handle.world
        if rank is not None and rank != g_rank:
            raise LoadError(f"rank={rank} given, but this process is rank {g_rank} of its group")
        if g_world != world_needed:
            raise LoadError(f"the process group has {g_world} ranks, the layout ({layout}) needs "
                            f"{world_needed} = pp*dp*tp", rank=g_rank)
        if g_world == 1:
            return None, 0, 1
        return handle, g_rank, g_world
    if rank is None:
        if world_needed != 1:
            raise LoadError(f"the layout ({layout}) has {world_needed} ranks but no process group "
                            f"is initialised: run under torchrun, pass group=, or pass rank= to "
                            f"load one rank's share in this process")
        rank = 0
    if not 0 <= rank < world_needed:
        raise LoadError(f"rank={rank} outside the layout's world of {world_needed} ({layout})")
    return None, rank, world_needed


def _with_test_hang(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """Test hook for the fault tests (tests/test_faults_mp.py): with
    COORDLOADER_TEST_HANG_PHASE=<phase> in this process's environment, the phase touches
    $COORDLOADER_TEST_HANG_FILE (if set) and then sleeps instead of returning, so the test
    can SIGKILL a rank that is provably in the middle of that phase. Unset = no effect."""
    if os.environ.get("COORDLOADER_TEST_HANG_PHASE") != name:
        return fn

    def hang():
        mark = os.environ.get("COORDLOADER_TEST_HANG_FILE")
        if mark:
            with open(mark, "w") as f:
                f.write(repr(time.time()))
        time.sleep(float(os.environ.get("COORDLOADER_TEST_HANG_S", "3600")))
        return fn()
    return hang


def run_phase(name: str, group, fn: Callable[[], Any]):
    """Run one step on every rank, then agree: if any rank failed, every rank raises
    (coordloader.collective.run_phase: a CollectiveError naming the failing rank and its
    message). Without a group the step's own error propagates."""
    return collective.run_phase(name, _with_test_hang(name, fn), group)


# -- phases -----------------------------------------------------------------------------

def read_metadata(ckpt, group, rank: int, world: int):
    """Headers split across ranks, gathered, assembled identically everywhere."""
    from .metadata import CheckpointMeta
    if isinstance(ckpt, CheckpointMeta):
        return ckpt
    from . import checkpoint
    if group is None:
        return checkpoint.read_checkpoint(os.fspath(ckpt))
    root = os.fspath(ckpt)

    def mine():
        disc = checkpoint.discover(root)
        return disc, [checkpoint.read_file_header(disc.root, n) for n in disc.files[rank::world]]

    disc, headers = run_phase("metadata-read", group, mine)

    def gather_and_assemble():
        # Inside a phase: every rank finished reading (the previous phase agreed), so all
        # of them reach this all_gather; one dying in it (or in assemble) is still named.
        gathered = collective.gather_object(group, headers)
        return checkpoint.assemble(disc.root, disc, [h for part in gathered for h in part])
    return run_phase("metadata-assemble", group, gather_and_assemble)


def agree_on_plan(plan, group, rank: int) -> None:
    """Every rank must have computed the same plan before any tensor I/O."""
    if group is None:
        return
    run_phase("plan-agree", group, lambda: _compare_plan_digests(plan, group, rank))


def _compare_plan_digests(plan, group, rank: int) -> None:
    digests = collective.gather_object(group, plan.digest())
    if len(set(digests)) > 1:
        by: dict[str, list[int]] = {}
        for r, x in enumerate(digests):
            by.setdefault(x, []).append(r)
        major = max(by.values(), key=len)
        odd = sorted(r for x, rs in by.items() if rs is not major for r in rs)
        desc = "; ".join(f"ranks {rs} -> {x[:12]}" for x, rs in by.items())
        raise PlanError(f"ranks disagree on the plan digest (differing ranks {odd}: {desc}); "
                        f"they see a different checkpoint, layout, rules or coordloader version",
                        rank=rank)


def run_verify(mode: str, tensors, plan, meta, rank: int, group) -> dict:
    """coordloader.verify.verify_rank (it gathers and agrees itself and raises VerifyError
    with the report on every rank), inside a phase."""
    if mode == "none":
        return {"ok": True, "mode": "none"}
    from .verify import verify_rank
    # verify_rank makes its own all_gather; inside a phase, a rank failing before it
    # (or dying in it) reaches every rank by name instead of as a bare gloo timeout.
    try:
        return run_phase("verify", group, lambda: verify_rank(
            tensors, plan, rank, mode=mode, meta=meta, group=group))
    except CollectiveError as e:
        # verify_rank reaches one verdict on every rank; the user asked for a verify
        # result, so give them the VerifyError (with its report), not the phase wrapper.
        local = getattr(e, "local_error", None)
        if isinstance(local, VerifyError):
            raise local from None
        raise


# -- the library call ---------------------------------------------------------------------

def _progress_callback(progress, total: int, rank: int):
    """``progress``: False/None, True (tqdm bar on this process), or a callable(bytes)."""
    if not progress:
        return None, None
    if callable(progress):
        return progress, None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, None
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, delay=1.0,
               desc=f"rank {rank} load", file=sys.stderr, leave=False)
    return bar.update, bar


def _load_device(engine: str, device) -> torch.device:
    """``device``, or for None: the current CUDA device when ``engine`` resolves to
    instanttensor and CUDA is available, else the CPU."""
    if device is None:
        name = resolve_engine_name(engine)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if name == "instanttensor" and torch.cuda.is_available() else torch.device("cpu"))
    return torch.device(device)


def load_detailed(ckpt, layout: Layout, *, group=None, rank: int | None = None, device=None,
                  engine: str = "auto", verify: str = "shapes", rules=None,
                  progress: Any = False, loader_config=None, out=None,
                  replicate_unmatched: bool = False, timeout: float | None = None) -> LoadResult:
    """``load`` returning the plan and the load statistics too."""
    if not isinstance(layout, Layout):
        raise PlanError(f"layout must be a coordloader.Layout, got {type(layout).__name__}")
    if verify not in VERIFY_MODES:
        raise LoadError(f"unknown verify mode {verify!r}; expected one of {', '.join(VERIFY_MODES)}")
    # no cyclic GC while loading (see coordloader.gcpause): a full collection over the
    # metadata, plan and tensors landed in whichever phase was running. Measured with the
    # pause narrowed to metadata + plan (torchrun, tp=2, qwen3_moe-small, medians of 5):
    # load 0.45 -> 0.56-0.59 s, digest-mode verify 0.11 -> 0.18 s, and a 0.14 s collection
    # right after load() returned
    with gc_paused():
        group, rank, world = _resolve_group(group, rank, layout, timeout)
        device = _load_device(engine, device)
        eng_name = resolve_engine_name(engine, device)
        phases: dict[str, float] = {}

        t = time.perf_counter()
        meta = read_metadata(ckpt, group, rank, world)
        phases["metadata"] = time.perf_counter() - t

        t = time.perf_counter()

        def build_plan():
            from .plan import make_plan
            kw = {"replicate_unmatched": True} if replicate_unmatched else {}
            return make_plan(meta, layout, rules, **kw)

        plan = run_phase("plan", group, build_plan)
        agree_on_plan(plan, group, rank)
        phases["plan"] = time.perf_counter() - t

        rank_plan = plan.rank(rank)
        cb, bar = _progress_callback(progress, rank_plan.bytes_to_read, rank)

        def do_load():
            eng = select_engine(eng_name, device, plan=plan, group=group.pg if group is not None else None,
                                loader_config=loader_config)
            return eng.load_rank(meta, rank_plan, device, progress=cb, out=out)

        t = time.perf_counter()
        try:
            tensors, stats = run_phase("load", group, do_load)
        finally:
            if bar is not None:
                bar.close()
        phases["load"] = time.perf_counter() - t

        t = time.perf_counter()
        report = run_verify(verify, tensors, plan, meta, rank, group)
        phases["verify"] = time.perf_counter() - t
        return LoadResult(tensors, plan, meta, stats, rank, world, phases, report)


def load(ckpt, layout: Layout, *, group=None, rank: int | None = None, device=None,
         engine: str = "auto", verify: str = "shapes", rules=None, timeout=None,
         progress: Any = False, loader_config=None) -> dict[str, torch.Tensor]:
    """This rank's tensors (checkpoint names, local shapes) for ``layout``.

    Uses ``group``, else the default process group when one is initialised, else loads
    the share of ``rank`` (or of the only rank of a world-1 layout) in this process.
    ``timeout`` (seconds) bounds how long a rank waits for the others at each phase
    boundary; collectives inside a phase are bounded by the group's own timeout."""
    return load_detailed(ckpt, layout, group=group, rank=rank, device=device, engine=engine,
                         verify=verify, rules=rules, progress=progress, timeout=timeout,
                         loader_config=loader_config).tensors


@dataclass
class LoadIntoResult:
    loaded: list          # target names filled
    skipped: list         # checkpoint tensors the name map dropped
    not_loaded: list      # target entries no checkpoint tensor filled
    stats: LoadStats | None = None


def _target_dict(target) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        d = dict(target.named_parameters())
        d.update(dict(target.named_buffers()))
        return d
    if isinstance(target, Mapping):
        return dict(target)
    raise LoadError(f"load_into needs a torch.nn.Module or a mapping of tensors, got "
                    f"{type(target).__name__}")


class _DirectDests:
    """``out=`` for load_detailed from load_into: checkpoint name -> the target tensor the
    engine fills in place (detached: parameters require grad), for targets that are
    contiguous, on the load device's type and claimed by no other name. The engine checks
    shape and dtype; everything else goes through a temporary and ``copy_``."""

    def __init__(self, dests: dict, mapf, device_type: str):
        self._dests, self._mapf, self._type = dests, mapf, device_type
        self._memo: dict[str, torch.Tensor | None] = {}
        self._claimed: set[str] = set()

    def __contains__(self, name: str) -> bool:
        if name not in self._memo:
            tgt = self._mapf(name)
            t = self._dests.get(tgt) if tgt is not None else None
            ok = (t is not None and tgt not in self._claimed and t.is_contiguous()
                  and t.device.type == self._type)
            if ok:
                self._claimed.add(tgt)
            self._memo[name] = t.detach() if ok else None
        return self._memo[name] is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        return self._memo[name]


def load_into(target, ckpt, layout: Layout, *, name_map=None, strict: bool = True,
              **load_kw) -> LoadIntoResult:
    """Load this rank's tensors straight into existing parameters/buffers.

    ``name_map``: a mapping or a callable from checkpoint name to target name (None drops
    the tensor). Shapes and dtypes must match exactly (a clear ``LoadError`` names both).
    With ``strict``, a checkpoint tensor of this rank with no target entry is an error.
    A destination that is contiguous and on the load device is filled by the engine
    directly; any other through a temporary and ``copy_``."""
    dests = _target_dict(target)
    if name_map is None:
        mapf = lambda n: n  # noqa: E731
    elif callable(name_map):
        mapf = name_map
    elif isinstance(name_map, Mapping):
        mapf = lambda n: name_map.get(n, n)  # noqa: E731
    else:
        raise LoadError("name_map must be a mapping or a callable")
    direct = _DirectDests(dests, mapf,
                          _load_device(load_kw.get("engine", "auto"), load_kw.get("device")).type)
    res = load_detailed(ckpt, layout, out=direct, **load_kw)
    loaded, skipped = [], []
    with torch.no_grad():
        for name, t in res.tensors.items():
            tgt = mapf(name)
            if tgt is None:
                skipped.append(name)
                continue
            dst = dests.get(tgt)
            if dst is None:
                if strict:
                    raise LoadError(f"no target entry {tgt!r} for this checkpoint tensor (pass "
                                    f"name_map= or strict=False)", tensor=name, rank=res.rank)
                skipped.append(name)
                continue
            if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
                raise LoadError(f"target {tgt!r} is {dst.dtype} {list(dst.shape)}, this rank's "
                                f"slice is {t.dtype} {list(t.shape)}", tensor=name, rank=res.rank)
            if t.data_ptr() != dst.data_ptr() or t.device != dst.device:
                dst.copy_(t)   # else the engine filled dst in place (out=direct)
            loaded.append(tgt)
    filled = set(loaded)
    return LoadIntoResult(loaded, skipped, sorted(k for k in dests if k not in filled), res.stats)


# -- command line -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m coordloader.load",
        description="Load a safetensors checkpoint onto every rank of a torch.distributed job "
                    "(run under torchrun: torchrun --nproc-per-node N -m coordloader.load CKPT "
                    "...). Each rank ends up with exactly its slices for the layout.")
    p.add_argument("checkpoint", help="checkpoint directory (or a .safetensors file)")
    add_layout_args(p.add_argument_group("layout"))
    e = p.add_argument_group("loading")
    e.add_argument("--engine", default="auto", choices=ENGINE_NAMES,
                   help="auto = instanttensor with CUDA, else cpu (default auto)")
    e.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="where tensors go; cuda uses cuda:LOCAL_RANK (default: cuda when the "
                        "engine is instanttensor/auto and CUDA is available, else cpu)")
    e.add_argument("--loader-config", default=None, metavar="JSON",
                   help="instanttensor tuning, e.g. '{\"backend\": [\"URING\", \"AIO\"], "
                        "\"chunk_size\": 8388608, \"io_depth\": 64, \"buffer_size\": ...}'")
    e.add_argument("--verify", default="shapes", choices=VERIFY_MODES,
                   help="none, shapes (names/dtypes/shapes/zero padding; default), digest "
                        "(content digests vs the manifest), full (re-read and compare bytes)")
    e.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="bound on every collective, seconds (default 600)")
    e.add_argument("--rank", type=int, default=None,
                   help="without torchrun: load this rank's share in a single process")
    o = p.add_argument_group("output")
    o.add_argument("--report", default=None, metavar="FILE",
                   help="write the per-rank summary (and the plan digest) as JSON")
    o.add_argument("--dump", default=None, metavar="DIR",
                   help="write each rank's tensors to DIR/rank-00000.safetensors, ...")
    o.add_argument("--overwrite", action="store_true",
                   help="replace existing --dump files (default: refuse)")
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


def format_table(per_rank: list[dict], totals: dict) -> str:
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
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if "WORLD_SIZE" not in os.environ:
        return None, device
    g = collective.init_group("nccl" if want_cuda else "gloo", timeout_s=args.timeout)
    return (g if g.world > 1 else None), device


def _run(args) -> int:
    layout = layout_from_args(args)
    mark = os.environ.get("COORDLOADER_TEST_START_FILE")
    if mark:   # test hook: when this rank is past imports, before any group formation
        with open(mark, "w") as f:
            f.write(repr(time.time()))
    group, device = _init_from_env(args)
    try:
        if group is not None:
            if group.world != layout.world_size:
                raise LoadError(f"launched with {group.world} ranks but the layout ({layout}) "
                                f"needs {layout.world_size} = pp*dp*tp; use --nproc-per-node "
                                f"{layout.world_size} (or change the layout)", rank=group.rank)
            if args.rank is not None:
                raise LoadError("--rank is for single-process use; under torchrun the rank "
                                "comes from the environment")
        rank0 = group is None or group.rank == 0
        res = load_detailed(args.checkpoint, layout, group=group, rank=args.rank, device=device,
                            engine=args.engine, verify=args.verify, rules=args.rules,
                            progress=(not args.quiet) and rank0, loader_config=args.loader_config,
                            replicate_unmatched=args.replicate_unmatched, timeout=args.timeout)
        mine = dict(res.stats.to_dict(), rank=res.rank, phases=res.phases,
                    coords=dict(res.rank_plan.coords), experts=experts_held(res.rank_plan))
        if res.verify_report is not None:
            mine["verify"] = {k: v for k, v in res.verify_report.items()
                              if k in ("ok", "mode", "notes", "stats")}
        if args.dump:
            from .dump import dump_rank
            mine["dump"] = run_phase("dump", group, lambda: dump_rank(
                args.dump, res.rank, res.tensors, plan_digest=res.plan.digest(),
                layout=layout.to_dict(), coords=dict(res.rank_plan.coords),
                overwrite=args.overwrite))
        # a phase like the others: a rank dying here is named, not a bare gloo timeout
        per_rank = run_phase("summary", group, lambda: collective.gather_object(group, mine))
        def finish():
            if not rank0:
                return
            rows, totals = summary_rows(per_rank)
            if not args.quiet:
                print(f"coordloader: {args.checkpoint} layout {layout} engine {res.stats.engine} "
                      f"verify {args.verify} plan {res.plan.digest()[:12]}")
                print(format_table(rows, totals), flush=True)
                vr = res.verify_report or {}
                if args.verify != "none" and vr:
                    # the verdict is agreed (verify_rank gathers), so rank 0 speaks for all
                    print(f"verify {args.verify}: passed on all {len(per_rank)} rank(s): "
                          f"{', '.join(vr.get('checks', []))}", flush=True)
                    for note in vr.get("notes", []):
                        print(f"  note: {note}", flush=True)
            if args.report:
                report = {"checkpoint": os.path.abspath(args.checkpoint),
                          "layout": layout.to_dict(), "engine": res.stats.engine,
                          "verify": args.verify, "plan_digest": res.plan.digest(),
                          "verify_report": {k: v for k, v in (res.verify_report or {}).items()
                                            if k in ("ok", "mode", "checks", "manifest", "notes")},
                          "ranks": rows, "totals": totals}
                try:
                    write_file_atomic(args.report,
                                      json.dumps(report, indent=2, sort_keys=True).encode())
                except SaveError as e:
                    raise LoadError(f"cannot write the report: {e.message}", file=args.report,
                                    rank=0) from None

        # inside a phase: a failure on rank 0 (unwritable report) reaches every rank
        run_phase("report", group, finish)
        return 0
    finally:
        if group is not None:
            group.close()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with collective.exit_on_error():
        return _run(args)


if __name__ == "__main__":
    sys.exit(main())
