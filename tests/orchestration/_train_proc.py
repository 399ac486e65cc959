"""A `moe-async train` run of the smoke config as a child process that a fault test watches line
by line (signals, kills), and the check that nothing of it is left running."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.orchestration.test_resume import SMOKE, _procs_with_tag

ROOT = Path(__file__).resolve().parents[2]


def launch_train(out: Path, tag: str, *overrides: str, **env: str) -> tuple[subprocess.Popen, threading.Timer]:
    """Start the run (output under ``out``; every process tagged ``MOE_ASYNC_TEST_TAG=tag``; ``env``
    added to the environment) with a 600 s watchdog that kills it; stdout+stderr as text lines.
    Cancel the returned watchdog once the run has exited."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "MOE_ASYNC_TEST_TAG": tag,
                "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(SMOKE), f"logging.output_dir={out}",
           "eval_before=false", "eval_after=false", "logging.wandb_mode=disabled", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(600, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    return proc, watchdog


def left_running(tag: str, within_s: float = 30.0) -> list[int]:
    """The PIDs tagged ``tag`` still alive after waiting up to ``within_s`` s for them to go."""
    deadline = time.monotonic() + within_s
    while _procs_with_tag(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _procs_with_tag(tag)
