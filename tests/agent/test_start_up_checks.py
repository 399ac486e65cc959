"""rollout.agent settings refused before any Ray process (one line, exit status 2): a function-call
parser SGLang does not have (it failed in the rollout actor with a traceback), and tools offered to a
model whose chat template drops ``tools=`` (SmolLM2's: the model never saw its tools, tool_calls 0,
and nothing said so)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from moe_async.agent.config import AgentConfig
from moe_async.agent.start_up import PROBE, check_template_shows_tools, check_tool_parser
from moe_async.cli import main
from moe_async.errors import UserInputError

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "cpu_smoke.yaml"
AGENT = ["rollout.agent.enabled=true", "rollout.agent.env_class=answer_retry", "rollout.agent.tools=[calculator]"]
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="sglang is not installed (make setup: pip install --no-deps sglang==0.5.23)")
# a template that renders the tools' schemas (as Qwen2.5's does, shortened)
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def smollm2():
    from moe_async.models.prepare import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


@needs_sglang
def test_unknown_tool_parser_refused_naming_sglangs_parsers():
    from moe_async.compat.sglang_cpu import import_sglang

    known = sorted(import_sglang("sglang.srt.function_call.function_call_parser").FunctionCallParser.ToolCallParserEnum)
    with pytest.raises(UserInputError) as ei:
        check_tool_parser(AgentConfig(enabled=True, tools=["calculator"], tool_parser="qwen3"))
    assert str(ei.value) == f"rollout.agent.tool_parser='qwen3': SGLang has no such function-call parser; known: {known}"
    check_tool_parser(AgentConfig(enabled=True, tools=["calculator"], tool_parser="qwen25"))
    check_tool_parser(AgentConfig(enabled=True, tool_parser="qwen3"))  # no tools: the parser is never used


@needs_sglang
def test_train_with_unknown_tool_parser_is_one_line_exit_2_and_no_run_dir(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["train", str(SMOKE), *AGENT, "rollout.agent.tool_parser=qwen3", f"logging.output_dir={runs}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("moe-async: rollout.agent.tool_parser='qwen3': SGLang has no such")
    assert not runs.exists()


def test_template_that_drops_tools_is_refused(smollm2):
    cfg = AgentConfig(enabled=True, tools=["calculator"])
    # the fault itself: SmolLM2's template renders the same text with and without tools=
    assert smollm2.apply_chat_template(PROBE, tokenize=False, tools=[{"type": "function", "function": {"name": "x"}}]) \
        == smollm2.apply_chat_template(PROBE, tokenize=False)
    with pytest.raises(UserInputError, match=r"rollout\.agent\.tools=\['calculator'\]: the chat template of M ignores tools="):
        check_template_shows_tools(cfg, smollm2, "M")
    shows = copy.deepcopy(smollm2)
    shows.chat_template = TOOLS_TEMPLATE
    check_template_shows_tools(cfg, shows, "M")  # a template that renders them: accepted
    from moe_async.agent.builtin import resolve_tools

    assert '"calculator"' in shows.apply_chat_template(PROBE, tokenize=False,
                                                       tools=[t.schema for t in resolve_tools(["calculator"])])
    check_template_shows_tools(AgentConfig(enabled=True), smollm2, "M")  # no tools offered: nothing to show


def test_train_with_tools_on_smollm2_is_one_line_exit_2_and_no_run_dir(tmp_path, capsys):
    """Through the driver (cpu_smoke: random MoE with SmolLM2's tokenizer), before Ray starts."""
    runs = tmp_path / "runs"
    assert main(["train", str(SMOKE), *AGENT, "rollout.agent.tool_parser=qwen25", f"logging.output_dir={runs}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("moe-async: rollout.agent.tools=['calculator']: the chat template of ")
    assert "ignores tools=" in err[0]
    assert not runs.exists() or not any(runs.iterdir())
