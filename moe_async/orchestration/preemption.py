"""Pre-emption that reaches one trainer rank only (a SIGTERM the driver does not see).

Under ``MOE_ASYNC_SIGTERM=checkpoint`` a rank's first SIGTERM only sets a flag; the driver asks
every rank for it (:class:`StopCheck`) while it waits for a batch and after each step, and
stops every rank at the same step boundary with that step's checkpoint.

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

_RANK: dict[str, Any] = {"signal": None, "prev": None}  # the signal name; the handler it replaced


def arm_rank_sigterm(rank: int) -> bool:
    """In a trainer rank's process (its actor's main thread): replace the SIGTERM handler by one
    that records the signal (:func:`rank_stop_signal`) and prints one line naming ``rank``; a
    second SIGTERM calls the handler it replaced (Ray's: the process exits). Idempotent.

    Returns False (nothing armed) off the main thread, where handlers cannot be set."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    if _RANK["prev"] is not None:
        return True
    _RANK["signal"] = None

    def _flag(signum, frame):
        if _RANK["signal"] is not None:
            prev = _RANK["prev"]
            if callable(prev):
                return prev(signum, frame)
            raise SystemExit(128 + signum)
        _RANK["signal"] = signal.Signals(signum).name
        print(f"[moe-async] trainer rank {rank}: {_RANK['signal']}: the run checkpoints after the current "
              "step and stops (a second one exits this rank at once)", flush=True)

    _RANK["prev"] = signal.signal(signal.SIGTERM, _flag) or signal.SIG_DFL
    return True


def rank_stop_signal() -> str | None:
    """The signal name this rank received since :func:`arm_rank_sigterm`, else None."""
    return _RANK["signal"]


class StopCheck:
    """The step loop's question "stop now?": the driver's own pre-emption flag, else the
    first trainer rank that reported one.

    Args:
        driver_flag: returns the driver's signal name or None (:func:`lifecycle.stop_requested`).
        rank_signals: returns ``[(rank, signal name), ...]`` for the ranks that received one
            (:meth:`TrainerGroup.stop_signals`); None: ranks are not asked (not armed).

    Calling it returns the reason (``"SIGTERM"``, ``"SIGTERM on trainer rank 1"``) or None; once
    a reason is found it is kept (a later call does not ask the ranks again).
    """

    def __init__(self, driver_flag: Callable[[], str | None],
                 rank_signals: Callable[[], list[tuple[int, str]]] | None = None):
        self.driver_flag = driver_flag
        self.rank_signals = rank_signals
        self.reason: str | None = None

    def __call__(self) -> str | None:
        if self.reason is None:
            sig = self.driver_flag()
            if sig is None and self.rank_signals is not None:
                got = self.rank_signals()
                if got:
                    sig = f"{got[0][1]} on trainer rank " + ", ".join(str(r) for r, _ in got)
            self.reason = sig
        return self.reason


class ArmableRanks(Protocol):
    """The trainer ranks as :func:`stop_check` arms and asks them (:class:`TrainerGroup`)."""

    def arm_preemption(self) -> None: ...

    def stop_signals(self) -> list[tuple[int, str]]: ...


def stop_check(trainer: ArmableRanks, armed: bool) -> StopCheck:
    """The driver's :class:`StopCheck`: with ``armed`` (``MOE_ASYNC_SIGTERM=checkpoint``) every
    trainer rank is armed here (:meth:`TrainerGroup.arm_preemption`) and asked from then on."""
    from moe_async.orchestration.lifecycle import stop_requested

    if not armed:
        return StopCheck(stop_requested)
    trainer.arm_preemption()
    return StopCheck(stop_requested, trainer.stop_signals)


CKPT_STALL_ENV = "MOE_ASYNC_CKPT_STALL"


def stall_if_due(rank: int, n: int, tmp: str) -> None:
    """Test-only: when ``MOE_ASYNC_CKPT_STALL=RANK:N`` names this ``rank`` and its ``n``-th save,
    print one line (the process id and the temporary checkpoint ``tmp``) and sleep until killed.

    Raises: ValueError naming the variable when its value is not ``RANK:N``."""
    value = os.environ.get(CKPT_STALL_ENV)
    if not value:
        return
    parts = value.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{CKPT_STALL_ENV}={value!r}: expected RANK:N, e.g. 0:2")
    if (int(parts[0]), int(parts[1])) != (rank, n):
        return
    print(f"[moe-async] test hook {CKPT_STALL_ENV}: trainer rank {rank} (pid {os.getpid()}) stalls in its "
          f"save {n} before renaming {tmp}", flush=True)
    while True:
        time.sleep(3600)


CKPT_WAIT_BUFFERED_ENV = "MOE_ASYNC_CKPT_WAIT_BUFFERED"


def wait_buffered_if_asked(buffered: Callable[[], int], timeout_s: float = 60.0) -> None:
    """Test-only: when ``MOE_ASYNC_CKPT_WAIT_BUFFERED=N`` is set, wait (0.2 s polls, at most
    ``timeout_s``) until ``buffered()``, the buffer's count of finished untrained groups, is at
    least N, so that a test's save holds groups generated ahead of training however loaded the
    machine is.

    Raises: ValueError naming the variable when N is not a whole number."""
    value = os.environ.get(CKPT_WAIT_BUFFERED_ENV)
    if not value:
        return
    if not value.isdigit():
        raise ValueError(f"{CKPT_WAIT_BUFFERED_ENV}={value!r}: expected a whole number of groups")
    end = time.monotonic() + timeout_s
    while buffered() < int(value) and time.monotonic() < end:
        time.sleep(0.2)


SIGTERM_MODES = ("checkpoint", "exit")


def sigterm_mode(environ: Mapping[str, str] = os.environ) -> str:
    """What a SIGTERM does to this run, from ``MOE_ASYNC_SIGTERM``: ``"checkpoint"`` (write the
    whole-run checkpoint at the step boundary and stop, exit 0) or ``"exit"`` (unset or empty:
    stop now, cleaning up, exit 1). Raises ``ValueError`` naming the variable for any other value
    (``1``, ``true``, ``Checkpoint``): a pre-empted run must not silently skip its checkpoint."""
    value = environ.get("MOE_ASYNC_SIGTERM", "") or "exit"
    if value not in SIGTERM_MODES:
        raise ValueError(f"MOE_ASYNC_SIGTERM={value!r} is not one of {SIGTERM_MODES}: set it to 'checkpoint' "
                         "(a SIGTERM writes the step's checkpoint and stops the run) or unset it")
    return value
