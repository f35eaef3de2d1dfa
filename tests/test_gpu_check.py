"""launch/gpu_check.sh on a machine without CUDA: it refuses before installing or writing
anything, with a message saying why, and a non-zero exit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_refuses_without_cuda(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no CUDA device" in p.stderr and "torch.cuda.is_available() is False" in p.stderr
    assert not out.exists()   # refused before writing results or installing anything


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_hidden_gpus_are_refused_too(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU: the same refusal on a GPU machine
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 2 and "no CUDA device" in p.stderr, p.stderr


def test_needs_an_output_directory(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                       cwd=tmp_path)
    assert p.returncode == 2 and "usage:" in p.stderr


def test_refuses_a_python_without_torch(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec " + sys.executable + " -S -I -c 'raise SystemExit(1)' \"$@\"\n")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake))
    p = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=30, env=env, cwd=tmp_path)
    assert p.returncode == 2 and "cannot import torch" in p.stderr, p.stderr


def test_nccl_step_reruns_and_writes_the_manifest_before_loading():
    """The NCCL step synthesized without --overwrite (a rerun into the same OUT_DIR failed
    at synth) and loaded with --verify digest and no manifest (content compared with
    nothing: digest-replicas only). Checked on the script's text: the step needs 2 GPUs."""
    import re
    text = SCRIPT.read_text()
    m = re.search(r"step nccl_load .*? bash -c \\\n\s*'(.*?)'", text, re.S)
    assert m, "the nccl_load step's inner script was not found"
    cmds = [" ".join(c.split()) for c in m.group(1).split("&&")]
    assert len(cmds) == 3, cmds   # one chain: a failed step stops the ones after it
    synth, manifest, load = cmds
    assert synth.startswith('"$PYTHON" -m coordloader.synth ') and "--overwrite" in synth.split()
    assert synth.split()[-2:] == ['"$CKPT"', ">/dev/null"]
    assert manifest.startswith('"$PYTHON" -m coordloader.manifest ')
    assert manifest.split()[-1] == '"$CKPT"' and "--check" not in manifest
    assert load.startswith("launch/local.sh ") and "--verify digest" in load


@pytest.mark.slow   # subprocesses, or long: the full suite runs it
def test_a_failed_install_is_noted_and_the_steps_still_run(tmp_path):
    """A lent machine reaches no package index: the install failing exited 3 before any
    check, the GPU session spent. Run here with a PYTHON that reports one GPU, lacks
    instanttensor and cannot install it: every step still runs (each failing or not on
    its own) and the summary says the install failed."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *device_count*) echo 1; exit 0;;\n'
        '  *find_spec*) echo instanttensor; exit 0;;\n'
        '  *"pip install"*) echo "no package index reachable" >&2; exit 1;;\n'
        "esac\n"
        f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(fake), STEP_TIMEOUT="40", BUDGET="100")
    p = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True,
                       timeout=240, env=env, cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[0] == ("install FAIL (missing: instanttensor; see install.log): the steps run "
                        "with what is there"), lines
    assert [ln.split()[0] for ln in lines[1:]] == ["pytest_gpu", "bench_it", "nccl_load",
                                                   "total"], lines
    assert "no package index reachable" in (out / "install.log").read_text()
