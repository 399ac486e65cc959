"""Real checkpoints for tests/trainer/test_ckpt_shapes.py, in ONE fresh process (Megatron state is
process-global): ``_ckpt_shapes_checks.py TMP OUT.json``.

Per tiny family (mixtral, qwen3_moe, llama, deepseek_v3): a MegatronTrainer checkpoint, the
model keys it holds, the keys ckpt_shapes expects of the same HF config and of a resized one,
and their first shape difference. Then two cpu_smoke-sized random_moe checkpoints under
TMP/smoke_same/step_0 and TMP/smoke_other/step_0 (intermediate_size 128 as the smoke config,
and 96), for resolve_checkpoint."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "models"))

import torch  # noqa: E402
from _checks import trainer_cfg  # noqa: E402
from _tiny import make_tiny_llama, make_tiny_mixtral, make_tiny_qwen3_moe  # noqa: E402
from _tiny_deepseek_v3 import make_tiny_deepseek_v3  # noqa: E402

# family -> (maker, the HF field changed for "another model", its value)
FAMILIES = {
    "mixtral": (make_tiny_mixtral, "intermediate_size", 96),
    "qwen3_moe": (make_tiny_qwen3_moe, "num_local_experts", 8),
    "llama": (make_tiny_llama, "hidden_size", 128),
    "deepseek_v3": (make_tiny_deepseek_v3, "moe_intermediate_size", 16),
}


def main(tmp: str, out: str) -> None:
    from moe_async.trainer.ckpt_shapes import (first_shape_difference, megatron_shapes, saved_tensor_shapes,
                                               torch_dist_shapes)
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.megatron.sharding import padded_vocab_size

    res: dict = {}
    for fam, (make, field, value) in FAMILIES.items():
        path = make(os.path.join(tmp, fam))
        tcfg = trainer_cfg()
        tr = MegatronTrainer(tcfg, path)
        ck = os.path.join(tmp, f"{fam}_ck")
        tr.save_checkpoint(ck)
        tr.close()
        hf = json.load(open(os.path.join(path, "config.json")))
        rows = padded_vocab_size(hf["vocab_size"], 1, tcfg.make_vocab_size_divisible_by)
        saved = saved_tensor_shapes(ck)
        same = torch_dist_shapes(megatron_shapes(hf), rows)
        other = torch_dist_shapes(megatron_shapes({**hf, field: value}), rows)
        res[fam] = {"saved_not_expected": sorted(set(saved) - set(same)), "n_saved": len(saved),
                    "same_diff": first_shape_difference(saved, same),
                    "other_diff": first_shape_difference(saved, other)}

    from moe_async.models.config import ModelConfig
    from moe_async.models.prepare import build_random_moe

    for name, inter in (("smoke_same", 128), ("smoke_other", 96)):
        mc = ModelConfig(source="random_moe", num_layers=2, hidden_size=64, intermediate_size=inter,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, top_k=2,
                         max_position_embeddings=512)
        hf_dir = os.path.join(tmp, f"{name}_hf")
        build_random_moe(mc).save_pretrained(hf_dir)
        tr = MegatronTrainer(trainer_cfg(vocab_div=None), hf_dir)
        tr.save_checkpoint(os.path.join(tmp, name, "step_0"))
        tr.close()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
