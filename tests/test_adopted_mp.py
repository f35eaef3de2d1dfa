"""Heartbeat of groups adopted from the caller (``wrap_group``).

The multi-process tests start four plain processes that call
``torch.distributed.init_process_group("gloo")`` themselves (library use, no
``init_group``), then ``coordloader.load`` / ``coordloader.save`` with ``timeout=60``.
Rank 2 is SIGKILLed inside a phase; ranks 0, 1, 3 must raise the same CollectiveError
naming rank 2 dead long before the minute (before the adopted groups had a heartbeat
they waited out the whole timeout). Each test has a hard bound and kills its process
groups on the way out. The fast tests cover the heartbeat's parts in one process."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from coordloader.dist import collective as coll
from coordloader.dist.collective import Group, free_port

from ranks import rank_env, run_ranks

TIMEOUT = 60.0     # the ranks' timeout= : the adopted group must not wait it out
BOUND = 30.0       # survivors name the dead rank within this of the kill (DEAD_AFTER_S 5 s)
HARD = 150.0       # the harness's own bound (4 torch imports on a loaded 2-core box)

DRIVER = r'''
import os, signal, sys, time
from datetime import timedelta
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import torch.distributed as dist
import coordloader
from coordloader import loader
from coordloader.handoff import save as save_mod

mode, ckpt, mark, out, timeout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
rank = int(os.environ["RANK"])
# the caller's own process group: coordloader adopts it (wrap_group), no init_group
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                        timeout=timedelta(seconds=timeout))


def die(*_):
    with open(mark, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)   # no chance to report


if rank == 2 and mode == "load":
    loader.PHASE_HOOKS.append(lambda name: die() if name == "load" else None)
if rank == 2 and mode == "save":
    save_mod._write_rank = die             # dies inside the save-write phase
if rank == 2 and mode == "save-gather":
    # dies in the exchange of the written files' records, after save-write agreed
    from coordloader.dist import collective as _coll
    _gather = _coll.gather_object
    _coll.gather_object = lambda g, v: die() if isinstance(v, dict) and "files" in v else _gather(g, v)
layout = coordloader.Layout(tp=2, ep=2, dp=2)
try:
    res = coordloader.load_detailed(ckpt, layout, engine="cpu", timeout=timeout)
    if mode.startswith("save"):
        coordloader.save(out, res.tensors, res.plan, group=dist.group.WORLD, config=ckpt,
                         timeout=timeout)
    print("OK", flush=True)
except Exception as e:
    print("ERR", repr(time.time()), type(e).__name__, " ".join(str(e).split()), flush=True)
os._exit(0)   # a broken gloo group's destructors may abort or block
'''


def _run_script(tmp: Path, name: str, text: str, world: int, *args) -> dict:
    """Run ``text`` as ``world`` rank processes over gloo (bounded by HARD);
    -> {rank: (rc, stdout, stderr)}."""
    script = tmp / name
    script.write_text(text)
    port = free_port()
    procs, _, _ = run_ranks(range(world), lambda r: subprocess.Popen(
        [sys.executable, str(script), *args], env=rank_env(port, r, world, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(tmp),
        start_new_session=True), HARD)
    res = {}
    for r, p in procs.items():
        out, err = p.communicate()
        res[r] = (p.returncode, out.decode(), err.decode())
    return res


def _tagged(res, r: int, tag: str) -> str:
    """Rank ``r``'s first stdout line starting with ``tag`` (fails showing its output)."""
    rc, out, err = res[r]
    line = next((ln for ln in out.splitlines() if ln.startswith(tag)), None)
    assert line is not None, f"rank {r}: rc {rc}\n{out}\n{err}"
    return line


def _run(tmp: Path, ckpt: str, mode: str):
    """-> ({rank: (rc, stdout, stderr)}, time rank 2 killed itself)."""
    mark = tmp / "killed_at"
    res = _run_script(tmp, "driver.py", DRIVER, 4, mode, ckpt, str(mark), str(tmp / "out"),
                      str(TIMEOUT))
    assert mark.exists(), f"rank 2 never reached the fault: {res}"
    return res, float(mark.read_text())


def _check_named_dead(res, killed_at: float, phase: str):
    assert res[2][0] == -signal.SIGKILL, res[2]
    lines = {}
    for r in (0, 1, 3):
        _, at, typ, msg = _tagged(res, r, "ERR ").split(" ", 3)
        line = f"{typ} {msg}"
        elapsed = float(at) - killed_at
        print(f"rank {r}: {elapsed:.1f} s after the kill: {typ}: {msg}")
        assert typ == "CollectiveError", line
        assert f"phase {phase}: rank 2 died or hung hard" in msg, msg
        assert elapsed < BOUND, f"rank {r} named it {elapsed:.1f} s after the kill: {msg}"
        lines[r] = msg
    assert len(set(lines.values())) == 1, lines   # the same message on every survivor


@pytest.fixture(scope="module")
def ckpt(tiny_qwen3_moe):
    return tiny_qwen3_moe


@pytest.mark.slow   # rank processes over gloo
def test_load_adopted_group_names_a_sigkilled_rank_long_before_the_timeout(tmp_path, ckpt):
    res, killed_at = _run(tmp_path, ckpt, "load")
    _check_named_dead(res, killed_at, "load")


@pytest.mark.slow   # rank processes over gloo
def test_save_adopted_group_names_a_sigkilled_rank_long_before_the_timeout(tmp_path, ckpt):
    res, killed_at = _run(tmp_path, ckpt, "save")
    _check_named_dead(res, killed_at, "save-write")


@pytest.mark.slow   # rank processes over gloo
def test_save_adopted_group_names_a_rank_dead_in_the_records_exchange(tmp_path, ckpt):
    """The exchanges between save's phases run inside phases too: a rank dying in one is
    named like one dying in a phase (it used to surface as raw gloo text, or a hang)."""
    res, killed_at = _run(tmp_path, ckpt, "save-gather")
    _check_named_dead(res, killed_at, "save-collect")


def _script_lines(tmp_path, name: str, text: str, world: int, tag: str, *args) -> dict:
    """-> {rank: its first stdout line starting with ``tag``} of ``_run_script``."""
    res = _run_script(tmp_path, name, text, world, *args)
    return {r: _tagged(res, r, tag) for r in res}


REFUSED = r'''
import os, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
import coordloader
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                        timeout=timedelta(seconds=60))
try:
    coordloader.load(sys.argv[1], coordloader.Layout(tp=8), engine="cpu", timeout=60)
    print("LOADED", flush=True)
except coordloader.LoadError as e:   # the error is still held while the threads are counted
    end = time.monotonic() + 3
    beating = lambda: sum(t.name == "coordloader-heartbeat" for t in threading.enumerate())
    while beating() and time.monotonic() < end:
        time.sleep(0.05)
    print("REFUSED", beating(), " ".join(str(e).split()), flush=True)
os._exit(0)
'''


@pytest.mark.slow   # rank processes over gloo
def test_a_group_refused_after_adoption_stops_beating(tmp_path, ckpt):
    """load() adopts the default group, then refuses it (2 ranks, a layout of 8): the group
    it adopted is closed on the way out, so its heartbeat does not beat on while the
    caller holds the error (it used to stop only when the group was collected)."""
    for r, line in _script_lines(tmp_path, "refused.py", REFUSED, 2, "REFUSED ", ckpt).items():
        _, beating, msg = line.split(" ", 2)
        assert "the process group has 2 ranks, the layout (tp=8" in msg and "needs 8" in msg, msg
        assert beating == "0", f"rank {r}: {beating} heartbeat thread(s) still running"


MISMATCH = r'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
import coordloader
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
done = os.path.join(os.getcwd(), "rank0-done")
try:
    # rank 1 claims to be rank 0: refused before any phase; rank 0 goes on into them
    coordloader.load(sys.argv[1], coordloader.Layout(tp=2), engine="cpu", timeout=60,
                     rank=0 if rank == 1 else None)
    print("LOADED", flush=True)
except coordloader.CoordloaderError as e:
    print("ERROR", type(e).__name__, " ".join(str(e).split()), flush=True)
if rank == 0:
    open(done, "w").close()
else:   # alive, holding the error, until rank 0 has said what it saw
    end = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < end:
        time.sleep(0.05)
os._exit(0)
'''


@pytest.mark.slow   # rank processes over gloo
def test_a_rank_refusing_the_group_is_named_with_its_error_not_as_dead(tmp_path, ckpt):
    """A rank whose load() refuses the adopted group before any phase (here: a rank= that
    is not its rank) is alive; the other ranks name its error at their first phase, not
    "died or hung hard" once the refusal has stopped its heartbeat."""
    lines = _script_lines(tmp_path, "mismatch.py", MISMATCH, 2, "ERROR ", ckpt)
    assert lines[1] == ("ERROR LoadError rank=0 given, but this process is rank 1 of its "
                        "group"), lines[1]
    assert lines[0].startswith("ERROR CollectiveError phase metadata-read: rank 1: LoadError: "
                               "rank=0 given, but this process is rank 1 of its group"), lines[0]


def _one_rank_refuses(attempts: str, call: str, loaded: str = '""') -> str:
    """A 2-rank script: rank 1 makes ``call`` with each of ``attempts`` as ``arg``, rank 0
    with the last one (which both accept); every attempt prints ``RESULT <attempt>
    <seconds> <outcome>``, the outcome LOADED (+ ``loaded``) or the error's type and text."""
    return f'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
import coordloader
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
attempts = {attempts}
for attempt, arg in enumerate(attempts):
    arg = arg if rank == 1 else attempts[-1]
    t0 = time.monotonic()
    try:
        res = {call}
        outcome = "LOADED" + {loaded}
    except coordloader.CoordloaderError as e:
        outcome = type(e).__name__ + " " + " ".join(str(e).split())
    print("RESULT", attempt, f"{{time.monotonic() - t0:.1f}}", outcome, flush=True)
time.sleep(2)   # rank 0 hosts the store: let the other read its last answers
os._exit(0)
'''


def res_lines(res, r: int) -> list[str]:
    """Rank ``r``'s ``RESULT`` lines."""
    return [ln for ln in res[r][1].splitlines() if ln.startswith("RESULT ")]


def _outcomes(res, n: int) -> dict:
    """Each rank's ``n`` attempt outcomes; every attempt ended well inside the timeout
    (20 s), that is, no rank waited it out for the other."""
    out = {}
    for r in (0, 1):
        lines = [ln.split(" ", 3) for ln in res[r][1].splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == n, res[r]
        for _, attempt, took, _ in lines:
            assert float(took) < 15, (r, attempt, took, res[r])
        out[r] = [ln[3] for ln in lines]
    return out


# rank 1 alone passes a verify mode, then a layout, that load() refuses
BAD_ARG = _one_rank_refuses(
    '[("bogus", coordloader.Layout(tp=2)), ("shapes", {"tp": 2}), '
    '("shapes", coordloader.Layout(tp=2))]',
    'coordloader.load(sys.argv[1], arg[1], engine="cpu", timeout=20, verify=arg[0])')


@pytest.mark.slow   # rank processes over gloo
def test_an_argument_refused_on_one_rank_reaches_the_others_and_keeps_them_in_step(tmp_path, ckpt):
    """load() on rank 1 alone refuses its verify mode, then its layout: rank 0 names the
    error at its first phase (it used to wait out the timeout, the refusal made before
    rank 1 adopted the group), and the next load() pairs with the next load() (the
    adoptions used to fall out of step: rank 0's first load ran with rank 1's second)."""
    got = _outcomes(_run_script(tmp_path, "badarg.py", BAD_ARG, 2, ckpt), 3)
    assert got[1][0].startswith("LoadError rank 1: unknown verify mode 'bogus'"), got
    assert got[0][0].startswith("CollectiveError phase metadata-read: rank 1: LoadError: "
                                "unknown verify mode 'bogus'"), got
    assert got[1][1] == "PlanError layout must be a coordloader.Layout, got dict", got
    assert got[0][1].startswith("CollectiveError phase metadata-read: rank 1: PlanError: "
                                "layout must be a coordloader.Layout"), got
    assert got[0][2] == got[1][2] == "LOADED", got


# rank 1 alone passes a target, a name_map, a device that load_into refuses, then a target
# of the wrong shape for the embedding it loads (a transposed view: not filled by the
# engine in place, whose own check would have caught it); one run serves both tests below
BAD_INTO = _one_rank_refuses(
    '[([1, 2], None, "cpu"), ({}, 5, "cpu"), ({}, None, "bogus"), '
    '({"model.embed_tokens.weight": __import__("torch").zeros(2, 3).t()}, None, "cpu"), '
    '({}, None, "cpu")]',
    'coordloader.load_into(arg[0], sys.argv[1], coordloader.Layout(tp=2), name_map=arg[1], '
    'device=arg[2], strict=False, engine="cpu", timeout=20)',
    '" " + str(len(res.skipped) > 0)')


@pytest.fixture(scope="module")
def into_outcomes(tmp_path_factory, ckpt):
    tmp = tmp_path_factory.mktemp("badinto")
    return _outcomes(_run_script(tmp, "badinto.py", BAD_INTO, 2, ckpt), 5)


@pytest.mark.slow   # rank processes over gloo
def test_a_load_into_argument_refused_on_one_rank_reaches_the_others(into_outcomes):
    """load_into on rank 1 alone refuses its target, its name_map, its device: each
    refusal used to come before load_detailed adopted the group, so rank 0 waited out the
    whole timeout and its next call paired with rank 1's following one. Now rank 0 names
    rank 1's error at its first phase, and the last call loads on both."""
    got = into_outcomes
    want = ["load_into needs a torch.nn.Module or a mapping of tensors, got list",
            "name_map must be a mapping or a callable, got int",
            "device 'bogus' is not usable here: "]
    for attempt, msg in enumerate(want):
        assert got[1][attempt].startswith(f"LoadError rank 1: {msg}"), got
        assert got[0][attempt].startswith(f"CollectiveError phase metadata-read: rank 1: "
                                          f"LoadError: {msg}"), got
    assert got[0][4] == got[1][4] == "LOADED True", got


MANY = r'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from coordloader.dist import collective as coll
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                        timeout=timedelta(seconds=60))
opened = []
second = coll._second_connection
coll._second_connection = lambda *a, **k: opened.append(1) or second(*a, **k)
t0 = time.monotonic()
for i in range(40):   # a serving process reloading, a test running case after case
    with coll.adopted(None, 60) as g:
        for ph in range(3):
            coll.run_phase(f"p{ph}", lambda: i, g)
print("DONE", len(opened), f"{time.monotonic() - t0:.1f}", flush=True)
dist.barrier()   # rank 0 hosts the store: nobody leaves while another still reads it
dist.destroy_process_group()
os._exit(0)
'''


@pytest.mark.slow   # rank processes over gloo
def test_groups_adopted_in_turn_share_one_heartbeat_connection(tmp_path):
    """Every adoption of the default group used to open a heartbeat connection of its
    own; torch's client sometimes takes 5 s to connect (seen on loopback: one connect in
    ~25), and a run of 4-rank loads then failed a phase on a store deadline about every
    other run. One connection per process now serves the groups adopted in turn."""
    for r, line in _script_lines(tmp_path, "many.py", MANY, 4, "DONE ").items():
        assert line.split()[1] == "1", f"rank {r}: {line.split()[1]} heartbeat connections"


# ---- one process: the parts ------------------------------------------------------------

def _tcp_master():
    return dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True,
                         timeout=timedelta(seconds=10), wait_for_workers=False)


def test_second_connection_sees_the_same_keys_on_its_own_socket():
    master = _tcp_master()
    main = dist.PrefixStore("b", dist.PrefixStore("a", master))
    conn = coll._second_connection(main, 10)
    assert conn is not None
    conn.set("k", b"v")
    assert main.get("k") == b"v" and master.get("a/b/k") == b"v"   # same key space
    # its own connection: answers while the main client sits in a server-side wait
    waiter = threading.Thread(target=lambda: _swallow(
        lambda: main.wait(["never"], timedelta(seconds=1.5))), daemon=True)
    waiter.start()
    time.sleep(0.3)
    t = time.monotonic()
    conn.add("hb/0", 1)
    assert time.monotonic() - t < 1.0
    waiter.join()
    # without clone(): a TCPStore client on the store's host/port
    bare = coll._second_connection(master, 10, clone=False)
    assert bare is not None and bare.get("a/b/k") == b"v"


def test_the_heartbeat_connection_is_reused_while_it_reaches_the_store():
    master = _tcp_master()
    base = dist.PrefixStore("default_pg", master)
    coll._BEAT_CONNECTION.clear()
    try:
        first = coll._beat_connection(base, 10)
        keys = master.num_keys()
        assert first is not None and coll._beat_connection(base, 10) is first
        assert master.num_keys() == keys   # the probe's key is gone again
        # another store (a new rendezvous): its own connection, the old one let go
        other = dist.PrefixStore("default_pg", _tcp_master())
        conn = coll._beat_connection(other, 10)
        assert conn is not first and coll._BEAT_CONNECTION == [(id(other), conn)]
        # a kept connection that answers but reaches another store (an id reused by a
        # new default store, a new server on the old port) is not reused
        coll._BEAT_CONNECTION[:] = [(id(base), conn)]
        again = coll._beat_connection(base, 10)
        assert again is not conn and coll._BEAT_CONNECTION == [(id(base), again)]

        class Broken:   # a connection whose store went away
            def check(self, keys):
                raise RuntimeError("Connection reset by peer")
        coll._BEAT_CONNECTION[:] = [(id(base), Broken())]
        fresh = coll._beat_connection(base, 10)
        assert not isinstance(fresh, Broken) and coll._BEAT_CONNECTION == [(id(base), fresh)]
    finally:
        coll._BEAT_CONNECTION.clear()


def test_the_kept_connection_does_not_keep_the_store_server_alive():
    # rank 0 hosts the rendezvous server in its default store: once the caller drops it
    # (destroy_process_group), the port must close, so a new rendezvous can use it
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True,
                           timeout=timedelta(seconds=10), wait_for_workers=False)
    base = dist.PrefixStore("default_pg", master)
    coll._BEAT_CONNECTION.clear()
    try:
        assert coll._beat_connection(base, 10) is not None
        del master, base
        import gc
        gc.collect()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        coll._BEAT_CONNECTION.clear()


def _swallow(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass


def test_no_second_connection_without_a_tcpstore(tmp_path):
    assert coll._second_connection(dist.HashStore(), 10) is None
    fs = dist.FileStore(str(tmp_path / "fs"), 1)
    assert coll._second_connection(dist.PrefixStore("p", fs), 10) is None


def test_heartbeat_beats_and_close_stops_it(monkeypatch):
    monkeypatch.setattr(coll, "HEARTBEAT_S", 0.15)   # the same beats, scaled down
    store = dist.HashStore()
    before = {t for t in threading.enumerate() if t.name == "coordloader-heartbeat"}
    g = Group(rank=1, world=2, store=store, timeout_s=10)
    coll._start_heartbeat(g, lambda: dist.PrefixStore("ns", store))
    assert g._hb_stop is not None
    time.sleep(4 * coll.HEARTBEAT_S)
    assert store.add("ns/hb/1", 0) >= 2
    g.close()
    time.sleep(coll.HEARTBEAT_S)
    n = store.add("ns/hb/1", 0)
    time.sleep(3 * coll.HEARTBEAT_S)
    assert store.add("ns/hb/1", 0) == n
    assert {t for t in threading.enumerate() if t.name == "coordloader-heartbeat"} <= before


def test_no_heartbeat_when_the_connection_cannot_be_made():
    g = Group(rank=0, world=2, store=dist.HashStore(), timeout_s=10)
    coll._start_heartbeat(g, lambda: None)
    assert g._hb_stop is None

    def refuse():
        raise RuntimeError("connection refused")
    coll._start_heartbeat(g, refuse)
    assert g._hb_stop is None


def test_a_rank_that_never_beat_is_late_not_dead():
    # adopted groups have no join: a rank not yet in load() has counter 0 and must be
    # waited for (named at the timeout), not called dead
    store = dist.HashStore()
    g = Group(rank=0, world=3, store=store, timeout_s=10)
    g._hb_stop = threading.Event()
    store.add("hb/1", 7)   # beat, then stopped: dead
    assert coll._dead_ranks(g, [1, 2]) == [1]


def test_boundary_wait_does_not_cut_short_for_a_rank_that_never_beat(monkeypatch):
    # rank 1 never adopted the group (counter 0): rank 0 waits its whole timeout, it does
    # not give up after DEAD_AFTER_S as it would for a rank whose beat stopped
    monkeypatch.setattr(coll, "DEAD_AFTER_S", 0.5)   # the same wait, scaled down
    store = _tcp_master()   # (HashStore.wait can hang past a fractional timeout)
    g = Group(rank=0, world=2, store=store, timeout_s=2 * coll.DEAD_AFTER_S + 1)
    g._hb_stop = threading.Event()
    t = time.monotonic()
    assert coll._wait_or_death(g, "0/ev", 0, "load", None) is True
    assert time.monotonic() - t >= g.timeout_s - 0.1


@pytest.mark.slow   # rank processes over gloo
def test_a_target_refused_on_one_rank_stops_every_rank_before_the_load(into_outcomes):
    """A target that does not fit this rank's slice was found after the load, on that
    rank alone: rank 0 returned as if all had loaded, and met rank 1's failure (or its
    absence) at whatever collective came next. Now the targets are matched to the plan in
    a phase before the load: both ranks stop there with one message naming rank 1's
    error, and the next call pairs."""
    got = into_outcomes
    assert got[0][3] == got[1][3] == (
        "CollectiveError phase targets: rank 1: LoadError: tensor 'model.embed_tokens.weight': "
        "target 'model.embed_tokens.weight' is torch.float32 [3, 2], this rank's slice is "
        "torch.bfloat16 [224, 128]"), got
    assert got[0][4] == got[1][4] == "LOADED True", got


# ---- review of the phase agreement: late ranks, bad timeouts, subgroups, the store host

# rank 1 alone passes a timeout load() refuses, then both load; then rank 1 alone a
# max_shard_bytes save() refuses, then both save
BAD_TIMEOUT = _one_rank_refuses(
    '[("8s", 1), (float("nan"), 1), (0, 1), (1e10, 1), (20, 0), (20, 1)]',
    '(coordloader.load(sys.argv[1], coordloader.Layout(tp=2), engine="cpu", timeout=arg[0]) '
    'if attempt < 4 else coordloader.save(sys.argv[2] + "/s", coordloader.load('
    'sys.argv[1], coordloader.Layout(tp=2), engine="cpu", timeout=20), '
    'coordloader.make_plan(sys.argv[1], coordloader.Layout(tp=2)), group=dist.group.WORLD, '
    'config=sys.argv[1], max_shard_bytes=arg[1], timeout=20, overwrite=True))')


@pytest.mark.slow   # rank processes over gloo
def test_a_timeout_or_save_argument_refused_on_one_rank_keeps_the_ranks_in_step(tmp_path, ckpt):
    """A timeout of '8s' (a bare ValueError), nan, 0 or 1e10 on rank 1 alone, and a
    save's max_shard_bytes=0: refused before the group was adopted, so rank 0 waited out
    its timeout and every later call paired one rank's call with the other's next."""
    res = _run_script(tmp_path, "badtimeout.py", BAD_TIMEOUT, 2, ckpt, str(tmp_path))
    got = _outcomes(res, 6)
    for i in range(4):
        assert got[1][i].startswith("ConfigError rank 1: timeout must be a"), got
        # a refusal outside a phase waited 5 s at close() for ranks that never close
        took = [float(ln.split(" ", 3)[2]) for ln in res_lines(res, 1)][i]
        assert took < 4, (i, took)
        assert got[0][i].startswith("CollectiveError phase metadata-read: rank 1: "
                                    "ConfigError: timeout must be a"), got
    assert got[1][4] == "SaveError rank 1: max_shard_bytes must be a positive integer, got 0", got
    assert got[0][4].startswith("CollectiveError phase ") and got[0][4].endswith(
        ": rank 1: SaveError: max_shard_bytes must be a positive integer, got 0"), got
    assert got[0][5] == got[1][5] == "LOADED", got


# per attempt, what each rank calls (P: load of a path, M: load of a CheckpointMeta,
# L: load, I: load_into): two ranks differing, the other way round, then both alike
MIXED = r'''
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import coordloader
from coordloader.checkpoint.dtypes import torch_dtype
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
layout = coordloader.Layout(tp=2)


def call(kind):
    if kind == "I":
        target = {s.name: torch.zeros(s.local_shape, dtype=torch_dtype(s.dtype))
                  for s in coordloader.make_plan(sys.argv[1], layout).rank(rank).tensors}
        coordloader.load_into(target, sys.argv[1], layout, engine="cpu", timeout=20)
    else:
        src = coordloader.read_checkpoint(sys.argv[1]) if kind == "M" else sys.argv[1]
        coordloader.load(src, layout, engine="cpu", timeout=20)


for attempt, kinds in enumerate(sys.argv[2].split(",")):
    t0 = time.monotonic()
    try:
        call(kinds[rank])
        outcome = "LOADED"
    except coordloader.CoordloaderError as e:
        outcome = type(e).__name__ + " " + " ".join(str(e).split())
    print("RESULT", attempt, f"{time.monotonic() - t0:.1f}", outcome, flush=True)
time.sleep(2)   # rank 0 hosts the store: let the other read its last answers
os._exit(0)
'''


@pytest.mark.slow   # rank processes over gloo
@pytest.mark.parametrize("kinds, refusals", [
    ("PM,MP,MM,PP", [
        f"CollectiveError phase metadata-assemble: ranks 0,1: ConfigError: ranks disagree on "
        f"the checkpoint they were handed: {p} passed a path, {m} a CheckpointMeta; pass the "
        f"same kind on every rank" for p, m in (("rank 0", "rank 1"), ("rank 1", "rank 0"))]),
    ("LI,IL,LL,II", [
        f"CollectiveError phase plan-agree: ranks 0,1: ConfigError: ranks disagree on their "
        f"options (call: rank 0 '{a}', rank 1 '{b}'); give every rank the same options"
        for a, b in (("load", "load_into"), ("load_into", "load"))]),
], ids=["path_and_metadata", "load_and_load_into"])
def test_ranks_calling_differently_are_named_at_once(tmp_path, ckpt, kinds, refusals):
    """A path and a CheckpointMeta: a path ran metadata-read and metadata-assemble (a
    gather), a CheckpointMeta metadata-read alone, so the rank handed metadata said 'rank 0
    did not arrive' after its timeout while rank 0 sat in the gather until the process
    group's timeout; both now run the same phases and every rank names the mix in
    metadata-assemble. load and load_into: load_into makes a targets phase that load does
    not, and the ranks named each other's phase only after the whole timeout; the entry
    point is now among the options agreed at plan-agree, before any read. Either way the
    next calls pair up."""
    got = _outcomes(_run_script(tmp_path, "mixed.py", MIXED, 2, ckpt, kinds), 4)
    for attempt, refusal in enumerate(refusals):
        assert got[0][attempt] == got[1][attempt] == refusal, got
    assert got[0][2:] == got[1][2:] == ["LOADED", "LOADED"], got


LATE = r'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
import coordloader
from coordloader import loader
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
if rank == 1:   # arrives 4 s late at the end of the load phase, with timeout=2
    loader.PHASE_HOOKS.append(lambda n: time.sleep(4) if n == "load" else None)
t0 = time.monotonic()
try:
    coordloader.load(sys.argv[1], coordloader.Layout(tp=2), engine="cpu", verify="none",
                     timeout=2)
    outcome = "LOADED"
except coordloader.CoordloaderError as e:
    outcome = type(e).__name__ + " " + " ".join(str(e).split())
print("RESULT", f"{time.monotonic() - t0:.1f}", outcome, flush=True)
# alive (rank 0 hosting the store) until both ranks are through their load, or 8 s
open(f"late.done-{rank}", "w").close()
end = time.monotonic() + 8
while time.monotonic() < end and not all(os.path.exists(f"late.done-{q}") for q in (0, 1)):
    time.sleep(0.05)
os._exit(0)
'''


@pytest.mark.slow   # rank processes over gloo
def test_a_rank_arriving_after_the_others_gave_up_does_not_pass(tmp_path, ckpt):
    """Rank 0 gave up waiting at the end of the load phase and raised; rank 1, arriving
    after, completed the arrival count and returned as loaded."""
    res = _run_script(tmp_path, "late.py", LATE, 2, ckpt)
    got = {r: _tagged(res, r, "RESULT").split(" ", 2)[2] for r in (0, 1)}
    assert got[0] == ("CollectiveError phase load: rank 1 did not arrive within 2 s "
                      "(arrived: 0)"), got
    assert got[1] == ("CollectiveError phase load: arrived after rank 0 stopped waiting for "
                      "it (timeout 2 s): this rank is late, the others have stopped"), got


def _phase_script(world: int, timeout: float, phase: str, delay: str, linger: str) -> str:
    """A ``world``-rank script: each rank adopts the default group (``timeout``), sleeps
    ``delay`` (an expression of ``rank``), runs one phase named ``phase`` (an expression)
    and prints ``RESULT <seconds> <outcome>``; it stays alive (rank 0 hosting the store)
    for ``linger`` seconds, or until every rank has closed its group, if sooner: no rank
    needs another after that."""
    return f'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from coordloader.dist import collective as coll
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size={world}, timeout=timedelta(seconds=60))
g = coll.wrap_group(None, timeout_s={timeout})
time.sleep({delay})
t0 = time.monotonic()
try:
    coll.run_phase({phase}, lambda: None, g)
    outcome = "PASSED"
except coll.CollectiveError as e:
    outcome = " ".join(str(e).split())
print("RESULT", f"{{time.monotonic() - t0:.1f}}", outcome, flush=True)
g.close()
done = os.path.basename(__file__) + ".closed-{{}}"
open(done.format(rank), "w").close()
end = time.monotonic() + ({linger})
while time.monotonic() < end and not all(os.path.exists(done.format(q)) for q in range({world})):
    time.sleep(0.05)
os._exit(0)
'''


# rank 2 late; rank 0 hosts the store, alive for it
LATE3 = _phase_script(3, 4, '"load"', "{0: 0.0, 1: 0.5, 2: 12.0}[rank]",
                      "15 if rank == 0 else 3")


@pytest.mark.slow   # rank processes over gloo
def test_ranks_waiting_when_another_gives_up_wait_only_their_own_timeout(tmp_path):
    """Three ranks, rank 2 late: rank 1, still waiting when rank 0 gave up, was woken as if
    by a failure, waited the grace on top of the timeout and named rank 0's giving up as
    a failure."""
    res = _run_script(tmp_path, "late3.py", LATE3, 3)
    got = {r: _tagged(res, r, "RESULT").split(" ", 2) for r in range(3)}
    for r in (0, 1):
        assert got[r][2] == "phase load: rank 2 did not arrive within 4 s (arrived: 0,1)", got
        assert float(got[r][1]) < 4 + 3.5, got   # was the timeout + the 5 s grace and more
    assert got[2][2] == ("phase load: arrived after ranks 0,1 stopped waiting for it (timeout "
                         "4 s): this rank is late, the others have stopped"), got


MISMATCH2 = _phase_script(2, 3, '"read" if rank == 0 else "write"', "0", "3")


@pytest.mark.slow   # rank processes over gloo
def test_ranks_in_different_phases_name_each_other_when_they_stop_waiting(tmp_path):
    """Two ranks at one step in different phases: each names the other's phase (the
    claim of a rank giving up replaced its status, and the message named nobody)."""
    res = _run_script(tmp_path, "mismatch2.py", MISMATCH2, 2)
    got = {r: _tagged(res, r, "RESULT").split(" ", 2)[2] for r in (0, 1)}
    assert got[0] == ("phase read: rank 1: PhaseMismatch: is in phase 'write' at step 0, not "
                      "'read'"), got
    assert got[1] == ("phase write: rank 0: PhaseMismatch: is in phase 'read' at step 0, not "
                      "'write'"), got


SUBGROUPS = r'''
import os, shutil, sys, time
from datetime import timedelta
import torch.distributed as dist
import coordloader
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=60))
a, b = dist.new_group([0, 1]), dist.new_group([2, 3])
ckpt = sys.argv[1]
if rank == 3:   # a copy without one of its files: rank 3 alone fails
    ckpt = sys.argv[2]
try:
    coordloader.load(ckpt, coordloader.Layout(tp=2), engine="cpu", group=a if rank < 2 else b,
                     timeout=20)
    outcome = "LOADED"
except coordloader.CoordloaderError as e:
    outcome = type(e).__name__ + " " + " ".join(str(e).split())
print("RESULT", outcome, flush=True)
time.sleep(3)
os._exit(0)
'''


@pytest.mark.slow   # rank processes over gloo
def test_two_groups_adopted_over_one_store_keep_their_own_boards(tmp_path, ckpt):
    """new_group([0, 1]) and new_group([2, 3]) loading side by side shared one status
    board: group A failed for group B's rank 1 (rank 3 globally), or named a live rank
    dead."""
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    victim = sorted(p for p in broken.iterdir() if p.suffix == ".safetensors")[-1]
    victim.unlink()
    res = _run_script(tmp_path, "subgroups.py", SUBGROUPS, 4, ckpt, str(broken))
    got = {r: _tagged(res, r, "RESULT").split(" ", 1)[1] for r in range(4)}
    assert got[0] == got[1] == "LOADED", got
    assert got[2].startswith("CollectiveError phase metadata-read: rank 1: CheckpointError"), got
    assert got[3].startswith("CheckpointError") or got[3].startswith(
        "CollectiveError phase metadata-read: rank 1: CheckpointError"), got
    assert victim.name in got[2], got


HOST_EXITS = r'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
import coordloader
from coordloader.dist import collective as coll
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
if rank == 1:   # reads each step's failure count a little late, as a loaded host would
    add = coll.DeadlineStore.add
    def slow_add(self, key, n):
        if key.endswith("/f") and n == 0:
            time.sleep(0.5)
        return add(self, key, n)
    coll.DeadlineStore.add = slow_add
try:
    coordloader.load(sys.argv[1], coordloader.Layout(tp=2), engine="cpu", timeout=10)
    outcome = "LOADED"
except coordloader.CoordloaderError as e:
    outcome = type(e).__name__ + " " + " ".join(str(e).split())
print("RESULT", outcome, flush=True)
if rank == 1:
    time.sleep(2)
os._exit(0)   # rank 0, the store's host, exits as soon as its load returns
'''


@pytest.mark.slow   # rank processes over gloo
def test_the_store_host_returning_first_does_not_fail_the_others(tmp_path, ckpt):
    """Rank 0 (hosting the default store) returned and exited while rank 1 still read the
    last step's failure count: rank 1's load failed with 'lost contact with the
    coordination store'."""
    res = _run_script(tmp_path, "hostexits.py", HOST_EXITS, 2, ckpt)
    got = {r: _tagged(res, r, "RESULT").split(" ", 1)[1] for r in (0, 1)}
    assert got == {0: "LOADED", 1: "LOADED"}, got


# rank 1 arrives 2 s after rank 0, rank 2 after both gave up
STAGGERED = _phase_script(3, 4, '"load"', "{0: 0.0, 1: 2.0, 2: 5.0}[rank]",
                          "15 if rank == 0 else 5")
# rank 1 arrives in another phase after rank 0 gave up
LATE_ELSEWHERE = _phase_script(2, 3, '"read" if rank == 0 else "write"', "4.0 * rank",
                               "8 if rank == 0 else 2")


@pytest.mark.slow   # rank processes over gloo
def test_no_rank_passes_a_step_another_gave_up_at(tmp_path):
    """Rank 1, giving up after rank 2 had arrived late, found every arrival counted and
    passed, while ranks 0 and 2 raised; a late rank in another phase waited out a whole
    timeout of its own."""
    res = _run_script(tmp_path, "staggered.py", STAGGERED, 3)
    got = {r: _tagged(res, r, "RESULT").split(" ", 2) for r in range(3)}
    assert got[0][2] == "phase load: rank 2 did not arrive within 4 s (arrived: 0,1)", got
    assert got[1][2] == ("phase load: rank 0 stopped waiting (timeout 4 s) before every rank "
                         "had arrived"), got
    assert got[2][2].startswith("phase load: arrived after rank 0 stopped waiting"), got
    res = _run_script(tmp_path, "elsewhere.py", LATE_ELSEWHERE, 2)
    got = {r: _tagged(res, r, "RESULT").split(" ", 2) for r in (0, 1)}
    assert got[1][2].startswith("phase write: arrived after rank 0 stopped waiting"), got
    assert float(got[1][1]) < 1.5, got
