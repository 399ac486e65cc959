"""Megatron-Core GRPO trainer: model build from an HF checkpoint, train step, logprobs, export.

One code path: NCCL + TE layer spec with CUDA, gloo + local spec + ``moe_async.compat``
otherwise; any TP(+SP) x PP(+VPP) x EP x ETP x CP x DP that Megatron-Core builds. Every rank
gets the same global batch; the loss is the per-token mean over the whole global batch, so it
does not depend on the DP split, CP or the micro-batching. Metrics are equal on every rank.

Design notes: ``docs/design/trainer.md``."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any, Callable, Iterator

import torch

from moe_async.compat import apply_cpu_compat, cpu_device_scope, model_parallel_manual_seed
from moe_async.layout import ParallelLayout
from moe_async.megatron.build import model_chunks
from moe_async.megatron.hf_io import load_hf_weights
from moe_async.megatron.parallel import check_model_parallel, init_distributed, init_model_parallel
from moe_async.megatron.sharding import padded_vocab_size
from moe_async.models import get_family, hf_config_dict, tensor_checksum
from moe_async.replay.megatron import RouterReplayHook, transformer_overrides as replay_overrides  # router replay
from moe_async.trainer.batching import BatchingMixin
from moe_async.trainer.checkpoint import CheckpointMixin
from moe_async.trainer.config import TrainerConfig, resolve_sequence_packing
from moe_async.trainer.finite import StepGuard
from moe_async.trainer.logprobs import LogprobsMixin
from moe_async.trainer.loss import grpo_token_loss, topk_forward_kl
from moe_async.trainer.model_setup import ModelSetupMixin
from moe_async.types import MicroBatch, Sample

Tensor = torch.Tensor

# trainer.* fields that Megatron-Core's OptimizerConfig takes under the same names
_OPTIMIZER_FIELDS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
                     "use_distributed_optimizer", "optimizer_cpu_offload", "optimizer_offload_fraction")
_METRIC_KEYS = ("pg_loss", "clipfrac", "tis_mean", "is_masked_frac", "logp_diff_mean", "kl_k3", "entropy",
                "topk_kl_loss")


class MegatronTrainer(ModelSetupMixin, BatchingMixin, LogprobsMixin, CheckpointMixin):
    """GRPO trainer over a Megatron-Core ``GPTModel`` built from an HF checkpoint directory.

    Args:
        cfg: trainer section of the experiment config.
        hf_path: directory with ``config.json`` and ``*.safetensors`` (HF on-disk names).
        master_addr, master_port: rendezvous for ``torch.distributed`` when this object
            initialises it (port: ``MASTER_PORT`` env, else a free port for 1 process).

    World size/rank come from ``WORLD_SIZE``/``RANK`` when set (torchrun), else 1 process.
    If ``torch.distributed`` / Megatron parallel state are already initialised (another
    trainer in the process) they are reused when the sizes agree.

    At world size > 1 every public method is collective: all ranks call ``train_step``,
    ``compute_logprobs``, ``export_hf_weights`` (and exhaust it), ``hf_checksums`` and the
    checkpoint methods, with the same arguments (the same global batch on every rank).
    Results: ``train_step`` metrics and ``compute_logprobs`` / ``hf_checksums`` are equal on
    every rank; ``export_hf_weights`` yields on global rank 0 only.

    Attributes:
        version: weight_version, 0 after load, +1 per ``train_step``.
        hf_config: the HF config dict; ``family``: the model family.
        models: this rank's model chunks (``GPTModel``), one per virtual pipeline stage in
            ``vp_stage`` order (one element without virtual pipeline stages);
            ``ddp_models``: their DDP wrappers. ``model`` / ``ddp_model``: the first chunk.
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        hf_path: str,
        *,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        self.cfg = cfg
        self.hf_path = hf_path
        self.version = 0
        self._check_combinations()
        # packed THD micro-batches (trainer.sequence_packing resolved: 'auto' -> thd with CUDA + TE)
        self._thd = resolve_sequence_packing(cfg.sequence_packing, cfg.context_parallel_size) == "thd"
        # virtual pipeline stages (model chunks per PP rank); None = one chunk (Megatron's "off")
        vpp = cfg.virtual_pipeline_model_parallel_size
        self._vpp: int | None = vpp if vpp is not None and vpp > 1 else None
        if self._vpp:  # refused combinations are named before any process group is created
            hf_cfg = hf_config_dict(hf_path)
            self._check_virtual_pipeline(hf_cfg, get_family(hf_cfg.get("model_type")))
        torch.set_num_threads(cfg.num_threads)
        self._owns_dist = False
        self._init_distributed(master_addr, master_port)
        self._check_expert_tensor_parallel()  # ETP x EP vs the world, naming the fields
        self._layout = ParallelLayout.from_trainer_config(cfg)
        if ps.model_parallel_is_initialized():
            check_model_parallel(self._layout)  # RuntimeError when another trainer's sizes differ
        else:
            init_model_parallel(self._layout)
            self._owns_mp = True
        self._cpu = apply_cpu_compat()
        with cpu_device_scope():
            model_parallel_manual_seed(cfg.seed)
            self._build(hf_path)

    # ------------------------------------------------------------------ setup
    def _init_distributed(self, master_addr: str, master_port: int | None) -> None:
        if init_distributed(master_addr, master_port):  # moe_async.megatron.parallel
            self._owns_dist = True

    def _build(self, hf_path: str) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.cfg
        self.hf_config = hf_config_dict(hf_path)
        self.family = get_family(self.hf_config.get("model_type"))
        self.tf_config = self.family.transformer_config(
            self.hf_config,
            params_dtype=cfg.params_dtype,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            **self._layout.megatron_kwargs(),  # TP/PP/CP/EP/ETP/VPP
            **{**self._memory_overrides(), **self._layout_overrides()},  # recompute, dispatcher, uneven PP
            **replay_overrides(cfg.router_replay),  # router replay
            **self._expert_bias_overrides(),
        )
        self._check_expert_ffn_split()  # ETP divides the expert FFN size
        gpt_kwargs = self.family.gpt_model_kwargs(self.hf_config)
        # V: HF vocab; Megatron's vocab-parallel layers get V padded (zero rows, sliced off
        # the logits before the softmax and off the exported tensors).
        self.vocab_size = int(gpt_kwargs["vocab_size"])
        gpt_kwargs["vocab_size"] = padded_vocab_size(
            self.vocab_size, cfg.tensor_model_parallel_size, cfg.make_vocab_size_divisible_by
        )
        # Megatron's MoE aux-loss tracker is process-global and sized by the layer count of the
        # first model that logs into it (moe_utils.save_to_aux_losses_tracker): start it afresh
        # for this model (a 4-layer trainer after a 2-layer one raised IndexError)
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
        # This PP rank's model chunks, one per virtual pipeline stage (moe_async.megatron.build)
        self.models: list = model_chunks(self.family, self.hf_config, self.tf_config, gpt_kwargs,
                                         vpp=self._vpp, wrap_spec=self._cp_spec)
        self.model = self.models[0]  # the only chunk without virtual pipeline stages
        replay_root = self.model if len(self.models) == 1 else torch.nn.ModuleList(self.models)
        self.router_replay = RouterReplayHook(replay_root, self.tf_config, cfg.router_replay)  # router replay
        # expert-bias routers: padding taken back out of the token counts (_uncount_padding)
        self._router_pad: Tensor | None = None
        self._bias_hooks = [
            m.register_forward_hook(self._uncount_padding)
            for chunk in self.models for m in chunk.modules()
            if getattr(m, "local_tokens_per_expert", None) is not None and getattr(m, "expert_bias", None) is not None
        ]
        # logits of the response positions only (see _forward); not under sequence parallelism
        self._logit_rows: tuple[Tensor, Tensor] | None = None
        self._rows_hook = None
        last = self.models[-1]  # only the last chunk can hold the output layer
        out_layer = getattr(last, "output_layer", None) if last.post_process else None
        if out_layer is not None and not out_layer.sequence_parallel:
            self._rows_hook = out_layer.register_forward_pre_hook(self._select_logit_rows, with_kwargs=True)
        # Megatron flags expert params for the expert-DP gradient reduction and the expert
        # optimizer only when EP > 1 (moe/experts.py, tensor_parallel/layers.py: allreduce =
        # not (is_expert and EP > 1)). We flag them at every EP:
        # * at EP == 1, TP > 1, ETP == 1 every TP rank runs the full experts on its own
        #   sequence-parallel tokens, so expert grads must be summed over the expert-DP group
        #   (which holds the TP ranks), not the dense DP group; otherwise the TP ranks'
        #   experts drift apart after the first step;
        # * the optimizer is then always (dense, expert) chained, so torch_dist optimizer
        #   checkpoints have the same keys at EP == 1 and EP > 1 (save at EP2, resume at EP1).
        # At EP == 1, TP == 1 the expert-DP group equals the DP group: nothing else changes.
        for m in self.models:
            for n, p in m.named_parameters():
                if ".mlp.experts." in n:
                    p.allreduce = False
            if torch.cuda.is_available():
                m.cuda(torch.cuda.current_device())
        self._load_hf_weights(hf_path)
        # LoRA: adapters hooked on the loaded model, every base parameter frozen (DDP and the
        # optimizer then hold the adapters only)
        self.lora_linears: list = []
        if cfg.lora is not None:
            from moe_async.lora.layers import add_lora

            for m in self.models:
                self.lora_linears.append(add_lora(m, cfg.lora))

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        # one DDP wrapper per chunk; buckets only for chunk 0 (as Megatron-LM's get_model)
        self.ddp_models = [
            DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=m,
                                    disable_bucketing=v > 0)
            for v, m in enumerate(self.models)
        ]
        self.ddp_model = self.ddp_models[0]
        bf16 = cfg.params_dtype == "bf16"
        self.opt_config = OptimizerConfig(
            optimizer="adam",
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            **{k: getattr(cfg, k) for k in _OPTIMIZER_FIELDS},
        )
        self.optimizer = get_megatron_optimizer(self.opt_config, self.ddp_models)
        self.tf_config.finalize_model_grads_func = finalize_model_grads

    def _load_hf_weights(self, hf_path: str) -> None:
        """HF safetensors in ``hf_path`` -> this rank's slices of ``self.models``
        (:func:`moe_async.megatron.hf_io.load_hf_weights`; its errors)."""
        load_hf_weights(self.models, self.family, self.hf_config, hf_path, self.vocab_size)

    def close(self) -> None:
        """Destroy the process groups this trainer created (safe to call twice)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if getattr(self, "_owns_mp", False):
            ps.destroy_model_parallel()
            self._owns_mp = False
        if self._owns_dist and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_dist = False

    # ------------------------------------------------------------------ train
    def train_step(self, batch: list[Sample], advantages: list[float] | list[list[float]],
                   topk_kl_coef: float = 0.0) -> dict[str, float]:
        """One GRPO optimizer step over ``batch`` (one advantage per sample, or per response
        token: a ``[R]`` list per sample, as on-policy distillation's). ``topk_kl_coef > 0``:
        plus that times the top-k forward KL to the teacher on the tokens of samples with
        ``teacher_topk_ids`` (:func:`~moe_async.trainer.loss.topk_forward_kl`, weighted and
        averaged as the policy loss).

        The loss is the per-token mean over the WHOLE batch: each micro-batch contributes
        ``sum(token losses) / N_total`` where ``N_total`` is the number of loss-bearing
        response tokens of the batch (loss_weight > 0); Megatron's division by the number of
        micro-batches is compensated, so the result does not depend on ``micro_batch_size``.
        The MoE load-balancing aux loss is added by Megatron (``MoEAuxLossAutoScaler``);
        its value comes from Megatron's aux-loss tracker.

        Returns (floats): ``loss`` (= pg_loss + topk_kl_loss + moe_aux_loss_coeff * moe_aux_loss),
        ``pg_loss``, ``moe_aux_loss`` (unscaled, summed over MoE layers, averaged over
        micro-batches), ``grad_norm`` (before clipping), ``clipfrac``, ``tis_mean``,
        ``logp_diff_mean``, ``kl_k3``, ``entropy`` (token means), ``topk_kl_loss`` (the loss's
        top-k KL part), ``topk_forward_kl`` (its mean over the tokens with the teacher's top-k,
        unweighted) and ``topk_tokens`` (those tokens), ``num_tokens``,
        ``num_microbatches``, ``step_time_s``, ``lr``, ``weight_version`` (after the step).
        Raises ValueError for mismatched lengths or a batch with no loss-bearing token;
        :class:`~moe_async.trainer.finite.NonFiniteError` (all ranks) for a NaN/inf loss or
        gradient, naming the sample, before the optimizer runs (weights and version unchanged).
        """
        if len(advantages) != len(batch):
            raise ValueError(f"{len(advantages)} advantages for {len(batch)} samples")
        for i, (a, s) in enumerate(zip(advantages, batch)):  # per token (distillation): one per response token
            if isinstance(a, (list, tuple)) and len(a) != len(s.response_ids):
                raise ValueError(f"sample {i}: {len(a)} per-token advantages for {len(s.response_ids)} response tokens")
        t0 = time.perf_counter()
        with cpu_device_scope():
            out = self._train_step(batch, advantages, float(topk_kl_coef))
        out["step_time_s"] = time.perf_counter() - t0
        return out

    def _train_step(self, batch: list[Sample], advantages: list[float] | list[list[float]],
                    topk_kl_coef: float = 0.0) -> dict[str, float]:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        cfg = self.cfg
        guard = StepGuard(batch, self.version)  # non-finite loss/grad fails before the optimizer
        batch, local_adv = self._dp_local(batch, advantages)  # DP: this replica's slice
        mbs_list = self._pack(batch, local_adv, equalize_dp=True)
        guard.bind(mbs_list)
        # --- off-policy correction: decoupled PPO's proximal policy ---
        if cfg.off_policy_correction == "decoupled_ppo":
            mbs_list = self._with_proximal_logp(batch, mbs_list)
        # --- end off-policy correction ---
        n_total = self._dp_sum(float(sum((mb.loss_mask > 0).sum().item() for mb in mbs_list)))
        dp = self._dp_size()
        if n_total == 0:
            raise ValueError("train_step: batch has no loss-bearing response token")
        num_mb = len(mbs_list)
        seq_length, mb_size = self._schedule_shape(mbs_list)

        def loss_func(mb: MicroBatch, rows_only: bool, logits: Tensor):
            use_topk = topk_kl_coef > 0 and mb.topk_ids is not None  # distillation: teacher top-k
            ent, logp, tk = self._token_logps(logits, mb, rows_only, entropy=True, topk=use_topk)
            assert ent is not None  # asked for
            mask = mb.loss_mask
            loss_sum, m = grpo_token_loss(
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
                sums = {k: m[k] * n for k in _METRIC_KEYS if k in m}
                sums["entropy"] = (ent * (mask > 0)).sum()
                sums["num_tokens"] = (mask > 0).sum().to(torch.float32)
                sums["topk_kl_sum"], sums["topk_tokens"] = m["topk_kl_sum"], m["topk_kl_tokens"]
            # Megatron divides by num_microbatches and DDP averages over DP: multiply both
            # back, divide by the global (all DP ranks) token count.
            loss = loss_sum * (num_mb * dp / n_total)
            self.router_replay.add_logprobs(logp, mb)  # router replay: mismatch metrics
            return loss, sums

        def forward_step(data_iterator, model):
            mb = self._to_device(next(data_iterator))
            self.router_replay.before_forward(self._model_view(mb), model)  # router replay: this chunk's routes
            logits, rows_only = self._forward(model, mb)
            return logits, partial(loss_func, mb, rows_only)

        def record_forward(mb):  # router replay (R2): the old policy's own routes
            mb = self._to_device(mb)
            if mb.thd is not None:
                return self.ddp_model(mb.thd.tokens, mb.thd.position_ids, None,
                                      packed_seq_params=self._packed_seq_params(mb))
            return self.ddp_model(mb.tokens, mb.position_ids, mb.attention_mask)

        for d in self.ddp_models:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()
        clear_aux_losses_tracker()
        self._set_lr()
        for d in self.ddp_models:
            d.train()
        fb = get_forward_backward_func()
        with self.router_replay.step(mbs_list, record_forward):  # router replay: set/clear
            reduced = fb(
                forward_step_func=forward_step,
                data_iterator=self._data_iterators(mbs_list),
                model=self.ddp_models,
                num_microbatches=num_mb,
                seq_length=seq_length,
                micro_batch_size=mb_size,
                forward_only=False,
            )
        guard.check(self.ddp_models)  # every rank: raises (grads zeroed) before any update
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients)")
        self.version += 1

        tot = {k: 0.0 for k in (*_METRIC_KEYS, "num_tokens", "topk_kl_sum", "topk_tokens")}
        for d in reduced or []:
            for k, v in d.items():
                tot[k] += float(v)
        tot = self._world_metric_sum(tot)
        n = max(tot["num_tokens"], 1.0)
        out = {k: tot[k] / n for k in _METRIC_KEYS}
        aux = self._aux_loss_mean(num_mb)
        clear_aux_losses_tracker()
        out.update(
            moe_aux_loss=aux,
            loss=out["pg_loss"] + out["topk_kl_loss"] + cfg.moe_aux_loss_coeff * aux,
            topk_forward_kl=tot["topk_kl_sum"] / max(tot["topk_tokens"], 1.0),
            topk_tokens=tot["topk_tokens"],
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            num_tokens=tot["num_tokens"],
            num_microbatches=float(num_mb),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            weight_version=float(self.version),
        )
        out.update(self.router_replay.metrics())  # router replay: agreement, mismatch
        return out

    # --- off-policy correction ---
    def _with_proximal_logp(self, batch: list[Sample], mbs_list: list[MicroBatch]) -> list[MicroBatch]:
        """Decoupled PPO (Hilton et al., 2022; AReaL): ``mbs_list`` with ``logp_old [B,S-1]``
        float32 = logprobs of the response tokens under the weights BEFORE this update
        (recomputed with :meth:`compute_logprobs`, same packing), 0 elsewhere. Only the last PP
        stage uses it (``mbs_list`` unchanged on the others)."""
        prox = self.compute_logprobs(batch, equalize_dp=True)  # DP-local batches: cut to one count
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

    def _dp_max(self, x: float) -> float:
        """Max of a per-DP-rank scalar over the DP group."""
        import torch.distributed as dist

        return self._dp_reduce(x, dist.ReduceOp.MAX)

    def _dp_sum(self, x: float) -> float:
        """Sum of a per-DP-rank scalar over the DP group (float64 on the DP group)."""
        import torch.distributed as dist

        return self._dp_reduce(x, dist.ReduceOp.SUM)

    def _dp_reduce(self, x: float, op) -> float:
        """``op`` (a ``torch.distributed.ReduceOp``) of a per-DP-rank scalar over the DP
        group, in float64; ``x`` itself at DP 1."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self._dp_size() == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=op, group=ps.get_data_parallel_group())
        return float(t.item())

    def _comm_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _world_metric_sum(self, tot: dict[str, float]) -> dict[str, float]:
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
        t = torch.tensor([tot[k] if owner else 0.0 for k in keys], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def _aux_loss_mean(self, num_mb: int) -> float:
        """MoE load-balancing loss (unscaled, summed over MoE layers) averaged over the
        micro-batches and DP ranks - the average whose gradient Megatron applies (its
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
            n = self.tf_config.num_layers
            v = torch.zeros(n, dtype=torch.float64, device=self._comm_device())
            if vals is not None:
                v[: vals.numel()] = vals.to(v.device)
            dist.all_reduce(v, group=ps.get_pipeline_model_parallel_group())
            if ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size() > 1:
                dist.all_reduce(v, group=ps.get_tensor_and_context_parallel_group())  # the shares
            dist.all_reduce(v, group=ps.get_data_parallel_group())
            return float(v.sum()) / (num_mb * self._dp_size())
        return float(vals.sum()) / num_mb if vals is not None else 0.0

    def _set_lr(self) -> None:
        """Linear warmup over ``lr_warmup_steps`` then constant ``lr``."""
        w = self.cfg.lr_warmup_steps
        lr = self.cfg.lr * min(1.0, (self.version + 1) / w) if w else self.cfg.lr
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # ------------------------------------------------------------------ export
    def export_lora(self, out_dir: str | None = None, with_config: bool = False, replace: bool = False) -> Any:
        """The LoRA adapters as Hugging Face PEFT tensors (``base_model.model.<hf module>.lora_A/B.weight``,
        fp32, :mod:`moe_async.lora.peft_export`); ``with_config``: ``(tensors, adapter_config dict)``.
        With ``out_dir``, global rank 0 also writes ``adapter_model.safetensors`` +
        ``adapter_config.json`` there (``replace``: over an adapter already there,
        :func:`~moe_async.lora.peft_export.write_peft`). Collective at world size > 1. Raises
        ValueError without ``trainer.lora``."""
        import torch.distributed as dist

        from moe_async.lora.peft_export import megatron_adapter_state, peft_config_dict, peft_state, write_peft

        if self.cfg.lora is None:
            raise ValueError("export_lora: trainer.lora is not set (no adapters to export)")
        state = megatron_adapter_state(self.models, self.lora_linears)
        tensors, modules, params = peft_state(state, self.family, self.hf_config)
        config = peft_config_dict(self.cfg.lora, modules, params, self.hf_path)
        if out_dir is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            write_peft(out_dir, tensors, config, replace=replace)
        return (tensors, config) if with_config else tensors

    def export_hf_weights(self, dtype: torch.dtype | None = None,
                          out: Callable[[str, tuple[int, ...], torch.dtype], Tensor | None] | None = None,
                          ) -> Iterator[tuple[str, Tensor]]:
        """Current weights as ``(hf_name, full_tensor)`` under HF on-disk names.

        Data path (:meth:`hf_exporter`'s ``hf_tensors``): every rank's primary shards (TP
        slices, EP experts under their global ids, PP stages' layers under their global layer
        index) -> point-to-point to global rank 0 -> full 1-process Megatron tensor, vocab
        padding dropped -> rename to HF (the family's mapping table: split qkv and gate/up)
        -> cast to ``dtype`` (default: the model's dtype) -> yield.

        Collective at world size > 1: EVERY rank must exhaust the iterator. Global rank 0
        yields every HF tensor (detached CPU copies, safe to keep); other ranks yield nothing.
        ``out(hf_name, shape, dtype)`` (optional, e.g. ``BroadcastTransport.destination``) may
        return a tensor to copy (and cast) into instead of a fresh clone; that tensor is yielded
        (the caller owns its lifetime). None from ``out``: a clone as without it.

        One process (TP = PP = EP = 1): no gather; the full tensors are the parameters
        themselves, and with ``out`` the parameters whose HF tensors are pure views of them
        are first moved into ``out``'s buffer (:meth:`relayout_params`, once): those tensors
        are then yielded as they are (``out``'s own views, no copy), the others (fused QKV
        split, padded vocab rows, a cast) copied into ``out``; the order follows ``out``'s
        buffer (the engines' layout), so a consumer can send while the rest is exported.
        Raises KeyError if a parameter has no HF name or an HF tensor is left unset (rank 0),
        ValueError if shards do not tile a tensor exactly once.
        """
        ex = self.hf_exporter()
        ex.check()  # nothing non-finite reaches an engine
        self.relayout_params(out)  # 1 process: builds the plan; with out, moves parameters once
        plan = self.__dict__.get("_hf_export_plan")
        if plan is not None:  # 1 process: the parameters are the full tensors (views); no
            # CUDA->CPU function mode around the yields (it would tax the consumer's torch calls)
            yield from plan.export(plan.order(out) if out is not None else sorted(plan.entries), out, dtype)
            return
        with cpu_device_scope():
            for hf_name, t in ex.hf_tensors():  # global rank 0 only (the others take part)
                dst = out(hf_name, tuple(t.shape), dtype or t.dtype) if out is not None else None
                if dst is not None:  # one copy (with the cast) into the caller's buffer
                    dst.copy_(t)
                    yield hf_name, dst
                    continue
                t = t.to(dtype) if dtype is not None else t
                yield hf_name, t.clone()

    def hf_exporter(self):
        """This rank's :class:`~moe_async.megatron.hf_export.HFExporter` (one per trainer): the
        HF view of its model chunks that the weight sync (any world size), the checksums and
        the export share; also the ``ShardSource`` of the streamed sync."""
        from moe_async.megatron.hf_export import HFExporter

        ex = self.__dict__.get("_hf_exporter")
        if ex is None:
            ex = self.__dict__["_hf_exporter"] = HFExporter(self.models, self.family, self.hf_config,
                                                            self.vocab_size, version=lambda: self.version)
        return ex

    def relayout_params(self, out: Callable[[str, tuple[int, ...], torch.dtype], Tensor | None] | None = None,
                        ) -> dict[str, int] | None:
        """Move this trainer's parameters into ``out``'s buffer (zero-copy weight sync; see
        :mod:`moe_async.weight_sync.relayout`), where that is exact and safe.

        Only in one process (TP = PP = EP = 1, one model chunk: every tensor whole on this
        rank) and without Megatron's distributed optimizer (whose buffers own the
        parameters). A parameter moves when its HF tensors are views of it, in order
        (renames; a gated ``linear_fc1`` = gate rows then up rows) and ``out`` (e.g.
        ``BroadcastTransport.destination``) places them end to end in one buffer on the
        parameter's device with the parameter's dtype: its bytes are copied there and
        ``param.data`` re-pointed (the ``Parameter`` objects, hence the optimizer state, DDP's
        gradient buffer and hooks, are unchanged). Idempotent; :meth:`export_hf_weights` calls
        it whenever it is given ``out``. The caller must not write into ``out``'s buffer other
        than through this trainer's export, and must not run ``train_step`` while a send of
        that buffer is in flight.

        Returns None when this trainer cannot (or ``out`` is None), else counts:
        ``relaid_tensors``/``relaid_bytes`` (living in ``out``'s buffer), ``moved_tensors``
        (moved by this call), ``copied_tensors``/``copied_bytes`` (copied at each export).
        """
        from moe_async.weight_sync.relayout import describe

        if "_hf_export_plan" not in self.__dict__:  # once (None: the gather path)
            self.__dict__["_hf_export_plan"] = self.hf_exporter().whole_export()
        plan = self.__dict__["_hf_export_plan"]
        if plan is None or out is None or self.cfg.use_distributed_optimizer:
            return None
        st = plan.bind(out)
        if st["moved_tensors"]:
            import logging

            logging.getLogger(__name__).info("weight export: parameters moved into the send buffer: %s",
                                             describe(st))
        return st

    def hf_checksums(self) -> dict[str, str]:
        """``{hf_name: tensor_checksum(tensor)}`` of the current weights (sha256 of fp32 bytes;
        the engines compute the same with :func:`moe_async.models.tensor_checksum`).

        Collective at world size > 1 (every rank calls it): computed on global rank 0 from
        :meth:`export_hf_weights` and broadcast, so every rank returns the same dict."""
        import torch.distributed as dist

        sums = {n: tensor_checksum(t) for n, t in self.export_hf_weights()}
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [sums]
            dist.broadcast_object_list(box, src=0)
            sums = box[0]
        return sums
