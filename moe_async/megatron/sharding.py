"""Full (1-process) Megatron tensors <-> this rank's shards, at any TP/PP/EP/DP layout.

The slicing is read from Megatron-Core's own ``model.sharded_state_dict()`` metadata, never
hand-written per parameter: global layer/expert offsets, shard offsets in the full tensor, and
the one primary replica of each shard. Used by the HF load, the HF export and the converters.

Design notes: ``docs/design/megatron.md``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence, Union

import torch

from moe_async.layout import cp_positions

Tensor = torch.Tensor
Chunks = Union[torch.nn.Module, Sequence[torch.nn.Module]]

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER_RE = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_EXPERT_RE = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")
# the grouped expert MLP (Megatron-Core's TEGroupedMLP): local expert i's weight is
# ``experts.linear_fc1.weight<i>``; its sharded-state key and offsets are the sequential one's
_GROUPED_RE = re.compile(r"^(.*\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
# Megatron-Core's legacy GroupedMLP: all local experts in ``experts.weight1`` [H, E_l x fc1 out]
# and ``experts.weight2`` [E_l x fc2 in, H] (transposed to the sequential layout on save)
_LEGACY_GROUPED_RE = re.compile(r"^(.*\.experts\.)weight([12])$")


def padded_vocab_size(vocab: int, tp: int, divisible_by: int) -> int:
    """Smallest multiple of ``divisible_by * tp`` that is >= ``vocab`` (Megatron-LM's
    ``make_vocab_size_divisible_by`` rule)."""
    m = max(1, divisible_by) * tp
    return ((vocab + m - 1) // m) * m


@dataclass
class Piece:
    """One shard of one full tensor held by this rank.

    Attributes:
        name: 1-process Megatron (local-spec) name, e.g. ``decoder.layers.1.mlp.experts.
            local_experts.3.linear_fc2.weight``.
        data: view of this rank's parameter (writing to it writes the parameter).
        full_shape: shape of the full tensor (vocab rows padded).
        offset: offset of ``data`` in the full tensor, one entry per dim of ``data``.
        primary: True for exactly one replica of each shard over the whole world.
        param: the local parameter name (``model.named_parameters()``), prefixed with
            ``chunk<v>.`` when the rank holds several virtual-pipeline chunks.
    """

    name: str
    data: Tensor
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    primary: bool
    param: str

    def index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.data.shape))


def _global_name(local: str, sh_key: str, prepend: int, gofs: tuple[int, ...]) -> str:
    """1-process local-spec name of a local parameter (TE fused-norm names mapped too)."""
    from moe_async.models.family import local_spec_name

    return local_spec_name(_renumber(local, sh_key, prepend, gofs))


def _renumber(local: str, sh_key: str, prepend: int, gofs: tuple[int, ...]) -> str:
    m = _LAYER_RE.match(local)
    if m is None:
        # Global (non-layer) tensor: the sharded key is the 1-process name. (The last PP
        # stage's tied output layer is keyed as the embedding, which is what it is.)
        return sh_key if sh_key in VOCAB_PARAMS else local
    # deepseek_v3: with non-homogeneous layers (``moe_layer_freq`` a list: dense + MoE layers)
    # Megatron keys each layer by its global number (transformer_block.py sharded_state_dict,
    # ``non_homogeneous_layers``) and prepends no layer axis; the expert axis is then axis 0.
    km = _LAYER_RE.match(sh_key)
    if km is not None:
        layer, n_layer_axes = km.group(2), 0
    else:
        if prepend < 1:
            raise ValueError(f"{local!r}: layer tensor without a prepended layer axis")
        layer, n_layer_axes = gofs[0], 1
    name = f"{m.group(1)}{layer}{m.group(3)}"
    g = _GROUPED_RE.match(name)
    if g is not None:  # named as the sequential layout's expert (renumbered globally below)
        name = f"{g.group(1)}local_experts.{g.group(4)}.{g.group(2)}.{g.group(3)}"
    e = _EXPERT_RE.match(name)
    if e is not None:
        if prepend < n_layer_axes + 1:
            raise ValueError(f"{local!r}: expert tensor without a prepended expert axis")
        name = f"{e.group(1)}{gofs[n_layer_axes]}{e.group(3)}"
    return name


def local_pieces(model: Chunks) -> list[Piece]:
    """This rank's shards of every parameter of ``model`` (a ``GPTModel``, not DDP-wrapped,
    or the list of this rank's virtual-pipeline chunks, in ``vp_stage`` order), in chunk then
    ``named_parameters()`` order. Raises ValueError if a parameter has no sharded-state entry
    or its pieces do not cover it."""
    if isinstance(model, torch.nn.Module):
        return _chunk_pieces(model, "")
    chunks = list(model)
    if len(chunks) == 1:
        return _chunk_pieces(chunks[0], "")
    return [pc for v, m in enumerate(chunks) for pc in _chunk_pieces(m, f"chunk{v}.")]


def _chunk_pieces(model: Any, tag: str) -> list[Piece]:  # a megatron.core GPTModel chunk
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from moe_async.lora.layers import is_adapter_param

    # LoRA adapters are not base weights (moe_async.lora exports them on their own)
    params: dict[str, Tensor] = {n: p for n, p in model.named_parameters() if not is_adapter_param(n)}
    # deepseek_v3: the router's fp32 expert bias (HF e_score_correction_bias) is a buffer that
    # is loaded and exported like a parameter.
    params.update({n: b for n, b in model.named_buffers() if n.endswith(".router.expert_bias")})
    sd = model.sharded_state_dict()
    out: list[Piece] = []
    for pname, p in params.items():
        if pname not in sd:
            raise ValueError(f"parameter {pname!r} has no entry in sharded_state_dict()")
        entry = sd[pname]
        if isinstance(entry, ShardedTensorFactory):
            shs = entry.build()
        elif isinstance(entry, ShardedTensor):
            shs = [entry]
        else:
            raise ValueError(f"parameter {pname!r}: unexpected sharded entry {type(entry).__name__}")
        if (g := _LEGACY_GROUPED_RE.match(pname)) is not None:
            out.extend(_legacy_grouped_pieces(pname, g, p, shs, tag))
            continue
        covered = 0
        for sh in shs:
            if sh.flattened_range is not None:
                raise ValueError(f"{pname!r}: flattened (distributed-optimizer) shards not supported here")
            k = sh.prepend_axis_num
            gofs = tuple(int(x) for x in sh.global_offset)
            data = sh.data
            if data.data_ptr() < p.data_ptr() or data.data_ptr() >= p.data_ptr() + p.numel() * p.element_size():
                raise ValueError(f"{pname!r}: sharded data is not a view of the parameter")
            primary = all(int(r) == 0 for r in (sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)))
            out.append(
                Piece(
                    name=_global_name(pname, sh.key, k, gofs),
                    data=data,
                    full_shape=tuple(int(x) for x in sh.global_shape[k:]),
                    offset=gofs[k:],
                    primary=primary,
                    param=tag + pname,
                )
            )
            covered += data.numel()
        if covered != p.numel():
            raise ValueError(f"{pname!r}: sharded pieces cover {covered} of {p.numel()} elements")
    return out


def _legacy_grouped_pieces(pname: str, g: "re.Match[str]", p: Tensor, shs: Any, tag: str) -> list[Piece]:
    """Pieces of a legacy ``GroupedMLP`` weight, one per local expert (and GLU half), named and
    placed as the sequential expert MLP's. Megatron's factory builds each shard as a transposed
    copy, ``[E_l, fc1 out, H]`` (split into its gate/up halves with GLU) or ``[E_l, H, fc2 in]``;
    the pieces are the same slices as views of ``p`` (checked equal to the built shards), so a
    load writes the parameter. Raises ValueError if the built shards are not those slices."""
    shs = list(shs) if isinstance(shs, (list, tuple)) else [shs]
    w1 = g.group(2) == "1"
    hidden = p.shape[0] if w1 else p.shape[1]
    if not shs:
        raise ValueError(f"{pname!r}: no sharded tensors")
    n_local = int(shs[0].local_shape[0])
    t = (p.view(n_local, hidden, -1) if w1 else p.view(n_local, -1, hidden)).transpose(-1, -2)
    views = list(t.chunk(len(shs), dim=-2)) if w1 else [t]
    if len(views) != len(shs) or any(tuple(v.shape) != tuple(sh.data.shape) or not torch.equal(v, sh.data)
                                     for v, sh in zip(views, shs)):
        raise ValueError(f"{pname!r}: GroupedMLP's sharded tensors are not the expected slices of the parameter")
    fc = "linear_fc1" if w1 else "linear_fc2"
    out: list[Piece] = []
    for v, sh in zip(views, shs):
        if sh.flattened_range is not None:
            raise ValueError(f"{pname!r}: flattened (distributed-optimizer) shards not supported here")
        k = sh.prepend_axis_num
        gofs = tuple(int(x) for x in sh.global_offset)
        primary = all(int(r) == 0 for r in (sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)))
        for e in range(n_local):
            local = f"{g.group(1)}local_experts.{e}.{fc}.weight"
            out.append(Piece(name=_global_name(local, sh.key, k + 1, (*gofs[:k], gofs[k] + e)), data=v[e],
                             full_shape=tuple(int(x) for x in sh.global_shape[k + 1:]), offset=gofs[k + 1:],
                             primary=primary, param=tag + pname))
    return out


def _fit_vocab(name: str, t: Tensor, full_shape: tuple[int, ...], vocab_size: int) -> Tensor:
    """Pad (load) an HF-sized vocab tensor to the padded shape; ValueError otherwise."""
    if tuple(t.shape) == full_shape:
        return t
    if (
        name in VOCAB_PARAMS
        and t.dim() == 2
        and t.shape[0] == vocab_size
        and t.shape[1] == full_shape[1]
        and full_shape[0] >= vocab_size
    ):
        pad = t.new_zeros(full_shape[0] - vocab_size, t.shape[1])
        return torch.cat([t, pad], dim=0)
    raise ValueError(f"shape mismatch for {name}: HF gives {tuple(t.shape)}, Megatron expects {full_shape}")


@torch.no_grad()
def load_full_state(model: Chunks, full: Mapping[str, Tensor], vocab_size: int) -> None:
    """Copy this rank's slices of the full 1-process Megatron tensors ``full`` (CPU, any
    float dtype; cast to the parameter dtype) into ``model``'s parameters.

    Every rank calls it with the same ``full``; no communication. Raises KeyError naming
    local parameters with no source tensor. Sources that no local piece uses are not an
    error here (other ranks use them): the caller checks global coverage with
    :func:`needed_names`. ValueError on a shape mismatch other than vocab padding.
    """
    cache: dict[str, Tensor] = {}
    missing = []
    for pc in local_pieces(model):
        if pc.name not in full:
            missing.append(f"{pc.param} (as {pc.name})")
            continue
        if pc.name not in cache:
            cache[pc.name] = _fit_vocab(pc.name, full[pc.name], pc.full_shape, vocab_size)
        src = cache[pc.name][pc.index()]
        pc.data.copy_(src.to(dtype=pc.data.dtype, device=pc.data.device))
    if missing:
        raise KeyError(f"weight load: model params with no converted tensor: {missing}")


def needed_names(model: Chunks) -> set[str]:
    """1-process names this rank's parameters are sliced from."""
    return {pc.name for pc in local_pieces(model)}


@torch.no_grad()
def gather_full_state(
    model: Chunks, vocab_size: int, dst: int = 0, group=None
) -> Iterator[tuple[str, Tensor]]:
    """Full 1-process Megatron tensors, assembled from every rank's primary shards.

    Collective over ``group`` (default: the world): EVERY rank must exhaust the iterator.
    Rank ``dst`` yields ``(name, tensor)`` (CPU, parameter dtype, vocab padding removed) in
    a name order common to all ranks; the other ranks yield nothing, but send their shards
    (point-to-point; gloo on CPU, NCCL with CUDA tensors). One full tensor at a time is held
    on ``dst``. Metadata is exchanged first with one ``all_gather_object``.
    Raises ValueError if the primary shards of a tensor do not cover it exactly once.
    """
    import torch.distributed as dist

    pieces = [pc for pc in local_pieces(model) if pc.primary]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    me = dist.get_rank(group) if dist.is_initialized() else 0
    meta = [(pc.name, pc.full_shape, pc.offset, tuple(pc.data.shape), str(pc.data.dtype)) for pc in pieces]
    if world > 1:
        all_meta: list = [None] * world
        dist.all_gather_object(all_meta, meta, group=group)
    else:
        all_meta = [meta]
    names = sorted({m[0] for rank_meta in all_meta for m in rank_meta})
    by_name: dict[str, list[tuple[int, int]]] = {n: [] for n in names}
    for r, rank_meta in enumerate(all_meta):
        for i, m in enumerate(rank_meta):
            by_name[m[0]].append((r, i))
    for name in names:
        srcs = by_name[name]
        if me != dst:
            for r, i in srcs:
                if r == me:
                    dist.send(pieces[i].data.contiguous(), dst=_glob(dst, group), group=group)
            continue
        full_shape = all_meta[srcs[0][0]][srcs[0][1]][1]
        dtype = getattr(torch, all_meta[srcs[0][0]][srcs[0][1]][4].split(".")[-1])
        dev = pieces[0].data.device if pieces else torch.device("cpu")
        full = torch.empty(full_shape, dtype=dtype, device=dev)
        count = torch.zeros(full_shape, dtype=torch.int8)
        for r, i in srcs:
            _, fs, off, shape, _ = all_meta[r][i]
            if tuple(fs) != tuple(full_shape):
                raise ValueError(f"{name}: ranks disagree on the full shape ({fs} vs {full_shape})")
            idx = tuple(slice(o, o + s) for o, s in zip(off, shape))
            if r == me:
                full[idx] = pieces[i].data
            else:
                buf = torch.empty(shape, dtype=dtype, device=dev)
                dist.recv(buf, src=_glob(r, group), group=group)
                full[idx] = buf
            count[idx] += 1
        if not bool((count == 1).all()):
            raise ValueError(f"{name}: primary shards cover the full tensor {int(count.min())}..{int(count.max())} times")
        if name in VOCAB_PARAMS and full.shape[0] > vocab_size:
            full = full[:vocab_size]
        yield name, full.to("cpu").contiguous()


def _glob(rank: int, group) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


# ---------------------------------------------------------------------------------------
# Context parallelism: the load-balanced sequence split (Megatron-LM get_batch_on_this_cp_rank,
# Megatron-Core megatron.core.utils.get_batch_on_this_cp_rank / get_pos_emb_on_this_cp_rank)
# ---------------------------------------------------------------------------------------
class _GatherReplicatedOverCP(torch.autograd.Function):
    """``[B, S/CP, ...]`` (this CP rank's positions, local order) -> ``[B, S, ...]`` in global
    order, all-gathered over the CP group. For a value that EVERY CP rank then consumes
    identically (the loss over the whole sequence): the backward returns this rank's rows of
    the incoming gradient, without communication (each CP rank back-propagates only its own
    tokens; DDP sums the parameter gradients over CP)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        import torch.distributed as dist

        cp, r = dist.get_world_size(group), dist.get_rank(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x, group=group)
        S = x.shape[1] * cp
        order = torch.cat([cp_positions(S, cp, j) for j in range(cp)]).to(x.device)
        out = torch.empty((x.shape[0], S, *x.shape[2:]), dtype=x.dtype, device=x.device)
        out[:, order] = torch.cat(parts, dim=1)
        ctx.mine = cp_positions(S, cp, r).to(x.device)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        return g[:, ctx.mine], None


def gather_over_cp(x: Tensor, group) -> Tensor:
    """``x [B, S/CP, ...]`` of every rank of the context-parallel ``group`` -> ``[B, S, ...]``
    in global sequence order (see :func:`moe_async.layout.cp_positions`); differentiable, the backward keeping
    this rank's rows (for a loss computed identically on every CP rank). Collective over
    ``group``."""
    return _GatherReplicatedOverCP.apply(x, group)
