"""Zero-copy export (moe_async.weight_sync.relayout) on plain tensors: strided reads found
exactly, parameters moved into the transport's send buffer keep their values and identity,
renames are then exported as the buffer's own views, transforms copied, a new layout moves
them again. The Megatron trainer's use of it is checked in _sync_layouts.py (1 process)."""

from __future__ import annotations

import torch

from moe_async.weight_sync.config import WeightSyncConfig
from moe_async.weight_sync.relayout import WholeTensorExport, same_memory, strided_layout
from moe_async.weight_sync.packing import contiguous_span, in_layout_order, packed_buckets
from moe_async.weight_sync.transport import BroadcastTransport

NG, HPG, D, H = 2, 2, 3, 4  # query groups, heads per group, head dim, hidden


def qkv_split(t):  # Megatron's fused QKV -> q, k, v (as moe_async.models.family.qkv_split)
    g = t.reshape(NG, (HPG + 2) * D, H)
    q, k, v = g[:, : HPG * D], g[:, HPG * D: (HPG + 1) * D], g[:, (HPG + 1) * D:]
    return [q.reshape(-1, H).contiguous(), k.reshape(-1, H).contiguous(), v.reshape(-1, H).contiguous()]


RULES = {  # megatron name -> (hf names, split)
    "emb": (["embed"], lambda t: [t]),
    "fc1": (["gate", "up"], lambda t: [x.contiguous() for x in torch.chunk(t, 2, dim=0)]),
    "qkv": (["q", "k", "v"], qkv_split),
    "flip": (["flipped"], lambda t: [t.flip(0)]),  # a negative step: no strided read
    "scaled": (["scaled"], lambda t: [t * 2]),  # computes: never read as a view
}
SHAPES = {"embed": (5, H), "gate": (3, H), "up": (3, H), "q": (NG * HPG * D, H), "k": (NG * D, H),
          "v": (NG * D, H), "flipped": (2, H), "scaled": (2, H)}


def split(name, t):
    hs, fn = RULES[name]
    return list(zip(hs, fn(t)))


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (5, H), "fc1": (6, H), "qkv": (NG * (HPG + 2) * D, H), "flip": (2, H), "scaled": (2, H)}
    return {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in shapes.items()}


def transport(order):
    tr = BroadcastTransport([], WeightSyncConfig(bucket_bytes=2**20))
    tr._set_layout({"names": order, "shapes": [list(SHAPES[n]) for n in order], "dtypes": ["float32"] * len(order)})
    return tr


def reference(ps):
    return {h: x.clone() for n, p in ps.items() for h, x in split(n, p.data)}


def test_strided_layout_finds_the_exact_read():
    t = torch.arange(NG * (HPG + 2) * D * H).view(-1, H)
    for part in qkv_split(t):
        lay = strided_layout(part)
        assert lay is not None and torch.equal(t.reshape(-1).as_strided(*lay).reshape(part.shape), part)
    assert strided_layout(qkv_split(t)[0])[1] == ((HPG + 2) * D * H, 1)  # [groups, q rows x H]
    assert strided_layout(torch.tensor([3, 1, 2])) is None  # negative step
    assert strided_layout(torch.tensor([0, 1, 2, 5, 6, 9])) is None  # runs not tiled evenly
    assert strided_layout(torch.tensor([7])) == ((1,), (1,), 7)


def test_bind_moves_renames_and_export_sends_them_in_place():
    ps = params()
    ident = {n: p for n, p in ps.items()}
    ref = reference(ps)
    plan = WholeTensorExport({n: (p, None) for n, p in ps.items()}, split)
    assert {n: (e.views, e.strided is not None) for n, e in plan.entries.items()} == {
        "emb": (True, False), "fc1": (True, False), "qkv": (False, True), "flip": (False, False),
        "scaled": (False, False)}
    order = ["embed", "q", "k", "v", "gate", "up", "flipped", "scaled"]
    tr = transport(order)
    st = plan.bind(tr.destination)
    assert st == dict(relaid_tensors=2, relaid_bytes=(5 + 6) * H * 4, moved_tensors=2, copied_tensors=3,
                      copied_bytes=(NG * (HPG + 2) * D + 2 + 2) * H * 4)
    assert plan.bind(tr.destination)["moved_tensors"] == 0  # idempotent
    assert all(ps[n] is ident[n] for n in ps)  # same Parameter objects
    assert ps["emb"].data_ptr() == tr.destination("embed", (5, H), torch.float32).data_ptr()
    assert ps["fc1"].data_ptr() == tr.destination("gate", (3, H), torch.float32).data_ptr()
    got = list(plan.export(plan.order(tr.destination), tr.destination, None))
    assert [h for h, _ in got] == order  # in the buffer's order
    for h, x in got:
        assert torch.equal(x, ref[h]), h
        assert same_memory(x, tr.destination(h, SHAPES[h], torch.float32)), h
    flat = next(iter(packed_buckets(in_layout_order(iter(got), tr.layout), 2**20, overlap=False)))[1]
    assert flat.data_ptr() == contiguous_span([x for _, x in got]).data_ptr()  # one span, no packing
    # an in-place update of the parameters (an optimizer step) is what the next export sends
    with torch.no_grad():
        for p in ps.values():
            p.mul_(3)
    ref = reference(ps)
    for h, x in plan.export(plan.order(tr.destination), tr.destination, None):
        assert torch.equal(x, ref[h]), h
    # without out: fresh copies, not the parameters' memory
    got = dict(plan.export(sorted(plan.entries), None, None))
    assert got.keys() == ref.keys() and all(torch.equal(got[h], ref[h]) for h in ref)
    assert got["embed"].data_ptr() != ps["emb"].data_ptr()
    assert dict(plan.export(sorted(plan.entries), None, torch.bfloat16))["q"].dtype == torch.bfloat16


def test_new_layout_gets_a_new_buffer_and_parameters_move_again():
    ps = params(1)
    ref = reference(ps)
    plan = WholeTensorExport({n: (p, None) for n, p in ps.items()}, split)
    tr = transport(["embed", "gate", "up", "q", "k", "v", "flipped", "scaled"])
    plan.bind(tr.destination)
    old = ps["emb"].data_ptr()
    tr._set_layout({"names": ["gate", "up", "embed"], "shapes": [[3, H], [3, H], [5, H]],
                    "dtypes": ["float32"] * 3})
    new = tr.destination("embed", (5, H), torch.float32)
    assert new.data_ptr() != old  # the old buffer is never handed out under other names
    assert torch.equal(ps["emb"].data, ref["embed"])  # the parameters still hold their values
    st = plan.bind(tr.destination)
    assert st["moved_tensors"] == 2 and ps["emb"].data_ptr() == new.data_ptr()
    got = dict(plan.export(plan.order(tr.destination), tr.destination, None))
    assert all(torch.equal(got[h], ref[h]) for h in ref)
    # a layout whose gate/up are not end to end: fc1 stays where it is (copied per export)
    tr._set_layout({"names": ["gate", "embed", "up"], "shapes": [[3, H], [5, H], [3, H]],
                    "dtypes": ["float32"] * 3})
    st = plan.bind(tr.destination)
    assert st["relaid_tensors"] == 1 and st["moved_tensors"] == 1
    got = dict(plan.export(plan.order(tr.destination), tr.destination, None))
    assert all(torch.equal(got[h], ref[h]) for h in ref)
    # same layout again after a re-connect: the buffer (and the parameters in it) is kept
    ptr = ps["emb"].data_ptr()
    tr._set_layout({"names": ["gate", "embed", "up"], "shapes": [[3, H], [5, H], [3, H]],
                    "dtypes": ["float32"] * 3})
    assert tr.destination("embed", (5, H), torch.float32).data_ptr() == ptr
