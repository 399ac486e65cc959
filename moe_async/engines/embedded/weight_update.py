"""The embedded engine's weight-update endpoints (SGLang 0.5.23's, plus a few of ours).

Update group join/leave, the ``/begin_weight_update`` ... ``/end_weight_update`` session,
``/update_weights_from_distributed`` / ``_from_disk`` / ``_from_tensor``, ``/weights_layout`` and
``/weights_checksum``. Bodies carry SGLang's fields only (an unknown one is a 422 naming it);
``weight_version`` is a string; a bad name or shape is a 400 naming the tensor.

Design notes: ``docs/design/engines.md``."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from moe_async.engines.embedded.admission import Admission
from moe_async.engines.embedded.fault_hooks import SyncStall
from moe_async.engines.embedded.weights import HFWeightMap, ParamArena
from moe_async.weight_sync.bucket import nbytes_of, str_to_dtype, unflatten
from moe_async.weight_sync.group import (
    create_update_group,
    destroy_update_group,
    group_broadcast,
    store_alive,
)

if TYPE_CHECKING:
    from moe_async.engines.embedded.scheduler import Scheduler

log = logging.getLogger("moe_async.engines.embedded")

#: SGLang 0.5.23's failure of an update call whose cache flush was refused (same scheduler file)
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")

#: SGLang 0.5.23's refusal of an update outside a session (scheduler weight_updater.py)
OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                   "end_weight_update()")


# ---------------------------------------------------------------- request bodies (SGLang's)
class _Req(BaseModel):
    """SGLang's ``BaseReq`` fields; any field SGLang does not define is refused."""

    model_config = ConfigDict(extra="forbid")
    rid: str | None = None
    http_worker_ipc: str | None = None


class InitWeightsUpdateGroupReqInput(_Req):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Req):
    group_name: str = "weight_update_group"


class BeginWeightUpdateReqInput(_Req):
    selector: Literal["target", "draft", "all"] = "all"
    atomic: bool = Field(False, description="ours: stage until the versioned call (SGLang ignores it)")


class EndWeightUpdateReqInput(_Req):
    pass


class UpdateWeightsFromDistributedReqInput(_Req):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class UpdateWeightFromDiskReqInput(_Req):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None


class DebugReceiveBroadcastReqInput(_Req):
    group_name: str = "weight_update_group"
    nbytes: int = Field(ge=0)


def _fail(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


@dataclass
class Membership:
    """One weight-update group this engine is a member of."""

    group: torch.distributed.ProcessGroup
    store: torch.distributed.Store  # the rendezvous store (client of the sender's): probed for liveness
    rank: int
    world_size: int
    master: str
    backend: str = "gloo"  # "nccl": buffers on the engine's CUDA device; "gloo": CPU buffers


@dataclass
class Session:
    atomic: bool
    calls: int = 0


class WeightUpdater:
    """The engine's side of weight updates: groups, the session, the double-buffered params."""

    def __init__(self, model: torch.nn.Module, scheduler: Scheduler, dtype: torch.dtype, timeout_s: float = 600.0,
                 admission: Admission | None = None):
        self.admission = admission or Admission()  # the server's pause flag and update lock
        self.weight_map = HFWeightMap(model)
        self.arena = ParamArena(self.weight_map)
        self.sched = scheduler
        self.dtype = dtype
        #: the parameters' device (the engine's ``--device``): updates are written there
        self.device = next(model.parameters()).device
        self.timeout_s = timeout_s
        self.groups: dict[str, Membership] = {}
        self.session: Session | None = None
        self.bytes_received = 0  # over every weight-update broadcast so far
        self.recv_scratch = torch.empty(0, dtype=torch.uint8)
        self.recv_copies = 0  # buckets received into scratch and copied
        self.update_error: str | None = None  # a failed call of the atomic update under way
        self.bench_buf: torch.Tensor | None = None
        self.update_lock = asyncio.Lock()
        self.join_lock = asyncio.Lock()  # one join at a time, as SGLang's scheduler
        self.stall = SyncStall()  # test-only MOE_ASYNC_ENGINE_SYNC_STALL (a kill mid-sync)

    # ---- receiving ----
    def recv_device(self, group_name: str) -> torch.device:
        """Where broadcasts of group ``group_name`` are received: the engine's CUDA device for
        an NCCL group, the CPU for gloo (then copied into the parameters' device)."""
        return self.device if self.groups[group_name].backend == "nccl" else torch.device("cpu")

    def receive(self, body: UpdateWeightsFromDistributedReqInput, refuse: str | None = None) -> list[str]:
        """Receive one call's tensors from group rank 0 into the standby parameters (the live
        ones are untouched); returns the names received. Buffers are on :meth:`recv_device`.
        A flattened bucket whose names are consecutive in the arena and in the engine's dtype
        lands in its standby span when that is on the receiving device, else it is received
        into a reused scratch buffer and copied (one copy into the span when consecutive). The
        bytes are received even when the call is refused (``refuse``, a bad name/shape, an
        earlier failure: then it raises after), so the collective never desyncs. On CUDA it
        returns once the copies are done."""
        group = self.groups[body.group_name].group
        dev = self.recv_device(body.group_name)
        if not (len(body.names) == len(body.dtypes) == len(body.shapes)):
            raise ValueError(f"names/dtypes/shapes lengths differ: "
                             f"{len(body.names)}/{len(body.dtypes)}/{len(body.shapes)}")
        dtypes = [str_to_dtype(d) for d in body.dtypes]
        if body.load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format must be null or 'flattened_bucket', got {body.load_format!r}")
        error: Exception | None = ValueError(refuse) if refuse else None
        if error is None and self.update_error is not None:
            error = ValueError(f"an earlier bucket of this update failed ({self.update_error}); refused")
        try:
            for n, s in zip(body.names, body.shapes):
                self.weight_map.check(n, list(s))
        except (KeyError, ValueError) as e:
            error = error or e
        arena = self.arena
        if body.load_format == "flattened_bucket":
            n_bytes = sum(nbytes_of(s, d) for s, d in zip(body.shapes, dtypes))
            span = None if error else arena.span(body.names, body.shapes, dtypes)
            flat = span if span is not None and span.device == dev else self._recv_buffer(n_bytes, dev)
            group_broadcast(group, flat, src=0)
            self.bytes_received += flat.numel()
            if error:
                raise error
            if flat is not span:
                self.recv_copies += 1
                if span is not None:
                    span.copy_(flat)
                else:
                    for n, t in unflatten(flat, body.names, body.dtypes, body.shapes):
                        arena.standby(n).copy_(t)
        else:
            for n, d, s in zip(body.names, dtypes, body.shapes):
                dst = None if error else arena.standby(n)
                t = dst if dst is not None and dst.dtype == d and dst.device == dev else torch.empty(
                    s, dtype=d, device=dev)
                group_broadcast(group, t, src=0)
                self.bytes_received += t.numel() * t.element_size()
                if dst is not None and t is not dst:
                    dst.copy_(t)
            if error:
                raise error
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        arena.mark(body.names)
        return list(body.names)

    def _recv_buffer(self, n: int, device: torch.device) -> torch.Tensor:
        if self.recv_scratch.numel() < n or self.recv_scratch.device != device:
            self.recv_scratch = torch.empty(n, dtype=torch.uint8, device=device)
        return self.recv_scratch[:n]

    def drop_staged(self) -> None:
        """Forget an update that never got its versioned call, and its failure."""
        self.arena.discard()
        self.update_error = None

    def leave(self, name: str) -> Membership | None:
        """Leave group ``name`` (destroy it here); drops a staged update. Blocking."""
        m = self.groups.pop(name, None)
        if m is not None:
            destroy_update_group(m.group)
            self.drop_staged()
        return m

    def read_disk(self, model_path: str) -> dict[str, torch.Tensor]:
        """Every tensor of the ``*.safetensors`` files under ``model_path``, name/shape-checked."""
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files under {model_path!r}")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            for n, t in load_file(f).items():
                self.weight_map.check(n, list(t.shape))
                out[n] = t if t.dtype == self.dtype else t.to(self.dtype)
        return out


def join_refusal(body: InitWeightsUpdateGroupReqInput, ranks: int = 1,
                 device: torch.device | None = None) -> str | None:
    """Why a join cannot work, before anyone waits on the store (None when it can); ``device``:
    the engine's (an NCCL group needs CUDA)."""
    if body.backend not in ("gloo", "nccl"):
        return f"backend must be 'gloo' or 'nccl', got {body.backend!r}"
    if body.backend == "nccl" and device is not None and device.type != "cuda":
        return (f"backend 'nccl' receives into CUDA memory and this engine runs on {device.type} "
                "(engine.device); use backend 'gloo' or engine.device=cuda")
    if not body.group_name:
        return "group_name must be non-empty"
    if body.rank_offset < 1 or body.rank_offset + ranks > body.world_size:
        return (f"rank_offset={body.rank_offset} with this engine's {ranks} rank(s) does not fit "
                f"world_size={body.world_size} (engine ranks are 1 .. world_size - 1; rank 0 is the sender)")
    return None


async def apply_update_call(wu: WeightUpdater, receive: Callable[[str | None], list[str]],
                            version: str | None, abort_all_requests: bool,
                            outside_session: str = OUTSIDE_SESSION, flush_cache: bool = False) -> dict | JSONResponse:
    """One update call of any transport (``/update_weights_from_distributed``,
    ``/update_weights_from_tensor``), with SGLang's session, lock and flush semantics
    (``docs/design/engines.md``).

    ``receive(refuse)`` runs in a worker thread: it writes the call's tensors into the standby
    parameters (``wu.arena``, marked) and returns their names, or raises ``KeyError`` /
    ``ValueError`` / ``RuntimeError`` (a 400 naming the tensor); given a ``refuse`` message
    (no session open: ``outside_session``) it must raise ``ValueError(refuse)`` after
    draining whatever the transport needs drained. ``version``: the call's ``weight_version``
    (any string) or None. ``flush_cache``: after applying, fail with :data:`FLUSH_REFUSED`
    unless the engine is idle (SGLang's rule). Returns the JSON reply or a 400.
    """
    sched = wu.sched
    if abort_all_requests:  # before the lock, as SGLang's tokenizer manager does
        await asyncio.wrap_future(sched.call(lambda: sched.abort(None, "aborted for a weight update")))
    staging = wu.session is not None and wu.session.atomic and version is None
    async with wu.admission.update(exclusive=not staging):
        async with wu.update_lock:
            reply = await _apply_locked(wu, receive, version, outside_session)
        if flush_cache and isinstance(reply, dict) and not await asyncio.wrap_future(sched.call(sched.idle)):
            return _fail(FLUSH_REFUSED)
    return reply


async def _apply_locked(wu: WeightUpdater, receive: Callable[[str | None], list[str]],
                        version: str | None, outside_session: str) -> dict | JSONResponse:
    sched = wu.sched
    session = wu.session
    t0 = time.perf_counter()
    if not wu.arena.bound:
        await asyncio.wrap_future(sched.call(wu.arena.bind))
    atomic = session is not None and session.atomic
    # an atomic update of one versioned call (a sender that versions every call): applied by
    # copying that call's bytes into the live parameters, as a plain session does (no fill of
    # the standby copy, no swap of every parameter)
    whole = atomic and version is not None and not wu.arena.fresh

    def run() -> list[str]:
        names = receive(outside_session if session is None else None)
        if atomic and version is not None and not whole:
            # names this update did not carry keep their live values (off the scheduler
            # thread: the live buffer is only read there; update_lock keeps writers out)
            wu.arena.fill_stale()
        return names

    try:
        names = await asyncio.to_thread(run)
    except (KeyError, ValueError, RuntimeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if session is None:
            return _fail(msg)
        dropped = len(wu.arena.fresh)
        wu.arena.discard()
        # later calls of an atomic update are received and refused until its versioned
        # call, which fails and clears this (the first failure is the one named)
        wu.update_error = (wu.update_error or msg) if atomic and version is None else None
        return _fail(f"{msg} (staged update of {dropped} tensors discarded)" if atomic else msg)
    assert session is not None  # receive() raises the outside-session refusal without one
    session.calls += 1
    if atomic and version is None:
        return {"success": True, "message": f"staged {len(names)} tensors ({len(wu.arena.fresh)} in total)"}
    staged = len(wu.arena.fresh)

    def apply():
        if atomic and not whole:
            wu.arena.swap()  # pointers only: between two forward passes
        else:
            wu.arena.commit(names)  # this call's bytes only
        if version is not None:
            sched.weight_version = version

    await asyncio.wrap_future(sched.call(apply))
    dt = time.perf_counter() - t0
    what = f"applied {staged} tensors" if atomic and not whole else f"applied {len(names)} tensors at once"
    return {"success": True, "message": f"{what}; weight_version={sched.weight_version} ({dt:.3f}s)"}


def weight_update_router(wu: WeightUpdater) -> APIRouter:
    """The endpoints listed in ``docs/design/engines.md`` over ``wu`` (and its scheduler)."""
    r = APIRouter()
    sched = wu.sched

    async def on_sched(fn):
        return await asyncio.wrap_future(sched.call(fn))

    @r.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupReqInput):
        why = join_refusal(body, device=wu.device)
        if why:
            return _fail(f"init_weights_update_group refused: {why}")
        async with wu.join_lock:
            old = wu.groups.get(body.group_name)
            if old is not None:
                if await asyncio.to_thread(store_alive, old.store):
                    return _fail(
                        f"this engine already is rank {old.rank} of the live weight-update group "
                        f"{body.group_name!r} (world {old.world_size}, sender store {old.master} still answers); "
                        f"a second membership under one name is refused: close the other sender first "
                        f"(POST /destroy_weights_update_group {{\"group_name\": \"{body.group_name}\"}}) "
                        f"or give this sender another weight-update group name")
                log.warning("weight-update group %r: its sender %s is gone; tearing the stale group down "
                            "before the new join", body.group_name, old.master)
                async with wu.update_lock:
                    await asyncio.to_thread(wu.leave, body.group_name)
                    wu.session = None
            master = f"{body.master_address}:{body.master_port}"
            try:
                group, store = await asyncio.to_thread(
                    create_update_group, backend=body.backend, world_size=body.world_size,
                    rank=body.rank_offset, group_name=body.group_name, timeout_s=wu.timeout_s,
                    init_method=f"tcp://{master}")
            except Exception as e:  # noqa: BLE001 - reported to the sender, as SGLang does
                return _fail(f"Failed to initialize custom process group: {type(e).__name__}: {e}.")
            wu.groups[body.group_name] = Membership(group, store, body.rank_offset, body.world_size, master,
                                                    body.backend)
        async with wu.update_lock:  # a new sender: an update it did not finish is dropped
            wu.drop_staged()
        if not wu.arena.bound:  # live/standby buffers now, not in the first update
            await on_sched(wu.arena.bind)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @r.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupReqInput):
        if body.group_name not in wu.groups:
            return _fail("The group to be destroyed does not exist.")
        async with wu.update_lock:
            await asyncio.to_thread(wu.leave, body.group_name)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @r.post("/begin_weight_update")
    async def begin_weight_update(body: BeginWeightUpdateReqInput):
        async with wu.admission.update(exclusive=not body.atomic), wu.update_lock:
            if wu.session is not None:
                return _fail("a weight-update session is already open; call end_weight_update() first")
            wu.drop_staged()
            wu.session = Session(atomic=body.atomic)
        return {"success": True, "message": "Success"}

    @r.post("/end_weight_update")
    async def end_weight_update(body: EndWeightUpdateReqInput):
        atomic = wu.session is not None and wu.session.atomic  # an atomic end applies nothing
        async with wu.admission.update(exclusive=not atomic), wu.update_lock:
            if wu.session is None:
                return _fail("no weight-update session is open; call begin_weight_update() first")
            dropped = len(wu.arena.fresh)
            wu.drop_staged()
            wu.session = None
        return {"success": True, "message": "Success" if not dropped else
                f"Success; dropped {dropped} staged tensors that no versioned call applied"}

    @r.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedReqInput):
        if body.group_name not in wu.groups:
            return _fail(f"Group {body.group_name} not in {list(wu.groups)}. "
                         f"Please call `init_weights_update_group` first.")
        await wu.stall.maybe_stall(sched.weight_version)  # test-only (fault_hooks.py)
        return await apply_update_call(
            wu, lambda refuse: wu.receive(body, refuse=refuse), body.weight_version, body.abort_all_requests,
            flush_cache=body.flush_cache)

    @r.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightFromDiskReqInput):
        version = body.weight_version
        if body.abort_all_requests:
            await on_sched(lambda: sched.abort(None, "aborted for a weight update"))
        async with wu.admission.update(), wu.update_lock:
            try:
                new = await asyncio.to_thread(wu.read_disk, body.model_path)
            except (KeyError, ValueError, OSError) as e:
                msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
                return _fail(f"{msg} (nothing applied)")

            def apply():
                wu.weight_map.apply(new)
                wu.arena.live_written(new)
                if version is not None:
                    sched.weight_version = version

            await on_sched(apply)
            if body.flush_cache and not await on_sched(sched.idle):
                return _fail(FLUSH_REFUSED)
            return {"success": True, "message": f"applied {len(new)} tensors from {body.model_path}",
                    "num_paused_requests": 0}

    @r.post("/debug_receive_broadcast")
    async def debug_receive_broadcast(body: DebugReceiveBroadcastReqInput):
        if body.group_name not in wu.groups:
            return _fail(f"no weight update group named {body.group_name!r}")

        def recv():
            dev = wu.recv_device(body.group_name)
            if wu.bench_buf is None or wu.bench_buf.numel() < body.nbytes or wu.bench_buf.device != dev:
                wu.bench_buf = torch.ones(body.nbytes, dtype=torch.uint8, device=dev)  # touched: no page faults
            buf = wu.bench_buf[: body.nbytes]
            t0 = time.perf_counter()
            group_broadcast(wu.groups[body.group_name].group, buf, src=0)
            return time.perf_counter() - t0

        async with wu.update_lock:
            secs = await asyncio.to_thread(recv)
        return {"success": True, "seconds": secs}

    @r.get("/weights_layout")
    async def weights_layout():
        return wu.arena.layout()

    @r.get("/weights_checksum")
    async def weights_checksum():
        return await on_sched(
            lambda: {"weight_version": str(sched.weight_version), "checksums": wu.weight_map.checksums(),
                     "bytes_received": wu.bytes_received, "recv_copies": wu.recv_copies}
        )

    return r
