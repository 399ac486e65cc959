"""Per-step loop metrics: the reward per generated sample, which dynamic filtering and stale
drops do not bias (the trained batch's reward_mean is biased by them)."""

from moe_async.orchestration.metrics import batch_metrics, loop_metrics

_B = {"drop_reasons": {"stale": 1}}


def test_reward_mean_generated_counts_every_scored_sample():
    rm = {"rollout/reward_sum": 3.0, "rollout/samples_generated": 8.0, "rollout/samples_filtered": 4.0}
    m = loop_metrics(_B, rm, {}, 1.0)
    assert m["rollout/reward_mean_generated"] == 3.0 / 8.0
    assert m["rollout/samples_generated"] == 8.0 and m["rollout/reward_sum"] == 3.0
    assert m["buffer/dropped/stale"] == 1.0
    assert "rollout/reward_mean_generated" not in loop_metrics(_B, {"rollout/samples_generated": 0.0}, {}, 1.0)


class _S:
    def __init__(self, reward):
        self.reward, self.weight_versions, self.response_ids, self.reward_error = reward, [0], [1, 2], None


class _G:
    def __init__(self, rewards):
        self.samples = [_S(r) for r in rewards]


def test_filtered_batch_mean_differs_from_generated_mean():
    """A filter that drops an all-1 and an all-0 group leaves the batch at 0.5 whatever the
    policy's reward: 2 mixed groups [1,0,0,0], [1,1,1,0] + filtered [1]*4 and [0]*4 ->
    batch 0.5, generated 9/16."""
    batch = batch_metrics([_G([1, 0, 0, 0]), _G([1, 1, 1, 0])], trainer_version=0)
    assert batch["rollout/reward_mean"] == 0.5
    rm = {"rollout/reward_sum": 4.0 + 4.0 + 1.0, "rollout/samples_generated": 16.0}
    assert loop_metrics(_B, rm, {}, 1.0)["rollout/reward_mean_generated"] == 9 / 16
