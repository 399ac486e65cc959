"""Every field of SGLang 0.5.23's ``/generate`` schema against the embedded engine (C17).

The field lists are read from the installed SGLang: ``io_struct.GenerateReqInput`` (the
dataclass SGLang's HTTP server binds ``/generate`` to), ``api_types.SamplingParams`` (its
contract decoder) and ``sampling_params.SamplingParams`` (its runtime struct, whose internal
fields must be refused as unknown). Each field is either honoured -- a value check against
transformers on the same weights, or SGLang's own penalizers -- or refused with a 400 that
names it. A field missing from :data:`GEN` / :data:`SAMPLING` fails its test.

The server is a real embedded engine process: a tiny random Mixtral with the SmolLM2
tokenizer (ChatML; vocab 49152), so text, stop strings and special tokens are real.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import httpx
import pytest
import torch

from _sglang_import import io_struct_or_skip

io, _mods, pytestmark = io_struct_or_skip("sglang.api.v1.api_types", "sglang.srt.sampling.sampling_params",
                                         what="sglang")
if io is not None:
    api_types = _mods["sglang.api.v1.api_types"]
    SglSamplingParams = _mods["sglang.srt.sampling.sampling_params"].SamplingParams

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
EOS = 2
PROMPT = [1, 504, 3458, 314, 253, 1159, 28, 339, 6171]  # arbitrary real token ids


@pytest.fixture(scope="module")
def served(tiny_chat_engine):
    """The shared tiny chat engine (conftest.py)."""
    return tiny_chat_engine


def post(served, body, status=200):
    r = httpx.post(f"{served.url}/generate", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def gen(served, sp=None, **kw):
    return post(served, {"input_ids": PROMPT, "sampling_params": sp or {}, **kw})


GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def hf_logits(served, ids):
    with torch.no_grad():
        return served.model(torch.tensor([ids])).logits[0].float()


def hf_greedy(served, n=12):
    ids = list(PROMPT)
    for _ in range(n):
        ids.append(int(hf_logits(served, ids)[-1].argmax()))
    return ids[len(PROMPT):]


def refused(served, body_or_sp, name, top=False):
    body = body_or_sp if top else {"input_ids": PROMPT, "sampling_params": body_or_sp}
    if top:
        body = {"input_ids": PROMPT, **body}
    err = post(served, body, 400)["error"]["message"]
    assert f"{name}" in err, err
    return err


# ------------------------------------------------------------------ sampling_params checks
def s_max_new_tokens(served):
    out = gen(served, {**GREEDY, "max_new_tokens": 5})
    assert out["output_ids"] == hf_greedy(served, 5)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def _greedy_text(served):
    out = gen(served, {**GREEDY, "max_new_tokens": 16})
    return out, served.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def _stop_string(text):
    """A stop string of 2-4 characters from the middle of ``text``, first seen there."""
    for i in range(len(text) // 3, len(text) - 3):
        s = text[i:i + 3]
        if s.strip() and text.find(s) == i:
            return s, i
    raise AssertionError(f"no stop string in {text!r}")


def s_stop(served):
    base, text = _greedy_text(served)
    s, pos = _stop_string(text)
    for stop in (s, [s, "\x00never"]):
        out = gen(served, {**GREEDY, "max_new_tokens": 16, "stop": stop})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": s}
        assert out["text"] == text[:pos]
        ids = out["output_ids"]
        assert ids == base["output_ids"][: len(ids)] and len(ids) < 16
        assert s in served.tokenizer.decode(ids) and s not in served.tokenizer.decode(ids[:-1])


def s_no_stop_trim(served):
    _, text = _greedy_text(served)
    s, pos = _stop_string(text)
    out = gen(served, {**GREEDY, "max_new_tokens": 16, "stop": s, "no_stop_trim": True})
    assert out["text"] == text[: pos + len(s)]


def s_stop_regex(served):
    base, text = _greedy_text(served)
    s, pos = _stop_string(text)
    rx = re.escape(s)
    out = gen(served, {**GREEDY, "max_new_tokens": 16, "stop_regex": rx})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": rx}
    ids = out["output_ids"]
    assert ids == base["output_ids"][: len(ids)] and s in served.tokenizer.decode(ids)


def s_stop_token_ids(served):
    ref = hf_greedy(served, 12)
    t = ref[3]
    out = gen(served, {"temperature": 0.0, "max_new_tokens": 12, "stop_token_ids": [t]})
    k = ref.index(t)
    assert out["output_ids"] == ref[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": t}
    # the matched stop token is not in the text (SGLang's trim_matched_stop)
    assert out["text"] == served.tokenizer.decode(ref[:k], skip_special_tokens=True)


def s_temperature(served):
    out = gen(served, {**GREEDY, "temperature": 0.0}, return_logprob=True)
    assert out["output_ids"] == hf_greedy(served, 12)
    out = gen(served, {"temperature": 0.7, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3},
              return_logprob=True)
    ids = PROMPT + out["output_ids"]
    lp = torch.log_softmax(hf_logits(served, ids) / 0.7, dim=-1)
    exp = [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(out["output_ids"])]
    got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(exp, abs=1e-4)


def s_top_k(served):
    out = gen(served, {"temperature": 1.0, "top_k": 3, "max_new_tokens": 4, "ignore_eos": True},
              return_sampling_mask=True)
    rows = out["meta_info"]["output_token_sampling_mask"]
    ids = PROMPT + out["output_ids"]
    logits = hf_logits(served, ids)
    for i, row in enumerate(rows):
        assert row == sorted(torch.topk(logits[len(PROMPT) - 1 + i], 3).indices.tolist())
    refused(served, {"top_k": 0}, "top_k")


def s_top_p(served):  # a tiny top_p keeps only the argmax: sampling = greedy
    out = gen(served, {"temperature": 1.0, "top_p": 1e-6, "max_new_tokens": 8, "ignore_eos": True})
    assert out["output_ids"] == hf_greedy(served, 8)
    refused(served, {"top_p": 0.0}, "top_p")


def s_min_p(served):  # min_p = 1 keeps only the argmax
    out = gen(served, {"temperature": 1.0, "min_p": 1.0, "max_new_tokens": 8, "ignore_eos": True})
    assert out["output_ids"] == hf_greedy(served, 8)
    refused(served, {"min_p": 1.5}, "min_p")


class _Batch:
    device = "cpu"

    def __init__(self, sp):
        from types import SimpleNamespace as NS

        full = {"stop_token_ids": set(), "min_new_tokens": 0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "repetition_penalty": 1.0, **sp}
        self.reqs = [NS(sampling_params=NS(**full),
                        eos_token_ids={EOS}, tokenizer=NS(additional_stop_token_ids=None, eos_token_id=EOS))]


def _sglang_penalized_greedy(served, sp, n, bias):
    """Greedy decoding of ``PROMPT`` under transformers with SGLang 0.5.23's own penalizers
    (``BatchedPenalizerOrchestrator`` over the penaltylib classes) applied to each step's
    logits, then ``logit_bias`` (SGLang adds it after the penalizers): the reference tokens
    and logprobs."""
    import torch._dynamo

    from sglang.srt.sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
    from sglang.srt.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
    from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
    from sglang.srt.sampling.penaltylib.presence_penalty import BatchedPresencePenalizer
    from sglang.srt.sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer

    torch._dynamo.config.disable = True  # apply_scaling_penalties is torch.compile'd: run it eagerly
    batch = _Batch(sp)
    orch = BatchedPenalizerOrchestrator(
        served.model.config.vocab_size, batch,
        {BatchedFrequencyPenalizer, BatchedPresencePenalizer, BatchedRepetitionPenalizer,
         BatchedMinNewTokensPenalizer})
    ids, lps = list(PROMPT), []
    for _ in range(n):
        logits = hf_logits(served, ids)[-1:].clone()
        orch.apply(logits)
        for t, b in bias.items():
            logits[0, int(t)] += b
        t = int(logits[0].argmax())
        lps.append(float(torch.log_softmax(logits[0], -1)[t]))
        ids.append(t)
        orch.cumulate_output_tokens(torch.tensor([t]))
    return ids[len(PROMPT):], lps


PENALTIES = ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0})
_BIAS: dict = {}


def _penalty_bias(served):
    """A logit bias (+10 on two of the best tokens) under which plain greedy decoding keeps
    choosing between those two, so every penalty changes the output (a random model rarely
    repeats a token by itself): the first pair of the top 6 for which all three penalties'
    SGLang references differ from the unpenalized output."""
    if "bias" not in _BIAS:
        top = torch.topk(hf_logits(served, PROMPT)[-1], 6).indices.tolist()
        for i in range(6):
            for j in range(i + 1, 6):
                bias = {str(top[i]): 10.0, str(top[j]): 10.0}
                plain, _ = _sglang_penalized_greedy(served, {}, 12, bias)
                if all(_sglang_penalized_greedy(served, sp, 12, bias)[0] != plain for sp in PENALTIES):
                    _BIAS["bias"] = bias, plain
                    return _BIAS["bias"]
        raise AssertionError("no logit bias makes all three penalties matter")
    return _BIAS["bias"]


def _check_penalty(served, sp):
    n = 12
    bias, plain = _penalty_bias(served)
    out = gen(served, {**GREEDY, "max_new_tokens": n, "logit_bias": bias, **sp}, return_logprob=True)
    ref, ref_lp = _sglang_penalized_greedy(served, sp, n, bias)
    assert out["output_ids"] == ref != plain
    assert [x[0] for x in out["meta_info"]["output_token_logprobs"]] == pytest.approx(ref_lp, abs=1e-4)
    assert gen(served, {**GREEDY, "max_new_tokens": n, "logit_bias": bias})["output_ids"] == plain


def s_frequency_penalty(served):
    _check_penalty(served, {"frequency_penalty": 2.0})
    refused(served, {"frequency_penalty": 2.5}, "frequency_penalty")


def s_presence_penalty(served):
    _check_penalty(served, {"presence_penalty": 2.0})
    refused(served, {"presence_penalty": -3.0}, "presence_penalty")


def s_repetition_penalty(served):
    _check_penalty(served, {"repetition_penalty": 2.0})
    refused(served, {"repetition_penalty": 0.0}, "repetition_penalty")


def s_logit_bias(served):
    out = gen(served, {"temperature": 0.0, "max_new_tokens": 8, "logit_bias": {str(EOS): 100.0}})
    assert out["output_ids"] == [EOS]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    refused(served, {"logit_bias": {"99999999": 1.0}}, "logit_bias")


def s_min_new_tokens(served):
    out = gen(served, {"temperature": 0.0, "max_new_tokens": 8, "min_new_tokens": 3,
                       "logit_bias": {str(EOS): 100.0}})
    ids = out["output_ids"]
    assert len(ids) == 4 and EOS not in ids[:3] and ids[3] == EOS
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    logits = hf_logits(served, PROMPT)[-1].clone()
    logits[EOS] = float("-inf")  # masked until 3 tokens exist; the bias is on EOS only
    assert ids[0] == int(logits.argmax())
    refused(served, {"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens")


def s_n(served):
    out = gen(served, {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "ignore_eos": True})
    assert isinstance(out, list) and len(out) == 3
    assert len({o["meta_info"]["id"] for o in out}) == 3
    assert all(o["meta_info"]["completion_tokens"] == 6 for o in out)
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # independent samples
    batch = post(served, {"input_ids": [PROMPT, PROMPT[:4]], "sampling_params": {**GREEDY, "n": 2}})
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [len(PROMPT)] * 2 + [4] * 2
    refused(served, {"n": 0}, "n")


def s_ignore_eos(served):
    out = gen(served, {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True,
                       "logit_bias": {str(EOS): 100.0}})
    assert out["output_ids"] == [EOS] * 4
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def s_skip_special_tokens(served):
    sp = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True, "logit_bias": {str(EOS): 100.0}}
    assert gen(served, sp)["text"] == ""
    assert gen(served, {**sp, "skip_special_tokens": False})["text"] == "<|im_end|>" * 3


def s_spaces_between_special_tokens(served):
    sp = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True, "logit_bias": {str(EOS): 100.0},
          "skip_special_tokens": False}
    out = gen(served, {**sp, "spaces_between_special_tokens": False})
    assert out["text"] == served.tokenizer.decode([EOS] * 3, skip_special_tokens=False,
                                                  spaces_between_special_tokens=False)


def s_stream_interval(served):  # streaming only; streaming is refused: no effect
    assert gen(served, {**GREEDY, "stream_interval": 4})["output_ids"] == hf_greedy(served, 12)


def s_sampling_seed(served):
    sp = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True}
    a = gen(served, {**sp, "sampling_seed": 7})["output_ids"]
    assert gen(served, {**sp, "sampling_seed": 7})["output_ids"] == a
    assert gen(served, {**sp, "sampling_seed": 8})["output_ids"] != a


SAMPLING = {
    "max_new_tokens": s_max_new_tokens, "stop": s_stop, "stop_token_ids": s_stop_token_ids,
    "stop_regex": s_stop_regex, "temperature": s_temperature, "top_p": s_top_p, "top_k": s_top_k,
    "min_p": s_min_p, "frequency_penalty": s_frequency_penalty, "presence_penalty": s_presence_penalty,
    "repetition_penalty": s_repetition_penalty, "min_new_tokens": s_min_new_tokens, "n": s_n,
    "ignore_eos": s_ignore_eos, "skip_special_tokens": s_skip_special_tokens,
    "spaces_between_special_tokens": s_spaces_between_special_tokens, "no_stop_trim": s_no_stop_trim,
    "stream_interval": s_stream_interval, "logit_bias": s_logit_bias, "sampling_seed": s_sampling_seed,
    # refused: a non-default value (the default -- what SGLang's frontend sends -- is accepted)
    "json_schema": ("refused", '{"type": "object"}'), "regex": ("refused", "a+"),
    "ebnf": ("refused", 'root ::= "a"'), "structural_tag": ("refused", "{}"),
    "custom_params": ("refused", {"k": 1}), "beam_width": ("refused", 2),
    "watermark": ("refused", {"enabled": True}), "choice": ("refused", ["a", "b"]),
    # sglang.srt SamplingParams' internal fields: not API fields, refused as unknown
    "stop_strs": ("unknown", ["x"]), "stop_regex_strs": ("unknown", ["x"]),
    "stop_str_max_len": ("unknown", 3), "stop_regex_max_len": ("unknown", 3),
    "is_normalized": ("unknown", True), "ebnf_full_assistant": ("unknown", True),
}


def _sampling_fields():
    if io is None:
        return []
    return sorted(set(api_types.SamplingParams.__struct_fields__) | set(SglSamplingParams.__struct_fields__))


@pytest.mark.parametrize("name", _sampling_fields())
def test_sampling_param(served, name):
    assert name in SAMPLING, f"sampling_params.{name} (SGLang 0.5.23) is neither honoured nor refused"
    entry = SAMPLING[name]
    if callable(entry):
        return entry(served)
    kind, value = entry
    err = refused(served, {"max_new_tokens": 2, name: value}, name)
    if kind == "unknown":
        assert f"unknown field `{name}`" in err
    else:
        assert "not supported" in err
        default = getattr(SglSamplingParams(), name, None) if name != "choice" else []
        out = gen(served, {**GREEDY, "max_new_tokens": 2, name: default})  # the default is accepted
        assert out["meta_info"]["completion_tokens"] == 2


def test_c17_openai_max_tokens_is_refused(served):
    err = refused(served, {"max_tokens": 8}, "max_tokens")
    assert err.startswith("sampling_params: unknown field `max_tokens`, expected one of `max_new_tokens`")
    # SGLang's own contract decoder refuses it with the same serde words
    with pytest.raises(api_types.JsonContractError, match="unknown field `max_tokens`"):
        api_types.SamplingParams.from_json_value({"max_tokens": 8})


# ------------------------------------------------------------------ GenerateReqInput checks
def g_rid(served):
    assert gen(served, GREEDY, rid="abc")["meta_info"]["id"] == "abc"
    batch = post(served, {"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY, "rid": ["x", "y"]})
    assert [o["meta_info"]["id"] for o in batch] == ["x", "y"]


def g_text(served):
    out = post(served, {"text": "Hello there, how", "sampling_params": GREEDY})
    assert out["meta_info"]["prompt_tokens"] == len(served.tokenizer("Hello there, how")["input_ids"])
    # text together with input_ids: SGLang accepts it and generates from input_ids (its
    # tokenizer manager takes input_ids first; text only sizes the batch)
    for body in ({"text": "Hello there, how", "input_ids": PROMPT},
                 {"text": ["Hello", "there"], "input_ids": [PROMPT, PROMPT]}):
        ref = io.GenerateReqInput(**body, sampling_params=GREEDY)
        ref.normalize_batch_and_arguments()  # SGLang's own decoding of the request
        out = post(served, {**body, "sampling_params": GREEDY})
        outs = out if isinstance(out, list) else [out]
        assert isinstance(out, list) == (not ref.is_single) and len(outs) == ref.batch_size
        for o in outs:
            assert o["meta_info"]["prompt_tokens"] == len(PROMPT) and o["output_ids"] == hf_greedy(served, 12)
    post(served, {"text": ["a", "b"], "input_ids": PROMPT, "sampling_params": GREEDY}, 400)


def g_input_ids(served):
    assert gen(served, GREEDY)["output_ids"] == hf_greedy(served, 12)


def g_sampling_params(served):
    batch = post(served, {"input_ids": [PROMPT, PROMPT],
                          "sampling_params": [{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 3}]})
    assert [o["meta_info"]["completion_tokens"] for o in batch] == [2, 3]


def g_return_logprob(served):
    out = gen(served, GREEDY, return_logprob=True)
    lp = torch.log_softmax(hf_logits(served, PROMPT + out["output_ids"]), -1)
    exp = [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(out["output_ids"])]
    got = out["meta_info"]["output_token_logprobs"]
    assert [x[0] for x in got] == pytest.approx(exp, abs=1e-4)
    assert [x[1] for x in got] == out["output_ids"] and all(x[2] is None for x in got)
    assert out["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1


def g_logprob_start_len(served):  # scoring: max_new_tokens 0 (C17; the frontend's select)
    lp = torch.log_softmax(hf_logits(served, PROMPT), -1)
    for start in (0, 4):
        out = gen(served, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start)
        got = out["meta_info"]["input_token_logprobs"]
        assert [x[1] for x in got] == PROMPT[start:]
        exp = [float(lp[p - 1, PROMPT[p]]) for p in range(start + 1, len(PROMPT))]
        # SGLang 0.5.23 computes logits from logprob_start_len on: the token AT it has none
        assert got[0][0] is None and [x[0] for x in got[1:]] == pytest.approx(exp, abs=1e-4)
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    refused(served, {"return_logprob": True, "logprob_start_len": 99}, "logprob_start_len", top=True)


def g_top_logprobs_num(served):
    out = gen(served, GREEDY, return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
    m = out["meta_info"]
    lp = torch.log_softmax(hf_logits(served, PROMPT + out["output_ids"]), -1)
    assert len(m["output_top_logprobs"]) == 12
    for i, row in enumerate(m["output_top_logprobs"]):
        v, ix = torch.topk(lp[len(PROMPT) - 1 + i], 3)
        assert [x[1] for x in row] == ix.tolist() and row[0][1] == out["output_ids"][i]
        assert [x[0] for x in row] == pytest.approx(v.tolist(), abs=1e-4)
    assert m["input_top_logprobs"][0] is None and len(m["input_top_logprobs"]) == len(PROMPT)
    v, ix = torch.topk(lp[0], 3)
    assert [x[1] for x in m["input_top_logprobs"][1]] == ix.tolist()


def g_token_ids_logprob(served):
    out = gen(served, GREEDY, return_logprob=True, token_ids_logprob=[5, 9])
    lp = torch.log_softmax(hf_logits(served, PROMPT + out["output_ids"]), -1)
    rows = out["meta_info"]["output_token_ids_logprobs"]
    assert len(rows) == 12
    for i, row in enumerate(rows):
        assert [x[1] for x in row] == [5, 9]
        assert [x[0] for x in row] == pytest.approx(lp[len(PROMPT) - 1 + i, [5, 9]].tolist(), abs=1e-4)


def g_return_text_in_logprobs(served):
    out = gen(served, GREEDY, return_logprob=True, return_text_in_logprobs=True, top_logprobs_num=2)
    m = out["meta_info"]
    assert [x[2] for x in m["output_token_logprobs"]] == [served.tokenizer.decode([t]) for t in out["output_ids"]]
    assert all(e[2] == served.tokenizer.decode([e[1]]) for row in m["output_top_logprobs"] for e in row)


def g_return_sampling_mask(served):
    out = gen(served, GREEDY, return_sampling_mask=True)
    assert out["meta_info"]["output_token_sampling_mask"] == [[t] for t in out["output_ids"]]


def g_sampling_logprobs_mode(served):
    out = gen(served, {"temperature": 1.0, "top_k": 2, "max_new_tokens": 3, "ignore_eos": True},
              return_sampling_mask=True, sampling_logprobs_mode="support")
    rows = out["meta_info"]["output_token_sampling_logprobs"]
    assert all(len(r) == 2 and sum(torch.tensor(r).exp().tolist()) == pytest.approx(1.0) for r in rows)
    refused(served, {"sampling_logprobs_mode": "support"}, "sampling_logprobs_mode", top=True)


def g_stream(served):
    assert gen(served, GREEDY, stream=False)["meta_info"]["completion_tokens"] == 12
    refused(served, {"stream": True}, "stream", top=True)


def g_noop_flag(name):
    def check(served):  # no per-request metrics or logs here: both values honoured
        for v in (True, False):
            assert gen(served, GREEDY, **{name: v})["output_ids"] == hf_greedy(served, 12)
    return check


def g_return_routed_experts(served):
    import base64

    import numpy as np

    out = gen(served, {**GREEDY, "max_new_tokens": 4}, return_routed_experts=True)
    m = out["meta_info"]
    assert m["routed_experts_shape"] == [len(PROMPT) + 3, 2, 2]
    arr = np.frombuffer(base64.b64decode(m["routed_experts"]), dtype=np.int32).reshape(m["routed_experts_shape"])
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, i, o: got.append(o[2].clone()))
             for layer in served.model.model.layers]
    with torch.no_grad():
        served.model(torch.tensor([(PROMPT + out["output_ids"])[:-1]]))
    for h in hooks:
        h.remove()
    np.testing.assert_array_equal(arr, torch.stack(got, dim=1).numpy())
    return arr


def g_routed_experts_start_len(served):
    import base64

    import numpy as np

    full = g_return_routed_experts(served)
    out = gen(served, {**GREEDY, "max_new_tokens": 4}, return_routed_experts=True, routed_experts_start_len=3)
    m = out["meta_info"]
    arr = np.frombuffer(base64.b64decode(m["routed_experts"]), dtype=np.int32).reshape(m["routed_experts_shape"])
    np.testing.assert_array_equal(arr, full[3:])
    refused(served, {"return_routed_experts": True, "routed_experts_start_len": len(PROMPT) + 1},
            "routed_experts_start_len", top=True)


def g_return_prompt_token_ids(served):
    assert gen(served, GREEDY, return_prompt_token_ids=True)["prompt_token_ids"] == PROMPT
    assert "prompt_token_ids" not in gen(served, GREEDY)


def g_lora_path(served):
    """The name of a loaded LoRA adapter (tests/engines/test_embedded_lora.py runs them against
    peft); here: null is the base model, and a name that is not loaded is a 400 naming it."""
    assert gen(served, GREEDY, lora_path=None)["output_ids"] == gen(served, GREEDY)["output_ids"]
    out = post(served, {"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "nope"}, status=400)
    assert "lora_path" in json.dumps(out) and "nope" in json.dumps(out)


GEN = {
    "lora_path": g_lora_path,
    "rid": g_rid, "text": g_text, "input_ids": g_input_ids, "sampling_params": g_sampling_params,
    "return_logprob": g_return_logprob, "logprob_start_len": g_logprob_start_len,
    "top_logprobs_num": g_top_logprobs_num, "token_ids_logprob": g_token_ids_logprob,
    "return_text_in_logprobs": g_return_text_in_logprobs, "return_sampling_mask": g_return_sampling_mask,
    "sampling_logprobs_mode": g_sampling_logprobs_mode, "stream": g_stream,
    "log_metrics": g_noop_flag("log_metrics"), "no_logs": g_noop_flag("no_logs"),
    "return_routed_experts": g_return_routed_experts, "routed_experts_start_len": g_routed_experts_start_len,
    "return_prompt_token_ids": g_return_prompt_token_ids,
}
_BAD = {  # a non-default value for each refused field
    "use_audio_in_video": True, "return_flat_raw_top_logprobs": True,
    "return_flat_raw_output_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True,
    "return_hidden_states": True, "return_indexer_topk": True, "background": True,
    "require_reasoning": True, "return_bytes": True, "return_entropy": True,
    "bootstrap_port": 8998, "bootstrap_room": 1, "decode_tp_size": 2, "routed_dp_rank": 0,
    "data_parallel_rank": 0, "disagg_prefill_dp_rank": 0, "max_thinking_tokens": 8, "priority": 1,
    "max_dynamic_patch": 4, "min_dynamic_patch": 1, "image_max_dynamic_patch": 4,
    "video_max_dynamic_patch": 4, "received_time": 1.0, "need_wait_for_mm_inputs": True,
    "input_embeds": [[0.0] * 4], "session_params": {"id": "s"}, "video_config": {"fps": 1},
    "custom_labels": {"a": "b"}, "external_trace_header": {"t": "x"}, "images_config": {"a": 1},
    "mm_processor_kwargs": {"a": 1}, "num_items_assigned": {"image": [1]}, "kv_hints": {"v": 1},
    "multi_item_delimiter_indices": [1], "token_indices_to_pool": [1], "mm_hashes": ["ab"],
    "mm_content_hashes": ["sha256:" + "0" * 64], "modalities": ["image"], "encoder_urls": ["http://e"],
}


def _gen_fields():
    return [] if io is None else [f.name for f in dataclasses.fields(io.GenerateReqInput)]


@pytest.mark.parametrize("name", _gen_fields())
def test_generate_field(served, name):
    from moe_async.engines.embedded.request import REFUSED

    if name in GEN:
        return GEN[name](served)
    assert name in REFUSED, f"GenerateReqInput.{name} (SGLang 0.5.23) is neither honoured nor refused"
    err = refused(served, {name: _BAD.get(name, "x")}, name, top=True)
    assert "not supported by the embedded engine" in err
    default = next(f for f in dataclasses.fields(io.GenerateReqInput) if f.name == name).default
    default = None if default is dataclasses.MISSING else default
    assert gen(served, {**GREEDY, "max_new_tokens": 1}, **{name: default})["meta_info"]["completion_tokens"] == 1


def test_unknown_top_level_field_refused(served):
    err = refused(served, {"max_tokens": 8}, "max_tokens", top=True)
    assert "unknown field `max_tokens`" in err


def test_tables_cover_sglang_exactly():
    """Our decoder's tables list exactly SGLang 0.5.23's fields (no stale, no missing)."""
    from moe_async.engines.embedded import request, sampling

    assert set(request.FIELDS) == set(_gen_fields())
    assert set(sampling.FIELDS) == set(api_types.SamplingParams.__struct_fields__)
    assert list(sampling.FIELDS) == list(api_types.SamplingParams.__struct_fields__)  # message order


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_client_gone_before_its_body_leaves_no_traceback(served, route):
    """A client that closes its connection before sending the whole body (a run stopping with
    requests on the wire) is not an error of the engine: nothing is written to its log (before,
    uvicorn's ``Exception in ASGI application`` with starlette's ``ClientDisconnect``), and the
    engine answers the next request."""
    import socket
    import time
    from urllib.parse import urlparse

    u = urlparse(served.url)
    with open(served.log_path, "rb") as f:
        start = len(f.read())
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(f"POST {route} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 1000\r\n\r\n{{\"text\": \"hi".encode())
        time.sleep(0.5)  # the server reads the headers and waits for the rest of the body
    time.sleep(1.0)
    r = httpx.post(served.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200 and "text" in r.json()
    with open(served.log_path, "rb") as f:
        new = f.read()[start:].decode("utf-8", "replace")
    assert "Traceback" not in new and "ClientDisconnect" not in new, new[-3000:]
