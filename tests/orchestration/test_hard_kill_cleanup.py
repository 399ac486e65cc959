"""A hard kill leaves nothing running: ``kill -9`` of the driver of ``moe-async train`` in the
middle of a step (process-based reward workers on), and separately of its whole process
group; within 60 s no process the run started is alive (Ray's GCS, raylet and agents, the
actors' workers, the engine server, the reward worker processes and their resource tracker,
wandb's service), checked by PID: every process whose environment carries this test's tag,
and every descendant of the driver seen while it ran (psutil's process tree, the same PID and
start time: Ray's agents set their title over what ``/proc/<pid>/environ`` reads, so their
tag may not show); and a next run on the same machine starts cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "cpu_smoke.yaml"
GONE_WITHIN_S = 60.0


def _tagged(tag: str) -> dict[int, str]:
    """PID -> command line of every live (not zombie) process whose environment has the tag."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"MOE_ASYNC_TEST_TAG={tag}".encode() in env and state != "Z":
            out[int(pid)] = cmd
    return out


def _kinds(procs: dict[int, str]) -> set[str]:
    names = {"gcs_server": "gcs_server", "raylet": "raylet", "dashboard_agent": "agent",
             "runtime_env_agent": "agent", "moe_async.engines.embedded.server": "engine",
             "resource_tracker": "resource_tracker", "multiprocessing.spawn": "reward_worker",
             "ray::": "ray_worker", "default_worker.py": "ray_worker"}
    return {k for cmd in procs.values() for n, k in names.items() if n in cmd}


def _start(tmp: Path, tag: str) -> tuple[subprocess.Popen, Path]:
    runs = tmp / "runs"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MOE_ASYNC_RUN_ID")}
    env.update(MOE_ASYNC_TEST_TAG=tag, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1",
               RAY_AUTH_MODE="disabled")
    p = subprocess.Popen([sys.executable, "-m", "moe_async.cli", "train", str(SMOKE), "num_steps=40",
                          "eval_before=false", "eval_after=false", "rollout.reward_use_processes=true",
                          f"logging.output_dir={runs}"], env=env, cwd=ROOT, stdout=open(tmp / "out.log", "wb"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    return p, runs


def _tree(p: subprocess.Popen, tree: dict[int, float]) -> None:
    """Add the driver's live descendants (PID -> start time) to ``tree``."""
    try:
        for c in psutil.Process(p.pid).children(recursive=True):
            try:
                tree.setdefault(c.pid, c.create_time())
            except psutil.Error:
                pass
    except psutil.Error:
        pass


def _wait_mid_step(p: subprocess.Popen, runs: Path, tag: str, tree: dict[int, float],
                   timeout_s: float = 400.0) -> dict[int, str]:
    """Wait until step 1's metrics are written (step 2 under way), noting the driver's
    descendants in ``tree``; returns the run's tagged processes."""
    t0 = time.monotonic()
    seen: dict[int, str] = {}
    while time.monotonic() - t0 < timeout_s:
        assert p.poll() is None, f"the run exited ({p.returncode}) before its first step"
        seen.update(_tagged(tag))
        _tree(p, tree)
        m = list(runs.glob("*/metrics.jsonl"))
        if m and m[0].read_text().count("\n") >= 1:
            seen.update(_tagged(tag))
            _tree(p, tree)
            return seen
        time.sleep(0.5)
    raise AssertionError(f"no step within {timeout_s:.0f} s")


def _alive(tag: str, tree: dict[int, float]) -> dict[int, str]:
    """The tagged processes and the live members of ``tree`` (same start time): PID -> command line."""
    out = _tagged(tag)
    for pid, t in tree.items():
        try:
            q = psutil.Process(pid)
            if pid not in out and q.create_time() == t and q.status() != psutil.STATUS_ZOMBIE:
                out[pid] = " ".join(q.cmdline())[:200]
        except psutil.Error:
            pass
    return out


def _survivors(tag: str, tree: dict[int, float], within_s: float) -> dict[int, str]:
    t0 = time.monotonic()
    while _alive(tag, tree) and time.monotonic() - t0 < within_s:
        time.sleep(0.5)
    return _alive(tag, tree)


def _kill_all(tag: str, tree: dict[int, float]) -> None:
    for pid in _alive(tag, tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("what", ["driver", pytest.param("process_group", marks=pytest.mark.slow)])
def test_kill_9_leaves_nothing_running(tmp_path, what) -> None:
    tag = uuid.uuid4().hex
    p, runs = _start(tmp_path, tag)
    tree: dict[int, float] = {}
    try:
        seen = _wait_mid_step(p, runs, tag, tree)
        assert {"gcs_server", "raylet", "engine", "reward_worker", "ray_worker"} <= _kinds(seen), seen
        if what == "driver":
            os.kill(p.pid, signal.SIGKILL)
        else:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
        left = _survivors(tag, tree, GONE_WITHIN_S)
        assert left == {}, (f"alive {GONE_WITHIN_S:.0f} s after kill -9 of the {what}", left,
                            (tmp_path / "out.log").read_text()[-3000:])
    finally:
        _kill_all(tag, tree)
        if p.poll() is None:
            p.kill()
