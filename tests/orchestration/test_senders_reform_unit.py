"""The trainer actor under ``weight_sync.senders: all`` (fakes for the trainer, the formation
and the sync; no Ray, no process group): a sync that failed, or that lost an engine, makes the
actor form every sender's update group again before its next sync, in the fixed order, under
fresh names and a fresh store key; a good sync re-forms nothing; an explicit reconnect does it
once."""

from __future__ import annotations

import os

import pytest

from moe_async.config import load_config
from moe_async.orchestration.actors import TrainerActor
from moe_async.weight_sync import sender_groups
from moe_async.weight_sync.group import WeightSyncError
from moe_async.weight_sync.outcome import SyncOutcome

SMOKE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cpu_smoke.yaml")


class _Trainer:
    version = 3
    cfg = type("C", (), {"lora": None})()

    def hf_exporter(self):
        return "exporter"


@pytest.fixture
def actor_of(monkeypatch):
    """``make(rank) -> (actor, log)``: the plain actor class at ``rank`` of 2 with fakes; ``log``
    records each formation ``("connect", rank 0's group name, key, what this rank made)`` and
    sync ``("sync", version)``; ``log.outcomes``: what the next syncs do (an exception to raise,
    or a SyncOutcome / dict to return)."""
    import torch

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the actor's; not this process's
    monkeypatch.setattr("ray.util.get_node_ip_address", lambda: "127.0.0.1")

    def make(rank: int):
        cfg = load_config(SMOKE, ["weight_sync.senders=all", "trainer.world_size=2"])
        a = TrainerActor.__ray_actor_class__(cfg, "/nonexistent", rank=rank, world_size=2)
        a.trainer, a._store = _Trainer(), object()
        log: list = []
        outcomes: list = []

        def connect(rank_, world, store, *, transport, link, key, timeout_s):
            made = transport if rank_ == 0 else link
            log.append(("connect", made.group_name if rank_ == 0 else made.group_name.rsplit("-s", 1)[0], key,
                        type(made).__name__))

        def sync(rank_, source, version, *, transport, link, send):
            log.append(("sync", version))
            out = outcomes.pop(0)
            if isinstance(out, Exception):
                raise out
            return out

        monkeypatch.setattr(sender_groups, "connect_senders", connect)
        monkeypatch.setattr(sender_groups, "sync_from_senders", sync)
        return a, (log, outcomes)

    return make


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_or_engine_losing_sync_makes_the_next_one_form_every_group_again(actor_of, rank):
    a, (log, outcomes) = actor_of(rank)
    made = "BroadcastTransport" if rank == 0 else "SenderLink"
    a.connect_engines(["http://e0", "http://e1"])
    assert log == [("connect", "moe_async_weight_sync", "moe_async/sender_groups/0", made)]
    outcomes += [{"sync/seconds": 1.0}, WeightSyncError("weight sync failed on rank 1: boom"),
                 SyncOutcome({}, ["http://e1"], "lost"), {"sync/seconds": 1.0}, {"sync/seconds": 1.0}]
    a.sync_weights()  # good: nothing re-formed
    with pytest.raises(WeightSyncError, match="boom"):
        a.sync_weights()
    del log[:]
    out = a.sync_weights_outcome()  # re-formed first (fresh name and key), then it loses an engine
    assert log == [("connect", "moe_async_weight_sync-r1", "moe_async/sender_groups/1", made), ("sync", 3)]
    assert out.lost == (["http://e1"] if rank == 0 else [])  # rank 0's outcome (the group's reply)
    del log[:]
    a.sync_weights()  # after the lost engine: formed again before it
    assert log == [("connect", "moe_async_weight_sync-r2", "moe_async/sender_groups/2", made), ("sync", 3)]
    del log[:]
    a.reconnect_engines(["http://e0"])  # the recovery's re-form: once, then a plain sync
    a.sync_weights()
    assert log == [("connect", "moe_async_weight_sync-r3", "moe_async/sender_groups/3", made), ("sync", 3)]
