"""Off-policy corrections of the GRPO loss (trainer/loss.py), hand-computed values, and C11."""

import math
from pathlib import Path

import pytest
import torch

from moe_async.config import ConfigError, load_config
from moe_async.trainer.loss import OFF_POLICY_CORRECTIONS, grpo_token_loss, off_policy_weight

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
e = math.exp

# two sequences (rows), 3 positions; the last position of row 0 is padding
LOGP = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]]
ROLL = [[-1.5, -0.5, -3.0], [-1.2, -0.8, -1.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
ADV = [[2.0], [-1.0]]
# d = logp_old - rollout = [[0.5, -1.5, (2.5)], [0.2, -0.2, 0.0]]


def _run(corr, **kw):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    loss, m = grpo_token_loss(logp, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64),
                              torch.tensor(ROLL, dtype=torch.float64), off_policy_correction=corr, **kw)
    loss.backward()
    return loss.item(), m, logp.grad


def _expect(w):
    """At ratio 1 (logp_old = logp) the loss is sum(-A * w * mask) and d loss / d logp = -A * w."""
    loss = -2.0 * (w[0][0] + w[0][1]) + 1.0 * sum(w[1])
    grad = [[-2.0 * w[0][0], -2.0 * w[0][1], 0.0], [1.0 * x for x in w[1]]]
    return loss, grad


@pytest.mark.parametrize(
    "corr, kw, w, masked",
    [
        ("none", {}, [[1, 1], [1, 1, 1]], 0),
        ("tis", {"tis_cap": 1.5}, [[1.5, e(-1.5)], [e(0.2), e(-0.2), 1.0]], 0),
        # geometric mean per row: row 0 exp((0.5 - 1.5) / 2), row 1 exp(0)
        ("tis_seq", {"tis_cap": 1.5}, [[e(-0.5), e(-0.5)], [1.0, 1.0, 1.0]], 0),
        ("tis_seq", {"tis_cap": 0.5}, [[0.5, 0.5], [0.5, 0.5, 0.5]], 0),
        # token band [0.5, 2]: e^-1.5 = 0.223 rejected
        ("mis", {"mis_low": 0.5, "mis_high": 2.0}, [[e(0.5), 0.0], [e(0.2), e(-0.2), 1.0]], 1),
        # sequence band [0.8, 1.5]: row 0 (e^-0.5 = 0.61) rejected whole, row 1 (1.0) kept
        ("mis_seq", {"mis_low": 0.8, "mis_high": 1.5}, [[0.0, 0.0], [1.0, 1.0, 1.0]], 2),
        # IcePop beta 1.5: band [0.667, 1.5]; e^0.5 = 1.65 and e^-1.5 = 0.22 get no gradient
        ("icepop", {"icepop_beta": 1.5}, [[0.0, 0.0], [e(0.2), e(-0.2), 1.0]], 2),
        # OPSM: row 0 has KL 0.5 > delta but A > 0 (kept); row 1 KL = 0 (kept) -> plain TIS
        ("opsm", {"tis_cap": 1.5, "opsm_delta": 0.1}, [[1.5, e(-1.5)], [e(0.2), e(-0.2), 1.0]], 0),
    ],
)
def test_corrections_by_hand(corr, kw, w, masked):
    loss, m, grad = _run(corr, **kw)
    want_loss, want_grad = _expect(w)
    assert loss == pytest.approx(want_loss, rel=1e-9)
    assert grad.tolist() == [pytest.approx(g, rel=1e-9, abs=1e-12) for g in want_grad]
    assert m["is_masked_frac"].item() == pytest.approx(masked / 5)
    assert m["tis_mean"].item() == pytest.approx((sum(w[0]) + sum(w[1])) / 5)


def test_opsm_masks_only_negative_advantage_off_policy_sequences():
    # row KLs (mean of rollout - logp): row 0: (0.3 + 0.3) / 2 = 0.3; row 1: 0.3; row 2: 0.0
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    roll = torch.tensor([[-0.7, -0.7], [-0.7, -0.7], [-1.0, -1.0]])
    adv = torch.tensor([[1.0], [-1.0], [-1.0]])
    loss, m = grpo_token_loss(logp, adv, torch.ones(3, 2), roll, off_policy_correction="opsm",
                              opsm_delta=0.2, tis_cap=10.0)
    w0 = e(-0.3)  # token TIS weight exp(logp_old - rollout) = e^-0.3
    # row 0 kept (A > 0), row 1 masked (A < 0, KL 0.3 > 0.2), row 2 kept (KL 0 <= 0.2)
    assert loss.item() == pytest.approx(-2 * w0 + 2 * 1.0, rel=1e-6)
    assert m["is_masked_frac"].item() == pytest.approx(2 / 6)
    loss.backward()
    assert logp.grad[1].tolist() == [0.0, 0.0]
    # delta above the KL: nothing masked
    _, m = grpo_token_loss(logp.detach(), adv, torch.ones(3, 2), roll, off_policy_correction="opsm", opsm_delta=0.31)
    assert m["is_masked_frac"].item() == 0.0


def test_c11_truncated_weight_uses_logp_old_not_current_logp():
    """C11: sample from version v-2, trainer at v: w = min(exp(logp_old - logp_rollout), C) per token."""
    logp = torch.tensor([-1.0, -1.0, -1.0])
    old = torch.tensor([-0.4, -2.0, -1.1])   # proximal / old policy
    roll = torch.tensor([-1.0, -1.0, -1.0])  # stored rollout logprobs
    w, rej = off_policy_weight("tis", logp, old, roll, torch.ones(3), torch.ones(3), tis_cap=1.5)
    assert w.tolist() == pytest.approx([min(e(0.6), 1.5), e(-1.0), e(-0.1)], rel=1e-6)
    assert w.tolist()[0] == 1.5 and not rej.any()


def test_decoupled_ppo_by_hand():
    # token 0: ratio to proximal e^0.1 inside the clip band; behaviour weight e^(-1.1 + 1.3) = e^0.2
    # token 1: ratio e^0.5 > 1.28 with A > 0 -> clipped (no gradient); behaviour weight e^0 = 1
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    prox = torch.tensor([-1.1, -1.5])
    roll = torch.tensor([-1.3, -1.5])
    adv = torch.tensor([1.0, 1.0])
    loss, m = grpo_token_loss(logp, adv, torch.ones(2), roll, logp_old=prox, off_policy_correction="decoupled_ppo",
                              eps_clip=0.2, eps_clip_high=0.28, tis_cap=2.0)
    assert loss.item() == pytest.approx(-e(0.1) * e(0.2) - 1.28 * 1.0, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-e(0.1) * e(0.2), 0.0], rel=1e-6)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="logp_old"):
        grpo_token_loss(logp, adv, torch.ones(2), roll, off_policy_correction="decoupled_ppo")


def test_extreme_ratios_stay_finite():
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    roll = torch.tensor([[-1000.0, -1.0]])  # ratio exp(1000) = inf
    for corr in OFF_POLICY_CORRECTIONS:
        kw = {"logp_old": logp.detach()} if corr == "decoupled_ppo" else {}
        loss, m = grpo_token_loss(logp, torch.tensor([[-1.0]]), torch.ones(1, 2), roll, off_policy_correction=corr, **kw)
        assert math.isfinite(loss.item()), corr
        assert all(math.isfinite(v.item()) for k, v in m.items() if k != "kl_k3"), corr


def test_every_correction_needs_rollout_logp():
    for corr in OFF_POLICY_CORRECTIONS:
        if corr != "none":
            with pytest.raises(ValueError, match="rollout_logp"):
                grpo_token_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), off_policy_correction=corr)


@pytest.mark.parametrize("corr", [c for c in OFF_POLICY_CORRECTIONS if c != "none"])
def test_async_config_accepts_each_correction(corr):
    cfg = load_config(CONFIGS / "cpu_smoke.yaml", [f"trainer.off_policy_correction={corr}", "async.max_staleness=2"])
    assert cfg.trainer.off_policy_correction == corr


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["trainer.off_policy_correction=none"], "trainer.off_policy_correction='none' with async.max_staleness>0"),
        (["async.mode=one_step_off", "trainer.off_policy_correction=none"], "off_policy_correction"),
        (["trainer.off_policy_correction=ppo"], "trainer.off_policy_correction"),
        (["trainer.mis_low=2.0", "trainer.mis_high=1.0"], "trainer.mis_low"),
        (["trainer.icepop_beta=0.5"], "trainer.icepop_beta"),
    ],
)
def test_c11_bad_configs_rejected_at_load(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace("'", "'")):
        load_config(CONFIGS / "cpu_smoke.yaml", overrides)
