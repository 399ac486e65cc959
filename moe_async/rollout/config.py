"""Rollout (task, sampling, reward) section of an experiment config."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from moe_async.agent.config import AgentConfig
from moe_async.config_base import ConfigModel
from moe_async.types import JsonDict

# reasoning-gym settings with GRPO signal for the CPU demo model (see shared/notes/demo.md):
# two terms, +/- only, 1 digit, no parentheses and no negated terms (reasoning-gym's defaults
# allow both: "-( -3 - -9 )" brings the model to 6% at T=1 and 12% greedy, with almost no
# group of mixed rewards; without them it is 56% at T=1 and 81% greedy, half the groups
# mixed). Used when ``task_kwargs`` is not given for that task. The task has 242 distinct
# problems: keep ``train_size`` small enough (e.g. 120) to leave held-out problems.
DEMO_TASK_KWARGS: dict[str, JsonDict] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
}


class RolloutConfig(ConfigModel):
    """Prompts, sampling and rewards.

    A step trains on ``prompts_per_step`` GRPO groups of ``n_samples_per_prompt`` samples.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    task: str = Field("basic_arithmetic", description="reasoning-gym dataset name.")
    task_kwargs: JsonDict = Field(default_factory=dict, description="reasoning-gym args.")
    train_size: int = Field(2000, ge=1, description="Training problems generated.")
    eval_size: int = Field(48, ge=0, description="Held-out problems (fixed, disjoint seed).")
    data_seed: int = 42
    eval_seed: int = 4242
    prompt_style: str = Field("one_shot", description="'one_shot' or 'plain' chat prompt.")
    n_samples_per_prompt: int = Field(
        4,
        ge=1,
        description=(
            "G: samples per group. A training run needs >= 2 (checked by the experiment config): "
            "GRPO's group-relative advantage of a group of one sample is always 0."
        ),
    )
    prompts_per_step: int = Field(4, ge=1, description="B: groups per training step.")
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = off.")
    sampling_seed: int | None = Field(
        None,
        description="Seed every request's sampling (SGLang's sampling_params.sampling_seed) from this seed, "
        "the prompt's draw (epoch and index), the sample's index in its group and the tokens it has so far, so that a run's "
        "samples do not depend on which engine serves them or on timing (a sync-mode run repeats its "
        "batches); None = unseeded.",
    )
    eval_max_new_tokens: int = Field(32, ge=1)
    eval_interval: int = Field(
        0, ge=0,
        description=(
            "Held-out curve (moe_async/rollout/evaluation.py): evaluate at step 0, every N steps and at "
            "the last step (greedy accuracy and mean@k at the training temperature, +- standard error "
            "over problems, as eval/* metrics); 0 = off (only eval_before/eval_after, greedy)."
        ),
    )
    eval_k: int = Field(4, ge=1, description="k: samples per held-out problem for eval/mean_at_k (eval_interval > 0).")
    eval_concurrency: int | None = Field(
        None, ge=1,
        description="Held-out curve: problems evaluated at once; each sends its greedy and eval_k sampled requests "
        "together, so an engine prefills their shared prompt once. None = max_concurrent_groups. Size it so that "
        "eval_concurrency x (eval_k + 1) fills engine.max_running_requests x the engines.",
    )
    eval_timeout_s: float = Field(
        3600.0, gt=0,
        description="The most seconds one held-out evaluation (eval_before/eval_after, a curve point) may take; "
        "past it the run fails naming the evaluation and this field.",
    )
    max_concurrent_groups: int = Field(4, ge=1, description="Groups generating at once.")
    reward_timeout_s: float = Field(10.0, gt=0, description="Per-sample reward timeout.")
    partial_rollout: bool = Field(
        True, description="Resume aborted requests from their prefix (else restart)."
    )
    system_prompt: str = Field(
        "You are a helpful assistant. Solve the problem and end with 'The answer is N.'",
        description="Explicit short system prompt (avoids the template's injected default).",
    )
    max_abort_retries: int = Field(
        16, ge=0, description="Resubmissions of an aborted request before its group is dropped."
    )
    return_routed_experts: bool = Field(False, description="Ask engines for routed experts (R3).")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Multi-turn trajectories: environments, "
                               "tools, budgets (moe_async/agent).")
    max_consecutive_reward_errors: int = Field(
        100,
        ge=0,
        description=(
            "Stop the run (RewardFailureError naming the reward setting and the last error) after "
            "this many scored samples in a row whose reward raised, timed out or was not a finite "
            "number (training and eval; each is scored 0 and counted in rollout/reward_errors); "
            "before any sample has scored, one step's samples (prompts_per_step * n_samples_per_prompt, "
            "timeouts included) when fewer. 0: never stop."
        ),
    )
    reward_workers: int = Field(2, ge=1, description="Reward worker processes/threads.")
    reward_use_processes: bool = Field(
        True, description="Score in worker processes (a hung scorer is killed) instead of threads."
    )
    admit_poll_s: float = Field(0.05, gt=0, description="Sleep between refused admissions.")
    # --- dynamic filtering (DAPO dynamic sampling; moe_async/rollout/manager.py) ---
    dynamic_filter: bool = Field(
        False,
        description=(
            "Drop groups whose G rewards are all equal (zero GRPO advantage: no gradient) before "
            "the buffer and generate another group in their place (DAPO, Yu et al., 2025)."
        ),
    )
    dynamic_filter_max_per_version: int = Field(
        8,
        description=(
            "Cap on wasted generations, >= 1: at most this many groups are filtered per engine "
            "weight version; later all-equal groups of that version are kept (counted as "
            "rollout/filter_cap_passed) so a task with no signal cannot stall training. (0 would "
            "filter nothing: set dynamic_filter=false instead.)"
        ),
    )
    # --- rewards (moe_async/rollout/rewards.py) ---
    reward: Literal["reasoning_gym", "math_verify", "function", "remote"] = Field(
        "reasoning_gym",
        description=(
            "Scorer: the task's reasoning-gym scorer (exact match), math-verify on \\boxed{} "
            "answers, a user function (reward_function) or a reward model over HTTP (reward_url)."
        ),
    )
    reward_function: str | None = Field(
        None, description="'package.module:function' called as fn(response, answer, question) -> number."
    )
    reward_url: str | None = Field(
        None, description="POST endpoint of a remote reward model: JSON in, {'reward': number} out."
    )

    @field_validator("dynamic_filter_max_per_version")
    @classmethod
    def _check_filter_cap(cls, v: int) -> int:
        if v < 1:
            raise ValueError(
                "must be >= 1: a cap of 0 groups per weight version would keep every "
                "all-equal group, i.e. filter nothing; set rollout.dynamic_filter=false to turn "
                "filtering off")
        return v

    @model_validator(mode="after")
    def _defaults(self) -> "RolloutConfig":
        if "task_kwargs" not in self.model_fields_set and self.task in DEMO_TASK_KWARGS:
            self.task_kwargs = dict(DEMO_TASK_KWARGS[self.task])
        _check_task(self.task, self.task_kwargs)
        if self.prompt_style not in ("one_shot", "plain"):
            raise ValueError(f"rollout.prompt_style must be 'one_shot' or 'plain', got {self.prompt_style!r}")
        if self.reward == "function":
            from moe_async.rollout.rewards import resolve_import_path

            resolve_import_path(self.reward_function, "rollout.reward_function")  # fail at load
        if self.reward == "remote" and not (self.reward_url or "").startswith(("http://", "https://")):
            raise ValueError(f"rollout.reward_url must be an http(s) URL when rollout.reward='remote', got {self.reward_url!r}")
        return self


def _check_task(task: str, task_kwargs: JsonDict) -> None:
    """Fail at config load, naming the field, on a task reasoning-gym does not know or on
    ``task_kwargs`` its dataset refuses (not 25 s into ``train`` inside a Ray actor)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"rollout.task={task!r} is not a reasoning-gym dataset (e.g. {sorted(DATASETS)[:8]}...)")
    try:
        reasoning_gym.create_dataset(task, seed=0, size=1, **task_kwargs)
    except Exception as e:  # noqa: BLE001 - TypeError (unknown arg) or the config's own check
        raise ValueError(f"rollout.task_kwargs={task_kwargs!r} refused by {task!r}: {type(e).__name__}: {e}") from e
