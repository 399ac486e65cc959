"""Per-token advantages of on-policy distillation.

For response token ``t`` of a sample (natural-log probabilities)::

    A_t = kl_coef * -(logp_student_t - logp_teacher_t) + reward_coef * A_grpo

``logp_student_t`` is the student's sampling logprob (``sample.rollout_logprobs``, the
behaviour policy the off-policy corrections already weigh against), ``logp_teacher_t`` the
teacher's (``sample.teacher_logprobs``), ``A_grpo`` the sample's GRPO group advantage of the
task reward (:func:`moe_async.trainer.advantages.compute_grpo_advantages`). The first term is
the negated per-token reverse KL ``KL(student || teacher)`` estimate of on-policy
distillation (Agarwal et al., 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes"; Lu et al., Thinking Machines, 2025, "On-Policy Distillation"): its
policy gradient ``E[A_t grad logp_t]`` lowers the reverse KL. The advantages go into the
GRPO loss unchanged (:func:`moe_async.trainer.loss.grpo_token_loss`: clipping, the
off-policy correction; the buffer's staleness bound applies as for any sample).
A sample the teacher failed on (``teacher_logprobs`` None) gets only the reward term.
"""

from __future__ import annotations

import math

from moe_async.trainer.advantages import compute_grpo_advantages
from moe_async.types import Group


def distill_advantages(groups: list[Group], kl_coef: float, reward_coef: float) -> list[list[float]]:
    """``[R]`` advantages per sample (the module formula), flattened over ``groups`` in order.

    Raises: ValueError naming the group and sample whose teacher or rollout logprobs are
    non-finite or not one per response token."""
    grpo = compute_grpo_advantages([[s.reward for s in g.samples] for g in groups]) if reward_coef else None
    out: list[list[float]] = []
    for gi, g in enumerate(groups):
        for si, s in enumerate(g.samples):
            base = reward_coef * grpo[gi][si] if grpo is not None else 0.0
            t = s.teacher_logprobs
            R = len(s.response_ids)
            if t is None:
                out.append([base] * R)
                continue
            if len(t) != R or len(s.rollout_logprobs) != R:
                raise ValueError(f"group {g.group_id} sample {si}: {len(t)} teacher and {len(s.rollout_logprobs)} "
                                 f"rollout logprobs for {R} response tokens")
            a = [kl_coef * -(st - te) + base for st, te in zip(s.rollout_logprobs, t)]
            if not all(math.isfinite(x) for x in a):
                raise ValueError(f"group {g.group_id} sample {si}: non-finite teacher or rollout logprob")
            out.append(a)
    return out


def distill_metrics(groups: list[Group], train: dict[str, float] | None = None) -> dict[str, float]:
    """Of a trained batch: ``teacher/batch_kl_per_token`` (mean over the tokens the teacher
    scored of ``logp_student - logp_teacher``), ``teacher/batch_kl_per_sample`` (its sum over a
    sample's tokens, averaged over scored samples: the sequence's reverse-KL estimate, which
    a per-token mean hides when responses change length), ``teacher/batch_tokens`` (tokens it
    scored) and ``teacher/batch_failed_samples``; with the trainer's step metrics ``train`` holding a top-k
    forward KL (``topk_tokens > 0``), ``teacher/topk_forward_kl``: its mean per token with the
    teacher's top-k, under the weights before the step."""
    kl, n, scored, failed = 0.0, 0, 0, 0
    for g in groups:
        for s in g.samples:
            if s.teacher_logprobs is None:
                failed += bool(s.response_ids)
                continue
            kl += sum(a - b for a, b in zip(s.rollout_logprobs, s.teacher_logprobs))
            n += len(s.teacher_logprobs)
            scored += 1
    out = {"teacher/batch_kl_per_token": kl / n if n else 0.0,
           "teacher/batch_kl_per_sample": kl / scored if scored else 0.0, "teacher/batch_tokens": float(n),
           "teacher/batch_failed_samples": float(failed)}
    if train and train.get("topk_tokens"):
        out["teacher/topk_forward_kl"] = float(train["topk_forward_kl"])
    return out
