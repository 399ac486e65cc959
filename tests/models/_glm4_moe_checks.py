"""glm4_moe through MegatronTrainer in ONE fresh process (Megatron parallel state and the CPU
compat layer are process-global); prints a JSON dict of results on the last line.

On the tiny C26 checkpoint (tests/models/_tiny_glm4_moe.py: partial rotary 0.5, first layer
dense, 4 routed + 1 shared expert top-2, q/k/v bias, q/k norm, non-zero fp32 router bias, an
MTP block ``model.layers.2`` on disk): logprob parity with HF (fp32), the same routed experts
and weights on every token, the logprobs of a Megatron model rotating the WHOLE head
(rotary_percent 1.0), export == checkpoint minus the MTP block, one train step, bf16 params
with the expert bias kept fp32."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import _checks  # noqa: E402
import torch  # noqa: E402
from _routes import hf_logprobs_and_routes, megatron_logprobs_and_routes  # noqa: E402
from _tiny_glm4_moe import make_tiny_glm4_moe  # noqa: E402

from moe_async.trainer.config import TrainerConfig  # noqa: E402
from moe_async.trainer.megatron_trainer import MegatronTrainer  # noqa: E402
from moe_async.types import Sample  # noqa: E402

ADV = [1.0, -0.5, 0.7, -1.2, 3.0]


def samples(seed: int = 0) -> list[Sample]:
    """5 samples (57 tokens, 31 response tokens of which 26 weighted), ids in [3, 128)."""
    return _checks.samples(seed, [(5, 7), (3, 6), (8, 4), (4, 9), (6, 5)], vocab=128)


def hf_run(m, ss):
    """HF logprobs of the response tokens and, per sample, per MoE layer, (indices, weights)."""
    return hf_logprobs_and_routes(m, ss)


def megatron_routes(tr, ss):
    return megatron_logprobs_and_routes(tr, ss, moe_layers=1)


def maxdiff(a, b) -> float:
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))


def main(tmp: str) -> None:
    from safetensors.torch import load_file
    from transformers import Glm4MoeForCausalLM

    from moe_async.models import get_family
    from moe_async.models.glm4_moe import Glm4MoeFamily

    res: dict = {}
    ss = samples()
    path = make_tiny_glm4_moe(os.path.join(tmp, "glm"))
    disk = load_file(os.path.join(path, "model.safetensors"))
    fam = get_family("glm4_moe")
    mtp = set(fam.mtp_hf_keys(fam.arch_args(path)))
    res["mtp_on_disk"] = len(mtp & set(disk))
    hm = Glm4MoeForCausalLM.from_pretrained(path).eval()
    ref, hroutes = hf_run(hm, ss)
    res["ref_logp_min"] = min(min(x) for x in ref)

    tr = MegatronTrainer(TrainerConfig(micro_batch_size=1, moe_aux_loss_coeff=0.0, lr=1e-3), path)
    res["rotary_dims"] = int(tr.model.rotary_pos_emb.inv_freq.numel()) * 2
    res["router_dtype"] = tr.tf_config.moe_router_dtype
    mine, mroutes = megatron_routes(tr, ss)
    res["parity_maxdiff"] = maxdiff(mine, ref)
    res["lens_ok"] = [len(x) for x in mine] == [len(s.response_ids) for s in ss]
    same, total, wdiff = 0, 0, 0.0
    for hr, mr in zip(hroutes, mroutes):
        assert sorted(hr) == sorted(mr) == [1], (sorted(hr), sorted(mr))
        idx, w = hr[1]
        probs, rmap = mr[1]
        probs, rmap = probs[: idx.shape[0]], rmap[: idx.shape[0]]  # the sample's tokens come first
        for t in range(idx.shape[0]):
            total += 1
            same += set(idx[t].tolist()) == set(torch.nonzero(rmap[t]).flatten().tolist())
            for j, e in enumerate(idx[t].tolist()):
                wdiff = max(wdiff, abs(float(w[t, j]) - float(probs[t, e])))
    res["routes_same"] = (same, total)
    res["route_weight_maxdiff"] = wdiff
    # the bias is live: HF routing on the plain sigmoid scores differs somewhere
    for layer in hm.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    _, r0 = hf_run(hm, ss)
    res["bias_changes_routes"] = any(not torch.equal(torch.sort(r0[i][1][0], -1)[0], torch.sort(hroutes[i][1][0], -1)[0])
                                     for i in range(len(ss)))
    exported = dict(tr.export_hf_weights())
    res["export_keys_ok"] = set(exported) == set(disk) - mtp
    res["export_equals_disk"] = all(torch.equal(exported[k], disk[k]) for k in exported)
    res["export_bias_dtype"] = str(exported["model.layers.1.mlp.gate.e_score_correction_bias"].dtype)
    before = tr.hf_checksums()
    m = tr.train_step(ss, ADV)
    after = tr.hf_checksums()
    res["step"] = {k: m[k] for k in ("loss", "grad_norm", "num_tokens")}
    res["unchanged"] = sorted(k for k in before if before[k] == after[k])
    res["n_tensors"] = len(before)
    tr.close()

    # rotating the whole head (Megatron rotary_percent 1.0) instead of its first half
    orig = Glm4MoeFamily.gpt_model_kwargs

    def rotate_all(self, hf_config):
        return {**orig(self, hf_config), "rotary_percent": 1.0}

    Glm4MoeFamily.gpt_model_kwargs = rotate_all
    try:
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=1, moe_aux_loss_coeff=0.0, lr=1e-3), path)
        res["rotate_all_dims"] = int(tr.model.rotary_pos_emb.inv_freq.numel()) * 2
        res["rotate_all_maxdiff"] = maxdiff(tr.compute_logprobs(ss), ref)
        tr.close()
    finally:
        Glm4MoeFamily.gpt_model_kwargs = orig

    # bf16 params: the expert bias stays an fp32 buffer and exports bit-exactly
    tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3, params_dtype="bf16"), path)
    res["bf16_bias_dtypes"] = sorted({str(b.dtype) for n, b in tr.model.named_buffers() if n.endswith("expert_bias")})
    res["bf16_router_dtype"] = tr.tf_config.moe_router_dtype
    ex = dict(tr.export_hf_weights())
    res["bf16_bias_export_exact"] = all(ex[k].dtype == torch.float32 and torch.equal(ex[k], disk[k])
                                        for k in ex if k.endswith("e_score_correction_bias"))
    tr.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
