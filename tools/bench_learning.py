"""Benchmark: does moe-async learn the demo's task as well as a reference GRPO trainer?

Runs the CPU demo's task, prompts, reward and model (configs/cpu_demo.yaml: reasoning-gym
basic_arithmetic, one-shot chat prompt, exact-match reward, SmolLM2-135M upcycled to 4
experts top-2) under moe-async (``moe-async train``, a fresh process) and under Hugging Face
TRL's ``GRPOTrainer`` (``pip install trl==1.16.0``), with matched settings:

=========================  ===========================================  ==========================
setting                    moe-async override                           TRL GRPOConfig
=========================  ===========================================  ==========================
group size G               rollout.n_samples_per_prompt                 num_generations
prompts per step B         rollout.prompts_per_step                     per_device_train_batch_size = B*G
learning rate              trainer.lr (constant)                        learning_rate, constant schedule
Adam                       betas (0.9, 0.98), eps 1e-8, no decay        adam_beta2=0.98, weight_decay=0
grad clip                  trainer.clip_grad 1.0                        max_grad_norm=1.0
temperature, top-p/k       rollout.temperature, top_p 1, top_k off      temperature, top_p=1, top_k=0
response length            rollout.max_new_tokens                       max_completion_length
KL                         none (no reference model)                    beta=0
loss                       per-token mean over the batch, clip          loss_type='dapo', epsilon 0.2,
                           [0.8, 1.28]                                  epsilon_high 0.28
advantages                 (r - mean_g) / (std_g + eps)                 scale_rewards='group'
MoE aux loss               trainer.moe_aux_loss_coeff (0.001)           router_aux_loss_coef (0.001)
samples                    steps x B x G trained (dynamic filter off)   steps x B x G
=========================  ===========================================  ==========================

moe-async keeps its own mode (``--mode``, default the demo's fully_async K=1 with TIS) and
evaluates with its held-out curve (``rollout.eval_interval`` = steps: step 0 and the last
step, on its engine); TRL's model is evaluated before and after by this script with
``transformers`` ``generate`` on the same held-out problems (greedy, and k samples at the
training temperature with top-k off), scored by the same exact-match scorer. Both report
greedy accuracy and mean@k with standard errors over problems and the paired gain
(moe_async.rollout.evaluation). The train prompts are the dataset's own order in both.
Absolute numbers on a shared CPU mean little: the two gains and the wall-time ratio, measured
in the same invocation, are the result.

    .venv/bin/python tools/bench_learning.py                   # demo settings, 24 steps each
    .venv/bin/python tools/bench_learning.py --lr 5e-6 --steps 24 --json out.json
    .venv/bin/python tools/bench_learning.py --only trl        # one side

Exit status 1 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_async.rollout.evaluation import paired_gains, summarize  # noqa: E402


def overrides(a: argparse.Namespace) -> list[str]:
    """The config overrides both sides share (applied to configs/cpu_demo.yaml)."""
    return [f"num_steps={a.steps}", f"seed={a.seed}", f"trainer.lr={a.lr}",
            f"rollout.prompts_per_step={a.prompts}", f"rollout.n_samples_per_prompt={a.group}",
            f"rollout.max_new_tokens={a.max_new_tokens}", f"rollout.eval_max_new_tokens={a.max_new_tokens}",
            f"rollout.temperature={a.temperature}", f"rollout.eval_k={a.k}",
            f"rollout.dynamic_filter={'true' if a.filter else 'false'}", f"rollout.eval_size={a.eval_size}"]


def run_moe_async(a: argparse.Namespace, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    k = 0 if a.mode == "sync" else a.staleness
    cmd = [sys.executable, "-m", "moe_async.cli", "train", str(ROOT / a.config), *overrides(a),
           f"async.mode={a.mode}", f"async.max_staleness={k}",
           f"rollout.eval_interval={a.eval_interval or a.steps}",
           "eval_before=false", "eval_after=false", f"logging.output_dir={out}", *a.set]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError("moe-async run failed:\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    s = json.loads((run_dir / "summary.json").read_text())
    curve = s["eval_curve"]
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] >= 1]
    gain = {k: v for k, v in curve[-1].items() if k.endswith(("_gain", "_gain_se"))}  # paired, vs step 0
    return {"before": curve[0], "after": curve[-1], "gain": gain, "curve": curve, "wall_s": wall,
            "train_s": s["perf"]["loop_seconds"], "steps": len(steps),
            "samples_trained": s["buffer"]["samples_trained"],
            "samples_generated": s["rollout"]["rollout/samples_generated"],
            "reward_generated": [m.get("rollout/reward_mean_generated_step") for m in steps],
            "run_dir": str(run_dir)}


def hf_evaluate(model, tok, ds, k: int, max_new: int, temperature: float, chunk: int = 16) -> dict:
    """Greedy + ``k`` sampled responses per held-out problem with ``generate`` (left padding,
    stop at eos), scored by the dataset's exact-match scorer: :func:`summarize`'s dict."""
    import torch

    probs = ds.eval_problems()
    prompts = [ds.build_prompt_ids(p) for p in probs]

    def gen(ids_list: list[list[int]], sample: bool, n: int) -> list[list[str]]:
        outs = []
        for i in range(0, len(ids_list), chunk):
            part = ids_list[i:i + chunk]
            L = max(map(len, part))
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            x = torch.tensor([[pad] * (L - len(p)) + p for p in part])
            att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in part])
            kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
            with torch.no_grad():
                y = model.generate(input_ids=x, attention_mask=att, max_new_tokens=max_new, num_return_sequences=n,
                                   eos_token_id=tok.eos_token_id, pad_token_id=pad, **kw)
            texts = [tok.decode(r[L:], skip_special_tokens=True) for r in y]
            outs += [texts[j * n:(j + 1) * n] for j in range(len(part))]
        return outs

    was_training = model.training
    model.eval()
    greedy = [ds.score(p, t[0]) for p, t in zip(probs, gen(prompts, False, 1))]
    sampled = [[ds.score(p, x) for x in t] for p, t in zip(probs, gen(prompts, True, k))]
    model.train(was_training)
    return summarize(greedy, sampled)


def run_trl(a: argparse.Namespace, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from moe_async.config import load_config
    from moe_async.models.prepare import load_tokenizer, prepare_hf_checkpoint
    from moe_async.rollout.tasks import TaskDataset

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    cfg = load_config(ROOT / a.config, overrides(a))
    path = str(prepare_hf_checkpoint(cfg.model))
    tok = load_tokenizer(path)
    ds = TaskDataset(cfg.rollout, tok)
    n_prompts = a.steps * a.prompts
    probs = [ds.next_train() for _ in range(n_prompts)]  # the order moe-async draws them in
    train = Dataset.from_list([{"prompt": ds.messages(p), "index": p.index} for p in probs])

    def exact_match(prompts, completions, index, **kw):
        return [ds.score(ds.train[i], c[0]["content"] if isinstance(c, list) else c)
                for c, i in zip(completions, index)]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    t0 = time.perf_counter()
    before = hf_evaluate(model, tok, ds, a.k, a.max_new_tokens, a.temperature)
    t_eval = time.perf_counter() - t0
    args = GRPOConfig(
        output_dir=str(out / "trl"), learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=a.prompts * a.group, gradient_accumulation_steps=1,
        num_generations=a.group, max_completion_length=a.max_new_tokens, temperature=a.temperature,
        top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group", num_iterations=1, max_steps=a.steps, shuffle_dataset=False,
        router_aux_loss_coef=cfg.trainer.moe_aux_loss_coeff, logging_steps=1, report_to=[],
        save_strategy="no", seed=a.seed, use_cpu=True, bf16=False, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match], args=args, train_dataset=train,
                          processing_class=tok)
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    hist = [h for h in trainer.state.log_history if "reward" in h]
    after = hf_evaluate(trainer.model, tok, ds, a.k, a.max_new_tokens, a.temperature)
    gain = paired_gains(after.pop("per_problem"), before.pop("per_problem"))
    return {"before": before, "after": after, "gain": gain, "train_s": train_s, "eval_s": t_eval, "steps": trainer.state.global_step,
            "samples_trained": trainer.state.global_step * a.prompts * a.group,
            "reward_generated": [h["reward"] for h in hist]}


def _row(name: str, r: dict) -> str:
    b, f = r["before"], r["after"]
    g = r["gain"]
    return (f"{name:>9} | {r['steps']:>3} steps {r['samples_trained']:>5} samples {r['train_s']:>6.0f} s train"
            f" | greedy {b['eval/greedy_accuracy']:.3f} -> {f['eval/greedy_accuracy']:.3f}"
            f" ({g['eval/greedy_accuracy_gain']:+.3f} +- {g['eval/greedy_accuracy_gain_se']:.3f})"
            f" | mean@{f['eval/k']:.0f} {b['eval/mean_at_k']:.3f} -> {f['eval/mean_at_k']:.3f}"
            f" ({g['eval/mean_at_k_gain']:+.3f} +- {g['eval/mean_at_k_gain_se']:.3f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/cpu_demo.yaml")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--prompts", type=int, default=4, help="B: prompts per step")
    p.add_argument("--group", type=int, default=4, help="G: samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--k", type=int, default=4, help="samples per held-out problem for mean@k")
    p.add_argument("--eval-size", type=int, default=48, help="held-out problems (the demo's 48)")
    p.add_argument("--eval-interval", type=int, default=0, help="moe-async's curve every N steps (0: start and end)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--mode", default="fully_async", choices=["sync", "one_step_off", "fully_async"])
    p.add_argument("--staleness", type=int, default=1, help="K for fully_async")
    p.add_argument("--filter", action="store_true", help="keep moe-async's dynamic filtering (more samples generated)")
    p.add_argument("--only", choices=["moe", "trl"], default=None)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the TRL run")
    p.add_argument("--set", action="append", default=[], help="extra moe-async override")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    res: dict = {"settings": vars(a)}
    with tempfile.TemporaryDirectory(prefix="bench_learning_") as tmp:
        for name, fn in (("moe-async", run_moe_async), ("trl", run_trl)):
            if a.only and not name.startswith(a.only):
                continue
            try:
                r = fn(a, Path(tmp) / name.replace("-", "_"))
            except Exception as e:  # noqa: BLE001 - report and fail
                print(f"[bench_learning] {name} failed: {e}", file=sys.stderr)
                return 1
            res[name] = r
            print(_row(name, r), flush=True)
    if "moe-async" in res and "trl" in res:
        m, t = res["moe-async"], res["trl"]
        res["ratios"] = {
            "mean_at_k_gain_moe_minus_trl": m["gain"]["eval/mean_at_k_gain"] - t["gain"]["eval/mean_at_k_gain"],
            "train_seconds_moe_over_trl": m["train_s"] / t["train_s"],
        }
        print(f"moe-async - TRL mean@k gain: {res['ratios']['mean_at_k_gain_moe_minus_trl']:+.3f}; "
              f"train wall time moe-async / TRL: {res['ratios']['train_seconds_moe_over_trl']:.2f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
