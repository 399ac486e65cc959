"""Non-finite values never pass silently: the train step's guard and the export check.

:class:`StepGuard` finds a non-finite loss term or gradient before the optimizer runs, agreed
over the whole world, and raises :class:`NonFiniteError` on every rank naming the samples or
the parameter (weights, optimizer state and ``weight_version`` unchanged);
:func:`check_weights_finite` refuses to export weights holding NaN/inf to the engines.

Design notes: ``docs/design/trainer.md``."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Iterable

import torch

from moe_async.types import MicroBatch

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

Tensor = torch.Tensor


class NonFiniteError(RuntimeError):
    """A loss, gradient or weight holds NaN/inf; the message names the sample or tensor."""


def _first_nonfinite(tensors: list[Tensor]) -> int | None:
    """Index of the first of ``tensors`` holding a NaN or inf, None if none does. One sum per
    tensor (no temporary of its size; NaN/inf propagate), gathered with ONE host sync; a
    non-finite sum is confirmed element-wise (a sum that merely overflows is no hit)."""
    ts = [t.detach() for t in tensors if t.numel()]
    if not ts:
        return None
    sums = torch.stack([t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).double()
                        .to(ts[0].device) for t in ts])
    hits = (~torch.isfinite(sums)).nonzero().flatten().tolist()
    live = [i for i, t in enumerate(tensors) if t.numel()]
    for h in hits:
        if not bool(torch.isfinite(ts[h]).all()):
            return live[h]
    return None


def dp_sample_indices(n_global: int, dp: int, dp_rank: int, n_local: int) -> list[int]:
    """Global batch index of each of this DP rank's ``n_local`` samples, -1 for the
    zero-weight padding copies (``Batcher.dp_local`` gives rank ``r`` the contiguous
    slice ``[r*per, min((r+1)*per, n))``, ``per = ceil(n/dp)``, padded to ``per``, then PP pads)."""
    per = -(-n_global // dp) if dp > 1 else n_global
    lo, hi = min(dp_rank * per, n_global), min((dp_rank + 1) * per, n_global)
    return [lo + i if lo + i < hi else -1 for i in range(n_local)]


def _world() -> tuple[int, ModuleType | None]:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size(), dist
    return 1, None


def _all_max(flags: Tensor) -> Tensor:
    """Element-wise MAX of ``flags`` (float64) over the world (itself at world size 1)."""
    world, dist = _world()
    if world == 1 or dist is None:
        return flags
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = flags.to(dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu()


def _grad_tensors(ddp_models: Iterable[DistributedDataParallel]) -> Iterable[tuple[str, Tensor]]:
    """``(what, gradient)`` of every DDP model chunk: Megatron DDP's contiguous gradient
    buffers when it has them, else each parameter's ``main_grad`` / ``grad``."""
    for c, d in enumerate(ddp_models):
        # Megatron DDP's lists (``buffers`` shadows nn.Module.buffers() there)
        bufs = [b for k in ("buffers", "expert_parallel_buffers")
                if isinstance(getattr(d, k, None), (list, tuple)) for b in getattr(d, k)]
        grads = [b.grad_data for b in bufs if getattr(b, "grad_data", None) is not None]
        if grads:
            for i, g in enumerate(grads):
                yield f"chunk {c} gradient buffer {i}", g
            continue
        for n, p in d.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                yield n, g


def _first_bad_param(ddp_models: Iterable[DistributedDataParallel]) -> str | None:
    """Name of the first parameter whose gradient (``main_grad`` or ``grad``) is non-finite."""
    named = []
    for d in ddp_models:
        for n, p in d.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                named.append((n, g))
    i = _first_nonfinite([g for _, g in named])
    return None if i is None else named[i][0]


def _describe(batch: list, idx: list[int], limit: int = 5) -> str:
    parts = []
    for i in idx[:limit]:
        md = getattr(batch[i], "metadata", None) or {}
        extra = ", ".join(f"{k} {md[k]}" for k in ("group_id", "sample_index", "problem_index") if k in md)
        parts.append(f"{i} ({extra})" if extra else str(i))
    more = f" and {len(idx) - limit} more" if len(idx) > limit else ""
    return ", ".join(parts) + more


class StepGuard:
    """One train step's record of non-finite losses, checked with the gradients before the
    optimizer runs (design notes: ``docs/design/trainer.md``). Use::

        guard = StepGuard(batch, version)    # the global batch given to train_step
        ...                                  # DP slice, packing
        guard.bind(mbs_list)                 # this rank's micro-batches, in sample order
        # in the loss function of each micro-batch:
        guard.record(mb, metrics["nonfinite_rows"], loss_sum)
        guard.check(ddp_models)              # after backward, before optimizer.step()
    """

    def __init__(self, batch: list, version: int):
        self.batch = list(batch)
        self.version = int(version)
        self.local_index: list[int] = []
        self._records: list[tuple[int, Tensor, Tensor]] = []  # (first row, nonfinite_rows, loss finite)

    def bind(self, mbs_list: list[MicroBatch]) -> None:
        """Note the global batch index of each sample of this rank's micro-batches (their
        rows start at ``mb.first`` in this rank's sample list: contiguous runs of it, in
        order; :func:`dp_sample_indices`; DP size and rank from Megatron's parallel state)."""
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        r = ps.get_data_parallel_rank() if dp > 1 else 0
        o = 0
        for mb in mbs_list:
            o += int(mb.tokens.shape[0])
        self.local_index = dp_sample_indices(len(self.batch), dp, r, o)

    def record(self, mb: MicroBatch, nonfinite_rows: Tensor, loss_sum: Tensor) -> None:
        """Mark the samples of micro-batch ``mb`` whose loss is non-finite
        (``nonfinite_rows`` ``[B]`` bool), and the unattributed slot when the micro-batch's
        loss is non-finite with no row flagged."""
        # kept on the device: read once in check() (no host sync per micro-batch)
        self._records.append((mb.first, nonfinite_rows.detach().reshape(-1),
                              torch.isfinite(loss_sum.detach())))

    def _local_flags(self) -> Tensor:
        """``[len(batch) + 1]`` float64: 1 for each global sample with a non-finite loss on
        this rank; the last slot for a padding copy or an unattributed non-finite loss."""
        bad = torch.zeros(len(self.batch) + 1, dtype=torch.float64)
        for first, rows_t, finite in self._records:
            rows = rows_t.cpu().tolist()
            for b, hit in enumerate(rows):
                if hit:
                    i = first + b
                    g = self.local_index[i] if i < len(self.local_index) else -1
                    bad[g if g >= 0 else len(self.batch)] = 1.0
            if not any(rows) and not bool(finite):
                bad[len(self.batch)] = 1.0
        return bad

    def check(self, ddp_models: list[DistributedDataParallel]) -> None:
        """After the backward pass, before ``optimizer.step()``. Collective (every rank).

        Raises:
            NonFiniteError: on every rank when any rank saw a non-finite loss or gradient;
                the gradient buffers are zeroed first (nothing of the step is kept).
        """
        grad_bad = _first_nonfinite([g for _, g in _grad_tensors(ddp_models)]) is not None
        flags = _all_max(torch.cat([self._local_flags(), torch.tensor([1.0 if grad_bad else 0.0], dtype=torch.float64)]))
        if not bool((flags > 0).any()):
            return
        samples = [i for i in range(len(self.batch)) if flags[i] > 0]
        param = _first_bad_param(ddp_models) if grad_bad else None
        for _, g in _grad_tensors(ddp_models):
            g.zero_()
        if samples:
            what = f"non-finite loss (NaN/inf) at sample(s) {_describe(self.batch, samples)} of the batch"
        elif flags[len(self.batch)] > 0:
            what = "non-finite loss (NaN/inf) not attributable to one sample (a padding copy)"
        else:
            where = f"parameter {param}" if param else "a parameter on another rank"
            what = f"non-finite gradient (NaN/inf) of {where}, with a finite loss"
        raise NonFiniteError(
            f"train_step at weight_version {self.version}: {what}; the step was not applied "
            "(no optimizer step: weights, optimizer state and weight_version unchanged)")


def check_weights_finite(models: Iterable[torch.nn.Module], version: int) -> None:
    """Refuse to export weights holding NaN/inf (before anything is sent). Collective at
    world size > 1: every rank checks its own shards and all agree.

    Raises:
        NonFiniteError: naming the first non-finite parameter (this rank's) and the version.
    """
    named = [(n, p) for m in models for n, p in m.named_parameters()]
    i = _first_nonfinite([p for _, p in named])
    bad = None if i is None else named[i][0]
    flags = _all_max(torch.tensor([1.0 if bad else 0.0], dtype=torch.float64))
    if flags[0] > 0:
        where = f"parameter {bad}" if bad else "a parameter on another rank"
        raise NonFiniteError(f"weight export at weight_version {version}: {where} holds NaN/inf; "
                             "nothing was sent to the engines")
