"""Adapter-only sync bookkeeping: versioned names, what is unloaded after each sync."""

from __future__ import annotations

import pytest
import torch

from moe_async.weight_sync.lora_sync import AdapterVersions, adapter_bytes


def test_versions_keep_max_staleness_and_unload_the_rest():
    v = AdapterVersions(base="policy", max_staleness=1)
    assert v.newest is None and v.synced(1) == [] and v.synced(2) == []
    assert v.synced(3) == ["policy@1"] and v.newest == "policy@3"
    assert v.synced(3) == []  # a re-sync of the same version (an engine restarted)
    assert v.synced(5) == ["policy@2", "policy@3"] and v.loaded == [5]
    with pytest.raises(ValueError, match="must increase"):
        v.synced(4)


def test_adapter_bytes_in_the_wire_dtype():
    ts = {"a": torch.zeros(4, 8), "b": torch.zeros(3, dtype=torch.float64)}
    assert adapter_bytes(ts) == 4 * 8 * 4 + 3 * 8
    assert adapter_bytes(ts, torch.bfloat16) == (32 + 3) * 2
