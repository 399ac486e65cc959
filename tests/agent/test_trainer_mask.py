"""The trainer's micro-batches take a trajectory's ``loss_mask``: observation tokens carry no
loss and no rollout-logprob comparison (R3's mismatch metrics), padded and packed (THD)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_async.types import Sample


def _packer(thd: bool):
    from moe_async.replay.megatron import RouterReplayHook
    from moe_async.trainer.batching import Batcher
    from moe_async.trainer.config import TrainerConfig

    tf = SimpleNamespace(num_moe_experts=None, moe_router_topk=None, context_parallel_size=1)
    replay = RouterReplayHook(torch.nn.Linear(1, 1), tf, "off")  # a dense stand-in model
    return Batcher(TrainerConfig(micro_batch_size=2), 1000, replay, thd=thd, vpp=None)


@pytest.mark.parametrize("thd", [False, True])
def test_loss_mask_covers_only_sampled_tokens(thd):
    mask = [1, 1, 0, 0, 0, 1, 1, 1, 0, 1]
    traj = Sample(prompt_ids=[5, 6, 7], response_ids=list(range(100, 110)), rollout_logprobs=[-0.5] * 10,
                  weight_versions=[0] * 10, loss_mask=mask, loss_weight=1.0)
    plain = Sample(prompt_ids=[5, 6], response_ids=[9, 9, 9], rollout_logprobs=[-0.1] * 3, weight_versions=[0] * 3)
    (mb,) = _packer(thd).pack([traj, plain], advantages=[2.0, -1.0])
    # position t predicts token t+1: response token j at P-1+j
    want = torch.zeros(mb.loss_mask.shape[1])
    want[2:12] = torch.tensor(mask, dtype=torch.float32)
    assert mb.loss_mask[0].tolist() == want.tolist()
    assert mb.rollout_lp_mask[0].tolist() == want.tolist()
    assert mb.loss_mask[1, 1:4].tolist() == [1.0, 1.0, 1.0] and float(mb.loss_mask[1].sum()) == 3.0
    assert mb.advantages[0, 2:12].tolist() == [2.0] * 10  # the trajectory's advantage on every token; the mask selects
    assert int((mb.loss_mask > 0).sum()) == sum(mask) + 3  # what the step's token count normalises by


def test_mask_length_is_checked():
    s = Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[0.0, 0.0], weight_versions=[0, 0], loss_mask=[1])
    with pytest.raises(ValueError, match="loss_mask=1"):
        s.validate()


def test_snapshot_round_trip_keeps_the_mask():
    from moe_async.buffer.snapshot import sample_from_dict, sample_to_dict

    s = Sample(prompt_ids=[1], response_ids=[2, 3, 4], rollout_logprobs=[-1.0, 0.0, -2.0], weight_versions=[3, 3, 4],
               loss_mask=[1, 0, 1])
    d = sample_to_dict(s)
    assert sample_from_dict(d).loss_mask == [1, 0, 1]
    d.pop("loss_mask")  # a snapshot written before multi-turn samples
    assert sample_from_dict(d).loss_mask is None


def test_staleness_counts_sampled_tokens_only():
    """A trajectory's staleness is its oldest sampled token's; the histogram of trained
    tokens counts sampled tokens only (observations are not generated)."""
    from moe_async.buffer.buffer import RolloutBuffer
    from moe_async.types import Group

    s = Sample(prompt_ids=[1], response_ids=[2, 3, 4, 5], rollout_logprobs=[-1.0, 0.0, 0.0, -1.0],
               weight_versions=[4, 4, 4, 5], loss_mask=[1, 0, 0, 1])
    assert s.oldest_version == 4
    buf = RolloutBuffer(groups_per_step=1, max_staleness=1)
    assert buf.admit() is not None
    buf.put(Group(group_id=0, samples=[s], start_version=4))
    (g,) = buf.get_batch(5)
    assert g.samples[0] is s and dict(buf.staleness_hist) == {1: 1, 0: 1}


def test_step_metrics_count_sampled_tokens_and_report_agent_counters():
    from moe_async.orchestration.metrics import batch_metrics, loop_metrics
    from moe_async.types import Group

    s = Sample(prompt_ids=[1], response_ids=[2, 3, 4, 5], rollout_logprobs=[-1.0, 0.0, 0.0, -1.0],
               weight_versions=[4, 4, 4, 5], loss_mask=[1, 0, 0, 1])
    m = batch_metrics([Group(group_id=0, samples=[s])], trainer_version=5)
    assert m["buffer/staleness_hist/1"] == 1.0 and m["buffer/staleness_hist/0"] == 1.0
    assert m["buffer/staleness_mean"] == 0.5
    lm = loop_metrics({"drop_reasons": {}}, {"rollout/agent/turns": 6.0, "rollout/agent/tool_errors": 1.0}, {}, 1.0)
    assert lm["rollout/agent/turns"] == 6.0 and lm["rollout/agent/tool_errors"] == 1.0
