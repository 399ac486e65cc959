"""A checkpoint written without Transformer Engine's ``_extra_state`` objects (any CPU-written
checkpoint: the local spec has no FP8 metadata) loaded into a trainer whose core-attention
modules carry extra state, as TE's ``TEDotProductAttention`` does on a GPU. Run as one process:

    python _te_extra_state_checks.py TMP

Prints JSON: the load's outcome, whether the weights arrived bit-exact, and whether the
modules kept their own extra state.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def main(tmp: str) -> None:
    from _tiny import make_tiny_mixtral
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    a = make_tiny_mixtral(os.path.join(tmp, "a"), seed=0)
    b = make_tiny_mixtral(os.path.join(tmp, "b"), seed=1)
    t = MegatronTrainer(TrainerConfig(), a)
    want = {k: v.detach().clone() for k, v in t.model.state_dict().items() if isinstance(v, torch.Tensor)}
    t.save_checkpoint(os.path.join(tmp, "ckpt"))
    t.close()

    # TE's attention keeps FP8 metadata as extra state (a tensor here); the saved checkpoint has none
    DotProductAttention.get_extra_state = lambda self: torch.tensor([7.0])
    seen: list = []
    DotProductAttention.set_extra_state = lambda self, state: seen.append(state)
    t2 = MegatronTrainer(TrainerConfig(), b)
    res: dict = {}
    try:
        t2.load_checkpoint(os.path.join(tmp, "ckpt"))
        res["loaded"] = True
    except Exception as e:  # noqa: BLE001 - reported
        res["loaded"], res["error"] = False, f"{type(e).__name__}: {e}"[:400]
    got = t2.model.state_dict()
    res["extra_keys"] = sorted(k for k in got if k.endswith("core_attention._extra_state"))
    res["bit_exact"] = all(torch.equal(got[k], v) for k, v in want.items() if not k.endswith("_extra_state"))
    res["extra_state_set_from_checkpoint"] = len(seen)
    t2.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
