"""Megatron's parallel-layout rule: the data-parallel sizes a world of ranks leaves.

Megatron-Core (``parallel_state.initialize_model_parallel``) lays out two grids over the same
ranks (case C24):

    dense layers:  world = TP x CP x DP x PP
    expert layers: world = ETP x EP x EDP x PP

so DP = world / (TP x CP x PP) and EDP = world / (ETP x EP x PP), each an integer >= 1; ETP
left unset (None) is Megatron's default, TP. ``TP x PP x EP`` is never the rule: EP divides
the ranks of the DP x CP (x TP when ETP = 1) grid.

Errors: :class:`LayoutError` (a ``ValueError``) naming the fields (with their ``prefix``,
``trainer.`` by default), the numbers and the rule that fails.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that Megatron-Core would refuse; the message names the fields and rule."""


@dataclass(frozen=True)
class ParallelLayout:
    """A checked layout. Every size >= 1; ``world == tp*cp*dp*pp == etp*ep*edp*pp``."""

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    edp: int


def resolve_layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                   etp: int | None = None, *, prefix: str = "trainer.") -> ParallelLayout:
    """Check a layout against Megatron's rule and derive DP and EDP.

    Args:
        world_size: the trainer's ranks (nodes x devices per node, or explicit).
        tp, pp, cp, ep: tensor, pipeline, context and expert parallel sizes.
        etp: expert tensor parallel size; None = Megatron's default (= ``tp``).
        prefix: what the field names in messages start with (``trainer.``).

    Returns: the :class:`ParallelLayout` with ``dp`` and ``edp``.

    Raises:
        LayoutError: a size < 1, ``world_size`` not divisible by ``TP x CP x PP`` (dense rule)
            or by ``ETP x EP x PP`` (expert rule); an unset ETP is named as Megatron's default.
    """
    names = {"world_size": world_size, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
             "context_parallel_size": cp, "expert_model_parallel_size": ep}
    if etp is not None:
        names["expert_tensor_parallel_size"] = etp
    for k, v in names.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(f"{prefix}{k}={v!r}: must be an integer >= 1")
    dense = tp * cp * pp
    if world_size % dense:
        raise LayoutError(
            f"{prefix}world_size={world_size} is not divisible by {prefix}tensor_model_parallel_size={tp} x "
            f"{prefix}context_parallel_size={cp} x {prefix}pipeline_model_parallel_size={pp} = {dense} "
            "(Megatron's dense rule: world = TP x CP x DP x PP)")
    etp_eff = tp if etp is None else etp
    etp_txt = (f"{prefix}expert_tensor_parallel_size unset (Megatron's default: = TP = {tp})" if etp is None
               else f"{prefix}expert_tensor_parallel_size={etp}")
    expert = etp_eff * ep * pp
    if world_size % expert:
        hint = f"; set {prefix}expert_tensor_parallel_size=1" if etp is None and world_size % (ep * pp) == 0 else ""
        raise LayoutError(
            f"{prefix}world_size={world_size} is not divisible by {etp_txt} x {prefix}expert_model_parallel_size={ep} "
            f"x {prefix}pipeline_model_parallel_size={pp} = {expert} (Megatron's expert rule: world = ETP x EP x "
            f"EDP x PP){hint}")
    return ParallelLayout(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp_eff,
                          dp=world_size // dense, edp=world_size // expert)
