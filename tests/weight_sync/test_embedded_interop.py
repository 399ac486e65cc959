"""Senders written the way other projects write theirs, against the running embedded engine.

* C15: a slime/miles-style sender (SGLang 0.5.23's own ``init_custom_process_group`` on rank
  0 with ``tcp://`` rendezvous, per-tensor broadcasts with ``load_format: null``,
  ``weight_version`` on every call, inside ``begin_weight_update`` / ``end_weight_update``):
  the group forms within seconds, the engine's tensors equal the sent ones bit for bit, and
  its greedy output equals transformers' on the same weights.
* C16: an unversioned call (AReaL, SGLang's Python Engine API) is applied when it returns;
  an update outside a session is refused with SGLang's message, and the group stays usable.
* C20: the engine holds its group and the trainer that made it is SIGKILLed; a new trainer
  joins with the same group name on a new port: the stale group is torn down first, the join
  succeeds, the next sync is bit-exact; a second live membership is refused naming the fix.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engines"))

pytestmark = pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")


def _sglang_common():
    import _sglang_import

    from moe_async.compat.sglang_cpu import import_sglang  # the stubs, taken out of sys.modules after

    _sglang_import.load_io_struct()  # an ImportError fails the test, as in the contract tests
    return import_sglang("sglang.srt.utils.common")


def _rand(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}


def _sums(ts):
    from moe_async.models.checksum import tensor_checksum

    return {n: tensor_checksum(t) for n, t in ts.items()}


def _post(url, path, body, timeout=120):
    return httpx.post(url + path, json=body, timeout=timeout)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slime_style_sender_into_embedded_engine(tiny_engine, tiny_shapes):
    """C15 (direction 2): slime's sender protocol against our engine."""
    common = _sglang_common()
    eng, model_dir = tiny_engine
    url = eng.url
    port = _free_port()
    name = "slime_style"
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("r", _post(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"})))
    t0 = time.monotonic()
    th.start()
    pg = common.init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                          rank=0, group_name=name, timeout=datetime.timedelta(seconds=30))
    th.join(60)
    formed_s = time.monotonic() - t0
    assert res["r"].status_code == 200 and res["r"].json()["success"], res["r"].text
    assert formed_s < 15, formed_s  # seconds: SGLang's keys on both sides (C15)
    try:
        new = _rand(tiny_shapes, 21)
        names = sorted(new)
        assert _post(url, "/begin_weight_update", {}).json()["success"]
        for k in range(0, len(names), 7):  # calls of 7 tensors, one broadcast per tensor, all versioned
            chunk = names[k:k + 7]
            out = {}
            body = {"names": chunk, "dtypes": ["float32"] * len(chunk), "shapes": [list(new[n].shape) for n in chunk],
                    "group_name": name, "flush_cache": False, "weight_version": "7", "load_format": None}
            th = threading.Thread(target=lambda: out.setdefault("r", _post(url, "/update_weights_from_distributed", body)))
            th.start()
            handles = [torch.distributed.broadcast(new[n], src=0, group=pg, async_op=True) for n in chunk]
            for h in handles:
                h.wait()
            th.join(60)
            assert out["r"].status_code == 200 and out["r"].json()["success"], out["r"].text
        assert _post(url, "/end_weight_update", {}).json()["success"]
        got = httpx.get(url + "/weights_checksum").json()
        assert got["weight_version"] == "7"  # a string, as SGLang's
        assert got["checksums"] == _sums(new)
        assert httpx.get(url + "/get_weight_version").json() == {"weight_version": "7"}
        # greedy output equals transformers holding the same tensors
        from transformers import AutoModelForCausalLM

        from moe_async.engines.embedded.weights import HFWeightMap

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        HFWeightMap(model).apply(new)
        prompt = [5, 17, 33, 2, 99, 140]
        r = _post(url, "/generate", {"input_ids": prompt,
                                     "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}).json()
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=8)
        assert r["output_ids"] == ref[0, len(prompt):].tolist() and len(r["output_ids"]) > 0
        assert r["meta_info"]["weight_version"] == "7"
    finally:
        _post(url, "/destroy_weights_update_group", {"group_name": name})
        torch.distributed.destroy_process_group(pg)


def _join_pair(url, name, rank0_timeout=30):
    """A group of the engine and a sender in this process made with our create_update_group."""
    from moe_async.weight_sync.group import bind_master_store, create_update_group

    store = bind_master_store("127.0.0.1", 2, rank0_timeout)
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("r", _post(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"})))
    th.start()
    pg, _ = create_update_group(backend="gloo", world_size=2, rank=0, group_name=name, timeout_s=rank0_timeout,
                                store=store)
    th.join(60)
    assert res["r"].json()["success"], res["r"].text
    return pg


def _call(url, pg, name, ts, version=None):
    from moe_async.weight_sync.bucket import make_buckets
    from moe_async.weight_sync.group import group_broadcast

    (b,) = list(make_buckets(list(ts.items()), 1 << 30))
    body = {"names": b.names, "dtypes": b.dtypes, "shapes": b.shapes, "group_name": name,
            "load_format": "flattened_bucket"}
    if version is not None:
        body["weight_version"] = version
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", _post(url, "/update_weights_from_distributed", body)))
    th.start()
    group_broadcast(pg, b.flatten(), src=0)
    th.join(60)
    return out["r"]


def test_unversioned_update_is_applied_at_once(tiny_engine, tiny_shapes):
    """C16: in a session, a call without weight_version is applied when it returns (the
    version unchanged); outside a session: SGLang's refusal, bytes drained, group usable;
    a second begin and an end without begin: SGLang's refusals."""
    from moe_async.weight_sync.group import destroy_update_group

    url = tiny_engine[0].url
    name = "c16"
    pg = _join_pair(url, name)
    try:
        v0 = httpx.get(url + "/get_weight_version").json()["weight_version"]
        names = sorted(tiny_shapes)
        part = _rand({n: tiny_shapes[n] for n in names[:9]}, 31)
        r = _call(url, pg, name, part)  # no session open
        assert r.status_code == 400
        assert r.json()["message"] == ("update_weights_from_distributed must run between begin_weight_update() "
                                       "and end_weight_update()")
        before = httpx.get(url + "/weights_checksum").json()["checksums"]
        assert all(before[n] != s for n, s in _sums(part).items())  # nothing applied
        assert _post(url, "/begin_weight_update", {"selector": "all"}).json()["success"]
        again = _post(url, "/begin_weight_update", {})
        assert again.status_code == 400 and "already open" in again.json()["message"]
        r = _call(url, pg, name, part)  # unversioned (AReaL / SGLang's Engine API)
        assert r.status_code == 200, r.text
        now = httpx.get(url + "/weights_checksum").json()
        assert now["weight_version"] == v0  # no version given: unchanged
        assert now["checksums"] == {**before, **_sums(part)}  # applied when the call returned
        assert _post(url, "/end_weight_update", {}).json()["success"]
        r = _post(url, "/end_weight_update", {})
        assert r.status_code == 400 and "no weight-update session is open" in r.json()["message"]
        # unknown fields are refused, naming them; a non-string version too (SGLang: Optional[str])
        r = _post(url, "/begin_weight_update", {"selector": "all", "atomik": True})
        assert r.status_code == 422 and "atomik" in r.text
        r = _post(url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                            "group_name": name, "weight_version": 3})
        assert r.status_code == 422 and "weight_version" in r.text
    finally:
        _post(url, "/destroy_weights_update_group", {"group_name": name})
        destroy_update_group(pg)


_KILLED_TRAINER = r"""
import sys, time, torch
from moe_async.engines.client import SyncEngineClient
from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.transport import BroadcastTransport
url, name = sys.argv[1], sys.argv[2]
c = SyncEngineClient(url, timeout_s=60)
tr = BroadcastTransport([c], WeightSyncConfig(backend="gloo", bucket_bytes=1 << 20, timeout_s=60), group_name=name)
tr.connect()
lay = c.weights_layout()
g = torch.Generator().manual_seed(41)
tr.send([(n, torch.randn(s, generator=g)) for n, s in zip(lay["names"], lay["shapes"])], 1)
print("synced", flush=True)
time.sleep(600)
"""


def test_rejoin_after_the_trainer_was_killed(tiny_engine, tiny_shapes):
    """C20."""
    from moe_async.engines.client import SyncEngineClient
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.transport import BroadcastTransport

    url = tiny_engine[0].url
    name = "c20"
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", _KILLED_TRAINER, url, name], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert p.stdout.readline().strip() == "synced"
        assert httpx.get(url + "/get_weight_version").json()["weight_version"] == "1"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    c = SyncEngineClient(url, timeout_s=60)
    tr = BroadcastTransport([c], WeightSyncConfig(backend="gloo", bucket_bytes=1 << 20, timeout_s=20), group_name=name)
    try:
        t0 = time.monotonic()
        tr.connect()  # same group name, new port: the stale group is torn down first
        assert time.monotonic() - t0 < 20
        new = _rand(tiny_shapes, 43)
        tr.send(new.items(), 2)
        got = c.weights_checksum()
        assert got["weight_version"] == 2 and got["checksums"] == _sums(new)
        # a second LIVE membership under the same name: refused, naming the fix
        from moe_async.weight_sync.group import bind_master_store

        other = bind_master_store("127.0.0.1", 2, 10)
        r = _post(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": other.port,
                                                      "rank_offset": 1, "world_size": 2, "group_name": name,
                                                      "backend": "gloo"})
        assert r.status_code == 400
        msg = r.json()["message"]
        assert "live weight-update group 'c20'" in msg and "/destroy_weights_update_group" in msg, msg
        assert (tr.send(new.items(), 3)["sync/weight_version"] == 3 and c.get_weight_version() == 3)  # still ours
    finally:
        tr.shutdown()
        c.close()


def test_update_without_pause_waits_for_requests_in_flight(tiny_engine, tiny_shapes):
    """SGLang's model-update lock: an update call made without a pause waits until every
    request in flight has finished (they keep the old weights for all their tokens, never a
    switch mid-sequence), and a request arriving meanwhile waits behind it (it runs on the
    new weights only). The version is any string (SGLang's ``weight_version: Optional[str]``);
    its ``flush_cache: true`` succeeds then (the engine is idle when the call applies)."""
    from moe_async.weight_sync.group import destroy_update_group

    url = tiny_engine[0].url
    name = "unpaused"
    pg = _join_pair(url, name)
    sp = {"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True}
    res: dict[str, object] = {}
    times: dict[str, float] = {}

    def gen(key, prompt):
        res[key] = _post(url, "/generate", {"input_ids": prompt, "sampling_params": sp}).json()
        times[key] = time.monotonic()

    _post(url, "/slow_down", {"forward_sleep_time": 0.05})
    try:
        v0 = httpx.get(url + "/get_weight_version").json()["weight_version"]
        first = threading.Thread(target=gen, args=("first", [3, 4, 5, 6]))
        first.start()
        end = time.monotonic() + 60
        while httpx.get(url + "/get_server_info").json()["num_requests"] < 1 and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(0.3)  # a few tokens at the old weights
        assert _post(url, "/begin_weight_update", {}).json()["success"]  # a plain session, no pause
        upd: dict[str, object] = {}

        def update():
            upd["r"] = _call(url, pg, name, _rand(tiny_shapes, 31), version="rl-step-9")
            times["update"] = time.monotonic()

        th = threading.Thread(target=update)
        th.start()
        time.sleep(0.3)
        second = threading.Thread(target=gen, args=("second", [7, 8, 9]))  # arrives while the update waits
        second.start()
        for t in (first, th, second):
            t.join(120)
        assert upd["r"].status_code == 200 and upd["r"].json()["success"], upd["r"].text
        assert _post(url, "/end_weight_update", {}).json()["success"]
        a, b = res["first"]["meta_info"], res["second"]["meta_info"]
        assert a["output_token_weight_versions"] == [v0] * 30 and a["weight_version"] == v0
        assert b["output_token_weight_versions"] == ["rl-step-9"] * 30 and b["weight_version"] == "rl-step-9"
        assert times["first"] <= times["update"] <= times["second"]
        assert httpx.get(url + "/get_weight_version").json() == {"weight_version": "rl-step-9"}
        assert _post(url, "/begin_weight_update", {}).json()["success"]  # the next tests count from v0
        one = sorted(tiny_shapes)[0]
        assert _call(url, pg, name, {one: _rand(tiny_shapes, 31)[one]}, version=v0).json()["success"]
        assert _post(url, "/end_weight_update", {}).json()["success"]
    finally:
        _post(url, "/slow_down", {"forward_sleep_time": None})
        _post(url, "/destroy_weights_update_group", {"group_name": name})
        destroy_update_group(pg)


def test_flush_refused_while_requests_are_paused_in_place(tiny_engine, tiny_shapes):
    """SGLang's flush rule: while a request paused ``in_place`` holds its KV, ``/flush_cache``
    is refused and an update call with ``flush_cache: true`` fails after applying (SGLang's
    message; the version is served); after a ``retract`` pause (no running request) both
    succeed; the paused request finishes with each token's version recorded."""
    from moe_async.engines.embedded.weight_update import FLUSH_REFUSED
    from moe_async.weight_sync.group import destroy_update_group

    url = tiny_engine[0].url
    name = "flush_rule"
    pg = _join_pair(url, name)
    sp = {"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True}
    res: dict[str, dict] = {}
    v0 = httpx.get(url + "/get_weight_version").json()["weight_version"]
    _post(url, "/slow_down", {"forward_sleep_time": 0.05})
    try:
        for mode, version in (("in_place", "flush-1"), ("retract", v0)):
            th = threading.Thread(target=lambda m=mode: res.setdefault(m, _post(url, "/generate", {
                "input_ids": [3, 4, 5], "sampling_params": sp}).json()))
            th.start()
            end = time.monotonic() + 60
            while httpx.get(url + "/get_server_info").json()["num_requests"] < 1 and time.monotonic() < end:
                time.sleep(0.02)
            time.sleep(0.3)
            _post(url, "/pause_generation", {"mode": mode})
            flushed = httpx.post(url + "/flush_cache", timeout=30)
            assert _post(url, "/begin_weight_update", {}).json()["success"]
            r = _call(url, pg, name, _rand(tiny_shapes, 41), version=version)  # flush_cache: true (default)
            assert _post(url, "/end_weight_update", {}).json()["success"]
            served = httpx.get(url + "/get_weight_version").json()["weight_version"]
            _post(url, "/continue_generation", {})
            th.join(120)
            assert served == version  # applied either way, as SGLang
            if mode == "in_place":
                assert flushed.status_code == 400
                assert r.status_code == 400 and r.json()["message"] == FLUSH_REFUSED, r.text
            else:
                assert flushed.status_code == 200 and r.status_code == 200 and r.json()["success"], r.text
            v = res[mode]["meta_info"]["output_token_weight_versions"]
            prev = v0 if mode == "in_place" else "flush-1"
            k = v.index(version)
            assert 0 < k and v == [prev] * k + [version] * (30 - k), v
    finally:
        _post(url, "/slow_down", {"forward_sleep_time": None})
        _post(url, "/destroy_weights_update_group", {"group_name": name})
        destroy_update_group(pg)


def test_atomic_session_with_every_call_versioned(tiny_engine, tiny_shapes):
    """An atomic session whose sender versions every call (as slime does): each call is
    applied when it returns (its own bytes copied, nothing else), the served tensors equal the
    sent ones bit for bit after every call, and the version is each call's."""
    from moe_async.weight_sync.group import destroy_update_group

    url = tiny_engine[0].url
    name = "atomic_every_call"
    pg = _join_pair(url, name)
    try:
        v0 = httpx.get(url + "/get_weight_version").json()["weight_version"]
        before = httpx.get(url + "/weights_checksum").json()["checksums"]
        new = _rand(tiny_shapes, 51)
        names = sorted(new)
        want = dict(before)
        assert _post(url, "/begin_weight_update", {"atomic": True}).json()["success"]
        for k in range(0, len(names), 5):
            chunk = {n: new[n] for n in names[k:k + 5]}
            r = _call(url, pg, name, chunk, version=f"c{k}")
            assert r.status_code == 200 and "at once" in r.json()["message"], r.text
            want.update(_sums(chunk))
            got = httpx.get(url + "/weights_checksum").json()
            assert got["weight_version"] == f"c{k}" and got["checksums"] == want
        assert _post(url, "/end_weight_update", {}).json()["success"]
        assert _post(url, "/begin_weight_update", {}).json()["success"]  # the next tests count from v0
        assert _call(url, pg, name, {names[0]: new[names[0]]}, version=v0).json()["success"]
        assert _post(url, "/end_weight_update", {}).json()["success"]
    finally:
        _post(url, "/destroy_weights_update_group", {"group_name": name})
        destroy_update_group(pg)
