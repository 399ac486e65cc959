"""The learning test's toy reward: the fraction of the response's characters in a-m."""

from moe_async.config import load_config
from moe_async.rollout.rewards import FunctionReward
from moe_async.rollout.tasks import Problem
from moe_async.rollout.toy_rewards import first_half_letters


def test_fraction_of_a_to_m_characters():
    assert first_half_letters("abcz") == 0.75
    assert first_half_letters("mn") == 0.5  # m is in, n is not
    assert first_half_letters("ABC 12") == 0.0  # lowercase only
    assert first_half_letters("") == 0.0


def test_named_by_the_config_as_a_function_reward():
    path = "moe_async.rollout.toy_rewards:first_half_letters"
    cfg = load_config("configs/cpu_smoke.yaml", ["rollout.reward=function", f"rollout.reward_function={path}"])
    r = FunctionReward(cfg.rollout.reward_function)
    assert r(Problem("q", "7", {}), "aaz") == 2 / 3
