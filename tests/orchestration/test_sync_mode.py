"""`async.mode=sync` through the same driver loop: every trained token is on-policy
(staleness 0), and the loop's metrics (staleness histogram, idle fractions, samples/s)
are reported."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sync_mode_trains_only_fresh_tokens(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / "configs/cpu_smoke.yaml"),
           f"logging.output_dir={tmp_path}", "num_steps=3", "async.mode=sync", "async.max_staleness=0",
           "eval_before=false", "eval_after=false", "weight_sync.check=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = list(tmp_path.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    hist = summary["buffer"]["staleness_hist"]
    assert set(map(int, hist)) == {0} and sum(hist.values()) > 0  # every trained token: staleness 0
    for m in steps:
        assert m["buffer/staleness_max"] == 0
        assert m["buffer/staleness_hist/0"] == m["train/response_tokens"]
        assert not any(k.startswith("buffer/staleness_hist/") and k != "buffer/staleness_hist/0" for k in m)
        assert 0 <= m["perf/trainer_idle_frac"] <= 1 and 0 <= m["perf/engine_idle_frac"] <= 1
        assert m["perf/samples_per_s"] > 0
    assert summary["buffer"]["samples_dropped"] == 0
    assert summary["perf"]["perf/samples_per_s"] > 0
