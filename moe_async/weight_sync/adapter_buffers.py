"""Shared-memory buffers the adapter-only sync sends the adapter in, reused across syncs.

A :class:`PackedAdapter` holds one adapter version in SGLang's flattened-bucket layout: every
tensor end to end in ONE ``uint8`` buffer in shared memory (torch's ``file_system`` sharing, one
segment opened by name). A fresh segment costs a page fault per page (tens of ms for 50 MB); a
reused one is a plain copy, or none at all when the exporter wrote the adapter into the buffer's
slots (:meth:`AdapterBuffers.destination`). Entries are pickled for each send: each pickle
takes a reference on the segment that the receiver's unpickling gives back (torch's
``file_system`` reductions), so one pickle read twice would let the segment be unlinked.

Reuse rule: an engine may keep views of a buffer for as long as it holds the version the buffer
carried (SGLang 0.5.23's ``LoRAAdapter`` keeps the CPU tensors it was given; the embedded engine
copies them at once), so a buffer is written again only after that version was unloaded on
every engine (:meth:`AdapterBuffers.release`; SGLang's unload returns once the adapter's
requests ended and the adapter is gone). A buffer whose load failed is dropped, never reused.
Not thread-safe: one sync at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moe_async.weight_sync.tensor_ipc import bucket_metadata, serialize_bucket, shared_uint8

Tensor = torch.Tensor
#: ``(name, dtype, shape)`` of each tensor, in bucket order
Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
#: free buffers kept beyond the ones in use (a sync takes one and frees one)
MAX_FREE = 2


def layout_of(tensors: dict[str, Tensor], dtype: torch.dtype | None = None) -> Layout:
    """The bucket layout of ``tensors`` sent in ``dtype`` (default: each tensor's own)."""
    return tuple((n, dtype or t.dtype, tuple(t.shape)) for n, t in tensors.items())


@dataclass
class PackedAdapter:
    """One flattened bucket in shared memory: ``flat`` (1-D ``uint8``), ``slots[name]`` the
    view of each tensor in it (its layout's dtype and shape), ``meta`` its SGLang
    ``FlattenedTensorMetadata`` fields (:func:`~moe_async.weight_sync.tensor_ipc.bucket_metadata`)."""

    layout: Layout
    flat: Tensor
    slots: dict[str, Tensor]
    meta: list

    @classmethod
    def allocate(cls, layout: Layout) -> PackedAdapter:
        """A new buffer for ``layout`` in shared memory (contents undefined)."""
        sizes = [torch.Size(s).numel() * d.itemsize for _, d, s in layout]
        flat = shared_uint8(sum(sizes))
        slots, off = {}, 0
        for (n, d, s), nb in zip(layout, sizes):
            slots[n] = flat[off:off + nb].view(d).view(s)
            off += nb
        meta = bucket_metadata([n for n, _, _ in layout], [d for _, d, _ in layout], [s for _, _, s in layout])
        return cls(layout, flat, slots, meta)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def entries(self, copies: int = 1) -> list[str]:
        """``serialized_named_tensors`` of the bucket (``load_format="flattened_bucket"``),
        ``copies`` entries (engine TP size), for ONE send (see the module's note)."""
        return serialize_bucket(self.flat, self.meta, copies=copies)

    def write(self, tensors: dict[str, Tensor]) -> None:
        """Copy (and cast) ``tensors`` into their slots; a tensor that is its slot (the exporter
        wrote it there: the object :meth:`AdapterBuffers.destination` returned) is not copied.
        ``tensors`` must have this buffer's layout."""
        for n, t in tensors.items():
            slot = self.slots[n]
            if t is not slot:
                slot.copy_(t)


class AdapterBuffers:
    """The buffers of one sender: ``free`` ones (reusable), ``held`` ones (a version engines
    may still read, by adapter name), and the one the next :meth:`pack` fills."""

    def __init__(self) -> None:
        self._free: list[PackedAdapter] = []
        self._held: dict[str, list[PackedAdapter]] = {}
        self._next: PackedAdapter | None = None
        self.allocated = 0  # buffers made so far (shared-memory segments)

    def destination(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor | None:
        """Where an exporter may write tensor ``name`` of the next sync (``out`` of
        ``MegatronTrainer.export_lora``): its slot in a free buffer, if a buffer of the last
        layout is free and the slot has this shape and dtype; else None (the exporter makes
        its own tensor and :meth:`pack` copies it)."""
        if self._next is None and self._free:
            self._next = self._free.pop()
        slot = self._next.slots.get(name) if self._next is not None else None
        if slot is None or tuple(slot.shape) != tuple(shape) or slot.dtype != dtype:
            return None
        return slot

    def pack(self, tensors: dict[str, Tensor], dtype: torch.dtype | None = None) -> PackedAdapter:
        """A buffer holding ``tensors`` (cast to ``dtype`` if given): the one :meth:`destination`
        handed out, else a free one of the same layout, else a new one; free buffers of another
        layout are dropped. The caller passes it to :meth:`hold` once loaded; a buffer not held
        (its load failed: an engine may or may not hold it) is dropped, never reused."""
        layout = layout_of(tensors, dtype)
        cands = self._free + ([self._next] if self._next is not None else [])
        self._next = None
        self._free = [b for b in cands if b.layout == layout]
        buf = self._free.pop() if self._free else None  # the one the exporter wrote into, if it fits
        if buf is None:
            buf = PackedAdapter.allocate(layout)
            self.allocated += 1
        buf.write(tensors)
        return buf

    def hold(self, name: str, buf: PackedAdapter) -> None:
        """``buf`` was loaded as adapter ``name``: not reused until ``name`` is released."""
        self._held.setdefault(name, []).append(buf)

    def release(self, names: Sequence[str]) -> None:
        """Adapters ``names`` were unloaded on every engine: their buffers are free again."""
        for n in names:
            self._free.extend(self._held.pop(n, []))
        del self._free[:-MAX_FREE]

    @property
    def held(self) -> dict[str, int]:
        """Adapter name -> buffers held for it."""
        return {n: len(b) for n, b in self._held.items()}
