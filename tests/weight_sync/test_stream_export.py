"""C14: the streamed export for weight sync (moe_async/weight_sync/stream_export.py).

One 2-process torchrun (_stream_export_checks.py): C14's own case (PP=2, 4 layers x 4 tensors
of 64 KiB, 128 KiB buckets, an EP=2 expert block, a dim-1 TP shard pair) and a real
MegatronTrainer at TP2 / PP2 / EP2; rank 0's peak extra tensor bytes are counted by a dispatch
hook (moe_async/weight_sync/alive_bytes.py), not RSS. Plus one-process checks of the plan.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _launch import torchrun

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_stream_export_checks.py")
LAYOUTS = ["tp2pp1ep1", "tp1pp2ep1", "tp1pp1ep2"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "models"))
    from _tiny import make_tiny_mixtral

    tmp = tmp_path_factory.mktemp("stream_export")
    model_dir = make_tiny_mixtral(str(tmp / "mixtral"), tie=False)
    out = str(tmp / "out.json")
    torchrun(2, SCRIPT, model_dir, out, timeout=400)
    with open(out) as f:
        r = json.load(f)
    print("stream export peaks (bytes):", {k: v["streamed_peak"] if k == "synthetic" else
                                           [v["export_order"]["peak"], v["reversed"]["peak"]] for k, v in r.items()})
    return r


def test_c14_streamed_export_is_bit_identical_in_a_fixed_order(res):
    s = res["synthetic"]
    assert s["streamed_names"] == s["ref_names"]  # sorted Megatron names, split order
    assert s["bit_identical"] is True
    assert s["expert_block_whole"] is True  # the EP block gathered into one tensor, sent as one
    assert max(s["bucket_sizes"]) <= s["bucket_bytes"]
    assert sum(s["bucket_sizes"]) == s["model_bytes"]


def test_c14_extra_memory_is_one_bucket_plus_the_largest_tensor(res):
    """Rank 0 (the sender) holds beyond its shard at most one bucket + the largest tensor
    (here exactly that: the bucket buffer and a fused tensor's gather scratch); the control,
    the same export keeping every bucket (the state dict materialised), is caught."""
    s = res["synthetic"]
    bound = s["bucket_bytes"] + s["largest_bytes"]
    assert s["streamed_peak"] <= bound, (s["streamed_peak"], bound)
    assert s["materialised_peak"] >= s["model_bytes"] > bound


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_stream_equals_export_hf_weights(res, layout):
    r = res[layout]
    for label in ("export_order", "reversed"):  # the engines' order is followed when given
        assert r[label]["names_equal"] is True, label
        assert r[label]["bit_identical"] is True, label
        assert r[label]["max_bucket"] <= max(r["bucket_bytes"], r["largest_bytes"])
    assert r["overlap_bit_identical"] is True


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_stream_memory_bound(res, layout):
    """A real trainer at 16 KiB buckets: one bucket + the largest of the 64 KiB embedding (over
    the bucket: its own buffer) and a fused QKV's scratch + q/k/v copies (2 x 32 KiB); here that
    is one bucket + the largest tensor, far below the model."""
    r = res[layout]
    bound = r["bucket_bytes"] + max(r["largest_bytes"], 2 * r["largest_fused_bytes"])
    assert bound == r["bucket_bytes"] + r["largest_bytes"]
    for label in ("export_order", "reversed"):
        assert r[label]["peak"] <= bound, (label, r[label]["peak"], bound)
    assert bound < r["model_bytes"] / 10


# ---------------------------------------------------------------------------- one process
def _meta(name, full, off, shape):
    return (name, tuple(full), tuple(off), tuple(shape), "torch.float32")


def _ident(name, t):
    return [(name, t)]


def test_plan_refuses_bad_tiling_before_any_byte_moves():
    from moe_async.weight_sync.stream_export import make_plan

    with pytest.raises(ValueError, match="w: primary shards overlap"):
        make_plan([[_meta("w", (4, 4), (0, 0), (3, 4))], [_meta("w", (4, 4), (2, 0), (2, 4))]], _ident, 64)
    with pytest.raises(ValueError, match="w: primary shards cover 8 of 16"):
        make_plan([[_meta("w", (4, 4), (0, 0), (2, 4))]], _ident, 64)
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        make_plan([[_meta("w", (4, 4), (0, 0), (4, 4))]], _ident, 0)
    with pytest.raises(KeyError, match=r"missing \['v'\]"):
        make_plan([[_meta("w", (4, 4), (0, 0), (4, 4))]], _ident, 64, expected={"v", "w"})


def test_plan_buckets_follow_the_given_order_and_size():
    from moe_async.weight_sync.stream_export import make_plan

    meta = [[_meta(n, (4, 4), (0, 0), (4, 4)) for n in ("a", "b", "c")]]  # 64 B each
    plan = make_plan(meta, _ident, 128, order=["c", "a", "b"])
    assert [[p.hf_name for p in b] for b in plan.buckets] == [["c", "a"], ["b"]]
    assert plan.bucket_nbytes == [128, 64]
    big = make_plan(meta, _ident, 32)  # each over the budget: alone (C2)
    assert [[p.hf_name for p in b] for b in big.buckets] == [["a"], ["b"], ["c"]]


def test_one_process_stream_of_shards():
    """World of 1 (no process group): two pieces of one tensor and a cast to bf16."""
    from moe_async.weight_sync.stream_export import streamed_buckets

    class P:
        def __init__(self, name, data, full, off):
            self.name, self.data, self.full_shape, self.offset = name, data, full, off

    w = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    pieces = [P("w", w[:, :4].clone(), (4, 8), (0, 0)), P("w", w[:, 4:].clone(), (4, 8), (0, 4))]
    out = list(streamed_buckets(pieces, _ident, 1024, dtype=torch.bfloat16))
    assert len(out) == 1 and out[0][2] is True
    b, flat, _ = out[0]
    assert b.names == ["w"] and b.dtypes == ["bfloat16"] and torch.equal(b.tensors[0], w.to(torch.bfloat16))
    assert flat.numel() == 64


def test_padded_vocab_rows_are_dropped_and_a_renamed_tensor_is_received_in_place():
    """Vocab padding (rows >= the HF vocab) never reaches the bucket; a rename goes straight
    into the bucket's bytes (no scratch: peak = the bucket buffer alone)."""
    from moe_async.weight_sync.alive_bytes import AliveBytes
    from moe_async.weight_sync.stream_export import release_kept_buffers, streamed_buckets

    class P:
        def __init__(self, name, data, full, off):
            self.name, self.data, self.full_shape, self.offset = name, data, full, off

    emb = torch.randn(6, 4)  # 2 padded rows over a vocab of 4, two vocab-parallel shards
    pieces = [P("emb", emb[:3].clone(), (6, 4), (0, 0)), P("emb", emb[3:].clone(), (6, 4), (3, 0))]
    release_kept_buffers()  # counted when allocated in the block (kept between syncs after)
    with AliveBytes() as ab:
        (b, flat, last), = streamed_buckets(pieces, _ident, 1024, vocab={"emb": 4}, direct=lambda n: True)
        peak = ab.peak
    assert last and b.shapes == [[4, 4]] and torch.equal(b.tensors[0], emb[:4])
    assert peak == 4 * 4 * 4  # the bucket's 64 bytes, nothing else


def test_mixed_dtypes_keep_their_metadata_at_any_offset():
    """A bf16 tensor of odd length puts the next fp32 tensor at an offset fp32 cannot view:
    the bucket still names every tensor's own dtype and shape, and the bytes are end to end."""
    from moe_async.weight_sync.bucket import unflatten
    from moe_async.weight_sync.stream_export import streamed_buckets

    class P:
        def __init__(self, name, data):
            self.name, self.data, self.full_shape, self.offset = name, data, tuple(data.shape), (0,) * data.dim()

    a = torch.randn(3).to(torch.bfloat16)  # 6 bytes
    w = torch.randn(2, 2)
    (b, flat, _), = streamed_buckets([P("a", a), P("w", w)], _ident, 1024, direct=lambda n: True)
    assert b.names == ["a", "w"] and b.dtypes == ["bfloat16", "float32"] and b.shapes == [[3], [2, 2]]
    got = dict(unflatten(flat, b.names, b.dtypes, b.shapes))
    assert torch.equal(got["a"], a) and torch.equal(got["w"], w)


def test_gate_up_tensor_is_gathered_in_place_and_kept_in_one_bucket():
    """A split that gives row blocks (gate;up, ``split_rows_2``) under ``direct``: both parts go
    into one bucket end to end (greedy per part would put up into the next bucket) and the
    shards are received straight into those bytes: no scratch (peak = the bucket buffer)."""
    from moe_async.models.mapping import split_rows_2
    from moe_async.weight_sync.alive_bytes import AliveBytes
    from moe_async.weight_sync.stream_export import make_plan, release_kept_buffers, streamed_buckets

    class P:
        def __init__(self, name, data, full, off):
            self.name, self.data, self.full_shape, self.offset = name, data, full, off

    def convert(name, t):
        if name == "fc1":
            g, u = split_rows_2(t, None)
            return [("gate", g), ("up", u)]
        return [(name, t)]

    a = torch.randn(4, 8)  # 128 B
    fc1 = torch.randn(6, 8)  # [gate; up], 3 rows each: 2 x 96 B; TP2 shards of 3 rows
    pieces = [P("a", a.clone(), (4, 8), (0, 0)), P("fc1", fc1[:3].clone(), (6, 8), (0, 0)),
              P("fc1", fc1[3:].clone(), (6, 8), (3, 0))]
    meta = [[(p.name, p.full_shape, p.offset, tuple(p.data.shape), str(p.data.dtype)) for p in pieces]]
    assert [[q.hf_name for q in b] for b in make_plan(meta, convert, 256).buckets] == [["a", "gate"], ["up"]]
    plan = make_plan(meta, convert, 256, direct=lambda n: True)
    assert [[q.hf_name for q in b] for b in plan.buckets] == [["a"], ["gate", "up"]]
    assert plan.tensors[1].direct
    release_kept_buffers()
    with AliveBytes() as ab:
        out = [(b.names, [t.clone() for t in b.tensors], last)
               for b, _, last in streamed_buckets(pieces, convert, 256, direct=lambda n: True)]
        peak = ab.peak
    assert [(n, last) for n, _, last in out] == [(["a"], False), (["gate", "up"], True)]
    assert torch.equal(out[0][1][0], a)
    assert torch.equal(out[1][1][0], fc1[:3]) and torch.equal(out[1][1][1], fc1[3:])
    clones = 128 + 192  # the test's own clones of the two buckets' tensors
    assert peak == 192 + clones  # one buffer of the largest bucket, nothing else


def test_overlapped_plan_ramps_its_first_buckets_up():
    """With ``first_bucket_bytes`` the budgets double from it up to ``bucket_bytes``."""
    from moe_async.weight_sync.stream_export import make_plan

    meta = [[_meta(f"t{i:02d}", (4, 4), (0, 0), (4, 4)) for i in range(16)]]  # 64 B each
    plan = make_plan(meta, _ident, 256, first_bucket_bytes=64)
    assert plan.bucket_nbytes == [64, 128, 256, 256, 256, 64]
    assert sum(plan.bucket_nbytes) == 16 * 64


def test_cpu_bucket_buffers_are_kept_between_syncs():
    """The second export reuses the first one's bucket buffer (no fresh pages to fault in)."""
    from moe_async.weight_sync.stream_export import kept_bucket_bytes, release_kept_buffers, streamed_buckets

    class P:
        def __init__(self, name, data):
            self.name, self.data, self.full_shape, self.offset = name, data, tuple(data.shape), (0,) * data.dim()

    release_kept_buffers()
    w = torch.randn(8, 8)
    ptrs = [flat.data_ptr() for _ in range(2) for _, flat, _ in streamed_buckets([P("w", w)], _ident, 1024,
                                                                             direct=lambda n: True)]
    assert ptrs[0] == ptrs[1] and kept_bucket_bytes() == 256
    release_kept_buffers()
    assert kept_bucket_bytes() == 0
