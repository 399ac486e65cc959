"""One multi-turn trajectory: model turns through the engine, observations from tools or the
environment, appended token in / token out (moe_async/agent/trajectory.py).

Per turn::

    turn  = await generate_turn(trajectory.ids, max_new)   # one /generate (the manager's
                                                           # partial rollouts and pause modes)
    calls = SGLang's parser on the turn's text
    calls ? observations = await tools (concurrent, per-call timeout)
          : observations, reward, done = env.step(text)
    trajectory += chat-template tokens of the observations (checked against the full render)

Each turn is its own request (a trajectory waiting on a tool or ``env.step``, run on
:mod:`moe_async.agent.workers`, holds none). A step past ``agent.env_step_timeout_s``, or
one that raises or returns a malformed result, ends the trajectory with
``metadata['agent_error']`` (the sample's ``reward_error``; ``env_timeouts`` / ``env_errors``);
so do done, ``agent.max_turns`` turns, or ``agent.max_trajectory_tokens`` (``'length'``).
Reward: the sum of step rewards."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from moe_async.agent.config import AgentConfig
from moe_async.agent.env_base import Env, as_step
from moe_async.agent.template import ChatRenderer, TemplateMismatch
from moe_async.agent.tools import Tool, ToolStats, parse_tool_calls, run_tool_calls
from moe_async.agent.trajectory import Trajectory
from moe_async.agent.workers import WorkerPool, WorkerTimeout
from moe_async.types import Sample, Tokenizer

GenerateTurn = Callable[[list[int], int], Awaitable[Sample]]


@dataclass
class TrajectoryStats:
    """Per-trajectory metrics: model turns, observation tokens, template mismatches (with
    their descriptions), environment steps and the tool counters."""

    turns: int = 0
    obs_tokens: int = 0
    env_steps: int = 0
    env_timeouts: int = 0
    env_errors: int = 0
    template_mismatches: int = 0
    mismatch_notes: list[str] = field(default_factory=list)
    tools: ToolStats = field(default_factory=ToolStats)

    def as_metrics(self) -> dict[str, float]:
        return {"turns": self.turns, "tool_calls": self.tools.calls, "tool_errors": self.tools.errors,
                "tool_timeouts": self.tools.timeouts, "tool_seconds": self.tools.seconds,
                "observation_tokens": self.obs_tokens, "template_mismatches": self.template_mismatches,
                "env_steps": self.env_steps, "env_timeouts": self.env_timeouts, "env_errors": self.env_errors}


def assistant_text(tokenizer: Tokenizer, ids: list[int], eos_ids: set[int]) -> str:
    """A model turn's content as a chat message: its sampled ids decoded with special tokens,
    less the end-of-turn token the template writes itself."""
    body = ids[:-1] if ids and ids[-1] in eos_ids else ids
    return tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)


async def run_trajectory(env: Env, env_name: str, prompt: list[dict], renderer: ChatRenderer,
                         generate_turn: GenerateTurn, cfg: AgentConfig, max_new_tokens: int,
                         tools: list[Tool] | None = None, eos_token_ids: list[int] | None = None,
                         max_context_len: int | None = None, pool: WorkerPool | None = None
                         ) -> tuple[Sample, TrajectoryStats]:
    """Run one trajectory (module docstring); ``env`` is closed before returning. Returns
    the trainable sample (``loss_mask`` over the sampled tokens, ``reward`` the summed step
    rewards, ``metadata['agent']`` the stats) and the stats. ``pool``: where synchronous tools
    and ``env.step`` run (default: one of ``agent.workers`` threads for this trajectory)."""
    tools = list(tools or [])
    eos = {int(t) for t in (eos_token_ids or [])}
    tok = renderer.tokenizer
    stats = TrajectoryStats()
    reward, finish = 0.0, "stop"
    error: str | None = None
    pool = pool or WorkerPool(cfg.workers, "agent-worker")
    try:
        conversation, _ = env.init(list(prompt))
        conversation = list(conversation)
        traj = Trajectory(prompt_ids=renderer.prompt_ids(conversation))
        done = False
        while not done:
            room = cfg.max_trajectory_tokens - len(traj.response_ids)
            if max_context_len is not None:
                room = min(room, max_context_len - len(traj.ids))
            if stats.turns >= cfg.max_turns or room <= 0:
                finish = "length" if room <= 0 else finish
                break
            turn = await generate_turn(traj.ids, min(max_new_tokens, room))
            traj.add_turn(turn)
            stats.turns += 1
            finish = turn.finish_reason
            text = assistant_text(tok, turn.response_ids, eos)
            conversation.append({"role": "assistant", "content": text})
            _, calls = parse_tool_calls(text, tools, cfg.tool_parser)
            if calls:
                obs = await run_tool_calls(calls, tools, cfg.tool_timeout_s, stats.tools, pool)
            else:
                action = tok.decode(turn.response_ids, skip_special_tokens=True)
                # on a worker thread: a slow environment (a sandbox, a judge) holds neither the
                # event loop nor an engine slot while other trajectories generate
                try:
                    out = await pool.run(functools.partial(env.step, action), timeout_s=cfg.env_step_timeout_s)
                except WorkerTimeout as exc:
                    stats.env_timeouts += 1
                    error = (f"environment {env_name!r}: step() timed out (rollout.agent.env_step_timeout_s="
                             f"{cfg.env_step_timeout_s:g}): {exc}")
                    break
                except Exception as exc:  # the environment's own failure ends this trajectory only
                    stats.env_errors += 1
                    error = f"environment {env_name!r}: step() raised {type(exc).__name__}: {exc}"
                    break
                try:
                    step = as_step(out, env_name, type(env).__name__)
                except ValueError as exc:  # a malformed step result: named, this trajectory only
                    stats.env_errors += 1
                    error = str(exc)
                    break
                stats.env_steps += 1
                reward += step.reward
                obs, done = step.observations, step.done
            if done or not obs or stats.turns >= cfg.max_turns:
                break
            ids, mm = renderer.observation_ids(conversation, obs, traj.ids, turn.response_ids)
            _count(stats, mm)
            conversation += obs
            traj.add_observation(ids)
            stats.obs_tokens += len(ids)
        if not stats.template_mismatches:  # one named event per trajectory, not one per later check
            end = len(traj.prompt_ids) + (traj.turn_spans[-1][1] if traj.turn_spans else 0)
            _count(stats, renderer.final_check(conversation, traj.ids[:end]))
    finally:
        env.close()
    sample = traj.to_sample(finish if finish in ("stop", "length") else "length")
    sample.reward = reward
    sample.metadata["agent"] = stats.as_metrics()
    if error is not None:
        sample.metadata["agent_error"] = error
    if stats.mismatch_notes:
        sample.metadata["template_mismatch"] = stats.mismatch_notes[0]
    sample.metadata["tool_spans"] = [list(s) for s in stats.tools.spans]
    sample.metadata["conversation_len"] = len(conversation)
    return sample, stats


def _count(stats: TrajectoryStats, mm: TemplateMismatch | None) -> None:
    if mm is not None:
        stats.template_mismatches += 1
        stats.mismatch_notes.append(mm.describe())
