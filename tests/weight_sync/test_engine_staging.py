"""The embedded engine's staging through the transport: buckets in /weights_layout order land
in the standby parameters without a copy, any other order through the scratch copy (same
result), a partial update keeps the other tensors, and a failed bucket in the middle of an
update fails the whole update (later buckets refused, nothing applied, the next one fine)."""

from __future__ import annotations

import pytest
import torch

from moe_async.models.checksum import tensor_checksum

pytestmark = pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")


def test_layout_order_partial_update_and_failed_bucket(broadcast, tiny_shapes):
    shapes = tiny_shapes
    client, tr = broadcast()
    layout = tr.layout
    assert layout is not None and sorted(layout) == sorted(shapes)
    g = torch.Generator().manual_seed(11)

    def rand(names):
        return {n: torch.randn(shapes[n], generator=g) * 0.05 for n in names}

    def state():
        s = client.weights_checksum()
        return s["weight_version"], s["checksums"], s["recv_copies"], s["bytes_received"]

    v0, sums0, copies0, _ = state()
    # 1) full update, exporter order reversed: the transport re-orders, nothing copied
    full = rand(sorted(shapes))
    m = tr.send(reversed(list(full.items())), v0 + 1)
    v1, sums1, copies1, _ = state()
    assert v1 == v0 + 1 and copies1 == copies0 and m["sync/buckets"] > 3
    assert sums1 == {n: tensor_checksum(t) for n, t in full.items()}
    # 2) the same through the scratch copy (no layout known): same bytes land
    tr.layout = None
    full2 = rand(sorted(shapes))
    tr.send(sorted(full2.items()), v1 + 1)
    v2, sums2, copies2, _ = state()
    assert v2 == v1 + 1 and copies2 > copies1
    assert sums2 == {n: tensor_checksum(t) for n, t in full2.items()}
    tr.layout = layout
    # 3) partial update: the names not sent keep their values
    part = rand(layout[5:17])
    tr.send(part.items(), v2 + 1)
    v3, sums3, _, _ = state()
    assert v3 == v2 + 1
    assert sums3 == {n: tensor_checksum(part[n]) if n in part else sums2[n] for n in sums2}
    # 4) a bad bucket mid-update (buckets posted before its reply is read): nothing applied
    tr.layout = None
    names = sorted(shapes)
    bad = list(rand(names[:3]).items()) + [("model.layers.0.block_sparse_moe.experts.9.w1.weight",
                                             torch.zeros(4))] + list(rand(names[3:]).items())
    _, _, _, b0 = state()
    with pytest.raises(Exception, match="experts.9.w1"):
        tr.send(bad, v3 + 1)
    v4, sums4, _, b4 = state()
    assert v4 == v3 and sums4 == sums3  # no mix of old and new tensors
    assert b4 - b0 == sum(t.numel() * t.element_size() for _, t in bad)  # every byte received
    tr.layout = layout
    # 5) the next update goes through whole
    full5 = rand(sorted(shapes))
    tr.send(full5.items(), v3 + 1)
    v5, sums5, _, _ = state()
    assert v5 == v3 + 1 and sums5 == {n: tensor_checksum(t) for n, t in full5.items()}
