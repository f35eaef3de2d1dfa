"""``coordloader.save``: write a sharded state (one dict of local tensors per rank, as a
plan describes them) as a coordloader sharded checkpoint that any layout can load.

On-disk format (read back by ``coordloader.checkpoint``):

- every rank writes the pieces it holds as *primary* copy (``replica == 0``; replicas are
  not written twice) into its own files ``model-rank-RRRRR-part-PPPPP.safetensors``. A piece
  is stored under the key ``name`` when it is the whole tensor, else ``name@a:b,c:d`` (its
  box in the global tensor). The file's ``__metadata__`` maps each key to a JSON string
  ``{"name", "shape", "box"}`` so a shard file explains itself without the index;
- ``model.safetensors.index.json`` holds the HF ``weight_map`` (name -> file of its first
  piece) plus a ``"coordloader"`` section: version, the saving layout and, per tensor,
  dtype, global shape and its pieces ``[{file, key, box}]``;
- ``coordloader.manifest.json``: content digests per tensor, the sum of the pieces'
  digests (digests are linear), so the manifest costs no second read.

Publishing is atomic at the level that matters to a reader: every file is written and
fsynced in a hidden staging directory inside ``out_dir``, renamed into place, the
directory fsynced, and the index is renamed in LAST. A crash at any point leaves either
the previous checkpoint or a directory without an index (which no reader takes for a
checkpoint); a re-run cleans the leftovers. An existing checkpoint is never replaced unless
``overwrite=True``; its files that the new checkpoint does not reuse are removed only after
the new index is published.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.metadata import Box, box_numel, box_shape, piece_key
from coordloader.errors import CoordloaderError, SaveError
from coordloader.verify.manifest import MANIFEST_NAME

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
STAGING_PREFIX = ".coordloader-staging-"
FORMAT_VERSION = 1
SHARD_PATTERN = "model-rank-{rank:05d}-part-{part:05d}.safetensors"

# Test hook: called with a stage name ("staged", "published-shards") so a test can kill
# the process between shard writes and the index. Never set in production.
_test_hook: Callable[[str], None] | None = None


def _hook(stage: str) -> None:
    if _test_hook is not None:
        _test_hook(stage)


def shard_name(rank: int, part: int) -> str:
    return SHARD_PATTERN.format(rank=rank, part=part)


@dataclass(frozen=True)
class SaveResult:
    out_dir: str
    rank: int
    files: tuple[str, ...]          # files this rank wrote
    bytes_written: int              # data bytes this rank wrote
    seconds: float                  # this rank's write time (staging, before the barrier)
    published: bool                 # True on the rank that published the index
    manifest: bool = False          # a content-digest manifest was written


# ---------------------------------------------------------------------------------------
# low-level durable file helpers
# ---------------------------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(e: OSError, path: str, rank: int | None, what: str) -> SaveError:
    if e.errno == errno.ENOSPC:
        msg = f"no space left on device while {what}; the previous state of the directory is intact"
    elif e.errno == errno.EDQUOT:
        msg = f"disk quota exceeded while {what}; the previous state of the directory is intact"
    else:
        msg = f"{what} failed: {e.strerror or e}"
    return SaveError(msg, file=path, rank=rank)


def _writer_error(e: SaveError, path: str, rank: int | None, what: str) -> SaveError:
    """The safetensors writer's SaveError re-addressed to ``path`` and ``rank``: an OS error
    (it wraps every one) in ``_os_error``'s words, anything else with its tensor kept."""
    if isinstance(e.__cause__, OSError):
        return _os_error(e.__cause__, path, rank, what)
    return SaveError(e.message, file=path, tensor=e.tensor, rank=rank)


def _write_bytes_durable(path: str, data: bytes) -> None:
    """Write a small file completely and fsync it (the caller renames it into place)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_durable(path: str, obj: Any) -> None:
    _write_bytes_durable(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


# ---------------------------------------------------------------------------------------
# per-rank work: choose pieces, narrow them out of the local tensors, write shard files
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _PieceOut:
    name: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    key: str
    nbytes: int


def _local_pieces(tensors: Mapping[str, torch.Tensor], rank_plan, rank: int):
    """(PieceOut, tensor view) for every primary piece of this rank, in plan order.
    Views are narrowed from the local tensor at the piece's destination offset, so vocab
    padding rows (covered by no piece) are never written."""
    from coordloader.checkpoint.dtypes import torch_dtype
    from coordloader.engines import narrow_box
    out = []
    for ts in rank_plan.tensors:
        if ts.replica != 0:
            continue
        if ts.name not in tensors:
            raise SaveError("the plan gives this rank a primary slice of the tensor, but it is "
                            "missing from the tensors passed to save()", tensor=ts.name, rank=rank)
        t = tensors[ts.name]
        if not isinstance(t, torch.Tensor):
            raise SaveError(f"expected a torch.Tensor, got {type(t).__name__}", tensor=ts.name, rank=rank)
        if tuple(t.shape) != tuple(ts.local_shape):
            raise SaveError(f"local shape {list(t.shape)} differs from the plan's {list(ts.local_shape)}",
                            tensor=ts.name, rank=rank)
        if t.dtype != torch_dtype(ts.dtype):
            raise SaveError(f"dtype {t.dtype} differs from the checkpoint dtype {ts.dtype} "
                            f"({torch_dtype(ts.dtype)}); convert before saving", tensor=ts.name, rank=rank)
        for pc in ts.pieces:
            view = narrow_box(t, pc.dst, box_shape(pc.src))
            key = piece_key(ts.name, pc.src, ts.global_shape)
            nb = box_numel(pc.src) * itemsize(ts.dtype)
            out.append((_PieceOut(ts.name, ts.dtype, tuple(ts.global_shape), tuple(pc.src), key, nb), view))
    return out


def _split_parts(pieces, max_shard_bytes: int):
    """Greedy packing in plan order; a piece larger than the bound gets its own file."""
    parts, cur, size = [], [], 0
    for p, v in pieces:
        if cur and size + p.nbytes > max_shard_bytes:
            parts.append(cur)
            cur, size = [], 0
        cur.append((p, v))
        size += p.nbytes
    if cur:
        parts.append(cur)
    return parts


def _write_rank(stage: str, tensors, plan, rank: int, max_shard_bytes: int, with_digests: bool):
    """Write this rank's shard files into ``stage``; return its record for the index.
    The pieces' digests are computed on a worker thread while the file is written (torch
    ops and os.write both release the GIL), so the manifest costs little wall time."""
    from concurrent.futures import ThreadPoolExecutor

    from coordloader.checkpoint.fileio import write_safetensors
    from coordloader.verify.digest import digest_many
    pieces = _local_pieces(tensors, plan.rank(rank), rank)
    records, files, total = [], [], 0
    pool = ThreadPoolExecutor(1, thread_name_prefix="coordloader-save-digest") if with_digests else None
    try:
        for part, chunk in enumerate(_split_parts(pieces, max_shard_bytes)):
            fname = shard_name(rank, part)
            path = os.path.join(stage, fname)
            entries, meta, items = [], {"format": "pt"}, []
            for p, view in chunk:
                data = view.detach()
                if data.device.type != "cpu":
                    data = data.cpu()
                data = data.contiguous()
                entries.append((p.key, p.dtype, list(box_shape(p.box)), data))
                meta[p.key] = json.dumps({"name": p.name, "shape": list(p.shape),
                                          "box": [list(x) for x in p.box]}, separators=(",", ":"))
                items.append((data, p.box, p.shape))
                records.append({"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "key": p.key,
                                "box": [list(x) for x in p.box], "file": fname, "nbytes": p.nbytes,
                                "digest": None})
                total += p.nbytes
            # one batched digest per shard (small pieces of one shape share a product),
            # computed while the file is written
            fut = (pool.submit(digest_many, items, return_errors=True) if pool is not None
                   else None)
            try:
                write_safetensors(path, entries, meta)
            except SaveError as e:
                raise _writer_error(e, fname, rank, "writing a shard file") from e
            if fut is not None:
                for rec, d in zip(records[len(records) - len(items):], fut.result()):
                    if isinstance(d, Exception):
                        raise SaveError(f"cannot digest the piece {rec['box']}: "
                                        f"{getattr(d, 'message', d)}", file=fname,
                                        tensor=rec["name"], rank=rank) from d
                    rec["digest"] = int(d)
            files.append(fname)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return {"rank": rank, "files": files, "pieces": records, "bytes": total}


# ---------------------------------------------------------------------------------------
# rank 0: index, manifest, atomic publication
# ---------------------------------------------------------------------------------------

def _existing_checkpoint_files(out_dir: str) -> set[str] | None:
    """Files of the checkpoint already in ``out_dir`` (None when there is none)."""
    idx = os.path.join(out_dir, INDEX_NAME)
    if os.path.exists(idx):
        names = {INDEX_NAME}
        try:
            with open(idx) as f:
                d = json.load(f)
            names |= {v for v in (d.get("weight_map") or {}).values() if isinstance(v, str)}
            for t in ((d.get("coordloader") or {}).get("tensors") or {}).values():
                names |= {p.get("file") for p in t.get("pieces", []) if isinstance(p.get("file"), str)}
        except (OSError, ValueError, AttributeError):
            pass  # unreadable old index: only its own name is known
        for extra in (MANIFEST_NAME,):
            if os.path.exists(os.path.join(out_dir, extra)):
                names.add(extra)
        # never follow names out of the directory
        return {n for n in names if n and "/" not in n and "\\" not in n and n not in (".", "..")}
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        names = {"model.safetensors"}
        if os.path.exists(os.path.join(out_dir, MANIFEST_NAME)):
            names.add(MANIFEST_NAME)
        return names
    return None


def _prepare(out_dir: str, overwrite: bool, rank: int, token: str) -> str:
    """Check the target and create a fresh staging directory; returns its name."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise _os_error(e, out_dir, rank, "creating the output directory") from e
    if not os.path.isdir(out_dir):
        raise SaveError("output path exists and is not a directory", file=out_dir, rank=rank)
    if _existing_checkpoint_files(out_dir) is not None and not overwrite:
        raise SaveError("a checkpoint already exists here; pass overwrite=True to replace it",
                        file=out_dir, rank=rank)
    # Leftovers of a crashed save (never part of a published checkpoint).
    for n in os.listdir(out_dir):
        if n.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(out_dir, n), ignore_errors=True)
    stage = STAGING_PREFIX + token
    try:
        os.mkdir(os.path.join(out_dir, stage))
    except OSError as e:
        raise _os_error(e, os.path.join(out_dir, stage), rank, "creating the staging directory") from e
    return stage


def _build_index(records: list[dict], layout_dict: dict, names_order: list[str]) -> tuple[dict, dict]:
    """(index, per-tensor digests or {}) from every rank's records."""
    tensors: dict[str, dict] = {}
    digests: dict[str, int | None] = {}
    for rec in records:
        for p in rec["pieces"]:
            t = tensors.get(p["name"])
            if t is None:
                t = tensors[p["name"]] = {"dtype": p["dtype"], "shape": p["shape"], "pieces": []}
                digests[p["name"]] = 0
            elif t["dtype"] != p["dtype"] or t["shape"] != p["shape"]:
                raise SaveError(f"ranks disagree on dtype/shape ({t['dtype']} {t['shape']} vs "
                                f"{p['dtype']} {p['shape']} on rank {rec['rank']})", tensor=p["name"])
            t["pieces"].append({"file": p["file"], "key": p["key"], "box": p["box"]})
            if p["digest"] is None or digests[p["name"]] is None:
                digests[p["name"]] = None
            else:
                digests[p["name"]] = (digests[p["name"]] + p["digest"]) % (1 << 64)
    # The plan is cover-validated, but a caller may hand in a hand-made one: refuse a
    # checkpoint whose pieces do not add up to each tensor (cheap volume check).
    total = 0
    for name, t in tensors.items():
        numel = 1
        for s in t["shape"]:
            numel *= s
        got = sum(box_numel(tuple(tuple(x) for x in pc["box"])) for pc in t["pieces"])
        if got != numel:
            raise SaveError(f"primary pieces hold {got} elements of {numel}: the plan does not cover "
                            f"the tensor exactly once", tensor=name)
        t["pieces"].sort(key=lambda pc: pc["box"])
        total += numel * itemsize(t["dtype"])
    order = [n for n in names_order if n in tensors] + sorted(set(tensors) - set(names_order))
    ordered = {n: tensors[n] for n in order}
    index = {
        "metadata": {"total_size": total, "format": "coordloader-sharded"},
        "weight_map": {n: ordered[n]["pieces"][0]["file"] for n in order},
        "coordloader": {"version": FORMAT_VERSION, "layout": layout_dict, "tensors": ordered},
    }
    if any(v is None for v in digests.values()):
        digests = {}
    return index, digests


def staged_manifest(stage_dir: str, files: list[str], entries: dict) -> dict:
    """The manifest document of the staged ``files`` (fingerprint from their headers,
    exactly as the reader computes it) with the given per-tensor ``TensorDigest``s: save
    sums them from the pieces' digests, consolidate carries the source's over; no re-read."""
    from coordloader.checkpoint.metadata import CheckpointMeta
    from coordloader.checkpoint.reader import read_file_header
    from coordloader.verify import manifest as mf
    infos = sorted((read_file_header(stage_dir, f).info for f in files), key=lambda i: i.name)
    meta = CheckpointMeta(root=os.path.abspath(stage_dir), files=tuple(infos), tensors={})
    return mf.to_json(meta, entries)


def _publish(out_dir: str, stage: str, records: list[dict], plan, overwrite: bool,
             config: Any, rank: int, names_order: list[str]) -> bool:
    """Rank 0: write index/manifest/config into the stage, then move everything into
    place, index last. Returns True when a manifest was written."""
    stage_dir = os.path.join(out_dir, stage)
    index, digests = _build_index(records, plan.layout.to_dict(), names_order)
    shard_files = [f for rec in records for f in rec["files"]]
    small: list[str] = []
    # config.json
    if config is not None:
        p = os.path.join(stage_dir, CONFIG_NAME)
        try:
            if isinstance(config, (str, os.PathLike)):
                if os.path.isdir(config):  # a checkpoint directory: take its config.json
                    config = os.path.join(config, CONFIG_NAME)
                with open(config, "rb") as f:
                    data = f.read()
                json.loads(data)  # refuse to publish a config that is not JSON
                _write_bytes_durable(p, data)
            else:
                _write_json_durable(p, dict(config))
        except OSError as e:
            raise _os_error(e, p, rank, "writing config.json") from e
        except ValueError as e:
            raise SaveError(f"config is not valid JSON: {e}", file=str(config), rank=rank) from e
        small.append(CONFIG_NAME)
    # manifest: digests summed from the pieces' digests, against the new files' fingerprint
    wrote_manifest = False
    if digests:
        from coordloader.verify.manifest import TensorDigest
        tensors = index["coordloader"]["tensors"]
        doc = staged_manifest(stage_dir, shard_files, {
            n: TensorDigest(tensors[n]["dtype"], tuple(tensors[n]["shape"]), d)
            for n, d in digests.items()})
        p = os.path.join(stage_dir, MANIFEST_NAME)
        try:
            _write_json_durable(p, doc)
        except OSError as e:
            raise _os_error(e, p, rank, "writing the manifest") from e
        small.append(MANIFEST_NAME)
        wrote_manifest = True
    if plan.excluded:
        # The plan left these out on purpose (e.g. MTP layers): they are not in the new
        # checkpoint either. Say so, since a handoff usually wants everything.
        import warnings
        warnings.warn(f"coordloader.save: {len(plan.excluded)} checkpoint tensors excluded by the plan "
                      f"are not saved (e.g. {list(plan.excluded)[:3]}); use a layout that includes "
                      f"them (include_mtp=True) to keep them", stacklevel=3)
    ip = os.path.join(stage_dir, INDEX_NAME)
    try:
        _write_json_durable(ip, index)
        _fsync_dir(stage_dir)
    except OSError as e:
        raise _os_error(e, ip, rank, "writing the index") from e
    _hook("staged")
    publish_staged(out_dir, stage_dir, shard_files + small, stray_prefix="model-rank-")
    shutil.rmtree(stage_dir, ignore_errors=True)
    _fsync_dir(out_dir)
    return wrote_manifest


def publish_staged(out_dir: str, stage_dir: str, files: list[str], *,
                   stray_prefix: str | None = None) -> None:
    """Move ``files`` and then the index from ``stage_dir`` (inside ``out_dir``, all
    written and fsynced) into place, index LAST, then remove the previous checkpoint's
    files the new one does not use (and, with ``stray_prefix``, ``*.safetensors`` files of
    that prefix left by a crashed run). ``config.json`` is never removed. Used by
    ``save`` and ``consolidate``."""
    # From here on nothing is written, only renamed: no ENOSPC. First take the old index
    # away (overwrite only), so that no moment shows an old index over new shards.
    old = _existing_checkpoint_files(out_dir) or set()
    if INDEX_NAME in old:
        os.unlink(os.path.join(out_dir, INDEX_NAME))
        _fsync_dir(out_dir)
    for f in files:
        os.replace(os.path.join(stage_dir, f), os.path.join(out_dir, f))
    _fsync_dir(out_dir)
    _hook("published-shards")
    os.replace(os.path.join(stage_dir, INDEX_NAME), os.path.join(out_dir, INDEX_NAME))
    _fsync_dir(out_dir)
    # Published. Now remove what the new checkpoint does not use.
    stray = set()
    if stray_prefix:
        stray = {n for n in os.listdir(out_dir) if n.startswith(stray_prefix) and n.endswith(".safetensors")}
    for n in sorted((old | stray) - set(files) - {INDEX_NAME, CONFIG_NAME}):
        try:
            os.unlink(os.path.join(out_dir, n))
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------
# error agreement across ranks
# ---------------------------------------------------------------------------------------

def _resolve_group(group):
    """``group`` as a coordloader.collective.Group (error agreement with rank naming and
    timeouts)."""
    from coordloader.dist import collective as coll
    return group if isinstance(group, coll.Group) else coll.wrap_group(group)


# ---------------------------------------------------------------------------------------
# public entry
# ---------------------------------------------------------------------------------------

def _ckpt_order(plan) -> list[str]:
    seen, order = set(), []
    for rp in plan.ranks:
        for ts in rp.tensors:
            if ts.name not in seen:
                seen.add(ts.name)
                order.append(ts.name)
    return order


def save(out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor], plan, *,
         rank: int | None = None, group=None, max_shard_bytes: int = 5 * 2**30,
         overwrite: bool = False, config: Mapping | str | os.PathLike | None = None,
         digests: bool = True) -> SaveResult:
    """Save this rank's share of a sharded state as a coordloader sharded checkpoint.

    ``tensors`` is this rank's dict as ``coordloader.load`` returns it for ``plan`` (local
    tensors keyed by checkpoint names). Distributed mode (``group`` given, or the default
    group initialised and ``rank`` None): every rank of the group calls save; errors are
    agreed so every rank raises. Local mode (no process group): call once per plan rank,
    in rank order 0..world-1 (``rank=r``); the call for rank 0 starts a fresh save, the
    call for the last rank publishes it. ``config`` (a dict, a path to config.json, or the
    source checkpoint directory) is written next to the index: pass it, since the
    planner's presets are detected from config.json. Returns a :class:`SaveResult` for this rank."""
    import torch.distributed as dist

    from coordloader.dist.collective import gather_object, run_phase
    out_dir = os.fspath(out_dir)
    if max_shard_bytes <= 0:
        raise SaveError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    world = plan.world_size
    distributed = group is not None or (rank is None and dist.is_available() and dist.is_initialized())
    names_order = _ckpt_order(plan)

    if distributed:
        g = _resolve_group(group)
        rank_, gworld = g.rank, g.world
        if rank is not None and rank != rank_:
            raise SaveError(f"rank={rank} given, but this process is rank {rank_} of the group", rank=rank_)
        rank = rank_
        if gworld != world:
            raise SaveError(f"the process group has {gworld} ranks but the plan has {world} "
                            f"({plan.layout})", rank=rank)
        token = uuid.uuid4().hex[:16]
        stage = run_phase("save-prepare",
                          lambda: _prepare(out_dir, overwrite, rank, token) if rank == 0 else None, g)
        stage = gather_object(g, stage)[0]   # rank 0's staging directory name
        t0 = time.perf_counter()
        try:
            mine = run_phase("save-write", _write_rank, g, os.path.join(out_dir, stage), tensors,
                             plan, rank, max_shard_bytes, digests)
        except CoordloaderError:
            if rank == 0:  # every rank has stopped writing: the stage can go
                shutil.rmtree(os.path.join(out_dir, stage), ignore_errors=True)
            raise
        secs = time.perf_counter() - t0
        recs = gather_object(g, mine)

        def publish():
            if rank != 0:
                return None
            try:
                return _publish(out_dir, stage, recs, plan, overwrite, config, rank, names_order)
            except BaseException:
                shutil.rmtree(os.path.join(out_dir, stage), ignore_errors=True)
                raise
        wrote = gather_object(g, run_phase("save-publish", publish, g))[0]
        return SaveResult(out_dir, rank, tuple(mine["files"]), mine["bytes"], secs, rank == 0, bool(wrote))

    # ---- local mode -------------------------------------------------------------------
    rank = 0 if rank is None else int(rank)
    if not 0 <= rank < world:
        raise SaveError(f"rank {rank} outside the plan's world of {world} ({plan.layout})", rank=rank)
    stage = STAGING_PREFIX + "local-" + plan.digest()[:16]
    stage_dir = os.path.join(out_dir, stage)
    if rank == 0:
        _prepare_local = _prepare(out_dir, overwrite, rank, "local-" + plan.digest()[:16])
        assert _prepare_local == stage
    else:
        missing = [r for r in range(rank)
                   if not os.path.exists(os.path.join(stage_dir, f"rank-{r:05d}.json"))]
        if missing:
            raise SaveError(f"local-mode save: call save() for ranks in order 0..{world - 1}; ranks "
                            f"{missing} have not been saved into this staging directory", file=stage_dir,
                            rank=rank)
    t0 = time.perf_counter()
    try:
        rec = _write_rank(stage_dir, tensors, plan, rank, max_shard_bytes, digests)
        _write_json_durable(os.path.join(stage_dir, f"rank-{rank:05d}.json"), rec)
    except OSError as e:
        shutil.rmtree(stage_dir, ignore_errors=True)
        raise _os_error(e, stage_dir, rank, "writing the rank record") from e
    except BaseException:
        shutil.rmtree(stage_dir, ignore_errors=True)
        raise
    secs = time.perf_counter() - t0
    wrote = False
    if rank == world - 1:
        recs = []
        for r in range(world):
            with open(os.path.join(stage_dir, f"rank-{r:05d}.json")) as f:
                recs.append(json.load(f))
        try:
            wrote = _publish(out_dir, stage, recs, plan, overwrite, config, rank, names_order)
        except BaseException:
            shutil.rmtree(stage_dir, ignore_errors=True)
            raise
    return SaveResult(out_dir, rank, tuple(rec["files"]), rec["bytes"], secs, rank == world - 1, wrote)
