"""Built-in environments and tools (registered by name; selected in moe_async/agent/env.py).

- ``answer_retry`` (:class:`AnswerRetryEnv`): the model answers; a correct answer (the row's
  label, compared after number normalisation) ends the trajectory with reward 1.0, a wrong
  one gets the user reply ``"Wrong, try again."`` until ``max_turns`` model turns; reward 0.0
  then. Good for a demo model: a second chance it can learn to use.
- tool ``calculator``: evaluates ``+ - * / ( )`` on numbers (Python's ``ast``, no ``eval``).
"""

from __future__ import annotations

import ast
import operator
import time
from collections.abc import Callable

from moe_async.agent.env_base import EnvStep, TextEnv, register_env
from moe_async.agent.tools import Tool
from moe_async.types import JsonDict


@register_env("answer_retry")
class AnswerRetryEnv(TextEnv):
    """Answer checker with retries (module docstring). ``extras``: SkyRL-gym's
    ``reward_spec.ground_truth``; ``env_config.retry_message`` overrides the reply,
    ``env_config.step_delay_s`` makes each step take that long (a slow tool's latency)."""

    def __init__(self, env_config: JsonDict | None = None, extras: JsonDict | None = None):
        super().__init__(env_config, extras)
        self.answer = str(self.extras.get("reward_spec", {}).get("ground_truth", ""))
        self.retry = str(self.env_config.get("retry_message", "Wrong, try again."))
        self.step_delay_s = float(self.env_config.get("step_delay_s", 0.0))

    def step(self, action: str) -> EnvStep:
        from moe_async.rollout.tasks import _clean_number, extract_answer

        if self.step_delay_s > 0:  # a stand-in for a slow tool or sandbox (tools/bench_async.py)
            time.sleep(self.step_delay_s)

        got = extract_answer(action)
        ok = got is not None and _clean_number(got) == _clean_number(self.answer)
        if ok:
            return EnvStep(reward=1.0, done=True, metadata={"correct": True})
        return EnvStep(observations=[{"role": "user", "content": self.retry}], reward=0.0, done=False,
                       metadata={"correct": False})


_OPS: dict[type, Callable[..., float]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    raise ValueError(f"not an arithmetic expression: {ast.dump(node)[:80]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses."""
    v = _arith(ast.parse(str(expression), mode="eval"))
    return str(int(v)) if float(v).is_integer() else str(v)


TOOLS: dict[str, Tool] = {
    "calculator": Tool.from_function(calculator, parameters={
        "type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
        "required": ["expression"]}),
}


def resolve_tools(names: list[str]) -> list[Tool]:
    """Tools by name (:data:`TOOLS`) or ``module:attribute`` (a :class:`Tool`). ValueError
    naming the entry and the known names."""
    import importlib

    out = []
    for n in names:
        if n in TOOLS:
            out.append(TOOLS[n])
            continue
        mod, _, attr = n.partition(":")
        try:
            t = getattr(importlib.import_module(mod), attr) if attr else None
        except (ImportError, AttributeError):
            t = None
        if not isinstance(t, Tool):
            raise ValueError(f"rollout.agent.tools: {n!r} is neither a built-in tool {sorted(TOOLS)} "
                             "nor 'module:attribute' of a moe_async.agent.tools.Tool")
        out.append(t)
    return out
