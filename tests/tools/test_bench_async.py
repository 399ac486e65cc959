"""tools/bench_async.py's reward-per-sample summary (pure function, no runs)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_async", ROOT / "tools/bench_async.py")
bench_async = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_async)


def test_reward_per_sample_weights_steps_by_generated_samples():
    # step 1: 8 samples at 0.25, step 2: 24 more at 0.75 -> mean (2 + 18) / 32 = 0.625
    steps = [{"reward_generated": 0.25, "samples_generated": 8.0},
             {"reward_generated": 0.75, "samples_generated": 32.0}]
    out = bench_async.reward_per_sample({"sync": {"steps": steps}, "fully_async": {"steps": [
        {"reward_generated": None, "samples_generated": None}]}})
    assert set(out) == {"sync"}  # a run without the metric is left out, not counted as 0
    r = out["sync"]
    assert r["n"] == 32 and r["mean"] == pytest.approx(0.625)
    assert r["se"] == pytest.approx((0.625 * 0.375 / 32) ** 0.5)
    assert r["curve"] == [0.25, 0.75] and r["samples"] == [8.0, 32.0]
