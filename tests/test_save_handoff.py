"""The worked example of docs/handoff.md runs: TP=4 training on 4 gloo ranks, save,
TP=2 (and TP=1) serving, logits equal within fp32 tolerance."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # runs the handoff example end to end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Gloo's C++ worker threads can abort a process at interpreter exit ("terminate called
# without an active exception", SIGABRT) even after destroy_process_group: a torch
# teardown race (pytorch/pytorch#179291 discusses it), seen here about once in 20 runs on
# a loaded machine, always after the example's own work was done. One retry on exactly
# that signature keeps the suite deterministic; any other failure fails at once.
_GLOO_EXIT_ABORT = "terminate called without an active exception"


def _run_example(work):
    env = dict(os.environ, WORK=str(work), STEPS="3",
               TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    p = subprocess.run(["bash", os.path.join(ROOT, "launch", "handoff_example.sh")], env=env,
                       capture_output=True, text=True, timeout=240)
    return p, p.stdout + p.stderr


def test_handoff_example_script(tmp_path):
    p, out = _run_example(tmp_path)
    if p.returncode != 0 and _GLOO_EXIT_ABORT in out:
        tmp_path = tmp_path / "retry"
        p, out = _run_example(tmp_path)
    assert p.returncode == 0, out[-4000:]
    assert "serve: TP=2 logits vs training-side TP=4 logits" in out and "MISMATCH" not in out, out[-4000:]
    assert out.count("-> OK") == 2 and "handoff example: OK" in out
    losses = [float(l.rsplit(" ", 1)[1]) for l in out.splitlines() if l.startswith("train: step")]
    assert len(losses) == 3
    saved = sorted(os.listdir(tmp_path / "trained"))
    assert "coordloader-index.json" in saved
    assert [f for f in saved if f.startswith("rank-")] == [
        f"rank-{r:05d}-part-00000.coordloader-shard" for r in range(4)]
