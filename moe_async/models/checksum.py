"""Per-tensor checksums shared by the trainer and the engines (weight-sync verification)."""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 hex digest of the tensor's values as contiguous fp32 bytes (CPU, native byte
    order). Shape is not hashed; dtype differences vanish when values are fp32-exact (bf16 ->
    fp32 is exact)."""
    a = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.sha256(a.numpy().tobytes()).hexdigest()
