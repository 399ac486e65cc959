"""Megatron-Core GRPO trainer: model build from an HF checkpoint, train step, logprobs, export.

Legend (shapes): ``B`` sequences in a micro-batch, ``S`` padded sequence length (prompt +
response), ``V`` vocab, ``R`` response tokens of one sample, ``P`` prompt tokens.

One code path for both kinds of machine: NCCL + TE layer spec when CUDA and
transformer_engine are present, gloo + local layer spec + ``moe_async.compat`` otherwise.

Layouts: any TP (with sequence parallel) x PP x EP x DP that Megatron-Core builds (tested
on CPU/gloo: 1 process, TP2+SP, EP2, PP2, TP2+EP2, PP2+EP2, TP2+PP2+EP2, EP4; see
tests/trainer/test_layouts.py), and virtual pipeline stages (``trainer.
virtual_pipeline_model_parallel_size``: each PP rank holds a list of model chunks, one per
``vp_stage``, run by Megatron's interleaved 1F1B schedule with one data iterator per chunk;
PP2+VPP2 and PP2+VPP2+EP2 tested). HF weights are sliced per rank and gathered back for
export with :mod:`moe_async.trainer.sharding` (driven by Megatron's ``sharded_state_dict()``,
per chunk).

Data path at DP > 1: every rank is given the SAME global batch; rank ``d`` of the data-parallel
group trains on the contiguous slice ``d`` of it (padded with zero-weight copies so every DP
rank runs the same number of micro-batches, which EP's all-to-all needs); TP/PP ranks of
one replica see the same slice. The loss is ``sum(token losses) / N_global`` with ``N_global``
the loss-bearing tokens of the whole global batch (all-reduced over DP), multiplied by
``dp_size`` to undo DDP's gradient averaging, so losses and gradients do not depend on the
DP split or the micro-batching. Metrics are reduced over DP/PP and equal on every rank.

Context parallelism (``trainer.context_parallel_size`` C > 1): every micro-batch is padded to
a multiple of ``C * lcm(2, TP)`` and each CP rank ``r`` runs the model on sequence chunks ``r``
and ``2C-1-r`` of ``2C`` (Megatron-Core's ``get_batch_on_this_cp_rank``: tokens, positions,
padding mask, next-token labels, R3 routes); RoPE slices its table per CP rank itself
(Megatron's ``RotaryEmbedding`` with the CP group), attention runs over the CP group (TE's CP
attention on GPU; ``moe_async.compat.cp_attention`` on CPU). The per-token logprobs are
all-gathered over CP into token order before the loss (backward: each rank its own positions),
so the loss, its off-policy corrections (sequence-level ones included) and
``compute_logprobs`` see whole sequences, equal on the CP ranks; DDP averages gradients over
DP x CP and Megatron's schedule multiplies the loss by C, so the loss stays the per-token
mean over the global batch. Tested on CPU/gloo against 1 process: CP2, TP2+CP2, EP2+CP2,
PP2+CP2, every model family, router replay R3 (tests/trainer/test_layouts.py). Refused: CP
with router replay R2 or virtual pipeline stages.

Packed sequences (``trainer.sequence_packing``: 'thd', or 'auto' with CUDA + Transformer Engine):
each micro-batch reaches the model as ONE row ``[1,T]`` of its sequences back to back, with
Megatron-Core's ``PackedSeqParams`` (``qkv_format='thd'``, int32 ``cu_seqlens``, positions
restarting per sequence, no attention mask; ``T`` = real tokens rounded up to a multiple of TP,
at least 64, the tail marked in ``padding_mask``; PP > 1 exchanges each row's shape, Megatron's
``variable_seq_lengths``; with VPP rows are padded to the batch's largest ``T``), so no
FLOPs go to padding between sequences and ``max_tokens_per_micro_batch`` counts real tokens.
Attention runs per sequence: TE's THD attention on GPU, ``moe_async.compat.thd_attention`` on
CPU. The loss side stays per sequence (see :meth:`MegatronTrainer._pack`). Tested on CPU/gloo:
every family equal to the padded path at 1 process, and at TP2+SP, EP2, PP2 equal to 1 process,
micro-batch invariance, router replay R3 (tests/trainer/test_layouts.py,
test_megatron_trainer.py). Refused: THD with CP > 1.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import socket
import time
from functools import partial
from typing import Any, Callable, Iterator

import torch

from moe_async.compat import apply_cpu_compat, cpu_device_scope, model_parallel_manual_seed
from moe_async.models import get_family, hf_config_dict, local_spec_name, tensor_checksum
from moe_async.replay.megatron import RouterReplayHook, transformer_overrides as replay_overrides  # router replay
from moe_async.trainer.config import TrainerConfig, resolve_sequence_packing, unsupported_combination
from moe_async.trainer.finite import StepGuard, check_weights_finite
from moe_async.trainer.loss import grpo_token_loss
from moe_async.trainer.micro_batches import micro_batch_ranges, padded_len, split_to_count
from moe_async.trainer.sharding import (
    cp_positions,
    gather_full_state,
    gather_over_cp,
    load_full_state,
    needed_names,
    padded_vocab_size,
)
from moe_async.types import Sample

Tensor = torch.Tensor

# Micro-batches are right-padded to at least this many positions (see MegatronTrainer._pack)
MIN_SEQ_LEN = 64

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
        tp, pp, ep, cp = (
            cfg.tensor_model_parallel_size,
            cfg.pipeline_model_parallel_size,
            cfg.expert_model_parallel_size,
            cfg.context_parallel_size,
        )
        if ps.model_parallel_is_initialized():
            got = (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(),
            )
            if got != (tp, pp, ep, self._vpp, cp):
                raise RuntimeError(
                    f"Megatron parallel state already initialised with (tp, pp, ep, vpp, cp)={got}, "
                    f"this trainer wants {(tp, pp, ep, self._vpp, cp)}"
                )
            if ps.get_expert_tensor_parallel_world_size() != cfg.expert_tensor_parallel_size:
                raise RuntimeError(
                    f"Megatron parallel state already initialised with expert_tensor_parallel_size="
                    f"{ps.get_expert_tensor_parallel_world_size()}, this trainer wants "
                    f"trainer.expert_tensor_parallel_size={cfg.expert_tensor_parallel_size}")
        else:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                context_parallel_size=cp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
                virtual_pipeline_model_parallel_size=self._vpp,
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
            expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
            virtual_pipeline_model_parallel_size=self._vpp,
            **self._layout_overrides(),
            **replay_overrides(cfg.router_replay),  # router replay
            **self._expert_bias_overrides(),
        )
        self._check_expert_ffn_split()  # ETP divides the expert FFN size
        use_te = torch.cuda.is_available() and _have_te()
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
        import inspect

        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        # a family whose spec is a decoder block spec (deepseek_v3: first-k dense layers) lists
        # one model chunk's layers and takes ``vp_stage``: one spec per chunk with virtual
        # pipeline stages; a per-layer spec (the other families) is the same for every chunk
        per_chunk_spec = bool(self._vpp) and "vp_stage" in inspect.signature(self.family.layer_spec).parameters
        layer_spec = None if per_chunk_spec else self._cp_spec(self.family.layer_spec(self.hf_config, use_te=use_te))
        if self._vpp and isinstance(layer_spec, TransformerBlockSubmodules):  # one PP stage's layers
            raise NotImplementedError(
                f"trainer.virtual_pipeline_model_parallel_size={self._vpp} with model_type "
                f"{self.hf_config.get('model_type')!r}: the family's layer_spec returns a decoder block spec "
                "without a vp_stage argument (its layers would be one pipeline stage's, not one chunk's)")
        # This PP rank's model chunks (Megatron-LM's get_model): one per virtual stage v, holding
        # layers from Megatron's get_transformer_layer_offset(config, vp_stage=v); the first
        # stage's chunk 0 embeds, the last stage's last chunk has the output layer.
        self.models: list = []
        for v in range(self._vpp or 1):
            stage = dict(ignore_virtual=False, vp_stage=v) if self._vpp else {}
            self.models.append(GPTModel(
                config=self.tf_config,
                transformer_layer_spec=(self._cp_spec(self.family.layer_spec(self.hf_config, use_te=use_te, vp_stage=v))
                                        if per_chunk_spec else layer_spec),
                pre_process=ps.is_pipeline_first_stage(**stage),
                post_process=ps.is_pipeline_last_stage(**stage),
                parallel_output=False,  # logits gathered over TP: [B,S,V_padded] on every TP rank
                vp_stage=v if self._vpp else None,
                **gpt_kwargs,
            ))
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
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(self.opt_config, self.ddp_models)
        self.tf_config.finalize_model_grads_func = finalize_model_grads

    def _layout_overrides(self) -> dict[str, Any]:
        """TransformerConfig fields set by the trainer (beyond the family's): on CPU,
        ``gradient_accumulation_fusion`` through the compat stand-in (each linear layer's
        weight gradient is accumulated into DDP's ``main_grad`` by one in-place GEMM instead of
        a fresh tensor plus an add per micro-batch; compat mend 12); with packed THD rows at PP > 1
        (no VPP) Megatron's ``variable_seq_lengths``."""
        from moe_async.compat import enable_cpu_wgrad_accumulation_fusion

        out: dict[str, Any] = {}
        if self._cpu and enable_cpu_wgrad_accumulation_fusion():
            out["gradient_accumulation_fusion"] = True
        if self.cfg.context_parallel_size > 1:
            out["context_parallel_size"] = self.cfg.context_parallel_size
        if self._thd and self.cfg.pipeline_model_parallel_size > 1 and not self._vpp:
            # packed rows of different T: each p2p exchange sends its shape first (Megatron-Core's
            # p2p_communication._communicate_shapes; on gloo too: PP2 rows of 119/91/136/110 tokens
            # gave the loss and grad norm of rows all padded to 136, <= 1.2e-7). Not with VPP
            # (overlapped p2p): there _pack pads every row to the batch's largest T.
            out["variable_seq_lengths"] = True
            if not self.family.arch_args(self.hf_config).num_experts:
                # a dense model never dispatches, but TransformerConfig refuses variable_seq_lengths
                # with its default "allgather" dispatcher type
                out["moe_token_dispatcher_type"] = "alltoall"
        if self._vpp:
            # Megatron-LM's interleaved-schedule defaults (overlap_p2p_comm on, batch_p2p_comm =
            # not overlap_p2p_comm). A batched exchange at PP2 holds two sends and two receives
            # between the same two ranks, matched in posting order: the backward gradient was
            # received as the next chunk's activation (a 4-layer mixtral's step-1 grad norm was
            # 6e4 vs 1.5 on gloo). Megatron-LM refuses that case ("pipeline-model-parallel size
            # should be greater than 2 ... multiple p2p sends and recvs between same 2 ranks").
            out.update(overlap_p2p_comm=True, batch_p2p_comm=False)
        return out

    def _check_expert_tensor_parallel(self) -> None:
        """Megatron-Core's expert-layout rule (parallel_state.initialize_model_parallel), checked
        before it runs so that the error names the fields: ETP x EP x PP divides the world size,
        i.e. ETP x EP divides TP x CP x DP (expert data parallelism gets the rest).

        Raises:
            ValueError: naming ``trainer.expert_tensor_parallel_size`` and
                ``trainer.expert_model_parallel_size``.
        """
        etp, ep = self.cfg.expert_tensor_parallel_size, self.cfg.expert_model_parallel_size
        pp = self.cfg.pipeline_model_parallel_size
        tp, cp = self.cfg.tensor_model_parallel_size, self.cfg.context_parallel_size
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world % (tp * pp * cp):
            self.close()  # the process group this trainer created (the caller gets no trainer to close)
            raise ValueError(
                f"trainer.tensor_model_parallel_size={tp} x trainer.pipeline_model_parallel_size={pp} x "
                f"trainer.context_parallel_size={cp} = {tp * pp * cp} must divide the world size {world} "
                "(Megatron-Core: DP = world / (TP x PP x CP))")
        if world % (etp * ep * pp):
            self.close()  # the process group this trainer created (the caller gets no trainer to close)
            raise ValueError(
                f"trainer.expert_tensor_parallel_size={etp} x trainer.expert_model_parallel_size={ep} must divide "
                f"TP x CP x DP = world size {world} / trainer.pipeline_model_parallel_size={pp} "
                f"(Megatron-Core: world size divisible by ETP x EP x PP = {etp * ep * pp})")

    def _check_expert_ffn_split(self) -> None:
        """ETP splits every routed expert's FFN (``moe_ffn_hidden_size``: fc1's output rows per
        gate/up half, fc2's input columns) into ETP equal parts (transformer/moe/experts.py).

        Raises:
            ValueError: naming ``trainer.expert_tensor_parallel_size`` when it does not divide
                the expert FFN size.
        """
        etp = self.cfg.expert_tensor_parallel_size
        ffn = getattr(self.tf_config, "moe_ffn_hidden_size", None)
        if etp > 1 and getattr(self.tf_config, "num_moe_experts", None) and ffn and ffn % etp:
            self.close()  # the parallel state and process group this trainer created
            raise ValueError(
                f"trainer.expert_tensor_parallel_size={etp} must divide the expert FFN size "
                f"(moe_ffn_hidden_size={ffn}, from the HF config of {self.hf_path})")

    def _expert_bias_overrides(self) -> dict[str, Any]:
        """``moe_router_bias_update_rate`` for families whose router has an expert bias
        (Megatron's ``moe_router_enable_expert_bias``: deepseek_v3); Megatron-Core applies the
        update in ``finalize_model_grads`` after each step's gradients.

        Raises:
            ValueError: ``trainer.moe_router_bias_update_rate > 0`` for a family without one.
        """
        rate = float(self.cfg.moe_router_bias_update_rate)
        if rate == 0.0:
            return {}
        probe = self.family.transformer_config(self.hf_config)
        if not getattr(probe, "moe_router_enable_expert_bias", False):
            self.close()  # the parallel state and process group this trainer created
            raise ValueError(
                f"trainer.moe_router_bias_update_rate={rate}: model_type="
                f"{self.hf_config.get('model_type')!r} has no router expert bias (only deepseek_v3's "
                "e_score_correction_bias is updated aux-loss-free); set it to 0"
            )
        return {"moe_router_bias_update_rate": rate}

    def _check_virtual_pipeline(self, hf_config: dict[str, Any], family: Any) -> None:
        """Refuse, naming the field, a layer count not divisible by PP x VPP (ValueError;
        Megatron's TransformerConfig) with virtual pipeline stages. (Router replay R2 with VPP:
        :meth:`_check_combinations`; R3 runs: the replay hook keeps its micro-batch counter per
        model chunk.)"""
        vpp = self._vpp
        if not vpp:
            return
        pp = self.cfg.pipeline_model_parallel_size
        n = family.arch_args(hf_config).num_layers
        if n % (pp * vpp):
            raise ValueError(
                f"trainer.virtual_pipeline_model_parallel_size={vpp}: the model's {n} layers are not divisible "
                f"by pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp * vpp} "
                "(Megatron-Core's TransformerConfig requires it)")

    def _check_combinations(self) -> None:
        """Refuse, naming the fields, before any process group is created, a parallel
        combination this trainer does not run (:func:`moe_async.trainer.config.unsupported_combination`:
        R2 with CP or VPP, VPP with CP); a validated TrainerConfig refuses them already, this
        catches one built without validation. Raises NotImplementedError."""
        if (why := unsupported_combination(self.cfg)) is not None:
            raise NotImplementedError(why)

    def _cp_spec(self, spec: Any) -> Any:
        """The layer spec to build with: ``spec`` itself, except on the CPU path (no CUDA, local
        spec) with ``context_parallel_size > 1``, where the local core attention (which asserts
        CP == 1) is replaced by the compat CP core attention
        (:mod:`moe_async.compat.cp_attention`). With CUDA + TE the TE spec's own CP attention
        runs and the compat module is not imported.

        Likewise packed THD micro-batches (``trainer.sequence_packing`` resolved to thd) on the
        CPU path: the local core attention (which asserts ``packed_seq_params is None``) is
        replaced by the compat THD core attention (:mod:`moe_async.compat.thd_attention`);
        with CUDA + TE the TE spec's THD attention runs."""
        if self._thd and self._cpu:
            from moe_async.compat.thd_attention import thd_layer_spec

            spec, n = thd_layer_spec(spec)
            if n == 0:
                raise RuntimeError("trainer.sequence_packing='thd': the layer spec has no local core attention "
                                   "to replace with the CPU packed-sequence attention")
            return spec
        if self.cfg.context_parallel_size <= 1 or not self._cpu:
            return spec
        from moe_async.compat.cp_attention import cp_layer_spec

        spec, n = cp_layer_spec(spec)
        if n == 0:
            raise RuntimeError("trainer.context_parallel_size > 1: the layer spec has no local core attention "
                               "to replace with the CPU context-parallel attention")
        return spec

    def _load_hf_weights(self, hf_path: str) -> None:
        """HF safetensors (all ``*.safetensors`` in ``hf_path``) -> family mapping (full
        1-process Megatron tensors) -> this rank's slices (:func:`sharding.load_full_state`).

        When the files hold exactly the mapping table's HF on-disk names (the normal case),
        each rank reads only the HF tensors its own shards come from (``safe_open``; e.g. an
        EP rank reads its experts only), so host memory per rank is about its share of the
        model plus one full tensor. Otherwise (transformers' in-memory fused layout, stray or
        missing keys) every rank reads everything and the mapping raises naming the keys.
        Raises KeyError naming unused/missing HF tensors, local parameters with no source, or
        converted tensors that no rank of the world uses; ValueError on a shape mismatch
        (vocab padding excepted) or a tensor present in two files."""
        import contextlib

        import torch.distributed as dist
        from safetensors import safe_open
        from safetensors.torch import load_file

        from moe_async.errors import check_safetensors_file

        files = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {hf_path}")
        where: dict[str, str] = {}
        for f in files:
            check_safetensors_file(f)  # a truncated/corrupt file is named (CheckpointReadError)
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    if k in where:
                        raise ValueError(f"tensor {k!r} appears in two safetensors files ({f})")
                    where[k] = f
        from moe_async.models.deepseek_v3.hf_extras import hf_extras

        extras = hf_extras(self.hf_config, where)  # DeepSeek-V3: MTP keys skipped (logged), FP8 dequantized
        read_scale, where = extras.scale_reader(where), extras.weights(where)
        arch = self.family.arch_args(self.hf_config)
        table = self.family.table(arch)
        want = needed_names(self.models)  # 1-process local-spec names this rank slices from
        if set(where) == set(table.hf_keys):
            unknown = sorted(want - set(table.by_megatron))
            if unknown:
                raise KeyError(f"weight load: model params with no HF mapping: {unknown}")
            meg_local: dict[str, Tensor] = {}
            with contextlib.ExitStack() as stack:
                handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in files}
                for m in sorted(want):
                    rule, hs = table.by_megatron[m]
                    meg_local[m] = rule.fuse([extras.get_tensor(h, handles[where[h]].get_tensor(h), read_scale)
                                              for h in hs], arch)
        else:
            hf_state: dict[str, Tensor] = {}
            for f in files:
                hf_state.update(load_file(f))
            hf_state = extras.apply(hf_state)
            meg = self.family.hf_to_megatron(hf_state, self.hf_config)
            del hf_state
            # TE-spec names (fused norms) -> the local-spec names of the mapping table
            meg_local = {local_spec_name(k): v for k, v in meg.items()}
        load_full_state(self.models, meg_local, self.vocab_size)
        used = set(want)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, sorted(used))
            used = set().union(*map(set, everyone))
        unused = sorted(set(table.by_megatron) - used)
        if unused:
            raise KeyError(f"weight load: converted tensors used by no rank: {unused}")

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
    def _pack(self, samples: list[Sample], advantages: list[float] | None,
              equalize_dp: bool = False) -> list[dict[str, Tensor]]:
        """Right-padded micro-batches of at most ``cfg.micro_batch_size`` sequences and, with
        ``cfg.max_tokens_per_micro_batch``, at most that many padded positions ``B x S``
        (contiguous runs of ``samples``, :func:`micro_batches.micro_batch_ranges`; a sequence
        longer than the budget goes alone). ``equalize_dp``: the train step's DP-local slices
        may cut into different counts; the smaller counts are split further to the DP
        maximum (EP all-to-all and the schedule are collectives over the DP ranks).

        Padded length ``S``: the micro-batch's longest sequence (with PP > 1 the batch's
        longest: the p2p buffers have one shape), at least :data:`MIN_SEQ_LEN` (64), rounded
        up to a multiple of TP (sequence parallelism splits ``S``). The floor makes gradients
        independent of the micro-batching to fp32 accumulation order for short sequences too
        (measured 7e-8..9e-8 relative with 9..17-token samples, vs 1.9e-6 without it): on CPU
        two kernels round differently for tiny shapes than for the same rows inside a larger
        tensor, torch's softmax over a last dim shorter than the AVX-512 width (16 floats) and
        MKL's sgemm with <= 3 rows (an expert given 2 tokens). Micro-batches of >= 30 tokens
        measured 6e-8..8e-8 without padding, so longer ones are not padded further (rounding
        every length up to a multiple of 64 cost the CPU demo's train step ~25% tokens/s).
        Padding tokens are causal-masked and carry no loss; they are routed, but
        ``padding_mask`` keeps them out of Megatron's MoE load-balancing statistics (aux loss,
        z-loss), except with a router expert bias (see :meth:`_stage_padding_mask`).

        Each dict: ``tokens [B,S]`` long, ``position_ids [B,S]``, ``attention_mask
        [B,1,S,S]`` bool (True = masked, causal), ``padding_mask [B,S]`` bool (True = padding
        position, Megatron-Core's GPTModel ``padding_mask``), and over the S-1 predicted positions:
        ``loss_mask [B,S-1]`` float (response tokens x loss_weight), ``advantages [B,S-1]``,
        ``rollout_logp [B,S-1]``, ``resp_len [B]``, ``prompt_len [B]``; ``logit_b [N]``,
        ``logit_s [N]`` the (sequence, position) of the N response-predicting positions.

        Packed THD micro-batches (``trainer.sequence_packing`` resolved to thd): the model sees
        ONE row of the micro-batch's sequences back to back (:meth:`_thd_entries`); the loss
        side above stays per sequence (``tokens [B,S]`` with ``S`` the longest sequence, no
        floor; ``loss_mask``, ``advantages``, ``rollout_logp``, ``logit_b``/``logit_s``), so
        the loss, its sequence-level off-policy corrections and the per-sample logprobs are
        the padded path's; no ``attention_mask``/``position_ids``/``padding_mask [B,S]``. The
        token budget counts the packed row's ``T`` (real tokens). With PP > 1 each row keeps
        its own ``T`` through Megatron-Core's ``variable_seq_lengths`` (every p2p exchange
        sends its shape first; see :meth:`_layout_overrides`); with virtual pipeline stages
        every row is padded to the batch's largest ``T`` (one p2p shape) instead.
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
        thd = self._thd
        pp = self.cfg.pipeline_model_parallel_size
        fixed_len = max(lens) if pp > 1 and not thd else None
        # S (padded) or T (thd): SP splits it over TP ranks; CP into 2*CP chunks (see _seq_multiple)
        pad = dict(min_len=MIN_SEQ_LEN, multiple=self._seq_multiple(), fixed_len=fixed_len)
        budget = self.cfg.max_tokens_per_micro_batch
        ranges = micro_batch_ranges(lens, mbs, budget, packed=thd, **pad)
        if equalize_dp and budget is not None and self._dp_size() > 1:
            ranges = split_to_count(ranges, int(self._dp_max(len(ranges))))
        # thd: the packed row's length T per micro-batch; with PP > 1 and without Megatron's
        # variable_seq_lengths (VPP) the largest (one p2p shape)
        T_rows = [padded_len([sum(lens[a:b])], min_len=MIN_SEQ_LEN, multiple=self._seq_multiple())
                  for a, b in ranges] if thd else []
        if thd and pp > 1 and not getattr(self.tf_config, "variable_seq_lengths", False):
            T_rows = [max(T_rows)] * len(ranges)
        out = []
        for i, (start, end) in enumerate(ranges):
            chunk = samples[start:end]
            S = max(lens[start:end]) if thd else padded_len(lens[start:end], **pad)
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
            mb = dict(tokens=tokens, loss_mask=loss_mask, advantages=adv, rollout_logp=rlp,
                      prompt_len=plen, resp_len=rlen)
            if not thd:
                causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
                mb.update(position_ids=torch.arange(S).unsqueeze(0).expand(B, S).contiguous(),
                          attention_mask=causal.expand(B, 1, S, S).contiguous(),
                          padding_mask=torch.arange(S).unsqueeze(0) >= (plen + rlen).unsqueeze(1))
            out.append(mb)
            # response positions (b, t): the only rows whose logits the loss and logprobs use
            rows = [(b, t) for b in range(B) for t in range(int(plen[b]) - 1, int(plen[b] + rlen[b]) - 1)]
            out[-1]["logit_b"] = torch.tensor([b for b, _ in rows], dtype=torch.long)
            out[-1]["logit_s"] = torch.tensor([t for _, t in rows], dtype=torch.long)
            # router replay: routes (thd: in the packed row's order), masks
            out[-1].update(self.router_replay.pack(chunk, S, packed_len=T_rows[i] if thd else None))
            if thd:
                out[-1].update(self._thd_entries(out[-1], lens[start:end], T_rows[i]))
            if self.cfg.context_parallel_size > 1:
                out[-1].update(self._cp_split(out[-1]))
        return out

    def _thd_entries(self, mb: dict[str, Any], lens: list[int], T: int) -> dict[str, Any]:
        """The packed THD row of a micro-batch whose loss-side ``tokens [B,S]`` hold sequences of
        ``lens`` tokens, as extra entries (Megatron-Core's packed sequences, as TE's THD
        attention takes them; Megatron-LM's ``get_packed_seq_params``):

        ``thd_tokens [1,T]`` long: the sequences back to back (sequence ``b`` at offsets
        ``cu[b] .. cu[b+1]-1``), then tail padding (token 0) up to ``T``; ``thd_position_ids
        [1,T]``: 0..l-1 per sequence (the tail continues the last one's); ``thd_padding_mask
        [1,T]`` bool, True on the tail; ``cu_seqlens [B+1]`` int32 (real lengths, Megatron's
        ``cu_seqlens_q/kv``), ``cu_seqlens_padded [B+1]`` int32 (the same with the last one
        ending at ``T``: ``cu_seqlens_q/kv_padded``; RoPE's ``_apply_rotary_pos_emb_thd``
        splits all ``T`` tokens by it); ``thd_max_seqlen`` int (longest padded segment: the
        RoPE table length); ``thd_logit_s [N]``: the packed offset of each response-predicting
        row ``(logit_b, logit_s)`` (``cu[logit_b] + logit_s``)."""
        from moe_async.replay.routes import pack_rows

        B = len(lens)
        total = int(sum(lens))
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        cu_pad = cu.clone()
        cu_pad[-1] = T
        pos = torch.arange(T).unsqueeze(0).expand(B, T).contiguous()  # [B, T]: row b's own positions
        last = lens[-1]
        position_ids = pack_rows(pos, lens, T, 0)
        position_ids[0, total:] = torch.arange(last, last + T - total)
        return dict(
            thd_tokens=pack_rows(mb["tokens"], lens, T, 0),
            thd_position_ids=position_ids,
            thd_padding_mask=torch.arange(T).unsqueeze(0) >= total,
            cu_seqlens=cu,
            cu_seqlens_padded=cu_pad,
            thd_max_seqlen=int((cu_pad[1:] - cu_pad[:-1]).max()),
            thd_logit_s=cu[mb["logit_b"]].long() + mb["logit_s"],
        )

    @staticmethod
    def _packed_seq_params(mb: dict[str, Any]) -> Any:
        """Megatron-Core's ``PackedSeqParams`` (``qkv_format='thd'``) of a packed micro-batch
        (see :meth:`_thd_entries`); self-attention, so q and kv share the cu_seqlens."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb["cu_seqlens"], cu_seqlens_kv=mb["cu_seqlens"],
            cu_seqlens_q_padded=mb["cu_seqlens_padded"], cu_seqlens_kv_padded=mb["cu_seqlens_padded"],
            max_seqlen_q=mb["thd_max_seqlen"], max_seqlen_kv=mb["thd_max_seqlen"],
        )

    def _schedule_shape(self, mbs_list: list[dict[str, Any]]) -> tuple[int, int]:
        """``(seq_length, micro_batch_size)`` for Megatron's schedule (its p2p buffers with
        PP > 1: ``[seq_length/TP, micro_batch_size, hidden]``): the padded micro-batches'
        ``(S, cfg.micro_batch_size)``, packed ones' ``(T, 1)``."""
        if self._thd:
            return max(mb["thd_tokens"].shape[1] for mb in mbs_list), 1
        return max(mb["tokens"].shape[1] for mb in mbs_list), self.cfg.micro_batch_size

    def _seq_multiple(self) -> int:
        """Padded sequence lengths are multiples of this: TP (sequence parallelism splits S
        over the TP ranks); with CP > 1, of ``2*CP`` (Megatron's load-balanced split into
        ``2*CP`` chunks) with each rank's ``S/CP`` positions a multiple of TP:
        ``CP * lcm(2, TP)``."""
        import math

        tp, cp = self.cfg.tensor_model_parallel_size, self.cfg.context_parallel_size
        return tp if cp == 1 else cp * math.lcm(2, tp)

    _CP_SEQ_KEYS = ("tokens", "position_ids", "padding_mask", "routes_BSLK", "routes_real_BS")

    def _cp_split(self, mb: dict[str, Tensor]) -> dict[str, Tensor]:
        """CP > 1: this context-parallel rank's part of a packed micro-batch (which keeps its
        whole-sequence tensors for the loss), as extra entries. Sequence-dim tensors are split
        by Megatron-Core's ``get_batch_on_this_cp_rank`` (chunks ``r`` and ``2*CP-1-r`` of
        ``2*CP``): ``cp_tokens``, ``cp_position_ids`` (global positions), ``cp_padding_mask``,
        ``cp_labels`` (token ``t+1`` at position ``t``, 0 at the last), and with router replay
        ``cp_routes_BSLK``, ``cp_routes_real_BS``; all ``[B, S/CP, ...]``.
        ``cp_logit_b``/``cp_logit_s``: the response-predicting rows of ``logit_b``/``logit_s``
        this rank holds, as (sequence, local position). The loss side (loss mask, advantages,
        rollout/old logprobs) stays whole: logprobs are gathered over CP before the loss
        (:meth:`_cp_token_logp`)."""
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_batch_on_this_cp_rank

        tokens = mb["tokens"]
        B, S = tokens.shape
        labels = torch.zeros_like(tokens)
        labels[:, :-1] = tokens[:, 1:]
        seq = {k: mb[k].contiguous() for k in self._CP_SEQ_KEYS if mb.get(k) is not None}
        seq["labels"] = labels
        local = get_batch_on_this_cp_rank(seq, ps.get_context_parallel_group())
        cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        inv = torch.full((S,), -1, dtype=torch.long)
        inv[cp_positions(S, cp, r)] = torch.arange(S // cp)
        s_local = inv[mb["logit_s"]]
        keep = s_local >= 0
        out = {f"cp_{k}": v for k, v in local.items()}
        out.update(cp_logit_b=mb["logit_b"][keep], cp_logit_s=s_local[keep])
        return out

    def _model_view(self, mb: dict[str, Tensor]) -> dict[str, Tensor]:
        """The micro-batch as the model (and the router replay hook) sees it on this rank:
        with CP the ``cp_*`` entries (this rank's sequence chunks) in place of the whole
        sequence's tokens, positions, padding mask and routes; packed (thd) the ``thd_*``
        entries (the packed row ``[1,T]``; its routes are already packed); ``mb`` itself
        otherwise."""
        if "thd_tokens" in mb:
            return {**mb, "tokens": mb["thd_tokens"], "position_ids": mb["thd_position_ids"],
                    "padding_mask": mb["thd_padding_mask"]}
        if "cp_tokens" not in mb:
            return mb
        view = dict(mb)
        for k in self._CP_SEQ_KEYS:
            if f"cp_{k}" in mb:
                view[k] = mb[f"cp_{k}"]
        return view

    def _to_device(self, mb: dict[str, Tensor]) -> dict[str, Tensor]:
        if torch.cuda.is_available():
            return {k: v.cuda(non_blocking=True) if isinstance(v, Tensor) else v for k, v in mb.items()}
        return mb

    def _forward(self, model, mb: dict[str, Tensor]) -> tuple[Tensor, bool]:
        """Forward of one micro-batch: ``(output, rows_only)``. On the last PP stage the
        output is the logits: ``[1,N,V_padded]`` for the N response positions of
        ``mb["logit_b"/"logit_s"]`` when ``rows_only`` (the output layer is applied to those
        hidden states only: prompt positions carry no loss), else ``[B,S,V_padded]``. Rows
        are selected when the output layer is not sequence parallel (TP == 1); under
        sequence parallelism its input is this rank's sequence shard and all rows go."""
        rows_only = self._rows_hook is not None
        extra: dict[str, Any] = {}
        if "cp_tokens" in mb:  # CP: this rank's chunks; causal attention over CP (no dense mask)
            self._logit_rows = (mb["cp_logit_s"], mb["cp_logit_b"]) if rows_only else None
            inputs = (mb["cp_tokens"], mb["cp_position_ids"], None)
            padding_mask = mb.get("cp_padding_mask")
        elif "thd_tokens" in mb:  # packed: one row [1,T], attention per cu_seqlens segment
            s = mb["thd_logit_s"]
            self._logit_rows = (s, torch.zeros_like(s)) if rows_only else None
            inputs = (mb["thd_tokens"], mb["thd_position_ids"], None)
            padding_mask = mb["thd_padding_mask"]
            extra["packed_seq_params"] = self._packed_seq_params(mb)
        else:
            self._logit_rows = (mb["logit_s"], mb["logit_b"]) if rows_only else None
            inputs = (mb["tokens"], mb["position_ids"], mb["attention_mask"])
            padding_mask = mb.get("padding_mask")
        if self._bias_hooks and padding_mask is not None:  # see _uncount_padding
            pm = self._sp_shard(padding_mask) if self.tf_config.sequence_parallel else padding_mask
            self._router_pad = pm.transpose(0, 1).reshape(-1)  # router token order: [S, B] flattened
        try:
            return model(*inputs, padding_mask=self._stage_padding_mask(model, padding_mask), **extra), rows_only
        finally:
            self._logit_rows = None
            self._router_pad = None

    def _uncount_padding(self, module, args, output) -> None:
        """Forward hook of a router with an expert bias (deepseek_v3): takes this micro-batch's
        padding positions back out of ``local_tokens_per_expert``, the token counts that
        Megatron-Core's aux-loss-free update (``get_updated_expert_bias``) balances. Megatron
        counts every routed row because this trainer cannot pass it the padding mask there
        (see :meth:`_stage_padding_mask`); without this the update's direction depended on how
        much padding the micro-batching added. ``output``: ``(probs, routing_map [tokens,
        experts] bool)``; counted only where Megatron counts (grad enabled)."""
        pad = self._router_pad
        if pad is None or not torch.is_grad_enabled():
            return
        routing_map = output[1]
        if routing_map.shape[0] != pad.numel():
            raise RuntimeError(f"router saw {routing_map.shape[0]} tokens, the micro-batch's padding mask "
                               f"has {pad.numel()} (this rank's shard)")
        with torch.no_grad():
            cnt = module.local_tokens_per_expert
            cnt -= routing_map[pad.to(routing_map.device)].sum(0).to(cnt.dtype)

    def _stage_padding_mask(self, model, padding_mask: Tensor | None) -> Tensor | None:
        """``padding_mask [B,S]`` as this stage's MoE routers see it: Megatron-Core's GPTModel
        splits it over the TP ranks under sequence parallelism only on the first pipeline
        stage (with the embedding); a later stage gets this rank's ``[B,S/TP]`` slice here,
        the same contiguous split as ``scatter_to_sequence_parallel_region``.

        ``None`` (padding routed and counted like real tokens) for routers with an expert bias
        (deepseek_v3): Megatron-Core 0.16.1's ``TopKRouter._apply_expert_bias`` ANDs the
        ``[tokens, experts]`` routing map with the flattened ``[tokens]`` mask, which does not
        broadcast (fixed upstream with ``unsqueeze(-1)``)."""
        from megatron.core.utils import get_attr_wrapped_model

        if getattr(self.tf_config, "moe_router_enable_expert_bias", False):
            return None
        if padding_mask is None or not self.tf_config.sequence_parallel:
            return padding_mask
        if get_attr_wrapped_model(model, "pre_process"):
            return padding_mask
        return self._sp_shard(padding_mask)

    @staticmethod
    def _sp_shard(x: Tensor) -> Tensor:
        """``x [B,S,...]`` -> this TP rank's ``[B,S/TP,...]``: the contiguous sequence split of
        sequence parallelism (``scatter_to_sequence_parallel_region`` on ``[S,B,...]``)."""
        from megatron.core import parallel_state as ps

        tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        n = x.shape[1] // tp
        return x[:, r * n : (r + 1) * n].contiguous()

    def _select_logit_rows(self, module, args, kwargs):
        """Forward pre-hook of the output layer (see :meth:`_forward`): hidden ``[S,B,H]`` ->
        ``[N,1,H]`` of the selected (position, sequence) rows."""
        if self._logit_rows is None:
            return None
        s, b = self._logit_rows
        return (args[0][s, b].unsqueeze(1), *args[1:]), kwargs

    def _token_logp(self, logits: Tensor, mb: dict[str, Tensor], rows_only: bool,
                    entropy: bool = False) -> tuple[Tensor | None, Tensor]:
        """``(entropy [B,S-1] or None, logp [B,S-1])``: fp32 (fp64 for fp64 logits) log-softmax over the HF vocab V
        (the padded vocab rows are dropped first); ``logp[b,t]`` = log-prob of token t+1,
        ``entropy[b,t]`` of the predicted distribution (no grad). With ``rows_only``
        (``logits [1,N,V_padded]``) positions other than the response rows hold 0."""
        if "cp_tokens" in mb:
            return self._cp_token_logp(logits, mb, rows_only, entropy)
        if "thd_tokens" in mb and not rows_only:  # packed [1,T,V]: the response rows, in logit_b/s order
            logits, rows_only = logits[:, mb["thd_logit_s"]], True
        tokens = mb["tokens"]
        B, S = tokens.shape
        wide = torch.promote_types(logits.dtype, torch.float32)  # fp32 (fp64 stays fp64)
        if rows_only:
            b, s = mb["logit_b"], mb["logit_s"]
            logp_NV = torch.log_softmax(logits[0, :, : self.vocab_size].to(wide), dim=-1)
            lp = logp_NV.gather(-1, tokens[b, s + 1].unsqueeze(-1)).squeeze(-1)
            logp = torch.zeros(B, S - 1, dtype=lp.dtype, device=lp.device).index_put((b, s), lp)
            ent = None
            if entropy:
                with torch.no_grad():
                    e = -(logp_NV.exp() * logp_NV).sum(-1)
                    ent = torch.zeros(B, S - 1, dtype=e.dtype, device=e.device).index_put((b, s), e)
            return ent, logp
        logp_BSV = torch.log_softmax(logits[:, :-1, : self.vocab_size].to(wide), dim=-1)
        logp = logp_BSV.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        ent = None
        if entropy:
            with torch.no_grad():
                ent = -(logp_BSV.exp() * logp_BSV).sum(-1)
        return ent, logp

    def _cp_token_logp(self, logits: Tensor, mb: dict[str, Tensor], rows_only: bool,
                       entropy: bool = False) -> tuple[Tensor | None, Tensor]:
        """:meth:`_token_logp` with CP > 1: logits of this rank's positions (``[1,N_local,V_padded]``
        rows ``cp_logit_b/s`` when ``rows_only``, else ``[B,S/CP,V_padded]``) -> this rank's
        ``[B,S/CP]`` logprobs of ``cp_labels`` -> all-gathered over the CP group into global
        order ``[B,S]`` (differentiable; each rank back-propagates its own positions, see
        :func:`sharding.gather_over_cp`) -> ``[B,S-1]``, equal on every CP rank."""
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
        labels = mb["cp_labels"]
        B, S_loc = labels.shape
        wide = torch.promote_types(logits.dtype, torch.float32)
        ent_loc = None
        if rows_only:
            b, s = mb["cp_logit_b"], mb["cp_logit_s"]
            logp_NV = torch.log_softmax(logits[0, :, : self.vocab_size].to(wide), dim=-1)
            lp = logp_NV.gather(-1, labels[b, s].unsqueeze(-1)).squeeze(-1)
            logp_loc = torch.zeros(B, S_loc, dtype=lp.dtype, device=lp.device).index_put((b, s), lp)
            if entropy:
                with torch.no_grad():
                    e = -(logp_NV.exp() * logp_NV).sum(-1)
                    ent_loc = torch.zeros(B, S_loc, dtype=e.dtype, device=e.device).index_put((b, s), e)
        else:
            logp_BSV = torch.log_softmax(logits[:, :, : self.vocab_size].to(wide), dim=-1)
            logp_loc = logp_BSV.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            if entropy:
                with torch.no_grad():
                    ent_loc = -(logp_BSV.exp() * logp_BSV).sum(-1)
        logp = gather_over_cp(logp_loc, group)[:, :-1]
        ent = None
        if ent_loc is not None:
            with torch.no_grad():
                ent = gather_over_cp(ent_loc, group)[:, :-1]
        return ent, logp

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
        Raises ValueError for mismatched lengths or a batch with no loss-bearing token;
        :class:`~moe_async.trainer.finite.NonFiniteError` (all ranks) for a NaN/inf loss or
        gradient, naming the sample, before the optimizer runs (weights and version unchanged).
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
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        cfg = self.cfg
        guard = StepGuard(batch, self.version)  # C28: non-finite loss/grad fails before the optimizer
        batch, advantages = self._dp_local(batch, advantages)  # DP: this replica's slice
        mbs_list = self._pack(batch, advantages, equalize_dp=True)
        guard.bind(mbs_list)
        # --- off-policy correction (issue 7): decoupled PPO's proximal policy ---
        if cfg.off_policy_correction == "decoupled_ppo":
            self._attach_proximal_logp(batch, mbs_list)
        # --- end off-policy correction ---
        n_total = self._dp_sum(float(sum((mb["loss_mask"] > 0).sum().item() for mb in mbs_list)))
        dp = self._dp_size()
        if n_total == 0:
            raise ValueError("train_step: batch has no loss-bearing response token")
        num_mb = len(mbs_list)
        seq_length, mb_size = self._schedule_shape(mbs_list)

        def loss_func(mb: dict[str, Tensor], rows_only: bool, logits: Tensor):
            ent, logp = self._token_logp(logits, mb, rows_only, entropy=True)
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
            guard.record(mb, m["nonfinite_rows"], loss_sum)
            with torch.no_grad():
                n = m["num_tokens"]
                sums = {k: m[k] * n for k in _METRIC_KEYS if k in m}
                sums["entropy"] = (ent * (mask > 0)).sum()
                sums["num_tokens"] = (mask > 0).sum().to(torch.float32)
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
            if "thd_tokens" in mb:
                return self.ddp_model(mb["thd_tokens"], mb["thd_position_ids"], None,
                                      packed_seq_params=self._packed_seq_params(mb))
            return self.ddp_model(mb["tokens"], mb["position_ids"], mb["attention_mask"])

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

        tot = {k: 0.0 for k in (*_METRIC_KEYS, "num_tokens")}
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
        prox = self.compute_logprobs(batch, equalize_dp=True)  # DP-local batches: cut to one count
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

    # ------------------------------------------------------------------ data parallel
    def _dp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    def _dp_local(self, batch: list[Sample], advantages: list[float]) -> tuple[list[Sample], list[float]]:
        """This DP rank's contiguous slice of the global batch (every rank is given the same
        global batch). Slices are padded to ``ceil(len/dp)`` with zero-weight copies of the
        first sample (no loss, no token count) so that every DP rank runs the same number of
        micro-batches (EP all-to-all and DDP are collectives over DP ranks)."""
        from megatron.core import parallel_state as ps

        dp = self._dp_size()
        b, a = list(batch), list(advantages)
        if dp > 1:
            r = ps.get_data_parallel_rank()
            per = -(-len(batch) // dp)
            lo, hi = min(r * per, len(batch)), min((r + 1) * per, len(batch))
            b, a = list(batch[lo:hi]), list(advantages[lo:hi])
            while len(b) < per:
                b.append(dataclasses.replace(batch[0], loss_weight=0.0))
                a.append(0.0)
        b = self._pad_for_pp(b)
        return b, a + [0.0] * (len(b) - len(a))

    def _pad_for_pp(self, samples: list[Sample]) -> list[Sample]:
        """With PP > 1 every micro-batch must hold exactly ``micro_batch_size`` sequences (the
        p2p receive buffers are sized from it): pad with zero-weight copies of the first
        sample. With virtual pipeline stages, also pad the number of micro-batches to a
        multiple of PP (Megatron's interleaved schedule runs micro-batches in groups of
        ``microbatch_group_size_per_vp_stage`` = PP and refuses a partial last group).
        Identity at PP == 1."""
        mbs = self.cfg.micro_batch_size
        unit = mbs * (self.cfg.pipeline_model_parallel_size if self._vpp else 1)
        if self.cfg.pipeline_model_parallel_size == 1 or not samples or len(samples) % unit == 0:
            return list(samples)
        pad = [dataclasses.replace(samples[0], loss_weight=0.0)] * (unit - len(samples) % unit)
        return list(samples) + pad

    def _data_iterators(self, mbs_list: list[dict[str, Tensor]]):
        """Megatron's ``data_iterator`` argument: one iterator over the micro-batches, or with
        virtual pipeline stages one per model chunk (each chunk runs every micro-batch, in
        order; the interleaved schedule calls ``forward_step`` with the chunk's iterator)."""
        if len(self.ddp_models) == 1:
            return iter(mbs_list)
        return [iter(mbs_list) for _ in self.ddp_models]

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

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample], equalize_dp: bool = False) -> list[list[float]]:
        """Per-response-token logprobs (natural log, temperature 1) under the current
        weights, aligned with ``Sample.rollout_logprobs`` (entry j = log p(response_ids[j] |
        prompt, response_ids[:j])). Runs through Megatron's schedule (forward only).

        Collective: every rank of the world calls it with the same ``samples``; each DP
        replica computes all of them (no DP split), and the last PP stage's result is
        broadcast over the PP group, so every rank returns the same lists. ``equalize_dp``
        (internal: decoupled PPO's proximal logprobs of each DP rank's own slice): DP ranks
        holding different samples cut them into one common micro-batch count."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not samples:
            return []
        n_real = len(samples)
        samples = self._pad_for_pp(samples)
        with cpu_device_scope():
            mbs_list = self._pack(samples, None, equalize_dp=equalize_dp)

            def loss_func(mb, rows_only, logits):
                _, logp = self._token_logp(logits, mb, rows_only)
                return logits.sum() * 0.0, {"logp": logp.float().cpu()}

            def forward_step(data_iterator, model):
                mb = self._to_device(next(data_iterator))
                self.router_replay.before_forward(self._model_view(mb), model)  # router replay (R3: engine routes)
                logits, rows_only = self._forward(model, mb)
                return logits, partial(loss_func, mb, rows_only)

            for d in self.ddp_models:
                d.eval()
            seq_length, mb_size = self._schedule_shape(mbs_list)
            with self.router_replay.step(mbs_list):  # router replay: set/clear (R2: own routes)
                reduced = get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=self._data_iterators(mbs_list),
                    model=self.ddp_models,
                    num_microbatches=len(mbs_list),
                    seq_length=seq_length,
                    micro_batch_size=mb_size,
                    forward_only=True,
                )
            for d in self.ddp_models:
                d.train()
        out: list[list[float]] = []
        if ps.is_pipeline_last_stage():
            for mb, d in zip(mbs_list, reduced):
                for b in range(mb["tokens"].shape[0]):
                    P, R = int(mb["prompt_len"][b]), int(mb["resp_len"][b])
                    out.append(d["logp"][b, P - 1 : P - 1 + R].tolist())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            import torch.distributed as dist

            box = [out]
            dist.broadcast_object_list(
                box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
            out = box[0]
        return out[:n_real]

    # ------------------------------------------------------------------ export
    def export_hf_weights(self, dtype: torch.dtype | None = None,
                          out: Callable[[str, tuple[int, ...], torch.dtype], Tensor | None] | None = None,
                          ) -> Iterator[tuple[str, Tensor]]:
        """Current weights as ``(hf_name, full_tensor)`` under HF on-disk names.

        Data path: every rank's primary shards (TP slices, EP experts under their global ids,
        PP stages' layers under their global layer index) -> point-to-point to global rank 0
        -> full 1-process Megatron tensor, vocab padding dropped
        (:func:`sharding.gather_full_state`) -> rename to HF (the family's mapping table:
        split qkv and gate/up) -> cast to ``dtype`` (default: the model's dtype) -> yield.

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
        import torch.distributed as dist

        check_weights_finite(self.models, self.version)  # C28: nothing non-finite reaches an engine
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.relayout_params(out)  # 1 process: builds the plan; with out, moves parameters once
        plan = self.__dict__.get("_hf_export_plan")
        if plan is not None:  # 1 process: the parameters are the full tensors (views); no
            # CUDA->CPU function mode around the yields (it would tax the consumer's torch calls)
            yield from plan.export(plan.order(out) if out is not None else sorted(plan.entries), out, dtype)
            return
        with cpu_device_scope():
            full = gather_full_state(self.models, self.vocab_size, dst=0)
            if rank != 0:
                for _ in full:  # take part in the collectives
                    pass
                return
            for hf_name, t in self.family.megatron_to_hf(full, self.hf_config):
                dst = out(hf_name, tuple(t.shape), dtype or t.dtype) if out is not None else None
                if dst is not None:  # one copy (with the cast) into the caller's buffer
                    dst.copy_(t)
                    yield hf_name, dst
                    continue
                t = t.to(dtype) if dtype is not None else t
                yield hf_name, t.clone()

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
        import torch.distributed as dist

        from moe_async.weight_sync.relayout import WholeTensorExport, describe, whole_tensors

        if "_hf_export_plan" not in self.__dict__:  # once
            plan = None
            world = dist.get_world_size() if dist.is_initialized() else 1
            a = self.family.arch_args(self.hf_config)
            table = self.family.table(a)
            with cpu_device_scope():  # Megatron's sharded_state_dict
                whole = whole_tensors(self.models, self.vocab_size) if world == 1 else None
            if whole is not None and {local_spec_name(n) for n in whole} != set(table.by_megatron):
                whole = None  # not the mapping's names: the gather path names the difference
            if whole is not None:

                def split(name: str, t: Tensor) -> list[tuple[str, Tensor]]:
                    rule, hs = table.by_megatron[local_spec_name(name)]
                    return list(zip(hs, rule.split(t, a)))

                plan = WholeTensorExport(whole, split)
            self.__dict__["_hf_export_plan"] = plan
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

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Save model + optimizer as a Megatron ``torch_dist`` checkpoint (layout-independent;
        with the distributed optimizer, its state in 'dp_reshardable' format, resumable at another
        DP size only, or with ``trainer.dist_ckpt_optim_fully_reshardable`` in 'fully_reshardable'
        format, resumable at any layout), plus ``version``, this rank's RNG state and ``extra``.

        Files besides the torch_dist shards: ``moe_async_version.txt`` (``version``);
        ``moe_async_state.json`` (rank 0: ``version``, the saving ``layout`` and ``extra``, a
        JSON-able dict, e.g. the driver's data-side step and prompt position);
        ``moe_async_rng/rank_<r>.pt`` (every rank: python ``random``, numpy, torch CPU and, when
        CUDA is available, CUDA generator states, and Megatron's RNG tracker states, as
        Megatron-LM's ``rng_state``). There is no separate scheduler state: the LR is a pure
        function of ``version`` (:meth:`_set_lr`), so restoring the step restores the schedule.
        Saving into a directory that holds a checkpoint overwrites it: its old checkpoint
        files are removed first (:meth:`_remove_old_checkpoint_files`; other files stay).
        The caller's script needs an ``if __name__ == "__main__"`` guard. Collective."""
        import json
        import random

        import numpy as np
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel import random as mrandom

        os.makedirs(path, exist_ok=True)
        if torch.distributed.get_rank() == 0:
            self._remove_old_checkpoint_files(path)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()  # no rank writes before the old files are gone
        with cpu_device_scope():
            from moe_async.megatron.container import trainer_common_state

            sd = {
                **trainer_common_state(self),  # Megatron-LM's iteration / args / checkpoint_version (common.pt)
                **self._model_sharded_state_dict(),
                "optimizer": self.optimizer.sharded_state_dict(self._model_sharded_state_dict(),
                                                               **self._optim_ckpt_kwargs()),
            }
            dist_checkpointing.save(sd, path)
        rank = torch.distributed.get_rank()
        rng = {
            "layout": self._ckpt_layout(),
            "random": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": mrandom.get_cuda_rng_tracker().get_states(),
        }
        os.makedirs(os.path.join(path, "moe_async_rng"), exist_ok=True)
        torch.save(rng, os.path.join(path, "moe_async_rng", f"rank_{rank}.pt"))
        if rank == 0:
            with open(os.path.join(path, "moe_async_version.txt"), "w") as f:
                f.write(str(self.version))
            with open(os.path.join(path, "moe_async_state.json"), "w") as f:
                json.dump({"version": self.version, "layout": self._ckpt_layout(), "extra": extra or {}}, f)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()  # every rank's files are written when any rank returns

    @staticmethod
    def _remove_old_checkpoint_files(path: str) -> None:
        """Before saving into ``path``: remove the files a previous checkpoint there left
        (``__<rank>_<i>.distcp``, ``.metadata``, ``metadata.json``, ``common.pt``, our
        ``moe_async_*`` files and ``moe_async_rng/``, and a converter-made checkpoint's
        ``hf_config.json`` and ``moe_async_convert.json``, which a load would otherwise check
        the new weights against, and a Megatron-LM tracker, which a load would otherwise follow
        to the old iteration dir), with a WARNING log line, as Megatron-LM
        overwrites. A save at fewer ranks would otherwise leave the old ranks' shards and RNG
        files beside the new ones (a later load at the old layout restored a stale rank's RNG
        state). Other files are left alone."""
        import logging
        import re
        import shutil

        old = [n for n in os.listdir(path)
               if re.fullmatch(r"__\d+_\d+\.distcp|\.metadata|metadata\.json|common\.pt|"
                               r"moe_async_version\.txt|moe_async_state\.json|moe_async_rng|"
                               r"hf_config\.json|moe_async_convert\.json|latest_checkpointed_iteration\.txt", n)]
        if not old:
            return
        logging.getLogger(__name__).warning("save_checkpoint: %s holds a checkpoint; overwriting it (%d old files "
                                            "removed)", path, len(old))
        for n in old:
            f = os.path.join(path, n)
            shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)

    def _model_sharded_state_dict(self, ckpt_keys=None) -> dict[str, Any]:
        """The model part of a torch_dist state dict, as Megatron-LM's ``generate_state_dict``:
        ``{"model": sd}`` for one chunk, ``{"model0": sd0, "model1": sd1, ...}`` for virtual
        pipeline chunks (in ``vp_stage`` order). The tensor keys inside are global (layer
        numbers from each chunk's offset), so checkpoints load at any PP/VPP layout, and the
        Transformer Engine spec's names on any machine (:mod:`moe_async.megatron.te_spec_names`);
        ``ckpt_keys`` (loading): the checkpoint's keys, whose spec's names are then used."""
        from moe_async.megatron.te_spec_names import match_checkpoint, to_te_names

        if len(self.models) == 1:
            sd = {"model": self.model.sharded_state_dict()}
        else:
            sd = {f"model{v}": m.sharded_state_dict() for v, m in enumerate(self.models)}
        to_te_names(sd) if ckpt_keys is None else match_checkpoint(sd, ckpt_keys)
        return sd

    # Megatron's distributed optimizer saves its state in one of two of Megatron-Core's formats
    # (DistributedOptimizer.sharded_state_dict): 'dp_reshardable' (Megatron-LM's default),
    # per-bucket shards each rank writes without communication, loadable at any DP size but only
    # at the saving TP/PP/EP/ETP/VPP/CP (the buckets follow the model chunks and their parameters;
    # _check_optimizer_format); or, with trainer.dist_ckpt_optim_fully_reshardable (Megatron-LM's
    # --dist-ckpt-optim-fully-reshardable), 'fully_reshardable': gathered over the DP group and
    # stored per parameter under the model's global keys, so torch_dist reshards it like the
    # weights (any layout). Loading reads the format the checkpoint records. With torch's Adam (no
    # Apex/TE, always on CPU) both need compat mend 13 (moe_async/compat/dist_opt_step.py: the
    # per-parameter 'step'). Megatron-Core's default, 'fully_sharded_model_space', raises
    # 'ShardedTensor.flattened_range is not supported' on save and is not offered.
    _DIST_OPT_FORMATS = ("dp_reshardable", "fully_reshardable")

    def _dist_opt_save_format(self) -> str:
        """The format this trainer saves distributed-optimizer state in (see above)."""
        return "fully_reshardable" if self.cfg.dist_ckpt_optim_fully_reshardable else "dp_reshardable"

    def _optim_ckpt_kwargs(self, fmt: str | None = None) -> dict[str, Any]:
        """Keyword arguments of ``optimizer.sharded_state_dict`` (the ``metadata`` Megatron-LM's
        checkpointing passes): the distributed optimizer's sharding type ``fmt`` (default: the
        one this trainer saves in); none without the distributed optimizer (format unchanged)."""
        if not self.cfg.use_distributed_optimizer:
            return {}
        return {"metadata": {"distrib_optim_sharding_type": fmt or self._dist_opt_save_format(),
                             "chained_optim_avoid_prefix": True}}

    @staticmethod
    def _saved_dist_opt_format(common: Any, opt_keys: list[str]) -> str | None:
        """The distributed-optimizer format a checkpoint's optimizer state was saved in, None for
        the plain optimizer's. ``common``: the checkpoint's common (non-tensor) optimizer state,
        where Megatron records ``param_state_sharding_type`` (once per chained optimizer);
        ``opt_keys``: its optimizer tensor keys (``*optimizer.distributed.*`` are
        'dp_reshardable' buckets, the fallback when no type is recorded).

        Raises:
            UserInputError (a ValueError): chained optimizers saved in different formats."""
        from moe_async.errors import UserInputError

        found: set[str] = set()

        def walk(x: Any) -> None:
            if isinstance(x, dict):
                if isinstance(x.get("param_state_sharding_type"), str):
                    found.add(x["param_state_sharding_type"])
                for v in x.values():
                    walk(v)

        walk(common)
        if len(found) > 1:
            raise UserInputError(f"its optimizer state mixes distributed-optimizer formats {sorted(found)}")
        if found:
            return found.pop()
        return "dp_reshardable" if any(".distributed." in k for k in opt_keys) else None

    def _init_dist_opt_state(self) -> None:
        """Allocate the Adam state of a distributed optimizer that has not stepped yet, before its
        sharded state dict is built for loading. Answers Megatron-Core 0.16.1's
        ``DistributedOptimizer.state_dict``, which without Apex/Transformer Engine reads
        'step' from the per-parameter state (``assert len(steps) == 1`` on an empty one).
        Uses Megatron's own ``_init_optimizer_states_with_dummy_values`` (a step on zero
        gradients, as for its fsdp_dtensor format); that step's weight decay would move the
        weights (fp32 main params are views of them), so they are put back; the checkpoint
        then overwrites the state, the main params and the step."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        opts = [o for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                if isinstance(o, DistributedOptimizer) and len(o.optimizer.state) == 0]
        if not opts:
            return
        keep = [(p, p.detach().clone()) for m in self.models for p in m.parameters()]
        for o in opts:
            o._init_optimizer_states_with_dummy_values()
        with torch.no_grad():
            for p, v in keep:
                p.copy_(v)

    # layout keys a checkpoint records; absent from checkpoints written before they were added
    # (virtual pipeline, context parallel, expert tensor parallel): those were saved at 1
    _LAYOUT_DEFAULTS = {"vpp": 1, "cp": 1, "etp": 1}
    # the layout a 'dp_reshardable' distributed-optimizer checkpoint (per-bucket state) needs
    _DIST_OPT_LAYOUT_KEYS = ("tp", "pp", "ep", "etp", "vpp", "cp")

    def _check_optimizer_format(self, path: str, fmt: str | None, state: dict[str, Any] | None) -> None:
        """A checkpoint's optimizer state must match this trainer's optimizer. ``fmt``: the
        format it was saved in (:meth:`_saved_dist_opt_format`; None = the plain optimizer's).
        The distributed optimizer's loads only into a distributed optimizer (whatever
        ``trainer.dist_ckpt_optim_fully_reshardable`` says): 'fully_reshardable' at any layout,
        'dp_reshardable' at the saving TP/PP/EP/ETP/VPP/CP (any DP); the plain optimizer's only
        into a plain one (its state is keyed by global parameter names, so it loads at any
        layout). ``state`` is ``moe_async_state.json`` (None when absent), whose ``layout`` is
        the only record of the saving layout: a 'dp_reshardable' checkpoint without it is
        refused, as Megatron's bucket-space state would otherwise be read into the wrong
        parameters at another layout.

        Raises:
            UserInputError (a ValueError) naming ``trainer.use_distributed_optimizer``, an
            unsupported format, the two layouts, or the missing ``moe_async_state.json``.
        """
        from moe_async.errors import UserInputError

        saved_do = fmt is not None
        do = bool(self.cfg.use_distributed_optimizer)
        if saved_do != do:
            raise UserInputError(
                f"checkpoint {path}: its optimizer state was saved "
                f"{'with' if saved_do else 'without'} Megatron's distributed optimizer and this trainer has "
                f"trainer.use_distributed_optimizer={str(do).lower()}; set it to {str(saved_do).lower()} to resume")
        if not do:
            return
        if fmt not in self._DIST_OPT_FORMATS:
            raise UserInputError(
                f"checkpoint {path}: its distributed-optimizer state is in Megatron's {fmt!r} format, which "
                f"this trainer does not read (it reads {' and '.join(map(repr, self._DIST_OPT_FORMATS))})")
        if fmt == "fully_reshardable":
            return  # keyed per parameter like the weights: any layout
        saved = (state or {}).get("layout")
        if not isinstance(saved, dict):
            raise UserInputError(
                f"checkpoint {path}: its distributed-optimizer state ({fmt}) loads only at "
                f"the saving TP/PP/EP/ETP/VPP/CP, and {os.path.join(path, 'moe_async_state.json')} (which records that "
                f"layout) is {'missing' if state is None else 'without a layout'}; restore the file or resume "
                "from another checkpoint")
        saved = {**self._LAYOUT_DEFAULTS, **saved}
        now = self._ckpt_layout()
        keys = self._DIST_OPT_LAYOUT_KEYS
        diff = {k: (saved.get(k), now[k]) for k in keys if saved.get(k) != now[k]}
        if diff:
            lay_str = lambda lay: " ".join(f"{k.upper()}{lay.get(k)}" for k in keys)  # noqa: E731
            raise UserInputError(
                f"checkpoint {path}: distributed-optimizer state ({fmt}) loads at "
                f"another DP size but not at another TP/PP/EP/ETP/VPP/CP (saved vs now: {diff}; saved at "
                f"{lay_str(saved)}, this trainer at {lay_str(now)}); resume at the saving layout (checkpoints "
                "saved with trainer.dist_ckpt_optim_fully_reshardable=true resume at any layout)")

    def _ckpt_layout(self) -> dict[str, int]:
        """The world layout RNG states and distributed-optimizer state belong to: world size,
        TP, PP, EP, ETP, VPP (model chunks per PP rank, 1 without a virtual pipeline), CP, DP."""
        return {"world_size": torch.distributed.get_world_size(),
                "tp": self.cfg.tensor_model_parallel_size, "pp": self.cfg.pipeline_model_parallel_size,
                "ep": self.cfg.expert_model_parallel_size,
                "etp": getattr(self.cfg, "expert_tensor_parallel_size", 1) or 1,
                "vpp": self.cfg.virtual_pipeline_model_parallel_size or 1,
                "cp": getattr(self.cfg, "context_parallel_size", 1) or 1, "dp": self._dp_size()}

    _RNG_KEYS = ("layout", "random", "numpy", "torch", "cuda", "tracker")

    def _read_ckpt_side_files(self, path: str) -> tuple[int | None, dict[str, Any] | None, dict[str, Any] | None]:
        """Read and check the files :meth:`save_checkpoint` writes besides the tensors, before
        anything of this trainer changes: ``(version, state, rng)`` from
        ``moe_async_version.txt`` (an int), ``moe_async_state.json`` (a JSON object whose
        ``layout`` and ``extra`` are objects) and this rank's ``moe_async_rng/rank_<r>.pt``
        (a dict with the RNG states); None for a file that is absent.

        Collective at world size > 1: every rank learns whether any rank failed, so that all
        raise together (one rank alone would leave the others waiting in the next collective).

        Raises:
            CheckpointReadError naming the file (and the rank for an RNG file).
        """
        import json

        import torch.distributed as dist

        from moe_async.errors import CheckpointReadError

        rank = dist.get_rank() if dist.is_initialized() else 0
        version = state = rng = None
        err = None
        ver_p = os.path.join(path, "moe_async_version.txt")
        state_p = os.path.join(path, "moe_async_state.json")
        rng_p = os.path.join(path, "moe_async_rng", f"rank_{rank}.pt")
        cur = ver_p
        try:
            if os.path.exists(ver_p):
                with open(ver_p) as f:
                    text = f.read().strip()
                if not text.isdigit():
                    raise ValueError(f"expected a non-negative integer (the weight_version), got {text[:40]!r}")
                version = int(text)
            cur = state_p
            if os.path.exists(state_p):
                with open(state_p) as f:
                    state = json.load(f)
                if not isinstance(state, dict):
                    raise ValueError(f"expected a JSON object, got {type(state).__name__}")
                for k in ("layout", "extra"):
                    if k in state and not isinstance(state[k], dict):
                        raise ValueError(f"{k!r} is a {type(state[k]).__name__}, not an object")
            cur = rng_p
            if os.path.exists(rng_p):
                rng = torch.load(rng_p, weights_only=False)  # written by save_checkpoint (numpy state)
                if not isinstance(rng, dict) or any(k not in rng for k in self._RNG_KEYS):
                    raise ValueError(f"not an RNG state file of this trainer (needs keys {list(self._RNG_KEYS)})")
        except Exception as e:  # noqa: BLE001 - truncated text/JSON/zip: OSError, ValueError, RuntimeError, EOFError, ...
            lines = [x.strip() for x in str(e).splitlines() if x.strip()]
            err = (f"checkpoint {path}: cannot read {cur} (rank {rank}; {type(e).__name__}: "
                   f"{(lines[-1] if lines else '')[:200]}); the trainer is unchanged")
        if dist.is_initialized() and dist.get_world_size() > 1:
            errs: list = [None] * dist.get_world_size()
            dist.all_gather_object(errs, err)
            err = next((x for x in errs if x), None)
        if err:
            raise CheckpointReadError(err)
        return version, state, rng

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Load a torch_dist checkpoint into this trainer, at any parallel layout (torch_dist
        reshards on load). Returns the ``extra`` dict given to :meth:`save_checkpoint` (``{}``
        when the checkpoint has none). ``path``: the torch_dist directory, or a Megatron-LM
        container root (its ``latest_checkpointed_iteration.txt`` names the ``iter_*`` dir);
        tensor keys under either layer spec's names (Transformer Engine or local).

        Two kinds are accepted:

        * written by :meth:`save_checkpoint`: model, optimizer state and ``version`` (which
          also restores the LR schedule, a pure function of ``version``); this rank's RNG
          states are restored when the saving layout (world size, TP, PP, EP, ETP, VPP, CP, DP)
          equals this one, else an INFO log line says they are not (Megatron-LM's
          ``--no-load-rng``). Distributed-optimizer state is read in the format it was saved in
          (recorded in the checkpoint): 'fully_reshardable' at any layout, 'dp_reshardable' only
          at the saving TP/PP/EP/ETP/VPP/CP (any DP), read from ``moe_async_state.json``;
        * model only (``tools/convert_hf_to_megatron.py``, or any checkpoint without
          optimizer tensors): the model is loaded, the optimizer starts fresh (its
          state, if this trainer already stepped, is cleared; bf16 main params are re-read
          from the loaded model, as Megatron-LM's ``--no-load-optim`` / ``--finetune`` do),
          ``version`` is read from ``moe_async_version.txt`` when present, else 0; a log line
          (``logging``, WARNING) says so.

        Everything that can fail is read and checked before any weight or optimizer state of
        this trainer changes: the side files, then the model tensors and the optimizer state
        (read into copies: torch_dist would otherwise read into the live tensors, and the
        distributed optimizer's fp32 main params are views of the weights), then they are
        applied. A failed load leaves the trainer as it was (weights, optimizer state,
        version, RNG). Memory: the model and optimizer state are held twice while loading.

        The checkpoint's vocab rows (Megatron pads V) must equal this model's: ValueError
        naming ``trainer.make_vocab_size_divisible_by`` and TP otherwise. A
        ``hf_config.json`` next to the tensors (written by the converter) must describe
        the same architecture as this trainer's HF config: ValueError naming the first
        differing field. Collective at world size > 1.

        Raises:
            FileNotFoundError: ``path`` is not a directory.
            CheckpointReadError (a UserInputError and a RuntimeError): a file that cannot be
                read, named: ``.metadata``, ``metadata.json`` or ``common.pt`` truncated or
                corrupt, a ``.distcp`` shard missing or shorter than its items
                (:func:`moe_async.errors.check_torch_dist_files`, before any tensor is read),
                shard bytes that do not deserialise (model or optimizer part),
                ``moe_async_version.txt``, ``moe_async_state.json``,
                ``moe_async_rng/rank_<r>.pt``, ``hf_config.json``.
            UserInputError (a ValueError): optimizer kind or ('dp_reshardable' distributed
                optimizer state) layout differs from the saving one, ``moe_async_state.json`` is
                missing for a 'dp_reshardable' checkpoint, or the distributed-optimizer format is
                neither 'dp_reshardable' nor 'fully_reshardable'.
            KeyError: naming the model tensors absent from the checkpoint, or the checkpoint
                tensors (other than optimizer state) this model does not use (checked on
                every rank, before any weight is changed).
        """
        import json
        import logging

        import torch.distributed as dist
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.validation import StrictHandling

        from moe_async.errors import CheckpointReadError

        log = logging.getLogger(__name__)
        from moe_async.megatron.container import resolve

        path = resolve(path)  # a Megatron-LM container root -> its iteration dir (flat dirs as they are)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint dir {path} " + ("is a file, not a checkpoint directory"
                                                                 if os.path.exists(path) else "does not exist"))
        cfg_p = os.path.join(path, "hf_config.json")
        if os.path.exists(cfg_p):
            try:
                with open(cfg_p) as f:
                    saved = json.load(f)
                a_saved = get_family(saved.get("model_type")).arch_args(saved)
            except (OSError, ValueError, AttributeError, TypeError) as e:
                raise CheckpointReadError(f"checkpoint {path}: cannot read {cfg_p} ({type(e).__name__}: "
                                          f"{str(e)[:200]}); the trainer is unchanged") from e
            a_now = self.family.arch_args(self.hf_config)
            if a_saved != a_now:
                diff = [k for k in dataclasses.fields(a_now) if getattr(a_saved, k.name) != getattr(a_now, k.name)]
                k = diff[0].name if diff else "model_type"
                raise ValueError(f"checkpoint {path}: its hf_config.json differs from this trainer's HF config "
                                 f"in field {k} ({getattr(a_saved, k, None)!r} vs {getattr(a_now, k, None)!r})")
        from moe_async.models.convert import is_optimizer_key, saved_vocab_rows
        from moe_async.megatron.te_spec_names import is_te_extra_state

        from moe_async.errors import check_torch_dist_files

        # metadata, common.pt and every shard's length, each named, before any tensor is read
        try:
            metadata = check_torch_dist_files(path)
        except CheckpointReadError as e:
            raise CheckpointReadError(f"{e}; the trainer is unchanged") from None
        rows = saved_vocab_rows(path, metadata)
        want = padded_vocab_size(self.vocab_size, self.cfg.tensor_model_parallel_size,
                                 self.cfg.make_vocab_size_divisible_by)
        if rows is not None and rows != want:
            raise ValueError(
                f"checkpoint {path} has {rows} (padded) vocab rows, this trainer's model {want} "
                f"(V={self.vocab_size}, trainer.make_vocab_size_divisible_by="
                f"{self.cfg.make_vocab_size_divisible_by}, TP={self.cfg.tensor_model_parallel_size}); "
                "set make_vocab_size_divisible_by (or convert with --vocab-div) so that they agree")
        version, state, rng = self._read_ckpt_side_files(path)

        # torch_dist reads into the tensors it is given: give it copies, so that a load failing
        # halfway (a truncated shard) leaves this trainer's weights and optimizer state untouched
        def _own_copy(x):
            if isinstance(getattr(x, "data", None), torch.Tensor):
                x.data = x.data.detach().clone()
            return x

        def _read(sd: dict[str, Any], what: str, **kw):
            try:
                return dist_checkpointing.load(sd, path, **kw)
            except BaseException as e:  # torch's CheckpointException derives from BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                lines = [x.strip() for x in str(e).splitlines() if x.strip()]
                cause = lines[-1][:200] if lines else ""  # torch's text ends with the rank's error
                raise CheckpointReadError(f"checkpoint {path}: cannot read its {what} (.distcp shards), the "
                                          f"trainer's weights and optimizer state are unchanged "
                                          f"({type(e).__name__}: {cause})") from e

        with cpu_device_scope():
            ckpt_keys = metadata.state_dict_metadata  # the names (either layer spec's) the checkpoint uses
            model_sd = self._model_sharded_state_dict(ckpt_keys)
            dict_list_map_inplace(_own_copy, model_sd)
            # Megatron's naming: "unexpected" = asked for by this rank's model but absent from
            # the checkpoint (local); "missing" = in the checkpoint, asked for by no rank (global)
            loaded, in_ckpt_only, absent = _read(model_sd, "model tensors", strict=StrictHandling.RETURN_ALL)
            absent = set(absent)
            if dist.is_initialized() and dist.get_world_size() > 1:
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, sorted(absent))
                absent = set().union(*map(set, everyone))
            has_opt = any(is_optimizer_key(k) for k in in_ckpt_only)
            unused = sorted(k for k in in_ckpt_only if not is_optimizer_key(k) and not is_te_extra_state(k))
            if absent or unused:
                raise KeyError(
                    f"checkpoint {path}: "
                    + (f"model tensors missing from it {sorted(absent)[:20]} (of {len(absent)}); " if absent else "")
                    + (f"tensors this model does not use {unused[:20]} (of {len(unused)})" if unused else ""))
            opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
            if has_opt:
                opt_keys = [k for k in in_ckpt_only if is_optimizer_key(k)]
                try:
                    fmt = self._saved_dist_opt_format(loaded.get("optimizer"), opt_keys)
                except ValueError as e:
                    raise type(e)(f"checkpoint {path}: {e}") from e
                self._check_optimizer_format(path, fmt, state)
                # the optimizer's sharded state dict needs allocated state: remember which
                # optimizers had none, to give them back none if the read fails
                fresh = [o for o in opts if len(o.optimizer.state) == 0]
                try:
                    self._init_dist_opt_state()
                    opt_sd = self.optimizer.sharded_state_dict(self._model_sharded_state_dict(ckpt_keys), is_loading=True,
                                                               **self._optim_ckpt_kwargs(fmt))
                    dict_list_map_inplace(_own_copy, opt_sd)
                    opt_loaded = _read({"optimizer": opt_sd}, "optimizer state")["optimizer"]
                except BaseException:
                    for o in fresh:
                        o.optimizer.state.clear()
                        o.reload_model_params()  # bf16: main params <- the (unchanged) weights
                    raise
                with torch.no_grad():  # fp32 + distributed optimizer: main params are views of the weights
                    self.optimizer.load_state_dict(opt_loaded)
            for key, m in zip(model_sd, self.models):
                m.load_state_dict(loaded[key])
            if not has_opt:
                for opt in opts:
                    opt.optimizer.state.clear()  # Adam moments and step: fresh
                self.optimizer.reload_model_params()  # bf16: main (fp32) params <- loaded model
        self.version = version if version is not None else 0
        if version is not None and (state is None or rng is None):  # a save_checkpoint dir missing files
            log.warning("checkpoint %s has moe_async_version.txt but no %s: loaded without them (no saved "
                        "step/data position%s)", path,
                        " and no ".join(n for n, x in (("moe_async_state.json", state),
                                                        (f"moe_async_rng/rank_{dist.get_rank() if dist.is_initialized() else 0}.pt", rng))
                                        if x is None),
                        "; RNG not restored" if rng is None else "")
        if not has_opt:
            log.warning("checkpoint %s holds no optimizer state: loaded the model only, the optimizer "
                        "starts fresh (weight_version=%d)", path, self.version)
        if rng is not None:
            saved_layout = {**self._LAYOUT_DEFAULTS, **(rng["layout"] or {})}
            if saved_layout == self._ckpt_layout():
                import random

                import numpy as np
                from megatron.core.tensor_parallel import random as mrandom

                random.setstate(rng["random"])
                np.random.set_state(rng["numpy"])
                torch.set_rng_state(rng["torch"])
                if rng["cuda"] is not None and torch.cuda.is_available():
                    torch.cuda.set_rng_state_all(rng["cuda"])
                mrandom.get_cuda_rng_tracker().set_states(rng["tracker"])
            else:
                log.info("checkpoint %s: RNG state not restored, the layout changed (saved %s, now %s)",
                         path, saved_layout, self._ckpt_layout())
        return dict((state or {}).get("extra") or {})
