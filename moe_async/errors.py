"""Exception types for bad user input found after the config has loaded.

:class:`moe_async.config.ConfigError` covers what the config file alone can tell. Some
input can only be judged at start-up against this host or the file system: a
``cpu_affinity`` core this machine lacks, a ``trainer.load`` path that is no checkpoint, a
``model.hf_path`` that is no HF model directory. Those checks raise :class:`UserInputError`
(its message names the field and the value), and ``moe-async train`` prints it as one line
``moe-async: <message>`` and exits with status 2, as it does for a ConfigError. Any other
exception is treated as a bug or a crash and keeps its traceback.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """A value the user gave (a config field, a path) is unusable here; the message names it.

    A ``ValueError`` subclass so that callers catching ``ValueError`` keep working.
    """


class UserInputFileNotFoundError(UserInputError, FileNotFoundError):
    """A path the user gave does not exist or lacks a required file.

    Both a :class:`UserInputError` and a ``FileNotFoundError`` (callers catching either keep
    working); ``str(e)`` is the message alone.
    """


class CheckpointReadError(UserInputError, RuntimeError):
    """A checkpoint file cannot be read (truncated, corrupt, not what its name says); the
    message names the file and says whether the trainer's state is unchanged.

    Both a :class:`UserInputError` (``moe-async train`` prints one line and exits 2) and a
    ``RuntimeError`` (what torch_dist read failures were reported as before).
    """


def check_safetensors_file(path: str) -> None:
    """Read a ``.safetensors`` file's header (8-byte little-endian length + JSON) and check that
    the file holds every byte its tensors' ``data_offsets`` name, so a truncated or corrupt
    file is refused by name before any tensor is read.

    Raises:
        CheckpointReadError: naming ``path`` (short header, bad JSON, missing bytes).
    """
    import json
    import os
    import struct

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise ValueError(f"header of {n} bytes, file of {size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: {size} bytes, its tensors end at byte {8 + n + end}")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointReadError(f"cannot read safetensors file {path}: {e}") from e


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
    import os

    import torch

    from moe_async.models.convert import read_torch_dist_metadata

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
