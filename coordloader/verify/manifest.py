"""Per-tensor content digests of a checkpoint, kept next to it in
``coordloader.manifest.json``, so ``--verify digest`` can check what ranks loaded against
what is on disk without a second read.

    python -m coordloader.manifest CKPT [--jobs N]

Digests are computed streaming: each source piece is read in bounded chunks with
``os.preadv`` into one reusable buffer per worker, never a whole shard in memory. A
tensor stored as several pieces (coordloader's sharded format) gets the sum of its
pieces' digests, which is the digest of the whole tensor because digests are linear over
disjoint boxes. The manifest records the checkpoint fingerprint (file names, sizes,
header hashes); a manifest whose fingerprint differs from the checkpoint's is refused.
"""
from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping

import torch

from coordloader.checkpoint.dtypes import bits_dtype, itemsize
from coordloader.checkpoint.fileio import OpenFiles, pread_into, write_file_atomic
from coordloader.checkpoint.formats import MANIFEST_NAME
from coordloader.checkpoint.identity import data_sample_sha256
from coordloader.checkpoint.metadata import CheckpointMeta, TensorInfo, box_numel, box_shape
from coordloader.checkpoint.reader import read_json_document
from coordloader.engines import on_host_default_device
from coordloader.errors import CheckpointError, LoadError, VerifyError
from coordloader.text import MAX_NAME_CHARS, clip, first_items, nul_problem, positive_int_problem

# explicit names: the package re-exports the function `digest`, shadowing the module
from coordloader.verify.digest import ALGORITHM, MASK64, digest, flat_offset, fmt, iter_subboxes

VERSION = 1
READ_CHUNK_BYTES = 32 << 20   # per read; digest() then works through it in cache-sized chunks

_tls = threading.local()


@dataclass(frozen=True)
class TensorDigest:
    dtype: str
    shape: tuple[int, ...]
    digest: int


@dataclass(frozen=True)
class Manifest:
    path: str
    fingerprint: str
    algorithm: str
    tensors: Mapping[str, TensorDigest]
    root: str = ""
    # file name -> the sha256 of its sampled data blocks when the manifest was written
    # (FileIdentity.sample_sha256); absent in manifests written before they were recorded
    samples: Mapping[str, str] = field(default_factory=dict)

    def get(self, name: str) -> TensorDigest | None:
        return self.tensors.get(name)

    def data_changed(self) -> tuple[str, ...]:
        """The files whose sampled data is not what the manifest recorded (same headers and
        sizes, other values). Read on demand, after a digest failure: a load that verifies
        clean reads no samples. A file that cannot be read now is not listed: this only
        explains a failure found otherwise."""
        out = []
        for name, want in sorted(self.samples.items()):
            try:
                got = data_sample_sha256(self.root, name)
            except CheckpointError:
                continue
            if got != want:
                out.append(name)
        return tuple(out)

    def changed_hint(self, changed: tuple[str, ...] | None = None) -> str:
        """Why digests may differ from this manifest other than a wrong load ("" if
        nothing says so). ``changed``: ``data_changed()`` where the caller read it."""
        changed = self.data_changed() if changed is None else changed
        if not changed:
            return ""
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        return (f"file {changed[0]}{more} holds other data than when the manifest "
                f"was written (sampled blocks differ; headers and sizes are the same): the "
                f"checkpoint was changed or saved again since (another training step?). If on "
                f"purpose, the manifest is stale: regenerate it with `python -m "
                f"coordloader.manifest {self.root}`; if not, the file is corrupt")


def manifest_path(root: str) -> str:
    return os.path.join(root, MANIFEST_NAME)


def tensor_digest(meta: CheckpointMeta, info: TensorInfo, *,
                  read_chunk_bytes: int = READ_CHUNK_BYTES, files: OpenFiles | None = None) -> int:
    """Digest of one checkpoint tensor read from disk in bounded chunks, through ``files``
    (the checkpoint's files, each opened once; default: opened for this tensor alone)."""
    if files is None:
        with OpenFiles(meta.root) as own:
            return tensor_digest(meta, info, read_chunk_bytes=read_chunk_bytes, files=own)
    size = itemsize(info.dtype)
    view_dt = bits_dtype(info.dtype)
    budget = max(1, read_chunk_bytes // size)
    need = min(budget, max(info.numel, 1)) * size
    # one read buffer per worker thread, grown on demand (a fresh zero-filled buffer per
    # tensor measured as costly as the digest for small expert tensors)
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < need:
        buf = _tls.buf = bytearray(max(need, min(read_chunk_bytes, 1 << 20)))
    mv = memoryview(buf)
    total = 0
    for sp in info.pieces:
        # 0-d tensors are digested as one-element 1-d tensors (as digest() does)
        box = sp.box if info.shape else ((0, 1),)
        shape = tuple(info.shape) if info.shape else (1,)
        if sp.end - sp.start != box_numel(box) * size:
            raise VerifyError(f"source piece {[list(p) for p in sp.box]} spans {sp.end - sp.start} bytes, "
                              f"expected {box_numel(box) * size}", file=sp.file, tensor=info.name)
        try:
            fd = files.fd(sp.file)
        except OSError as e:
            raise VerifyError(f"cannot open: {e.strerror}", file=sp.file, tensor=info.name) from None
        for sub in iter_subboxes(box, budget):
            n = box_numel(sub)
            off = sp.start + flat_offset(box, sub) * size
            pread_into(fd, mv[:n * size], off, file=sp.file, tensor=info.name, error=VerifyError)
            t = torch.frombuffer(buf, dtype=view_dt, count=n).view(box_shape(sub))
            total += digest(t, sub, shape)
    return total & MASK64


def compute(meta: CheckpointMeta, *, jobs: int = 1, progress=None) -> dict[str, TensorDigest]:
    """Digest every tensor of the checkpoint; ``jobs`` worker threads (reads and torch ops
    release the GIL)."""
    names = list(meta.tensors)

    def one(name: str) -> tuple[str, TensorDigest]:
        info = meta.tensors[name]
        d = tensor_digest(meta, info, files=files)
        if progress:
            progress(name, info)
        return name, TensorDigest(info.dtype, tuple(info.shape), d)

    from coordloader.engines import descriptor_room
    try:
        # every file is held open until the end, as the cpu engine holds them: a checkpoint
        # of more files than the soft limit failed here where loads passed. A few spare
        # (the worker threads' own), not the engines': a hard limit that fits the files
        # must do, as before
        release = descriptor_room(len(meta.files), None, spare=8)
    except LoadError:
        def release() -> None:   # past even the hard limit: EMFILE names the file
            pass
    try:
        with OpenFiles(meta.root) as files:   # each shard opened once, not once per tensor
            if jobs <= 1:
                return dict(one(n) for n in names)
            with ThreadPoolExecutor(max_workers=jobs) as ex:
                return dict(ex.map(one, names))
    finally:
        release()


def to_json(meta: CheckpointMeta, digests: Mapping[str, TensorDigest]) -> dict:
    return {
        "format": "coordloader.manifest",
        "version": VERSION,
        "algorithm": ALGORITHM,
        "fingerprint": meta.fingerprint(),
        # the data samples tell this checkpoint from another with the same headers (another
        # training step): its manifest would fail every tensor as if the load were wrong
        "files": [{"name": f.name, "size": f.size, "header_sha256": f.header_sha256,
                   "data_sample_sha256": data_sample_sha256(meta.root, f.name)}
                  for f in meta.files],
        "tensors": {n: {"dtype": d.dtype, "shape": list(d.shape), "digest": fmt(d.digest)}
                    for n, d in digests.items()},
    }


def write_atomic(path: str, data: bytes) -> None:
    """temp file + fsync + rename (+ directory fsync): readers see the old file or the
    new one, never a torn one. The temp name carries the pid: two processes writing the
    same manifest never share a temp file."""
    write_file_atomic(path, data, tmp_suffix=f".tmp.{os.getpid()}")


@on_host_default_device
def write_manifest(meta: CheckpointMeta, *, jobs: int = 1, path: str | None = None,
                   progress=None) -> str:
    """Write the content manifest of the checkpoint ``meta`` (``read_checkpoint(dir)``;
    a checkpoint directory's path is read first) to ``path`` (default: its
    coordloader.manifest.json); returns the path written. ``progress(name, info)`` is
    called as each tensor (its name and TensorInfo) is digested. A directory holds one
    manifest, of the checkpoint the directory reads as: VerifyError, before any digest,
    where ``meta`` is another (one file beside an indexed checkpoint) and the manifest
    there describes other files."""
    if isinstance(meta, (str, os.PathLike)):
        from coordloader.checkpoint.reader import read_checkpoint
        meta = read_checkpoint(os.fspath(meta))
    if not isinstance(meta, CheckpointMeta):
        raise VerifyError(f"write_manifest: meta must be a CheckpointMeta (read_checkpoint(dir)) "
                          f"or a checkpoint directory, got {type(meta).__name__}")
    problem = positive_int_problem("jobs", jobs)
    if problem:
        raise VerifyError(f"write_manifest: {problem}")
    jobs = int(jobs)
    if progress is not None and not callable(progress):
        raise VerifyError(f"write_manifest: progress must be a callable(name, info) or None, "
                          f"got {type(progress).__name__}")
    path = path or manifest_path(meta.root)
    if problem := nul_problem("write_manifest: path", os.fspath(path)):
        raise VerifyError(problem)
    _refuse_replacing_anothers(path, meta)
    digests = compute(meta, jobs=jobs, progress=progress)
    blob = json.dumps(to_json(meta, digests), indent=1, sort_keys=False).encode() + b"\n"
    write_atomic(path, blob)
    return path


def _refuse_replacing_anothers(path: str, meta: CheckpointMeta) -> None:
    """VerifyError, before any digest, when ``path`` is the manifest of ``meta``'s
    directory, ``meta`` is not the checkpoint that directory reads as (one file read by its
    path beside an indexed checkpoint: Mistral's ``consolidated.safetensors``), and the
    manifest there describes other files: a directory holds one manifest, and replacing the
    directory's made its loads with ``--verify digest`` fail as changed. A manifest of the
    directory's own checkpoint replaces any (a stale one regenerated), and an unreadable one
    is replaced as before."""
    if os.path.realpath(path) != os.path.realpath(manifest_path(meta.root)):
        return
    ours = sorted(f.name for f in meta.files)
    try:
        doc = read_json_document(path, path, "manifest")
        theirs = sorted(str(f["name"]) for f in doc["files"])
    except (CheckpointError, ValueError, RecursionError, KeyError, TypeError):
        return   # none there, or none that describes any files
    if theirs == ours:
        return
    from coordloader.checkpoint.reader import discover
    try:
        if sorted(discover(meta.root).files) == ours:
            return
    except CheckpointError:
        pass   # the directory reads as no checkpoint: meta is not its checkpoint either
    shown, mine = first_items(theirs, 3, ", ..."), first_items(ours, 3, ", ...")
    raise VerifyError(
        f"is the manifest of {shown} ({len(theirs)} file(s)), not of {mine}, the checkpoint "
        f"given; a directory holds one manifest, of the checkpoint the directory reads as, so "
        f"nothing was written. To make a manifest of {mine}, put it in a directory of its own; "
        f"to regenerate this one, run `python -m coordloader.manifest {meta.root}`", file=path)


def _staleness(doc: dict, meta: CheckpointMeta) -> str:
    old = {f["name"]: f for f in doc.get("files", [])}
    new = {f.name: f for f in meta.files}
    what = []
    for n in sorted(set(old) - set(new)):
        what.append(f"file {n} is gone")
    for n in sorted(set(new) - set(old)):
        what.append(f"file {n} is new")
    for n in sorted(set(old) & set(new)):
        if old[n].get("size") != new[n].size:
            what.append(f"file {n} changed size ({old[n].get('size')} -> {new[n].size} bytes)")
        elif old[n].get("header_sha256") != new[n].header_sha256:
            what.append(f"file {n} has a different header")
    return "; ".join(what) or "the recorded fingerprint differs"


_DIGEST_TEXT = re.compile(r"[0-9a-fA-F]{16}")


def _digest_value(text) -> int:
    """A digest as ``fmt`` writes it: 16 hex digits. int(x, 16) also took a sign, "0x",
    underscores and values of 2^64 and more, which no digest equals; the finding then
    printed the value masked, equal to the one computed."""
    if not isinstance(text, str) or not _DIGEST_TEXT.fullmatch(text):
        raise ValueError(f"digest {text!r} is not 16 hex digits")
    return int(text, 16)


def _shape(dims) -> tuple[int, ...]:
    if not isinstance(dims, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                         for d in dims):
        raise ValueError(f"shape {dims!r} is not a list of non-negative integers")
    return tuple(dims)


def _samples(doc: dict, meta: CheckpointMeta) -> dict[str, str]:
    """The recorded data samples of the checkpoint's own files (an entry for a name the
    checkpoint does not have is never read)."""
    files = doc.get("files", [])
    if not isinstance(files, list):
        raise ValueError("'files' is not a list")
    ours = {f.name for f in meta.files}
    out = {}
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError(clip(f"a 'files' entry is not an object with a name: {f!r}",
                                  MAX_NAME_CHARS))
        want = f.get("data_sample_sha256")
        if want is None:
            continue
        if not isinstance(want, str):
            raise ValueError(f"data_sample_sha256 of {clip(repr(f['name']), MAX_NAME_CHARS)} "
                             f"is not a string")
        if f["name"] in ours:
            out[f["name"]] = want
    return out


def load_manifest(root: str, meta: CheckpointMeta, *, required: bool = False,
                  skip_stale: bool = False) -> Manifest | None:
    """The checkpoint's manifest, or None when there is none (unless ``required``), or,
    with ``skip_stale``, when it is stale (of other headers, or of another digest
    algorithm). Raises VerifyError for a malformed or stale manifest, naming what
    changed."""
    path = manifest_path(root)
    if not os.path.lexists(path):
        if required:
            raise VerifyError(f"no manifest; create it with `python -m coordloader.manifest {root}`",
                              file=path)
        return None
    try:
        # never blocks: a FIFO, a device or a directory in its place is refused
        doc = read_json_document(path, path, "manifest")
    except CheckpointError as e:
        raise VerifyError(f"cannot read the manifest: {e.message}", file=path) from None
    except ValueError as e:
        raise VerifyError(f"malformed manifest: {e}", file=path) from None
    except RecursionError:
        raise VerifyError("malformed manifest: JSON nested too deeply", file=path) from None
    try:
        if doc.get("format") != "coordloader.manifest" or doc.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} coordloader manifest")
        tensors = {n: TensorDigest(str(t["dtype"]), _shape(t["shape"]), _digest_value(t["digest"]))
                   for n, t in doc["tensors"].items()}
        fp = str(doc["fingerprint"])
        samples = _samples(doc, meta)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise VerifyError(f"malformed manifest: {e}", file=path) from None
    if skip_stale and (doc.get("algorithm") != ALGORITHM or fp != meta.fingerprint()):
        return None
    if doc.get("algorithm") != ALGORITHM:
        # a well-formed manifest of another coordloader version: its digests are not
        # comparable, and recomputing them is the fix
        raise VerifyError(f"stale manifest: its digests use algorithm {doc.get('algorithm')!r}, "
                          f"this coordloader computes {ALGORITHM!r}; regenerate it with "
                          f"`python -m coordloader.manifest {root}`", file=path)
    if fp != meta.fingerprint():
        raise VerifyError(f"stale manifest: the checkpoint changed since it was written "
                          f"({_staleness(doc, meta)}); regenerate it with "
                          f"`python -m coordloader.manifest {root}`", file=path)
    missing = sorted(set(meta.tensors) - set(tensors))
    extra = sorted(set(tensors) - set(meta.tensors))
    if missing or extra:
        raise VerifyError(f"manifest does not match the checkpoint's tensors (missing {missing[:5]}, "
                          f"unexpected {extra[:5]})", file=path)
    recorded = _recorded(meta)
    for n, t in tensors.items():
        dtype, shape = recorded(n)
        if t.dtype != dtype or t.shape != tuple(shape):
            raise VerifyError(f"manifest records {t.dtype}{list(t.shape)}, checkpoint has "
                              f"{dtype}{list(shape)}", file=path, tensor=n)
    return Manifest(path, fp, doc["algorithm"], tensors, meta.root, samples)


def _recorded(meta: CheckpointMeta):
    """name -> (dtype, shape) of ``meta``'s tensors: from the table (without making every
    record), else from the records."""
    try:
        table = meta.table()
    except (CheckpointError, TypeError, ValueError, AttributeError):
        # records built by hand that a table cannot hold: their own fields
        return lambda n: (meta.tensors[n].dtype, meta.tensors[n].shape)
    row = dict(zip(table.names, range(len(table.names))))
    dtype, shape = table.dtype.tolist(), table.shape.tolist()
    return lambda n: (table.dtypes[dtype[row[n]]], table.shapes[shape[row[n]]])
