"""Reading a run directory written by ``moe-async train``: ``metrics.jsonl`` (one JSON object
per step) and ``summary.json``; nothing else is needed and nothing is fetched."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from moe_async.errors import UserInputError
from moe_async.types import JsonDict


def finite_number(v: object) -> TypeGuard[float]:
    """A real number (not a bool), finite: a value a curve can draw."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Run:
    """One run's own records.

    ``steps``: the metrics.jsonl records in file order (``step`` and every metric);
    ``summary``: summary.json (empty when the run did not finish); ``name``: the run dir's name;
    ``notes``: what was left out while reading (a half-written last line), one sentence each;
    ``damaged``: files of the run that could not be read, each named with what is wrong (the
    report is made from the rest, and ``moe-async report`` exits non-zero).
    """

    path: Path
    name: str
    steps: list[JsonDict]
    summary: JsonDict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of the records that hold a finite number under ``key``."""
        xs, ys = [], []
        for r in self.steps:
            v = r.get(key)
            if finite_number(v):
                xs.append(int(r["step"]))
                ys.append(float(v))
        return xs, ys

    def keys(self, prefix: str) -> list[str]:
        """Metric names starting with ``prefix`` in any record, sorted (numeric suffixes by value)."""
        names = {k for r in self.steps for k in r if k.startswith(prefix)}

        def order(k: str):
            tail = k[len(prefix):].lstrip("_l/")
            return (0, int(tail), k) if tail.isdigit() else (1, 0, k)
        return sorted(names, key=order)


def load_run(path: str | Path) -> Run:
    """Read ``path``'s metrics.jsonl (required, one step or more) and summary.json (optional).

    Raises:
        UserInputError naming the path when it is not a run directory (missing, a file, no
        metrics.jsonl) or a file in it cannot be read (a line that is not JSON, a record
        without ``step``). A last line without its newline that is not JSON is the record a
        killed run was writing: it is left out and named in ``Run.notes``, not refused.
    """
    p = Path(path).expanduser()
    if p.is_file():
        raise UserInputError(f"{path}: not a run directory (a file; give the run's directory)")
    if not p.is_dir():
        raise UserInputError(f"{path}: not a run directory (no such directory)")
    mpath = p / "metrics.jsonl"
    if not mpath.is_file():
        raise UserInputError(f"{path}: not a run directory of moe-async train (no metrics.jsonl)")
    steps = []
    notes: list[str] = []
    try:
        text = mpath.read_text()
    except UnicodeDecodeError as e:
        raise UserInputError(f"{mpath}: not a metrics file (not UTF-8 text: {e.reason} at byte {e.start})") from e
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            int(rec["step"])
        except ValueError as e:
            if i == len(lines) and not text.endswith("\n"):
                notes.append(f"{mpath}:{i}: half-written last record left out (the run stopped while writing it)")
                break
            raise UserInputError(f"{mpath}:{i}: not a metrics record ({type(e).__name__}: {e})") from e
        except (KeyError, TypeError) as e:
            raise UserInputError(f"{mpath}:{i}: not a metrics record ({type(e).__name__}: {e})") from e
        steps.append(rec)
    if not steps:
        raise UserInputError(f"{mpath}: no steps recorded")
    summary: JsonDict = {}
    damaged: list[str] = []
    spath = p / "summary.json"
    if spath.is_file():
        try:
            summary = json.loads(spath.read_text())
        except ValueError as e:  # UnicodeDecodeError included
            summary = {}
            damaged.append(f"{spath}: not JSON ({e}); reported without it")
        if not isinstance(summary, dict):
            damaged.append(f"{spath}: a JSON {type(summary).__name__}, not an object; reported without it")
            summary = {}
    return Run(p.resolve(), p.resolve().name, steps, summary, notes, damaged)
