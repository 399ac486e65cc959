"""Peak bytes of tensor storage allocated and still alive, counted by a dispatch hook
(a measuring aid for the streamed export's memory bound: tests/weight_sync/test_stream_export.py and
tools/bench_weight_sync.py).

``with AliveBytes() as ab: ...`` counts every storage that an aten op allocates inside the
block on this thread (an op output that aliases none of its tensor inputs), until the last
tensor holding it that the hook saw is garbage-collected; views made by ops on a counted
storage keep it counted. ``ab.peak`` is the largest sum of such bytes at any moment, ``ab.now``
the current one. Storages made before the block (the model's own shard) are never counted.
Not RSS: the allocator's caching and Python objects do not count, only tensor bytes.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AliveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, live tensors]
        self.now = 0
        self.peak = 0
        self.lock = threading.Lock()

    def _drop(self, key: int) -> None:
        with self.lock:
            e = self.refs.get(key)
            if e is None:
                return
            e[1] -= 1
            if e[1] == 0:
                self.now -= e[0]
                del self.refs[key]

    def _hold(self, key: int, t: torch.Tensor) -> None:
        self.refs[key][1] += 1
        weakref.finalize(t, self._drop, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
               if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key, nb = st.data_ptr(), st.nbytes()
            if nb == 0:
                continue
            with self.lock:
                if key in self.refs:  # a view (or in-place result) of a counted storage
                    self._hold(key, t)
                elif key not in ins:  # a new allocation
                    self.refs[key] = [nb, 0]
                    self._hold(key, t)
                    self.now += nb
                    self.peak = max(self.peak, self.now)
        return out
