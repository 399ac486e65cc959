"""The embedded engines' torch threads around a held-out evaluation (``engine.eval_num_threads``).

While the driver waits on a held-out evaluation the trainer computes nothing (before the
first step, after the last, and between steps the driver blocks on the evaluation), so where
trainer and engines share cores the engines may take the trainer's too: :class:`EvalThreads`
sets every live engine to ``eval_num_threads`` on entry and back to ``num_threads`` on exit
(the embedded engine's ``POST /set_num_threads``, applied between forward passes). The count
changes speed only: generation is the same computation on more threads.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

from types import TracebackType
from typing import Callable

SetThreads = Callable[[str, int], "int | None"]


def http_set_threads(url: str, n: int) -> int | None:
    """``POST url/set_num_threads`` (30 s timeout, 2 attempts); the count in effect, None (SGLang)."""
    from moe_async.engines.client import SyncEngineClient

    with SyncEngineClient(url, timeout_s=30.0, retries=2) as client:
        return client.set_num_threads(n)


class EvalThreads:
    """Context manager around one held-out evaluation.

    Args:
        urls: ``() -> list[str]``, the engines to set (the live ones at that moment).
        eval_threads: threads during the evaluation; None: nothing is ever sent.
        threads: the threads to restore on exit (``engine.num_threads``).
        set_threads: ``(url, n) -> count in effect`` (default :func:`http_set_threads`).

    An engine that cannot be reached keeps its count and the evaluation goes on (a warning
    line names it): the threads change speed, never the result, and a dead engine is the
    supervisor's to report. ``changes`` counts the engines switched (tests, logs).
    """

    def __init__(self, urls: Callable[[], list[str]], eval_threads: int | None, threads: int,
                 set_threads: SetThreads = http_set_threads):
        self._urls, self.eval_threads, self.threads = urls, eval_threads, threads
        self._set_threads = set_threads
        self.changes = 0

    def _set_all(self, n: int) -> None:
        for url in self._urls():
            try:
                got = self._set_threads(url, n)
            except Exception as e:  # noqa: BLE001 - speed only; the run's checks report the engine
                print(f"[moe-async] warning: engine {url}: could not set {n} thread(s) ({e!r}); "
                      "it keeps its count", flush=True)
                continue
            self.changes += got is not None

    def __enter__(self) -> EvalThreads:
        if self.eval_threads is not None and self.eval_threads != self.threads:
            self._set_all(self.eval_threads)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.eval_threads is not None and self.eval_threads != self.threads:
            self._set_all(self.threads)
