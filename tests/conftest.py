"""Shared fixtures. Tests import their helpers from `helpers.py` and `ranks.py` (beside
this file, on sys.path through pytest's rootdir insertion)."""
from __future__ import annotations

import os
import stat

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch)`` -> the path of a synthesized tiny checkpoint of ``arch``,
    made once per session. The files are made read-only: a test that changes a checkpoint
    makes its own."""
    from coordloader.synth import synthesize
    made: dict[str, str] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str) -> str:
        if arch not in made:
            path = synthesize(str(root / arch), arch, "tiny")
            for f in os.listdir(path):
                p = os.path.join(path, f)
                os.chmod(p, stat.S_IMODE(os.stat(p).st_mode) & ~0o222)
            made[arch] = path
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_checkpoint) -> str:
    return tiny_checkpoint("qwen3_moe")
