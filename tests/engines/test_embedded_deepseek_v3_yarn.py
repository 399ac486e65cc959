"""The embedded engine serves DeepSeek-V3 with the released YaRN ``rope_scaling`` (the tiny
checkpoint of tests/models/_deepseek_v3_yarn_checks.py: config.json in the release's form,
factor 40, mscale = mscale_all_dim = 1): greedy tokens equal transformers', logprobs within
1e-4 of transformers' YaRN model and far from the same weights with plain RoPE (so an engine
that dropped the scaling would fail)."""

from __future__ import annotations

import os
import sys

import httpx
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

PROMPT = [5, 17, 99, 3, 250, 41, 7, 120, 64, 33]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from _deepseek_v3_yarn_checks import make_yarn_checkpoint
    from transformers import AutoModelForCausalLM

    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig

    d = make_yarn_checkpoint(str(tmp_path_factory.mktemp("dsv3_yarn")))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    eng = make_engine(EngineConfig(startup_timeout_s=180, num_threads=1, max_running_requests=4), d, 0)
    eng.launch()
    try:
        yield eng.url, model, d
    finally:
        eng.shutdown()


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_greedy_logprobs_match_transformers_yarn(served):
    from transformers import AutoConfig, AutoModelForCausalLM

    url, model, d = served
    assert model.config.rope_parameters["rope_type"] == "yarn"
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12)[0, len(PROMPT):].tolist()
    r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    ids, lps = r.json()["output_ids"], [x[0] for x in r.json()["meta_info"]["output_token_logprobs"]]
    assert ids == ref
    lp = _logprobs(model, PROMPT + ids)
    want = [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(ids)]
    assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-4
    cfg = AutoConfig.from_pretrained(d)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = _logprobs(AutoModelForCausalLM.from_pretrained(d, config=cfg).eval(), PROMPT + ids)
    other = [float(plain[len(PROMPT) - 1 + i, t]) for i, t in enumerate(ids)]
    assert max(abs(a - b) for a, b in zip(lps, other)) > 1e-2  # YaRN is live in the engine
