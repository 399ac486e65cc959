"""Bucketed weight sync vs one raw broadcast of the same bytes, same processes, same run.

Sender: this process (group rank 0; the tensors are the checkpoint's HF tensors, i.e. what
``MegatronTrainer.export_hf_weights`` yields at rank 0). Receiver: one embedded engine server
(``python -m moe_async.engines.embedded.server``, group rank 1), gloo on loopback.

For each bucket size, interleaved and repeated:
  * raw: ONE ``broadcast`` of a uint8 buffer of the model's total bytes into the engine
    (``POST /debug_receive_broadcast``; timed by the receiver from its entering the broadcast
    to the last byte: the wire's limit between these two processes);
  * sync: ``BroadcastTransport.send`` end to end (pause, per-bucket metadata POST + broadcast,
    the engine's unflatten/stage, atomic apply on the last bucket, continue), with packing
    overlapped (default), serial, and with ``pause_scope=last_bucket``.
Each sync is paired with a raw broadcast just before it (load on a shared machine drifts);
prints the median (and best) of sync GB/s / raw GB/s per bucket size, plus the generation
stall (``sync/pause_seconds``: engines paused) for both pause scopes.

    python tools/bench_weight_sync.py                       # random Mixtral, ~0.5 GB fp32
    python tools/bench_weight_sync.py --model-path DIR      # e.g. the upcycled demo checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

MiB = 1024**2


def make_model(path: str, hidden: int, layers: int, experts: int, inter: int, vocab: int) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=8, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
    MixtralForCausalLM(cfg).save_pretrained(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="HF dir (default: a random Mixtral, see below)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--bucket-mib", type=float, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import httpx
    import torch
    from safetensors.torch import load_file

    from moe_async.engines.base import make_engine
    from moe_async.engines.client import SyncEngineClient
    from moe_async.engines.config import EngineConfig
    from moe_async.weight_sync.config import WeightSyncConfig
    from moe_async.weight_sync.group import group_broadcast
    from moe_async.weight_sync.transport import BroadcastTransport

    torch.set_num_threads(args.threads)
    tmp = None
    path = args.model_path
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_ws_")
        path = tmp.name
        t0 = time.perf_counter()
        make_model(path, args.hidden, args.layers, args.experts, args.inter, args.vocab)
        print(f"random Mixtral written in {time.perf_counter() - t0:.1f}s", flush=True)
    named = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            named.update(load_file(os.path.join(path, f)))
    named = sorted(named.items())
    total = sum(t.numel() * t.element_size() for _, t in named)
    largest = max(t.numel() * t.element_size() for _, t in named)
    print(f"model: {path}  {len(named)} tensors, {total / 1e6:.1f} MB, largest {largest / 1e6:.1f} MB", flush=True)

    eng = make_engine(EngineConfig(startup_timeout_s=600, num_threads=args.threads, max_running_requests=4), path, 0)
    eng.launch()
    rows = []
    try:
        client = SyncEngineClient(eng.url, timeout_s=600)
        tr = BroadcastTransport([client], WeightSyncConfig(bucket_bytes=64 * MiB, backend="gloo", timeout_s=600),
                                pause_mode="in_place")
        tr.connect()
        raw_buf = torch.empty(total, dtype=torch.uint8)
        raw_buf.fill_(7)

        def raw_once() -> tuple[float, float]:
            box = {}
            th = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
                f"{eng.url}/debug_receive_broadcast", json={"group_name": tr.group_name, "nbytes": total},
                timeout=600).json()))
            th.start()
            t0 = time.perf_counter()
            group_broadcast(tr.group, raw_buf, src=0)
            th.join()
            send_s = time.perf_counter() - t0
            assert box["r"]["success"], box["r"]
            return float(box["r"]["seconds"]), send_s

        version = client.get_weight_version()
        raw_gbps = []
        raw_once()  # warm-up (first use of the pair's connections)
        variants = {"on": dict(overlap=True, pause_scope="sync"), "off": dict(overlap=False, pause_scope="sync"),
                    "last": dict(overlap=True, pause_scope="last_bucket")}
        for mib in args.bucket_mib:
            res = {"bucket_mib": mib}
            per: dict[str, list] = {k: [] for k in variants}
            for _ in range(args.repeats):  # interleaved: each sync paired with a raw broadcast just before
                for key, upd in variants.items():
                    tr.cfg = tr.cfg.model_copy(update={"bucket_bytes": int(mib * MiB), **upd})
                    recv_s, _send_s = raw_once()
                    raw = total / recv_s / 1e9
                    raw_gbps.append(raw)
                    version += 1
                    m = tr.send(named, version)
                    assert m["sync/bytes"] == total
                    per[key].append((m["sync/gbps"] / raw, raw, m))
            for key, xs in per.items():
                xs.sort(key=lambda x: x[0])
                med = xs[len(xs) // 2]
                res[f"ratio_{key}"] = med[0]
                res[f"ratio_best_{key}"] = xs[-1][0]
                res[f"raw_gbps_{key}"] = med[1]
                res[f"sync_gbps_{key}"] = med[2]["sync/gbps"]
                res[f"stall_s_{key}"] = sorted(x[2]["sync/pause_seconds"] for x in xs)[len(xs) // 2]
                res[f"buckets_{key}"] = int(med[2]["sync/buckets"])
                res[f"detail_{key}"] = med[2]
            rows.append(res)
            print(f"  bucket {mib:>7g} MiB: buckets {res['buckets_on']:>3}  raw {res['raw_gbps_on']:.2f} GB/s  "
                  f"sync {res['sync_gbps_on']:.2f} GB/s  ratio median {res['ratio_on']:.3f} (best "
                  f"{res['ratio_best_on']:.3f}), serial {res['ratio_off']:.3f}  stall {res['stall_s_on']:.3f}s "
                  f"(last-bucket pause: {res['stall_s_last']:.3f}s)", flush=True)
        sums = client.weights_checksum()
        from moe_async.engines.checksum import tensor_checksum

        assert sums["checksums"] == {n: tensor_checksum(t) for n, t in named}, "engine weights differ"
        tr.shutdown()
        client.close()
    finally:
        eng.shutdown()
        if tmp is not None:
            tmp.cleanup()
    print()
    print(f"model {total / 1e6:.0f} MB, {len(named)} tensors; raw gloo broadcast of {total / 1e6:.0f} MB "
          f"(trainer -> engine, loopback): median {sorted(raw_gbps)[len(raw_gbps) // 2]:.2f} GB/s")
    print("ratio = sync GB/s / raw GB/s of a broadcast of the same bytes just before it; median (best) of "
          f"{args.repeats} pairs")
    print(f"{'bucket':>10} {'buckets':>8} {'raw GB/s':>9} {'sync GB/s':>10} {'ratio':>7} {'(best)':>7} "
          f"{'serial':>7} {'stall s':>8} {'stall s, last-bucket pause':>27}")
    for r in rows:
        print(f"{r['bucket_mib']:>7g}MiB {r['buckets_on']:>8} {r['raw_gbps_on']:>9.2f} {r['sync_gbps_on']:>10.2f} "
              f"{r['ratio_on']:>7.3f} {r['ratio_best_on']:>7.3f} {r['ratio_off']:>7.3f} {r['stall_s_on']:>8.3f} "
              f"{r['stall_s_last']:>27.3f}")
    best = max(rows, key=lambda r: r["ratio_on"])
    print(f"best: {best['bucket_mib']:g} MiB, median ratio {best['ratio_on']:.3f} (goal >= 0.9)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_bytes": total, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
