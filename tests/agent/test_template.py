"""The template check: observations rendered with the conversation's full context equal the
full render (Qwen's one user turn around consecutive tool messages); message-by-message
rendering (slime #2263's shape: an extra ``<|im_end|><|im_start|>user`` between two tool
results) is caught and named; a template that rewrites earlier turns (reasoning dropped from
past assistant turns) is a counted mismatch while the sampled ids stay untouched."""

from __future__ import annotations

import asyncio
import copy
import os
import sys

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

# Qwen2.5's handling of tool messages (its chat template, tool-free parts elided): consecutive
# tool messages share ONE user turn
QWEN_TOOLS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-like: reasoning is dropped from assistant turns before the last user message
DROPS_THINK = QWEN_TOOLS.replace(
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content",
    "{%- elif message.role == 'assistant' and not loop.last %}{{- '<|im_start|>assistant\\n' + "
    "message.content.split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content")


@pytest.fixture(scope="module")
def base_tok():
    from moe_async.models.prepare import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def _tok(base, template):
    t = copy.deepcopy(base)
    t.chat_template = template
    return t


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


class Once(TextEnv):
    def step(self, action):
        done = "answer is 7" in action
        return EnvStep(observations=[] if done else [{"role": "user", "content": "Wrong, try again."}],
                       reward=float(done), done=done)


def _run(tok, turns, tools=()):
    eng = ScriptedEngine([(t, "stop", [0] * len(t)) for t in turns])
    m = RolloutManager(RolloutConfig(), None, [eng], None, None, eos_token_ids=[tok.eos_token_id])

    async def turn(ids, n):
        return await m._generate_sample(ids, n)

    r = ChatRenderer(tok, [t.schema for t in tools])
    return asyncio.run(run_trajectory(Once(), "once", [{"role": "user", "content": "3+4?"}], r, turn,
                                      AgentConfig(enabled=True, max_turns=3), 64, tools=list(tools),
                                      eos_token_ids=[tok.eos_token_id]))


def _a(): return "A"  # noqa: E704


def _b(): return "B"  # noqa: E704


TOOLS = (Tool.from_function(_a, parameters={"type": "object", "properties": {}}),
         Tool.from_function(_b, parameters={"type": "object", "properties": {}}))
TWO_CALLS = ('<tool_call>\n{"name": "_a", "arguments": {}}\n</tool_call>\n'
             '<tool_call>\n{"name": "_b", "arguments": {}}\n</tool_call>')


def test_two_tool_messages_render_as_one_user_turn(base_tok):
    tok = _tok(base_tok, QWEN_TOOLS)
    t1, t2 = _ids(tok, TWO_CALLS), _ids(tok, "The answer is 7")
    s, st = _run(tok, [t1, t2], TOOLS)
    assert st.template_mismatches == 0 and st.tools.calls == 2 and st.tools.errors == 0
    (a, b), = s.metadata["obs_spans"]
    assert tok.decode(s.response_ids[a:b], skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert s.response_ids == t1 + s.response_ids[a:b] + t2


def test_message_by_message_render_is_caught(base_tok):
    """slime #2263: rendering each tool message on its own puts a turn boundary between two
    consecutive tool results; the full-render check names where."""
    tok = _tok(base_tok, QWEN_TOOLS)
    r = ChatRenderer(tok)
    conv = [{"role": "user", "content": "3+4?"}, {"role": "assistant", "content": TWO_CALLS},
            {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    ids = r.prompt_ids(conv[:1]) + _ids(tok, TWO_CALLS) + r.encode("\n")
    for m in conv[2:]:  # one message at a time, as slime's loss-mask generator did
        ids += r.encode(r.render([m], add_generation_prompt=False))
    mm = r.final_check(conv, ids)
    assert mm is not None and mm.where == "final"
    assert mm.have.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\nB")
    assert mm.want.startswith("\n<tool_response>\nB")
    assert "chat template mismatch (final)" in mm.describe()
    # the same conversation rendered with its context passes
    good = r.prompt_ids(conv[:1]) + _ids(tok, TWO_CALLS)
    obs, bad = r.observation_ids(conv[:2], conv[2:], good, _ids(tok, TWO_CALLS))
    assert bad is None and r.decode(good + obs) == r.render(conv, add_generation_prompt=True)


def test_template_rewriting_earlier_turns_is_counted_and_ids_kept(base_tok):
    tok = _tok(base_tok, DROPS_THINK)
    t1, t2 = _ids(tok, "<think>5 or 7</think>The answer is 5"), _ids(tok, "The answer is 7")
    s, st = _run(tok, [t1, t2])
    assert st.template_mismatches == 1 and "chat template mismatch (observation)" in st.mismatch_notes[0]
    assert s.metadata["agent"]["template_mismatches"] == 1
    (a, b), = s.metadata["obs_spans"]
    assert s.response_ids[:len(t1)] == t1 and s.response_ids[b:] == t2  # sampled ids untouched
    assert tok.decode(s.response_ids[a:b], skip_special_tokens=False) == (
        "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")
    assert s.reward == 1.0
