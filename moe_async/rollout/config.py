"""Rollout (task, sampling, reward) section of an experiment config."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RolloutConfig(BaseModel):
    """Prompts, sampling and rewards.

    A step trains on ``prompts_per_step`` GRPO groups of ``n_samples_per_prompt`` samples.
    """

    model_config = ConfigDict(extra="forbid")

    task: str = Field("basic_arithmetic", description="reasoning-gym dataset name.")
    task_kwargs: dict[str, Any] = Field(default_factory=dict, description="reasoning-gym args.")
    train_size: int = Field(2000, ge=1, description="Training problems generated.")
    eval_size: int = Field(48, ge=0, description="Held-out problems (fixed, disjoint seed).")
    data_seed: int = 42
    eval_seed: int = 4242
    prompt_style: str = Field("one_shot", description="'one_shot' or 'plain' chat prompt.")
    n_samples_per_prompt: int = Field(4, ge=1, description="G: samples per group.")
    prompts_per_step: int = Field(4, ge=1, description="B: groups per training step.")
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = off.")
    eval_max_new_tokens: int = Field(32, ge=1)
    max_concurrent_groups: int = Field(4, ge=1, description="Groups generating at once.")
    reward_timeout_s: float = Field(10.0, gt=0, description="Per-sample reward timeout.")
    partial_rollout: bool = Field(
        True, description="Resume aborted requests from their prefix (else restart)."
    )
