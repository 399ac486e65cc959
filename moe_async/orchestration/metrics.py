"""Per-step metrics the driver adds to the trainer's: batch rewards and staleness, drop and
filter counts by reason, idle fractions and throughput."""

from __future__ import annotations

from collections import Counter

from moe_async.buffer.buffer import BufferStats


def batch_metrics(groups: list, trainer_version: int) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    # sampled tokens (a multi-turn trajectory's observations carry no version of their own)
    stale = [trainer_version - v for s in samples
             for v, m in zip(s.weight_versions, getattr(s, "loss_mask", None) or [1] * len(s.weight_versions)) if m]
    rewards = [s.reward for s in samples]
    return {
        "rollout/reward_mean": sum(rewards) / max(1, len(rewards)),
        "rollout/accuracy": sum(r >= 1.0 for r in rewards) / max(1, len(rewards)),
        "rollout/response_len_mean": sum(len(s.response_ids) for s in samples) / max(1, len(samples)),
        "rollout/reward_errors": float(sum(s.reward_error is not None for s in samples)),
        "buffer/staleness_mean": sum(stale) / max(1, len(stale)),
        "buffer/staleness_max": float(max(stale, default=0)),
        "buffer/staleness_min": float(min(stale, default=0)),
        "train/response_tokens": float(sum(len(s.response_ids) for s in samples)),
        "train/samples": float(len(samples)),
        # this batch's tokens per staleness (trainer version - token version)
        **{f"buffer/staleness_hist/{k}": float(c) for k, c in sorted(Counter(stale).items())},
        **_per_source(samples),
    }


def _per_source(samples: list) -> dict[str, float]:
    """``rollout/reward_mean/<data_source>``: the batch's mean reward per data source (prompt
    files only: samples whose metadata has ``data_source``)."""
    by: dict[str, list[float]] = {}
    for s in samples:
        src = getattr(s, "metadata", {}).get("data_source")
        if src is not None:
            by.setdefault(str(src), []).append(s.reward)
    return {f"rollout/reward_mean/{k}": sum(v) / len(v) for k, v in sorted(by.items())}


# cumulative rollout counts reported every step (0.0 before their first event)
LOOP_COUNT_KEYS = ("rollout/dropped_total", "rollout/samples_filtered", "rollout/tokens_filtered",
                   "rollout/filter_cap_passed", "rollout/reward_errors", "rollout/aborts",
                   "rollout/samples_generated", "rollout/reward_sum")


def loop_metrics(bstats: BufferStats, rmetrics: dict[str, float], busy0: dict[str, float], elapsed: float) -> dict[str, float]:
    """Cumulative since generation started: drop/filter counts by reason (buffer and rollout),
    engine idle fraction (1 - mean over engines of busy time / elapsed; an engine is busy while
    it has a request outstanding)."""
    m = {f"buffer/dropped/{r}": float(n) for r, n in bstats["drop_reasons"].items()}
    # every cumulative count is present from the first step (0.0 until its first event): the
    # rollout manager's counters only appear once incremented, and a missing key would read as
    # "not measured" in metrics.jsonl / wandb rather than 0
    m.update({k: float(rmetrics.get(k, 0.0)) for k in LOOP_COUNT_KEYS})
    m.update({k: v for k, v in rmetrics.items()
              if k.startswith(("rollout/dropped/", "rollout/requests/", "rollout/agent/"))})
    m.update({k: v for k, v in rmetrics.items() if k.startswith("teacher/")})  # distillation (cumulative)
    m["rollout/engine_request_retries"] = float(rmetrics.get("rollout/engine_request_retries", 0.0))
    m["rollout/requests_in_flight"] = float(rmetrics.get("rollout/requests_in_flight", 0.0))  # at this step's end
    # mean reward of every sample scored so far, trained or not (dynamic filtering and stale
    # drops bias rollout/reward_mean, the trained batch's mean, away from the policy's reward)
    if rmetrics.get("rollout/samples_generated"):
        m["rollout/reward_mean_generated"] = rmetrics.get("rollout/reward_sum", 0.0) / rmetrics["rollout/samples_generated"]
    busy = [v - busy0.get(k, 0.0) for k, v in rmetrics.items() if k.startswith("rollout/engine_busy_s/")]
    if busy and elapsed > 0:
        m["perf/engine_idle_frac"] = max(0.0, 1.0 - sum(busy) / len(busy) / elapsed)
    return m


def prompt_accounting(bstats: dict) -> dict:
    """Where every train prompt drawn went, from the buffer's counters (one admission = one
    prompt drawn): ``drawn`` = ``trained`` + ``dropped`` (summed over ``dropped_by_reason``:
    ``stale``, ``engine_lost``, ``filtered_equal_rewards``, ``prompt_too_long``, ...) +
    ``pending`` (buffered, in flight, or in flight when generation stopped). ``balanced``:
    whether the sum holds (it always should; False means a prompt went unaccounted)."""
    reasons = dict(bstats.get("drop_reasons", {}))
    # groups_put: put into the buffer, then trained, dropped as stale (in reasons) or buffered
    pending = int(bstats["buffered_groups"]) + int(bstats["in_flight"]) + int(bstats["in_flight_at_stop"])
    dropped = sum(int(v) for v in reasons.values())
    drawn, trained = int(bstats["admitted"]), int(bstats["groups_trained"])
    return {"drawn": drawn, "trained": trained, "dropped": dropped, "dropped_by_reason": reasons, "pending": pending,
            "balanced": drawn == trained + dropped + pending}
