"""A trainer rank SIGKILLed in the middle of a checkpoint write, TP2 with 2 engines (the default
run's end-to-end trainer rank death and checkpoint crash; the runs are conftest.py's
``tp2_crash_resume``, whose TP2 training test_trainer_group_e2e.py compares with 1 process):
the test-only hook ``MOE_ASYNC_CKPT_STALL=0:2`` stops trainer rank 0 in its second save after
every file is in ``step_2.tmp`` and before the rename; SIGKILL to that rank stops the run
within 60 s naming the rank (every rank stopped, no process of the run left, checked by PID
and by tag). The previous checkpoint is intact (``latest``, Megatron-LM's tracker and
``iter_0000001`` still name step 1, nothing named ``step_2``), a resume at TP2 from the CLI
continues from it (steps 2 and 3, versions 2 and 3), and its own save of step 2 replaces the
partial ``step_2.tmp``. The rank-death logic as a unit: test_trainer_group_unit.py."""

from __future__ import annotations

import json

from tests.orchestration.conftest import CRASH_STEPS


def test_sigkill_during_checkpoint_write_keeps_the_previous_one_and_resume_uses_it(tp2_crash_resume) -> None:
    r = tp2_crash_resume
    ckpt, out, seen = r["ckpt"], r["out"], r["seen"]
    # at the stall: every file of step 2 written, not yet renamed; the previous checkpoint is the valid one
    assert r["at_stall"], out[-4000:]
    assert {"metadata.json", "moe_async_state.json"} <= set(r["at_stall"]["files"]), r["at_stall"]
    assert r["at_stall"]["latest"] == "step_1"
    assert sum("TrainerActor" in c for c in seen.values()) >= 2, seen  # both TP ranks
    assert r["rc"] != 0, out[-4000:]
    assert r["exit_s"] < 60, (r["exit_s"], out[-3000:])
    assert "trainer rank 0 died in save_checkpoint" in out, out[-3000:]
    assert "all 2 trainer ranks stopped" in out, out[-3000:]
    assert r["left"] == []
    assert r["alive"] == []  # every process of the run is gone
    assert r["listing_a"] == ["iter_0000001", "latest", "latest_checkpointed_iteration.txt",
                              "moe_async_owner.json", "step_1", "step_2.tmp"]
    assert r["latest_a"] == "step_1" and r["tracker_a"] == "1"
    rs1 = json.loads((ckpt / "step_1" / "moe_async_state.json").read_text())["extra"]["run_state"]
    assert rs1["step"] == 1 and rs1["weight_version"] == 1 and rs1["counts"]["trained"] == 2

    # resume at TP2 from the save_dir (its latest: step_1), saving into the same directory
    s2, steps2 = r["b"]["summary"], r["b"]["steps"]
    assert r["b"]["left"] == []
    assert s2["resumed_from"] == str(ckpt / "step_1") and s2["start_step"] == 1
    assert [m["step"] for m in steps2] == list(range(2, CRASH_STEPS + 1))
    assert [m["train/weight_version"] for m in steps2] == [float(s) for s in range(2, CRASH_STEPS + 1)]
    assert s2["final_weights_match"] is True
    assert s2["draws"]["counts"]["trained"] == CRASH_STEPS * 2  # step 1's prompts not trained again
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "latest", "latest_checkpointed_iteration.txt",
        "moe_async_owner.json", "step_1", "step_2", "step_3"]  # the partial step_2.tmp replaced by the resumed run's save
    assert (ckpt / "latest").read_text().strip() == "step_3"
    assert json.loads((ckpt / "step_2" / "moe_async_state.json").read_text())["extra"]["step"] == 2
