"""Helpers for tests that start several rank processes on this machine."""
from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp

HARD_TIMEOUT_S = 150


def spawn_and_wait(worker, args: tuple, nprocs: int, what: str,
                   hard_s: float = HARD_TIMEOUT_S) -> None:
    """``worker(rank, *args)`` in ``nprocs`` spawned processes; pytest.fail when they have
    not all finished within ``hard_s`` (a hang), killing any left on the way out."""
    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + hard_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not finish within {hard_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
