"""The GRPO train step of :class:`~moe_async.trainer.megatron_trainer.MegatronTrainer`.

:func:`grpo_step`: one optimizer step of a :class:`~moe_async.trainer.state.TrainerState` over
a global batch, through Megatron's forward/backward schedule, with the token loss it is given
(:func:`~moe_async.trainer.loss.grpo_token_loss`); decoupled PPO's proximal logprobs
(:func:`with_proximal_logp`), the metric and aux-loss reductions over the world and the LR
schedule (:func:`set_lr`, a pure function of ``version``).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Iterator

import torch

from moe_async.trainer.batching import (
    Batcher,
    comm_device,
    dp_size,
    dp_sum,
    model_view,
    packed_seq_params,
    to_device,
)
from moe_async.trainer.finite import StepGuard
from moe_async.trainer.logprobs import ModelForward, compute_logprobs, token_logps
from moe_async.trainer.loss import grpo_token_loss, topk_forward_kl
from moe_async.trainer.state import TrainerState
from moe_async.types import MicroBatch, Sample

Tensor = torch.Tensor
#: a per-micro-batch token loss with :func:`~moe_async.trainer.loss.grpo_token_loss`'s arguments and result
LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

METRIC_KEYS = ("pg_loss", "clipfrac", "tis_mean", "is_masked_frac", "logp_diff_mean", "kl_k3", "entropy",
               "topk_kl_loss")


def grpo_step(st: TrainerState, batcher: Batcher, fwd: ModelForward, batch: list[Sample],
              advantages: list[float] | list[list[float]], topk_kl_coef: float = 0.0, *,
              loss_fn: LossFn = grpo_token_loss) -> dict[str, float]:
    """One GRPO optimizer step of the trainer state ``st`` over the global ``batch`` (the
    contract, metrics and errors: :meth:`MegatronTrainer.train_step
    <moe_async.trainer.megatron_trainer.MegatronTrainer.train_step>`, which checks the
    arguments and calls this under ``cpu_device_scope``). ``loss_fn``: the per-micro-batch
    token loss, called as :func:`~moe_async.trainer.loss.grpo_token_loss` (logprobs,
    advantages, loss mask and the ``trainer.*`` clip/off-policy settings as keywords) and
    returning its ``(loss_sum, metrics)``. Increments ``st.version``. Collective."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    cfg = st.cfg
    guard = StepGuard(batch, st.version)  # non-finite loss/grad fails before the optimizer
    batch, local_adv = batcher.dp_local(batch, advantages)  # DP: this replica's slice
    mbs_list = batcher.pack(batch, local_adv, equalize_dp=True)
    guard.bind(mbs_list)
    # --- off-policy correction: decoupled PPO's proximal policy ---
    if cfg.off_policy_correction == "decoupled_ppo":
        mbs_list = with_proximal_logp(st, batcher, fwd, batch, mbs_list)
    # --- end off-policy correction ---
    n_total = dp_sum(float(sum((mb.loss_mask > 0).sum().item() for mb in mbs_list)))
    dp = dp_size()
    if n_total == 0:
        raise ValueError("train_step: batch has no loss-bearing response token")
    num_mb = len(mbs_list)
    seq_length, mb_size = batcher.schedule_shape(mbs_list)

    def loss_func(mb: MicroBatch, rows_only: bool, logits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        use_topk = topk_kl_coef > 0 and mb.topk_ids is not None  # distillation: teacher top-k
        ent, logp, tk = token_logps(logits, mb, rows_only, st.vocab_size, entropy=True, topk=use_topk)
        assert ent is not None  # asked for
        mask = mb.loss_mask
        loss_sum, m = loss_fn(
            logp,
            mb.advantages,
            mask,
            rollout_logp=mb.rollout_logp,
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            off_policy_correction=cfg.off_policy_correction,
            tis_cap=cfg.tis_cap,
            logp_old=mb.logp_old,  # off-policy correction: decoupled PPO only
            mis_low=cfg.mis_low,
            mis_high=cfg.mis_high,
            icepop_beta=cfg.icepop_beta,
            opsm_delta=cfg.opsm_delta,
            topk_kl=topk_forward_kl(tk, mb.topk_logp) if tk is not None and mb.topk_logp is not None else None,
            topk_kl_mask=mb.topk_mask, topk_kl_coef=topk_kl_coef,
        )
        guard.record(mb, m["nonfinite_rows"], loss_sum)
        with torch.no_grad():
            n = m["num_tokens"]
            sums = {k: m[k] * n for k in METRIC_KEYS if k in m}
            sums["entropy"] = (ent * (mask > 0)).sum()
            sums["num_tokens"] = (mask > 0).sum().to(torch.float32)
            sums["topk_kl_sum"], sums["topk_tokens"] = m["topk_kl_sum"], m["topk_kl_tokens"]
        # Megatron divides by num_microbatches and DDP averages over DP: multiply both
        # back, divide by the global (all DP ranks) token count.
        loss = loss_sum * (num_mb * dp / n_total)
        st.router_replay.add_logprobs(logp, mb)  # router replay: mismatch metrics
        return loss, sums

    def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module,
                     ) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]]:
        mb = to_device(next(data_iterator))
        st.router_replay.before_forward(model_view(mb), model)  # router replay: this chunk's routes
        logits, rows_only = fwd.forward(model, mb)
        return logits, partial(loss_func, mb, rows_only)

    def record_forward(mb: MicroBatch) -> Tensor:  # router replay (R2): the old policy's own routes
        mb = to_device(mb)
        if mb.thd is not None:
            return st.ddp_models[0](mb.thd.tokens, mb.thd.position_ids, None,
                                    packed_seq_params=packed_seq_params(mb))
        return st.ddp_models[0](mb.tokens, mb.position_ids, mb.attention_mask)

    for d in st.ddp_models:
        d.zero_grad_buffer()
    st.optimizer.zero_grad()
    clear_aux_losses_tracker()
    set_lr(st)
    for d in st.ddp_models:
        d.train()
    fb = get_forward_backward_func()
    with st.router_replay.step(mbs_list, record_forward):  # router replay: set/clear
        reduced = fb(
            forward_step_func=forward_step,
            data_iterator=batcher.data_iterators(mbs_list),
            model=st.ddp_models,
            num_microbatches=num_mb,
            seq_length=seq_length,
            micro_batch_size=mb_size,
            forward_only=False,
        )
    guard.check(st.ddp_models)  # every rank: raises (grads zeroed) before any update
    update_ok, grad_norm, _ = st.optimizer.step()
    if not update_ok:
        raise RuntimeError("optimizer step skipped (non-finite gradients)")
    st.version += 1

    tot = {k: 0.0 for k in (*METRIC_KEYS, "num_tokens", "topk_kl_sum", "topk_tokens")}
    for d in reduced or []:
        for k, v in d.items():
            tot[k] += float(v)
    tot = world_metric_sum(tot)
    n = max(tot["num_tokens"], 1.0)
    out = {k: tot[k] / n for k in METRIC_KEYS}
    aux = aux_loss_mean(num_mb, st.tf_config.num_layers)
    clear_aux_losses_tracker()
    out.update(
        moe_aux_loss=aux,
        loss=out["pg_loss"] + out["topk_kl_loss"] + cfg.moe_aux_loss_coeff * aux,
        topk_forward_kl=tot["topk_kl_sum"] / max(tot["topk_tokens"], 1.0),
        topk_tokens=tot["topk_tokens"],
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        num_tokens=tot["num_tokens"],
        num_microbatches=float(num_mb),
        lr=float(st.optimizer.param_groups[0]["lr"]),
        weight_version=float(st.version),
    )
    out.update(st.router_replay.metrics())  # router replay: agreement, mismatch
    return out


# --- off-policy correction ---
def with_proximal_logp(st: TrainerState, batcher: Batcher, fwd: ModelForward, batch: list[Sample],
                       mbs_list: list[MicroBatch]) -> list[MicroBatch]:
    """Decoupled PPO (Hilton et al., 2022; AReaL): ``mbs_list`` with ``logp_old [B,S-1]``
    float32 = logprobs of the response tokens under the weights BEFORE this update
    (recomputed with :func:`~moe_async.trainer.logprobs.compute_logprobs`, same packing), 0 elsewhere. Only the last PP
    stage uses it (``mbs_list`` unchanged on the others)."""
    prox = compute_logprobs(batch, batcher=batcher, fwd=fwd, ddp_models=st.ddp_models,
                            router_replay=st.router_replay, vocab_size=st.vocab_size, equalize_dp=True)  # DP-local batches: cut to one count
    if not prox:  # not the last pipeline stage: the loss is not computed here
        return mbs_list
    i = 0
    out = []
    for mb in mbs_list:
        lo = torch.zeros_like(mb.rollout_logp)
        for b in range(mb.tokens.shape[0]):
            P, R = int(mb.prompt_len[b]), int(mb.resp_len[b])
            if R:
                lo[b, P - 1 : P - 1 + R] = torch.tensor(prox[i], dtype=lo.dtype)
            i += 1
        out.append(dataclasses.replace(mb, logp_old=lo))
    return out


def world_metric_sum(tot: dict[str, float]) -> dict[str, float]:
    """Metric sums of the whole global batch on every rank: the last PP stage's TP rank 0
    of each DP replica contributes its local sums, all-reduced (SUM) over the world."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tot
    keys = sorted(tot)
    # the loss-side metrics are computed on whole sequences, equal on the CP ranks
    owner = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
             and ps.get_context_parallel_rank() == 0)
    t = torch.tensor([tot[k] if owner else 0.0 for k in keys], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def aux_loss_mean(num_mb: int, num_layers: int) -> float:
    """MoE load-balancing loss (unscaled, summed over MoE layers) averaged over the
    micro-batches and DP ranks (``num_layers``: the model's, all PP stages) - the average whose gradient Megatron applies (its
    ``MoEAuxLossAutoScaler`` scale is 1/num_mb and DDP averages over DP). The tracker
    holds one value per layer, on the PP stage owning the layer; under sequence
    parallelism (TP > 1) and CP each rank's router sees its own tokens, and its value is
    that share of the layer's loss (token counts are reduced over the TP x CP group, the
    router probabilities are this rank's: Megatron's ``switch_load_balancing_loss_func``;
    Megatron's own tracker reduction sums over that ``tp_cp_group``). So: summed over
    TP x CP and PP, averaged over DP. (Before this sum the TP2 value was one rank's share:
    1.22 vs 2.12 at 1 process for a tiny qwen3_moe; its gradient was right.)"""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    vals = tracker["load_balancing_loss"]["values"].detach().clone().to(torch.float64) \
        if "load_balancing_loss" in tracker else None
    multi = dist.is_initialized() and dist.get_world_size() > 1
    if multi:
        # every rank takes part (a rank whose layers logged nothing contributes zeros)
        n = num_layers
        v = torch.zeros(n, dtype=torch.float64, device=comm_device())
        if vals is not None:
            v[: vals.numel()] = vals.to(v.device)
        dist.all_reduce(v, group=ps.get_pipeline_model_parallel_group())
        if ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size() > 1:
            dist.all_reduce(v, group=ps.get_tensor_and_context_parallel_group())  # the shares
        dist.all_reduce(v, group=ps.get_data_parallel_group())
        return float(v.sum()) / (num_mb * dp_size())
    return float(vals.sum()) / num_mb if vals is not None else 0.0


def set_lr(st: TrainerState) -> None:
    """Set the optimizer's LR for the step after ``st.version``: linear warmup over
    ``trainer.lr_warmup_steps``, then constant ``trainer.lr``."""
    w = st.cfg.lr_warmup_steps
    lr = st.cfg.lr * min(1.0, (st.version + 1) / w) if w else st.cfg.lr
    for g in st.optimizer.param_groups:
        g["lr"] = lr
