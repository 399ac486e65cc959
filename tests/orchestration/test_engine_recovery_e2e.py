"""Engine failure live in the driver, on the CPU pipeline (cpu_smoke, ``engine.num_engines=2``):
an engine process SIGKILLed mid-run is restarted (supervisor policy), re-joins the update
group, receives the current weights, and serves again after acknowledging the version; the
run completes; every prompt drawn is trained, dropped with a reason or pending; both engines'
checksums equal the trainer's after the last sync (C19, C20, C21 end to end)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.orchestration.test_engine_death import _engine_pids

ROOT = Path(__file__).resolve().parents[2]


def test_killed_engine_restarted_rejoins_and_run_completes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path}", "num_steps=6", "eval_before=false", "eval_after=false",
           "engine.num_engines=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(600, proc.kill)  # a hung run fails this test, not the suite
    watchdog.daemon = True
    watchdog.start()
    lines, killed, pids = [], None, []
    for line in proc.stdout:
        lines.append(line)
        if killed is None and line.startswith("step   2/"):
            pids = sorted(_engine_pids(proc.pid))  # engine 1 starts second: the larger pid, usually
            killed = pids[-1]
            os.kill(killed, signal.SIGKILL)
    rc = proc.wait(timeout=120)
    watchdog.cancel()
    out = "".join(lines)
    assert len(pids) == 2, (pids, out[-3000:])
    assert rc == 0, out[-4000:]
    (run_dir,) = list(tmp_path.iterdir())
    s = json.loads((run_dir / "summary.json").read_text())
    eng = s["engines"]
    assert eng["engine/restarts"] == 1.0 and eng["engine/retired"] == 0.0 and eng["engine/healthy"] == 2.0
    (dead_i,) = [i for i in (0, 1) if eng[f"engine/restarts/{i}"] == 1.0]
    assert any(e.startswith(f"engine {dead_i} at ") and "exited with code -9" in e and e.endswith("-> restart")
               for e in eng["events"]), eng["events"]
    assert any(f"engine {dead_i} at " in e and "rejoined at weight_version" in e for e in eng["events"])
    # after the last sync both engines hold the trainer's weights and version
    assert s["final_weight_version"] == 6 and s["engine_weight_versions"] == [6, 6]
    assert s["engine_weights_match"] == [True, True] and s["final_weights_match"] is True
    # every prompt drawn: trained, dropped with a reason, or pending; none lost or twice
    acc = s["accounting"]
    assert acc["balanced"] and acc["drawn"] == acc["trained"] + acc["dropped"] + acc["pending"], acc
    assert acc["trained"] == 6 * 2  # 6 steps x prompts_per_step
    assert set(acc["dropped_by_reason"]) <= {"engine_lost", "stale"}, acc
    # the replacement served requests after it re-joined (routing only after the acknowledgement)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first_after = next(r for r in rows if r.get("engine/restarts") == 1.0)
    key = f"rollout/requests/{dead_i}"
    assert s["rollout"][key] > first_after[key], (s["rollout"][key], first_after[key])
    assert s["rollout"]["rollout/engine_request_retries"] >= 1.0  # its in-flight requests went elsewhere
