"""Toy rewards a tiny random-init model can learn in a minute: the learning test's task.

Named in a config as ``rollout.reward: function`` with
``rollout.reward_function: moe_async.rollout.toy_rewards:first_half_letters`` (called as
``fn(response, answer, question)``, :class:`moe_async.rollout.rewards.FunctionReward`); the
prompts are the task's own (any ``rollout.task``), the answer is ignored.

``first_half_letters``: ``r = |{c in response : c in "abcdefghijklm"}| / len(response)``
(0 for an empty response), in ``[0, 1]``. A random-init model samples tokens near-uniformly
from the 49152-token SmolLM2 vocabulary (entropy 10.79 nats of log V = 10.80 for the smoke
model), which scores about 0.42 per 8-token sample with a spread of about 0.1 inside a group:
every GRPO group has a signal. The reward is maximised (1.0) by emitting tokens made of those
letters only (e.g. repeating ``a``), a context-independent preference the policy reaches by
concentrating its mass on rewarded tokens; with the smoke model, 4 prompts x 4 samples x 8
tokens per step and Adam at lr 3e-2, plain GRPO in PyTorch reached 1.0 in about 23 steps and
stayed at 0.42 without updates.
"""

from __future__ import annotations

FIRST_HALF = frozenset("abcdefghijklm")


def first_half_letters(response: str, answer: str = "", question: str = "") -> float:
    """Fraction of the response's characters that are lowercase ``a``-``m`` (see the module)."""
    if not response:
        return 0.0
    return sum(c in FIRST_HALF for c in response) / len(response)
