"""The embedded engine serves DeepSeek-V3 (every family the trainer supports): a tiny random
deepseek_v3 (MLA, first layer dense, 8 routed experts top-4 in groups, a shared expert, a
non-zero ``e_score_correction_bias``) as a real server process. Greedy tokens and logprobs
equal transformers; routed experts equal the HF router's group-limited top-k; every tensor of
the checkpoint (the router bias buffer included: the trainer syncs it) is a weight name of
the engine, and an update from disk of the bias alone changes the routing as transformers'
does."""

from __future__ import annotations

import base64
import os
import sys

import httpx
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3
    from transformers import AutoModelForCausalLM

    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig

    d = str(tmp_path_factory.mktemp("dsv3"))
    make_tiny_deepseek_v3(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    eng = make_engine(EngineConfig(startup_timeout_s=180, num_threads=1, max_running_requests=4), d, 0)
    eng.launch()
    try:
        yield eng.url, model, d
    finally:
        eng.shutdown()


def _hf(model, ids):
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: got.append(o[2].clone()))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for h in hooks:
        h.remove()
    return lp, torch.stack(got, dim=1).numpy()


def _gen(url, n=8):
    r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "return_logprob": True, "return_routed_experts": True,
                                           "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                               "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    m = r.json()["meta_info"]
    routed = np.frombuffer(base64.b64decode(m["routed_experts"]), dtype=np.int32).reshape(m["routed_experts_shape"])
    return r.json()["output_ids"], [x[0] for x in m["output_token_logprobs"]], routed


def test_greedy_logprobs_and_routing_match_transformers(served):
    url, model, _ = served
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8)[0, len(PROMPT):].tolist()
    ids, lps, routed = _gen(url)
    assert ids == ref
    lp, hf_routed = _hf(model, PROMPT + ids)
    assert lps == pytest.approx([float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(ids)], abs=1e-4)
    assert routed.shape == (len(PROMPT) + 7, 2, 4)  # 2 MoE layers (the first is dense), top-4
    np.testing.assert_array_equal(np.sort(routed, -1), np.sort(hf_routed[:-1], -1))
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["model_type"] == "deepseek_v3" and info["num_moe_layers"] == 2 and info["moe_top_k"] == 4


def test_every_checkpoint_tensor_is_an_engine_weight_and_bias_updates_route(served, tmp_path):
    from safetensors.torch import load_file, save_file

    url, model, d = served
    disk = load_file(os.path.join(d, "model.safetensors"))
    layout = httpx.get(f"{url}/weights_layout").json()
    assert set(layout["names"]) == set(disk)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in layout["names"]
    # a new router bias alone (the trainer's aux-loss-free update) moves the engine's routing
    # exactly as it moves transformers'
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    new = torch.randn_like(disk[name]) * 2.0
    save_file({name: new}, str(tmp_path / "model.safetensors"))
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "1"},
                   timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(new)
    ids, _, routed = _gen(url, 4)
    _, hf_routed = _hf(model, PROMPT + ids)
    np.testing.assert_array_equal(np.sort(routed, -1), np.sort(hf_routed[:-1], -1))
    before = _hf_routing_with_bias(model, name, disk[name], PROMPT + ids)
    assert not np.array_equal(np.sort(before, -1), np.sort(hf_routed[:-1], -1))  # the bias mattered


def _hf_routing_with_bias(model, name, bias, ids):
    gate = model.model.layers[1].mlp.gate
    keep = gate.e_score_correction_bias.clone()
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(bias)
    try:
        return _hf(model, ids)[1][:-1]
    finally:
        with torch.no_grad():
            gate.e_score_correction_bias.copy_(keep)
