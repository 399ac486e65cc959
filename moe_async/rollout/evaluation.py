"""Held-out evaluation during a run: greedy accuracy and mean@k at the training temperature,
each with its standard error over problems, and paired gains against the first evaluation.

:func:`evaluate_heldout` answers every held-out problem once greedily and ``k`` times sampled
through the rollout manager's request path and reward pool; metrics ``eval/greedy_accuracy``,
``eval/mean_at_k``, ``eval/pass_at_k`` (+ ``_se``, ``_gain``), unit: fraction of problems.

Design notes: ``docs/design/rollout.md``."""

from __future__ import annotations

import asyncio
import math
from typing import Any, Callable

from moe_async.rollout.config import RolloutConfig
from moe_async.rollout.failures import DropGroup
from moe_async.rollout.manager import RolloutManager, greedy_summary
from moe_async.types import Sample

# the per-problem series an evaluation keeps (for paired gains) and reports
SERIES = ("greedy_accuracy", "mean_at_k", "pass_at_k", "greedy_reward", "sampled_reward")
GAIN_SERIES = ("greedy_accuracy", "mean_at_k")


def mean_se(x: list[float]) -> tuple[float, float]:
    """``(mean, std(ddof=1)/sqrt(n))``; ``(0, 0)`` for no values, se 0 for one."""
    n = len(x)
    if n == 0:
        return 0.0, 0.0
    mu = sum(x) / n
    if n < 2:
        return mu, 0.0
    var = sum((v - mu) ** 2 for v in x) / (n - 1)
    return mu, math.sqrt(var / n)


def summarize(greedy: list[float], sampled: list[list[float]], ids: list[int] | None = None) -> dict[str, Any]:
    """Metrics of one evaluation from per-problem rewards (formulas: ``docs/design/rollout.md``).

    Args:
        greedy: the greedy reward of each problem (``n``).
        sampled: the ``k`` sampled rewards of each problem (``n`` lists, same order).
        ids: the problems' ids (default ``0..n-1``): paired gains match problems by id.

    Returns: ``eval/<name>`` and ``eval/<name>_se`` floats for :data:`SERIES`, ``eval/n``,
    ``eval/k``, and ``per_problem`` (``{name: [x_i]}`` plus ``"ids"``, for paired gains; not
    a metric).
    """
    if len(greedy) != len(sampled):
        raise ValueError(f"{len(greedy)} greedy rewards for {len(sampled)} problems")
    per = {
        "greedy_accuracy": [1.0 if r >= 1.0 else 0.0 for r in greedy],
        "mean_at_k": [sum(r >= 1.0 for r in s) / len(s) if s else 0.0 for s in sampled],
        "pass_at_k": [1.0 if any(r >= 1.0 for r in s) else 0.0 for s in sampled],
        "greedy_reward": [float(r) for r in greedy],
        "sampled_reward": [sum(s) / len(s) if s else 0.0 for s in sampled],
    }
    out: dict[str, Any] = {"eval/n": float(len(greedy)), "eval/k": float(max((len(s) for s in sampled), default=0))}
    for name, x in per.items():
        out[f"eval/{name}"], out[f"eval/{name}_se"] = mean_se(x)
    per["ids"] = list(range(len(greedy))) if ids is None else list(ids)
    out["per_problem"] = per
    return out


def paired_gains(now: dict[str, list], base: dict[str, list]) -> dict[str, float]:
    """``eval/<name>_gain`` and ``_gain_se`` (paired over the problems both evaluations
    scored, matched by ``"ids"``; positions when absent) for :data:`GAIN_SERIES`."""
    ids_now = now.get("ids", list(range(len(now["greedy_accuracy"]))))
    ids_base = base.get("ids", list(range(len(base["greedy_accuracy"]))))
    pos_base = {i: j for j, i in enumerate(ids_base)}
    pairs = [(j, pos_base[i]) for j, i in enumerate(ids_now) if i in pos_base]
    out = {}
    for name in GAIN_SERIES:
        a, b = now[name], base[name]
        out[f"eval/{name}_gain"], out[f"eval/{name}_gain_se"] = mean_se([a[j] - b[jb] for j, jb in pairs])
    return out


async def evaluate_heldout(manager: RolloutManager, problems: list, k: int, max_new_tokens: int,
                           temperature: float | None = None,
                           prompt_fn: Callable[[object, list[int]], list[int]] | None = None) -> dict[str, Any]:
    """One held-out evaluation (greedy + ``k`` samples per problem) with ``manager``'s engines
    and reward pool; returns :func:`summarize`'s dict plus ``eval/n_skipped`` (problems whose
    prompt fills the context, or whose request was dropped), ``eval/seconds`` and ``greedy``
    (:func:`greedy_summary`: the greedy answers as an ``eval_before``/``eval_after`` dict; not
    a metric). Problems run concurrently, at most ``eval_concurrency`` (default
    ``max_concurrent_groups``) at once, each problem's ``k + 1`` requests sent together (the
    engine prefills their shared prompt once); ``temperature``: the sampled answers' (None:
    ``rollout.temperature``); ``prompt_fn``: ``(problem, prompt ids) -> the ids to send`` (a
    distillation teacher's own prompt; None: the dataset's prompt). Raises
    ``RewardFailureError`` as ``RolloutManager.evaluate`` when the greedy answers' rewards keep
    failing (``manager.reward_streak``)."""
    import time

    t0 = time.perf_counter()
    cfg = manager.cfg
    sem = asyncio.Semaphore(cfg.eval_concurrency or cfg.max_concurrent_groups)

    async def sample(p: object, prompt_ids: list[int], max_new: int, greedy: bool
                     ) -> tuple[float, str | None, float, int] | float:
        temp = None if greedy else temperature
        agent = getattr(manager, "agent", None)
        if agent is not None:  # multi-turn: reward within the turn budget
            async def turn(ids: list[int], n: int) -> Sample:
                return await manager._generate_sample(ids, n, greedy=greedy, temperature=temp)

            s = await agent.sample(p, turn, max_new, count=False)
            if greedy:
                return float(s.reward), None, float(s.reward >= 1.0), int(sum(s.response_mask()))
            return float(s.reward)
        s = await manager._generate_sample(prompt_ids, max_new, greedy=greedy, temperature=temp)
        text = manager.dataset.decode(s.response_ids)
        r = await manager.reward_pool.score(p, text)
        if greedy:  # the greedy answer's details too, for the eval_before/eval_after dict
            return float(r.reward), getattr(r, "error", None), float(manager.dataset.score(p, text)), len(s.response_ids)
        return float(r.reward)

    async def one(p: object) -> tuple[tuple[float, str | None, float, int], list[float], int] | None:

        prompt_ids = manager.dataset.build_prompt_ids(p)
        if prompt_fn is not None:
            prompt_ids = prompt_fn(p, prompt_ids)
        max_new = manager._check_length(len(prompt_ids), max_new_tokens, count=False)
        if max_new is None:
            return None
        try:
            async with sem:
                rs = await asyncio.gather(*(sample(p, prompt_ids, max_new, i == 0) for i in range(k + 1)))
        except DropGroup:
            return None
        first = rs[0]
        assert isinstance(first, tuple)  # the greedy sample's details
        return first, [r for r in rs[1:] if isinstance(r, float)], int(getattr(p, "index", id(p)))

    res = [r for r in await asyncio.gather(*(one(p) for p in problems)) if r is not None]
    out = summarize([r[0][0] for r in res], [r[1] for r in res], [r[2] for r in res])
    out["eval/n_skipped"] = float(len(problems) - len(res))
    out["eval/seconds"] = time.perf_counter() - t0
    out["greedy"] = greedy_summary([r[0] for r in res], len(problems) - len(res))
    streak = getattr(manager, "reward_streak", None)
    if streak is not None:  # as RolloutManager.evaluate: a reward failing on every problem stops the run
        streak.update(r[0][1] for r in res)
    return out


async def evaluate_sets(manager: RolloutManager, sets: dict[str, list], cfgs: dict[str, Any], rollout: RolloutConfig) -> dict[str, Any]:
    """Every named eval set (``data.eval``) evaluated in turn with :func:`evaluate_heldout` and
    its own ``n_samples`` (k), ``max_new_tokens`` and ``temperature`` (defaults:
    ``rollout.eval_max_new_tokens``, ``rollout.temperature``). Returns ``{"sets": {name: dict},
    "greedy": the greedy answers of all sets (greedy_summary, weighted by problems),
    "eval/seconds": total}``; :class:`EvalCurve` names each set's metrics ``eval/<name>/...``."""
    out: dict[str, Any] = {"sets": {}}
    greedy_parts = []
    for name, rows in sets.items():
        c = cfgs[name]
        ev = await evaluate_heldout(manager, rows, c.n_samples, c.max_new_tokens or rollout.eval_max_new_tokens,
                                    c.temperature)
        greedy_parts.append(ev.pop("greedy"))
        out["sets"][name] = ev
    out["eval/seconds"] = sum(ev["eval/seconds"] for ev in out["sets"].values())
    out["greedy"] = _merge_greedy(greedy_parts)
    return out


def _merge_greedy(parts: list[dict[str, float]]) -> dict[str, float]:
    """:func:`greedy_summary` dicts of several sets as one (means weighted by ``n``)."""
    n = sum(p["n"] for p in parts)
    out = {"n": n, "n_skipped": sum(p["n_skipped"] for p in parts),
           "reward_errors": sum(p["reward_errors"] for p in parts)}
    for key in ("reward_mean", "accuracy", "task_accuracy", "mean_response_len"):
        out[key] = sum(p[key] * p["n"] for p in parts) / n if n else 0.0
    return out


def _gain(p: dict[str, float], name: str) -> str:
    """``+g +- se [lo, hi]``: a paired gain, its standard error and 95% normal interval."""
    g, se = p[f"eval/{name}_gain"], p[f"eval/{name}_gain_se"]
    return f"{g:+.3f} +- {se:.3f} [{g - 1.96 * se:+.3f}, {g + 1.96 * se:+.3f}]"


class EvalCurve:
    """The run's held-out curve: evaluations at step 0 (before training; on resume the loaded
    step), every ``rollout.eval_interval`` steps and at the last step; ``run(step)`` returns
    the step's metrics (with paired gains against the first point) for the step's log line.

    ``evaluate``: a callable ``() -> dict`` returning :func:`evaluate_heldout`'s dict (in the
    driver: a Ray call to the rollout actor).
    """

    def __init__(self, interval: int, num_steps: int, evaluate: Callable[[], dict[str, Any]]):
        self.interval = int(interval)
        self.num_steps = int(num_steps)
        self._evaluate = evaluate
        self.points: list[dict[str, float]] = []
        self._base: dict[str, list[float]] | None = None
        # the last point's greedy answers as an eval_before/eval_after dict (greedy_summary)
        self.last_greedy: dict[str, float] | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int) -> bool:
        """The first call (step 0, or the resumed step), every ``interval`` steps, the last step."""
        return self.enabled and (not self.points or step % self.interval == 0 or step == self.num_steps)

    def run(self, step: int) -> dict[str, float]:
        """Evaluate now (if :meth:`due`) and return the ``eval/*`` metrics (else ``{}``)."""
        if not self.due(step):
            return {}
        ev = self._evaluate()
        self.last_greedy = ev.pop("greedy", None)
        if "sets" in ev:  # named eval sets: eval/<name>/<metric>, paired gains per set
            out: dict[str, float] = {"eval/seconds": float(ev["eval/seconds"])}
            bases = self.__dict__.setdefault("_set_bases", {})
            for name, sev in ev["sets"].items():
                per = sev.pop("per_problem")
                bases.setdefault(name, per)
                sev.update(paired_gains(per, bases[name]))
                print(f"[moe-async] held-out {name} at step {step}: " + self._line(sev), flush=True)
                out.update({f"eval/{name}/{k[len('eval/'):]}": float(v) for k, v in sev.items()})
            self.points.append({"step": step, **out})
            return out
        per = ev.pop("per_problem")
        if self._base is None:
            self._base = per
        ev.update(paired_gains(per, self._base))
        self.points.append({"step": step, **ev})
        print(f"[moe-async] held-out at step {step}: " + self._line(self.points[-1]), flush=True)
        return {k: float(v) for k, v in ev.items()}

    @staticmethod
    def _line(p: dict[str, float]) -> str:
        return (f"greedy {p['eval/greedy_accuracy']:.3f} +- {p['eval/greedy_accuracy_se']:.3f}"
                f" | mean@{p['eval/k']:.0f} {p['eval/mean_at_k']:.3f} +- {p['eval/mean_at_k_se']:.3f}"
                f" | pass@{p['eval/k']:.0f} {p['eval/pass_at_k']:.3f}"
                f" | mean@k gain {_gain(p, 'mean_at_k')} | greedy gain {_gain(p, 'greedy_accuracy')}"
                f" (n={p['eval/n']:.0f}, {p.get('eval/seconds', 0.0):.0f} s)")

    def format(self) -> str:
        """The curve as a table: one line per evaluation (values +- standard error)."""
        lines = ["[moe-async] held-out curve (k samples per problem at the training temperature; "
                 "+- one standard error over problems; gains paired against the first point, "
                 "[95% interval]):"]
        for p in self.points:
            if "eval/greedy_accuracy" in p:
                lines.append(f"  step {p['step']:>4} | " + self._line(p))
                continue
            names = sorted({k.split("/")[1] for k in p if k.count("/") == 2})
            for name in names:  # named eval sets: one line per set
                sub = {"eval/" + k.split("/", 2)[2]: v for k, v in p.items() if k.startswith(f"eval/{name}/")}
                lines.append(f"  step {p['step']:>4} | {name}: " + self._line(sub))
        return "\n".join(lines)
