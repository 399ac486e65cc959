"""Runs shared by several test modules of this directory (each is one ``moe-async train``, the
costly part of these tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE_STEPS = 5


@pytest.fixture(scope="session")
def smoke_r3_run(tmp_path_factory):
    """``moe-async train configs/cpu_smoke.yaml num_steps=5 trainer.router_replay=R3`` (the smoke
    config otherwise as shipped: fully_async K=1, held-out eval before and after, wandb offline):
    (the finished process, its run dir, summary.json, the metrics.jsonl records). Read by
    test_e2e_smoke.py (the pipeline end to end) and test_e2e_report.py (``moe-async report``
    on it; R3 so that routing agreement is logged)."""
    out = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={out}", f"num_steps={SMOKE_STEPS}", "trainer.router_replay=R3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, run_dir, summary, steps
