"""Tools: OpenAI function-calling schemas, calls parsed with SGLang's own parsers, run async.

A :class:`Tool` is an OpenAI function schema (``{"type": "function", "function": {name,
description, parameters}}``) and a Python callable (sync: run on the bounded daemon pool
:class:`moe_async.agent.workers.WorkerPool`; async: awaited) taking the call's arguments as
keywords and returning a string (anything else is ``json.dumps``-ed or ``str``-ed).

Parsing (:func:`parse_tool_calls`): SGLang's ``FunctionCallParser`` with the family's
detector (``rollout.agent.tool_parser``: ``qwen25``, ``deepseekv3``, ``llama3``, ...); on a
CPU host imported through :func:`moe_async.compat.sglang_cpu.import_sglang`.

Execution (:func:`run_tool_calls`): every call of a turn concurrently, each under
``tool_timeout_s``; a call that raises, times out, names an unknown tool or has arguments
that are not a JSON object becomes a ``tool`` message ``"Error: ..."`` for the model
(counted in :class:`ToolStats`), never an exception of the rollout. A synchronous tool past
its timeout keeps its thread until it returns; the trajectory does not wait for it and the
thread does not keep the process alive.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from moe_async.agent.workers import WorkerPool, WorkerTimeout
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from sglang.srt.function_call.function_call_parser import FunctionCallParser


@dataclass
class Tool:
    """An OpenAI function schema and the callable that answers it."""

    schema: JsonDict
    fn: Callable[..., object]

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])

    @classmethod
    def from_function(cls, fn: Callable[..., object], description: str = "",
                      parameters: JsonDict | None = None) -> "Tool":
        """A tool named after ``fn``; ``parameters`` a JSON schema (default: every argument a
        string, all required)."""
        if parameters is None:
            names = list(inspect.signature(fn).parameters)
            parameters = {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}
        return cls({"type": "function", "function": {"name": fn.__name__, "description": description or
                                                      (fn.__doc__ or "").strip(), "parameters": parameters}}, fn)


@dataclass
class ToolCall:
    """A parsed call: tool name and its arguments (a dict, or the raw string when not JSON)."""

    name: str
    arguments: JsonDict | str


@dataclass
class ToolStats:
    """Per-trajectory tool counters: calls, errors (raised, unknown tool, bad arguments),
    timeouts (also errors), seconds (summed over calls), spans ``(name, start, end, ok)`` in
    ``time.time()`` seconds (the trace's clock, moe_async/logging/timeline.py)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    spans: list[tuple[str, float, float, bool]] = field(default_factory=list)


_PARSERS: dict[tuple[str, tuple[str, ...]], FunctionCallParser] = {}


def _sglang_parser(parser: str, tools: list[Tool]) -> FunctionCallParser:
    """SGLang's ``FunctionCallParser`` for ``parser`` over ``tools`` (cached). ValueError
    naming the parser and SGLang's known ones when it does not exist."""
    key = (parser, tuple(t.name for t in tools))
    if key not in _PARSERS:
        from moe_async.compat.sglang_cpu import import_sglang

        # on a CPU host: with SGLang's GPU-only imports stubbed (moe_async/compat/sglang_cpu.py)
        SGTool = import_sglang("sglang.srt.entrypoints.openai.protocol").Tool
        Parser = import_sglang("sglang.srt.function_call.function_call_parser").FunctionCallParser

        known = Parser.ToolCallParserEnum
        if parser not in known:
            raise ValueError(f"rollout.agent.tool_parser={parser!r}: SGLang has no such parser; known: {sorted(known)}")
        _PARSERS[key] = Parser([SGTool(**t.schema) for t in tools], parser)
    return _PARSERS[key]


def parse_tool_calls(text: str, tools: list[Tool], parser: str) -> tuple[str, list[ToolCall]]:
    """``(normal text, calls)`` of one model turn, by SGLang's parser ``parser`` (module
    docstring). No tools: ``(text, [])``."""
    if not tools:
        return text, []
    p = _sglang_parser(parser, tools)
    if not p.has_tool_call(text):
        return text, []
    normal, items = p.parse_non_stream(text)
    calls = []
    for it in items:
        try:
            args: JsonDict | str = json.loads(it.parameters) if it.parameters else {}
        except json.JSONDecodeError:
            args = it.parameters
        calls.append(ToolCall(name=str(it.name), arguments=args))
    return normal, calls


def _as_text(v: object) -> str:
    if isinstance(v, str):
        return v
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return str(v)


async def _run_one(call: ToolCall, tools: dict[str, Tool], timeout_s: float, stats: ToolStats,
                   pool: WorkerPool) -> str:
    t0, w0 = time.monotonic(), time.time()
    ok = False
    try:
        tool = tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; available: {sorted(tools)}"
        if not isinstance(call.arguments, dict):
            return f"Error: arguments of {call.name!r} are not a JSON object: {str(call.arguments)[:200]}"
        try:
            if inspect.iscoroutinefunction(tool.fn):
                out = await asyncio.wait_for(tool.fn(**call.arguments), timeout=timeout_s)
            else:
                out = await pool.run(functools.partial(tool.fn, **call.arguments), timeout_s=timeout_s)
        except (asyncio.TimeoutError, WorkerTimeout):
            stats.timeouts += 1
            return f"Error: tool {call.name!r} timed out after {timeout_s} s"
        except Exception as exc:  # noqa: BLE001 - returned to the model, counted
            return f"Error: tool {call.name!r} raised {type(exc).__name__}: {str(exc)[:300]}"
        ok = True
        return _as_text(out)
    finally:
        stats.calls += 1
        stats.errors += 0 if ok else 1
        stats.seconds += time.monotonic() - t0
        stats.spans.append((call.name, w0, time.time(), ok))


async def run_tool_calls(calls: list[ToolCall], tools: list[Tool], timeout_s: float,
                         stats: ToolStats, pool: WorkerPool | None = None) -> list[dict[str, str]]:
    """Run ``calls`` concurrently (module docstring); one ``{"role": "tool", "name",
    "content"}`` message per call, in call order. ``pool``: where synchronous tools run
    (default: a pool of ``len(calls)`` threads of its own)."""
    by_name = {t.name: t for t in tools}
    pool = pool or WorkerPool(max(1, len(calls)), "agent-tool")
    outs = await asyncio.gather(*(_run_one(c, by_name, timeout_s, stats, pool) for c in calls))
    return [{"role": "tool", "name": c.name, "content": o} for c, o in zip(calls, outs)]
