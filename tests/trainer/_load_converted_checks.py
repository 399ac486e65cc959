"""A model-only torch_dist checkpoint from tools/convert_hf_to_megatron.py loaded into
MegatronTrainer at ANOTHER layout; run as ONE 2-process torchrun, results as JSON in TMP.

    torchrun --nproc_per_node 2 _load_converted_checks.py TMP

Rank 0 makes two tiny random Mixtrals of the same config (``orig``: seed 0, ``other``:
seed 1) before the process group exists (the other rank waits in the rendezvous). Then:

* ``orig`` -> torch_dist at TP2 (the converter's CLI ``main``; model only, no optimizer);
* a trainer at EP2 built from ``other`` loads it (resharded TP2 -> EP2): its logprobs vs
  transformers' logprobs of ``orig``; its version (0) and the log line;
* one GRPO step on it and on a trainer built from ``orig`` directly (same layout, same
  batch): loss, grad norm and every exported tensor's checksum after the step;
* a checkpoint without ``decoder.final_layernorm.weight`` (KeyError naming it) and a trainer
  whose vocab padding differs from the checkpoint's (ValueError naming the setting);
* the stepped trainer's own checkpoint (model + optimizer) back to HF with
  tools/convert_megatron_to_hf.py at EP2: the same tensors as the trainer's export.
"""

from __future__ import annotations

import json
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def main(tmp: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    orig, other = os.path.join(tmp, "orig"), os.path.join(tmp, "other")
    if rank == 0:
        from _tiny import make_tiny_mixtral

        make_tiny_mixtral(orig, tie=False, seed=0)
        make_tiny_mixtral(other, tie=False, seed=1)
    dist.init_process_group("gloo")  # rank 1 waits here until rank 0 has written both
    import convert_hf_to_megatron as h2m_cli
    from _trainer_checks import hf_logprobs, samples

    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    res: dict = {}
    meg = os.path.join(tmp, "meg_tp2")
    h2m_cli.main(["--hf", orig, "--out", meg, "--tp", "2", "--no-progress"])
    from moe_async.megatron.container import resolve

    res["ckpt_root_files"] = sorted(os.listdir(meg))
    res["ckpt_files"] = sorted(os.listdir(resolve(meg)))
    ss, adv = samples(), [1.0, -0.5, 0.7, -1.2, 3.0]
    ref = hf_logprobs(orig, ss)

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())

    logging.getLogger("moe_async.trainer.megatron_trainer").addHandler(Keep())
    cfg = TrainerConfig(expert_model_parallel_size=2, micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3)
    tr = MegatronTrainer(cfg, other)

    def maxdiff(a, b):
        return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))

    res["before_load_maxdiff"] = maxdiff(tr.compute_logprobs(ss), ref)
    tr.load_checkpoint(meg)
    mine = tr.compute_logprobs(ss)
    res["lens_ok"] = [len(x) for x in mine] == [len(s.response_ids) for s in ss]
    res["maxdiff"] = maxdiff(mine, ref)
    res["version_after_load"] = tr.version
    res["log"] = [m for m in records if "no optimizer state" in m]
    direct = MegatronTrainer(cfg, orig)
    res["direct_maxdiff"] = maxdiff(direct.compute_logprobs(ss), ref)
    res["step_loaded"] = tr.train_step(ss, adv)
    res["step_direct"] = direct.train_step(ss, adv)
    a, b = tr.hf_checksums(), direct.hf_checksums()
    res["same_after_step"] = a == b
    res["n_tensors"] = len(a)
    res["version_after_step"] = tr.version
    trained = os.path.join(tmp, "trained")
    tr.save_checkpoint(trained)  # model + optimizer (chained_<i>.optimizer.* keys): back to HF below

    # loud failures: a model tensor missing from the checkpoint; a vocab padding mismatch
    from megatron.core import dist_checkpointing

    from moe_async.compat import cpu_device_scope

    bad = os.path.join(tmp, "missing_norm")
    os.makedirs(bad, exist_ok=True)
    with cpu_device_scope():
        sd = tr.model.sharded_state_dict()
        sd.pop("decoder.final_layernorm.weight")
        dist_checkpointing.save({"model": sd}, bad)
    try:
        tr.load_checkpoint(bad)
        res["missing_error"] = None
    except KeyError as e:
        res["missing_error"] = str(e)[:500]
    tr96 = MegatronTrainer(cfg.model_copy(update={"make_vocab_size_divisible_by": 96}), other)
    try:
        tr96.load_checkpoint(meg)
        res["vocab_error"] = None
    except ValueError as e:
        res["vocab_error"] = str(e)[:500]
    # the trained trainer's checkpoint -> HF (optimizer state ignored), at EP2 in this world
    tr.close()  # Megatron parallel state (the converter sets up its own)
    import convert_megatron_to_hf as m2h_cli

    from moe_async.models import tensor_checksum
    from moe_async.megatron.hf_io import iter_hf_tensors

    m2h_cli.main(["--megatron", trained, "--hf-config", orig, "--out", os.path.join(tmp, "trained_hf"),
                  "--ep", "2", "--no-progress"])
    if rank == 0:
        back = {k: tensor_checksum(t) for k, t in iter_hf_tensors(os.path.join(tmp, "trained_hf"))}
        res["trained_to_hf_equal"] = back == a
        with open(os.path.join(tmp, "load_converted.json"), "w") as f:
            json.dump(res, f)
    dist.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
