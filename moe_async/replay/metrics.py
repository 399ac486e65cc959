"""Train/inference mismatch metrics of one train step.

Over response tokens that carry rollout logprobs (``d = logp_train - logp_rollout``, the
trainer's logprob from the step's forward, i.e. the policy before the update):

- ``mismatch_logp_absdiff_mean`` / ``_max``: ``|d|``;
- ``mismatch_kl_k3``: Schulman's k3 estimate of KL(pi_rollout || pi_train) on tokens
  sampled from the rollout policy, ``exp(d) - 1 - d``;
- ``mismatch_ratio_gt2_frac``: share of tokens whose importance ratio ``exp(d)`` > 2.

Over (real token, MoE layer) pairs with engine routes:

- ``routing_agreement``: share with the trainer router's own top-k SET equal to the
  engine's; ``routing_agreement_l{j}`` per MoE layer ``j``;
- ``replay_agreement`` (R3, added by ``RouterReplayHook.metrics``): share whose experts USED
  in the forward are the engine's (1.0 when every real token replays the engine's routes).
"""

from __future__ import annotations

import torch


class MismatchMeter:
    """Accumulates sums over micro-batches; :meth:`result` gives the step's metrics."""

    def __init__(self, num_moe_layers: int):
        self.num_moe_layers = num_moe_layers
        self.reset()

    def reset(self) -> None:
        self.n = 0.0
        self.absdiff = 0.0
        self.absmax = 0.0
        self.k3 = 0.0
        self.gt2 = 0.0
        self.layers: dict[int, tuple[int, int]] = {}

    def add_logprobs(self, logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
        """``logp``, ``rollout_logp``, ``mask`` of the same shape; mask > 0 selects tokens."""
        with torch.no_grad():
            m = mask > 0
            if not bool(m.any()):
                return
            d = (logp.float() - rollout_logp.float())[m]
            self.n += float(d.numel())
            self.absdiff += float(d.abs().sum())
            self.absmax = max(self.absmax, float(d.abs().max()))
            self.k3 += float((torch.exp(d) - 1.0 - d).sum())
            self.gt2 += float((d > torch.log(torch.tensor(2.0))).sum())

    def set_layer(self, moe_index: int, agree: int, count: int) -> None:
        self.layers[moe_index] = (agree, count)

    def result(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.n:
            out.update(
                mismatch_logp_absdiff_mean=self.absdiff / self.n,
                mismatch_logp_absdiff_max=self.absmax,
                mismatch_kl_k3=self.k3 / self.n,
                mismatch_ratio_gt2_frac=self.gt2 / self.n,
                mismatch_num_tokens=self.n,
            )
        tot_a = tot_c = 0
        for j in sorted(self.layers):
            a, c = self.layers[j]
            if c:
                out[f"routing_agreement_l{j}"] = a / c
            tot_a, tot_c = tot_a + a, tot_c + c
        if tot_c:
            out["routing_agreement"] = tot_a / tot_c
        return out
