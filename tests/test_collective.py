"""Fault tests for coordloader.collective with real processes.

Four plain processes (no torchrun) over gloo on 127.0.0.1, each given MASTER_ADDR /
MASTER_PORT / RANK / WORLD_SIZE like a Slurm or Kubernetes launch would. Every test has a
hard bound (subprocess deadline) and kills its children on the way out."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coordloader.dist.collective import (
    Group,
    _is_comm_failure,
    describe_exception,
    exit_on_error,
    free_port,
    run_phase,
)
from coordloader.errors import CheckpointError, CollectiveError, SaveError

from helpers import rank_line
from ranks import rank_env, run_ranks

pytestmark = pytest.mark.slow   # rank processes over gloo

TIMEOUT = 5.0          # the group's timeout inside the children
HARD = 60.0            # the harness's own bound per test
REPO = Path(__file__).resolve().parents[1]

DRIVER = r'''
import os, sys, time, signal
from coordloader.dist.collective import init_group, run_phase, exit_on_error
from coordloader.errors import SaveError

mode = sys.argv[1]
mark = sys.argv[2]
# Ctrl-C as a terminal delivers it: a suite started in the background of a non-interactive
# shell hands its children SIGINT ignored, and Python then installs no handler of its own
signal.signal(signal.SIGINT, signal.default_int_handler)


def main():
    with open(mark + "-started-" + os.environ["RANK"], "w") as f:
        f.write(repr(time.time()))   # the harness measures from here, not interpreter start
    g = init_group(timeout_s=float(os.environ["CL_TIMEOUT"]))
    r = g.rank
    assert run_phase("metadata", lambda: r, g) == r
    if mode == "error":
        def dump():
            if r == 2:   # an error only rank 2 can see
                raise SaveError("cannot create rank-00002.safetensors: Permission denied",
                                file="/out/rank-00002.safetensors")
            return r
        run_phase("dump", dump, g)
    elif mode == "kill":
        def load():
            if r == 2:   # dies in the middle of the phase, no chance to report
                with open(mark, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.5)
            import torch, torch.distributed as dist
            t = torch.ones(1)
            dist.all_reduce(t)   # a real collective with the dead peer inside the phase
            return r
        run_phase("load", load, g)
    elif mode == "sigint":
        def load():
            if r == 2:   # Ctrl-C on rank 2 while it works in the phase
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            return r
        run_phase("load", load, g)
    elif mode == "sigint_wait":
        def load():
            if r == 2:   # rank 2 is first at the boundary; Ctrl-C reaches it while it waits
                import threading
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
            else:
                time.sleep(3)
            return r
        run_phase("load", load, g)
        run_phase("verify", lambda: r, g)
    elif mode == "sigint_collective":
        def verify():
            import torch.distributed as dist
            if r == 2:   # Ctrl-C on rank 2 before the phase's collective
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            out = [None] * g.world
            dist.all_gather_object(out, r)   # the others' breaks when rank 2 leaves
            return r
        run_phase("verify", verify, g)
    elif mode == "host_error_collective":
        def verify():
            import torch.distributed as dist
            if r == 0:   # the store's host fails while the others wait in the collective
                time.sleep(1)
                raise RuntimeError("disk vanished")
            out = [None] * g.world
            dist.all_gather_object(out, r)
            return r
        run_phase("verify", verify, g)
    elif mode == "own_and_nccl":
        def load():
            if r == 1:
                raise SaveError("truncated", file="/ck/model.safetensors")
            if r == 0:   # an NCCL failure of its own, in the same phase
                raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled cuda "
                                   "error, NCCL version 2.21.5: out of memory")
            return r
        run_phase("load", load, g)
    elif mode == "plain_error":
        run_phase("plan", lambda: 1 / (r - 1), g)
    elif mode == "bad_str":
        class BadStr(Exception):
            def __str__(self):
                raise RuntimeError("str exploded")

        def plan():
            if r == 1:
                raise BadStr()
            return r
        run_phase("plan", plan, g)
    elif mode == "happy":
        out = run_phase("load", lambda: {"rank": r, "x": r * 10}, g)
        again = run_phase("verify", lambda: out["x"] + 1, g)
        print("VALUE", out["rank"], out["x"], again, flush=True)
    g.close()
    print("DONE", flush=True)


with exit_on_error():
    main()
'''


def _launch(tmp_path: Path, mode: str, ranks, world: int = 4, timeout: float = TIMEOUT,
            port: int | None = None, env: dict | None = None):
    """Start `ranks` of a `world`-rank group (rank r's environment updated by `env[r]`);
    return ({rank: (rc, out, err, end_time, start_time)}, launch time, time rank 2 killed
    itself or None)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    mark = tmp_path / "killed_at"
    port = port or free_port()
    procs, ends, t0 = run_ranks(ranks, lambda r: subprocess.Popen(
        [sys.executable, str(script), mode, str(mark)],
        env={**rank_env(port, r, world, CL_TIMEOUT=str(timeout)), **(env or {}).get(r, {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, cwd=str(tmp_path), start_new_session=True), HARD)
    res = {}
    for r, p in procs.items():
        out, err = p.communicate()
        f = Path(f"{mark}-started-{r}")
        res[r] = (p.returncode, out.decode(), err.decode(), ends[r],
                  float(f.read_text()) if f.exists() else t0)
    killed_at = float(mark.read_text()) if mark.exists() else None
    return res, t0, killed_at


def test_happy_path_returns_value_on_every_rank(tmp_path):
    res, _, _ = _launch(tmp_path, "happy", range(4))
    for r, (rc, out, err, *_) in res.items():
        assert rc == 0, f"rank {r}: {err}"
        assert f"VALUE {r} {r * 10} {r * 10 + 1}" in out and "DONE" in out


@pytest.mark.parametrize("env", [
    {1: {"MASTER_ADDR": "localhost"}},
], ids=["master-addr-spelt-per-node"])
def test_a_group_forms_where_nodes_see_their_launch_apart(tmp_path, env):
    """Keys were in a namespace of MASTER_ADDR as each rank saw it: one store reached as
    localhost and as 127.0.0.1 never formed ("rank 1 did not join", each rank blaming the
    other) where torch's own init_process_group does."""
    res, _, _ = _launch(tmp_path, "happy", range(2), world=2, env=env)
    for r, (rc, out, err, *_) in res.items():
        assert rc == 0, f"rank {r}: {err}"
        assert "DONE" in out


def test_error_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    res, t0, _ = _launch(tmp_path, "error", range(4))
    for r, (rc, out, err, *_) in res.items():
        assert rc == 1, f"rank {r}: rc {rc}\n{err}"
        line = rank_line(err, r)
        assert "phase dump: rank 2: SaveError:" in line
        assert "Permission denied" in line and "/out/rank-00002.safetensors" in line
        assert "Traceback" not in err
        assert "DONE" not in out


def test_sigkilled_rank_is_named_by_every_survivor_within_timeout(tmp_path):
    res, t0, killed_at = _launch(tmp_path, "kill", range(4))
    assert killed_at is not None
    assert res[2][0] == -signal.SIGKILL
    for r in (0, 1, 3):
        rc, out, err, end, _ = res[r]
        assert rc == 1, f"rank {r}: rc {rc}\n{err}"
        line = rank_line(err, r)
        assert "phase load: rank 2 died" in line, line
        assert end - killed_at < TIMEOUT + 10, f"rank {r} exited {end - killed_at:.1f} s after the kill"


@pytest.mark.parametrize("ranks, wanted", [
    ((0, 1, 3), ("group did not form within 5 s: rank 2 did not join (joined: 0,1,3)",)),
    ((1, 2, 3), ("cannot reach the rendezvous store", "rank 0 did not start")),
], ids=["rank_2_never_joins", "rank_0_missing"])
def test_rank_that_never_starts_is_named_by_the_others(tmp_path, ranks, wanted):
    res, t0, _ = _launch(tmp_path, "happy", ranks)
    for r, (rc, out, err, end, started) in res.items():
        assert rc == 1, f"rank {r}: rc {rc}\n{err}"
        line = rank_line(err, r)
        assert all(w in line for w in wanted), line
        assert end - started < TIMEOUT + 10, f"rank {r} took {end - started:.1f} s"


@pytest.mark.parametrize("mode, phase", [("sigint", "load"), ("sigint_wait", "verify")],
                         ids=["in_the_phase", "at_the_boundary"])
def test_sigint_on_one_rank_exits_130_there_and_1_naming_it_elsewhere(tmp_path, mode, phase):
    res, _, _ = _launch(tmp_path, mode, range(4))
    rc, out, err, end2, _ = res[2]
    assert rc == 130, f"rank 2: rc {rc}\n{err}"
    assert rank_line(err, 2).endswith(": interrupted"), err
    for r in (0, 1, 3):
        rc, out, err, end, _ = res[r]
        assert rc == 1, f"rank {r}: rc {rc}\n{err}"
        line = rank_line(err, r)
        # named at once, not after the 5 s timeout as a rank that did not arrive
        assert f"phase {phase}: rank 2: KeyboardInterrupt: interrupted (SIGINT / Ctrl-C)" in line, line
        assert "did not arrive" not in line and "died" not in line, line
        assert end - end2 < TIMEOUT, f"rank {r} exited {end - end2:.1f} s after rank 2"


def test_sigint_before_a_collective_is_named_alone(tmp_path):
    """Ctrl-C on rank 2 inside a phase whose collective the others had entered: every
    rank listed the others' broken collectives too ("Connection closed by peer", gloo's
    timeouts), live ranks named as failing beside the one that left."""
    res, _, _ = _launch(tmp_path, "sigint_collective", range(4))
    assert res[2][0] == 130, res[2][2]
    for r in (0, 1, 3):
        rc, out, err, *_ = res[r]
        assert rc == 1, f"rank {r}: rc {rc}\n{err}"
        line = rank_line(err, r)
        assert line == (f"coordloader: rank {r}: phase verify: rank 2: KeyboardInterrupt: "
                        f"interrupted (SIGINT / Ctrl-C)"), line


def test_the_store_host_failing_while_the_others_wait_in_a_collective_is_named(tmp_path):
    """Rank 0, which hosts the store, failed in a phase whose collective the others had
    entered: it waited the grace for their statuses, left, and took the store with it;
    the others printed "lost contact with the coordination store" and gloo's text, never
    its error, and rank 0 said they "did not report". It now shuts its own process group
    down (their collective breaks at once) and waits for them: every rank names it."""
    # a timeout past the grace (5 s): the collective outlasts it
    res, _, _ = _launch(tmp_path, "host_error_collective", range(4), timeout=20)
    for r, (rc, out, err, end, started) in res.items():
        assert rc == 1, f"rank {r}: rc {rc}\n{err}"
        assert rank_line(err, r) == (f"coordloader: rank {r}: phase verify: rank 0: "
                                     f"RuntimeError: disk vanished"), err
        # not at gloo's timeout of the collective (20 s)
        assert end - started < 20, f"rank {r} took {end - started:.1f} s"


def test_a_collective_failure_of_its_own_is_named_beside_another_ranks_error(tmp_path):
    """Only a broken collective that says a peer left is dropped beside another rank's
    error: rank 0's NCCL out-of-memory was hidden behind rank 1's error on every rank."""
    res, _, _ = _launch(tmp_path, "own_and_nccl", range(4))
    for r, (rc, out, err, *_) in res.items():
        assert rc == 1, f"rank {r}: rc {rc}\n{err}"
        line = rank_line(err, r)
        assert "phase load: rank 0: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1234, " \
               "unhandled cuda error, NCCL version 2.21.5: out of memory; rank 1: SaveError: " \
               "file /ck/model.safetensors: truncated" in line, line


@pytest.mark.parametrize("text", ["Socket closed [127.0.0.1]:4242",
                                  "Application timeout caused pair closure",
                                  "NCCL error: remote process exited or there was a network "
                                  "error, NCCL version 2.21.5"])
def test_gloo_and_nccl_texts_that_say_a_peer_left_are_dropped_beside_the_cause(text):
    """Rank 2's collective broke when rank 1 left (gloo's and NCCL's other words for it):
    it was named beside rank 1's own error. One process plays rank 0 at the boundary, the
    others' statuses posted on the store beforehand."""
    import pickle

    import torch.distributed as dist

    from coordloader.dist import collective as C
    st = dist.HashStore()
    g = C.Group(rank=0, world=3, store=st, timeout_s=5, grace_s=0.5)
    for r, status in {1: ("load", False, "SaveError", "truncated"),
                      2: ("load", False, "RuntimeError", text, True)}.items():
        st.set(f"0/s/{r}", pickle.dumps(status))
        st.add("0/load/n", 1)
        st.add("0/f", 1)
        st.set("0/ev", b"f")

    def fn():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1")
    with pytest.raises(CollectiveError) as ei:
        C.run_phase("load", fn, g)
    assert str(ei.value).endswith("phase load: rank 1: SaveError: truncated"), str(ei.value)


def test_foreign_exception_keeps_type_and_text(tmp_path):
    res, _, _ = _launch(tmp_path, "plain_error", range(4))
    for r, (rc, out, err, *_) in res.items():
        assert rc == 1
        assert "phase plan: rank 1: ZeroDivisionError: division by zero" in rank_line(err, r)


def test_an_exception_whose_str_raises_keeps_its_type_on_every_rank(tmp_path):
    """Rendering the failure raised 'str exploded' on the failing rank, untyped, before it
    posted its status; the others named it only as missing, at the timeout."""
    res, _, _ = _launch(tmp_path, "bad_str", range(2), world=2)
    for r, (rc, out, err, *_) in res.items():
        assert rc == 1, (r, err)
        line = rank_line(err, r)
        assert line.endswith("phase plan: rank 1: BadStr: BadStr (its message could not be "
                             "rendered)"), line


def test_foreign_listener_on_master_port_is_named_by_every_rank(tmp_path):
    # Another process holds MASTER_PORT: it accepts connections (the kernel does, into
    # the backlog) and never answers. Rank 0 cannot bind; rank 1's store handshake used to
    # block past its own timeout (still running at 90 s).
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("0.0.0.0", 0))
        squatter.listen(16)
        port = squatter.getsockname()[1]
        res, _, _ = _launch(tmp_path, "happy", range(2), world=2, port=port)
    for r, (rc, out, err, end, started) in res.items():
        assert rc == 1, f"rank {r}: rc {rc}\n{err}"
        line = rank_line(err, r)
        print(line, f"-- {end - started:.1f} s")
        assert f"another process holds MASTER_PORT={port}" in line, line
        assert end - started < TIMEOUT + 10, f"rank {r} took {end - started:.1f} s"


# ----------------------------------------------------------------- in-process unit tests

def test_single_process_runs_fn_and_keeps_the_typed_error():
    assert run_phase("plan", lambda a, b=0: a + b, None, 2, b=3) == 5
    with pytest.raises(CheckpointError):
        run_phase("metadata", _raise_ckpt, Group(rank=0, world=1))


def _raise_ckpt():
    raise CheckpointError("bad header", file="a.safetensors")


def test_describe_exception_keeps_context_and_drops_own_rank():
    t, m = describe_exception(CheckpointError("bad", file="x", tensor="w", rank=3), rank=3)
    assert (t, m) == ("CheckpointError", "file x, tensor 'w': bad")
    t, m = describe_exception(RuntimeError("[/src/gloo/pair.cc:553] Connection\n closed"))
    assert (t, m) == ("RuntimeError", "Connection closed")
    assert describe_exception(KeyError())[1] == "(no message)"


def test_describe_exception_of_an_exception_whose_str_raises():
    class BadStr(Exception):
        def __str__(self):
            raise RuntimeError("str exploded")

    class BadRuntime(RuntimeError):
        def __str__(self):
            raise ValueError("no")
    assert describe_exception(BadStr()) == ("BadStr",
                                            "BadStr (its message could not be rendered)")
    assert describe_exception(BadRuntime())[0] == "BadRuntime"
    assert not _is_comm_failure(BadRuntime())


def test_rank_ranges():
    from coordloader.text import format_ranges
    assert format_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7,8"
    assert format_ranges([]) == ""
    assert format_ranges([], empty="-") == "-"
    assert format_ranges(range(0, 200, 2), max_chars=12) == "0,2,4,6,8..."
    from coordloader.text import format_ranks
    assert (format_ranks([3]), format_ranks([3, 0, 1, 2])) == ("rank 3", "ranks 0-3")


def test_options_disagreement_by_rank_and_shown():
    """Ranks in order, or by rank where some take no part (verify's basis of the ranks
    that sent one); values compared whole, written by ``show``."""
    from coordloader.dist.collective import options_disagreement
    assert options_disagreement([{"a": 1}, {"a": [2]}, {"a": 1}]) == "a: ranks 0,2 1, rank 1 [2]"
    assert options_disagreement({4: {"m": "x1"}, 2: {"m": "x1"}, 7: {"m": "x2"}}) == \
        "m: ranks 2,4 'x1', rank 7 'x2'"
    assert options_disagreement({0: {"m": "ab1"}, 1: {"m": "ab2"}}, show=lambda v: v[:2]) == \
        "m: rank 0 ab, rank 1 ab"
    assert options_disagreement({0: {"m": 1}, 3: {"m": 1}}) == ""


def test_exit_on_error_prints_one_line_and_exit_codes(capsys, monkeypatch):
    monkeypatch.delenv("COORDLOADER_DEBUG", raising=False)
    with pytest.raises(SystemExit) as ei:
        with exit_on_error(rank=3):
            raise SaveError("disk full", file="/o/r.safetensors")
    assert ei.value.code == 1
    err = capsys.readouterr().err
    assert err == "coordloader: rank 3: SaveError: file /o/r.safetensors: disk full\n"

    @exit_on_error(rank=lambda: 1, usage_errors=(ValueError,))
    def bad_usage():
        raise ValueError("--tp must be positive")
    with pytest.raises(SystemExit) as ei:
        bad_usage()
    assert ei.value.code == 2
    assert capsys.readouterr().err == "coordloader: rank 1: ValueError: --tp must be positive\n"

    with pytest.raises(SystemExit) as ei:
        with exit_on_error(rank=0):
            raise CollectiveError("phase dump: rank 2: SaveError: x")
    assert capsys.readouterr().err == "coordloader: rank 0: phase dump: rank 2: SaveError: x\n"

    monkeypatch.setenv("COORDLOADER_DEBUG", "1")
    with pytest.raises(SystemExit):
        with exit_on_error(rank=0):
            raise KeyError("k")
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("coordloader: rank 0: KeyError: 'k'\n")
    with exit_on_error(rank=0):
        pass   # no exception: nothing printed, no exit
    assert capsys.readouterr().err == ""


def test_collective_error_declares_its_fields_and_pickles_them():
    import pickle

    from coordloader.errors import CollectiveError
    e = CollectiveError("phase load: rank 2: LoadError: short read", rank=0, phase="load",
                        failures={2: ("LoadError", "short read")}, missing=[3],
                        local_error=ValueError("mine"))
    back = pickle.loads(pickle.dumps(e))
    assert (back.phase, back.failures, back.missing, back.rank) == (
        "load", {2: ("LoadError", "short read")}, [3], 0)
    assert back.local_error is None and str(back) == str(e)   # this rank's own error stays here
    assert CollectiveError("x").failures == {} and CollectiveError("x").phase is None


def test_deadline_store_names_a_request_that_never_returns_and_fails_fast_after():
    import threading
    import time
    from datetime import timedelta

    from coordloader.dist.collective import DeadlineStore, StoreStalled

    release = threading.Event()

    class Stopped:      # a store host that keeps its socket open and never answers
        def add(self, key, n):
            release.wait(30)
            return 1

        def wait(self, keys, timeout):
            release.wait(30)

    st = DeadlineStore(Stopped(), op_s=0.2)
    t = time.monotonic()
    with pytest.raises(StoreStalled, match="no reply to add within 0.2 s"):
        st.add("n", 1)
    assert time.monotonic() - t < 5
    t = time.monotonic()
    with pytest.raises(StoreStalled):     # queued behind the stuck request: fail at once
        st.wait(["k"], timedelta(seconds=60))
    assert time.monotonic() - t < 0.1
    release.set()


_RELEASE = r'''
import os, socket, sys, threading, time
from coordloader.dist.collective import init_group
from coordloader.errors import CollectiveError
port = int(os.environ["MASTER_PORT"])
if sys.argv[1] == "bogus":
    try:
        init_group("bogus", timeout_s=20)
        print("FORMED")
    except CollectiveError as e:
        print("REFUSED", str(e)[:200])
else:
    g = init_group(timeout_s=20)
    g.close()
time.sleep(1.0)   # the heartbeat thread ends at once when told to
print("BEATS", sum(t.name == "coordloader-heartbeat" for t in threading.enumerate()))
if os.environ["RANK"] == "0":
    with socket.socket() as s:
        print("LISTENING", s.connect_ex(("127.0.0.1", port)) == 0)
'''


@pytest.mark.parametrize("mode", ["bogus"])
def test_a_failed_or_closed_group_leaves_no_heartbeat_or_store_behind(tmp_path, mode):
    """A failed init_group kept its heartbeat thread beating (the other ranks saw it as
    alive) until a gc, through a reference cycle."""
    script = tmp_path / "release.py"
    script.write_text(_RELEASE)
    port = free_port()
    procs, _, _ = run_ranks(range(2), lambda r: subprocess.Popen(
        [sys.executable, str(script), mode], env=rank_env(port, r, 2), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, cwd=str(tmp_path), start_new_session=True), HARD)
    for r, p in procs.items():
        out, err = (x.decode() for x in p.communicate())
        assert p.returncode == 0, (r, err)
        if mode == "bogus":
            assert "REFUSED" in out, out
        assert "BEATS 0" in out, (r, out)


_RETRY = r'''
import os
import sys
from coordloader.dist.collective import exit_on_error, init_group, run_phase
from coordloader.errors import SaveError

def main():
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    g = init_group(timeout_s=20.0)
    r = g.rank
    run_phase("metadata", lambda: r, g)
    if attempt == "0":
        def dump():
            if r == 1:
                raise SaveError("disk full on attempt 0", file="/out/x")
        run_phase("dump", dump, g)
    # one write a line: print's separate writes of its parts interleaved between the ranks
    sys.stdout.write(f"attempt {attempt} rank {r} loaded {run_phase('load', lambda: r, g)}\n")
    sys.stdout.flush()
    g.close()

with exit_on_error():
    main()
'''


@pytest.mark.slow   # torchrun, two attempts
def test_a_torchrun_retry_forms_its_group_afresh(tmp_path):
    """torchrun keeps its store across restarts: keys of the failed attempt's group
    (its joins, gloo's addresses, its phase status) met the retry in a namespace without
    the attempt ("Connection refused", a stale phase), and --max-restarts never helped."""
    script = tmp_path / "retry.py"
    script.write_text(_RETRY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                        os.environ.get("PYTHONPATH", "")])}
    env.pop("COORDLOADER_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5",
                        str(script)], capture_output=True, text=True, timeout=150,
                       cwd=str(tmp_path), env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "disk full on attempt 0" in out
    for r in range(2):
        assert f"attempt 1 rank {r} loaded {r}" in out, out[-3000:]


_HOLD = r'''
import time
from coordloader.dist.collective import exit_on_error, init_group
with exit_on_error():
    g = init_group(timeout_s=20)
    time.sleep(3)   # long enough for a second process of the same RANK to arrive
    g.close()
    print("DONE")
'''


def test_a_second_process_given_the_same_rank_is_named(tmp_path):
    """Two processes given RANK=1 (a node launched twice): the second was told the store
    stopped answering, or rank 0 exited or did not start, another story each run."""
    script = tmp_path / "hold.py"
    script.write_text(_HOLD)
    port = free_port()
    procs = []
    try:
        for r in (0, 1, 1):
            procs.append(subprocess.Popen([sys.executable, str(script)],
                                          env=rank_env(port, r, 2), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True))
        out = [tuple(x.decode() for x in p.communicate(timeout=HARD)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    rcs = [p.returncode for p in procs]
    assert sorted(rcs) == [0, 0, 1], out
    err = out[rcs.index(1)][1]
    assert "group did not form: RANK=1 is taken by" in err and "was given the same RANK" in err


def test_a_master_addr_that_does_not_resolve_is_named(monkeypatch):
    """An unresolvable MASTER_ADDR (a typo; a pod name without its service) was reported,
    after the timeout, as "rank 0 did not start or is unreachable"."""
    from coordloader.dist.collective import init_group
    for k, v in dict(MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29511", RANK="1",
                     WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(CollectiveError) as e:
        init_group("gloo", timeout_s=1)
    assert ("cannot reach the rendezvous store at no-such-host.invalid:29511 (hosted by rank "
            "0) within 1 s; the name MASTER_ADDR=no-such-host.invalid does not resolve"
            in str(e.value)) and "check MASTER_ADDR on this node" in str(e.value)


def test_ranks_given_other_world_sizes_are_told_so(tmp_path):
    """Nodes given different WORLD_SIZE: rank 0 got torch's raw DistStoreError from the
    rendezvous, the other "rank 2 did not join": neither named the cause."""
    res, _, _ = _launch(tmp_path, "happy", range(2), world=2, timeout=5,
                        env={1: {"WORLD_SIZE": "3"}})
    assert res[0][0] == 1 and res[1][0] == 1
    assert ("group did not form: ranks disagree on WORLD_SIZE (rank 1 says 3, this rank (0) "
            "2); give every node the same WORLD_SIZE") in res[0][2], res[0][2]


_ROUNDS = r'''
import time
from coordloader.dist.collective import init_group, run_phase
for i in range(3):
    g = init_group(timeout_s=20)
    run_phase("p", lambda: g.rank, g)
    if g.rank == 0:
        time.sleep(1.0)   # rank 0 does a little more after the last phase
    g.close()
    print("round", i, "ok", flush=True)
'''


def test_groups_formed_one_after_another_in_a_process_all_form(tmp_path):
    """close() that dropped the store host's server: a rank that formed the next group at
    once joined the old server, which the host then shut: the host waited out the
    timeout for a rank that "did not join", the other saw rank 0 "exited or died"."""
    script = tmp_path / "rounds.py"
    script.write_text(_ROUNDS)
    port = free_port()
    procs, _, _ = run_ranks(range(2), lambda r: subprocess.Popen(
        [sys.executable, str(script)], env=rank_env(port, r, 2), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True), HARD)
    for r, p in procs.items():
        out, err = (x.decode() for x in p.communicate())
        assert p.returncode == 0 and "round 2 ok" in out, (r, err[-2000:])
