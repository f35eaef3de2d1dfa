"""Load a checkpoint onto every rank of a ``torch.distributed`` group.

Library: ``load(ckpt, layout, ...) -> dict[name, Tensor]`` (this rank's tensors),
``load_detailed(...)`` (tensors, plan, stats), ``load_into(model_or_state_dict, ...)``.
Command line: ``torchrun --nproc-per-node N -m coordloader.load CKPT --tp .. --ep ..``.

Phases, each ended by an agreement among the ranks (a failure anywhere stops every rank
with the failing rank's message, never a hang):

1. metadata: each rank reads the headers of a share of the files (``files[r::world]``),
   ``all_gather_object``, every rank assembles the same ``CheckpointMeta``;
2. plan: every rank builds the (pure) plan; the ranks compare ``Plan.digest()`` and their
   own fingerprints of the files (``checkpoint.identity``, read in phase 1) before any
   tensor I/O;
3. load: the engine moves this rank's bytes;
4. verify: local check of names, dtypes, shapes, zero padding (``coordloader.verify`` for
   the global and digest modes).
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch

from coordloader.api import make_plan, read_config
from coordloader.checkpoint import reader as checkpoint
from coordloader.checkpoint.dtypes import torch_dtype
from coordloader.checkpoint.identity import CheckpointIdentity, checkpoint_identity, identity_mismatch
from coordloader.checkpoint.metadata import CheckpointMeta
from coordloader.dist import collective
from coordloader.engines import (
    LoadStats,
    check_disjoint,
    host_default_device,
    refuse_layout,
    refuse_wrapper,
    require_tensor,
    resolve_engine_name,
    select_engine,
    uninitialized,
    writable,
)
from coordloader.errors import (
    CheckpointError,
    CollectiveError,
    ConfigError,
    LoadError,
    PlanError,
    VerifyError,
)
from coordloader.gcpause import gc_paused
from coordloader.layout import Layout, as_rank
from coordloader.planning.model import RankPlan, TensorSlice
from coordloader.text import MAX_NAME_CHARS, clip, format_ranges, format_ranks
from coordloader.verify.checks import MODES, digest_workers, verify_rank
from coordloader.verify.manifest import MANIFEST_NAME

VERIFY_MODES = MODES   # the command line and load() accept exactly verify's modes


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


def _resolve_group(group, rank, layout: Layout, stack: contextlib.ExitStack, timeout=None):
    """-> (group handle or None, rank, world). ``group`` (a ProcessGroup or a
    collective.Group) wins; else the default group when one is initialised; else
    single-process use (``rank`` given, or a world-1 layout). A process group is adopted
    on ``stack``: closed when it unwinds, also when a check here refuses the group."""
    dist = _dist()
    if group is None and dist is not None and dist.is_initialized():
        group = dist.group.WORLD
    handle = None if group is None else stack.enter_context(collective.adopted(group, timeout))
    # checked once adopted: a rank refusing its arguments alone then reaches the others
    # at their first boundary, and every rank's adoption stays in step for the next call
    if not isinstance(layout, Layout):
        raise PlanError(f"layout must be a coordloader.Layout, got {type(layout).__name__}")
    world_needed = layout.world_size
    if rank is not None:
        rank = as_rank(rank, LoadError)
    if handle is not None:
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


# Called with the phase's name on this rank as each phase of load() starts, before its
# work. Empty in normal use; the fault tests append one to hold a rank inside a phase so
# it can be killed there (tests/rank_driver.py).
PHASE_HOOKS: list[Callable[[str], None]] = []


def _phase(name: str, fn: Callable[[], Any], group):
    """``collective.run_phase`` (every rank runs ``fn``, then they agree), after the
    PHASE_HOOKS."""
    def step():
        for hook in PHASE_HOOKS:
            hook(name)
        return fn()
    return collective.run_phase(name, step if PHASE_HOOKS else fn, group)


# -- phases -----------------------------------------------------------------------------

class _MetaShare(NamedTuple):
    """What a rank puts into the metadata-assemble gather: what it was handed (``"path"``
    or ``"meta"``) and, for a path, the headers it read and the digest of its own
    fingerprint of every file."""
    source: str
    headers: list | None
    identity: str | None = None


def read_metadata(ckpt, group, rank: int, world: int) -> tuple[CheckpointMeta,
                                                               CheckpointIdentity | None]:
    """Headers split across ranks, gathered, assembled identically everywhere; and this
    rank's own fingerprint of every file (None in one process), for ``agree_on_plan``.
    A path and a ``CheckpointMeta`` run the same phases, so ranks handed different kinds
    meet in the same gather and are named there."""
    if isinstance(ckpt, CheckpointMeta):
        if group is None:
            return ckpt, None
        identity = _phase("metadata-read", lambda: checkpoint_identity(
            ckpt.root, [f.name for f in ckpt.files], [MANIFEST_NAME], read_from=ckpt.files),
            group)

        def agree():
            _same_source(collective.gather_object(group, _MetaShare("meta", None)), rank)
            return ckpt
        return _phase("metadata-assemble", agree, group), identity
    if group is None:
        return checkpoint.read_checkpoint(checkpoint.checkpoint_path(ckpt)), None
    root = checkpoint.checkpoint_path(ckpt)

    def mine():
        disc = checkpoint.discover(root)
        side = [MANIFEST_NAME] + ([disc.index_file] if disc.index_file else [])
        return (disc, [checkpoint.read_file_header(disc.root, n) for n in disc.files[rank::world]],
                checkpoint_identity(disc.root, disc.files, side))

    disc, headers, identity = _phase("metadata-read", mine, group)

    def gather_and_assemble():
        # Inside a phase: every rank finished reading (the previous phase agreed), so all
        # of them reach this all_gather; one dying in it (or in assemble) is still named.
        gathered = collective.gather_object(group, _MetaShare("path", headers,
                                                              identity.digest()))
        _same_source(gathered, rank)
        if len({part.identity for part in gathered}) > 1:
            # nodes' copies differ (a file more or less, another split, other bytes): named
            # by file and rank before this rank's index is checked against the others'
            # headers, which blamed whichever copy the index disagreed with
            mismatch = identity_mismatch(collective.gather_object(group, identity))
            if mismatch:
                raise CheckpointError(mismatch, rank=rank)
        return checkpoint.assemble(disc.root, disc,
                                   [h for part in gathered for h in part.headers])
    return _phase("metadata-assemble", gather_and_assemble, group), identity


def _same_source(gathered: list[_MetaShare], rank: int) -> None:
    """ConfigError unless every rank was handed the same kind of checkpoint: a path's
    headers are split across the ranks, so a rank handed metadata holds no share of them
    (the path's ranks waited for it in this gather until the process group's timeout)."""
    by: dict[str, list[int]] = {}
    for r, share in enumerate(gathered):
        by.setdefault(share.source, []).append(r)
    if len(by) > 1:
        raise ConfigError(f"ranks disagree on the checkpoint they were handed: "
                          f"{format_ranks(by['path'])} passed a path, {format_ranks(by['meta'])} a "
                          f"CheckpointMeta; pass the same kind on every rank", rank=rank)


# what lays out instanttensor's chunks, and so its collectives: as options and variables
_COLLECTIVE_OPTIONS = ("chunk_size", "concurrency")
_COLLECTIVE_ENV = ("INSTANTTENSOR_CHUNK_SIZE", "INSTANTTENSOR_CONCURRENCY")


def _tuning_seen(loader_config) -> str:
    """The options of ``loader_config`` that shape the engine's collectives, as the ranks
    compare them: parsed JSON text and a mapping alike, in key order (None and "" as {});
    text that is no JSON object as it is (refused later)."""
    cfg = loader_config if loader_config not in (None, "") else {}
    if isinstance(cfg, str):
        try:
            cfg = checkpoint.parse_strict_json(cfg)
        except ValueError:
            return cfg
    if not isinstance(cfg, Mapping):
        return repr(cfg)
    try:
        return json.dumps({k: cfg[k] for k in _COLLECTIVE_OPTIONS if k in cfg},
                          sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return repr(cfg)


def agree_on_plan(plan, group, rank: int, identity: CheckpointIdentity | None = None,
                  options: Mapping[str, Any] | None = None,
                  config_of: Callable[[], Mapping | None] | None = None) -> None:
    """Every rank must have computed the same plan from the same checkpoint (its own
    fingerprint ``identity`` of the files), with the same ``options`` (settings outside
    the plan that decide which phases and collectives a rank makes: verify mode, engine,
    entry point), before any tensor I/O. ``config_of()``: the model config the plan was
    made with (asked for only when the plans differ), named when it differs too."""
    if group is None:
        return
    _phase("plan-agree", lambda: _compare_plan_digests(plan, group, rank, identity, options,
                                                       config_of), group)


def _config_digest(config: Mapping | None) -> str | None:
    try:
        return hashlib.sha256(json.dumps(config, sort_keys=True, default=repr).encode()
                              ).hexdigest()[:12] if config is not None else None
    except (TypeError, ValueError):
        return repr(config)[:40]


def _compare_plan_digests(plan, group, rank: int, identity: CheckpointIdentity | None,
                          options: Mapping[str, Any] | None = None,
                          config_of: Callable[[], Mapping | None] | None = None) -> None:
    opts = tuple(sorted((options or {}).items()))
    triples = collective.gather_object(group, (plan.digest(),
                                               identity.digest() if identity else None, opts))
    if len({i for _, i, _ in triples}) > 1:
        # the root cause of a plan difference too, so named first; the full fingerprints
        # travel only now, when they are needed to name the file
        mismatch = identity_mismatch(collective.gather_object(group, identity))
        if mismatch:
            raise CheckpointError(mismatch, rank=rank)
    if any(o != triples[0][2] for _, _, o in triples):   # values need not be hashable
        # a rank verifying in another mode (or not at all), or reading with an engine that
        # makes other collectives, would pass its phases with the others' data crossed
        # (or claim a check it never made on some ranks): stop before any tensor I/O
        diffs = collective.options_disagreement([dict(o) for _, _, o in triples])
        raise ConfigError(f"ranks disagree on their options ({diffs}); give every rank the "
                          f"same options", rank=rank)
    digests = [p for p, _, _ in triples]
    if len(set(digests)) > 1:
        by: dict[str, list[int]] = {}
        for r, x in enumerate(digests):
            by.setdefault(x, []).append(r)
        major = max(by.values(), key=len)
        odd = sorted(r for x, rs in by.items() if rs is not major for r in rs)
        desc = collective.options_disagreement([{"plan digest": x} for x in digests],
                                               show=lambda x: repr(x[:12]))
        # the files agree (compared above): a node's own config.json (or --config) is the
        # likeliest cause, and not in the files' fingerprint (fields that change no
        # weight may differ)
        configs = collective.gather_object(
            group, _config_digest(config_of()) if config_of is not None else None)
        if len(set(configs)) > 1:
            cause = ("the model config (config.json, or --config / config=) differs between "
                     "ranks (" + collective.options_disagreement(
                         [{"config digest": c} for c in configs]) +
                     "); give every node the same config")
        else:
            cause = "they see a different checkpoint, layout, rules or coordloader version"
        raise PlanError(f"ranks disagree on the plan digest (differing {format_ranks(odd)}; {desc}); "
                        f"{cause}", rank=rank)


def _refuse_unfilled_out(tensors, out, rank_plan, engine: str, rank: int) -> None:
    """LoadError where the engine returned, for an ``out=`` destination, a tensor that is
    not over that destination's memory: verify checks what the engine returned, and the
    caller's tensor would keep what it held (every engine fills ``out`` in place)."""
    for ts in rank_plan.tensors:
        if ts.name not in out:
            continue
        got, want = tensors.get(ts.name), out[ts.name]
        if got is want:
            continue
        if (got is None or got.device != want.device or got.data_ptr() != want.data_ptr()
                or got.shape != want.shape or got.stride() != want.stride()):
            raise LoadError(f"the {engine} engine did not load into the out= destination "
                            f"(it returned a tensor of its own), which keeps what it held",
                            tensor=ts.name, rank=rank)


def run_verify(mode: str, tensors, plan, meta, rank: int, group) -> dict:
    """coordloader.verify.verify_rank (it gathers and agrees itself and raises VerifyError
    with the report on every rank), inside a phase."""
    if mode == "none":
        return {"ok": True, "mode": "none"}

    # verify_rank makes its own all_gather; inside a phase, a rank failing before it
    # (or dying in it) reaches every rank by name instead of as a bare gloo timeout.
    try:
        # agreed: the mode at plan-agree, the manifest's bytes with the files' identity
        return _phase("verify", lambda: verify_rank(
            tensors, plan, rank, mode=mode, meta=meta, group=group, agreed=True), group)
    except CollectiveError as e:
        # verify_rank reaches one verdict on every rank; the user asked for a verify
        # result, so give them the VerifyError (with its report), not the phase wrapper.
        local = e.local_error
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


def _load_device(engine: str, device, rank: int | None = None) -> torch.device:
    """``device``, or for None: the current CUDA device when ``engine`` resolves to
    instanttensor and CUDA is available, else the CPU."""
    if device is None:
        name = resolve_engine_name(engine)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if name == "instanttensor" and torch.cuda.is_available() else torch.device("cpu"))
    try:
        dev = torch.device(device)
        # an unavailable device failed only after the whole rank had been read, with
        # torch's bare AssertionError / RuntimeError
        if dev.type == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            # a count of 0 while CUDA says it is available is no count (a stand-in CUDA,
            # as tests set up): only a known count refuses an index past it
            if dev.index is not None and 0 < n <= dev.index:
                raise RuntimeError(f"this machine has {n} CUDA device(s)")
        elif dev.type == "meta":
            # read in full, then moved to a device that keeps no data: tensors of the right
            # shapes and dtypes without the checkpoint's bytes, and a passing "shapes" check
            raise RuntimeError("the meta device holds no data, so nothing loaded onto it "
                               "would hold the checkpoint's bytes; load onto cpu or cuda")
        elif dev.type != "cpu":
            torch.empty(0, device=dev)
    # ImportError: a backend name torch knows but has no module for ('privateuseone')
    except (RuntimeError, TypeError, AssertionError, ValueError, ImportError) as e:
        raise LoadError(f"device {device!r} is not usable here: {e}", rank=rank) from None
    return dev


def load_detailed(ckpt, layout: Layout, *, group=None, rank: int | None = None, device=None,
                  engine: str = "auto", verify: str = "shapes", rules=None,
                  progress: Any = False, loader_config=None, out=None,
                  replicate_unmatched: bool = False, timeout: float | None = None,
                  config=None, agree: Mapping[str, Any] | None = None) -> LoadResult:
    """``load`` returning the plan and the load statistics too. ``agree``: more settings
    every rank must share (a command's own options), compared with the verify mode and
    engine before any tensor I/O."""
    return _load_detailed(ckpt, layout, group=group, rank=rank, device=device, engine=engine,
                          verify=verify, rules=rules, progress=progress,
                          loader_config=loader_config, out=out,
                          replicate_unmatched=replicate_unmatched, timeout=timeout,
                          config=config, agree=agree)


def _load_detailed(ckpt, layout: Layout, *, group=None, rank: int | None = None, device=None,
                   engine: str = "auto", verify: str = "shapes", rules=None,
                   progress: Any = False, loader_config=None, out=None,
                   replicate_unmatched: bool = False, timeout: float | None = None,
                   config=None, agree: Mapping[str, Any] | None = None,
                   prepare: Callable[[int, torch.device], Any] | None = None,
                   check: Callable[[RankPlan], None] | None = None,
                   call: str = "load") -> LoadResult:
    """load_detailed; ``prepare(rank, device) -> out`` (load_into's checks of its own
    arguments) runs once the group is adopted, like the checks here; ``check(rank_plan, meta)``
    (load_into's targets against the plan) in a phase of its own before the load;
    ``call``: the entry point, agreed on with the options."""
    # no cyclic GC while loading (see coordloader.gcpause): a full collection over the
    # metadata, plan and tensors landed in whichever phase was running. Measured with the
    # pause narrowed to metadata + plan (torchrun, tp=2, qwen3_moe-small, medians of 5):
    # load 0.45 -> 0.56-0.59 s, digest-mode verify 0.11 -> 0.18 s, and a 0.14 s collection
    # right after load() returned
    with gc_paused(), host_default_device(), contextlib.ExitStack() as stack:
        group, rank, world = _resolve_group(group, rank, layout, stack, timeout)
        bad = collective.timeout_problem(timeout) if group is None else None
        if bad:   # (a group adopted has refused it on every rank already)
            raise ConfigError(bad, rank=rank)
        if verify not in VERIFY_MODES:
            raise LoadError(f"unknown verify mode {verify!r}; expected one of "
                            f"{', '.join(VERIFY_MODES)}", rank=rank)
        if verify in ("digest", "full"):
            digest_workers()   # a bad setting is one, not a verify failure after the load
        device = _load_device(engine, device, rank)
        if prepare is not None:
            out = prepare(rank, device)
        # a mapping in all but its type (nn.ParameterDict: it has keys) fills as one
        elif not (out is None or isinstance(out, Mapping) or hasattr(out, "keys")):
            raise LoadError(f"out= must be a mapping of checkpoint name to tensor, got "
                            f"{type(out).__name__}", rank=rank)
        eng_name = resolve_engine_name(engine, device, group.pg if group is not None else None)
        phases: dict[str, float] = {}

        t = time.perf_counter()
        meta, identity = read_metadata(ckpt, group, rank, world)
        phases["metadata"] = time.perf_counter() - t

        t = time.perf_counter()

        def build_plan():
            kw = {"replicate_unmatched": True} if replicate_unmatched else {}
            return make_plan(meta, layout, rules, config=config, **kw)

        plan = _phase("plan", build_plan, group)
        # the entry point too: load_into makes a targets phase that load does not, and the
        # ranks would meet in different phases, named only after the whole timeout
        # and the engine's tuning that shapes its collectives: instanttensor's group mode
        # lays out its chunks and all-gathers from chunk_size x concurrency x world, so
        # ranks tuned apart would meet in mismatched ones (a backend, an I/O depth or
        # debug logging of a node's own may differ)
        tuning = {"loader_config": _tuning_seen(loader_config)}
        if eng_name == "instanttensor":
            tuning["INSTANTTENSOR_*"] = {k: os.environ.get(k) for k in _COLLECTIVE_ENV}
        agree_on_plan(plan, group, rank, identity,
                      dict(agree or {}, verify=verify, engine=eng_name, call=call, **tuning),
                      config_of=lambda: meta.config if config is None else read_config(config))
        rank_plan = plan.rank(rank)
        if check is not None:
            _phase("targets", lambda: check(rank_plan, meta), group)
        phases["plan"] = time.perf_counter() - t

        cb, bar = _progress_callback(progress, rank_plan.bytes_to_read, rank)

        def do_load():
            eng = select_engine(eng_name, device, plan=plan, group=group.pg if group is not None else None,
                                loader_config=loader_config)
            tensors, stats = eng.load_rank(meta, rank_plan, device, progress=cb, out=out)
            if out is not None:
                _refuse_unfilled_out(tensors, out, rank_plan, eng.name, rank)
            return tensors, stats

        t = time.perf_counter()
        try:
            tensors, stats = _phase("load", do_load, group)
        finally:
            if bar is not None:
                bar.close()
            if out is not None:
                # written in place behind autograd's back (preadv, numpy): a graph that
                # saved a destination's old value must refuse to backpropagate through
                # the new one, as it does after copy_; a failed load wrote some of them too
                filled = [out[ts.name] for ts in rank_plan.tensors if ts.name in out]
                torch.autograd.graph.increment_version(
                    [t for t in filled if isinstance(t, torch.Tensor)])
        phases["load"] = time.perf_counter() - t

        t = time.perf_counter()
        report = run_verify(verify, tensors, plan, meta, rank, group)
        phases["verify"] = time.perf_counter() - t
        return LoadResult(tensors, plan, meta, stats, rank, world, phases, report)


def load(ckpt, layout: Layout, *, group=None, rank: int | None = None, device=None,
         engine: str = "auto", verify: str = "shapes", rules=None, timeout=None,
         progress: Any = False, loader_config=None, config=None) -> dict[str, torch.Tensor]:
    """This rank's tensors (checkpoint names, local shapes) for ``layout``.

    Uses ``group``, else the default process group when one is initialised, else loads
    the share of ``rank`` (or of the only rank of a world-1 layout) in this process.
    ``timeout`` (seconds) bounds how long a rank waits for the others at each phase
    boundary; collectives inside a phase are bounded by the group's own timeout.
    ``config``: the model's config.json (a path or a dict) when the checkpoint has none."""
    return load_detailed(ckpt, layout, group=group, rank=rank, device=device, engine=engine,
                         verify=verify, rules=rules, progress=progress, timeout=timeout,
                         loader_config=loader_config, config=config).tensors


@dataclass
class LoadIntoResult:
    loaded: list          # target names filled
    skipped: list         # checkpoint tensors not loaded: dropped by the name map, of a
                          # module's computed (non-persistent) buffer, or with no target
    not_loaded: list      # target entries no checkpoint tensor filled
    stats: LoadStats | None = None


def _target_dict(target, rank: int | None = None) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        d = dict(target.named_parameters())
        d.update(dict(target.named_buffers()))
        return d
    if isinstance(target, Mapping):
        # entries no checkpoint tensor fills may be anything (TransformerEngine's
        # ``_extra_state``): a target is checked when a tensor maps to it
        return dict(target)
    raise LoadError(f"load_into needs a torch.nn.Module or a mapping of tensors, got "
                    f"{type(target).__name__}", rank=rank)


class _Buffers(NamedTuple):
    """A module's buffers as loading them goes: ``computed``, its non-persistent ones
    (rotary tables: the module computes them, its state_dict leaves them out, and
    from_pretrained never loads one), under every name a shared submodule has; and
    ``optional``, the persistent ones torch's own ``load_state_dict(strict=True)`` lets
    a checkpoint leave out (a norm's ``num_batches_tracked``, which it fills itself)."""
    computed: frozenset[str]
    optional: frozenset[str]


def _module_buffers(module: torch.nn.Module) -> _Buffers:
    computed, optional = set(), set()
    for prefix, m in module.named_modules(remove_duplicate=False):
        at = f"{prefix}." if prefix else ""
        computed.update(at + b for b in m._non_persistent_buffers_set)
        if isinstance(m, torch.nn.modules.batchnorm._NormBase):
            optional.add(at + "num_batches_tracked")
    return _Buffers(frozenset(computed), frozenset(optional))


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
            ok = (isinstance(t, torch.Tensor) and tgt not in self._claimed and t.is_contiguous()
                  and t.device.type == self._type)
            if ok:
                self._claimed.add(tgt)
            self._memo[name] = t.detach() if ok else None
        return self._memo[name] is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        return self._memo[name]


class _Fusion(NamedTuple):
    """One of transformers' weight converters of the target model, kept in transformers'
    order (a checkpoint name goes by the first converter matching it). One load_into can
    apply (``ops`` not None) makes the checkpoint tensors its sources match one parameter
    through ``ops`` (("merge", dim): stack each source's experts; ("concat", dim): join
    every source's tensors), e.g. per-expert gate/up -> fused ``mlp.experts.gate_up_proj``,
    q/k/v conv -> ``conv1d``."""
    conv: Any                                  # the transformers WeightConverter: it matches
    experts: tuple[re.Pattern | None, ...]     # per source: reads the expert id, None: no ``*``
    ops: tuple[tuple[str, int], ...] | None
    source_names: tuple[str, ...]   # transformers' own patterns, for messages


_OP_NAMES = {"merge": "MergeModulelist", "concat": "Concatenate"}   # their class names, for messages


class _Conversion(NamedTuple):
    """transformers' conversion mapping of a target model, as far as load_into applies it:
    its converters, and its renamings of checkpoint names (``rename``: transformers' own
    ``apply_renamings``; None when it has none)."""
    fusions: list[_Fusion]
    rename: Callable[[str], str] | None


def _expert_reader(source: str) -> re.Pattern | None:
    """The regex transformers builds from source pattern ``source`` (WeightTransform: a
    regex already, its "*." -> ".*\\.", a name boundary after a trailing word character),
    with what its ``*`` matches captured as the expert id. None for a source without
    "*.", whose one tensor is the whole source."""
    if "*." not in source:
        return None
    pattern = source.replace("*.", r"(?P<cl_expert>.*)\.", 1)
    if re.search(r"[a-zA-Z0-9]$", pattern):
        pattern += r"(?!\w)"
    return re.compile(pattern)


def _transformers_conversion(target, rank: int) -> _Conversion:
    """transformers' conversion mapping for ``target`` (a transformers model): its
    converters, those of MergeModulelist / Concatenate steps applied (the model holds
    experts fused that checkpoints store one by one), and the renamings (mixtral's ".block_sparse_moe." ->
    ".mlp."). Read from transformers, never a table of our own."""
    if not isinstance(target, torch.nn.Module) or not hasattr(getattr(target, "config", None),
                                                               "model_type"):
        return _Conversion([], None)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            apply_renamings,
        )
    except ImportError:
        return _Conversion([], None)
    out, renamings = [], []
    for conv in get_model_conversion_mapping(target):
        if isinstance(conv, WeightRenaming):
            renamings.append(conv)
        if not isinstance(conv, WeightConverter):
            continue
        with _converter_api(conv, rank):
            out.append(_fusion_of(conv, MergeModulelist, Concatenate))
    return _Conversion(out, (lambda n: apply_renamings(n, renamings)) if renamings else None)


def _fusion_of(conv, merge: type, concat: type) -> _Fusion:
    """A converter as load_into applies it (``ops`` None: one it does not); ``merge`` and
    ``concat``: transformers' MergeModulelist and Concatenate, the steps it applies."""
    ops: list[tuple[str, int]] | None = []
    for op in conv.operations:
        if type(op) is merge:
            ops.append(("merge", op.dim))
        elif type(op) is concat:
            ops.append(("concat", op.dim))
        else:
            ops = None
            break
    srcs = conv.source_patterns   # as transformers matches them (\1 and ^ resolved)
    # one target, and at most one "*" an expert id can come from
    if ops is not None and not (len(conv.target_patterns) == 1
                                and all(s.count("*.") <= 1 for s in srcs)):
        ops = None
    return _Fusion(conv, tuple(_expert_reader(s) for s in srcs) if ops is not None else (),
                   tuple(ops) if ops is not None else None,
                   tuple(getattr(conv, "_original_source_patterns", srcs)))


_EXPERT_ID = re.compile(r"0|[1-9][0-9]*")   # one spelling per id: "01" and "1" are one expert


@contextlib.contextmanager
def _converter_api(converter: Any, rank: int, name: str | None = None,
                   tensor: str | None = None):
    """transformers' converters are read through WeightConverter's ``operations``,
    ``source_patterns`` and ``target_patterns``, and matched through its private
    ``_scoped_match``, numbered groups and ``rename_source_key`` (transformers 5.25): a
    transformers whose converters answer otherwise is refused naming the converter and
    the version, not with a bare AttributeError from deep in load_into. ``converter``:
    the converter, or its source patterns (a tuple), formatted only on a refusal: this
    wraps every match of every checkpoint name."""
    try:
        yield
    except (AttributeError, TypeError, ValueError, IndexError, StopIteration) as e:
        import transformers
        converter = (list(converter) if isinstance(converter, tuple)
                     else clip(repr(converter), MAX_NAME_CHARS))
        to = "" if name is None else f" to {name!r}"
        raise LoadError(f"cannot apply transformers {transformers.__version__}'s weight "
                        f"converter {converter}{to} ({type(e).__name__}: {e}); load_into "
                        f"applies the converters as transformers 5.25 has them: load with "
                        f"from_pretrained, or map the names with name_map=",
                        tensor=tensor, rank=rank) from None


def _fusion_source(fusions: list[_Fusion], name: str, rank: int, tensor: str):
    """(fusion index, name prefix, fused target, source index, expert id) when ``name`` (of
    checkpoint tensor ``tensor``, after name_map) is a source of one of ``fusions``, else
    None; the expert id is None for a source without ``*``. ``name`` is matched by
    transformers' own converters, in their order, so it becomes what from_pretrained makes
    of it: their patterns are regexes (kimi_linear's "\\.experts.*.w1.weight"), and their
    ``*`` matches any text, dots included."""
    for k, f in enumerate(fusions):
        with _converter_api(f.source_names, rank, name, tensor):
            hit = f.conv._scoped_match(name)
        if hit is None:
            continue
        if f.ops is None:   # transformers converts it another way: not a fused source
            return None
        with _converter_api(f.source_names, rank, name, tensor):
            scope, key, m = hit
            # transformers names the alternative of its i-th source "g<i>"
            i = int(next(g for g, v in m.groupdict().items() if v is not None)[1:])
            tgt, _ = f.conv.rename_source_key(name)
        prefix = (scope or "") + key[:m.start()]
        reader = f.experts[i]
        if reader is None:
            return k, prefix, tgt, i, None
        e = reader.match(key, m.start())
        if e is None or e.end() != m.end():
            # transformers built its regex otherwise than _expert_reader reads it
            raise LoadError(f"cannot tell the expert of this checkpoint tensor: transformers' "
                            f"pattern {f.source_names[i]!r} matches {m.group(0)!r} of "
                            f"{name!r}, which coordloader reads as "
                            f"{e.group(0) if e else None!r}", tensor=tensor, rank=rank)
        eid = e.group("cl_expert")
        if _EXPERT_ID.fullmatch(eid) is None:
            # transformers stacks whatever "*" matched in name order; load_into places each
            # expert by its id, and a wrong slot is a silent wrong load
            raise LoadError(f"transformers' pattern {f.source_names[i]!r} matches {name!r} "
                            f"with {eid!r} for its '*'; expected an expert index (0, 1, ...) "
                            f"to place it by", tensor=tensor, rank=rank)
        return k, prefix, tgt, i, int(eid)
    return None


def _check_fusion_parts(fusion: _Fusion, prefix: str, target: str,
                        parts: dict[int, dict[int | None, str]], rank: int) -> None:
    """Every source of ``fusion`` must be there, and every source with an expert id must
    bring the same experts: one missing (dropped by name_map, absent from the checkpoint)
    failed in torch.stack/cat with a bare RuntimeError, put each half's experts in
    different slots (another expert in its place), or left a shorter concatenation."""
    names = fusion.source_names
    tgt = repr(target)
    absent = [n for i, n in enumerate(names) if fusion.experts[i] is None and i not in parts]
    if absent:
        raise LoadError(f"transformers fuses {', '.join(prefix + n for n in names)} into {tgt}; "
                        f"this rank has no {', '.join(prefix + n for n in absent)} (check the "
                        f"checkpoint and name_map)", rank=rank)
    have = [(n, sorted(parts.get(i, {}))) for i, n in enumerate(names)
            if fusion.experts[i] is not None]
    if all(h == have[0][1] for _, h in have):
        return
    got = "; ".join(f"{prefix}{n} for experts {format_ranges(h, empty='none')}" for n, h in have)
    raise LoadError(f"transformers fuses this rank's {got} into {tgt}; expected the same "
                    f"experts of every source (check the checkpoint and name_map)", rank=rank)


def _fuse(fusion: _Fusion, parts: dict[int, dict[int | None, torch.Tensor]],
          order: list[int]) -> torch.Tensor:
    """Apply ``fusion.ops`` to this rank's source tensors (per source: expert id -> tensor)
    as transformers' MergeModulelist and Concatenate do: each source starts as its list of
    tensors (its experts in ``order``, ``Layout.local_order``; a source without an expert
    id is a list of one), a merge stacks each list still unstacked (a tensor passes), a
    concat joins every source's tensors, flattened in source order, into one. Raises
    ValueError where the steps do not end in one tensor."""
    cur: list[torch.Tensor | list[torch.Tensor]] = [
        [p[e] for e in (order if fusion.experts[i] is not None else (None,))]
        for i, p in sorted(parts.items())]
    for op, dim in fusion.ops:
        if op == "merge":
            cur = [c if isinstance(c, torch.Tensor) else torch.stack(c, dim) for c in cur]
        else:
            cur = [torch.cat([t for c in cur for t in ([c] if isinstance(c, torch.Tensor) else c)],
                             dim)]
    if len(cur) != 1 or not isinstance(cur[0], torch.Tensor):
        steps = ", ".join(f"{_OP_NAMES[op]}(dim={dim})" for op, dim in fusion.ops) or "none"
        raise ValueError(f"transformers' steps ({steps}) do not join them into one tensor")
    return cur[0]


def _padding_hint(s: TensorSlice, dst: torch.Tensor) -> str:
    """Why a vocabulary table's slice has more rows than the target: a module of unpadded
    rows (a transformers model) otherwise reads as the wrong checkpoint."""
    if s.strategy != "vocab" or dst.dim() != len(s.local_shape) or dst.dim() == 0 \
            or tuple(dst.shape[1:]) != tuple(s.local_shape[1:]) \
            or dst.shape[0] >= s.local_shape[0]:
        return ""
    return (f" (the 'vocab' rule pads {list(s.global_shape)} to a multiple of its pad_to rows, "
            f"as vLLM's vocabulary-parallel layers hold it; for a target of unpadded rows "
            f"pass rules=[{{'pattern': {s.name!r}, 'strategy': 'vocab', 'params': "
            f"{{'pad_to': 1}}}}])")


def _refuse_meta(dst: torch.Tensor, tgt: str, name: str | None, rank: int) -> None:
    """A meta tensor has no memory: copying into it does nothing, so the target would be
    reported loaded while it holds nothing. ``to_empty`` is no way out: it leaves the
    buffers a module computes at construction (rotary tables) uninitialised, and a load
    does not fill them."""
    if dst.device.type == "meta":
        raise LoadError(f"target {tgt!r} is on the meta device and has no memory to load "
                        f"into; build the module on the device to fill (e.g. under "
                        f"`with torch.device('cpu'):`): module.to_empty() would leave the "
                        f"buffers it computes itself (rotary tables) uninitialised",
                        tensor=name, rank=rank)


def _refuse_wrapper(dst: torch.Tensor, tgt: str, name: str | None, rank: int) -> None:
    """A target the engines cannot write (a wrapper subclass, a sparse or nested tensor):
    refused before any read, since a failure in the
    copies into targets after the load (the last phase) reached only the rank that raised,
    the others returning as loaded."""
    # a subclass over its own storage (a Parameter subclass, as_subclass) is filled like a
    # plain tensor
    refuse_wrapper(dst, f"target {tgt!r}", name, rank, "load into a plain tensor, then convert it")
    refuse_layout(dst, f"target {tgt!r}", name, rank)


class _Placement(NamedTuple):
    """Where load_into puts this rank's tensors, decided from the rank's plan before any
    read: checkpoint tensor -> target, and the fused parameters' parts."""
    fusions: list[_Fusion]                        # transformers' fusions of the target
    copies: list[tuple[str, str, torch.Tensor]]   # (target, checkpoint tensor, target tensor)
    # (fusion index, name prefix, fused target) -> source index -> expert id (None: the
    # source has none) -> checkpoint tensor
    fused: dict[tuple[int, str, str], dict[int, dict[int | None, str]]]
    fused_dst: dict[tuple[int, str, str], torch.Tensor]
    slots: dict[tuple[int, str, str], list[int]]      # the experts of each, in slot order
    skipped: list[str]
    aliases: frozenset[str]   # entries filled as the very tensor of a filled one


def _tied_names(target) -> dict[str, str]:
    """A module's parameter names that are another's very tensor (a tied lm_head) -> the
    name its parameters are listed under."""
    if not isinstance(target, torch.nn.Module):
        return {}
    first: dict[int, str] = {}
    tied = {}
    for n, p in target.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[n] = first[id(p)]
        else:
            first[id(p)] = n
    return tied


def _place_targets(rank_plan, layout: Layout, dests: dict, mapf, strict: bool,
                   fusions: list[_Fusion], required: tuple[str, ...] = (),
                   tied: Mapping[str, str] | None = None,
                   names: Iterable[str] = ()) -> _Placement:
    """Match every slice of ``rank_plan`` to its target: refused here (before any read, in
    a phase of its own, so every rank stops together) are, under ``strict``, a missing
    target and a ``required`` target no slice fills, and always a shape or dtype that
    differs, a target on the meta device, a tensor subclass that wraps others, two tensors
    for one target, parts of a fused parameter that do not fuse to it, and targets sharing
    memory. A refusal after the load left targets filled in
    place with checkpoint bytes while the call raised, and reached only the rank that
    raised. ``names``: every tensor of the checkpoint (a tied tensor is filled from its
    alias only where the whole checkpoint ships that alias alone, not this rank's plan:
    a pipeline stage's plan may hold the head without the embedding)."""
    rank = rank_plan.rank
    copies, skipped = [], []
    fused: dict[tuple[int, str, str], dict[int, dict[int | None, str]]] = {}
    slots: dict[tuple[int, str, str], list[int]] = {}
    spec: dict[str, torch.Tensor] = {}   # checkpoint tensor -> its slice, as a meta tensor
    source_of: dict[str, str] = {}       # target -> the checkpoint tensor that fills it

    def claim(tgt: str, name: str) -> None:
        if tgt in source_of:
            raise LoadError(f"checkpoint tensors {source_of[tgt]!r} and {name!r} both map to the "
                            f"target {tgt!r}; expected one checkpoint tensor per target (check "
                            f"name_map)", tensor=name, rank=rank)
        source_of[tgt] = name
    pairs = [(s, mapf(s.name)) for s in rank_plan.tensors]
    shipped: set | None = None   # every checkpoint tensor's target, when first needed
    for s, tgt in pairs:
        name = s.name
        if tgt is None:
            skipped.append(name)
            continue
        dst = dests.get(tgt)
        if dst is None and tgt in (tied or {}) and tied[tgt] in dests:
            if shipped is None:
                shipped = set(map(mapf, names))
            primary = tied[tgt]
            if primary not in shipped and [a for a, p in tied.items()
                                           if p == primary and a in shipped] == [tgt]:
                # the checkpoint ships the one tied tensor under this alias alone (a head,
                # no embedding): it fills the tensor, as from_pretrained fills it
                tgt, dst = primary, dests[primary]
        if tgt in dests and not isinstance(dst, torch.Tensor):
            # an entry holding no tensor (TransformerEngine's _extra_state: None, a
            # BytesIO) is not filled; strict says so, else it is left as it is
            if strict:
                require_tensor(dst, f"target {clip(repr(tgt), MAX_NAME_CHARS)}", name, rank)
            skipped.append(name)
            continue
        hit = None if dst is not None else _fusion_source(fusions, tgt, rank, name)
        if hit is not None:   # one of many checkpoint tensors of a fused parameter
            k, prefix, fused_tgt, src, expert = hit
            mine = fused.setdefault((k, prefix, fused_tgt), {}).setdefault(src, {})
            if expert in mine:   # the one slot would hold whichever came last
                raise LoadError(f"checkpoint tensors {mine[expert]!r} and {name!r} are both "
                                f"{'expert ' + str(expert) if expert is not None else 'the'} "
                                f"source {fusions[k].source_names[src]!r} of {fused_tgt!r}; "
                                f"expected one (check name_map)", tensor=name, rank=rank)
            mine[expert] = name
            spec[name] = torch.empty(s.local_shape, dtype=torch_dtype(s.dtype), device="meta")
            continue
        if dst is None:
            if strict and tgt in (tied or {}) and shipped is not None \
                    and tied[tgt] not in shipped:
                others = sorted(a for a, p in tied.items() if p == tied[tgt] and a in shipped)
                raise LoadError(f"target {tgt!r} is tied to {tied[tgt]!r} (one tensor, "
                                f"tie_word_embeddings), which the checkpoint ships under "
                                f"several names ({', '.join(map(repr, others))}), none of "
                                f"them {tied[tgt]!r}: map all but one of them to None "
                                f"(name_map=) to load it from the one left",
                                tensor=name, rank=rank)
            if strict and tgt in (tied or {}):
                # (was: "no target entry": strict=False, the advice, kept the embedding's
                # values as the head, where from_pretrained loads the checkpoint's)
                raise LoadError(f"target {tgt!r} is tied to {tied[tgt]!r} (one tensor, "
                                f"tie_word_embeddings), and the checkpoint ships {name!r} "
                                f"beside {tied[tgt]!r}: a second copy of the tied tensor "
                                f"(pass name_map={{{name!r}: None}} to load the one tensor "
                                f"from {tied[tgt]!r}), or a tensor of its own (build the "
                                f"module untied to load both); strict=False leaves {tgt!r} "
                                f"holding {tied[tgt]!r}'s values", tensor=name, rank=rank)
            if strict:
                raise LoadError(f"no target entry {tgt!r} for this checkpoint tensor (pass "
                                f"name_map= or strict=False)", tensor=name, rank=rank)
            skipped.append(name)
            continue
        # first: a DTensor states its global shape, and a shape refusal would hide this one
        _refuse_wrapper(dst, tgt, name, rank)
        dt = torch_dtype(s.dtype)
        if tuple(dst.shape) != tuple(s.local_shape) or dst.dtype != dt:
            raise LoadError(f"target {tgt!r} is {dst.dtype} {list(dst.shape)}, this rank's "
                            f"slice is {dt} {list(s.local_shape)}{_padding_hint(s, dst)}",
                            tensor=name, rank=rank)
        _refuse_meta(dst, tgt, name, rank)
        claim(tgt, name)
        copies.append((tgt, name, dst))
    fused_dst = {}
    for key, parts in list(fused.items()):
        k, prefix, tgt = key
        fusion = fusions[k]
        starred = [p for i, p in parts.items() if fusion.experts[i] is not None]
        experts = sorted(starred[0]) if starred else []
        what = (f"experts {experts}" if starred else
                "slices of " + ", ".join(prefix + n for n in fusion.source_names))
        dst = dests.get(tgt)
        if dst is None:   # as a plain tensor without a target
            names = sorted(n for p in parts.values() for n in p.values())
            if strict:
                raise LoadError(f"no target entry {tgt!r}, into which transformers fuses this "
                                f"rank's {what} (pass name_map= or strict=False)",
                                tensor=names[0], rank=rank)
            skipped.extend(names)
            del fused[key]
            continue
        _check_fusion_parts(fusion, prefix, tgt, parts, rank)
        # named by one of the checkpoint tensors it fuses
        require_tensor(dst, f"target {clip(repr(tgt), MAX_NAME_CHARS)}",
                       next(iter(next(iter(parts.values())).values())), rank)
        _refuse_wrapper(dst, tgt, None, rank)   # filled with a copy of the fusion
        slots[key] = layout.local_order(rank_plan.coords.get("ep"), experts)
        try:   # the fusion itself, on meta tensors: the shape and dtype it gives
            t = _fuse(fusion, {i: {e: spec[n] for e, n in p.items()} for i, p in parts.items()},
                      slots[key])
        # RuntimeError: parts that do not stack or join (shapes differ); TypeError and
        # ValueError: steps in an order that does not end in one tensor
        except (RuntimeError, TypeError, ValueError) as e:
            raise LoadError(f"transformers fuses this rank's {what} into {tgt!r}, but they "
                            f"do not fuse: {' '.join(str(e).split())}", rank=rank) from None
        if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
            raise LoadError(f"transformers fuses these checkpoint tensors into {tgt!r} "
                            f"({dst.dtype} {list(dst.shape)}); this rank's {what} "
                            f"fuse to {t.dtype} {list(t.shape)}", rank=rank)
        _refuse_meta(dst, tgt, None, rank)
        claim(tgt, f"{tgt} (fused)")
        fused_dst[key] = dst
    # two targets sharing memory would hold one's bytes in both
    check_disjoint([(tgt, dst) for tgt, _, dst in copies]
                   + [(key[2], dst) for key, dst in fused_dst.items()],
                   rank, what="target")
    # an entry that is the very tensor of a filled one (tied weights in a state dict, one
    # name mapped to None) is filled with it
    def view(t):
        return t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype
    same = {view(dests[n]) for n in source_of if n in dests}
    aliases = frozenset(n for n, t in dests.items() if n not in source_of
                        and isinstance(t, torch.Tensor) and view(t) in same)
    if strict:
        # a parameter nothing fills keeps whatever it held (random init), and the model
        # looks loaded: a checkpoint that lost a file (DCP lists no tensors) did just that
        missing = [n for n in required if n not in source_of and n not in aliases]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise LoadError(f"no checkpoint tensor of this rank fills the target "
                            f"{missing[0]!r}{more}: the checkpoint lacks it (a file missing?), "
                            f"the layout gives it to other ranks (another pipeline stage or "
                            f"expert owner: build only this rank's part of the model), or "
                            f"name_map sends it elsewhere; pass strict=False to load the "
                            f"rest (LoadIntoResult.not_loaded then lists them)", rank=rank)
    return _Placement(fusions, copies, fused, fused_dst, slots, skipped, aliases)


class _Targets:
    """load_into's targets as one rank sees them once the group is adopted: the target
    entries, transformers' conversion of the target model, the entries strict requires
    filled, and the name mapping (``map``); ``placement`` once matched to the plan."""

    def __init__(self, target, name_map, rank: int):
        if not (name_map is None or callable(name_map) or isinstance(name_map, Mapping)):
            raise LoadError(f"name_map must be a mapping or a callable, got "
                            f"{type(name_map).__name__}", rank=rank)
        self.rank = rank
        self.dests = _target_dict(target, rank)
        for tgt, t in self.dests.items():
            # first: every later step reads shapes, and torch answers a lazy one with a bare
            # ValueError. Refused even where no checkpoint tensor maps to it: with no shape,
            # strict cannot tell whether it needs filling
            lazy = uninitialized(t)
            if lazy is not None:
                raise LoadError(f"target {clip(repr(tgt), MAX_NAME_CHARS)} is {lazy}", rank=rank)
        self.conv = _transformers_conversion(target, rank)
        self.tied = _tied_names(target)
        # given: a checkpoint name's target as the caller gives it; named: whether the
        # caller named it (a mapping's entry, even onto the same name)
        self.named = lambda n: False
        if callable(name_map):
            self.given = name_map
        elif isinstance(name_map, Mapping):
            self.given = lambda n: name_map.get(n, n)
            self.named = name_map.__contains__
        else:
            self.given = lambda n: n
        if isinstance(target, torch.nn.Module):
            # what its state_dict holds (its parameters and persistent buffers: a missing
            # router bias keeps its stale value), less what torch and transformers do not
            # expect from a checkpoint: a norm's num_batches_tracked, entries transformers
            # leaves out of its saves (sinusoidal tables) and those it lets be missing.
            # Its non-persistent buffers are computed: a checkpoint tensor of that name is
            # skipped, as from_pretrained skips it (a name_map naming one fills it)
            buffers = _module_buffers(target)
            self.computed = buffers.computed
            skip_saved = set(getattr(target, "_keys_to_ignore_on_save", None) or ())
            skip_saved |= buffers.computed | buffers.optional
            skip_missing = [re.compile(p) for p in
                            getattr(target, "_keys_to_ignore_on_load_missing", None) or ()]
            self.required = tuple(n for n, p in self.dests.items()
                                  if p.numel() and n not in skip_saved
                                  and not any(r.search(n) for r in skip_missing))
        else:   # every entry of a mapping
            self.computed = frozenset()
            self.required = tuple(n for n, t in self.dests.items()
                                  if not isinstance(t, torch.Tensor) or t.numel())
        self.placement: _Placement | None = None

    def fits(self, tgt: str, name: str) -> bool:
        """``tgt`` (checkpoint tensor ``name``'s) is a target entry, or a source of a fusion
        whose parameter is one."""
        if tgt in self.dests:
            return True
        hit = _fusion_source(self.conv.fusions, tgt, self.rank, name)
        return hit is not None and hit[2] in self.dests

    def map(self, name: str) -> str | None:
        """The target of checkpoint tensor ``name``: the name given (or mapped), else
        transformers' renaming of it, as from_pretrained renames a checkpoint's names
        before matching them to the model (a checkpoint save_pretrained wrote holds the
        names from before the renaming)."""
        try:
            tgt = self.given(name)
        except Exception as e:
            raise LoadError(f"name_map raised {type(e).__name__}: "
                            f"{clip(str(e), MAX_NAME_CHARS)} for this checkpoint tensor",
                            tensor=name, rank=self.rank) from e
        if tgt is not None and not isinstance(tgt, str):
            raise LoadError(f"name_map gave {clip(repr(tgt), MAX_NAME_CHARS)} for this "
                            f"checkpoint tensor; expected a target name (a str) or None",
                            tensor=name, rank=self.rank)
        mapped = tgt != name or self.named(name)   # by the caller: to a computed buffer too
        if tgt is not None and self.conv.rename is not None and not self.fits(tgt, name):
            renamed = self.conv.rename(tgt)
            if self.fits(renamed, name):
                tgt = renamed
        # a computed buffer of the checkpoint's own name (or transformers' renaming of it)
        return None if tgt in self.computed and not mapped else tgt


# the keywords load_into passes on: load_detailed's, less what load_into itself decides
_LOAD_KEYWORDS = frozenset(inspect.signature(load_detailed).parameters) - {
    "ckpt", "layout", "out", "agree"}


def load_into(target, ckpt, layout: Layout, *, name_map=None, strict: bool = True,
              **load_kw) -> LoadIntoResult:
    """Load this rank's tensors straight into existing parameters/buffers.

    ``name_map``: a mapping or a callable from checkpoint name to target name (None drops
    the tensor). Shapes and dtypes must match exactly (a clear ``LoadError`` names both).
    A module's targets are its parameters and buffers; a checkpoint tensor named as one of
    its non-persistent buffers (computed by the module, as rotary tables are) is skipped,
    as from_pretrained skips it, unless ``name_map`` maps a name to it. With ``strict``, a
    checkpoint tensor of this rank with no target entry is an error, and so is a target no
    checkpoint tensor of this rank fills (a module's parameters and persistent buffers,
    less a norm's ``num_batches_tracked`` and what transformers lets be missing; every
    entry of a mapping).
    A transformers model whose parameters fuse several checkpoint tensors (transformers 5
    MoE experts: per-expert gate/up -> ``mlp.experts.gate_up_proj``) is filled through
    transformers' own conversion mapping (its MergeModulelist / Concatenate steps), and a
    checkpoint name with no target of its own goes by transformers' renaming of it
    (mixtral: ``.block_sparse_moe.`` -> ``.mlp.``).
    A destination that is contiguous and on the load device is filled by the engine
    directly; any other through a temporary and ``copy_``. Every target is checked
    against the plan before any read: a refusal on any rank stops every rank, with no
    target written."""
    unknown = sorted(set(load_kw) - _LOAD_KEYWORDS - {"out"})   # out=: refused below
    if unknown:   # (was a TypeError naming a private function)
        raise TypeError(f"load_into() got an unexpected keyword argument {unknown[0]!r}; it "
                        f"takes name_map, strict and load()'s keywords: "
                        f"{', '.join(sorted(_LOAD_KEYWORDS))}")
    made: list[_Targets] = []   # by prepare, once the group is adopted

    def prepare(rank: int, device: torch.device) -> _DirectDests:
        # once the group is adopted: a target or name_map refused on one rank alone
        # reaches the others at their first phase, and every rank's calls stay in step
        if "out" in load_kw:   # the targets are the destinations; out= went unused
            raise LoadError("load_into takes no out=: its target is where the tensors go",
                            rank=rank)
        made.append(_Targets(target, name_map, rank))
        return _DirectDests(made[0].dests, made[0].map, device.type)

    def check(rank_plan, meta) -> None:
        t = made[0]
        t.placement = _place_targets(rank_plan, layout, t.dests, t.map, strict,
                                     t.conv.fusions, t.required, t.tied, meta.tensors)

    res = _load_detailed(ckpt, layout, prepare=prepare, check=check, call="load_into",
                         **load_kw)
    dests, pl = made[0].dests, made[0].placement
    fusions = pl.fusions
    loaded = []
    with torch.no_grad():
        for tgt, name, dst in pl.copies:
            t = res.tensors[name]
            if t.data_ptr() != dst.data_ptr() or t.device != dst.device:
                with writable(dst):   # an inference target takes it only in inference mode
                    dst.copy_(t)      # else the engine filled dst in place (out=direct)
            loaded.append(tgt)
        for key, parts in pl.fused.items():
            t = _fuse(fusions[key[0]], {i: {e: res.tensors[n] for e, n in p.items()}
                                        for i, p in parts.items()}, pl.slots[key])
            with writable(pl.fused_dst[key]):
                pl.fused_dst[key].copy_(t)
            loaded.append(key[2])
    filled = set(loaded)
    return LoadIntoResult(loaded, pl.skipped,
                          sorted(k for k in dests if k not in filled and k not in pl.aliases
                                 and k not in made[0].computed),
                          res.stats)


# -- command line -----------------------------------------------------------------------------
