"""Tools on a CPU host: SGLang's function-call parsers import through
moe_async/compat/sglang_cpu.py (triton and torchvision stubbed for sglang's own imports only,
only without CUDA), so a CPU run with rollout.agent.tools starts; it used to be refused.
In the default suite in this process (the contract tests' SGLang import helper goes through the
same shim); end to end in a fresh process that never loaded that helper (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys
    from types import SimpleNamespace
    from moe_async.agent.builtin import resolve_tools
    from moe_async.agent.config import AgentConfig
    from moe_async.agent.rollout import AgentRollout
    from moe_async.agent.tools import parse_tool_calls

    tools = resolve_tools(["calculator"])
    tok = SimpleNamespace(apply_chat_template=lambda *a, **k: "")
    AgentRollout(AgentConfig(enabled=True, env_class="answer_retry", tools=["calculator"]), tok, None)
    text = 'Let me compute.<tool_call>\\n{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}\\n</tool_call>'
    normal, calls = parse_tool_calls(text, tools, "qwen25")
    stubs_left = [m for m in sys.modules if m.split(".")[0] in ("triton", "torchvision")]
    print(json.dumps({"normal": normal, "calls": [[c.name, c.arguments] for c in calls],
                      "parser": type(sys.modules["sglang.srt.function_call.qwen25_detector"].Qwen25Detector()).__name__,
                      "stubs_left": stubs_left, "triton_findable": importlib.util.find_spec("triton") is not None}))
""")


@pytest.mark.slow  # a fresh process importing SGLang: ~1 min alone
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (with CUDA the real packages import)")
def test_tool_calls_parse_with_sglangs_parser_on_cpu(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (make setup: pip install --no-deps sglang==0.5.23)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["calls"] == [["calculator", {"expression": "3 * (4 + 5)"}]]
    assert r["normal"] == "Let me compute." and r["parser"] == "Qwen25Detector"
    # the stubs served sglang's imports only: gone afterwards, and nobody else can find one
    assert r["stubs_left"] == [] and r["triton_findable"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (with CUDA the real packages import)")
def test_agent_rollout_with_tools_starts_on_cpu():
    import importlib.util
    from types import SimpleNamespace

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (make setup: pip install --no-deps sglang==0.5.23)")
    from moe_async.agent.builtin import resolve_tools
    from moe_async.agent.config import AgentConfig
    from moe_async.agent.rollout import AgentRollout
    from moe_async.agent.tools import parse_tool_calls
    from moe_async.compat.sglang_cpu import _Stub

    tok = SimpleNamespace(apply_chat_template=lambda *a, **k: "")
    AgentRollout(AgentConfig(enabled=True, env_class="answer_retry", tools=["calculator"]), tok, None)
    text = 'Sure.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    normal, calls = parse_tool_calls(text, resolve_tools(["calculator"]), "qwen25")
    assert normal == "Sure." and [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2 + 2"})]
    assert not any(isinstance(m, _Stub) for m in sys.modules.values())  # the stubs served sglang's imports only
    assert importlib.util.find_spec("triton") is None
