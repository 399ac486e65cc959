"""Bucket packing: exact byte round trips, oversize tensors (C2), bad metadata."""

import pytest
import torch

from moe_async.weight_sync.bucket import Bucket, make_buckets, unflatten


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(64, 32, generator=g)),  # 8 KiB
        ("a", torch.randn(7, generator=g)),
        ("b", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("c", torch.arange(10, dtype=torch.int64)),
    ]


@pytest.mark.parametrize("limit", [1, 40, 1024, 10**9])
def test_round_trip_bit_exact(limit):
    named = _tensors()
    buckets = list(make_buckets(named, limit))
    got = {}
    for b in buckets:
        flat = b.flatten()
        assert flat.dtype == torch.uint8 and flat.numel() == b.nbytes
        for n, t in unflatten(flat.clone(), b.names, b.dtypes, b.shapes):
            got[n] = t
    assert list(got) == [n for n, _ in named]  # order kept, each once
    for n, t in named:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t)
    sent = sum(t.numel() * t.element_size() for _, t in named)
    assert sum(b.nbytes for b in buckets) == sent


def test_c2_tensor_larger_than_bucket_goes_alone():
    named = _tensors()
    buckets = list(make_buckets(named, 1024))  # 1 KiB limit, 8 KiB embedding
    assert buckets[0].names == ["embed"] and buckets[0].nbytes == 64 * 32 * 4
    assert all(b.nbytes <= 1024 for b in buckets[1:])


def test_one_tensor_per_bucket():
    assert [len(b.names) for b in make_buckets(_tensors(), 1)] == [1, 1, 1, 1]


def test_unflatten_rejects_wrong_sizes():
    b = Bucket()
    b.names, b.tensors, b.nbytes = ["x"], [torch.zeros(4)], 16
    flat = b.flatten()
    with pytest.raises(ValueError, match="metadata describes"):
        unflatten(torch.cat([flat, flat]), b.names, b.dtypes, b.shapes)
    with pytest.raises(ValueError, match="too small"):
        unflatten(flat[:8], b.names, b.dtypes, b.shapes)
    with pytest.raises(ValueError, match="lengths differ"):
        unflatten(flat, b.names, [], b.shapes)
    with pytest.raises(ValueError, match="unknown dtype"):
        unflatten(flat, b.names, ["float8"], b.shapes)
    with pytest.raises(ValueError):
        list(make_buckets([], 0))


def test_master_store_binds_its_port_before_handing_it_out():
    """The weight-update group's port is bound when it is chosen (no free-port race)."""
    import socket

    from moe_async.weight_sync.group import bind_master_store

    store = bind_master_store("127.0.0.1", world_size=2, timeout_s=5)
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))  # already ours
