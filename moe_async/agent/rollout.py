"""The rollout manager's multi-turn side: which rows are trajectories, and how one is made.

:class:`AgentRollout` is built by :class:`~moe_async.rollout.manager.RolloutManager` when
``rollout.agent.enabled``; for each train sample of such a row it makes the row's
environment (moe_async/agent/env.py), runs :func:`~moe_async.agent.loop.run_trajectory`
with the manager's own per-turn generation (partial rollouts, pause modes, engine routing)
and keeps the counters the manager reports as ``rollout/agent/<name>`` (turns, tool calls,
tool errors, tool timeouts, tool seconds, observation tokens, template mismatches,
environment steps and step timeouts, trajectories).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable

from moe_async.agent.builtin import resolve_tools
from moe_async.agent.config import AgentConfig
from moe_async.agent.env import env_class_of, make_env
from moe_async.agent.loop import GenerateTurn, run_trajectory
from moe_async.agent.template import ChatRenderer
from moe_async.agent.workers import WorkerPool
from moe_async.types import Sample, Tokenizer

log = logging.getLogger(__name__)


class AgentRollout:
    """Trajectories for rows with an environment (module docstring)."""

    def __init__(self, cfg: AgentConfig, tokenizer: Tokenizer | None, messages_of: Callable[[object], list[dict]], eos_token_ids: list[int] | None = None,
                 max_context_len: int | None = None):
        if tokenizer is None:
            raise ValueError("rollout.agent needs the dataset's tokenizer (chat template) to render observations")
        self.cfg = cfg
        self.tools = resolve_tools(cfg.tools)
        if self.tools:  # at start-up, not in every group: the parser must import and exist
            from moe_async.agent.tools import _sglang_parser

            try:
                _sglang_parser(cfg.tool_parser, self.tools)
            except ImportError as exc:
                raise RuntimeError(
                    f"rollout.agent.tools={cfg.tools}: SGLang's function-call parsers do not import here "
                    f"({type(exc).__name__}: {exc}); install them: pip install -e '.[agent]' and pip install "
                    "--no-deps sglang==0.5.23 xgrammar==0.2.7 (docs/features.md, multi-turn rollouts)") from exc
        self.renderer = ChatRenderer(tokenizer, [t.schema for t in self.tools])
        self.messages_of = messages_of
        self.eos_token_ids = list(eos_token_ids or [])
        self.max_context_len = max_context_len
        self.counters: defaultdict[str, float] = defaultdict(float)
        self._mismatch_logged = False
        self.pool = WorkerPool(cfg.workers, "agent-worker")  # sync tools and env.step, all trajectories

    def env_class(self, problem: object) -> str | None:
        """The environment of ``problem``'s trajectory, or None (single-turn)."""
        return env_class_of(problem, self.cfg.env_class)

    async def sample(self, problem: object, generate_turn: GenerateTurn, max_new_tokens: int,
                     count: bool = True) -> Sample:
        """One trajectory of ``problem`` as a trainable sample (reward set from the
        environment); ``count``: add it to :meth:`metrics` (False for evals). ValueError when
        the row names no environment."""
        name = self.env_class(problem)
        if name is None:
            raise ValueError("rollout.agent.enabled but neither rollout.agent.env_class nor the row's env_class is set")
        env = make_env(name, problem, self.cfg.env_config)
        s, st = await run_trajectory(env, name, self.messages_of(problem), self.renderer, generate_turn, self.cfg,
                                     max_new_tokens, tools=self.tools, eos_token_ids=self.eos_token_ids,
                                     max_context_len=self.max_context_len, pool=self.pool)
        if count:
            self.counters["trajectories"] += 1
            for k, v in st.as_metrics().items():
                self.counters[k] += v
        if st.mismatch_notes and not self._mismatch_logged:
            self._mismatch_logged = True
            log.warning("%s (counted in rollout/agent/template_mismatches; further ones only counted)",
                        st.mismatch_notes[0])
        return s

    def metrics(self) -> dict[str, float]:
        """Cumulative ``rollout/agent/<name>`` counters and per-trajectory means."""
        m = {f"rollout/agent/{k}": float(v) for k, v in self.counters.items()}
        n = self.counters["trajectories"]
        if n:
            m["rollout/agent/turns_per_trajectory"] = self.counters["turns"] / n
        return m
