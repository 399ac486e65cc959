"""A trainer rank that raises fails `moe-async train` within 60 s, naming the rank, and leaves
no process of the run behind (checked by PID).

The fault is the test-only hook of moe_async/orchestration/trainer_group.py:
``MOE_ASYNC_TRAINER_FAULT=1:train_step:2`` makes rank 1 of a TP2 trainer raise in its second
train step, while rank 0 enters the step's collectives and would wait there for rank 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> dict[int, str]:
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for k in kids:
        try:
            out[k.pid] = " ".join(k.cmdline())[:120]
        except psutil.Error:
            pass
    return out


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# `pytest -m slow` only: the default run proves a failing trainer rank stopping the run named,
# with nothing left, through a SIGKILLed rank (test_ckpt_crash_resume.py); the hook's parsing
# and a raising rank's error are test_trainer_group_unit.py
@pytest.mark.slow
def test_raising_rank_fails_the_run_named_and_nothing_left(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT),
           "MOE_ASYNC_TRAINER_FAULT": "1:train_step:2"}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path}", "num_steps=6", "eval_before=false", "eval_after=false",
           "trainer.tensor_model_parallel_size=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(600, proc.kill)  # a hung run fails this test, not the suite
    watchdog.daemon = True
    watchdog.start()
    lines, seen, t_step1 = [], {}, None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step   1/") and t_step1 is None:
            t_step1 = time.monotonic()  # step 2 (the fault) starts now
            seen = _descendants(proc.pid)
            break
    out = "".join(lines) + proc.stdout.read()
    rc = proc.wait(timeout=120)
    t_exit = time.monotonic()
    watchdog.cancel()
    assert t_step1 is not None, out[-4000:]
    assert rc != 0, out[-3000:]
    assert t_exit - t_step1 < 60, (t_exit - t_step1, out[-3000:])
    assert "trainer rank 1 failed in train_step: RuntimeError: injected fault (MOE_ASYNC_TRAINER_FAULT)" in out, out[-3000:]
    assert "all 2 trainer ranks stopped" in out
    ranks = [p for p, c in seen.items() if "TrainerActor" in c]
    engines = [p for p, c in seen.items() if "moe_async.engines.embedded.server" in c]
    assert len(ranks) == 2 and len(engines) == 1, seen
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        time.sleep(0.5)
    assert not [(p, seen[p]) for p in seen if _alive(p)]  # every process of the run is gone
