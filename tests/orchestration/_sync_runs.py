"""The seeded sync-mode runs that multi-rank runs are compared with step by step: their
overrides and the CLI call (``moe-async train configs/cpu_smoke.yaml``).

Every run: ``async.mode=sync``, seeded sampling (``rollout.sampling_seed``: the same batches
whatever the layout, engine count, timing or a resume in between), a reward that is not
constant on a random model's text (so GRPO advantages are not all 0), router replay R3, check
mode on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["async.mode=sync", "async.max_staleness=0", "eval_before=false", "eval_after=false",
          "rollout.sampling_seed=7", "rollout.reward=function",
          "rollout.reward_function=tests.orchestration._rewards:char_parity",
          "trainer.router_replay=R3", "rollout.return_routed_experts=true", "weight_sync.check=true"]
TOL = 1e-5  # |loss| and |grad norm| difference from the 1-process reference per step


def train(out: Path, *overrides: str, timeout: float = 600, **env: str) -> dict:
    """Run the CLI with :data:`COMMON` then ``overrides`` (``env`` added to its environment; exit
    0 asserted); returns summary, per-step metrics, stdout and wall seconds."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={out}", *COMMON, *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    (run_dir,) = list(out.iterdir())
    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "steps": [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()],
            "stdout": proc.stdout, "wall": wall}


def assert_steps_equal(steps: list[dict], reference: dict) -> None:
    """Each of ``steps`` (metrics.jsonl records) has the batch, loss and grad norm of the
    reference run's step of the same number (loss and grad norm within :data:`TOL`)."""
    ref = {m["step"]: m for m in reference["steps"]}
    assert steps
    for m in steps:
        a = ref[m["step"]]
        assert m["train/response_tokens"] == a["train/response_tokens"], (m["step"], m, a)
        assert m["rollout/reward_mean"] == a["rollout/reward_mean"], (m["step"], m, a)
        assert abs(m["train/loss"] - a["train/loss"]) <= TOL, (m["step"], m["train/loss"], a["train/loss"])
        assert abs(m["train/grad_norm"] - a["train/grad_norm"]) <= TOL, (m["step"], m["train/grad_norm"],
                                                                         a["train/grad_norm"])
