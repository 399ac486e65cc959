"""Open prompt files as memory-mapped Hugging Face ``datasets`` tables.

``open_rows(paths, what, cache_dir)`` returns one :class:`datasets.Dataset` over every file
(``.jsonl``/``.json`` through datasets' JSON builder, ``.parquet`` through its Parquet builder,
both written once to datasets' Arrow cache and memory-mapped from there; a ``save_to_disk``
folder with :func:`datasets.load_from_disk`; a plain folder: its ``*.jsonl``, ``*.json``,
``*.parquet`` files in name order). Rows are read on demand, so a file of a million rows costs
its page cache, not a copy per process.

Errors are :class:`DataError` naming the config field (``what``), the file and, for a malformed
JSON line, its line number (1-based; found by re-reading the file only on that error path).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger(__name__)

_JSON = (".jsonl", ".json")
_PARQUET = (".parquet",)


class DataError(ValueError):
    """A prompt file cannot be used; the message names the config field, file, row and key."""


def _files(path: str, what: str) -> tuple[str, list[Path]]:
    """``(kind, files)``: kind ``json``/``parquet``/``disk``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{what}: {path!r}: no such file or folder")
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "state.json").is_file():
            return "disk", [p]
        fs = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in _JSON + _PARQUET)
        if not fs:
            raise DataError(f"{what}: folder {path!r} has no .jsonl, .json or .parquet file")
        kinds = {f.suffix in _PARQUET for f in fs}
        if len(kinds) > 1:
            raise DataError(f"{what}: folder {path!r} mixes JSON and Parquet files; give them as separate paths")
        return ("parquet" if kinds.pop() else "json"), fs
    if p.suffix in _JSON:
        return "json", [p]
    if p.suffix in _PARQUET:
        return "parquet", [p]
    raise DataError(f"{what}: {path!r}: unknown file type {p.suffix!r} (expected .jsonl, .json, .parquet)")


def _bad_json_line(f: Path) -> tuple[int, str] | None:
    """The first line of ``f`` that is not a JSON object: ``(1-based line, error)``."""
    with open(f, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                return n, f"{e.msg} (column {e.colno})"
            if not isinstance(obj, dict):
                return n, f"a JSON {type(obj).__name__}, not an object"
    return None


def _load_one(kind: str, files: list[Path], what: str, cache_dir: str | None) -> Dataset:
    import datasets

    datasets.disable_progress_bars()
    if kind == "disk":
        ds = datasets.load_from_disk(str(files[0]))
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else next(iter(ds))
            ds = ds[split]
        return ds
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"{what}: {str(f)!r} is empty (0 bytes)")
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - datasets wraps pyarrow's error; find the row ourselves
        if kind == "json":
            for f in files:
                bad = _bad_json_line(f)
                if bad is not None:
                    raise DataError(f"{what}: {str(f)!r} line {bad[0]}: malformed JSON: {bad[1]}") from e
        cause = e.__cause__ or e
        raise DataError(f"{what}: cannot read {[str(f) for f in files]}: {type(cause).__name__}: "
                        f"{str(cause)[:300]}") from e


def open_rows(paths: list[str], what: str, cache_dir: str | None = None) -> tuple[Dataset, list[tuple[str, int]]]:
    """``(dataset, spans)``: the rows of every path, concatenated in order, and each path's
    ``(path, number of rows)`` (to name a row's file in errors). Raises :class:`DataError`:
    missing path, unknown type, an empty file or one with no rows, malformed JSON (line)."""
    import datasets

    if not paths:
        raise DataError(f"{what}: no path given")
    parts, spans = [], []
    for path in paths:
        kind, files = _files(path, what)
        ds = _load_one(kind, files, what, cache_dir)
        if len(ds) == 0:
            raise DataError(f"{what}: {path!r} has no rows")
        parts.append(ds)
        spans.append((path, len(ds)))
    if len(parts) == 1:
        return parts[0], spans
    try:
        return datasets.concatenate_datasets(parts), spans
    except ValueError as e:
        raise DataError(f"{what}: the files {paths} have different columns/types: {e}") from e


def locate(spans: list[tuple[str, int]], index: int) -> tuple[str, int]:
    """``(path, row within that path)`` of concatenated row ``index``."""
    for path, n in spans:
        if index < n:
            return path, index
        index -= n
    raise IndexError(index)
