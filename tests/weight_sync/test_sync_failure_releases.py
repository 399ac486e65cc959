"""A weight sync that fails midway (issue 19, item 4) leaves the engine on its previous
weight_version and weights, and releases what the sync held: the engine is not left paused
(generation answers), its weight-update session is closed (a new one opens without "already
open"), the sender's poster threads are free (the next sync goes through), for both pause
scopes and for a failure before any bucket (exporter) and after some (a refused bucket)."""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:weight_sync.bucket_bytes")


@pytest.mark.parametrize("pause_scope", ["sync", "last_bucket"])
@pytest.mark.parametrize("fail_at", [0, 20])
def test_failed_sync_keeps_version_and_releases_pause_session_and_posters(broadcast, tiny_shapes, dies_at, pause_scope,
                                                                           fail_at):
    client, tr = broadcast(pause_mode="abort", pause_scope=pause_scope)
    layout = tr.layout
    g = torch.Generator().manual_seed(11)
    full = {n: torch.randn(tiny_shapes[n], generator=g) * 0.05 for n in layout}
    before = client.weights_checksum()
    with pytest.raises(RuntimeError, match="exporter died"):
        tr.send(dies_at(list(full.items()), fail_at), before["weight_version"] + 1)
    after = client.weights_checksum()
    assert (after["weight_version"], after["checksums"]) == (before["weight_version"], before["checksums"])
    info = httpx.get(f"{client.base_url}/server_info", timeout=10).json()
    assert info["paused"] is False  # not left paused (a sync-scope pause went out before the failure)
    out = client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0})
    assert out.finish_reason in ("stop", "length") and len(out.output_ids) >= 1  # serves, not aborted
    r = client.begin_weight_update(atomic=True)  # the failed sync's session was closed
    assert r.get("success") is not False, r
    client.end_weight_update()
    if tr.group is None:
        tr.connect()
    tr.send(full.items(), before["weight_version"] + 1)  # posters and group free: the next sync goes through
    assert client.weights_checksum()["weight_version"] == before["weight_version"] + 1
