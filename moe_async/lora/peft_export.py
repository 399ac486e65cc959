"""LoRA adapters of a Megatron-Core model -> Hugging Face PEFT tensors and files.

Data path: each rank's adapters (:class:`~moe_async.lora.layers.AdaptedLinear`) -> whole factors
(TP pieces all-gathered inside their TP group: a ColumnParallel ``B`` on out, a RowParallel ``A``
on in; a gated ``linear_fc1``'s ``B`` pieces are ``[gate_r; up_r]``, reassembled as
``[gate; up]``) -> keyed by the global Megatron weight name (global layer index, global expert
index) -> all ranks' dicts gathered (adapters are small) -> HF PEFT names via the family's
mapping table: a fused Megatron weight (``linear_qkv``, ``linear_fc1``) gives its ``B`` to the
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
from moe_async.models.family import ModelFamily

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


def megatron_adapter_state(models: Sequence[GPTModel], linears: Sequence[Sequence[AdaptedLinear]],
                           copy: bool = True) -> dict[str, tuple[Tensor, Tensor]]:
    """``{global Megatron weight name: (A [r, in], B [out, r])}`` of every adapter of the whole
    model, on every rank (collective at world size > 1: every rank calls it), fp32 on the CPU.

    ``models``: this rank's chunks; ``linears``: :func:`~moe_async.lora.layers.add_lora`'s result
    per chunk. A shared expert adapter appears once per expert (same tensors). ``copy=False``:
    a factor that needs no gather, cast or move is the parameter itself (detached; for a caller
    that copies it at once, e.g. :func:`peft_state`)."""
    import torch.distributed as dist

    local: dict[str, tuple[Tensor, Tensor]] = {}
    for model, lins in zip(models, linears):
        layers = model.decoder.layers
        for al in lins:
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", al.weight_name)
            assert m is not None
            gl = layers[int(m.group(1))].layer_number - 1
            rest = m.group(2)
            if al.expert is not None:
                rest = re.sub(r"local_experts\.\d+\.", f"local_experts.{al.expert}.", rest)
            a = al.adapter
            gated = rest.endswith("linear_fc1.weight") and a.kind == "column"
            A = _whole(a.A, 1, a.tp_group, False, copy) if a.kind == "row" else _whole(a.A, 0, None, False, copy)
            B = _whole(a.B, 0, a.tp_group, gated, copy) if a.kind == "column" else _whole(a.B, 0, None, False, copy)
            local[f"decoder.layers.{gl}.{rest}"] = (A.float().cpu(), B.float().cpu())
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    every: list[dict[str, tuple[Tensor, Tensor]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for d in every:
        for k, v in (d or {}).items():
            out.setdefault(k, v)
    return out


def peft_state(state: dict[str, tuple[Tensor, Tensor]], family: ModelFamily, hf_config: JsonDict,
               out: Destination | None = None) -> tuple[dict[str, Tensor], list[str], list[str]]:
    """Megatron adapters (:func:`megatron_adapter_state`) -> ``(PEFT tensors, target_modules,
    target_parameters)`` under the HF names of ``family``'s mapping table. Every PEFT tensor is
    a copy (none aliases ``state``), written where ``out(name, shape, dtype)`` says when it
    returns a tensor (one copy from ``state``, no temporary), else a new tensor.

    Raises:
        KeyError: an adapted Megatron weight with no HF name in the table.
        ValueError: some but not all experts of a layer adapted.
    """
    a = family.arch_args(hf_config)
    table = family.table(a).by_megatron
    res: dict[str, Tensor] = {}

    def dest(name: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        t = out(name, tuple(shape), dtype) if out is not None else None
        res[name] = t if t is not None else torch.empty(tuple(shape), dtype=dtype)
        return res[name]

    modules: set[str] = set()
    experts: dict[tuple[str, str], dict[int, tuple[Tensor, Tensor]]] = {}
    for name in sorted(state):
        A, B = state[name]
        if name not in table:
            raise KeyError(f"LoRA adapter on {name!r}: the family's mapping table has no such Megatron weight")
        rule, hf_names = table[name]
        m = re.search(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", name)
        if m is not None:
            e, fc = int(m.group(1)), m.group(2)
            # transformers 5 holds every family's routed experts fused at ``model.layers.{i}.mlp.experts``
            # (whatever the on-disk names, e.g. Mixtral's block_sparse_moe.experts.N.w1): PEFT's names
            layer = re.match(r"decoder\.layers\.(\d+)\.", name)
            assert layer is not None
            module = f"model.layers.{layer.group(1)}.mlp.experts"
            experts.setdefault((module, fc), {})[e] = (A, B)
            continue
        bs = rule.split(B, a)
        for hf, b in zip(hf_names, bs):
            base = hf[: -len(".weight")]
            dest(f"{PEFT_PREFIX}{base}.lora_A.weight", A.shape, A.dtype).copy_(A)
            dest(f"{PEFT_PREFIX}{base}.lora_B.weight", b.shape, b.dtype).copy_(b)
            modules.add(base.rsplit(".", 1)[1])
    params: list[str] = []
    fcs_by_module: dict[str, list[str]] = {}
    for module, fc in experts:
        fcs_by_module.setdefault(module, []).append(fc)
    for (module, fc), per in sorted(experts.items()):
        n = a.num_experts or 0  # expert adapters exist only for a MoE family
        if sorted(per) != list(range(n)):
            raise ValueError(f"{module}: LoRA adapters on experts {sorted(per)} of {n}; PEFT adapts all of them")
        A0, B0 = per[0]
        (r, inn), (o, _) = A0.shape, B0.shape
        both = len(fcs_by_module[module]) == 2
        key = f"{module}.base_layer" if both and fc == "linear_fc1" else module
        As = dest(f"{PEFT_PREFIX}{key}.lora_A.weight", (n * r, inn), A0.dtype)  # [E*r, in], expert-major
        torch.cat([per[e][0] for e in range(n)], dim=0, out=As)
        Bs = dest(f"{PEFT_PREFIX}{key}.lora_B.weight", (o, r * n), B0.dtype).view(o, r, n)  # column j*E + e
        for e in range(n):  # one strided copy per expert (twice as fast as stack(out=) here)
            Bs[:, :, e].copy_(per[e][1])
        pname = "mlp.experts." + EXPERT_PARAMS[fc]
        if pname not in params:
            params.append(pname)
    params.sort(key=lambda p: list(EXPERT_PARAMS.values()).index(p.rsplit(".", 1)[1]))
    return res, sorted(modules), params


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
