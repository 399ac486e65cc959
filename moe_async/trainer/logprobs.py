"""Forward pass and per-token logprobs of :class:`~moe_async.trainer.megatron_trainer.MegatronTrainer`.

:class:`ModelForward` (owns the output-layer and router hooks of the model chunks): one
micro-batch through a model chunk (:meth:`ModelForward.forward`: logits of the response
positions only where the output layer allows) with the expert-bias routers' padding
correction. Free functions: token logprobs from the logits (:func:`token_logps`, with the
distillation teacher's top-k ids; gathered over CP by :func:`cp_token_logps`) and
:func:`compute_logprobs` (forward only through Megatron's schedule).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from moe_async.compat import cpu_device_scope
from moe_async.megatron.sharding import gather_over_cp
from moe_async.trainer.batching import Batcher, model_view, packed_seq_params, to_device
from moe_async.types import MicroBatch, Sample

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    from moe_async.replay.megatron import RouterReplayHook

Tensor = torch.Tensor


class ModelForward:
    """Runs micro-batches through the model chunks ``models`` (megatron.core ``GPTModel``,
    this PP rank's) built with ``tf_config``. Installs, once: a forward pre-hook on the last
    chunk's output layer that keeps only the response rows' hidden states (not under sequence
    parallelism), and a forward hook on each router with an expert bias that takes padding
    back out of its token counts. ``rows_only``: the output-layer hook is installed."""

    def __init__(self, models: list[GPTModel], tf_config: TransformerConfig) -> None:
        self.tf_config = tf_config
        # expert-bias routers: padding taken back out of the token counts (_uncount_padding)
        self._router_pad: Tensor | None = None
        self._bias_hooks = [
            m.register_forward_hook(self._uncount_padding)
            for chunk in models for m in chunk.modules()
            if getattr(m, "local_tokens_per_expert", None) is not None and getattr(m, "expert_bias", None) is not None
        ]
        # logits of the response positions only (see forward); not under sequence parallelism
        self._logit_rows: tuple[Tensor, Tensor] | None = None
        self._rows_hook = None
        last = models[-1]  # only the last chunk can hold the output layer
        out_layer = getattr(last, "output_layer", None) if last.post_process else None
        if out_layer is not None and not out_layer.sequence_parallel:
            self._rows_hook = out_layer.register_forward_pre_hook(self._select_logit_rows, with_kwargs=True)

    @property
    def rows_only(self) -> bool:
        """The output layer is given the response rows only (its pre-hook is installed)."""
        return self._rows_hook is not None

    def forward(self, model: torch.nn.Module, mb: MicroBatch) -> tuple[Tensor, bool]:
        """Forward of one micro-batch: ``(output, rows_only)``. On the last PP stage the
        output is the logits: ``[1,N,V_padded]`` for the N response positions of
        ``mb.logit_b/logit_s`` when ``rows_only`` (the output layer is applied to those
        hidden states only: prompt positions carry no loss), else ``[B,S,V_padded]``. Rows
        are selected when the output layer is not sequence parallel (TP == 1); under
        sequence parallelism its input is this rank's sequence shard and all rows go."""
        rows_only = self.rows_only
        extra: dict[str, object] = {}
        inputs: tuple[Tensor, Tensor | None, Tensor | None]
        padding_mask: Tensor | None
        if mb.cp is not None:  # CP: this rank's chunks; causal attention over CP (no dense mask)
            self._logit_rows = (mb.cp.logit_s, mb.cp.logit_b) if rows_only else None
            inputs = (mb.cp.tokens, mb.cp.position_ids, None)
            padding_mask = mb.cp.padding_mask
        elif mb.thd is not None:  # packed: one row [1,T], attention per cu_seqlens segment
            s = mb.thd.logit_s
            self._logit_rows = (s, torch.zeros_like(s)) if rows_only else None
            inputs = (mb.thd.tokens, mb.thd.position_ids, None)
            padding_mask = mb.thd.padding_mask
            extra["packed_seq_params"] = packed_seq_params(mb)
        else:
            self._logit_rows = (mb.logit_s, mb.logit_b) if rows_only else None
            inputs = (mb.tokens, mb.position_ids, mb.attention_mask)
            padding_mask = mb.padding_mask
        if self._bias_hooks and padding_mask is not None:  # see _uncount_padding
            pm = sp_shard(padding_mask) if self.tf_config.sequence_parallel else padding_mask
            self._router_pad = pm.transpose(0, 1).reshape(-1)  # router token order: [S, B] flattened
        try:
            return model(*inputs, padding_mask=stage_padding_mask(model, padding_mask, self.tf_config), **extra), rows_only
        finally:
            self._logit_rows = None
            self._router_pad = None

    def _uncount_padding(self, module: TopKRouter, args: object, output: tuple[Tensor, Tensor]) -> None:
        """Forward hook of a router with an expert bias (deepseek_v3): takes this micro-batch's
        padding positions back out of ``local_tokens_per_expert``, the token counts that
        Megatron-Core's aux-loss-free update (``get_updated_expert_bias``) balances. Megatron
        counts every routed row because this trainer cannot pass it the padding mask there
        (see :func:`stage_padding_mask`); without this the update's direction depended on how
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

    def _select_logit_rows(self, module: object, args: tuple[Tensor, ...], kwargs: dict[str, object],
                           ) -> tuple[tuple[Tensor, ...], dict[str, object]] | None:
        """Forward pre-hook of the output layer (see :meth:`forward`): hidden ``[S,B,H]`` ->
        ``[N,1,H]`` of the selected (position, sequence) rows."""
        if self._logit_rows is None:
            return None
        s, b = self._logit_rows
        return (args[0][s, b].unsqueeze(1), *args[1:]), kwargs


def stage_padding_mask(model: torch.nn.Module, padding_mask: Tensor | None, tf_config: TransformerConfig) -> Tensor | None:
    """``padding_mask [B,S]`` as this stage's MoE routers see it: Megatron-Core's GPTModel
    splits it over the TP ranks under sequence parallelism only on the first pipeline
    stage (with the embedding); a later stage gets this rank's ``[B,S/TP]`` slice here,
    the same contiguous split as ``scatter_to_sequence_parallel_region``.

    ``None`` (padding routed and counted like real tokens) for routers with an expert bias
    (deepseek_v3): Megatron-Core 0.16.1's ``TopKRouter._apply_expert_bias`` ANDs the
    ``[tokens, experts]`` routing map with the flattened ``[tokens]`` mask, which does not
    broadcast (fixed upstream with ``unsqueeze(-1)``)."""
    from megatron.core.utils import get_attr_wrapped_model

    if getattr(tf_config, "moe_router_enable_expert_bias", False):
        return None
    if padding_mask is None or not tf_config.sequence_parallel:
        return padding_mask
    if get_attr_wrapped_model(model, "pre_process"):
        return padding_mask
    return sp_shard(padding_mask)


def sp_shard(x: Tensor) -> Tensor:
    """``x [B,S,...]`` -> this TP rank's ``[B,S/TP,...]``: the contiguous sequence split of
    sequence parallelism (``scatter_to_sequence_parallel_region`` on ``[S,B,...]``)."""
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    n = x.shape[1] // tp
    return x[:, r * n : (r + 1) * n].contiguous()


def token_logp(logits: Tensor, mb: MicroBatch, rows_only: bool, vocab_size: int,
               entropy: bool = False) -> tuple[Tensor | None, Tensor]:
    """``(entropy [B,S-1] or None, logp [B,S-1])``: :func:`token_logps` without the top-k."""
    ent, logp, _ = token_logps(logits, mb, rows_only, vocab_size, entropy)
    return ent, logp


def token_logps(logits: Tensor, mb: MicroBatch, rows_only: bool, vocab_size: int, entropy: bool = False,
                topk: bool = False) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``(entropy [B,S-1] or None, logp [B,S-1], topk_logp [B,S-1,k] or None)``: fp32 (fp64
    for fp64 logits) log-softmax over the HF vocab V (the padded vocab rows are dropped
    first; ``vocab_size``: V); ``logp[b,t]`` = log-prob of token t+1, ``entropy[b,t]`` of the predicted
    distribution (no grad), ``topk_logp[b,t,j]`` = log-prob of token ``mb.topk_ids[b,t,j]``
    (with ``topk`` and ``mb.topk_ids``; the distillation teacher's top-k ids, with grad).
    The logits hold the whole vocabulary on every TP rank (``parallel_output=False``: the
    output layer all-gathers its vocab shards, and its backward keeps each rank's shard),
    so every id is gathered locally. With ``rows_only`` (``logits [1,N,V_padded]``)
    positions other than the response rows hold 0."""
    if mb.cp is not None:
        return cp_token_logps(logits, mb, rows_only, vocab_size, entropy, topk)
    if mb.thd is not None and not rows_only:  # packed [1,T,V]: the response rows, in logit_b/s order
        logits, rows_only = logits[:, mb.thd.logit_s], True
    tokens = mb.tokens
    B, S = tokens.shape
    ids = mb.topk_ids if topk else None
    wide = torch.promote_types(logits.dtype, torch.float32)  # fp32 (fp64 stays fp64)
    if rows_only:
        b, s = mb.logit_b, mb.logit_s
        logp_NV = torch.log_softmax(logits[0, :, : vocab_size].to(wide), dim=-1)
        picked = _pick(logp_NV, tokens[b, s + 1], None if ids is None else ids[b, s], entropy)
        ent, logp, tk = (None if x is None else _at_rows(x, B, S - 1, b, s) for x in picked)
        assert logp is not None
        return ent, logp, tk
    logp_BSV = torch.log_softmax(logits[:, :-1, : vocab_size].to(wide), dim=-1)
    return _pick(logp_BSV, tokens[:, 1:], ids, entropy)


def cp_token_logps(logits: Tensor, mb: MicroBatch, rows_only: bool, vocab_size: int, entropy: bool = False,
                   topk: bool = False) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """:func:`token_logps` with CP > 1: logits of this rank's positions (``[1,N_local,V_padded]``
    rows ``mb.cp.logit_b/logit_s`` when ``rows_only``, else ``[B,S/CP,V_padded]``) -> this rank's
    ``[B,S/CP]`` logprobs of ``mb.cp.labels`` (and ``[B,S/CP,k]`` of ``mb.cp.topk_ids``) ->
    all-gathered over the CP group into global order ``[B,S]`` (differentiable; each rank
    back-propagates its own positions, see :func:`sharding.gather_over_cp`) -> ``[B,S-1]``,
    equal on every CP rank."""
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    assert mb.cp is not None, "a micro-batch with its context-parallel shard"
    labels = mb.cp.labels
    ids = mb.cp.topk_ids if topk else None
    B, S_loc = labels.shape
    wide = torch.promote_types(logits.dtype, torch.float32)
    if rows_only:
        b, s = mb.cp.logit_b, mb.cp.logit_s
        logp_NV = torch.log_softmax(logits[0, :, : vocab_size].to(wide), dim=-1)
        picked = _pick(logp_NV, labels[b, s], None if ids is None else ids[b, s], entropy)
        ent_loc, logp_loc, tk_loc = (None if x is None else _at_rows(x, B, S_loc, b, s) for x in picked)
    else:
        logp_BSV = torch.log_softmax(logits[:, :, : vocab_size].to(wide), dim=-1)
        ent_loc, logp_loc, tk_loc = _pick(logp_BSV, labels, ids, entropy)
    assert logp_loc is not None
    logp = gather_over_cp(logp_loc, group)[:, :-1]
    tk = gather_over_cp(tk_loc, group)[:, :-1] if tk_loc is not None else None
    ent = None
    if ent_loc is not None:
        with torch.no_grad():
            ent = gather_over_cp(ent_loc, group)[:, :-1]
    return ent, logp, tk


# ------------------------------------------------------------------ inference
@torch.no_grad()
def compute_logprobs(samples: list[Sample], *, batcher: Batcher, fwd: ModelForward, ddp_models: list[DistributedDataParallel],
                     router_replay: RouterReplayHook, vocab_size: int,
                     equalize_dp: bool = False) -> list[list[float]]:
    """Per-response-token logprobs (natural log, temperature 1) under the current
    weights, aligned with ``Sample.rollout_logprobs`` (entry j = log p(response_ids[j] |
    prompt, response_ids[:j])). Runs ``ddp_models`` (this rank's DDP-wrapped chunks) through
    Megatron's schedule (forward only), micro-batches from ``batcher``, forwards by ``fwd``.

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
    samples = batcher.pad_for_pp(samples)
    with cpu_device_scope():
        mbs_list = batcher.pack(samples, None, equalize_dp=equalize_dp)

        def loss_func(mb: MicroBatch, rows_only: bool, logits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            _, logp = token_logp(logits, mb, rows_only, vocab_size)
            return logits.sum() * 0.0, {"logp": logp.float().cpu()}

        def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module,
                         ) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]]:
            mb = to_device(next(data_iterator))
            router_replay.before_forward(model_view(mb), model)  # router replay (R3: engine routes)
            logits, rows_only = fwd.forward(model, mb)
            return logits, partial(loss_func, mb, rows_only)

        for d in ddp_models:
            d.eval()
        seq_length, mb_size = batcher.schedule_shape(mbs_list)
        with router_replay.step(mbs_list):  # router replay: set/clear (R2: own routes)
            reduced = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=batcher.data_iterators(mbs_list),
                model=ddp_models,
                num_microbatches=len(mbs_list),
                seq_length=seq_length,
                micro_batch_size=mb_size,
                forward_only=True,
            )
        for d in ddp_models:
            d.train()
    out: list[list[float]] = []
    if ps.is_pipeline_last_stage():
        for mb, d in zip(mbs_list, reduced):
            for b in range(mb.tokens.shape[0] if mb.n_real is None else mb.n_real):  # not the fillers
                P, R = int(mb.prompt_len[b]), int(mb.resp_len[b])
                out.append(d["logp"][b, P - 1 : P - 1 + R].tolist())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        import torch.distributed as dist

        box = [out]
        dist.broadcast_object_list(
            box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        out = box[0]
    return out[:n_real]


def _pick(logp_XV: Tensor, labels_X: Tensor, ids_XK: Tensor | None,
          entropy: bool) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """From log-softmax rows ``[..., V]``: ``(entropy [...] (no grad) or None, the labels'
    logprobs [...], the logprobs of ``ids_XK [..., k]`` or None)``."""
    lp = logp_XV.gather(-1, labels_X.unsqueeze(-1)).squeeze(-1)
    tk = logp_XV.gather(-1, ids_XK) if ids_XK is not None else None
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logp_XV.exp() * logp_XV).sum(-1)
    return ent, lp, tk


def _at_rows(x_N: Tensor, B: int, S: int, b: Tensor, s: Tensor) -> Tensor:
    """Response rows ``x [N, ...]`` placed at ``(b, s)`` of a zero ``[B, S, ...]`` tensor."""
    return torch.zeros(B, S, *x_N.shape[1:], dtype=x_N.dtype, device=x_N.device).index_put((b, s), x_N)
