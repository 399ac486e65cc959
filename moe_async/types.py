"""Data records that flow through the loop: rollout -> reward -> buffer -> trainer.

Legend (shapes): ``R`` = response tokens of one sample, ``P`` = prompt tokens,
``L`` = MoE layers, ``K`` = router top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Sample:
    """One generated response to one prompt.

    Attributes:
        prompt_ids: ``[P]`` int token ids sent to the engine (chat template applied).
        response_ids: ``[R]`` int token ids the engine generated (eos included when it stopped).
        rollout_logprobs: ``[R]`` float logprob (natural log) of each response token under the
            engine's weights, as returned in SGLang's ``output_token_logprobs``.
        weight_versions: ``[R]`` int weight_version of the engine weights that produced each
            response token. A sample's staleness is measured from ``min(weight_versions)``.
        finish_reason: ``"stop"`` (eos/stop token), ``"length"`` (max_new_tokens or context),
            ``"abort"`` (aborted and not resumed).
        reward: scalar reward (float), set by the reward stage.
        reward_error: ``None`` or a short reason when the reward function failed/timed out.
        answer: gold answer of the task, used by the reward.
        response_text: decoded response.
        routed_experts: ``None`` or ``[P + R - 1, L, K]`` uint8/int16 expert ids, as SGLang returns.
        loss_weight: 1.0 normally; 0.0 for samples that must not contribute to the loss
            (e.g. 0-token completions).
        metadata: free-form task metadata (task name, problem index ...).
        teacher_logprobs: ``None`` (no teacher, or it failed on this sample) or ``[R]`` float
            logprob (natural log) of each response token under the distillation teacher
            (moe_async/distill), given the teacher's prompt.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    reward: float = 0.0
    reward_error: str | None = None
    answer: str = ""
    response_text: str = ""
    routed_experts: np.ndarray | None = None
    loss_weight: float = 1.0
    metadata: dict[str, Any] = field(default_factory=dict)
    teacher_logprobs: list[float] | None = None

    @property
    def oldest_version(self) -> int:
        """Oldest weight_version among the response tokens (``-1`` for an empty response)."""
        return min(self.weight_versions) if self.weight_versions else -1

    def validate(self) -> None:
        """Raise ``ValueError`` when per-token lists disagree in length."""
        n = len(self.response_ids)
        t = self.teacher_logprobs
        if len(self.rollout_logprobs) != n or len(self.weight_versions) != n or (t is not None and len(t) != n):
            raise ValueError(
                f"sample lengths disagree: response_ids={n}, rollout_logprobs="
                f"{len(self.rollout_logprobs)}, weight_versions={len(self.weight_versions)}"
                + ("" if t is None else f", teacher_logprobs={len(t)}")
            )


@dataclass
class Group:
    """A GRPO group: ``G`` samples for the same prompt; admitted to or dropped from the
    buffer as a whole.

    Attributes:
        group_id: unique, increasing id assigned by the rollout manager.
        samples: the ``G`` samples.
        start_version: engine weight_version when generation of the group was admitted.
    """

    group_id: int
    samples: list[Sample]
    start_version: int = 0

    @property
    def oldest_version(self) -> int:
        """Oldest token version over all samples (``start_version`` if none has tokens)."""
        vs = [s.oldest_version for s in self.samples if s.weight_versions]
        return min(vs) if vs else self.start_version

    @property
    def num_tokens(self) -> int:
        """Number of response tokens in the group."""
        return sum(len(s.response_ids) for s in self.samples)
