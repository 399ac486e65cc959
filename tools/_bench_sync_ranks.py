"""The 2-rank trainer side of ``tools/bench_weight_sync.py --trainer-layouts`` (run by it under
torchrun/gloo; not a command of its own).

    torchrun --nproc_per_node N tools/_bench_sync_ranks.py MODEL_DIR URLS OUT.json LAYOUT BUCKET_MIB REPEATS [SENDERS]

Every rank builds a ``MegatronTrainer`` of MODEL_DIR at LAYOUT (``tp2``, ``ep2``, ``ep4``: N = 2 or
4); global rank 0 connects one ``BroadcastTransport`` to every engine of URLS (comma-separated).
SENDERS ``all`` (default; ``weight_sync.senders: all``): every other rank connects a
``SenderLink`` (its own update group, formed in rank order) and every rank sends the shards it
holds (``senders.sync_from_senders``); ``one``: rank 0 sends, the other ranks take part in the
streamed export (``stream_export.source_buckets`` of ``trainer.hf_exporter()``), as the trainer
actors do. Per repeat: one raw broadcast of the model's bytes from rank 0 into every engine over
the same weight-update group (``/debug_receive_broadcast``; the slowest receiver's time), the
sync, another raw broadcast; ratio = sync GB/s / mean raw GB/s. Then one more sync with each
rank's extra tensor bytes counted (``AliveBytes``, overlap off: one bucket buffer) beside the
streamed-export bound (bucket + largest tensor, + a fused QKV's split copies), and the check mode.
Rank 0 writes JSON.
"""

from __future__ import annotations

import json
import sys
import threading
import time

MiB = 1024**2


#: the sync's phases on rank 0 (seconds; the export's run in its thread, overlapping the broadcasts)
PHASES = {"first_bucket": "first_bucket_seconds", "prepare_finite": "export_finite_seconds",
          "prepare_pieces": "export_pieces_seconds", "plan": "export_plan_seconds",
          "gather": "export_gather_seconds", "copy_own": "export_copy_seconds",
          "convert": "export_convert_seconds", "export_buffer_wait": "export_buffer_wait_seconds",
          "export_busy": "pack_seconds", "wait_for_export": "pack_wait_seconds",
          "handshake_wait": "handshake_wait_seconds", "broadcast": "broadcast_seconds",
          "ack_wait": "ack_wait_seconds", "resume_wait": "resume_wait_seconds", "total": "seconds"}


def phases(m: dict) -> dict:
    return {k: float(m.get(f"sync/{v}", 0.0)) for k, v in PHASES.items()}


def main() -> None:
    import httpx
    import torch
    import torch.distributed as dist

    from moe_async.engines.client import SyncEngineClient
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.weight_sync.alive_bytes import AliveBytes
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.group import group_broadcast
    from moe_async.weight_sync.stream_export import release_kept_buffers, source_buckets, source_export
    from moe_async.weight_sync.transport import BroadcastTransport, check_engines

    from torch.distributed.distributed_c10d import _get_default_store

    from moe_async.weight_sync import senders

    model_dir, urls, out, layout, bucket_mib, repeats = sys.argv[1:7]
    several = (sys.argv[7] if len(sys.argv) > 7 else "all") == "all"
    urls, bucket, repeats = urls.split(","), int(float(bucket_mib) * MiB), int(repeats)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp, ep = {"tp2": (2, 1), "ep2": (1, 2), "ep4": (1, 4)}[layout]
    t0 = time.perf_counter()
    tr = MegatronTrainer(TrainerConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                       moe_aux_loss_coeff=0.0, num_threads=1), model_dir)
    build_s = time.perf_counter() - t0
    sizes = {n: t.numel() * t.element_size() for n, t in tr.export_hf_weights()}  # rank 0 only
    box = [sizes]
    dist.broadcast_object_list(box, src=0)
    sizes = box[0]
    total, largest = sum(sizes.values()), max(sizes.values())
    fused = max((3 * v for n, v in sizes.items() if n.endswith("q_proj.weight")), default=0)  # q+k+v (MHA)
    cfg = WeightSyncConfig(bucket_bytes=bucket, backend="gloo", timeout_s=600)
    transport = clients = link = None
    version = 0
    if rank == 0:
        clients = [SyncEngineClient(u, timeout_s=600) for u in urls]
        transport = BroadcastTransport(clients, cfg, pause_mode="in_place")
    elif several:
        link = senders.SenderLink([SyncEngineClient(u, timeout_s=600) for u in urls], cfg, rank=rank)
    if several:
        senders.connect_senders(rank, dist.get_world_size(), _get_default_store(), transport=transport, link=link)
    elif rank == 0:
        transport.connect()
    if rank == 0:
        version = max(c.get_weight_version() for c in clients)
        raw_buf = torch.full((total,), 7, dtype=torch.uint8)

    def raw_once() -> float:
        """Rank 0: one broadcast of ``total`` bytes into every engine; the slowest receiver's s."""
        if rank != 0:
            return 0.0
        got: list = []
        ths = [threading.Thread(target=lambda u=u: got.append(httpx.post(
            f"{u}/debug_receive_broadcast", json={"group_name": transport.group_name, "nbytes": total},
            timeout=600).json())) for u in urls]
        for th in ths:
            th.start()
        group_broadcast(transport.group, raw_buf, src=0)
        for th in ths:
            th.join()
        assert all(r["success"] for r in got), got
        return max(float(r["seconds"]) for r in got)

    def sync(overlap: bool = True) -> dict:
        nonlocal version
        version += 1
        if several:  # every rank sends its own buckets (serial export per sender)
            m = senders.sync_from_senders(rank, tr.hf_exporter(), version, transport=transport, link=link)
            return m if rank == 0 else {}
        if rank != 0:
            for _ in source_buckets(tr.hf_exporter(), bucket):
                pass
            return {}
        transport.cfg = cfg.model_copy(update={"overlap": overlap})
        return transport.send(source_export(tr.hf_exporter()), version)

    raw_once()  # warm-up
    sync()  # cold: the engines' first update allocates their standby copies
    rows = []
    for _ in range(repeats):
        before = raw_once()
        m = sync()
        after = raw_once()
        if rank == 0:
            raw = (total / before + total / after) / 2 / 1e9
            rows.append({"ratio": m["sync/gbps"] / raw, "sync_gbps": m["sync/gbps"], "raw_gbps": raw,
                         "seconds": m["sync/seconds"], "buckets": m["sync/buckets"], "stall_s": m["sync/pause_seconds"],
                         "broadcast_s": m["sync/broadcast_seconds"], "export_s": m["sync/pack_seconds"],
                         "export_wait_s": m["sync/pack_wait_seconds"], "raw_s": (before + after) / 2,
                         "phases": phases(m)})
    release_kept_buffers()  # the bucket buffer kept between syncs is allocated inside the count
    with AliveBytes() as ab:
        sync(overlap=False)
        peak = ab.peak
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    sums = tr.hf_checksums()  # collective
    res = {}
    if rank == 0:
        chk = check_engines(clients, sums, version)
        rows.sort(key=lambda r: r["ratio"])
        plan = next(iter(senders._PLANS.values()), None) if several else None
        res = {"layout": layout, "engines": len(urls), "bucket_bytes": bucket, "total_bytes": total,
               "senders": "all" if several else "one",
               "sent_bytes": {str(k): v for k, v in plan.sent_bytes.items()} if plan is not None else {"0": total},
               "phases_median": {k: sorted(r["phases"][k] for r in rows)[len(rows) // 2] for k in rows[0]["phases"]},
               "largest_bytes": largest, "fused_bytes": fused, "build_s": build_s, "peaks": peaks,
               "bound": bucket + largest + fused, "median": rows[len(rows) // 2], "best": rows[-1], "rows": rows,
               "check_tensors": chk["sync/check_tensors"]}
        with open(out, "w") as f:
            json.dump(res, f)
    for r in reversed(range(dist.get_world_size())):  # every sender leaves its group, last formed first
        if r == rank and transport is not None:
            transport.shutdown()
            for c in clients:
                c.close()
        elif r == rank and link is not None:
            link.close()
        dist.barrier()
    tr.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
