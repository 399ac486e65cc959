"""An engine that dies mid-run with no restart allowed (``engine.max_restarts=0``: retired at
once) leaves fewer than ``engine.min_healthy_engines`` healthy engines: the run stops with an
error naming it (index, URL, exit code, log; C21), the finished steps stay in metrics.jsonl,
and nothing is left running. The restart path: test_engine_recovery_e2e.py.

`pytest -m slow` only: the default run kills an engine mid-run end to end in
test_engine_recovery_e2e.py (the exit code in the event, the restart); the stop with no restarts
left, naming the engine, its URL, exit code, floor and cap, is the unit
test_engine_recovery.py::test_only_engine_dead_without_restarts_stops_the_run_naming_it, and
nothing left running after a failed run is test_ckpt_crash_resume.py."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _engine_pids(root_pid: int) -> set[int]:
    """Embedded engine servers among ``root_pid``'s descendants (this run's own: the Ray head
    and its workers are children of the driver, the engines children of an actor). Not a
    machine-wide pgrep: another run's engines on the same machine are not this test's."""
    import psutil

    try:
        kids = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    out = set()
    for k in kids:
        try:
            if "moe_async.engines.embedded.server" in " ".join(k.cmdline()):
                out.add(k.pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
def test_dead_engine_is_named(tmp_path):
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path}", "num_steps=40", "eval_before=false", "eval_after=false",
           "engine.max_restarts=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # a hung run must fail this test, not the whole suite: kill it after 600 s
    watchdog = threading.Timer(600, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    lines, killed = [], set()
    for line in proc.stdout:  # wait for the second step, then kill the engine
        lines.append(line)
        if line.startswith("step   2/"):
            killed = _engine_pids(proc.pid)
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            break
    out = "".join(lines) + proc.stdout.read()
    rc = proc.wait(timeout=120)
    watchdog.cancel()
    assert len(killed) == 1, (killed, out[-3000:])  # cpu_smoke has one engine
    assert rc != 0, out[-3000:]
    assert "engine 0 at http://127.0.0.1:" in out and "exited with code -9" in out, out[-3000:]
    assert "fewer than engine.min_healthy_engines=1" in out and "retired after 0 restart(s)" in out, out[-3000:]
    (run_dir,) = list(tmp_path.iterdir())
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 2
    time.sleep(2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in killed)
