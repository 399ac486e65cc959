"""The reaper stops every process of a run whose driver died, including children started while
it was signalling (a process that ignores SIGTERM and keeps starting tagged children)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from moe_async.orchestration.reaper import TAG_VAR, reap, tagged

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
