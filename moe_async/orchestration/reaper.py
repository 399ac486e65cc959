"""Fate-sharing for a local run: when the driver dies, however it dies (``kill -9`` included,
which runs no cleanup of its own), every process it started goes with it.

The driver tags its environment with :data:`TAG_VAR` before it starts the local Ray cluster;
every process of the run inherits it (Ray's GCS, raylet and agents, the actors' workers, the
engine servers, the reward worker processes). :func:`start` spawns this module as a separate
process in a session of its own (a signal to the driver's process group does not reach it); it
waits on the driver's pidfd, noting the driver's descendants every second, and, once the driver
has exited, gives the run ``grace_s`` to stop by itself, then SIGTERMs and finally SIGKILLs
every live process of the run: those that carry the tag, and those it saw under the driver (the
same PID and start time) with their children. The tag alone misses some: a process that sets
its title (``setproctitle``, as Ray's dashboard and runtime-env agents do) may overwrite the
memory ``/proc/<pid>/environ`` reads, and the driver's own helpers started before the tag
(wandb's service) never had it.
Linux only (``/proc``, ``os.pidfd_open``); elsewhere :func:`start` does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from typing import Callable

TAG_VAR = "MOE_ASYNC_RUN_TAG"


def _live() -> dict[int, tuple[int, float]]:
    """PID -> (parent PID, start time in clock ticks since boot) of every live (not zombie) process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            out[int(name)] = (int(fields[1]), float(fields[19]))
    return out


def tagged(tag: str, live: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """PIDs of the live (not zombie) processes (of ``live``, default: read now) whose
    environment holds ``TAG_VAR=tag``; never this process."""
    want, me, out = f"{TAG_VAR}={tag}".encode(), os.getpid(), []
    for pid in (_live() if live is None else live):
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    out.append(pid)
        except OSError:
            continue
    return out


def descendants(known: dict[int, float], live: dict[int, tuple[int, float]] | None = None) -> dict[int, float]:
    """The live members of ``known`` (PID -> start time) and every live process under one of them;
    a member that died, or whose PID now has another start time (reused), is dropped, with what
    hangs under such a PID."""
    live = _live() if live is None else live
    out = {pid: st for pid, st in known.items() if pid in live and live[pid][1] == st}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in live.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(out)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out[c] = live[c][1]
                todo.append(c)
    return out


def start(grace_s: float = 5.0) -> str | None:
    """Tag this (the driver's) environment and spawn the reaper watching this process; returns
    the tag, or None where pidfds are not available. Call before the local Ray starts."""
    if not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"):
        return None
    # a new tag per run: a run started by another run's process (a test, a sweep) inherits the
    # outer tag, and must reap only its own processes
    tag = os.environ[TAG_VAR] = uuid.uuid4().hex
    # a bare environment: the reaper is not one of the run's processes (no tag, nothing a test
    # or a site marks the run's processes with); it only needs to import this module
    env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME", "LANG") if k in os.environ}
    subprocess.Popen([sys.executable, "-m", "moe_async.orchestration.reaper", str(os.getpid()), tag, str(grace_s)],
                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True)
    return tag


def _signal_all(find: Callable[[], list[int]], sig: int, within_s: float) -> None:
    """Send ``sig`` to every process ``find()`` lists, again to any that appears later (a child
    started while the others were signalled), until none is left or ``within_s`` seconds have passed."""
    end = time.monotonic() + within_s
    signalled: set[int] = set()
    while pids := find():
        for pid in pids:
            if sig == signal.SIGKILL or pid not in signalled:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
                signalled.add(pid)
        if time.monotonic() >= end:
            return
        time.sleep(0.1)


def reap(driver_pid: int, tag: str, grace_s: float) -> int:
    """Wait for ``driver_pid`` to exit, then stop what is left of the run (its tagged processes
    and the descendants seen while it ran); returns how many processes it had to signal."""
    me = os.getpid()
    known: dict[int, float] = {}
    try:
        fd = os.pidfd_open(driver_pid)
    except ProcessLookupError:
        fd = None
    if fd is not None:
        if (st := _live().get(driver_pid)) is not None:
            known[driver_pid] = st[1]
        p = select.poll()
        p.register(fd, select.POLLIN)
        while not p.poll(1000):
            known = descendants(known)
        os.close(fd)

    def run_processes() -> list[int]:
        nonlocal known
        live = _live()
        known = descendants(known, live)
        return sorted((set(known) | set(tagged(tag, live))) - {me})

    deadline = time.monotonic() + grace_s  # a clean exit has already stopped everything
    while run_processes() and time.monotonic() < deadline:
        time.sleep(0.25)
    left = run_processes()
    _signal_all(run_processes, signal.SIGTERM, 3.0)
    _signal_all(run_processes, signal.SIGKILL, 10.0)
    return len(left)


if __name__ == "__main__":
    reap(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
