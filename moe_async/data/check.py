"""Start-up checks of the ``data`` section, in the driver before any process starts: every
train and eval table opens and passes :func:`moe_async.data.rows.check_table`, every reward
spec is usable, every ``data_source`` in the files has a reward, and every row whose reward
compares with a ground truth (:data:`NEEDS_LABEL`) has a label (a ``messages`` row may have
none: a user function then gets ``""``, a verl file ``ground_truth=None``);
:func:`check_prompt_room` compares ``data.max_prompt_length`` with the model's context.

Raises :class:`moe_async.data.source.DataError` (a ``ValueError``) naming the field, file, row
and key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from moe_async.data.config import DataConfig
from moe_async.data.source import DataError
from moe_async.types import JsonDict
from moe_async.data.rows import Keys

if TYPE_CHECKING:
    from datasets import Dataset
    import pyarrow as pa


# the built-in rewards that compare the answer with the row's label
NEEDS_LABEL = ("math_verify", "gsm8k", "exact_match", "reasoning_gym")


def _source_column(ds: Dataset, metadata_key: str) -> pa.ChunkedArray | pa.Array | None:
    """The table's ``data_source`` values (a column, or the metadata struct's field); None."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from moe_async.data.rows import arrow_table

    table = arrow_table(ds)
    cols = list(ds.column_names)
    if "data_source" in cols:
        return table.column("data_source")
    if metadata_key in cols:
        t = table.schema.field(metadata_key).type
        if pa.types.is_struct(t) and "data_source" in [f.name for f in t]:
            return pc.struct_field(table.column(metadata_key).combine_chunks(), "data_source")
    return None


def data_sources(ds: Dataset, fmt: str, metadata_key: str) -> dict[str | None, int]:
    """``{data_source: first row index}`` of a table (None: rows without one)."""
    import pyarrow.compute as pc

    col = _source_column(ds, metadata_key)
    if col is None:
        return {None: 0}
    uniq = pc.unique(col)
    out: dict[str | None, int] = {}
    for v in uniq.to_pylist():
        mask = pc.is_null(col) if v is None else pc.equal(col, v)
        out[v] = int(pc.indices_nonzero(mask)[0].as_py())
    return out


def _first_unlabelled(ds: Dataset, keys: Keys, source: str | None, no_label: pa.Array) -> int | None:
    """The first row of ``source`` (all rows when the table has no data_source) in ``no_label``."""
    import pyarrow.compute as pc

    col = _source_column(ds, keys.metadata_key)
    mask = no_label
    if col is not None:
        of_source = pc.is_null(col) if source is None else pc.fill_null(pc.equal(col, source), False)
        mask = pc.and_(mask, of_source.combine_chunks() if hasattr(of_source, "combine_chunks") else of_source)
    hit = pc.indices_nonzero(mask)
    return int(hit[0].as_py()) if len(hit) else None


def check_prompt_room(data: DataConfig, max_new_tokens: int, hf_config: JsonDict, where: str) -> None:
    """Refuse a ``data.max_prompt_length`` that leaves less than ``rollout.max_new_tokens`` of the
    model's context (``hf_config["max_position_embeddings"]``, 2048 when absent, as the rollout
    manager's; ``where`` names the model). Raises :class:`DataError` naming both numbers."""
    context = int(hf_config.get("max_position_embeddings") or 2048)
    cap = data.max_prompt_length
    if cap is None or cap + max_new_tokens <= context:
        return
    raise DataError(f"data.max_prompt_length={cap} plus rollout.max_new_tokens={max_new_tokens} is {cap + max_new_tokens} "
                    f"tokens, more than the model's context of {context} tokens (max_position_embeddings of {where}): "
                    f"set data.max_prompt_length <= {context - max_new_tokens} or lower rollout.max_new_tokens")


class DataCheck(TypedDict):
    """What :func:`check_data` found: train rows, rows per eval set, the reward spec per data_source."""

    train_rows: int
    eval_rows: dict[str, int]
    data_sources: dict[str | None, str]


def check_data(data: DataConfig) -> DataCheck:
    """Open and check every table; return ``{"train_rows": n, "eval_rows": {name: n},
    "data_sources": {source: spec}}``. Raises DataError / RewardConfigError (both ValueError)."""
    from moe_async.data.dataset import open_table
    from moe_async.data.rows import unlabelled, where_row
    from moe_async.rollout.row_rewards import check_spec, spec_for

    for src, spec in data.rewards.items():
        check_spec(spec, f"data.rewards[{src!r}]")
    if data.default_reward is not None:
        check_spec(data.default_reward, "data.default_reward")
    tables = [("data.train", [p], data.format) for p in data.train_paths()]
    tables += [(f"data.eval.{n}", [e.path] if isinstance(e.path, str) else list(e.path), e.format or data.format)
               for n, e in data.eval.items()]
    out: DataCheck = {"train_rows": 0, "eval_rows": {}, "data_sources": {}}
    for what, paths, fmt in tables:
        ds, spans, keys = open_table(paths, fmt, data, what, check=True)
        if what == "data.train":
            out["train_rows"] += len(ds)
        else:
            out["eval_rows"][what.split(".", 2)[2]] = len(ds)
        no_label = unlabelled(ds, keys)
        for source, first in data_sources(ds, keys.format, keys.metadata_key).items():
            try:
                spec, chosen_by = spec_for(source, data)
            except KeyError:
                raise DataError(f"{what}: {where_row(spans, first)}: data_source {source!r} has no reward: add "
                                f"data.rewards[{source!r}] or data.default_reward") from None
            out["data_sources"][source] = spec
            bad = _first_unlabelled(ds, keys, source, no_label) if no_label is not None and spec in NEEDS_LABEL \
                else None
            if bad is not None:
                raise DataError(
                    f"{what}: {where_row(spans, bad)}: no label: key {keys.label_key!r} (data.label_key) is missing and "
                    f"the last message is not the assistant's answer, but reward {spec!r} ({chosen_by}, "
                    f"data_source {source!r}) compares the answer with the label; add the label, or score these "
                    "rows with a function (data.rewards: 'verl:<file>' or 'function:<module>:<fn>')")
    return out
