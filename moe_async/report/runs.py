"""Reading a run directory written by ``moe-async train``: ``metrics.jsonl`` (one JSON object
per step) and ``summary.json``; nothing else is needed and nothing is fetched.

A damaged file is named, not fatal: a metrics line that is not a record (not UTF-8, not
JSON, not an object, no integer ``step``) is skipped and counted, a metric value the report
reads that is not a number is left out, an unreadable summary.json is reported without; each
lands in ``Run.damaged`` (``moe-async report`` exits 1). Only a directory that is not a run's,
or one with nothing readable, is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from moe_async.errors import UserInputError
from moe_async.types import JsonDict

#: Bad metrics lines named one by one in ``Run.damaged``; the rest are only counted.
NAMED_LINES = 5


def finite_number(v: object) -> TypeGuard[float]:
    """A real number (not a bool), finite: a value a curve can draw."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Run:
    """One run's own records.

    ``steps``: the readable metrics.jsonl records in file order (``step`` and every metric),
    ``lines`` their 1-based line numbers; ``summary``: summary.json (empty when the run did
    not finish or it is damaged); ``name``: the run dir's name; ``notes``: what was left out or
    missing while reading (a half-written last line, no summary.json), one sentence each;
    ``damaged``: what of the run's files could not be read, each named with its file (and
    line) and what is wrong (the report is made from the rest, and ``moe-async report``
    exits non-zero).
    """

    path: Path
    name: str
    steps: list[JsonDict]
    summary: JsonDict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)

    def value(self, i: int, key: str) -> float | None:
        """``steps[i][key]`` as a float; None when absent, null, NaN or inf (not drawn). A
        value of another JSON type (a string, a bool, a list, an object) is None too, and is
        named in ``damaged`` (once per line and key)."""
        v = self.steps[i].get(key)
        if v is None or finite_number(v):
            return None if v is None else float(v)
        if isinstance(v, float):  # NaN / inf: a number the run logged, not drawn
            return None
        line = self.lines[i] if i < len(self.lines) else i + 1
        msg = (f"{self.path / 'metrics.jsonl'}:{line}: {key} is {json.dumps(v)[:40]} "
               f"(a JSON {_json_type(v)}), not a number; left out")
        if msg not in self.damaged:
            self.damaged.append(msg)
        return None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of the records that hold a finite number under ``key``."""
        xs, ys = [], []
        for i, r in enumerate(self.steps):
            v = self.value(i, key)
            if v is not None:
                xs.append(int(r["step"]))
                ys.append(v)
        return xs, ys

    def summary_number(self, section: str, key: str) -> float | None:
        """``summary[section][key]`` as a float (``eval_before`` / ``accuracy``); None when
        absent; a value that is not a finite number is named in ``damaged`` and None."""
        sec = self.summary.get(section)
        v = sec.get(key) if isinstance(sec, dict) else None
        if v is None or finite_number(v):
            return None if v is None else float(v)
        msg = f"{self.path / 'summary.json'}: {section}.{key} is {json.dumps(v)[:40]}, not a number; left out"
        if msg not in self.damaged:
            self.damaged.append(msg)
        return None

    def keys(self, prefix: str) -> list[str]:
        """Metric names starting with ``prefix`` in any record, sorted (numeric suffixes by value)."""
        names = {k for r in self.steps for k in r if k.startswith(prefix)}

        def order(k: str) -> tuple[int, int, str]:
            tail = k[len(prefix):].lstrip("_l/")
            return (0, int(tail), k) if tail.isdigit() else (1, 0, k)
        return sorted(names, key=order)


def _json_type(v: object) -> str:
    return {str: "string", bool: "bool", list: "list", dict: "object"}.get(type(v), type(v).__name__)


def _record(raw: bytes) -> JsonDict:
    """One metrics.jsonl line as a record; ``ValueError`` saying what is wrong."""
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        rec = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"a JSON {_json_type(rec)}, not an object")
    step = rec.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError("no step" if step is None else f"step is {json.dumps(step)[:40]}, not an integer")
    return rec


def _read_metrics(mpath: Path) -> tuple[list[JsonDict], list[int], list[str], list[str]]:
    """``(records, their line numbers, notes, damaged)`` of ``mpath``: bad lines skipped, the
    first :data:`NAMED_LINES` named, the rest counted; a last line without its newline that is
    not a record is the one a killed run was writing (a note, not damage)."""
    data = mpath.read_bytes()
    raw_lines = data.splitlines()
    steps: list[JsonDict] = []
    lines: list[int] = []
    notes: list[str] = []
    bad: list[str] = []
    for i, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            steps.append(_record(raw))
            lines.append(i)
        except ValueError as e:
            if i == len(raw_lines) and not data.endswith(b"\n") and bad == []:
                notes.append(f"{mpath}:{i}: half-written last record left out (the run stopped while writing it)")
            else:
                bad.append(f"{mpath}:{i}: not a metrics record ({e})")
    damaged = bad[:NAMED_LINES]
    if len(bad) > NAMED_LINES:
        damaged.append(f"{mpath}: {len(bad)} lines in all not metrics records, skipped "
                       f"({len(bad) - NAMED_LINES} more after the {NAMED_LINES} above)")
    elif bad:
        damaged.append(f"{mpath}: {len(bad)} line(s) not metrics records, skipped; {len(steps)} records read")
    return steps, lines, notes, damaged


def _read_summary(spath: Path) -> tuple[JsonDict, list[str], list[str]]:
    """``(summary, notes, damaged)``: summary.json, or ``{}`` with a note (missing) or a
    damage (not JSON, not an object)."""
    if not spath.is_file():
        return {}, [f"{spath}: missing (the run did not finish); held-out accuracy before/after left empty"], []
    try:
        summary = json.loads(spath.read_bytes())
    except ValueError as e:  # UnicodeDecodeError included
        return {}, [], [f"{spath}: not JSON ({e}); reported without it"]
    if not isinstance(summary, dict):
        return {}, [], [f"{spath}: a JSON {_json_type(summary)}, not an object; reported without it"]
    return summary, [], []


def load_run(path: str | Path) -> Run:
    """Read ``path``'s metrics.jsonl (required) and summary.json (optional), skipping and
    naming what is damaged (see the module's docstring).

    Raises:
        UserInputError naming the path when it is not a run directory (missing, a file, no
        metrics.jsonl), or when nothing in it can be read (no metrics record and no
        summary.json; the damage named).
    """
    p = Path(path).expanduser()
    if p.is_file():
        raise UserInputError(f"{path}: not a run directory (a file; give the run's directory)")
    if not p.is_dir():
        raise UserInputError(f"{path}: not a run directory (no such directory)")
    mpath = p / "metrics.jsonl"
    if not mpath.is_file():
        raise UserInputError(f"{path}: not a run directory of moe-async train (no metrics.jsonl)")
    steps, lines, notes, damaged = _read_metrics(mpath)
    summary, s_notes, s_damaged = _read_summary(p / "summary.json")
    if not steps:
        if not summary:
            why = "; ".join(damaged + s_damaged) or "no steps recorded"
            raise UserInputError(f"{mpath}: no metrics record can be read and no summary.json ({why})")
        damaged.append(f"{mpath}: no metrics record can be read; reported from summary.json only")
    return Run(p.resolve(), p.resolve().name, steps, summary, notes + s_notes, damaged + s_damaged, lines)
