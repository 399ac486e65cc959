"""C1 and C2 end to end: a torchrun/gloo MegatronTrainer at layouts 1-process, TP2, EP2 and
PP2 syncs into one running embedded engine over the bucketed broadcast (and once over the
disk fallback); the check mode proves the engine's weights bit-identical to the trainer's.

Two launches in all (see _sync_layouts.py): torchrun with 1 process (then the zero-copy
export check, ``relayout``), and torchrun with 2 processes looping over TP2, EP2, PP2; the
engine is reused, the weight-update group is re-created per layout
(/destroy_weights_update_group between them).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _launch import torchrun

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_sync_layouts.py")
W1 = ["tp1pp1ep1"]
W2 = ["tp2pp1ep1", "tp1pp1ep2", "tp1pp2ep1"]
LABELS = ["c1_one_tensor", "c1_below_largest", "c1_whole_model", "c2_1KiB"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo layout checks")


def _torchrun(n: int, url: str, model_dir: str, out: str, layouts: list[str]) -> None:
    torchrun(n, SCRIPT, url, model_dir, out, *layouts, timeout=600)


@pytest.fixture(scope="module")
def res(tiny_engine, tmp_path_factory):
    eng, model_dir = tiny_engine
    tmp = tmp_path_factory.mktemp("sync_layouts")
    out = {}
    for n, lays in ((1, W1 + ["relayout"]), (2, W2)):
        path = str(tmp / f"w{n}.json")
        _torchrun(n, eng.url, model_dir, path, lays)
        with open(path) as f:
            out.update(json.load(f))
    return out


@pytest.mark.parametrize("layout", W1 + W2)
@pytest.mark.parametrize("label", LABELS)
def test_sync_bit_exact(res, layout, label):
    r = res[layout]
    rec = next(s for s in r["syncs"] if s["label"] == label)
    first, repeat = rec["first"], rec["repeat"]
    assert "check_error" not in first, first["check_error"]
    assert first["checksums_equal"] and first["sync/check_tensors"] == r["n_tensors"] == 41
    assert first["sync/check_seconds"] > 0
    # bytes received == bytes sent == the model's bytes
    assert first["sync/bytes"] == first["bytes_received"] == r["total_bytes"]
    # weight_version advances with the update, and the trained weights changed
    assert first["version_after"] == rec["version"] > first["version_before"]
    assert first["changed_tensors"] > 0
    # a second sync of the same weights changes nothing
    assert "check_error" not in repeat, repeat["check_error"]
    assert repeat["checksums_equal"] and repeat["changed_tensors"] == 0
    assert repeat["version_before"] == repeat["version_after"] == rec["version"]
    assert repeat["sync/bytes"] == repeat["bytes_received"] == r["total_bytes"]
    # sent in the engine's layout order: every bucket received in place (no scratch copy)
    assert first["layout_known"] and first["recv_copies"] == repeat["recv_copies"] == 0
    for m in (first, repeat):
        for k in ("sync/seconds", "sync/gbps", "sync/pause_seconds", "sync/broadcast_seconds"):
            assert m[k] > 0, k
        assert m["sync/pause_seconds"] <= m["sync/seconds"]


@pytest.mark.parametrize("layout", W1 + W2)
def test_bucket_shapes(res, layout):
    """C1: one tensor per bucket at 1 byte (gate and up of one expert in different buckets),
    the largest tensor alone in a grown bucket below its size, one bucket for the whole
    model; C2: the 64 KiB embedding (and every tensor over 1 KiB) alone, no assertion."""
    r = res[layout]
    s = {x["label"]: x["first"] for x in r["syncs"]}
    assert s["c1_one_tensor"]["sync/buckets"] == r["n_tensors"]
    assert s["c1_one_tensor"]["max_bucket_tensors"] == 1 and s["c1_one_tensor"]["gate_up_split"]
    assert 1 < s["c1_below_largest"]["sync/buckets"] < r["n_tensors"]
    assert s["c1_below_largest"]["sync/oversize_buckets"] >= 1
    assert s["c1_whole_model"]["sync/buckets"] == 1 and s["c1_whole_model"]["sync/oversize_buckets"] == 0
    assert r["largest_bytes"] == 256 * 64 * 4  # embedding / lm_head: 64 KiB > 8 KiB
    assert s["c2_1KiB"]["sync/oversize_buckets"] >= 2
    assert r["small_bucket_config_warned"]


@pytest.mark.parametrize("layout", W1 + W2)
def test_disk_fallback_bit_exact(res, layout):
    d = res[layout]["disk"]
    assert "check_error" not in d, d["check_error"]
    assert d["checksums_equal"] and d["sync/bytes"] == res[layout]["total_bytes"]
    assert d["sync/buckets"] > 1 and d["sync/check_seconds"] > 0


def test_relaid_trainer_trains_and_syncs_identically(res):
    """1 process: a trainer whose parameters were moved into the transport's send buffer
    (every tensor but the 2 fused QKVs of the tiny Mixtral) trains bit-identically to one as
    built (loss, grad norm of 2 steps), keeps its Parameter objects and exports the same
    bytes, all 41 HF tensors as views of the send buffer, 35 of them the parameters' own
    memory (q, k, v of 2 layers copied); its sync lands bit-identical to the other trainer's
    weights (check mode), in place on the engine."""
    r = res["relayout"]
    st = r["relayout"]
    assert st["moved_tensors"] == st["relaid_tensors"] == 27 and st["copied_tensors"] == 2
    assert r["relayout_again"]["moved_tensors"] == 0 and r["relayout_again"]["relaid_tensors"] == 27
    assert r["plain_relayout_without_out"] is None
    for s in r["steps"]:
        for k, (a, b) in s.items():
            assert a == b, (k, a, b)
    assert r["steps"][0]["loss"] != r["steps"][1]["loss"]  # the weights did move between steps
    assert r["embedding_in_send_buffer"] and r["same_parameter_objects"]
    assert r["export_equal"] and r["export_views"] == 41 and r["export_param_memory"] == 41 - 6
    m = r["sync"]
    assert "check_error" not in m, m["check_error"]
    assert m["sync/check_tensors"] == 41 and m["recv_copies"] == 0
    assert m["sync/bytes"] == m["bytes_received"] == m["total_bytes"]
