"""Per-token GRPO policy loss with asymmetric clipping and one off-policy correction.

Inputs share ``[B, T]`` (``advantages`` may be ``[B, 1]``): logprobs, proximal and rollout
logprobs, ``loss_mask``; the loss is ``sum(w * pg * loss_mask)`` with ``pg`` the clipped
surrogate (GRPO, DAPO's clip-higher) and ``w`` the detached weight of the configured correction
(``none``, ``tis``, ``tis_seq``, ``mis``, ``mis_seq``, ``icepop``, ``opsm``, ``decoupled_ppo``).
Masked positions are selected out, never multiplied by 0: they contribute exactly 0.
On-policy distillation may add a top-k forward KL term per token (:func:`topk_forward_kl`),
weighted by the same ``w``.

Design notes: ``docs/design/trainer.md``."""

from __future__ import annotations

from typing import get_args

import torch

from moe_async.trainer.config import OffPolicyCorrection

Tensor = torch.Tensor

OFF_POLICY_CORRECTIONS: tuple[str, ...] = get_args(OffPolicyCorrection)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """``sum(x * mask)`` over ``dim`` (None: all), with the positions where ``mask == 0``
    SELECTED away (``torch.where``) instead of multiplied by 0: a NaN/inf of ``x`` there
    contributes exactly 0 to the value and gets exactly 0 gradient. ``mask`` float (weights)
    or bool, broadcastable to ``x``."""
    w = mask.to(x.dtype) if mask.dtype == torch.bool else mask
    y = torch.where(mask != 0, x * w, torch.zeros((), dtype=x.dtype, device=x.device))
    return y.sum() if dim is None else y.sum(dim, keepdim=keepdim)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Token mean ``masked_sum(x, mask) / sum(mask)`` (0-d; 0 tokens -> 0.0), by selection:
    the row ``[1, NaN, 3]`` with mask ``[1, 0, 1]`` gives 2.0, not NaN."""
    return masked_sum(x, mask) / torch.clamp(mask.to(x.dtype).sum(), min=1.0)


def _row_mean(x: Tensor, m: Tensor) -> Tensor:
    """Masked mean over the last dim, kept as ``[..., 1]``; rows with no token give 0."""
    return masked_sum(x, m, -1, keepdim=True) / torch.clamp(m.sum(-1, keepdim=True), min=1.0)


def _select(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` where ``keep`` (bool, broadcastable), else 0: the masked inputs of the loss."""
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def topk_forward_kl(student_topk_logp: Tensor, teacher_topk_logp: Tensor) -> Tensor:
    """Forward KL over the teacher's top-k support, per token: ``[..., k]`` -> ``[...]``::

        KL_t = sum_{j in topk_t} p_T(j) * (log p_T(j) - log p_S(j))

    ``teacher_topk_logp``: the teacher's logprobs (natural log, its full-vocabulary log-softmax)
    of its ``k`` most likely tokens, NOT renormalised over the top-k (as verl's
    ``forward_kl_topk``; miles' top-k OPD instead renormalises its weights over the selected ids,
    and uses them in the advantage), detached; ``student_topk_logp``: the student's
    full-vocabulary log-softmax at the same ids, with grad. Its gradient w.r.t. the student's
    logits ``z`` is ``M * softmax(z) - p_T`` (``p_T`` 0 outside the top-k, ``M = sum_j p_T(j)``):
    the minimum is ``p_S = p_T / M`` on the top-k, where ``KL_t = M log M <= 0`` (0 when the
    top-k holds all the teacher's mass). Not clamped at 0 (verl clamps; that stops the gradient
    of tokens below 0 before that minimum). Same dtype as the inputs."""
    t = teacher_topk_logp.detach()
    return (t.exp() * (t - student_topk_logp)).sum(-1)


def off_policy_weight(
    correction: str,
    logp: Tensor,
    logp_old: Tensor,
    rollout_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    icepop_beta: float = 2.0,
    opsm_delta: float = 1e-4,
) -> tuple[Tensor, Tensor]:
    """The detached per-token weight ``w`` of the table in ``docs/design/trainer.md``.

    Args: as :func:`grpo_token_loss` (all ``[B, T]`` float32/64 logprobs, natural log).

    Returns:
        ``(w, rejected)``: ``w`` ``[B, T]`` detached float weight (``>= 0``; ``0`` where a
        token/sequence is masked); ``rejected`` ``[B, T]`` bool, True where the correction
        zeroed the token (MIS/IcePop/OPSM), for the ``is_masked_frac`` metric.

    Raises:
        ValueError: unknown ``correction``.
    """
    with torch.no_grad():
        keep = loss_mask > 0
        m = keep.to(logp.dtype)
        # by selection: a NaN rollout logprob under a zero mask must not reach the weight
        d = _select(logp_old.detach(), keep) - _select(rollout_logp, keep)
        no = torch.zeros_like(d, dtype=torch.bool)
        if correction == "none":
            return torch.ones_like(d), no
        if correction in ("tis", "decoupled_ppo"):
            return torch.clamp(torch.exp(d), max=tis_cap), no
        if correction == "tis_seq":
            w = torch.clamp(torch.exp(_row_mean(d, m)), max=tis_cap)
            return w.expand_as(d).clone(), no
        if correction in ("mis", "icepop", "mis_seq"):
            lo, hi = (1.0 / icepop_beta, icepop_beta) if correction == "icepop" else (mis_low, mis_high)
            r = torch.exp(_row_mean(d, m)).expand_as(d) if correction == "mis_seq" else torch.exp(d)
            keep = (r >= lo) & (r <= hi)
            # torch.where, not r * keep: an overflowed ratio (inf) times 0 would be NaN
            return torch.where(keep, r, torch.zeros_like(r)), ~keep
        if correction == "opsm":
            kl_seq = _row_mean(_select(rollout_logp, keep) - _select(logp.detach(), keep), m)
            neg = (advantages < 0).expand_as(d)
            drop = neg & (kl_seq > opsm_delta).expand_as(d)
            w = torch.clamp(torch.exp(d), max=tis_cap)
            return torch.where(drop, torch.zeros_like(w), w), drop
    raise ValueError(f"off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got {correction!r}")


def grpo_token_loss(
    logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    rollout_logp: Tensor | None = None,
    logp_old: Tensor | None = None,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    off_policy_correction: str = "tis",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    icepop_beta: float = 2.0,
    opsm_delta: float = 1e-4,
    topk_kl: Tensor | None = None,
    topk_kl_mask: Tensor | None = None,
    topk_kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO clipped loss with one off-policy correction, summed over masked tokens; with
    ``topk_kl`` the loss of token ``t`` is ``w_t * (pg_t + topk_kl_coef * topk_kl_t)``.

    Args:
        logp: ``[B, T]`` float, current-policy logprob (natural log) of each taken token,
            with grad.
        advantages: ``[B, T]`` (or broadcastable, e.g. ``[B, 1]``) advantage per token.
        loss_mask: ``[B, T]`` float/bool; 0 excludes a token (prompt, padding). Non-binary
            values weight the token.
        rollout_logp: ``[B, T]`` logprobs the rollout engine reported; required for every
            correction but ``"none"`` and used for the mismatch metrics.
        logp_old: ``[B, T]`` proximal-policy logprobs; default ``logp.detach()``; REQUIRED for
            ``"decoupled_ppo"`` (the recomputed logprobs of the weights before the update).
        eps_clip, eps_clip_high: clip range ``[1 - eps_clip, 1 + eps_clip_high]``.
        off_policy_correction: one of :data:`OFF_POLICY_CORRECTIONS`; see the module table.
        tis_cap: cap ``C > 0`` of the truncated weights (tis, tis_seq, opsm, decoupled_ppo).
        mis_low, mis_high: band ``[low, high]`` of the ratio kept by mis / mis_seq.
        icepop_beta: ``beta > 1``; IcePop keeps ratios in ``[1/beta, beta]``.
        opsm_delta: OPSM threshold ``delta`` (nats per token) on the sequence KL estimate.
        topk_kl: ``[B, T]`` per-token top-k forward KL (:func:`topk_forward_kl`, with grad) or
            None; topk_kl_mask: ``[B, T]``, > 0 where a token has it (required with it);
            topk_kl_coef: its weight (distillation's ``teacher.topk_forward_kl_coef``).

    Returns:
        ``(loss_sum, metrics)``: ``loss_sum`` a 0-d tensor (sum over tokens, NOT averaged;
        the caller divides by the global token count; masked positions selected away, see the
        ``docs/design/trainer.md``); ``metrics["nonfinite_rows"]`` ``[B]`` bool (the shape of the inputs
        without their last dim), True for a row with a non-finite loss term at a loss-bearing
        token (the caller names the sample); the other ``metrics`` are 0-d detached tensors, each
        the masked mean over tokens (``num_tokens`` = masked token count; 0 tokens -> 0.0):
        ``pg_loss`` (mean loss), ``clipfrac`` (fraction where the clipped branch is active),
        ``tis_mean`` (mean off-policy weight ``w``), ``is_masked_frac`` (fraction of tokens
        the correction zeroed), ``logp_diff_mean`` (|logp - rollout_logp|), ``kl_k3``
        (Schulman's k3 estimator of KL(pi_rollout || pi_theta): ``exp(d) - 1 - d`` with
        ``d = logp - rollout_logp``); ``topk_kl_loss`` (the mean of ``topk_kl_coef * w *
        topk_kl``: the loss's part from it), and the sums ``topk_kl_sum`` (of ``topk_kl``,
        unweighted) and ``topk_kl_tokens`` over the loss-bearing tokens that have it (0 without).

    Raises:
        ValueError: a correction other than "none" without ``rollout_logp``,
            "decoupled_ppo" without ``logp_old``, or an unknown correction.
    """
    if off_policy_correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got {off_policy_correction!r}"
        )
    if off_policy_correction != "none" and rollout_logp is None:
        raise ValueError(f"off_policy_correction={off_policy_correction!r} needs rollout_logp")
    if off_policy_correction == "decoupled_ppo" and logp_old is None:
        raise ValueError("off_policy_correction='decoupled_ppo' needs logp_old (the recomputed proximal logprobs)")
    mask = loss_mask.to(logp.dtype)
    keep = mask > 0
    # masking by selection: every input is 0 where the mask is 0, so nothing non-finite
    # there reaches the value or the gradient (torch.where's gradient there is exactly 0)
    logp_old = logp.detach() if logp_old is None else logp_old.detach()
    logp, logp_old = _select(logp, keep), _select(logp_old, keep)
    advantages = _select(torch.as_tensor(advantages, dtype=logp.dtype, device=logp.device), keep)
    if rollout_logp is not None:
        rollout_logp = _select(rollout_logp, keep)
    ratio = torch.exp(logp - logp_old)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    pg = torch.maximum(pg1, pg2)
    if off_policy_correction == "none":
        w = torch.ones_like(logp).detach()
        rejected = torch.zeros_like(logp, dtype=torch.bool)
    else:
        assert rollout_logp is not None  # refused above
        w, rejected = off_policy_weight(
            off_policy_correction, logp, logp_old, rollout_logp, advantages, mask,
            tis_cap=tis_cap, mis_low=mis_low, mis_high=mis_high, icepop_beta=icepop_beta,
            opsm_delta=opsm_delta,
        )
        pg = pg * w
    term = pg
    kl_keep = torch.zeros_like(keep)
    if topk_kl is not None:
        if topk_kl_mask is None:
            raise ValueError("topk_kl needs topk_kl_mask (the tokens that have the teacher's top-k)")
        kl_keep = keep & (topk_kl_mask > 0)
        kl = _select(topk_kl, kl_keep)
        term = pg + topk_kl_coef * w * kl
    loss_sum = masked_sum(term, mask)

    with torch.no_grad():
        n = mask.sum()
        denom = torch.clamp(n, min=1.0)

        def mmean(x: Tensor) -> Tensor:
            return masked_sum(x, mask) / denom

        fin = torch.where(keep, term.detach() * mask, torch.zeros((), dtype=pg.dtype, device=pg.device))
        nonfinite_rows = ~torch.isfinite(fin).all(-1) if fin.ndim else ~torch.isfinite(fin)

        metrics = {
            "pg_loss": masked_sum(pg.detach(), mask) / denom,
            "clipfrac": mmean((pg2 > pg1).to(mask.dtype)),
            "tis_mean": mmean(w),
            "is_masked_frac": mmean(rejected.to(mask.dtype)),
            "num_tokens": n,
            "nonfinite_rows": nonfinite_rows,
        }
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        metrics["topk_kl_loss"], metrics["topk_kl_sum"], metrics["topk_kl_tokens"] = zero, zero, zero
        if topk_kl is not None:
            kl_d = _select(topk_kl.detach(), kl_keep)
            metrics["topk_kl_loss"] = mmean(topk_kl_coef * w * kl_d)
            metrics["topk_kl_sum"] = kl_d.sum()
            metrics["topk_kl_tokens"] = kl_keep.sum().to(logp.dtype)
        if rollout_logp is not None:
            d = logp.detach() - rollout_logp
            metrics["logp_diff_mean"] = mmean(d.abs())
            metrics["kl_k3"] = mmean(torch.exp(d) - 1.0 - d)
        else:
            metrics["logp_diff_mean"] = torch.zeros((), dtype=logp.dtype)
            metrics["kl_k3"] = torch.zeros((), dtype=logp.dtype)
    return loss_sum, metrics
