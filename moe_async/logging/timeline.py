"""A timeline of a run as a Chrome trace (``<run dir>/trace.json``, opens in Perfetto or
``chrome://tracing``).

:class:`SpanRecorder` (where the work happens: engine requests, reward scoring) and
:class:`Timeline` (the driver's phases per step: wait with its filling/straggler parts, train,
sync, save, eval) each append one tuple per span, wall-clock ``time.time()`` seconds; the trace
is written when the run ends.

Design notes: ``docs/design/logging.md``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable
from moe_async.types import JsonDict

Span = tuple  # (track, name, t_start_s, t_end_s, args dict or None)


class SpanRecorder:
    """Spans recorded in one process, drained by the driver.

    Args:
        max_spans: spans kept between drains; beyond it new ones are counted in ``dropped``
            (bounded memory if nobody drains).
    """

    def __init__(self, max_spans: int = 200_000):
        self.max_spans = max_spans
        self.spans: list[Span] = []
        self.dropped = 0

    @staticmethod
    def now() -> float:
        """The spans' clock: ``time.time()`` seconds (comparable across processes and hosts)."""
        return time.time()

    def add(self, track: str, name: str, t_start: float, t_end: float, args: dict | None = None) -> None:
        """One span from ``t_start`` to ``t_end`` (``time.time()`` seconds) on ``track``."""
        if len(self.spans) >= self.max_spans:
            self.dropped += 1
            return
        self.spans.append((track, name, t_start, t_end, args))

    def drain(self) -> list[Span]:
        out, self.spans = self.spans, []
        return out


_PIDS = {"trainer loop": 1, "engines": 2, "rollout": 3}


def _process_of(track: str) -> str:
    if track.startswith("engine"):
        return "engines"
    if track == "trainer":
        return "trainer loop"
    return "rollout"


class Timeline:
    """The driver's recorder and the trace writer.

    Args:
        path: where :meth:`write` puts the trace (``<run dir>/trace.json``).
        on_phase: called with each phase's label as it begins (the console's live status).
    """

    def __init__(self, path: Path, on_phase: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.on_phase = on_phase
        self.rec = SpanRecorder(max_spans=2_000_000)
        self._open: tuple[str, float, dict] | None = None
        self.wait_spans: dict[int, tuple[float, float]] = {}

    def phase(self, name: str, step: int | None = None, label: str | None = None) -> None:
        """End the open phase now and begin ``name`` (``step`` goes to the span's args)."""
        now = time.time()
        self._close(now)
        self._open = (name, now, {} if step is None else {"step": step})
        if self.on_phase is not None:
            self.on_phase(label or (name if step is None else f"step {step}: {name}"))

    def idle(self) -> None:
        """End the open phase (nothing of the trainer loop runs until the next phase)."""
        self._close(time.time())

    def _close(self, now: float) -> None:
        if self._open is not None:
            name, t0, args = self._open
            self.rec.add("trainer", name, t0, now, args or None)
            if name == "wait" and "step" in args:
                self.wait_spans[args["step"]] = (t0, now)
            self._open = None

    def end_step(self, step: int, straggler_s: float, spans: list[Span]) -> None:
        """Split step ``step``'s ``wait`` into ``filling`` then ``straggler`` (its last
        ``straggler_s`` seconds) and add the spans drained from other processes; ends
        the open phase."""
        self._close(time.time())
        if step in self.wait_spans:
            t0, t1 = self.wait_spans.pop(step)
            cut = max(t0, t1 - max(0.0, straggler_s))
            self.rec.add("trainer", "filling", t0, cut, {"step": step})
            if cut < t1:
                self.rec.add("trainer", "straggler", cut, t1, {"step": step})
        self.extend(spans)

    def extend(self, spans: list[Span]) -> None:
        for s in spans:
            self.rec.add(*s)

    def write(self) -> Path:
        """Write the Chrome trace JSON (the whole file each time); returns its path."""
        self._close(time.time())
        self.path.write_text(json.dumps(chrome_trace(self.rec.spans)))
        return self.path


def _lanes(spans: list[Span]) -> list[int]:
    """A lane per span so that spans of one lane do not overlap (greedy, by start time)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][2])
    ends: list[float] = []
    lane = [0] * len(spans)
    for i in order:
        t0, t1 = spans[i][2], spans[i][3]
        for k, e in enumerate(ends):
            if e <= t0:
                lane[i], ends[k] = k, t1
                break
        else:
            lane[i] = len(ends)
            ends.append(t1)
    return lane


def chrome_trace(spans: list[Span]) -> JsonDict:
    """Chrome trace (object format) of ``spans``: complete events (``ph: X``) laned per track,
    a ``requests in flight`` counter per engine track, process and thread names."""
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(s[2] for s in spans)
    us = lambda t: round((t - origin) * 1e6, 1)  # noqa: E731
    by_track: dict[str, list[Span]] = {}
    for s in spans:
        by_track.setdefault(s[0], []).append(s)
    events: list[dict] = []
    tids: dict[tuple[str, int], int] = {}
    for pname, pid in _PIDS.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pname}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for track in sorted(by_track):
        ss = by_track[track]
        pid = _PIDS[_process_of(track)]
        # the trainer's phases nest (wait > filling/straggler): one thread, no lanes
        lanes = [0] * len(ss) if track == "trainer" else _lanes(ss)
        for s, lane in zip(ss, lanes):
            key = (track, lane)
            if key not in tids:
                tids[key] = len(tids) + 1
                tname = track if track == "trainer" else f"{track} · lane {lane}"
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[key], "args": {"name": tname}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tids[key],
                               "args": {"sort_index": tids[key]}})
            cat = "phase" if track == "trainer" else s[1]
            ev = {"ph": "X", "name": s[1], "cat": cat, "pid": pid, "tid": tids[key],
                  "ts": us(s[2]), "dur": max(0.0, round((s[3] - s[2]) * 1e6, 1))}
            if s[4]:
                ev["args"] = s[4]
            events.append(ev)
        if track.startswith("engine"):
            edges = sorted([(s[2], 1) for s in ss] + [(s[3], -1) for s in ss], key=lambda e: (e[0], e[1]))
            n = 0
            for t, d in edges:
                n += d
                events.append({"ph": "C", "name": f"requests in flight/{track}", "pid": pid, "tid": 0,
                               "ts": us(t), "args": {"requests": n}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin}}
