"""Loading engines: turn one rank's plan into tensors.

Every engine implements the same contract::

    engine.load_rank(meta, rank_plan, device, *, progress=None, out=None)
        -> (dict[name, Tensor], LoadStats)

``progress`` is an optional callable receiving byte counts as data lands; ``out`` an
optional dict of preallocated destinations (``load_into`` hands the model's own
parameters in, so nothing is loaded twice). Engines:

- ``cpu``: slice-exact reader (``os.preadv`` of the plan's byte runs straight into the
  tensors' memory, a few threads). The embedded default without CUDA.
- ``safetensors``: the HF ``safetensors`` library (``get_slice``); baseline and fallback.
- ``instanttensor``: InstantTensor over the device process group (CUDA/ROCm only).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from coordloader.checkpoint import dtypes
from coordloader.checkpoint.metadata import Box, CheckpointMeta, box_numel, box_shape
from coordloader.errors import LoadError
from coordloader.planning.model import RankPlan, TensorSlice

ENGINE_NAMES = ("auto", "cpu", "safetensors", "instanttensor")

Progress = Callable[[int], None]


@dataclass
class LoadStats:
    """What one rank's load cost. ``bytes_read`` is what this rank read from storage
    (for InstantTensor group mode: its share of the group's reads); ``bytes_held`` the
    size of its local tensors."""
    engine: str
    tensors: int = 0
    bytes_read: int = 0
    bytes_held: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes_held / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_held if self.bytes_held else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = self.gbps
        d["read_amplification"] = self.read_amplification
        return d


def cuda_backend(pg: Any) -> str | None:
    """The backend process group ``pg`` runs collectives of CUDA tensors with ("nccl",
    "gloo", ...: a ``cpu:gloo,cuda:nccl`` group's CUDA entry); None for no group."""
    if pg is None:
        return None
    import torch.distributed as dist
    backend = str(dist.get_backend(pg))
    if ":" in backend:
        return dict(p.split(":", 1) for p in backend.split(",")).get("cuda")
    return backend


def resolve_engine_name(name: str, device: Any = None, group: Any = None) -> str:
    """``auto`` = instanttensor on a CUDA machine (unless a CPU device was asked for, or
    the load's process group ``group`` has no NCCL backend for CUDA: instanttensor hands
    its groups' NCCL communicator to its loader), else cpu."""
    if name not in ENGINE_NAMES:
        raise LoadError(f"unknown engine {name!r}; expected one of {', '.join(ENGINE_NAMES)}")
    if name != "auto":
        return name
    if device is not None and torch.device(device).type != "cuda":
        return "cpu"
    if group is not None and cuda_backend(group) != "nccl":
        return "cpu"
    return "instanttensor" if torch.cuda.is_available() else "cpu"


def select_engine(name: str = "auto", device: Any = None, **options):
    """Build the engine called ``name`` (``auto`` resolved for ``device``).

    ``options`` go to the engine's constructor (the instanttensor engine takes ``plan``,
    ``group`` and ``loader_config``; the cpu engine ``threads``, ``chunk_bytes`` and
    ``span_bytes``)."""
    name = resolve_engine_name(name, device, options.get("group"))
    if name != "instanttensor" and options.get("loader_config"):
        from coordloader.engines.instanttensor_engine import check_loader_config
        check_loader_config(options["loader_config"])
    if name == "cpu":
        from coordloader.engines.cpu import CpuEngine
        return CpuEngine(**{k: v for k, v in options.items() if k in ("threads", "chunk_bytes",
                                                                       "span_bytes")})
    if name == "safetensors":
        from coordloader.engines.safetensors_engine import SafetensorsEngine
        return SafetensorsEngine()
    from coordloader.engines.instanttensor_engine import InstantTensorEngine
    return InstantTensorEngine(**{k: v for k, v in options.items()
                                  if k in ("plan", "group", "loader_config")})


# -- helpers shared by the engines ---------------------------------------------------

def _check_dest(t: torch.Tensor, shape, dtype: torch.dtype, name: str, rank: int | None) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise LoadError(f"destination has shape {list(t.shape)} dtype {t.dtype}, the plan "
                        f"needs shape {list(shape)} dtype {dtype}", tensor=name, rank=rank)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte address ``t``'s elements span."""
    isz = t.element_size()
    lo = hi = t.data_ptr()
    for n, st in zip(t.shape, t.stride()):
        if st >= 0:
            hi += (n - 1) * st * isz
        else:
            lo += (n - 1) * st * isz
    return lo, hi + isz


def _runs(t: torch.Tensor):
    """(sorted start addresses, bytes per run) of ``t``'s contiguous runs: its innermost
    dims that are packed form one run, so a column slice of a matrix is one run per row,
    not one address per element (an element map of a large view took gigabytes)."""
    import numpy as np
    isz = t.element_size()
    k, run = t.dim(), 1
    while k > 0 and t.stride(k - 1) == run:
        run *= t.shape[k - 1]
        k -= 1
    a = np.full((1,) * k, t.data_ptr(), dtype=np.int64)
    for d in range(k):
        a = a + (np.arange(t.shape[d], dtype=np.int64) * (t.stride(d) * isz)).reshape(
            (1,) * d + (t.shape[d],) + (1,) * (k - d - 1))
    return np.sort(a.reshape(-1)), run * isz


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (their spans intersecting) share a byte."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    import numpy as np
    (sa, la), (sb, lb) = _runs(a), _runs(b)
    # a's runs are disjoint (no internal overlap) and of one length: for each run of b,
    # the last run of a starting before it ends is the only one that can reach into it
    i = np.searchsorted(sa, sb + lb, side="left") - 1
    ok = i >= 0
    return bool(np.any(sa[i[ok]] + la > sb[ok]))


def _self_overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory, where torch cannot tell (its answer 2,
    "too hard", for any view that is not dense: a slice with a step, a column, and an
    ``as_strided`` whose rows overlap alike)."""
    # sufficient, and cheap: with the dims sorted by stride, each stride passes the
    # furthest offset the smaller dims reach, so no two index tuples meet (every view a
    # slice, transpose or narrow makes)
    reach = 0
    for st, n in sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st <= reach:
            break
        reach += st * (n - 1)
    else:
        return False
    # exact, for what is left: the start of every contiguous run, each run clear of the next
    import numpy as np
    starts, run = _runs(t)
    return bool(np.any(np.diff(starts) < run))


def writable(t: torch.Tensor):
    """A context in which torch lets this process write ``t`` in place: inference mode for
    an inference tensor (a target made under ``torch.inference_mode()``; torch refuses an
    in-place write to one outside it), none for any other tensor."""
    return torch.inference_mode() if t.is_inference() else contextlib.nullcontext()


def wraps_other_tensors(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass with a ``__torch_dispatch__`` of its own (a
    wrapper: DTensor, torch's TwoTensor, float8 / NF4 training weights): its values need
    not lie in its own storage, which a wrapper does not have (``data_ptr()`` 0), and an op
    on it goes where the subclass sends it. A subclass over its own storage (an
    ``nn.Parameter`` subclass, ``as_subclass``) is read and written like a plain tensor."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def uninitialized(t: torch.Tensor) -> str | None:
    """None for a tensor with a shape; else what it is and what to do, for a refusal: a
    lazy module's parameter or buffer before its first forward (``nn.LazyLinear``) has no
    shape or values, and torch answers its ``shape`` or ``numel()`` with a bare
    ValueError that names neither the tensor nor the rank."""
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
        return (f"an {type(t).__name__} (a lazy module's, before its first forward); run the "
                f"module once or initialize it first")
    return None


def layout_kind(t: torch.Tensor) -> str | None:
    """None for a dense (strided) tensor; else what it is instead ("sparse_coo",
    "sparse_csr", "nested", ...): a tensor that keeps its values in other tensors, which
    no engine reads into and no writer writes from."""
    if t.is_nested:   # a nested tensor says torch.strided (or jagged) and has no sizes
        return "nested"
    if t.layout != torch.strided:
        return str(t.layout).removeprefix("torch.")
    # torch's lazy negation or conjugation (x.conj().imag): the storage holds other values
    # than the tensor shows, and the cpu engine's byte view of it failed in torch, untyped
    if t.is_neg():
        return "negative-bit"
    return "conjugate-bit" if t.is_conj() else None


def require_tensor(t, what: str, name: str | None, rank: int | None,
                   wrapper_advice: str | None = None) -> None:
    """LoadError unless ``t``, a destination handed in, is a torch.Tensor with a shape;
    with ``wrapper_advice``, also unless it is one a reader can write (``refuse_wrapper``)."""
    if not isinstance(t, torch.Tensor):
        raise LoadError(f"{what} is a {type(t).__name__}, not a torch.Tensor; expected a "
                        f"tensor to load into", tensor=name, rank=rank)
    lazy = uninitialized(t)
    if lazy is not None:
        raise LoadError(f"{what} is {lazy}", tensor=name, rank=rank)
    if wrapper_advice is not None:
        refuse_wrapper(t, what, name, rank, wrapper_advice)
    refuse_layout(t, what, name, rank)


def refuse_wrapper(t: torch.Tensor, what: str, name: str | None, rank: int | None,
                   advice: str) -> None:
    """LoadError when ``t`` wraps other tensors (``wraps_other_tensors``): it has no
    storage of its own (data pointer 0), so a reader writing at its address writes at
    address 0, and a copy_ into it goes where the subclass sends it."""
    if wraps_other_tensors(t):
        raise LoadError(f"{what} is a {type(t).__name__}, a tensor subclass that wraps "
                        f"others; expected a tensor whose own storage holds its values "
                        f"({advice})", tensor=name, rank=rank)


def refuse_layout(t: torch.Tensor, what: str, name: str | None, rank: int | None) -> None:
    """LoadError unless ``t``, a destination handed in, is dense (``layout_kind``): a
    sparse COO one was refused as "sharing memory", a CSR or nested one failed in torch,
    untyped, wherever its strides or sizes were first read."""
    kind = layout_kind(t)
    if kind is not None:
        raise LoadError(f"{what} is a {kind} tensor; expected a dense (strided) tensor (load "
                        f"into a dense one, then convert it)", tensor=name, rank=rank)


def check_disjoint(dests, rank: int | None, what: str = "destination",
                   wrapper_advice: str | None = None) -> None:
    """LoadError unless the tensors of ``dests`` (name, tensor) pairs, each checked in
    turn by ``require_tensor``, own their memory: none shares a byte with another or has
    elements sharing memory (an expanded view). Filling overlapping destinations leaves one
    with the other's bytes, unnoticed."""
    spans = []
    for name, t in dests:
        require_tensor(t, what, name, rank, wrapper_advice)
        if t.numel() == 0 or t.device.type == "meta":
            continue
        lo, hi = _extent(t)
        if not wraps_other_tensors(t):
            # memory freed or shrunk under a tensor that keeps its shape (FSDP frees a
            # parameter's storage with resize_(0)): the reads went to a private buffer
            # (data pointer 0) or past the end of the allocation, and the load returned
            st = t.untyped_storage()
            base, have = st.data_ptr(), st.nbytes()
            if lo < base or hi > base + have:
                raise LoadError(f"{what} {name!r} holds {have} bytes of memory, but its "
                                f"shape {list(t.shape)} ({t.dtype}) at storage offset "
                                f"{t.storage_offset()} needs {hi - base} (its storage was "
                                f"freed or resized, as FSDP frees a resharded parameter's); "
                                f"expected memory that holds the tensor", tensor=name,
                                rank=rank)
        overlap = torch._debug_has_internal_overlap(t)   # 0 no, 1 yes, 2 too hard to tell
        if overlap == 1 or (overlap == 2 and _self_overlaps(t)):
            raise LoadError(f"{what} has elements that share memory (an expanded or "
                            f"overlapping view); it needs memory of its own", tensor=name,
                            rank=rank)
        spans.append((str(t.device), lo, hi, name, t))
    spans.sort(key=lambda x: x[:3])
    active: list = []
    for dev, lo, hi, name, t in spans:
        active = [x for x in active if x[0] == dev and x[2] > lo]
        for _, _, _, other, u in active:
            if _overlap(u, t):
                raise LoadError(f"{what}s of {other!r} and {name!r} share memory; each needs "
                                f"memory of its own (aliased or overlapping views; tied "
                                f"weights: map one of the two names to None)",
                                tensor=name, rank=rank)
        active.append((dev, lo, hi, name, t))


def host_out(out: Mapping[str, torch.Tensor] | None, rank_plan, device,
             *, rank: int | None = None) -> Mapping[str, torch.Tensor] | None:
    """The destinations a host-memory reader fills itself: ``out`` when it loads to the
    CPU; else None, once every given destination's shape and dtype is checked, before any
    I/O (``to_device`` copies into them after the reads, and would otherwise find a wrong
    one only after reading the whole rank)."""
    check_out(out, rank_plan, rank)
    if torch.device(device).type == "cpu":
        return out
    if out:
        for ts in rank_plan.tensors:
            if ts.name in out:
                _check_dest(out[ts.name], ts.local_shape, dtypes.torch_dtype(ts.dtype), ts.name, rank)
    return None


def check_out(out: Mapping[str, torch.Tensor] | None, rank_plan, rank: int | None) -> None:
    """``check_disjoint`` over the destinations ``out`` gives for this rank's slices, in
    plan order, wrapper subclasses refused among the rest (the first bad one named)."""
    if out:
        check_disjoint([(ts.name, out[ts.name]) for ts in rank_plan.tensors if ts.name in out],
                       rank, wrapper_advice="its local tensor, or a plain tensor to convert "
                                            "after")


def host_default_device():
    """A context in which torch's factory calls that name no device make CPU tensors, as
    coordloader's own code expects: a load inside the caller's ``with
    torch.device("meta"):`` (where model skeletons are built) re-read the checkpoint into
    meta tensors (a good checkpoint failed its verify), and ran the digest self-tests on
    meta tensors, failing them for the whole process. A no-op where the default is the
    CPU already (a device mode costs every torch call)."""
    if _no_device_context():   # most calls: no torch mode at all, no default device set
        return _NO_CONTEXT
    if torch.get_default_device().type == "cpu":
        return _NO_CONTEXT
    return torch.device("cpu")


_NO_CONTEXT = contextlib.nullcontext()


def _no_device_context() -> bool:
    """Whether no device context can be in force, read without torch.get_default_device
    (5 us a call, per digest call once it guarded each): no torch function mode on the
    stack and no global default device. False where torch's private names are gone."""
    try:
        return (torch._C._len_torch_function_stack() == 0
                and torch.utils._device.CURRENT_DEVICE is None)
    except AttributeError:
        return False


def on_host_default_device(fn: Callable) -> Callable:
    """``fn`` run under ``host_default_device`` (an entry point that digests or reads)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with host_default_device():
            return fn(*args, **kwargs)
    return run


def allocate(ts: TensorSlice, device: Any, out: Mapping[str, torch.Tensor] | None = None,
             *, rank: int | None = None) -> torch.Tensor:
    """The destination of one slice: ``out[name]`` when given (checked), else a fresh
    tensor. Padding rows (pieces not covering the local tensor) are zeroed: they must
    never carry stale memory."""
    dt = dtypes.torch_dtype(ts.dtype)
    if out is not None and ts.name in out:
        # detached: filling a parameter that requires grad in place is what is asked for,
        # and autograd refuses in-place writes to a leaf (a bare RuntimeError)
        t = out[ts.name].detach()
        _check_dest(t, ts.local_shape, dt, ts.name, rank)
        if not t.is_contiguous():
            raise LoadError("destination tensor is not contiguous", tensor=ts.name, rank=rank)
        if torch.device(device).type != t.device.type:
            raise LoadError(f"destination lives on {t.device}, the engine loads to {device}",
                            tensor=ts.name, rank=rank)
    else:
        try:
            t = torch.empty(ts.local_shape, dtype=dt, device=device)
        except (RuntimeError, MemoryError) as e:
            text = (str(e).strip().splitlines() or [""])[0][:300]
            # torch.OutOfMemoryError on a device, a RuntimeError from the CPU allocator
            oom = (isinstance(e, (MemoryError, torch.OutOfMemoryError))
                   or "can't allocate memory" in text or "out of memory" in text.lower())
            advice = ("; split the model over more ranks (a larger tp, ep or pp), or load "
                      "into tensors of your own (out=)" if oom else "")
            raise LoadError(f"cannot allocate this rank's slice, {ts.dtype} "
                            f"{list(ts.local_shape)} ({slice_nbytes(ts)} bytes) on {device}: "
                            f"{type(e).__name__}: {text}{advice}", tensor=ts.name,
                            rank=rank) from e
    if ts.needs_zero_fill:
        with writable(t):
            t.zero_()
    return t


def to_device(tensors: dict[str, torch.Tensor], device: torch.device,
              out: Mapping[str, torch.Tensor] | None, *, rank: int | None = None) -> None:
    """Move tensors loaded in host memory to ``device``, in place in ``tensors``: into
    ``out[name]`` when given (checked, as ``host_out`` did before the reads), else a
    fresh copy."""
    for name, t in tensors.items():
        if out is None or name not in out:
            tensors[name] = t.to(device)
            continue
        dst = out[name]
        _check_dest(dst, t.shape, t.dtype, name, rank)
        with writable(dst):
            dst.copy_(t)
        tensors[name] = dst


def refuse_changed(path: str, fd: int, info, rank: int | None, *,
                   during: str = "the load") -> os.stat_result:
    """LoadError unless the open file ``fd`` is still the one whose header ``info`` (a
    FileInfo) the plan was made from: a regular file of the same size and header and, when
    this process read that header, the same inode, mtime and ctime. Every engine calls it on each
    file before reading it: a rewritten file would otherwise be read under the old plan.
    ``consolidate`` calls it too, on each source file (``during``: what is under way).
    Returns the file's ``fstat`` as checked, for ``refuse_moved`` once it is read."""
    import stat

    from coordloader.checkpoint.reader import changed_since_header, header_unchanged
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise LoadError("is no longer a regular file: it changed after its header was read",
                        file=info.name, rank=rank)
    if st.st_size != info.size:
        raise LoadError(f"file is {st.st_size} bytes, its header was read when it had "
                        f"{info.size}: it changed during {during}", file=info.name, rank=rank)
    if not header_unchanged(fd, info):
        raise LoadError("file's header differs from the one the plan was made from: the file "
                        "was rewritten after its header was read; read the checkpoint again",
                        file=info.name, rank=rank)
    if changed_since_header(path, st, info.header_sha256):
        raise LoadError("file changed after its header was read (same size and header; "
                        "another inode, mtime or ctime: replaced, rewritten in place, or its "
                        "permissions or links changed): read the checkpoint again",
                        file=info.name, rank=rank)
    return st


def refuse_moved(fd: int, checked: os.stat_result, info, rank: int | None, *,
                 during: str = "the load") -> None:
    """LoadError unless the file open on ``fd`` still has the ``stat_key`` of ``checked``,
    the ``fstat`` ``refuse_changed`` returned when it checked it before the reads. A file
    rewritten in place (same size and header, other data) while it is read loads as a mix
    of its old and new bytes, which no check made before the reads can see: each engine
    calls this on every file once its reads are done, before the descriptor closes (one
    ``fstat`` per file, not per read; the safetensors engine, whose mapped reads a
    truncation would end in SIGBUS, also before each piece). A rewrite within one tick of the file system's
    coarse clock after the file's last change moves neither time and is not seen; nor is
    one that sets the mtime back to the very nanosecond it had (the ctime alone moving is
    let through, below)."""
    from coordloader.checkpoint.reader import STAT_KEY_FIELDS, stat_key
    moved = [(what, a, b) for what, a, b in zip(STAT_KEY_FIELDS, stat_key(checked),
                                                 stat_key(os.fstat(fd))) if a != b]
    # the ctime alone moves for a chmod, a rename, a hard link made or removed (a new
    # file renamed over the path, a backup snapshot), an xattr, an atime set back: the
    # bytes read through the descriptor are still the checked file's, and refusing would
    # fail a good load. A write moves the mtime, and a new version copied in place with
    # its times kept (rsync --inplace -t) has its own mtime, not the old file's
    if not moved or [what for what, _, _ in moved] == ["ctime"]:
        return
    shown = [f"{what} ({a} -> {b} bytes)" if what == "size" else what for what, a, b in moved]
    said = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"
    raise LoadError(f"file changed during {during}: its {said} moved after it was "
                    f"checked before the reads (rewritten in place or truncated), so the "
                    f"bytes read may mix two versions "
                    f"of it; load again once nothing writes the file", file=info.name, rank=rank)


def open_checked(path: str, info, rank: int | None, *,
                 during: str = "the load") -> tuple[int, os.stat_result]:
    """Open ``path`` once and ``refuse_changed`` on that descriptor -> (descriptor, its
    ``fstat`` as checked); the caller closes it. For an engine whose library opens
    files itself (safetensors, instanttensor): checking one open and letting the library
    open the path again would check one file and read another, if a new file were renamed
    over the path in between. The library is handed ``fd_path(fd)`` (the checked file
    itself), or, where there is none, the path followed by ``refuse_replaced`` once the
    library has opened it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise LoadError(f"cannot open: {e.strerror}", file=info.name, rank=rank) from None
    try:
        st = refuse_changed(path, fd, info, rank, during=during)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def refuse_changed_path(path: str, info, rank: int | None, *,
                        during: str = "the load") -> None:
    """``refuse_changed`` on the file at ``path`` now (opened, checked and closed)."""
    os.close(open_checked(path, info, rank, during=during)[0])


def fd_path(fd: int) -> str | None:
    """A path whose opening opens the very file ``fd`` is open on, wherever the file's
    own path points now (``/proc/self/fd/N``); None on a platform without one."""
    p = f"/proc/self/fd/{fd}"
    return p if os.path.exists(p) else None


def refuse_replaced(path: str, fd: int, info, rank: int | None) -> None:
    """LoadError unless ``path`` still names the file open on ``fd`` (the one
    ``open_checked`` checked): same device and inode. Called after a library opened
    ``path`` itself; while ``fd`` stays open its inode cannot be reused, so a file renamed
    over the path in between is seen (the checked file renamed back over it is not)."""
    st = os.fstat(fd)
    try:
        now = os.stat(path)
    except OSError as e:
        raise LoadError(f"file is gone from its path after it was checked: {e.strerror}; "
                        f"read the checkpoint again", file=info.name, rank=rank) from None
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise LoadError("file was replaced at its path between its check and its read (another "
                        "inode there now): read the checkpoint again", file=info.name, rank=rank)


# descriptors left for the rest of the process while a rank holds its files open
_FD_SPARE = 64


class _Room:
    """The soft RLIMIT_NOFILE as coordloader's loads in this process left it: the loads
    holding raised room, the soft limit before the first of them raised it, and the one
    set last. The limit goes back only when the last holder leaves, and only if nothing
    else changed it meanwhile: concurrent loads (threads, two models in one process) must
    not take each other's descriptors away."""
    lock = threading.Lock()
    holders = 0
    before: int | None = None   # the soft limit before coordloader raised it
    granted: int | None = None  # the soft limit coordloader set last


def descriptor_room(files: int, rank: int | None, spare: int | None = None) -> Callable[[], None]:
    """Make room for ``files`` more open descriptors: the cpu engine holds every file it
    reads open for the whole load (its read threads share them), instanttensor's library
    opens them all beside the engine's checked ones, and a rank of a torch DCP checkpoint
    saved by 1024 ranks reads 1024 files, past the common soft limit of 1024.
    Raises the soft RLIMIT_NOFILE up to the hard limit when needed; returns the call that
    ends this load's hold (the limit is put back when no load holds room any more);
    LoadError when even the hard limit is too low. ``spare``: descriptors beyond the
    files (default the engines' own, _FD_SPARE)."""
    try:
        import resource
    except ImportError:   # not POSIX
        return lambda: None
    with _Room.lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            used = len(os.listdir("/proc/self/fd"))
        except OSError:   # no /proc, or no descriptor left to list it with
            used = soft if soft != resource.RLIM_INFINITY else 0
        need = used + files + (_FD_SPARE if spare is None else spare)
        if soft != resource.RLIM_INFINITY and need > soft:
            if hard != resource.RLIM_INFINITY and need > hard:
                raise LoadError(f"this rank reads {files} files, holding each open, and needs "
                                f"{need} file descriptors; the hard limit (RLIMIT_NOFILE) is "
                                f"{hard}: raise it (ulimit -Hn), or load with more ranks",
                                rank=rank)
            if _Room.before is None:
                _Room.before = soft
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            _Room.granted = need
        _Room.holders += 1

    done = []

    def release() -> None:
        with _Room.lock:
            if done:   # once per hold
                return
            done.append(True)
            _Room.holders -= 1
            if _Room.holders or _Room.before is None:
                return
            now, hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)
            if now == _Room.granted:
                resource.setrlimit(resource.RLIMIT_NOFILE, (_Room.before, hard_now))
            _Room.before = _Room.granted = None
    return release


@contextlib.contextmanager
def paths_stay_checked(paths: Sequence[str], infos: Sequence, rank: int | None):
    """For a library that opens ``paths`` itself (instanttensor): ``open_checked`` each,
    holding the descriptors while the body runs; when it ends, or fails with a LoadError,
    ``refuse_replaced`` and ``refuse_moved`` on each, so a file renamed over its path
    between the check and the library's open of it, or rewritten in place while the
    library read it, is named instead of loaded (or blamed on the library). The path
    names the checked file (``refuse_replaced``), so its descriptor's ``fstat`` is of the
    file the library read."""
    fds: list[tuple[int, os.stat_result]] = []
    room = descriptor_room(2 * len(paths), rank)   # these and the library's own
    try:
        for path, info in zip(paths, infos):
            fds.append(open_checked(path, info, rank))
        def still_checked() -> None:
            for path, (fd, st), info in zip(paths, fds, infos):
                refuse_replaced(path, fd, info, rank)
                refuse_moved(fd, st, info, rank)
        try:
            yield
        except LoadError:
            still_checked()   # a file replaced meanwhile: the cause
            raise
        still_checked()
    finally:
        for fd, _ in fds:
            os.close(fd)
        room()


def needed_keys(meta: CheckpointMeta, rank_plan: RankPlan) -> dict[str, set[str]]:
    """file -> the keys (``SourcePiece.key``) of the stored pieces this rank's slices
    overlap."""
    need: dict[str, set[str]] = {}
    for ts in rank_plan.tensors:
        info = meta.tensors.get(ts.name)
        if info is None:
            continue
        for sp in info.pieces:
            if any(intersect(pc.src, sp.box) is not None for pc in ts.pieces):
                need.setdefault(sp.file, set()).add(sp.key)
    return need


def needed_files(meta: CheckpointMeta, rank_plan: RankPlan) -> set[str]:
    """The files of ``needed_keys`` (a bound for the descriptors a load holds), without its
    box intersections where a tensor is stored in one piece: a slice holding any piece of
    such a tensor reads that file."""
    files: set[str] = set()
    tensors = meta.tensors
    for ts in rank_plan.tensors:
        info = tensors.get(ts.name)
        if info is None or not ts.pieces:
            continue
        if len(info.pieces) == 1:
            files.add(info.pieces[0].file)
            continue
        for sp in info.pieces:
            if sp.file not in files and any(intersect(pc.src, sp.box) is not None
                                            for pc in ts.pieces):
                files.add(sp.file)
    return files


def slice_nbytes(ts: TensorSlice) -> int:
    return ts.local_numel * dtypes.itemsize(ts.dtype)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def narrow_box(t: torch.Tensor, starts, shape) -> torch.Tensor:
    for d, (s, n) in enumerate(zip(starts, shape)):
        if s != 0 or n != t.shape[d]:
            t = t.narrow(d, s, n)
    return t


def copy_overlap(dst: torch.Tensor, piece_src: Box, piece_dst: tuple[int, ...],
                 src: torch.Tensor, src_box: Box) -> int:
    """Copy the part of ``src`` (holding global box ``src_box``) that falls inside the
    planned piece (global box ``piece_src`` placed at ``piece_dst`` in ``dst``).
    Returns the number of elements copied."""
    ov = intersect(piece_src, src_box)
    if ov is None:
        return 0
    shape = box_shape(ov)
    s = narrow_box(src, [lo - b0 for (lo, _), (b0, _) in zip(ov, src_box)], shape)
    d = narrow_box(dst, [off + lo - p0 for off, (lo, _), (p0, _) in zip(piece_dst, ov, piece_src)],
                   shape)
    with writable(dst):
        d.copy_(s)
    return box_numel(ov)


__all__ = ["ENGINE_NAMES", "LoadStats", "select_engine", "resolve_engine_name", "cuda_backend",
           "allocate",
           "host_out", "check_out", "check_disjoint", "require_tensor", "copy_overlap", "intersect",
           "uninitialized", "layout_kind", "refuse_layout", "refuse_wrapper", "writable",
           "wraps_other_tensors",
           "to_device", "descriptor_room"]
