"""``coordloader.save``: write what the ranks of a training job hold (a plan's slices,
DTensors, boxes given by hand: ``handoff/pieces.py``) as a coordloader sharded checkpoint
that any layout can load.

On-disk format, version 2 (read back by ``coordloader.checkpoint``; names in
``checkpoint/formats.py``, chosen so that no Hugging Face reader takes the directory for
a checkpoint of its own):

- every rank writes the pieces it holds as *primary* copy (``replica == 0``, less the
  pieces the plan marks as copies, ``Piece.copy``; replicas are not written twice) into
  its own files ``rank-RRRRR-part-PPPPP.coordloader-shard``
  (safetensors content). A piece is stored under the key ``name`` when it is the whole
  tensor, else ``name@a:b,c:d`` (its box in the global tensor). The file's
  ``__metadata__`` maps each key to a JSON string ``{"name", "shape", "box"}`` so a shard
  file explains itself without the index;
- ``coordloader-index.json``: format, version, the saving layout, the model (preset,
  architectures, model_type from config.json) and, per tensor, dtype, global shape and
  its pieces ``[{file, key, box}]``;
- ``coordloader.manifest.json``: content digests per tensor, the sum of the pieces'
  digests (digests are linear), so the manifest costs no second read;
- ``config.json`` (required) and the source directory's companion files
  (``generation_config.json``, tokenizer files, chat template).

Publishing goes through ``handoff/publish.py``: staged and fsynced first, then moved in
under a marker that every coordloader reader refuses, so a kill at any point leaves the
previous checkpoint, the new one, or a directory that says a save was interrupted and how
to finish it.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Mapping

import torch

from coordloader.checkpoint.dtypes import itemsize
from coordloader.checkpoint.formats import (
    SHARDED_FORMAT,
    SHARDED_INDEX,
    SHARDED_VERSION,
    STAGING_PREFIX,
    shard_name,
)
from coordloader.checkpoint.metadata import box_numel, box_shape, config_mismatch
from coordloader.checkpoint.tiling import TilingKind, fmt_box, tiling_problem
from coordloader.engines import on_host_default_device, wraps_other_tensors
from coordloader.errors import CollectiveError, ConfigError, SaveError
from coordloader.handoff.pieces import (
    collect_pieces,
    disagreement,
    keep_primaries,
    undecided,
)
from coordloader.handoff.publish import (
    ModelConfig,
    check_sizes,
    end_stage,
    os_error,
    output_dir,
    prepare_target,
    publish,
    publish_error,
    resolve_config,
    stage_call,
    stage_config,
    write_json_durable,
    writer_error,
)
from coordloader.layout import as_rank
from coordloader.text import format_ranks
from coordloader.verify.manifest import MANIFEST_NAME


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
# per-rank work: choose pieces, narrow them out of the local tensors, write shard files
# ---------------------------------------------------------------------------------------

def _split_parts(pieces, max_shard_bytes: int):
    """Greedy packing in plan order; a piece larger than the bound gets its own file."""
    parts, cur, size = [], [], 0
    for p in pieces:
        if cur and size + p.nbytes > max_shard_bytes:
            parts.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.nbytes
    if cur:
        parts.append(cur)
    return parts


def _write_rank(stage: str, pieces, rank: int, max_shard_bytes: int, with_digests: bool):
    """Write this rank's shard files into ``stage``; return its record for the index.
    The pieces' digests are computed on a worker thread while the file is written (torch
    ops and os.write both release the GIL), so the manifest costs little wall time."""
    from concurrent.futures import ThreadPoolExecutor

    from coordloader.checkpoint.fileio import write_safetensors
    from coordloader.verify.digest import digest_many
    records, files, total = [], [], 0
    pool = ThreadPoolExecutor(1, thread_name_prefix="coordloader-save-digest") if with_digests else None
    try:
        for part, chunk in enumerate(_split_parts(pieces, max_shard_bytes)):
            fname = shard_name(rank, part)
            path = os.path.join(stage, fname)
            entries, meta, items = [], {"format": "pt"}, []
            for p in chunk:
                data = p.view.detach()
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
                raise writer_error(e, fname, rank, "writing a shard file") from e
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


def check_whole_claims(pieces, tensors, cfg: ModelConfig, rank: int) -> None:
    """SaveError where a plain tensor saved without a plan, in a distributed save, has a
    global shape config.json contradicts (``config_mismatch``: vocab, hidden size, heads
    times head_dim, intermediate size, experts). Each rank's tensor is taken as the whole
    tensor and the ranks' equal boxes are written once, from the lowest rank: ranks
    passing their FSDP or TP shards (``dt.to_local()``) saved half of a weight. Only that
    claim is checked: the shapes of a plan, a DTensor or a Boxed tensor are stated, not
    inferred, and a single process's plain tensor is whole by its own say (a draft head,
    a vision tower under a flat config or packed quantized weights need not have the
    sizes config.json states). A whole tensor the check refuses goes as a Boxed one."""
    plain = {p.name: p.shape for p in pieces
             if isinstance(tensors.get(p.name), torch.Tensor)
             and not wraps_other_tensors(tensors[p.name])}
    bad = config_mismatch(plain, cfg.doc)
    if bad is None:
        return
    name, key, want, got, dim = bad
    raise SaveError(f"global shape {list(plain[name])} has {got} along dim {dim}, but "
                    f"config.json says {key}={want}; expected the whole tensor (a plain tensor "
                    f"saved without a plan is taken as the whole tensor: pass a rank's shard "
                    f"as a DTensor or a coordloader Boxed, or save with the plan it was "
                    f"loaded with; a whole tensor of another shape as Boxed(t, t.shape, "
                    f"(0,) * t.dim()))", tensor=name, rank=rank)


# ---------------------------------------------------------------------------------------
# the last rank to finish: index, manifest, config, publication
# ---------------------------------------------------------------------------------------

def _build_index(records: list[dict], layout_dict: dict, names_order: list[str],
                 cfg: ModelConfig) -> tuple[dict, dict]:
    """(index, per-tensor digests or {}) from every rank's records."""
    from coordloader.planning.rules.presets import detect_preset
    tensors: dict[str, dict] = {}
    digests: dict[str, int | None] = {}
    ranks_of: dict[str, list[int]] = {}   # the rank of each piece, for messages
    for rec in records:
        for p in rec["pieces"]:
            t = tensors.get(p["name"])
            if t is None:
                t = tensors[p["name"]] = {"dtype": p["dtype"], "shape": p["shape"], "pieces": []}
                digests[p["name"]] = 0
            elif t["dtype"] != p["dtype"] or t["shape"] != p["shape"]:
                raise disagreement(p["name"], (t["dtype"], t["shape"], ranks_of[p["name"]][0]),
                                   (p["dtype"], p["shape"], rec["rank"]))
            t["pieces"].append({"file": p["file"], "key": p["key"], "box": p["box"]})
            ranks_of.setdefault(p["name"], []).append(rec["rank"])
            if p["digest"] is None or digests[p["name"]] is None:
                digests[p["name"]] = None
            else:
                digests[p["name"]] = (digests[p["name"]] + p["digest"]) % (1 << 64)
    if not tensors:
        # every reader refuses an index without tensors: publishing one would replace a
        # previous checkpoint with an unreadable directory
        raise SaveError("no rank passed any tensor: there is nothing to save (expected a "
                        "state dict with at least one tensor)")
    # Whatever the pieces came from (a plan, DTensor placements, boxes given by hand),
    # they must tile each tensor exactly once: refuse gaps and overlaps, naming the ranks.
    total = 0
    for name, t in tensors.items():
        boxes = [tuple(tuple(x) for x in pc["box"]) for pc in t["pieces"]]
        prob = tiling_problem(boxes, t["shape"], allow_empty=True)
        if prob is not None:
            who = ranks_of[name]
            if prob.kind is TilingKind.OVERLAP:
                raise SaveError(f"the pieces saved by rank {who[prob.first]} "
                                f"{fmt_box(boxes[prob.first])} and rank {who[prob.second]} "
                                f"{fmt_box(boxes[prob.second])} overlap; expected every element "
                                f"of the global shape {t['shape']} saved exactly once", tensor=name)
            got = sum(box_numel(b) for b in boxes)
            raise SaveError(f"the pieces saved by {format_ranks(who)} hold {got} elements of "
                            f"the global shape {t['shape']} ({prob.detail}); expected them to "
                            f"tile the tensor exactly once", tensor=name)
        numel = 1
        for s in t["shape"]:
            numel *= s
        t["pieces"].sort(key=lambda pc: pc["box"])
        total += numel * itemsize(t["dtype"])
    order = [n for n in names_order if n in tensors] + sorted(set(tensors) - set(names_order))
    index = {
        "format": SHARDED_FORMAT,
        "version": SHARDED_VERSION,
        "total_size": total,
        "layout": layout_dict,
        # what the checkpoint is, for a reader that has only this directory
        "model": {"preset": detect_preset(cfg.doc),
                  "architectures": list(cfg.doc.get("architectures") or []),
                  "model_type": cfg.doc.get("model_type")},
        "tensors": {n: tensors[n] for n in order},
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


def _publish(out_dir: str, stage: str, records: list[dict], plan, cfg: ModelConfig,
             rank: int, names_order: list[str]) -> bool:
    # the saving layout, for information; a plan-less save records its world size only
    """Write index/manifest/config/companions into the stage, then publish it. Returns
    True when a manifest was written."""
    stage_dir = os.path.join(out_dir, stage)
    layout = plan.layout.to_dict() if plan is not None else {"world_size": len(records)}
    index, digests = _build_index(records, layout, names_order, cfg)
    shard_files = [f for rec in records for f in rec["files"]]
    try:
        small = stage_config(stage_dir, cfg)
    except SaveError as e:
        raise SaveError(e.message, file=e.file, rank=rank) from e
    # manifest: digests summed from the pieces' digests, against the new files' fingerprint
    wrote_manifest = False
    if digests:
        from coordloader.verify.manifest import TensorDigest
        tensors = index["tensors"]
        doc = staged_manifest(stage_dir, shard_files, {
            n: TensorDigest(tensors[n]["dtype"], tuple(tensors[n]["shape"]), d)
            for n, d in digests.items()})
        p = os.path.join(stage_dir, MANIFEST_NAME)
        try:
            write_json_durable(p, doc)
        except OSError as e:
            raise os_error(e, p, rank, "writing the manifest") from e
        small.append(MANIFEST_NAME)
        wrote_manifest = True
    if plan is not None and plan.excluded:
        # The plan left these out on purpose (e.g. MTP layers): they are not in the new
        # checkpoint either. Say so, since a handoff usually wants everything.
        import warnings
        warnings.warn(f"coordloader.save: {len(plan.excluded)} checkpoint tensors excluded by the plan "
                      f"are not saved (e.g. {list(plan.excluded)[:3]}); use a layout that includes "
                      f"them (include_mtp=True) to keep them", stacklevel=3)
    ip = os.path.join(stage_dir, SHARDED_INDEX)
    try:
        write_json_durable(ip, index)
        from coordloader.checkpoint.fileio import fsync_dir
        fsync_dir(stage_dir)
        publish(out_dir, stage, shard_files + small, SHARDED_INDEX, rank)
    except OSError as e:
        raise publish_error(e, out_dir, stage, getattr(e, "filename", None) or ip, rank,
                            "publishing the checkpoint") from e
    return wrote_manifest


# ---------------------------------------------------------------------------------------
# public entry: one function per mode
# ---------------------------------------------------------------------------------------

def _ckpt_order(plan, tensors) -> list[str]:
    seen, order = set(), []
    for rp in plan.ranks if plan is not None else ():
        for ts in rp.tensors:
            if ts.name not in seen:
                seen.add(ts.name)
                order.append(ts.name)
    return order + [n for n in tensors if n not in seen]


SAVE_USAGE = "save(out_dir, state_dict, ...)"


@on_host_default_device
def save(out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor], plan=None, *,
         rank: int | None = None, group=None, max_shard_bytes: int = 5 * 2**30,
         overwrite: bool = False, config: Mapping | str | os.PathLike | None = None,
         digests: bool = True, timeout: float | None = None) -> SaveResult:
    """Save this rank's share of a sharded state as a coordloader sharded checkpoint.

    ``tensors``: this rank's state dict. Its values are plain tensors as
    ``coordloader.load`` returns them for ``plan`` (checkpoint names, local shapes),
    ``DTensor``s (FSDP2 / TP: the boxes come from their placements, no plan needed),
    ``coordloader.Boxed`` local tensors (a box given by hand), or, without a plan, whole
    tensors. Any set of boxes over the ranks that tiles each tensor exactly once is
    accepted; a box held by several ranks is written once. Distributed mode (``group``
    given, or the default group initialised and ``rank`` None): every rank of the group
    calls save (``save_distributed``). Local mode (no process group): call once per plan
    rank, in rank order 0..world-1 (``rank=r``, ``save_local``); without a plan, one call.
    ``config`` (required: a dict, a path to config.json, or the source checkpoint
    directory, whose generation config, tokenizer files and chat template are copied too)
    is written next to the index. ``timeout``: seconds a rank waits for the others at each
    phase boundary of a distributed save. Returns a :class:`SaveResult` for this rank."""
    import torch.distributed as dist

    from coordloader.planning.model import Plan
    if plan is not None and not isinstance(plan, Plan):
        # (a rank's plan or a layout failed deep in the save with a bare AttributeError)
        hint = " (pass the whole plan, not plan.rank(r))" if hasattr(plan, "tensors") else ""
        raise SaveError(f"plan must be a coordloader Plan (make_plan(...), or "
                        f"load_detailed(...).plan) or None, got {type(plan).__name__}{hint}",
                        rank=rank if isinstance(rank, int) else None)
    if group is not None or (rank is None and dist.is_available() and dist.is_initialized()):
        return save_distributed(out_dir, tensors, plan, group=group, rank=rank,
                                max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                                config=config, digests=digests, timeout=timeout)
    from coordloader.dist.collective import timeout_problem
    bad = timeout_problem(timeout)   # refused as the same call under a group refuses it
    if bad:
        raise ConfigError(bad, rank=rank if isinstance(rank, int) else None)
    return save_local(out_dir, tensors, plan, rank=0 if rank is None else rank,
                      max_shard_bytes=max_shard_bytes, overwrite=overwrite, config=config,
                      digests=digests)


def save_distributed(out_dir, tensors, plan=None, *, group=None, rank: int | None = None,
                     max_shard_bytes: int = 5 * 2**30, overwrite: bool = False, config=None,
                     digests: bool = True, timeout: float | None = None) -> SaveResult:
    """Every rank of ``group`` (default: the default group) calls this; errors are agreed
    at each phase (prepare, write, publish) so every rank raises, naming the failing one."""
    from coordloader.dist import collective as coll
    # a coordloader Group, for error agreement with rank naming and ``timeout`` seconds at
    # each phase boundary (the collective default if None)
    with coll.adopted(group, timeout) as g:
        # checked once adopted: a rank refusing its arguments alone reaches the others at
        # their first boundary, and every rank's next adoption stays in step
        out_dir = output_dir(out_dir, g.rank, usage=SAVE_USAGE)
        max_shard_bytes, = check_sizes(g.rank, max_shard_bytes=max_shard_bytes)
        try:
            return _save_distributed(g, out_dir, tensors, plan, rank, max_shard_bytes,
                                     overwrite, config, digests)
        except CollectiveError as e:
            hint = _absent_hint(g, e)
            if not hint:
                raise
            raise CollectiveError(e.message + hint, file=e.file, tensor=e.tensor, rank=e.rank,
                                  phase=e.phase, failures=e.failures, missing=e.missing,
                                  local_error=e.local_error) from e


def _absent_hint(g, e: CollectiveError) -> str:
    """Why the first phase timed out, where the heartbeats say it: the missing ranks
    never adopted the save's group, so they never called save() at all. The likely cause
    is ``if rank == 0: save(...)`` with the whole state under an initialised group, which
    is distributed mode and waits for every rank; a rank merely slow to arrive has beaten,
    and a group without heartbeats tells nothing, so neither gets a hint."""
    from coordloader.dist.collective import never_adopted
    if e.phase != "save-prepare" or e.failures or not e.missing:
        return ""
    absent = never_adopted(g, e.missing)
    if not absent or absent != e.missing:
        return ""
    who = format_ranks(absent)
    hint = (f"; {who} never entered save() (no heartbeat from "
            f"{'it' if len(absent) == 1 else 'them'} in this save's group): under an "
            f"initialised process group save() is distributed mode, which every rank calls")
    if len(absent) == g.world - 1:
        hint += "; if this process alone holds the whole state, pass rank=0 (local mode)"
    return hint


def _save_distributed(g, out_dir, tensors, plan, rank, max_shard_bytes, overwrite, config,
                      digests) -> SaveResult:
    from coordloader.dist.collective import gather_object, options_disagreement, run_phase
    rank_, world = g.rank, g.world
    if rank is not None and rank != rank_:
        raise SaveError(f"rank={rank} given, but this process is rank {rank_} of the group", rank=rank_)
    rank = rank_
    token = uuid.uuid4().hex[:16]

    def prepare():
        if plan is not None and world != plan.world_size:
            raise SaveError(f"the process group has {world} ranks but the plan has "
                            f"{plan.world_size} ({plan.layout})", rank=rank)
        cfg = resolve_config(config, rank)
        pieces = collect_pieces(tensors, plan.rank(rank) if plan is not None else None, rank)
        if plan is None and world > 1:
            check_whole_claims(pieces, tensors, cfg, rank)
        stage = (prepare_target(out_dir, overwrite, rank, token, sharded=True)
                 if rank == 0 else None)
        return cfg, pieces, stage
    try:
        cfg, pieces, stage = run_phase("save-prepare", prepare, g)
    except BaseException:   # Ctrl-C too: its lock would be held while this process lives
        if rank == 0:  # another rank refused its tensors: the stage made here can go
            end_stage(out_dir, STAGING_PREFIX + token)
        raise
    # Every exchange runs inside a phase: a rank that dies in one is named by the others
    # (the agreement and the heartbeat), not reported as raw gloo text or a hang.

    def assign():
        # rank 0's staging directory, who holds which undecided box (written once, by the
        # lowest rank holding it), each rank's options; the order of names in the checkpoint
        # (out_dir is not compared: ranks may reach one directory by different paths, a
        # symlink or another mount point; each rank seeing rank 0's stage proves it)
        opts = {"digests": bool(digests), "overwrite": bool(overwrite)}
        held = gather_object(g, (stage, undecided(pieces), opts))
        diffs = options_disagreement([h[2] for h in held])
        if diffs:
            # digests: a manifest left out without a word
            raise ConfigError(f"ranks disagree on their save options ({diffs}); give every "
                              f"rank the same options", rank=rank)
        names = gather_object(g, _ckpt_order(plan, tensors) if rank == 0 or plan is None
                              else [])
        # after the phase's last collective: a rank refusing alone leaves none pending
        if not os.path.isdir(os.path.join(out_dir, held[0][0])):
            raise SaveError(f"rank 0's staging directory {held[0][0]} is not in out_dir "
                            f"{out_dir} as this rank sees it: a distributed save writes into "
                            f"one directory every rank sees (a shared file system); expected "
                            f"out_dir there", rank=rank)
        return (held[0][0], keep_primaries(pieces, [h[1] for h in held], rank),
                list(dict.fromkeys(n for part in names for n in part)))
    stage_here = stage
    try:
        stage, pieces, names_order = run_phase("save-assign", assign, g)
        t0 = time.perf_counter()
        mine = run_phase("save-write", _write_rank, g, os.path.join(out_dir, stage), pieces,
                         rank, max_shard_bytes, digests)
        secs = time.perf_counter() - t0
        recs = run_phase("save-collect", gather_object, g, g, mine)
    except BaseException:   # Ctrl-C too (see above)
        if rank == 0:  # every rank has stopped writing: the stage can go
            end_stage(out_dir, stage_here)
        raise

    def publish_():
        if rank != 0:
            return None
        return _publish_or_clean(out_dir, stage_here, recs, plan, cfg, rank, names_order)
    published = run_phase("save-publish", publish_, g)
    wrote = run_phase("save-done", gather_object, g, g, published)[0]
    return SaveResult(out_dir, rank, tuple(mine["files"]), mine["bytes"], secs, rank == 0, bool(wrote))


def _publish_or_clean(out_dir, stage, recs, plan, cfg, rank, names_order) -> bool:
    """Publish; a failure before the marker was written removes the stage (the previous
    checkpoint is untouched), one after it leaves marker and stage for ``recover_save``."""
    try:
        return _publish(out_dir, stage, recs, plan, cfg, rank, names_order)
    except BaseException:
        end_stage(out_dir, stage)
        raise


def _record(stage_dir: str, rank: int, reader: int) -> dict:
    """What rank ``rank`` of a local-mode save wrote (its ``rank-*.json``), read by rank
    ``reader``; SaveError naming the file when it cannot be read back."""
    path = os.path.join(stage_dir, f"rank-{rank:05d}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise os_error(e, path, reader, f"reading rank {rank}'s record") from e
    except ValueError as e:
        raise SaveError(f"rank {rank}'s record of this local-mode save is not valid JSON "
                        f"({e}); save every rank again", file=path, rank=reader) from None


def _group_hint(rank: int) -> str:
    """Where a local-mode call under an initialised process group passes the process's own
    rank, the likely cause of its refusal: every rank calling save(rank=get_rank()), which
    runs one local-mode save per process at once (rank= keeps local mode under a group, so
    that one process can save every plan rank in turn; the ranks then agree nothing)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    world, me = dist.get_world_size(), dist.get_rank()
    if world < 2 or rank != me:
        return ""
    return (f"; this process is rank {me} of an initialised process group of {world}: if every "
            f"rank calls save(), leave rank= out, so that they save together (distributed "
            f"mode); rank= is local mode, one process saving the ranks in turn")


def save_local(out_dir, tensors, plan=None, *, rank: int = 0, max_shard_bytes: int = 5 * 2**30,
               overwrite: bool = False, config=None, digests: bool = True) -> SaveResult:
    """One process saves every plan rank in turn (rank 0, 1, ..., world-1): the call for
    rank 0 starts a fresh save, the call for the last rank publishes it. Without a plan
    the world is this one call (whole tensors, or ``Boxed`` ones that tile alone)."""
    rank = as_rank(rank, SaveError)
    out_dir = output_dir(out_dir, rank, usage=SAVE_USAGE)
    max_shard_bytes, = check_sizes(rank, max_shard_bytes=max_shard_bytes)
    world = plan.world_size if plan is not None else 1
    if not 0 <= rank < world:
        where = f"the plan's world of {world} ({plan.layout})" if plan is not None else \
            "a save without a plan, which is one call (rank 0)"
        raise SaveError(f"rank {rank} outside {where}{_group_hint(rank)}", rank=rank)
    token = "local-" + (plan.digest()[:16] if plan is not None else uuid.uuid4().hex[:16])
    stage = STAGING_PREFIX + token
    stage_dir = os.path.join(out_dir, stage)
    try:  # refused before anything is written; a refused later rank ends the save
        cfg = resolve_config(config, rank)
        pieces = collect_pieces(tensors, plan.rank(rank) if plan is not None else None, rank,
                                alone=True)
    except BaseException:
        if rank > 0:
            end_stage(out_dir, stage)
        raise
    names_order = _ckpt_order(plan, tensors)
    if rank == 0:
        prepare_target(out_dir, overwrite, rank, token, sharded=True)
    else:
        missing = [r for r in range(rank)
                   if not os.path.exists(os.path.join(stage_dir, f"rank-{r:05d}.json"))]
        if missing:
            raise SaveError(f"local-mode save: call save() for ranks in order 0..{world - 1}; "
                            f"{format_ranks(missing)} {'has' if len(missing) == 1 else 'have'} "
                            f"not been saved into this staging directory"
                            f"{_group_hint(rank)}", file=stage_dir, rank=rank)
        stage_call(stage_dir, running=True)
    try:
        return _save_local_rank(out_dir, stage, stage_dir, pieces, plan, cfg, rank, world,
                                max_shard_bytes, digests, names_order)
    finally:
        # the stage waits for the next rank's call, or a rank-0 call restarting the save
        stage_call(stage_dir, running=False)


def _save_local_rank(out_dir, stage, stage_dir, pieces, plan, cfg, rank, world,
                     max_shard_bytes, digests, names_order) -> SaveResult:
    """The part of a local-mode rank's call that runs on the stage."""
    t0 = time.perf_counter()
    try:
        earlier = [_record(stage_dir, r, rank) for r in range(rank)]   # once: the index uses them
        if earlier:
            # a box an earlier rank already wrote (a Boxed replica) is written once, as in
            # a distributed save, and only under the dtype and global shape that rank gave it
            held = [[(p["name"], p["box"], p["dtype"], p["shape"]) for p in r["pieces"]]
                    for r in earlier]
            pieces = keep_primaries(pieces, held + [undecided(pieces)], rank)
        rec = _write_rank(stage_dir, pieces, rank, max_shard_bytes, digests)
        write_json_durable(os.path.join(stage_dir, f"rank-{rank:05d}.json"), rec,
                           capped=False)   # read back by this save only
    except OSError as e:
        end_stage(out_dir, stage)
        raise os_error(e, stage_dir, rank, "writing the rank record") from e
    except BaseException:
        end_stage(out_dir, stage)
        raise
    secs = time.perf_counter() - t0
    wrote = False
    if rank == world - 1:
        try:
            recs = earlier + [_record(stage_dir, rank, rank)]
        except BaseException:
            end_stage(out_dir, stage)
            raise
        wrote = _publish_or_clean(out_dir, stage, recs, plan, cfg, rank, names_order)
    return SaveResult(out_dir, rank, tuple(rec["files"]), rec["bytes"], secs, rank == world - 1, wrote)
