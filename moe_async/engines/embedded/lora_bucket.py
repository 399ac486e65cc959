"""Adapters the embedded engine receives as one flattened bucket (``load_format="flattened_bucket"``
of ``/load_lora_adapter_from_tensors``), parsed once per bucket layout.

A sender that reuses its shared-memory buffers (the adapter sync) sends the same segment with
the same metadata and config sync after sync; only the values differ. :class:`BucketAdapters`
keeps the last :data:`MAX_MAPPED` buckets mapped (a segment sent again is read without a page
fault per page; an unload unmaps nothing) and, for each, the adapter parsed from it when every
tensor of that adapter views the bucket: the same segment (the same storage: the mapping is
held, so its address is not reused), metadata, config and engine dtype again give that
adapter's views under the new name once the new values passed the finiteness check (one pass
over the bucket). Anything else is decoded and parsed in full
(:func:`~moe_async.engines.embedded.tensor_update.bucket_views`,
:func:`~moe_async.engines.embedded.lora.parse_peft`). Called from the HTTP handlers' event loop
only (not thread-safe).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from moe_async.engines.embedded.lora import EngineAdapter, finite_spans, is_finite, parse_peft
from moe_async.engines.embedded.tensor_update import bucket_views
from moe_async.types import JsonDict

Tensor = torch.Tensor
#: senders' buckets kept mapped after their adapters left (the adapter sync cycles through
#: max_staleness + 2 buffers)
MAX_MAPPED = 4


@dataclass(eq=False)  # found by identity (its tensors have no truth value)
class _Mapped:
    """A bucket held mapped: ``bucket`` (``uint8`` over its whole storage), the ``key`` of the
    last load from it, that load's adapter as a ``template`` (its tensors all views of
    ``bucket``; None when some were copies) and the spans its finiteness check reads."""

    bucket: Tensor
    key: tuple | None
    template: EngineAdapter | None
    spans: list[Tensor]


class BucketAdapters:
    """Parses flattened-bucket adapters for ``model`` (``modules``: its ``named_modules()``) in
    ``dtype``, reusing the parse of a bucket layout seen before (module note)."""

    def __init__(self, model: torch.nn.Module, modules: dict[str, torch.nn.Module], dtype: torch.dtype):
        self.model, self.modules, self.dtype = model, modules, dtype
        self._mapped: list[_Mapped] = []
        self.reused = 0  # loads served from a kept parse

    def parse(self, name: str, config: JsonDict, flat: Tensor, metadata: list) -> EngineAdapter:
        """The adapter ``name`` of one bucket (``flat``: the payload's 1-D ``uint8`` tensor,
        ``metadata``: its ``FlattenedTensorMetadata`` entries); its tensors view the bucket
        (``sender`` set) where they are contiguous in the engine's dtype.

        Raises:
            ValueError: a metadata entry lacks a field or does not fit ``flat`` (naming it).
            LoraError: as :func:`~moe_async.engines.embedded.lora.parse_peft` (non-finite values
                included, naming the tensor).
        """
        bucket = torch.empty(0, dtype=torch.uint8).set_(flat.untyped_storage())
        key = _key(flat, metadata, config, self.dtype)
        kept = next((m for m in self._mapped if m.bucket.data_ptr() == bucket.data_ptr()), None)
        if kept is not None:
            self._mapped.remove(kept)
        if kept is not None and key is not None and kept.key == key and kept.template is not None \
                and all(is_finite(s) for s in kept.spans):
            self._mapped.append(kept)
            self.reused += 1
            return kept.template.renamed(name)
        tensors = dict(bucket_views(flat, metadata))
        ad = parse_peft(name, config, tensors, self.model, self.dtype, self.modules)  # names a non-finite tensor
        template = None
        if ad.views(bucket):
            ad.sender = bucket  # the sender's memory, until unloaded
            if ad.viewed_by_all(bucket):
                template = ad.renamed("")
        self._mapped = [*self._mapped, _Mapped(bucket, key, template, finite_spans(list(tensors.values())))][-MAX_MAPPED:]
        return ad


def _key(flat: Tensor, metadata: list, config: JsonDict, dtype: torch.dtype) -> tuple | None:
    """What a parse of ``flat`` depends on besides its values; None when an entry is malformed
    (the full parse names it)."""
    try:
        layout = tuple((m.name, tuple(m.shape), m.dtype, int(m.start_idx), int(m.end_idx)) for m in metadata)
        cfg = json.dumps(config, sort_keys=True)
    except (AttributeError, TypeError, ValueError):
        return None
    return flat.data_ptr(), flat.numel(), layout, cfg, dtype
