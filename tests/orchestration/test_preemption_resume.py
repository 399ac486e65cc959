"""Pre-emption while the driver waits for a batch (C22), then resume: with
``MOE_ASYNC_SIGTERM=checkpoint`` a SIGTERM that reaches the driver while it waits for step 3's
batch (sync mode: generation waits for each update, so the driver waits after every step)
stops at once with the whole-run checkpoint of step 2 (weights, optimizer, version, data
position, draw ledger), exits 0, and leaves nothing running; the resumed run continues at
step 3 with version 3, and over both runs every train prompt drawn is trained once, dropped
with a reason, or pending (the ledger refuses a draw settled twice)."""

from __future__ import annotations

import json
import signal
import time
import uuid

from tests.orchestration._train_proc import launch_train, left_running
from tests.orchestration.test_resume import _train


def test_sigterm_while_waiting_for_a_batch_checkpoints_then_resume_continues(tmp_path) -> None:
    tag = uuid.uuid4().hex
    ckpt = tmp_path / "ckpt"
    proc, watchdog = launch_train(tmp_path / "a", tag, "num_steps=20", "async.mode=sync", "async.max_staleness=0",
                                  f"trainer.save_dir={ckpt}", "rollout.max_new_tokens=128",  # the driver waits seconds per batch
                                  MOE_ASYNC_SIGTERM="checkpoint")
    lines, t_sig = [], None
    for line in proc.stdout:
        lines.append(line)
        if t_sig is None and line.startswith("step   2/"):  # printed at the step's end
            time.sleep(1.0)  # past the after-step stop check: now it waits for step 3's batch
            proc.send_signal(signal.SIGTERM)
            t_sig = time.monotonic()
    rc = proc.wait(timeout=120)
    t_exit = time.monotonic()
    watchdog.cancel()
    out = "".join(lines)
    assert rc == 0, out[-4000:]
    assert "SIGTERM while waiting for the batch of step 3: stopped after step 2" in out, out[-3000:]
    assert t_exit - t_sig < 60, t_exit - t_sig  # well within a pre-emption grace
    assert not any(ln.startswith("step   3/") for ln in lines)
    # renamed from step_2.tmp; Megatron-LM's tracker and iter_0000002 (a symlink) name it too
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest", "latest_checkpointed_iteration.txt",
                                                     "moe_async_owner.json", "step_2"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert left_running(tag) == []  # nothing of the job left running
    (run_a,) = list((tmp_path / "a").iterdir())
    s1 = json.loads((run_a / "summary.json").read_text())
    assert s1["stopped_at_step"] == 2 and s1["last_checkpoint"] == str(ckpt / "step_2")
    extra = json.loads((ckpt / "step_2" / "moe_async_state.json").read_text())["extra"]
    rs = extra["run_state"]
    assert extra["step"] == 2 and rs["step"] == 2 and rs["weight_version"] == 2 and rs["max_staleness"] == 0
    assert rs["counts"]["trained"] == 2 * 2 and rs["frontier"] == 4 and rs["settled"] == {}  # sync: in order
    losses1 = [json.loads(x)["train/loss"] for x in (run_a / "metrics.jsonl").read_text().splitlines()]
    assert len(losses1) == 2

    s2, steps2 = _train(tmp_path / "b", "num_steps=3", "async.mode=sync", "async.max_staleness=0",
                        f"trainer.load={ckpt}",
                        "rollout.max_new_tokens=128",
                        f"trainer.save_dir={tmp_path / 'ckpt2'}", "trainer.save_interval=10")
    assert s2["start_step"] == 2 and s2["loaded_weights_digest"] == s1["final_weights_digest"]
    assert [m["step"] for m in steps2] == [3]
    assert [m["train/weight_version"] for m in steps2] == [3.0]
    assert all(abs(m["train/loss"]) < 1.0 for m in steps2)  # finite, the same scale as before the stop
    d = s2["draws"]  # the ledger over both runs: 3 steps x 2 prompts trained, each once
    assert d["counts"]["trained"] == 3 * 2 and d["frontier"] >= 6
    acc = s2["accounting"]
    assert acc["balanced"] and acc["trained"] == 1 * 2, acc
