"""Data records that flow through the loop: rollout -> reward -> buffer -> trainer.

Legend (shapes): ``R`` = response tokens of one sample, ``P`` = prompt tokens,
``L`` = MoE layers, ``K`` = router top-k.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, TypeVar, overload

import numpy as np

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from torch import Tensor

#: A JSON object as ``json.load`` / an HTTP reply / a YAML mapping gives it: its values are
#: unknown until the reader checks them (the standard library types them as ``Any``).
JsonDict: TypeAlias = dict[str, Any]


class Tokenizer(Protocol):
    """An HF tokenizer as the package calls it (``transformers.PreTrainedTokenizerBase``, a
    test's stand-in). ``apply_chat_template`` gives the prompt text (``tokenize=False``), its
    token ids, or (some tokenizers) a mapping holding them under ``input_ids``."""

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str: ...

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> Mapping[str, list[int]]: ...

    def get_vocab(self) -> dict[str, int]: ...

    @property
    def all_special_tokens(self) -> list[str]: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    @overload
    def apply_chat_template(self, conversation: Sequence[Mapping[str, object]], *,
                            tools: Sequence[Mapping[str, object]] | None = None,
                            add_generation_prompt: bool = False, tokenize: Literal[False]) -> str: ...

    @overload
    def apply_chat_template(self, conversation: Sequence[Mapping[str, object]], *,
                            tools: Sequence[Mapping[str, object]] | None = None,
                            add_generation_prompt: bool = False,
                            tokenize: Literal[True] = True) -> list[int] | Mapping[str, list[int]]: ...


def template_ids(out: list[int] | Mapping[str, list[int]]) -> list[int]:
    """:meth:`Tokenizer.apply_chat_template`'s token ids (``tokenize=True``): the list, or the
    ``input_ids`` of the mapping some tokenizers return (a ``BatchEncoding``)."""
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(i) for i in ids]


@dataclass
class Sample:
    """One generated response to one prompt.

    Attributes:
        prompt_ids: ``[P]`` int token ids sent to the engine (chat template applied).
        response_ids: ``[R]`` int token ids the engine generated (eos included when it stopped).
        rollout_logprobs: ``[R]`` float logprob (natural log) of each response token under the
            engine's weights, as returned in SGLang's ``output_token_logprobs``.
        weight_versions: ``[R]`` int weight_version of the engine weights that produced each
            response token. A sample's staleness is measured from ``min(weight_versions)``.
        finish_reason: ``"stop"`` (eos/stop token), ``"length"`` (max_new_tokens or context),
            ``"abort"`` (aborted and not resumed).
        reward: scalar reward (float), set by the reward stage.
        reward_error: ``None`` or a short reason when the reward function failed/timed out.
        answer: gold answer of the task, used by the reward.
        response_text: decoded response.
        routed_experts: ``None`` or ``[P + R - 1, L, K]`` uint8/int16 expert ids, as SGLang returns.
        loss_weight: 1.0 normally; 0.0 for samples that must not contribute to the loss
            (e.g. 0-token completions).
        metadata: free-form task metadata (task name, problem index ...).
        loss_mask: ``None`` (every response token is the model's) or ``[R]`` 0/1 ints: 1 for
            tokens the engine sampled, 0 for tokens appended by the rollout (a multi-turn
            trajectory's observations: tool results, environment replies, chat-template
            glue). Masked tokens carry no loss, no logprob comparison; their
            ``rollout_logprobs`` are 0.0 and their ``weight_versions`` repeat the preceding
            sampled token's (the trajectory's staleness is its oldest sampled token's).
        teacher_logprobs: ``None`` (no teacher, or it failed on this sample) or ``[R]`` float
            logprob (natural log) of each response token under the distillation teacher
            (moe_async/distill), given the teacher's prompt.
        teacher_topk_ids, teacher_topk_logprobs: ``None`` (no top-k asked, or the teacher
            failed) or ``[R, k]`` int64 token ids / float32 logprobs (natural log, the
            teacher's full-vocabulary log-softmax) of the teacher's ``k`` most likely tokens at
            each response position, best first (SGLang's ``input_top_logprobs``).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    reward: float = 0.0
    reward_error: str | None = None
    answer: str = ""
    response_text: str = ""
    routed_experts: np.ndarray | None = None
    loss_weight: float = 1.0
    metadata: JsonDict = field(default_factory=dict)
    loss_mask: list[int] | None = None
    teacher_logprobs: list[float] | None = None
    teacher_topk_ids: np.ndarray | None = None
    teacher_topk_logprobs: np.ndarray | None = None

    @property
    def oldest_version(self) -> int:
        """Oldest weight_version among the response tokens (``-1`` for an empty response)."""
        return min(self.weight_versions) if self.weight_versions else -1

    def validate(self) -> None:
        """Raise ``ValueError`` when per-token lists disagree in length."""
        n = len(self.response_ids)
        t = self.teacher_logprobs
        if len(self.rollout_logprobs) != n or len(self.weight_versions) != n or (t is not None and len(t) != n):
            raise ValueError(
                f"sample lengths disagree: response_ids={n}, rollout_logprobs="
                f"{len(self.rollout_logprobs)}, weight_versions={len(self.weight_versions)}"
                + ("" if t is None else f", teacher_logprobs={len(t)}")
            )
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(f"sample lengths disagree: response_ids={n}, loss_mask={len(self.loss_mask)}")
        ti, tl = self.teacher_topk_ids, self.teacher_topk_logprobs
        if (ti is None) != (tl is None):
            raise ValueError("teacher_topk_ids and teacher_topk_logprobs must be set together")
        if ti is not None and tl is not None and (ti.ndim != 2 or ti.shape[0] != n or ti.shape != tl.shape):
            raise ValueError(f"sample lengths disagree: response_ids={n}, teacher_topk_ids {tuple(ti.shape)}, "
                             f"teacher_topk_logprobs {tuple(tl.shape)} (want [{n}, k] each)")

    def response_mask(self) -> list[float]:
        """``[R]`` float: 1.0 where a response token carries loss (``loss_mask``; all when None)."""
        if self.loss_mask is None:
            return [1.0] * len(self.response_ids)
        return [float(m) for m in self.loss_mask]


@dataclass
class Group:
    """A GRPO group: ``G`` samples for the same prompt; admitted to or dropped from the
    buffer as a whole.

    Attributes:
        group_id: unique, increasing id assigned by the rollout manager.
        samples: the ``G`` samples.
        start_version: engine weight_version when generation of the group was admitted.
    """

    group_id: int
    samples: list[Sample]
    start_version: int = 0

    @property
    def oldest_version(self) -> int:
        """Oldest token version over all samples (``start_version`` if none has tokens)."""
        vs = [s.oldest_version for s in self.samples if s.weight_versions]
        return min(vs) if vs else self.start_version

    @property
    def num_tokens(self) -> int:
        """Number of response tokens in the group."""
        return sum(len(s.response_ids) for s in self.samples)


_Frozen = TypeVar("_Frozen", bound="DataclassInstance")


def _map_tensors(obj: _Frozen, fn: Callable[["Tensor"], "Tensor"]) -> _Frozen:
    """A copy of the frozen dataclass ``obj`` with ``fn`` applied to every tensor field
    (nested dataclasses too; ints and None kept)."""
    import torch

    changes: dict[str, object] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = fn(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
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
        topk_ids: ``[B,S/CP,k]`` long, ``MicroBatch.topk_ids`` at this rank's positions (as
            ``labels``), or None.
    """

    tokens: Tensor
    position_ids: Tensor
    padding_mask: Tensor
    labels: Tensor
    logit_b: Tensor
    logit_s: Tensor
    routes_BSLK: Tensor | None = None
    routes_real_BS: Tensor | None = None
    topk_ids: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of ``B`` sequences right-padded to ``S`` positions (the trainer's
    ``Batcher.pack``); the loss side is per sequence over the ``S-1`` predicted positions (position
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
        topk_ids, topk_logp: ``[B,S-1,k]`` long / float32, the distillation teacher's top-k
            token ids and logprobs at each response-predicting position (``Sample.teacher_topk_*``;
            0 elsewhere); topk_mask: ``[B,S-1]`` float, 1 on the response tokens that have them.
            None when no sample of the batch has them.
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
    topk_ids: Tensor | None = None
    topk_logp: Tensor | None = None
    topk_mask: Tensor | None = None

    def map_tensors(self, fn: Callable[["Tensor"], "Tensor"]) -> "MicroBatch":
        """A copy with ``fn`` applied to every tensor (those of ``thd`` and ``cp`` too)."""
        return _map_tensors(self, fn)
