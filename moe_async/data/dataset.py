"""Train and eval prompts from files: the rollout manager's dataset when ``data.train`` is set.

:class:`FileDataset` has the interface of :class:`moe_async.rollout.tasks.TaskDataset`:
``next_train()`` walks the train rows epoch after epoch, epoch ``e`` in the order
``numpy.random.default_rng([data.seed, e]).permutation(n)`` (``arange(n)`` without
``data.shuffle``); ``position()`` is the draw number ``e * n + pos`` and ``seek(seq)`` makes it
the next one, so the run's draw ledger (moe_async/orchestration/run_state.py) resumes a run at
the same row and trains no row twice. Rows are read from the memory-mapped table one at a time
when drawn (only the rows in flight are Python objects). ``build_prompt_ids(row)`` applies the
tokenizer's own chat template once per draw (cached for eval rows) and those ids are what the
engines receive.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from moe_async.data.config import DataConfig, EvalSetConfig
from moe_async.data.rows import Keys, Row, check_table, resolve_format, to_row
from moe_async.data.source import DataError, open_rows
from moe_async.rollout.draw_cursor import DrawCursor
from moe_async.types import Tokenizer, template_ids

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger(__name__)


def open_table(paths: list[str], fmt: str, cfg: DataConfig, what: str, check: bool) -> tuple[Dataset, list[tuple[str, int]], Keys]:
    """Open ``paths`` (:func:`open_rows`), resolve the format, optionally :func:`check_table`."""
    ds, spans = open_rows(paths, what, cfg.cache_dir)
    keys = Keys(resolve_format(fmt, list(ds.column_names), cfg.input_key), cfg.input_key, cfg.label_key,
                cfg.metadata_key)
    if check:
        check_table(ds, spans, keys, what, chat_template=cfg.apply_chat_template)
    return ds, spans, keys


class FileDataset:
    """Prompts of ``data`` (module docstring). ``system_prompt``: for string prompts when
    ``data.system_prompt`` is None (``rollout.system_prompt``). ``check``: run the start-up
    checks of every table (the driver did them already in a run)."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer | None = None, system_prompt: str | None = None,
                 check: bool = False):
        if not data.enabled:
            raise DataError("data.train is not set")
        self.cfg = data
        self.tokenizer = tokenizer
        self.max_prompt_length = data.max_prompt_length  # the rollout manager skips longer prompts
        self.system_prompt = data.system_prompt if data.system_prompt is not None else system_prompt
        # one table per train path (each its own format: a verl Parquet and a slime JSONL mix)
        self._parts = [open_table([p], data.format, data, "data.train", check) for p in data.train_paths()]
        self._starts = np.cumsum([0] + [len(t[0]) for t in self._parts])
        self.n = int(self._starts[-1])
        self.eval_sets: dict[str, list[Row]] = {}
        self.eval_cfgs: dict[str, EvalSetConfig] = dict(data.eval)
        for name, ec in data.eval.items():
            paths = [ec.path] if isinstance(ec.path, str) else list(ec.path)
            ds, _, keys = open_table(paths, ec.format or data.format, data, f"data.eval.{name}", check)
            m = len(ds) if ec.limit is None else min(ec.limit, len(ds))
            self.eval_sets[name] = [to_row(r, keys, i, name) for i, r in enumerate(ds.select(range(m)))]
        self._ids_cache: dict[tuple[str, int], list[int]] = {}
        self.cursor = DrawCursor(self.n, self._epoch_order)

    # --------------------------------------------------------------- iteration
    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.cfg.shuffle:
            return np.arange(self.n, dtype=np.int64)
        return np.random.default_rng([int(self.cfg.seed) & 0xFFFFFFFF, epoch]).permutation(self.n)

    def row(self, index: int) -> Row:
        """Train row ``index`` (its place in the concatenated train files)."""
        index = int(index)
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        ds, spans, keys = self._parts[k]
        row = to_row(ds[index - int(self._starts[k])], keys, index, "train")
        row.file, row.file_row = spans[0][0], index - int(self._starts[k])
        return row

    def next_train(self) -> Row:
        return self.row(self.cursor.next_index())

    def state_dict(self) -> dict[str, int]:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor.load_state_dict(state)

    def position(self) -> int:
        """The draw number of the next :meth:`next_train` (:meth:`DrawCursor.position`)."""
        return self.cursor.position()

    def seek(self, seq: int) -> None:
        """Make draw number ``seq`` the next one. Raises ValueError for a negative ``seq``."""
        self.cursor.seek(seq)

    # ----------------------------------------------------------------- prompts
    def eval_problems(self) -> list[Row]:
        """Every eval set's rows, in set order (the greedy eval_before / eval_after)."""
        return [r for rows in self.eval_sets.values() for r in rows]

    def messages(self, row: Row) -> list[dict[str, str]]:
        """The chat messages of ``row``: a string prompt as a user message with the system prompt
        (``data.system_prompt``, else ``rollout.system_prompt``) first; a message list as it is,
        with ``data.system_prompt`` first only when set and the list has no system message."""
        if isinstance(row.prompt, str):
            msgs, system = [{"role": "user", "content": row.prompt}], self.system_prompt
        else:
            msgs, system = list(row.prompt), self.cfg.system_prompt
        if system and not any(m.get("role") == "system" for m in msgs):
            msgs = [{"role": "system", "content": system}] + msgs
        return msgs

    def build_prompt_ids(self, row: Row) -> list[int]:
        """The prompt's token ids: the tokenizer's chat template with the generation prompt
        (``data.apply_chat_template``), else the string tokenized without special tokens."""
        key = (row.split, row.index)
        if key in self._ids_cache:
            return self._ids_cache[key]
        if self.tokenizer is None:
            raise RuntimeError("FileDataset has no tokenizer")
        if self.cfg.apply_chat_template:
            ids = template_ids(self.tokenizer.apply_chat_template(self.messages(row), add_generation_prompt=True,
                                                                  tokenize=True))
        else:
            if not isinstance(row.prompt, str):
                raise ValueError(f"{row.split} row {row.index}: a list of messages needs data.apply_chat_template=true")
            ids = [int(i) for i in self.tokenizer(row.prompt, add_special_tokens=False)["input_ids"]]
        if row.split != "train":
            self._ids_cache[key] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise RuntimeError("FileDataset has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, row: Row, response_text: str) -> float:
        """The row's built-in scorer when its data_source selects one (exact match otherwise):
        the 'task scorer' reported beside the configured reward in greedy evals."""
        from moe_async.rollout.row_rewards import builtin_score

        return builtin_score(row, response_text, self.cfg)

    def __getstate__(self) -> dict[str, object]:
        raise TypeError("FileDataset is not sent between processes: rows travel one at a time")
