"""``teacher`` section of an experiment config: who scores the student's tokens, and how the
teacher's logprobs become the advantage."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from moe_async.config_base import ConfigModel
from moe_async.engines.config import EngineConfig


class TeacherConfig(ConfigModel):
    """On-policy distillation (moe_async/distill). Off unless ``enabled``.

    The teacher is either another model (``model_path``) or the student's starting checkpoint
    with another prompt (context distillation: ``few_shot`` worked examples and/or its own
    ``system_prompt``); it is served by its own engine pool (``engine``: the embedded engine on
    CPU, SGLang on GPU), never weight-synced, or by servers already running (``urls``). It must
    share the student's tokenizer: it scores the student's exact token ids.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    model_path: str | None = Field(
        None, description="HF checkpoint directory of the teacher model; None = the student's starting checkpoint "
        "(the prepared model.* checkpoint), frozen.")
    urls: list[str] | None = Field(
        None, description="Teacher servers already running (SGLang /generate); None = start teacher.engine.num_engines "
        "engines serving model_path.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The teacher's engine pool.")
    few_shot: int = Field(0, ge=0, description="Worked examples (user/assistant turns ending 'The answer is N.') "
                          "the teacher sees before the question and the student does not (task prompts only).")
    system_prompt: str | None = Field(None, description="The teacher's system prompt; None = rollout.system_prompt.")
    kl_coef: float = Field(1.0, ge=0, description="Weight of the per-token reverse-KL advantage "
                           "-(logp_student - logp_teacher).")
    reward_coef: float = Field(0.0, ge=0, description="Weight of the task reward's GRPO advantage added to it "
                               "(0: pure distillation; the reward is still scored and reported).")
    topk_forward_kl_coef: float = Field(
        0.0, ge=0, description="Weight of the top-k forward KL loss term sum_j p_T(j) (log p_T(j) - log p_S(j)) over "
        "the teacher's top_k tokens at each response position (moe_async/trainer/loss.py), added to the policy loss "
        "with the same token mean; 0: off (the teacher is then asked for no top-k).")
    top_k: int = Field(20, ge=1, description="Teacher tokens per response position for the top-k forward KL (SGLang's "
                       "top_logprobs_num); at most the vocabulary size. Unused while topk_forward_kl_coef is 0.")
    eval: bool = Field(True, description="Evaluate the teacher once on the held-out problems before training (greedy + "
                       "rollout.eval_k samples, its own prompt, its engines; summary.json eval_teacher, metrics "
                       "eval_teacher/*): the reference for the student's held-out curve. Runs only with "
                       "rollout.eval_interval > 0, not on a resumed run.")
    timeout_s: float = Field(60.0, gt=0, description="Per-sample teacher scoring timeout (s).")
    max_concurrent_requests: int = Field(16, ge=1, description="Teacher requests in flight at once (all engines).")
    max_consecutive_failures: int = Field(
        100, ge=0, description="Stop the run after this many samples in a row the teacher failed to score (error or "
        "timeout; each trains with a zero distillation advantage and is counted in teacher/failures). 0: never.")

    @model_validator(mode="after")
    def _check(self) -> "TeacherConfig":
        if self.enabled and self.kl_coef == 0 and self.reward_coef == 0 and self.topk_forward_kl_coef == 0:
            raise ValueError("teacher.kl_coef, teacher.reward_coef and teacher.topk_forward_kl_coef are all 0: nothing "
                             "would be learned; set teacher.kl_coef > 0 (reverse-KL advantage) or "
                             "teacher.topk_forward_kl_coef > 0 (top-k forward KL loss), or disable the teacher")
        if self.urls is not None and not self.urls:
            raise ValueError("teacher.urls is an empty list: name at least one server, or leave it unset to start "
                             "teacher engines")
        if self.engine.eval_num_threads is not None:
            raise ValueError("teacher.engine.eval_num_threads: only the policy's engines change threads around "
                             "held-out evaluations (engine.eval_num_threads); leave it null")
        return self
