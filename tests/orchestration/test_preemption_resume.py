"""Pre-emption while the driver waits for a batch, then resume: with
``MOE_ASYNC_SIGTERM=checkpoint`` a SIGTERM that reaches the driver while it waits for step 3's
batch (sync mode: generation waits for each update, and the run's reward takes seconds per
batch, so the driver waits after every step) stops at once with the whole-run checkpoint of
step 2 (weights, optimizer, version, data position, draw ledger), exits 0, and leaves nothing
running; the resumed run continues at step 3 with version 3, and over both runs every train
prompt drawn is trained once, dropped with a reason, or pending (the ledger refuses a draw
settled twice). The runs are conftest.py's ``sync_reference``, which test_trainer_group_e2e.py
also reads: their steps 1..4 are the 1-process reference the multi-rank runs equal, so there the
resumed step 3 equals the TP2 run's within 1e-5."""

from __future__ import annotations

import json

from tests.orchestration.conftest import PREEMPT_STEP, REF_STEPS


def test_sigterm_while_waiting_for_a_batch_checkpoints_then_resume_continues(sync_reference) -> None:
    a, b, ckpt = sync_reference["a"], sync_reference["b"], sync_reference["ckpt"]
    n, out = PREEMPT_STEP, a["out"]
    assert a["rc"] == 0, out[-4000:]
    assert f"SIGTERM while waiting for the batch of step {n + 1}: stopped after step {n}" in out, out[-3000:]
    assert a["exit_s"] < 60, a["exit_s"]  # well within a pre-emption grace
    assert not any(ln.startswith(f"step   {n + 1}/") for ln in a["lines"])
    # renamed from step_2.tmp; Megatron-LM's tracker and iter_0000002 (a symlink) name it too
    assert a["listing"] == [f"iter_{n:07d}", "latest", "latest_checkpointed_iteration.txt", "moe_async_owner.json",
                            f"step_{n}"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(n)
    assert a["left"] == []  # nothing of the job left running
    s1 = a["summary"]
    assert s1["stopped_at_step"] == n and s1["last_checkpoint"] == str(ckpt / f"step_{n}")
    extra = json.loads((ckpt / f"step_{n}" / "moe_async_state.json").read_text())["extra"]
    rs = extra["run_state"]
    assert extra["step"] == n and rs["step"] == n and rs["weight_version"] == n and rs["max_staleness"] == 0
    assert rs["counts"]["trained"] == n * 2 and rs["frontier"] == n * 2 and rs["settled"] == {}  # sync: in order
    assert [m["step"] for m in a["steps"]] == list(range(1, n + 1))

    s2, steps2 = b["summary"], b["steps"]
    assert s2["start_step"] == n and s2["loaded_weights_digest"] == s1["final_weights_digest"]
    assert [m["step"] for m in steps2] == list(range(n + 1, REF_STEPS + 1))
    assert [m["train/weight_version"] for m in steps2] == [float(s) for s in range(n + 1, REF_STEPS + 1)]
    assert all(abs(m["train/loss"]) < 1.0 for m in steps2)  # finite, the same scale as before the stop
    d = s2["draws"]  # the ledger over both runs: every step's 2 prompts trained, each once
    assert d["counts"]["trained"] == REF_STEPS * 2 and d["frontier"] >= REF_STEPS * 2
    acc = s2["accounting"]
    assert acc["balanced"] and acc["trained"] == (REF_STEPS - n) * 2, acc
