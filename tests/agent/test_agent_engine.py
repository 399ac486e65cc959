"""A 3-turn trajectory against a real embedded engine (tiny random Mixtral, SmolLM2's
tokenizer and ChatML template), with a real weight update (gloo broadcast, bucketed) landing
in the middle of turn 2, in each SGLang pause mode: the trained ids are the engine's sampled
ids plus the observation tokens, in order; the mask covers the sampled tokens; logprobs,
per-token versions and routes are the engine's for every sampled token of every turn."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engines"))

from moe_async.agent.builtin import AnswerRetryEnv  # noqa: E402
from moe_async.agent.config import AgentConfig  # noqa: E402
from moe_async.agent.loop import run_trajectory  # noqa: E402
from moe_async.agent.template import ChatRenderer  # noqa: E402
from moe_async.rollout.config import RolloutConfig  # noqa: E402
from moe_async.rollout.manager import RolloutManager  # noqa: E402

MAX_NEW = 16


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory):
    from _tiny_engine import launch_tiny_chat_engine

    with launch_tiny_chat_engine(tmp_path_factory.mktemp("agent_engine")) as e:
        yield e


class Recording:
    """The async engine client, recording each reply (input, ids, logprobs, versions, routes)."""

    def __init__(self, client):
        self.client, self.calls = client, []
        self.base_url, self.timeout_s = client.base_url, client.timeout_s

    async def generate(self, input_ids, sp, **kw):
        out = await self.client.generate(input_ids, sp, **kw)
        self.calls.append((list(input_ids), list(out.output_ids), list(out.output_logprobs),
                           list(out.output_token_weight_versions), out.routed_experts, out.finish_reason))
        return out


def _send_update(eng, model_dir, mode, version, started: threading.Event, errs: list):
    """Wait until turn 2's request is decoding, then broadcast new random weights."""
    from safetensors.torch import load_file

    from moe_async.engines.client import SyncEngineClient
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.transport import BroadcastTransport

    try:
        shapes = {n: t.shape for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
        g = torch.Generator().manual_seed(version)
        weights = [(n, torch.randn(s, generator=g) * 0.05) for n, s in sorted(shapes.items())]
        with SyncEngineClient(eng, timeout_s=120) as client:
            tr = BroadcastTransport([client], WeightSyncConfig(bucket_bytes=1 << 20, backend="gloo", timeout_s=120),
                                    pause_mode=mode)
            tr.connect()
            try:
                started.wait(60)
                end = time.monotonic() + 60
                while httpx.get(f"{eng}/get_server_info").json()["num_requests"] < 1 and time.monotonic() < end:
                    time.sleep(0.02)
                time.sleep(0.25)  # a few tokens of turn 2 at the old version
                tr.send(weights, version)
            finally:
                tr.shutdown()
    except BaseException as e:  # noqa: BLE001
        errs.append(e)


@pytest.mark.parametrize("mode", ["abort", pytest.param("retract", marks=pytest.mark.slow), "in_place"])
def test_weight_update_mid_turn_two(chat_engine, mode):
    from moe_async.engines.client import EngineClient, SyncEngineClient

    tok = chat_engine.tokenizer
    with SyncEngineClient(chat_engine.url, timeout_s=60) as c:
        old = c.get_weight_version()
    new = old + 1
    started, errs = threading.Event(), []
    th = threading.Thread(target=_send_update, args=(chat_engine.url, chat_engine.model_dir, mode, new, started, errs))
    th.start()

    async def main():
        async with EngineClient(chat_engine.url, timeout_s=120) as client:
            eng = Recording(client)
            m = RolloutManager(RolloutConfig(return_routed_experts=True, partial_rollout=True, max_abort_retries=4),
                               None, [eng], None, None, eos_token_ids=[tok.eos_token_id])
            turn_no = iter(range(100))

            async def turn(ids, n):
                if next(turn_no) == 1:
                    started.set()
                return await m._generate_sample(ids, n)

            env = AnswerRetryEnv(extras={"reward_spec": {"ground_truth": "123456789"}})
            s, st = await run_trajectory(env, "answer_retry", [{"role": "user", "content": "What is 2 + 2?"}],
                                         ChatRenderer(tok), turn, AgentConfig(enabled=True, max_turns=3), MAX_NEW,
                                         eos_token_ids=[tok.eos_token_id])
            return s, st, eng.calls

    httpx.post(f"{chat_engine.url}/slow_down", json={"forward_sleep_time": 0.04})
    try:
        s, st, calls = asyncio.run(main())
    finally:
        httpx.post(f"{chat_engine.url}/slow_down", json={"forward_sleep_time": None})
        started.set()
        th.join(180)
    assert not errs, errs
    assert st.turns == 3 and st.template_mismatches == 0 and s.reward == 0.0
    # turns: the engine's replies in order (an aborted turn-2 segment then its continuation)
    assert len(calls) == (4 if mode == "abort" else 3), [(len(c[1]), c[5]) for c in calls]
    sampled = [t for c in calls for t in c[1]]
    assert [t for t, m in zip(s.response_ids, s.loss_mask) if m] == sampled
    assert [lp for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m] == pytest.approx(
        [x for c in calls for x in c[2]], abs=0)
    vs = [v for v, m in zip(s.weight_versions, s.loss_mask) if m]
    assert vs == [v for c in calls for v in c[3]]
    spans = s.metadata["turn_spans"]
    t2 = s.weight_versions[spans[1][0]:spans[1][1]]
    k = t2.index(new)  # the update landed inside turn 2, once
    assert 0 < k and t2 == [old] * k + [new] * (len(t2) - k)
    assert set(s.weight_versions[:spans[0][1]]) == {old}
    assert set(s.weight_versions[spans[2][0]:spans[2][1]]) == {new}
    # observations: the chat template's text, between the turns, masked
    for a, b in s.metadata["obs_spans"]:
        assert tok.decode(s.response_ids[a:b], skip_special_tokens=False).endswith(
            "<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")
        assert set(s.loss_mask[a:b]) == {0}
    # each request was sent the trajectory so far, token for token
    full = s.prompt_ids + s.response_ids
    for inp, out, *_ in calls:
        assert full[:len(inp) + len(out)] == inp + out
    # routes: row j is the one the request that first fed token j returned
    P, R = len(s.prompt_ids), len(s.response_ids)
    r = s.routed_experts
    assert r.shape[0] == P + R - 1
    lo = 0
    for inp, out, _, _, routes, _ in calls:
        hi = len(inp) + len(out) - 1
        np.testing.assert_array_equal(r[lo:hi], np.asarray(routes)[lo:hi])
        lo = hi
