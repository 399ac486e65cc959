"""Write a reasoning-gym task to slime-format JSONL: the train problems and held-out eval sets.

Each line: ``{"prompt": [chat messages], "label": answer, "metadata": {"data_source": task,
"reasoning_gym": the entry's metadata}}`` -- the messages are the ones ``moe-async train`` builds
for ``rollout.task`` (system prompt, the one-shot example of ``rollout.prompt_style``, the
question), so a run from the file trains on the same prompt token ids; the reward is the task's
reasoning-gym scorer, chosen by ``data_source`` (moe_async/rollout/row_rewards.py).

Train problems: ``create_dataset(task, seed=--seed, size=--train-size, **kwargs)``; eval sets:
problems from ``--eval-seed`` whose questions are in no train problem and in no other eval set,
in index order, split over the ``--eval`` files in the order given (``PATH:N`` each).

    python tools/rg_to_jsonl.py --task basic_arithmetic --train-size 120 \\
        --train data/arith_train.jsonl --eval data/arith_eval_a.jsonl:48 --eval data/arith_eval_b.jsonl:48

``--kwargs`` (JSON) defaults to the demo's settings for tasks that have them
(moe_async/rollout/config.py DEMO_TASK_KWARGS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _line(ds, p, task: str) -> str:
    return json.dumps({"prompt": ds.messages(p), "label": str(p.answer),
                       "metadata": {"data_source": task, "reasoning_gym": p.entry.get("metadata", {})}},
                      default=str)


def write(task: str, train_size: int, train: str, evals: list[tuple[str, int]], seed: int = 42,
          eval_seed: int = 4242, kwargs: dict | None = None, prompt_style: str = "one_shot",
          system_prompt: str | None = None) -> dict[str, int]:
    """Write the files; returns ``{path: rows}``. Raises ValueError on a task or kwargs that
    reasoning-gym refuses, or too few distinct eval problems."""
    from moe_async.rollout.config import RolloutConfig
    from moe_async.rollout.tasks import TaskDataset

    over = {"task": task, "train_size": train_size, "eval_size": sum(n for _, n in evals), "data_seed": seed,
            "eval_seed": eval_seed, "prompt_style": prompt_style}
    if kwargs is not None:
        over["task_kwargs"] = kwargs
    if system_prompt is not None:
        over["system_prompt"] = system_prompt
    ds = TaskDataset(RolloutConfig(**over))
    if len(ds.eval) < over["eval_size"]:
        raise ValueError(f"only {len(ds.eval)} held-out problems of {task!r} are disjoint from train; "
                         f"asked for {over['eval_size']}")
    out = {}
    Path(train).parent.mkdir(parents=True, exist_ok=True)
    Path(train).write_text("".join(_line(ds, p, task) + "\n" for p in ds.train))
    out[train] = len(ds.train)
    start = 0
    for path, n in evals:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("".join(_line(ds, p, task) + "\n" for p in ds.eval[start:start + n]))
        out[path], start = n, start + n
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--train-size", type=int, default=120)
    ap.add_argument("--train", required=True, help="train JSONL path")
    ap.add_argument("--eval", action="append", default=[], help="PATH:N, an eval set of N problems (repeatable)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--eval-seed", type=int, default=4242)
    ap.add_argument("--kwargs", default=None, help="reasoning-gym args as JSON")
    ap.add_argument("--prompt-style", default="one_shot", choices=["one_shot", "plain"])
    ap.add_argument("--system-prompt", default=None)
    a = ap.parse_args(argv)
    evals = []
    for e in a.eval:
        path, _, n = e.rpartition(":")
        if not path or not n.isdigit():
            ap.error(f"--eval {e!r}: expected PATH:N")
        evals.append((path, int(n)))
    try:
        out = write(a.task, a.train_size, a.train, evals, a.seed, a.eval_seed,
                    json.loads(a.kwargs) if a.kwargs else None, a.prompt_style, a.system_prompt)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, n in out.items():
        print(f"{path}: {n} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
