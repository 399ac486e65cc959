import math

import pytest
import torch

from moe_async.trainer.advantages import compute_grpo_advantages
from moe_async.trainer.loss import grpo_token_loss


def test_advantages():
    a = compute_grpo_advantages([[1.0, 1.0, 1.0], [0.0, 1.0], [5.0], [], [2.0, 0.0, 1.0, 1.0]])
    assert a[0] == [0.0, 0.0, 0.0] and a[2] == [0.0] and a[3] == []
    assert a[1] == pytest.approx([-1.0, 1.0], abs=1e-5)
    std = math.sqrt(0.5)
    assert a[4] == pytest.approx([1 / (std + 1e-6), -1 / (std + 1e-6), 0.0, 0.0])
    with pytest.raises(ValueError):
        compute_grpo_advantages([[float("nan"), 1.0]])


def test_tis_cap_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    roll = torch.tensor([[-1.5, -0.5, -3.0]])
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = grpo_token_loss(logp, adv, mask, roll, tis_cap=1.5)
    w = [min(math.exp(-1.0 + 1.5), 1.5), min(math.exp(-2.0 + 0.5), 1.5)]  # 1.5 (capped), e^-1.5
    assert w[0] == 1.5
    assert loss.item() == pytest.approx(-2.0 * (w[0] + w[1]), rel=1e-6)
    assert m["tis_mean"].item() == pytest.approx((w[0] + w[1]) / 2, rel=1e-6)
    assert m["logp_diff_mean"].item() == pytest.approx((0.5 + 1.5) / 2)
    d = [0.5, -1.5]
    assert m["kl_k3"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 2, rel=1e-6)
    loss.backward()  # d/dlogp of -A*tis*ratio at ratio 1 = -A*tis
    assert logp.grad.tolist()[0] == pytest.approx([-2.0 * w[0], -2.0 * w[1], 0.0], rel=1e-6)


def test_asymmetric_clip():
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0])
    old = torch.log(torch.tensor([1 / 1.5, 1 / 0.5, 1 / 1.1, 1 / 0.9]))  # ratios 1.5, .5, 1.1, .9
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, m = grpo_token_loss(logp, adv, torch.ones(4), logp_old=old, off_policy_correction="none",
                              eps_clip=0.2, eps_clip_high=0.28)
    # pos adv clipped at 1.28, neg adv clipped at 0.8; in-range tokens unclipped
    assert loss.item() == pytest.approx(-1.28 + 0.8 - 1.1 + 0.9, rel=1e-5)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    assert m["tis_mean"].item() == 1.0


def test_errors():
    with pytest.raises(ValueError, match="rollout_logp"):
        grpo_token_loss(torch.zeros(2), torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError):
        grpo_token_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.zeros(2), off_policy_correction="x")
