"""SGLang 0.5.23's ``/generate`` response for one finished request of the embedded engine.

``{"text", "output_ids", "meta_info"}`` with SGLang's ``meta_info`` fields (finish reason, token
counts, ``weight_version`` and its spans, logprobs and top logprobs in SGLang's
``[logprob, token_id, text]`` entries) plus ``output_token_weight_versions`` and
``routed_experts_shape``.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np

from moe_async.engines.embedded.sampling import output_text
from moe_async.types import Tokenizer, JsonDict


def _entries(vals: list, ids: list[int], tokenizer: Tokenizer, with_text: bool) -> list[list]:
    texts = [tokenizer.decode([t]) for t in ids] if with_text else [None] * len(ids)
    return [[v, t, s] for v, t, s in zip(vals, ids, texts)]


def _top(rows: list, tokenizer: Tokenizer, with_text: bool) -> list:
    return [None if r is None else _entries(r[0], r[1], tokenizer, with_text) for r in rows]


def build_response(req: Any, *,  # a scheduler Req (the scheduler imports this module)
                    weight_version: str, num_layers: int, top_k: int, tokenizer: Tokenizer) -> dict:
    """The response dict of ``req`` (a finished :class:`~.req.Req`)."""
    C = len(req.output_ids)
    version = req.output_versions[-1] if req.output_versions else weight_version
    meta: JsonDict = {
        "id": req.rid,
        "finish_reason": req.finish,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": C,
        "cached_tokens": 0,
        "weight_version": str(version),  # any string, as SGLang's
        # our extension: the weight_version (string) that produced each output token
        "output_token_weight_versions": list(req.output_versions),
        # SGLang 0.5.23's span form of the same information
        "weight_versions": _spans(req.output_versions, version),
        "num_retractions": req.num_retractions,
        "e2e_latency": time.monotonic() - req.created,
    }
    with_text = req.return_text_in_logprobs
    if req.return_logprob:
        meta["input_token_logprobs"] = _entries(
            [x[0] for x in req.input_token_logprobs or []], [x[1] for x in req.input_token_logprobs or []],
            tokenizer, with_text)
        meta["output_token_logprobs"] = _entries(req.output_logprobs, req.output_ids, tokenizer, with_text)
        meta["output_token_logprobs_length"] = C
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _top(req.input_top, tokenizer, with_text)
            meta["output_top_logprobs"] = _top(req.output_top, tokenizer, with_text)
        if req.token_ids_logprob is not None:
            meta["input_token_ids_logprobs"] = _top(req.input_ids_lp, tokenizer, with_text)
            meta["output_token_ids_logprobs"] = _top(req.output_ids_lp, tokenizer, with_text)
    if req.return_sampling_mask:
        meta["output_token_sampling_mask"] = req.sampling_mask[:C]
        meta["output_token_sampling_logprobs"] = req.sampling_logprobs[:C]
        meta["output_token_sampling_mask_length"] = len(meta["output_token_sampling_mask"])
    if req.return_routed_experts:
        # rows = prompt + completion - 1 (SGLang's (seqlen - 1, L, K)) from
        # routed_experts_start_len on; a 0-token completion covers the prompt's first P - 1.
        if req.routed:
            arr = np.concatenate(req.routed, axis=0)[req.routed_experts_start_len:]
            arr = np.ascontiguousarray(arr, dtype=np.int32)
        else:
            arr = np.zeros((0, num_layers, top_k), dtype=np.int32)
        meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode("ascii")
        meta["routed_experts_shape"] = list(arr.shape)  # our extension
    text = ""
    if tokenizer is not None and C:
        try:
            text = output_text(req.params, req.output_ids, req.finish, tokenizer)
        except Exception:  # pragma: no cover - tokenizer quirks must not fail a request
            text = ""
    out = {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
    if req.return_prompt_token_ids:
        out["prompt_token_ids"] = list(req.input_ids)
    return out


def _spans(versions: list[str], current: str) -> list[dict]:
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans or [{"version": str(current), "start": 0, "end": 0}]
