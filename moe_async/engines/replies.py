"""The replies of an engine's ``/generate``, parsed (SGLang's JSON -> our dataclasses).

:func:`parse_generate` -> :class:`GenerateOutput` (tokens, logprobs, the weight version of each
token, routed experts ``[tokens, L, K]`` int32); :func:`parse_score` -> :class:`ScoreOutput`
(a scoring call's per-token logprobs and top-k). Both raise ValueError naming what the reply
lacks. Used by :mod:`moe_async.engines.client`."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class GenerateOutput:
    """One finished generation.

    Attributes:
        output_ids: ``[R]`` generated token ids.
        output_logprobs: ``[R]`` logprob of each generated token (SGLang's definition:
            ``log_softmax(logits / temperature)``; raw logits when greedy).
        finish_reason: ``"stop"`` | ``"length"`` | ``"abort"``.
        weight_version: the engine's weight version reported with the result.
        output_token_weight_versions: ``[R]`` version per token (from the server's
            ``output_token_weight_versions`` or SGLang's ``weight_versions`` spans, else
            ``weight_version`` repeated).
        routed_experts: ``None`` or int32 ``[prompt + R - 1, moe_layers, top_k]``.
        prompt_tokens: prompt length the engine saw.
        rid: request id.
        text: decoded text ("" without a tokenizer).
        finish_info: the raw ``finish_reason`` dict.
        sampling_mask: ``None`` or, per output token, the token ids the sampler could pick
            after top-k/top-p/min-p truncation (SGLang's ``output_token_sampling_mask``;
            greedy: just the chosen token).
        sampling_logprobs: ``None`` or, per output token, the behaviour logprob: log of the
            chosen token's probability renormalised over that support (``"selected"``
            mode; 0.0 when greedy), or the list over the support (``"support"`` mode).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    weight_version: int
    output_token_weight_versions: list[int]
    routed_experts: np.ndarray | None
    prompt_tokens: int
    rid: str = ""
    text: str = ""
    finish_info: dict = field(default_factory=dict)
    sampling_mask: list[list[int]] | None = None
    sampling_logprobs: list | None = None


@dataclass
class ScoreOutput:
    """A scoring call's result (:meth:`~moe_async.engines.client._Calls.score`).

    Attributes:
        token_logprobs: ``[n]`` logprob (natural log, raw ``log_softmax``, no temperature) of
            each scored token ``input_ids[logprob_start_len:]`` given the tokens before it.
        top_logprobs: ``None`` or, per scored position, ``[(token_id, logprob)]`` of the
            ``top_logprobs_num`` most likely tokens, best first.
    """

    token_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


def parse_score(resp: dict, n: int) -> ScoreOutput:
    """SGLang ``/generate`` response of a scoring call sent with ``logprob_start_len`` one before
    the first scored token (:meth:`~moe_async.engines.client._Calls.score`) -> :class:`ScoreOutput` of the ``n`` tokens
    after it: SGLang's first input entry (the token at ``logprob_start_len``) has no logprob
    (``null``) and is dropped.

    Raises: ValueError when the engine returned other than ``n + 1`` input logprobs or a null
    one after the first."""
    meta = resp["meta_info"]
    rows = meta.get("input_token_logprobs") or []
    lps = [r[0] for r in rows[1:]]
    if len(rows) != n + 1 or any(v is None for v in lps):
        raise ValueError(f"scoring call: expected {n + 1} input logprobs (the first null), the engine returned "
                         f"{len(rows)} ({sum(v is None for v in lps)} null after the first)")
    top = meta.get("input_top_logprobs")
    tops = None if top is None else [[(int(e[1]), float(e[0])) for e in (r or [])] for r in top[1:]]
    return ScoreOutput([float(v) for v in lps], tops)


def as_version(v: Any) -> int:
    """A ``weight_version`` as an int; -1 for SGLang's non-numeric default (``"default"``)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1  # SGLang's default version string ("default") is not a number


def parse_generate(
    resp: dict, moe_shape: tuple[int, int] | None = None
) -> GenerateOutput:
    """SGLang ``/generate`` response dict -> :class:`GenerateOutput`."""
    meta = resp["meta_info"]
    ids = list(resp.get("output_ids") or [])
    lps = [x[0] for x in meta.get("output_token_logprobs") or []]
    version = as_version(meta.get("weight_version"))
    if "output_token_weight_versions" in meta:
        versions = [as_version(v) for v in meta["output_token_weight_versions"]]
    elif meta.get("weight_versions"):
        versions = [version] * len(ids)
        for span in meta["weight_versions"]:
            for i in range(span["start"], min(span["end"], len(ids))):
                versions[i] = as_version(span["version"])
    else:
        versions = [version] * len(ids)
    routed = None
    if meta.get("routed_experts") is not None:
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        if "routed_experts_shape" in meta:
            routed = flat.reshape(meta["routed_experts_shape"])
        elif moe_shape is not None:
            routed = flat.reshape(-1, *moe_shape)
        else:
            raise ValueError(
                "routed_experts came without routed_experts_shape; construct the client with "
                "moe_layers= and top_k= to decode it"
            )
    finish = meta.get("finish_reason") or {}
    return GenerateOutput(
        output_ids=ids,
        output_logprobs=lps,
        finish_reason=finish.get("type", "length") if isinstance(finish, dict) else str(finish),
        weight_version=version,
        output_token_weight_versions=versions,
        routed_experts=routed,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        rid=str(meta.get("id", "")),
        text=resp.get("text", ""),
        finish_info=finish if isinstance(finish, dict) else {},
        sampling_mask=meta.get("output_token_sampling_mask"),
        sampling_logprobs=meta.get("output_token_sampling_logprobs"),
    )
