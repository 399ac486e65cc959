"""An engine whose weight-update side is SGLang 0.5.23's own code, for contract tests on a CPU.

Each engine rank is a spawned process holding SGLang's ``WeightUpdater``
(``sglang/srt/model_executor/model_runner_components/weight_updater.py``, the class SGLang's
ModelRunner uses): it joins the update group with SGLang's ``init_weights_update_group``
(-> ``init_custom_process_group``, rank ``rank_offset + tp_rank``) and receives every call
with SGLang's ``receive_weights_from_distributed`` (``FlattenedTensorBucket`` for
``load_format="flattened_bucket"``, else one ``torch.distributed.broadcast`` per tensor).
Only the HTTP/scheduler shell is ours (:class:`SGLangEngine`, a client object with the
calls the transport makes): one join at a time per engine (SGLang's scheduler is one
thread), and the scheduler's session rule (``SchedulerWeightUpdaterManager``: an update
outside ``begin_weight_update`` / ``end_weight_update`` is refused with SGLang's message,
nothing received).

A TP x DP engine has ``tp * dp`` rank processes; rank ``d * tp + t`` of it joins at
``rank_offset + d * tp + t`` (the DP replicas' TP groups side by side, case C13).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
JOIN_TIMEOUT_S = 20  # a rank's join gives up after this (SGLang: torch's default, 30 min)


def _rank_main(local_rank: int, conn) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "engines"))
    torch.set_num_threads(1)
    import importlib

    import _sglang_import as si
    import torch.distributed as dist

    si.load_io_struct()
    finder = si._StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        wu_mod = importlib.import_module("sglang.srt.model_executor.model_runner_components.weight_updater")
    finally:
        sys.meta_path.remove(finder)
    from moe_async.models.checksum import tensor_checksum

    # SGLang's joins wait torch's default_pg_timeout (30 min): a join reaching this rank
    # after its sender died would block it that long; 20 s here keeps the tests bounded
    # (per join: an ``init`` may carry its own ``join_timeout_s``, SGLang reads this at each join)
    import datetime

    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    # SGLang asserts a default group exists (its TP world); a 1-rank one stands in for it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    nop = lambda *a, **k: None  # noqa: E731
    wu = wu_mod.WeightUpdater(tp_rank=local_rank, device="cpu", gpu_id=0, model_config=None,
                              custom_weight_loaders={}, get_model=nop, update_model_fields=nop,
                              recapture_cuda_graph=nop, get_model_runner=nop)
    conn.send(("ready", None))
    while True:
        op, kw = conn.recv()
        try:
            if op == "init":
                c10d.default_pg_timeout = datetime.timedelta(seconds=kw.pop("join_timeout_s"))
                ok, msg = wu.init_weights_update_group(**kw)
                pg = wu._model_update_group.get(kw["group_name"])
                conn.send(("ok", {"success": ok, "message": msg,
                                  "rank": pg.rank() if pg is not None else None,
                                  "world": pg.size() if pg is not None else None}))
            elif op == "recv":
                got = wu.receive_weights_from_distributed(**kw)
                conn.send(("ok", {n: tensor_checksum(t) for n, t in got}))
            elif op == "destroy":
                ok, msg = wu.destroy_weights_update_group(kw["group_name"])
                conn.send(("ok", {"success": ok, "message": msg}))
            elif op == "exit":
                conn.send(("ok", None))
                # at once: the interpreter's own exit can wait seconds on the gloo groups' teardown
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        except Exception as e:  # noqa: BLE001 - reported to the test
            conn.send(("err", f"{type(e).__name__}: {e}"))


OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                   "end_weight_update()")


class SGLangEngine:
    """A client-like object (the calls BroadcastTransport makes) over ``tp * dp`` rank processes."""

    def __init__(self, tp: int = 1, dp: int = 1):
        ctx = mp.get_context("spawn")
        self.n = tp * dp
        self.pipes, self.procs = [], []
        for r in range(self.n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, b), daemon=True)
            p.start()
            self.pipes.append(a)
            self.procs.append(p)
        self.join_lock = threading.Lock()  # SGLang's scheduler: one join at a time
        self.session = False
        self.checksums: dict[str, str] = {}
        self.joins: list[dict] = []  # every rank's reply to every join
        self.version: str | None = None
        self.calls: list[str] = []
        #: optional ``hook(group_name)`` run before a join is forwarded (tests delay/hang joins);
        #: it may return that join's timeout on the ranks in seconds (None: JOIN_TIMEOUT_S)
        self.before_join = None
        self.inflight = 0  # joins and rank calls not yet answered
        self._io = threading.Lock()

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until no call is in flight (a join whose sender died ends after the ranks' store
        connect retries, about 2 x JOIN_TIMEOUT_S)."""
        import time

        end = time.monotonic() + timeout
        while self.inflight and time.monotonic() < end:
            time.sleep(0.1)
        assert not self.inflight, "a join is still in flight"

    def wait_ready(self, timeout: float = 300.0) -> None:
        for c in self.pipes:
            if not c.poll(timeout):
                raise TimeoutError("SGLang rank process did not start")
            assert c.recv()[0] == "ready"

    def _all(self, op: str, kws: list[dict]) -> list[Any]:
        self.inflight += 1
        try:
            with self._io:  # one call at a time on the ranks' pipes (as SGLang's scheduler)
                for c, kw in zip(self.pipes, kws):
                    c.send((op, kw))
                out = []
                for c in self.pipes:
                    st, v = c.recv()
                    if st == "err":
                        raise RuntimeError(v)
                    out.append(v)
                return out
        finally:
            self.inflight -= 1

    # ---- the calls the transport makes ----
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        self.inflight += 1
        try:
            return self._join(master_address, master_port, rank_offset, world_size, group_name, backend)
        finally:
            self.inflight -= 1

    def _join(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        join_timeout_s = self.before_join(group_name) if self.before_join is not None else None
        with self.join_lock:
            self.calls.append(f"init:{group_name}")
            kw = dict(master_address=master_address, master_port=master_port, world_size=world_size,
                      group_name=group_name, backend=backend, join_timeout_s=join_timeout_s or JOIN_TIMEOUT_S)
            # a DP replica's ranks follow the previous replica's (rank_offset + d * tp + t)
            outs = self._all("init", [{**kw, "rank_offset": rank_offset} for _ in range(self.n)])
            self.joins.extend(outs)
        bad = [o for o in outs if not o["success"]]
        return {"success": not bad, "message": (bad or outs)[0]["message"]}

    def destroy_weights_update_group(self, group_name="weight_update_group"):
        outs = self._all("destroy", [{"group_name": group_name}] * self.n)
        return {"success": all(o["success"] for o in outs), "message": outs[0]["message"]}

    def begin_weight_update(self, atomic=False, selector="all"):
        if self.session:
            return {"success": False, "message": "a weight-update session is already open; "
                                                 "call end_weight_update() first"}
        self.session = True
        self.calls.append("begin")
        return {"success": True, "message": "Success"}

    def end_weight_update(self):
        if not self.session:
            return {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"}
        self.session = False
        self.calls.append("end")
        return {"success": True, "message": "Success"}

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, weight_version=None, load_format=None,
                                        abort_all_requests=False):
        if not self.session:
            return {"success": False, "message": OUTSIDE_SESSION}
        self.calls.append(f"update:{len(names)}:{weight_version}")
        kw = dict(names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes],
                  group_name=group_name, load_format=load_format)
        outs = self._all("recv", [kw] * self.n)
        assert all(o == outs[0] for o in outs), "the engine's ranks received different bytes"
        self.checksums.update(outs[0])
        if weight_version is not None:
            self.version = weight_version
        return {"success": True, "message": "Succeeded to update parameter online."}

    def pause_generation(self, mode="abort"):
        return {"status": "ok"}

    def continue_generation(self):
        return {"status": "ok"}

    def weights_layout(self):
        return None  # SGLang has no such endpoint

    def close(self) -> None:
        for c, p in zip(self.pipes, self.procs):
            try:
                c.send(("exit", None))
            except Exception:  # noqa: BLE001
                pass
            p.join(5)
            if p.is_alive():
                p.kill()
