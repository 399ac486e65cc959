"""Update-group arithmetic and device selection, no processes: rank offsets from each
engine's own size (C13), the declared-world check, the transport's device (CUDA for NCCL,
CPU for gloo) and buckets packed on it, a group name freed by destroy."""

from __future__ import annotations

import pytest
import torch

from moe_async.weight_sync.group import check_world, rank_offsets, resolve_backend, transport_device


def test_rank_offsets_from_each_engines_own_size():
    assert rank_offsets([1, 2]) == ([1, 2], 4)  # TP1 + TP2 with one sender
    assert rank_offsets([2, 1]) == ([1, 3], 4)
    # 2 engines of TP2 x DP2: engine e, replica d, TP rank t at 1 + 4e + 2d + t
    offs, world = rank_offsets([4, 4])
    assert world == 9
    ranks = [offs[e] + 2 * d + t for e in range(2) for d in range(2) for t in range(2)]
    assert ranks == [1 + 4 * e + 2 * d + t for e in range(2) for d in range(2) for t in range(2)]
    assert sorted(ranks) == list(range(1, world))  # distinct, covering 1..world-1
    assert rank_offsets([3], first=2) == ([2], 5)  # two senders before the engines
    with pytest.raises(ValueError, match="engine 1: size 0"):
        rank_offsets([1, 0])


def test_declared_world_names_the_three_numbers():
    check_world(4, 1, 3)
    with pytest.raises(ValueError, match=r"declared world_size=5 but 1 sender rank\(s\) \+ 3 engine rank\(s\) = 4"):
        check_world(5, 1, 3)


def test_transport_device():
    assert transport_device("gloo") == torch.device("cpu")
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        assert transport_device("nccl") == torch.device("cuda", torch.cuda.current_device())
        assert transport_device("auto").type == "cuda"
    else:
        assert transport_device("auto") == torch.device("cpu") and resolve_backend("auto") == "gloo"
        with pytest.raises(RuntimeError, match="needs CUDA"):
            transport_device("nccl")
    with pytest.raises(ValueError, match="auto|gloo|nccl"):
        transport_device("mpi")


def test_buckets_are_packed_on_the_given_device():
    """A packed bucket, a 1-tensor bucket and a contiguous span all end up on the device the
    transport asks for (meta here stands in for CUDA: same code path, no data)."""
    from moe_async.weight_sync.packing import packed_buckets

    a, b = torch.arange(6.0), torch.arange(4.0)
    flat_src = torch.cat([a, b])
    for src in ([("a", a), ("b", b)], [("a", flat_src[:6]), ("b", flat_src[6:])], [("big", torch.zeros(64))]):
        for overlap in (False, True):
            got = list(packed_buckets(iter(src), 10**6, overlap=overlap, device=torch.device("meta")))
            assert got and all(flat.device.type == "meta" for _, flat, _ in got), src
    # the default (no device): the tensors' own, packed bytes exact
    (bucket, flat, last), = list(packed_buckets(iter([("a", a), ("b", b)]), 10**6, overlap=False))
    assert last and flat.device.type == "cpu" and torch.equal(flat.view(torch.float32), torch.cat([a, b]))


def test_transport_device_follows_its_backend_and_world():
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.transport import BroadcastTransport

    tr = BroadcastTransport([object(), object()], WeightSyncConfig(backend="gloo"), ranks_per_engine=[1, 2])
    assert tr.device == torch.device("cpu") and tr.world_size == 4 and tr.rank_offsets == [1, 2]
    with pytest.raises(ValueError, match="engine_sizes has 1 entries for 2 engines"):
        BroadcastTransport([object(), object()], WeightSyncConfig(backend="gloo"), ranks_per_engine=[1])
    tr.shutdown()


def test_group_name_is_freed_by_destroy():
    """create_update_group registers the name (as SGLang's does: a second live group of one
    name in a process is refused); destroy_update_group frees it for the next join."""
    import torch.distributed as dist

    from moe_async.weight_sync.group import create_update_group, destroy_update_group, group_broadcast

    for _ in range(2):
        store = dist.HashStore()
        pg, raw = create_update_group(backend="gloo", world_size=1, rank=0, group_name="unit_g", timeout_s=10,
                                      store=store)
        assert raw is store
        t = torch.ones(3)
        group_broadcast(pg, t)
        with pytest.raises(ValueError, match="already exists"):
            create_update_group(backend="gloo", world_size=1, rank=0, group_name="unit_g", timeout_s=10,
                                store=dist.HashStore())
        # the keys carry SGLang's prefixes: group name (ours), group name again and the device (torch's)
        # the key SGLang's side waits on: PrefixStore(name) + torch's "{name}/" + "cpu/" prefixes
        # (a bare ProcessGroupGloo over PrefixStore(name) writes "unit_g/0/0" instead: case C15)
        assert store.check(["unit_g/unit_g//cpu//0/0"]) and not store.check(["unit_g/0/0"])
        destroy_update_group(pg)


def test_form_in_turn_orders_senders_and_names_an_earlier_failure():
    """Senders in different processes (threads here, one shared store): group k is formed only
    after group k-1 was; a failed earlier group fails the later ones, naming it."""
    import threading
    import time

    import torch.distributed as dist

    from moe_async.weight_sync.membership import GroupFormationError, form_in_turn

    order: list[int] = []

    class _M:
        def __init__(self, k, fail=False):
            self.k, self.fail = k, fail

        def form(self):
            time.sleep(0.2 * (2 - self.k))  # the later turn would finish first if not ordered
            if self.fail:
                raise GroupFormationError(f"group {self.k} broke")
            order.append(self.k)
            return f"pg{self.k}"

    for fail0 in (False, True):
        order.clear()
        store = dist.HashStore()
        out: dict = {}

        def run(k, fail0=fail0, store=store, out=out):
            try:
                out[k] = form_in_turn(_M(k, fail=fail0 and k == 0), k, 3, store, timeout_s=10)
            except GroupFormationError as e:
                out[k] = e

        ths = [threading.Thread(target=run, args=(k,)) for k in (2, 1, 0)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(20)
        if not fail0:
            assert order == [0, 1, 2] and out == {0: "pg0", 1: "pg1", 2: "pg2"}
        else:
            assert order == [] and all(isinstance(out[k], GroupFormationError) for k in range(3))
            assert "group 0 broke" in str(out[2])
