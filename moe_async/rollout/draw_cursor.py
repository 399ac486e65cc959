"""The draw position over ``n`` train rows drawn epoch by epoch in a seeded order: the one
cursor under both prompt sources (reasoning-gym generators and prompt files), so that both
resume at the same draw the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import numpy as np


class DrawCursor:
    """Epoch ``epoch``'s order is ``order_of(epoch)`` (a permutation of ``range(n)``); draws go
    through it and on into the next epoch's. The draw number of the next draw is
    ``epoch * n + pos`` (:meth:`position`); :meth:`state_dict` is ``{"epoch", "pos"}``."""

    def __init__(self, n: int, order_of: Callable[[int], Sequence[int] | np.ndarray]):
        self.n = n
        self._order_of = order_of
        self.load_state_dict({"epoch": 0, "pos": 0})

    def next_index(self) -> int:
        """The row index of the next draw (advancing to the next epoch's order at its end)."""
        if self._pos >= self.n:
            self.load_state_dict({"epoch": self._epoch + 1, "pos": 0})
        i = int(self._order[self._pos])
        self._pos += 1
        return i

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "pos": self._pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._pos = int(state["epoch"]), int(state["pos"])
        self._order = self._order_of(self._epoch)

    def position(self) -> int:
        """The draw number of the next :meth:`next_index`: ``epoch * n + pos``."""
        return self._epoch * self.n + self._pos

    def seek(self, seq: int) -> None:
        """Make draw number ``seq`` the next one. Raises ValueError for a negative ``seq``."""
        if seq < 0:
            raise ValueError(f"draw number must be >= 0, got {seq}")
        self.load_state_dict({"epoch": seq // self.n, "pos": seq % self.n})
