"""Hung synchronous tools and environment steps: they run on the agent's own bounded pool of
daemon threads, so they neither take the event loop's default executor nor keep the process
alive at exit; a step past ``rollout.agent.env_step_timeout_s`` ends the trajectory with a
named, counted error that the rollout manager records as the sample's reward error."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _scripted import ScriptedEngine  # noqa: E402

from moe_async.agent.config import AgentConfig  # noqa: E402
from moe_async.agent.env import TextEnv  # noqa: E402
from moe_async.agent.loop import run_trajectory  # noqa: E402
from moe_async.agent.template import ChatRenderer  # noqa: E402
from moe_async.agent.tools import Tool, ToolCall, ToolStats, run_tool_calls  # noqa: E402
from moe_async.agent.workers import WorkerPool  # noqa: E402
from moe_async.rollout.config import RolloutConfig  # noqa: E402
from moe_async.rollout.manager import RolloutManager  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok():
    from moe_async.models.prepare import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def test_hung_sync_tools_leave_the_default_executor_free():
    """12 synchronous tool calls that never return (more than the default executor's threads
    on this machine): each is a timed-out error observation after ~timeout_s, they ran on the
    pool's daemon threads, and the loop's default executor still answers at once."""
    release = threading.Event()
    daemons: list[bool] = []

    def stuck() -> str:
        daemons.append(threading.current_thread().daemon)
        release.wait(60)
        return "late"

    tools = [Tool.from_function(stuck, parameters={"type": "object", "properties": {}})]
    stats = ToolStats()
    pool = WorkerPool(4, "test-tools")

    async def main():
        try:
            t0 = time.monotonic()
            msgs = await run_tool_calls([ToolCall("stuck", {})] * 12, tools, 0.3, stats, pool)
            took = time.monotonic() - t0
            free = await asyncio.wait_for(asyncio.to_thread(lambda: 42), 5)
            assert pool.hung == 4 and pool.busy == 4  # 4 running past their timeout, 8 never started
            return msgs, took, free
        finally:
            release.set()

    msgs, took, free = asyncio.run(asyncio.wait_for(main(), 30))
    assert free == 42
    assert [m["content"] for m in msgs] == ["Error: tool 'stuck' timed out after 0.3 s"] * 12
    assert stats.calls == 12 and stats.timeouts == 12 and stats.errors == 12
    assert took < 3.0  # every call bounded by its timeout, queued ones too
    assert len(daemons) == 4 and all(daemons)  # only the pool's 4 threads ever ran it


def test_a_hung_tool_does_not_block_interpreter_exit(tmp_path):
    """A synchronous tool sleeping for 10 minutes past its timeout: the process still exits."""
    script = tmp_path / "hung.py"
    script.write_text(textwrap.dedent("""
        import asyncio, time
        from moe_async.agent.tools import Tool, ToolCall, ToolStats, run_tool_calls

        def nap() -> str:
            time.sleep(600)
            return "late"

        stats = ToolStats()
        tools = [Tool.from_function(nap, parameters={"type": "object", "properties": {}})]
        msgs = asyncio.run(run_tool_calls([ToolCall("nap", {})], tools, 0.2, stats))
        print(msgs[0]["content"], stats.timeouts)
    """))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Error: tool 'nap' timed out after 0.2 s 1"
    assert time.monotonic() - t0 < 100


class HungEnv(TextEnv):
    def __init__(self, release: threading.Event):
        super().__init__()
        self.release, self.closed = release, False

    def step(self, action):
        self.release.wait(60)
        return {"observations": [], "reward": 1.0, "done": True}

    def close(self):
        self.closed = True


def test_hung_env_step_ends_the_trajectory_with_a_named_counted_error(tok):
    ids = tok("The answer is 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    eng = ScriptedEngine([(ids, "stop", [0] * len(ids))])
    m = RolloutManager(RolloutConfig(), None, [eng], None, None, eos_token_ids=[tok.eos_token_id])
    release = threading.Event()
    env = HungEnv(release)

    async def turn(i, n):
        return await m._generate_sample(i, n)

    async def main():
        try:
            return await run_trajectory(env, "hung_env", [{"role": "user", "content": "q"}], ChatRenderer(tok), turn,
                                        AgentConfig(enabled=True, env_step_timeout_s=0.3), 32,
                                        eos_token_ids=[tok.eos_token_id])
        finally:
            release.set()

    t0 = time.monotonic()
    s, st = asyncio.run(asyncio.wait_for(main(), 30))
    assert time.monotonic() - t0 < 10
    assert st.env_timeouts == 1 and st.env_steps == 0 and st.turns == 1 and env.closed
    assert s.metadata["agent_error"].startswith(
        "environment 'hung_env': step() timed out (rollout.agent.env_step_timeout_s=0.3)")
    assert s.metadata["agent"]["env_timeouts"] == 1 and s.reward == 0.0
    assert s.response_ids == ids and s.loss_mask == [1] * len(ids)


def test_manager_records_the_env_timeout_as_the_samples_reward_error(tok):
    """answer_retry with a 1 s step and a 0.2 s step timeout: every trajectory of the group ends
    with the named error, recorded as the sample's reward error and counted."""

    class Eng:
        base_url, timeout_s = "scripted://answer", 30.0

        async def generate(self, input_ids, sp, return_logprob=True, return_routed_experts=False):
            out = tok("The answer is 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            return SimpleNamespace(output_ids=out, output_logprobs=[-0.5] * len(out), finish_reason="stop",
                                   weight_version=0, output_token_weight_versions=[0] * len(out),
                                   routed_experts=None)

    class Rows:
        tokenizer = tok

        def messages(self, p):
            return [{"role": "user", "content": "What is 3 + 4?"}]

        def decode(self, ids):
            return tok.decode(ids, skip_special_tokens=True)

    class Buf:
        def __init__(self):
            self.groups = []

        async def put(self, g):
            self.groups.append(g)

        async def cancel(self, reason="cancelled"):
            pass

    cfg = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=16, max_consecutive_reward_errors=0,
                        agent={"enabled": True, "env_class": "answer_retry", "env_step_timeout_s": 0.2,
                               "env_config": {"step_delay_s": 1.0}})
    buf = Buf()
    m = RolloutManager(cfg, Rows(), [Eng()], buf, reward_pool=None, eos_token_ids=[tok.eos_token_id])
    problem = SimpleNamespace(index=0, question="What is 3 + 4?", answer="7")
    asyncio.run(asyncio.wait_for(m._produce_group(0, problem, [], 16, 0), 30))
    (g,) = buf.groups
    assert [s.reward for s in g.samples] == [0.0, 0.0]
    for s in g.samples:
        assert s.reward_error is not None and "'answer_retry': step() timed out" in s.reward_error
    met = m.metrics()
    assert met["rollout/reward_errors"] == 2 and met["rollout/agent/env_timeouts"] == 2


class _BadEnv(TextEnv):
    """``step`` raises (``mode='raise'``) or returns a NaN reward (``mode='nan'``)."""

    def __init__(self, mode: str):
        self.mode, self.closed = mode, False

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        if self.mode == "raise":
            raise RuntimeError("sandbox exploded")
        return {"observations": [], "reward": float("nan"), "done": True, "metadata": {}}

    def close(self):
        self.closed = True


@pytest.mark.parametrize("mode,error", [
    ("raise", "environment 'bad_env': step() raised RuntimeError: sandbox exploded"),
    ("nan", "environment 'bad_env'"),
])
def test_failing_env_step_ends_only_its_trajectory_with_a_named_counted_error(tok, mode, error):
    ids = tok("The answer is 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    eng = ScriptedEngine([(ids, "stop", [0] * len(ids))])
    m = RolloutManager(RolloutConfig(), None, [eng], None, None, eos_token_ids=[tok.eos_token_id])
    env = _BadEnv(mode)

    async def turn(i, n):
        return await m._generate_sample(i, n)

    s, st = asyncio.run(run_trajectory(env, "bad_env", [{"role": "user", "content": "q"}], ChatRenderer(tok), turn,
                                       AgentConfig(enabled=True), 32, eos_token_ids=[tok.eos_token_id]))
    assert s.metadata["agent_error"].startswith(error)
    assert st.env_errors == 1 and s.metadata["agent"]["env_errors"] == 1 and st.env_steps == 0
    assert s.reward == 0.0 and env.closed and s.response_ids == ids
