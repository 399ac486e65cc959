"""The LoRA adapters merged into the base weights, as PEFT's ``merge_and_unload`` does: each
adapted weight becomes ``W + (alpha / rank) * B A`` (fp32 arithmetic, then the base dtype),
the rest is the base unchanged, under the HF on-disk names (a full HF checkpoint).

Per HF tensor, ``B`` goes through the family's Megatron->HF split (fused qkv -> q/k/v rows,
gated fc1 -> gate/up rows) and ``A`` to each part, so each delta is computed as PEFT computes
it from the exported adapter (``lora_B @ lora_A`` of that module, times scaling); a routed
expert's delta is its own ``B_e A_e`` (PEFT's fused-expert ``ParamWrapper`` delta, expert ``e``).
"""

from __future__ import annotations

from typing import Iterator

import torch

from moe_async.models.family import ModelFamily
from moe_async.types import JsonDict

Tensor = torch.Tensor


def hf_deltas(state: dict[str, tuple[Tensor, Tensor]], family: ModelFamily, hf_config: JsonDict,
              scaling: float) -> dict[str, Tensor]:
    """``{HF on-disk weight name: scaling * B_part @ A [out_part, in], fp32}`` for every adapted
    weight of ``state`` (:func:`~moe_async.lora.peft_export.megatron_adapter_state`: global
    Megatron weight name -> whole ``(A [r, in], B [out, r])``).

    Raises:
        KeyError: an adapted Megatron weight with no HF name in the family's mapping table.
    """
    args = family.arch_args(hf_config)
    table = family.table(args).by_megatron
    out: dict[str, Tensor] = {}
    for name in sorted(state):
        if name not in table:
            raise KeyError(f"LoRA adapter on {name!r}: the family's mapping table has no such Megatron weight")
        A, B = state[name]
        rule, hf_names = table[name]
        for hf, b in zip(hf_names, rule.split(B.float(), args)):
            out[hf] = (b.contiguous() @ A.float()) * scaling
    return out


def merged_tensors(base: Iterator[tuple[str, Tensor]], deltas: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """``base`` (HF name, tensor) with each name in ``deltas`` replaced by ``W + delta`` (added in
    fp32, returned in ``W``'s dtype). Raises KeyError after the last tensor naming the deltas whose
    weight ``base`` did not yield, and ValueError for a delta of another shape than its weight."""
    seen: set[str] = set()
    for name, w in base:
        d = deltas.get(name)
        if d is not None:
            if tuple(d.shape) != tuple(w.shape):
                raise ValueError(f"merged LoRA: delta {tuple(d.shape)} for {name} {tuple(w.shape)}")
            w = (w.float() + d).to(w.dtype)
            seen.add(name)
        yield name, w
    missing = sorted(set(deltas) - seen)
    if missing:
        raise KeyError(f"merged LoRA: adapted weights absent from the base export: {missing[:10]}")
