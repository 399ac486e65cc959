"""The trainer's micro-batches: what one holds (:class:`MicroBatch`, with its packed-THD row
:class:`PackedRow` and context-parallel shard :class:`CpShard`) and how a batch is cut into
them: by a sequence count, optionally under a token budget (dynamic micro-batch size).

The budget follows verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu`` and slime's
``--use-dynamic-batch-size`` / ``--max-tokens-per-gpu``: a micro-batch holds as many sequences
as fit in ``max_tokens`` padded positions (with packed THD rows: real tokens), so long rollouts do not blow up activation memory
and short ones are not run a few at a time. Micro-batches here are CONTIGUOUS runs of the
batch (sample order kept: per-sample outputs need no re-ordering; verl re-balances with
Karmarkar-Karp partitioning, which this does not do). The GRPO loss is a per-token mean over
the global batch, so how the batch is cut does not change the gradient beyond fp32
accumulation order (tests/trainer/test_megatron_trainer.py, micro-batch invariance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


def _map_tensors(obj: Any, fn: Callable[["Tensor"], "Tensor"]) -> Any:
    """A copy of the frozen dataclass ``obj`` with ``fn`` applied to every tensor field
    (nested dataclasses too; ints and None kept)."""
    import torch

    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = fn(v)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _map_tensors(v, fn)
    return dataclasses.replace(obj, **changes)


@dataclasses.dataclass(frozen=True)
class PackedRow:
    """A packed THD micro-batch's model input (``trainer.sequence_packing='thd'``): its ``B``
    sequences back to back in ONE row of ``T`` positions (Megatron-Core's packed sequences, as
    TE's THD attention takes them; Megatron-LM's ``get_packed_seq_params``).

    Attributes:
        tokens: ``[1,T]`` long; sequence ``b`` at offsets ``cu_seqlens[b] .. cu_seqlens[b+1]-1``,
            then tail padding (token 0) up to ``T``.
        position_ids: ``[1,T]`` long, 0..l-1 per sequence (the tail continues the last one's).
        padding_mask: ``[1,T]`` bool, True on the tail.
        cu_seqlens: ``[B+1]`` int32, the real lengths' prefix sums (``cu_seqlens_q/kv``).
        cu_seqlens_padded: ``[B+1]`` int32, the same with the last one ending at ``T``
            (``cu_seqlens_q/kv_padded``; RoPE's ``_apply_rotary_pos_emb_thd`` splits by it).
        max_seqlen: int, the longest padded segment (the RoPE table length).
        logit_s: ``[N]`` long, the packed offset of each response-predicting row
            ``(MicroBatch.logit_b, MicroBatch.logit_s)``: ``cu_seqlens[logit_b] + logit_s``.
    """

    tokens: Tensor
    position_ids: Tensor
    padding_mask: Tensor
    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    max_seqlen: int
    logit_s: Tensor


@dataclasses.dataclass(frozen=True)
class CpShard:
    """This context-parallel rank's part of a micro-batch (CP > 1): the sequence-dim tensors
    split by Megatron-Core's ``get_batch_on_this_cp_rank`` (chunks ``r`` and ``2*CP-1-r`` of
    ``2*CP``), all ``[B, S/CP, ...]``.

    Attributes:
        tokens, position_ids (global positions): ``[B,S/CP]`` long; padding_mask: ``[B,S/CP]``
            bool; labels: ``[B,S/CP]`` long, token ``t+1`` at position ``t`` (0 at the last).
        routes_BSLK: ``[B,S/CP,L,K]`` long, routes_real_BS: ``[B,S/CP]`` bool (router
            replay; None without routes).
        logit_b, logit_s: ``[N_local]`` long, the response-predicting rows of
            ``MicroBatch.logit_b/logit_s`` this rank holds, as (sequence, local position).
    """

    tokens: Tensor
    position_ids: Tensor
    padding_mask: Tensor
    labels: Tensor
    logit_b: Tensor
    logit_s: Tensor
    routes_BSLK: Tensor | None = None
    routes_real_BS: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of ``B`` sequences right-padded to ``S`` positions (the trainer's
    ``_pack``); the loss side is per sequence over the ``S-1`` predicted positions (position
    ``t`` predicts token ``t+1``), whatever the model is given.

    Attributes:
        tokens: ``[B,S]`` long, prompt then response tokens, 0 after.
        loss_mask: ``[B,S-1]`` float, each response token's ``loss_weight`` times its ``Sample.loss_mask`` (0 elsewhere).
        advantages: ``[B,S-1]`` float, the sample's advantage on its response tokens.
        rollout_logp: ``[B,S-1]`` float32, the engine's logprobs of the response tokens.
        prompt_len, resp_len: ``[B]`` long.
        logit_b, logit_s: ``[N]`` long, the (sequence, position) of the N response-predicting
            positions (the only rows whose logits the loss and logprobs use).
        rollout_lp_mask: ``[B,S-1]`` float, 1 on response tokens with rollout logprobs and
            ``loss_weight > 0`` (router replay's mismatch metrics).
        first: int, the index of its first sequence in the packed sample list (micro-batches
            are contiguous runs of it, in order).
        position_ids: ``[B,S]`` long; attention_mask: ``[B,1,S,S]`` bool (True = masked,
            causal); padding_mask: ``[B,S]`` bool (True = padding position, Megatron-Core's
            GPTModel ``padding_mask``): the padded model input; None when packed (``thd``).
        routes_BSLK: long ``[B,S,L,K]`` (packed: ``[1,T,L,K]``, the model's token order; -1 =
            none), routes_real_BS: bool ``[B,S]`` (``[1,T]``): the engine's routes (router
            replay, when any sample has them); routes_missing_B: ``[B]`` bool, loss-bearing
            samples without routes (router replay on). None otherwise.
        thd: the packed model input (:class:`PackedRow`), or None (padded).
        cp: this CP rank's shard (:class:`CpShard`) at CP > 1, else None.
        logp_old: ``[B,S-1]`` float32, the proximal policy's logprobs (decoupled PPO), or None.
        n_real: the sequences of the packed list in this micro-batch (rows ``[0, n_real)``); the
            rows after them are zero-weight fillers (padded micro-batches at PP > 1 with a token
            budget: one ``[B,S]`` shape per step). None: every row is real.
    """

    tokens: Tensor
    loss_mask: Tensor
    advantages: Tensor
    rollout_logp: Tensor
    prompt_len: Tensor
    resp_len: Tensor
    logit_b: Tensor
    logit_s: Tensor
    rollout_lp_mask: Tensor
    first: int = 0
    position_ids: Tensor | None = None
    attention_mask: Tensor | None = None
    padding_mask: Tensor | None = None
    routes_BSLK: Tensor | None = None
    routes_real_BS: Tensor | None = None
    routes_missing_B: Tensor | None = None
    thd: PackedRow | None = None
    cp: CpShard | None = None
    logp_old: Tensor | None = None
    n_real: int | None = None

    def map_tensors(self, fn: Callable[["Tensor"], "Tensor"]) -> "MicroBatch":
        """A copy with ``fn`` applied to every tensor (those of ``thd`` and ``cp`` too)."""
        return _map_tensors(self, fn)


def padded_len(lens: Sequence[int], *, min_len: int, multiple: int, fixed_len: int | None = None) -> int:
    """Padded sequence length ``S`` (positions) of a micro-batch whose sequences have ``lens``
    tokens: ``fixed_len`` if given, else the longest; at least ``min_len``; rounded up to a
    multiple of ``multiple`` (TP for sequence parallelism, 2 x CP for context parallelism)."""
    S = fixed_len if fixed_len is not None else max(lens)
    S = max(S, min_len)
    return -(-S // multiple) * multiple


def micro_batch_ranges(
    lens: Sequence[int],
    micro_batch_size: int,
    max_tokens: int | None = None,
    *,
    min_len: int = 1,
    multiple: int = 1,
    fixed_len: int | None = None,
    packed: bool = False,
) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` sample ranges covering ``range(len(lens))`` in order.

    Args:
        lens: tokens per sequence (prompt + response), ints > 0.
        micro_batch_size: most sequences per micro-batch (>= 1).
        max_tokens: most padded positions per micro-batch, ``B x S`` with ``S`` from
            :func:`padded_len`; ``None`` = sequence count only. A single sequence longer than
            the budget gets a micro-batch of its own (never dropped, never truncated).
        min_len, multiple, fixed_len: as in :func:`padded_len`.
        packed: the micro-batch is ONE packed row (THD, ``trainer.sequence_packing='thd'``):
            its cost is ``T`` = :func:`padded_len` of the summed lengths (real tokens, rounded
            up), not ``B x S``; ``fixed_len`` is then ignored (the row's final length is known
            only once every range is cut).

    Returns:
        ``[(start, end), ...]``: greedy (a range grows while the next sequence still fits).

    Raises:
        ValueError: ``micro_batch_size < 1`` or ``max_tokens < 1``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out: list[tuple[int, int]] = []
    start = 0
    n = len(lens)
    while start < n:
        end = start + 1
        while end < n and end - start < micro_batch_size:
            if max_tokens is not None:
                if packed:
                    cost = padded_len([sum(lens[start : end + 1])], min_len=min_len, multiple=multiple)
                else:
                    S = padded_len(lens[start : end + 1], min_len=min_len, multiple=multiple, fixed_len=fixed_len)
                    cost = (end + 1 - start) * S
                if cost > max_tokens:
                    break
            end += 1
        out.append((start, end))
        start = end
    return out


def split_to_count(ranges: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """``ranges`` split further until there are ``count`` of them (data-parallel ranks must run
    the same number of micro-batches: expert all-to-all and the pipeline schedule are
    collectives). The range with the most sequences is halved first; order is kept.

    Raises:
        ValueError: ``count`` exceeds the number of sequences or is below ``len(ranges)``.
    """
    n = sum(e - s for s, e in ranges)
    if count < len(ranges) or count > n:
        raise ValueError(f"cannot cut {n} sequences in {len(ranges)} micro-batches into {count}")
    out = list(ranges)
    while len(out) < count:
        i = max(range(len(out)), key=lambda k: (out[k][1] - out[k][0], -k))
        s, e = out[i]
        mid = s + (e - s + 1) // 2
        out[i : i + 1] = [(s, mid), (mid, e)]
    return out
