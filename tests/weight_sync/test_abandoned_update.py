"""An update the sender abandons before its last (versioned) bucket (the exporter raised after
some buckets went out, one of them refused) must leave nothing behind on the engine: the
engine keeps serving the old weights, the next partial update does not apply the abandoned
update's staged tensors, the next full update succeeds, and a refusal names the first failure
once (not nested once per refused bucket)."""

from __future__ import annotations

import pytest
import torch

from moe_async.models.checksum import tensor_checksum

pytestmark = pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")


def test_abandoned_update_leaves_nothing_staged(broadcast, tiny_shapes, dies_at):
    shapes = tiny_shapes
    client, tr = broadcast()
    layout = tr.layout
    g = torch.Generator().manual_seed(5)

    def rand(names):
        return {n: torch.randn(shapes[n], generator=g) * 0.05 for n in names}

    def state():
        s = client.weights_checksum()
        return s["weight_version"], s["checksums"]

    v0, sums0 = state()
    # 1) good buckets staged, then the exporter dies: nothing applied, nothing kept staged
    with pytest.raises(RuntimeError, match="exporter died"):
        tr.send(dies_at(list(rand(layout).items()), 20), v0 + 1)
    if tr.group is None:  # the transport may drop the group of an abandoned update
        tr.connect()
    assert state() == (v0, sums0)
    part = rand(layout[30:35])
    tr.send(part.items(), v0 + 1)
    v1, sums1 = state()
    assert v1 == v0 + 1
    assert sums1 == {n: tensor_checksum(part[n]) if n in part else sums0[n] for n in sums0}
    # 2) a refused bucket, later buckets refused too, then the exporter dies before the last
    tr.layout = None
    names = sorted(shapes)
    bad = list(rand(names[:3]).items()) + [("model.layers.0.block_sparse_moe.experts.9.w1.weight",
                                             torch.zeros(4))] + list(rand(names[3:]).items())
    with pytest.raises(RuntimeError, match="exporter died"):
        tr.send(dies_at(bad, len(bad) - 2), v1 + 1)
    tr.layout = layout
    if tr.group is None:
        tr.connect()
    assert state() == (v1, sums1)
    # 3) the next full update goes through whole
    full = rand(layout)
    tr.send(full.items(), v1 + 1)
    v2, sums2 = state()
    assert v2 == v1 + 1 and sums2 == {n: tensor_checksum(t) for n, t in full.items()}
    # 4) a refused update: every later bucket's refusal names the first failure, once
    replies = []
    orig = client.update_weights_from_distributed

    def recording(**kw):
        try:
            return orig(**kw)
        except Exception as e:
            replies.append(str(e))
            raise

    client.update_weights_from_distributed = recording
    tr.layout = None
    with pytest.raises(Exception, match="experts.9.w1"):
        tr.send(bad, v2 + 1)
    tr.layout = layout
    client.update_weights_from_distributed = orig
    assert len(replies) > 2
    for r in replies:
        assert "experts.9.w1" in r and r.count("an earlier bucket of this update failed") <= 1, r[:300]
    assert state() == (v2, sums2)
