"""Per-tensor checksums, comparable between the trainer and the engines.

Both sides hash the same bytes: the tensor cast to float32, made contiguous, in C order.
"""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 hex digest of ``t.detach().to(torch.float32).contiguous()`` raw bytes."""
    t32 = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.sha256(t32.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
