"""The rollout manager with ``rollout.agent``: GRPO groups of G trajectories rewarded by
their environment (answer_retry), a calculator tool called through SGLang's parser, tool
spans on the trace, per-turn metrics, and the greedy eval scoring success within the turn
budget."""

from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engines"))
from _sglang_import import io_struct_or_skip  # noqa: E402

from moe_async.rollout.config import RolloutConfig  # noqa: E402
from moe_async.rollout.manager import RolloutManager  # noqa: E402

_, _, pytestmark = io_struct_or_skip("sglang.srt.function_call.function_call_parser", what="sglang function_call")


@pytest.fixture(scope="module")
def tok():
    from moe_async.models.prepare import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


class TurnEngine:
    """Replies by the number of assistant turns in its input: 1st a calculator call, 2nd a
    wrong answer, 3rd the right one (so each trajectory takes 3 turns and 1 tool call)."""

    base_url, timeout_s = "scripted://turns", 30.0

    def __init__(self, tok):
        self.tok, self.requests = tok, 0

    async def generate(self, input_ids, sp, return_logprob=True, return_routed_experts=False):
        self.requests += 1
        n = self.tok.decode(input_ids).count("<|im_start|>assistant")
        text = {1: '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>',
                2: "The answer is 5"}.get(n, "The answer is 7")
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        await asyncio.sleep(0)
        return SimpleNamespace(output_ids=ids, output_logprobs=[-0.5] * len(ids), finish_reason="stop",
                               weight_version=2, output_token_weight_versions=[2] * len(ids), routed_experts=None)


class Rows:
    def __init__(self, tok):
        self.tokenizer = tok
        self.i = 0

    def next_train(self):
        self.i += 1
        return SimpleNamespace(index=self.i, question="What is 3 + 4?", answer="7")

    def messages(self, p):
        return [{"role": "user", "content": p.question}]

    def build_prompt_ids(self, p):
        return self.tokenizer.apply_chat_template(self.messages(p), add_generation_prompt=True, tokenize=True)

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, p, text):
        return 0.0


class Buf:
    admit_waits = False

    def __init__(self, n):
        self.n, self.groups, self.cancels = n, [], []

    async def admit(self):
        if self.n <= 0:
            return None
        self.n -= 1
        return 2

    async def put(self, g):
        self.groups.append(g)

    async def cancel(self, reason="cancelled"):
        self.cancels.append(reason)


def test_groups_of_trajectories(tok):
    cfg = RolloutConfig(n_samples_per_prompt=3, max_new_tokens=48,
                        agent={"enabled": True, "env_class": "answer_retry", "max_turns": 3, "tools": ["calculator"]})
    buf, eng = Buf(2), TurnEngine(tok)
    m = RolloutManager(cfg, Rows(tok), [eng], buf, reward_pool=None, eos_token_ids=[tok.eos_token_id])

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(m.run(stop))
        while len(buf.groups) + len(buf.cancels) < 2:
            await asyncio.sleep(0.01)
        stop.set()
        await task

    asyncio.run(asyncio.wait_for(main(), 60))
    assert len(buf.groups) == 2 and not buf.cancels
    for g in buf.groups:
        assert len(g.samples) == 3
        for s in g.samples:
            assert s.reward == 1.0 and s.metadata["agent"]["turns"] == 3
            assert len(s.metadata["turn_spans"]) == 3 and len(s.metadata["obs_spans"]) == 2
            obs1 = s.response_ids[slice(*s.metadata["obs_spans"][0])]
            assert "<|im_start|>tool\n7<|im_end|>" in tok.decode(obs1)  # the calculator's answer
    met = m.metrics()
    n = 2 * 3
    assert met["rollout/agent/trajectories"] == n and met["rollout/agent/turns"] == 3 * n
    assert met["rollout/agent/tool_calls"] == n and met["rollout/agent/tool_errors"] == 0
    assert met["rollout/agent/turns_per_trajectory"] == 3.0 and met["rollout/agent/template_mismatches"] == 0
    assert met["rollout/agent/observation_tokens"] > 0 and met["rollout/reward_sum"] == n
    spans = [sp for sp in m.trace.spans if sp[0] == "tools"]
    assert len(spans) == n and all(sp[1] == "tool calculator" and sp[4]["ok"] for sp in spans)
    assert eng.requests == 3 * n  # one request per turn: tool waits hold none

    # greedy eval: success within the turn budget; not counted in the training metrics
    ev = asyncio.run(m.evaluate([SimpleNamespace(index=0, question="What is 3 + 4?", answer="7"),
                                 SimpleNamespace(index=1, question="What is 3 + 4?", answer="9")]))
    assert ev["n"] == 2 and ev["accuracy"] == 0.5 and ev["task_accuracy"] == 0.5
    assert m.metrics()["rollout/agent/trajectories"] == n
