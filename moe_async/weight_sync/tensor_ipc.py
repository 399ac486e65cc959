"""One bucket as SGLang 0.5.23's ``/update_weights_from_tensor`` payload (colocated engines).

Builds the base64 ``ForkingPickler`` text of ``{"flattened_tensor", "metadata"}`` that SGLang's
``FlattenedTensorBucket`` receiver reads (CUDA IPC handles, or CPU shared memory by name), and
reads it back for the embedded engine; needs no sglang import.

Design notes: ``docs/design/weight_sync.md``."""

from __future__ import annotations

import base64
import io
import threading
import types
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Iterator, Sequence

import torch
import torch.multiprocessing as tmp
from torch.multiprocessing import reductions  # registers torch's reducers with ForkingPickler

#: index of the device in ``reductions.reduce_tensor``'s CUDA rebuild arguments (torch 2.x;
#: SGLang's patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX)
_CUDA_DEVICE_ARG = 6
_strategy_lock = threading.Lock()


@contextmanager
def _file_system_sharing() -> Iterator[None]:
    """torch's sharing strategy is ``file_system`` inside the block (restored after)."""
    with _strategy_lock:
        prev = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            tmp.set_sharing_strategy(prev)


def _reduce_tensor_device_uuid(t: torch.Tensor):
    fn, args = reductions.reduce_tensor(t)
    if fn is reductions.rebuild_cuda_tensor and isinstance(args[_CUDA_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


def forking_pickle(obj: object) -> bytes:
    """``ForkingPickler`` bytes of ``obj`` (tensors as IPC / shared-memory handles, above)."""
    buf = io.BytesIO()
    p = ForkingPickler(buf)
    p.dispatch_table[torch.Tensor] = _reduce_tensor_device_uuid  # this pickler only
    with _file_system_sharing():
        p.dump(obj)
    return buf.getvalue()


def shared_uint8(nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of ``nbytes`` in shared memory under torch's ``file_system``
    strategy (pickled as a segment name, which a peer process can open; each pickle after the
    first costs no copy), its pages touched."""
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    if nbytes:
        with _file_system_sharing():
            flat.share_memory_()
    return flat


def bucket_metadata(names: Sequence[str], dtypes: Sequence[torch.dtype],
                    shapes: Sequence[Sequence[int]]) -> list[types.SimpleNamespace]:
    """SGLang's ``FlattenedTensorMetadata`` fields of tensors laid end to end from byte 0."""
    out, off = [], 0
    for n, d, s in zip(names, dtypes, shapes, strict=True):
        size = torch.Size(s)
        nb = size.numel() * d.itemsize
        out.append(types.SimpleNamespace(name=n, shape=size, dtype=d, start_idx=off, end_idx=off + nb, numel=nb))
        off += nb
    return out


def serialize_flattened_bucket(flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype],
                               shapes: Sequence[Sequence[int]], copies: int = 1) -> list[str]:
    """``serialized_named_tensors`` for one bucket: ``copies`` entries (one per engine TP
    rank, each pickled on its own as SGLang's ranks each open only their own), base64 text.

    Args:
        flat: the bucket's bytes, 1-D ``uint8`` (CPU or CUDA), tensors end to end in order.
        names/dtypes/shapes: the bucket's tensors (dtypes as ``torch.dtype``).

    Raises:
        ValueError: ``flat`` is not 1-D uint8 or its size differs from the tensors' bytes.
    """
    return serialize_bucket(flat, bucket_metadata(names, dtypes, shapes), copies)


def serialize_bucket(flat: torch.Tensor, meta: Sequence[types.SimpleNamespace], copies: int = 1) -> list[str]:
    """:func:`serialize_flattened_bucket` with the bucket's :func:`bucket_metadata` given
    (a sender that keeps a bucket's layout computes it once). Raises as it."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    total = meta[-1].end_idx if meta else 0
    if total != flat.numel():
        raise ValueError(f"the bucket's tensors hold {total} bytes, flat has {flat.numel()}")
    payload = {"flattened_tensor": flat, "metadata": list(meta)}
    return [base64.b64encode(forking_pickle(payload)).decode("ascii") for _ in range(copies)]
