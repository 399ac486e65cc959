"""A trainer rank SIGKILLed in the middle of a checkpoint write, TP2 (the default run's end-to-end
trainer rank death and checkpoint crash): the test-only hook ``MOE_ASYNC_CKPT_STALL=0:2`` stops
trainer rank 0 in its second save after every file is in ``step_2.tmp`` and before the rename;
SIGKILL to that rank stops the run within 60 s naming the rank (every rank stopped, no process
of the run left, checked by PID and by tag). The previous checkpoint is intact (``latest``,
Megatron-LM's tracker and ``iter_0000001`` still name step 1, nothing named ``step_2``), a
resume at TP2 from the CLI continues from it (step 2, version 2), and its own save of step 2
replaces the partial ``step_2.tmp``. The rank-death logic as a unit: test_trainer_group_unit.py."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid

from tests.orchestration._train_proc import launch_train, left_running
from tests.orchestration.test_resume import _train
from tests.orchestration.test_trainer_rank_fault import _alive, _descendants


def test_sigkill_during_checkpoint_write_keeps_the_previous_one_and_resume_uses_it(tmp_path) -> None:
    tag = uuid.uuid4().hex
    ckpt = tmp_path / "ckpt"
    proc, watchdog = launch_train(tmp_path / "a", tag, "num_steps=20", "trainer.save_interval=1",
                                  f"trainer.save_dir={ckpt}", "trainer.tensor_model_parallel_size=2",
                                  MOE_ASYNC_CKPT_STALL="0:2", PYTHONUNBUFFERED="1")
    lines, seen, t_kill = [], {}, None
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"MOE_ASYNC_CKPT_STALL: trainer rank 0 \(pid (\d+)\) stalls in its save 2", line)
        if t_kill is None and m:
            tmp = ckpt / "step_2.tmp"
            # every file of step 2 written, not yet renamed; the previous checkpoint is the valid one
            assert (tmp / "metadata.json").is_file() and (tmp / "moe_async_state.json").is_file()
            assert (ckpt / "latest").read_text().strip() == "step_1"
            seen = _descendants(proc.pid)
            assert sum("TrainerActor" in c for c in seen.values()) >= 2, seen  # both TP ranks
            os.kill(int(m.group(1)), signal.SIGKILL)
            t_kill = time.monotonic()
    rc = proc.wait(timeout=120)
    t_exit = time.monotonic()
    watchdog.cancel()
    out = "".join(lines)
    assert t_kill is not None and rc != 0, out[-4000:]
    assert t_exit - t_kill < 60, (t_exit - t_kill, out[-3000:])
    assert "trainer rank 0 died in save_checkpoint" in out, out[-3000:]
    assert "all 2 trainer ranks stopped" in out, out[-3000:]
    assert left_running(tag) == []
    deadline = time.monotonic() + 30  # the run's reaper exits a few seconds after the driver
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        time.sleep(0.5)
    assert not [(p, seen[p]) for p in seen if _alive(p)]  # every process of the run is gone
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000001", "latest", "latest_checkpointed_iteration.txt",
                                                     "moe_async_owner.json", "step_1", "step_2.tmp"]
    assert (ckpt / "latest").read_text().strip() == "step_1"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    rs1 = json.loads((ckpt / "step_1" / "moe_async_state.json").read_text())["extra"]["run_state"]
    assert rs1["step"] == 1 and rs1["weight_version"] == 1 and rs1["counts"]["trained"] == 2

    # resume at TP2 from the save_dir (its latest: step_1) for one step, saving into the same directory
    s2, steps2 = _train(tmp_path / "b", "num_steps=2", f"trainer.load={ckpt}", "trainer.save_interval=1",
                        f"trainer.save_dir={ckpt}", "trainer.tensor_model_parallel_size=2")
    assert s2["resumed_from"] == str(ckpt / "step_1") and s2["start_step"] == 1
    assert [m["step"] for m in steps2] == [2]
    assert [m["train/weight_version"] for m in steps2] == [2.0]
    assert s2["final_weights_match"] is True
    assert s2["draws"]["counts"]["trained"] == 2 * 2  # step 1's prompts not trained again
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000001", "iter_0000002", "latest", "latest_checkpointed_iteration.txt",
        "moe_async_owner.json", "step_1", "step_2"]  # the partial step_2.tmp replaced by the resumed run's save
    assert (ckpt / "latest").read_text().strip() == "step_2"
    assert json.loads((ckpt / "step_2" / "moe_async_state.json").read_text())["extra"]["step"] == 2
