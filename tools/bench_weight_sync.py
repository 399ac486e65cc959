"""Bucketed weight sync vs one raw broadcast of the same bytes, same processes, same run.

Sender: this process (group rank 0; the tensors are the checkpoint's HF tensors, i.e. what
``MegatronTrainer.export_hf_weights`` yields at rank 0). Receiver: one embedded engine server
(``python -m moe_async.engines.embedded.server``, group rank 1), gloo on loopback.

For each bucket size, interleaved and repeated:
  * raw: ONE ``broadcast`` of a uint8 buffer of the model's total bytes into the engine
    (``POST /debug_receive_broadcast``; timed by the receiver from its entering the broadcast
    to the last byte: the wire's limit between these two processes);
  * sync: ``BroadcastTransport.send`` end to end (pause, re-order to the engine's
    ``/weights_layout``, pack, per-bucket metadata POST + broadcast, the engine's receive
    into its standby parameters, atomic pointer-swap apply on the last bucket, continue):
      - ``export``: the sender's whole path from the exporter's last step on: each tensor is
        copied into ``BroadcastTransport.destination`` (what ``export_hf_weights(out=...)``
        does instead of its clone: one copy of the model, in the producer thread, overlapped
        with the broadcast of earlier buckets), then sent without packing;
      - ``pack``: the source is the exporter's separate tensors, already copied (not timed),
        the transport packs each bucket (one copy of the model), overlapped with the
        broadcast; ``serial``: the same, packing not overlapped;
      - ``last``: as ``pack`` with ``pause_scope=last_bucket``;
      - ``flat``: the source tensors already lie end to end in the engine's layout order
        (no copy on the sender at all): isolates what the transport and the engine add to
        the wire;
      - ``versioned``: as ``pack``, but the way slime writes its sender: a plain (not
        atomic) session and ``weight_version`` on EVERY bucket, so the engine applies each
        bucket when its call returns (SGLang's semantics) instead of staging them; its cost
        must stay proportional to the bytes (each bucket's bytes copied once into the live
        parameters), not buckets x model size: the summary prints its time over ``pack``'s;
      - ``atomic_versioned``: every bucket versioned as ``versioned``, but inside the atomic
        session our transport opens: each call fills the standby copy only where it is
        stale (the previous call's tensors) and swaps by pointer; the summary prints its time
        over ``pack``'s (version on the last bucket only); goal <= 1.3 at 100 buckets
        (``--bucket-count 100``), where a copy of the model per call would be ~100x;
      - ``trainer``: the real sender, a 1-process ``MegatronTrainer`` built from the same
        checkpoint, ``send(trainer.export_hf_weights(out=transport.destination))`` as the
        trainer actor does (its own transport and weight-update group with the same engine;
        its raw broadcast over that group). Its first export moves the parameters whose HF
        tensors are views of them into the send buffer (``relayout_params``): those are sent
        from the trainer's own memory, only the fused QKV (split into q/k/v) is copied.
    ``export`` and ``pack`` each do one timed copy of the model on the sender; the raw
    broadcast does none (on loopback the wire is itself a memory copy, so that copy shows).
Each sync is bracketed by a raw broadcast just before and one just after it, over the same
group, and divided by their mean GB/s (load on a shared machine drifts; the mean cancels a
linear drift); prints the median (and best) of sync GB/s / raw GB/s per bucket size (the
JSON also keeps the median against the raw broadcast before only), plus the generation
stall (``sync/pause_seconds``: engines paused) for both pause scopes.

    python tools/bench_weight_sync.py                       # random Mixtral, ~0.5 GB fp32
    python tools/bench_weight_sync.py --model-path DIR      # any HF checkpoint
    python tools/bench_weight_sync.py --model-path demo     # the CPU demo's model (1.5 GB fp32)
    python tools/bench_weight_sync.py --trainer-layouts tp2 ep2 --engines 2 --bucket-mib 64

``--trainer-layouts``: instead of the 1-process paths, a 2-rank MegatronTrainer (TP2, EP2; EP4: 4
ranks; torchrun/gloo, tools/_bench_sync_ranks.py) syncs into ``--engines`` embedded engines, every
rank sending the shards it holds over its own update group (``--senders all``, the default) or
rank 0 sending the streamed export (``--senders one``: each tensor gathered into the bucket that
is sent); ratio = sync GB/s over
a raw broadcast of the same bytes from rank 0 to the same engines over the same group, just
before and after each sync; each rank's peak extra tensor bytes during a sync printed beside the
streamed-export bound (one bucket + the largest tensor + a fused QKV's split copies).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

MiB = 1024**2
LABEL = {"on": "pack", "off": "serial", "last": "last", "flat": "flat", "export": "export", "trainer": "trainer",
         "versioned": "versioned", "atomic_versioned": "atomic_v"}
WHAT = {"on": "separate source tensors, packed, overlapped", "off": "packed, not overlapped",
        "last": "packed, engines paused before the last bucket only",
        "flat": "flat source, no copy on the sender", "export": "exporter copies into the send buffer",
        "trainer": "1-process MegatronTrainer, parameters moved into the send buffer",
        "versioned": "slime's protocol: every bucket versioned, each applied at once",
        "atomic_versioned": "every bucket versioned inside an atomic session, each applied by pointer swap"}


class VersionEveryBucket:
    """A client as slime's sender drives it: a plain session (SGLang's semantics: each call is
    applied when it returns) and ``weight_version`` on every bucket, not only the last."""

    def __init__(self, client, atomic: bool = False):
        self.client, self.version, self.atomic = client, None, atomic

    def __getattr__(self, name):
        return getattr(self.client, name)

    def begin_weight_update(self, atomic=False, selector="all"):
        return self.client.begin_weight_update(atomic=self.atomic, selector=selector)

    def update_weights_from_distributed(self, **kw):
        return self.client.update_weights_from_distributed(**{**kw, "weight_version": self.version})


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
    ap.add_argument("--model-path", default=None, help="HF dir, or 'demo': the CPU demo's upcycled SmolLM2 MoE (configs/cpu_demo.yaml model, "
                    "made once and cached); default: a random Mixtral, see below")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--bucket-mib", type=float, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--bucket-count", type=int, nargs="+", default=None,
                    help="bucket sizes as the model's bytes / N (instead of --bucket-mib)")
    ap.add_argument("--modes", nargs="+", default=["on", "off", "last", "flat", "export", "trainer", "versioned"],
                    choices=["on", "off", "last", "flat", "export", "trainer", "versioned", "atomic_versioned"],
                    help="sender paths to measure (on = pack, off = serial pack)")
    ap.add_argument("--trainer-layouts", nargs="+", choices=["tp2", "ep2", "ep4"], default=None,
                    help="a 2-rank (ep4: 4-rank) trainer at these layouts into --engines engines; "
                         "replaces the 1-process paths")
    ap.add_argument("--senders", choices=["all", "one"], default="all",
                    help="--trainer-layouts: every rank sends its own shards (all) or rank 0 gathers and sends (one)")
    ap.add_argument("--engines", type=int, default=2, help="engines for --trainer-layouts")
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
    if path == "demo":
        from moe_async.config import load_config
        from moe_async.models.prepare import prepare_hf_checkpoint

        here = os.path.dirname(os.path.abspath(__file__))
        path = str(prepare_hf_checkpoint(load_config(os.path.join(here, "..", "configs", "cpu_demo.yaml")).model))
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
    if args.bucket_count:  # about N buckets each (greedy packing at tensor boundaries)
        args.bucket_mib = [total / n / MiB for n in args.bucket_count]

    if args.trainer_layouts:
        try:
            multi_rank(args, path, total)
        finally:
            if tmp is not None:
                tmp.cleanup()
        return
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

        def raw_once(t=tr) -> tuple[float, float]:
            box = {}
            th = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
                f"{eng.url}/debug_receive_broadcast", json={"group_name": t.group_name, "nbytes": total},
                timeout=600).json()))
            th.start()
            t0 = time.perf_counter()
            group_broadcast(t.group, raw_buf, src=0)
            th.join()
            send_s = time.perf_counter() - t0
            assert box["r"]["success"], box["r"]
            return float(box["r"]["seconds"]), send_s

        version = client.get_weight_version()
        raw_gbps = []
        raw_once()  # warm-up (first use of the pair's connections)
        # "flat" source: the same tensors end to end in one buffer, in the engine's layout order
        layout = tr.layout or [n for n, _ in named]
        by_name = dict(named)
        flat_src = torch.empty(total, dtype=torch.uint8)
        named_flat, off = [], 0
        for n in [n for n in layout if n in by_name] + [n for n, _ in named if n not in set(layout)]:
            t = by_name[n]
            nb = t.numel() * t.element_size()
            v = flat_src[off: off + nb].view(t.dtype).view(t.shape)
            v.copy_(t)
            named_flat.append((n, v))
            off += nb
        print(f"engine layout published: {tr.layout is not None}", flush=True)
        variants = {"on": dict(overlap=True, pause_scope="sync"), "off": dict(overlap=False, pause_scope="sync"),
                    "last": dict(overlap=True, pause_scope="last_bucket"),
                    "flat": dict(overlap=True, pause_scope="sync"), "export": dict(overlap=True, pause_scope="sync"),
                    "trainer": dict(overlap=True, pause_scope="sync"), "versioned": dict(overlap=True, pause_scope="sync"),
                    "atomic_versioned": dict(overlap=True, pause_scope="sync")}
        variants = {k: v for k, v in variants.items() if k in args.modes}
        transports = {k: tr for k in variants}
        versioned = None
        taggers: list[VersionEveryBucket] = []  # the clients that version every bucket
        if "versioned" in variants:  # slime's protocol: its own group with the same engine
            versioned = VersionEveryBucket(client)
            taggers.append(versioned)
            tr_v = BroadcastTransport([versioned], tr.cfg, pause_mode="in_place", group_name="bench_weight_sync_versioned")
            tr_v.connect()
            transports["versioned"] = tr_v
            raw_once(tr_v)  # warm-up
        if "atomic_versioned" in variants:  # every bucket versioned into an atomic session
            versioned_a = VersionEveryBucket(client, atomic=True)
            tr_a = BroadcastTransport([versioned_a], tr.cfg, pause_mode="in_place",
                                      group_name="bench_weight_sync_atomic_versioned")
            tr_a.connect()
            transports["atomic_versioned"] = tr_a
            raw_once(tr_a)  # warm-up
            taggers.append(versioned_a)
        trainer = None
        if "trainer" in variants:  # the real sender: a 1-process Megatron trainer, its own group
            from moe_async.trainer.config import TrainerConfig
            from moe_async.trainer.megatron_trainer import MegatronTrainer

            t0 = time.perf_counter()
            trainer = MegatronTrainer(TrainerConfig(num_threads=args.threads, moe_aux_loss_coeff=0.0), path)
            tr_t = BroadcastTransport([client], tr.cfg, pause_mode="in_place", group_name="bench_weight_sync_trainer")
            tr_t.connect()
            transports["trainer"] = tr_t
            raw_once(tr_t)  # warm-up
            st = trainer.relayout_params(tr_t.destination)
            print(f"trainer built in {time.perf_counter() - t0:.1f}s; relayout: {st}", flush=True)

        def exported():  # export_hf_weights' last step with out=tr.destination
            for n, t in named:
                d = tr.destination(n, tuple(t.shape), t.dtype)
                if d is None:
                    yield n, t.clone()
                else:
                    d.copy_(t)
                    yield n, d

        sources = {"flat": lambda: named_flat, "export": exported}
        if trainer is not None:
            sources["trainer"] = lambda: trainer.export_hf_weights(out=transports["trainer"].destination)
        cold = {}  # one untimed sync per path first: the engine's first update allocates its standby copy
        for key, upd in variants.items():
            t = transports[key]
            t.cfg = t.cfg.model_copy(update={"bucket_bytes": int(args.bucket_mib[0] * MiB), **upd})
            version += 1
            for tg in taggers:
                tg.version = str(version)
            cold[key] = t.send(sources.get(key, lambda: named)(), version)["sync/seconds"]
        print("first (cold) sync, not in the ratios: " + ", ".join(f"{LABEL[k]} {v:.2f}s" for k, v in cold.items()),
              flush=True)
        for mib in args.bucket_mib:
            res = {"bucket_mib": mib}
            per: dict[str, list] = {k: [] for k in variants}
            for _ in range(args.repeats):  # interleaved: each sync bracketed by raw broadcasts
                for key, upd in variants.items():
                    t = transports[key]
                    t.cfg = t.cfg.model_copy(update={"bucket_bytes": int(mib * MiB), **upd})
                    before = total / raw_once(t)[0] / 1e9
                    version += 1
                    for tg in taggers:
                        tg.version = str(version)
                    m = t.send(sources.get(key, lambda: named)(), version)
                    after = total / raw_once(t)[0] / 1e9
                    assert m["sync/bytes"] == total
                    raw = (before + after) / 2  # bracketed: linear drift of the load cancels
                    raw_gbps += [before, after]
                    per[key].append((m["sync/gbps"] / raw, raw, m, m["sync/gbps"] / before))
            for key, xs in per.items():
                xs.sort(key=lambda x: x[0])
                med = xs[len(xs) // 2]
                res[f"ratio_{key}"] = med[0]
                res[f"ratio_best_{key}"] = xs[-1][0]
                res[f"ratio_before_only_{key}"] = sorted(x[3] for x in xs)[len(xs) // 2]
                res[f"raw_gbps_{key}"] = med[1]
                res[f"sync_gbps_{key}"] = med[2]["sync/gbps"]
                res[f"stall_s_{key}"] = sorted(x[2]["sync/pause_seconds"] for x in xs)[len(xs) // 2]
                res[f"buckets_{key}"] = int(med[2]["sync/buckets"])
                res[f"detail_{key}"] = med[2]
            rows.append(res)
            print(f"  bucket {mib:>7g} MiB: " + ", ".join(
                f"{LABEL[k]} {res[f'ratio_{k}']:.3f} (best {res[f'ratio_best_{k}']:.3f}, "
                f"vs the raw before only {res[f'ratio_before_only_{k}']:.3f}, raw {res[f'raw_gbps_{k}']:.2f} "
                f"GB/s, {res[f'buckets_{k}']} buckets, stall {res[f'stall_s_{k}']:.3f}s)" for k in variants), flush=True)
            for key in variants:
                print(f"    detail ({LABEL[key]}, median): " + json.dumps(
                    {k.removeprefix("sync/"): round(v, 4) for k, v in res[f"detail_{key}"].items()}), flush=True)
        sums = client.weights_checksum()
        from moe_async.models.checksum import tensor_checksum

        assert sums["checksums"] == {n: tensor_checksum(t) for n, t in named}, "engine weights differ"
        if trainer is not None:
            transports["trainer"].shutdown()
            trainer.close()
        for key in ("versioned", "atomic_versioned"):
            if key in variants:
                transports[key].shutdown()
        tr.shutdown()
        client.close()
    finally:
        eng.shutdown()
        if tmp is not None:
            tmp.cleanup()
    print()
    print(f"model {total / 1e6:.0f} MB, {len(named)} tensors; raw gloo broadcast of {total / 1e6:.0f} MB "
          f"(trainer -> engine, loopback): median {sorted(raw_gbps)[len(raw_gbps) // 2]:.2f} GB/s")
    print("ratio = sync GB/s / mean raw GB/s of the broadcasts of the same bytes just before and after it; "
          f"median (best) of {args.repeats} syncs")
    print(f"{'bucket':>10} {'buckets':>8} {'raw GB/s':>9} " + " ".join(f"{LABEL[k]:>8} {'(best)':>7}" for k in variants)
          + f" {'stall s':>8}" + (f" {'stall s, last-bucket pause':>27}" if "last" in variants else ""))
    k0 = next(iter(variants))
    for r in rows:
        print(f"{r['bucket_mib']:>7g}MiB {r[f'buckets_{k0}']:>8} {r[f'raw_gbps_{k0}']:>9.2f} "
              + " ".join(f"{r[f'ratio_{k}']:>8.3f} {r[f'ratio_best_{k}']:>7.3f}" for k in variants)
              + f" {r[f'stall_s_{k0}']:>8.3f}" + (f" {r['stall_s_last']:>27.3f}" if "last" in variants else ""))
    for key in variants:
        best = max(rows, key=lambda r: r[f"ratio_{key}"])
        print(f"best ({LABEL[key]}: {WHAT[key]}): {best['bucket_mib']:g} MiB, median ratio {best[f'ratio_{key}']:.3f} "
              f"(best {best[f'ratio_best_{key}']:.3f}; goal >= 0.9)")
    if "versioned" in variants and "on" in variants:
        print("every bucket versioned (slime) vs version on the last bucket (ours), same packed source: "
              "sync seconds versioned / pack, median; 1.0 = proportional to the bytes, not buckets x model size")
        for r in rows:
            v, o = r["detail_versioned"]["sync/seconds"], r["detail_on"]["sync/seconds"]
            print(f"  {r['bucket_mib']:>7g} MiB ({r['buckets_versioned']} buckets): {v:.3f}s / {o:.3f}s = {v / o:.3f}")
    if "atomic_versioned" in variants and "on" in variants:
        print("every bucket versioned into an atomic session vs version on the last bucket only, same packed "
              "source: sync seconds atomic_v / pack, median (goal <= 1.3 at 100 buckets)")
        for r in rows:
            v, o = r["detail_atomic_versioned"]["sync/seconds"], r["detail_on"]["sync/seconds"]
            print(f"  {r['bucket_mib']:>7g} MiB ({r['buckets_atomic_versioned']} buckets): {v:.3f}s / {o:.3f}s "
                  f"= {v / o:.3f}")
    print(f"engine buckets copied through scratch (not in layout order): {sums.get('recv_copies')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_bytes": total, "rows": rows}, f, indent=1)


def multi_rank(args, path: str, total: int) -> None:
    """``--trainer-layouts``: engines launched here, the trainer's 2 ranks under torchrun."""
    import socket
    import subprocess
    import sys

    from moe_async.engines.base import make_engine
    from moe_async.engines.config import EngineConfig

    engines = [make_engine(EngineConfig(startup_timeout_s=600, num_threads=args.threads, max_running_requests=4),
                           path, 0) for _ in range(args.engines)]
    out_all = []
    try:
        for e in engines:  # one after another: 2 cores
            e.launch()
        urls = ",".join(e.url for e in engines)
        here = os.path.dirname(os.path.abspath(__file__))
        for layout in args.trainer_layouts:
            for mib in args.bucket_mib:
                with socket.socket() as sk:
                    sk.bind(("127.0.0.1", 0))
                    port = sk.getsockname()[1]
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                    nproc = 4 if layout == "ep4" else 2
                    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                    "--master_addr=127.0.0.1", f"--master_port={port}",
                                    os.path.join(here, "_bench_sync_ranks.py"), path, urls, f.name, layout,
                                    str(mib), str(args.repeats), args.senders], check=True, env=env)
                    r = json.load(open(f.name))
                out_all.append(r)
                md, b = r["median"], r["best"]
                print(f"{layout} ({r['senders']} senders: bytes per sender "
                      f"{ {k: round(v / MiB, 1) for k, v in r['sent_bytes'].items()} } MiB) -> "
                      f"{r['engines']} engines, bucket {mib:g} MiB ({int(md['buckets'])} buckets): "
                      f"sync / raw broadcast median {md['ratio']:.3f} (best {b['ratio']:.3f}; goal >= 0.9), "
                      f"sync {md['sync_gbps']:.2f} GB/s, raw {md['raw_gbps']:.2f} GB/s, stall {md['stall_s']:.3f}s "
                      f"(sync {md['seconds']:.3f}s: broadcasts {md['broadcast_s']:.3f}s, waiting for the export "
                      f"{md['export_wait_s']:.3f}s, export busy {md['export_s']:.3f}s; raw {md['raw_s']:.3f}s); "
                      f"peak extra bytes per rank {[round(p / MiB, 2) for p in r['peaks']]} MiB vs the streamed-export bound "
                      f"{r['bound'] / MiB:.2f} MiB (bucket {r['bucket_bytes'] / MiB:g} + largest "
                      f"{r['largest_bytes'] / MiB:.2f} + fused QKV {r['fused_bytes'] / MiB:.2f}); model "
                      f"{total / MiB:.1f} MiB; check mode: {r['check_tensors']:.0f} tensors equal", flush=True)
                print("    phases of the median sync, rank 0, s (the export runs in its thread beside the "
                      "broadcasts): " + ", ".join(f"{k} {v:.3f}" for k, v in md["phases"].items()), flush=True)
    finally:
        for e in engines:
            e.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_bytes": total, "multi_rank": out_all}, f, indent=1)


if __name__ == "__main__":
    main()
