"""Weight sync from a torchrun/gloo MegatronTrainer into ONE running embedded engine.

    torchrun --nproc_per_node W _sync_layouts.py ENGINE_URL MODEL_DIR OUT.json LAYOUT [LAYOUT ...]

LAYOUT is ``tp{t}pp{p}ep{e}``. For each layout (Megatron's parallel state destroyed and
re-created between layouts, as in tests/trainer/_layout_checks.py): build the trainer from
MODEL_DIR (the engine's checkpoint); global rank 0 connects a BroadcastTransport to the
engine (re-creating the weight-update group; closed with /destroy_weights_update_group at
the end of the layout), every rank takes part in ``export_hf_weights``. For each bucket
limit (C1: 1 byte, largest tensor - 1, the whole model; C2: 1 KiB): one train step, a sync,
the check mode (engine /weights_checksum == trainer hf_checksums), then a second sync of the
same weights (the exporter writing into ``transport.destination``; at 1 process that moves
the trainer's parameters into the send buffer, and the later steps train in it). Then one
sync through the DiskTransport. Rank 0 writes the results as JSON.

LAYOUT ``relayout`` (1 process): two trainers from MODEL_DIR, one with its parameters moved
into a transport's send buffer (``relayout_params``), one as built; two train steps each
(loss and grad norm recorded), exports compared, then the moved one syncs into the engine
and the check mode compares the engine with the other one's checksums.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _checks import finish  # noqa: E402
from _checks import samples as _samples  # noqa: E402

ADV = [1.0, -0.5, 0.7, -1.2, 3.0, 0.4, -0.9, 1.5]


def samples(seed: int = 0):
    """tests/_checks.py's 8 samples, every one with loss weight 1."""
    return _samples(seed, zero_at=None)


def parse(layout: str) -> tuple[int, int, int]:
    tp = int(layout.split("tp")[1].split("pp")[0])
    pp = int(layout.split("pp")[1].split("ep")[0])
    ep = int(layout.split("ep")[1])
    return tp, pp, ep


def bcast(obj, src: int = 0):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def run_layout(url: str, model_dir: str, layout: str) -> dict:
    import torch.distributed as dist

    from moe_async.engines.client import SyncEngineClient
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.disk_transport import DiskTransport
    from moe_async.weight_sync.transport import BroadcastTransport, check_engines

    tp, pp, ep = parse(layout)
    rank = dist.get_rank()
    t0 = time.perf_counter()
    tr = MegatronTrainer(TrainerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                       expert_model_parallel_size=ep, micro_batch_size=2,
                                       moe_aux_loss_coeff=0.0, lr=1e-3), model_dir)
    res: dict = {"build_s": time.perf_counter() - t0, "syncs": []}
    sizes = {n: t.numel() * t.element_size() for n, t in tr.export_hf_weights()}  # rank 0 only
    sizes = bcast(sizes)
    total, largest = sum(sizes.values()), max(sizes.values())
    res.update(total_bytes=total, largest_bytes=largest, n_tensors=len(sizes))
    limits = {"c1_one_tensor": 1, "c1_below_largest": largest - 1, "c1_whole_model": total, "c2_1KiB": 1024}

    client = transport = None
    base = None
    if rank == 0:
        client = SyncEngineClient(url, timeout_s=120)
        base = client.get_weight_version()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cfg = WeightSyncConfig(bucket_bytes=1, backend="gloo", timeout_s=120)
        res["small_bucket_config_warned"] = any("bucket_bytes" in str(x.message) for x in w)
        transport = BroadcastTransport([client], cfg, pause_mode="in_place")
        transport.connect()
    base = bcast(base)
    ss = samples()
    for label, limit in limits.items():
        tr.train_step(ss, ADV)
        version = base + tr.version
        sums = tr.hf_checksums()  # collective
        rec: dict = {"label": label, "limit": limit, "version": version}
        for attempt in ("first", "repeat"):
            if rank == 0:
                transport.cfg = transport.cfg.model_copy(update={"bucket_bytes": limit})
                where: dict[str, int] = {}
                nb = [0]

                def on_bucket(bucket, last, where=where, nb=nb):
                    for n in bucket.names:
                        where[n] = nb[0]
                    nb[0] += 1

                transport.on_bucket = on_bucket
                before = client.weights_checksum()
                # the repeat: the exporter copies straight into the transport's send buffer
                out = transport.destination if attempt == "repeat" else None
                m = transport.send(tr.export_hf_weights(out=out), version)
                try:  # a failure is recorded, not raised: the other ranks must not hang
                    chk = check_engines([client], sums, version)
                except Exception as ex:  # noqa: BLE001
                    chk = {"check_error": f"{type(ex).__name__}: {ex}"}
                after = client.weights_checksum()
                e = "model.layers.0.block_sparse_moe.experts.0"
                rec[attempt] = {
                    **m, **chk,
                    "bytes_received": after["bytes_received"] - before["bytes_received"],
                    "recv_copies": after["recv_copies"] - before["recv_copies"],
                    "layout_known": transport.layout is not None,
                    "version_before": before["weight_version"], "version_after": after["weight_version"],
                    "checksums_equal": after["checksums"] == sums,
                    "changed_tensors": sum(before["checksums"][k] != after["checksums"][k] for k in sums),
                    "gate_up_split": where.get(f"{e}.w1.weight") != where.get(f"{e}.w3.weight"),
                    "max_bucket_tensors": max(list(where.values()).count(b) for b in set(where.values())),
                }
            else:
                for _ in tr.export_hf_weights():
                    pass
        res["syncs"].append(rec)
    # the disk fallback: one more step, then safetensors + /update_weights_from_disk
    tr.train_step(ss, ADV)
    version = base + tr.version
    sums = tr.hf_checksums()
    if rank == 0:
        disk = DiskTransport([client], WeightSyncConfig(transport="disk", bucket_bytes=16 * 1024, timeout_s=120),
                             pause_mode="in_place")
        disk.connect()
        m = disk.send(tr.export_hf_weights(), version)
        try:
            chk = check_engines([client], sums, version)
        except Exception as ex:  # noqa: BLE001
            chk = {"check_error": f"{type(ex).__name__}: {ex}"}
        res["disk"] = {**m, **chk, "checksums_equal": client.weights_checksum()["checksums"] == sums}
        disk.shutdown()
        transport.shutdown()
        client.close()
    else:
        for _ in tr.export_hf_weights():
            pass
    tr.close()
    dist.barrier()
    res["total_s"] = time.perf_counter() - t0
    return res


def run_relayout(url: str, model_dir: str) -> dict:
    from moe_async.engines.client import SyncEngineClient
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.transport import BroadcastTransport, check_engines

    cfg = TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3)
    plain = MegatronTrainer(cfg, model_dir)
    moved = MegatronTrainer(cfg, model_dir)
    client = SyncEngineClient(url, timeout_s=120)
    transport = BroadcastTransport([client], WeightSyncConfig(bucket_bytes=16 * 1024, backend="gloo",
                                                              timeout_s=120), pause_mode="in_place")
    transport.connect()
    res: dict = {"relayout": moved.relayout_params(transport.destination),
                 "relayout_again": moved.relayout_params(transport.destination),
                 "plain_relayout_without_out": plain.relayout_params()}
    emb = dict(moved.model.named_parameters())["embedding.word_embeddings.weight"]
    ident = {n: id(p) for n, p in moved.model.named_parameters()}
    ss = samples()
    res["steps"] = []
    for _ in range(2):
        a, b = plain.train_step(ss, ADV), moved.train_step(ss, ADV)
        res["steps"].append({k: [a[k], b[k]] for k in ("loss", "grad_norm", "pg_loss", "entropy")})
    dst = transport.destination("model.embed_tokens.weight", tuple(emb.shape), emb.dtype)
    res["embedding_in_send_buffer"] = emb.data_ptr() == dst.data_ptr()
    res["same_parameter_objects"] = ident == {n: id(p) for n, p in moved.model.named_parameters()}
    ref = dict(plain.export_hf_weights())
    got = list(moved.export_hf_weights(out=transport.destination))
    res["export_equal"] = len(got) == len(ref) and all(torch.equal(ref[n], t) for n, t in got)
    res["export_views"] = sum(t.data_ptr() == transport.destination(n, tuple(t.shape), t.dtype).data_ptr()
                              for n, t in got)
    spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in moved.model.parameters()]
    res["export_param_memory"] = sum(any(a <= t.data_ptr() < b for a, b in spans) for _, t in got)
    version = client.get_weight_version() + 1
    before = client.weights_checksum()
    m = transport.send(moved.export_hf_weights(out=transport.destination), version)
    sums = plain.hf_checksums()
    try:
        chk = check_engines([client], sums, version)
    except Exception as ex:  # noqa: BLE001
        chk = {"check_error": f"{type(ex).__name__}: {ex}"}
    after = client.weights_checksum()
    res["sync"] = {**m, **chk, "recv_copies": after["recv_copies"] - before["recv_copies"],
                   "bytes_received": after["bytes_received"] - before["bytes_received"],
                   "total_bytes": sum(t.numel() * t.element_size() for t in ref.values())}
    transport.shutdown()
    client.close()
    moved.close()
    plain.close()
    return res


def main(url: str, model_dir: str, out: str, layouts: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    res = {lay: run_relayout(url, model_dir) if lay == "relayout" else run_layout(url, model_dir, lay)
           for lay in layouts}
    finish(out, res)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
