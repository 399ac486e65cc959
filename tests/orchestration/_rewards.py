"""A deterministic reward for random-init models (tests only): the arithmetic task scores a
random model's text 0 every time, so every GRPO advantage would be 0 and a parity test would
compare only the aux loss. ``fn(response, answer, question)`` as ``rollout.reward='function'``
takes it."""


def char_parity(response: str, answer: str, question: str) -> float:  # noqa: ARG001
    """1.0 when the response's code points sum to an even number, else 0.0."""
    return float(sum(map(ord, response)) % 2 == 0)


SLOW_S = 0.75  # seconds per call: 8 samples, 2 reward workers -> about 3 s per batch


def char_parity_slow(response: str, answer: str, question: str) -> float:
    """:func:`char_parity`'s value after :data:`SLOW_S` seconds: a sync run scored with it spends
    seconds waiting for each batch (a pre-emption test's SIGTERM lands in that wait) and trains
    the same batches as with :func:`char_parity`."""
    import time

    time.sleep(SLOW_S)
    return char_parity(response, answer, question)
