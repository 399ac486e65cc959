"""One generation request of the embedded engine's scheduler and what it produced so far.

:class:`Req` holds SGLang's ``/generate`` fields (sampling, logprob and routing options), the
output tokens with their logprobs and weight versions, and the ``Future`` the scheduler
resolves with the response dict (:mod:`moe_async.engines.embedded.response`)."""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_async.engines.embedded.sampling import SamplingParams


@dataclass
class Req:
    """One generation request and everything it has produced so far."""

    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str = "selected"  # "selected" | "support"
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    routed_experts_start_len: int = 0
    return_prompt_token_ids: bool = False
    lora_name: str | None = None  # the LoRA adapter this request runs on (held until it finishes)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    max_new_tokens: int = 0  # after clamping to the context
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    input_token_logprobs: list[list] | None = None
    input_top: list = field(default_factory=list)  # per input position: None | (vals, ids)
    input_ids_lp: list = field(default_factory=list)  # per input position: None | (vals, ids)
    output_top: list = field(default_factory=list)  # per output token: (vals, ids)
    output_ids_lp: list = field(default_factory=list)  # per output token: (vals, ids)
    routed: list[np.ndarray] = field(default_factory=list)  # chunks of [S, L, K] int32
    sampling_mask: list[list[int]] = field(default_factory=list)  # per output token: support ids
    sampling_logprobs: list = field(default_factory=list)  # per output token: float | list
    finish: dict | None = None
    num_retractions: int = 0
    created: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
