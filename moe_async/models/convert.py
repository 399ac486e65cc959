"""Checkpoint conversion HF safetensors <-> Megatron ``torch_dist`` (the converters' API).

Kept for the callers of this module (``tools/convert_*.py``, tests): the code lives in
:mod:`moe_async.megatron` (``convert``: the two directions; ``parallel``, ``build``,
``hf_io``, ``dist_ckpt``, ``export``: their parts, shared with the trainer). The names
below are re-exported unchanged; see :mod:`moe_async.megatron.convert` for the contract.
"""

from __future__ import annotations

from moe_async.megatron.build import DEFAULT_VOCAB_DIV, build_model
from moe_async.megatron.convert import META_NAME, hf_to_megatron_checkpoint, megatron_to_hf_checkpoint, run_tool
from moe_async.megatron.dist_ckpt import (
    ITEM_ALIGN,
    in_process_save_strategy,
    is_optimizer_key,
    load_megatron_into_model,
    mmap_load_strategy,
    read_torch_dist_metadata,
    save_strategy,
    saved_vocab_rows,
    whole_glu_tensors,
)
from moe_async.megatron.export import HF_SIDE_FILES, ShardWriter, check_out_dir, parse_size
from moe_async.megatron.hf_io import (
    INDEX_NAME,
    check_hf_keys,
    iter_hf_tensors,
    load_hf_into_model,
    prefault_read,
    read_hf_config,
    read_hf_index,
    read_json_file,
)
from moe_async.megatron.parallel import check_layout, parallel_layout

__all__ = [
    "DEFAULT_VOCAB_DIV", "HF_SIDE_FILES", "INDEX_NAME", "ITEM_ALIGN", "META_NAME", "ShardWriter",
    "build_model", "check_hf_keys", "check_layout", "check_out_dir", "hf_to_megatron_checkpoint",
    "in_process_save_strategy", "is_optimizer_key", "iter_hf_tensors", "load_hf_into_model",
    "load_megatron_into_model", "megatron_to_hf_checkpoint", "mmap_load_strategy", "parallel_layout",
    "parse_size", "prefault_read", "read_hf_config", "read_hf_index", "read_json_file",
    "read_torch_dist_metadata", "run_tool", "save_strategy", "saved_vocab_rows", "whole_glu_tensors",
]
