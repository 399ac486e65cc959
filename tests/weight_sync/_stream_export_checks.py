"""C14 under torchrun/gloo (2 ranks): the streamed export (moe_async/weight_sync/stream_export.py).

    torchrun --nproc_per_node 2 _stream_export_checks.py MODEL_DIR OUT.json

``synthetic`` (C14's own numbers): a PP=2 split of 4 layers x 4 tensors of 64 KiB fp32 (layers
0-1 on rank 0, 2-3 on rank 1; tensor 3 of each layer "fused" [2 x 32 KiB] split into two HF
parts, as gate;up), an EP=2 expert block (full [4,8,16], rank r experts 2r..2r+1 as one
[2,8,16] piece) and a dim-1 (row-parallel TP) shard pair; 128 KiB buckets. Rank 0 records its
peak extra tensor bytes (:class:`moe_async.weight_sync.alive_bytes.AliveBytes`) for the streamed export, and for the
materialised one (every full tensor gathered first, then bucketed) as the control; the flat
bytes of both in the same fixed order.

``tp2pp1ep1`` / ``tp1pp2ep1`` / ``tp1pp1ep2``: a MegatronTrainer of MODEL_DIR (tiny Mixtral):
the streamed buckets against ``export_hf_weights`` (names, order, bytes), with the engines'
order reversed too, and the peak extra bytes at 16 KiB buckets. Rank 0 writes JSON.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from moe_async.weight_sync.alive_bytes import AliveBytes  # noqa: E402
from moe_async.weight_sync.stream_export import release_kept_buffers  # noqa: E402
from _checks import finish  # noqa: E402

KIB = 1024


class _Piece:
    def __init__(self, name, data, full_shape, offset):
        self.name, self.data, self.full_shape, self.offset = name, data, tuple(full_shape), tuple(offset)
        self.primary = True


def _value(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*shape, generator=g)


def synthetic_pieces(rank: int) -> tuple[list[_Piece], dict[str, torch.Tensor]]:
    """This rank's pieces and the full tensors (the reference, built outside any tracker)."""
    full: dict[str, torch.Tensor] = {}
    for layer in range(4):
        for j in range(4):
            full[f"decoder.layers.{layer}.t{j}"] = _value(f"l{layer}t{j}", (128, 128))  # 64 KiB
    full["decoder.experts.block"] = _value("experts", (4, 8, 16))
    full["decoder.rowpar.weight"] = _value("rowpar", (16, 32))
    pieces = []
    for layer in range(2 * rank, 2 * rank + 2):  # PP: this stage's layers, whole
        for j in range(4):
            n = f"decoder.layers.{layer}.t{j}"
            pieces.append(_Piece(n, full[n].clone(), (128, 128), (0, 0)))
    pieces.append(_Piece("decoder.experts.block", full["decoder.experts.block"][2 * rank: 2 * rank + 2].clone(),
                         (4, 8, 16), (2 * rank, 0, 0)))
    pieces.append(_Piece("decoder.rowpar.weight", full["decoder.rowpar.weight"][:, 16 * rank: 16 * rank + 16].clone(),
                         (16, 32), (0, 16 * rank)))
    return pieces, full


def synthetic_convert(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if name.endswith(".t3"):  # fused: two HF halves (views, as split_rows_2's contiguous chunks)
        a, b = torch.chunk(t, 2, dim=0)
        return [(name + ".gate", a.contiguous()), (name + ".up", b.contiguous())]
    return [(name.replace("decoder.", "model."), t)]


def _flat_of(buckets) -> tuple[list[str], bytes, list[int]]:
    names, raw, sizes = [], [], []
    for b, flat, _ in buckets:
        names += b.names
        raw.append(bytes(flat.numpy()))
        sizes.append(int(flat.numel()))
        b = flat = None  # dropped before the next bucket, as BroadcastTransport.send does
    return names, b"".join(raw), sizes


def run_synthetic() -> dict:
    import torch.distributed as dist

    from moe_async.weight_sync.stream_export import streamed_buckets

    rank = dist.get_rank()
    pieces, full = synthetic_pieces(rank)
    bucket = 128 * KIB
    res: dict = {"bucket_bytes": bucket, "largest_bytes": 64 * KIB,
                 "model_bytes": sum(t.numel() * 4 for t in full.values())}
    direct = lambda n: not n.endswith(".t3")  # noqa: E731
    release_kept_buffers()  # allocated inside the count (kept between syncs otherwise)
    with AliveBytes() as ab:  # rank 0: yields; rank 1: sends
        it = streamed_buckets(pieces, synthetic_convert, bucket, direct=direct)
        names, raw, sizes = [], [], []
        for b, flat, last in it:
            names += b.names
            raw.append(bytes(flat.numpy()))
            sizes.append(int(flat.numel()))
            b = flat = None
        peak = ab.peak
    res.update(streamed_peak=peak, streamed_names=names, bucket_sizes=sizes)
    # reference bytes: the full tensors (outside the tracker), converted, in the same order
    ref = [(h, t) for n in sorted(full) for h, t in synthetic_convert(n, full[n])]
    res["ref_names"] = [h for h, _ in ref]
    res["bit_identical"] = raw != [] and b"".join(raw) == b"".join(
        bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for _, t in ref)
    # the EP block is received into one tensor: its bytes sit in one bucket as one tensor
    res["expert_block_whole"] = "model.experts.block" in names
    # control (what C14 forbids): the same stream, but rank 0 keeps every bucket (the whole
    # state dict alive at the end): the tracker must see it
    release_kept_buffers()  # allocated inside the count (kept between syncs otherwise)
    with AliveBytes() as ab:
        kept = [flat.clone() for _, flat, _ in streamed_buckets(pieces, synthetic_convert, bucket, direct=direct)]
        res["materialised_peak"] = ab.peak
    del kept
    return res


def _index(self):
    return tuple(slice(o, o + s) for o, s in zip(self.offset, self.data.shape))


_Piece.index = _index


def _in_plan_order(tr, ref, order):
    """``ref`` as the stream orders it for the engines' ``order``: Megatron tensors by their
    first HF part's position in ``order``, each one's HF parts in its rule's order."""
    table = tr.family.table(tr.family.arch_args(tr.hf_config))
    pos = {n: i for i, n in enumerate(order)}
    groups = sorted((hs for _, hs in table.by_megatron.values()), key=lambda hs: min(pos[h] for h in hs))
    by = dict(ref)
    return [(h, by[h]) for hs in groups for h in hs]


def run_trainer(model_dir: str, layout: str) -> dict:
    import torch.distributed as dist

    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.weight_sync.stream_export import source_buckets

    tp, pp, ep = (int(layout.split(k)[1][0]) for k in ("tp", "pp", "ep"))
    tr = MegatronTrainer(TrainerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                       expert_model_parallel_size=ep, micro_batch_size=2,
                                       moe_aux_loss_coeff=0.0, lr=1e-3), model_dir)
    rank = dist.get_rank()
    ref = list(tr.export_hf_weights())  # the materialised way (rank 0), one tensor at a time
    bucket = 16 * KIB
    res: dict = {"bucket_bytes": bucket}
    if rank == 0:
        res["model_bytes"] = sum(t.numel() * t.element_size() for _, t in ref)
        res["largest_bytes"] = max(t.numel() * t.element_size() for _, t in ref)
        qkv = [t for n, t in ref if n.endswith("q_proj.weight")]
        res["largest_fused_bytes"] = max(2 * t.numel() * t.element_size() for t in qkv)  # q + k + v = 2 q (GQA 2:1)
    for label, order in (("export_order", None), ("reversed", [n for n, _ in reversed(ref)] if rank == 0 else None)):
        release_kept_buffers()  # allocated inside the count (kept between syncs otherwise)
        with AliveBytes() as ab:
            names, raw, sizes = _flat_of(source_buckets(tr.hf_exporter(), bucket, order=order))
            peak = ab.peak
        if rank == 0:
            want = ref if order is None else _in_plan_order(tr, ref, order)
            res[label] = {
                "peak": peak, "names_equal": names == [n for n, _ in want],
                "bit_identical": raw == b"".join(bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                                                 for _, t in want),
                "buckets": len(sizes), "max_bucket": max(sizes),
            }
    # overlap: a thread one bucket ahead, two buffers: same bytes
    names, raw, _ = _flat_of(source_buckets(tr.hf_exporter(), bucket, overlap=rank == 0))
    if rank == 0:
        res["overlap_bit_identical"] = raw == b"".join(bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                                                       for _, t in ref)
    tr.close()
    dist.barrier()
    return res


def main() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    model_dir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    res = {"synthetic": run_synthetic()}
    for layout in ("tp2pp1ep1", "tp1pp2ep1", "tp1pp1ep2"):
        res[layout] = run_trainer(model_dir, layout)
    finish(out, res)


if __name__ == "__main__":
    main()
