"""Expert tensor parallelism (ETP) checks for MegatronTrainer, run as ONE process per world size
(Megatron's parallel state and the compat layer are process-global). Writes a JSON file of
results (rank 0).

Checkpoints (tiny, random, fp32, written by ``ref`` before Megatron is imported):
    mixtral  tiny Mixtral (2 layers, 4 experts top-2, expert FFN 128), untied
    qwen3    tiny Qwen3-MoE (2 layers, qk-norm, 4 experts top-2, expert FFN 96, norm_topk_prob)
    ds3      tiny DeepSeek-V3 (3 layers, first dense, MLA, 8 routed experts top-4 in 4 groups,
             1 shared expert, expert FFN 32, non-zero e_score_correction_bias)
    qwen3odd qwen3 with expert FFN 90 (not divisible by ETP 4: the refusal check)

Modes:
    python _etp_checks.py ref TMP
        writes the checkpoints, runs the 1-process reference of each (HF export, 2 steps,
        logprobs) and the 1-process refusal (ETP 2 x EP 1 does not divide world size 1)
        -> TMP/ref.json
    torchrun --nproc_per_node 4 _etp_checks.py run TMP OUT.json CASE [CASE ...]
        CASE = ``{ckpt}-tp{t}[pp{p}]ep{e}etp{x}[do]``: HF export == checkpoint (plain and through an ``out``
        buffer as the weight sync's transport passes), 2 optimizer steps, logprobs, checksums
        agree on all ranks; then the parallel state is destroyed and the next case runs in the
        same process. ``ckpt``: torch_dist save of ds3 at TP2+EP2+ETP2 after one step, loaded
        at TP1+EP1+ETP1 (DP4) and saved again, that loaded at EP2+ETP2: the HF checksums equal
        the first saving run's each time.
        ``refuse``: ETP 4 with the qwen3odd checkpoint (expert FFN 90) is a ValueError naming
        the field. A ``do`` suffix on a CASE: Megatron's distributed optimizer.

Data and optimizer as tests/models/_family_layouts.py (both from tests/_checks.py): 8 samples,
advantages (mixed signs, not summing to ~0), micro batch 2, lr 1e-3, Adam eps 1e-5, aux coeff 0,
vocab padded to a multiple of 96 x TP.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _checks import ADAM_EPS, ADV, gather, main, rank, same_on_all_ranks, samples, trainer_cfg  # noqa: E402

CKPTS = ("mixtral", "qwen3", "ds3")


def cfg(tp=1, ep=1, etp=1, dist_opt=False, vocab_div=96, pp=1):
    return trainer_cfg(tp, pp, ep, etp=etp, dist_opt=dist_opt, vocab_div=vocab_div, adam_eps=ADAM_EPS)


def parse(case: str) -> tuple[str, int, int, int, bool, int]:
    """``"ds3-tp2ep2etp2"`` -> ``("ds3", 2, 2, 2, False, 1)``; ``tp1pp2ep1etp2``: PP 2; a ``do``
    suffix: Megatron's distributed optimizer."""
    ck, lay = case.split("-")
    m = re.fullmatch(r"tp(\d+)(?:pp(\d+))?ep(\d+)etp(\d+)(do)?", lay)
    if m is None:
        raise ValueError(f"bad case {case!r}")
    return ck, int(m[1]), int(m[3]), int(m[4]), m[5] is not None, int(m[2] or 1)


def export_checks(tr, path: str) -> dict:
    """HF export == the checkpoint's tensors bit-exactly, both plain and written into caller
    buffers (``out``, as ``BroadcastTransport.destination`` is passed by the weight sync)."""
    from safetensors.torch import load_file

    plain = dict(tr.export_hf_weights())  # collective: every rank iterates
    bufs: dict[str, torch.Tensor] = {}

    def out(name, shape, dtype):
        bufs[name] = torch.full(shape, float("nan"), dtype=dtype)
        return bufs[name]

    via_out = dict(tr.export_hf_weights(out=out))
    if rank() != 0:
        return {}
    disk = load_file(os.path.join(path, "model.safetensors"))
    return {
        "export_equals_disk": set(plain) == set(disk) and all(torch.equal(plain[k], disk[k]) for k in disk),
        "export_out_equals_disk": set(via_out) == set(disk)
        and all(torch.equal(via_out[k], disk[k]) and via_out[k] is bufs[k] for k in disk),
        "n_tensors": len(disk),
    }


def expert_shards(tr) -> list:
    """(local name, shape) of this rank's first routed-expert fc1/fc2 weights (the split)."""
    out = []
    for n, p in tr.models[0].named_parameters():
        if ".local_experts.0." in n and n.endswith("weight") and "linear_fc" in n:
            out.append((n, list(p.shape)))
            if len(out) == 2:
                break
    return out


def run(path: str, tp: int, ep: int, etp: int, dist_opt: bool = False, pp: int = 1) -> dict:
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    t0 = time.perf_counter()
    ss = samples()
    tr = MegatronTrainer(cfg(tp, ep, etp, dist_opt, pp=pp), path)
    res: dict = export_checks(tr, path)
    res["expert_shards"] = gather(expert_shards(tr))
    res["steps"] = [{k: m[k] for k in ("loss", "grad_norm", "entropy", "num_tokens")}
                    for m in (tr.train_step(ss, ADV), tr.train_step(ss, ADV))]
    res["checksums_agree_on_ranks"] = same_on_all_ranks(tr.hf_checksums())
    res["logp"] = tr.compute_logprobs(ss[:3])
    tr.close()
    res["seconds"] = time.perf_counter() - t0
    return res


def ckpt(tmp: str) -> dict:
    """deepseek_v3, torch_dist checkpoints across ETP: at TP2+EP2+ETP2 one step and a save
    (``etp_ckpt``); loaded at TP1+EP1+ETP1 (DP4, every rank the whole model, as 1 process) the
    HF checksums equal the saving run's (the ETP-split expert shards reassemble); saved there
    (``etp1_ckpt``, an ETP1 checkpoint as the converter writes) and loaded at EP2+ETP2 (TP1):
    equal again (ETP1 shards split on load). Vocab padded to a multiple of 128 (256 rows at
    TP1 and TP2: a checkpoint's padded vocab must match the loading trainer's)."""
    import torch.distributed as dist

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    path, ck, ck1 = os.path.join(tmp, "ds3"), os.path.join(tmp, "etp_ckpt"), os.path.join(tmp, "etp1_ckpt")
    tr = MegatronTrainer(cfg(2, 2, 2, vocab_div=128), path)
    before = tr.hf_checksums()
    tr.train_step(samples(), ADV)
    ref = tr.hf_checksums()
    tr.save_checkpoint(ck)
    tr.close()
    dist.barrier()
    res: dict = {"changed": sum(before[k] != ref[k] for k in ref), "n": len(ref)}
    tr = MegatronTrainer(cfg(vocab_div=128), path)
    tr.load_checkpoint(ck)
    res["etp2_to_etp1_equal"] = tr.hf_checksums() == ref
    res["etp2_to_etp1_version"] = tr.version
    tr.save_checkpoint(ck1)
    tr.close()
    dist.barrier()
    tr = MegatronTrainer(cfg(1, 2, 2, vocab_div=128), path)
    tr.load_checkpoint(ck1)
    res["etp1_to_etp2_equal"] = tr.hf_checksums() == ref
    res["etp1_to_etp2_version"] = tr.version
    tr.close()
    return res


def refuse(tmp: str) -> dict:
    """ETP 4 with an expert FFN of 90: ValueError naming the field; a parallel state already
    initialised at ETP1 (EP2, by the caller) and a trainer wanting ETP2: RuntimeError."""
    from megatron.core import parallel_state as ps

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    out: dict = {}
    try:
        MegatronTrainer(cfg(1, 1, 4), os.path.join(tmp, "qwen3odd")).close()
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    ps.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    try:
        MegatronTrainer(cfg(1, 2, 2), os.path.join(tmp, "mixtral")).close()
        out["initialised_error"] = None
    except RuntimeError as e:
        out["initialised_error"] = str(e)
    ps.destroy_model_parallel()
    return out


def main_ref(tmp: str) -> None:
    from _tiny import make_tiny_mixtral, make_tiny_qwen3_moe  # before Megatron is imported
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3

    make_tiny_mixtral(os.path.join(tmp, "mixtral"), tie=False)
    make_tiny_qwen3_moe(os.path.join(tmp, "qwen3"), tie=False, norm_topk_prob=True)
    make_tiny_deepseek_v3(os.path.join(tmp, "ds3"))
    make_tiny_qwen3_moe(os.path.join(tmp, "qwen3odd"), tie=False, moe_intermediate_size=90)
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    out: dict = {}
    for ck in CKPTS:
        out[f"{ck}-tp1ep1etp1"] = run(os.path.join(tmp, ck), 1, 1, 1)
    try:
        MegatronTrainer(cfg(1, 1, 2), os.path.join(tmp, "mixtral")).close()
        out["refuse_world"] = {"error": None}
    except ValueError as e:
        out["refuse_world"] = {"error": str(e)}
    # the refused trainer released its process group: a next trainer in this process builds
    out["after_refusal_builds"] = run(os.path.join(tmp, "qwen3"), 1, 1, 1)["export_equals_disk"]
    with open(os.path.join(tmp, "ref.json"), "w") as f:
        json.dump(out, f)


def run_case(tmp: str, case: str) -> dict:
    if case == "ckpt":
        return ckpt(tmp)
    if case == "refuse":
        return refuse(tmp)
    ck, tp, ep, etp, dist_opt, pp = parse(case)
    return run(os.path.join(tmp, ck), tp, ep, etp, dist_opt, pp)


if __name__ == "__main__":
    main(main_ref, run_case, barrier=True)
