"""Mend 9 (uneven first-dim all-gather on gloo, moe_async.compat) in 3 forked gloo processes.
Prints a JSON dict on the last line (from rank 0: every rank's results).

Rank r holds ``SIZES[r]`` rows (3, 0, 5: uneven, one empty) of integer-valued fp32 values, so
every sum below is exact and the checks compare with ``torch.equal``:

* ``before_gather_error``: Megatron-Core's own ``_gather_along_first_dim`` with
  ``output_split_sizes`` (the function the mend wraps) fails on gloo (the mend is needed);
* ``gather_exact``: the mended one returns every rank's rows in rank order;
* ``equal_split_same``: equal split sizes still take Megatron's code (same result);
* ``gather_autograd_exact``: ``gather_from_sequence_parallel_region(x, output_split_sizes)``
  (as the alltoall dispatcher calls it with ETP > 1): forward exact, and its backward (the
  UNMENDED uneven ``reduce_scatter``) gives each rank the sum over ranks of its rows of the
  upstream gradients;
* ``reduce_scatter_native_exact``: ``reduce_scatter_to_sequence_parallel_region(y,
  input_split_sizes)`` forward (gloo's own uneven reduce_scatter, no mend) exact, and its
  backward (the mended uneven gather) returns every rank's upstream gradient rows.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile

import torch

SIZES = [3, 0, 5]
H = 4


def rows(rank: int, n: int, base: int) -> torch.Tensor:
    return (torch.arange(n * H, dtype=torch.float32).reshape(n, H) + base + 1000 * rank)


def worker(rank: int, init: str, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = len(SIZES)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from moe_async.compat import apply_cpu_compat

    res: dict = {"applied": apply_cpu_compat()}
    from megatron.core.tensor_parallel import mappings

    g = dist.group.WORLD
    mine = rows(rank, SIZES[rank], 0)
    every = torch.cat([rows(k, SIZES[k], 0) for k in range(world)])
    mended = mappings._gather_along_first_dim
    res["mend_in_place"] = getattr(mended, "_moe_async_uneven_mend", False)
    try:
        mended.__wrapped__(mine, g, SIZES)
        res["before_gather_error"] = None
    except RuntimeError as e:
        res["before_gather_error"] = str(e)
    dist.barrier()  # gloo's failed all-gather may leave a peer waiting: resynchronise
    res["gather_exact"] = torch.equal(mended(mine, g, SIZES), every)
    even = rows(rank, 2, 0)
    res["equal_split_same"] = torch.equal(mended(even, g, [2] * world), mended.__wrapped__(even, g, [2] * world))

    # gather with autograd (dispatcher forward); backward = uneven reduce-scatter (unmended)
    x = mine.clone().requires_grad_(True)
    out = mappings.gather_from_sequence_parallel_region(x, group=g, output_split_sizes=SIZES)
    w = [rows(k, sum(SIZES), 7) for k in range(world)]  # rank k's upstream gradient
    out.backward(w[rank])
    lo = sum(SIZES[:rank])
    want = sum(wk[lo : lo + SIZES[rank]] for wk in w)
    res["gather_autograd_exact"] = torch.equal(out.detach(), every) and torch.equal(x.grad, want)

    # reduce-scatter with autograd (combine forward, gloo's own); backward = mended uneven gather
    ys = [rows(k, sum(SIZES), 3) for k in range(world)]
    y = ys[rank].clone().requires_grad_(True)
    rs = mappings.reduce_scatter_to_sequence_parallel_region(y, group=g, input_split_sizes=SIZES)
    g_up = [rows(k, SIZES[k], 11) for k in range(world)]
    rs.backward(g_up[rank])
    res["reduce_scatter_native_exact"] = torch.equal(rs.detach(), sum(yk[lo : lo + SIZES[rank]] for yk in ys)) \
        and torch.equal(y.grad, torch.cat(g_up))
    box: list = [None] * world
    dist.all_gather_object(box, res)
    if rank == 0:
        q.put(box)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import megatron.core.tensor_parallel.mappings  # noqa: F401  (imported once, inherited by the forks)

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        procs = [ctx.Process(target=worker, args=(r, init, q)) for r in range(len(SIZES))]
        for p in procs:
            p.start()
        box = q.get(timeout=90)
        for p in procs:
            p.join(timeout=30)
    codes = [p.exitcode for p in procs]
    print(json.dumps({"ranks": box, "exitcodes": codes}))
    sys.exit(0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    main()
