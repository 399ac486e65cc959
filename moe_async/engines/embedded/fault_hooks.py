"""Test-only fault hook of the embedded engine: a weight update that stalls, so a test can kill
the engine while a sync is in flight (an engine that dies during a weight sync).

``MOE_ASYNC_ENGINE_SYNC_STALL=V:K:DIR`` in the engine's environment (inherited from the driver
in a local run): the K-th ``/update_weights_from_distributed`` call (K >= 1) the engine gets
while it serves weight_version V waits, before it receives its bucket, until it is killed or
``STALL_MAX_S`` seconds passed. Only one engine of a run stalls: the first to create
``DIR/stalled`` (exclusive create), which holds its pid (the test reads it and kills that
process). Not a configuration knob.
"""

from __future__ import annotations

import asyncio
import os

STALL_ENV = "MOE_ASYNC_ENGINE_SYNC_STALL"
STALL_MAX_S = 300.0  # s: an engine nobody kills goes on after this


def parse_stall(value: str | None) -> tuple[int, int, str] | None:
    """``(V, K, DIR)`` from ``MOE_ASYNC_ENGINE_SYNC_STALL``, None when unset.

    Raises: ValueError naming the variable when the value is not ``V:K:DIR`` with K >= 1."""
    if not value:
        return None
    parts = value.split(":", 2)
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or int(parts[1]) < 1 or not parts[2]:
        raise ValueError(f"{STALL_ENV}={value!r}: expected V:K:DIR (K >= 1), e.g. 2:2:/tmp/stall")
    return int(parts[0]), int(parts[1]), parts[2]


class SyncStall:
    """Counts update calls per served version; :meth:`maybe_stall` waits when due (module docstring)."""

    def __init__(self, value: str | None = None):
        self.spec = parse_stall(os.environ.get(STALL_ENV) if value is None else value)
        self.calls: dict[str, int] = {}

    async def maybe_stall(self, version: str | int) -> bool:
        """Count one update call at ``version``; wait when it is the configured one and this
        engine is the first to claim the stall. Returns whether it stalled."""
        if self.spec is None:
            return False
        version = str(version)  # the served weight_version (a string; an int is taken as its digits)
        n = self.calls[version] = self.calls.get(version, 0) + 1
        v, k, d = self.spec
        if (version, n) != (str(v), k):
            return False
        os.makedirs(d, exist_ok=True)
        try:
            fd = os.open(os.path.join(d, "stalled"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        await asyncio.sleep(STALL_MAX_S)
        return True
