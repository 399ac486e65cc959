"""Toy rewards a tiny random-init model can learn in a minute: the learning test's task.

``first_half_letters(response, answer, question)``: the fraction of the response's characters
in ``a``-``m`` (0 for an empty response), in ``[0, 1]``; about 0.42 for a random-init model, 1.0
for a policy emitting only those letters.

Design notes: ``docs/design/rollout.md``."""

from __future__ import annotations

FIRST_HALF = frozenset("abcdefghijklm")


def first_half_letters(response: str, answer: str = "", question: str = "") -> float:
    """Fraction of the response's characters that are lowercase ``a``-``m`` (see the module)."""
    if not response:
        return 0.0
    return sum(c in FIRST_HALF for c in response) / len(response)
