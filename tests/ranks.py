"""Helpers for tests that start several rank processes on this machine."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

HARD_TIMEOUT_S = 150
REPO = Path(__file__).resolve().parents[1]


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


def rank_env(port: int, rank: int, world: int, **extra: str) -> dict:
    """This environment plus what a Slurm/Kubernetes launch gives rank ``rank`` (and the
    repository on PYTHONPATH); COORDLOADER_DEBUG removed so stderr is the one-line form."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    env.pop("COORDLOADER_DEBUG", None)
    return env


def run_ranks(ranks, start, hard: float, on_running=None):
    """``start(rank)`` -> a Popen in its own session, for each rank; wait until all exit
    (pytest.fail after ``hard`` s: a hang), polling ``on_running(procs)`` until it returns
    True. -> (procs, {rank: exit time}, start time). Kills every process group left over
    on the way out."""
    procs: dict[int, subprocess.Popen] = {}
    t0 = time.time()
    try:
        for r in ranks:
            procs[r] = start(r)
        ends: dict[int, float] = {}
        done_hook = on_running is None
        while len(ends) < len(procs):
            if time.time() - t0 > hard:
                pytest.fail(f"ranks {sorted(set(procs) - set(ends))} still running after "
                            f"{hard} s: hang")
            if not done_hook:
                done_hook = on_running(procs)
            for r, p in procs.items():
                if r not in ends and p.poll() is not None:
                    ends[r] = time.time()
            time.sleep(0.02)
        return procs, ends, t0
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
