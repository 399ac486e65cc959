"""A multi-turn trajectory as ONE token sequence (token in, token out).

``prompt_ids [P]`` then, per turn, the engine's sampled ids of the model turn (mask 1) and
the observation's ids (mask 0: tool results, environment replies, chat-template glue). The
trajectory is never re-tokenised: model tokens are exactly what the engine returned, and
every model token keeps its rollout logprob, weight_version and routed experts from the
request that sampled it (a turn continued after a weight update keeps each segment's).

Routes: a turn's request re-feeds the whole sequence so far, so its ``routed_experts`` has
``len(input) + R - 1`` rows; they are joined with the kept ones by the partial-rollout rule
(:func:`moe_async.replay.routes.join_segments`): rows of tokens already routed when they were
sampled keep those routes, the rest (the previous model turn's last token, the observation,
this turn) come from this turn's request. Shapes: ``R`` response tokens (all turns and
observations after the prompt), ``L`` MoE layers, ``K`` top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_async.types import Sample


@dataclass
class Trajectory:
    """The growing sequence of one multi-turn rollout (module docstring).

    Attributes:
        prompt_ids: ``[P]`` the initial conversation rendered with the generation prompt.
        response_ids / loss_mask / rollout_logprobs / weight_versions: ``[R]`` each, aligned.
        routed_experts: None or ``[P + R' - 1, L, K]`` where ``R'`` is the response length at
            the end of the last model turn (observations after it get their rows from the next
            turn's request).
        turn_spans: ``(start, end)`` in ``response_ids`` of each model turn.
        obs_spans: ``(start, end)`` in ``response_ids`` of each observation.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    routed_experts: np.ndarray | None = None
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    obs_spans: list[tuple[int, int]] = field(default_factory=list)
    aborts: int = 0
    _routed_len: int = 0  # tokens the kept routes cover (their rows + 1)

    @property
    def ids(self) -> list[int]:
        """The whole sequence: ``prompt_ids + response_ids`` (the next turn's input)."""
        return list(self.prompt_ids) + self.response_ids

    @property
    def num_model_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def add_turn(self, turn: Sample) -> None:
        """Append one model turn: ``turn`` is the engine's reply to ``self.ids`` (its
        ``prompt_ids`` must equal them): its sampled ids, logprobs, per-token versions and
        routes (``[len(ids) + R_turn - 1, L, K]`` or None). ValueError when the turn was
        generated from another sequence or its per-token lists disagree."""
        turn.validate()
        if list(turn.prompt_ids) != self.ids:
            raise ValueError("model turn was not generated from the trajectory's sequence "
                             f"({len(turn.prompt_ids)} input tokens, trajectory has {len(self.ids)})")
        start = len(self.response_ids)
        n_in = len(turn.prompt_ids)
        self.response_ids += [int(t) for t in turn.response_ids]
        self.loss_mask += [1] * len(turn.response_ids)
        self.rollout_logprobs += [float(x) for x in turn.rollout_logprobs]
        self.weight_versions += [int(v) for v in turn.weight_versions]
        self.turn_spans.append((start, len(self.response_ids)))
        self.aborts += int(turn.metadata.get("aborts", 0))
        if turn.routed_experts is not None:
            from moe_async.replay.routes import compact_routes, join_segments

            prev = self.routed_experts if self._routed_len else None
            joined = join_segments(prev, self._routed_len, turn.routed_experts, n_in + len(turn.response_ids))
            assert joined is not None  # this turn's routes were joined
            self.routed_experts = compact_routes(joined)
            self._routed_len = n_in + len(turn.response_ids)

    def add_observation(self, ids: list[int]) -> None:
        """Append observation token ids (mask 0, logprob 0.0, the last model token's version:
        the staleness of a trajectory is its oldest SAMPLED token's)."""
        if not ids:
            return
        start = len(self.response_ids)
        v = self.weight_versions[-1] if self.weight_versions else -1
        self.response_ids += [int(t) for t in ids]
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)
        self.weight_versions += [v] * len(ids)
        self.obs_spans.append((start, len(self.response_ids)))

    def model_versions(self) -> list[int]:
        """Per-token weight_version of the sampled tokens only."""
        return [v for v, m in zip(self.weight_versions, self.loss_mask) if m]

    def to_sample(self, finish_reason: str) -> Sample:
        """The trajectory as one trainable :class:`Sample` (``loss_mask`` set). Routes cover
        the sequence up to the last model token; the trailing observation (none when the
        episode ended on a model turn) has no rows and is dropped from the sample, since
        nothing after it is trained."""
        resp, mask = list(self.response_ids), list(self.loss_mask)
        lps, vs = list(self.rollout_logprobs), list(self.weight_versions)
        end = self.turn_spans[-1][1] if self.turn_spans else 0
        resp, mask, lps, vs = resp[:end], mask[:end], lps[:end], vs[:end]
        routed = self.routed_experts
        if routed is not None:
            from moe_async.replay.routes import truncate_routes

            routed = truncate_routes(routed, len(self.prompt_ids) + end)
        # an empty-response first turn leaves no oldest token: versions stay as the engine gave
        s = Sample(prompt_ids=list(self.prompt_ids), response_ids=resp, rollout_logprobs=lps,
                   weight_versions=vs, finish_reason=finish_reason, routed_experts=routed, loss_mask=mask)
        s.metadata["aborts"] = self.aborts
        s.metadata["turn_spans"] = [list(t) for t in self.turn_spans]
        s.metadata["obs_spans"] = [list(o) for o in self.obs_spans if o[1] <= end]
        if not any(mask):
            s.loss_weight = 0.0
        s.validate()
        return s
