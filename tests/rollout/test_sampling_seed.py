"""rollout.sampling_seed: each request's sampling_seed from the seed, the prompt's draw and the
sample's index; none when unset or greedy. That the engines then repeat a run's batches is
checked end to end in tests/orchestration/test_trainer_group_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

from moe_async.rollout.config import RolloutConfig
from moe_async.rollout.manager import RolloutManager


def _mgr(seed):
    return SimpleNamespace(cfg=RolloutConfig(sampling_seed=seed), eos_token_ids=[2])


def test_seed_per_draw_and_sample():
    m = _mgr(7)
    seeds = {RolloutManager._sample_seed(m, key, i) for key in range(50) for i in range(4)}
    assert len(seeds) == 200  # distinct per (draw, sample)
    assert RolloutManager._sample_seed(m, 3, 1) == RolloutManager._sample_seed(_mgr(7), 3, 1)
    assert RolloutManager._sample_seed(m, 3, 1) != RolloutManager._sample_seed(_mgr(8), 3, 1)
    assert RolloutManager._sample_seed(_mgr(None), 3, 1) is None


def test_sampling_params_carry_the_seed_except_greedy():
    m = _mgr(7)
    assert RolloutManager._sampling_params(m, 8, False, 123)["sampling_seed"] == 123
    assert "sampling_seed" not in RolloutManager._sampling_params(m, 8, True, 123)
    assert "sampling_seed" not in RolloutManager._sampling_params(m, 8, False, None)


def test_draw_key_from_dataset_position():
    ds = SimpleNamespace(state_dict=lambda: {"epoch": 2, "pos": 5})
    m = SimpleNamespace(dataset=ds)
    assert RolloutManager._draw_key(m, SimpleNamespace(index=11)) == 2 * 1_000_003 + 11

