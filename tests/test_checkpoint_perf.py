"""Header-reading speed on a full-size DeepSeek-V3 layout (163 shards, ~92k tensors,
synthesized metadata-only: real headers, sparse data). Issue 2: all headers in < 2 s."""
from __future__ import annotations

import os
import pickle
import time

import pytest

from coordloader import synth
from coordloader.checkpoint.reader import assemble, discover, read_checkpoint, read_file_header

pytestmark = pytest.mark.slow   # full DeepSeek-V3 metadata


@pytest.fixture(scope="module")
def ds3(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ds3") / "ckpt")
    synth.synthesize(out, "deepseek_v3", "full", metadata_only=True)
    return out


def test_deepseek_v3_full_headers_under_2s(ds3):
    read_checkpoint(ds3)  # page cache warm, as on a node that has just listed the files
    walls, cpus = [], []
    for _ in range(3):
        w, c = time.perf_counter(), time.process_time()
        meta = read_checkpoint(ds3)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    print(f"\nDeepSeek-V3 full: {len(meta.files)} files, {len(meta.tensors)} tensors, "
          f"read_checkpoint best wall {min(walls):.3f} s, best CPU {min(cpus):.3f} s")
    assert len(meta.files) == 163
    assert len(meta.tensors) > 90_000
    # every data byte of every file belongs to exactly one tensor
    assert meta.total_bytes == sum(f.size - f.data_start for f in meta.files)
    # CPU time, not wall: the shared test machine's load must not make this flaky
    assert min(cpus) < 2.0


def test_split_reading_matches(ds3):
    """The loader's path: ranks read shares of the headers, all-gather (pickle), assemble."""
    disc = discover(ds3)
    world = 4
    shares = [[read_file_header(ds3, f) for f in disc.files[r::world]] for r in range(world)]
    gathered = [h for share in shares for h in pickle.loads(pickle.dumps(share))]
    disc2 = pickle.loads(pickle.dumps(disc))
    assert assemble(ds3, disc2, gathered) == read_checkpoint(ds3)
    assert os.path.isabs(disc.root)
