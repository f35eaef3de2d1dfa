"""InstantTensor engine (CUDA/ROCm).

InstantTensor's distributed mode splits the raw bytes of a file set over a process group
and all-gathers them, so every member receives every tensor of those files, one at a
time, as zero-copy views into a ring buffer (``copy=False``). We consume each tensor as
it streams: narrow it to this rank's planned pieces, copy into the preallocated
destination, drop it. Tensors that only their owner needs (experts under EP) are better
fetched with ``tensor_filter`` (exact names, ``process_group=None``): each rank reads
only its own. The plan's ``load_groups`` say which file sets go which way (the planner's
cost model); a plan without them loads every file in one group of all ranks.

The handle API used (instanttensor 0.2.x): ``with safe_open(files, framework="pt",
device=idx, process_group=pg, copy=False, ...) as f: for key, t in f.tensors(): ...``;
keys stream in file order, then data offset. The stream names each tensor by its key
alone, which is not unique across files (torch DCP stores every rank's piece of a tensor
under the tensor's name): the engine attributes each yielded tensor to its file by
position, from the number of tensors each file streams, in the file order the handle
gives (``f.filename``: the list it streams, sorted in 0.2.x). A handle that does not give
it leaves only the keys: the engine attributes by key where each key is in one file, and
refuses where one is in several. Every yielded tensor must have exactly the dtype and
shape its file stores the piece as.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import os
import threading
import time
from operator import itemgetter
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from coordloader.checkpoint import dtypes
from coordloader.checkpoint.metadata import CheckpointMeta, TensorMap, box_shape, full_box
from coordloader.checkpoint.reader import header_order, parse_strict_json
from coordloader.engines import (
    LoadStats,
    Progress,
    allocate,
    check_out,
    copy_overlap,
    cuda_backend,
    needed_keys,
    paths_stay_checked,
    slice_nbytes,
)
from coordloader.errors import CoordloaderError, LoadError
from coordloader.gcpause import gc_paused
from coordloader.planning.model import LoadGroup, LoadGroupMode, Plan, RankPlan
from coordloader.text import MAX_NAME_CHARS, clip, format_ranks

# Arguments the engine sets itself: overriding them would break correctness.
FIXED_ARGS = ("filename", "framework", "device", "process_group", "copy")
ENGINE_ARGS = ("tensor_filter", "tensor_name_match_mode")


def _instanttensor():
    try:
        import instanttensor
    except Exception as e:  # ImportError, or a broken native extension
        raise LoadError(f"the instanttensor engine needs the 'instanttensor' package: {e}") from None
    return instanttensor


def _safe_open():
    """The callable used to open file sets; tests replace it with a CPU stand-in."""
    return _instanttensor().safe_open


def _allocation_device(device: torch.device) -> torch.device:
    """Where destinations live: the CUDA device. Tests on CPU replace this."""
    return device


def tuning_options() -> tuple[str, ...]:
    """Keyword arguments of ``instanttensor.safe_open`` a user may set."""
    sig = inspect.signature(_instanttensor().safe_open)
    return tuple(p for p in sig.parameters if p not in FIXED_ARGS + ENGINE_ARGS)


def parse_loader_config(cfg: str | Mapping | None) -> dict:
    """``--loader-config`` (JSON text or a mapping) -> keyword arguments for
    ``instanttensor.safe_open``. Backend names become ``instanttensor.Backend`` (or
    ``BackendPolicy``) members, case-sensitive; a list keeps its order (fallbacks)."""
    if cfg is None or cfg == "":
        return {}
    if isinstance(cfg, str):
        try:
            cfg = parse_strict_json(cfg)
        except ValueError as e:   # bad syntax, a duplicate key, NaN
            raise LoadError(f"--loader-config is not valid JSON: {e}") from None
    if not isinstance(cfg, Mapping):
        raise LoadError(f"--loader-config must be a JSON object, got {type(cfg).__name__}")
    it = _instanttensor()
    fixed = sorted(k for k in cfg if k in FIXED_ARGS + ENGINE_ARGS)
    if fixed:
        raise LoadError(f"--loader-config cannot set {', '.join(fixed)}: the engine sets "
                        f"{', '.join(FIXED_ARGS + ENGINE_ARGS)} itself")
    allowed = tuning_options()
    unknown = sorted(k for k in cfg if k not in allowed)
    if unknown:
        raise LoadError(f"--loader-config has unknown option(s) {', '.join(unknown)}; "
                        f"instanttensor.safe_open accepts {', '.join(allowed)}")
    out = dict(cfg)
    if "backend" in out and out["backend"] is not None:
        members = {m.name: m for m in it.Backend}
        members.update({m.name: m for m in getattr(it, "BackendPolicy", [])})

        def conv(v):
            if not isinstance(v, str):
                if isinstance(v, tuple(type(m) for m in members.values())):
                    return v
                raise LoadError(f"--loader-config backend entries must be names, got {v!r}")
            if v not in members:
                raise LoadError(f"--loader-config: unknown backend {v!r}; valid names "
                                f"(case-sensitive): {', '.join(members)}")
            return members[v]

        b = out["backend"]
        if isinstance(b, (list, tuple)):
            if not b:
                raise LoadError("--loader-config: backend list is empty")
            out["backend"] = [conv(v) for v in b]
        else:
            out["backend"] = conv(b)
    for k, v in out.items():
        problem = _option_problem(k, v, getattr(it, "_impl", None))
        if problem:
            raise LoadError(f"--loader-config: {k}={clip(repr(v), MAX_NAME_CHARS)}: {problem}")
    b = out.get("backend")
    named = {getattr(m, "name", None) for m in (b if isinstance(b, list) else [b])}
    if out.get("concurrency") == 0 and named and named <= {"MMAP", "CUFILE"}:
        # (a combination instanttensor refuses on the GPU only, each value being valid)
        raise LoadError(f"--loader-config: concurrency=0 with backend "
                        f"{' or '.join(sorted(named))}: instanttensor needs concurrency >= 1 "
                        f"there (0 is for the buffered backends)")
    return out


# what instanttensor.safe_open refuses of each option's value, on the GPU only (its own
# bounds where it states them): checked before the load, under every engine
_POSITIVE = ("buffer_size", "chunk_size", "io_depth")


def _option_problem(key: str, v, impl) -> str:
    """Why instanttensor would refuse ``v`` for ``key`` ("" if it would not); ``impl``: its
    ``_impl`` module, whose bounds it states."""
    if v is None or key == "backend":
        return ""
    if key == "load_now":   # "no" is truthy: taken as load now
        return "" if isinstance(v, bool) else "expected true or false"
    if key == "max_free_mem_usage":
        ok = (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
              and 0 < v <= 1)
        return "" if ok else "expected a number with 0 < value <= 1"
    if key in _POSITIVE + ("concurrency",):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            return "expected a whole number"
        if v < (1 if key in _POSITIVE else 0):
            return f"expected a whole number {'>= 1' if key in _POSITIVE else '>= 0'}"
        limit = getattr(impl, "MAX_IO_DEPTH", None)
        if key == "io_depth" and isinstance(limit, int) and v > limit:
            return f"expected at most {limit} (instanttensor's MAX_IO_DEPTH)"
        limit = getattr(impl, "MAX_CHUNK_SIZE", None)
        if key == "chunk_size" and isinstance(limit, int):
            page = os.sysconf("SC_PAGE_SIZE")
            if -(-v // page) * page > limit:
                return (f"expected at most {limit} bytes once rounded up to whole pages "
                        f"(instanttensor's MAX_CHUNK_SIZE)")
    return ""


def check_loader_config(cfg: str | Mapping | None) -> None:
    """LoadError for a ``cfg`` the instanttensor engine would refuse, checked under every
    engine: a typo accepted by the cpu engine (which reads none of it) failed only on the
    GPU machine. Without an importable instanttensor nothing says which options it takes,
    and nothing reads them: unchecked."""
    try:
        _instanttensor()
    except LoadError:
        return
    parse_loader_config(cfg)


@contextlib.contextmanager
def _instanttensor_errors(what: str, rank: int):
    """A failure inside instanttensor becomes a LoadError saying ``what`` failed (ours pass)."""
    try:
        yield
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"{what}: {type(e).__name__}: {e}", rank=rank) from None


class OpenCall(NamedTuple):
    """One ``instanttensor.safe_open``: these files, over this process group (None: this
    rank alone), keeping only these keys (None: every tensor streams past), the bytes split
    ``group_size`` ways."""
    files: list[str]
    process_group: Any
    keys: list[str] | None
    group_size: int


def open_calls(groups: Sequence[LoadGroup], process_groups: Sequence[Any], rank: int,
               need: Mapping[str, set[str]]) -> list[OpenCall]:
    """Which safe_open calls this rank makes (pure; the engine runs them in order).

    A group-mode group is opened by every member, whether it needs the files or not: the
    members read collectively. A filtered group is opened only for the keys this rank
    needs. Files the rank needs that no group of its own covers get one filtered call."""
    calls: list[OpenCall] = []
    covered: set[str] = set()
    for g, pg in zip(groups, process_groups):
        if rank not in g.ranks or not g.files:
            continue
        covered.update(g.files)
        if g.mode == LoadGroupMode.GROUP:
            calls.append(OpenCall(list(g.files), pg, None, len(g.ranks) if pg is not None else 1))
        else:
            keys = sorted({k for f in g.files for k in need.get(f, ())})
            if keys:
                calls.append(OpenCall(list(g.files), None, keys, 1))
    rest = sorted(f for f in need if f not in covered)
    if rest:
        calls.append(OpenCall(rest, None, sorted({k for f in rest for k in need[f]}), 1))
    return calls


def check_device(device: Any) -> torch.device:
    """Refuse anything but an available CUDA device before InstantTensor is touched."""
    if device is None:
        if not torch.cuda.is_available():
            raise LoadError("the instanttensor engine needs a CUDA device, and CUDA is not "
                            "available here; use --engine cpu")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        # an int is a CUDA index (instanttensor's convention), not "the current accelerator"
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise LoadError(f"bad device {device!r}: {e}") from None
    if dev.type != "cuda":
        raise LoadError(f"the instanttensor engine loads onto CUDA devices only, got {dev}; "
                        f"use --engine cpu (or safetensors) for {dev.type}")
    if not torch.cuda.is_available():
        raise LoadError(f"device {dev} asked for, but CUDA is not available here; "
                        f"use --engine cpu")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _stream_order(handle: Any, paths: Sequence[str], files: Sequence[str]) -> list[str] | None:
    """The files in the order ``handle`` streams them: its ``filename`` (instanttensor 0.2.x
    keeps there the list it reads and streams, after sorting it), mapped back to file
    names; None when the handle has no such list of exactly ``paths``."""
    order = getattr(handle, "filename", None)
    if isinstance(order, str):
        order = [order]
    if (not isinstance(order, (list, tuple)) or not all(isinstance(p, str) for p in order)
            or sorted(order) != sorted(paths)):
        return None
    by_path = dict(zip(paths, files))
    return [by_path[p] for p in order]


def _stream_files(order: Sequence[str], keys: Sequence[str] | None,
                  file_keys: Mapping[str, Sequence[tuple[int, str]]]
                  ) -> list[tuple[str, str, int]]:
    """(file, key, start) of each tensor one ``safe_open(paths, tensor_filter=keys)``
    streams, in stream order: the files in ``order`` (``_stream_order``), per file its
    keys in the order of their bytes (``file_keys``: (start, key) pairs), or those of
    ``keys`` (exact names). The key yielded at each position is checked against it: a
    stream that skips or adds a tensor is refused there, not attributed to the next file
    (tensors of one start excepted, ``_take_tied``)."""
    keep = None if keys is None else set(keys)
    return [(fname, k, at) for fname in order for at, k in file_keys.get(fname, ())
            if keep is None or k in keep]


def _take_tied(streams: list[tuple[str, str, int]], i: int, key: str) -> bool:
    """Whether ``key`` is a tensor of the same file and start as the one expected at
    position ``i``, later in ``streams``; if so it is moved to ``i``. instanttensor orders
    a file's tensors by start alone, keeping header order among equal starts (zero-element
    tensors, and the tensor after them), and the metadata keeps only the offset order: a
    tie may stream in any order, and nothing else may."""
    fname, _, at = streams[i]
    for j in range(i + 1, len(streams)):
        if streams[j][0] != fname or streams[j][2] != at:
            return False
        if streams[j][1] == key:
            streams[i], streams[j] = streams[j], streams[i]
            return True
    return False


def _key_files(files: Sequence[str], keys: Sequence[str] | None,
               file_keys: Mapping[str, Sequence[tuple[int, str]]]
               ) -> tuple[dict[str, str], list[str]]:
    """(key -> its file, the keys stored in several of ``files``) among the keys a
    ``safe_open(files, tensor_filter=keys)`` streams: what attributes a tensor to its
    file when the stream's file order is not known."""
    keep = None if keys is None else set(keys)
    where: dict[str, str] = {}
    shared: set[str] = set()
    for fname in files:
        for _, k in file_keys.get(fname, ()):
            if keep is not None and k not in keep:
                continue
            if k in where and where[k] != fname:
                shared.add(k)
            where[k] = fname
    return where, sorted(shared)


class _Stored(NamedTuple):
    keymap: dict        # (file, key) -> (tensor name, dtype, box)
    file_keys: dict     # file -> its (start, key) pairs in the order of their bytes
    empty_files: set    # files holding a piece of no bytes


def _stored_pieces(meta: CheckpointMeta) -> _Stored:
    """(file, key) -> (tensor name, dtype, box) of every stored piece (keys are unique
    within a file only), per file its (start, key) pairs in the order of their bytes, and
    the files holding a piece of no bytes: what each streamed tensor is attributed to and
    checked against. A plain checkpoint's from its header entries, with no record made (a
    rank streams every tensor of its group's files, most of them other ranks')."""
    got = meta.tensors.header_entries() if isinstance(meta.tensors, TensorMap) else None
    starts: dict[str, list[tuple[int, str]]] = {}
    empty: set[str] = set()
    with gc_paused():   # ~300 k tuples, all kept: nothing to collect
        if got is None:
            keymap: dict[tuple[str, str], tuple] = {}
            for info in meta.tensors.values():
                for sp in info.pieces:
                    keymap[(sp.file, sp.key)] = (info.name, info.dtype, sp.box)
                    starts.setdefault(sp.file, []).append((sp.start, sp.key))
                    if sp.start == sp.end:
                        empty.add(sp.file)
        else:
            entries, files = got
            keys = list(map(itemgetter(0), entries))
            shapes = list(map(itemgetter(2), entries))
            boxes = {s: full_box(s) for s in set(shapes)}
            keymap = dict(zip(zip(files, keys), zip(keys, map(itemgetter(1), entries),
                                                    map(boxes.__getitem__, shapes))))
            for f, at, k in zip(files, map(itemgetter(3), entries), keys):
                p = starts.get(f)
                if p is None:
                    starts[f] = [(at, k)]
                else:
                    p.append((at, k))
            t = meta.table()
            zero = t.whole & (t.end == t.start)
            if zero.any():
                empty.update(meta.files[i].name for i in np.unique(t.file[zero]).tolist())
        # sorted file by file (tuples: no key function per entry)
        return _Stored(keymap, {f: sorted(p) for f, p in starts.items()}, empty)


class _StageGroups:
    """The process groups ``_stage_group`` made, by global ranks, and the default group
    they were made in (a sentinel before the first)."""
    lock = threading.Lock()
    world: Any = object()
    groups: dict[tuple[int, ...], Any] = {}


def _stage_group(ranks: tuple[int, ...]) -> Any:
    """The process group of these global ranks, made once per default group: every group
    new_group makes holds its communicators until destroyed, and one per load leaked an
    NCCL communicator per stage group per load (pp > 1). Every rank makes the same loads,
    so the ranks find the same groups made and call new_group (collective over the whole
    default group) alike. A new default group (destroyed and initialised again) starts
    afresh: the old one's groups went with it."""
    import torch.distributed as dist
    with _StageGroups.lock:
        if _StageGroups.world is not dist.group.WORLD:
            _StageGroups.world, _StageGroups.groups = dist.group.WORLD, {}
        pg = _StageGroups.groups.get(ranks)
        if pg is None:
            pg = _StageGroups.groups[ranks] = dist.new_group(ranks=list(ranks))
        return pg


def _distributed(world: int) -> bool:
    """Whether a load of ``world`` ranks runs over torch.distributed (every rank in it)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and world > 1


class _Load:
    """One rank's prepared load (``InstantTensorEngine._prepare``) and what its streams
    have delivered so far."""

    def __init__(self, groups, keys, calls, slices, tensors, held, keymap, file_keys, need):
        self.groups, self.keys, self.calls = groups, keys, calls
        self.slices, self.tensors, self.held = slices, tensors, held
        self.keymap, self.file_keys, self.need = keymap, file_keys, need
        self.seen: set[tuple[str, str]] = set()
        self.streamed = self.share = 0


def _refuse_other_formats(meta: CheckpointMeta, rank: int) -> None:
    """LoadError before any read where a file's __metadata__ names a format other than
    "pt" (an MLX, TF, Flax or numpy export): InstantTensor raises ValueError on it, on
    CUDA only, where the cpu engine loads it."""
    for f in meta.files:
        fmt = dict(f.metadata).get("format", "pt")
        if fmt != "pt":
            raise LoadError(f"its __metadata__ format is {clip(repr(fmt), MAX_NAME_CHARS)}; "
                            f"InstantTensor loads only files of format 'pt': load with "
                            f"engine='cpu' (--engine cpu)", file=f.name, rank=rank)


def _refuse_zero_size_ties(meta: CheckpointMeta, empty_files: set[str], rank: int) -> None:
    """LoadError before any read where a zero-size tensor starts where a tensor of bytes
    does and comes after it in the header: InstantTensor orders a file's tensors by start,
    keeping the header's order among equal starts, and refuses the file as not contiguous
    (on CUDA only, naming no tensor) where the cpu engine loads it. Only ``empty_files``,
    those holding a piece of no bytes, have their header read again, for its order."""
    for name in sorted(empty_files):
        try:
            order = sorted(header_order(meta.root, name), key=itemgetter(1))   # stable
        except (CoordloaderError, OSError):
            continue   # the file changed since: the load names it
        for (a, _, end), (b, start, _) in zip(order, order[1:]):
            if end != start:
                raise LoadError(f"tensor {clip(repr(b), MAX_NAME_CHARS)} holds no bytes and "
                                f"starts where {clip(repr(a), MAX_NAME_CHARS)} does, after it "
                                f"in the header: InstantTensor reads the file as not "
                                f"contiguous and refuses it; load with engine='cpu' "
                                f"(--engine cpu)", file=name, rank=rank)


class InstantTensorEngine:
    name = "instanttensor"

    def __init__(self, plan: Plan | None = None, group: Any = None,
                 loader_config: str | Mapping | None = None):
        self.plan = plan
        self.group = group
        # parsing imports instanttensor: a node whose install is broken fails here, and it
        # is raised in load_rank, before the ranks agree, not here, where its peers would
        # wait for it in the engine's agreement until the group's timeout
        self._config_error: LoadError | None = None
        try:
            self.tuning = parse_loader_config(loader_config)
        except LoadError as e:
            self.tuning, self._config_error = {}, e

    # -- load groups ---------------------------------------------------------------
    def load_groups(self, meta: CheckpointMeta, stored) -> tuple[LoadGroup, ...]:
        """The plan's load groups, else one group of every file that stores a tensor
        (``stored``: those files): instanttensor refuses a file that holds none, and the
        planner's groups leave such files out."""
        if self.plan is not None and self.plan.load_groups:
            return tuple(self.plan.load_groups)
        world = self.plan.world_size if self.plan is not None else 1
        files = tuple(f.name for f in meta.files if f.name in stored)
        return (LoadGroup(files=files, ranks=tuple(range(world)), mode="group"),)

    def _group_keys(self, groups: Sequence[LoadGroup], world: int) -> list:
        """Per load group, the ranks of the process group its members read it over (None:
        each rank reads alone): a "group"-mode group of several ranks in a distributed
        load. Decided alike on every rank, before any group is made."""
        distributed = _distributed(world)
        return [tuple(g.ranks) if g.mode == "group" and distributed and len(g.ranks) > 1
                else None for g in groups]

    def _process_groups(self, keys: Sequence[tuple[int, ...] | None], world: int) -> dict:
        """Plan ranks -> the torch.distributed group of each of ``keys``, looked up or made
        in plan order on every rank (new_group is collective over the whole default
        group)."""
        import torch.distributed as dist
        pgs: dict[tuple[int, ...], Any] = {}
        for ranks in keys:
            if ranks is None or ranks in pgs:
                continue
            if ranks == tuple(range(world)):
                pgs[ranks] = self.group if self.group is not None else dist.group.WORLD
                continue
            # plan ranks are ranks of self.group; new_group wants global ranks
            if self.group is not None and self.group is not dist.group.WORLD:
                gr = tuple(dist.get_global_rank(self.group, r) for r in ranks)
            else:
                gr = ranks
            pgs[ranks] = _stage_group(gr)
        return pgs

    def _agree(self, failure: BaseException | None, rank: int, world: int,
               dev: torch.device | None) -> None:
        """Every rank of a distributed load says whether its preparation succeeded, before
        the first collective of the load: a rank that failed alone (allocation out of
        memory, a changed file) left the others in safe_open's all_reduce until the
        process group's timeout (NCCL: a watchdog crash), the cause never named. The
        others raise naming the failed ranks; the failed rank raises its own error."""
        import torch.distributed as dist
        if not _distributed(world):
            if failure is not None:
                raise failure
            return
        pg = self.group if self.group is not None else dist.group.WORLD
        if "gloo" in str(dist.get_backend(pg)):
            on = torch.device("cpu")
        else:   # NCCL: on the device (the current one where this rank's was refused)
            on = _allocation_device(dev or torch.device("cuda", torch.cuda.current_device()))
        failed = torch.zeros(world, dtype=torch.int32, device=on)
        failed[rank] = failure is not None
        dist.all_reduce(failed, group=pg)
        if failure is not None:
            raise failure
        bad = [r for r, f in enumerate(failed.tolist()) if f]
        if bad:
            raise LoadError(f"{format_ranks(bad)} failed to "
                            f"prepare the instanttensor load (destinations, file checks; "
                            f"{'their' if len(bad) > 1 else 'its'} own error says why): not "
                            f"loading", rank=rank)

    # -- the load ------------------------------------------------------------------
    def load_rank(self, meta: CheckpointMeta, rank_plan: RankPlan, device: Any = None, *,
                  progress: Progress | None = None,
                  out: Mapping[str, torch.Tensor] | None = None):
        t0 = time.perf_counter()
        rank = rank_plan.rank
        world = self.plan.world_size if self.plan is not None else 1
        with contextlib.ExitStack() as checked:
            # everything rank-local first, then agreement, then the first collective
            dev = failure = opener = None
            try:
                if self._config_error is not None:
                    raise self._config_error
                _refuse_other_formats(meta, rank)
                dev = check_device(device)
                # the package imported here too: a node whose install is broken failed
                # after the agreement, its peers left in safe_open's first collective
                opener = _safe_open()
                st = self._prepare(meta, rank_plan, dev, out, world, checked)
            except CoordloaderError as e:
                failure = e
            except Exception as e:   # torch's OutOfMemoryError, ...: named as this rank's
                failure = LoadError(f"preparing the instanttensor load failed: "
                                    f"{type(e).__name__}: {e}", rank=rank)
                failure.__cause__ = e
            self._agree(failure, rank, world, dev)
            pgs = self._process_groups(st.keys, world)
            calls = [c._replace(process_group=pgs[c.process_group])
                     if c.process_group is not None else c for c in st.calls]
            for c in calls:
                backend = cuda_backend(c.process_group)
                if c.process_group is not None and backend != "nccl":
                    raise LoadError(f"the instanttensor engine needs an NCCL process group (it "
                                    f"hands the group's NCCL communicator to its loader); the "
                                    f"load's group runs CUDA collectives with "
                                    f"{backend or 'no backend'}: pass an NCCL group, or use "
                                    f"--engine cpu", rank=rank)
            # dev made current: instanttensor lets its loader reuse a ring-buffer slot once
            # tensors() has synchronised torch.cuda.current_stream(), the current device's
            # stream; with another device current, the copy_ queued on dev's stream could
            # read the next chunk's bytes
            with torch.cuda.device(dev):
                for call in calls:
                    self._stream(meta, st, call, opener, dev, rank, progress)
        need, seen, tensors = st.need, st.seen, st.tensors
        missing = sorted(f"{f}:{k}" for f, ks in need.items() for k in ks if (f, k) not in seen)
        if missing:
            raise LoadError(f"instanttensor never delivered {len(missing)} needed key(s): "
                            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}", rank=rank)
        if _allocation_device(dev).type == "cuda":   # dev is CUDA and available (check_device)
            torch.cuda.synchronize(dev)
        return tensors, LoadStats(engine=self.name, tensors=len(tensors), bytes_read=st.share,
                                  bytes_held=st.held, seconds=time.perf_counter() - t0,
                                  extra={"bytes_streamed": st.streamed, "calls": len(calls),
                                         "groups": [g.mode for g in st.groups]})

    def _prepare(self, meta: CheckpointMeta, rank_plan: RankPlan, dev: torch.device,
                 out: Mapping[str, torch.Tensor] | None, world: int,
                 checked: contextlib.ExitStack) -> _Load:
        """This rank's part of the load that needs no other rank: the plan's load groups
        checked, the destinations allocated, the safe_open calls decided (their process
        groups as plan ranks, ``_group_keys``), and every file of every call checked on a
        descriptor ``checked`` holds open until the load ends."""
        rank = rank_plan.rank
        keymap, file_keys, empty_files = _stored_pieces(meta)
        _refuse_zero_size_ties(meta, empty_files, rank)
        groups = self.load_groups(meta, file_keys)
        known_files = {f.name for f in meta.files}
        for g in groups:
            bad = [f for f in g.files if f not in known_files]
            if bad:
                raise LoadError(f"plan load group names files not in the checkpoint: {bad}",
                                rank=rank)
            if g.mode not in tuple(LoadGroupMode):
                raise LoadError(f"plan load group mode {g.mode!r}; expected 'group' or 'filtered'",
                                rank=rank)
        alloc_dev = _allocation_device(dev)
        tensors: dict[str, torch.Tensor] = {}
        held = 0
        check_out(out, rank_plan, rank)
        for ts in rank_plan.tensors:
            if ts.name not in meta.tensors:
                raise LoadError("planned tensor is not in the checkpoint", tensor=ts.name, rank=rank)
            tensors[ts.name] = allocate(ts, alloc_dev, out, rank=rank)
            held += slice_nbytes(ts)
        need = needed_keys(meta, rank_plan)
        keys = self._group_keys(groups, world)
        calls = open_calls(groups, keys, rank, need)
        infos = {fi.name: fi for fi in meta.files}
        for c in calls:
            # instanttensor opens the paths itself: each file is checked on a descriptor
            # held open meanwhile, and each path must still name that file after the
            # stream (not the descriptors' /proc paths: instanttensor sorts the paths it
            # is given, and the ranks of a group must list the files alike)
            checked.enter_context(paths_stay_checked(
                [os.path.join(meta.root, f) for f in c.files], [infos[f] for f in c.files], rank))
        return _Load(groups, keys, calls, rank_plan.by_name(), tensors, held, keymap, file_keys,
                     need)

    def _stream(self, meta: CheckpointMeta, st: _Load, call: OpenCall, opener: Any,
                dev: torch.device, rank: int, progress: Progress | None) -> None:
        """One safe_open: each streamed tensor attributed to its file and piece, checked,
        and copied into this rank's destinations where it holds part of it."""
        files, pg, keys, gsize = call
        paths = [os.path.join(meta.root, f) for f in files]
        keymap, file_keys, slices, tensors = st.keymap, st.file_keys, st.slices, st.tensors
        kwargs = dict(self.tuning)
        if keys is not None:
            kwargs.update(tensor_filter=keys, tensor_name_match_mode="exact")
        named = files[0] + (" and others" if len(files) > 1 else "")   # for messages
        listed = ", ".join(files[:4]) + (f", and {len(files) - 4} more" if len(files) > 4
                                         else "")
        with _instanttensor_errors(f"instanttensor.safe_open failed on {len(files)} file(s) "
                                   f"({listed})", rank):
            handle = opener(list(paths), framework="pt", device=dev.index, process_group=pg,
                            copy=False, **kwargs)
        with _instanttensor_errors(f"instanttensor failed while streaming {named}", rank), \
                handle as f:
            # which file each yielded tensor comes from: its position in the file
            # order the handle streams; without that order, its key where each key
            # is in one file (never a guessed order: two files holding a key 'w'
            # of one shape, a wrong order loads one's rows as the other's)
            order = _stream_order(f, paths, files) if len(files) > 1 else list(files)
            streams = by_key = None
            if order is not None:
                streams = _stream_files(order, keys, file_keys)   # file per yield
            else:
                by_key, shared = _key_files(files, keys, file_keys)
                if shared:
                    raise LoadError(
                        f"instanttensor does not say in which order it streams the "
                        f"{len(files)} files ({files[0]}, ...; its handle has no "
                        f"'filename' list of them), and key(s) {shared[:4]}"
                        f"{' ...' if len(shared) > 4 else ''} are stored in several "
                        f"of them (torch DCP's per-rank files): which file a streamed "
                        f"tensor comes from cannot be told; use --engine cpu",
                        rank=rank)

            def take(i: int, key: str, t: torch.Tensor) -> None:
                """The ``i``-th streamed tensor checked, and copied where this rank holds it."""
                if streams is not None and i >= len(streams):
                    raise LoadError(f"instanttensor yielded key {key!r} after the "
                                    f"{len(streams)} tensor(s) the checkpoint metadata "
                                    f"lists in {named} (file changed?)", rank=rank)
                if streams is not None:
                    fname, want, _ = streams[i]
                    if key != want and not _take_tied(streams, i, key):
                        raise LoadError(
                            f"instanttensor yielded key {key!r} where the checkpoint "
                            f"metadata has {want!r} next in this file (the stream "
                            f"skipped or added a tensor, or the file changed?)",
                            file=fname, rank=rank)
                elif key in by_key:
                    fname = by_key[key]
                else:
                    raise LoadError(f"instanttensor yielded key {key!r}, which the "
                                    f"checkpoint metadata does not list in {files[0]}"
                                    f"{' or the others' if len(files) > 1 else ''} "
                                    f"(file changed?)", rank=rank)
                ent = keymap.get((fname, key))
                if ent is None:
                    raise LoadError(f"instanttensor yielded key {key!r}, which the "
                                    f"checkpoint metadata does not list in this file "
                                    f"(file changed?)", file=fname, rank=rank)
                name, dtype, box = ent
                want = (dtypes.torch_dtype(dtype), box_shape(box))
                if (t.dtype, tuple(t.shape)) != want:
                    # same element count is not enough: a piece of another file
                    # or layout would be copied in as this one's
                    raise LoadError(f"instanttensor yielded key {key!r} as {t.dtype} "
                                    f"{list(t.shape)}; the checkpoint metadata has it "
                                    f"in this file as {want[0]} {list(want[1])} (file "
                                    f"changed, or the stream attributed to the wrong "
                                    f"file?)", file=fname, tensor=name, rank=rank)
                nb = t.numel() * t.element_size()
                st.streamed += nb
                st.share += nb // gsize
                ts = slices.get(name)
                if ts is None:
                    return  # another rank's tensor: dropped as it streams past
                dst = tensors[name]
                for pc in ts.pieces:
                    copy_overlap(dst, pc.src, pc.dst, t, box)
                st.seen.add((fname, key))
                if progress is not None:
                    progress(nb)
            yielded, failed = 0, None
            for i, (key, t) in enumerate(f.tensors()):
                yielded = i + 1
                if failed is not None:
                    continue   # drained: see below
                try:
                    take(i, key, t)
                except Exception as e:
                    if not isinstance(e, LoadError):   # a progress callback's, a copy's
                        err = LoadError(f"taking key {key!r} of {named} from instanttensor's "
                                        f"stream failed: {type(e).__name__}: {e}", rank=rank)
                        err.__cause__ = e
                        e = err
                    if pg is None:
                        raise e
                    # the group's ranks read collectively: one leaving the stream left
                    # the others in its all-gathers until the group's timeout (NCCL: a
                    # watchdog crash). It drains the stream with them, then raises; the
                    # others learn of it where the load agrees next.
                    failed = e
            if failed is not None:
                raise failed
            if streams is not None and yielded < len(streams):
                # the next file's keys and shapes can line up with the ones expected (DCP's
                # per-rank files): a stream that left out a file had its tensors attributed
                # to that file, checked and copied in as its rows
                fname, want, _ = streams[yielded]
                raise LoadError(f"instanttensor's stream ended after {yielded} of the "
                                f"{len(streams)} tensor(s) the checkpoint metadata lists in "
                                f"{named}, before key {want!r} of this file (the stream skipped "
                                f"tensors, or the file changed?)", file=fname, rank=rank)
