"""tools/bench_learning.py: the overrides both sides share are valid demo settings and match
the arguments (no runs: the benchmark itself takes tens of minutes)."""

import importlib.util
from pathlib import Path

from moe_async.config import load_config

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "tools/bench_learning.py")
bench_learning = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_learning)


def test_shared_overrides_are_valid_and_matched():
    import argparse

    a = argparse.Namespace(steps=24, seed=7, lr=5e-6, prompts=4, group=4, max_new_tokens=32, temperature=1.0,
                           k=4, filter=False, eval_size=48)
    cfg = load_config(ROOT / "configs/cpu_demo.yaml", bench_learning.overrides(a))
    r = cfg.rollout
    assert (cfg.num_steps, cfg.seed, cfg.trainer.lr) == (24, 7, 5e-6)
    assert (r.prompts_per_step, r.n_samples_per_prompt, r.max_new_tokens, r.eval_max_new_tokens) == (4, 4, 32, 32)
    assert r.temperature == 1.0 and r.eval_k == 4 and r.eval_size == 48
    assert r.dynamic_filter is False  # the same number of samples generated as trained, as TRL
    assert r.top_p == 1.0 and r.top_k == -1  # TRL side: top_p=1, top_k=0 (off)
