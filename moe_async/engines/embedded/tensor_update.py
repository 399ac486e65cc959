"""The embedded engine's ``POST /update_weights_from_tensor`` (SGLang 0.5.23's colocated path).

The body holds SGLang's ``UpdateWeightsFromTensorReqInput`` fields only (an unknown one is a 422):
base64 ``ForkingPickler`` handles to the sender's tensors (CUDA IPC or CPU shared memory by
name), copied onto the engine's device and applied with the same session semantics as the
distributed update. A bad handle, name or shape is a 400 naming it.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import base64
import binascii
import builtins
import collections
import copyreg
import io
import pickle
import types
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fastapi import APIRouter

from moe_async.engines.embedded.weight_update import (
    WeightUpdater,
    _fail,
    _Req,
    apply_update_call,
)
from moe_async.weight_sync.bucket import nbytes_of
from moe_async.weight_sync.packing import contiguous_span

#: SGLang 0.5.23's refusal outside a session (scheduler_components/weight_updater.py)
OUTSIDE_SESSION_TENSOR = ("update_weights_from_tensor must run between begin_weight_update() and "
                          "end_weight_update()")


class UpdateWeightsFromTensorReqInput(_Req):
    """SGLang's fields (``managers/io_struct.py``); on the wire each entry is base64 text."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


@dataclass
class FlattenedTensorMetadata:
    """What a pickled ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` (a
    slime-style sender's) is rebuilt as here: the same fields, without importing sglang."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor``, with the device given as an index or (as SGLang's
    patched reductions and our sender send it) as the GPU's UUID string."""
    from torch.multiprocessing import reductions as red

    dev = args[6]
    if isinstance(dev, str):
        match = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == dev]
        if not match:
            raise ValueError(f"no visible GPU has the UUID {dev!r} of the sender's tensor")
        args = (*args[:6], match[0], *args[7:])
    return red.rebuild_cuda_tensor(*args)


def _allowed() -> dict[tuple[str, str], Any]:
    from torch.multiprocessing import reductions as red

    ok: dict[tuple[str, str], Any] = {}
    for n in ("dict", "list", "tuple", "int", "float", "bool", "str", "bytes", "bytearray"):
        ok[("builtins", n)] = getattr(builtins, n)
    ok[("collections", "OrderedDict")] = collections.OrderedDict
    ok[("copyreg", "__newobj__")] = getattr(copyreg, "__newobj__")
    ok[("types", "SimpleNamespace")] = types.SimpleNamespace
    ok[("torch", "Tensor")] = torch.Tensor
    ok[("torch", "Size")] = torch.Size
    ok[("torch", "device")] = torch.device
    ok[("torch", "UntypedStorage")] = torch.UntypedStorage
    ok[("torch.storage", "UntypedStorage")] = torch.storage.UntypedStorage
    ok[("torch.storage", "TypedStorage")] = torch.storage.TypedStorage
    for n in ("rebuild_tensor", "rebuild_storage_filename", "rebuild_typed_storage", "rebuild_storage_empty"):
        ok[("torch.multiprocessing.reductions", n)] = getattr(red, n)
    ok[("torch.multiprocessing.reductions", "rebuild_cuda_tensor")] = _rebuild_cuda_tensor
    for n in dir(torch):
        v = getattr(torch, n, None)
        if isinstance(v, torch.dtype):
            ok[("torch", n)] = v
    ok[("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")] = FlattenedTensorMetadata
    return ok


_ALLOWED = _allowed()


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals a tensor payload needs (containers, dtypes, torch's tensor
    and storage rebuild functions, SGLang's metadata class: mapped to ours); anything else is
    an ``UnpicklingError`` naming it. The ``file_descriptor`` handles (``rebuild_storage_fd``)
    are refused: they cannot be opened from an HTTP request."""

    def find_class(self, module: str, name: str) -> Any:
        v = _ALLOWED.get((module, name))
        if v is None:
            hint = (" (a file-descriptor shared tensor: the sender must use torch's file_system sharing "
                    "strategy)") if name == "rebuild_storage_fd" else ""
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload{hint}")
        return v


def decode_named_tensors(entry: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of one ``serialized_named_tensors`` entry (``docs/design/engines.md``).

    Raises:
        ValueError: not base64, not a payload of ``load_format``, a global not allowed, a
            metadata entry out of the flat tensor's bounds or of the wrong size.
    """
    if load_format not in (None, "direct", "flattened_bucket"):
        raise ValueError(f"load_format must be null, 'direct' or 'flattened_bucket', got {load_format!r}")
    obj = load_entry(entry)
    if load_format == "flattened_bucket":
        return bucket_views(*flattened_bucket(obj))
    if not (isinstance(obj, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in obj)):
        raise ValueError(f"load_format={load_format!r} needs a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in obj]


def load_entry(entry: str) -> object:
    """The object one base64 ``serialized_named_tensors`` entry pickles (:class:`RestrictedUnpickler`).
    Raises ValueError: not base64, or it cannot be unpickled (naming why)."""
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"serialized_named_tensors[0] is not base64: {e}") from None
    try:
        return RestrictedUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure is the sender's
        raise ValueError(f"serialized_named_tensors[0] cannot be deserialised: {type(e).__name__}: {e}") from None


def flattened_bucket(obj: object) -> tuple[torch.Tensor, list]:
    """``(flattened_tensor, metadata)`` of a ``load_format="flattened_bucket"`` payload.
    Raises ValueError: not such a dict, or the tensor is not 1-D ``uint8``."""
    if not (isinstance(obj, dict) and isinstance(obj.get("flattened_tensor"), torch.Tensor)
            and isinstance(obj.get("metadata"), list)):
        raise ValueError("load_format='flattened_bucket' needs a dict with 'flattened_tensor' (a tensor) "
                         f"and 'metadata' (a list), got {type(obj).__name__}")
    flat = obj["flattened_tensor"]
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened_tensor must be 1-D uint8, got {flat.dtype} {tuple(flat.shape)}")
    return flat, obj["metadata"]


def bucket_views(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    """``(name, view of flat)`` of each metadata entry (SGLang's ``FlattenedTensorMetadata``
    fields). Raises ValueError: an entry lacks a field, or its bytes are out of ``flat``'s
    bounds or of the wrong size for its shape and dtype."""
    out = []
    for m in metadata:
        try:
            name, shape, dtype = m.name, torch.Size(m.shape), m.dtype
            start, end = int(m.start_idx), int(m.end_idx)
        except (AttributeError, TypeError) as e:
            raise ValueError(f"a flattened_bucket metadata entry lacks a field: {e}") from None
        nb = nbytes_of(shape, dtype)
        if not (0 <= start <= end <= flat.numel()) or end - start != nb:
            raise ValueError(f"{name}: bytes [{start}, {end}) do not hold {tuple(shape)} {dtype} "
                             f"in a flat tensor of {flat.numel()} bytes")
        out.append((name, flat[start:end].view(dtype).reshape(shape)))
    return out


@torch.no_grad()
def write_standby(wu: WeightUpdater, named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Copy ``named`` into the standby parameters (one copy when they are consecutive there
    in the engine's dtype and arrive as one span, else one per tensor, cast; from whatever
    device the handles opened on to the engine's) and mark them; returns the names once the
    copies are done (on CUDA: synchronized, so the sender may free its memory after the reply).
    Raises KeyError/ValueError naming a tensor the engine does not have."""
    for n, t in named:
        wu.weight_map.check(n, list(t.shape))
    names = [n for n, _ in named]
    arena = wu.arena
    tensors = [t for _, t in named]
    span = arena.span(names, [list(t.shape) for t in tensors], [t.dtype for t in tensors])
    src = contiguous_span(tensors) if span is not None else None
    if src is not None and span is not None and src.numel() == span.numel():
        span.copy_(src)
    else:
        for n, t in named:
            arena.standby(n).copy_(t)
    for dev in {t.device for t in tensors} | {wu.device}:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    wu.bytes_received += sum(t.numel() * t.element_size() for t in tensors)
    arena.mark(names)
    return names


def tensor_update_router(wu: WeightUpdater) -> APIRouter:
    """``POST /update_weights_from_tensor`` over ``wu`` (``docs/design/engines.md``)."""
    r = APIRouter()

    @r.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorReqInput):
        if not body.serialized_named_tensors:
            return _fail("serialized_named_tensors is empty: one entry per engine TP rank is needed (this engine: 1)")

        def receive(refuse: str | None) -> list[str]:
            if refuse:
                raise ValueError(refuse)
            return write_standby(wu, decode_named_tensors(body.serialized_named_tensors[0], body.load_format))

        return await apply_update_call(wu, receive, body.weight_version, body.abort_all_requests,
                                       outside_session=OUTSIDE_SESSION_TENSOR, flush_cache=body.flush_cache)

    return r
