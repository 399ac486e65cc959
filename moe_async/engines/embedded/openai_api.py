"""The OpenAI-compatible endpoints of the embedded engine, as SGLang 0.5.23 serves them.

``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (non-streaming):
each request is translated to a ``/generate`` body as SGLang translates it and run by the same
scheduler; responses carry SGLang's fields. An unsupported field is a 400 naming it.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import time
import uuid
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from moe_async.engines.embedded.sampling import RequestError
from moe_async.types import Tokenizer, JsonDict

# OpenAI / SGLang request field -> sampling_params field (the same meaning)
_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex", "n": "n", "logit_bias": "logit_bias", "seed": "sampling_seed",
    "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos", "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
}
_COMMON = set(_SAMPLING) | {"model", "stream", "user", "rid", "return_routed_experts", "routed_experts_start_len"}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "max_tokens", "logprobs", "echo", "return_token_ids"})
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_tokens", "max_completion_tokens", "logprobs",
                                   "top_logprobs"})

# SGLang defaults a client may send explicitly for features this engine does not have
_DEFAULTS = {"tool_choice": ("auto", "none"), "parallel_tool_calls": (True,), "separate_reasoning": (True,),
             "stream_reasoning": (True,), "return_flat_raw_top_logprobs_b64": (True,), "best_of": (1,)}

#: The engine's ``/generate`` handler: a request body -> its reply (one dict, or a list for a batch).
Generate = Callable[[JsonDict], Awaitable[JsonDict | list[JsonDict]]]


def error_response(message: str, status: int = 400) -> JSONResponse:
    """SGLang's OpenAI ``ErrorResponse``."""
    return JSONResponse({"object": "error", "message": message, "type": "BadRequestError",
                         "param": None, "code": status}, status_code=status)


def _check_fields(body: object, allowed: frozenset, route: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the {route} body must be a JSON object")
    for key, v in body.items():
        if key not in allowed and v is not None and v is not False and v not in _DEFAULTS.get(key, ()):
            raise RequestError(f"{key} is not supported by the embedded engine's {route} "
                               f"(supported: {', '.join(sorted(allowed))})")
    if body.get("stream"):
        raise RequestError(f"stream=true is not supported by the embedded engine's {route}")
    return body


def _sampling(body: dict, max_new: int | None) -> dict:
    sp = {dst: body[src] for src, dst in _SAMPLING.items() if body.get(src) is not None}
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    return sp


def _finish(ret: JsonDict) -> tuple[str | None, object]:
    f = ret["meta_info"]["finish_reason"]
    return (f["type"], f.get("matched")) if f else (None, None)


def _usage(rets: list[dict], n: int) -> dict:
    prompt = sum(rets[i]["meta_info"]["prompt_tokens"] for i in range(0, len(rets), n))
    completion = sum(r["meta_info"]["completion_tokens"] for r in rets)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": None, "reasoning_tokens": 0}


def _listify(out: JsonDict | list[JsonDict]) -> list[JsonDict]:
    return out if isinstance(out, list) else [out]


def _completion_logprobs(ret: dict, echo: bool) -> dict:
    m = ret["meta_info"]
    tokens, lps, tops = [], [], []
    rows = (m.get("input_token_logprobs") or []) if echo else []
    top_rows = (m.get("input_top_logprobs") or []) if echo else []
    rows = rows + m.get("output_token_logprobs", [])
    top_rows = top_rows + m.get("output_top_logprobs", [])
    for lp, _tid, text in rows:
        tokens.append(text)
        lps.append(lp)
    for row in top_rows:
        tops.append(None if row is None else {text: lp for lp, _tid, text in row})
    return {"text_offset": [-1] * len(tokens), "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def _chat_logprobs(ret: dict) -> dict:
    m = ret["meta_info"]
    tops = m.get("output_top_logprobs") or []
    content = []
    for i, (lp, _tid, text) in enumerate(m["output_token_logprobs"]):
        row = tops[i] if i < len(tops) and tops[i] is not None else []
        content.append({"token": text or "", "bytes": list((text or "").encode("utf-8")), "logprob": lp,
                        "top_logprobs": [{"token": t or "", "bytes": list((t or "").encode("utf-8")),
                                          "logprob": v} for v, _i, t in row]})
    return {"content": content}


def chat_prompt_ids(tokenizer: Tokenizer | None, messages: object) -> list[int]:
    """The prompt of ``messages`` under the tokenizer's chat template (generation prompt
    added), as SGLang's ``serving_chat`` renders it for a template-only model."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages: the model path has no tokenizer with a chat template")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of messages")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]: expected an object with a role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise RequestError(f"messages[{i}].{sorted(extra)[0]} is not supported by the embedded engine")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise RequestError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(part.get("text", ""))
            content = "".join(parts)
        if content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: expected a string or a list of text parts")
        msgs.append({"role": m["role"], "content": content or ""})
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def register_openai_routes(app: FastAPI, *, generate: Generate, tokenizer: Tokenizer | None, model_path: str,
                           context_length: int) -> None:
    """Add ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` to ``app``;
    ``generate(body)`` runs one ``/generate`` body (raises :class:`RequestError`)."""

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_path, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": model_path, "parent": None, "max_model_len": context_length}]}

    async def body_of(request: Request) -> object:
        try:
            return await request.json()
        except ValueError:
            raise RequestError("the body is not valid JSON") from None

    async def answer(request: Request, fields: frozenset[str], route: str,
                     handler: Callable[[JsonDict], Awaitable[object]]) -> object:
        """``handler(body)`` for a request whose JSON body passes :func:`_check_fields`; a
        :class:`RequestError` from either is SGLang's 400 ``ErrorResponse``."""
        try:
            return await handler(_check_fields(await body_of(request), fields, route))
        except RequestError as e:
            return error_response(str(e))
        except ClientDisconnect:  # the client left before its body arrived: no one to answer
            return Response(status_code=499)

    def pass_through(body: JsonDict, g: JsonDict) -> None:
        """The SGLang request fields both /v1 routes hand to ``/generate`` as given."""
        for k in ("rid", "return_routed_experts", "routed_experts_start_len"):
            if body.get(k) is not None:
                g[k] = body[k]

    def with_routes(out: dict, body: dict, rets: list) -> dict:
        """``out`` with SGLang's ``sglext.routed_experts`` when the body asked for them."""
        if body.get("return_routed_experts"):
            out["sglext"] = {"routed_experts": rets[0]["meta_info"]["routed_experts"]}
        return out

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, COMPLETION_FIELDS, "/v1/completions", _completions)

    async def _completions(body: dict) -> dict:
        prompt = body.get("prompt")
        if prompt is None:
            raise RequestError("prompt is required")
        max_tokens = body.get("max_tokens", 16)  # OpenAI's and SGLang's default
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise RequestError(f"max_tokens must be positive, got {max_tokens!r}")
        g: JsonDict = {"sampling_params": _sampling(body, max_tokens)}
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            g["text"] = prompt
        else:
            g["input_ids"] = prompt
        logprobs, echo = body.get("logprobs"), bool(body.get("echo"))
        if logprobs is not None:
            g.update(return_logprob=True, top_logprobs_num=int(logprobs), return_text_in_logprobs=True)
            if echo:
                g["logprob_start_len"] = 0
        pass_through(body, g)
        if body.get("return_token_ids"):
            g["return_prompt_token_ids"] = True
        rets = _listify(await generate(g))
        n = int(body.get("n") or 1)
        prompts = [prompt] if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], (str, list)) \
            else prompt
        choices = []
        for i, r in enumerate(rets):
            reason, matched = _finish(r)
            text = r["text"]
            if echo:
                p = prompts[i // n]
                if isinstance(p, str):
                    text = p + text
                elif tokenizer is None:
                    raise RequestError("echo: a token-id prompt needs a tokenizer to be echoed; none at the model path")
                else:
                    text = tokenizer.decode(p) + text
            c = {"index": i, "text": text, "logprobs": _completion_logprobs(r, echo) if logprobs is not None
                 else None, "finish_reason": reason, "matched_stop": matched}
            if body.get("return_token_ids"):
                c["token_ids"], c["prompt_token_ids"] = r["output_ids"], r.get("prompt_token_ids")
            choices.append(c)
        out = {"id": rets[0]["meta_info"]["id"], "object": "text_completion", "created": int(time.time()),
               "model": body.get("model", "default"), "choices": choices, "usage": _usage(rets, n)}
        return with_routes(out, body, rets)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, CHAT_FIELDS, "/v1/chat/completions", _chat)

    async def _chat(body: dict) -> dict:
        ids = chat_prompt_ids(tokenizer, body.get("messages"))
        max_new = body.get("max_completion_tokens") or body.get("max_tokens")  # SGLang's precedence
        g: JsonDict = {"input_ids": ids, "sampling_params": _sampling(body, max_new)}
        if body.get("logprobs"):
            g.update(return_logprob=True, top_logprobs_num=int(body.get("top_logprobs") or 0),
                     return_text_in_logprobs=True)
        elif body.get("top_logprobs"):
            raise RequestError("top_logprobs needs logprobs=true")
        pass_through(body, g)
        rets = _listify(await generate(g))
        choices = []
        for i, r in enumerate(rets):
            reason, matched = _finish(r)
            choices.append({
                "index": i,
                "message": {"role": "assistant", "content": r["text"], "reasoning_content": None,
                            "tool_calls": None},
                "logprobs": _chat_logprobs(r) if body.get("logprobs") else None,
                "finish_reason": reason, "matched_stop": matched})
        out = {"id": rets[0]["meta_info"]["id"] if body.get("rid") else uuid.uuid4().hex,
               "object": "chat.completion", "created": int(time.time()), "model": body.get("model", "default"),
               "choices": choices, "usage": _usage(rets, int(body.get("n") or 1))}
        return with_routes(out, body, rets)
