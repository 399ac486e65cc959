"""GRPO group-relative advantages (Shao et al., 2024, DeepSeekMath, sec. 4.1.2)."""

from __future__ import annotations

import math


def compute_grpo_advantages(rewards: list[list[float]], eps: float = 1e-6) -> list[list[float]]:
    """Group-normalised advantages ``A_g,j = (r_g,j - mean_g) / (std_g + eps)``.

    Args:
        rewards: one list per group (``G`` rewards of the samples of one prompt).
        eps: added to the std (population std, ``ddof=0``).

    Returns:
        Same nesting as ``rewards``. A group whose rewards are all equal (including a group of
        one) gets exactly ``0.0`` for every sample (no NaN). ValueError on NaN/inf rewards.
    """
    out: list[list[float]] = []
    for gi, group in enumerate(rewards):
        if not group:
            out.append([])
            continue
        if any(not math.isfinite(r) for r in group):
            raise ValueError(f"non-finite reward in group {gi}: {group}")
        mean = sum(group) / len(group)
        if all(r == group[0] for r in group):
            out.append([0.0] * len(group))
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out.append([(r - mean) / (std + eps) for r in group])
    return out
