"""Several senders into a real embedded engine (2 gloo processes, synthetic shards of the
engine's own HF tensors: no Megatron), through each rank's SenderGroups: a sender that fails
mid-sync ends the update on the engine at once (no wait for the failed sender's broadcast until
the group's timeout), and so does a sender whose broadcast fails after its update call was
posted (the engine already waits in it: the sender abandons its group, so the engine's receive
ends at once, not at its 600 s group timeout); the engine keeps the previous version's weights;
every group is formed again in the fixed order, under fresh names, before the next sync, which
equals the trainer's tensors."""

from __future__ import annotations

import io
import os
import socket
import time

import torch

T = 40.0  # the update groups' timeout (s): a failed sync must end far below it


def _tensors(model_dir: str, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t.float() + 0.01 * version for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}


class _P:
    def __init__(self, name, data, full, off):
        self.name, self.data, self.full_shape, self.offset = name, data, tuple(full), tuple(off)


class _Source:
    """A ShardSource: every HF tensor whole on rank ``i % 2`` (its index in sorted order), the
    embedding split by rows over both ranks (gathered by one of them); ``fail``: this rank's
    split raises on the real tensor ``fail`` (planned on ``meta`` as usual)."""

    vocab: dict = {}

    def __init__(self, model_dir: str, rank: int, version: int, fail: str | None = None):
        full = _tensors(model_dir, version)
        self.expected = frozenset(full)
        self.fail = fail
        emb = "model.embed_tokens.weight"
        h = full[emb].shape[0] // 2
        self._pieces = [_P(emb, full[emb][h * rank: h * (rank + 1)].clone(), full[emb].shape, (h * rank, 0))]
        self._pieces += [_P(n, t, t.shape, (0,) * t.dim()) for i, (n, t) in enumerate(sorted(full.items()))
                         if n != emb and i % 2 == rank]

    def check(self):
        pass

    def shards(self):
        return self._pieces

    def convert(self, name, t):
        if name == self.fail and t.device.type != "meta":
            raise ValueError(f"injected: the split of {name} failed")
        return [(name, t)]

    def direct(self, name):
        return False


def _destroy_reply(client, name: str) -> str:
    try:
        return f"destroyed: {client.destroy_weights_update_group(group_name=name)}"
    except Exception as e:  # noqa: BLE001 - the engine's 400
        return str(e)


def _run(rank, port, url, model_dir, q):
    """Sync 1 goes through; in sync 2 rank 1's split of a tensor in the middle of its buckets
    raises; in syncs 3 and 4 rank 1's broadcast raises (no byte sent) at its bucket 1, then at
    its last one, each after rank 0 posted that bucket's call; sync 5 goes through."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from moe_async.engines.client import SyncEngineClient
    from moe_async.models.checksum import tensor_checksum
    from moe_async.weight_sync import group as group_mod
    from moe_async.weight_sync import senders
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.sender_groups import SenderGroups
    from moe_async.weight_sync.transport import BroadcastTransport, check_engines

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out: dict = {"failed_s": [], "errors": [], "after": []}
    client = SyncEngineClient(url, timeout_s=120)
    cfg = WeightSyncConfig(bucket_bytes=16 * 1024, backend="gloo", timeout_s=T)

    def make(name):
        return BroadcastTransport([client], cfg, pause_mode="in_place", group_name=name) if rank == 0 else \
            senders.SenderLink([client], cfg, rank=1, group_name=name)

    real = group_mod.group_broadcast
    calls = {"n": 0, "fail_at": None}

    def flaky(group, tensor, src=0):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected: the link broke mid-broadcast")
        return real(group, tensor, src)

    group_mod.group_broadcast = flaky
    try:
        g = SenderGroups(rank, 2, _get_default_store(), make, base="release", key="release", timeout_s=T)
        box = [int(client.weights_checksum()["weight_version"]) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        base = box[0]
        g.sync(_Source(model_dir, rank, 1), base + 1)
        (plan,) = senders._PLANS.values()
        mine = [p.hf_name for b in plan.plans[1].buckets for p in b]
        n1 = len(plan.plans[1].buckets)
        if rank == 0:
            out["before"] = client.weights_checksum()
        fail = mine[len(mine) // 2] if rank == 1 else None  # a tensor in the middle of rank 1's buckets
        for v, split, at in ((2, fail, None), (3, None, 2), (4, None, n1)):
            calls.update(n=0, fail_at=at if rank == 1 else None)
            t0 = time.perf_counter()
            try:
                g.sync(_Source(model_dir, rank, v, split), base + v)
                out["errors"].append(None)
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"{type(e).__name__}: {e}")
            out["failed_s"].append(time.perf_counter() - t0)
            if rank == 0:
                out["after"].append(client.weights_checksum())
        calls.update(n=0, fail_at=None)
        old = [g.name(n) for n in range(g.connects)]
        g.sync(_Source(model_dir, rank, 5), base + 5)  # formed again first, under fresh names
        if rank == 0:
            sums = {n: tensor_checksum(t) for n, t in _tensors(model_dir, 5).items()}
            out["next_check"] = check_engines([client], sums, base + 5)
            names = [n for o in old for n in (o, senders.sender_group_name(o, 1))]
            out["old_groups"] = {n: _destroy_reply(client, n) for n in names}
        out.update(base=base, n1=n1, connects=g.connects)
        dist.barrier()
        g.close()
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put((rank, buf.getvalue()))
    except BaseException:  # noqa: BLE001
        import traceback

        q.put((rank, traceback.format_exc()))
    finally:
        client.close()
        dist.destroy_process_group()


def test_a_failing_sender_ends_the_engines_update_at_once_and_the_next_sync_goes_through(tiny_engine):
    import torch.multiprocessing as mp

    eng, model_dir = tiny_engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, port, eng.url, model_dir, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        res = dict(q.get(timeout=6 * T) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(isinstance(r, bytes) for r in res.values()), res
    r0, r1 = (torch.load(io.BytesIO(res[r])) for r in (0, 1))
    assert r1["n1"] >= 3  # rank 1 sends several buckets: each failure is mid-sync
    for r in (r0, r1):  # every rank fails naming rank 1's error, far below the group's timeout
        split, *broken = r["errors"]
        assert split and "rank 1: WeightSyncError: sender 1: export failed: ValueError: injected" in split, split
        for e in broken:
            assert e and "rank 1: WeightSyncError: sender 1, its bucket" in e and "injected: the link broke" in e, e
        assert max(r["failed_s"]) < T / 4, r["failed_s"]
        assert r["connects"] == 4  # the first connect, then one before each sync after a failure
    for after in r0["after"]:  # the engine kept the previous version's weights: nothing half-applied
        assert int(after["weight_version"]) == r0["base"] + 1
        assert after["checksums"] == r0["before"]["checksums"]
    assert r0["next_check"]["sync/check_tensors"] == len(r0["before"]["checksums"])  # equals the trainer's
    # every earlier connect's groups are gone from the engine (left or abandoned, then destroyed)
    assert len(r0["old_groups"]) == 6 and all(rep.endswith("HTTP 400: The group to be destroyed does not exist.")
                                              for rep in r0["old_groups"].values()), r0["old_groups"]
