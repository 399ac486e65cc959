"""Re-export of :mod:`moe_async.megatron.sharding` (full Megatron tensors <-> this rank's
shards; it moved into the Megatron runtime package shared with the converters)."""

from moe_async.megatron.sharding import (
    VOCAB_PARAMS,
    Piece,
    cp_positions,
    gather_full_state,
    gather_over_cp,
    load_full_state,
    local_pieces,
    needed_names,
    padded_vocab_size,
)

__all__ = ["VOCAB_PARAMS", "Piece", "cp_positions", "gather_full_state", "gather_over_cp", "load_full_state",
           "local_pieces", "needed_names", "padded_vocab_size"]
