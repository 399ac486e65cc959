"""Router replay benchmark: train/inference mismatch with replay off vs R3, and the training
step time overhead of replay, measured in the same run on the same data.

Data path: experiment config (tiny random MoE, or e.g. configs/cpu_demo.yaml with real
weights) -> HF checkpoint -> the embedded engine (a real server process; ``--engine-dtype``,
bf16 by default so that engine and trainer differ numerically as they do on GPUs) generates
``--prompts`` x ``--samples`` rollouts with logprobs and routed experts -> stored compact
(``Sample.routed_experts``) -> ONE MegatronTrainer (fp32) runs ``--reps`` train steps per
mode, alternating off / R3 on the same batch. The learning rate is tiny (1e-12) so every step
sees the same weights: the mismatch metrics of the two modes are directly comparable and the
time ratio is R3 / off (medians).

Usage::

    python tools/bench_replay.py                         # tiny random MoE
    python tools/bench_replay.py --config configs/cpu_demo.yaml --prompts 4 --samples 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="experiment YAML (default: tiny random MoE)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--engine-dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--reps", type=int, default=5, help="train steps per mode")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    torch.set_num_threads(1)
    from moe_async.config import load_config
    from moe_async.engines.base import make_engine
    from moe_async.engines.client import EngineClient
    from moe_async.engines.config import EngineConfig
    from moe_async.models.prepare import load_tokenizer, prepare_hf_checkpoint
    from moe_async.replay.routes import engine_routes, route_bytes_per_token
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.types import Sample

    overrides = [] if args.config else ["model.source=random_moe"]
    cfg = load_config(args.config, overrides)
    path = str(prepare_hf_checkpoint(cfg.model))
    hf = json.load(open(os.path.join(path, "config.json")))
    E = int(hf.get("num_local_experts") or hf.get("num_experts"))

    # ---- prompts: the config's task when available, else random token ids
    g = np.random.default_rng(args.seed)
    try:
        from moe_async.rollout.tasks import TaskDataset

        ds = TaskDataset(cfg.rollout, load_tokenizer(path))
        prompts = [ds.build_prompt_ids(ds.next_train()) for _ in range(args.prompts)]
        prompt_src = cfg.rollout.task
    except Exception as exc:  # noqa: BLE001 - the benchmark still runs on random prompts
        print(f"(task prompts unavailable: {exc!r}; random token prompts)", file=sys.stderr)
        prompts = [g.integers(3, min(hf["vocab_size"], 5000), 16).tolist() for _ in range(args.prompts)]
        prompt_src = "random"

    # ---- rollouts from the embedded engine
    ecfg = EngineConfig(dtype=args.engine_dtype, num_threads=1, max_running_requests=64, startup_timeout_s=300)
    eng = make_engine(ecfg, path, 0)
    eng.launch()
    t0 = time.perf_counter()
    try:
        client = EngineClient(eng.url, timeout_s=600)

        async def gen():
            sp = dict(max_new_tokens=args.max_new, temperature=1.0, top_p=1.0)
            reqs = [
                client.generate(p, dict(sp, sampling_seed=args.seed + 1000 * i + j), return_logprob=True,
                                return_routed_experts=True)
                for i, p in enumerate(prompts) for j in range(args.samples)
            ]
            return await asyncio.gather(*reqs)

        outs = asyncio.run(gen())
    finally:
        eng.shutdown()
    gen_s = time.perf_counter() - t0
    samples = []
    for k, o in enumerate(outs):
        p = prompts[k // args.samples]
        n = len(p) + len(o.output_ids)
        samples.append(Sample(prompt_ids=list(p), response_ids=list(o.output_ids),
                              rollout_logprobs=list(o.output_logprobs),
                              weight_versions=[0] * len(o.output_ids),
                              routed_experts=engine_routes(o.routed_experts, n, num_experts=E),
                              loss_weight=1.0 if o.output_ids else 0.0))
    r0 = samples[0].routed_experts
    L, K = r0.shape[1], r0.shape[2]
    bytes_per_tok = sum(s.routed_experts.nbytes for s in samples) / sum(s.routed_experts.shape[0] for s in samples)
    adv = g.standard_normal(len(samples)).tolist()

    # ---- one trainer, alternating modes on the same batch and (effectively) the same weights
    tcfg = cfg.trainer.model_copy(update=dict(lr=1e-12, lr_warmup_steps=0, micro_batch_size=args.micro_batch_size,
                                              router_replay="off", num_threads=1))
    tr = MegatronTrainer(tcfg, path)
    per: dict[str, list[dict]] = {"off": [], "R3": []}
    # time spent inside the replay hook itself (packing routes, padding, setting targets)
    hook, hook_s = tr.router_replay, {"t": 0.0}

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                hook_s["t"] += time.perf_counter() - t
        return wrapper

    hook.pack, hook.before_forward, hook.add_logprobs = (
        timed(hook.pack), timed(hook.before_forward), timed(hook.add_logprobs))
    tr.train_step(samples, adv)  # warm-up (allocations, first-call overheads)
    for _ in range(args.reps):
        for mode in ("off", "R3"):
            hook.mode = mode
            hook_s["t"] = 0.0
            m = tr.train_step(samples, adv)
            m["hook_s"] = hook_s["t"]
            per[mode].append(m)
    tr.close()

    keys = ("mismatch_logp_absdiff_mean", "mismatch_logp_absdiff_max", "mismatch_kl_k3",
            "mismatch_ratio_gt2_frac", "routing_agreement", "kl_k3", "tis_mean")
    res = {
        "model": cfg.model.source, "config": args.config or "tiny random_moe",
        "prompts": prompt_src, "num_samples": len(samples),
        "response_tokens": int(sum(len(s.response_ids) for s in samples)),
        "moe_layers": L, "top_k": K, "experts": E, "engine_dtype": args.engine_dtype,
        "route_dtype": str(r0.dtype), "route_bytes_per_token": bytes_per_tok,
        "route_bytes_bound": L * K, "route_bytes_per_token_sample0": route_bytes_per_token(r0),
        "gen_s": gen_s,
    }
    for mode, ms in per.items():
        res[mode] = {k: ms[0][k] for k in keys if k in ms[0]}
        res[mode]["agreement_per_layer"] = [ms[0][f"routing_agreement_l{j}"] for j in range(L)
                                            if f"routing_agreement_l{j}" in ms[0]]
        res[mode]["step_time_s_median"] = statistics.median(m["step_time_s"] for m in ms)
        res[mode]["step_times_s"] = [m["step_time_s"] for m in ms]
        res[mode]["hook_s_median"] = statistics.median(m["hook_s"] for m in ms)
    res["step_time_ratio_R3_over_off"] = res["R3"]["step_time_s_median"] / res["off"]["step_time_s_median"]
    res["hook_share_of_step_R3"] = res["R3"]["hook_s_median"] / res["R3"]["step_time_s_median"]
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
