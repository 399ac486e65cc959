"""Several senders under torchrun/gloo into TWO running embedded engines.

    torchrun --nproc_per_node W _senders_checks.py URL0,URL1 MODEL_DIR OUT.json LAYOUT [LAYOUT ...]

LAYOUT is ``tp{t}pp{p}ep{e}``. Per layout: build the trainer from MODEL_DIR (the engines'
checkpoint); global rank 0 connects a BroadcastTransport (its own update group), every other
rank a SenderLink (one group per sender), in rank order (connect_senders); one train step;
a sync from every rank (sync_from_senders); check mode on each engine (engine
/weights_checksum == trainer hf_checksums); the bytes each sender sent (its plan); then each
sender leaves its group. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _checks import finish  # noqa: E402
from _checks import samples as _samples  # noqa: E402

ADV = [1.0, -0.5, 0.7, -1.2, 3.0, 0.4, -0.9, 1.5]


def parse(layout: str) -> tuple[int, int, int]:
    tp = int(layout.split("tp")[1].split("pp")[0])
    pp = int(layout.split("pp")[1].split("ep")[0])
    ep = int(layout.split("ep")[1])
    return tp, pp, ep


def run_layout(urls: list[str], model_dir: str, layout: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from moe_async.engines.client import SyncEngineClient
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.weight_sync import senders
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.transport import BroadcastTransport, check_engines

    tp, pp, ep = parse(layout)
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    tr = MegatronTrainer(TrainerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                       expert_model_parallel_size=ep, micro_batch_size=2,
                                       moe_aux_loss_coeff=0.0, lr=1e-3), model_dir)
    cfg = WeightSyncConfig(bucket_bytes=16 * 1024, backend="gloo", timeout_s=120)
    clients = [SyncEngineClient(u, timeout_s=120) for u in urls]
    transport = link = None
    if rank == 0:
        transport = BroadcastTransport(clients, cfg, pause_mode="in_place")
    else:
        link = senders.SenderLink(clients, cfg, rank=rank)
    senders.connect_senders(rank, world, _get_default_store(), transport=transport, link=link,
                            key=f"senders_checks/{layout}")
    res: dict = {"build_s": time.perf_counter() - t0}
    box = [[c.get_weight_version() for c in clients] if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    base = max(box[0])
    tr.train_step(_samples(0, zero_at=None), ADV)
    version = base + 1
    sums = tr.hf_checksums()  # collective
    before = [c.weights_checksum() for c in clients] if rank == 0 else []
    m = senders.sync_from_senders(rank, tr.hf_exporter(), version, transport=transport, link=link)
    (plan,) = senders._PLANS.values()  # the plan this sync used (same on every rank)
    if rank == 0:
        assert transport is not None
        per_engine = []
        for c, b in zip(clients, before):
            try:
                chk = check_engines([c], sums, version)
            except Exception as ex:  # noqa: BLE001 - recorded: the other ranks must not hang
                chk = {"check_error": f"{type(ex).__name__}: {ex}"}
            after = c.weights_checksum()
            per_engine.append({**chk, "checksums_equal": after["checksums"] == sums,
                               "version_after": after["weight_version"],
                               "bytes_received": after["bytes_received"] - b["bytes_received"],
                               "changed": sum(b["checksums"][k] != after["checksums"][k] for k in sums)})
        res.update(sync=m, engines=per_engine, n_tensors=len(sums), version=version,
                   group_names=[transport.group_name] + [senders.sender_group_name(transport.group_name, r)
                                                         for r in range(1, world)])
    res["sent_bytes"] = {str(s): n for s, n in plan.sent_bytes.items()}
    res["senders_of"] = {str(s): sorted({p.hf_name for b in sp.buckets for p in b})
                         for s, sp in plan.plans.items()}
    # teardown in the formation order's reverse: every sender leaves its group
    for r in reversed(range(world)):
        if r == rank:
            if transport is not None:
                transport.shutdown()
            elif link is not None:
                link.close()
        dist.barrier()
    for c in clients:
        c.close()
    tr.close()
    res["total_s"] = time.perf_counter() - t0
    return res


def main(urls: str, model_dir: str, out: str, layouts: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    res = {lay: run_layout(urls.split(","), model_dir, lay) for lay in layouts}
    finish(out, res)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
