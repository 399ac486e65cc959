"""An engine that dies mid-run is named (index, URL, exit code, log) in the driver's error,
the finished steps stay in metrics.jsonl, and nothing is left running."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _engine_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "moe_async.engines.embedded.server"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_dead_engine_is_named(tmp_path):
    before = set(_engine_pids())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path}", "num_steps=40", "eval_before=false", "eval_after=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # a hung run must fail this test, not the whole suite: kill it after 600 s
    watchdog = threading.Timer(600, proc.kill)
    watchdog.start()
    lines = []
    for line in proc.stdout:  # wait for the second step, then kill the engine
        lines.append(line)
        if line.startswith("step   2/"):
            for pid in set(_engine_pids()) - before:
                os.kill(pid, signal.SIGKILL)
            break
    out = "".join(lines) + proc.stdout.read()
    rc = proc.wait(timeout=120)
    watchdog.cancel()
    assert rc != 0, out[-3000:]
    assert "engine 0 at http://127.0.0.1:" in out and "exited with code -9" in out, out[-3000:]
    (run_dir,) = list(tmp_path.iterdir())
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 2
    time.sleep(2)
    assert set(_engine_pids()) - before == set()
