"""Per-token GRPO policy loss with asymmetric clipping and truncated importance sampling.

Legend: ``B`` sequences, ``T`` token positions (all tensors of one call share ``[B, T]``
or any common shape; only elementwise ops are used).

Formula (per token, masked by ``loss_mask``):

    ratio  = exp(logp - logp_old)                           (PPO ratio to the proximal policy)
    pg     = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
    tis    = min(exp(logp_old - logp_rollout), tis_cap)     (detached; only when "tis")
    loss   = sum(tis * pg * loss_mask)

Sources: clipped surrogate with group advantages, GRPO (Shao et al., 2024, DeepSeekMath);
asymmetric ("clip-higher") bounds, DAPO (Yu et al., 2025); truncated importance weight
against the rollout engine's logprobs, Yao et al., 2025 ("Your efficient RL framework
secretly brings you off-policy RL training").

With one optimizer step per batch the proximal policy equals the current one, so by default
``logp_old = logp.detach()`` (ratio == 1 in value, gradient of ``A * ratio`` == ``A * grad logp``).
"""

from __future__ import annotations

from typing import Literal

import torch

Tensor = torch.Tensor


def grpo_token_loss(
    logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    rollout_logp: Tensor | None = None,
    logp_old: Tensor | None = None,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    off_policy_correction: Literal["tis", "none"] = "tis",
    tis_cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO clipped loss, summed over masked tokens.

    Args:
        logp: ``[B, T]`` float, current-policy logprob (natural log) of each taken token,
            with grad.
        advantages: ``[B, T]`` (or broadcastable, e.g. ``[B, 1]``) advantage per token.
        loss_mask: ``[B, T]`` float/bool; 0 excludes a token (prompt, padding). Non-binary
            values weight the token.
        rollout_logp: ``[B, T]`` logprobs the rollout engine reported; required for "tis"
            and for the mismatch metrics.
        logp_old: ``[B, T]`` proximal-policy logprobs; default ``logp.detach()``.
        eps_clip, eps_clip_high: clip range ``[1 - eps_clip, 1 + eps_clip_high]``.
        off_policy_correction: ``"tis"`` multiplies each token's loss by the detached
            truncated weight ``min(exp(logp_old - rollout_logp), tis_cap)``; ``"none"`` doesn't.
        tis_cap: cap ``C`` of the weight (> 0).

    Returns:
        ``(loss_sum, metrics)``: ``loss_sum`` a 0-d tensor (sum over tokens, NOT averaged;
        the caller divides by the global token count); ``metrics`` 0-d detached tensors, each
        the masked mean over tokens (``num_tokens`` = masked token count; 0 tokens -> 0.0):
        ``pg_loss`` (mean loss), ``clipfrac`` (fraction where the clipped branch is active),
        ``tis_mean``, ``logp_diff_mean`` (|logp - rollout_logp|), ``kl_k3`` (Schulman's k3
        estimator of KL(pi_rollout || pi_theta): ``exp(d) - 1 - d`` with
        ``d = logp - rollout_logp``).

    Raises:
        ValueError: "tis" without ``rollout_logp``, or an unknown correction.
    """
    if off_policy_correction not in ("tis", "none"):
        raise ValueError(f"off_policy_correction must be 'tis' or 'none', got {off_policy_correction!r}")
    mask = loss_mask.to(logp.dtype)
    if logp_old is None:
        logp_old = logp.detach()
    ratio = torch.exp(logp - logp_old)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    pg = torch.maximum(pg1, pg2)
    if off_policy_correction == "tis":
        if rollout_logp is None:
            raise ValueError("off_policy_correction='tis' needs rollout_logp")
        tis = torch.clamp(torch.exp(logp_old.detach() - rollout_logp), max=tis_cap).detach()
        pg = pg * tis
    else:
        tis = torch.ones_like(logp).detach()
    loss_sum = (pg * mask).sum()

    with torch.no_grad():
        n = mask.sum()
        denom = torch.clamp(n, min=1.0)

        def mmean(x: Tensor) -> Tensor:
            return (x * mask).sum() / denom

        metrics = {
            "pg_loss": loss_sum.detach() / denom,
            "clipfrac": mmean((pg2 > pg1).to(mask.dtype)),
            "tis_mean": mmean(tis),
            "num_tokens": n,
        }
        if rollout_logp is not None:
            d = logp.detach() - rollout_logp
            metrics["logp_diff_mean"] = mmean(d.abs())
            metrics["kl_k3"] = mmean(torch.exp(d) - 1.0 - d)
        else:
            metrics["logp_diff_mean"] = torch.zeros((), dtype=logp.dtype)
            metrics["kl_k3"] = torch.zeros((), dtype=logp.dtype)
    return loss_sum, metrics
