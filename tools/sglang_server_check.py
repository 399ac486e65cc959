"""GPU smoke check: one SGLang server, generate with routed experts, one weight update.

On a GPU machine with ``sglang`` installed (``pip install sglang==0.5.23``):

    python tools/sglang_server_check.py [--port 30000] [--model-dir DIR] [--transport auto|tensor|nccl]

NOT YET RUN ON A GPU in its colocated (``tensor``) form: written and tested on CPU only
(argument parsing and transport choice: tests/tools/test_sglang_server_check.py).

Steps (each printed PASS/FAIL with its time):
  1. make a tiny random Mixtral-style MoE (``moe_async.models.prepare``, source=random_moe);
  2. launch ``python -m sglang.launch_server`` on it (``SGLangEngine``, GPU 0, routed-expert
     capture on) and wait for ``/health``;
  3. ``/generate`` greedy with ``return_routed_experts``: routes decode to
     ``(prompt + completion - 1, moe_layers, top_k)`` with ids in ``[0, num_experts)``;
  4. a 1-process ``MegatronTrainer`` on the same checkpoint (cuda:0) perturbs its weights and
     sends them. One GPU visible (``--transport auto``): trainer and engine share cuda:0, and
     NCCL refuses two ranks on one device, so ``TensorTransport`` sends each bucket as
     ``/update_weights_from_tensor`` (CUDA IPC handles); two or more GPUs: the engine runs on
     cuda:1 and ``BroadcastTransport`` sends over NCCL (``/init_weights_update_group`` +
     ``/update_weights_from_distributed``). Either way flattened buckets, the version on the
     last one; the engine reports the new ``weight_version``;
  5. a few tensors read back with SGLang's ``/get_weights_by_name`` (first rows) equal the
     trainer's exported values cast to the engine dtype (a name the model class cannot
     serve, e.g. SGLang's Mixtral has no ``get_weights_by_name``: ``skip``, not pass);
  6. greedy output on the new weights (version 1);
  7. shutdown: no server process left.
The last line printed is one JSON object ``{step name: {"result": "pass"|"fail"|"skip",
"seconds": s, "note": ...}}``. Exit code 0 when no step failed. Importing this module
starts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


#: HF names SGLang keeps under the same name (not fused into qkv_proj / gate_up_proj / w13)
COMPARE_NAMES = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.block_sparse_moe.gate.weight")


class SkipCheck(Exception):
    """Raised by a step that could not check anything (reported as ``skip``, not a failure)."""


class Checks:
    def __init__(self):
        self.results: list[tuple[str, str, float, str]] = []

    def run(self, name, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
            result, note = "pass", ""
        except SkipCheck as e:
            out, result, note = None, "skip", str(e)
        except Exception as e:  # report and go on to the summary
            out, result, note = None, "fail", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        dt = time.perf_counter() - t0
        self.results.append((name, result, dt, note))
        print(f"[{result.upper()}] {name} ({dt:.1f}s) {note}", flush=True)
        if result == "fail":
            raise SystemExit(self.summary())
        return out

    def summary(self) -> int:
        bad = [r for r in self.results if r[1] == "fail"]
        passed = sum(r[1] == "pass" for r in self.results)
        print(f"sglang_server_check: {passed}/{len(self.results)} passed; {'PASS' if not bad else 'FAIL'}", flush=True)
        print(json.dumps({n: {"result": r, "seconds": round(dt, 3), **({"note": note} if note else {})}
                          for n, r, dt, note in self.results}), flush=True)
        return 1 if bad else 0


def pick_transport(requested: str, n_gpus: int) -> tuple[str, int]:
    """``(transport, engine_gpu)``: ``tensor`` with the engine on the trainer's cuda:0 when one
    GPU is visible (``auto``), ``nccl`` with the engine on cuda:1 when two or more are.

    Raises:
        ValueError: ``nccl`` asked with fewer than 2 GPUs (NCCL refuses two ranks on one
            device), or no GPU at all.
    """
    if n_gpus < 1:
        raise ValueError("no CUDA device visible")
    if requested == "auto":
        requested = "nccl" if n_gpus >= 2 else "tensor"
    if requested == "nccl":
        if n_gpus < 2:
            raise ValueError(f"--transport nccl needs 2 GPUs (trainer cuda:0, engine cuda:1), {n_gpus} visible: "
                             f"NCCL refuses two ranks on one device; use --transport tensor")
        return "nccl", 1
    return "tensor", 0


def compare_weights(reply_of, exported: dict, dtype, rows: int) -> dict[str, str]:
    """``{name: "equal" | "unsupported" | "differs: ..."}`` for each of ``exported`` (HF name ->
    the trainer's tensor): ``reply_of(name)`` is SGLang's ``/get_weights_by_name`` answer (the
    first ``rows`` rows as nested lists, or None when the model class cannot serve it),
    compared exactly with the exported rows cast to the engine ``dtype``."""
    import torch

    out = {}
    for name, t in exported.items():
        got = reply_of(name)
        if got is None:
            out[name] = "unsupported"
            continue
        want = t[:rows].to(dtype).float().cpu()
        have = torch.tensor(got, dtype=torch.float32).reshape(want.shape)
        out[name] = "equal" if torch.equal(have, want) else \
            f"differs: max abs diff {(have - want).abs().max().item():.3g}"
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model-dir", default=None, help="cache dir for the random MoE")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--transport", choices=("auto", "tensor", "nccl"), default="auto",
                    help="trainer->engine update: tensor (colocated, /update_weights_from_tensor), nccl "
                         "(/update_weights_from_distributed, needs 2 GPUs); auto: by the visible GPUs")
    ap.add_argument("--compare-rows", type=int, default=4, help="rows read back per tensor (>= 1)")
    args = ap.parse_args(argv)
    if args.compare_rows < 1:
        ap.error(f"--compare-rows must be >= 1, got {args.compare_rows}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from moe_async.engines.base import make_engine
    from moe_async.engines.client import SyncEngineClient
    from moe_async.engines.config import EngineConfig
    from moe_async.models.config import ModelConfig
    from moe_async.models.prepare import prepare_hf_checkpoint

    if not torch.cuda.is_available():
        print("sglang_server_check: no CUDA device; nothing to check", flush=True)
        return 2
    transport, engine_gpu = pick_transport(args.transport, torch.cuda.device_count())
    print(f"sglang_server_check: {torch.cuda.device_count()} GPU(s): transport {transport}, engine on cuda:{engine_gpu}, "
          f"trainer on cuda:0", flush=True)
    ck = Checks()
    mc = ModelConfig(source="random_moe", num_layers=2, hidden_size=256, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2, num_experts=4, top_k=2,
                     max_position_embeddings=1024, cache_dir=args.model_dir)
    path = str(ck.run("make tiny random MoE", lambda: prepare_hf_checkpoint(mc)))
    ec = EngineConfig(backend="sglang", dtype="bf16", max_running_requests=8,
                      startup_timeout_s=args.startup_timeout,
                      sglang_args={"mem_fraction_static": args.mem_fraction, "disable_cuda_graph": True,
                                   "base_gpu_id": engine_gpu})
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

        exported: dict = {}

        def update():
            from moe_async.trainer.config import TrainerConfig
            from moe_async.trainer.megatron_trainer import MegatronTrainer
            from moe_async.weight_sync.config import WeightSyncConfig
            from moe_async.weight_sync.tensor_transport import TensorTransport
            from moe_async.weight_sync.transport import BroadcastTransport

            trainer = MegatronTrainer(TrainerConfig(), path)
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            if transport == "tensor":
                tr = TensorTransport([c], WeightSyncConfig(transport="tensor", bucket_bytes=64 << 20))
            else:
                tr = BroadcastTransport([c], WeightSyncConfig(backend="nccl", bucket_bytes=64 << 20))

            def recorded():
                for n, t in trainer.export_hf_weights():
                    if n in COMPARE_NAMES:
                        exported[n] = t.detach()[: args.compare_rows].clone()
                    yield n, t

            t0 = time.perf_counter()
            tr.connect()
            t1 = time.perf_counter()
            stats = tr.send(recorded(), weight_version=1)
            t2 = time.perf_counter()
            print(f"  {type(tr).__name__}: connect {t1 - t0:.2f}s, send {t2 - t1:.2f}s, stats {stats}", flush=True)
            assert c.get_weight_version() == 1, c.get_weight_version()
            tr.shutdown()
            trainer.close()

        ck.run(f"{transport} weight update from MegatronTrainer", update)

        def readback():
            from moe_async.engines.client import EngineRequestError

            dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[ec.dtype]

            def reply_of(name):
                try:
                    return c._request("POST", "/get_weights_by_name",
                                      {"name": name, "truncate_size": args.compare_rows}, retry=None).json()
                except EngineRequestError as e:  # SGLang: None from the model -> an error response
                    if "Get parameter by name failed" in str(e):
                        return None
                    raise

            res = compare_weights(reply_of, exported, dtype, args.compare_rows)
            print(f"  /get_weights_by_name: {res}", flush=True)
            bad = {n: v for n, v in res.items() if v.startswith("differs")}
            assert exported and not bad, bad or "no tensor recorded"
            if all(v == "unsupported" for v in res.values()):
                raise SkipCheck(f"the engine's model class serves none of {sorted(res)} by name")

        ck.run("weights read back equal the trainer's", readback)

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
