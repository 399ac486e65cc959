"""C22 with the signal on one trainer rank only: a 2-rank trainer (TP2) under
``MOE_ASYNC_SIGTERM=checkpoint``; a SIGTERM to one rank actor's process while the driver waits
for a batch (sync mode, long generations) makes the driver stop every rank at the same step
boundary, write that step's whole-run checkpoint (each rank's part: both RNG files; renamed from
``step_<N>.tmp``; ``latest`` and Megatron-LM's tracker name it), exit 0 and leave no process of
the job (checked by PID); the run resumed from it continues at step N+1, version N+1."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid

import pytest

from tests.orchestration._train_proc import launch_train, left_running
from tests.orchestration.test_resume import _train
from tests.orchestration.test_trainer_rank_fault import _descendants


# `pytest -m slow` only: the default run proves checkpoint-then-stop on SIGTERM and the resume
# through the driver (test_preemption_resume.py) and under Slurm (tests/launch/test_slurm.py);
# the rank handler and the driver-then-ranks stop check are test_preemption_unit.py
@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_one_step_with_its_checkpoint(tmp_path) -> None:
    tag = uuid.uuid4().hex
    ckpt = tmp_path / "ckpt"
    proc, watchdog = launch_train(tmp_path / "a", tag, "num_steps=20", "async.mode=sync", "async.max_staleness=0",
                                  "trainer.tensor_model_parallel_size=2", f"trainer.save_dir={ckpt}",
                                  "rollout.max_new_tokens=128",  # the driver waits seconds per batch
                                  MOE_ASYNC_SIGTERM="checkpoint")
    lines, t_sig, victim = [], None, None
    for line in proc.stdout:
        lines.append(line)
        if t_sig is None and line.startswith("step   2/"):  # printed at the step's end
            ranks = sorted(p for p, c in _descendants(proc.pid).items() if "TrainerActor" in c)
            assert len(ranks) == 2, ranks
            victim = ranks[-1]
            time.sleep(1.0)  # past the after-step check: the driver waits for step 3's batch
            os.kill(victim, signal.SIGTERM)  # one rank only, not the driver
            t_sig = time.monotonic()
    rc = proc.wait(timeout=120)
    t_exit = time.monotonic()
    watchdog.cancel()
    out = "".join(lines)
    assert t_sig is not None and rc == 0, out[-4000:]
    assert t_exit - t_sig < 60, t_exit - t_sig  # well within a pre-emption grace
    got = re.search(r"\[moe-async\] trainer rank (\d): SIGTERM: the run checkpoints", out)
    assert got, out[-3000:]  # the signalled rank flagged it (and did not exit)
    rank = got.group(1)
    m = re.search(rf"SIGTERM on trainer rank {rank}(?: while waiting for the batch of step \d+)?: stopped after "
                  r"step (\d+), checkpoint (\S+)", out)
    assert m, out[-3000:]
    n = int(m.group(1))
    assert n >= 2 and m.group(2) == str(ckpt / f"step_{n}")
    assert not any(ln.startswith(f"step {n + 1:3d}/") for ln in lines)
    assert sorted(p.name for p in ckpt.iterdir()) == [f"iter_{n:07d}", "latest", "latest_checkpointed_iteration.txt",
                                                     "moe_async_owner.json", f"step_{n}"]  # renamed: no step_<N>.tmp left
    assert (ckpt / "latest").read_text().strip() == f"step_{n}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(n)
    assert sorted(p.name for p in (ckpt / f"step_{n}" / "moe_async_rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    state = json.loads((ckpt / f"step_{n}" / "moe_async_state.json").read_text())
    rs = state["extra"]["run_state"]
    assert state["version"] == n and state["extra"]["step"] == n and rs["step"] == n and rs["weight_version"] == n
    assert rs["counts"]["trained"] == n * 2  # 2 prompts a step, each settled once
    assert left_running(tag) == []  # nothing of the job left running, the signalled rank included
    (run_a,) = list((tmp_path / "a").iterdir())
    s1 = json.loads((run_a / "summary.json").read_text())
    assert s1["stopped_at_step"] == n

    s2, steps2 = _train(tmp_path / "b", f"num_steps={n + 1}", "async.mode=sync", "async.max_staleness=0",
                        f"trainer.load={ckpt}", "trainer.tensor_model_parallel_size=2",
                        f"trainer.save_dir={tmp_path / 'ckpt2'}")
    assert s2["start_step"] == n and [m["step"] for m in steps2] == [n + 1]
    assert s2["loaded_weights_digest"] == s1["final_weights_digest"]  # the stopped run's weights, bit for bit
    assert steps2[0]["train/weight_version"] == float(n + 1)
    assert s2["final_weights_match"] is True
    assert s2["draws"]["counts"]["trained"] == (n + 1) * 2
