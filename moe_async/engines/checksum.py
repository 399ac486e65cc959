"""Per-tensor checksums, comparable between the trainer and the engines: one definition,
in :mod:`moe_async.models.checksum`, re-exported here for engine code."""

from moe_async.models.checksum import tensor_checksum

__all__ = ["tensor_checksum"]
