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

from moe_async.engines.embedded.req import Req
from moe_async.engines.embedded.sampling import SamplingParams
from moe_async.engines.embedded.scheduler import Scheduler

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


def _device_probe_reqs() -> list[Req]:
    """Requests that take every scheduler/sampling path that builds a tensor: a left-padded
    prefill with a row finishing there, penalties, logit bias, min_new_tokens over EOS and
    stop ids, top-k/top-p/min-p sampling with a seed and its sampling mask, top-k and
    asked-id logprobs of prompt and output, routed experts, a batched decode with padding
    and per-row temperatures, rows leaving the batch, a prompt-only scoring call."""
    sampled = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, max_new_tokens=8,
                             min_new_tokens=3, frequency_penalty=0.5, presence_penalty=0.3,
                             repetition_penalty=1.2, logit_bias={7: 2.0, 9: -1.0}, stop_token_ids=[11],
                             sampling_seed=3)
    return [
        Req(input_ids=_prompt(4, 41), params=sampled, return_logprob=True, logprob_start_len=0,
            top_logprobs_num=3, token_ids_logprob=[4, 9], return_routed_experts=True, return_sampling_mask=True),
        Req(input_ids=_prompt(9, 42), params=_greedy(6), return_logprob=True, logprob_start_len=2,
            top_logprobs_num=2, token_ids_logprob=[3]),
        Req(input_ids=_prompt(6, 43), params=SamplingParams(temperature=1.3, max_new_tokens=3, ignore_eos=True,
                                                             sampling_seed=5)),
        Req(input_ids=_prompt(7, 44), params=_greedy(1)),  # finishes at prefill
        Req(input_ids=_prompt(5, 45), params=SamplingParams(max_new_tokens=0), return_logprob=True,
            logprob_start_len=0, return_routed_experts=True),  # scoring: prompt only
    ]


def _drive(sched: Scheduler, reqs: list[Req], default_device: str | None) -> list[dict]:
    """Run ``reqs`` to completion on this thread (no scheduler thread) with torch's default
    device set to ``default_device`` (thread-local) while the scheduler works."""
    futs = [sched.submit(r) for r in reqs]
    if default_device:
        torch.set_default_device(default_device)
    try:
        while sched.waiting or sched.running:
            sched._admit()
            if sched.running:
                sched._decode_step()
    finally:
        torch.set_default_device(None)
    return [f.result(timeout=0) for f in futs]


def test_no_tensor_is_made_off_the_models_device(model):
    """Every tensor the scheduler and the sampler build (input ids, masks, positions, pads,
    row selections, temperatures, penalty counts, stop ids, logit bias, asked ids) is made on
    the model's device. Run with torch's default device set to ``meta``: a factory call
    without ``device=`` makes a meta tensor, which fails against the CPU model or corrupts
    the result; so the outputs must equal those of the same requests run normally, none
    aborted."""
    def fresh():
        return Scheduler(model, context_length=128, max_running_requests=8, eos_token_ids={2})

    assert fresh().device == next(model.parameters()).device
    want = _drive(fresh(), _device_probe_reqs(), None)
    got = _drive(fresh(), _device_probe_reqs(), "meta")

    def strip(o):
        return {**o, "meta_info": {k: v for k, v in o["meta_info"].items() if k not in ("id", "e2e_latency")}}

    assert [o["meta_info"]["finish_reason"]["type"] for o in got] == ["length"] * 5
    assert [len(o["output_ids"]) for o in got] == [8, 6, 3, 1, 0]
    assert "output_token_sampling_mask" in got[0]["meta_info"] and "input_token_ids_logprobs" in got[1]["meta_info"]
    assert [strip(o) for o in got] == [strip(o) for o in want]


def test_every_tensor_factory_call_names_its_device():
    """A static complement (it also covers ``torch.Generator``, which the default device does
    not reach): each tensor factory or generator made in the scheduler and the sampler passes
    ``device=``."""
    import ast
    import inspect

    from moe_async.engines.embedded import sampling, scheduler

    factories = {"tensor", "zeros", "ones", "full", "arange", "empty", "Generator", "rand", "randn",
                 "randint", "linspace", "eye"}
    seen, missing = 0, []
    for mod in (scheduler, sampling):
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and node.func.attr in factories):
                seen += 1
                if not any(k.arg == "device" for k in node.keywords):
                    missing.append(f"{mod.__name__}:{node.lineno} torch.{node.func.attr}")
    assert seen >= 15, seen
    assert not missing, missing
