"""Training throughput: the Megatron trainer's GRPO step vs a plain ``transformers`` step.

Same model, same batch, same threads, same run, interleaved and repeated:

* **Megatron**: :meth:`MegatronTrainer.train_step` (packing, Megatron's forward/backward
  schedule over micro-batches, GRPO loss with truncated IS, MoE aux loss, DDP grad buffer,
  Megatron Adam with grad-norm clipping).
* **transformers**: ``AutoModelForCausalLM`` in train mode; per micro-batch of the same
  ``micro_batch_size`` right-padded sequences: forward (``output_router_logits``: the
  per-layer router logits come back for Megatron's load-balancing loss, ``HFStep.aux_loss``),
  fp32 log-softmax, the same
  :func:`moe_async.trainer.loss.grpo_token_loss` divided by the batch's token count plus
  ``aux_coeff x aux / num_microbatches``, backward; then ``clip_grad_norm_`` and
  ``torch.optim.AdamW.step``.

The trainer applies its output layer to the response positions only (prompt positions carry
no loss); the plain step computes logits everywhere, as a plain forward does.

Tokens/s = (prompt + response tokens of the batch) / step wall time. The step order
alternates each repeat (ABBA...), the first step of each is a warm-up and not counted;
prints both medians and the median of the per-repeat ratios Megatron / transformers (goal
>= 1.0).

Default: the CPU demo's model (configs/cpu_demo.yaml ``model``: SmolLM2-135M upcycled to a
4-expert top-2 Mixtral, made once and cached by :func:`prepare_hf_checkpoint`) and the demo's
batch (16 samples = 4 prompts x 4, the chat-templated one-shot basic_arithmetic prompts,
32 response tokens; micro-batch 4; trainer threads 2).

    python tools/bench_trainer.py                       # the demo model, ~12 GB RAM
    python tools/bench_trainer.py --num-layers 6 --repeats 3   # first 6 layers only
    python tools/bench_trainer.py --packing thd                # packed THD micro-batches
    python tools/bench_trainer.py --packing thd --min-new-tokens 4   # variable response lengths

    python tools/bench_trainer.py --recompute                  # with and without full recompute

``--recompute``: the Megatron step also runs with Megatron-Core's full activation recompute
(``recompute_granularity='full'``, uniform, 1 layer; switched on the same trainer between steps,
the same weights) and prints its tokens/s, the ratio recompute / no recompute (same run,
interleaved) and the peak saved activations of each (:class:`SavedActivationMeter`).

``--packing`` sets the Megatron trainer's ``trainer.sequence_packing`` (padded / thd / auto); the
transformers step always right-pads each micro-batch to its longest sequence, as ``generate``
batches are. Tokens/s counts real tokens either way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def truncated_checkpoint(src: str, num_layers: int, out: str) -> str:
    """Copy of the HF checkpoint ``src`` keeping only decoder layers ``< num_layers``."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(src, "config.json")) as f:
        conf = json.load(f)
    if num_layers > conf["num_hidden_layers"]:
        raise ValueError(f"--num-layers {num_layers} > num_hidden_layers {conf['num_hidden_layers']} of {src}")
    conf["num_hidden_layers"] = num_layers
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and not name.endswith(".json") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, name), out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f)
    keep = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(src, name), framework="pt") as h:
                for k in h.keys():
                    if k.startswith("model.layers.") and int(k.split(".")[2]) >= num_layers:
                        continue
                    keep[k] = h.get_tensor(k)
    save_file(keep, os.path.join(out, "model.safetensors"))
    return out


def demo_batch(n_prompts: int, n_per_prompt: int, new_tokens: int, vocab: int, seed: int = 0,
               min_new_tokens: int | None = None):
    """The demo's batch shape: chat-templated one-shot basic_arithmetic prompts (real
    tokenizer), ``new_tokens`` random response tokens each (with ``min_new_tokens``: a length
    drawn uniformly from ``[min_new_tokens, new_tokens]`` per sample, as responses stopping at
    EOS), random rollout logprobs in [-3, 0], group advantages +-1."""
    import torch

    from moe_async.config import load_config
    from moe_async.models.prepare import load_smollm2_tokenizer
    from moe_async.rollout.tasks import TaskDataset
    from moe_async.types import Sample

    here = os.path.dirname(os.path.abspath(__file__))
    cfg = load_config(os.path.join(here, "..", "configs", "cpu_demo.yaml"))
    ds = TaskDataset(cfg.rollout, load_smollm2_tokenizer())
    g = torch.Generator().manual_seed(seed)
    samples, adv = [], []
    for _ in range(n_prompts):
        prompt = ds.build_prompt_ids(ds.next_train())
        for j in range(n_per_prompt):
            n = new_tokens
            if min_new_tokens is not None:
                n = int(torch.randint(min_new_tokens, new_tokens + 1, (1,), generator=g))
            resp = torch.randint(3, vocab, (n,), generator=g).tolist()
            rl = (-torch.rand(n, generator=g) * 3).tolist()
            samples.append(Sample(prompt_ids=prompt, response_ids=resp, rollout_logprobs=rl,
                                  weight_versions=[0] * n))
            adv.append(1.0 if j % 2 == 0 else -1.0)
    return samples, adv


class HFStep:
    """The plain transformers reference step (see the module docstring)."""

    def __init__(self, path: str, cfg, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.config.output_router_logits = cfg.moe_aux_loss_coeff > 0
        self.model.config.router_aux_loss_coef = cfg.moe_aux_loss_coeff
        self.model.train()
        self.top_k = self.model.config.num_experts_per_tok
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                     eps=cfg.adam_eps, weight_decay=cfg.weight_decay)

    def aux_loss(self, router_logits):
        """Megatron's load-balancing loss (moe_utils.switch_load_balancing_loss_func, aux_loss
        type), summed over layers: per layer ``E * sum_i f_i * P_i`` with ``f_i`` = tokens
        routed to expert i / (T * k), ``P_i`` = mean softmax probability of expert i over the
        T tokens (padding included, as Megatron routes it). ``router_logits``: per layer
        ``[T, E]``. (transformers' own ``aux_loss`` pools all layers into one product.)"""
        import torch

        tot = 0.0
        for lg in router_logits:
            probs = torch.softmax(lg.float(), -1)
            T, E = probs.shape
            counts = torch.zeros(E).index_add_(0, lg.topk(self.top_k, -1).indices.flatten(), torch.ones(T * self.top_k))
            tot = tot + E * (counts / (T * self.top_k) * probs.mean(0)).sum()
        return tot

    def step(self, samples, advantages) -> dict:
        import torch

        from moe_async.trainer.loss import grpo_token_loss

        cfg = self.cfg
        mbs = cfg.micro_batch_size
        chunks = [range(i, min(i + mbs, len(samples))) for i in range(0, len(samples), mbs)]
        n_total = sum(len(s.response_ids) for s in samples if s.loss_weight > 0)
        tot = 0.0
        for idx in chunks:
            S = max(len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in idx)
            B = len(idx)
            ids = torch.zeros(B, S, dtype=torch.long)
            att = torch.zeros(B, S, dtype=torch.long)
            mask, adv, rlp = torch.zeros(B, S - 1), torch.zeros(B, S - 1), torch.zeros(B, S - 1)
            for b, i in enumerate(idx):
                s = samples[i]
                P, R = len(s.prompt_ids), len(s.response_ids)
                ids[b, : P + R] = torch.tensor(s.prompt_ids + s.response_ids)
                att[b, : P + R] = 1
                mask[b, P - 1 : P - 1 + R] = s.loss_weight
                adv[b, P - 1 : P - 1 + R] = advantages[i]
                rlp[b, P - 1 : P - 1 + R] = torch.tensor(s.rollout_logprobs)
            out = self.model(input_ids=ids, attention_mask=att)
            logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss_sum, _ = grpo_token_loss(logp, adv, mask, rollout_logp=rlp, eps_clip=cfg.eps_clip,
                                          eps_clip_high=cfg.eps_clip_high,
                                          off_policy_correction=cfg.off_policy_correction, tis_cap=cfg.tis_cap)
            loss = loss_sum / n_total
            if cfg.moe_aux_loss_coeff > 0:
                loss = loss + cfg.moe_aux_loss_coeff * self.aux_loss(out.router_logits) / len(chunks)
            loss.backward()
            tot += float(loss)
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"loss": tot, "grad_norm": float(gn)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="HF dir (default: the CPU demo's upcycled SmolLM2 MoE)")
    ap.add_argument("--num-layers", type=int, default=0, help="keep only the first N decoder layers (0: all)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples-per-prompt", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--min-new-tokens", type=int, default=None,
                    help="response lengths drawn uniformly from [this, --new-tokens] per sample (default: all "
                         "--new-tokens; variable lengths are where packed THD micro-batches save padding)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both (the demo trainer's)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps of each, after one warm-up each")
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of one Megatron step here")
    ap.add_argument("--packing", choices=("auto", "padded", "thd", "both"), default=None,
                    help="trainer.sequence_packing of the Megatron trainer (default: the config's, 'auto'); "
                         "'both': one trainer built for thd runs padded and thd steps in turn (same run, "
                         "same model), each timed against the transformers step; the transformers step "
                         "always right-pads")
    ap.add_argument("--recompute", action="store_true",
                    help="also time the Megatron step with full activation recompute (uniform, 1 layer)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra TrainerConfig fields for the Megatron trainer (repeatable)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch
    import yaml

    from moe_async.trainer.config import TrainerConfig

    torch.set_num_threads(args.threads)
    path = args.model_path
    if path is None:
        from moe_async.config import load_config
        from moe_async.models.prepare import prepare_hf_checkpoint

        here = os.path.dirname(os.path.abspath(__file__))
        path = str(prepare_hf_checkpoint(load_config(os.path.join(here, "..", "configs", "cpu_demo.yaml")).model))
    tmp = None
    if args.num_layers:
        tmp = tempfile.TemporaryDirectory(prefix="bench_trainer_")
        path = truncated_checkpoint(path, args.num_layers, tmp.name)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    samples, adv = demo_batch(args.prompts, args.samples_per_prompt, args.new_tokens, vocab,
                              min_new_tokens=args.min_new_tokens)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)

    extra = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        extra[k] = yaml.safe_load(v)
    if args.packing is not None:
        extra["sequence_packing"] = "thd" if args.packing == "both" else args.packing
    # the demo trainer's settings (configs/cpu_demo.yaml: lr, aux coeff, TIS cap, threads)
    cfg = TrainerConfig(lr=1e-5, micro_batch_size=args.micro_batch_size, moe_aux_loss_coeff=0.001,
                        off_policy_correction="tis", tis_cap=2.0, num_threads=args.threads,
                        **extra)
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    hf = HFStep(path, cfg, args.threads)
    meg = MegatronTrainer(cfg, path)
    torch.set_num_threads(args.threads)

    # --packing both: the thd-built trainer also runs padded micro-batches (its CPU THD core
    # attention is the local one without packed_seq_params; TE's takes both); batcher.thd selects
    # Batcher.pack's layout per step
    kinds = ["padded", "thd"] if args.packing == "both" else ["thd" if meg.batcher.thd else "padded"]
    if args.recompute:
        if len(kinds) > 1:
            ap.error("--recompute runs with one packing (not --packing both)")
        kinds.append(kinds[0] + "+recompute")

    def run_meg(kind=kinds[0], meter=None):
        meg.batcher.thd = kind.startswith("thd")
        # Megatron's TransformerBlock reads the full-recompute setting at each forward
        full = kind.endswith("+recompute")
        meg.tf_config.recompute_granularity = "full" if full else None
        meg.tf_config.recompute_method = "uniform" if full else None
        meg.tf_config.recompute_num_layers = 1 if full else None
        t0 = time.perf_counter()
        if meter is not None:
            with meter:
                m = meg.train_step(samples, adv)
        else:
            m = meg.train_step(samples, adv)
        return time.perf_counter() - t0, m

    def run_hf():
        t0 = time.perf_counter()
        m = hf.step(samples, adv)
        return time.perf_counter() - t0, m

    from moe_async.trainer.activation_meter import SavedActivationMeter

    peaks = {}
    for kind in kinds:
        meter = SavedActivationMeter([p for m in meg.models for p in m.parameters()])
        w_meg, m0 = run_meg(kind, meter)
        peaks[kind] = meter.peak_bytes
        print(f"warm-up: megatron ({kind}) {w_meg:.2f} s (loss {m0['loss']:.5f}, grad_norm {m0['grad_norm']:.4f}, "
              f"peak saved activations {meter.peak_bytes / 2**20:.1f} MiB)", flush=True)
    w_hf, h0 = run_hf()
    print(f"warm-up: transformers {w_hf:.2f} s (loss {h0['loss']:.5f}, grad_norm {h0['grad_norm']:.4f})", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            meg.train_step(samples, adv)
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            hf.step(samples, adv)
        with open(args.profile + ".hf", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
    t_meg = {k: [] for k in kinds}
    t_hf, ratios = [], {k: [] for k in kinds}
    for r in range(args.repeats):
        # rotate the order (ABBA... with one trainer; ABC, BCA, CAB with both packings)
        order = ["hf", *kinds]
        if len(order) == 2:
            order = order[::-1] if r % 2 == 0 else order
        else:
            order = order[r % 3:] + order[:r % 3]
        got = {}
        for what in order:
            got[what] = run_hf()[0] if what == "hf" else run_meg(what)[0]
        b = got["hf"]
        t_hf.append(b)
        line = []
        for k in kinds:
            t_meg[k].append(got[k])
            ratios[k].append(b / got[k])
            line.append(f"megatron ({k}) {tokens / got[k]:.1f} tok/s ({got[k]:.2f} s, ratio {b / got[k]:.3f})")
        print(f"repeat {r}: " + ", ".join(line) + f", transformers {tokens / b:.1f} tok/s ({b:.2f} s)", flush=True)
    res = {
        "model": path if tmp is None else f"{args.model_path or 'demo'} (first {args.num_layers} layers)",
        "tokens_per_step": tokens, "samples": len(samples), "micro_batch_size": args.micro_batch_size,
        "padded_positions_per_step": sum(len(samples[i : i + args.micro_batch_size]) * max(
            len(s.prompt_ids) + len(s.response_ids) for s in samples[i : i + args.micro_batch_size])
            for i in range(0, len(samples), args.micro_batch_size)),
        "threads": args.threads, "dtype": "fp32", "sequence_packing": cfg.sequence_packing,
        "sequence_packing_run": "both" if args.packing == "both" else kinds[0],
        "transformers_tok_s": tokens / statistics.median(t_hf),
    }
    for k in kinds:
        sfx = "" if len(kinds) == 1 else f"_{k}"
        res[f"megatron_tok_s{sfx}"] = tokens / statistics.median(t_meg[k])
        res[f"ratio_median{sfx}"] = statistics.median(ratios[k])
        res[f"ratios{sfx}"] = ratios[k]
    if args.packing == "both":
        res["thd_over_padded_median"] = statistics.median(p / t for p, t in zip(t_meg["padded"], t_meg["thd"]))
    if args.recompute:
        base, rc = kinds
        res["recompute_over_none_tok_s_median"] = statistics.median(b / r for b, r in zip(t_meg[base], t_meg[rc]))
        res["peak_saved_activations_bytes"] = peaks
    print(json.dumps(res))
    for k in kinds:
        sfx = "" if len(kinds) == 1 else f"_{k}"
        print(f"megatron ({k}) / transformers tokens/s (median of {args.repeats}): {res['ratio_median' + sfx]:.3f}")
    if args.packing == "both":
        print(f"megatron thd / padded tokens/s (median of {args.repeats}): {res['thd_over_padded_median']:.3f}")
    if args.recompute:
        print(f"megatron full recompute / no recompute tokens/s (median of {args.repeats}): "
              f"{res['recompute_over_none_tok_s_median']:.3f}; peak saved activations "
              f"{peaks[kinds[1]] / 2**20:.1f} MiB vs {peaks[kinds[0]] / 2**20:.1f} MiB")
    meg.close()
    if tmp is not None:
        tmp.cleanup()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
