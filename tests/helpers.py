"""One copy of the small helpers the tests share."""
from __future__ import annotations

import contextlib
import os

import torch


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (empty for a zero-element tensor), so two
    tensors compare bit for bit whatever their dtype (NaN payloads and -0.0 included)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return tensor_bits(t).numpy().tobytes()


def open_fds() -> set[str]:
    """The file descriptors this process holds open now."""
    return set(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def few_descriptors(spare: int):
    """The soft RLIMIT_NOFILE set to allow ``spare`` more open descriptors than this
    process holds now (the hard limit kept); yields that soft limit and puts the old one
    back whatever happens."""
    import resource
    fd = os.open(os.devnull, os.O_RDONLY)   # the lowest free descriptor
    os.close(fd)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (fd + spare, hard))
    try:
        yield fd + spare
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def many_files(directory, n: int) -> None:
    """An HF checkpoint of ``n`` files under an index, file i holding ``t{i}`` = four i's."""
    from safetensors.torch import save_file

    from stfiles import write_index
    wm = {f"t{i}": f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)}
    for i in range(n):
        save_file({f"t{i}": torch.full((4,), float(i))}, os.path.join(directory, wm[f"t{i}"]))
    write_index(directory, wm)


def rank_line(err: str, rank: int, *, only: bool = False) -> str:
    """The one `coordloader: rank R: ...` message line of a rank's stderr; no traceback may
    stand beside it, and with ``only`` nothing else at all."""
    lines = [ln for ln in err.splitlines() if ln.startswith(f"coordloader: rank {rank}: ")]
    assert len(lines) == 1, f"rank {rank} stderr:\n{err}"
    assert "Traceback" not in err, err
    if only:
        assert err.strip() == lines[0], f"rank {rank} stderr has more than the message:\n{err}"
    return lines[0]


def flip_byte(path, offset: int, mask: int = 0x40) -> None:
    """XOR the file's byte at ``offset`` with ``mask``: a corruption that keeps the file's
    size and header (bit rot, a copy gone wrong)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def flip_data_bytes(path, every: int, mask: int) -> None:
    """XOR one byte in every ``every`` of a safetensors file's data (past its header) with
    ``mask``: a change in many tensors, headers and sizes the same."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start = 8 + int.from_bytes(data[:8], "little")
    for i in range(start, len(data), every):
        data[i] ^= mask
    with open(path, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def shm_dir():
    """A fresh directory on tmpfs (/dev/shm), removed on the way out: sparse files there may
    be far larger than ext4's 16 TiB. The test is skipped where there is none."""
    import shutil
    import uuid

    import pytest
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    root = os.path.join(shm, f"coordloader-test-{uuid.uuid4().hex}")
    os.makedirs(root)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def write_sparse_st(path, header: dict) -> None:
    """A safetensors file of ``header`` whose data is a hole as long as its offsets say."""
    from stfiles import raw_file
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    with open(path, "wb") as f:
        f.write(raw_file(header))
    os.truncate(path, os.path.getsize(path) + end)
