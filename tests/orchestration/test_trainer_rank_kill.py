"""A trainer rank SIGKILLed mid-run (2-rank trainer, TP2): the run stops within 60 s naming the
rank, no process of the run is left (checked by PID), and a run resumed from the last
checkpoint continues at the next step and version.

`pytest -m slow` only: the default run kills a rank of a TP2 trainer (in its checkpoint write),
checks the run stops within 60 s naming it with every process gone, and resumes at TP2
(test_ckpt_crash_resume.py); the rank-death error and teardown as a unit:
test_trainer_group_unit.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.orchestration.test_resume import _train
from tests.orchestration.test_trainer_rank_fault import _alive, _descendants

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_killed_rank_stops_the_run_named_then_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path / 'a'}", "num_steps=20", "eval_before=false", "eval_after=false",
           "trainer.tensor_model_parallel_size=2", "trainer.save_interval=1", f"trainer.save_dir={ckpt}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(600, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    lines, seen, t_kill = [], {}, None
    for line in proc.stdout:
        lines.append(line)
        if t_kill is None and line.startswith("step   2/"):
            seen = _descendants(proc.pid)
            ranks = sorted(p for p, c in seen.items() if "TrainerActor" in c)
            os.kill(ranks[-1], signal.SIGKILL)  # the second rank actor started (rank 1, usually)
            t_kill = time.monotonic()
    rc = proc.wait(timeout=120)
    t_exit = time.monotonic()
    watchdog.cancel()
    out = "".join(lines)
    assert t_kill is not None and rc != 0, out[-4000:]
    assert t_exit - t_kill < 60, (t_exit - t_kill, out[-3000:])
    assert "died in" in out and "trainer rank" in out and "all 2 trainer ranks stopped" in out, out[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        time.sleep(0.5)
    assert not [(p, seen[p]) for p in seen if _alive(p)]  # every process of the run is gone
    last = int((ckpt / "latest").read_text().strip().removeprefix("step_"))
    assert last >= 2
    s2, steps2 = _train(tmp_path / "b", f"num_steps={last + 1}", f"trainer.load={ckpt}",
                        "trainer.tensor_model_parallel_size=2")
    assert s2["start_step"] == last and [m["step"] for m in steps2] == [last + 1]
    assert steps2[0]["train/weight_version"] == float(last + 1)
    assert s2["final_weights_match"] is True
    state = json.loads((ckpt / f"step_{last}" / "moe_async_state.json").read_text())["extra"]["run_state"]
    assert s2["draws"]["counts"]["trained"] == state["counts"]["trained"] + 2
