"""deepseek_v3 through MegatronTrainer in ONE fresh process (Megatron parallel state and the
CPU compat layer are process-global); prints a JSON dict of results on the last line.

For each variant (q_lora_rank 32 untied / None tied): logprob parity with HF (fp32), the same
routed experts (and weights) on every token of every MoE layer, export == checkpoint, and one
train step that moves the weights (expert bias kept: update rate 0)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))

import torch  # noqa: E402
from _routes import hf_logprobs_and_routes, megatron_logprobs_and_routes  # noqa: E402
from _tiny_deepseek_v3 import make_tiny_deepseek_v3  # noqa: E402
from _trainer_checks import samples  # noqa: E402

from moe_async.trainer.config import TrainerConfig  # noqa: E402
from moe_async.trainer.megatron_trainer import MegatronTrainer  # noqa: E402


def hf_run(path, ss):
    """HF logprobs of the response tokens and, per sample, per MoE layer, the routed expert
    sets and weights of every token."""
    from transformers import DeepseekV3ForCausalLM

    return hf_logprobs_and_routes(DeepseekV3ForCausalLM.from_pretrained(path).eval(), ss)


def megatron_routes(tr, ss):
    return megatron_logprobs_and_routes(tr, ss, moe_layers=2)


def main(tmp: str) -> None:
    res: dict = {}
    ss = samples()
    for name, kw in (("qlora", dict(q_lora_rank=32, tie=False)), ("noqlora", dict(q_lora_rank=None, tie=True, rms_norm_eps=1e-2, rope_interleave=False))):
        path = make_tiny_deepseek_v3(os.path.join(tmp, name), **kw)
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=1, moe_aux_loss_coeff=0.0, lr=1e-3), path)
        mine, mroutes = megatron_routes(tr, ss)
        ref, hroutes = hf_run(path, ss)
        res[f"parity_maxdiff_{name}"] = max(abs(a - b) for x, y in zip(mine, ref) for a, b in zip(x, y))
        res[f"ref_logp_min_{name}"] = min(min(x) for x in ref)
        res[f"lens_ok_{name}"] = [len(x) for x in mine] == [len(s.response_ids) for s in ss]
        same, total, wdiff, bias_flips = 0, 0, 0.0, 0
        for s, hr, mr in zip(ss, hroutes, mroutes):
            assert sorted(hr) == sorted(mr), (sorted(hr), sorted(mr))
            for k in hr:
                idx, w = hr[k]
                probs, rmap = mr[k]
                # one sequence per micro-batch, right-padded to at least 64 positions:
                # the router's first rows are the sample's tokens
                assert rmap.shape[0] >= idx.shape[0], (rmap.shape, idx.shape)
                probs, rmap = probs[: idx.shape[0]], rmap[: idx.shape[0]]
                for t in range(idx.shape[0]):
                    total += 1
                    hs = set(idx[t].tolist())
                    ms = set(torch.nonzero(rmap[t]).flatten().tolist())
                    same += hs == ms
                    for j, e in enumerate(idx[t].tolist()):
                        wdiff = max(wdiff, abs(float(w[t, j]) - float(probs[t, e])))
        res[f"routes_same_{name}"] = (same, total)
        res[f"route_weight_maxdiff_{name}"] = wdiff
        # the bias must matter: routing on the plain sigmoid scores would differ somewhere
        from transformers import DeepseekV3ForCausalLM

        hm = DeepseekV3ForCausalLM.from_pretrained(path)
        res[f"bias_nonzero_{name}"] = all(
            float(l.mlp.gate.e_score_correction_bias.abs().min()) > 0 for l in hm.model.layers[1:]
        )
        for l in hm.model.layers[1:]:
            l.mlp.gate.e_score_correction_bias.zero_()
        _, r0 = hf_run_model(hm, ss)
        res[f"bias_changes_routes_{name}"] = any(
            not torch.equal(torch.sort(r0[i][k][0], -1)[0], torch.sort(hroutes[i][k][0], -1)[0])
            for i in range(len(ss)) for k in hroutes[i]
        )
        exported = dict(tr.export_hf_weights())
        from safetensors.torch import load_file

        disk = load_file(os.path.join(path, "model.safetensors"))
        res[f"export_equals_disk_{name}"] = set(exported) == set(disk) and all(
            torch.equal(exported[k], disk[k]) for k in disk
        )
        before = tr.hf_checksums()
        m = tr.train_step(ss, [1.0, -0.5, 0.7, -1.2, 3.0])
        after = tr.hf_checksums()
        res[f"step_{name}"] = {k: m[k] for k in ("loss", "grad_norm", "num_tokens")}
        res[f"unchanged_{name}"] = sorted(k for k in before if before[k] == after[k])
        res[f"n_tensors_{name}"] = len(before)
        tr.close()
    # MoE aux loss (load-balancing on the sigmoid scores) reaches the loss and the gradients
    tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.01, lr=1e-3), path)
    res["aux_step"] = {k: v for k, v in tr.train_step(ss, [1.0, -0.5, 0.7, -1.2, 3.0]).items()
                       if k in ("loss", "pg_loss", "moe_aux_loss", "grad_norm")}
    tr.close()
    # bf16 params: the expert bias stays an fp32 buffer and exports bit-exactly
    tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3, params_dtype="bf16"), path)
    res["bf16_bias_dtypes"] = sorted({str(b.dtype) for n, b in tr.model.named_buffers() if n.endswith("expert_bias")})
    ex = dict(tr.export_hf_weights())
    res["bf16_bias_export_exact"] = all(
        ex[k].dtype == torch.float32 and torch.equal(ex[k], disk[k]) for k in disk if k.endswith("e_score_correction_bias")
    )
    tr.close()
    # aux-loss-free load balancing (trainer.moe_router_bias_update_rate): after one step every MoE
    # router's bias moved by rate * sign(mean count - count), where count[e] = the batch's real
    # (non-padding) tokens routed to expert e. Reference counts: HF's routes of the same tokens with
    # the same (pre-step) weights (shown equal above). Micro-batches of 1 and of 2 sequences (all
    # padded to 64 positions: 263 vs 135 padding rows) must give the same update.
    rate = 0.01
    b1 = {}
    for mbs in (1, 2):
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=mbs, moe_aux_loss_coeff=0.0, lr=1e-3,
                                           moe_router_bias_update_rate=rate), path)
        b0 = {k: v.clone() for k, v in tr.export_hf_weights() if k.endswith("e_score_correction_bias")}
        tr.train_step(ss, [1.0, -0.5, 0.7, -1.2, 3.0])
        b1[mbs] = {k: v.clone() for k, v in tr.export_hf_weights() if k.endswith("e_score_correction_bias")}
        tr.close()
    exact, moved = True, 0
    for k in sorted(b0):
        layer = int(k.split(".")[2])
        E = b0[k].numel()
        count = torch.zeros(E, dtype=torch.float32)
        for r in hroutes:
            count += torch.bincount(r[layer][0].flatten(), minlength=E).float()
        expected = b0[k] + torch.sign(count.sum() / E - count) * rate
        exact &= torch.equal(b1[2][k], expected) and torch.equal(b1[1][k], expected)
        moved += int((b1[2][k] != b0[k]).sum())
    res["bias_update"] = {"exact": exact, "moved": moved, "n": sum(v.numel() for v in b0.values()),
                          "tokens": int(sum(len(s.prompt_ids) + len(s.response_ids) for s in ss))}
    # a family without a router expert bias refuses a non-zero rate, naming the field
    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    from _tiny import make_tiny_mixtral

    mx = make_tiny_mixtral(os.path.join(tmp, "mixtral"))
    try:
        MegatronTrainer(TrainerConfig(moe_router_bias_update_rate=rate), mx)
        res["bias_rate_refused"] = ""
    except ValueError as e:
        res["bias_rate_refused"] = str(e)
    print(json.dumps(res))


def hf_run_model(m, ss):
    return None, hf_logprobs_and_routes(m, ss)[1]


if __name__ == "__main__":
    main(sys.argv[1])
