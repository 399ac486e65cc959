"""The console of ``moe-async train``: expected warnings folded into one line, everything in
the run's log file, a live view of the current phase.

:class:`RunConsole` replaces the driver's ``sys.stdout``/``sys.stderr`` for the run: every line
goes to ``<run dir>/console.log``; lines matching :data:`EXPECTED` are counted by kind, not
shown (:meth:`RunConsole.summary_line`); on a terminal a spinner shows the current phase.

Design notes: ``docs/design/logging.md``."""

from __future__ import annotations

import io
import re
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

# kind -> pattern (searched in the line with ANSI colours and Ray's "(Actor pid=N) " prefix removed)
EXPECTED: dict[str, re.Pattern] = {
    "Transformer Engine/Apex fallback": re.compile(r"Transformer Engine and Apex are not installed|Apex is not installed"),
    "deprecation": re.compile(r"DeprecationWarning|FutureWarning|is deprecated|will be removed in"),
    "Ray notice": re.compile(r"Token authentication is enabled|authentication token|Started a local Ray instance"
                             r"|Connecting to existing Ray cluster|Connected to Ray cluster|Ray deduplicates logs by default"),
    "progress bar": re.compile(r"\d+%\|[^|]*\|\s*\d+/\d+|\|\s*\d+/\d+ \[\d+:\d+"),
    "oversize-bucket note": re.compile(r"weight sync: .* exceeds bucket_bytes=\d+; sent alone"),
}

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RAY_PREFIX = re.compile(r"^\((?:[\w.:-]+ )?pid=\d+(?:, ip=[\d.]+)?\)\s?")
_RAY_REPEAT = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
_CONTINUATION = re.compile(r"^\s+\S")  # a warning's source line: "  warnings.warn("


def classify(line: str) -> str | None:
    """The :data:`EXPECTED` kind of ``line`` (raw, as Ray forwards it), or None."""
    text = _RAY_REPEAT.sub("", _RAY_PREFIX.sub("", _ANSI.sub("", line)))
    for kind, pat in EXPECTED.items():
        if pat.search(text):
            return kind
    return None


class _Stream(io.TextIOBase):
    """A text stream that hands whole lines (split at ``\\n`` and ``\\r``) to the console."""

    def __init__(self, console: "RunConsole", real: TextIO, name: str):
        self._console, self._real, self.name = console, real, name
        self._partial = ""

    def write(self, s: str) -> int:
        with self._console.lock:
            data = self._partial + s
            parts = re.split(r"(\r\n|\n|\r)", data)
            self._partial = parts.pop()  # text after the last line end
            for text, end in zip(parts[0::2], parts[1::2]):
                self._console._line(self, text, end)
        return len(s)

    def flush(self) -> None:
        self._real.flush()

    def flush_partial(self) -> None:
        with self._console.lock:
            if self._partial:
                self._console._line(self, self._partial, "")
                self._partial = ""

    def isatty(self) -> bool:
        return self._real.isatty()

    def fileno(self) -> int:
        return self._real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._real, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


class RunConsole:
    """The driver's console for one run (design notes: ``docs/design/logging.md``).

    Args:
        quiet: no live view (the per-step lines are left out by the run logger).
        install: replace ``sys.stdout``/``sys.stderr`` (False: an inert console, as when
            ``run_experiment`` is called from Python without one).
    """

    def __init__(self, quiet: bool = False, install: bool = True):
        self.quiet = quiet
        self.lock = threading.RLock()
        self.hidden: Counter[str] = Counter()
        self._reported = 0
        self._log: TextIO | None = None
        self._pending: list[str] = []
        self._skip_continuation: set[str] = set()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._installed = False
        self.log_path: Path | None = None
        if install:
            self._real_out, self._real_err = sys.stdout, sys.stderr
            self._out = _Stream(self, self._real_out, "stdout")
            self._err = _Stream(self, self._real_err, "stderr")
            sys.stdout, sys.stderr = self._out, self._err
            self._installed = True

    # ---- lines --------------------------------------------------------------------
    def _line(self, stream: _Stream, text: str, end: str) -> None:
        clean = _ANSI.sub("", text)
        if self._log is not None:
            self._log.write(clean + "\n")
        elif len(self._pending) < 100_000:
            self._pending.append(clean)
        if not clean.strip():
            if stream.name in self._skip_continuation or end == "\r":
                return
            self._show(stream, text)
            return
        body = _RAY_PREFIX.sub("", clean)
        if stream.name in self._skip_continuation and _CONTINUATION.match(body):
            return  # the hidden warning's source line
        kind = classify(text)
        if kind is not None:
            if end != "\r":  # a progress bar's intermediate states are not counted apart
                self.hidden[kind] += 1
            self._skip_continuation.add(stream.name)
            return
        self._skip_continuation.discard(stream.name)
        self._show(stream, text)

    def _show(self, stream: _Stream, text: str) -> None:
        if self._progress is not None:
            from rich.text import Text

            self._progress.console.print(Text.from_ansi(text), soft_wrap=True)
        else:
            stream._real.write(text + "\n")
            stream._real.flush()

    def attach_log(self, run_dir: Path) -> None:
        """Write everything so far, and everything from now on, to ``<run_dir>/console.log``."""
        if not self._installed:
            return
        with self.lock:
            self.log_path = Path(run_dir) / "console.log"
            self._log = open(self.log_path, "a", buffering=1, encoding="utf-8")
            for line in self._pending:
                self._log.write(line + "\n")
            self._pending = []

    def summary_line(self) -> str | None:
        """``[moe-async] N expected CPU warnings hidden (kind n, ...); full text: <log>`` for
        the ones not yet reported, or None when there are none."""
        with self.lock:
            total = sum(self.hidden.values())
            new = total - self._reported
            if new <= 0:
                return None
            self._reported = total
            kinds = ", ".join(f"{k} {n}" for k, n in self.hidden.most_common())
            where = self.log_path or "the run's console.log"
            more = "" if new == total else f"{new} more, "
            return f"[moe-async] {more}{total} expected CPU warnings hidden ({kinds}); full text: {where}"

    def report_hidden(self) -> None:
        """Print :meth:`summary_line` if there is anything new to report."""
        line = self.summary_line()
        if line is not None:
            print(line, flush=True)

    # ---- live view ------------------------------------------------------------------
    def status(self, label: str) -> None:
        """Show ``label`` as the current phase (spinner and elapsed time) on a terminal."""
        if not self._installed or self.quiet or not self._real_out.isatty():
            return
        with self.lock:
            if self._progress is None:
                from rich.console import Console
                from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

                self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                          console=Console(file=self._real_out), transient=True,
                                          redirect_stdout=False, redirect_stderr=False)
                self._progress.start()
                self._task = self._progress.add_task(label, total=None)
            else:
                assert self._task is not None  # added with the progress view
                self._progress.reset(self._task, description=label)

    def close(self) -> None:
        """Stop the live view, flush partial lines, restore the streams, close the log."""
        if not self._installed:
            return
        with self.lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
            self._out.flush_partial()
            self._err.flush_partial()
            sys.stdout, sys.stderr = self._real_out, self._real_err
            self._installed = False
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> "RunConsole":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
