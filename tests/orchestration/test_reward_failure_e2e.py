"""A reward function that never returns a number fails the whole run (exit status != 0) naming
the function and its last error, instead of training on zero rewards and exiting 0 (CPU smoke pipeline,
rollout.max_consecutive_reward_errors=12; a reward that never scored stops at one step's samples)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# `pytest -m slow` only: the default run proves rewards that never return a number stopping a
# run named, before any step trains, in tests/data/test_data_e2e.py (a function and a verl file);
# the counting and the message are tests/rollout/test_reward_failure.py
@pytest.mark.slow
def test_reward_that_never_returns_a_number_fails_the_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path}", "num_steps=20", "eval_before=false", "eval_after=false",
           "rollout.reward=function", "rollout.reward_function=tests.rollout._user_rewards:returns_text",
           "rollout.max_consecutive_reward_errors=12"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    # it never scored: stopped at one step's samples (2 prompts x 4), below the configured 12
    assert "RewardFailureError" in out and "failed on 8 samples in a row, every sample of the run so far" in out, \
        out[-3000:]
    assert "rollout.reward_function='tests.rollout._user_rewards:returns_text'" in out, out[-3000:]
    assert "returned 'high'" in out, out[-3000:]
    run_dir = next(tmp_path.glob("cpu_smoke-*"))
    steps = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    assert steps == [], steps  # no step trained on the failed rewards
