"""The two kinds of tensors a released DeepSeek-V3 HF checkpoint holds besides the model's.

MTP layers (``model.layers.{L + i}.*``) are skipped through an explicit list, logged once;
FP8 block-scaled weights are dequantized with their ``weight_scale_inv`` (DeepSeek's own
``weight_dequant``) to the configured dtype. Anything else unexpected is left for the mapping's
unused-key check.

Design notes: ``docs/design/models.md``."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

from moe_async.types import JsonDict

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SCALE_SUFFIX = ".weight_scale_inv"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HFExtras:
    """What :func:`hf_extras` found: ``skipped`` (MTP keys, sorted), ``scales`` (FP8 weight
    key -> its ``weight_scale_inv`` key), ``block`` (rows, cols of a scale block),
    ``dtype`` (the dequantized weights' dtype)."""

    skipped: list[str] = field(default_factory=list)
    scales: dict[str, str] = field(default_factory=dict)
    block: tuple[int, int] = (128, 128)
    dtype: torch.dtype = torch.bfloat16

    def weights(self, index: Mapping[str, str]) -> dict[str, str]:
        """``index`` (HF key -> file) without the skipped keys and the scale tensors: the
        keys the family mapping must account for."""
        drop = set(self.skipped) | set(self.scales.values())
        return {k: v for k, v in index.items() if k not in drop}

    def plain(self, index: Mapping[str, str]) -> dict[str, str]:
        """:meth:`weights` without the FP8 weights too (the tensors stored as they load)."""
        return {k: v for k, v in self.weights(index).items() if k not in self.scales}

    def get_tensor(self, key: str, tensor: torch.Tensor, read_scale: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """``tensor`` (the stored ``key``) as the model takes it: dequantized when ``key`` is
        an FP8 weight (``read_scale(scale_key)`` gives its scale), else unchanged."""
        s = self.scales.get(key)
        if s is None:
            return tensor
        return dequantize_block_fp8(tensor, read_scale(s), self.block, self.dtype, key)

    def scale_reader(self, index: Mapping[str, str]) -> Callable[[str], torch.Tensor]:
        """``read_scale`` for :meth:`get_tensor`: a scale key read from its file in ``index``."""
        def read(key: str) -> torch.Tensor:
            from safetensors import safe_open

            with safe_open(index[key], framework="pt") as h:
                return h.get_tensor(key)
        return read

    def apply(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole HF state dict as the model takes it: skipped keys and scales dropped, FP8
        weights dequantized."""
        out = {}
        for k, t in state.items():
            if k in self.skipped or k in self.scales.values():
                continue
            out[k] = self.get_tensor(k, t, state.__getitem__)
        return out


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype, key: str = "weight") -> torch.Tensor:
    """``w`` ([M, N], float8) times its block scales ``scale_inv`` ([ceil(M/bm), ceil(N/bn)],
    float32), in float32, cast to ``dtype``. ValueError naming ``key`` on a wrong shape."""
    bm, bn = block
    if w.dim() != 2 or tuple(scale_inv.shape) != (math.ceil(w.shape[0] / bm), math.ceil(w.shape[1] / bn)):
        raise ValueError(f"HF tensor {key}: its weight_scale_inv has shape {tuple(scale_inv.shape)}, which "
                         f"does not fit weight {tuple(w.shape)} in "
                         f"{bm}x{bn} blocks (quantization_config.weight_block_size)")
    s = scale_inv.to(torch.float32).repeat_interleave(bm, 0)[: w.shape[0]].repeat_interleave(bn, 1)[:, : w.shape[1]]
    return (w.to(torch.float32) * s).to(dtype)


def hf_extras(hf_config: JsonDict, keys: Iterable[str], dtypes: Mapping[str, str] | None = None,
              log_skipped: bool = True) -> HFExtras:
    """Find the MTP keys and FP8 (weight, scale) pairs among ``keys`` (an HF checkpoint's
    tensor names) for ``hf_config``. ``dtypes`` (key -> safetensors dtype string, optional):
    an ``F8_*`` weight without a scale is then refused too. Logs the skipped keys (WARNING)
    when ``log_skipped``. ValueError naming the key of an unpaired scale / FP8 weight."""
    keys = set(keys)
    ex = HFExtras()
    if hf_config.get("model_type") not in ("deepseek_v3",):
        return ex
    n_layers = int(hf_config.get("num_hidden_layers", 0))
    n_mtp = int(hf_config.get("num_nextn_predict_layers") or 0)
    for k in keys:
        m = _LAYER.match(k)
        if m and n_layers <= int(m.group(1)) < n_layers + n_mtp:
            ex.skipped.append(k)
    ex.skipped.sort()
    q = hf_config.get("quantization_config") or {}
    if q.get("weight_block_size"):
        bm, bn = q["weight_block_size"]
        ex.block = (int(bm), int(bn))
    ex.dtype = _DTYPES.get(str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"), torch.bfloat16)
    skip = set(ex.skipped)
    for k in sorted(keys - skip):
        if k.endswith(SCALE_SUFFIX):
            w = k[: -len(SCALE_SUFFIX)] + ".weight"
            if w not in keys:
                raise ValueError(f"HF tensor {k} has no {w} beside it (an FP8 scale without its weight)")
            ex.scales[w] = k
    if dtypes is not None:
        for k in sorted(keys - skip):
            if str(dtypes.get(k, "")).startswith("F8") and k not in ex.scales:
                raise ValueError(f"HF tensor {k} is {dtypes[k]} without a {k[:-len('.weight')]}{SCALE_SUFFIX} "
                                 "(an FP8 weight needs its block scales)")
    if ex.skipped and log_skipped:
        log.warning("DeepSeek-V3 HF checkpoint: skipping %d MTP tensors (layers %d..%d, num_nextn_predict_layers="
                    "%d; the trainer builds no MTP block), e.g. %s", len(ex.skipped), n_layers,
                    n_layers + n_mtp - 1, n_mtp, ", ".join(ex.skipped[:3]))
    return ex
