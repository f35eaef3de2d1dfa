"""One copy of the small helpers the tests share."""
from __future__ import annotations

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


def rank_line(err: str, rank: int, *, only: bool = False) -> str:
    """The one `coordloader: rank R: ...` message line of a rank's stderr; no traceback may
    stand beside it, and with ``only`` nothing else at all."""
    lines = [ln for ln in err.splitlines() if ln.startswith(f"coordloader: rank {rank}: ")]
    assert len(lines) == 1, f"rank {rank} stderr:\n{err}"
    assert "Traceback" not in err, err
    if only:
        assert err.strip() == lines[0], f"rank {rank} stderr has more than the message:\n{err}"
    return lines[0]
