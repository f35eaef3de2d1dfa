"""The launchers: local.sh really runs (2 CPU ranks over gloo on a tiny checkpoint); the
multi-node, Slurm and Kubernetes ones are checked statically (no cluster here)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordloader.dist.collective import free_port
from coordloader.synth import synthesize

pytestmark = pytest.mark.slow   # the launch scripts start torchrun

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["local.sh", "multinode.sh", "slurm.sbatch", "handoff_example.sh", "gpu_check.sh"]


def test_local_sh_runs_two_cpu_ranks(tmp_path):
    ckpt = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    env = dict(os.environ, NPROC="2", CKPT=ckpt, DEVICE="cpu", PYTHON=sys.executable,
               MASTER_PORT=str(free_port()), PET_MASTER_PORT=str(free_port()))
    # no layout flag, other flags given: the default --tp $NPROC still applies (it applied
    # only when no argument at all was given)
    p = subprocess.run(["bash", str(REPO / "launch" / "local.sh"),
                        "--report", str(tmp_path / "r.json"), "--quiet"],
                       capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    import json
    rep = json.load(open(tmp_path / "r.json"))
    assert [r["rank"] for r in rep["ranks"]] == [0, 1]
    assert rep["layout"]["tp"] == 2 and rep["totals"]["bytes_read"] > 0


def test_local_sh_reports_a_layout_mismatch(tmp_path):
    ckpt = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    env = dict(os.environ, NPROC="2", CKPT=ckpt, DEVICE="cpu", PYTHON=sys.executable,
               MASTER_PORT=str(free_port()), PET_MASTER_PORT=str(free_port()))
    p = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "--tp", "4"],
                       capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert p.returncode != 0
    assert "launched with 2 ranks but the layout" in p.stderr, p.stderr[-3000:]


def test_local_sh_with_cuda_asked_and_no_gpu_says_so(tmp_path):
    """DEVICE=cuda on a machine without a GPU gave NPROC=0, and torchrun died on an
    AssertionError traceback."""
    env = dict(os.environ, DEVICE="cuda", CKPT=str(tmp_path), PYTHON=sys.executable,
               CUDA_VISIBLE_DEVICES="")
    env.pop("NPROC", None)
    p = subprocess.run(["bash", str(REPO / "launch" / "local.sh")], capture_output=True,
                       text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip() == ("local.sh: DEVICE=cuda but torch sees no CUDA device; set "
                                "DEVICE=cpu or NPROC")


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    p = subprocess.run(["bash", "-n", str(REPO / "launch" / script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    p = subprocess.run(["shellcheck", *[str(REPO / "launch" / s) for s in SCRIPTS]],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_multinode_requires_its_variables():
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    p = subprocess.run(["bash", str(REPO / "launch" / "multinode.sh")], capture_output=True,
                       text=True, env=env, timeout=30)
    assert p.returncode != 0 and "NNODES" in p.stderr


def test_k8s_manifest_is_a_pytorchjob():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(open(REPO / "launch" / "k8s-pytorchjob.yaml"))
    assert doc["kind"] == "PyTorchJob"
    for role in ("Master", "Worker"):
        c = doc["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]
        assert "coordloader.load" in " ".join(c["args"])


def test_console_script_dispatches(tmp_path):
    from coordloader.cli import main
    ckpt = synthesize(str(tmp_path / "ck"), "llama", "tiny")
    assert main(["plan", ckpt, "--tp", "2", "--json", str(tmp_path / "p.json")]) == 0
    assert (tmp_path / "p.json").stat().st_size > 0
    assert main(["nope"]) == 2
