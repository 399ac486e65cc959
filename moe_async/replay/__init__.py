"""Routed experts: compact storage aligned with token ids, segment joining, padding,
Megatron-Core router replay (off | R3 | R2) and the train/inference mismatch metrics.

Modules: :mod:`.routes` (storage, alignment, padding; numpy/torch only),
:mod:`.megatron` (the hook around Megatron's native ``RouterReplay``),
:mod:`.metrics` (mismatch metrics)."""

from moe_async.replay.metrics import MismatchMeter
from moe_async.replay.routes import (
    batch_routes,
    compact_routes,
    engine_routes,
    fill_padding,
    join_segments,
    select_moe_layers,
    storage_dtype,
    truncate_routes,
)

__all__ = [
    "MismatchMeter",
    "batch_routes",
    "compact_routes",
    "engine_routes",
    "fill_padding",
    "join_segments",
    "select_moe_layers",
    "storage_dtype",
    "truncate_routes",
]
