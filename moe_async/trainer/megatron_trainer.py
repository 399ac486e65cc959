"""Megatron-Core GRPO trainer: model build from an HF checkpoint, train step, logprobs, export.

Legend (shapes): ``B`` sequences in a micro-batch, ``S`` padded sequence length (prompt +
response), ``V`` vocab, ``R`` response tokens of one sample, ``P`` prompt tokens.

One code path for both kinds of machine: NCCL + TE layer spec when CUDA and
transformer_engine are present, gloo + local layer spec + ``moe_async.compat`` otherwise.

Status: 1 process (TP=PP=EP=DP=1) is complete and tested. TP/EP > 1 weight loading and
export (slicing/gathering full tensors) raise ``NotImplementedError``; the schedule,
loss and micro-batching are written to work with PP (forward_step returns
``(output, loss_func)``, micro-batches share one sequence length when PP > 1).
"""

from __future__ import annotations

import glob
import os
import socket
import time
from functools import partial
from typing import Any, Iterator

import torch

from moe_async.compat import apply_cpu_compat, cpu_device_scope, model_parallel_manual_seed
from moe_async.models import get_family, hf_config_dict, local_spec_name, tensor_checksum
from moe_async.replay.megatron import RouterReplayHook, transformer_overrides as replay_overrides  # router replay
from moe_async.trainer.config import TrainerConfig
from moe_async.trainer.loss import grpo_token_loss
from moe_async.types import Sample

Tensor = torch.Tensor

_METRIC_KEYS = ("pg_loss", "clipfrac", "tis_mean", "is_masked_frac", "logp_diff_mean", "kl_k3", "entropy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


class MegatronTrainer:
    """GRPO trainer over a Megatron-Core ``GPTModel`` built from an HF checkpoint directory.

    Args:
        cfg: trainer section of the experiment config.
        hf_path: directory with ``config.json`` and ``*.safetensors`` (HF on-disk names).
        master_addr, master_port: rendezvous for ``torch.distributed`` when this object
            initialises it (port: ``MASTER_PORT`` env, else a free port for 1 process).

    World size/rank come from ``WORLD_SIZE``/``RANK`` when set (torchrun), else 1 process.
    If ``torch.distributed`` / Megatron parallel state are already initialised (another
    trainer in the process) they are reused when the sizes agree.

    Attributes:
        version: weight_version, 0 after load, +1 per ``train_step``.
        hf_config: the HF config dict; ``family``: the model family.
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
        torch.set_num_threads(cfg.num_threads)
        self._owns_dist = False
        self._init_distributed(master_addr, master_port)
        tp, pp, ep = (
            cfg.tensor_model_parallel_size,
            cfg.pipeline_model_parallel_size,
            cfg.expert_model_parallel_size,
        )
        if ps.model_parallel_is_initialized():
            got = (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
            )
            if got != (tp, pp, ep):
                raise RuntimeError(
                    f"Megatron parallel state already initialised with (tp, pp, ep)={got}, "
                    f"this trainer wants {(tp, pp, ep)}"
                )
        else:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1,
            )
            self._owns_mp = True
        self._cpu = apply_cpu_compat()
        with cpu_device_scope():
            model_parallel_manual_seed(cfg.seed)
            self._build(hf_path)

    # ------------------------------------------------------------------ setup
    def _init_distributed(self, master_addr: str, master_port: int | None) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            return
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if master_port is None:
            env_port = os.environ.get("MASTER_PORT")
            if env_port:
                master_port = int(env_port)
            elif world == 1:
                master_port = _free_port()
            else:
                raise ValueError("master_port (or MASTER_PORT) is required for WORLD_SIZE > 1")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world,
        )
        self._owns_dist = True

    def _build(self, hf_path: str) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.cfg
        self.hf_config = hf_config_dict(hf_path)
        self.family = get_family(self.hf_config.get("model_type"))
        self.tf_config = self.family.transformer_config(
            self.hf_config,
            params_dtype=cfg.params_dtype,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            expert_model_parallel_size=cfg.expert_model_parallel_size,
            **replay_overrides(cfg.router_replay),  # router replay
        )
        use_te = torch.cuda.is_available() and _have_te()
        self.model = GPTModel(
            config=self.tf_config,
            transformer_layer_spec=self.family.layer_spec(self.hf_config, use_te=use_te),
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            **self.family.gpt_model_kwargs(self.hf_config),
        )
        self.router_replay = RouterReplayHook(self.model, self.tf_config, cfg.router_replay)  # router replay
        if torch.cuda.is_available():
            self.model.cuda(torch.cuda.current_device())
        self._load_hf_weights(hf_path)

        self.ddp_model = DistributedDataParallel(
            config=self.tf_config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
            module=self.model,
        )
        bf16 = cfg.params_dtype == "bf16"
        self.opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=False,
        )
        self.optimizer = get_megatron_optimizer(self.opt_config, [self.ddp_model])
        self.tf_config.finalize_model_grads_func = finalize_model_grads

    def _load_hf_weights(self, hf_path: str) -> None:
        """HF safetensors (all ``*.safetensors`` in ``hf_path``) -> mapping -> model params.
        Raises KeyError naming unused/missing tensors, ValueError on a shape mismatch."""
        from safetensors.torch import load_file

        if (
            self.cfg.tensor_model_parallel_size > 1
            or self.cfg.expert_model_parallel_size > 1
            or self.cfg.pipeline_model_parallel_size > 1
        ):
            raise NotImplementedError(
                "loading HF weights with TP/EP/PP > 1 (slicing full tensors per rank) is not "
                "implemented yet; use 1 process or a torch_dist checkpoint"
            )
        files = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {hf_path}")
        hf_state: dict[str, Tensor] = {}
        for f in files:
            for k, v in load_file(f).items():
                if k in hf_state:
                    raise ValueError(f"tensor {k!r} appears in two safetensors files ({f})")
                hf_state[k] = v
        meg = self.family.hf_to_megatron(hf_state, self.hf_config)
        params = dict(self.model.named_parameters())
        unset = []
        for name, p in params.items():
            key = local_spec_name(name)
            if key not in meg:
                unset.append(name)
                continue
            src = meg.pop(key)
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"shape mismatch for {name}: HF gives {tuple(src.shape)}, model {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(src.to(dtype=p.dtype, device=p.device))
        if unset or meg:
            raise KeyError(f"weight load: model params not set {unset}, converted tensors unused {sorted(meg)}")

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

    # ------------------------------------------------------------------ batching
    def _pack(self, samples: list[Sample], advantages: list[float] | None) -> list[dict[str, Tensor]]:
        """Right-padded micro-batches of ``cfg.micro_batch_size`` sequences.

        Each dict: ``tokens [B,S]`` long, ``position_ids [B,S]``, ``attention_mask
        [B,1,S,S]`` bool (True = masked, causal), and over the S-1 predicted positions:
        ``loss_mask [B,S-1]`` float (response tokens x loss_weight), ``advantages [B,S-1]``,
        ``rollout_logp [B,S-1]``, ``resp_len [B]``, ``prompt_len [B]``.
        """
        mbs = self.cfg.micro_batch_size
        lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        for i, s in enumerate(samples):
            if len(s.prompt_ids) == 0:
                raise ValueError(f"sample {i} has an empty prompt")
            if s.rollout_logprobs and len(s.rollout_logprobs) != len(s.response_ids):
                raise ValueError(
                    f"sample {i}: {len(s.rollout_logprobs)} rollout_logprobs for {len(s.response_ids)} response tokens"
                )
        fixed_len = max(lens) if self.cfg.pipeline_model_parallel_size > 1 else None
        out = []
        for start in range(0, len(samples), mbs):
            chunk = samples[start : start + mbs]
            S = fixed_len or max(lens[start : start + mbs])
            B = len(chunk)
            tokens = torch.zeros(B, S, dtype=torch.long)
            loss_mask = torch.zeros(B, S - 1)
            adv = torch.zeros(B, S - 1)
            rlp = torch.zeros(B, S - 1)
            plen = torch.zeros(B, dtype=torch.long)
            rlen = torch.zeros(B, dtype=torch.long)
            for b, s in enumerate(chunk):
                P, R = len(s.prompt_ids), len(s.response_ids)
                tokens[b, :P] = torch.tensor(s.prompt_ids, dtype=torch.long)
                if R:
                    tokens[b, P : P + R] = torch.tensor(s.response_ids, dtype=torch.long)
                    # position t predicts token t+1: response token j is predicted at P-1+j
                    loss_mask[b, P - 1 : P - 1 + R] = float(s.loss_weight)
                    if advantages is not None:
                        adv[b, P - 1 : P - 1 + R] = float(advantages[start + b])
                    if s.rollout_logprobs:
                        rlp[b, P - 1 : P - 1 + R] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
                plen[b], rlen[b] = P, R
            causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
            out.append(
                dict(
                    tokens=tokens,
                    position_ids=torch.arange(S).unsqueeze(0).expand(B, S).contiguous(),
                    attention_mask=causal.expand(B, 1, S, S).contiguous(),
                    loss_mask=loss_mask,
                    advantages=adv,
                    rollout_logp=rlp,
                    prompt_len=plen,
                    resp_len=rlen,
                )
            )
            out[-1].update(self.router_replay.pack(chunk, S))  # router replay: routes, masks
        return out

    def _to_device(self, mb: dict[str, Tensor]) -> dict[str, Tensor]:
        if torch.cuda.is_available():
            return {k: v.cuda(non_blocking=True) for k, v in mb.items()}
        return mb

    @staticmethod
    def _token_logp(logits_BSV: Tensor, tokens_BS: Tensor) -> tuple[Tensor, Tensor]:
        """logprob ``[B,S-1]`` of tokens 1..S-1 and the entropy ``[B,S-1]`` (fp32)."""
        logp_BSV = torch.log_softmax(logits_BSV[:, :-1].float(), dim=-1)
        logp = logp_BSV.gather(-1, tokens_BS[:, 1:].unsqueeze(-1)).squeeze(-1)
        return logp_BSV, logp

    # ------------------------------------------------------------------ train
    def train_step(self, batch: list[Sample], advantages: list[float]) -> dict[str, float]:
        """One GRPO optimizer step over ``batch`` (one advantage per sample).

        The loss is the per-token mean over the WHOLE batch: each micro-batch contributes
        ``sum(token losses) / N_total`` where ``N_total`` is the number of loss-bearing
        response tokens of the batch (loss_weight > 0); Megatron's division by the number of
        micro-batches is compensated, so the result does not depend on ``micro_batch_size``.
        The MoE load-balancing aux loss is added by Megatron (``MoEAuxLossAutoScaler``);
        its value comes from Megatron's aux-loss tracker.

        Returns (floats): ``loss`` (= pg_loss + moe_aux_loss_coeff * moe_aux_loss),
        ``pg_loss``, ``moe_aux_loss`` (unscaled, summed over MoE layers, averaged over
        micro-batches), ``grad_norm`` (before clipping), ``clipfrac``, ``tis_mean``,
        ``logp_diff_mean``, ``kl_k3``, ``entropy`` (token means), ``num_tokens``,
        ``num_microbatches``, ``step_time_s``, ``lr``, ``weight_version`` (after the step).
        Raises ValueError for mismatched lengths or a batch with no loss-bearing token.
        """
        if len(advantages) != len(batch):
            raise ValueError(f"{len(advantages)} advantages for {len(batch)} samples")
        t0 = time.perf_counter()
        with cpu_device_scope():
            out = self._train_step(batch, advantages)
        out["step_time_s"] = time.perf_counter() - t0
        return out

    def _train_step(self, batch: list[Sample], advantages: list[float]) -> dict[str, float]:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        cfg = self.cfg
        mbs_list = self._pack(batch, advantages)
        # --- off-policy correction (issue 7): decoupled PPO's proximal policy ---
        if cfg.off_policy_correction == "decoupled_ppo":
            self._attach_proximal_logp(batch, mbs_list)
        # --- end off-policy correction ---
        n_total = float(sum((mb["loss_mask"] > 0).sum().item() for mb in mbs_list))
        if n_total == 0:
            raise ValueError("train_step: batch has no loss-bearing response token")
        num_mb = len(mbs_list)
        S_max = max(mb["tokens"].shape[1] for mb in mbs_list)

        def loss_func(mb: dict[str, Tensor], logits_BSV: Tensor):
            logp_BSV, logp = self._token_logp(logits_BSV, mb["tokens"])
            mask = mb["loss_mask"]
            loss_sum, m = grpo_token_loss(
                logp,
                mb["advantages"],
                mask,
                rollout_logp=mb["rollout_logp"],
                eps_clip=cfg.eps_clip,
                eps_clip_high=cfg.eps_clip_high,
                off_policy_correction=cfg.off_policy_correction,
                tis_cap=cfg.tis_cap,
                logp_old=mb.get("logp_old"),  # off-policy correction: decoupled PPO only
                mis_low=cfg.mis_low,
                mis_high=cfg.mis_high,
                icepop_beta=cfg.icepop_beta,
                opsm_delta=cfg.opsm_delta,
            )
            with torch.no_grad():
                ent = -(logp_BSV.exp() * logp_BSV).sum(-1)
                n = m["num_tokens"]
                sums = {k: m[k] * n for k in _METRIC_KEYS if k in m}
                sums["entropy"] = (ent * (mask > 0)).sum()
                sums["num_tokens"] = (mask > 0).sum().to(torch.float32)
            # Megatron divides by num_microbatches: multiply back, divide by the global count.
            loss = loss_sum * (num_mb / n_total)
            self.router_replay.add_logprobs(logp, mb)  # router replay: mismatch metrics
            return loss, sums

        def forward_step(data_iterator, model):
            mb = self._to_device(next(data_iterator))
            self.router_replay.before_forward(mb)  # router replay: this micro-batch's routes
            logits = model(mb["tokens"], mb["position_ids"], mb["attention_mask"])
            return logits, partial(loss_func, mb)

        def record_forward(mb):  # router replay (R2): the old policy's own routes
            mb = self._to_device(mb)
            return self.ddp_model(mb["tokens"], mb["position_ids"], mb["attention_mask"])

        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        clear_aux_losses_tracker()
        self._set_lr()
        self.ddp_model.train()
        fb = get_forward_backward_func()
        with self.router_replay.step(mbs_list, record_forward):  # router replay: set/clear
            reduced = fb(
                forward_step_func=forward_step,
                data_iterator=iter(mbs_list),
                model=[self.ddp_model],
                num_microbatches=num_mb,
                seq_length=S_max,
                micro_batch_size=cfg.micro_batch_size,
                forward_only=False,
            )
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients)")
        self.version += 1

        tot = {k: 0.0 for k in (*_METRIC_KEYS, "num_tokens")}
        for d in reduced or []:
            for k, v in d.items():
                tot[k] += float(v)
        n = max(tot["num_tokens"], 1.0)
        out = {k: tot[k] / n for k in _METRIC_KEYS}
        aux = 0.0
        tracker = get_moe_layer_wise_logging_tracker()
        if "load_balancing_loss" in tracker:
            aux = float(tracker["load_balancing_loss"]["values"].sum()) / num_mb
        clear_aux_losses_tracker()
        out.update(
            moe_aux_loss=aux,
            loss=out["pg_loss"] + cfg.moe_aux_loss_coeff * aux,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            num_tokens=tot["num_tokens"],
            num_microbatches=float(num_mb),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            weight_version=float(self.version),
        )
        out.update(self.router_replay.metrics())  # router replay: agreement, mismatch
        return out

    # --- off-policy correction (issue 7) ---
    def _attach_proximal_logp(self, batch: list[Sample], mbs_list: list[dict[str, Tensor]]) -> None:
        """Decoupled PPO (Hilton et al., 2022; AReaL): ``mb["logp_old"] [B,S-1]`` float32 =
        logprobs of the response tokens under the weights BEFORE this update (recomputed with
        :meth:`compute_logprobs`, same packing), 0 elsewhere. Only the last PP stage uses it."""
        prox = self.compute_logprobs(batch)
        if not prox:  # not the last pipeline stage: the loss is not computed here
            return
        i = 0
        for mb in mbs_list:
            lo = torch.zeros_like(mb["rollout_logp"])
            for b in range(mb["tokens"].shape[0]):
                P, R = int(mb["prompt_len"][b]), int(mb["resp_len"][b])
                if R:
                    lo[b, P - 1 : P - 1 + R] = torch.tensor(prox[i], dtype=lo.dtype)
                i += 1
            mb["logp_old"] = lo
    # --- end off-policy correction ---

    def _set_lr(self) -> None:
        """Linear warmup over ``lr_warmup_steps`` then constant ``lr``."""
        w = self.cfg.lr_warmup_steps
        lr = self.cfg.lr * min(1.0, (self.version + 1) / w) if w else self.cfg.lr
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token logprobs (natural log, temperature 1) under the current
        weights, aligned with ``Sample.rollout_logprobs`` (entry j = log p(response_ids[j] |
        prompt, response_ids[:j])). Runs through Megatron's schedule (forward only).
        On non-last PP stages returns an empty list."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not samples:
            return []
        with cpu_device_scope():
            mbs_list = self._pack(samples, None)

            def loss_func(mb, logits_BSV):
                _, logp = self._token_logp(logits_BSV, mb["tokens"])
                return logits_BSV.sum() * 0.0, {"logp": logp.float().cpu()}

            def forward_step(data_iterator, model):
                mb = self._to_device(next(data_iterator))
                self.router_replay.before_forward(mb)  # router replay (R3: engine routes)
                logits = model(mb["tokens"], mb["position_ids"], mb["attention_mask"])
                return logits, partial(loss_func, mb)

            self.ddp_model.eval()
            with self.router_replay.step(mbs_list):  # router replay: set/clear (R2: own routes)
                reduced = get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iter(mbs_list),
                    model=[self.ddp_model],
                    num_microbatches=len(mbs_list),
                    seq_length=max(mb["tokens"].shape[1] for mb in mbs_list),
                    micro_batch_size=self.cfg.micro_batch_size,
                    forward_only=True,
                )
            self.ddp_model.train()
        if not ps.is_pipeline_last_stage():
            return []
        out: list[list[float]] = []
        for mb, d in zip(mbs_list, reduced):
            for b in range(mb["tokens"].shape[0]):
                P, R = int(mb["prompt_len"][b]), int(mb["resp_len"][b])
                out.append(d["logp"][b, P - 1 : P - 1 + R].tolist())
        return out

    # ------------------------------------------------------------------ export
    def export_hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """Current weights as ``(hf_name, full_tensor)`` under HF on-disk names.

        Data path: gather PP/EP -> gather TP -> rename to HF (the family's mapping table:
        fuse/split qkv and gate/up) -> cast to ``dtype`` (default: the model's dtype) ->
        yield. Tensors are detached CPU copies, safe to keep. At 1 process the gathers are
        identities; TP/EP/PP > 1 raises NotImplementedError for now. Raises KeyError if a
        parameter has no HF name or an HF tensor is left unset.
        """
        if (
            self.cfg.tensor_model_parallel_size > 1
            or self.cfg.expert_model_parallel_size > 1
            or self.cfg.pipeline_model_parallel_size > 1
        ):
            raise NotImplementedError("export_hf_weights with TP/EP/PP > 1 (gathers) is not implemented yet")

        def named() -> Iterator[tuple[str, Tensor]]:
            for n, p in self.model.named_parameters():
                yield n, p.detach().to("cpu")

        for hf_name, t in self.family.megatron_to_hf(named(), self.hf_config):
            t = t.to(dtype) if dtype is not None else t
            yield hf_name, t.clone()

    def hf_checksums(self) -> dict[str, str]:
        """``{hf_name: tensor_checksum(tensor)}`` of the current weights (sha256 of fp32 bytes;
        the engines compute the same with :func:`moe_async.models.tensor_checksum`)."""
        return {n: tensor_checksum(t) for n, t in self.export_hf_weights()}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Save model + optimizer as a Megatron ``torch_dist`` checkpoint (layout-independent),
        plus ``version``. The caller's script needs an ``if __name__ == "__main__"`` guard."""
        from megatron.core import dist_checkpointing

        os.makedirs(path, exist_ok=True)
        with cpu_device_scope():
            sd = {
                "model": self.model.sharded_state_dict(),
                "optimizer": self.optimizer.sharded_state_dict(self.model.sharded_state_dict()),
            }
            dist_checkpointing.save(sd, path)
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(path, "moe_async_version.txt"), "w") as f:
                f.write(str(self.version))

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint` (any parallel layout)."""
        from megatron.core import dist_checkpointing

        with cpu_device_scope():
            model_sd = self.model.sharded_state_dict()
            loaded = dist_checkpointing.load({"model": model_sd}, path)
            self.model.load_state_dict(loaded["model"])
            opt_sd = self.optimizer.sharded_state_dict(self.model.sharded_state_dict(), is_loading=True)
            loaded = dist_checkpointing.load({"optimizer": opt_sd}, path)
            self.optimizer.load_state_dict(loaded["optimizer"])
        with open(os.path.join(path, "moe_async_version.txt")) as f:
            self.version = int(f.read().strip())
