"""Adapter-only sync vs full sync, same trainer, same engine, same run.

A 1-process ``MegatronTrainer`` with ``trainer.lora`` (rank ``--rank``) and one embedded engine
built from the same HF checkpoint (``--model DIR``, else a random Mixtral written here:
``--hidden``, ``--layers``, ``--experts``). Interleaved ``--reps`` times:

* full: ``BroadcastTransport.send(trainer.export_hf_weights(out=...), version)`` over gloo
  (the trainer actor's sync of the whole model);
* adapter: ``sync_adapter`` of ``trainer.export_lora(out=buffers.destination)`` (PEFT tensors,
  gathered, renamed and written into the sender's reused shared-memory buffer) as ``policy@V``
  through ``/load_lora_adapter_from_tensors`` (one flattened bucket), the version before
  unloaded; timed from the export on, as the full sync is.

The first ``--warmup`` pairs are not counted (first-time costs of both: buffers, layouts).
Prints the median seconds and bytes of each and their ratios (goal: both below 1/20 at rank 16).

    .venv/bin/python tools/bench_lora_sync.py --rank 16 --hidden 512 --layers 4 --experts 8
    .venv/bin/python tools/bench_lora_sync.py --model ~/.cache/moe-async/smollm2_upcycled-*  # the demo model
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "models"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: a random Mixtral made here)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from moe_async.engines.base import make_engine
    from moe_async.engines.client import SyncEngineClient
    from moe_async.engines.config import EngineConfig
    from moe_async.lora.config import LoraConfig
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.adapter_buffers import AdapterBuffers
    from moe_async.weight_sync.lora_sync import AdapterVersions, sync_adapter
    from moe_async.weight_sync.transport import BroadcastTransport

    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    path = args.model
    if path is None:
        from _tiny import make_tiny_mixtral

        h = args.hidden
        path = make_tiny_mixtral(os.path.join(tmp.name, "model"), hidden_size=h, intermediate_size=2 * h,
                                 num_hidden_layers=args.layers, num_local_experts=args.experts,
                                 num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, tie=False)
    lcfg = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    trainer = MegatronTrainer(TrainerConfig(num_threads=args.threads, moe_aux_loss_coeff=0.0, lora=lcfg), path)
    eng = make_engine(EngineConfig(startup_timeout_s=600, num_threads=args.threads, max_running_requests=4), path, 0)
    eng.launch()
    try:
        client = SyncEngineClient(eng.url, timeout_s=600)
        tr = BroadcastTransport([client], WeightSyncConfig(bucket_bytes=64 * 2**20, backend="gloo", timeout_s=600),
                                pause_mode="in_place")
        tr.connect()
        versions, buffers = AdapterVersions(max_staleness=0), AdapterBuffers()
        full_s, lora_s, export_s, full_b, lora_b = [], [], [], 0, 0
        v = 0
        for _ in range(args.warmup + args.reps):
            v += 1
            t0 = time.perf_counter()
            tr.send(trainer.export_hf_weights(out=tr.destination), v)
            full_s.append(time.perf_counter() - t0)
            full_b = sum(t.numel() * t.element_size() for _, t in trainer.export_hf_weights())
            v += 1
            t0 = time.perf_counter()
            tensors, cfg = trainer.export_lora(with_config=True, out=buffers.destination)
            t1 = time.perf_counter()
            out = sync_adapter([client], versions, v, tensors, cfg, buffers=buffers)
            lora_s.append(time.perf_counter() - t0)
            export_s.append(t1 - t0)
            lora_b = out["bytes"]
        del full_s[:args.warmup], lora_s[:args.warmup], export_s[:args.warmup]
        fs, ls = statistics.median(full_s), statistics.median(lora_s)
        print(f"full sync:    {fs:.3f} s  {full_b / 2**20:.1f} MiB")
        print(f"adapter sync: {ls:.3f} s  {lora_b / 2**20:.2f} MiB  (rank {args.rank}; export "
              f"{statistics.median(export_s):.3f} s of it)")
        print(f"adapter / full: seconds {ls / fs:.4f}  bytes {lora_b / full_b:.4f}  (goal < 0.05 both)")
        print("per sync (s): full " + " ".join(f"{x:.3f}" for x in full_s) + "; adapter "
              + " ".join(f"{x:.4f}" for x in lora_s) + f"; {buffers.allocated} adapter buffers made")
    finally:
        eng.shutdown()
        trainer.close()
        tmp.cleanup()


if __name__ == "__main__":
    main()
