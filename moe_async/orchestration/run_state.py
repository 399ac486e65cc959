"""The data side of a whole-run checkpoint: which train prompts were settled.

Every drawn prompt has a draw number (its place in the seeded order over all epochs); it is
settled once trained or dropped for a named reason. :class:`DrawLedger` keeps the trained
frontier and the settled draws beyond it, saved atomically with each checkpoint, so a resumed
run draws the pending prompts again and trains each prompt once (a draw settled twice raises).

Design notes: ``docs/design/orchestration.md``."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from moe_async.types import JsonDict, Group

if TYPE_CHECKING:
    from ray.actor import ActorHandle

TRAINED = "trained"


class DrawLedger:
    """Settled draws of a run (``docs/design/orchestration.md``).

    Args:
        state: a saved :meth:`state_dict` to continue from (None: a new run).

    Raises:
        ValueError: a malformed ``state`` (named key) or a draw settled twice (the bug this
            ledger exists to catch: a prompt trained twice).
    """

    def __init__(self, state: JsonDict | None = None):
        self.frontier = 0
        self.settled: dict[int, str] = {}
        self.counts: Counter = Counter()
        if state:
            try:
                self.frontier = int(state["frontier"])
                self.settled = {int(k): str(v) for k, v in state["settled"].items()}
                self.counts = Counter({k: int(v) for k, v in state["counts"].items()})
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"run_state: malformed ledger ({type(e).__name__}: {e}); keys: frontier, settled, "
                                 "counts") from e

    def settle(self, seq: int, outcome: str) -> None:
        """Record draw ``seq`` as trained (``outcome="trained"``) or dropped with ``outcome``."""
        seq = int(seq)
        if seq < self.frontier or seq in self.settled:
            prev = self.settled.get(seq, "settled before the frontier")
            raise ValueError(f"draw {seq} settled twice: {prev} then {outcome}")
        self.settled[seq] = outcome
        self.counts[outcome] += 1
        while self.frontier in self.settled:  # advance over the settled prefix, keep the rest
            del self.settled[self.frontier]
            self.frontier += 1

    def state_dict(self, **extra: object) -> dict[str, object]:
        """``frontier``, ``settled`` (str keys: JSON), ``counts``, plus ``extra`` (version, step, K)."""
        return {"frontier": self.frontier, "settled": {str(k): v for k, v in sorted(self.settled.items())},
                "counts": dict(self.counts), **extra}


def group_draw(group: Group) -> int | None:
    """The draw number the rollout manager stamped on ``group``'s samples (None: not stamped)."""
    seq = group.samples[0].metadata.get("draw_seq") if group.samples else None
    return None if seq is None else int(seq)


def record_settled(ledger: DrawLedger, trained_groups: list[Group], rollout: ActorHandle, buffer: ActorHandle,
                   timeout_s: float = 120.0) -> None:
    """Settle the draws of ``trained_groups`` (just trained) and of every drop the rollout
    actor and the buffer actor recorded since the last call (Ray handles; each reply bounded
    by ``timeout_s``: ``ray.exceptions.GetTimeoutError`` names the call)."""
    import ray

    for g in trained_groups:
        seq = group_draw(g)
        if seq is not None:
            ledger.settle(seq, TRAINED)
    try:
        drops = ray.get(rollout.drain_settled.remote(), timeout=timeout_s)
        stale = ray.get(buffer.drain_stale_draws.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise ray.exceptions.GetTimeoutError(f"run_state: rollout/buffer drain: no reply within {timeout_s:.0f} s") from e
    for seq, reason in drops:
        ledger.settle(seq, reason)
    for seq in stale:
        ledger.settle(seq, "stale")


def resume_data(ledger: DrawLedger, resumed: JsonDict, buffer: ActorHandle, rollout: ActorHandle, trainer_version: int,
                timeout_s: float = 120.0) -> dict[str, int]:
    """A resumed run's data side, before generation starts (Ray handles; each reply bounded by
    ``timeout_s``): the saved buffer's groups back into ``buffer`` (stale ones at
    ``trainer_version`` dropped), then the prompts rewound to the ledger's frontier, passing
    over the settled and the restored draws; a checkpoint without a ledger continues after its
    loader position (``resumed["dataset"]``).

    Returns ``{"restored": n, "dropped_stale": m}`` (groups of the buffer snapshot; zeros without
    one). Raises: ``ray.exceptions.GetTimeoutError`` naming the call; ValueError naming the
    field of a malformed snapshot."""
    import ray

    from moe_async.buffer.snapshot import snapshot_draws

    def get(ref, what):
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise ray.exceptions.GetTimeoutError(f"run_state: {what}: no reply within {timeout_s:.0f} s") from e

    out = {"restored": 0, "dropped_stale": 0}
    snap = resumed.get("buffer")
    if snap and resumed.get("run_state"):  # restored groups are pending draws of the ledger
        out = get(buffer.restore.remote(snap, trainer_version), "buffer.restore")
    if resumed.get("run_state"):
        restored = snapshot_draws(snap) if out["restored"] else []
        get(rollout.resume_draws.remote(ledger.frontier, list(ledger.settled), restored), "rollout.resume_draws")
    elif resumed.get("dataset"):
        get(rollout.load_data_state.remote(resumed["dataset"]), "rollout.load_data_state")
    return out
