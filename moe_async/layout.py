"""Megatron's parallel-layout rule: the data-parallel sizes a world of ranks leaves.

Megatron-Core (``parallel_state.initialize_model_parallel``) lays out two grids over the same
ranks (Megatron's layout rule):

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
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from torch import Tensor


class MegatronSizes(TypedDict):
    """:meth:`ParallelLayout.megatron_kwargs`: the sizes under Megatron-Core's keyword names."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None


class LayoutError(ValueError):
    """A parallel layout that Megatron-Core would refuse; the message names the fields and rule."""


@dataclass(frozen=True)
class ParallelLayout:
    """The Megatron-Core parallel sizes of one model, the one layout type of the package: TP, PP,
    EP, ETP (expert tensor parallel), CP (context parallel), VPP (virtual pipeline stages per PP
    rank; None = one model chunk, Megatron's "off"), each an int >= 1, and optionally the world
    (ranks) they were resolved against.

    Two ways to make one: :func:`resolve_layout` (the config-time layout, checked against a
    planned world; ``world_size`` set, so :attr:`dp` / :attr:`edp` are defined) and
    :meth:`from_trainer_config` (what the trainer initialises; the world is the process
    group's, checked with :meth:`check_world`). ``world == tp*cp*dp*pp == etp*ep*edp*pp``.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    vpp: int | None = None
    world_size: int | None = None

    @property
    def dp(self) -> int:
        """Data-parallel size ``world / (TP x CP x PP)``; LayoutError without ``world_size``."""
        return self._world("dp") // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size ``world / (ETP x EP x PP)``; LayoutError without ``world_size``."""
        return self._world("edp") // (self.etp * self.ep * self.pp)

    def _world(self, what: str) -> int:
        if self.world_size is None:
            raise LayoutError(f"ParallelLayout.{what}: the layout has no world_size (use resolve_layout)")
        return self.world_size

    @classmethod
    def from_trainer_config(cls, cfg) -> "ParallelLayout":
        """The layout of a ``TrainerConfig`` (``virtual_pipeline_model_parallel_size`` <= 1 -> None);
        no world (the runtime's is the process group's: :meth:`check_world`)."""
        vpp = cfg.virtual_pipeline_model_parallel_size
        return cls(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size,
                   ep=cfg.expert_model_parallel_size, etp=cfg.expert_tensor_parallel_size,
                   cp=cfg.context_parallel_size, vpp=vpp if vpp is not None and vpp > 1 else None)

    def megatron_kwargs(self) -> MegatronSizes:
        """The sizes under Megatron-Core's names, as both ``parallel_state.initialize_model_parallel``
        and ``TransformerConfig`` (``ModelParallelConfig``) take them: ``tensor_model_parallel_size``,
        ``pipeline_model_parallel_size``, ``context_parallel_size``, ``expert_model_parallel_size``,
        ``expert_tensor_parallel_size``, ``virtual_pipeline_model_parallel_size``."""
        return MegatronSizes(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                             context_parallel_size=self.cp, expert_model_parallel_size=self.ep,
                             expert_tensor_parallel_size=self.etp, virtual_pipeline_model_parallel_size=self.vpp)

    def check_world(self, world: int) -> None:
        """Megatron-Core's rules (``parallel_state.initialize_model_parallel``) against the
        runtime's ``world`` (ranks), checked before it runs so the error names the fields:
        TP x PP x CP divides the world size, and ETP x EP x PP divides it (expert data
        parallelism gets the rest).

        Raises:
            ValueError: naming ``trainer.tensor_model_parallel_size`` / ``pipeline_model_parallel_size``
                / ``context_parallel_size``, or ``trainer.expert_tensor_parallel_size`` and
                ``trainer.expert_model_parallel_size``.
        """
        tp, pp, cp, etp, ep = self.tp, self.pp, self.cp, self.etp, self.ep
        if world % (tp * pp * cp):
            raise ValueError(
                f"trainer.tensor_model_parallel_size={tp} x trainer.pipeline_model_parallel_size={pp} x "
                f"trainer.context_parallel_size={cp} = {tp * pp * cp} must divide the world size {world} "
                "(Megatron-Core: DP = world / (TP x PP x CP))")
        if world % (etp * ep * pp):
            raise ValueError(
                f"trainer.expert_tensor_parallel_size={etp} x trainer.expert_model_parallel_size={ep} must divide "
                f"TP x CP x DP = world size {world} / trainer.pipeline_model_parallel_size={pp} "
                f"(Megatron-Core: world size divisible by ETP x EP x PP = {etp * ep * pp})")


def resolve_layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                   etp: int | None = None, *, prefix: str = "trainer.") -> ParallelLayout:
    """Check a layout against Megatron's rule and derive DP and EDP.

    Args:
        world_size: the trainer's ranks (nodes x devices per node, or explicit).
        tp, pp, cp, ep: tensor, pipeline, context and expert parallel sizes.
        etp: expert tensor parallel size; None = Megatron's default (= ``tp``).
        prefix: what the field names in messages start with (``trainer.``).

    Returns: the :class:`ParallelLayout` with ``world_size`` set (``dp`` and ``edp`` defined).

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
    return ParallelLayout(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp_eff)


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> "Tensor":
    """Global sequence positions held by context-parallel rank ``cp_rank``, in its local
    order: ``[seq_len // cp_size]`` long = chunk ``cp_rank`` then chunk ``2*cp_size-1-cp_rank``
    of ``2*cp_size`` equal chunks (the split Megatron-Core's ``get_batch_on_this_cp_rank`` and
    RoPE's ``get_pos_emb_on_this_cp_rank`` make). ValueError unless ``seq_len`` is a multiple
    of ``2*cp_size``."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside a context-parallel group of size {cp_size}")
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x context_parallel_size = {2 * cp_size}")
    import torch

    c = seq_len // (2 * cp_size)
    a, b = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(a, a + c), torch.arange(b, b + c)])
