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


class _ViewKeepingEngine:
    """An engine that, like SGLang 0.5.23's ``LoRAAdapter``, keeps views of the sender's shared
    memory (no copy) for as long as it holds an adapter; an unload drops them."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, torch.Tensor]] = {}

    def load_lora_adapter_from_tensors(self, lora_name, config_dict, serialized_named_tensors, load_format=None):
        from moe_async.engines.embedded.tensor_update import decode_named_tensors

        self.held[lora_name] = dict(decode_named_tensors(serialized_named_tensors[0], load_format))

    def unload_lora_adapter(self, lora_name):
        del self.held[lora_name]


def _adapter(v: int) -> dict[str, torch.Tensor]:
    return {"a.lora_A.weight": torch.full((4, 8), float(v)), "a.lora_B.weight": torch.full((8, 4), -float(v)),
            "b.lora_A.weight": torch.arange(12.0).reshape(3, 4) * v}


def test_buffers_reused_only_after_their_version_is_unloaded():
    """Ten syncs (max_staleness 1): every version an engine still holds reads what was sent for
    it (no buffer rewritten while held), and max_staleness + 2 shared-memory buffers serve them
    all; the export writes into the next buffer's slots (no copy at pack)."""
    from moe_async.weight_sync.adapter_buffers import AdapterBuffers
    from moe_async.weight_sync.lora_sync import sync_adapter

    engines = [_ViewKeepingEngine(), _ViewKeepingEngine()]
    versions, buffers = AdapterVersions(base="policy", max_staleness=1), AdapterBuffers()
    in_slot = 0
    for v in range(1, 11):
        tensors = {}
        for n, t in _adapter(v).items():  # as peft_state(out=buffers.destination) does
            dst = buffers.destination(n, tuple(t.shape), t.dtype)
            tensors[n] = dst.copy_(t) if dst is not None else t.clone()
            in_slot += dst is not None
        out = sync_adapter(engines, versions, v, tensors, {"r": 4}, buffers=buffers)
        assert out["bytes"] == (32 + 32 + 12) * 4
        for e in engines:
            assert set(e.held) == {f"policy@{u}" for u in range(max(1, v - 1), v + 1)}
            for name, got in e.held.items():
                want = _adapter(int(name.split("@")[1]))
                assert all(torch.equal(got[k], want[k]) for k in want), (v, name)
    assert buffers.allocated == 3
    assert in_slot == 3 * (10 - 3)  # every sync after the first three wrote straight into a reused buffer
    assert buffers.held == {"policy@9": 1, "policy@10": 1}


def test_buffer_of_a_failed_load_is_not_reused():
    from moe_async.weight_sync.adapter_buffers import AdapterBuffers
    from moe_async.weight_sync.lora_sync import sync_adapter

    class Refusing(_ViewKeepingEngine):
        def load_lora_adapter_from_tensors(self, lora_name, *args, **kw):
            super().load_lora_adapter_from_tensors(lora_name, *args, **kw)  # holds views, then fails
            raise OSError("connection reset")

    versions, buffers = AdapterVersions(max_staleness=0), AdapterBuffers()
    eng = Refusing()
    with pytest.raises(RuntimeError, match="engine 0: /load_lora_adapter_from_tensors 'policy@1'"):
        sync_adapter([eng], versions, 1, _adapter(1), {}, buffers=buffers)
    ok = _ViewKeepingEngine()
    for v in (2, 3, 4):
        sync_adapter([ok], versions, v, _adapter(v), {}, buffers=buffers)
    assert torch.equal(eng.held["policy@1"]["a.lora_A.weight"], _adapter(1)["a.lora_A.weight"])
    assert buffers.allocated == 3  # policy@1's buffer dropped; 2 and 3 alternate
