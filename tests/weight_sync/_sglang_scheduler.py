"""An engine whose pause, session, update and flush logic is SGLang 0.5.23's own scheduler code.

Run in the test process, no GPU and no model:

* ``SchedulerWeightUpdaterManager`` (``managers/scheduler_components/weight_updater.py``):
  the session rule, ``update_weights_from_distributed`` and ``flush_cache_after_weight_update``
  (the failure ``Weights were updated, but the cache was not flushed ...``), fed SGLang's own
  request dataclasses (``io_struct``) built from the transport's keyword arguments;
* ``Scheduler.is_fully_idle`` / ``flush_cache`` / ``pause_generation`` /
  ``continue_generation``: the function bodies of the installed ``managers/scheduler.py``
  (that module itself cannot be imported here: its imports need GPU packages), compiled from
  its source and bound to this shell, which holds the state they read;
* ``SchedulerFlushWrapper`` (``flush_wrapper.py``): the deferred ``/flush_cache?timeout=``.

Ours (the stand-ins): the requests and their decoding (one token per step, tagged with the
served ``weight_version``), a prefix cache that records the weight version its KV was
computed under (``tree_cache``: ``reset()`` is what SGLang's flush calls), and the receiving
end of the weight-update group (our ``create_update_group`` in a spawned process: a group
name is registered once per process, and the sender is this one; the bytes are received,
not loaded into a model).
"""

from __future__ import annotations

import __future__
import ast
import importlib
import logging
import os
import sys
import threading
import time
import types
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULER_FUNCS = ("is_fully_idle", "flush_cache", "pause_generation", "continue_generation")


def _receiver_main(conn) -> None:
    """The engine rank's end of the weight-update group: joins, then receives buckets."""
    torch.set_num_threads(1)
    from moe_async.weight_sync.group import create_update_group, destroy_update_group, group_broadcast

    groups = {}
    while True:
        op, kw = conn.recv()
        try:
            if op == "init":
                groups[kw["group_name"]], _ = create_update_group(**kw)
                conn.send(("ok", None))
            elif op == "recv":
                buf = torch.empty(kw["nbytes"], dtype=torch.uint8)
                group_broadcast(groups[kw["group_name"]], buf, src=0)
                conn.send(("ok", int(buf.sum())))
            elif op == "destroy":
                destroy_update_group(groups.pop(kw["group_name"]))
                conn.send(("ok", None))
            else:
                conn.send(("ok", None))
                return
        except Exception as e:  # noqa: BLE001 - reported to the caller
            conn.send(("err", f"{type(e).__name__}: {e}"))


class Receiver:
    """A spawned process holding the engine's end of the weight-update groups."""

    def __init__(self):
        import multiprocessing as mp

        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_receiver_main, args=(child,), daemon=True)
        self.proc.start()
        self.io = threading.Lock()

    def __call__(self, op: str, **kw) -> Any:
        with self.io:
            self.conn.send((op, kw))
            st, v = self.conn.recv()
        if st == "err":
            raise RuntimeError(v)
        return v

    def close(self) -> None:
        try:
            self("exit")
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def load_sglang() -> types.SimpleNamespace:
    """SGLang's modules and scheduler functions used here (ImportError: the test skips)."""
    sys.path.insert(0, os.path.join(HERE, "..", "engines"))
    import _sglang_import as si

    from moe_async.compat.sglang_cpu import import_sglang  # its stub modules leave sys.modules after

    io = si.load_io_struct()
    wu = import_sglang("sglang.srt.managers.scheduler_components.weight_updater")
    fw = import_sglang("sglang.srt.managers.scheduler_components.flush_wrapper")
    dis = import_sglang("sglang.srt.disaggregation.utils")
    spec = importlib.util.find_spec("sglang.srt.managers.scheduler")
    src = open(spec.origin).read()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    funcs = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in SCHEDULER_FUNCS}
    missing = set(SCHEDULER_FUNCS) - set(funcs)
    if missing:
        raise ImportError(f"sglang's Scheduler has no {sorted(missing)}")
    module = ast.Module(body=list(funcs.values()), type_ignores=[])
    code = compile(module, spec.origin, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns: dict[str, Any] = {"DisaggregationMode": dis.DisaggregationMode, "logging": logging, "time": time,
                          "torch": torch, "logger": logging.getLogger("sglang.scheduler"),
                          "current_platform": types.SimpleNamespace(empty_cache=lambda: None)}
    exec(code, ns)  # noqa: S102 - SGLang's own function bodies, from the installed file
    return types.SimpleNamespace(io=io, wu=wu, fw=fw, funcs={k: ns[k] for k in SCHEDULER_FUNCS},
                                 NULL=dis.DisaggregationMode.NULL)


class _Batch:
    def __init__(self):
        self.reqs: list[Any] = []

    def is_empty(self) -> bool:
        return not self.reqs


class PrefixCache:
    """Prefixes -> the weight version their KV was computed under (``reset``: SGLang's flush)."""

    def __init__(self):
        self.kv: dict[tuple[int, ...], str] = {}

    def reset(self) -> None:
        self.kv.clear()

    def match(self, ids: list[int]) -> list[str]:
        """Versions of the cached KV a request with ``ids`` would reuse (longest prefix)."""
        for n in range(len(ids), 0, -1):
            hit = [self.kv[tuple(ids[:k])] for k in range(1, n + 1) if tuple(ids[:k]) in self.kv]
            if len(hit) == n:
                return hit
        return []

    def insert(self, ids: list[int], versions: list[str]) -> None:
        for k in range(1, len(ids) + 1):
            self.kv.setdefault(tuple(ids[:k]), versions[k - 1])


class Req:
    def __init__(self, ids: list[int], max_new: int):
        self.ids, self.max_new = list(ids), max_new
        self.kv_versions: list[str] = []  # the version of each prompt position's KV
        self.out_versions: list[str] = []
        self.reused: list[str] = []  # versions of the prefix-cache KV reused at admission
        self.done = threading.Event()

    def finished(self) -> bool:
        return len(self.out_versions) >= self.max_new


class SGLangShell:
    """The calls the transport makes, on SGLang's scheduler code (module docstring). One
    thread decodes (``step_s`` per step) under ``lock``; control calls take the same lock
    (SGLang's scheduler runs them between batches)."""

    def __init__(self, sg: types.SimpleNamespace, step_s: float = 0.01):
        self.sg = sg
        self.lock = threading.RLock()
        self.version = "0"
        self.versions_seen: list[str] = []
        # the state SGLang's scheduler functions read
        self.running_batch, self.waiting_queue = _Batch(), []
        self.chunked_req = self.last_batch = self.cur_batch_for_debug = self.draft_worker = None
        self.enable_overlap, self.result_queue = False, []
        self.dllm_manager = types.SimpleNamespace(any_staging_reqs=lambda: False)
        self.grammar_manager = types.SimpleNamespace(grammar_queue=[], clear=lambda: None)
        self.disaggregation_mode, self.disagg_decode_prealloc_queue = sg.NULL, None
        self.enable_hisparse = self.enable_hierarchical_cache = self.enable_lmcache = False
        self.decode_offload_manager = self.hisparse_coordinator = None
        self._pp_microbatches_drained = lambda: True  # pipeline parallel size 1
        self._engine_paused, self._pause_started_at, self._pause_intervals = False, None, []
        self.tree_cache = PrefixCache()
        self.req_to_token_pool = types.SimpleNamespace(clear=lambda: None, reset_aux_cache_allocator=lambda: None)
        self.token_to_kv_pool_allocator = types.SimpleNamespace(clear=lambda: None)
        self.metrics_reporter = types.SimpleNamespace(reset_metrics=lambda: None, is_stats_logging_rank=False)
        self.flushes = 0
        for name, fn in sg.funcs.items():  # is_fully_idle keeps its name (flush_cache calls it)
            setattr(self, name if name == "is_fully_idle" else f"sg_{name}", types.MethodType(fn, self))
        # SGLang's scheduler-side weight updater, its fields set as the scheduler sets them
        mgr = object.__new__(sg.wu.SchedulerWeightUpdaterManager)
        runner = types.SimpleNamespace(weight_updater=types.SimpleNamespace(
            receive_weights_from_distributed=self._receive, begin_weight_update=lambda: None,
            end_weight_update=lambda run_post_load: None,
            load_weights_from_distributed=lambda weights: (True, "Succeeded to update parameter online.")))
        for k, v in dict(tp_worker=types.SimpleNamespace(model_runner=runner,
                                                         weight_update_runners=lambda: [("target", runner)]),
                         draft_worker=None, memory_saver_adapter=None, flush_cache=self._flush,
                         is_fully_idle=self.is_fully_idle, scheduler=self, metrics_collector=None,
                         offload_tags=set(), stashed_model_static_state=None, _session=None,
                         tp_cpu_group=None).items():
            setattr(mgr, k, v)
        self.mgr = mgr
        self.flusher = sg.fw.SchedulerFlushWrapper(flush_cache=lambda: self._flush(empty_cache=False),
                                                   is_fully_idle=self._idle_now, send_output=self._flushed)
        self._flush_replies: dict[int, Any] = {}
        self.rx = Receiver()
        self.received: dict[str, int] = {}
        self.step_s = step_s
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    # ---- SGLang scheduler hooks ----
    def _flush(self, empty_cache: bool = True) -> bool:
        ok = self.sg_flush_cache(empty_cache=False)
        self.flushes += ok
        return ok

    def _idle_now(self) -> bool:
        return self.is_fully_idle(ignore_waiting=self._engine_paused)

    def _flushed(self, out, req) -> None:
        self._flush_replies[id(req)] = out

    def record_weight_version_change(self, new_version) -> None:
        if new_version is not None:
            self.version = new_version
            self.versions_seen.append(new_version)

    def _receive(self, names, dtypes, shapes, group_name, load_format):
        from moe_async.weight_sync.bucket import nbytes_of, str_to_dtype

        n = sum(nbytes_of(s, str_to_dtype(d)) for s, d in zip(shapes, dtypes))
        total = self.rx("recv", group_name=group_name, nbytes=n)
        for name in names:
            self.received[name] = self.received.get(name, 0) + 1
        return [(name, total) for name in names]

    # ---- requests ----
    def submit(self, ids: list[int], max_new: int) -> Req:
        r = Req(ids, max_new)
        with self.lock:
            self.waiting_queue.append(r)
        return r

    def _loop(self) -> None:
        while not self._stop:
            with self.lock:
                self.flusher.check_pending()
                if not self._engine_paused:
                    for r in self.waiting_queue:  # admission: reuse the cached prefix KV
                        r.reused = self.tree_cache.match(r.ids)
                        r.kv_versions = r.reused + [self.version] * (len(r.ids) - len(r.reused))
                        self.tree_cache.insert(r.ids, r.kv_versions)
                        self.running_batch.reqs.append(r)
                    self.waiting_queue = []
                    for r in list(self.running_batch.reqs):
                        r.out_versions.append(self.version)
                        if r.finished():
                            self.running_batch.reqs.remove(r)
                            r.done.set()
            time.sleep(self.step_s)

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.rx.close()

    # ---- the calls the transport makes ----
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        self.sg.io.InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port,
                                                  rank_offset=rank_offset, world_size=world_size,
                                                  group_name=group_name, backend=backend)
        self.rx("init", backend=backend, world_size=world_size, rank=rank_offset, group_name=group_name,
                timeout_s=60, init_method=f"tcp://{master_address}:{master_port}")
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_weights_update_group(self, group_name="weight_update_group"):
        self.rx("destroy", group_name=group_name)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def weights_layout(self):
        return None  # SGLang has no such endpoint

    def _out(self, o) -> dict:
        return {"success": o.success, "message": o.message}

    def begin_weight_update(self, atomic=False, selector="all"):
        with self.lock:
            return self._out(self.mgr.begin_weight_update(self.sg.io.BeginWeightUpdateReqInput(selector=selector)))

    def end_weight_update(self):
        with self.lock:
            return self._out(self.mgr.end_weight_update(self.sg.io.EndWeightUpdateReqInput()))

    def update_weights_from_distributed(self, **kw):
        req = self.sg.io.UpdateWeightsFromDistributedReqInput(**kw)
        with self.lock:
            return self._out(self.mgr.update_weights_from_distributed(req))

    def pause_generation(self, mode="abort"):
        assert mode == "in_place", "this shell runs SGLang's in_place pause only"
        with self.lock:
            self.sg_pause_generation(self.sg.io.PauseGenerationReqInput(mode=mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self):
        with self.lock:  # torch_empty_cache: CUDA only
            self.sg_continue_generation(self.sg.io.ContinueGenerationReqInput(torch_empty_cache=False))
        return {"message": "Generation continued successfully.", "status": "ok"}

    def flush_cache(self, timeout_s: float = 0.0):
        req = self.sg.io.FlushCacheReqInput(timeout_s=timeout_s)
        with self.lock:
            out = self.flusher.handle(req)
        deadline = time.monotonic() + timeout_s + 5
        while out is None and time.monotonic() < deadline:
            time.sleep(0.01)
            out = self._flush_replies.pop(id(req), None)
        return bool(out is not None and out.success)
