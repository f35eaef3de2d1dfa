"""Publishing a checkpoint directory that no reader can mistake, shared by ``save`` and
``consolidate``.

Every file is first written and fsynced in a hidden staging directory inside the target
(``.coordloader-staging-*``, which no reader looks at). Publishing then makes the visible
changes under a marker:

1. ``coordloader-publishing.json`` is written atomically (temp + rename + directory fsync).
   It names the staging directory, the files to move in (the entry file, an index, last)
   and the previous checkpoint's files to remove;
2. the previous checkpoint's entry files (its index, ``model.safetensors``) are removed, so
   no reader that ignores the marker (transformers, vLLM) ever sees an old index over new
   files;
3. the new files are renamed in, the entry file last, and the directory fsynced;
4. the previous checkpoint's other files are removed, the staging directory too;
5. the marker is removed (and the directory fsynced): the new checkpoint is published.

A kill before step 1 leaves the previous checkpoint as it was; after step 5, the new one.
In between every coordloader reader refuses the directory (``interrupted_message``), and
``recover_save`` rolls the publish forward from the marker (every new file is on disk,
either already moved or still staged), as does the next save into the directory.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import threading
from typing import Any, Callable, Mapping, NamedTuple

from coordloader.checkpoint.fileio import fsync_dir, write_file_atomic
from coordloader.checkpoint.formats import (
    CONFIG_NAME,
    HF_INDEX,
    HF_INDEX_SUFFIX,
    HF_SINGLE,
    OTHER_HF_WEIGHTS_RE,
    PUBLISH_MARKER,
    SHARD_SUFFIX,
    SHARDED_INDEX,
    STAGING_PREFIX,
    V1_SHARD_RE,
    interrupted_message,
)
from coordloader.checkpoint.reader import (
    MAX_CONFIG,
    MAX_JSON_FILE,
    PICKLE_SUFFIXES,
    is_checkpoint_file,
    parse_strict_json,
    read_json_document,
    read_small_file,
    refuse_dense_json,
)
from coordloader.errors import CheckpointError, SaveError
from coordloader.text import clip, first_items, nul_problem, positive_int_problem
from coordloader.verify.manifest import MANIFEST_NAME

# Test hook: called with the name of each publish step just taken, so a test can kill the
# process (or inject a fault) at every one of them. Never set in production.
_test_hook: Callable[[str], None] | None = None

# Companion files larger than this are not copied along (they are not tokenizer or config
# files; a stray dataset next to a checkpoint must not be duplicated).
MAX_COMPANION_BYTES = 64 * 2**20
# Folders of small companion files a checkpoint directory holds: transformers writes each
# named chat template but the default as additional_chat_templates/NAME.jinja. Their files
# travel (and are published, and removed with an old checkpoint) as ``DIR/NAME``.
COMPANION_DIRS = ("additional_chat_templates",)


def _hook(step: str) -> None:
    if _test_hook is not None:
        _test_hook(step)


# ------------------------------------------------------------------------------- errors

def os_error(e: OSError, path: str, rank: int | None, what: str) -> SaveError:
    if e.errno == errno.ENOSPC:
        msg = f"no space left on device while {what}; the previous state of the directory is intact"
    elif e.errno == errno.EDQUOT:
        msg = f"disk quota exceeded while {what}; the previous state of the directory is intact"
    else:
        msg = f"{what} failed: {e.strerror or e}"
    return SaveError(msg, file=path, rank=rank)


def publish_error(e: OSError, out_dir: str, stage: str, path: str, rank: int | None,
                  what: str) -> SaveError:
    """``os_error``, unless the publish of ``stage`` had begun: the previous checkpoint is
    then partly replaced, and the error says what readers say and how to finish."""
    if not publishing(out_dir, stage):
        return os_error(e, path, rank, what)
    return SaveError(f"{what} failed after publishing began ({e.strerror or e}): "
                     f"{interrupted_message(out_dir)}", file=path, rank=rank)


def writer_error(e: SaveError, path: str, rank: int | None, what: str) -> SaveError:
    """The safetensors writer's SaveError re-addressed to ``path`` and ``rank``: an OS error
    (it wraps every one) in ``os_error``'s words, anything else with its tensor kept."""
    if isinstance(e.__cause__, OSError):
        return os_error(e.__cause__, path, rank, what)
    return SaveError(e.message, file=path, tensor=e.tensor, rank=rank)


# ---------------------------------------------------------------------- durable writes

def write_bytes_durable(path: str, data: bytes) -> None:
    """Write a small file completely and fsync it (into staging: the publish renames it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: str, obj: Any, *, capped: bool = True,
                       limit: int | None = None) -> None:
    """Write a JSON side file into staging. ``capped`` (a file that readers open: index,
    manifest): SaveError when it is over the size they accept for it (``limit``, else
    ``MAX_JSON_FILE``), since published it would replace the previous checkpoint with one
    that no reader opens."""
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    cap = MAX_JSON_FILE if limit is None else limit
    if capped and len(data) > cap:
        raise SaveError(f"this file would be {len(data)} bytes, over the {cap} bytes readers "
                        f"accept for it; nothing was published (the previous checkpoint, if "
                        f"any, is untouched)", file=path)
    write_bytes_durable(path, data)


# ---------------------------------------------------------------- what is already there

class Existing(NamedTuple):
    """The checkpoint already in a directory: its entry files (what a reader opens first)
    and every file that belongs to it."""
    entries: frozenset[str]
    files: frozenset[str]


def _plain(names) -> frozenset[str]:
    # never follow a name out of the directory: a plain name, or one inside a companion
    # folder (``COMPANION_DIRS``)
    return frozenset(n for n in names if isinstance(n, str) and _plain_name(n))


def _plain_name(n: str) -> bool:
    head, sep, tail = n.partition("/")
    if sep:
        return head in COMPANION_DIRS and _plain_name(tail) and "/" not in tail
    return bool(n) and "\\" not in n and n not in (".", "..")


def _companion_dir_files(root: str, names) -> set[str]:
    """``DIR/NAME`` of every regular file in the companion folders among ``names`` (a
    listing of ``root``): a folder in there (Jupyter's .ipynb_checkpoints) is no file of a
    checkpoint, and removing one with the old checkpoint's files failed after the marker."""
    out: set[str] = set()
    for d in COMPANION_DIRS:
        p = os.path.join(root, d)
        if d in names and os.path.isdir(p) and not os.path.islink(p):
            # (isfile follows a link: a hub snapshot's files are links into its blobs)
            out |= {f"{d}/{e}" for e in os.listdir(p)
                    if not e.startswith(".") and os.path.isfile(os.path.join(p, e))}
    return out


def _index_files(path: str) -> set[str]:
    """File names an index (HF, v1 or v2 sharded) refers to; empty if it is no index (not
    a regular file, over the size bound, dense, not JSON). SaveError for an I/O error: a
    save that went on would leave the old index's files beside the new checkpoint."""
    name = os.path.basename(path)
    try:
        # never blocks (a FIFO under an index's name hung the save that looked at it), nor
        # takes many times the file's size in memory; parsed leniently, as before: this
        # only finds the old files a save over them removes
        raw = read_small_file(path, name, "index")
        refuse_dense_json(raw, name, "index")
        d = json.loads(raw)
        names = {v for v in (d.get("weight_map") or {}).values()}
        section = d.get("coordloader") if "coordloader" in d else d
        for t in ((section or {}).get("tensors") or {}).values():
            names |= {p.get("file") for p in t.get("pieces", [])}
        return names
    except (OSError, CheckpointError) as e:
        # an I/O error (open and stat ones come as a CheckpointError's cause) stops the
        # save; a file that is no index is only an old entry
        cause = e if isinstance(e, OSError) else e.__cause__
        if isinstance(cause, OSError):
            raise os_error(cause, path, None, "reading the existing index to find the files "
                                              "the save replaces") from e
        return set()
    except (ValueError, RecursionError, AttributeError, TypeError):
        return set()  # an unreadable old index: only its own name is known


def existing_checkpoint(out_dir: str) -> Existing | None:
    """The checkpoint in ``out_dir`` (None when there is none), as the reader would find
    it. Loose shards of a crashed version-1 save count as its files, so that a save over
    them removes them."""
    try:
        names = set(os.listdir(out_dir))
    except FileNotFoundError:
        return None
    entries = {n for n in names if n == SHARDED_INDEX or n.endswith(HF_INDEX_SUFFIX)
               or n == HF_SINGLE}
    if not entries:
        # loose .safetensors files (numbered shards whose index was lost, torch DCP's
        # per-rank files): the reader loads them as a checkpoint, each one an entry
        entries = {n for n in names if n.endswith(".safetensors")}
    # pickle (TF, Flax) weights: transformers loads them when it finds no safetensors, as
    # beside a sharded save; left there, it loaded the old weights for the new checkpoint
    entries |= {n for n in names if OTHER_HF_WEIGHTS_RE.match(n)}
    if not entries and MANIFEST_NAME in names:
        # a manifest without its weights is another checkpoint's: left beside a new one
        # that brings none, every digest verify failed as a stale manifest
        entries = {MANIFEST_NAME}
    if not entries:
        return None
    files = set(entries)
    for e in entries:
        if e.endswith(".json"):   # an index (never a weights file read as JSON)
            files |= _index_files(os.path.join(out_dir, e))
    files |= {n for n in names if V1_SHARD_RE.match(n) or n.endswith(SHARD_SUFFIX)}
    # the config describes the model whose weights these are: left beside another
    # model's weights (a new checkpoint that brings none), it would be read as theirs
    files |= {MANIFEST_NAME, CONFIG_NAME} & names
    # the named chat templates too (describing the model, as its config)
    nested = _plain(_companion_dir_files(out_dir, names))
    return Existing(_plain(entries), (_plain(files) & names) | nested)


def output_dir(out_dir: Any, rank: int | None = None, *, usage: str = "") -> str:
    """``out_dir`` as a str path; SaveError for anything else. ``usage``, the call's
    signature, is named when a mapping came instead (a state dict passed first)."""
    try:
        path = os.fspath(out_dir)
    except TypeError:
        path = None
    if not isinstance(path, str):
        hint = (f" (the output directory comes first: {usage})"
                if usage and isinstance(out_dir, Mapping) else "")
        raise SaveError(f"output directory {str(out_dir)[:200]!r} is {type(out_dir).__name__}; "
                        f"expected a str or os.PathLike path{hint}", rank=rank)
    if problem := nul_problem("output directory", path):
        raise SaveError(problem, rank=rank)
    return path


def check_sizes(rank: int | None, **sizes: Any) -> tuple[int, ...]:
    """``sizes`` (argument name -> value) as ints, in order; SaveError for the first that
    is not a positive integer: save and consolidate refuse their byte bounds before
    anything is written (a float of an integer value, ``5e9``, is taken as that int)."""
    out = []
    for name, value in sizes.items():
        problem = positive_int_problem(name, value)
        if problem is not None:
            raise SaveError(problem, rank=rank)
        out.append(int(value))
    return tuple(out)


# -------------------------------------------------------------- one writer at a time
# A writer holds an exclusive flock on its staging directory's lock file while it lives
# (the kernel drops it when the process dies): a stage whose lock is free is a killed
# writer's leftover; one whose lock is held is another writer's, live. Within this process
# the lock tells no writer apart: a call running on the stage does (a save in a background
# thread), and a stage no call runs on is an earlier call's (a local-mode save between its
# ranks' calls, or abandoned: a rank-0 call restarts it).
_STAGE_LOCK = ".lock"


class _Held(NamedTuple):
    fd: int                          # the descriptor holding the stage's lock
    pid: int                         # the process that took it (a forked child inherits it)
    thread: threading.Thread | None  # the thread of the call running on the stage, if any


_HELD: dict[str, _Held] = {}   # stage directory (real path) -> its lock, in this process


def _lock_stage(stage_dir: str) -> None:
    import fcntl
    fd = os.open(os.path.join(stage_dir, _STAGE_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:   # a file system without locks: writers are not told apart, as before
        os.close(fd)
        return
    _HELD[os.path.realpath(stage_dir)] = _Held(fd, os.getpid(), threading.current_thread())


def stage_call(stage_dir: str, running: bool) -> None:
    """Mark this process's ``stage_dir`` as one a call of this thread runs on now
    (``running``), or as one no call runs on (the call returned, leaving the stage for the
    next rank's call of a local-mode save)."""
    key = os.path.realpath(stage_dir)
    held = _HELD.get(key)
    if held is not None and held.pid == os.getpid():
        _HELD[key] = held._replace(thread=threading.current_thread() if running else None)


def _stage_in_use(stage_dir: str) -> bool:
    """Whether a live writer holds ``stage_dir``: another process's (a forked child sees
    its parent's by the lock too), or a call running on it in another live thread of this
    process. A stage of this process no call runs on is an earlier call's: not in use."""
    import fcntl
    held = _HELD.get(os.path.realpath(stage_dir))
    if held is not None and held.pid == os.getpid():
        t = held.thread
        return t is not None and t is not threading.current_thread() and t.is_alive()
    try:
        fd = os.open(os.path.join(stage_dir, _STAGE_LOCK), os.O_RDWR | os.O_NONBLOCK)
    except OSError:   # no lock file: a writer killed before it took the lock, or gone
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def release_stage(stage_dir: str) -> None:
    """Drop this process's lock on ``stage_dir`` (its writer is done, or gave up)."""
    held = _HELD.pop(os.path.realpath(stage_dir), None)
    if held is not None:   # (a forked child's copy of its parent's: the parent keeps its lock)
        os.close(held.fd)


def end_stage(out_dir: str, stage: str) -> None:
    """A writer that published, or failed: its stage removed unless its publish began (the
    stage then holds what ``recover_save`` moves in), and its lock released."""
    stage_dir = os.path.join(out_dir, stage)
    if not publishing(out_dir, stage):
        shutil.rmtree(stage_dir, ignore_errors=True)
    release_stage(stage_dir)


def _refuse_live_writer(out_dir: str, stage: str, rank: int | None, doing: str) -> None:
    if _stage_in_use(os.path.join(out_dir, stage)):
        raise SaveError(f"another save or consolidate is {doing} this directory now (its "
                        f"staging directory {stage} is in use by a live process or thread): "
                        f"wait for it to finish, or write elsewhere; two writers into one "
                        f"directory would replace each other's files", file=out_dir, rank=rank)


def _refuse_inside_checkpoint(out_dir: str, rank: int | None) -> None:
    """SaveError when ``out_dir`` is named like a checkpoint file (``model.safetensors``)
    in a directory holding checkpoint files (files: outputs side by side under such names
    are no checkpoint's): the reader would take it as part of that checkpoint, which then
    no longer loads (two checkpoints in one directory)."""
    parent, name = os.path.split(os.path.realpath(os.path.abspath(out_dir)))
    if not is_checkpoint_file(name):
        return
    try:
        beside = [n for n in os.listdir(parent) if n != name and is_checkpoint_file(n)
                  and os.path.isfile(os.path.join(parent, n))]
    except OSError:
        return
    if beside:
        raise SaveError(f"output directory {out_dir} would add {name} to the checkpoint "
                        f"directory {parent} (holding {first_items(sorted(beside), 3)}), where "
                        f"it would be read as part of that checkpoint; choose another "
                        f"directory", file=out_dir, rank=rank)


def _refuse_strays(out_dir: str, existing: Existing, rank: int | None) -> None:
    """SaveError for .safetensors files the checkpoint a sharded save replaces does not
    list (Mistral's consolidated.safetensors beside an HF index, an adapter): the publish
    would leave them beside the new index, where vLLM reads every *.safetensors file as
    the model and coordloader refuses the directory as two checkpoints. Not removed: they
    are no part of what the save replaces."""
    strays = sorted(n for n in os.listdir(out_dir)
                    if n.endswith(".safetensors") and n not in existing.files)
    if strays:
        raise SaveError(f"{first_items(strays, 3)} in the output directory is no part of the "
                        f"checkpoint the save replaces; beside the new sharded save it would "
                        f"be read as a second checkpoint (vLLM reads every *.safetensors "
                        f"file, and coordloader refuses such a directory): move it out first",
                        file=out_dir, rank=rank)


def prepare_target(out_dir: str, overwrite: bool, rank: int | None, token: str, *,
                   sharded: bool = False) -> str:
    """Check the target and create a fresh staging directory in it; returns its name. An
    interrupted publish found there is finished first, so the directory is one checkpoint
    again before the overwrite rule applies; with ``overwrite``, one whose new files are
    lost is left to the new publish, which replaces its marker. ``sharded``: the publish is
    a coordloader sharded save, beside whose index no .safetensors file may stay."""
    _refuse_inside_checkpoint(out_dir, rank)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise os_error(e, out_dir, rank, "creating the output directory") from e
    if not os.path.isdir(out_dir):
        raise SaveError("output path exists and is not a directory", file=out_dir, rank=rank)
    rec = _read_marker(out_dir)
    if rec is not None:   # a live writer's publish under way is not finished from here
        _refuse_live_writer(out_dir, rec.stage, rank, "publishing into")
    # with overwrite, a publish whose new files are lost cannot be finished and need not
    # be: its marker stays, so readers refuse the directory until this save's own marker
    # replaces it
    if rec is not None and not (overwrite and _lost_files(out_dir, rec)):
        _roll_forward(out_dir, rec, rank)
    stages = sorted(n for n in os.listdir(out_dir) if n.startswith(STAGING_PREFIX))
    for n in stages:
        _refuse_live_writer(out_dir, n, rank, "writing into")
    existing = existing_checkpoint(out_dir)
    if existing is not None and not overwrite:
        raise SaveError("a checkpoint already exists here; pass overwrite=True (--overwrite) to replace it",
                        file=out_dir, rank=rank)
    if sharded and existing is not None:
        _refuse_strays(out_dir, existing, rank)
    # Leftovers of a save killed before it published (never part of a checkpoint).
    for n in stages:
        shutil.rmtree(os.path.join(out_dir, n), ignore_errors=True)
        release_stage(os.path.join(out_dir, n))
    stage = STAGING_PREFIX + token
    stage_dir = os.path.join(out_dir, stage)
    try:
        os.mkdir(stage_dir)
        _lock_stage(stage_dir)
    except OSError as e:
        raise os_error(e, stage_dir, rank, "creating the staging directory") from e
    # two writers that both found the directory free: each sees the other's stage now,
    # and both give up (neither would know which publish a reader gets)
    others = [n for n in os.listdir(out_dir) if n.startswith(STAGING_PREFIX) and n != stage]
    for n in others:
        try:
            _refuse_live_writer(out_dir, n, rank, "writing into")
        except SaveError:
            end_stage(out_dir, stage)
            raise
    return stage


# ------------------------------------------------------------------------------ publish

class PublishRecord(NamedTuple):
    """The marker's content: enough to finish the publish from any point."""
    stage: str               # staging directory (a name inside the target)
    files: tuple[str, ...]   # new files, in move order: the entry file last
    remove: tuple[str, ...]  # previous checkpoint's files the new one does not reuse
    old_entries: tuple[str, ...]


def publish(out_dir: str, stage: str, files: list[str], entry: str,
            rank: int | None = None) -> None:
    """Move ``files`` and then ``entry`` (all written and fsynced in ``out_dir/stage``)
    into ``out_dir`` under the publish marker (see the module docstring). ``rank``: the
    publishing rank, for errors."""
    old = existing_checkpoint(out_dir) or Existing(frozenset(), frozenset())
    new = [f for f in files if f != entry] + [entry]
    keep = set(new)
    # every old entry goes, even one named like a new file (an index over the same shard
    # names): left in place, it would name a mix of old and new files while they move in
    rec = PublishRecord(stage, tuple(new), tuple(sorted(old.files - keep)),
                        tuple(sorted(old.entries)))
    _hook("staged")
    gone = _lost_files(out_dir, rec, moved=False)
    if gone:
        # nothing visible has changed yet; past the marker, files found in place would
        # pass for moved ones, and another writer's for this one's
        raise SaveError(f"the staging directory {stage} no longer holds {first_items(gone, 4)}, "
                        f"written there for this publish: "
                        f"another writer removed it; nothing was published", file=out_dir,
                        rank=rank)
    write_file_atomic(os.path.join(out_dir, PUBLISH_MARKER),
                      (json.dumps(rec._asdict(), indent=1) + "\n").encode())
    _hook("marked")
    _roll_forward(out_dir, rec, rank)


def _roll_forward(out_dir: str, rec: PublishRecord, rank: int | None = None) -> None:
    """Steps 2-5 of a publish; every step is idempotent, so recovery re-runs them all."""
    stage_dir = os.path.join(out_dir, rec.stage)
    lost = _lost_files(out_dir, rec)
    if lost:
        # checked before anything is removed: the directory stays as the kill left it
        raise SaveError(f"cannot finish the interrupted save: {first_items(lost, 4)}"
                        f" is neither in the staging "
                        f"directory {rec.stage} nor in place, so the new checkpoint is lost; "
                        f"save it again with overwrite=True, which replaces what is left",
                        file=out_dir, rank=rank)
    for n in rec.old_entries:
        if n in rec.files and not os.path.lexists(os.path.join(stage_dir, n)):
            continue   # recovery: the new file of that name has already moved in
        _unlink(os.path.join(out_dir, n))
    fsync_dir(out_dir)
    _hook("old-entries-removed")
    for f in rec.files:
        src, dst = os.path.join(stage_dir, f), os.path.join(out_dir, f)
        if os.path.lexists(src):
            if f == rec.files[-1]:
                # every other file's rename is durable before the entry's
                sync_companion_dirs(out_dir)
                fsync_dir(out_dir)
            if "/" in f:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
        _hook(f"moved {f}")
    fsync_dir(out_dir)
    for n in rec.remove:
        _unlink(os.path.join(out_dir, n))
    for d in COMPANION_DIRS:   # a folder the old checkpoint's files alone were in
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(out_dir, d))
    shutil.rmtree(stage_dir, ignore_errors=True)
    release_stage(stage_dir)
    fsync_dir(out_dir)
    _hook("old-files-removed")
    _unlink(os.path.join(out_dir, PUBLISH_MARKER))
    fsync_dir(out_dir)
    _hook("published")


def _lost_files(out_dir: str, rec: PublishRecord, *, moved: bool = True) -> list[str]:
    """The new files of ``rec`` not staged, nor moved in already where ``moved`` (past its
    marker). Before the marker nothing has moved: a file of that name in place is the
    previous checkpoint's, or another writer's."""
    stage_dir = os.path.join(out_dir, rec.stage)
    return [f for f in rec.files if not os.path.lexists(os.path.join(stage_dir, f))
            and not (moved and os.path.lexists(os.path.join(out_dir, f)))]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def recover_save(out_dir: str | os.PathLike) -> bool:
    """Finish a save or consolidate whose publish was interrupted in ``out_dir`` (killed
    after its marker was written). Returns False when there was nothing to finish.
    Raises SaveError if the marker is unreadable or a new file is gone."""
    out_dir = output_dir(out_dir)
    rec = _read_marker(out_dir)
    if rec is None:
        return False
    _refuse_live_writer(out_dir, rec.stage, None, "publishing into")
    _roll_forward(out_dir, rec)
    return True


def _read_marker(out_dir: str) -> PublishRecord | None:
    """The publish marker of ``out_dir``, checked to name only entries inside it; None
    when there is none."""
    path = os.path.join(out_dir, PUBLISH_MARKER)
    if not os.path.lexists(path):
        return None
    try:
        d = read_json_document(path, PUBLISH_MARKER, "the publish marker")   # never blocks
        rec = PublishRecord(str(d["stage"]), tuple(map(str, d["files"])),
                            tuple(map(str, d["remove"])), tuple(map(str, d["old_entries"])))
    except (CheckpointError, OSError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise SaveError(f"the publish marker {PUBLISH_MARKER} is unreadable ({e}); the directory "
                        f"mixes two checkpoints: save again into a fresh directory",
                        file=out_dir) from e
    names = (rec.stage,) + rec.files + rec.remove + rec.old_entries
    if not rec.stage.startswith(STAGING_PREFIX) or _plain(names) != frozenset(names):
        raise SaveError(f"the publish marker {PUBLISH_MARKER} names files outside the directory; "
                        f"refusing to act on it", file=out_dir)
    return rec


def publishing(out_dir: str, stage: str) -> bool:
    """Whether the publish of ``stage`` has begun (the marker in ``out_dir`` names it): a
    save that fails from then on leaves its stage for ``recover_save``. A marker that
    cannot be read counts as begun: the stage is kept."""
    try:
        rec = _read_marker(out_dir)
    except SaveError:
        return True
    return rec is not None and rec.stage == stage


# ------------------------------------------------------------------- the model's config

class ModelConfig(NamedTuple):
    """``config=`` resolved: the config.json bytes to write, their parsed content, and the
    directory whose companion files travel along (None for a dict or a file)."""
    data: bytes
    doc: dict
    src_dir: str | None


_FLOAT_TAG = "__float__"   # transformers' tag for the floats JSON cannot hold


def _tag_special_floats(obj: Any) -> Any:
    """``obj`` with every infinite or NaN float written as transformers writes it in a
    config.json (``{"__float__": "Infinity"}``, ``"-Infinity"``, ``"NaN"``; its
    from_pretrained reads them back): Mamba2's default ``time_step_limit`` is
    ``(0.0, inf)``, and JSON has no Infinity."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_FLOAT_TAG: "NaN" if obj != obj else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: _tag_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tag_special_floats(v) for v in obj]
    return obj


def resolve_config(config: Any, rank: int | None) -> ModelConfig:
    """Read ``config=`` (a dict, a path to config.json, or the source checkpoint directory)
    before anything is written; refuse None (save's rule: a checkpoint without config.json
    cannot be planned at any sharded layout nor consolidated into something transformers
    loads)."""
    if config is None:
        raise SaveError("config= is required: pass the source checkpoint directory, a path to "
                        "its config.json, or the config as a dict. The planner detects the "
                        "architecture preset from config.json, so without it the saved "
                        "checkpoint could not be loaded at any sharded layout, nor consolidated "
                        "into a checkpoint transformers accepts", rank=rank)
    if isinstance(config, Mapping):
        try:
            data = (json.dumps(_tag_special_floats(dict(config)), indent=2,
                               allow_nan=False) + "\n").encode()
            if len(data) > MAX_CONFIG:   # the reader's own bounds on a config.json
                raise ValueError(f"it is {len(data)} bytes as JSON; expected at most "
                                 f"{MAX_CONFIG}")
            refuse_dense_json(data, CONFIG_NAME, "config")
            # read back as the reader will read it: keys 1 and "1" become one key twice,
            # an int past 2**63 is refused; the parsed form is what the save plans with
            doc = parse_strict_json(data)
        except CheckpointError as e:
            raise SaveError(f"config= dict is not JSON the reader accepts: {e.message}",
                            rank=rank) from None
        except (TypeError, ValueError, RecursionError) as e:
            raise SaveError(f"config= dict is not JSON the reader accepts: {e}",
                            rank=rank) from None
        _refuse_no_model_config(doc, None, rank)
        return ModelConfig(data, doc, None)
    if not isinstance(config, (str, os.PathLike)):
        raise SaveError(f"config= must be a dict, a path to config.json or a checkpoint "
                        f"directory, got {type(config).__name__}", rank=rank)
    path = os.fspath(config)
    src_dir = None
    if os.path.isdir(path):
        src_dir, path = path, os.path.join(path, CONFIG_NAME)
    try:
        # a regular file, opened without blocking: a FIFO given as --config waited forever
        data = read_small_file(path, path, "config file", MAX_CONFIG)
        refuse_dense_json(data, path, "config file")
    except CheckpointError as e:
        raise SaveError(f"cannot read the config given as config= (--config): {e.message}",
                        file=path, rank=rank) from None
    try:
        doc = parse_strict_json(data)
    except (ValueError, RecursionError) as e:   # a duplicate key, NaN: the reader refuses them
        raise SaveError(f"config is not valid JSON: {e}", file=path, rank=rank) from None
    if not isinstance(doc, dict):
        raise SaveError(f"config is a JSON {type(doc).__name__}, expected an object", file=path,
                        rank=rank)
    _refuse_no_model_config(doc, path, rank)
    return ModelConfig(data, doc, src_dir)


def _refuse_no_model_config(doc: dict, path: str | None, rank: int | None) -> None:
    """SaveError for a JSON object that is no model config: one naming neither
    transformers' ``model_type`` nor its ``architectures`` (the source's
    model.safetensors.index.json given by mistake was published as config.json, exit 0,
    and the output could not be planned)."""
    mt, arch = doc.get("model_type"), doc.get("architectures")
    if (isinstance(mt, str) and mt) or (isinstance(arch, list) and arch):
        return
    what = ("a checkpoint index (it has weight_map)" if "weight_map" in doc else
            "no model config" if mt is None else f"model_type {clip(repr(mt), 80)}")
    raise SaveError(f"the config given as config= (--config) is {what}: a model config "
                    f"(config.json) names its model_type or architectures, by which "
                    f"transformers and the planner know the model", file=path, rank=rank)


# --------------------------------------------------------------------- companion files

# Weights in other formats (pickle, TF, Flax, GGUF) and their indexes: carried along, they
# would sit beside the new weights, and transformers prefers some of them (a stale
# pytorch_model.bin loads the pretrained weights, not the saved ones).
WEIGHT_SUFFIXES = PICKLE_SUFFIXES + (".h5", ".msgpack", ".gguf", ".bin.index.json",
                                     ".h5.index.json", ".msgpack.index.json", ".onnx", ".npz",
                                     ".npy")
# a TensorFlow 1 checkpoint (transformers' model.ckpt.index, .data-00000-of-00001, .meta;
# a training step's model.ckpt-1000.*)
_TF1_CHECKPOINT = re.compile(r".*\.ckpt(?:-\d+)?(?:\.index|\.meta|\.data-\d+-of-\d+)?\Z")
# a writer's temporary, left by a killed process (the manifest's carries its pid): half
# written, never the checkpoint's
_TEMPORARY = re.compile(r".*\.tmp(?:\.\d+)?\Z")


def companion_files(src_dir: str, skip: set[str]) -> list[str]:
    """Small regular files of a checkpoint directory that are not checkpoint data
    (config.json, generation_config.json, tokenizer files, chat template, ...): what a save
    or a consolidate carries along. ``skip``: the source checkpoint's own files."""
    out = []
    for entry in sorted(os.listdir(src_dir)):
        p = os.path.join(src_dir, entry)
        if (entry in skip or entry.startswith(".") or entry in (PUBLISH_MARKER, MANIFEST_NAME,
                                                                SHARDED_INDEX, HF_INDEX)
                or entry.endswith((".safetensors", HF_INDEX_SUFFIX, SHARD_SUFFIX)
                                  + WEIGHT_SUFFIXES)
                or _TEMPORARY.match(entry) or _TF1_CHECKPOINT.match(entry)
                or not os.path.isfile(p)):
            continue
        if os.path.getsize(p) > MAX_COMPANION_BYTES:
            continue
        out.append(entry)
    # (regular files, no dot-names: _companion_dir_files' own filter)
    for n in sorted(_companion_dir_files(src_dir, os.listdir(src_dir))):
        if (not _TEMPORARY.match(n.rsplit("/", 1)[1])
                and os.path.getsize(os.path.join(src_dir, n)) <= MAX_COMPANION_BYTES):
            out.append(n)
    return out


# The tokenizer itself: its files in the formats transformers reads (tokenizer.json,
# sentencepiece and tiktoken models, vocab and merges) and its chat templates. A config
# directory holding none of these (``model.save_pretrained`` writes config.json and
# generation_config.json) has no tokenizer to supply, and its generation config goes over
# the source's, as before.
_TOKENIZER_FILES = (r"tokenizer[^/]*|special_tokens_map\.json|added_tokens\.json|vocab\.[^/]+"
                    r"|merges\.txt|[^/]+\.model|[^/]+\.tiktoken|chat_template\.[^/]+"
                    r"|additional_chat_templates/.+")
_TOKENIZER_ITSELF = re.compile(f"(?:{_TOKENIZER_FILES})\\Z")
# The companions tied to the model's tokenizer: those, and the configs that hold its token
# ids (generation, processor). Taken from two directories they mix two models' tokenizers
# (one's named templates, the other's vocabulary), so they come from one.
_TOKENIZER_KIND = re.compile(
    f"(?:{_TOKENIZER_FILES}"
    r"|generation_config\.json|(?:video_)?preprocessor_config\.json|processor_config\.json)\Z")


def tokenizer_companion(name: str) -> bool:
    """Whether companion ``name`` is of the tokenizer's kind (``_TOKENIZER_KIND``)."""
    return _TOKENIZER_KIND.match(name) is not None


def config_supplies_tokenizer(cfg: ModelConfig | None) -> bool:
    """Whether ``config=`` is a directory holding a tokenizer (``_TOKENIZER_ITSELF``): then
    the output's files of the tokenizer's kind (its generation and processor configs too)
    are the directory's alone."""
    return (cfg is not None and cfg.src_dir is not None
            and any(_TOKENIZER_ITSELF.match(n)
                    for n in companion_files(cfg.src_dir, {CONFIG_NAME})))


def companion_path(stage_dir: str, name: str) -> str:
    """Where companion ``name`` goes in the stage (its folder made for a ``DIR/NAME``)."""
    p = os.path.join(stage_dir, name)
    if "/" in name:
        os.makedirs(os.path.dirname(p), exist_ok=True)
    return p


def sync_companion_dirs(root: str) -> None:
    """fsync the companion folders in ``root`` (their entries' renames or creations)."""
    for d in COMPANION_DIRS:
        if os.path.isdir(os.path.join(root, d)):
            fsync_dir(os.path.join(root, d))


def stage_config(stage_dir: str, cfg: ModelConfig, skip: set[str] = frozenset()) -> list[str]:
    """Write ``cfg``'s config.json and copy its directory's companion files into the stage
    (fsynced: the publish renames them); returns the names written."""
    written = []
    p = os.path.join(stage_dir, CONFIG_NAME)
    try:
        write_bytes_durable(p, cfg.data)
        written.append(CONFIG_NAME)
        if cfg.src_dir is not None:
            for n in companion_files(cfg.src_dir, set(skip) | {CONFIG_NAME}):
                p = companion_path(stage_dir, n)
                shutil.copyfile(os.path.join(cfg.src_dir, n), p)
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
                written.append(n)
            sync_companion_dirs(stage_dir)
    except OSError as e:
        raise os_error(e, p, None, "copying the config and companion files") from e
    return written
