"""``sampling_params`` of SGLang 0.5.23's ``/generate``: decoded, checked, and applied.

One entry per field of SGLang's ``SamplingParams``, never ignored: an unknown key or a wrong
type is a 400 naming it (SGLang's words), a field in :data:`REFUSED` is accepted only at its
default, and ranges are checked as ``SamplingParams.verify`` checks them. Truncation order:
temperature, top-k, top-p, min-p.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_async.types import Tokenizer, JsonDict

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
MAX_STOP_COUNT = 32  # SGLang's limits
MAX_STOP_REGEX_LEN = 256
_SAMPLING_EPS = 1e-6

# field -> expected JSON kind, in SGLang's api_types declaration order (the unknown-field
# message lists them in this order)
_KINDS: dict[str, str] = {
    "max_new_tokens": "int", "stop": "str_or_list", "stop_token_ids": "int_list",
    "stop_regex": "str_or_list", "temperature": "float", "top_p": "float", "top_k": "int",
    "min_p": "float", "frequency_penalty": "float", "presence_penalty": "float",
    "repetition_penalty": "float", "min_new_tokens": "int", "n": "int", "json_schema": "str",
    "regex": "str", "ebnf": "str", "structural_tag": "str", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool", "stream_interval": "int", "logit_bias": "float_map",
    "sampling_seed": "int", "custom_params": "any", "beam_width": "int", "watermark": "any",
    "choice": "str_list",
}
FIELDS: tuple[str, ...] = tuple(_KINDS)

#: field -> why it is refused (accepted only at its SGLang default)
REFUSED: dict[str, str] = {
    "json_schema": "constrained decoding is not implemented",
    "regex": "constrained decoding is not implemented",
    "ebnf": "constrained decoding is not implemented",
    "structural_tag": "constrained decoding is not implemented",
    "custom_params": "custom logit processors are not implemented",
    "beam_width": "beam search is not implemented",
    "watermark": "watermarking is not implemented",
    "choice": "constrained choice decoding is not implemented",
}
#: SGLang's default of each refused field (a request may carry it)
REFUSED_DEFAULTS: dict[str, object] = {"choice": []}

HONOURED: frozenset[str] = frozenset(FIELDS) - frozenset(REFUSED)


class RequestError(ValueError):
    """A request SGLang would refuse: the HTTP 400 message (names the field)."""


@dataclass
class SamplingParams:
    """One request's decoded ``sampling_params`` (design notes: ``docs/design/engines.md``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k (SGLang refuses 0)
    min_p: float = 0.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_new_tokens_set: bool = False  # the client set max_new_tokens (context check)
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_str_max_len: int = 0  # tokens of the longest stop string (tail window to decode)

    @classmethod
    def from_dict(cls, d: JsonDict | None, *, vocab_size: int | None = None,
                  tokenizer: Tokenizer | None = None) -> "SamplingParams":
        return decode_sampling_params(d, vocab_size=vocab_size, tokenizer=tokenizer)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether :func:`adjust_logits` changes anything for this request."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_new_tokens or self.logit_bias)


def _type_error(name: str, v: object, expected: str) -> RequestError:
    return RequestError(f"sampling_params.{name}: invalid type: {type(v).__name__} {v!r}, expected {expected}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_kind(name: str, kind: str, v: Any) -> Any:
    if kind == "int":
        if not _is_int(v):
            raise _type_error(name, v, "an integer")
    elif kind == "float":
        if not (_is_int(v) or isinstance(v, float)):
            raise _type_error(name, v, "a number")
        v = float(v)
    elif kind == "bool":
        if not isinstance(v, bool):
            raise _type_error(name, v, "a boolean")
    elif kind == "str":
        if not isinstance(v, str):
            raise _type_error(name, v, "a string")
    elif kind == "str_or_list":
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise _type_error(name, v, "a string or a list of strings")
    elif kind == "str_list":
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise _type_error(name, v, "a list of strings")
    elif kind == "int_list":
        if not isinstance(v, list) or not all(_is_int(t) for t in v):
            raise _type_error(name, v, "a list of integers")
    elif kind == "float_map":
        if not isinstance(v, dict) or not all(_is_int(x) or isinstance(x, float) for x in v.values()):
            raise _type_error(name, v, "a map of token id to number")
    return v


def unknown_field(where: str, key: str, fields: tuple[str, ...]) -> RequestError:
    listed = ", ".join(f"`{f}`" for f in fields)
    return RequestError(f"{where}: unknown field `{key}`, expected one of {listed}")


def decode_sampling_params(d: JsonDict | None, *, vocab_size: int | None = None,
                           tokenizer: Tokenizer | None = None) -> SamplingParams:
    """``d`` (one ``sampling_params`` object) -> :class:`SamplingParams`, or
    :class:`RequestError` (the 400's message, naming the field)."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise RequestError(f"sampling_params: invalid type: {type(d).__name__}, expected an object")
    p = SamplingParams()
    for key, v in d.items():
        kind = _KINDS.get(key)
        if kind is None:
            raise unknown_field("sampling_params", key, FIELDS)
        if v is None:
            continue  # null: SGLang's default
        v = _check_kind(key, kind, v)
        if key in REFUSED:
            if v != REFUSED_DEFAULTS.get(key):
                raise RequestError(f"sampling_params.{key} is not supported by the embedded "
                                   f"engine ({REFUSED[key]}); got {v!r}")
            continue
        if key == "max_new_tokens":
            p.max_new_tokens, p.max_new_tokens_set = v, True
        elif key == "logit_bias":
            try:
                p.logit_bias = {int(k): float(b) for k, b in v.items()}
            except ValueError:
                raise RequestError(f"sampling_params.logit_bias: keys must be token ids, got {list(v)}") from None
        elif key == "stream_interval":
            pass  # streaming only (refused): no effect, as in SGLang without stream
        else:
            setattr(p, key, v)
    if 0 <= p.temperature < _SAMPLING_EPS:  # SGLang: greedy is top_k = 1
        p.temperature, p.top_k = 0.0, 1
    _verify(p, vocab_size)
    if tokenizer is not None and p.stop:
        p.stop_str_max_len = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in p.stop)
    elif p.stop:
        p.stop_str_max_len = max(len(s) for s in p.stop)
    if tokenizer is None:
        for name, val in (("stop", p.stop), ("stop_regex", p.stop_regex)):
            if val:
                raise RequestError(f"sampling_params.{name}={val!r} needs a tokenizer to match text; "
                                   "none was found at the model path")
    return p


def _verify(p: SamplingParams, vocab_size: int | None) -> None:
    """SGLang's ``SamplingParams.verify`` (and ``normalize``'s stop limits), its messages."""
    def bad(name: str, msg: str) -> RequestError:
        return RequestError(f"sampling_params.{name}: {msg}")

    if not math.isfinite(p.temperature) or p.temperature < 0.0:
        raise bad("temperature", f"temperature must be a non-negative finite number, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise bad("top_p", f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise bad("min_p", f"min_p must be in [0, 1], got {p.min_p}.")
    if p.top_k != -1 and p.top_k < 1:
        raise bad("top_k", f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
    if p.top_k >= TOP_K_ALL:
        p.top_k = -1
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(p, name) <= 2.0:
            raise bad(name, f"{name} must be in [-2, 2], got {getattr(p, name)}.")
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise bad("repetition_penalty", "repetition_penalty must be in (0, 2] (1.0 = no penalty), "
                  f"got {p.repetition_penalty}.")
    if p.max_new_tokens < 0:
        raise bad("max_new_tokens", f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    if not 0 <= p.min_new_tokens <= p.max_new_tokens:
        raise bad("min_new_tokens", f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], "
                  f"got {p.min_new_tokens}.")
    if p.n < 1:
        raise bad("n", f"n must be at least 1, got {p.n}.")
    if vocab_size is not None:
        for t in p.logit_bias:
            if not 0 <= t < vocab_size:
                raise bad("logit_bias", f"logit_bias must has keys in [0, {vocab_size - 1}], got {t}.")
        for t in p.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise bad("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size}), got {t}.")
    if len(p.stop) > MAX_STOP_COUNT:
        raise bad("stop", f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(p.stop)}")
    if len(p.stop_regex) > MAX_STOP_COUNT:
        raise bad("stop_regex", f"at most {MAX_STOP_COUNT} stop_regex patterns are allowed, "
                  f"got {len(p.stop_regex)}")
    for rx in p.stop_regex:
        if len(rx.encode("utf-8")) > MAX_STOP_REGEX_LEN:
            raise bad("stop_regex", f"stop_regex is {len(rx.encode())} bytes, over the "
                      f"{MAX_STOP_REGEX_LEN}-byte limit")
        try:
            re.compile(rx)
        except re.error as e:
            raise bad("stop_regex", f"invalid stop_regex {rx!r}: {e}") from None
    p.stop = [s for s in p.stop if s]


# ------------------------------------------------------------------ logits processing
def adjust_logits(logits_V: torch.Tensor, p: SamplingParams, output_ids: list[int],
                  stop_ids: set[int]) -> torch.Tensor:
    """SGLang's penalizers and ``logit_bias`` on one row of logits (a new tensor).

    ``counts[t]`` = occurrences of token ``t`` among the request's *output* tokens so far
    (SGLang's penalizers accumulate output tokens only, never the prompt). In SGLang's
    order: the additive penalizers ``logits -= frequency_penalty * counts +
    presence_penalty * (counts > 0)``, and ``-inf`` on every id in ``stop_ids`` (EOS,
    ``stop_token_ids``) while ``len(output_ids) < min_new_tokens``; then the scaling one
    (``repetition_penalty`` ``r`` on seen tokens: ``logit * r`` if ``logit < 0`` else
    ``logit / r``); then ``logits += logit_bias``. Logprobs and sampling see the result.
    Every tensor made here is on ``logits_V``'s device.
    """
    x = logits_V.clone()
    V = x.numel()
    counts = None
    if output_ids and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=x.device),
                                minlength=V)[:V].to(x.dtype)
    if counts is not None and p.frequency_penalty:
        x -= p.frequency_penalty * counts
    if counts is not None and p.presence_penalty:
        x -= p.presence_penalty * (counts > 0).to(x.dtype)
    if len(output_ids) < p.min_new_tokens and stop_ids:
        ids = torch.tensor(sorted(t for t in stop_ids if 0 <= t < V), dtype=torch.long, device=x.device)
        x[ids] = float("-inf")
    if counts is not None and p.repetition_penalty != 1.0:
        seen = counts > 0
        r = p.repetition_penalty
        x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=x.device)
        x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device)
    return x


# ------------------------------------------------------------------ stop conditions
def check_finish(p: SamplingParams, output_ids: list[int], max_new_tokens: int,
                 eos_ids: set[int], tokenizer: Tokenizer) -> dict | None:
    """SGLang's ``Req.update_finish_state`` after one new token: stop strings / regexes on
    the decoded tail first (``matched``: the string or pattern), then EOS and
    ``stop_token_ids`` (both off under ``ignore_eos``; ``matched``: the token id), then
    the length cap. ``None`` while the request goes on."""
    if p.stop or p.stop_regex:
        tail_len = min(max(p.stop_str_max_len, _regex_tail(p)) + 1, len(output_ids))
        tail = tokenizer.decode(output_ids[-tail_len:])
        for s in p.stop:
            if s in tail:
                return {"type": "stop", "matched": s}
        for rx in p.stop_regex:
            if re.search(rx, tail):
                return {"type": "stop", "matched": rx}
    tok = output_ids[-1]
    if not p.ignore_eos and (tok in eos_ids or tok in p.stop_token_ids):
        return {"type": "stop", "matched": tok}
    if len(output_ids) >= max_new_tokens:
        return {"type": "length", "length": max_new_tokens}
    return None


def _regex_tail(p: SamplingParams) -> int:
    # SGLang bounds the window by the regex's longest match; a decoded tail of 64 tokens
    # covers any bounded pattern of the 256-byte limit that can match within a few tokens.
    return 64 if p.stop_regex else 0


def output_text(p: SamplingParams, output_ids: list[int], finish: dict | None, tokenizer: Tokenizer) -> str:
    """The response ``text`` as SGLang's detokenizer makes it: a matched stop token is not
    decoded and a matched stop string is cut off (both kept under ``no_stop_trim``);
    ``skip_special_tokens`` and ``spaces_between_special_tokens`` as requested."""
    if tokenizer is None or not output_ids:
        return ""
    matched = (finish or {}).get("matched") if (finish or {}).get("type") == "stop" else None
    ids = output_ids
    if isinstance(matched, int) and not p.no_stop_trim:
        ids = ids[:-1]
    kw = {"skip_special_tokens": p.skip_special_tokens}
    if not p.spaces_between_special_tokens:
        kw["spaces_between_special_tokens"] = False
    text = tokenizer.decode(ids, **kw)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[: pos + len(matched)] if p.no_stop_trim else text[:pos]
    return text
