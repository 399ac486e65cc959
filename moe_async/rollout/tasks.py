"""reasoning-gym tasks: train/eval problems, chat prompts, answer extraction, exact-match score.

The reward is exact match: 1.0 iff reasoning-gym's own ``score_answer(extracted, entry)``
returns exactly 1.0, else 0.0 (its partial credit, e.g. 0.5 for "10" against "1", counts
as 0). The demo model never emits ``<answer>`` tags; answers are extracted leniently
("the answer is X", else the last number in the text).
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Iterator

from moe_async.rollout.config import RolloutConfig
from moe_async.rollout.draw_cursor import DrawCursor
from moe_async.types import JsonDict, Tokenizer, template_ids

log = logging.getLogger(__name__)

# One-shot examples per task: (user question, assistant answer). The fallback uses a
# problem of the task itself drawn with a seed outside the train/eval seeds.
ONE_SHOT_EXAMPLES: dict[str, tuple[str, str]] = {
    "basic_arithmetic": ("Calculate 4 + 3.", "4 + 3 = 7. The answer is 7."),
    "chain_sum": ("State the final answer to the following arithmetic problem: 4 + 3 =",
                  "4 + 3 = 7. The answer is 7."),
}

_NUM = r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?"
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]*)", re.IGNORECASE)
_NUM_RE = re.compile(_NUM)
_MAX_SCAN = 20_000  # chars of a (possibly huge) response looked at from its end


@dataclass
class Problem:
    """One task instance: ``question`` and gold ``answer`` strings plus the reasoning-gym
    ``entry`` (needed by its scorer); ``index`` in its split, ``split`` 'train'/'eval'."""

    question: str
    answer: str
    entry: JsonDict = field(repr=False)
    index: int = 0
    split: str = "train"


def _clean_number(s: str) -> str:
    s = s.replace(",", "")
    if s.startswith("+"):
        s = s[1:]
    return s


def extract_answer(text: str | None) -> str | None:
    """Lenient answer extraction: the value after the last "answer is"/"answer:", else the
    last number; ``None`` when nothing is found. Linear-time on any input (only the last
    ``_MAX_SCAN`` characters of a huge response are examined)."""
    if not text:
        return None
    t = text[-_MAX_SCAN:].replace("\u2212", "-")
    t = t.replace("<|im_end|>", "").replace("<|endoftext|>", "")
    hits = list(_ANSWER_IS.finditer(t))
    for m in reversed(hits):
        rest = m.group(1).strip().strip("*$ ")
        rest = re.sub(r"\\boxed\{([^{}]*)\}", r"\1", rest)
        num = _NUM_RE.match(rest)
        if num:
            return _clean_number(num.group(0))
        rest = rest.rstrip(" .").strip("*$` ")
        if rest:
            return rest
    nums = _NUM_RE.findall(t)
    if nums:
        return _clean_number(nums[-1])
    return None


class TaskDataset:
    """Train and held-out eval problems of a reasoning-gym task, prompts and scoring.

    * train: ``create_dataset(task, seed=data_seed, size=train_size, **task_kwargs)``;
    * eval: ``eval_size`` problems from ``seed=eval_seed`` whose questions are not in train
      (and not repeated), taken in index order: fixed across runs and disjoint from train.

    ``next_train()`` / ``iter(dataset)`` walk the train problems forever, reshuffled every
    epoch with ``Random(data_seed + epoch)``.

    Picklable without the tokenizer (``score`` works in reward worker processes).
    """

    def __init__(self, cfg: RolloutConfig, tokenizer: Tokenizer | None = None):
        import reasoning_gym

        self.cfg = cfg
        self.tokenizer = tokenizer
        kw = dict(cfg.task_kwargs)
        self._train_ds = reasoning_gym.create_dataset(cfg.task, seed=cfg.data_seed, size=cfg.train_size, **kw)
        self.train: list[Problem] = [
            Problem(e["question"], str(e["answer"]), e, i, "train") for i, e in enumerate(self._train_ds)
        ]
        self.eval: list[Problem] = self._make_eval(reasoning_gym, kw)
        self.cursor = DrawCursor(len(self.train), self._epoch_order)

    # ------------------------------------------------------------------ splits
    def _make_eval(self, reasoning_gym: ModuleType, kw: JsonDict) -> list[Problem]:
        n = self.cfg.eval_size
        if n == 0:
            return []
        seen = {p.question for p in self.train}
        pool = max(64, 64 * n)
        ds = reasoning_gym.create_dataset(self.cfg.task, seed=self.cfg.eval_seed, size=pool, **kw)
        out: list[Problem] = []
        for i in range(pool):
            e = ds[i]
            q = e["question"]
            if q in seen:
                continue
            seen.add(q)
            out.append(Problem(q, str(e["answer"]), e, len(out), "eval"))
            if len(out) == n:
                break
        if len(out) < n:
            log.warning("only %d of %d eval problems are disjoint from train for task %s",
                        len(out), n, self.cfg.task)
        return out

    def eval_problems(self) -> list[Problem]:
        return list(self.eval)

    # --------------------------------------------------------------- iteration
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(self.cfg.data_seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_train(self) -> Problem:
        return self.train[self.cursor.next_index()]

    def __iter__(self) -> Iterator[Problem]:
        while True:
            yield self.next_train()

    def state_dict(self) -> dict[str, int]:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor.load_state_dict(state)

    def position(self) -> int:
        """The draw number of the next :meth:`next_train` (its place in the seeded order over
        all epochs; moe_async/orchestration/run_state.py)."""
        return self.cursor.position()

    def seek(self, seq: int) -> None:
        """Make draw number ``seq`` the next one (a resumed run's trained frontier).
        Raises ValueError for a negative ``seq``."""
        self.cursor.seek(seq)

    # ----------------------------------------------------------------- prompts
    def messages(self, problem: Problem) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.cfg.system_prompt}]
        if self.cfg.prompt_style == "one_shot":
            q, a = self._one_shot_example()
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": problem.question})
        return msgs

    def _one_shot_example(self) -> tuple[str, str]:
        if self.cfg.task in ONE_SHOT_EXAMPLES:
            return ONE_SHOT_EXAMPLES[self.cfg.task]
        if not hasattr(self, "_example"):
            import reasoning_gym

            e = reasoning_gym.create_dataset(self.cfg.task, seed=987_654_321, size=1, **self.cfg.task_kwargs)[0]
            self._example = (e["question"], f"The answer is {e['answer']}.")
        return self._example

    def build_prompt_ids(self, problem: Problem) -> list[int]:
        """Chat-template token ids (generation prompt added, no extra BOS)."""
        if self.tokenizer is None:
            raise RuntimeError("TaskDataset has no tokenizer")
        return template_ids(self.tokenizer.apply_chat_template(self.messages(problem), add_generation_prompt=True,
                                                              tokenize=True))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise RuntimeError("TaskDataset has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ----------------------------------------------------------------- scoring
    def score(self, problem: Problem | JsonDict, response_text: str) -> float:
        """1.0 iff reasoning-gym scores the extracted answer exactly 1.0, else 0.0."""
        entry = problem.entry if isinstance(problem, Problem) else problem
        ans = extract_answer(response_text)
        if ans is None:
            return 0.0
        return 1.0 if float(self._train_ds.score_answer(ans, entry)) == 1.0 else 0.0

    def __getstate__(self) -> dict[str, object]:
        st = dict(self.__dict__)
        st["tokenizer"] = None  # workers only score
        return st
