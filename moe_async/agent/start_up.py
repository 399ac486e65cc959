"""Start-up checks of ``rollout.agent`` that run before any Ray process (the driver), so that a
bad setting is one line and exit status 2, not a traceback from the rollout actor after the
engines started: the function-call parser is one SGLang knows, and the model's chat template
shows the offered tools to the model (a template that ignores ``tools=`` never does, so the
model never calls them).
"""

from __future__ import annotations


from moe_async.agent.config import AgentConfig
from moe_async.errors import UserInputError
from moe_async.types import Tokenizer

#: the conversation rendered with and without ``tools=`` to see whether the template uses them
PROBE = [{"role": "user", "content": "What is 2 + 3?"}]


def check_tool_parser(cfg: AgentConfig) -> None:
    """UserInputError naming ``rollout.agent.tool_parser`` and SGLang's parser names
    (``FunctionCallParser.ToolCallParserEnum``) when tools are offered and the parser is not one
    of them. SGLang's parsers not importable here: left to the rollout actor (its error says
    how to install them)."""
    if not (cfg.enabled and cfg.tools):
        return
    try:
        from moe_async.compat.sglang_cpu import import_sglang

        known = import_sglang("sglang.srt.function_call.function_call_parser").FunctionCallParser.ToolCallParserEnum
    except ImportError:
        return
    if cfg.tool_parser not in known:
        raise UserInputError(f"rollout.agent.tool_parser={cfg.tool_parser!r}: SGLang has no such function-call "
                             f"parser; known: {sorted(known)}")


def check_template_shows_tools(cfg: AgentConfig, tokenizer: Tokenizer, model: str) -> None:
    """UserInputError naming ``rollout.agent.tools`` and ``model`` when the tokenizer's chat
    template renders :data:`PROBE` the same with and without the tools' schemas (or fails
    with them): the model would never see its tools."""
    if not (cfg.enabled and cfg.tools):
        return
    from moe_async.agent.builtin import resolve_tools

    schemas = [t.schema for t in resolve_tools(list(cfg.tools))]
    plain = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    try:
        with_tools = tokenizer.apply_chat_template(PROBE, tools=schemas, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template error is named with the model
        raise UserInputError(f"rollout.agent.tools={list(cfg.tools)}: the chat template of {model} fails with "
                             f"tools= ({type(e).__name__}: {e})") from None
    if with_tools == plain:
        raise UserInputError(
            f"rollout.agent.tools={list(cfg.tools)}: the chat template of {model} ignores tools= (it renders "
            "a conversation the same with and without them), so the model would never see its tools; use a "
            "model whose template renders tools (e.g. Qwen2.5/Qwen3) or remove rollout.agent.tools")
