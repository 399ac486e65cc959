"""User reward functions for tests/rollout/test_rewards.py (imported by path)."""

NOT_CALLABLE = 3


def contains_answer(response: str, answer: str, question: str) -> float:
    return 1.0 if answer in response else 0.0


def returns_text(response: str, answer: str, question: str):
    return "high"


def returns_nan(response: str, answer: str, question: str):
    return float("nan")


def returns_none(response: str, answer: str, question: str):
    return None


def sleeps_past_timeout(response: str, answer: str, question: str) -> float:
    """Never answers within a test's rollout.reward_timeout_s (an abandoned thread ends later)."""
    import time

    time.sleep(20)
    return 1.0
