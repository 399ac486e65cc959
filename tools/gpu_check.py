"""GPU smoke check: one SGLang server, generate with routed experts, one NCCL weight update.

On a GPU machine with ``sglang`` installed (``pip install sglang==0.5.23``):

    python tools/gpu_check.py [--port 30000] [--keep-model DIR]

Steps (each printed PASS/FAIL with its time):
  1. make a tiny random Mixtral-style MoE (``moe_async.models.prepare``, source=random_moe);
  2. launch ``python -m sglang.launch_server`` on it (``SGLangEngine``, GPU 0, routed-expert
     capture on) and wait for ``/health``;
  3. ``/generate`` greedy with ``return_routed_experts``: routes decode to
     ``(prompt + completion - 1, moe_layers, top_k)`` with ids in ``[0, num_experts)``;
  4. a 1-process ``MegatronTrainer`` on the same checkpoint perturbs its weights and sends them
     over NCCL with ``BroadcastTransport`` (``/init_weights_update_group`` +
     ``/update_weights_from_distributed``, flattened buckets); the engine reports the new
     ``weight_version`` and greedy output changes;
  5. shutdown: no server process left.
Exit code 0 when every step passed. Importing this module starts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback


class Checks:
    def __init__(self):
        self.results: list[tuple[str, bool, float, str]] = []

    def run(self, name, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
            ok, note = True, ""
        except Exception as e:  # report and go on to the summary
            out, ok, note = None, False, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        dt = time.perf_counter() - t0
        self.results.append((name, ok, dt, note))
        print(f"[{'PASS' if ok else 'FAIL'}] {name} ({dt:.1f}s) {note}", flush=True)
        if not ok:
            raise SystemExit(self.summary())
        return out

    def summary(self) -> int:
        bad = [r for r in self.results if not r[1]]
        print(f"gpu_check: {len(self.results) - len(bad)}/{len(self.results)} passed; "
              f"{'PASS' if not bad else 'FAIL'}", flush=True)
        return 1 if bad else 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model-dir", default=None, help="cache dir for the random MoE")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from moe_async.engines.base import make_engine
    from moe_async.engines.client import SyncEngineClient
    from moe_async.engines.config import EngineConfig
    from moe_async.models.config import ModelConfig
    from moe_async.models.prepare import prepare_hf_checkpoint

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check", flush=True)
        return 2
    ck = Checks()
    mc = ModelConfig(source="random_moe", num_layers=2, hidden_size=256, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2, num_experts=4, top_k=2,
                     max_position_embeddings=1024, cache_dir=args.model_dir)
    path = str(ck.run("make tiny random MoE", lambda: prepare_hf_checkpoint(mc)))
    ec = EngineConfig(backend="sglang", dtype="bf16", max_running_requests=8,
                      startup_timeout_s=args.startup_timeout,
                      sglang_args={"mem_fraction_static": args.mem_fraction, "disable_cuda_graph": True})
    eng = make_engine(ec, path, args.port)
    try:
        ck.run("launch sglang server", eng.launch)
        c = SyncEngineClient(eng.url, timeout_s=120, moe_layers=mc.num_layers, top_k=mc.top_k)
        prompt = list(range(10, 30))
        sp = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}

        def gen():
            o = c.generate(prompt, sp, return_routed_experts=True)
            n = len(prompt) + len(o.output_ids) - 1
            assert o.routed_experts is not None and o.routed_experts.shape == (n, mc.num_layers, mc.top_k), \
                (None if o.routed_experts is None else o.routed_experts.shape)
            assert 0 <= o.routed_experts.min() and o.routed_experts.max() < mc.num_experts
            assert len(o.output_logprobs) == len(o.output_ids) == 16
            return o

        before = ck.run("generate with routed experts", gen)

        def update():
            from moe_async.trainer.config import TrainerConfig
            from moe_async.trainer.megatron_trainer import MegatronTrainer
            from moe_async.weight_sync.config import WeightSyncConfig
            from moe_async.weight_sync.transport import BroadcastTransport

            trainer = MegatronTrainer(TrainerConfig(), path)
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            tr = BroadcastTransport([c], WeightSyncConfig(backend="nccl", bucket_bytes=64 << 20))
            t0 = time.perf_counter()
            tr.connect()
            t1 = time.perf_counter()
            stats = tr.send(trainer.export_hf_weights(), weight_version=1)
            t2 = time.perf_counter()
            print(f"  connect {t1 - t0:.2f}s, send {t2 - t1:.2f}s, stats {stats}", flush=True)
            assert c.get_weight_version() == 1, c.get_weight_version()
            tr.close()
            trainer.close()

        ck.run("NCCL weight update from MegatronTrainer", update)

        def after():
            o = c.generate(prompt, sp, return_routed_experts=True)
            assert o.weight_version == 1, o.weight_version
            print(f"  greedy output changed: {o.output_ids != before.output_ids}", flush=True)
            return o

        ck.run("generate on the new weights", after)
    finally:
        pid = eng.proc.pid if eng.proc is not None else None
        eng.shutdown()
    if pid is not None:
        def no_orphan():
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            raise AssertionError(f"process group {pid} still has processes")

        ck.run("shutdown leaves no process", no_orphan)
    return ck.summary()


if __name__ == "__main__":
    sys.exit(main())
