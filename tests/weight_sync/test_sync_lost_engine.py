"""Two real embedded engines, one SIGKILLed in the middle of a gloo weight sync (issue 19, "Sync
failure"): ``send_or_lost`` returns the killed engine's URL instead of raising; the other engine
holds a whole version (the previous one with its weights, or the new one with the sent
weights, never a mix), is not left paused and generates; re-formed alone, it takes the next
sync bit-exactly. The kill lands mid-sync through the test-only stall hook
(``MOE_ASYNC_ENGINE_SYNC_STALL``: the engine stalls before its 3rd bucket of the first update)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")


def _kill_when_stalled(f, pids: dict[int, int], out: dict) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        if f.is_file() and f.read_text().strip():
            pid = int(f.read_text().strip())
            out["killed"] = pids[pid]
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.1)


def test_engine_killed_mid_sync_is_named_and_the_other_holds_a_whole_version(tmp_path, monkeypatch, caplog):
    from _tiny import make_tiny_mixtral
    from safetensors.torch import load_file

    from moe_async.engines.base import make_engine
    from moe_async.engines.client import SyncEngineClient
    from moe_async.engines.config import EngineConfig
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.outcome import send_or_lost
    from moe_async.weight_sync.transport import BroadcastTransport

    model_dir = str(tmp_path / "m")
    make_tiny_mixtral(model_dir, tie=False)
    stall = tmp_path / "stall"
    monkeypatch.setenv("MOE_ASYNC_ENGINE_SYNC_STALL", f"0:3:{stall}")  # read by the engine processes
    cfg = EngineConfig(startup_timeout_s=180, num_threads=1, max_running_requests=16)
    engs = [make_engine(cfg, model_dir, 0) for _ in range(2)]
    clients: list = []
    tr = None
    try:
        for e in engs:
            e.launch()
        clients = [SyncEngineClient(e.url, timeout_s=60) for e in engs]
        tr = BroadcastTransport(clients, WeightSyncConfig(bucket_bytes=8 * 1024, backend="gloo", timeout_s=60),
                                pause_mode="abort")
        tr.connect()
        shapes = {n: t.shape for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
        g = torch.Generator().manual_seed(5)
        full = {n: torch.randn(shapes[n], generator=g) * 0.05 for n in tr.layout}
        before = [c.weights_checksum() for c in clients]
        kill: dict = {}
        killer = threading.Thread(target=_kill_when_stalled, args=(stall / "stalled", {e.proc.pid: i for i, e in
                                                                                     enumerate(engs)}, kill))
        killer.start()
        out = send_or_lost(tr, full.items(), 1)
        killer.join(timeout=10)
        k = kill["killed"]
        live = 1 - k
        assert out.lost == [engs[k].url] and not out.ok, out
        assert out.metrics == {"sync/engines_lost": 1.0, "sync/weight_version": 1.0}
        mid = clients[live].weights_checksum()
        info = httpx.get(f"{engs[live].url}/server_info", timeout=10).json()
        assert info["paused"] is False
        gen = clients[live].generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0})
        assert len(gen.output_ids) >= 1
        tr.reform([clients[live]])  # the group without the lost engine (recovery adds a replacement)
        tr.send(full.items(), 1)
        final = clients[live].weights_checksum()
        assert final["weight_version"] == 1 and before[live]["weight_version"] == 0
        # a whole version: the previous one with its own weights, or the new one with the sent ones
        assert (mid["weight_version"], mid["checksums"]) in (
            (0, before[live]["checksums"]), (1, final["checksums"])), mid
        assert final["checksums"] != before[live]["checksums"]
        # the failed sync closed the live engine's session (the next one found none left open)
        assert not [r for r in caplog.records if "session was left open" in r.getMessage()]
    finally:
        if tr is not None:
            tr.shutdown()
        for c in clients:
            c.close()
        for e in engs:
            e.shutdown()
