"""The embedded engine as a real server process on loopback, against a tiny random Mixtral.

Checks values that would be wrong if the engine were: greedy tokens equal HF
``generate``; logprobs equal HF ``log_softmax``; routed experts equal HF's router top-k;
context-length refusals (SGLang's 400s) and clipping; abort/in_place pauses; weight updates over gloo land bit-exactly
(checksums equal the sender's) and atomically (staged until the versioned call).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from moe_async.engines.base import EmbeddedEngine, make_engine
from moe_async.models.checksum import tensor_checksum
from moe_async.engines.client import EngineClient, EngineRequestError, SyncEngineClient
from moe_async.engines.config import EngineConfig
from moe_async.weight_sync.bucket import make_buckets
from moe_async.weight_sync.group import bind_master_store, create_update_group, group_broadcast

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

CTX = 64


def _tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=CTX, sliding_window=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return MixtralForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_mixtral")
    model = _tiny_mixtral()
    model.save_pretrained(model_dir)
    # engine.device given explicitly (the default is the same): the HF parity below holds with it
    cfg = EngineConfig(startup_timeout_s=120, num_threads=1, max_running_requests=16, device="cpu")
    eng = make_engine(cfg, str(model_dir), 0)
    assert isinstance(eng, EmbeddedEngine)
    eng.launch()
    try:
        yield eng, model_dir, model
    finally:
        eng.shutdown()
    assert not eng.alive


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _hf_routing(model, ids: list[int]) -> np.ndarray:
    """Router top-k of every position of ``ids`` under ``model``: [S, L, K]."""
    got = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: got.append(o[2].clone()))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(got, dim=1).numpy()


def _check_against_hf(model, prompt, out, max_new):
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new,
        )[0, len(prompt):].tolist()
    assert out.output_ids == ref
    full = prompt + out.output_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)
    exp = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out.output_ids)]
    np.testing.assert_allclose(out.output_logprobs, exp, atol=1e-4, rtol=0)
    assert out.routed_experts.shape == (len(full) - 1, 2, 2)
    np.testing.assert_array_equal(out.routed_experts, _hf_routing(model, full[:-1]))


def test_greedy_concurrent_matches_hf(engine):
    eng, _, model = engine
    prompts = [_prompt(5, 1), _prompt(19, 2)]

    async def run():
        async with EngineClient(eng.url, timeout_s=60) as c:
            assert await c.health()
            return await asyncio.gather(*[
                c.generate(p, {"temperature": 0.0, "max_new_tokens": 12}, return_routed_experts=True)
                for p in prompts
            ])

    outs = asyncio.run(run())
    info = httpx.get(f"{eng.url}/get_server_info").json()
    assert info["max_decode_batch_size"] >= 2 and info["device"] == "cpu"
    for p, o in zip(prompts, outs):
        assert o.prompt_tokens == len(p)
        assert o.weight_version == 0 and o.output_token_weight_versions == [0] * len(o.output_ids)
        _check_against_hf(model, p, o, 12)


def test_set_num_threads_takes_effect_on_the_forward_thread(engine):
    """``/set_num_threads``: the count in effect on the scheduler thread (where forwards run)
    follows the call both ways; greedy answers on 2 threads still equal HF's; 0 is a 422."""
    eng, _, model = engine
    p = _prompt(7, 3)
    with SyncEngineClient(eng.url, timeout_s=60) as c:
        assert c.set_num_threads(2) == 2
        _check_against_hf(model, p, c.generate(p, {"temperature": 0.0, "max_new_tokens": 8},
                                               return_routed_experts=True), 8)
        assert c.set_num_threads(1) == 1
        r = httpx.post(f"{eng.url}/set_num_threads", json={"num_threads": 0})
        assert r.status_code == 422 and "num_threads" in r.text


def test_batch_input_and_sampling(engine):
    eng, _, _ = engine
    body = {
        "input_ids": [_prompt(4, 3), _prompt(7, 4)],
        "sampling_params": {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5,
                            "ignore_eos": True, "sampling_seed": 7},
        "return_logprob": True,
    }
    r1 = httpx.post(f"{eng.url}/generate", json=body, timeout=30).json()
    r2 = httpx.post(f"{eng.url}/generate", json=body, timeout=30).json()
    assert isinstance(r1, list) and len(r1) == 2
    assert [x["output_ids"] for x in r1] == [x["output_ids"] for x in r2]  # seeded
    for x in r1:
        assert len(x["output_ids"]) == 5
        assert [t for _, t, _ in x["meta_info"]["output_token_logprobs"]] == x["output_ids"]


def test_context_length_refusals_and_default_clip(engine):
    """As SGLang 0.5.23 (no --allow-auto-truncate): prompt >= context and an explicit
    prompt + max_new_tokens > context are 400s naming the lengths, with SGLang's wording; the
    default max_new_tokens (128) is clipped to the room left. Prompts are never cut."""
    eng, _, _ = engine
    url = f"{eng.url}/generate"
    sp = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    for n in (CTX + 3, CTX):
        r = httpx.post(url, json={"input_ids": _prompt(n, n), "sampling_params": sp}, timeout=60)
        assert r.status_code == 400
        assert r.json() == {"error": {"message": f"The input ({n} tokens) is longer than the model's "
                                                 f"context length ({CTX} tokens)."}}
    r = httpx.post(url, json={"input_ids": _prompt(CTX - 1, 1), "sampling_params": sp}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"Requested token count exceeds the model's maximum context length of {CTX} tokens. "
        f"You requested a total of {CTX - 1 + 16} tokens: {CTX - 1} tokens from the input messages "
        "and 16 tokens for the completion. Please reduce the number of tokens in the input messages "
        "or the completion to fit within the limit.")
    # a batch with one element too long is refused whole, naming that element's lengths
    r = httpx.post(url, json={"input_ids": [_prompt(8, 2), _prompt(CTX, 3)], "sampling_params": sp}, timeout=60)
    assert r.status_code == 400 and f"The input ({CTX} tokens)" in r.json()["error"]["message"]
    with SyncEngineClient(eng.url, timeout_s=60) as c:
        with pytest.raises(EngineRequestError, match=rf"HTTP 400: The input \({CTX} tokens\)"):
            c.generate(_prompt(CTX, 4), sp)
        fits = c.generate(_prompt(CTX - 16, 5), sp)  # exactly fills the context: allowed
        assert len(fits.output_ids) == 16 and fits.finish_reason == "length"
        no_budget = {"temperature": 0.0, "ignore_eos": True}  # default 128, clipped to the room
        outs = [c.generate(_prompt(n, n), no_budget) for n in (CTX - 1, CTX - 7)]
        assert [len(o.output_ids) for o in outs] == [1, 7]
        assert [o.finish_reason for o in outs] == ["length"] * 2
        assert [o.prompt_tokens for o in outs] == [CTX - 1, CTX - 7]  # never truncated
        with pytest.raises(EngineRequestError, match="outside"):
            c.generate([1, 999], sp)
        assert c.health()


def test_pause_abort_and_in_place(engine):
    eng, _, _ = engine
    c = SyncEngineClient(eng.url, timeout_s=60)
    sp = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    httpx.post(f"{eng.url}/slow_down", json={"forward_sleep_time": 0.05})
    try:
        res = {}
        t = threading.Thread(target=lambda: res.setdefault("a", c.generate(_prompt(4, 5), sp)))
        t.start()
        time.sleep(0.6)
        c.pause_generation("abort")
        t.join(10)
        out = res["a"]
        assert out.finish_reason == "abort"
        assert 0 < len(out.output_ids) < 40 and len(out.output_logprobs) == len(out.output_ids)
        # paused: a new request waits until continue_generation
        t2 = threading.Thread(target=lambda: res.setdefault("b", c.generate(_prompt(4, 6), sp)))
        t2.start()
        time.sleep(0.3)
        assert "b" not in res
        c.continue_generation()
        time.sleep(0.6)
        c.pause_generation("in_place")  # freezes b mid-decode, keeps its KV
        time.sleep(0.3)
        assert "b" not in res
        assert not c.flush_cache()  # refused with requests in flight, as SGLang does
        c.continue_generation()
        t2.join(20)
        b = res["b"]
        assert b.finish_reason == "length" and len(b.output_ids) == 40
    finally:
        httpx.post(f"{eng.url}/slow_down", json={"forward_sleep_time": None})
        c.close()
    with SyncEngineClient(eng.url, timeout_s=60) as c2:  # paused decode resumed the same tokens
        ref = c2.generate(_prompt(4, 6), sp)
        assert ref.output_ids == b.output_ids
        np.testing.assert_allclose(ref.output_logprobs, b.output_logprobs, atol=1e-5)
        assert c2.flush_cache()
    # retract: KV dropped, the request re-prefills prompt + outputs on continue, same tokens
    c3 = SyncEngineClient(eng.url, timeout_s=60)
    httpx.post(f"{eng.url}/slow_down", json={"forward_sleep_time": 0.05})
    try:
        t3 = threading.Thread(target=lambda: res.setdefault("c", c3.generate(_prompt(4, 6), sp)))
        t3.start()
        time.sleep(0.6)
        c3.pause_generation("retract")
        time.sleep(0.2)
        assert "c" not in res
        c3.continue_generation()
        t3.join(20)
    finally:
        httpx.post(f"{eng.url}/slow_down", json={"forward_sleep_time": None})
        c3.close()
    assert res["c"].output_ids == ref.output_ids
    np.testing.assert_allclose(res["c"].output_logprobs, ref.output_logprobs, atol=1e-4)


def _send(client, group, bucket, version=None):
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("r", _call(client, bucket, version)))
    th.start()
    group_broadcast(group, bucket.flatten(), src=0)
    th.join(60)
    return res["r"]


def _call(client, bucket, version):
    try:
        return client.update_weights_from_distributed(
            bucket.names, bucket.dtypes, bucket.shapes, group_name="wu", weight_version=version,
            load_format="flattened_bucket",
        )
    except EngineRequestError as e:
        return e


def test_weight_update_over_gloo(engine):
    eng, model_dir, model = engine
    from safetensors import safe_open

    from moe_async.engines.embedded.weights import HFWeightMap

    c = SyncEngineClient(eng.url, timeout_s=60)
    # engine's HF names and initial checksums equal the checkpoint on disk
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        disk = {n: f.get_tensor(n) for n in f.keys()}
    init = c.weights_checksum()
    assert init["weight_version"] == 0  # "0" on the wire (SGLang types it str), parsed by the client
    assert init["checksums"] == {n: tensor_checksum(t) for n, t in disk.items()}

    store = bind_master_store("127.0.0.1", 2, 60)
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("r", c.init_weights_update_group(
        "127.0.0.1", store.port, rank_offset=1, world_size=2, group_name="wu", backend="gloo")))
    th.start()
    group, _ = create_update_group(backend="gloo", world_size=2, rank=0, group_name="wu", timeout_s=60,
                                   store=store)
    th.join(60)
    assert res["r"]["success"], res["r"]
    assert c.begin_weight_update(atomic=True)["success"]  # one atomic session: staged until versioned

    names = sorted(disk)
    largest = max(t.numel() * 4 for t in disk.values())
    g = torch.Generator().manual_seed(123)
    for version, bucket_bytes in enumerate([1, largest - 1, 1 << 30], start=1):
        new = {n: torch.randn(disk[n].shape, generator=g) * 0.05 for n in names}
        buckets = list(make_buckets([(n, new[n]) for n in names], bucket_bytes))
        if bucket_bytes == 1:
            assert all(len(b.names) == 1 for b in buckets)
        elif version == 2:
            assert any(len(b.names) > 1 for b in buckets) and any(b.nbytes > bucket_bytes for b in buckets)
        else:
            assert len(buckets) == 1
        for i, b in enumerate(buckets):
            last = i == len(buckets) - 1
            r = _send(c, group, b, version if last else None)
            assert not isinstance(r, Exception) and r["success"], r
            if i == 0 and not last:  # staged only: nothing visible yet
                assert c.get_weight_version() == version - 1
        got = c.weights_checksum()
        assert got["weight_version"] == version
        assert got["checksums"] == {n: tensor_checksum(t) for n, t in new.items()}

    # an unknown name / wrong shape is a 400 naming it; the staged update is discarded
    bad = next(make_buckets([("model.layers.0.block_sparse_moe.experts.9.w1.weight", torch.zeros(4))], 1))
    r = _send(c, group, bad, 99)
    assert isinstance(r, EngineRequestError) and r.status_code == 400 and "experts.9.w1" in r.message
    n0 = names[0]
    bad = next(make_buckets([(n0, torch.zeros(3, 3))], 1))
    r = _send(c, group, bad, 99)
    assert isinstance(r, EngineRequestError) and "shape mismatch" in r.message and n0 in r.message
    assert c.get_weight_version() == 3
    assert c.weights_checksum()["checksums"] == got["checksums"]

    # generation now runs on the new weights: parity with HF holding the same tensors
    HFWeightMap(model).apply(new)
    out = c.generate(_prompt(9, 8), {"temperature": 0.0, "max_new_tokens": 6}, return_routed_experts=True)
    assert out.weight_version == 3 and out.output_token_weight_versions == [3] * len(out.output_ids)
    _check_against_hf(model, _prompt(9, 8), out, 6)
    assert c.end_weight_update()["success"]
    c.destroy_weights_update_group("wu")
    from moe_async.weight_sync.group import destroy_update_group

    destroy_update_group(group)
    c.close()


def test_sampling_mask(engine):
    """Per-token sampling support + behaviour logprob (SGLang's return_sampling_mask)."""
    eng, _, model = engine
    prompt = _prompt(6, 11)
    with SyncEngineClient(eng.url, timeout_s=60) as c:
        # greedy and top_k=1: the support is the chosen token, behaviour logprob 0
        for sp in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}):
            o = c.generate(prompt, {**sp, "max_new_tokens": 4, "ignore_eos": True},
                           return_sampling_mask=True)
            assert o.sampling_mask == [[t] for t in o.output_ids]
            assert o.sampling_logprobs == [0.0] * 4
        # top_k=5 at T=0.7: support = the 5 largest logits; logprob renormalised over them
        sp = {"temperature": 0.7, "top_k": 5, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 3}
        o = c.generate(prompt, sp, return_sampling_mask=True)
        full = prompt + o.output_ids
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0].float() / 0.7
        for i, (t, mask, lp) in enumerate(zip(o.output_ids, o.sampling_mask, o.sampling_logprobs)):
            row = logits[len(prompt) - 1 + i]
            top = torch.topk(row, 5)
            assert mask == sorted(top.indices.tolist()) and t in mask
            exp = torch.log_softmax(top.values, -1)[top.indices.tolist().index(t)]
            assert abs(lp - float(exp)) < 1e-4
        s = c.generate(prompt, sp, return_sampling_mask=True, sampling_logprobs_mode="support")
        assert s.output_ids == o.output_ids and s.sampling_mask == o.sampling_mask
        for mask, lps, lp, t in zip(s.sampling_mask, s.sampling_logprobs, o.sampling_logprobs, s.output_ids):
            assert len(lps) == len(mask) and abs(np.logaddexp.reduce(lps)) < 1e-5
            assert abs(lps[mask.index(t)] - lp) < 1e-6
        # top_p=1, no top_k: a no-op truncation: whole vocab, logprob == the plain logprob
        o = c.generate(prompt, {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 3, "sampling_seed": 1,
                                "ignore_eos": True}, return_sampling_mask=True)
        assert all(m == list(range(256)) for m in o.sampling_mask)
        np.testing.assert_allclose(o.sampling_logprobs, o.output_logprobs, atol=1e-5)
        # over the server's cap (--sampling-mask-max-tokens) would abort; unset mode without mask: 400
        r = httpx.post(f"{eng.url}/generate", json={"input_ids": prompt, "sampling_logprobs_mode": "support"})
        assert r.status_code == 400


def test_routed_experts_of_empty_completion(engine):
    """max_new_tokens=0: 0 tokens, finish 'length', routes still cover P-1 rows."""
    eng, _, model = engine
    prompt = _prompt(CTX - 1, 12)
    with SyncEngineClient(eng.url, timeout_s=60) as c:
        o = c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 0}, return_routed_experts=True)
    assert o.output_ids == [] and o.finish_reason == "length" and o.prompt_tokens == CTX - 1
    assert o.routed_experts.shape == (CTX - 2, 2, 2)
    np.testing.assert_array_equal(o.routed_experts, _hf_routing(model, prompt[:-1]))
