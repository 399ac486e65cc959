"""Megatron-Core GRPO trainer: model build from an HF checkpoint, train step, logprobs, export.

One code path: NCCL + TE layer spec with CUDA, gloo + local spec + ``moe_async.compat``
otherwise; any TP(+SP) x PP(+VPP) x EP x ETP x CP x DP that Megatron-Core builds. Every rank
gets the same global batch; the loss is the per-token mean over the whole global batch, so it
does not depend on the DP split, CP or the micro-batching. Metrics are equal on every rank.

Design notes: ``docs/design/trainer.md``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, TypeVar, overload

import torch

from moe_async.compat import apply_cpu_compat, cpu_device_scope, model_parallel_manual_seed, no_device_scope
from moe_async.layout import ParallelLayout
from moe_async.megatron.build import model_chunks
from moe_async.megatron.hf_io import load_hf_weights
from moe_async.megatron.parallel import check_model_parallel, init_distributed, init_model_parallel
from moe_async.megatron.sharding import padded_vocab_size
from moe_async.models import get_family, hf_config_dict, tensor_checksum
from moe_async.replay.megatron import RouterReplayHook, transformer_overrides as replay_overrides  # router replay
from moe_async.trainer import model_setup as setup
from moe_async.trainer.batching import Batcher
from moe_async.trainer.checkpoint import Checkpointer
from moe_async.trainer.config import TrainerConfig, resolve_sequence_packing
from moe_async.trainer.grpo_step import grpo_step
from moe_async.trainer.logprobs import ModelForward, compute_logprobs
from moe_async.trainer.loss import grpo_token_loss
from moe_async.trainer.state import TrainerState
from moe_async.types import JsonDict, Sample

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import ModuleSpec

    from moe_async.megatron.hf_export import HFExporter
    from moe_async.lora.peft_export import Destination
    from moe_async.lora.peft_tensors import PeftExporter

Tensor = torch.Tensor
_T = TypeVar("_T")

# trainer.* fields that Megatron-Core's OptimizerConfig takes under the same names
_OPTIMIZER_FIELDS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
                     "use_distributed_optimizer", "optimizer_cpu_offload", "optimizer_offload_fraction")


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
        state: the :class:`~moe_async.trainer.state.TrainerState` these attributes read;
            ``batcher``, ``checkpointer``: the parts (:class:`Batcher`, :class:`Checkpointer`).
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

        setup.check_combinations(cfg)
        # packed THD micro-batches (trainer.sequence_packing resolved: 'auto' -> thd with CUDA + TE)
        thd = resolve_sequence_packing(cfg.sequence_packing, cfg.context_parallel_size) == "thd"
        # virtual pipeline stages (model chunks per PP rank); None = one chunk (Megatron's "off")
        vpp = cfg.virtual_pipeline_model_parallel_size
        vpp = vpp if vpp is not None and vpp > 1 else None
        if vpp:  # refused combinations are named before any process group is created
            hf_cfg = hf_config_dict(hf_path)
            setup.check_virtual_pipeline(cfg, vpp, hf_cfg, get_family(hf_cfg.get("model_type")))
        torch.set_num_threads(cfg.num_threads)
        self._owns_dist = False
        self._owns_mp = False
        self._peft_exporter: PeftExporter | None = None  # export_lora's names and plan, made on its first call
        if init_distributed(master_addr, master_port):  # moe_async.megatron.parallel
            self._owns_dist = True
        # ETP x EP vs the world, naming the fields (the caller gets no trainer to close)
        self._or_close(setup.check_expert_tensor_parallel, cfg)
        layout = ParallelLayout.from_trainer_config(cfg)
        if ps.model_parallel_is_initialized():
            check_model_parallel(layout)  # RuntimeError when another trainer's sizes differ
        else:
            init_model_parallel(layout)
            self._owns_mp = True
        cpu = apply_cpu_compat()
        with cpu_device_scope():
            model_parallel_manual_seed(cfg.seed)
            self.state, self.model_forward = self._build(cfg, hf_path, layout, thd=thd, vpp=vpp, cpu=cpu)
        st = self.state
        self.batcher = Batcher(cfg, st.vocab_size, st.router_replay, thd=thd, vpp=vpp, n_chunks=len(st.ddp_models),
                               variable_seq_lengths=bool(getattr(st.tf_config, "variable_seq_lengths", False)))
        self.checkpointer = Checkpointer(st, base_digest=self.base_digest)

    # ------------------------------------------------------------------ state
    cfg = property(lambda self: self.state.cfg, doc="The trainer section of the experiment config.")
    hf_path = property(lambda self: self.state.hf_path, doc="The HF checkpoint directory the model was built from.")
    hf_config = property(lambda self: self.state.hf_config, doc="The HF config dict (``config.json``).")
    family = property(lambda self: self.state.family, doc="The model family (``ModelFamily``).")
    tf_config = property(lambda self: self.state.tf_config, doc="Megatron-Core's ``TransformerConfig``.")
    vocab_size = property(lambda self: self.state.vocab_size, doc="The HF vocabulary V (unpadded).")
    models = property(lambda self: self.state.models, doc="This rank's model chunks (``GPTModel``).")
    model = property(lambda self: self.state.models[0], doc="The first model chunk.")
    ddp_models = property(lambda self: self.state.ddp_models, doc="The chunks' DDP wrappers.")
    ddp_model = property(lambda self: self.state.ddp_models[0], doc="The first chunk's DDP wrapper.")
    optimizer = property(lambda self: self.state.optimizer, doc="Megatron-Core's (chained) optimizer.")
    opt_config = property(lambda self: self.state.opt_config, doc="Megatron-Core's ``OptimizerConfig``.")
    router_replay = property(lambda self: self.state.router_replay, doc="The router replay hook.")
    lora_linears = property(lambda self: self.state.lora_linears, doc="The LoRA adapters, per chunk.")

    @property
    def version(self) -> int:
        """weight_version of the current weights (0 after load, +1 per ``train_step``)."""
        return self.state.version

    @version.setter
    def version(self, v: int) -> None:
        self.state.version = v

    # ------------------------------------------------------------------ setup
    def _or_close(self, check: Callable[..., _T], *args: object) -> _T:
        """``check(*args)``; on its ValueError (a refused setting, named) the process groups
        this trainer created are destroyed first (the caller gets no trainer to close)."""
        try:
            return check(*args)
        except ValueError:
            self.close()
            raise

    def _build(self, cfg: TrainerConfig, hf_path: str, layout: ParallelLayout, *, thd: bool, vpp: int | None,
               cpu: bool) -> tuple[TrainerState, ModelForward]:
        """The model chunks (HF weights loaded, LoRA adapters added), their DDP wrappers and the
        optimizer at the current Megatron parallel state, as the trainer's state; and the
        forward runner holding the chunks' hooks."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        hf_config = hf_config_dict(hf_path)
        family = get_family(hf_config.get("model_type"))
        tf_config = family.transformer_config(
            hf_config,
            params_dtype=cfg.params_dtype,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            **layout.megatron_kwargs(),  # TP/PP/CP/EP/ETP/VPP
            **{**setup.memory_overrides(cfg, family, hf_config),  # recompute, dispatcher, uneven PP
               **setup.layout_overrides(cfg, family, hf_config, cpu=cpu, thd=thd, vpp=vpp)},
            **replay_overrides(cfg.router_replay),  # router replay
            **self._or_close(setup.expert_bias_overrides, cfg, family, hf_config),
        )
        self._or_close(setup.check_expert_ffn_split, cfg, tf_config, hf_path)  # ETP divides the expert FFN size
        gpt_kwargs = family.gpt_model_kwargs(hf_config)
        # V: HF vocab; Megatron's vocab-parallel layers get V padded (zero rows, sliced off
        # the logits before the softmax and off the exported tensors).
        vocab_size = int(gpt_kwargs["vocab_size"])
        gpt_kwargs["vocab_size"] = padded_vocab_size(
            vocab_size, cfg.tensor_model_parallel_size, cfg.make_vocab_size_divisible_by
        )
        # Megatron's MoE aux-loss tracker is process-global and sized by the layer count of the
        # first model that logs into it (moe_utils.save_to_aux_losses_tracker): start it afresh
        # for this model (a 4-layer trainer after a 2-layer one raised IndexError)
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()

        def wrap_spec(spec: ModuleSpec) -> ModuleSpec:
            return setup.cp_spec(spec, cfg, family, hf_config, thd=thd, cpu=cpu)

        # This PP rank's model chunks, one per virtual pipeline stage (moe_async.megatron.build)
        models: list[GPTModel] = model_chunks(family, hf_config, tf_config, gpt_kwargs, vpp=vpp, wrap_spec=wrap_spec)
        replay_root = models[0] if len(models) == 1 else torch.nn.ModuleList(models)
        router_replay = RouterReplayHook(replay_root, tf_config, cfg.router_replay)  # router replay
        # output-layer rows and expert-bias routers' hooks, before the weights and adapters (as ever)
        fwd = ModelForward(models, tf_config)
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
        for m in models:
            for n, p in m.named_parameters():
                if ".mlp.experts." in n:
                    p.allreduce = False
            if torch.cuda.is_available():
                m.cuda(torch.cuda.current_device())
        # HF safetensors -> this rank's slices of the chunks (moe_async.megatron.hf_io; its errors)
        load_hf_weights(models, family, hf_config, hf_path, vocab_size)
        # LoRA: adapters hooked on the loaded model, every base parameter frozen (DDP and the
        # optimizer then hold the adapters only)
        lora_linears = []
        if cfg.lora is not None:
            from moe_async.lora.layers import add_lora

            for m in models:
                lora_linears.append(add_lora(m, cfg.lora))

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        # one DDP wrapper per chunk; buckets only for chunk 0 (as Megatron-LM's get_model)
        ddp_models = [
            DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=m,
                                    disable_bucketing=v > 0)
            for v, m in enumerate(models)
        ]
        bf16 = cfg.params_dtype == "bf16"
        opt_config = OptimizerConfig(
            optimizer="adam",
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            **{k: getattr(cfg, k) for k in _OPTIMIZER_FIELDS},
        )
        optimizer = get_megatron_optimizer(opt_config, ddp_models)
        tf_config.finalize_model_grads_func = finalize_model_grads
        return TrainerState(cfg=cfg, hf_path=hf_path, hf_config=hf_config, family=family, tf_config=tf_config,
                            vocab_size=vocab_size, models=models, ddp_models=ddp_models, optimizer=optimizer,
                            opt_config=opt_config, router_replay=router_replay, lora_linears=lora_linears,
                            thd=thd, vpp=vpp, cpu=cpu), fwd

    def close(self) -> None:
        """Destroy the process groups this trainer created (safe to call twice)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self._owns_mp:
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
            out = grpo_step(self.state, self.batcher, self.model_forward, batch, advantages, float(topk_kl_coef),
                            loss_fn=grpo_token_loss)
        out["step_time_s"] = time.perf_counter() - t0
        return out

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample], equalize_dp: bool = False) -> list[list[float]]:
        """Per-response-token logprobs (natural log, temperature 1) under the current weights,
        aligned with ``Sample.rollout_logprobs`` (entry j = log p(response_ids[j] | prompt,
        response_ids[:j])); :func:`~moe_async.trainer.logprobs.compute_logprobs` (collective:
        every rank gets the same lists)."""
        st = self.state
        return compute_logprobs(samples, batcher=self.batcher, fwd=self.model_forward, ddp_models=st.ddp_models,
                                router_replay=st.router_replay, vocab_size=st.vocab_size, equalize_dp=equalize_dp)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, extra: JsonDict | None = None) -> None:
        """Save model + optimizer + ``version``, RNG states and ``extra`` (a JSON-able dict) as a
        Megatron ``torch_dist`` checkpoint in ``path``: :meth:`Checkpointer.save
        <moe_async.trainer.checkpoint.Checkpointer.save>` (files, formats). Collective."""
        self.checkpointer.save(path, extra)

    def load_checkpoint(self, path: str) -> JsonDict:
        """Load a torch_dist checkpoint (any parallel layout) into this trainer and return the
        ``extra`` dict it was saved with: :meth:`Checkpointer.load
        <moe_async.trainer.checkpoint.Checkpointer.load>` (accepted kinds, errors; a failed
        load leaves the trainer unchanged). Collective."""
        return self.checkpointer.load(path)

    # ------------------------------------------------------------------ export
    @overload
    def export_lora(self, out_dir: str | None = None, with_config: Literal[False] = False,
                    replace: bool = False, out: Destination | None = None) -> dict[str, Tensor]: ...

    @overload
    def export_lora(self, out_dir: str | None = None, *, with_config: Literal[True],
                    replace: bool = False, out: Destination | None = None) -> tuple[dict[str, Tensor], JsonDict]: ...

    def export_lora(self, out_dir: str | None = None, with_config: bool = False,
                    replace: bool = False, out: Destination | None = None) -> dict[str, Tensor] | tuple[dict[str, Tensor], JsonDict]:
        """The LoRA adapters as Hugging Face PEFT tensors (``base_model.model.<hf module>.lora_A/B.weight``,
        fp32, :mod:`moe_async.lora.peft_export`, planned once per layout: :mod:`moe_async.lora.peft_tensors`); ``with_config``: ``(tensors, adapter_config dict)``.
        With ``out_dir``, global rank 0 also writes ``adapter_model.safetensors`` +
        ``adapter_config.json`` there (``replace``: over an adapter already there,
        :func:`~moe_async.lora.peft_export.write_peft`). ``out(name, shape, dtype)`` (e.g.
        ``AdapterBuffers.destination``) may return the tensor to write a PEFT tensor into (it is
        then the one returned); None: a new tensor. The tensors never alias the parameters.
        Collective at world size > 1. Raises ValueError without ``trainer.lora``."""
        import torch.distributed as dist

        from moe_async.lora.peft_export import peft_config_dict, write_peft
        from moe_async.lora.peft_tensors import PeftExporter

        if self.cfg.lora is None:
            raise ValueError("export_lora: trainer.lora is not set (no adapters to export)")
        with no_device_scope():  # CPU tensors only: no Python call per torch op
            if self._peft_exporter is None:
                self._peft_exporter = PeftExporter(self.models, self.lora_linears, self.family, self.hf_config)
            tensors, modules, params = self._peft_exporter(out)
        config = peft_config_dict(self.cfg.lora, modules, params, self.hf_path)
        if out_dir is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            write_peft(out_dir, tensors, config, replace=replace)
        return (tensors, config) if with_config else tensors

    def export_merged(self, out_dir: str, replace: bool = False, max_shard_size: str | int = "5GB") -> list[str]:
        """A full HF checkpoint with the LoRA adapters merged into the base (PEFT's
        ``merge_and_unload``: ``W + (alpha / rank) * B A`` per adapted weight, fp32 arithmetic,
        :mod:`moe_async.lora.merge`), in the base's dtype and on-disk names, sharded safetensors
        plus the base's ``config.json`` and tokenizer files, written by global rank 0 into
        ``out_dir`` (``replace``: over a directory there, via ``<out_dir>.tmp``; else
        FileExistsError for a non-empty one). Returns the safetensors file names (rank 0; [] on
        the others). Collective at world size > 1. Raises ValueError without ``trainer.lora``."""
        import torch.distributed as dist

        from moe_async.lora.merge import hf_deltas, merged_tensors
        from moe_async.lora.peft_export import megatron_adapter_state, staged_dir
        from moe_async.megatron.export import write_hf

        if self.cfg.lora is None:
            raise ValueError("export_merged: trainer.lora is not set (no adapters to merge)")
        state = megatron_adapter_state(self.models, self.lora_linears)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        base = self.export_hf_weights()
        if not rank0:
            for _ in base:  # collective: take part in the gather
                pass
            return []
        deltas = hf_deltas(state, self.family, self.hf_config, self.cfg.lora.scaling)
        with staged_dir(out_dir, replace) as d:
            files, _ = write_hf(merged_tensors(base, deltas), self.family, self.hf_config, self.cfg.params_dtype,
                                self.hf_path, d, max_shard_size, False, False)
        return files

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
        The non-finite check runs when this is called, not when the iterator is first read:
        in ``transport.send(trainer.export_hf_weights(...), v)`` it is done before ``send``
        pauses any engine (the stall does not include it).

        Raises NonFiniteError (at the call) on NaN/inf weights, KeyError if a parameter has
        no HF name or an HF tensor is left unset (rank 0), ValueError if shards do not tile a
        tensor exactly once.
        """
        ex = self.hf_exporter()
        ex.check()  # nothing non-finite reaches an engine; before the caller's send pauses them
        return self._hf_weights(ex, dtype, out)

    def _hf_weights(self, ex: HFExporter, dtype: torch.dtype | None,
                    out: Callable[[str, tuple[int, ...], torch.dtype], Tensor | None] | None,
                    ) -> Iterator[tuple[str, Tensor]]:
        """:meth:`export_hf_weights`' tensors, after its check."""
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

    def base_digest(self) -> str:
        """sha256 over the name-sorted per-tensor checksums of the base weights (:meth:`hf_checksums`,
        which leave the LoRA adapters out), computed once with ``trainer.lora``: the base is
        frozen (a LoRA checkpoint records it and a resume compares it). Collective."""
        import hashlib
        import json

        if "_base_digest" in self.__dict__:
            return str(self.__dict__["_base_digest"])
        digest = hashlib.sha256(json.dumps(sorted(self.hf_checksums().items())).encode()).hexdigest()
        if self.cfg.lora is not None:  # a trained base changes: computed again next time
            self.__dict__["_base_digest"] = digest
        return digest

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
