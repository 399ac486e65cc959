"""deepseek_v3 at parallel layouts (CPU/gloo). ONE process per world size.

    python _deepseek_v3_layouts.py ref TMP            tiny 4-layer checkpoint (first dense) +
        1-process reference (HF logprobs, Megatron logprobs, 2 train steps) -> TMP/ref.json
    torchrun --nproc_per_node W _deepseek_v3_layouts.py run TMP OUT.json LAYOUT...
        LAYOUT = tp{t}pp{p}ep{e}: logprobs, export == checkpoint, 2 train steps -> OUT.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

ADV = [1.0, -0.5, 0.7, -1.2, 3.0, 0.4, -0.9, 1.5]


def samples(seed: int = 0):
    from moe_async.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate([(5, 7), (3, 6), (8, 4), (4, 9), (6, 5), (7, 6), (2, 8), (5, 5)]):
        ids = torch.randint(3, 256, (p + r,), generator=g).tolist()
        rl = (-torch.rand(r, generator=g) * 6).tolist()
        out.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], rollout_logprobs=rl,
                          weight_versions=[0] * r, loss_weight=0.0 if i == 4 else 1.0))
    return out


def cfg(tp=1, pp=1, ep=1):
    from moe_async.trainer.config import TrainerConfig

    return TrainerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         expert_model_parallel_size=ep, micro_batch_size=2, moe_aux_loss_coeff=0.0,
                         lr=1e-3, make_vocab_size_divisible_by=96)


def run(path: str, tp: int, pp: int, ep: int) -> dict:
    from safetensors.torch import load_file

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    ss = samples()
    tr = MegatronTrainer(cfg(tp, pp, ep), path)
    res = {"logp": tr.compute_logprobs(ss)}
    exported = dict(tr.export_hf_weights())
    if exported:
        disk = load_file(os.path.join(path, "model.safetensors"))
        res["export_equals_disk"] = set(exported) == set(disk) and all(torch.equal(exported[k], disk[k]) for k in disk)
    res["steps"] = [{k: m[k] for k in ("loss", "grad_norm")} for m in (tr.train_step(ss, ADV), tr.train_step(ss, ADV))]
    tr.close()
    return res


def main() -> None:
    mode, tmp = sys.argv[1], sys.argv[2]
    path = os.path.join(tmp, "ds3")
    if mode == "ref":
        from _tiny_deepseek_v3 import make_tiny_deepseek_v3

        make_tiny_deepseek_v3(path, num_hidden_layers=4)
        from transformers import DeepseekV3ForCausalLM

        m = DeepseekV3ForCausalLM.from_pretrained(path).eval()
        hf = []
        with torch.no_grad():
            for s in samples():
                ids = s.prompt_ids + s.response_ids
                lp = m(torch.tensor([ids])).logits[0].float().log_softmax(-1)
                P = len(s.prompt_ids)
                hf.append([lp[P - 1 + j, ids[P + j]].item() for j in range(len(s.response_ids))])
        out = {"hf_logp": hf, "tp1pp1ep1": run(path, 1, 1, 1)}
        with open(os.path.join(tmp, "ref.json"), "w") as f:
            json.dump(out, f)
        return
    import torch.distributed as dist

    out_path, layouts = sys.argv[3], sys.argv[4:]
    dist.init_process_group("gloo")  # once: the trainers (one per layout) then do not own it
    out = {}
    for lay in layouts:
        tp, rest = lay[2:].split("pp")
        pp, ep = rest.split("ep")
        out[lay] = run(path, int(tp), int(pp), int(ep))
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
