"""The numbers of a report, each computed from one run's own records (:class:`Run`).

Every value names its source: ``last`` values are the final metrics.jsonl record's (the
``perf/*_per_s`` and ``*_idle_frac`` metrics are already running values over the whole
loop), ``mean`` values are plain means over the steps that logged the metric, the staleness
figures are over every trained token (the per-step ``buffer/staleness_hist/<k>`` counts
summed), and held-out accuracies come from summary.json (``eval_before`` / ``eval_after``).
"""

from __future__ import annotations

from typing import TypeAlias

from moe_async.report.runs import Run
from moe_async.types import JsonDict

# per-step time parts of the stacked breakdown: (label, metric), all seconds
TIME_PARTS = (("wait: filling", "perf/wait_filling_seconds"), ("wait: straggler", "perf/wait_straggler_seconds"),
              ("train", "train/step_time_s"), ("sync", "sync/seconds"), ("sync check", "sync/check_seconds"),
              ("save", "perf/save_seconds"))


#: One run's summary row: metric name -> its value (None where the run did not log it).
RunNumbers: TypeAlias = "dict[str, str | int | float | None]"

def staleness_hist(run: Run) -> dict[int, float]:
    """Trained tokens per staleness (versions behind the trainer), summed over the steps."""
    out: dict[int, float] = {}
    for i, r in enumerate(run.steps):
        for k in r:
            tail = k.rsplit("/", 1)[-1]
            if k.startswith("buffer/staleness_hist/") and tail.isdigit() and (v := run.value(i, k)) is not None:
                out[int(tail)] = out.get(int(tail), 0.0) + v
    return dict(sorted(out.items()))


def hist_quantile(hist: dict[int, float], q: float) -> float | None:
    """The smallest staleness ``s`` with at least a fraction ``q`` of the tokens at ``<= s``."""
    total = sum(hist.values())
    if total <= 0:
        return None
    acc = 0.0
    for s, n in sorted(hist.items()):
        acc += n
        if acc >= q * total - 1e-9:
            return float(s)
    return float(max(hist))


def _mean(run: Run, key: str) -> float | None:
    _, ys = run.series(key)
    return sum(ys) / len(ys) if ys else None


def _last(run: Run, key: str) -> float | None:
    _, ys = run.series(key)
    return ys[-1] if ys else None


def trained_steps(run: Run) -> list[JsonDict]:
    """The records of trained steps (``perf/step_seconds`` logged): not the held-out curve's
    step-0 record (``rollout.eval_interval``) written before the first step."""
    return [r for r in run.steps if "perf/step_seconds" in r] or run.steps


def held_out(run: Run) -> list[tuple[int, float]]:
    """Held-out (greedy) accuracy points ``(step, accuracy)``: the held-out curve's
    ``eval/greedy_accuracy`` records (``rollout.eval_interval``; its first point, step 0 or
    the resumed step, is the accuracy before training) when the run logged them; else
    summary.json's ``eval_before`` at the run's first step - 1 and ``eval_after`` at its last
    step, plus any per-step ``eval/accuracy`` records of metrics.jsonl."""
    xs, ys = run.series("eval/greedy_accuracy")
    if xs:
        return list(zip(xs, ys))
    steps = trained_steps(run)
    if not steps:  # no readable metrics record: no step to draw the summary's points at
        return []
    first, last = int(steps[0]["step"]), int(steps[-1]["step"])
    pts = []
    if (before := run.summary_number("eval_before", "accuracy")) is not None:
        pts.append((first - 1, before))
    xs, ys = run.series("eval/accuracy")
    pts += list(zip(xs, ys))
    if (after := run.summary_number("eval_after", "accuracy")) is not None:
        pts.append((last, after))
    return pts


def held_out_curve(run: Run, name: str) -> list[tuple[int, float, float]]:
    """``(step, value, standard error)`` of the held-out curve's ``eval/<name>`` records
    (``greedy_accuracy``, ``mean_at_k``, ...; se 0 where ``eval/<name>_se`` is absent)."""
    out = []
    for i, r in enumerate(run.steps):
        v, se = run.value(i, f"eval/{name}"), run.value(i, f"eval/{name}_se")
        if v is None:  # a point that is missing, not a number, NaN or inf is not drawn
            continue
        out.append((int(r["step"]), v, se if se is not None and se >= 0 else 0.0))
    return out



def _curve_numbers(run: Run) -> RunNumbers:
    """mean@k at the curve's first and last points and the last point's paired gain +- se."""
    pts = [i for i in range(len(run.steps)) if run.value(i, "eval/mean_at_k") is not None]
    if not pts:
        return {k: None for k in ("heldout_mean_at_k_first", "heldout_mean_at_k_last",
                                  "heldout_mean_at_k_gain", "heldout_mean_at_k_gain_se")}
    return {"heldout_mean_at_k_first": run.value(pts[0], "eval/mean_at_k"),
            "heldout_mean_at_k_last": run.value(pts[-1], "eval/mean_at_k"),
            "heldout_mean_at_k_gain": run.value(pts[-1], "eval/mean_at_k_gain"),
            "heldout_mean_at_k_gain_se": run.value(pts[-1], "eval/mean_at_k_gain_se")}


SET_FIELDS = (("greedy_accuracy", "first"), ("greedy_accuracy", "last"), ("mean_at_k", "first"),
              ("mean_at_k", "last"), ("pass_at_k", "last"), ("mean_at_k_gain", "last"), ("mean_at_k_gain_se", "last"))


def eval_set_names(run: Run) -> list[str]:
    """The named eval sets (``data.eval``) the run logged ``eval/<name>/mean_at_k`` for, sorted."""
    return sorted({k.split("/")[1] for r in run.steps for k in r
                   if k.startswith("eval/") and k.count("/") == 2 and k.endswith("/mean_at_k")})


def eval_set_numbers(run: Run) -> RunNumbers:
    """Named eval sets (``data.eval``; metrics ``eval/<name>/<metric>``): ``eval_set/<name>/
    <metric>_<first|last>`` for :data:`SET_FIELDS`, from the curve's first and last points."""
    out: RunNumbers = {}
    for name in eval_set_names(run):
        pts = [i for i in range(len(run.steps)) if run.value(i, f"eval/{name}/mean_at_k") is not None]
        if not pts:
            continue
        for metric, which in SET_FIELDS:
            out[f"eval_set/{name}/{metric}_{which}"] = run.value(pts[0] if which == "first" else pts[-1],
                                                                 f"eval/{name}/{metric}")
    return out


def run_numbers(run: Run) -> RunNumbers:
    """The summary row of one run (None where the run did not log the metric)."""
    hist = staleness_hist(run)
    tok = sum(hist.values())
    out: RunNumbers = {
        "run": run.name,
        "steps": len(trained_steps(run)),
        "last_step": int(run.steps[-1]["step"]) if run.steps else None,
        "reward_mean_last": _last(run, "rollout/reward_mean"),
        "reward_mean_avg": _mean(run, "rollout/reward_mean"),
        "accuracy_last": _last(run, "rollout/accuracy"),
        "accuracy_avg": _mean(run, "rollout/accuracy"),
        "reward_mean_generated": _last(run, "rollout/reward_mean_generated"),
        "heldout_accuracy_before": run.summary_number("eval_before", "accuracy"),
        "heldout_accuracy_after": run.summary_number("eval_after", "accuracy"),
        **_curve_numbers(run),
        "staleness_mean": sum(s * n for s, n in hist.items()) / tok if tok else None,
        "staleness_p50": hist_quantile(hist, 0.5),
        "staleness_p99": hist_quantile(hist, 0.99),
        "staleness_max": float(max(hist)) if hist else None,
        "samples_per_s": _last(run, "perf/samples_per_s"),
        "tokens_per_s": _last(run, "perf/tokens_per_s"),
        "trainer_idle_frac": _last(run, "perf/trainer_idle_frac"),
        "engine_idle_frac": _last(run, "perf/engine_idle_frac"),
        "step_seconds_avg": _mean(run, "perf/step_seconds"),
        "wait_seconds_avg": _mean(run, "perf/wait_seconds"),
        "samples_dropped": _last(run, "buffer/samples_dropped"),
        "samples_filtered": _last(run, "rollout/samples_filtered"),
    }
    for label, key in TIME_PARTS:
        out[f"{key.split('/')[1]}_avg"] = _mean(run, key)
    out.update(eval_set_numbers(run))
    return out
