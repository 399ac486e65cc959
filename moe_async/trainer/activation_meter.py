"""Activation memory held for the backward pass, measured with autograd's saved-tensor hooks.

:class:`SavedActivationMeter` is a context manager around forward/backward passes: every tensor
autograd saves for the backward (``ctx.save_for_backward`` and the built-in ops' saved inputs,
Megatron's recompute included) is counted by its storage from the moment it is saved until its
graph node frees it; storages of the model's parameters (and their gradient buffers) are left
out, so the figure is activations only. ``peak_bytes``: the largest total held at once (bytes,
each storage once however many nodes save it); ``saved_bytes``: all ever saved.
"""

from __future__ import annotations

from typing import Iterable

import torch


class _Held:
    """A saved tensor's handle; releases its storage's count when autograd drops it."""

    __slots__ = ("t", "key", "meter")

    def __init__(self, t: torch.Tensor, key: int, meter: "SavedActivationMeter") -> None:
        self.t, self.key, self.meter = t, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedActivationMeter:
    """``with SavedActivationMeter(model.parameters()) as m: loss.backward()`` -> ``m.peak_bytes``.

    Args:
        params: tensors whose storages are not activations (the model's parameters); their
            ``main_grad`` buffers are left out too.
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._skip: set[int] = set()
        for p in params:
            self._skip.add(p.untyped_storage().data_ptr())
            g = getattr(p, "main_grad", None)
            if g is not None:
                self._skip.add(g.untyped_storage().data_ptr())
        self._live: dict[int, list[int]] = {}  # storage ptr -> [nbytes, handles]
        self.current_bytes = 0
        self.peak_bytes = 0
        self.saved_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self._skip or st.nbytes() == 0:
            return t
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [st.nbytes(), 0]
            self.current_bytes += entry[0]
            self.saved_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry[1] += 1
        return _Held(t, key, self)

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Held) else h

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current_bytes -= entry[0]
            del self._live[key]

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
