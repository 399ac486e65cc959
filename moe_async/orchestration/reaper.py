"""Fate-sharing for a local run: when the driver dies, however it dies (``kill -9`` included,
which runs no cleanup of its own), every process it started goes with it.

The driver tags its environment with :data:`TAG_VAR` before it starts the local Ray cluster;
every process of the run inherits it (Ray's GCS, raylet and agents, the actors' workers, the
engine servers, the reward worker processes). :func:`start` spawns this module as a separate
process in a session of its own (a signal to the driver's process group does not reach it); it
waits on the driver's pidfd and, once the driver has exited, gives the run ``grace_s`` to stop
by itself, then SIGTERMs and finally SIGKILLs every live process that carries the tag.
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

TAG_VAR = "MOE_ASYNC_RUN_TAG"


def tagged(tag: str) -> list[int]:
    """PIDs of the live (not zombie) processes whose environment holds ``TAG_VAR=tag``."""
    want, me, out = f"{TAG_VAR}={tag}".encode(), os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
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


def _signal_all(tag: str, sig: int, within_s: float) -> None:
    """Send ``sig`` to every tagged process, again to any that appears later (a child started
    while the others were signalled), until none is left or ``within_s`` seconds have passed."""
    end = time.monotonic() + within_s
    signalled: set[int] = set()
    while pids := tagged(tag):
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
    """Wait for ``driver_pid`` to exit, then stop what is left of the run; returns how many
    processes it had to signal."""
    try:
        fd = os.pidfd_open(driver_pid)
    except ProcessLookupError:
        fd = None
    if fd is not None:
        p = select.poll()
        p.register(fd, select.POLLIN)
        while not p.poll(1000):
            pass
        os.close(fd)
    deadline = time.monotonic() + grace_s  # a clean exit has already stopped everything
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.25)
    left = tagged(tag)
    _signal_all(tag, signal.SIGTERM, 3.0)
    _signal_all(tag, signal.SIGKILL, 10.0)
    return len(left)


if __name__ == "__main__":
    reap(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
