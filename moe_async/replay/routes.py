"""Routed-expert storage, alignment with token ids, segment joining and padding.

Engine routes (int32 ``[T-1, L(+dense), K]``) -> :func:`engine_routes` (compact
``Sample.routed_experts`` ``[T-1, L, K]``) -> :func:`join_segments` for partial rollouts ->
:func:`batch_routes` (``[B, S, L, K]`` int64, -1 where no route) -> :func:`fill_padding` ->
Megatron's router replay.

Design notes: ``docs/design/replay.md``."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

PAD = -1


def storage_dtype(num_experts: int) -> np.dtype:
    """uint8 for ``num_experts <= 256`` (1 byte per (token, layer, k)), else int16."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= np.iinfo(np.int16).max + 1:
        return np.dtype(np.int16)
    raise ValueError(f"{num_experts} experts do not fit int16 route storage")


def compact_routes(routes: np.ndarray, num_experts: int | None = None) -> np.ndarray:
    """``[N, L, K]`` expert ids -> the compact dtype (:func:`storage_dtype`).

    ``num_experts`` None: inferred as ``max id + 1`` (ids are kept exactly either way).
    Raises ValueError for a non-3-D array or an id outside ``[0, num_experts)``.
    """
    a = np.asarray(routes)
    if a.ndim != 3:
        raise ValueError(f"routed experts must be [tokens, moe_layers, top_k], got shape {a.shape}")
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or (num_experts is not None and hi >= num_experts):
            raise ValueError(f"routed expert id out of range [0, {num_experts}): min {lo}, max {hi}")
    n = num_experts if num_experts is not None else (int(a.max()) + 1 if a.size else 1)
    return np.ascontiguousarray(a, dtype=storage_dtype(n))


def select_moe_layers(routes: np.ndarray, moe_layer_pattern: Sequence[int] | None) -> np.ndarray:
    """Keep the MoE layers' columns: ``routes [N, L', K]`` with ``L'`` either the number of
    MoE layers (returned as is) or the number of ALL layers (dense columns dropped).
    ``moe_layer_pattern``: 1/0 per decoder layer (Megatron's ``moe_layer_freq`` list form);
    None = every layer is MoE. Raises ValueError for any other ``L'``."""
    if moe_layer_pattern is None:
        return routes
    pattern = [int(x) for x in moe_layer_pattern]
    n_moe = sum(pattern)
    if routes.shape[1] == n_moe:
        return routes
    if routes.shape[1] == len(pattern):
        return routes[:, [i for i, x in enumerate(pattern) if x], :]
    raise ValueError(
        f"routed experts have {routes.shape[1]} layers; the model has {n_moe} MoE layers "
        f"of {len(pattern)}"
    )


def check_engine_rows(routes: np.ndarray, num_tokens: int, what: str = "sequence") -> None:
    """The engine routes every fed token: exactly ``num_tokens - 1`` rows (0 for an empty
    sequence). Raises ValueError naming both counts otherwise."""
    want = max(num_tokens - 1, 0)
    if routes.shape[0] != want:
        raise ValueError(
            f"routed experts have {routes.shape[0]} rows for a {what} of {num_tokens} tokens; "
            f"expected exactly {want} (tokens - 1: the last token is never fed to the model)"
        )


def engine_routes(
    routes: np.ndarray,
    num_tokens: int,
    *,
    num_experts: int | None = None,
    moe_layer_pattern: Sequence[int] | None = None,
) -> np.ndarray:
    """Engine output (``[num_tokens - 1, L(+dense), K]``) -> stored form ``[num_tokens-1, L, K]``
    compact. Raises ValueError on any other row count or an out-of-range id."""
    r = select_moe_layers(np.asarray(routes), moe_layer_pattern)
    check_engine_rows(r, num_tokens)
    return compact_routes(r, num_experts)


def join_segments(
    prev: np.ndarray | None, prev_tokens: int, seg: np.ndarray | None, seg_tokens: int
) -> np.ndarray | None:
    """Routes of a partial rollout continued by a resubmitted request.

    ``prev`` covers a sequence of ``prev_tokens`` tokens (``prev_tokens - 1`` rows; None =
    nothing kept yet). ``seg`` is what the engine returned for the continuation, whose input
    was those ``prev_tokens`` tokens and whose sequence (input + output) has ``seg_tokens``
    tokens (``seg_tokens - 1`` rows). Rows ``< prev_tokens - 1`` keep the routes under which
    their tokens were generated; from row ``prev_tokens - 1`` on (the last kept token, first
    fed in the continuation) the continuation's rows are used. Returns
    ``[seg_tokens - 1, L, K]``. Raises ValueError for inconsistent row counts or shapes.
    """
    if seg is None:
        raise ValueError("continuation returned no routed experts")
    check_engine_rows(seg, seg_tokens, "continuation")
    if prev is None:
        return seg
    check_engine_rows(prev, prev_tokens, "kept prefix")
    if seg_tokens < prev_tokens:
        raise ValueError(f"continuation of {seg_tokens} tokens is shorter than its input ({prev_tokens})")
    if prev.shape[1:] != seg.shape[1:]:
        raise ValueError(f"segment routes disagree in [layers, top_k]: {prev.shape[1:]} vs {seg.shape[1:]}")
    keep = max(prev_tokens - 1, 0)
    out = np.concatenate([prev[:keep], seg[keep:].astype(prev.dtype, copy=False)], axis=0)
    return out


def truncate_routes(routes: np.ndarray, num_tokens: int) -> np.ndarray:
    """Routes of the first ``num_tokens`` tokens (``num_tokens - 1`` rows) of a longer one."""
    want = max(num_tokens - 1, 0)
    if routes.shape[0] < want:
        raise ValueError(f"cannot truncate {routes.shape[0]} route rows to {want}")
    return routes[:want]


def batch_routes(
    routes: Sequence[np.ndarray | None], lengths: Sequence[int], S: int, num_layers: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored per-sample routes -> ``routes_BSLK`` int64 (``-1`` = no route) and
    ``real_BS`` bool (True where the engine gave a route).

    ``routes[b]`` is ``[lengths[b] - 1, L, K]`` (checked exactly) or None (no routes: the
    whole row is padding). Raises ValueError on a row count or ``[L, K]`` mismatch.
    """
    B = len(routes)
    out = torch.full((B, S, num_layers, top_k), PAD, dtype=torch.long)
    real = torch.zeros(B, S, dtype=torch.bool)
    for b, (r, n) in enumerate(zip(routes, lengths)):
        if r is None:
            continue
        if n > S:
            raise ValueError(f"sequence {b} has {n} tokens > padded length {S}")
        check_engine_rows(r, n, f"sequence {b}")
        if tuple(r.shape[1:]) != (num_layers, top_k):
            raise ValueError(
                f"sequence {b}: routed experts are [*, {r.shape[1]}, {r.shape[2]}], the model has "
                f"{num_layers} MoE layers with top-{top_k}"
            )
        if r.shape[0]:
            out[b, : r.shape[0]] = torch.from_numpy(r.astype(np.int64))
            real[b, : r.shape[0]] = True
    return out, real


def pack_rows(x_BS: torch.Tensor, lengths: Sequence[int], T: int, fill: bool | int | float) -> torch.Tensor:
    """``x [B, S, ...]`` -> ``[1, T, ...]``: the first ``lengths[b]`` positions of every row
    ``b`` back to back (the packed THD order of ``trainer.sequence_packing='thd'``; sequence
    ``b`` starts at ``sum(lengths[:b])``), then ``fill`` up to ``T``. Same dtype as ``x``.

    Raises:
        ValueError: a length above ``S``, or ``sum(lengths) > T``."""
    B, S = x_BS.shape[:2]
    if len(lengths) != B or any(n > S or n < 0 for n in lengths):
        raise ValueError(f"lengths {list(lengths)} do not fit rows of {B} x {S}")
    total = int(sum(lengths))
    if total > T:
        raise ValueError(f"{total} packed tokens > packed length {T}")
    out = torch.full((1, T, *x_BS.shape[2:]), fill, dtype=x_BS.dtype, device=x_BS.device)
    b = torch.repeat_interleave(torch.arange(B), torch.as_tensor(list(lengths), dtype=torch.long))
    s = torch.cat([torch.arange(n) for n in lengths]) if B else torch.zeros(0, dtype=torch.long)
    out[0, :total] = x_BS[b, s]
    return out


def fill_padding(
    routes_NLK: torch.Tensor, num_experts: int, offset: torch.Tensor | int = 0
) -> torch.Tensor:
    """Replace rows of ``-1`` (padding, the unrouted last token, route-less samples) by valid
    expert ids spread evenly: the ``c``-th such row of a layer gets experts
    ``(c*K + j) mod E``, ``j < K`` (distinct when ``K <= E``), so over ``n`` padded rows every
    expert receives ``floor`` or ``ceil`` of ``n*K/E`` of them and no expert (or EP rank) is
    flooded. ``offset`` (int or ``[L]``) starts the count ``c`` there, so successive
    micro-batches continue the rotation (use :func:`num_pad_rows` to advance it). Real rows
    are returned unchanged. Raises ValueError for a row that is only partly
    ``-1`` or an id ``>= num_experts``. Input ``[N, L, K]`` (any leading shape flattened)."""
    shape = routes_NLK.shape
    r = routes_NLK.reshape(-1, shape[-2], shape[-1]).clone()
    N, L, K = r.shape
    if K > num_experts:
        raise ValueError(f"top_k {K} > {num_experts} experts")
    pad = r == PAD
    row_pad = pad.all(-1)  # [N, L]
    if bool((pad.any(-1) & ~row_pad).any()):
        raise ValueError("a route row is partly -1: only whole rows may be padding")
    if bool((r >= num_experts).any()) or bool(((r < 0) & ~pad).any()):
        raise ValueError(f"expert id outside [0, {num_experts})")
    off = torch.as_tensor(offset, dtype=torch.long).reshape(-1)  # [1] or [L]
    c = torch.cumsum(row_pad.long(), dim=0) - 1 + off  # [N, L] running index of pad rows per layer
    fill = (c.unsqueeze(-1) * K + torch.arange(K)) % num_experts  # [N, L, K]
    r = torch.where(row_pad.unsqueeze(-1), fill, r)
    return r.reshape(shape)


def num_pad_rows(routes_NLK: torch.Tensor) -> torch.Tensor:
    """``[L]`` number of all-``-1`` rows per layer (to advance :func:`fill_padding`'s offset)."""
    r = routes_NLK.reshape(-1, routes_NLK.shape[-2], routes_NLK.shape[-1])
    return (r == PAD).all(-1).sum(0)


def route_bytes_per_token(routes: np.ndarray) -> float:
    """Stored bytes per routed token (``L*K`` for uint8 storage)."""
    return routes.nbytes / max(routes.shape[0], 1)
