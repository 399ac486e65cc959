"""The LoRA adapters of a tiny DeepSeek-V3 (MLA) in ONE CPU process (Megatron parallel state is
process-global); prints a JSON dict on the last line:

    python _lora_ds3_counts.py TMP

The model: tests/models/_tiny_deepseek_v3.py's with ``v_head_dim`` 24, so MLA's o projection
takes 4 x 24 = 96 inputs, not the hidden 64. Adapters on all seven PEFT targets (rank 4, one per
routed expert); ``adapter_numel``: the trainer's adapter parameters (TP1), ``peft_numel`` /
``peft_shapes``: the PEFT tensors its export writes (what the adapter sync sends), ``hf_config``:
the checkpoint's config.json for the plan's count.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "models"))

import torch  # noqa: E402
from _tiny_deepseek_v3 import make_tiny_deepseek_v3  # noqa: E402

RANK = 4


def main(tmp: str) -> None:
    from moe_async.lora.config import LoraConfig
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1)
    path = make_tiny_deepseek_v3(os.path.join(tmp, "ds3"), v_head_dim=24)
    lcfg = LoraConfig(rank=RANK, alpha=8.0, experts="per_expert")  # all seven targets
    tr = MegatronTrainer(TrainerConfig(lora=lcfg, micro_batch_size=1, moe_aux_loss_coeff=0.0), path)
    tensors = tr.export_lora()
    res = {
        "adapter_numel": sum(p.numel() for m in tr.models for p in m.parameters() if p.requires_grad),
        "peft_numel": sum(t.numel() for t in tensors.values()),
        "peft_shapes": {k: list(t.shape) for k, t in tensors.items()},
        "rank": RANK,
    }
    tr.close()
    with open(os.path.join(path, "config.json")) as f:
        res["hf_config"] = json.load(f)
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
