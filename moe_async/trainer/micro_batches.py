"""How the trainer's batch is cut into micro-batches (:class:`moe_async.types.MicroBatch`):
by a sequence count, optionally under a token budget (dynamic micro-batch size).

The budget follows verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu`` and slime's
``--use-dynamic-batch-size`` / ``--max-tokens-per-gpu``: a micro-batch holds as many sequences
as fit in ``max_tokens`` padded positions (with packed THD rows: real tokens), so long rollouts do not blow up activation memory
and short ones are not run a few at a time. Micro-batches here are CONTIGUOUS runs of the
batch (sample order kept: per-sample outputs need no re-ordering; verl re-balances with
Karmarkar-Karp partitioning, which this does not do). The GRPO loss is a per-token mean over
the global batch, so how the batch is cut does not change the gradient beyond fp32
accumulation order (tests/trainer/test_megatron_trainer.py, micro-batch invariance).
"""

from __future__ import annotations

from collections.abc import Sequence


def padded_len(lens: Sequence[int], *, min_len: int, multiple: int, fixed_len: int | None = None) -> int:
    """Padded sequence length ``S`` (positions) of a micro-batch whose sequences have ``lens``
    tokens: ``fixed_len`` if given, else the longest; at least ``min_len``; rounded up to a
    multiple of ``multiple`` (TP for sequence parallelism, 2 x CP for context parallelism)."""
    S = fixed_len if fixed_len is not None else max(lens)
    S = max(S, min_len)
    return -(-S // multiple) * multiple


def micro_batch_ranges(
    lens: Sequence[int],
    micro_batch_size: int,
    max_tokens: int | None = None,
    *,
    min_len: int = 1,
    multiple: int = 1,
    fixed_len: int | None = None,
    packed: bool = False,
) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` sample ranges covering ``range(len(lens))`` in order.

    Args:
        lens: tokens per sequence (prompt + response), ints > 0.
        micro_batch_size: most sequences per micro-batch (>= 1).
        max_tokens: most padded positions per micro-batch, ``B x S`` with ``S`` from
            :func:`padded_len`; ``None`` = sequence count only. A single sequence longer than
            the budget gets a micro-batch of its own (never dropped, never truncated).
        min_len, multiple, fixed_len: as in :func:`padded_len`.
        packed: the micro-batch is ONE packed row (THD, ``trainer.sequence_packing='thd'``):
            its cost is ``T`` = :func:`padded_len` of the summed lengths (real tokens, rounded
            up), not ``B x S``; ``fixed_len`` is then ignored (the row's final length is known
            only once every range is cut).

    Returns:
        ``[(start, end), ...]``: greedy (a range grows while the next sequence still fits).

    Raises:
        ValueError: ``micro_batch_size < 1`` or ``max_tokens < 1``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out: list[tuple[int, int]] = []
    start = 0
    n = len(lens)
    while start < n:
        end = start + 1
        while end < n and end - start < micro_batch_size:
            if max_tokens is not None:
                if packed:
                    cost = padded_len([sum(lens[start : end + 1])], min_len=min_len, multiple=multiple)
                else:
                    S = padded_len(lens[start : end + 1], min_len=min_len, multiple=multiple, fixed_len=fixed_len)
                    cost = (end + 1 - start) * S
                if cost > max_tokens:
                    break
            end += 1
        out.append((start, end))
        start = end
    return out


def split_to_count(ranges: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """``ranges`` split further until there are ``count`` of them (data-parallel ranks must run
    the same number of micro-batches: expert all-to-all and the pipeline schedule are
    collectives). The range with the most sequences is halved first; order is kept.

    Raises:
        ValueError: ``count`` exceeds the number of sequences or is below ``len(ranges)``.
    """
    n = sum(e - s for s, e in ranges)
    if count < len(ranges) or count > n:
        raise ValueError(f"cannot cut {n} sequences in {len(ranges)} micro-batches into {count}")
    out = list(ranges)
    while len(out) < count:
        i = max(range(len(out)), key=lambda k: (out[k][1] - out[k][0], -k))
        s, e = out[i]
        mid = s + (e - s + 1) // 2
        out[i : i + 1] = [(s, mid), (mid, e)]
    return out
