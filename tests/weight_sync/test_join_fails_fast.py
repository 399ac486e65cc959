"""A weight-update group whose join fails at once fails at once (``GroupMembership.form``).

An engine that answers no to ``/init_weights_update_group`` (here: the embedded engine still
holds a live group of that name) or that cannot be reached used to leave the sender (rank 0)
waiting in the rendezvous for the full ``timeout_s`` (600 s by default), and the error then
named a store key, not the engine. Right: the sync fails within seconds, the error names the
engine (index and URL) and its reason, every partial group is torn down, and a later form
with the engines that are fine succeeds.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

TIMEOUT_S = 60.0  # the bound the old code waited out in full
FAST_S = 15.0  # seconds: "at once" on a loaded 2-core machine


def _membership(clients, name):
    from moe_async.weight_sync.membership import GroupMembership

    return GroupMembership(clients, engine_sizes=1, group_name=name, backend="gloo", master_address="127.0.0.1",
                           timeout_s=TIMEOUT_S)


def _hold_live_group(url: str, name: str):
    """The engine joins group ``name`` with a sender whose store stays alive; this process then
    frees the name locally (the engine still holds a live group: it refuses another join)."""
    from moe_async.weight_sync.group import bind_master_store, create_update_group, destroy_update_group

    store = bind_master_store("127.0.0.1", 2, 30)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        url + "/init_weights_update_group", timeout=60,
        json={"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
              "group_name": name, "backend": "gloo"})))
    th.start()
    pg, _ = create_update_group(backend="gloo", world_size=2, rank=0, group_name=name, timeout_s=30, store=store)
    th.join(60)
    assert out["r"].json()["success"], out["r"].text
    destroy_update_group(pg)
    return store


def test_engine_refusing_the_join_fails_the_form_at_once(tiny_engine):
    from moe_async.engines.client import SyncEngineClient
    from moe_async.weight_sync.membership import GroupFormationError

    eng, _ = tiny_engine
    name = "join_refused"
    store = _hold_live_group(eng.url, name)
    client = SyncEngineClient(eng.url, timeout_s=120)
    try:
        t0 = time.monotonic()
        with pytest.raises(GroupFormationError) as e:
            _membership([client], name).form()
        took = time.monotonic() - t0
        msg = str(e.value)
        assert took < FAST_S, (took, msg)
        assert "\n" not in msg
        assert f"engine 0 at {eng.url}: init_weights_update_group failed: " in msg, msg
        assert f"live weight-update group {name!r}" in msg, msg  # the engine's own reason
        assert "wait timeout" not in msg.lower() and "key" not in msg, msg  # not a store key
    finally:
        httpx.post(eng.url + "/destroy_weights_update_group", json={"group_name": name}, timeout=60)
        del store
    m = _membership([client], name)  # the engine left it: the next form is clean
    m.form()
    m.leave()
    client.close()


def test_unreachable_engine_fails_the_form_at_once_and_the_others_are_left(tiny_engine):
    from moe_async.engines.client import SyncEngineClient
    from moe_async.weight_sync.membership import GroupFormationError

    eng, _ = tiny_engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    live, gone = SyncEngineClient(eng.url, timeout_s=120), SyncEngineClient(dead, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(GroupFormationError) as e:
        _membership([live, gone], "join_unreachable").form()
    took = time.monotonic() - t0
    assert took < FAST_S, (took, str(e.value))
    assert f"engine 1 at {dead}: init_weights_update_group failed: ConnectError" in str(e.value), str(e.value)
    # the live engine's half of the group is destroyed (in the background): a form with it alone succeeds
    deadline = time.monotonic() + 60
    while True:
        m = _membership([live], "join_unreachable")
        try:
            m.form()
            break
        except GroupFormationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    m.leave()
    live.close()
    gone.close()
