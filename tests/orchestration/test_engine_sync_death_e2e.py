"""An engine killed while a weight sync is in flight, on the CPU pipeline (cpu_smoke,
``engine.num_engines=2``; issue 19, "Sync failure"): the sync reports the lost engine instead
of failing the run, the engine is restarted, every live member and the replacement re-form the
update group and get the current weights, and the run completes. From the run's own counters:
one restart and one sync failure counted, both engines' per-tensor checksums equal the
trainer's at the end, no trained token older than max_staleness, every prompt drawn trained,
dropped with a reason or pending.

The kill lands mid-sync through the test-only hook ``MOE_ASYNC_ENGINE_SYNC_STALL=V:K:DIR``
(moe_async/engines/embedded/fault_hooks.py): the first engine to get its K-th update call while
it serves version V stalls there and writes its pid to ``DIR/stalled``; this test kills that pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.orchestration._train_proc import launch_train, left_running
from tests.orchestration.test_engine_death import _engine_pids


def _kill_when_stalled(stall_dir: Path, proc: subprocess.Popen, out: dict) -> None:
    """Wait for the stalled engine's pid file, check the pid is this run's engine, SIGKILL it."""
    f = stall_dir / "stalled"
    while proc.poll() is None:
        if f.is_file() and f.read_text().strip():
            pid = int(f.read_text().strip())
            out["engines"] = sorted(_engine_pids(proc.pid))
            if pid in out["engines"]:
                os.kill(pid, signal.SIGKILL)
                out["killed"] = pid
            return
        time.sleep(0.2)


# `pytest -m slow` only: the default run proves a killed engine restarted, re-joined and
# synced end to end (test_engine_recovery_e2e.py); an engine lost during the step sync is
# test_engine_recovery.py::test_engine_lost_during_the_step_sync_recovered_without_failing
@pytest.mark.slow
@pytest.mark.parametrize("senders", [(), ("trainer.world_size=2", "weight_sync.senders=all")],
                         ids=["one_sender", "every_rank_sends"])
def test_engine_killed_during_a_weight_sync_is_recovered_and_run_completes(tmp_path, senders):
    stall, out_dir, tag = tmp_path / "stall", tmp_path / "runs", f"syncdeath-{os.getpid()}"
    # the 2nd update call (bucket) of the sync from version 2 to 3: mid-sync (every_rank_sends:
    # that sync fails on every rank, which agree on the lost engine; each rank's SenderGroups
    # forms every sender's group again, fresh names, for the recovery's sync)
    proc, watchdog = launch_train(out_dir, tag, "num_steps=6", "engine.num_engines=2", *senders,
                                  MOE_ASYNC_ENGINE_SYNC_STALL=f"2:2:{stall}")
    kill: dict = {}
    killer = threading.Thread(target=_kill_when_stalled, args=(stall, proc, kill), daemon=True)
    killer.start()
    out = proc.stdout.read()
    rc = proc.wait(timeout=120)
    watchdog.cancel()
    killer.join(timeout=5)
    assert kill.get("killed") and len(kill["engines"]) == 2, (kill, out[-3000:])
    assert rc == 0, out[-5000:]
    assert left_running(tag) == []  # engines (the replacement too), ranks, Ray: all gone
    (run_dir,) = list(out_dir.iterdir())
    s = json.loads((run_dir / "summary.json").read_text())
    eng = s["engines"]
    # the sync of version 3 lost the engine; it was restarted once, none retired
    assert eng["engine/sync_failures"] == 1.0, eng
    assert eng["engine/restarts"] == 1.0 and eng["engine/retired"] == 0.0 and eng["engine/healthy"] == 2.0
    (dead_i,) = [i for i in (0, 1) if eng[f"engine/restarts/{i}"] == 1.0]
    assert any(e.startswith("weight sync of version 3 lost engine(s) ") for e in eng["events"]), eng["events"]
    assert any(e.startswith(f"engine {dead_i} at ") and "exited with code -9" in e and e.endswith("-> restart")
               for e in eng["events"]), eng["events"]
    assert any(f"engine {dead_i} at " in e and "rejoined at weight_version 3" in e for e in eng["events"])
    # the run completed; both engines hold the trainer's last weights and version
    assert s["final_weight_version"] == 6 and s["engine_weight_versions"] == [6, 6]
    assert s["engine_weights_match"] == [True, True] and s["final_weights_match"] is True
    # no trained token older than max_staleness (cpu_smoke: 1), every step
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "buffer/staleness_max" in r]
    assert len(steps) == 6 and max(r["buffer/staleness_max"] for r in steps) <= 1, steps
    assert steps[2]["engine/weight_version"] == 3.0  # step 3's sync reached every engine after the recovery
    # every prompt drawn: trained, dropped with a reason, or pending; none lost or twice
    acc = s["accounting"]
    assert acc["balanced"] and acc["drawn"] == acc["trained"] + acc["dropped"] + acc["pending"], acc
    assert acc["trained"] == 6 * 2  # 6 steps x prompts_per_step
    assert set(acc["dropped_by_reason"]) <= {"engine_lost", "stale"}, acc
