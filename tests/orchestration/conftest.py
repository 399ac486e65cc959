"""Runs shared by several test modules of this directory (each is one ``moe-async train``, the
costly part of these tests)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid

import pytest
from _launch import finished_train

SMOKE_STEPS = 5
SMOKE_SAVE_INTERVAL = 3  # the smoke run saves steps 3 (its interval) and 5 (its last step)
CRASH_STEPS = 3  # the TP2 pair below trains steps 1..CRASH_STEPS over its two runs
REF_STEPS = 4  # the 1-process reference trains steps 1..REF_STEPS over its two runs
PREEMPT_STEP = 2  # ... the first of them pre-empted after this step


@pytest.fixture(scope="session")
def smoke_r3_run(tmp_path_factory):
    """``moe-async train configs/cpu_smoke.yaml num_steps=5 trainer.router_replay=R3
    trainer.save_interval=3 trainer.save_dir=ckpt`` run in a fresh directory (the smoke config
    otherwise as shipped: fully_async K=1, held-out eval before and after, wandb offline; the
    run dir under ``<dir>/runs``, the checkpoints of steps 3 and 5 in ``<dir>/ckpt``, the
    relative save_dir resolved against the driver's cwd): (the finished process, its run dir,
    summary.json, the metrics.jsonl records). Read by test_e2e_smoke.py (the pipeline end to
    end), test_e2e_report.py (``moe-async report`` on it; R3 so that routing agreement is
    logged) and test_resume.py (the saved run its resumed run continues). Each save waits until a
    finished group is buffered (the test hook ``MOE_ASYNC_CKPT_WAIT_BUFFERED=1``): generation is
    the smoke run's bottleneck, and the resume checks need a save with groups generated ahead."""
    tmp = tmp_path_factory.mktemp("smoke")
    return finished_train(tmp / "runs", f"num_steps={SMOKE_STEPS}", "trainer.router_replay=R3",
                          f"trainer.save_interval={SMOKE_SAVE_INTERVAL}", "trainer.save_dir=ckpt", cwd=tmp,
                          env_extra={"MOE_ASYNC_CKPT_WAIT_BUFFERED": "1"})


@pytest.fixture(scope="session")
def sync_reference(tmp_path_factory) -> dict:
    """The 1-process, 1-engine seeded sync run (``_sync_runs.COMMON``) of ``REF_STEPS`` steps that
    the multi-rank runs equal step by step, in two parts (seeded sampling: the same batches across
    a resume), shared by test_preemption_resume.py and test_trainer_group_e2e.py:

    - ``a``: ``MOE_ASYNC_SIGTERM=checkpoint``, no interval saves into ``ckpt``, scored by
      ``_rewards.char_parity_slow`` (the same rewards, about 3 s per batch); SIGTERM 1 s after
      step 2's console line, while the driver waits for step 3's batch: it stops after step 2
      with that step's checkpoint and exits (its output, exit code, seconds from the signal to
      its exit, summary, metrics, the checkpoint dir's listing; what is left running);
    - ``b``: resumed from ``ckpt`` (its latest: step 2) for steps 3..``REF_STEPS``.

    ``steps``: a's steps then b's (the reference's steps 1..REF_STEPS)."""
    from tests.orchestration._sync_runs import COMMON, train
    from tests.orchestration._train_proc import launch_train, left_running

    tmp = tmp_path_factory.mktemp("ref")
    ckpt, tag = tmp / "ckpt", uuid.uuid4().hex
    slow = [o for o in COMMON if not o.startswith("rollout.reward_function=")]
    proc, watchdog = launch_train(tmp / "a", tag, *slow, "rollout.reward_function=tests.orchestration._rewards:"
                                  "char_parity_slow", "num_steps=20", f"trainer.save_dir={ckpt}",
                                  MOE_ASYNC_SIGTERM="checkpoint", PYTHONUNBUFFERED="1")
    lines, t_sig = [], None
    for line in proc.stdout:
        lines.append(line)
        if t_sig is None and line.startswith(f"step   {PREEMPT_STEP}/"):  # printed at the step's end
            time.sleep(1.0)  # past the after-step stop check: now it waits for the next batch
            proc.send_signal(signal.SIGTERM)
            t_sig = time.monotonic()
    rc = proc.wait(timeout=120)
    exit_s = time.monotonic() - t_sig if t_sig is not None else None
    watchdog.cancel()
    a = {"out": "".join(lines), "lines": lines, "rc": rc, "exit_s": exit_s, "left": left_running(tag),
         "listing": sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []}
    runs = list((tmp / "a").iterdir())
    if rc == 0 and len(runs) == 1:
        a["summary"] = json.loads((runs[0] / "summary.json").read_text())
        a["steps"] = [json.loads(x) for x in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert rc == 0 and "summary" in a, a["out"][-4000:]
    b = train(tmp / "b", f"num_steps={REF_STEPS}", f"trainer.load={ckpt}")
    return {"ckpt": ckpt, "a": a, "b": b, "steps": a["steps"] + b["steps"]}


@pytest.fixture(scope="session")
def tp2_crash_resume(tmp_path_factory) -> dict:
    """Two TP2 runs with 2 engines (``_sync_runs.COMMON``: seeded sync, R3), shared by
    test_ckpt_crash_resume.py and test_trainer_group_e2e.py:

    - ``a``: saves every step into ``ckpt``; the test-only hook ``MOE_ASYNC_CKPT_STALL=0:2``
      stops trainer rank 0 in its second save after every file is in ``step_2.tmp``, and the
      fixture SIGKILLs that rank there (what it saw then in ``at_stall``; the run's output,
      exit code, seconds from the kill to its exit, and its processes then in ``seen``);
    - ``b``: a TP2 resume with 2 engines from ``ckpt`` (its latest: step 1) up to step
      ``CRASH_STEPS``, saving every step into the same directory.

    Run a's step 1 and run b's steps 2..3 are the TP2 training compared with the 1-process
    reference."""
    from tests.orchestration._sync_runs import COMMON, train
    from tests.orchestration._train_proc import launch_train, left_running
    from tests.orchestration.test_resume import _procs_with_tag
    from tests.orchestration.test_trainer_rank_fault import _alive, _descendants

    tmp = tmp_path_factory.mktemp("tp2")
    ckpt = tmp / "ckpt"
    tag = uuid.uuid4().hex
    tp2 = ["trainer.tensor_model_parallel_size=2", "engine.num_engines=2", "trainer.save_interval=1",
           "logging.wandb_mode=disabled",
           f"trainer.save_dir={ckpt}"]
    proc, watchdog = launch_train(tmp / "a", tag, *COMMON, "num_steps=20", *tp2,
                                  MOE_ASYNC_CKPT_STALL="0:2", PYTHONUNBUFFERED="1")
    lines, seen, at_stall, t_kill = [], {}, {}, None
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"MOE_ASYNC_CKPT_STALL: trainer rank 0 \(pid (\d+)\) stalls in its save 2", line)
        if t_kill is None and m:
            part = ckpt / "step_2.tmp"
            at_stall = {"files": sorted(p.name for p in part.iterdir()),
                        "latest": (ckpt / "latest").read_text().strip()}
            seen = _descendants(proc.pid)
            os.kill(int(m.group(1)), signal.SIGKILL)
            t_kill = time.monotonic()
    rc = proc.wait(timeout=120)
    exit_s = time.monotonic() - t_kill if t_kill is not None else None
    watchdog.cancel()
    left = left_running(tag)
    deadline = time.monotonic() + 30  # the run's reaper exits a few seconds after the driver
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        time.sleep(0.5)
    alive = [(p, seen[p]) for p in seen if _alive(p)]
    (run_a,) = list((tmp / "a").iterdir())
    steps_a = [json.loads(x) for x in (run_a / "metrics.jsonl").read_text().splitlines()]
    listing_a = sorted(p.name for p in ckpt.iterdir())
    latest_a = (ckpt / "latest").read_text().strip()
    tracker_a = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()

    tag_b = uuid.uuid4().hex
    b = train(tmp / "b", f"num_steps={CRASH_STEPS}", f"trainer.load={ckpt}", *tp2, MOE_ASYNC_TEST_TAG=tag_b)
    b["left"] = _procs_with_tag(tag_b)  # engines, Ray workers and raylet all gone
    return {"ckpt": ckpt, "out": "".join(lines), "rc": rc, "exit_s": exit_s, "seen": seen, "at_stall": at_stall,
            "left": left, "alive": alive, "steps_a": steps_a, "listing_a": listing_a, "latest_a": latest_a,
            "tracker_a": tracker_a, "b": b}
