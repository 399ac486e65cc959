"""Flattened buckets: several tensors packed into one contiguous byte buffer.

Layout (our ``flattened_bucket``; SGLang's FlattenedTensorBucket follows the same idea):
tensors are laid end to end as raw bytes (``uint8``) in the order of ``names``; each
tensor's byte length is ``prod(shape) * itemsize(dtype)``. Metadata travels over HTTP as
the ``names``, ``dtypes`` (``"float32"``...) and ``shapes`` lists of SGLang's
``UpdateWeightsFromDistributedReqInput``; the buffer travels over the broadcast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the form SGLang's request carries)."""
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_to_str`. Raises ``ValueError`` on an unknown dtype name."""
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def nbytes_of(shape: Iterable[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


@dataclass
class Bucket:
    """Tensors bound for one broadcast. ``nbytes`` is the flat buffer size in bytes."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    #: the update group it is broadcast over (several senders, moe_async.weight_sync.senders);
    #: None: the transport's own
    group_name: str | None = None

    @property
    def dtypes(self) -> list[str]:
        return [dtype_to_str(t.dtype) for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]

    def flatten(self) -> torch.Tensor:
        """Pack into a 1-D ``uint8`` tensor of ``nbytes`` bytes."""
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in self.tensors]
        if not parts:
            return torch.empty(0, dtype=torch.uint8)
        if len(parts) == 1:  # one tensor: its own bytes, no copy (a contiguous CPU/GPU view)
            return parts[0]
        return torch.cat(parts)


def unflatten(
    flat: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[tuple[str, torch.Tensor]]:
    """Split a flat ``uint8`` buffer back into named tensors (views into ``flat`` where
    alignment allows, copies otherwise).

    Raises:
        ValueError: the metadata lists differ in length, or their byte total differs from
            ``flat.numel()`` (bytes received must equal bytes sent).
    """
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"bucket metadata lengths differ: names={len(names)} dtypes={len(dtypes)} shapes={len(shapes)}"
        )
    out, off = [], 0
    for n, d, s in zip(names, dtypes, shapes):
        dt = str_to_dtype(d)
        nb = nbytes_of(s, dt)
        if off + nb > flat.numel():
            raise ValueError(f"bucket too small for {n!r}: need {off + nb} bytes, have {flat.numel()}")
        chunk = flat[off : off + nb]
        if off % dt.itemsize:
            chunk = chunk.clone()  # misaligned for a view as a wider dtype: copy
        out.append((n, chunk.view(dt).reshape(s)))
        off += nb
    if off != flat.numel():
        raise ValueError(f"bucket has {flat.numel()} bytes but metadata describes {off}")
    return out


def make_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[Bucket]:
    """Greedily group tensors into buckets of at most ``bucket_bytes`` bytes.

    A tensor larger than ``bucket_bytes`` is sent alone in a bucket grown to its size
    (a tensor larger than the bucket): bytes are never dropped and nothing asserts. Order is preserved.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    cur = Bucket()
    for name, t in named_tensors:
        nb = t.numel() * t.element_size()
        if cur.names and cur.nbytes + nb > bucket_bytes:
            yield cur
            cur = Bucket()
        cur.names.append(name)
        cur.tensors.append(t)
        cur.nbytes += nb
    if cur.names:
        yield cur
