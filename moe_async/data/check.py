"""Start-up checks of the ``data`` section, in the driver before any process starts: every
train and eval table opens and passes :func:`moe_async.data.rows.check_table`, every reward
spec is usable, and every ``data_source`` in the files has a reward.

Raises :class:`moe_async.data.source.DataError` (a ``ValueError``) naming the field, file, row
and key.
"""

from __future__ import annotations

from typing import Any

from moe_async.data.config import DataConfig
from moe_async.data.source import DataError


def data_sources(ds: Any, fmt: str, metadata_key: str) -> dict[str | None, int]:
    """``{data_source: first row index}`` of a table (None: rows without one)."""
    import pyarrow.compute as pc

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    cols = list(ds.column_names)
    col = None
    if "data_source" in cols:
        col = table.column("data_source")
    elif metadata_key in cols:
        t = table.schema.field(metadata_key).type
        import pyarrow as pa

        if pa.types.is_struct(t) and "data_source" in [f.name for f in t]:
            col = pc.struct_field(table.column(metadata_key).combine_chunks(), "data_source")
    if col is None:
        return {None: 0}
    uniq = pc.unique(col)
    out: dict[str | None, int] = {}
    for v in uniq.to_pylist():
        mask = pc.is_null(col) if v is None else pc.equal(col, v)
        out[v] = int(pc.indices_nonzero(mask)[0].as_py())
    return out


def check_data(data: DataConfig) -> dict[str, Any]:
    """Open and check every table; return ``{"train_rows": n, "eval_rows": {name: n},
    "data_sources": {source: spec}}``. Raises DataError / RewardConfigError (both ValueError)."""
    from moe_async.data.dataset import open_table
    from moe_async.data.rows import locate
    from moe_async.rollout.row_rewards import check_spec, spec_for

    for src, spec in data.rewards.items():
        check_spec(spec, f"data.rewards[{src!r}]")
    if data.default_reward is not None:
        check_spec(data.default_reward, "data.default_reward")
    tables = [("data.train", [p], data.format) for p in data.train_paths()]
    tables += [(f"data.eval.{n}", [e.path] if isinstance(e.path, str) else list(e.path), e.format or data.format)
               for n, e in data.eval.items()]
    out: dict[str, Any] = {"train_rows": 0, "eval_rows": {}, "data_sources": {}}
    for what, paths, fmt in tables:
        ds, spans, keys = open_table(paths, fmt, data, what, check=True)
        if what == "data.train":
            out["train_rows"] += len(ds)
        else:
            out["eval_rows"][what.split(".", 2)[2]] = len(ds)
        for source, first in data_sources(ds, keys.format, keys.metadata_key).items():
            try:
                spec, _ = spec_for(source, data)
            except KeyError:
                path, r = locate(spans, first)
                raise DataError(f"{what}: {path!r} row {r}: data_source {source!r} has no reward: add "
                                f"data.rewards[{source!r}] or data.default_reward") from None
            out["data_sources"][source] = spec
    return out
