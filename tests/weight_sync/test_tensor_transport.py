"""``weight_sync.transport: tensor`` (SGLang's ``/update_weights_from_tensor``) into the running
embedded engine, a separate process that opens the sender's CPU shared memory by name.

* a full update, the atomic version on the last bucket only: the engine's per-tensor
  checksums equal the sent tensors', its greedy output equals the one after the same
  weights came over the distributed (broadcast) path;
* SGLang's semantics: outside a session refused with SGLang's message (nothing applied); an
  unversioned call in a plain session applied at once; an unknown field a 422 naming it;
  a payload with a global outside the allow-list a 400 naming it (never unpickled);
* the send buffer in shared memory from its allocation (its views never move);
* a 1-process MegatronTrainer's sync through this path (parameters moved into the send
  buffer, now shared memory): check mode equal to the trainer's checksums, also after a
  train step in that memory.
"""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys

import httpx
import pytest
import torch

from moe_async.models.checksum import tensor_checksum

pytestmark = pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _rand(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}


def _sums(ts):
    return {n: tensor_checksum(t) for n, t in ts.items()}


@pytest.fixture
def tensor_transport(tiny_engine):
    from moe_async.engines.client import SyncEngineClient
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.factory import make_transport
    from moe_async.weight_sync.tensor_transport import TensorTransport

    client = SyncEngineClient(tiny_engine[0].url, timeout_s=120)
    cfg = WeightSyncConfig(transport="tensor", bucket_bytes=8 * 1024, timeout_s=120)
    tr = make_transport([client], cfg, pause_mode="in_place", ranks_per_engine=1, master_address="127.0.0.1")
    assert isinstance(tr, TensorTransport)
    tr.connect()
    yield client, tr
    tr.shutdown()
    client.close()


def _greedy(url):
    r = httpx.post(url + "/generate", json={"input_ids": [3, 17, 42, 5, 9], "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_tensor_sync_bit_exact_and_greedy_equals_broadcast(tiny_engine, tiny_shapes, tensor_transport, broadcast):
    client, tr = tensor_transport
    url = tiny_engine[0].url
    assert tr.layout is not None and sorted(tr.layout) == sorted(tiny_shapes)
    w1, w2 = _rand(tiny_shapes, 5), _rand(tiny_shapes, 6)
    v0 = client.weights_checksum()["weight_version"]
    _, btr = broadcast()
    btr.send(sorted(w1.items()), v0 + 1)
    out_broadcast = _greedy(url)
    posted = []
    orig = client.update_weights_from_tensor

    def spy(**body):
        posted.append(body)
        return orig(**body)

    client.update_weights_from_tensor = spy
    try:
        m = tr.send(sorted(w2.items()), v0 + 2)  # other weights first: the next sync must change them back
        s = client.weights_checksum()
        assert s["weight_version"] == v0 + 2 and s["checksums"] == _sums(w2)
        assert _greedy(url) != out_broadcast
        n_before = len(posted)
        m = tr.send(sorted(w1.items()), v0 + 3)
    finally:
        client.update_weights_from_tensor = orig
    s = client.weights_checksum()
    assert s["weight_version"] == v0 + 3 and s["checksums"] == _sums(w1)
    assert _greedy(url) == out_broadcast
    this = posted[n_before:]
    assert m["sync/buckets"] == len(this) > 3
    assert m["sync/bytes"] == sum(t.numel() * t.element_size() for t in w1.values())
    # the version (a string) on the last bucket only; one payload per TP rank; in_place: no
    # flush with any call (SGLang refuses it while paused requests hold KV)
    assert [b["weight_version"] for b in this] == [None] * (len(this) - 1) + [str(v0 + 3)]
    assert [b["flush_cache"] for b in this] == [False] * len(this)
    assert all(b["load_format"] == "flattened_bucket" and len(b["serialized_named_tensors"]) == 1 for b in this)


def _payload(named):
    from moe_async.weight_sync.tensor_ipc import forking_pickle

    return base64.b64encode(forking_pickle(named)).decode()


def test_send_buffer_is_shared_from_the_start_and_never_moves(tiny_shapes, tensor_transport):
    """The destination views lie in shared memory before any send: a handle to a plain CPU
    tensor moves its bytes to a new segment, and an exporter thread writing a later tensor
    into the buffer during that copy would lose it. The views keep their address across
    syncs and the engine receives what was written into them."""
    client, tr = tensor_transport
    w = _rand(tiny_shapes, 7)
    views = {n: tr.destination(n, tuple(t.shape), t.dtype) for n, t in w.items()}
    assert all(v is not None for v in views.values()) and tr._send_buf.is_shared()
    ptrs = {n: v.data_ptr() for n, v in views.items()}

    def export(ws):  # like the trainer: each tensor written into its view when it is yielded
        for n in tr.layout:
            views[n].copy_(ws[n])
            yield n, views[n]

    v0 = client.weights_checksum()["weight_version"]
    for i, ws in enumerate((w, _rand(tiny_shapes, 8))):
        tr.send(export(ws), v0 + 1 + i)
        s = client.weights_checksum()
        assert s["weight_version"] == v0 + 1 + i and s["checksums"] == _sums(ws)
        assert {n: v.data_ptr() for n, v in views.items()} == ptrs


def test_sglang_session_semantics_and_refusals(tiny_engine, tiny_shapes):
    url = tiny_engine[0].url
    names = sorted(tiny_shapes)
    part = _rand({n: tiny_shapes[n] for n in names[:4]}, 21)
    body = {"serialized_named_tensors": [_payload(list(part.items()))], "load_format": None}
    before = httpx.get(url + "/weights_checksum").json()
    r = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=60)  # no session open
    assert r.status_code == 400
    assert r.json()["message"] == ("update_weights_from_tensor must run between begin_weight_update() and "
                                   "end_weight_update()")
    assert httpx.get(url + "/weights_checksum").json()["checksums"] == before["checksums"]
    assert httpx.post(url + "/begin_weight_update", json={}).json()["success"]
    try:
        r = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=60)  # plain session, unversioned
        assert r.status_code == 200, r.text
        now = httpx.get(url + "/weights_checksum").json()
        assert now["weight_version"] == before["weight_version"]
        assert now["checksums"] == {**before["checksums"], **_sums(part)}  # applied when the call returned
        # an unknown field: a 422 naming it; a non-string version too
        r = httpx.post(url + "/update_weights_from_tensor", json={**body, "bucket_id": 3})
        assert r.status_code == 422 and "bucket_id" in r.text
        r = httpx.post(url + "/update_weights_from_tensor", json={**body, "weight_version": 3})
        assert r.status_code == 422 and "weight_version" in r.text
        # a global outside the allow-list is refused, named, and never called
        evil = base64.b64encode(pickle.dumps(os.system)).decode()
        r = httpx.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
        assert r.status_code == 400 and "posix.system is not allowed" in r.json()["message"]
        r = httpx.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": ["%%"]})
        assert r.status_code == 400 and "not base64" in r.json()["message"]
        bad = {"serialized_named_tensors": [_payload([("model.nope.weight", torch.zeros(2))])]}
        r = httpx.post(url + "/update_weights_from_tensor", json=bad)
        assert r.status_code == 400 and "model.nope.weight" in r.json()["message"]
    finally:
        assert httpx.post(url + "/end_weight_update", json={}).json()["success"]


_TRAINER_SYNC = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from _sync_layouts import samples, ADV
from moe_async.engines.client import SyncEngineClient
from moe_async.trainer.config import TrainerConfig
from moe_async.trainer.megatron_trainer import MegatronTrainer
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.tensor_transport import TensorTransport
from moe_async.weight_sync.transport import check_engines
url, model_dir = sys.argv[1], sys.argv[2]
trainer = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3), model_dir)
c = SyncEngineClient(url, timeout_s=120)
tr = TensorTransport([c], WeightSyncConfig(transport="tensor", bucket_bytes=16 * 1024, timeout_s=120))
tr.connect()
out = {}
v = c.weights_checksum()["weight_version"]
for step in range(2):
    if step:
        before = trainer.hf_checksums()
        out["loss"] = trainer.train_step(samples(), ADV)["loss"]
        out["changed"] = sum(before[n] != s for n, s in trainer.hf_checksums().items())
    v += 1
    m = tr.send(trainer.export_hf_weights(out=tr.destination), v)
    out[f"sync{step}"] = {**m, **check_engines([c], trainer.hf_checksums(), v)}
    out[f"shared{step}"] = bool(tr._send_buf is not None and tr._send_buf.is_shared())
tr.shutdown(); c.close(); trainer.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def test_megatron_trainer_sync_through_tensor_path(tiny_engine, tmp_path):
    """1-process MegatronTrainer -> TensorTransport -> embedded engine; check mode raises on
    any differing tensor, so reaching RESULT means bit-equal."""
    import json

    eng, model_dir = tiny_engine
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    # output to files, not pipes: the trainer's torch_shm_manager (file_system sharing)
    # outlives it while the engine maps its memory, and would hold a pipe open
    with open(tmp_path / "out.txt", "w") as out_f, open(tmp_path / "err.txt", "w") as err_f:
        p = subprocess.run([sys.executable, "-c", _TRAINER_SYNC, eng.url, model_dir, os.path.dirname(__file__)],
                           env=env, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL, timeout=900)
    stdout, stderr = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, stdout[-3000:] + stderr[-6000:]
    out = json.loads(line[len("RESULT "):])
    for k in ("sync0", "sync1"):
        assert out[k]["sync/check_tensors"] == 41 and out[k]["sync/buckets"] > 3
    assert out["shared0"] and out["shared1"]  # the send buffer lives in shared memory
    assert out["changed"] > 0  # the step trained in the shared buffer, and that sync carried it


class _FakeEngine:
    """Records the calls an engine sees; decodes every tensor payload (each TP rank's entry)
    before answering, as an engine copies the tensors before it replies."""

    def __init__(self, log, i):
        self.log, self.i, self.got = log, i, {}

    def pause_generation(self, mode):
        self.log.append((self.i, "pause"))
        return {"status": "ok"}

    def continue_generation(self):
        self.log.append((self.i, "continue"))
        return {"status": "ok"}

    def begin_weight_update(self, atomic=False):
        self.log.append((self.i, "begin", atomic))
        return {"success": True}

    def end_weight_update(self):
        self.log.append((self.i, "end"))
        return {"success": True}

    def update_weights_from_tensor(self, serialized_named_tensors, load_format, flush_cache, weight_version):
        from moe_async.engines.embedded.tensor_update import decode_named_tensors

        ranks = [decode_named_tensors(e, load_format) for e in serialized_named_tensors]
        for named in ranks:
            for n, t in named:
                self.got.setdefault(n, []).append(t.clone())
        self.log.append((self.i, "update", len(serialized_named_tensors), weight_version, flush_cache))
        return {"success": True}


def test_tensor_transport_order_payload_per_tp_rank_and_errors():
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.group import WeightSyncError
    from moe_async.weight_sync.tensor_transport import TensorTransport

    log = []
    engines = [_FakeEngine(log, 0), _FakeEngine(log, 1)]
    tr = TensorTransport(engines, WeightSyncConfig(transport="tensor", bucket_bytes=1024), ranks_per_engine=[1, 2])
    with pytest.raises(WeightSyncError, match="TensorTransport.send before connect"):
        tr.send([], 1)
    tr.connect()
    g = torch.Generator().manual_seed(2)
    sent = {f"t{i}": torch.randn(40 + i, generator=g) for i in range(12)}  # 160+ bytes each: several buckets
    m = tr.send(sent.items(), 9)
    for e, tp in zip(engines, (1, 2)):
        calls = [x[1:] for x in log if x[0] == e.i]
        ups = [c for c in calls if c[0] == "update"]
        assert calls[0] == ("pause",) and calls[1] == ("begin", True) and calls[-2:] == [("end",), ("continue",)]
        assert len(ups) == m["sync/buckets"] > 2 and all(c[1] == tp for c in ups)  # one payload per TP rank
        assert [c[2] for c in ups] == [None] * (len(ups) - 1) + ["9"]
        assert [c[3] for c in ups] == [False] * (len(ups) - 1) + [True]
        assert sorted(e.got) == sorted(sent)
        for n, t in sent.items():  # every rank's copy bit-identical to what was sent
            assert len(e.got[n]) == tp and all(torch.equal(x, t) for x in e.got[n]), n
    tr.shutdown()
