"""The ``/generate`` body (SGLang 0.5.23's ``GenerateReqInput``) -> scheduler requests.

Every field of SGLang's ``GenerateReqInput`` is in :data:`HONOURED` or :data:`REFUSED`; an
unknown field is a 400, and a refused one is accepted only at its SGLang default (else a 400
naming it), so a typo never silently changes a rollout.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from moe_async.engines.embedded.sampling import RequestError, SamplingParams, decode_sampling_params, unknown_field
from moe_async.types import Tokenizer

HONOURED: tuple[str, ...] = (
    "lora_path", "rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "stream", "log_metrics", "return_routed_experts",
    "routed_experts_start_len", "no_logs", "return_prompt_token_ids",
)

_MM = "multimodal input is not supported (text-only models)"
_PD = "prefill/decode disaggregation is not supported"
_DP = "data-parallel routing is not supported (one engine is one DP rank)"
#: field -> (SGLang's default, why it is refused)
REFUSED: dict[str, tuple[object, str]] = {
    "session_id": (None, "sessions are not supported"),
    "input_embeds": (None, "input embeddings are not supported; send input_ids or text"),
    "image_data": (None, _MM), "video_data": (None, _MM), "audio_data": (None, _MM),
    "mm_hashes": (None, _MM), "mm_content_hashes": (None, _MM), "use_audio_in_video": (False, _MM),
    "video_config": (None, _MM), "modalities": (None, _MM), "max_dynamic_patch": (None, _MM),
    "min_dynamic_patch": (None, _MM), "image_max_dynamic_patch": (None, _MM),
    "video_max_dynamic_patch": (None, _MM), "images_config": (None, _MM),
    "mm_processor_kwargs": (None, _MM), "need_wait_for_mm_inputs": (None, _MM),
    "num_items_assigned": (None, _MM), "encoder_urls": (None, _MM),
    "watermark": (None, "watermarking is not implemented"),
    "return_flat_raw_top_logprobs": (False, "flat top-logprob arrays are not implemented"),
    "return_flat_raw_output_top_logprobs": (False, "flat top-logprob arrays are not implemented"),
    "return_flat_raw_top_logprobs_b64": (False, "flat top-logprob arrays are not implemented"),
    "return_hidden_states": (False, "hidden states are not returned"),
    "return_indexer_topk": (False, "no sparse-attention indexer"),
    "session_params": (None, "sessions are not supported"),
    "lora_id": (None, "LoRA adapters are not supported"),
    "custom_logit_processor": (None, "custom logit processors are not implemented"),
    "positional_embed_overrides": (None, "embedding overrides are not supported"),
    "bootstrap_host": (None, _PD), "bootstrap_port": (None, _PD), "bootstrap_room": (None, _PD),
    "bootstrap_pair_key": (None, _PD), "decode_tp_size": (None, _PD),
    "disagg_prefill_dp_rank": (None, _PD),
    "routed_dp_rank": (None, _DP), "data_parallel_rank": (None, _DP),
    "routing_key": (None, "routing-key scheduling is not supported"),
    "conversation_id": (None, "conversation tracking is not supported"),
    "http_worker_ipc": (None, "internal to SGLang's multi-tokenizer mode"),
    "background": (False, "background responses are not supported"),
    "require_reasoning": (False, "no reasoning parser"),
    "max_thinking_tokens": (None, "no reasoning parser"),
    "priority": (None, "priority scheduling is not supported"),
    "extra_key": (None, "no prefix cache to key"),
    "cache_salt": (None, "no prefix cache to salt"),
    "kv_hints": (None, "no hierarchical cache"),
    "custom_labels": (None, "no per-request metrics to label"),
    "return_bytes": (False, "internal to image generation"),
    "return_entropy": (False, "entropy is not returned"),
    "external_trace_header": (None, "tracing is not supported"),
    "received_time": (None, "internal to SGLang"),
    "multi_item_delimiter_indices": (None, "multi-item scoring is not supported"),
    "token_indices_to_pool": (None, "pooling readout is not supported"),
}
FIELDS: tuple[str, ...] = HONOURED + tuple(REFUSED)


@dataclass
class ItemSpec:
    """One sample to generate: what :class:`~.req.Req` is built from."""

    input_ids: list[int]
    params: SamplingParams
    rid: str
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    return_text_in_logprobs: bool
    return_routed_experts: bool
    routed_experts_start_len: int
    return_sampling_mask: bool
    sampling_logprobs_mode: str
    return_prompt_token_ids: bool
    lora_path: str | None = None  # the loaded LoRA adapter's name (SGLang's lora_path)


def _bool(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise RequestError(f"{name}: invalid type: {type(v).__name__} {v!r}, expected a boolean")
    return v


def _int(name: str, v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise RequestError(f"{name}: invalid type: {type(v).__name__} {v!r}, expected an integer")
    return v


def _ids(name: str, v: object) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise RequestError(f"{name}: expected a list of token ids")
    return v


def decode_generate(body: object, *, tokenizer: Tokenizer | None, vocab_size: int) -> tuple[list[ItemSpec], bool]:
    """The ``/generate`` body -> ``(samples, single)``; ``single``: answer one object, not
    a list. Raises :class:`RequestError` with the 400's message (which names the field)."""
    if not isinstance(body, dict):
        raise RequestError("the /generate body must be a JSON object")
    for key, v in body.items():
        if key in HONOURED:
            continue
        if key not in REFUSED:
            raise unknown_field("GenerateReqInput", key, FIELDS)
        default, why = REFUSED[key]
        if v is not None and v != default:
            raise RequestError(f"{key} is not supported by the embedded engine ({why}); got {v!r}")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the embedded engine")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise RequestError("text or input_ids is required")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise RequestError("text: expected a string or a list of strings")
    if input_ids is not None:  # SGLang: input_ids are what is generated from, text only sizes the batch
        if not isinstance(input_ids, list):
            raise RequestError("input_ids: expected a list of token ids or a list of lists")
        ids_single = len(input_ids) == 0 or not isinstance(input_ids[0], list)
        batch = [input_ids] if ids_single else input_ids
        if text is None:
            single = ids_single
        elif len(batch) != len(texts):
            raise RequestError(f"text ({len(texts)} prompt(s)) and input_ids ({len(batch)} prompt(s)) differ in "
                               f"batch size; input_ids are used when both are given")
        for i, ids in enumerate(batch):
            _ids("input_ids" if single else f"input_ids[{i}]", ids)
    else:
        if tokenizer is None:
            raise RequestError("text input needs a tokenizer; none found at the model path")
        batch = [tokenizer(t)["input_ids"] for t in texts]
    B = len(batch)
    if B == 0:
        raise RequestError("the batch is empty")

    def per_item(name: str, default: Any, check) -> list:
        v = body.get(name)
        if isinstance(v, list) and not (name == "token_ids_logprob" and (not v or not isinstance(v[0], list))):
            if single and name != "token_ids_logprob":
                raise RequestError(f"{name}: a list is only allowed for a batch")
            if len(v) != B:
                raise RequestError(f"{name}: {len(v)} values for a batch of {B}")
            return [default if x is None else check(f"{name}[{i}]", x) for i, x in enumerate(v)]
        return [default if v is None else check(name, v)] * B

    lora = per_item("lora_path", None, _lora_name)
    return_logprob = per_item("return_logprob", False, _bool)
    start_len = per_item("logprob_start_len", -1, _int)
    top_num = per_item("top_logprobs_num", 0, _int)
    token_ids_lp = per_item("token_ids_logprob", None, _ids)
    sampling_mask = per_item("return_sampling_mask", False, _bool)
    modes = per_item("sampling_logprobs_mode", None, lambda n, v: _mode(n, v))
    text_in_lp = _bool("return_text_in_logprobs", body.get("return_text_in_logprobs") or False)
    routed = _bool("return_routed_experts", body.get("return_routed_experts") or False)
    routed_start = _int("routed_experts_start_len", body.get("routed_experts_start_len") or 0)
    prompt_ids = _bool("return_prompt_token_ids", body.get("return_prompt_token_ids") or False)
    for name in ("log_metrics", "no_logs"):
        if body.get(name) is not None:
            _bool(name, body[name])
    if text_in_lp and tokenizer is None:
        raise RequestError("return_text_in_logprobs needs a tokenizer; none found at the model path")
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if single:
            raise RequestError("sampling_params: a list is only allowed for a batch")
        if len(sp) != B:
            raise RequestError(f"sampling_params: {len(sp)} values for a batch of {B}")
    params = [decode_sampling_params(sp[i] if isinstance(sp, list) else sp, vocab_size=vocab_size,
                                     tokenizer=tokenizer) for i in range(B)]
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, (str, list)):
        raise RequestError("rid: expected a string or a list of strings")
    if isinstance(rid, list) and (single or len(rid) != B):
        raise RequestError(f"rid: {len(rid)} values for a batch of {B}" if not single
                           else "rid: a list is only allowed for a batch")
    n_total = sum(p.n for p in params)
    out: list[ItemSpec] = []
    for i, ids in enumerate(batch):
        where = "" if single else f"[{i}]"
        if len(ids) == 0:
            raise RequestError(f"input_ids{where} is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"input_ids{where} has token ids outside [0, {vocab_size}): {bad[:5]}")
        if modes[i] is not None and not sampling_mask[i]:
            raise RequestError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
        if not 0 <= routed_start <= len(ids):
            raise RequestError(f"routed_experts_start_len={routed_start} must be in [0, prompt tokens "
                               f"({len(ids)})]")
        if start_len[i] > len(ids):
            raise RequestError(f"logprob_start_len{where}={start_len[i]} is larger than the prompt "
                               f"({len(ids)} tokens)")
        if top_num[i] < 0:
            raise RequestError(f"top_logprobs_num{where} must be >= 0, got {top_num[i]}")
        for t in token_ids_lp[i] or []:
            if not 0 <= t < vocab_size:
                raise RequestError(f"token_ids_logprob{where} has a token id outside [0, {vocab_size}): {t}")
        base = rid[i] if isinstance(rid, list) else (f"{rid}_{i}" if isinstance(rid, str) and not single else rid)
        for j in range(params[i].n):
            r = base if (base and n_total == B) else uuid.uuid4().hex
            out.append(ItemSpec(
                input_ids=list(ids), params=params[i], rid=r, return_logprob=return_logprob[i],
                logprob_start_len=start_len[i] if return_logprob[i] else -1,
                top_logprobs_num=top_num[i] if return_logprob[i] else 0,
                token_ids_logprob=token_ids_lp[i] if return_logprob[i] else None,
                return_text_in_logprobs=text_in_lp, return_routed_experts=routed,
                routed_experts_start_len=routed_start, return_sampling_mask=sampling_mask[i],
                sampling_logprobs_mode=modes[i] or "selected", return_prompt_token_ids=prompt_ids,
                lora_path=lora[i],
            ))
    return out, single and n_total == 1


def _lora_name(name: str, v: object) -> str:
    if not isinstance(v, str) or not v:
        raise RequestError(f"{name}: expected the name of a loaded LoRA adapter, got {v!r}")
    return v


def _mode(name: str, v: object) -> str:
    if not isinstance(v, str) or v not in ("selected", "support"):
        raise RequestError(f"{name}: expected 'selected' or 'support', got {v!r}")
    return v
