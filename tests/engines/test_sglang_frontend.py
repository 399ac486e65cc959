"""SGLang 0.5.23's frontend (``sglang.lang``: ``RuntimeEndpoint``, ``gen``, ``gen(stop=)``,
``select``) running a program against the embedded engine; every value is recomputed greedily
with transformers on the same weights (a tiny random Mixtral, SmolLM2 tokenizer). ``select``
scores each choice with a ``max_new_tokens: 0`` / ``return_logprob`` / ``logprob_start_len``
call and reads ``input_token_logprobs`` (with token texts) -- the scoring path of C17."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from _sglang_import import load_io_struct

try:
    load_io_struct()
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint, compute_normalized_prompt_logprobs
except ImportError as e:  # pragma: no cover - depends on the environment
    sgl, IMPORT_ERROR = None, str(e)

pytestmark = pytest.mark.skipif(sgl is None, reason="sglang frontend unavailable")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def served(tiny_chat_engine):
    """The shared tiny chat engine (conftest.py)."""
    return tiny_chat_engine


def _lp(served, ids):
    with torch.no_grad():
        return torch.log_softmax(served.model(torch.tensor([ids])).logits[0].float(), -1)


def _greedy_text(served, text, n):
    tok = served.tokenizer
    ids = tok(text)["input_ids"]
    out = []
    for _ in range(n):
        t = int(_lp(served, ids + out)[-1].argmax())
        out.append(t)
        if t == tok.eos_token_id:
            break
    return tok.decode(out, skip_special_tokens=True)


def _select_reference(served, text, choices):
    """RuntimeEndpoint.select's decision, from transformers' logprobs instead of the engine's."""
    tok = served.tokenizer
    start = max(len(tok(text)["input_ids"]) - 2, 0)
    norms, itls = [], []
    for c in choices:
        ids = tok(text + c)["input_ids"]
        lp = _lp(served, ids)
        # SGLang 0.5.23 gives the token AT logprob_start_len no logprob (null)
        itl = [[None if p == start else float(lp[p - 1, ids[p]]), ids[p], tok.decode([ids[p]])]
               for p in range(start, len(ids))]
        norm = compute_normalized_prompt_logprobs(itl)
        if text.endswith(itl[0][-1]):
            norm = (norm * len(itl) - itl[0][0]) / (len(itl) - 1)
            itl = itl[1:]
        norms.append(norm)
        itls.append(itl)
    return choices[int(np.argmax(norms))], norms, itls


def test_program_gen_stop_select_matches_transformers(served):
    backend = RuntimeEndpoint(served.url)
    assert backend.get_model_name() == served.model_dir
    head = "The weather today is"
    a_ref = _greedy_text(served, head, 8)
    b_full = _greedy_text(served, head + a_ref + " and", 16)
    stop = next(b_full[i:i + 3] for i in range(len(b_full) // 3, len(b_full) - 3)
                if b_full[i:i + 3].strip() and b_full.find(b_full[i:i + 3]) == i)
    b_ref = b_full[: b_full.find(stop)]
    choices = ["yes", "no", "maybe not"]

    @sgl.function
    def prog(s):
        s += head
        s += sgl.gen("a", max_tokens=8, temperature=0)
        s += " and"
        s += sgl.gen("b", max_tokens=16, stop=stop, temperature=0)
        s += " Answer:"
        s += sgl.select("c", choices=choices, temperature=0)

    state = prog.run(backend=backend)
    assert state["a"] == a_ref
    assert state["b"] == b_ref and len(b_ref) < len(b_full)
    decision, norms, itls = _select_reference(served, head + a_ref + " and" + b_ref + " Answer:", choices)
    meta = state.get_meta_info("c")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(norms, abs=1e-4)
    assert len(set(round(x, 3) for x in norms)) == 3  # the choices score differently
    for got, exp in zip(meta["input_token_logprobs"], itls):
        assert [x[1:] for x in got] == [x[1:] for x in exp]
        assert [x[0] for x in got] == pytest.approx([x[0] for x in exp], abs=1e-4)
    assert state["c"] == decision
