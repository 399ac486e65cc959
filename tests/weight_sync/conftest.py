"""One embedded engine (tiny random Mixtral, untied) shared by the weight-sync tests."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory):
    """``(engine, model_dir)``: an EmbeddedEngine serving a tiny Mixtral (2 layers, hidden 64,
    4 experts top-2, vocab 256: embedding 64 KiB fp32)."""
    from _tiny import make_tiny_mixtral

    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig

    model_dir = str(tmp_path_factory.mktemp("ws_tiny_mixtral"))
    make_tiny_mixtral(model_dir, tie=False)
    eng = make_engine(EngineConfig(startup_timeout_s=180, num_threads=1, max_running_requests=16), model_dir, 0)
    eng.launch()
    try:
        yield eng, model_dir
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def tiny_shapes(tiny_engine):
    """``{hf_name: torch.Size}`` of every tensor in the tiny engine's checkpoint."""
    from safetensors.torch import load_file

    return {n: t.shape for n, t in load_file(os.path.join(tiny_engine[1], "model.safetensors")).items()}


@pytest.fixture
def broadcast(tiny_engine):
    """Factory ``make(pause_mode="in_place", **cfg) -> (client, transport)``: a
    ``SyncEngineClient`` of the tiny engine and a connected gloo ``BroadcastTransport``
    (``WeightSyncConfig`` of 8 KiB buckets, 120 s timeouts, updated with ``cfg``); every pair
    made is shut down after the test."""
    from moe_async.engines.client import SyncEngineClient
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.transport import BroadcastTransport

    eng, _ = tiny_engine
    made = []

    def make(pause_mode: str = "in_place", **cfg):
        client = SyncEngineClient(eng.url, timeout_s=120)
        cfg = {"bucket_bytes": 8 * 1024, "backend": "gloo", "timeout_s": 120, **cfg}
        tr = BroadcastTransport([client], WeightSyncConfig(**cfg), pause_mode=pause_mode)
        made.append((client, tr))
        tr.connect()
        return client, tr

    yield make
    for client, tr in made:
        tr.shutdown()
        client.close()


@pytest.fixture
def dies_at():
    """``dies_at(items, k)``: a generator of ``items`` that raises ``RuntimeError("exporter
    died")`` in place of item ``k`` (an exporter failing after ``k`` tensors)."""

    def gen(items, k):
        for i, it in enumerate(items):
            if i == k:
                raise RuntimeError("exporter died")
            yield it

    return gen
