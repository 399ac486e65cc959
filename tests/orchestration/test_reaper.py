"""The reaper stops every process of a run whose driver died, including children started while
it was signalling (a process that ignores SIGTERM and keeps starting tagged children), and a
child whose tag is not visible (``setproctitle`` may overwrite what ``/proc/<pid>/environ``
reads) because it saw it under the driver; a PID reused by another process is not taken for
the run's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from moe_async.orchestration.reaper import TAG_VAR, _live, descendants, reap, tagged

_SPAWNER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("up", flush=True)
while True:
    subprocess.Popen(["sleep", "120"])
    time.sleep(0.005)
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the reaper needs Linux pidfds")
def test_children_started_during_the_kill_are_killed_too() -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_VAR: tag}
    driver = subprocess.Popen([sys.executable, "-c", "pass"], env=env)
    spawner = subprocess.Popen([sys.executable, "-c", _SPAWNER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert spawner.stdout is not None and spawner.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 30
        while len(tagged(tag)) < 20 and time.monotonic() < deadline:  # the spawner and its children
            time.sleep(0.05)
        driver.wait(30)
        signalled = reap(driver.pid, tag, grace_s=0.0)
        assert signalled >= 20
        assert tagged(tag) == []
        assert spawner.wait(10) == -9  # SIGTERM ignored, SIGKILLed
    finally:
        for pid in tagged(tag):
            os.kill(pid, 9)
        spawner.kill()


_DRIVER = """
import os, subprocess, sys
env = {k: v for k, v in os.environ.items() if k != sys.argv[1]}  # the child's tag is not visible
c = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "print(flush=True); time.sleep(120)"], env=env, stdout=subprocess.PIPE, text=True)
c.stdout.readline()
print(c.pid, flush=True)
c.wait()
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the reaper needs Linux pidfds")
def test_untagged_descendant_seen_under_the_driver_is_killed() -> None:
    tag = uuid.uuid4().hex
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, TAG_VAR], env={**os.environ, TAG_VAR: tag},
                              stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None
    child = int(driver.stdout.readline())
    try:
        assert tagged(tag) == [driver.pid]  # the child does not carry the tag
        out: list[int] = []
        th = threading.Thread(target=lambda: out.append(reap(driver.pid, tag, grace_s=0.5)))
        th.start()
        time.sleep(3.0)  # the reaper notes the driver's descendants every second
        driver.kill()
        driver.wait(10)
        th.join(60)
        assert out == [1]  # the child (SIGTERM ignored), SIGKILLed
        assert child not in _live()
    finally:
        try:
            os.kill(child, 9)
        except OSError:
            pass


def test_descendants_follow_parents_and_drop_reused_pids() -> None:
    live = {10: (1, 100.0), 11: (10, 200.0), 12: (11, 300.0), 13: (1, 400.0), 14: (13, 500.0)}
    assert descendants({10: 100.0}, live) == {10: 100.0, 11: 200.0, 12: 300.0}
    # 10 died and its PID was reused (another start time): neither it nor its children are the run's
    assert descendants({10: 100.0}, {10: (1, 999.0), 11: (10, 200.0)}) == {}
    # an orphan seen earlier (its parent gone, now under init) stays the run's, with its new child
    assert descendants({10: 100.0, 11: 200.0, 12: 300.0}, {12: (1, 300.0), 15: (12, 600.0)}) == {12: 300.0, 15: 600.0}
