"""The embedded engine's LoRA endpoints, SGLang 0.5.23's (``http_server.py``, bodies from
``managers/io_struct.py``): ``/load_lora_adapter`` (a PEFT directory), ``/load_lora_adapter_from_tensors``
(the PEFT config + serialized tensors, one entry per TP rank: this engine is one rank and reads
entry 0), ``/unload_lora_adapter``. Success: SGLang's ``LoRAUpdateOutput`` (``success``,
``loaded_adapters``); a bad body, adapter or tensor: 400 naming it. A flattened bucket is not
copied: the adapter views the sender's memory until it is unloaded (as SGLang keeps the tensors;
the sender reuses that memory only after the unload), and a bucket sent again reuses its parse
(:mod:`~moe_async.engines.embedded.lora_bucket`). A load that adds forward hooks (the first
adapter on a module) runs on the scheduler thread between forward passes; other loads and
unloads change the registry at once, without waiting for a forward to end. An unload of an
adapter still in use copies it (if it views a sender's memory), waits for the forward running
then, and returns; the adapter leaves with its last request (no abort)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import TYPE_CHECKING, Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from moe_async.engines.embedded.lora import EngineAdapter, LoraError, parse_peft
from moe_async.engines.embedded.lora_bucket import BucketAdapters
from moe_async.engines.embedded.tensor_update import decode_named_tensors, flattened_bucket, load_entry
from moe_async.engines.embedded.weight_update import _Req
from moe_async.types import JsonDict

if TYPE_CHECKING:
    import torch
    from torch import Tensor
    from moe_async.engines.embedded.scheduler import Scheduler


class LoadLoRAAdapterReqInput(_Req):
    """SGLang's fields."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class LoadLoRAAdapterFromTensorsReqInput(_Req):
    """SGLang's fields; ``serialized_named_tensors`` entries are base64 text on the wire."""

    lora_name: str
    config_dict: JsonDict
    serialized_named_tensors: list[str]
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


class UnloadLoRAAdapterReqInput(_Req):
    """SGLang's fields."""

    lora_name: str
    lora_id: str | None = None


def _out(ok: bool, message: str | None, loaded: list[str]) -> JSONResponse:
    return JSONResponse({"success": ok, "error_message": message, "loaded_adapters": {n: n for n in loaded}},
                        status_code=200 if ok else 400)


def read_peft_dir(path: str) -> tuple[JsonDict, dict[str, Tensor]]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of a PEFT directory.
    Raises LoraError naming the missing or unreadable file."""
    from safetensors.torch import load_file

    cfg_p, w_p = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    for p in (cfg_p, w_p):
        if not os.path.isfile(p):
            raise LoraError(f"lora_path {path!r}: {os.path.basename(p)} not found")
    try:
        with open(cfg_p) as f:
            cfg = json.load(f)
        return cfg, load_file(w_p)
    except Exception as e:  # noqa: BLE001 - a bad file is the caller's
        raise LoraError(f"lora_path {path!r}: cannot read the adapter: {type(e).__name__}: {e}") from None


def decode_adapter_tensors(entry: str, load_format: str | None) -> tuple[dict[str, Tensor], Tensor | None]:
    """One ``serialized_named_tensors`` entry -> ``({name: tensor}, bucket)``: with
    ``load_format`` None a pickled dict of tensors (SGLang's tp_worker uses the object as the
    dict; each cloned, bucket None), with ``"flattened_bucket"`` views of the sender's bucket
    (:func:`~moe_async.engines.embedded.tensor_update.decode_named_tensors`, no copy; the
    bucket's ``uint8`` tensor returned). Raises ValueError naming what is wrong."""
    import base64
    import binascii
    import io

    import torch

    from moe_async.engines.embedded.tensor_update import RestrictedUnpickler

    if load_format == "flattened_bucket":
        named = decode_named_tensors(entry, load_format)
        if not named:
            return {}, None
        t = named[0][1]
        return dict(named), torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    if load_format is not None:
        raise ValueError(f"load_format must be null or 'flattened_bucket', got {load_format!r}")
    try:
        obj = RestrictedUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"serialized_named_tensors[0] is not base64: {e}") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure is the sender's
        raise ValueError(f"serialized_named_tensors[0] cannot be deserialised: {type(e).__name__}: {e}") from None
    if not (isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())):
        raise ValueError(f"serialized_named_tensors[0] must hold a dict of name -> tensor, got {type(obj).__name__}")
    return {k: v.clone() for k, v in obj.items()}, None


def lora_router(scheduler: Scheduler, dtype: torch.dtype) -> APIRouter:
    """The three endpoints over ``scheduler.lora`` (:class:`~moe_async.engines.embedded.lora.EngineLora`)."""
    router = APIRouter()
    lora = scheduler.lora

    async def on_sched(fn):
        return await asyncio.wrap_future(scheduler.call(fn))

    buckets = BucketAdapters(scheduler.model, lora.modules, dtype)

    async def load(name: str, parse: Callable[[], EngineAdapter]) -> JSONResponse:
        try:
            ad = parse()
            if lora.hooked(ad):
                lora.load(ad)  # no hook to add: the registry changes under its lock, at once
            else:
                await on_sched(lambda: lora.load(ad))
        except LoraError as e:
            return _out(False, str(e), lora.names())
        return _out(True, None, lora.names())

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterReqInput):
        try:
            cfg, tensors = read_peft_dir(body.lora_path)
        except LoraError as e:
            return _out(False, str(e), lora.names())
        return await load(body.lora_name, lambda: parse_peft(body.lora_name, cfg, tensors, scheduler.model, dtype,
                                                             lora.modules))

    @router.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(body: LoadLoRAAdapterFromTensorsReqInput):
        if not body.serialized_named_tensors:
            return _out(False, "serialized_named_tensors is empty (one entry per TP rank)", lora.names())
        entry, name, cfg = body.serialized_named_tensors[0], body.lora_name, body.config_dict
        try:
            if body.load_format == "flattened_bucket":  # parsed once per bucket layout
                flat, meta = flattened_bucket(load_entry(entry))
                return await load(name, lambda: buckets.parse(name, cfg, flat, meta))
            tensors, _ = decode_adapter_tensors(entry, body.load_format)
        except ValueError as e:
            return _out(False, str(e), lora.names())
        return await load(name, lambda: parse_peft(name, cfg, tensors, scheduler.model, dtype, lora.modules))

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterReqInput):
        try:
            if not lora.unload(body.lora_name):  # held: marked (and copied out of the sender's memory)
                await on_sched(lambda: None)  # the forward running now (it may read the old tensors) ends
        except LoraError as e:
            return _out(False, str(e), lora.names())
        return _out(True, None, lora.names())

    return router
