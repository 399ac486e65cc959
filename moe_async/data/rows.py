"""Format adapters: a table row of slime JSONL, verl Parquet or a ``messages`` chat file as one
:class:`Row`, and the start-up check of a whole table (:func:`check_table`).

A :class:`Row` is what the rollout side needs of a prompt: ``prompt`` (a string, or a list of
``{"role", "content"}`` messages), ``answer`` (the label / ground truth as a string),
``data_source`` (selects the reward; None: the default reward), ``extra_info`` and ``metadata``
(dicts, passed to reward functions), ``index`` (the row in its table), ``split`` and
``has_label`` (False: a ``messages`` row with neither a label nor a final assistant message;
``answer`` is then ""; :func:`unlabelled` finds such rows column-wise at start-up), and for a
train row ``file`` / ``file_row`` (its ``data.train`` entry and the row within it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moe_async.data.source import DataError, locate
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from datasets import Dataset
    import pyarrow as pa


@dataclass
class Row:
    """One prompt row (module docstring). Picklable: it travels to reward workers."""

    prompt: str | list[dict[str, str]]
    answer: str
    data_source: str | None = None
    extra_info: JsonDict = field(default_factory=dict)
    metadata: JsonDict = field(default_factory=dict)
    index: int = 0
    split: str = "train"
    has_label: bool = True
    file: str | None = None  # the data.train entry (file or folder) of a train row
    file_row: int | None = None  # the row within that entry

    @property
    def question(self) -> str:
        """The prompt's text: the string, or the last user message's content."""
        if isinstance(self.prompt, str):
            return self.prompt
        users = [m.get("content", "") for m in self.prompt if m.get("role") == "user"]
        return str(users[-1] if users else self.prompt[-1].get("content", ""))


@dataclass(frozen=True)
class Keys:
    """Column names and format of one table."""

    format: str  # slime | verl | messages (resolved, never auto)
    input_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = "metadata"


def resolve_format(fmt: str, columns: list[str], input_key: str) -> str:
    """``auto`` -> ``verl`` (a ``reward_model`` column), ``messages`` (a ``messages`` column and
    no ``input_key`` column) or ``slime``; any other value as given."""
    if fmt != "auto":
        return fmt
    if "reward_model" in columns:
        return "verl"
    if "messages" in columns and input_key not in columns:
        return "messages"
    return "slime"


def _as_dict(v: object) -> JsonDict:
    if v is None:
        return {}
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            return {"text": v}
    return dict(v) if isinstance(v, dict) else {"value": v}


# the roles chat templates know (OpenAI's, plus Llama 3's ipython and the older function)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})


def _messages_ok(v: object) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in v)


def _check_message_column(table: pa.Table, col: str, spans: list[tuple[str, int]], what: str) -> None:
    """Every row of the ``list<struct<role, content, ...>>`` column ``col`` is a non-empty list
    of messages whose ``role`` is one of :data:`ROLES` and whose ``content`` is a string.

    Raises:
        DataError: naming the file, row (JSONL line) and key of the first bad row.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = table.column(col).combine_chunks()
    empty = pc.equal(pc.list_value_length(arr), 0)
    if pc.any(empty).as_py():
        row = int(pc.indices_nonzero(empty)[0].as_py())
        raise DataError(f"{what}: {where_row(spans, row)}: key {col!r} is an empty message list")
    flat, parents = pc.list_flatten(arr), pc.list_parent_indices(arr)

    def row_of(mask: pa.Array) -> int:
        return int(parents[int(pc.indices_nonzero(mask)[0].as_py())].as_py())

    if flat.null_count:
        raise DataError(f"{what}: {where_row(spans, row_of(pc.is_null(flat)))}: key {col!r} holds a null message")
    for name in ("role", "content"):
        f = pc.struct_field(flat, name)
        if not (pa.types.is_string(f.type) or pa.types.is_large_string(f.type)):
            raise DataError(f"{what}: {where_row(spans, 0)}: key {col!r}: a message's {name!r} has type {f.type}; "
                            "expected a string")
        if f.null_count:
            raise DataError(f"{what}: {where_row(spans, row_of(pc.is_null(f)))}: key {col!r}: a message's {name!r} "
                            "is null; expected a string")
    roles = pc.struct_field(flat, "role")
    bad = pc.invert(pc.is_in(roles, value_set=pa.array(sorted(ROLES))))
    if pc.any(bad).as_py():
        i = int(pc.indices_nonzero(bad)[0].as_py())
        raise DataError(f"{what}: {where_row(spans, int(parents[i].as_py()))}: key {col!r}: role "
                        f"{roles[i].as_py()!r} is not one of {sorted(ROLES)}")


def to_row(raw: JsonDict, keys: Keys, index: int, split: str) -> Row:
    """The :class:`Row` of table row ``raw`` (already checked by :func:`check_table`); an
    ``env_class`` column (SkyRL's: the row's multi-turn environment, moe_async/agent) goes to
    ``Row.metadata["env_class"]``."""
    row = _to_row(raw, keys, index, split)
    if raw.get("env_class"):
        row.metadata = {**row.metadata, "env_class": str(raw["env_class"])}
    return row


def _to_row(raw: JsonDict, keys: Keys, index: int, split: str) -> Row:
    if keys.format == "verl":
        rm = raw.get("reward_model") or {}
        return Row(prompt=[dict(m) for m in raw["prompt"]], answer=_label(rm.get("ground_truth")),
                   data_source=raw.get("data_source"), extra_info=_as_dict(raw.get("extra_info")),
                   index=index, split=split)
    if keys.format == "messages":
        msgs = [dict(m) for m in raw["messages"]]
        label = raw.get(keys.label_key)
        if label is None and msgs and msgs[-1]["role"] == "assistant":
            label = msgs.pop()["content"]
        meta = _as_dict(raw.get(keys.metadata_key))
        return Row(prompt=msgs, answer=_label(label), data_source=raw.get("data_source") or meta.get("data_source"),
                   extra_info=_as_dict(raw.get("extra_info")), metadata=meta, index=index, split=split,
                   has_label=label is not None)
    p = raw[keys.input_key]
    meta = _as_dict(raw.get(keys.metadata_key))
    return Row(prompt=p if isinstance(p, str) else [dict(m) for m in p], answer=_label(raw[keys.label_key]),
               data_source=raw.get("data_source") or meta.get("data_source"),
               extra_info=_as_dict(raw.get("extra_info")) or meta, metadata=meta, index=index, split=split)


def unlabelled(ds: Dataset, keys: Keys) -> pa.Array | None:
    """A pyarrow boolean array, True for each row with no label: only a ``messages`` table can
    have such rows (no ``label_key`` value and a last message that is not the assistant's); the
    other formats require their label (:func:`check_table`), so None for them, or when every
    row is labelled."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if keys.format != "messages":
        return None
    table = arrow_table(ds)
    n = table.num_rows
    no_label = pc.is_null(table.column(keys.label_key)).combine_chunks() if keys.label_key in ds.column_names \
        else pa.array([True] * n)
    t = table.schema.field("messages").type
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type):
        arr = table.column("messages").combine_chunks()
        last = pc.subtract(arr.offsets[1:], 1)  # lists are non-empty (check_table)
        roles = pc.take(pc.struct_field(arr.values, "role"), last)
        not_assistant = pc.fill_null(pc.not_equal(roles, "assistant"), True)
    else:  # a column of mixed JSON values: row by row
        flags = [not (isinstance(v, list) and v and isinstance(v[-1], dict) and v[-1].get("role") == "assistant")
                 for b in ds.select_columns(["messages"]).iter(batch_size=10_000) for v in b["messages"]]
        not_assistant = pa.array(flags, pa.bool_())
    mask = pc.and_(no_label, not_assistant)
    return mask if pc.any(mask).as_py() else None


def arrow_table(ds: Dataset) -> pa.Table:
    """The pyarrow table under a ``datasets.Dataset`` (memory-mapped; no copy)."""
    return ds.data.table if hasattr(ds.data, "table") else ds.data


def _label(v: object) -> str:
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return "" if v is None else str(v)


def where_row(spans: list[tuple[str, int]], i: int) -> str:
    """``'file' row r`` (plus ``(line r+1)`` for JSON files) of concatenated row ``i``."""
    path, r = locate(spans, i)
    line = f" (line {r + 1})" if path.endswith((".jsonl", ".json")) else ""
    return f"{path!r} row {r}{line}"


def _first_null(table: pa.Table, col: str) -> int | None:
    import pyarrow.compute as pc

    c = table.column(col)
    if c.null_count == 0:
        return None
    return int(pc.indices_nonzero(pc.is_null(c))[0].as_py())


def check_table(ds: Dataset, spans: list[tuple[str, int]], keys: Keys, what: str, need_label: bool = True,
                chat_template: bool = True) -> None:
    """Refuse a table the format cannot read, naming ``what`` (the config field), the file, the
    row (the line of a JSONL file) and the key: a missing column, a row without the prompt or
    label (a ``messages`` row's label is checked per reward by :mod:`moe_async.data.check`), a
    prompt that is neither a string nor a list of ``{"role", "content"}`` messages.
    Column-wise on the Arrow table; row by row only for a column of mixed JSON types.

    Raises: :class:`DataError`.
    """
    table = arrow_table(ds)
    cols = list(ds.column_names)
    label_col: str | None
    if keys.format == "verl":
        prompt_col, label_col = "prompt", "reward_model"
        for c in ("prompt", "reward_model"):
            if c not in cols:
                raise DataError(f"{what}: {spans[0][0]!r}: verl format needs column {c!r}; columns: {cols}")
    elif keys.format == "messages":  # a row's label may be its last (assistant) message, or none:
        prompt_col, label_col = "messages", None  # moe_async.data.check refuses that per reward
        if prompt_col not in cols:
            raise DataError(f"{what}: {spans[0][0]!r}: messages format needs column 'messages'; columns: {cols}")
    else:
        prompt_col, label_col = keys.input_key, keys.label_key
        for c, field_ in ((keys.input_key, "data.input_key"), (keys.label_key, "data.label_key")):
            if c not in cols and (c == keys.input_key or need_label):
                raise DataError(f"{what}: {where_row(spans, 0)}: missing key {c!r} ({field_}); columns: {cols}")
    renamable = keys.format not in ("verl", "messages")  # slime's keys: data.input_key / data.label_key
    bad = _first_null(table, prompt_col)
    if bad is not None:
        raise DataError(f"{what}: {where_row(spans, bad)}: missing key {prompt_col!r}"
                        + (" (data.input_key names the prompt's key)" if renamable else ""))
    if need_label and label_col is not None:
        bad = _first_null(table, label_col)
        if bad is None and keys.format == "verl":
            import pyarrow.compute as pc

            gt = pc.struct_field(table.column("reward_model").combine_chunks(), "ground_truth") \
                if "ground_truth" in [f.name for f in table.schema.field("reward_model").type] else None
            if gt is None:
                raise DataError(f"{what}: {where_row(spans, 0)}: missing key 'reward_model.ground_truth'")
            if gt.null_count:
                bad = int(pc.indices_nonzero(pc.is_null(gt))[0].as_py())
                raise DataError(f"{what}: {where_row(spans, bad)}: missing key 'reward_model.ground_truth'")
        if bad is not None:
            raise DataError(f"{what}: {where_row(spans, bad)}: missing key {label_col!r}"
                            + (" (data.label_key names the label's key)" if renamable else ""))
    _check_prompt_types(ds, table, prompt_col, spans, what, keys, chat_template)


def _check_prompt_types(ds: Dataset, table: pa.Table, col: str, spans: list[tuple[str, int]], what: str, keys: Keys, chat: bool) -> None:
    import pyarrow as pa

    t = table.schema.field(col).type
    want = "a string or a list of {'role', 'content'} messages" if keys.format == "slime" else \
        "a list of {'role', 'content'} messages"
    if type(ds.features.get(col)).__name__ == "Json":  # mixed JSON values: checked row by row below
        pass
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        if keys.format != "slime":
            raise DataError(f"{what}: {where_row(spans, 0)}: key {col!r} is a string; expected {want}")
        return
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        v = t.value_type
        if pa.types.is_struct(v) and {"role", "content"} <= {f.name for f in v}:
            if not chat:
                raise DataError(f"{what}: {where_row(spans, 0)}: key {col!r} is a message list but "
                                "data.apply_chat_template=false needs a string prompt")
            _check_message_column(table, col, spans, what)
            return
        raise DataError(f"{what}: {where_row(spans, 0)}: key {col!r} has type {t}; expected {want}")
    else:
        raise DataError(f"{what}: {where_row(spans, 0)}: key {col!r} has type {t}; expected {want}")
    # a column of mixed JSON values (datasets' Json feature): each row
    i = 0
    for batch in ds.select_columns([col]).iter(batch_size=10_000):
        for v in batch[col]:
            ok = _messages_ok(v) and chat or (isinstance(v, str) and keys.format == "slime")
            if not ok:
                raise DataError(f"{what}: {where_row(spans, i)}: key {col!r} is {type(v).__name__} "
                                f"{json.dumps(v)[:60]}; expected {want}")
            i += 1
