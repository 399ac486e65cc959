"""One bucket as SGLang 0.5.23's ``/update_weights_from_tensor`` payload (colocated engines).

SGLang's ``serialized_named_tensors`` entry for ``load_format="flattened_bucket"`` is the
base64 text of torch ``ForkingPickler`` bytes (its ``MultiprocessingSerializer.serialize(obj,
output_str=True)``) of the dict ``{"flattened_tensor": flat, "metadata": [m, ...]}`` that its
``FlattenedTensorBucket`` describes: ``flat`` a 1-D ``uint8`` tensor, each ``m`` with the
fields of its ``FlattenedTensorMetadata`` (``name``, ``shape`` (``torch.Size``), ``dtype``
(``torch.dtype``), ``start_idx``/``end_idx``/``numel``: bytes into ``flat``). The metadata
entries are ``types.SimpleNamespace`` objects: SGLang's receiver reads them by attribute
(``weight_updater._update_weights_from_flattened_bucket`` copies them field by field into its
own class), its ``SafeUnpickler`` allows the type, and the sender needs no sglang import
(sglang cannot be imported without triton, i.e. on a CPU machine).

The bytes of ``flat`` are not in the payload, only a handle to them:

* CUDA tensor: torch's CUDA IPC handle (``rebuild_cuda_tensor``), with the device given as
  its UUID string (what SGLang's ``monkey_patch_torch_reductions`` sends, so an engine with
  another ``CUDA_VISIBLE_DEVICES`` finds the GPU); SGLang's receiver accepts an index or a
  UUID there;
* CPU tensor: its storage is moved into shared memory and named (torch's ``file_system``
  sharing strategy, ``rebuild_storage_filename``), so an unrelated process (the engine) can
  open it by name from the HTTP body; the strategy is switched for the duration of the dump
  only (under a lock: it is a process-wide torch setting).

The sender must keep ``flat`` alive (and unchanged) until every engine answered the call.
"""

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
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    meta = bucket_metadata(names, dtypes, shapes)
    total = meta[-1].end_idx if meta else 0
    if total != flat.numel():
        raise ValueError(f"the bucket's tensors hold {total} bytes, flat has {flat.numel()}")
    payload = {"flattened_tensor": flat, "metadata": meta}
    return [base64.b64encode(forking_pickle(payload)).decode("ascii") for _ in range(copies)]
