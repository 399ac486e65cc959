"""Micro-batches of :class:`~moe_async.trainer.megatron_trainer.MegatronTrainer`: packing and the DP/PP/CP data path.

:class:`Batcher` (the trainer's config, vocabulary and router-replay hook): ``list[Sample]``
-> right-padded or packed-THD :class:`~moe_async.types.MicroBatch` es (:meth:`Batcher.pack`;
fields and shapes in its docstring), this DP rank's slice of the global batch
(:meth:`Batcher.dp_local`, :meth:`Batcher.pad_for_pp`) and Megatron's data iterators. Free
functions: the CP rank's sequence chunks (:func:`cp_split`), what the model is given
(:func:`model_view`), Megatron's ``PackedSeqParams`` and the DP-group scalar reductions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Iterator

import torch

from moe_async.layout import cp_positions
from moe_async.trainer.micro_batches import micro_batch_ranges, padded_len, split_to_count
from moe_async.types import CpShard, MicroBatch, PackedRow, Sample

if TYPE_CHECKING:
    from moe_async.replay.megatron import RouterReplayHook
    from moe_async.trainer.config import TrainerConfig

Tensor = torch.Tensor

# Micro-batches are right-padded to at least this many positions (see Batcher.pack)
MIN_SEQ_LEN = 64


def packed_row(tokens: Tensor, logit_b: Tensor, logit_s: Tensor, lens: list[int], T: int) -> PackedRow:
    """The packed THD row (:class:`PackedRow`, fields in its docstring) of a micro-batch whose
    loss-side ``tokens [B,S]`` (long) hold sequences of ``lens`` tokens, packed into ``T >=
    sum(lens)`` positions; ``logit_b``/``logit_s`` ``[N]`` long: its response-predicting rows
    (sequence, position). ValueError (:func:`~moe_async.replay.routes.pack_rows`) when the
    sequences do not fit."""
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
    return PackedRow(
        tokens=pack_rows(tokens, lens, T, 0),
        position_ids=position_ids,
        padding_mask=torch.arange(T).unsqueeze(0) >= total,
        cu_seqlens=cu,
        cu_seqlens_padded=cu_pad,
        max_seqlen=int((cu_pad[1:] - cu_pad[:-1]).max()),
        logit_s=cu[logit_b].long() + logit_s,
    )


class Batcher:
    """Packs samples into the micro-batches of one trainer. ``cfg``: the trainer config
    (micro-batch size, token budget, TP/PP/CP sizes); ``vocab_size``: the HF vocabulary V
    (teacher top-k ids are checked against it); ``router_replay``: adds the routes to each
    micro-batch; ``thd``: packed THD rows instead of right-padded ones; ``vpp``: model chunks
    per PP rank (None: one); ``variable_seq_lengths``: Megatron's p2p exchanges each shape
    (packed rows at PP > 1 then keep their own length); ``n_chunks``: this rank's model chunks."""

    def __init__(self, cfg: TrainerConfig, vocab_size: int, router_replay: RouterReplayHook, *, thd: bool,
                 vpp: int | None, variable_seq_lengths: bool = False, n_chunks: int = 1) -> None:
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.router_replay = router_replay
        self.thd = thd
        self.vpp = vpp
        self.variable_seq_lengths = variable_seq_lengths
        self.n_chunks = n_chunks

    def pack(self, samples: list[Sample], advantages: Sequence[float | list[float]] | None,
             equalize_dp: bool = False) -> list[MicroBatch]:
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
        (on CPU two kernels round differently for tiny shapes than for the same rows inside a
        larger tensor; measurements and why longer ones are not padded further: docs/trainer.md).
        Padding tokens are causal-masked and carry no loss; they are routed, but
        ``padding_mask`` keeps them out of Megatron's MoE load-balancing statistics (aux loss,
        z-loss), except with a router expert bias (see :func:`~moe_async.trainer.logprobs.stage_padding_mask`).

        Each :class:`MicroBatch` (fields and shapes in its docstring): ``tokens [B,S]``, the
        padded model input (``position_ids``, causal ``attention_mask``, ``padding_mask``), the
        loss side over the S-1 predicted positions, the response-predicting rows
        ``logit_b``/``logit_s``, router replay's fields, and at CP > 1 this rank's ``cp`` shard
        (:func:`cp_split`).

        Packed THD micro-batches (``trainer.sequence_packing`` resolved to thd): the model sees
        ONE row of the micro-batch's sequences back to back (``thd``: :func:`packed_row`); the
        loss side stays per sequence (``tokens [B,S]`` with ``S`` the longest sequence, no
        floor; ``loss_mask``, ``advantages``, ``rollout_logp``, ``logit_b``/``logit_s``), so
        the loss, its sequence-level off-policy corrections and the per-sample logprobs are
        the padded path's; ``position_ids``/``attention_mask``/``padding_mask`` are None. The
        token budget counts the packed row's ``T`` (real tokens). With PP > 1 each row keeps
        its own ``T`` through Megatron-Core's ``variable_seq_lengths`` (every p2p exchange
        sends its shape first; see :func:`~moe_async.trainer.model_setup.layout_overrides`);
        with virtual pipeline stages every row is padded to the batch's largest ``T`` (one p2p
        shape) instead.
        """
        mbs = self.cfg.micro_batch_size
        lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        k = self.topk_width(samples)
        for i, s in enumerate(samples):
            if len(s.prompt_ids) == 0:
                raise ValueError(f"sample {i} has an empty prompt")
            if s.rollout_logprobs and len(s.rollout_logprobs) != len(s.response_ids):
                raise ValueError(
                    f"sample {i}: {len(s.rollout_logprobs)} rollout_logprobs for {len(s.response_ids)} response tokens"
                )
        thd = self.thd
        pp = self.cfg.pipeline_model_parallel_size
        fixed_len = max(lens) if pp > 1 and not thd else None
        # S (padded) or T (thd): SP splits it over TP ranks; CP into 2*CP chunks (see seq_multiple)
        multiple = self.seq_multiple()
        budget = self.cfg.max_tokens_per_micro_batch
        ranges = micro_batch_ranges(lens, mbs, budget, packed=thd, min_len=MIN_SEQ_LEN, multiple=multiple,
                                    fixed_len=fixed_len)
        if equalize_dp and budget is not None and dp_size() > 1:
            ranges = split_to_count(ranges, int(dp_max(len(ranges))))
        # thd: the packed row's length T per micro-batch; with PP > 1 and without Megatron's
        # variable_seq_lengths (VPP) the largest (one p2p shape)
        T_rows = [padded_len([sum(lens[a:b])], min_len=MIN_SEQ_LEN, multiple=self.seq_multiple())
                  for a, b in ranges] if thd else []
        if thd and pp > 1 and not self.variable_seq_lengths:
            T_rows = [max(T_rows)] * len(ranges)
        # padded micro-batches at PP > 1 cut by the token budget: Megatron's schedule exchanges one
        # [S, B, hidden] shape per step, so every micro-batch gets the step's largest B (rows after
        # its own sequences: zero-weight copies of its first one, left out of logprobs)
        b_step = max(b - a for a, b in ranges) if pp > 1 and not thd and budget is not None and ranges else None
        out = []
        for i, (start, end) in enumerate(ranges):
            chunk = samples[start:end]
            n_real = len(chunk)
            if b_step is not None and n_real < b_step:
                chunk = chunk + [dataclasses.replace(chunk[0], loss_weight=0.0)] * (b_step - n_real)
            S = max(lens[start:end]) if thd else padded_len(lens[start:end], min_len=MIN_SEQ_LEN, multiple=multiple,
                                                            fixed_len=fixed_len)
            B = len(chunk)
            tokens = torch.zeros(B, S, dtype=torch.long)
            loss_mask = torch.zeros(B, S - 1)
            adv = torch.zeros(B, S - 1)
            rlp = torch.zeros(B, S - 1)
            plen = torch.zeros(B, dtype=torch.long)
            rlen = torch.zeros(B, dtype=torch.long)
            tk_ids = torch.zeros(B, S - 1, k, dtype=torch.long) if k else None
            tk_lp = torch.zeros(B, S - 1, k) if k else None
            tk_mask = torch.zeros(B, S - 1) if k else None
            for b, s in enumerate(chunk):
                P, R = len(s.prompt_ids), len(s.response_ids)
                tokens[b, :P] = torch.tensor(s.prompt_ids, dtype=torch.long)
                if R:
                    tokens[b, P : P + R] = torch.tensor(s.response_ids, dtype=torch.long)
                    # position t predicts token t+1: response token j is predicted at P-1+j
                    loss_mask[b, P - 1 : P - 1 + R] = float(s.loss_weight)
                    if s.loss_mask is not None:  # multi-turn: observation tokens carry no loss
                        loss_mask[b, P - 1 : P - 1 + R] *= torch.tensor(s.response_mask())
                    if advantages is not None and b < n_real:  # one per sample, or [R] per token
                        a = advantages[start + b]
                        adv[b, P - 1 : P - 1 + R] = torch.tensor(a, dtype=torch.float32) if isinstance(
                            a, (list, tuple)) else float(a)
                    if s.rollout_logprobs:
                        rlp[b, P - 1 : P - 1 + R] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
                    if tk_ids is not None and s.teacher_topk_ids is not None:  # distillation: teacher top-k
                        assert tk_lp is not None and tk_mask is not None and s.teacher_topk_logprobs is not None
                        tk_ids[b, P - 1 : P - 1 + R] = torch.tensor(s.teacher_topk_ids, dtype=torch.long)
                        tk_lp[b, P - 1 : P - 1 + R] = torch.tensor(s.teacher_topk_logprobs, dtype=torch.float32)
                        tk_mask[b, P - 1 : P - 1 + R] = 1.0
                plen[b], rlen[b] = P, R
            # response positions (b, t): the only rows whose logits the loss and logprobs use
            rows = [(b, t) for b in range(B) for t in range(int(plen[b]) - 1, int(plen[b] + rlen[b]) - 1)]
            fields: dict[str, Any] = dict(
                tokens=tokens, loss_mask=loss_mask, advantages=adv, rollout_logp=rlp, prompt_len=plen,
                resp_len=rlen, first=start, n_real=n_real if len(chunk) > n_real else None, logit_b=torch.tensor([b for b, _ in rows], dtype=torch.long),
                logit_s=torch.tensor([t for _, t in rows], dtype=torch.long),
                topk_ids=tk_ids, topk_logp=tk_lp, topk_mask=tk_mask)
            if thd:
                fields["thd"] = packed_row(tokens, fields["logit_b"], fields["logit_s"], lens[start:end], T_rows[i])
            else:
                causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
                fields.update(position_ids=torch.arange(S).unsqueeze(0).expand(B, S).contiguous(),
                              attention_mask=causal.expand(B, 1, S, S).contiguous(),
                              padding_mask=torch.arange(S).unsqueeze(0) >= (plen + rlen).unsqueeze(1))
            # router replay: routes (thd: in the packed row's order), masks
            fields.update(self.router_replay.pack(chunk, S, packed_len=T_rows[i] if thd else None))
            mb = MicroBatch(**fields)
            if self.cfg.context_parallel_size > 1:
                mb = dataclasses.replace(mb, cp=cp_split(mb))
            out.append(mb)
        return out

    def topk_width(self, samples: list[Sample]) -> int:
        """``k`` of the samples' distillation teacher top-k (``Sample.teacher_topk_ids [R, k]``),
        0 when none has them. Raises ValueError naming the sample whose ``k`` differs from the
        first's, whose shapes disagree with its response, or whose ids are outside the
        student's vocabulary ``[0, V)``."""
        k = 0
        for i, s in enumerate(samples):
            if s.teacher_topk_ids is None:
                continue
            s.validate()
            kk = int(s.teacher_topk_ids.shape[1])
            if k and kk != k:
                raise ValueError(f"sample {i}: teacher top-k of {kk} tokens per position, earlier samples {k}")
            k = kk
            ids = s.teacher_topk_ids
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                raise ValueError(f"sample {i}: teacher top-k token id {int(ids.max())} (or {int(ids.min())}) is outside "
                                 f"the student's vocabulary [0, {self.vocab_size})")
        return k

    def schedule_shape(self, mbs_list: list[MicroBatch]) -> tuple[int, int]:
        """``(seq_length, micro_batch_size)`` for Megatron's schedule (its p2p buffers with
        PP > 1: ``[seq_length/TP, micro_batch_size, hidden]``): the padded micro-batches'
        ``(S, cfg.micro_batch_size)`` (cut by the token budget: the step's largest ``B``, which
        every micro-batch has at PP > 1, :attr:`MicroBatch.n_real`),
        packed ones' ``(T, 1)``."""
        if self.thd:
            return max(mb.thd.tokens.shape[1] for mb in mbs_list if mb.thd is not None), 1
        if self.cfg.max_tokens_per_micro_batch is not None:  # cut by the budget: the step's one B at PP > 1
            return max(mb.tokens.shape[1] for mb in mbs_list), max(mb.tokens.shape[0] for mb in mbs_list)
        return max(mb.tokens.shape[1] for mb in mbs_list), self.cfg.micro_batch_size

    def seq_multiple(self) -> int:
        """:func:`seq_multiple` of this trainer's TP and CP sizes."""
        return seq_multiple(self.cfg.tensor_model_parallel_size, self.cfg.context_parallel_size)

    def dp_local(self, batch: list[Sample], advantages: Sequence[float | list[float]]
                 ) -> tuple[list[Sample], list[float | list[float]]]:
        """This DP rank's contiguous slice of the global batch (every rank is given the same
        global batch). Slices are padded to ``ceil(len/dp)`` with zero-weight copies of the
        first sample (no loss, no token count) so that every DP rank runs the same number of
        micro-batches (EP all-to-all and DDP are collectives over DP ranks)."""
        from megatron.core import parallel_state as ps

        dp = dp_size()
        b: list[Sample] = list(batch)
        a: list[float | list[float]] = list(advantages)
        if dp > 1:
            r = ps.get_data_parallel_rank()
            per = -(-len(batch) // dp)
            lo, hi = min(r * per, len(batch)), min((r + 1) * per, len(batch))
            b, a = list(batch[lo:hi]), list(advantages[lo:hi])
            while len(b) < per:
                b.append(dataclasses.replace(batch[0], loss_weight=0.0))
                a.append(0.0)
        b = self.pad_for_pp(b)
        return b, a + [0.0] * (len(b) - len(a))

    def pad_for_pp(self, samples: list[Sample]) -> list[Sample]:
        """With PP > 1 every micro-batch must hold exactly ``micro_batch_size`` sequences (the
        p2p receive buffers are sized from it): pad with zero-weight copies of the first
        sample. With virtual pipeline stages, also pad the number of micro-batches to a
        multiple of PP (Megatron's interleaved schedule runs micro-batches in groups of
        ``microbatch_group_size_per_vp_stage`` = PP and refuses a partial last group).
        Identity at PP == 1."""
        mbs = self.cfg.micro_batch_size
        unit = mbs * (self.cfg.pipeline_model_parallel_size if self.vpp else 1)
        if self.cfg.pipeline_model_parallel_size == 1 or not samples or len(samples) % unit == 0:
            return list(samples)
        pad = [dataclasses.replace(samples[0], loss_weight=0.0)] * (unit - len(samples) % unit)
        return list(samples) + pad

    def data_iterators(self, mbs_list: list[MicroBatch]) -> Iterator[MicroBatch] | list[Iterator[MicroBatch]]:
        """Megatron's ``data_iterator`` argument: one iterator over the micro-batches, or with
        virtual pipeline stages one per model chunk (each chunk runs every micro-batch, in
        order; the interleaved schedule calls ``forward_step`` with the chunk's iterator)."""
        if self.n_chunks == 1:
            return iter(mbs_list)
        return [iter(mbs_list) for _ in range(self.n_chunks)]


def seq_multiple(tp: int, cp: int) -> int:
    """Padded sequence lengths are multiples of this: TP (sequence parallelism splits S
    over the TP ranks); with CP > 1, of ``2*CP`` (Megatron's load-balanced split into
    ``2*CP`` chunks) with each rank's ``S/CP`` positions a multiple of TP:
    ``CP * lcm(2, TP)``."""
    import math

    return tp if cp == 1 else cp * math.lcm(2, tp)


def packed_seq_params(mb: MicroBatch) -> Any:
    """Megatron-Core's ``PackedSeqParams`` (``qkv_format='thd'``) of a packed micro-batch
    (its :class:`PackedRow` ``mb.thd``); self-attention, so q and kv share the cu_seqlens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    row = mb.thd
    assert row is not None, "a packed (thd) micro-batch"
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=row.cu_seqlens, cu_seqlens_kv=row.cu_seqlens,
        cu_seqlens_q_padded=row.cu_seqlens_padded, cu_seqlens_kv_padded=row.cu_seqlens_padded,
        max_seqlen_q=row.max_seqlen, max_seqlen_kv=row.max_seqlen,
    )


# the sequence tensors a CP rank holds its own chunks of
CP_SEQ_KEYS = ("tokens", "position_ids", "padding_mask", "routes_BSLK", "routes_real_BS")


def cp_split(mb: MicroBatch) -> CpShard:
    """CP > 1: this context-parallel rank's part of a padded micro-batch (which keeps its
    whole-sequence tensors for the loss; fields in :class:`CpShard`'s docstring): tokens,
    positions, padding mask, labels, the teacher's top-k ids and (router replay) routes split by Megatron-Core's
    ``get_batch_on_this_cp_rank``, and the response-predicting rows this rank holds. The
    loss side (loss mask, advantages, rollout/old logprobs) stays whole: logprobs are
    gathered over CP before the loss (:func:`~moe_async.trainer.logprobs.cp_token_logps`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    tokens = mb.tokens
    B, S = tokens.shape
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    seq = {k: getattr(mb, k).contiguous() for k in CP_SEQ_KEYS if getattr(mb, k) is not None}
    seq["labels"] = labels
    if mb.topk_ids is not None:  # position t's teacher top-k ids, aligned with labels
        seq["topk_ids"] = torch.cat([mb.topk_ids, torch.zeros_like(mb.topk_ids[:, :1])], 1)
    local = get_batch_on_this_cp_rank(seq, ps.get_context_parallel_group())
    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    inv = torch.full((S,), -1, dtype=torch.long)
    inv[cp_positions(S, cp, r)] = torch.arange(S // cp)
    s_local = inv[mb.logit_s]
    keep = s_local >= 0
    return CpShard(**local, logit_b=mb.logit_b[keep], logit_s=s_local[keep])


def model_view(mb: MicroBatch) -> MicroBatch:
    """The micro-batch as the model (and the router replay hook) sees it on this rank:
    with CP the ``cp`` shard's tensors (this rank's sequence chunks) in place of the whole
    sequence's tokens, positions, padding mask and routes; packed (thd) the packed row's
    (``[1,T]``; its routes are already packed); ``mb`` itself otherwise."""
    if mb.thd is not None:
        return dataclasses.replace(mb, tokens=mb.thd.tokens, position_ids=mb.thd.position_ids,
                                   padding_mask=mb.thd.padding_mask)
    if mb.cp is None:
        return mb
    return dataclasses.replace(mb, **{k: getattr(mb.cp, k) for k in CP_SEQ_KEYS})


def to_device(mb: MicroBatch) -> MicroBatch:
    """``mb`` with every tensor on this rank's CUDA device (``mb`` itself on CPU)."""
    if torch.cuda.is_available():
        return mb.map_tensors(lambda v: v.cuda(non_blocking=True))
    return mb


# ------------------------------------------------------------------ data parallel
def dp_size() -> int:
    """The data-parallel world size (Megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def comm_device() -> torch.device:
    """The device collectives run on: this rank's CUDA device, else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def dp_reduce(x: float, op: torch.distributed.ReduceOp.RedOpType) -> float:
    """``op`` (a ``torch.distributed.ReduceOp``) of a per-DP-rank scalar over the DP
    group, in float64; ``x`` itself at DP 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dp_size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=op, group=ps.get_data_parallel_group())
    return float(t.item())


def dp_max(x: float) -> float:
    """Max of a per-DP-rank scalar over the DP group."""
    import torch.distributed as dist

    return dp_reduce(x, dist.ReduceOp.MAX)


def dp_sum(x: float) -> float:
    """Sum of a per-DP-rank scalar over the DP group (float64 on the DP group)."""
    import torch.distributed as dist

    return dp_reduce(x, dist.ReduceOp.SUM)
