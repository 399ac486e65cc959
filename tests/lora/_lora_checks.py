"""LoRA trainer checks in ONE process per layout (Megatron parallel state is process-global);
rank 0 prints a JSON dict of results on the last line and writes it to TMP/res_<layout>.json.

    python _lora_checks.py TMP                      1 process (TP1)
    torchrun --nproc_per_node 2 _lora_checks.py TMP tp2|ep2|pp2|cp2 the same checks at TP2, EP2, PP2 or CP2

Checks on a tiny Mixtral (adapters on q/k/v/o and per-expert gate_up/down, rank 4, alpha 8):
base logprobs (no LoRA) vs LoRA logprobs at init (B = 0: must be equal exactly); one optimizer
step (lr 1e-2); the base weights unchanged (HF checksums); the exported PEFT adapter loaded by
``peft`` onto the HF model gives the trainer's logprobs; the optimizer holds adapter
parameters only.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402
from _checks import hf_response_logprobs, samples  # noqa: E402
from _tiny import make_tiny_mixtral  # noqa: E402

LENS = [(5, 7), (3, 6), (8, 4), (4, 9)]
ADV = [1.0, -0.5, 0.7, -1.2]


def main(tmp: str, layout: str) -> None:
    from moe_async.lora.config import LoraConfig
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    sizes = {"tp1": {}, "tp2": dict(tensor_model_parallel_size=2), "ep2": dict(expert_model_parallel_size=2),
             "pp2": dict(pipeline_model_parallel_size=2), "cp2": dict(context_parallel_size=2)}[layout]
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # once, so the trainers built here do not own it
        import torch.distributed as dist

        dist.init_process_group("gloo")
    path = os.path.join(tmp, "mix")
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_mixtral(path, tie=False)
    ss = samples(0, LENS)
    common = dict(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-2, clip_grad=1e9, **sizes)
    res: dict = {}
    base = MegatronTrainer(TrainerConfig(**common), path)
    base_lp = base.compute_logprobs(ss)
    base.close()
    lcfg = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], experts="per_expert")
    tr = MegatronTrainer(TrainerConfig(lora=lcfg, **common), path)
    init_lp = tr.compute_logprobs(ss)
    res["init_maxdiff"] = max(abs(a - b) for x, y in zip(init_lp, base_lp) for a, b in zip(x, y))
    n_adapter = sum(p.numel() for m in tr.models for n, p in m.named_parameters() if p.requires_grad)
    n_opt = sum(p.numel() for g in tr.optimizer.param_groups for p in g["params"])
    res["adapter_numel"], res["optimizer_numel"] = n_adapter, n_opt
    res["n_adapted"] = sum(len(x) for x in tr.lora_linears)
    out_dir = os.path.join(tmp, f"adapter_{layout}")
    tr.export_lora(out_dir)  # B = 0; replaced below by the trained adapter (as a run's end does)
    before = tr.hf_checksums()
    m = tr.train_step(ss, ADV)
    res["grad_norm"] = m["grad_norm"]
    after = tr.hf_checksums()
    res["base_changed"] = sum(before[k] != after[k] for k in before)
    step_lp = tr.compute_logprobs(ss)
    res["step_moved"] = max(abs(a - b) for x, y in zip(step_lp, init_lp) for a, b in zip(x, y))
    tensors = tr.export_lora(out_dir, replace=True)
    res["n_peft_tensors"] = len(tensors)
    res["peft_numel"] = sum(t.numel() for t in tensors.values())  # what the adapter sync sends
    # the export written into the caller's tensors (the adapter sync's shared-memory slots): the
    # same values, the caller's objects, and no exported tensor shares memory with a parameter
    slots = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    into = tr.export_lora(out=lambda n, shape, dtype: slots[n] if n != sorted(slots)[0] else None)
    res["export_into_out"] = (sorted(into) == sorted(tensors) and all(torch.equal(into[k], tensors[k]) for k in tensors)
                              and sum(into[k] is slots[k] for k in slots) == len(slots) - 1)
    params = {p.untyped_storage().data_ptr() for m in tr.models for p in m.parameters()}
    res["export_aliases_params"] = sum(t.untyped_storage().data_ptr() in params for t in [*tensors.values(), *into.values()])
    merged_dir = os.path.join(tmp, f"merged_{layout}")
    res["merged_files"] = tr.export_merged(merged_dir)
    tr.close()
    if rank == 0:
        from peft import PeftModel
        from safetensors.torch import load_file
        from transformers import MixtralForCausalLM

        mask = os.umask(0)
        os.umask(mask)
        res["file_modes_ok"] = all(os.stat(os.path.join(out_dir, n)).st_mode & 0o777 == 0o666 & ~mask
                                   for n in ("adapter_model.safetensors", "adapter_config.json"))
        res["tmp_left"] = os.path.exists(out_dir + ".tmp")
        hf = MixtralForCausalLM.from_pretrained(path).eval()
        pm = PeftModel.from_pretrained(hf, out_dir).eval()
        ref = hf_response_logprobs(pm, ss)
        res["peft_maxdiff"] = max(abs(a - b) for x, y in zip(step_lp, ref) for a, b in zip(x, y))
        sd = load_file(os.path.join(out_dir, "adapter_model.safetensors"))
        # every saved tensor is one PEFT placed (equal to the loaded module's parameter)
        from peft import get_peft_model_state_dict

        loaded = get_peft_model_state_dict(pm)
        res["peft_keys_match"] = sorted(sd) == sorted(loaded) and all(torch.equal(sd[k], loaded[k]) for k in sd)
        res["b_nonzero"] = sum(int(v.abs().max() > 0) for k, v in sd.items() if "lora_B" in k)
        # merged export: the HF checkpoint loads without peft and is peft's merge_and_unload()
        merged = MixtralForCausalLM.from_pretrained(merged_dir).eval()
        res["merged_lp_maxdiff"] = max(abs(a - b) for x, y in zip(step_lp, hf_response_logprobs(merged, ss))
                                       for a, b in zip(x, y))
        ref_merged = PeftModel.from_pretrained(MixtralForCausalLM.from_pretrained(path), out_dir).merge_and_unload()
        got, want = merged.state_dict(), ref_merged.state_dict()
        base_sd = MixtralForCausalLM.from_pretrained(path).state_dict()
        res["merged_keys_match"] = sorted(got) == sorted(want)
        res["merged_vs_peft_maxdiff"] = max(float((got[k] - want[k]).abs().max()) for k in want)
        res["merged_changed"] = sum(not torch.equal(got[k], base_sd[k]) for k in base_sd)
        ids = torch.tensor([ss[0].prompt_ids + ss[0].response_ids])
        with torch.no_grad():
            res["merged_logits_maxdiff"] = float((merged(ids).logits - pm(ids).logits).abs().max())
        res["n_b"] = sum("lora_B" in k for k in sd)
        with open(os.path.join(tmp, f"res_{layout}.json"), "w") as f:
            json.dump(res, f)
        print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tp1")
