"""Megatron ``torch_dist`` checkpoint files: checks and metadata reads, before any tensor is read.

:func:`read_torch_dist_metadata` (errors name ``metadata.json`` / ``.metadata``),
:func:`check_torch_dist_files` (every file of a checkpoint directory checked before any
tensor is read; ``CheckpointReadError`` / ``UserInputFileNotFoundError`` naming the file),
:func:`saved_vocab_rows`, :func:`checkpoint_dtype`, :func:`is_optimizer_key`.
"""

from __future__ import annotations

import os
import re

import torch

from moe_async.megatron.hf_io import read_json_dict


def is_optimizer_key(key: str) -> bool:
    """True for a torch_dist tensor key of Megatron optimizer state: ``optimizer.*`` (one
    optimizer) or ``chained_<i>.optimizer.*`` (``ChainedOptimizer``: dense + expert)."""
    return re.match(r"(chained_\d+\.)?optimizer\.", key) is not None


def read_torch_dist_metadata(megatron_dir: str):
    """DCP ``Metadata`` of the torch_dist checkpoint in ``megatron_dir`` (its ``.metadata``
    file), after reading Megatron's ``metadata.json`` as JSON. FileNotFoundError naming the
    dir when either file is absent; ValueError naming the file when it does not parse
    (truncated or corrupt)."""
    from torch.distributed.checkpoint import FileSystemReader

    mj = os.path.join(megatron_dir, "metadata.json")
    if not os.path.exists(mj):
        raise FileNotFoundError(f"{megatron_dir} is not a Megatron torch_dist checkpoint: no metadata.json")
    if "sharded_backend" not in read_json_dict(mj, "Megatron checkpoint metadata"):
        raise ValueError(f"{mj} (Megatron checkpoint metadata) has no 'sharded_backend': not written by "
                         "megatron.core.dist_checkpointing")
    p = os.path.join(megatron_dir, ".metadata")
    if not os.path.exists(p):
        raise FileNotFoundError(f"{megatron_dir} is not a complete torch_dist checkpoint: no .metadata file")
    try:
        return FileSystemReader(megatron_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds on a cut or corrupt file
        raise ValueError(f"{p} (torch_dist metadata) cannot be read, truncated or corrupt: "
                         f"{type(e).__name__}: {e}") from None


def saved_vocab_rows(megatron_dir: str, metadata=None) -> int | None:
    """Rows of the saved (padded) embedding / output layer of a torch_dist checkpoint
    (``metadata``: its :func:`read_torch_dist_metadata`, read when not given)."""
    md = (metadata or read_torch_dist_metadata(megatron_dir)).state_dict_metadata
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if k in md and hasattr(md[k], "size"):
            return int(md[k].size[0])
    return None


def checkpoint_dtype(megatron_dir: str, meta: dict | None = None, metadata=None) -> str:
    """``"fp32"`` / ``"bf16"``: ``params_dtype`` of the conversion metadata when given, else
    the dtype of the saved word embedding."""
    if meta and "params_dtype" in meta:
        return meta["params_dtype"]
    md = (metadata or read_torch_dist_metadata(megatron_dir)).state_dict_metadata
    for k, m in md.items():
        if k.endswith("word_embeddings.weight") and hasattr(m, "properties"):
            return "bf16" if m.properties.dtype == torch.bfloat16 else "fp32"
    return "fp32"


def check_torch_dist_files(path: str):
    """Check the files of a Megatron ``torch_dist`` checkpoint directory before any tensor is
    read: ``metadata.json`` (a JSON object with ``sharded_backend``), ``.metadata`` (torch DCP
    metadata), ``common.pt`` (Megatron's common state, ``torch.load``-able) and every ``.distcp`` shard the
    metadata names (present, and at least as long as the byte extent ``offset + length`` of
    every item stored in it). Cost: the metadata and ``common.pt`` are read; the shards are
    only ``stat``-ed.

    Returns:
        The DCP ``Metadata`` (``torch.distributed.checkpoint.metadata.Metadata``), for reuse.

    Raises:
        UserInputFileNotFoundError: ``path`` lacks ``metadata.json`` or ``.metadata``, naming it.
        CheckpointReadError: naming the file that is truncated or corrupt, and for a short
            ``.distcp`` its size, the byte its items end at and one item key cut off.
    """
    from moe_async.errors import CheckpointReadError, UserInputFileNotFoundError

    try:
        metadata = read_torch_dist_metadata(path)
    except FileNotFoundError as e:
        raise UserInputFileNotFoundError(str(e)) from None
    except ValueError as e:
        raise CheckpointReadError(f"checkpoint {path}: {e}") from None
    common = os.path.join(path, "common.pt")
    if not os.path.exists(common):  # Megatron's dist_checkpointing.save always writes it
        raise CheckpointReadError(f"checkpoint {path}: {common} (Megatron common state) is missing")
    try:
        torch.load(common, map_location="cpu", weights_only=False)  # as Megatron's load_common
    except Exception as e:  # noqa: BLE001 - a cut zip/pickle raises many kinds
        raise CheckpointReadError(f"checkpoint {path}: cannot read {common} (Megatron common state; "
                                  f"{type(e).__name__}: {str(e)[:200]})") from None
    ends: dict[str, tuple[int, str]] = {}
    for idx, info in metadata.storage_data.items():
        end = int(info.offset) + int(info.length)
        if end > ends.get(info.relative_path, (-1, ""))[0]:
            ends[info.relative_path] = (end, idx.fqn)
    for rel, (end, fqn) in sorted(ends.items()):
        f = os.path.join(path, rel)
        if not os.path.exists(f):
            raise CheckpointReadError(f"checkpoint {path}: shard {f} named by its .metadata is missing")
        size = os.path.getsize(f)
        if size < end:
            raise CheckpointReadError(f"checkpoint {path}: shard {f} is truncated ({size} bytes; its items end "
                                      f"at byte {end}, e.g. {fqn})")
    return metadata
