"""LoRA adapters of a Megatron-Core model -> Hugging Face PEFT tensors and files.

Data path: each rank's adapters (:class:`~moe_async.lora.layers.AdaptedLinear`) -> whole factors
(TP pieces all-gathered inside their TP group: a ColumnParallel ``B`` on out, a RowParallel ``A``
on in; a gated ``linear_fc1``'s ``B`` pieces are ``[gate_r; up_r]``, reassembled as
``[gate; up]``) -> keyed by the global Megatron weight name (global layer index, global expert
index) -> all ranks' dicts gathered (adapters are small) -> HF PEFT names via the family's
mapping table (:mod:`moe_async.lora.peft_tensors`, planned once per adapter layout): a fused Megatron weight (``linear_qkv``, ``linear_fc1``) gives its ``B`` to the
HF names through the same split as the weight, and the shared ``A`` to each of them; routed
experts become PEFT's adapters on transformers' fused expert parameters
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``; ``lora_A``
``[E*r, in]`` expert-major, ``lora_B`` ``[out, r*E]`` with expert ``e``'s column ``j`` at
``j*E + e``, as ``peft.tuners.lora.layer.ParamWrapper`` reads them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from moe_async.lora.config import LoraConfig
from moe_async.lora.layers import AdaptedLinear
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from torch.distributed import ProcessGroup

Tensor = torch.Tensor
PEFT_PREFIX = "base_model.model."
#: ``out(name, shape, dtype) -> Tensor | None``: where the export may write a PEFT tensor
#: (e.g. ``AdapterBuffers.destination``); None: a tensor of its own
Destination = Callable[[str, tuple[int, ...], torch.dtype], "Tensor | None"]
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# transformers' fused expert parameters, in PEFT target_parameters order (the first is wrapped
# innermost: its tensors are keyed ``experts.base_layer.lora_*`` when both are adapted)
EXPERT_PARAMS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}


def _whole(t: Tensor, dim: int, group: ProcessGroup | None, gated: bool, copy: bool = True) -> Tensor:
    """All-gather TP pieces of ``t`` along ``dim`` in ``group`` (size 1: a copy of ``t``, or
    with ``copy=False`` ``t`` detached); ``gated``: each piece is ``[gate_r; up_r]`` along dim 0,
    reassembled as ``[gate; up]``."""
    import torch.distributed as dist

    n = group.size() if group is not None else 1
    if n == 1:
        return t.detach().clone() if copy else t.detach()
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    if gated:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def adapter_names(models: Sequence[GPTModel], linears: Sequence[Sequence[AdaptedLinear]]) -> list[list[str]]:
    """The global Megatron weight name (global layer index, global expert index) of each adapter
    of ``linears`` (per chunk, in order): the keys :func:`megatron_adapter_state` gives them."""
    out = []
    for model, lins in zip(models, linears):
        layers, names = model.decoder.layers, []
        for al in lins:
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", al.weight_name)
            assert m is not None
            rest = m.group(2)
            if al.expert is not None:
                rest = re.sub(r"local_experts\.\d+\.", f"local_experts.{al.expert}.", rest)
            names.append(f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.{rest}")
        out.append(names)
    return out


def megatron_adapter_state(models: Sequence[GPTModel], linears: Sequence[Sequence[AdaptedLinear]],
                           copy: bool = True, names: Sequence[Sequence[str]] | None = None,
                           ) -> dict[str, tuple[Tensor, Tensor]]:
    """``{global Megatron weight name: (A [r, in], B [out, r])}`` of every adapter of the whole
    model, on every rank (collective at world size > 1: every rank calls it), fp32 on the CPU.

    ``models``: this rank's chunks; ``linears``: :func:`~moe_async.lora.layers.add_lora`'s result
    per chunk; ``names``: :func:`adapter_names` of them when the caller kept it. A shared expert
    adapter appears once per expert (same tensors). ``copy=False``: a factor that needs no
    gather, cast or move is the parameter itself (detached; for a caller that copies it at
    once, e.g. :func:`~moe_async.lora.peft_tensors.peft_state`)."""
    import torch.distributed as dist

    names = names if names is not None else adapter_names(models, linears)
    local: dict[str, tuple[Tensor, Tensor]] = {}
    cpu = torch.device("cpu")
    for lins, keys in zip(linears, names):
        for al, key in zip(lins, keys):
            a = al.adapter
            gated = key.endswith("linear_fc1.weight") and a.kind == "column"
            A = _whole(a.A, 1, a.tp_group, False, copy) if a.kind == "row" else _whole(a.A, 0, None, False, copy)
            B = _whole(a.B, 0, a.tp_group, gated, copy) if a.kind == "column" else _whole(a.B, 0, None, False, copy)
            if A.dtype != torch.float32 or A.device != cpu:
                A = A.float().cpu()
            if B.dtype != torch.float32 or B.device != cpu:
                B = B.float().cpu()
            local[key] = (A, B)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    every: list[dict[str, tuple[Tensor, Tensor]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for d in every:
        for k, v in (d or {}).items():
            out.setdefault(k, v)
    return out


def peft_config_dict(cfg: LoraConfig, target_modules: list[str], target_parameters: list[str],
                     base_model: str) -> JsonDict:
    """``adapter_config.json`` contents (PEFT ``LoraConfig`` fields) for the exported adapter."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": target_modules, "target_parameters": target_parameters or None,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }


def write_peft(out_dir: str, tensors: dict[str, Tensor], config: JsonDict, dtype: torch.dtype = torch.float32,
               replace: bool = False) -> int:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` into ``out_dir`` (created),
    each file with the mode any new file gets here (0666 less the umask; safetensors alone makes
    0600). FileExistsError if ``out_dir`` holds an adapter already, unless ``replace``: then the
    files are written under ``<out_dir>.tmp`` and that directory replaces ``out_dir`` (an
    interrupted write leaves the old adapter whole). Returns the tensor bytes written."""
    from safetensors.torch import save_file

    if not replace and os.path.exists(os.path.join(out_dir, ADAPTER_WEIGHTS)):
        raise FileExistsError(f"{out_dir} already holds {ADAPTER_WEIGHTS}")
    with staged_dir(out_dir, replace) as out_dir:
        os.makedirs(out_dir, exist_ok=True)
        mask = os.umask(0)
        os.umask(mask)
        ts = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
        save_file(ts, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            os.chmod(os.path.join(out_dir, name), 0o666 & ~mask)
    return sum(t.numel() * t.element_size() for t in ts.values())


@contextlib.contextmanager
def staged_dir(out_dir: str, replace: bool) -> Iterator[str]:
    """The directory to write ``out_dir``'s files into: ``out_dir`` itself, or with ``replace``
    ``<out_dir>.tmp`` (emptied first), which replaces ``out_dir`` once the block ends without an
    error (an interrupted write leaves the old directory whole)."""
    import shutil

    if not replace:
        yield out_dir
        return
    tmp = out_dir.rstrip(os.sep) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
