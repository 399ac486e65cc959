"""``BroadcastTransport.reform`` (C20 on the sender's side, used by the driver's engine
recovery): the group is left on every member and formed again with the given engines (a
replacement at the same URL), the next sync is bit-exact, and the send buffer survives."""

from __future__ import annotations

import pytest
import torch

from moe_async.models.checksum import tensor_checksum

pytestmark = pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")


def test_reform_rejoins_and_next_sync_is_bit_exact(broadcast, tiny_shapes):
    from moe_async.engines.client import SyncEngineClient

    client, tr = broadcast()
    g = torch.Generator().manual_seed(3)
    v0 = client.weights_checksum()["weight_version"]
    w1 = {n: torch.randn(tiny_shapes[n], generator=g) * 0.05 for n in tr.layout}
    dest = tr.destination(tr.layout[0], tuple(tiny_shapes[tr.layout[0]]), w1[tr.layout[0]].dtype)
    tr.send(w1.items(), v0 + 1)
    old_group = tr.group
    fresh = SyncEngineClient(client.base_url, timeout_s=120)  # the driver makes new clients for the new members
    tr.reform([fresh])
    assert tr.group is not None and tr.group is not old_group and tr.clients == [fresh]
    assert tr.destination(tr.layout[0], tuple(tiny_shapes[tr.layout[0]]), w1[tr.layout[0]].dtype) is dest
    w2 = {n: torch.randn(tiny_shapes[n], generator=g) * 0.05 for n in tr.layout}
    tr.send(w2.items(), v0 + 2)
    s = fresh.weights_checksum()
    assert s["weight_version"] == v0 + 2
    assert s["checksums"] == {n: tensor_checksum(t) for n, t in w2.items()}
    with pytest.raises(ValueError, match="ranks_per_engine has 2 entries for 1 engines"):
        tr.reform([fresh], ranks_per_engine=[1, 1])
    fresh.close()
