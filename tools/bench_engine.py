"""Decode throughput: the embedded engine (server process, HTTP) vs plain transformers generate().

Same model, same batch, same run: N prompts of P tokens, M new tokens each (greedy,
ignore_eos). transformers: one ``model.generate`` call on the left-padded batch. Engine: the
N requests sent concurrently to ``python -m moe_async.engines.embedded.server`` on loopback
(continuous batching). Prints tokens/s of both and engine / transformers (goal >= 1.0).

    python tools/bench_engine.py --num-prompts 16 --new-tokens 64 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--model-path", default=None, help="HF dir (default: a random tiny MoE)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    from moe_async.engines.base import make_engine
    from moe_async.engines.client import EngineClient
    from moe_async.engines.config import EngineConfig

    torch.set_num_threads(args.threads)
    path = args.model_path
    if path is None:
        from moe_async.models.config import ModelConfig
        from moe_async.models.prepare import prepare_hf_checkpoint

        mc = ModelConfig(source="random_moe", num_layers=args.num_layers, hidden_size=args.hidden_size,
                         intermediate_size=2 * args.hidden_size, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512,
                         cache_dir=os.path.join(tempfile.gettempdir(), "moe_async_bench"))
        path = str(prepare_hf_checkpoint(mc))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(10, vocab, (args.num_prompts, args.prompt_len), generator=g).tolist()
    N, M = args.num_prompts, args.new_tokens

    # transformers generate(): one padded batch (equal lengths here: no padding)
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), do_sample=False,
                       max_new_tokens=2, pad_token_id=0)  # warm-up
        t0, c0 = time.perf_counter(), time.thread_time()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=M, min_new_tokens=M, pad_token_id=0)
        hf_s, hf_cpu = time.perf_counter() - t0, time.thread_time() - c0
    hf_tokens = (out.shape[1] - ids.shape[1]) * N
    del model

    cfg = EngineConfig(num_threads=args.threads, max_running_requests=N, startup_timeout_s=300)
    eng = make_engine(cfg, path).launch()
    try:
        sp = {"temperature": 0.0, "max_new_tokens": M, "ignore_eos": True}

        async def run():
            async with EngineClient(eng.url, timeout_s=600) as c:
                await c.generate(prompts[0][:4], {**sp, "max_new_tokens": 2})  # warm-up
                info0 = (await c._http.get("/server_info")).json().get("scheduler_stats")
                t0 = time.perf_counter()
                outs = await asyncio.gather(*[c.generate(p, sp, return_logprob=True) for p in prompts])
                dt = time.perf_counter() - t0
                info1 = (await c._http.get("/server_info")).json().get("scheduler_stats")
                stats = {k: round(info1[k] - info0[k], 3) for k in info1} if info0 and info1 else {}
                return outs, dt, stats

        outs, eng_s, stats = asyncio.run(run())
    finally:
        eng.shutdown()
    eng_tokens = sum(len(o.output_ids) for o in outs)
    same = sum(o.output_ids == row[args.prompt_len:].tolist() for o, row in zip(outs, out))
    hf_tps, eng_tps = hf_tokens / hf_s, eng_tokens / eng_s
    print(f"model: {path}")
    print(f"batch: {N} prompts x {args.prompt_len} tokens, {M} new tokens, {args.threads} thread(s)")
    print(f"transformers generate(): {hf_tokens} tokens in {hf_s:.2f}s = {hf_tps:.1f} tok/s")
    print(f"embedded engine (HTTP):  {eng_tokens} tokens in {eng_s:.2f}s = {eng_tps:.1f} tok/s")
    print(f"ratio engine/transformers: {eng_tps / hf_tps:.2f} (goal >= 1.0); "
          f"greedy outputs identical for {same}/{N} prompts")
    if stats:
        # CPU seconds of the thread running the model: steadier than wall time on a shared host
        eng_cpu = stats["decode_cpu_s"] + stats["prefill_cpu_s"]
        print(f"engine scheduler: {stats}")
        print(f"cpu: transformers {hf_cpu:.2f}s, engine scheduler thread {eng_cpu:.2f}s, "
              f"ratio (transformers cpu / engine cpu) {hf_cpu / eng_cpu:.2f}")


if __name__ == "__main__":
    main()
