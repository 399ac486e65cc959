"""``rollout.agent``: multi-turn agentic rollouts (environments, tools, budgets)."""

from __future__ import annotations


from pydantic import ConfigDict, Field

from moe_async.config_base import ConfigModel
from moe_async.types import JsonDict


class AgentConfig(ConfigModel):
    """Multi-turn rollouts: each sample is a trajectory of model turns and environment
    observations (moe_async/agent). Off unless ``env_class`` is set or rows carry one."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(False, description="Generate every train sample as a multi-turn trajectory.")
    env_class: str | None = Field(
        None, description="Environment for rows without an env_class of their own: a name of "
        "moe_async.agent.env.ENVS, or a SkyRL-gym id ('skyrl_gym:gsm8k_multi_turn').")
    env_config: JsonDict = Field(default_factory=dict, description="Passed to the environment as env_config.")
    max_turns: int = Field(3, ge=1, description="Model turns per trajectory (the turn budget).")
    max_trajectory_tokens: int = Field(
        1024, ge=1, description="Response tokens per trajectory (model turns + observations); the "
        "turn that would pass it is cut, and the trajectory ends (finish_reason 'length').")
    tools: list[str] = Field(default_factory=list, description="Tools offered to the model: names in "
                             "moe_async.agent.builtin.TOOLS or 'module:attribute' of a Tool.")
    tool_parser: str = Field("qwen25", description="SGLang function-call parser (sglang/srt/function_call): "
                             "'qwen25' (Qwen2.5/Qwen3 Hermes-style <tool_call>), 'deepseekv3', 'llama3', ...")
    tool_timeout_s: float = Field(10.0, gt=0, description="Per tool call; a call past it is an error observation.")
    env_step_timeout_s: float = Field(
        60.0, gt=0, description="Per environment step (env.step); a step past it ends the trajectory with an "
        "error (the sample's reward_error, counted in rollout/reward_errors and rollout/agent/env_timeouts).")
    workers: int = Field(32, ge=1, description="Threads of the dedicated pool running synchronous tools and "
                         "environment steps (daemon threads: a hung call never blocks shutdown).")
