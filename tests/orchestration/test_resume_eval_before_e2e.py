"""A run resumed with trainer.resume=auto and the held-out curve on keeps the first run's
step-0 point as summary.json's eval_before; the resumed step's point is eval_at_resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# `pytest -m slow` only (two smoke runs): the default run proves the parts, the step-0 record
# read back (test_report_eval.py::test_resumed_run_keeps_the_first_runs_step0_point_as_eval_before)
# and a trainer.resume=auto run continuing its run dir (test_preemption_resume.py)
@pytest.mark.slow
def test_resumed_run_keeps_the_step0_eval_before(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT),
           "MOE_ASYNC_RUN_ID": "evalbefore"}
    base = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
            f"logging.output_dir={tmp_path}", "trainer.resume=auto", "trainer.save_interval=2",
            "rollout.eval_interval=2", "eval_after=false", "logging.wandb_mode=disabled"]
    for steps in (2, 4):  # the second start resumes the first's step-2 checkpoint in the same run dir
        p = subprocess.run(base + [f"num_steps={steps}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    run_dir = tmp_path / "cpu_smoke-evalbefore"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start_step"] == 2
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step0,) = [r for r in recs if r["step"] == 0 and "eval/greedy_accuracy" in r]
    before = summary["eval_before"]
    assert before["step"] == 0 and before["accuracy"] == step0["eval/greedy_accuracy"]
    assert before["n"] == step0["eval/n"] and "accuracy" in summary["eval_at_resume"]
