"""Error agreement and timeouts for every distributed phase of coordloader.

A multi-rank load is a sequence of *phases* (metadata, plan, load, verify, dump/save).
Each phase runs on every rank; at its end the ranks agree on whether it succeeded.
If any rank failed, *every* rank raises the same :class:`CollectiveError` naming the
failing ranks and their causes, instead of one rank dying and the others sitting in a
collective until a watchdog fires. If a rank never arrives (crashed, SIGKILLed, never
started), every surviving rank raises within the timeout, naming the missing ranks.

API (all a phase needs)::

    from coordloader.dist.collective import init_group, run_phase, exit_on_error

    def main():
        with exit_on_error():                      # one line on stderr, exit code 1
            group = init_group(timeout_s=60)       # env:// rendezvous, gloo/nccl
            meta = run_phase("metadata", read_share, group, ckpt)
            plan = run_phase("plan", make_plan, group, meta, layout)
            out = run_phase("load", engine.load, group, plan)
            group.close()

- ``init_group(backend=None, timeout_s=None) -> Group`` initialises torch.distributed from
  MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE (torchrun or plain processes). Backend:
  ``nccl`` when CUDA is available, else ``gloo``. ``timeout_s`` (default 300) is both the
  process-group timeout (bounds every collective made inside a phase) and the bound on
  how long a rank waits for the others at a phase boundary. Without RANK/WORLD_SIZE in the
  environment it returns a single-process group (``pg=None``, world 1).
- ``wrap_group(pg=None, timeout_s=None) -> Group`` adopts a process group the caller has
  already initialised (library use: ``coordloader.load(..., group=pg)``). Its ranks beat
  like those of ``init_group`` when the default store rests on a TCPStore (else a dead
  rank is named at the timeout). ``with adopted(group, timeout_s) as g:`` adopts for one
  call and closes on the way out (a Group passed in is left to its owner).
- ``run_phase(name, fn, group, *args, **kw)`` runs ``fn(*args, **kw)`` on this rank and
  returns its value once all ranks succeeded. Any exception is caught and turned into
  ``"<ErrorType>: <text>"`` (CoordloaderError context such as file/tensor is kept) and
  shared; if any rank failed, every rank raises ``CollectiveError("phase dump: rank 2:
  SaveError: ...")`` listing every failing rank (identical messages are merged: ``ranks
  1,3``). On the failing rank the original exception is the ``__cause__``. With
  ``group=None`` or world 1, ``fn`` just runs and its own exception propagates unchanged.
  Every rank must call the same phases in the same order (the collective
  discipline); a rank that is in a different phase is reported by name.
- ``leave_failed(group, exc)``: an exception raised outside any phase, posted for the
  others to name at their next boundary (the store's host waits, bounded, until they
  have read it); call it before ``close()``.
- ``Group.close()`` ends the group (the rank hosting the store waits, bounded, until the
  others are done with it) and destroys the process group it created.
- ``exit_on_error()`` (context manager or decorator) for entry points: any exception
  becomes one line ``coordloader: rank R: <message>`` on stderr (full traceback only when
  COORDLOADER_DEBUG=1) and exit code 1 (2 for the ``usage_errors`` given, 130 on Ctrl-C).

How the agreement works, and why this way
-----------------------------------------
The status exchange does **not** go through the process group. It uses the rendezvous
TCPStore as a status board: at phase ``seq`` each rank writes ``<seq>/s/<rank>`` = its
(phase, ok, type, message), bumps a failure counter if it failed, bumps an arrival
counter, and sets an event key when it fails or is the last to arrive. Every rank then
blocks in ``store.wait([event], timeout)`` - a server-side wait with a deadline.

- A timeout on the store is a clean exception after which the store is still usable, so
  a rank can then ask which status keys exist and name the ranks that did not arrive.
  Every rank can do that, not only rank 0. By contrast ``dist.monitored_barrier`` reports
  missing ranks on rank 0 only (the others see rank 0's abort as an unrelated connection
  error), and a gloo collective that timed out leaves the process group unusable, with an
  error naming peer addresses, not ranks. NCCL collectives with a dead peer hang until the
  watchdog kills the process.
- It costs O(1) store requests per rank per phase on success (set, add, wait, add) and
  needs no device memory, so it behaves the same under gloo and nccl.
- A SIGKILLed rank simply never writes its key: the others time out at the boundary and
  name it. If the rank that dies hosts the store (rank 0 with plain processes; under
  torchrun the agent hosts it and survives), every other rank's pending store call fails
  at once with a connection error, reported as "lost contact with rank 0".
- Once any rank has reported a failure the others stop waiting for stragglers after
  ``grace_s`` (default min(5, timeout)): the job has failed anyway; a short grace collects
  more causes. So a rank stuck in a collective with a dead peer (gloo timeout ``T``) then
  exits within ``T + grace_s``.
- The store host must outlive the others' last reads: on failure it waits (bounded) for
  an acknowledgement from every rank that reported, and ``close()`` does the same on
  success.

Timeouts: ``timeout_s`` bounds each wait, not the phase's own work. A rank waits at a
boundary at most ``timeout_s`` for the others, so it must exceed the expected skew between
ranks finishing a phase (e.g. uneven load sizes).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pickle
import re
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping

from coordloader.text import MAX_MESSAGE_CHARS, MAX_NAME_CHARS, clip, format_ranges, format_ranks
from coordloader.errors import CollectiveError, ConfigError, CoordloaderError

DEFAULT_TIMEOUT_S = 300.0
# the largest timeout taken: the store turns a deadline past what time_t holds into a C++
# abort (--timeout 1e10), and no collective needs a week
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# the smallest: the store rounds a deadline to whole milliseconds, and one of 0 ms aborts
# in C++ (a backtrace, exit 134) from the thread a stopped store is left to
MIN_TIMEOUT_S = 0.1
DEFAULT_GRACE_S = 5.0
_NAMESPACES: dict[str, int] = {}   # per-store-identity counter; same order on every rank


# --------------------------------------------------------------------------- messages

def describe_exception(exc: BaseException, rank: int | None = None) -> tuple[str, str]:
    """(type name, one-line message) of an exception, never losing its text.

    A CoordloaderError's own "rank R" is dropped when it equals the reporting rank: the
    phase message already says which rank it was."""
    if isinstance(exc, CoordloaderError):
        parts = []
        if exc.rank is not None and exc.rank != rank:
            parts.append(f"rank {exc.rank}")
        if exc.file is not None:
            parts.append(f"file {clip(str(exc.file), MAX_NAME_CHARS)}")
        if exc.tensor is not None:
            parts.append(f"tensor {clip(repr(exc.tensor), MAX_NAME_CHARS)}")
        text = (", ".join(parts) + ": " + exc.message) if parts else exc.message
    elif isinstance(exc, KeyboardInterrupt):
        text = "interrupted (SIGINT / Ctrl-C)"
    else:
        text = _text(exc)
    # capped: the message travels through the status board and must stay small at any scale
    return type(exc).__name__, clip(_one_line(text) or "(no message)", MAX_MESSAGE_CHARS)


def _text(exc: BaseException) -> str:
    """``str(exc)`` (its args when that is empty), or, when rendering it raises, a note
    saying so: the failure it reports must still reach every rank under its own type."""
    try:
        text = str(exc)
        return text if text or not exc.args else repr(exc.args)
    except Exception:  # noqa: BLE001 - any error of a foreign __str__ / __repr__
        return f"{type(exc).__name__} (its message could not be rendered)"


def _one_line(text: str) -> str:
    # C++ errors from torch carry multi-line backtraces; keep the first meaningful part.
    text = text.split("\nException raised from")[0]
    text = re.sub(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return re.sub(r"\s+", " ", text).strip()




def _phase_error(phase: str, failures: dict[int, tuple[str, str]], notes: list[str],
                 local: BaseException | None = None, missing=()) -> CollectiveError:
    """One CollectiveError naming every failing rank; ``notes`` (dead / late ranks, lost
    store) come first because they are usually the root cause of the others' errors."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r, (t, m) in sorted(failures.items()):
        groups.setdefault((t, m), []).append(r)
    parts = list(notes) + [f"{format_ranks(rs)}: {t}: {m}" for (t, m), rs in groups.items()]
    return CollectiveError(f"phase {phase}: " + "; ".join(parts), phase=phase, failures=failures,
                           missing=missing, local_error=local)


# ------------------------------------------------------------------ store deadlines

# A healthy store answers a set/add/get in milliseconds, even with thousands of clients
# queued on it; a store host that is SIGSTOPped or wedged still holds its TCP connections
# open, so torch's client blocks in recv forever (its own timeout covers connecting and
# server-side waits, not a reply that never comes). Every store call therefore runs on a
# daemon thread (the binding releases the GIL) that the caller abandons after a deadline:
# STORE_OP_S for a plain request (capped by the group's timeout), a wait's own timeout
# plus WAIT_MARGIN_S for a wait (the client gives up on its own socket poll at the
# timeout, so a live store answers a wait by then). With timeout T a store host stopped at
# any moment is named within T + STORE_OP_S (a rank in a gloo collective with it first
# waits out T) or T + WAIT_MARGIN_S, inside the promised T + 10 s.
STORE_OP_S = 5.0
WAIT_MARGIN_S = 3.0


class StoreStalled(Exception):
    """A store request got no reply within its deadline: the host is stopped or hung."""

    def __init__(self, op: str, seconds: float):
        super().__init__(f"no reply to {op} within {seconds:g} s")
        self.op, self.seconds = op, seconds


def call_with_deadline(what: str, fn: Callable, deadline_s: float):
    """``fn()`` on a daemon thread; StoreStalled(what) when it has not returned within
    ``deadline_s``. Its exception, if any, is re-raised here. The abandoned thread stays
    blocked in C++ until the process exits (it holds no Python state anyone waits for)."""
    import threading
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, name=f"coordloader-store-{what}", daemon=True)
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        raise StoreStalled(what, deadline_s)
    if "error" in box:
        raise box["error"]
    return box.get("value")


class DeadlineStore:
    """A torch Store whose every request is bounded (``call_with_deadline``). After one
    request stalls, later ones fail at once: torch's client serialises requests on its
    connection, so they would queue behind the stuck one anyway."""

    def __init__(self, store, op_s: float):
        self.inner = store
        self.op_s = op_s
        self.stalled: StoreStalled | None = None

    def _call(self, op: str, fn: Callable, deadline_s: float | None = None):
        if self.stalled is not None:
            raise self.stalled
        try:
            return call_with_deadline(op, fn, self.op_s if deadline_s is None else deadline_s)
        except StoreStalled as exc:
            self.stalled = exc
            raise

    def set(self, key: str, value) -> None:
        self._call("set", lambda: self.inner.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call("get", lambda: self.inner.get(key))

    def add(self, key: str, n: int) -> int:
        return self._call("add", lambda: self.inner.add(key, n))

    def check(self, keys: list) -> bool:
        return self._call("check", lambda: self.inner.check(keys))

    def multi_get(self, keys: list) -> list:
        return self._call("multi_get", lambda: self.inner.multi_get(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", lambda: self.inner.delete_key(key))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", lambda: self.inner.compare_set(key, expected, desired))

    def wait(self, keys: list, timeout: timedelta) -> None:
        self._call("wait", lambda: self.inner.wait(keys, timeout),
                   timeout.total_seconds() + WAIT_MARGIN_S)


def timeout_problem(timeout_s) -> str | None:
    """Why ``timeout_s`` (seconds; None: the default) is no timeout, or None. Zero,
    negative, NaN and past MAX_TIMEOUT_S reached the store as a wrong rank named, a
    wait of 0 s or a C++ abort."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        return f"timeout must be a number of seconds, got {type(timeout_s).__name__}"
    if not MIN_TIMEOUT_S <= timeout_s <= MAX_TIMEOUT_S:
        return (f"timeout must be a finite number of seconds from {MIN_TIMEOUT_S:g} to "
                f"{MAX_TIMEOUT_S:g}, got {timeout_s!r}")
    return None


def _store_op_s(timeout_s: float) -> float:
    return min(STORE_OP_S, timeout_s)


@dataclass(eq=False)
class Group:
    """This rank's view of the group: rank, world size, process group, status board.

    ``pg`` is the torch ProcessGroup (None in a single process). ``store`` is the status
    board (a PrefixStore over the rendezvous TCPStore); None means the fallback exchange
    over the process group (see ``wrap_group``)."""
    rank: int
    world: int
    pg: Any = None
    store: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    grace_s: float = DEFAULT_GRACE_S
    backend: str | None = None
    store_host: bool = False        # this process runs the store server (rank 0, no agent)
    # an adopted group cannot tell which process hosts the store: on failure every rank
    # lingers for the others' acks, so the host (whichever it is) outlives their reads
    store_host_unknown: bool = False
    store_desc: str = ""            # for messages: "127.0.0.1:29500 (hosted by rank 0)"
    owns_pg: bool = False
    _hb_stop: Any = field(default=None, repr=False)
    # the heartbeat's own store connection, so a rank leaving can post its failure while
    # the main one still carries the wait it left
    _hb_store: Any = field(default=None, repr=False)
    # the rendezvous TCPStore under ``store``: held so rank 0's server lives as long as
    # the group
    _base_store: Any = field(default=None, repr=False)
    _failed: bool = field(default=False, repr=False)   # a phase failed: close() must not wait
    _seq: int = field(default=0, repr=False)
    _prev: tuple[str, str] | None = field(default=None, repr=False)   # step, arrival key
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """End the group. The store host waits (at most timeout_s) for every rank to
        reach close(), so nobody loses the store while still reading it."""
        if self._closed:
            return
        self._stop_heartbeat()
        # After a failed phase the failure path has already waited for the others' acks;
        # waiting again for close() of ranks that may be dead would break the bound.
        if self.store is not None and self.world > 1 and not self._failed:
            with contextlib.suppress(Exception):
                if self.store_host:
                    self.store.wait([f"close/{r}" for r in range(self.world) if r != self.rank],
                                    timedelta(seconds=self.timeout_s))
                else:
                    self.store.set(f"close/{self.rank}", b"1")
                    if self.store_host_unknown:
                        # an adopted group's host is any rank: one that returned and exited
                        # took the store from a rank still reading the last step's count.
                        # They all passed that step together, so this is short; bounded.
                        self.store.wait([f"close/{r}" for r in range(self.world)],
                                        timedelta(seconds=min(self.grace_s, self.timeout_s)))
        if self.owns_pg:
            import torch.distributed as dist
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.pg)
            self.pg = None   # (its object holds the store's connection and server)
        # the store host keeps its server while the object lives: the ranks still to read
        # a failure, and a rank that formed the next group at once, joined it (a
        # multi-tenant server is shared by the host's next group on the port); the
        # other connections go now
        self.release(keep_server=self.store_host)

    def release(self, keep_server: bool = False) -> None:
        """Stop the heartbeat and drop the store connections (and rank 0's server unless
        ``keep_server``): what close() ends with (keeping the host's server), and what a
        group that never formed leaves behind."""
        self._stop_heartbeat()
        self._hb_store = None
        if not keep_server:
            self.store = None
            self._base_store = None

    def _stop_heartbeat(self) -> None:
        # (closed from here on: a phase is refused, a linger and a second close() do nothing)
        self._closed = True
        if self._hb_stop is not None:
            self._hb_stop.set()


def env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise CollectiveError(f"environment variable {name}={v!r} is not an integer") from None


def _env_port() -> int | None:
    port = env_int("MASTER_PORT")
    if port is not None and not 1 <= port <= 65535:
        # torch's binding would raise a TypeError about uint16 arguments
        raise CollectiveError(f"environment variable MASTER_PORT={port} is not a TCP port; "
                              f"expected an integer in 1-65535")
    return port


def init_group(backend: str | None = None, timeout_s: float | None = None, *,
               grace_s: float | None = None) -> Group:
    """Form the group from the environment (torchrun or plain processes).

    Steps, each bounded by ``timeout_s``: connect to the rendezvous TCPStore at
    MASTER_ADDR:MASTER_PORT (rank 0 hosts it, or the torchrun agent does), announce this
    rank on it and wait for all WORLD_SIZE ranks (so a rank that never starts is named),
    then ``init_process_group`` over the same store with ``timeout=timeout_s``."""
    import torch
    import torch.distributed as dist

    timeout_s = float(timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    grace = float(grace_s if grace_s is not None else min(DEFAULT_GRACE_S, timeout_s))
    if dist.is_available() and dist.is_initialized():
        return wrap_group(None, timeout_s, grace_s=grace)
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    if rank is None or world is None:
        if (world is None or world == 1) and (rank is None or rank == 0):
            return Group(rank=0, world=1, timeout_s=timeout_s, grace_s=grace)
        # one of a group's processes, told only half of where it stands: as one process
        # each would load alone, as if the group were a world of one
        have, lack = ((f"WORLD_SIZE={world}", "RANK") if rank is None
                      else (f"RANK={rank}", "WORLD_SIZE"))
        raise CollectiveError(f"environment variable {have} is set but {lack} is not; "
                              f"expected both (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and "
                              f"MASTER_PORT), or neither for one process")
    if world < 1 or not 0 <= rank < world:
        raise CollectiveError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    addr = os.environ.get("MASTER_ADDR")
    port = _env_port()
    if not addr or port is None:
        raise CollectiveError("MASTER_ADDR and MASTER_PORT must be set when RANK and "
                              "WORLD_SIZE are (torchrun sets all four)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = rank == 0 and not agent
    who = "the torchrun agent" if agent else "rank 0"
    desc = f"{addr}:{port} (hosted by {who})"
    td = timedelta(seconds=timeout_s)
    why = None if host else _wait_for_port(addr, port, timeout_s)
    if why is not None:
        cause = (f"{why}: check MASTER_ADDR on this node" if "does not resolve" in why else
                 f"{who} did not start or is unreachable")
        raise CollectiveError(f"group did not form: cannot reach the rendezvous store at {desc} "
                              f"within {timeout_s:g} s; {cause}", rank=rank)
    op_s = _store_op_s(timeout_s)
    try:
        # bounded: a listener that accepts and never answers (a foreign process on
        # MASTER_PORT, or a stopped rank 0) would block the client's handshake forever
        base = call_with_deadline("connect", lambda: dist.TCPStore(
            addr, port, world, is_master=host, timeout=td, wait_for_workers=False,
            multi_tenant=True), timeout_s + op_s)
    except StoreStalled as exc:
        raise CollectiveError(
            f"group did not form: something accepts connections on {addr}:{port} but did not "
            f"answer the store handshake within {exc.seconds:g} s; another process holds "
            f"MASTER_PORT={port} (choose a free port), or {who} is stopped or hung",
            rank=rank) from None
    except Exception as exc:  # noqa: BLE001 - turned into a clear message
        t, m = describe_exception(exc)
        if host and "address already in use" in m.lower():
            msg = (f"group did not form: cannot start the rendezvous store on {addr}:{port}: "
                   f"another process holds MASTER_PORT={port} (address already in use); "
                   f"choose a free port")
        elif host:
            msg = f"group did not form: cannot start the rendezvous store on {addr}:{port}: {t}: {m}"
        else:
            msg = (f"group did not form: cannot reach the rendezvous store at {desc} within "
                   f"{timeout_s:g} s; {who} did not start or is unreachable ({t}: {m})")
        raise CollectiveError(msg, rank=rank) from exc
    # A namespace per group formed over this store and per torchrun attempt, so a repeated
    # init or a retry (torchrun keeps its store across rounds) never reads stale keys. Not
    # MASTER_ADDR: it may be spelled per node (localhost, a name, its IP). The restart
    # count is each node's own: a node restarted for another's failure does not count it
    # (docs/troubleshooting.md), which no value the ranks could agree on first avoids.
    ns = _namespace(f"r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/port{port}")
    board = DeadlineStore(dist.PrefixStore(ns, base), op_s)
    group = Group(rank=rank, world=world, store=board, timeout_s=timeout_s, grace_s=grace,
                  backend=backend, store_host=host, store_desc=desc)
    group._base_store = base
    try:
        return _form(group, backend, ns, base, addr, port, world, td, timeout_s, op_s, desc)
    except BaseException:
        # a reference cycle through the traceback kept the group alive past the failure
        # until a gc (paused in loads), and its heartbeat thread beating: the other ranks
        # saw this rank as alive
        group.release()
        raise


def _form(group: Group, backend: str, ns: str, base, addr: str, port: int, world: int,
          td: timedelta, timeout_s: float, op_s: float, desc: str) -> Group:
    """``init_group`` from the join on: the heartbeat and the process group."""
    import torch
    import torch.distributed as dist
    rank = group.rank
    _join(group)
    _start_heartbeat(group, lambda: dist.PrefixStore(ns, dist.TCPStore(
        addr, port, world, is_master=False, timeout=td, wait_for_workers=False)))
    device = None
    if backend == "nccl":
        local = env_int("LOCAL_RANK")
        if local is None and torch.cuda.device_count() == 0:   # (a bare ZeroDivisionError)
            raise CollectiveError("backend 'nccl' needs CUDA devices and this process sees "
                                  "none; use backend 'gloo' on CPU", rank=rank)
        device = local if local is not None else rank % torch.cuda.device_count()
        torch.cuda.set_device(device)

    def init_pg():
        if device is not None:
            torch.cuda.set_device(device)   # the current device is per thread
        dist.init_process_group(backend, store=dist.PrefixStore(ns + "pg", base), rank=rank,
                                world_size=world, timeout=td)

    try:
        # its rendezvous reads the store too: bounded like every other store request
        call_with_deadline("init_process_group", init_pg, timeout_s + op_s)
    except StoreStalled as exc:
        raise CollectiveError(f"group formed but init_process_group({backend!r}) did not "
                              f"complete within {exc.seconds:g} s: the store {desc} stopped "
                              f"answering or a rank stopped", rank=rank) from None
    except Exception as exc:  # noqa: BLE001
        t, m = describe_exception(exc)
        raise CollectiveError(f"group formed but init_process_group({backend!r}) failed: "
                              f"{t}: {m}", rank=rank) from exc
    group.pg = dist.group.WORLD
    group.owns_pg = True
    return group


def _wait_for_port(addr: str, port: int, timeout_s: float) -> str | None:
    """Poll until something listens on addr:port; None then, else why not (the name did
    not resolve, or nothing listened). TCPStore's own client connect retries with
    randomised back-off (about 13 s for a 5 s timeout here), which would break the "exit
    within the timeout" promise; a plain socket poll keeps the bound exact. A name that
    does not resolve is tried again too (a pod's DNS entry may come after the pod)."""
    deadline = time.monotonic() + timeout_s
    why = "nothing accepted connections there"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        try:
            with socket.create_connection((addr, port), timeout=min(1.0, left)):
                return None
        except socket.gaierror as e:
            why = f"the name MASTER_ADDR={addr} does not resolve ({e.strerror or e})"
        except OSError:
            why = "nothing accepted connections there"
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


HEARTBEAT_S = 0.5
# A rank whose heartbeat has not moved for this long is dead (or stopped), not slow: the
# others stop waiting for it at once instead of at the end of --timeout. Ten beats, so a
# live rank whose beat thread is briefly starved of the GIL or the CPU is not called dead.
DEAD_AFTER_S = 10 * HEARTBEAT_S


def _start_heartbeat(group: Group, connect: Callable[[], Any]) -> None:
    """Bump ``hb/<rank>`` every HEARTBEAT_S from a daemon thread on its own store
    connection (the main one may sit in a long wait, and a client's requests serialise).
    ``connect()`` opens that connection and returns it as a store in the status board's
    key space (the same prefixes); it runs under the connect deadline. A rank missing at a
    boundary whose counter has moved and then stopped is reported as dead, not merely
    late. Counters, not clocks: hosts' clocks need not agree. The one implementation
    behind ``init_group`` and ``wrap_group``; ``Group.close()`` (or the group being
    collected) stops the thread."""
    import threading
    import weakref
    try:
        st = call_with_deadline("connect", connect,
                                group.timeout_s + _store_op_s(group.timeout_s))
    except Exception:  # noqa: BLE001 - liveness is a diagnostic aid, never fatal
        return
    if st is None:
        return
    stop = threading.Event()
    key = f"hb/{group.rank}"

    def beat():
        while True:
            try:
                st.add(key, 1)
            except Exception:  # noqa: BLE001 - store gone: the main thread will say so
                return
            if stop.wait(HEARTBEAT_S):
                return

    threading.Thread(target=beat, name="coordloader-heartbeat", daemon=True).start()
    weakref.finalize(group, stop.set)   # a group dropped without close() stops beating too
    group._hb_stop = stop
    group._hb_store = DeadlineStore(st, _store_op_s(group.timeout_s))


def _second_connection(store, timeout_s: float, *, clone: bool = True):
    """A new client connection to the TCPStore under ``store`` (PrefixStores walked via
    ``underlying_store``), wrapped in the same prefixes so it sees the same keys; None when
    ``store`` does not rest on a TCPStore (FileStore, HashStore) or the prefixes cannot be
    recovered. ``Store.clone()`` does exactly this (same prefixes, new socket); without
    it a TCPStore client is opened on the store's host/port and the prefixes read back
    (``prefix``: not exposed by every torch)."""
    import torch.distributed as dist
    prefixes = []
    inner = store
    while isinstance(inner, dist.PrefixStore):
        prefixes.append(getattr(inner, "prefix", None))
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        return None
    if clone and hasattr(store, "clone"):
        return store.clone()
    if any(p is None for p in prefixes):
        return None
    conn = dist.TCPStore(inner.host, inner.port, is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    for p in reversed(prefixes):
        conn = dist.PrefixStore(p, conn)
    return conn


def _heartbeats(group: Group, ranks) -> dict[int, int] | None:
    if group._hb_stop is None or not ranks:
        return None
    try:
        return {r: group.store.add(f"hb/{r}", 0) for r in ranks}
    except Exception:  # noqa: BLE001
        return None


def _namespace(identity: str) -> str:
    """Keys of the n-th group this process forms over ``identity`` (a store, or an adopted
    process group by name): the identity is part of them, so two groups adopted over one
    default store (new_group([0, 1]) and new_group([2, 3])) keep separate boards."""
    n = _NAMESPACES.get(identity, 0)
    _NAMESPACES[identity] = n + 1
    return f"coordloader/{identity}/g{n}"


def _join(group: Group) -> None:
    """Every rank announces itself; wait for all, naming those that never came."""
    st, world = group.store, group.world
    me = f"{socket.gethostname()}:{os.getpid()}"
    try:
        # a second process given the same RANK: named here, not later as a rank "exited",
        # "did not start" or a store that "stopped answering", one story per run
        if st.add(f"taken/{group.rank}", 1) > 1:
            try:
                first = st.get(f"join/{group.rank}").decode(errors="replace").partition(
                    " world=")[0]
            except Exception:  # noqa: BLE001 - the name only adds to the message
                first = "another process"
            raise CollectiveError(f"group did not form: RANK={group.rank} is taken by "
                                  f"{first} already; this process ({me}) was given the same "
                                  f"RANK: every process needs a RANK of its own in "
                                  f"[0, WORLD_SIZE={world})", rank=group.rank)
        st.set(f"join/{group.rank}", f"{me} world={world}")
        st.wait([f"join/{r}" for r in range(world)], timedelta(seconds=group.timeout_s))
        odd = _other_worlds(group, range(world))
        if odd:
            raise CollectiveError(f"group did not form: ranks disagree on WORLD_SIZE ({odd}); "
                                  f"give every node the same WORLD_SIZE", rank=group.rank)
        return
    except CollectiveError:
        raise
    except Exception as exc:  # noqa: BLE001
        if _is_lost(exc):
            raise _lost(group, "group formation", exc) from exc
        cause = exc
    present = _present(group, "join/")
    if present is None:
        msg = (f"group did not form within {group.timeout_s:g} s and the store "
               f"{group.store_desc} went away")
    else:
        missing = [r for r in range(world) if r not in present]
        msg = (f"group did not form within {group.timeout_s:g} s: {format_ranks(missing)} "
               f"did not join (joined: {format_ranges(present)})")
        odd = _other_worlds(group, present)
        if odd:   # the ranks "missing" may not exist: a node given another WORLD_SIZE
            msg += f"; the ranks disagree on WORLD_SIZE ({odd})"
    _ack_and_linger(group, "join", present or [])
    raise CollectiveError(msg, rank=group.rank) from cause


def _other_worlds(group: Group, ranks) -> str:
    """"rank 1 says 3, this rank (0) 2" where ranks that joined state another WORLD_SIZE
    than this rank's ('' when none does, or their join cannot be read)."""
    try:
        values = group.store.multi_get([f"join/{r}" for r in ranks])
    except Exception:  # noqa: BLE001 - a diagnostic only
        return ""
    odd = []
    for r, v in zip(ranks, values):
        _, _, w = v.decode(errors="replace").rpartition(" world=")
        if w.isdigit() and int(w) != group.world:
            odd.append(f"rank {r} says {w}")
    return (", ".join(odd) + f", this rank ({group.rank}) {group.world}") if odd else ""


def wrap_group(pg=None, timeout_s: float | None = None, *, grace_s: float | None = None) -> Group:
    """Adopt an already initialised torch.distributed (``pg`` None = the default group).

    The status board uses the default group's store when torch exposes it (it always has
    so far, via a private accessor); otherwise the exchange falls back to
    ``all_gather_object`` over ``pg``, which is bounded by the group's own timeout but
    cannot name ranks that did not arrive.

    Each rank of an adopted group beats like one of ``init_group`` (``hb/<rank in pg>`` in
    this wrap's namespace, on a second connection to the TCPStore under the default store),
    so a rank that dies after adopting it is named dead within about DEAD_AFTER_S, not at
    the timeout. A rank that has not adopted it yet (still on its way to ``load``) has
    never beaten and is only late: it is named at the timeout. When the default store does
    not rest on a TCPStore (FileStore, HashStore) or that store cannot be reached a second
    time, there is no heartbeat: a dead rank is named at the timeout. Call ``close()`` to
    stop the heartbeat thread."""
    import torch.distributed as dist

    if pg is not None and not isinstance(pg, dist.ProcessGroup):
        # (group="gloo", group=1: torch's own ValueError from deep inside)
        raise CollectiveError(f"group= must be a torch.distributed ProcessGroup, a "
                              f"coordloader Group or None (the default group), got "
                              f"{clip(repr(pg), MAX_NAME_CHARS)} ({type(pg).__name__})")
    timeout_s = float(timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    grace = float(grace_s if grace_s is not None else min(DEFAULT_GRACE_S, timeout_s))
    if not (dist.is_available() and dist.is_initialized()):
        if pg is None:
            return Group(rank=0, world=1, timeout_s=timeout_s, grace_s=grace)
        raise CollectiveError("wrap_group: torch.distributed is not initialised")
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    store = None
    try:
        base = dist.distributed_c10d._get_default_store()
        name = getattr(pg, "group_name", None) if pg is not None else "world"
        # the counter advances on every rank alike: nothing rank-specific before this
        ns = _namespace(f"wrap/{name}")
        store = DeadlineStore(dist.PrefixStore(ns, base), _store_op_s(timeout_s))
    except Exception:  # noqa: BLE001 - private API gone: use the fallback exchange
        store = None
    group = Group(rank=rank, world=world, pg=pg if pg is not None else dist.group.WORLD,
                  store=store, timeout_s=timeout_s, grace_s=grace,
                  backend=str(dist.get_backend(pg)), store_host=False,
                  store_host_unknown=True, store_desc="the default group's store")
    if store is not None and world > 1:
        # keys in the namespace of this wrap, by the rank within ``pg``
        _start_heartbeat(group, lambda: _wrapped_beat_store(base, ns, timeout_s))
    return group


@contextlib.contextmanager
def adopted(group, timeout_s: float | None = None):
    """``group`` as a Group for the ``with`` block: a Group is used as it is (whoever made
    it closes it); a process group (None: the default one) is adopted with ``wrap_group``
    and closed when the block ends, however it ends, so the heartbeat of a group adopted
    for one call never outlives the call; an exception that leaves the block outside a
    phase is posted for the other ranks first. The one way the library's entry points
    adopt."""
    if isinstance(group, Group):
        yield group
        return
    bad = timeout_problem(timeout_s)
    # a bad timeout on one rank is refused once adopted (with the default), like any other
    # argument: refused before, this rank's next adoption paired with the others' current one
    g = wrap_group(group, timeout_s=None if bad else timeout_s)
    try:
        if bad:
            raise ConfigError(bad, rank=g.rank)
        yield g
    except GeneratorExit:
        raise
    except BaseException as exc:
        # raised here outside any phase (load refusing the group it was handed, say)
        leave_failed(g, exc)
        raise
    finally:
        g.close()


def _wrapped_beat_store(base, ns: str, timeout_s: float):
    import torch.distributed as dist
    conn = _beat_connection(base, timeout_s)
    return None if conn is None else dist.PrefixStore(ns, conn)


# (id of the default store, this process's heartbeat connection to it): one connection
# serves the groups adopted over that store in turn. Each load adopting the default group
# used to open its own; torch's TCPStore client sometimes takes 5 s to connect (one
# connect in ~25 on loopback on some hosts), and a run of loads then stalled phases past
# the store deadline (tests/test_adopted_mp.py). Only the client is kept: holding the
# store itself would keep rank 0's server listening after destroy_process_group().
_BEAT_CONNECTION: list = []
_PROBES = itertools.count()


def _beat_connection(base, timeout_s: float):
    """The heartbeat connection to the TCPStore under ``base``: the one opened for an
    earlier adoption while it still reaches that very store, else a new one."""
    if _BEAT_CONNECTION and _BEAT_CONNECTION[0][0] == id(base):
        conn = _BEAT_CONNECTION[0][1]
        if _reaches(conn, base, _store_op_s(timeout_s)):
            return conn
    conn = _second_connection(base, timeout_s)
    _BEAT_CONNECTION[:] = [] if conn is None else [(id(base), conn)]
    return conn


def _reaches(conn, base, op_s: float) -> bool:
    """Whether ``conn`` sees a key just written through ``base``, all within ``op_s``: a
    connection kept from an earlier rendezvous (a new store on the same port, an id
    reused) does not, nor does one that stalls."""
    key = f"coordloader/beat-probe/{os.getpid()}/{next(_PROBES)}"

    def probe() -> bool:
        base.set(key, b"1")
        seen = conn.check([key])
        base.delete_key(key)
        return bool(seen)
    try:
        return call_with_deadline("check", probe, op_s)
    except Exception:  # noqa: BLE001 - stalled or broken: the caller opens a fresh one
        return False


# --------------------------------------------------------------------------- phases

def run_phase(name: str, fn: Callable, group: Group | None, *args, **kw):
    """Run ``fn(*args, **kw)`` here, agree with every rank, return its value.

    Raises CollectiveError on every rank if any rank failed or did not arrive within
    ``group.timeout_s``. With no group or world 1 it is just ``fn(*args, **kw)``."""
    if group is None or group.world <= 1:
        return fn(*args, **kw)
    if group._closed:
        raise CollectiveError(f"phase {name}: the group is closed", rank=group.rank)
    local: BaseException | None = None
    value = None
    try:
        value = fn(*args, **kw)
        status = (name, True, "", "")
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the others
        local = exc
        status = (name, False) + describe_exception(exc, group.rank) + (_is_comm_failure(exc),)
    try:
        if group.store is None:
            _agree_over_pg(name, group, status, local)
        else:
            _agree_over_store(name, group, status, local)
    except CollectiveError:
        group._failed = True
        if local is not None and not isinstance(local, Exception):
            raise local from None   # Ctrl-C / SystemExit: the others were told; exit 130 here
        raise
    except KeyboardInterrupt:
        # Ctrl-C while waiting at the boundary: this rank's status of this step is already
        # out, so leave a note where the others will wait for it next
        group._failed = True
        _post_leaving(group, KeyboardInterrupt())
        raise
    if local is not None and not isinstance(local, Exception):
        raise local  # KeyboardInterrupt / SystemExit: others were told, keep its meaning
    return value


def leave_failed(group: Group | None, exc: BaseException) -> None:
    """``exc`` ended this rank's part outside any phase (a check between two phases, the
    caller's own code): posted as this rank's failure at the step the others reach next,
    so they name it there rather than calling this rank dead once its heartbeat stops,
    or waiting out the timeout for it; ``close()`` then waits for no one. The rank hosting
    the store lingers until the others have read it (bounded): its exit would take the
    store, and the cause, with it. A no-op after a failed phase (every rank knows)."""
    if group is None or group.world <= 1 or group._failed or group._closed:
        return
    tag = str(group._seq)
    _post_leaving(group, exc)
    group._failed = True
    if group.store_host:
        _linger_for_readers(group, tag)


def _linger_for_readers(group: Group, tag: str) -> None:
    """Wait until every other rank has acknowledged step ``tag`` (or closed the group),
    at most the group's timeout, and no longer once the ranks still missing have all
    stopped beating (dead: they will never read it)."""
    st = group.store
    others = [r for r in range(group.world) if r != group.rank]
    end = time.monotonic() + group.timeout_s
    moved: dict[int, tuple[int, float]] = {}   # rank -> (beat count, when it last moved)
    with contextlib.suppress(Exception):
        while True:
            waiting = [r for r in others
                       if not st.check([f"ack/{tag}/{r}"]) and not st.check([f"close/{r}"])]
            left = end - time.monotonic()
            if not waiting or left <= 0:
                return
            beats = _heartbeats(group, waiting)
            if beats is not None:
                now = time.monotonic()
                for r, c in beats.items():
                    if r not in moved or moved[r][0] != c:
                        moved[r] = (c, now)
                if all(now - moved[r][1] >= DEAD_AFTER_S for r in waiting):
                    return
            with contextlib.suppress(Exception):
                st.wait([f"ack/{tag}/{r}" for r in waiting],
                        timedelta(seconds=min(left, 2 * HEARTBEAT_S)))


def _post_leaving(group: Group, exc: BaseException) -> None:
    """Best effort, bounded: report ``exc`` as this rank's failure at the next step, so
    the others name it as soon as they reach that boundary, not after their timeout."""
    st = group._hb_store or group.store
    if st is None:
        return
    seq = group._seq
    with contextlib.suppress(Exception):
        st.set(f"{seq}/s/{group.rank}",
               pickle.dumps(("?", False) + describe_exception(exc, group.rank)))
        st.add(f"{seq}/f", 1)
        st.set(f"{seq}/ev", b"f")
        st.set(f"ack/{seq}/{group.rank}", b"1")   # gone: the store host need not wait for it
        st.set(f"close/{group.rank}", b"1")       # nor an adopted group's ranks, at close()


def _agree_over_store(name: str, group: Group, status: tuple, local) -> None:
    st, rank, world = group.store, group.rank, group.world
    seq = group._seq
    group._seq += 1
    # failure counter and event by step, arrivals by step and phase: a rank that leaves
    # (Ctrl-C) posts where the others will wait without knowing their next phase, and a
    # rank in another phase at the same step never completes the count, so it is named
    # by its status (PhaseMismatch) instead of passing unnoticed
    k = str(seq)
    ok = status[1]
    try:
        st.set(f"{seq}/s/{rank}", pickle.dumps(status))
        if not ok:
            st.add(f"{k}/f", 1)
            st.set(f"{k}/ev", b"f")        # wake the others now: no need to wait for all
        arrived = st.add(f"{k}/{name}/n", 1)
        if arrived == world:
            st.set(f"{k}/ev", b"a")
        # a claim in this phase's count, or one made in another phase at this step
        late = arrived >= GIVE_UP or (arrived < world and st.check([f"{k}/gave"]))
    except Exception as exc:  # noqa: BLE001
        raise _lost(group, name, exc, local) from (local or exc)
    if late:
        _raise_late(group, k, name, status, local)
    timed_out = _wait_or_death(group, f"{k}/ev", seq, name, local)
    absent: list[int] = []    # the ranks missing when this rank gave up waiting
    fallback = None           # what it says when no rank can be named
    if timed_out:
        claim = _give_up(group, k, name, local)
        timed_out = claim is not None
        if claim is not None:
            absent, fallback = claim
    if not timed_out:
        try:
            nfail = st.add(f"{k}/f", 0)
        except Exception as exc:  # noqa: BLE001
            raise _lost(group, name, exc, local) from (local or exc)
        if nfail == 0:
            _cleanup(group, seq, name)
            return
        # A failure is known: no collective of this group will succeed again. A rank
        # still inside the phase's collective with one that never comes to it (gloo: a
        # ring; the store's host, leaving, took the board from under them) waits for the
        # backend's timeout; a process group this rank made is shut down now, so theirs
        # breaks at once (their connections close) and they report within the grace.
        _end_own_pg(group, local)
        # Give stragglers a short grace to report, then stop.
        # Check liveness as we wait: stop early once every missing rank is dead.
        grace_end = time.monotonic() + min(group.grace_s, group.timeout_s)
        keys = [f"{seq}/s/{r}" for r in range(world)]
        while True:
            statuses = _read_statuses(group, seq) or {}
            waiting = [r for r in range(world) if r not in statuses]
            before = _heartbeats(group, waiting)
            step = min(3 * HEARTBEAT_S, grace_end - time.monotonic())
            if not waiting or step <= 0:
                break
            with contextlib.suppress(Exception):
                st.wait(keys, timedelta(seconds=step))
            after = _heartbeats(group, waiting)
            if before is not None and before == after and all(before.values()):
                break   # every rank still missing has stopped beating: dead
    statuses = _read_statuses(group, seq)
    if statuses is None:
        gone = getattr(st, "stalled", None) or RuntimeError("store went away while reading "
                                                            "statuses")
        raise _lost(group, name, gone, local) from local
    failures = {r: (s[2], s[3]) for r, s in statuses.items() if not s[1]}
    for r, s in statuses.items():   # collective discipline: same phase at the same step
        if s[0] != name and s[1]:
            failures[r] = ("PhaseMismatch", f"is in phase {s[0]!r} at step {seq}, "
                                            f"not {name!r}")
    missing = [r for r in range(world) if r not in statuses]
    if absent:   # a rank arriving during the claim is late all the same
        missing = sorted(set(missing) | set(absent))
    dead = _dead_ranks(group, missing)
    late = [r for r in missing if r not in dead]

    def comm(r):   # this rank's failure was a collective broken under it
        return len(statuses[r]) > 4 and statuses[r][4]
    if dead:
        # A dead rank is the cause: the others' collectives with it failed (or are still
        # failing: those are the late ones) because of it. Name it alone, so every rank
        # prints the same line whatever it saw of the breakage.
        failures = {r: f for r, f in failures.items() if not comm(r)}
        late = []
    elif any(not comm(r) for r in failures):
        # A rank that failed for a reason of its own (an error, Ctrl-C) left the phase's
        # collectives, and the others' broke under them: its failure is the cause, theirs
        # only says it left. Only those are dropped ("closed by peer", a wait timed out):
        # an NCCL error of its own (out of memory) is a second failure, still named.
        failures = {r: f for r, f in failures.items()
                    if not (comm(r) and any(t in f[1].lower() for t in _PEER_LEFT_TEXT))}
    notes = []
    if dead:
        notes.append(f"{format_ranks(dead)} died or hung hard (no heartbeat for "
                     f"{3 * HEARTBEAT_S:g} s) before reaching the end of the phase")
    if late:
        if timed_out:
            notes.append(f"{format_ranks(late)} did not arrive within {group.timeout_s:g} s")
        else:
            notes.append(f"{format_ranks(late)} did not report within "
                         f"{min(group.grace_s, group.timeout_s):g} s of the failure")
    if timed_out and late:
        notes[-1] += (f" (arrived: "
                      f"{format_ranges([r for r in statuses if r not in missing]) or 'none'})")
    if timed_out and not notes and not failures and fallback:
        notes.append(fallback)
    err = _phase_error(name, failures, notes, local, missing)
    _ack_and_linger(group, str(seq), list(statuses))
    raise err from local


def _clear_frames(exc: BaseException | None) -> None:
    """Clear the finished frames of ``exc``'s traceback and of its causes and contexts: a
    frame holding the group (or its store) kept it, its connections and rank 0's server
    alive as long as the exception, and longer through a cycle."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def _end_own_pg(group: Group, local: BaseException | None = None) -> bool:
    """Shut down the gloo process group this Group made (``init_group``), so peers blocked
    in a collective with this rank fail at once (their connections close) instead of at
    the backend's timeout; never a caller's, nor NCCL's (its shutdown may wait for this
    rank's own pending work). ``local``: this rank's failure, whose frames (a collective
    that broke holds the group in them, and so kept it, connections open) are cleared,
    along its causes. -> whether it did."""
    if not group.owns_pg or group.pg is None or group.backend != "gloo":
        return False
    import torch.distributed as dist
    _clear_frames(local)
    pg, group.pg = group.pg, None
    with contextlib.suppress(Exception):
        pg.shutdown()
    with contextlib.suppress(Exception):
        dist.destroy_process_group(pg)
    group.owns_pg = False   # close() has nothing left to destroy
    return True


# Added to a step's arrival count by a rank that gives up waiting: far above any world, so
# count % GIVE_UP is the arrivals, and an arrival after it never counts to the world
GIVE_UP = 1 << 40


def _give_up(group: Group, k: str, name: str, local) -> tuple[list[int], str] | None:
    """This rank waited out the timeout at step ``k``: claim that in the arrival count
    itself, so that no rank can still complete the count and pass the boundary while
    this one raises (a late rank did, and returned as loaded); a rank arriving after the
    claim reads it in the count it gets back (or, in another phase, in ``k/gave``).
    -> None when every rank arrived before any claim (go on as if the wait had ended);
    else the ranks without a status and what to say when none can be named."""
    st = group.store
    try:
        got = st.add(f"{k}/{name}/n", GIVE_UP)
        if got < 2 * GIVE_UP and got % GIVE_UP >= group.world:
            return None
        st.set(f"{k}/g/{group.rank}", b"1")    # who gave up, for the late ranks' message
        st.set(f"{k}/gave", b"1")
    except Exception as exc:  # noqa: BLE001
        raise _lost(group, name, exc, local) from (local or exc)
    present = _present(group, f"{k}/s/") or []
    others = [r for r in (_present(group, f"{k}/g/") or []) if r != group.rank]
    if got >= 2 * GIVE_UP and others:
        say = (f"{format_ranks(others)} stopped waiting (timeout {group.timeout_s:g} s) before "
               f"every rank had arrived")
    else:   # a rank's status was in before its arrival was counted
        say = (f"{group.world - got % GIVE_UP} rank(s) did not arrive within "
               f"{group.timeout_s:g} s")
    return [r for r in range(group.world) if r not in present], say


def _raise_late(group: Group, k: str, name: str, status: tuple, local) -> None:
    """This rank arrived after another gave up waiting at step ``k``: the others have
    raised (or are raising), so this one must not pass the boundary either; its own
    failure, if it had one, is named too."""
    gave = _present(group, f"{k}/g/") or []
    who = format_ranks(gave) if gave else "another rank"
    note = (f"arrived after {who} stopped waiting for it (timeout {group.timeout_s:g} s): "
            f"this rank is late, the others have stopped")
    own = {} if status[1] else {group.rank: (status[2], status[3])}
    err = _phase_error(name, own, [note], local)
    _ack_and_linger(group, k, [])
    group._failed = True
    raise err from local


def _wait_or_death(group: Group, key: str, seq: int, name: str, local) -> bool:
    """Wait for ``key`` (every rank arrived, or one failed) for at most the group's
    timeout; True if it did not come. With heartbeats, wait in slices and give up early
    once a rank that has not arrived stopped beating for DEAD_AFTER_S (the caller then
    names it dead)."""
    st = group.store
    end = time.monotonic() + group.timeout_s
    slices = group._hb_stop is not None and group.timeout_s > DEAD_AFTER_S
    last: dict[int, tuple[int, float]] = {}    # rank -> (beat count, when it last moved)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return True
        try:
            st.wait([key], timedelta(seconds=min(left, DEAD_AFTER_S / 2) if slices else left))
            return False
        except Exception as exc:  # noqa: BLE001
            if _is_lost(exc):
                raise _lost(group, name, exc, local) from (local or exc)
        if not slices:
            return True
        present = _present(group, f"{seq}/s/")
        beats = _heartbeats(group, [r for r in range(group.world)
                                    if present is not None and r not in present])
        if not beats:
            continue
        now = time.monotonic()
        for r, c in beats.items():
            if r not in last or last[r][0] != c:
                last[r] = (c, now)
        # 0: never beat (not yet in the group it adopts, or no heartbeat): late, not dead
        if any(c > 0 and now - last[r][1] >= DEAD_AFTER_S for r, c in beats.items()):
            return True


def _dead_ranks(group: Group, missing: list[int]) -> list[int]:
    """Of the missing ranks, those whose heartbeat has beaten and does not move over 3
    beats."""
    before = _heartbeats(group, missing)
    if before is None:
        return []
    time.sleep(3 * HEARTBEAT_S)
    after = _heartbeats(group, missing)
    if after is None:
        return []
    # a counter still at 0 never moved because it never started: late, not dead
    return [r for r in missing if after[r] == before[r] > 0]


def never_adopted(group: Group, ranks) -> list[int] | None:
    """Of ``ranks``, those whose heartbeat in ``group`` never moved: they never adopted
    this group, so they never entered the call that adopts it (a rank that adopts beats
    at once). None when the group has no heartbeat to tell by (no TCPStore under it, or
    the store is gone): then nothing is known either way."""
    beats = _heartbeats(group, list(ranks))
    return None if beats is None else [r for r, c in beats.items() if c == 0]


def _read_statuses(group: Group, seq: int) -> dict[int, tuple] | None:
    present = _present(group, f"{seq}/s/")
    if present is None:
        return None
    try:
        values = group.store.multi_get([f"{seq}/s/{r}" for r in present]) if present else []
    except Exception:  # noqa: BLE001
        return None
    out = {}
    for r, v in zip(present, values):
        try:
            out[r] = pickle.loads(bytes(v))
        except Exception:  # noqa: BLE001 - a corrupt status is still a failure to report
            out[r] = ("?", False, "CollectiveError", "unreadable status on the board")
    return out


def _present(group: Group, prefix: str) -> list[int] | None:
    try:
        return [r for r in range(group.world) if group.store.check([f"{prefix}{r}"])]
    except Exception:  # noqa: BLE001
        return None


def _ack_and_linger(group: Group, tag: str, present: list[int]) -> None:
    """On failure: say we are done reading; the store host waits (bounded) for every
    rank that reported to say the same, so its exit does not cut them off. In an adopted
    group the host is not known (rank 0 of an env:// rendezvous, the torchrun agent, ...),
    so every rank waits: the others ack right after their own last read."""
    st = group.store
    with contextlib.suppress(Exception):
        if not group.store_host:
            st.set(f"ack/{tag}/{group.rank}", b"1")
            if not group.store_host_unknown:
                return
        others = [r for r in present if r != group.rank]
        if others:
            st.wait([f"ack/{tag}/{r}" for r in others],
                    timedelta(seconds=max(group.grace_s, 1.0)))


def _cleanup(group: Group, seq: int, name: str) -> None:
    # Everyone has arrived at `seq`, so everyone has finished reading step seq-1.
    prev, group._prev = group._prev, (str(seq), f"{seq}/{name}/n")
    if prev is None:
        return
    with contextlib.suppress(Exception):
        group.store.delete_key(f"{seq - 1}/s/{group.rank}")
        if group.rank == 0:
            step, arrivals = prev
            for key in (arrivals, f"{step}/f", f"{step}/ev"):
                group.store.delete_key(key)


# What a collective backend says when a peer went away; gloo raises plain RuntimeErrors.
# the texts of a collective broken because a peer stopped answering
_PEER_LEFT_TEXT = ("connection closed by peer", "connection reset by peer", "timed out waiting",
                   "broken pipe", "socket closed", "caused pair closure",
                   "remote process exited", "communicator was aborted")
# those, and any other failure of the backends themselves
_COMM_TEXT = _PEER_LEFT_TEXT + ("gloo", "nccl", "connection refused")


def _is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a collective failing because a peer
    stopped answering: with a dead rank known, such a failure is its consequence, not a
    cause of its own, and its raw backend text would differ from rank to rank."""
    import torch.distributed as dist
    seen = 0
    while exc is not None and seen < 6:
        if isinstance(exc, dist.DistError):
            return True
        if isinstance(exc, RuntimeError) and any(t in _text(exc).lower() for t in _COMM_TEXT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _is_lost(exc: BaseException) -> bool:
    """A store call failed because the connection broke (DistNetworkError: the server
    process is gone), not because its deadline passed (DistStoreError)."""
    import torch.distributed as dist
    return isinstance(exc, (dist.DistNetworkError, ConnectionError, StoreStalled))


def _lost(group: Group, phase: str, exc: BaseException, local=None) -> CollectiveError:
    t, m = describe_exception(exc)
    who = "rank 0" if "rank 0" in group.store_desc else group.store_desc
    failures = {}
    if local is not None:
        failures[group.rank] = describe_exception(local, group.rank)
    if isinstance(exc, StoreStalled):
        note = (f"the coordination store {group.store_desc} stopped answering ({exc}): {who} "
                f"is stopped (SIGSTOP), hung or overloaded")
    else:
        note = (f"lost contact with the coordination store {group.store_desc}: {who} exited or "
                f"died ({t}: {m})")
    return _phase_error(phase, failures, [note], local)


def _agree_over_pg(name: str, group: Group, status: tuple, local) -> None:
    """Fallback without a store: one all_gather_object over the process group."""
    import torch.distributed as dist
    group._seq += 1
    gathered: list = [None] * group.world
    try:
        dist.all_gather_object(gathered, status, group=group.pg)
    except Exception as exc:  # noqa: BLE001
        t, m = describe_exception(exc)
        failures = {group.rank: describe_exception(local, group.rank)} if local else {}
        raise _phase_error(name, failures, [f"status exchange failed "
                           f"(a rank died or timed out after {group.timeout_s:g} s): {t}: {m}"],
                           local) from (local or exc)
    failures = {r: (s[2], s[3]) for r, s in enumerate(gathered) if not s[1]}
    failures.update({r: ("PhaseMismatch", f"is in phase {s[0]!r}, not {name!r}")
                     for r, s in enumerate(gathered) if s[1] and s[0] != name})
    if failures:
        raise _phase_error(name, failures, [], local) from local


# --------------------------------------------------------------------------- CLI

class _ExitOnError(contextlib.ContextDecorator):
    def __init__(self, rank, usage_errors, tool=None):
        self.rank = rank
        self.usage_errors = tuple(usage_errors)
        self.tool = tool

    def __enter__(self):
        return self

    def __exit__(self, et, exc, tb):
        if exc is None or isinstance(exc, SystemExit):
            return False
        rank = self.rank() if callable(self.rank) else self.rank
        if rank is None:
            rank = os.environ.get("RANK", "0")
        if isinstance(exc, KeyboardInterrupt):
            code, text = 130, "interrupted"
        else:
            code = 2 if self.usage_errors and isinstance(exc, self.usage_errors) else 1
            t, m = describe_exception(exc, _as_int(rank))
            # A CollectiveError already reads "phase X: rank 2: SaveError: ..."; anything
            # else is labelled with its type so the cause is never lost.
            text = m if isinstance(exc, CollectiveError) else f"{t}: {m}"
        if os.environ.get("COORDLOADER_DEBUG") == "1":
            traceback.print_exception(et, exc, tb, file=sys.stderr)
        who = f"coordloader {self.tool}" if self.tool else f"coordloader: rank {rank}"
        sys.stderr.write(f"{who}: {clip(text)}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        if _dist_initialised():
            # After a failed collective the process group's C++ destructors may abort
            # ("terminate called without an active exception", exit -6) or block on a
            # dead peer; the message is out, so leave with the promised code right now.
            os._exit(code)
        raise SystemExit(code)


def _dist_initialised() -> bool:
    if "torch.distributed" not in sys.modules:
        return False
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_initialized()
    except Exception:  # noqa: BLE001
        return False


def _as_int(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def exit_on_error(fn: Callable | None = None, *, rank=None, usage_errors=(), tool=None):
    """Entry-point guard: ``with exit_on_error(): ...`` or ``@exit_on_error``; the one
    error/exit policy of every coordloader command.

    Prints ``coordloader: rank R: <message>`` (one line; ``coordloader <tool>: <message>``
    for a single-process ``tool``) and exits 1; 2 for exceptions in ``usage_errors``; 130
    on KeyboardInterrupt. ``rank`` may be an int or a callable returning it (default:
    $RANK, else 0). COORDLOADER_DEBUG=1 adds the traceback.
    When torch.distributed is initialised it leaves with ``os._exit`` (after flushing):
    a broken process group's destructors can abort or hang at interpreter exit."""
    guard = _ExitOnError(rank, usage_errors, tool)
    if fn is None:
        return guard

    @functools.wraps(fn)
    def wrapper(*a, **k):
        with guard:
            return fn(*a, **k)
    return wrapper


def options_disagreement(seen, show: Callable[[Any], str] = repr) -> str:
    """Each rank's options (mappings: ``seen[r]``, or ``seen`` a mapping of rank to options
    where some ranks take no part), the ones that differ as "key: rank 0 v, ranks 1-3 w;
    ..." ('' when every rank's agree). Values are compared by repr (they need not be
    hashable) and written by ``show``."""
    by_rank = sorted(seen.items()) if isinstance(seen, Mapping) else list(enumerate(seen))
    diffs = []
    for key in sorted({k for _, d in by_rank for k in d}):
        by: dict[str, tuple[Any, list[int]]] = {}
        for r, d in by_rank:
            by.setdefault(repr(d.get(key)), (d.get(key), []))[1].append(r)
        if len(by) > 1:
            diffs.append(f"{key}: " + ", ".join(f"{format_ranks(rs)} {show(v)}"
                                                for v, rs in by.values()))
    return "; ".join(diffs)


def gather_object(group: "Group | None", value) -> list:
    """Every rank's ``value``, by rank (``all_gather_object`` over the group's process
    group); ``[value]`` without a group or in a world of one. Every rank must call it, so
    call it inside a phase or after one succeeded on every rank."""
    if group is None or group.world == 1:
        return [value]
    import torch.distributed as dist
    out: list = [None] * group.world
    dist.all_gather_object(out, value, group=group.pg)
    return out


def free_port() -> int:
    """A free TCP port on the loopback interface, for a rendezvous of processes started on
    this machine (tests, the bench, the docs' examples). The port is free when this returns;
    another process may still take it before the rendezvous binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["Group", "init_group", "wrap_group", "adopted", "run_phase", "exit_on_error",
           "describe_exception", "free_port", "gather_object", "DEFAULT_TIMEOUT_S", "DEFAULT_GRACE_S"]
