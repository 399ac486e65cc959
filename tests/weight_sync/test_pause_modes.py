"""Requests in flight while the trainer's weights are synced, in each SGLang pause mode.

Both pause scopes: the whole sync (SGLang) and the last bucket only (the embedded engine
stages the other buckets while it keeps decoding).

abort: every request comes back (finish_reason ``abort``, its partial tokens all from the
old version); retract and in_place: every request finishes its full length, and its
per-token versions (``meta_info['output_token_weight_versions']``) switch once, from the old
version to the new one, never back and never to anything else (no half-updated model).
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import torch

from moe_async.engines.client import SyncEngineClient
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.transport import check_engines

N_REQ, MAX_NEW = 4, 24


def _disk_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")
@pytest.mark.parametrize("mode,scope", [("abort", "sync"), ("retract", "sync"), ("in_place", "sync"),
                                        ("abort", "last_bucket"), ("in_place", "last_bucket")])
def test_requests_in_flight_during_sync(tiny_engine, broadcast, mode, scope):
    from moe_async.models.checksum import tensor_checksum

    eng, model_dir = tiny_engine
    shapes = {n: t.shape for n, t in _disk_tensors(model_dir).items()}
    client, tr = broadcast(pause_mode=mode, pause_scope=scope)
    old = client.get_weight_version()
    new = old + 1
    g = torch.Generator().manual_seed(new)
    weights = {n: torch.randn(s, generator=g) * 0.05 for n, s in sorted(shapes.items())}
    sp = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    outs: dict[int, object] = {}
    errs: list[BaseException] = []

    def gen(i: int) -> None:
        try:
            with SyncEngineClient(eng.url, timeout_s=120) as c:
                outs[i] = c.generate(_prompt(5 + i, 100 + i), sp)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    httpx.post(f"{eng.url}/slow_down", json={"forward_sleep_time": 0.05})
    try:
        ths = [threading.Thread(target=gen, args=(i,)) for i in range(N_REQ)]
        for t in ths:
            t.start()
        end = time.monotonic() + 60  # every request admitted (a loaded machine starts threads late) ...
        while httpx.get(f"{eng.url}/get_server_info").json()["num_requests"] < N_REQ and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.3)  # ... and a few tokens decoded at the old version
        m = tr.send(list(weights.items()), new)
        for t in ths:
            t.join(120)
    finally:
        httpx.post(f"{eng.url}/slow_down", json={"forward_sleep_time": None})
    assert not errs, errs
    assert sorted(outs) == list(range(N_REQ))  # none lost
    sums = {n: tensor_checksum(t) for n, t in weights.items()}
    chk = check_engines([client], sums, new)
    assert chk["sync/check_seconds"] > 0
    assert m["sync/buckets"] > 1 and 0 < m["sync/pause_seconds"] <= m["sync/seconds"]
    for i, o in outs.items():
        v = o.output_token_weight_versions
        assert len(v) == len(o.output_ids), i
        if mode == "abort":
            assert o.finish_reason == "abort", (i, o.finish_reason, v)
            assert 0 < len(o.output_ids) < MAX_NEW and set(v) == {old}
        else:
            assert o.finish_reason == "length" and len(o.output_ids) == MAX_NEW, (i, o.finish_reason)
            k = v.index(new)  # the update landed mid-request ...
            assert 0 < k and v == [old] * k + [new] * (MAX_NEW - k), v  # ... once, atomically
            assert o.weight_version == new
    # in_place: no flush went with the update (refused while paused requests hold KV); the
    # deferred flush asked for after the continue ran once the requests had finished
    flushes = tr._flushes.pending
    assert len(flushes) == (1 if mode == "in_place" else 0)
    assert all(f.result(timeout=60) is True for _, f, _ in flushes)
    # after the update a new request runs on the new weights only
    o = client.generate(_prompt(6, 7), {"temperature": 0.0, "max_new_tokens": 3})
    assert set(o.output_token_weight_versions) == {new}


def test_disk_fallback_serves_the_new_weights(tiny_engine, tmp_path):
    """weight_sync.transport=disk: after /update_weights_from_disk the engine's greedy tokens
    equal transformers' on the same new tensors (nothing derived from the old weights kept)."""
    from transformers import AutoModelForCausalLM

    from moe_async.models.checksum import tensor_checksum
    from moe_async.engines.embedded.weights import HFWeightMap
    from moe_async.weight_sync.factory import make_transport

    eng, model_dir = tiny_engine
    client = SyncEngineClient(eng.url, timeout_s=120)
    version = client.get_weight_version() + 1
    g = torch.Generator().manual_seed(1000 + version)
    weights = {n: torch.randn(t.shape, generator=g) * 0.2 for n, t in sorted(_disk_tensors(model_dir).items())}
    tr = make_transport([client], WeightSyncConfig(transport="disk", bucket_bytes=64 * 1024, disk_dir=str(tmp_path)),
                        pause_mode="in_place")
    tr.connect()
    m = tr.send(list(weights.items()), version)
    assert m["sync/buckets"] > 1 and m["sync/bytes"] == sum(t.numel() * 4 for t in weights.values())
    check_engines([client], {n: tensor_checksum(t) for n, t in weights.items()}, version)
    assert os.listdir(tmp_path) == [f"v{version}"]
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    HFWeightMap(ref).apply(weights)
    prompt = _prompt(7, 9)
    out = client.generate(prompt, {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
    with torch.no_grad():
        exp = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 7, dtype=torch.long),
                           do_sample=False, max_new_tokens=6, min_new_tokens=6)[0, 7:].tolist()
    assert out.output_ids == exp and set(out.output_token_weight_versions) == {version}
    tr.shutdown()
    client.close()
