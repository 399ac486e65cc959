"""The embedded engine's scheduler in-process (no server) against a tiny random Mixtral.

Requests waiting together are prefilled in one left-padded forward; their greedy tokens,
output and input logprobs and routed experts must still equal HF's batch-1 values. The
cached transposed LM head must follow a weight write made through ``Scheduler.call``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moe_async.engines.embedded.scheduler import Req, SamplingParams, Scheduler

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128, sliding_window=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return MixtralForCausalLM(cfg).eval()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _hf_greedy(model, prompt, max_new):
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
        )[0, len(prompt):].tolist()


def _hf_logprobs_and_routing(model, ids):
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: got.append(o[2].clone()))
             for layer in model.model.layers]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for h in hooks:
        h.remove()
    return lp, torch.stack(got, dim=1).numpy()


def _run(sched, reqs):
    futs = [sched.submit(r) for r in reqs]
    return [f.result(timeout=120) for f in futs]


def _greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def test_batched_prefill_matches_hf(model):
    sched = Scheduler(model, context_length=128, max_running_requests=8, eos_token_ids={2})
    prompts = [_prompt(5, 1), _prompt(19, 2), _prompt(11, 3), _prompt(19, 4), _prompt(2, 5)]
    max_new = [12, 7, 1, 9, 12]  # 1: finishes at prefill, the rest leave the batch at different steps
    reqs = [
        Req(input_ids=p, params=_greedy(m), return_logprob=True, logprob_start_len=0 if i % 2 else -1,
            return_routed_experts=i != 3)
        for i, (p, m) in enumerate(zip(prompts, max_new))
    ]
    futs = [sched.submit(r) for r in reqs]  # all waiting before the thread starts
    sched.start()
    try:
        outs = [f.result(timeout=120) for f in futs]
        assert sched.stats["prefill_forwards"] == 1 and sched.stats["prefill_reqs"] == len(reqs)
        assert sched.max_decode_batch == len(reqs) - 1
        for i, (p, m, o) in enumerate(zip(prompts, max_new, outs)):
            assert o["output_ids"] == _hf_greedy(model, p, m), i
            full = p + o["output_ids"]
            lp, routing = _hf_logprobs_and_routing(model, full[:-1] if len(full) > 1 else full)
            meta = o["meta_info"]
            got = [x[0] for x in meta["output_token_logprobs"]]
            exp = [float(lp[len(p) - 1 + j, t]) for j, t in enumerate(o["output_ids"])]
            np.testing.assert_allclose(got, exp, atol=1e-4, rtol=0)
            if i % 2:
                inp = meta["input_token_logprobs"]
                assert [t for _, t, _ in inp] == p and inp[0][0] is None
                np.testing.assert_allclose([x[0] for x in inp[1:]],
                                           [float(lp[j - 1, p[j]]) for j in range(1, len(p))],
                                           atol=1e-4, rtol=0)
            if i != 3:
                arr = np.frombuffer(__import__("base64").b64decode(meta["routed_experts"]), np.int32)
                arr = arr.reshape(meta["routed_experts_shape"])
                assert arr.shape == (len(full) - 1, 2, 2)
                np.testing.assert_array_equal(arr, routing)
            else:
                assert "routed_experts" not in meta
        # a second wave joins a running batch: prefilled together, KV joined, same tokens
        late = [Req(input_ids=_prompt(7, 6), params=_greedy(20)),
                Req(input_ids=_prompt(3, 7), params=_greedy(6)),
                Req(input_ids=_prompt(13, 8), params=_greedy(6))]
        outs = _run(sched, late)
        for r, o in zip(late, outs):
            assert o["output_ids"] == _hf_greedy(model, r.input_ids, r.params.max_new_tokens)
    finally:
        sched.stop()


def test_lm_head_cache_follows_weight_writes(model):
    sched = Scheduler(model, context_length=128, max_running_requests=8, eos_token_ids={2})
    assert sched.head.enabled
    sched.start()
    w = model.lm_head.weight
    saved = w.detach().clone()
    try:
        prompts = [_prompt(6, 11), _prompt(9, 12), _prompt(4, 13), _prompt(8, 14), _prompt(5, 15)]
        before = _run(sched, [Req(input_ids=p, params=_greedy(8)) for p in prompts])

        def write():  # in place through a view of .data, as HFWeightMap.apply does
            w.data[:].copy_(torch.flip(saved, dims=[0]))

        sched.call(write).result(timeout=60)
        after = _run(sched, [Req(input_ids=p, params=_greedy(8)) for p in prompts])
        assert [o["output_ids"] for o in before] != [o["output_ids"] for o in after]
        for p, o in zip(prompts, after):
            assert o["output_ids"] == _hf_greedy(model, p, 8)
    finally:
        sched.stop()
        with torch.no_grad():
            w.copy_(saved)


def test_prefill_token_budget_splits_batches(model):
    sched = Scheduler(model, context_length=128, max_running_requests=8, eos_token_ids={2},
                      max_prefill_tokens=24)
    prompts = [_prompt(5, 21), _prompt(6, 22), _prompt(19, 23), _prompt(11, 24)]
    futs = [sched.submit(Req(input_ids=p, params=_greedy(5))) for p in prompts]
    sched.start()
    try:
        outs = [f.result(timeout=120) for f in futs]
        # [5, 6] (12 padded tokens), [19] (2 x 19 > 24), [11] (2 x 19 > 24 before it)
        assert sched.stats["prefill_forwards"] == 3 and sched.stats["prefill_reqs"] == 4
        for p, o in zip(prompts, outs):
            assert o["output_ids"] == _hf_greedy(model, p, 5)
    finally:
        sched.stop()


def test_identical_prompts_share_one_prefill_row(model):
    """A GRPO group (the same prompt several times) is prefilled as one row: 3 of the 5
    requests below are the same prompt. Each still gets HF's batch-1 greedy tokens, input
    logprobs and routed experts, and a sampled request samples its own tokens (two seeds on
    one shared row differ from each other and equal their own unshared run)."""
    p, q = _prompt(9, 31), _prompt(14, 32)
    sampled = [SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, sampling_seed=s) for s in (1, 2)]
    reqs = [Req(input_ids=p, params=_greedy(6), return_logprob=True, logprob_start_len=0,
                return_routed_experts=True),
            Req(input_ids=q, params=_greedy(6)),
            Req(input_ids=p, params=_greedy(1), return_routed_experts=True),  # finishes at prefill
            Req(input_ids=p, params=sampled[0]),
            Req(input_ids=p, params=sampled[1])]
    sched = Scheduler(model, context_length=128, max_running_requests=8, eos_token_ids={2})
    futs = [sched.submit(r) for r in reqs]  # all waiting before the thread starts: one prefill
    sched.start()
    try:
        outs = [f.result(timeout=120) for f in futs]
        assert sched.stats["prefill_forwards"] == 1 and sched.stats["prefill_shared_reqs"] == 3
        assert outs[0]["output_ids"] == _hf_greedy(model, p, 6)
        assert outs[1]["output_ids"] == _hf_greedy(model, q, 6)
        assert outs[2]["output_ids"] == _hf_greedy(model, p, 1)
        lp, routing = _hf_logprobs_and_routing(model, p + outs[0]["output_ids"][:-1])
        meta = outs[0]["meta_info"]
        np.testing.assert_allclose([x[0] for x in meta["input_token_logprobs"][1:]],
                                   [float(lp[j - 1, p[j]]) for j in range(1, len(p))], atol=1e-4, rtol=0)
        for o, n_routed in ((outs[0], len(p) + 5), (outs[2], len(p))):
            m = o["meta_info"]
            arr = np.frombuffer(__import__("base64").b64decode(m["routed_experts"]), np.int32)
            arr = arr.reshape(m["routed_experts_shape"])
            assert arr.shape[0] == n_routed
            np.testing.assert_array_equal(arr, routing[:n_routed])
        assert outs[3]["output_ids"] != outs[4]["output_ids"]
        alone = _run(sched, [Req(input_ids=p, params=sampled[0])])  # one request: nothing shared
        assert sched.stats["prefill_shared_reqs"] == 3
        assert alone[0]["output_ids"] == outs[3]["output_ids"]
    finally:
        sched.stop()
