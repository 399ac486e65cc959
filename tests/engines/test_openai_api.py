"""The embedded engine's ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
through the ``openai`` Python client, against transformers on the same weights (a tiny random
Mixtral with the SmolLM2 tokenizer and its ChatML template). The field lists of SGLang
0.5.23's own ``CompletionRequest`` / ``ChatCompletionRequest`` are read from the installed
package: each field is honoured or refused with a 400 naming it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import openai
import pytest
import torch

from _sglang_import import load_io_struct

try:
    load_io_struct()
    from sglang.srt.entrypoints.openai import protocol
except ImportError:  # pragma: no cover - depends on the environment
    protocol = None

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def served(tiny_chat_engine):
    """The shared tiny chat engine (conftest.py) with an OpenAI client on it."""
    return SimpleNamespace(**vars(tiny_chat_engine),
                           client=openai.OpenAI(base_url=f"{tiny_chat_engine.url}/v1", api_key="none",
                                                max_retries=0, timeout=120))


def _greedy(served, ids, n):
    ids = list(ids)
    lps = []
    for _ in range(n):
        with torch.no_grad():
            lp = torch.log_softmax(served.model(torch.tensor([ids])).logits[0, -1].float(), -1)
        t = int(lp.argmax())
        lps.append((float(lp[t]), lp))
        ids.append(t)
    return ids[-n:], lps


def test_models(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [served.model_dir]
    assert models[0].owned_by == "sglang" and models[0].model_extra["max_model_len"] == 256


def test_completion_greedy_logprobs(served):
    prompt = "The capital of France is"
    r = served.client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    ids = served.tokenizer(prompt)["input_ids"]
    ref, lps = _greedy(served, ids, 8)
    c = r.choices[0]
    assert c.text == served.tokenizer.decode(ref, skip_special_tokens=True)
    assert c.finish_reason == "length" and r.object == "text_completion" and r.model == "m"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8 and r.usage.total_tokens == len(ids) + 8
    assert c.logprobs.tokens == [served.tokenizer.decode([t]) for t in ref]
    assert c.logprobs.token_logprobs == pytest.approx([x for x, _ in lps], abs=1e-4)
    for row, (_, lp) in zip(c.logprobs.top_logprobs, lps):
        v, ix = torch.topk(lp, 3)
        assert list(row) == [served.tokenizer.decode([i]) for i in ix.tolist()] or len(set(row)) < 3
        assert sorted(row.values(), reverse=True) == pytest.approx(v.tolist(), abs=1e-4)


def test_completion_n_stop_and_token_prompt(served):
    ids = served.tokenizer("Once upon a time")["input_ids"]
    ref, _ = _greedy(served, ids, 16)
    text = served.tokenizer.decode(ref, skip_special_tokens=True)
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)
    r = served.client.completions.create(model="m", prompt=ids, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["matched_stop"] == stop
    r = served.client.completions.create(model="m", prompt=["a b", "c d e"], max_tokens=5, temperature=1.0, n=2,
                                         extra_body={"ignore_eos": True})
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    p = [len(served.tokenizer(t)["input_ids"]) for t in ("a b", "c d e")]
    assert r.usage.prompt_tokens == sum(p) and r.usage.completion_tokens == 20  # prompts once, not per sample


def test_chat_template_multi_turn_and_logprobs(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]
    r = served.client.chat.completions.create(model="m", messages=messages, max_completion_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2)
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else "2+2?"} for m in messages]
    text = served.tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>system\nBe brief." in text
    ids = served.tokenizer(text, add_special_tokens=False)["input_ids"]
    ref, lps = _greedy(served, ids, 6)
    ref_cut = ref[: ref.index(2)] if 2 in ref else ref
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == served.tokenizer.decode(ref_cut, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"
    assert [x.logprob for x in c.logprobs.content] == pytest.approx([x for x, _ in lps[: len(c.logprobs.content)]], abs=1e-4)
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob
               for x in c.logprobs.content)
    r = served.client.chat.completions.create(model="m", messages=messages, max_tokens=3, temperature=0.8, n=3,
                                              seed=5)
    assert len(r.choices) == 3 and r.usage.prompt_tokens == len(ids)


def test_unknown_and_unsupported_fields_are_400(served):
    with pytest.raises(openai.BadRequestError, match="bogus"):
        served.client.completions.create(model="m", prompt="x", max_tokens=2, extra_body={"bogus": 1})
    with pytest.raises(openai.BadRequestError, match="tools"):
        served.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="max_tokens must be positive"):
        served.client.completions.create(model="m", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="stream"):
        served.client.completions.create(model="m", prompt="x", max_tokens=2, stream=True)


def _protocol_fields(name):
    return [] if protocol is None else sorted(getattr(protocol, name).model_fields)


@pytest.mark.skipif(protocol is None, reason="sglang's openai protocol unavailable")
@pytest.mark.parametrize("route,cls", [("/v1/completions", "CompletionRequest"),
                                       ("/v1/chat/completions", "ChatCompletionRequest")])
def test_every_sglang_field_honoured_or_refused(served, route, cls):
    import httpx

    from moe_async.engines.embedded.openai_api import CHAT_FIELDS, COMPLETION_FIELDS

    ours = COMPLETION_FIELDS if cls == "CompletionRequest" else CHAT_FIELDS
    fields = set(_protocol_fields(cls))
    assert ours <= fields, f"fields SGLang's {cls} does not have: {sorted(ours - fields)}"
    base = {"prompt": "x"} if cls == "CompletionRequest" else {"messages": [{"role": "user", "content": "x"}]}
    base["max_tokens"] = 1
    for f in sorted(fields - ours):
        r = httpx.post(f"{served.url}{route}", json={**base, f: "on"}, timeout=60)
        assert r.status_code == 400 and f in r.json()["message"], (f, r.text)
    assert httpx.post(f"{served.url}{route}", json=base, timeout=60).status_code == 200
