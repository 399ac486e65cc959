"""Adapter-only weight sync: the trainer's LoRA adapter (PEFT tensors) to engines that serve it
under versioned names, with no pause.

Data path: ``MegatronTrainer.export_lora(out=buffers.destination)`` (PEFT names, fp32, written
straight into a shared-memory buffer, :mod:`~moe_async.weight_sync.adapter_buffers`) -> one
flattened bucket (all tensors in one buffer, cast to the wire dtype), one ``ForkingPickler``
entry per engine TP rank (base64; SGLang's ``serialized_named_tensors``,
``load_format="flattened_bucket"``; the bucket packed once, its entries pickled per engine) ->
``/load_lora_adapter_from_tensors`` under the name ``{base}@{version}`` -> new requests use the
newest name (``lora_path``) -> versions older than ``version - max_staleness`` are unloaded (an
engine keeps one still in use until its last request ends) and their buffers are reused. Tokens
generated on ``{base}@{version}`` record ``weight_version`` = version.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Sequence, TypedDict

import torch

from moe_async.compat import no_device_scope
from moe_async.protocols import WeightReceiver
from moe_async.types import JsonDict
from moe_async.weight_sync.adapter_buffers import AdapterBuffers, PackedAdapter, layout_of
from moe_async.weight_sync.tensor_ipc import forking_pickle


def lora_entries(tensors: dict[str, torch.Tensor], copies: int = 1, dtype: torch.dtype | None = None) -> list[str]:
    """``serialized_named_tensors`` for ``/load_lora_adapter_from_tensors``: ``copies`` (engine TP
    size) base64 entries, each a ``ForkingPickler`` dict ``{name: tensor}`` (SGLang's tp_worker
    takes the deserialized object as the tensor dict when ``load_format`` is None; tensors in
    shared memory: keep ``tensors`` alive until the engines answered)."""
    named = {n: (t if dtype is None else t.to(dtype)).contiguous() for n, t in tensors.items()}
    raw = base64.b64encode(forking_pickle(named)).decode()
    return [raw] * copies


def lora_bucket_entries(tensors: dict[str, torch.Tensor], copies: int = 1,
                        dtype: torch.dtype | None = None) -> tuple[list[str], torch.Tensor]:
    """As :func:`lora_entries` with ``load_format="flattened_bucket"``: every tensor end to end in
    ONE uint8 buffer (one shared-memory segment instead of one per tensor; SGLang's tp_worker
    rebuilds the dict with ``FlattenedTensorBucket``; :class:`PackedAdapter`, as
    :func:`sync_adapter` sends it). Returns ``(entries, buffer)``: keep the buffer alive while an
    engine may read it."""
    buf = PackedAdapter.allocate(layout_of(tensors, dtype))
    buf.write(tensors)
    return buf.entries(copies), buf.flat


def adapter_bytes(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> int:
    """Bytes of the adapter on the wire (in ``dtype`` when given)."""
    size = (lambda t: torch.empty(0, dtype=dtype).element_size()) if dtype is not None else (lambda t: t.element_size())
    return sum(t.numel() * size(t) for t in tensors.values())


@dataclass
class AdapterVersions:
    """Which adapter names engines hold: ``newest`` (what new requests use) and the names to
    unload after each sync (older than ``version - max_staleness``, so every request the buffer
    may still admit finishes on its own version)."""

    base: str = "policy"
    max_staleness: int = 1
    loaded: list[int] = field(default_factory=list)

    def name(self, version: int) -> str:
        return f"{self.base}@{version}"

    @property
    def newest(self) -> str | None:
        return self.name(self.loaded[-1]) if self.loaded else None

    def synced(self, version: int) -> list[str]:
        """Record ``version`` as loaded; returns the names to unload now."""
        if self.loaded and version == self.loaded[-1]:
            return []  # the same version again (a re-sync after an engine restart)
        if self.loaded and version < self.loaded[-1]:
            raise ValueError(f"adapter version {version} after {self.loaded[-1]}: versions must increase")
        self.loaded.append(version)
        old = [v for v in self.loaded if v < version - self.max_staleness]
        self.loaded = [v for v in self.loaded if v not in old]
        return [self.name(v) for v in old]


class AdapterSync(TypedDict):
    """:func:`sync_adapter`'s result: the loaded adapter's name, its bytes, the names unloaded."""

    name: str
    bytes: int
    unloaded: list[str]


def sync_adapter(clients: Sequence[WeightReceiver], versions: AdapterVersions, version: int, tensors: dict[str, torch.Tensor],
                 config: JsonDict, tp_sizes: Sequence[int] | None = None,
                 dtype: torch.dtype | None = None, buffers: AdapterBuffers | None = None) -> AdapterSync:
    """Load ``tensors`` as ``versions.name(version)`` on every engine (blocking clients), then
    unload the versions beyond ``max_staleness``. Returns ``{"name", "bytes", "unloaded"}``.

    ``buffers``: the sender's shared-memory buffers, kept across syncs (a buffer is reused once
    the version it carried is unloaded everywhere; the exporter may write into the next one,
    ``buffers.destination``); default: a new buffer for this sync. The bucket is packed once
    for every engine.

    An engine that holds ``version`` already (a re-sync) or lacks an old one (restarted) is fine.

    Raises:
        RuntimeError: an engine refused the adapter (its ``error_message``), naming the engine.
    """
    name = versions.name(version)
    buffers = buffers if buffers is not None else AdapterBuffers()
    with no_device_scope():  # CPU tensors only
        buf = buffers.pack(tensors, dtype)
    for i, c in enumerate(clients):
        with no_device_scope():
            entries = buf.entries(tp_sizes[i] if tp_sizes else 1)
        try:
            c.load_lora_adapter_from_tensors(name, config, entries, load_format="flattened_bucket")
        except Exception as e:  # the client's EngineRequestError (a 400), duck-typed: engines is a higher layer
            if getattr(e, "status_code", None) != 400 or "already loaded" not in str(e):  # a re-sync: the engine holds this version already
                raise RuntimeError(f"engine {i}: /load_lora_adapter_from_tensors {name!r}: {e}") from e
    buffers.hold(name, buf)
    unloaded = versions.synced(version)
    for c in clients:
        for old in unloaded:
            try:
                c.unload_lora_adapter(old)
            except Exception as e:  # a restarted engine never had it
                if getattr(e, "status_code", None) != 400 or "not loaded" not in str(e):
                    raise
    buffers.release(unloaded)
    return {"name": name, "bytes": buf.nbytes, "unloaded": unloaded}  # = adapter_bytes(tensors, dtype)
