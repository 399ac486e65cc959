"""A deterministic reward for random-init models (tests only): the arithmetic task scores a
random model's text 0 every time, so every GRPO advantage would be 0 and a parity test would
compare only the aux loss. ``fn(response, answer, question)`` as ``rollout.reward='function'``
takes it."""


def char_parity(response: str, answer: str, question: str) -> float:  # noqa: ARG001
    """1.0 when the response's code points sum to an even number, else 0.0."""
    return float(sum(map(ord, response)) % 2 == 0)
