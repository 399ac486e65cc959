"""Pieces shared by the multi-process check scripts of the suite (``tests/**/_*_checks.py``,
``_family_layouts.py``, ``_sync_layouts.py``), which run under torchrun (gloo) or as one process:
the 8 fixed tiny samples, a tiny-model TrainerConfig, the all-rank gather and same-on-all-ranks
helpers, the rank-0 JSON write that ends a run, and the ``ref`` / ``run`` command line of the
layout scripts.

Imported as ``_checks``: each script puts tests/ on ``sys.path`` (``os.path.dirname(__file__)``
+ ``".."``), as tests/conftest.py does for the test modules.
"""

from __future__ import annotations

import json
import sys
import time

import torch

# Mixed signs, but not summing to ~0: a near-zero loss would make its relative difference
# between layouts measure cancellation (with [1, -.5, .7, -1.2, 3, .4, -.9, 1.5] the loss is
# -0.02 and fp32 rounding alone gives 7e-6 relative at deepseek_v3 TP2).
ADV = [1.0, -0.5, 0.7, 1.2, 3.0, 0.4, -0.9, 1.5]
# Adam's first step moves each weight by lr * g / (|g| + eps): with eps 1e-8, weights whose
# gradient is ~1e-9 (rounding noise around an exact zero, e.g. key components that only shift
# a softmax) move by up to lr depending on the last bits of g, and the second step's grad
# norm then differed by 1.1e-5 (llama TP2) to 1.6e-5 (llama TP2+PP2) from 1 process although
# the first step's gradients agreed to 1e-6. eps 1e-5 (still << the typical |g| ~ 5e-3) keeps
# the update a smooth function of g.
ADAM_EPS = 1e-5
# (prompt, response) lengths of :func:`samples`: 9..13 tokens each
LENS = [(5, 7), (3, 6), (8, 4), (4, 9), (6, 5), (7, 6), (2, 8), (5, 5)]


def rel_err(a: float, b: float) -> float:
    """The suite's one relative difference of two scalars: ``|a - b| / max(|a|, |b|, 1e-12)``
    (symmetric; 0 when both are 0)."""
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def samples(seed: int = 0, lens: list[tuple[int, int]] = LENS, zero_at: int | None = 4, vocab: int = 256) -> list:
    """One ``moe_async.types.Sample`` per ``(prompt, response)`` length in ``lens``: token ids
    drawn uniformly from [3, vocab) and rollout logprobs from (-6, 0] by a ``torch.Generator``
    seeded ``seed`` (ids, then logprobs, sample after sample), weight version 0, loss weight 1
    except 0 for sample ``zero_at`` (None: none)."""
    from moe_async.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(lens):
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        rl = (-torch.rand(r, generator=g) * 6).tolist()
        out.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], rollout_logprobs=rl,
                          weight_versions=[0] * r, loss_weight=0.0 if i == zero_at else 1.0))
    return out


def hf_response_logprobs(m, ss: list) -> list[list[float]]:
    """The logprob (fp32 log-softmax) an HF causal LM ``m`` gives each response token of each
    sample in ``ss``, one unbatched forward per sample (the parity reference)."""
    out = []
    with torch.no_grad():
        for s in ss:
            ids = s.prompt_ids + s.response_ids
            lp = m(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            P = len(s.prompt_ids)
            out.append([lp[P - 1 + j, ids[P + j]].item() for j in range(len(s.response_ids))])
    return out


def trainer_cfg(tp: int = 1, pp: int = 1, ep: int = 1, *, etp: int = 1, cp: int = 1, vpp: int | None = None,
                dist_opt: bool = False, mbs: int = 2, aux: float = 0.0, vocab_div: int | None = 96, **fields):
    """A ``TrainerConfig`` for the tiny checkpoints: TP/PP/EP/ETP/CP sizes, ``vpp`` virtual
    pipeline stages per PP rank (None or 1: one chunk), Megatron's distributed optimizer
    (``dist_opt``), micro batch ``mbs``, aux-loss coefficient ``aux``, vocab padded to a multiple
    of ``vocab_div`` x TP (None: TrainerConfig's default), lr 1e-3; ``fields``: any other
    TrainerConfig field (e.g. ``adam_eps``, whose default stays TrainerConfig's)."""
    from moe_async.trainer.config import TrainerConfig

    if vocab_div is not None:
        fields["make_vocab_size_divisible_by"] = vocab_div
    return TrainerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, context_parallel_size=cp,
                         virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
                         use_distributed_optimizer=dist_opt, micro_batch_size=mbs, moe_aux_loss_coeff=aux,
                         **{"lr": 1e-3, **fields})


def rank() -> int:
    """This process's rank (0 without an initialized process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def gather(obj) -> list:
    """``obj`` of every rank, in rank order (a 1-element list on 1 process); collective."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, obj)
    return box


def same_on_all_ranks(obj) -> bool:
    """Whether every rank holds an equal ``obj`` (``==``); collective."""
    box = gather(obj)
    return all(b == box[0] for b in box)


def finish(out: str, res: dict) -> None:
    """End a torchrun script: rank 0 writes ``res`` as JSON to ``out``, then every rank waits
    for it and destroys the default process group."""
    import torch.distributed as dist

    if rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def run_cases(tmp: str, out: str, cases: list[str], one, *, barrier: bool = False, wall: bool = True) -> None:
    """The torchrun body of a layout script: the gloo process group (once, so the trainers built
    per case do not own it), ``res[case] = one(tmp, case)`` case after case (a barrier after each
    if ``barrier``), ``res["wall_s"]`` their wall time in seconds if ``wall``, then
    :func:`finish` (rank 0 writes ``res`` to ``out``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    res: dict = {}
    t0 = time.perf_counter()
    for case in cases:
        res[case] = one(tmp, case)
        if barrier:
            dist.barrier()
    if wall:
        res["wall_s"] = time.perf_counter() - t0
    finish(out, res)


def main(ref, one, *, barrier: bool = False, wall: bool = True, **modes) -> None:
    """The command line of a layout script, one torch thread per process:
    ``SCRIPT ref TMP`` -> ``ref(TMP)``; ``SCRIPT MODE TMP`` for a MODE of ``modes`` ->
    ``modes[MODE](TMP)``; ``SCRIPT run TMP OUT.json CASE [CASE ...]`` (under torchrun) ->
    :func:`run_cases` with ``one``, ``barrier`` and ``wall``."""
    torch.set_num_threads(1)
    mode, tmp = sys.argv[1], sys.argv[2]
    if mode == "ref":
        ref(tmp)
    elif mode in modes:
        modes[mode](tmp)
    else:
        run_cases(tmp, sys.argv[3], sys.argv[4:], one, barrier=barrier, wall=wall)
