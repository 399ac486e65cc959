"""Token in, token out: a scripted 3-turn trajectory with two tool calls (one raising, one
timing out) parsed by SGLang's own Qwen/Hermes parser; the trained ids are exactly the
engine's sampled ids plus the chat template's observation tokens, in order; the mask covers
exactly the model tokens; logprobs, versions and routes align with every model token; a
weight update in the middle of turn 2 in each pause mode keeps all of that true."""

from __future__ import annotations

import asyncio
import re
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engines"))
from _scripted import ScriptedEngine  # noqa: E402
from _sglang_import import io_struct_or_skip  # noqa: E402

from moe_async.agent.config import AgentConfig  # noqa: E402
from moe_async.agent.env import EnvStep, TextEnv  # noqa: E402
from moe_async.agent.loop import run_trajectory  # noqa: E402
from moe_async.agent.template import ChatRenderer  # noqa: E402
from moe_async.agent.tools import Tool  # noqa: E402
from moe_async.rollout.config import RolloutConfig  # noqa: E402
from moe_async.rollout.manager import RolloutManager  # noqa: E402

# SGLang's function-call parsers (sglang 0.5.23, installed --no-deps: imported with the
# GPU-only modules stubbed, as the contract tests do)
_, _, pytestmark = io_struct_or_skip("sglang.srt.function_call.function_call_parser", what="sglang function_call")


@pytest.fixture(scope="module")
def tok():
    from moe_async.models.prepare import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


class ScriptedEnv(TextEnv):
    """Answers 7: reward 1 and done; anything else: "no" and go on. Records its actions."""

    def __init__(self):
        super().__init__()
        self.actions, self.closed = [], False

    def step(self, action):
        self.actions.append(action)
        if "answer is 7" in action:
            return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}  # SkyRL-gym's dict
        return EnvStep(observations=[{"role": "user", "content": "no"}], reward=0.0)

    def close(self):
        self.closed = True


def boom(x: str) -> str:
    raise RuntimeError("disk on fire")


async def sleepy() -> str:
    await asyncio.sleep(30)
    return "late"


TOOLS = [Tool.from_function(boom), Tool.from_function(sleepy, parameters={"type": "object", "properties": {}})]
CALL1 = '<tool_call>\n{"name": "boom", "arguments": {"x": "1"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "sleepy", "arguments": {}}\n</tool_call>'
ANSWER = "The answer is 7"


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _script(tok, mode):
    """Turn 2 is cut by a weight update (version 0 -> 1) after its 5th token: abort returns the
    partial segment and the rest comes from a resubmission; retract and in_place finish the
    request with the versions switching inside it."""
    t1, t2, t3 = _ids(tok, CALL1), _ids(tok, CALL2), _ids(tok, ANSWER)
    k = 5
    if mode == "abort":
        turn2 = [(t2[:k], "abort", [0] * k), (t2[k:], "stop", [1] * (len(t2) - k))]
    else:
        turn2 = [(t2, "stop", [0] * k + [1] * (len(t2) - k))]
    return [(t1, "stop", [0] * len(t1))] + turn2 + [(t3, "stop", [1] * len(t3))], (t1, t2, t3), k


def _run(tok, mode, env):
    script, turns, k = _script(tok, mode)
    eng = ScriptedEngine(script)
    cfg = RolloutConfig(return_routed_experts=True, partial_rollout=True)
    m = RolloutManager(cfg, None, [eng], None, None, eos_token_ids=[tok.eos_token_id])
    acfg = AgentConfig(enabled=True, max_turns=3, tool_timeout_s=0.3, max_trajectory_tokens=4096)

    async def turn(ids, n):
        return await m._generate_sample(ids, n)

    prompt = [{"role": "user", "content": "What is 3 + 4? Use the tools."}]
    s, st = asyncio.run(run_trajectory(env, "scripted", prompt, ChatRenderer(tok, [t.schema for t in TOOLS]), turn,
                                       acfg, 64, tools=TOOLS, eos_token_ids=[tok.eos_token_id]))
    return s, st, eng, turns, k


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_three_turns_two_tools_token_in_token_out(tok, mode):
    env = ScriptedEnv()
    s, st, eng, (t1, t2, t3), k = _run(tok, mode, env)
    assert st.tools.seconds < 30.0  # the timed-out tool (it sleeps 30 s) was not waited for
    assert env.closed and env.actions == [ANSWER]  # tool turns do not step the environment
    assert s.reward == 1.0 and s.finish_reason == "stop"
    a = s.metadata["agent"]
    assert (a["turns"], a["tool_calls"], a["tool_errors"], a["tool_timeouts"], a["env_steps"]) == (3, 2, 2, 1, 1)
    assert a["template_mismatches"] == 0
    (o1s, o1e), (o2s, o2e) = s.metadata["obs_spans"]
    obs1, obs2 = s.response_ids[o1s:o1e], s.response_ids[o2s:o2e]
    # trained ids == sampled ids + observation tokens, in order
    assert s.response_ids == t1 + obs1 + t2 + obs2 + t3
    # the observations are the chat template's text for the tool messages (ChatML), the
    # newline after the model's <|im_end|> included
    dec = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert dec(obs1) == ("\n<|im_start|>tool\nError: tool 'boom' raised RuntimeError: disk on fire<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert dec(obs2) == "\n<|im_start|>tool\nError: tool 'sleepy' timed out after 0.3 s<|im_end|>\n<|im_start|>assistant\n"
    # the mask covers exactly the model tokens
    assert s.loss_mask == [1] * len(t1) + [0] * len(obs1) + [1] * len(t2) + [0] * len(obs2) + [1] * len(t3)
    # logprobs: the engine's, per sampled token, in order; 0.0 on observations
    engine_lps = [x for c in eng.calls for x in c[2]]
    assert [lp for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m] == engine_lps
    assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if not m)
    # versions: turn 2 switches 0 -> 1 after its k-th token; observations repeat the last sampled one's
    assert s.weight_versions == ([0] * len(t1) + [0] * len(obs1) + [0] * k + [1] * (len(t2) - k)
                                 + [1] * len(obs2) + [1] * len(t3))
    assert s.oldest_version == 0
    # every engine call's sequence is the trajectory so far (no re-tokenisation)
    full = s.prompt_ids + s.response_ids
    for inp, out, _, _ in eng.calls:
        assert full[: len(inp) + len(out)] == inp + out
    # routes: row j is the one of the first call that fed token j (a call feeds the previous
    # call's last sampled token, the observation and its own tokens)
    P, R = len(s.prompt_ids), len(s.response_ids)
    assert s.routed_experts.shape == (P + R - 1, 2, 2)
    want, lo = np.zeros(P + R - 1, dtype=int), 0
    for c, (inp, out, _, _) in enumerate(eng.calls, start=1):
        want[lo: len(inp) + len(out) - 1] = c
        lo = len(inp) + len(out) - 1
    np.testing.assert_array_equal(s.routed_experts[:, 0, 0], want)
    np.testing.assert_array_equal(s.routed_experts[:, 1, 1], np.arange(P + R - 1) % 5)
    assert len(eng.calls) == (4 if mode == "abort" else 3)


def test_budgets_end_the_trajectory(tok):
    """The turn budget stops a trajectory whose environment never says done; the token budget
    cuts the turn that would pass it (finish_reason 'length')."""
    wrong = _ids(tok, "The answer is 5")
    eng = ScriptedEngine([(wrong, "stop", [0] * len(wrong))] * 4)
    m = RolloutManager(RolloutConfig(), None, [eng], None, None, eos_token_ids=[tok.eos_token_id])

    async def turn(ids, n):
        return await m._generate_sample(ids, n)

    def go(**kw):
        env = ScriptedEnv()
        s, st = asyncio.run(run_trajectory(env, "scripted", [{"role": "user", "content": "q"}], ChatRenderer(tok),
                                           turn, AgentConfig(enabled=True, **kw), 64, eos_token_ids=[tok.eos_token_id]))
        return s, st, env

    s, st, env = go(max_turns=2)
    assert st.turns == 2 and len(env.actions) == 2 and s.reward == 0.0
    n_obs = len(s.response_ids) - 2 * len(wrong)
    assert n_obs > 0 and s.loss_mask == [1] * len(wrong) + [0] * n_obs + [1] * len(wrong)
    budget = len(wrong) + 3
    s, st, env = go(max_turns=3, max_trajectory_tokens=budget)
    assert s.finish_reason == "length" and len(s.response_ids) <= budget and st.turns <= 2


def test_bad_environment_step_is_named(tok):
    class Bad(TextEnv):
        def step(self, action):
            return {"observations": [], "done": True}

    eng = ScriptedEngine([(_ids(tok, "hi"), "stop", [0, 0])])
    m = RolloutManager(RolloutConfig(), None, [eng], None, None)

    async def turn(ids, n):
        return await m._generate_sample(ids, n)

    env = Bad()
    s, st = asyncio.run(run_trajectory(env, "bad_env", [{"role": "user", "content": "q"}], ChatRenderer(tok), turn,
                                       AgentConfig(enabled=True), 8))
    # the malformed result ends this trajectory only, named and counted (the rest of its group is scored)
    assert re.match(r"environment 'bad_env' \(Bad\): step\(\) result lacks \['reward'\]", s.metadata["agent_error"])
    assert st.env_errors == 1 and s.reward == 0.0
